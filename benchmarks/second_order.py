"""Per-step time and peak memory of the damped Gauss-Newton optimiser (thesis ch. 4; issue 12, section 4)
against ``torch.optim.Adam`` and against ASDL's KFAC, all measured in the same run. Prints a markdown table.

Problems (float32, CPU, bundled real MNIST scaled to [0, 1], minibatches of ``--batch`` = 1000 by default):

* ``autoencoder``: 784-1000-500-250-30-250-500-1000-784 tanh (2,833,000 parameters... see the table),
  Bernoulli cross-entropy summed over pixels, mean over the batch (thesis Fig. 4.1);
* ``mlp``: 784-512-512-10 ReLU (669,706 parameters), softmax cross-entropy.

Optimisers: Adam (the baseline of every ratio); ``GaussNewton`` with KFRA, KFLR and KFAC curvature, each
refreshing its factors and inverses every step (the thesis's setting), factored damping, alpha* by one
Jacobian-vector product, rho every 5 steps (so 1 step in 5 carries an extra forward pass; timing a whole
number of 5-step periods makes the mean exact); ASDL's ``KfacGradientMaker`` (``asdfghjkl``, an optional
benchmark dependency; Monte Carlo Fisher with one sample, factors and inverses every step, i.e. the same
update frequency) followed by an SGD step, on the MLP only (ASDL's KFAC has no Bernoulli loss). KFLR on
the autoencoder is not run: it back-propagates one vector per output (784 backward passes per step) and its
square root of H_L is a (B, 784, 784) tensor (2.5 GB at B = 1000): not affordable, as the thesis says.

Measurement: each (problem, optimiser) runs in a fresh process (``_common.run_worker``): ``--warmup`` steps,
then ``--steps`` timed steps (a multiple of 5); the per-step time is the mean wall time over the timed steps,
beside it the mean CPU time of the process over the same steps (``time.process_time``, every thread) and the
threads kept busy (CPU / wall time); the peak memory is the peak RSS increase during the timed steps over the RSS before them (model, data and
optimiser state already allocated). ``--rounds`` rounds run the optimisers in rotating order so that machine
load affects all alike; the table gives the median over rounds and the ratio of the wall time to Adam's median.

Time to target (``--results DIR``, default ``results/autoencoder-medium``): from a finished ``autoencoder``
run, the training wall-clock each optimiser needed for its smoothed minibatch objective to reach the value
the best Adam run reached at the end of its budget (measured inside that run, on the machine that ran it).

Targets (issue 12): a KFRA step at most 3x an Adam step on the autoencoder; the KFAC step no slower than
ASDL's. Run: ``.venv/bin/python benchmarks/second_order.py`` (``--quick`` for one short round; ``--out
FILE.md`` also writes the table). Default: one torch thread (``--threads``), the most stable setting on a
shared CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_busy, fmt_mib, fmt_ratio, fmt_seconds, require_library, run_worker, time_steps

PROBLEMS = {
    "autoencoder": ["Adam", "KFRA", "KFAC"],
    "mlp": ["Adam", "KFRA", "KFLR", "KFAC", "ASDL KFAC"],
}


def _model(problem: str) -> torch.nn.Module:
    from curvkit.experiments._second_order import glorot_
    from curvkit.models import autoencoder, mlp

    if problem == "autoencoder":
        return glorot_(autoencoder(784), 0)
    torch.manual_seed(0)
    return mlp([784, 512, 512, 10], "relu")


def _data(problem: str, batch: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from curvkit.experiments._second_order import load_mnist

    X, y = load_mnist(batch * n_batches)
    out = []
    for i in range(n_batches):
        xb = X[i * batch:(i + 1) * batch]
        out.append((xb, xb if problem == "autoencoder" else y[i * batch:(i + 1) * batch]))
    return out


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Time ``spec['opt']`` on ``spec['problem']`` in this process (see the module docstring)."""
    torch.set_num_threads(int(spec["threads"]))
    from curvkit.likelihoods import BernoulliBCE, CrossEntropy
    from curvkit.optim import GaussNewton

    problem, name = spec["problem"], spec["opt"]
    model = _model(problem)
    lik = BernoulliBCE("mean") if problem == "autoencoder" else CrossEntropy("mean")
    batches = _data(problem, int(spec["batch"]), 4)
    if name == "Adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            opt.zero_grad()
            lik(model(xb), yb).backward()
            opt.step()
    elif name == "ASDL KFAC":
        from asdl import KfacGradientMaker, PreconditioningConfig

        config = PreconditioningConfig(data_size=int(spec["batch"]), damping=1e-3)
        gm = KfacGradientMaker(model, config, fisher_type="fisher_mc", loss_type="cross_entropy")
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            sgd.zero_grad()
            dummy = gm.setup_model_call(model, xb)
            gm.setup_loss_call(torch.nn.functional.cross_entropy, dummy, yb)
            gm.forward_and_backward()
            sgd.step()
    else:
        gn = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature=name.lower(),
                         weight_decay=1e-5)

        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            gn.step(batch=(xb, yb))
    out = time_steps(step, batches, int(spec["warmup"]), int(spec["steps"]))
    return {**out, "params": sum(p.numel() for p in model.parameters())}


def time_to_target(results_dir: Path) -> list[list[Any]] | None:
    """Rows (dataset, run, time to reach the best Adam's final objective, its own final objective)."""
    path = results_dir / "results.json"
    if not path.exists():
        return None
    from curvkit.experiments._second_order import smooth

    res = json.loads(path.read_text())
    rows: list[list[Any]] = []
    for dataset, d in res["datasets"].items():
        best = d["claims"]["best_adam"]
        curves = d["curves"]
        target = float(smooth(curves[best]["loss"])[-1])
        for name, c in curves.items():
            s = smooth(c["loss"])
            hit = next((i for i, v in enumerate(s) if v <= target), None)
            rows.append([dataset, name, target, "-" if hit is None else c["time"][hit],
                         "-" if hit is None else hit + 1, float(s[-1]) if len(s) else math.nan, c["time"][-1]])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=sorted(PROBLEMS))
    ap.add_argument("--results", default="results/autoencoder-medium")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 5, 1
    asdl = require_library("ASDL KFAC", "asdl", "benchmarks/second_order.py", optional=True)  # skipped if absent
    problems = [args.only] if args.only else list(PROBLEMS)
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for problem in problems:
            names = [n for n in PROBLEMS[problem] if asdl or n != "ASDL KFAC"]
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                spec = {"problem": problem, "opt": name, "batch": args.batch, "steps": args.steps,
                        "warmup": args.warmup, "threads": args.threads}
                res = run_worker(__file__, spec, timeout=3600)
                samples.setdefault((problem, name), []).append(res)
                print(f"round {r + 1} {problem:11s} {name:9s} "
                      + (res["error"] if "error" in res else fmt_seconds(res["mean_s"])), file=sys.stderr)
    lines = [f"### Second-order optimiser step vs Adam ({datetime.date.today()})", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores, torch "
             f"{torch.__version__}, {args.threads} torch thread(s); load average at the end "
             f"{os.getloadavg()[0]:.2f} (shared machine). Batch {args.batch}, float32; {args.warmup} warm-up and "
             f"{args.steps} timed steps per process (mean wall and CPU time), median over {args.rounds} round(s).", "",
             "| problem | optimiser | params | time / step | vs Adam | CPU time / step | threads busy | peak memory (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for problem in problems:
        base = [s["mean_s"] for s in samples.get((problem, "Adam"), []) if "mean_s" in s]
        adam = statistics.median(base) if base else None
        for name in PROBLEMS[problem]:
            got = samples.get((problem, name))
            if got is None:
                lines.append(f"| {problem} | {name} | - | not run (optional dependency asdfghjkl missing) | - | - | - | - |")
                continue
            ok = [s for s in got if "mean_s" in s]
            if not ok:
                lines.append(f"| {problem} | {name} | - | error: {got[0].get('error', '?')[:80]} | - | - | - | - |")
                continue
            t = statistics.median(s["mean_s"] for s in ok)
            cpu = statistics.median(s["cpu_mean_s"] for s in ok)
            busy = statistics.median(s["cpu_mean_s"] / s["mean_s"] for s in ok)
            mem = [s["peak_delta_mib"] for s in ok if s["peak_delta_mib"] is not None]
            lines.append(f"| {problem} | {name} | {ok[0]['params']:,} | {fmt_seconds(t)} | "
                         f"{fmt_ratio(t / adam if adam else None)} | {fmt_seconds(cpu)} | {fmt_busy(busy)} | "
                         f"{fmt_mib(max(mem) if mem else None)} |")
    if "autoencoder" in problems:
        lines.append("| autoencoder | KFLR | - | not run: 784 backward passes and a (B, 784, 784) H_L square root "
                     "per step | - | - | - | - |")
    rows = time_to_target(Path(args.results))
    lines += ["", "#### Training wall-clock to reach the best Adam run's final objective", ""]
    if rows is None:
        lines.append(f"(no finished autoencoder run under {args.results}; run `curvkit reproduce autoencoder "
                     "--scale medium --out results/autoencoder-medium` first)")
    else:
        lines += ["| dataset | run | target (best Adam, final, smoothed) | time to target (s) | updates | "
                  "final objective | total train time (s) |", "|---|---|---|---|---|---|---|"]
        for row in rows:
            lines.append("| " + " | ".join(fmt(x) for x in row) + " |")
        lines.append("")
        lines.append(f"(from {args.results}/results.json; wall-clock measured inside that run)")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


if __name__ == "__main__":
    main()
