"""A GaussNewton (KFAC) step on a ViT against an AdamW step, a gradient pass and ASDL's KFAC, all measured in the
same run (issue 21, section 4, the GaussNewton part). Prints a markdown table.

Model and data (float32, CPU, train mode with dropout 0, softmax cross-entropy with mean reduction):
``curvkit.architectures.vit`` on real MNIST (bundled), 28x28 images in 4x4 patches (49 patches and a class
token = 50 tokens), width 256, 2 pre-norm blocks of 4 heads, MLP width 672: 1,238,858 parameters; minibatches
of ``--batch`` = 128, cycling over 4 of them.

Arms:

* ``gradient pass``: forward, loss and ``backward()`` (plain PyTorch, the user's default kernels);
* ``AdamW``: ``torch.optim.AdamW`` (lr 1e-3): a gradient pass and the update (a baseline of the ratios);
* ``GaussNewton KFAC``: ``curvkit.optim.GaussNewton(curvature='kfac')`` with the thesis's settings: factors
  of the current minibatch (one sampled label per example) and their factored damped inverses every step,
  alpha* from one Jacobian-vector product of the exact GGN, rho with one extra forward pass on one step in
  five (``tau_every=5``; a whole number of 5-step periods is timed, so the mean is exact). Every trainable
  parameter has a block (packed attention projections, LayerNorm, class token and position table included);
* ``GaussNewton KFAC-reduce``: the same with ``weight_sharing='reduce'`` (KFAC-reduce, Eschenhagen et al. 2023:
  the 50 tokens' inputs summed and their output gradients averaged before the factors' outer products, the
  variant they derive for a model whose loss reads one output per image; the factors cost B rows instead of
  B x 50, everything else as above);
* ``GaussNewton KFAC, alpha* every 5th step``: the same with ``quadratic_every=5`` (factors and inverses every
  step; the Jacobian-vector product of alpha* on the steps that adapt tau, one in five, the others take the
  geometric mean of the past alpha*s; not the thesis's setting);
* ``GaussNewton KFAC, factors every 10``: the same with ``curvature_every=10`` (factors and inverses of every
  tenth minibatch, the usual KFAC practice; not the thesis's setting). Time 10 steps or a multiple (``--steps``)
  for an exact mean;
* ``ASDL KFAC + SGD``: ASDL's ``KfacGradientMaker`` (``asdfghjkl==0.1a4``, optional, ``bash scripts/bench.sh``
  installs it; Monte Carlo Fisher with one sample, factors and inverses every step, the same frequency;
  damping 1e-2: with 1e-3 its float32 Cholesky of a factor fails on MNIST, "not positive-definite")
  followed by an SGD step. ASDL refuses the attention output projection (``NonDynamicallyQuantizableLinear``
  owned by ``nn.MultiheadAttention``, "Not supported module"), so it runs with that class in its
  ``ignore_modules``; the packed in-projection, class token and position table belong to no module it knows.
  Those parameters get no curvature from ASDL: the ``coverage`` column gives the fraction that does.

Measurement. Time: ONE process holds every arm (each with its own copy of the model, the same initial
weights), runs ``--warmup`` steps of each, then ``--steps`` rounds (a multiple of 10) of one step of every arm
in rotating order, so that the machine's load falls on all arms alike; per arm the mean wall-clock and CPU
time (``time.process_time``) of its steps (its own consecutive steps: whole rho and factor periods, an exact
mean). ``--rounds`` such processes, the median over them. On a shared machine the CPU time is the measure to
compare (one torch thread: it counts the arm's own work, not the time it waited for a core). Memory: each arm
in a fresh process (``_common.run_worker``; ``--no-memory`` skips it), the peak RSS increase during its timed
steps over the RSS before them (model, data and optimiser state already allocated). One torch thread by
default (``--threads``).

Targets: a GaussNewton step at most 3x an AdamW step (issue 21); a GaussNewton KFAC step with factors every
step at or below ASDL's step time in the same process, every parameter covered (issue 35). Run:
``.venv/bin/python benchmarks/gauss_newton_vit.py`` (``--quick``: one round of 10 steps; ``--out FILE.md``
also writes the table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_mib, fmt_ratio, fmt_seconds, require_library, run_worker, time_steps

ARMS = ("gradient pass", "AdamW", "GaussNewton KFAC", "GaussNewton KFAC-reduce",
        "GaussNewton KFAC, alpha* every 5th step", "GaussNewton KFAC, factors every 10", "ASDL KFAC + SGD")
VIT = dict(image_size=28, patch_size=4, channels=1, dim=256, depth=2, heads=4, mlp_dim=672, num_classes=10)


def _batches(batch: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from curvkit.experiments._second_order import load_mnist

    X, y = load_mnist(batch * n)
    X = X.reshape(-1, 1, 28, 28)
    return [(X[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]) for i in range(n)]


def _asdl(model: torch.nn.Module, batch: int) -> tuple[Any, float]:
    """ASDL's KFAC gradient maker on the parts of ``model`` it takes, and the fraction of parameters covered."""
    from asdl import KfacGradientMaker, PreconditioningConfig
    from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

    config = PreconditioningConfig(data_size=batch, damping=1e-2, ignore_modules=[NonDynamicallyQuantizableLinear])
    gm = KfacGradientMaker(model, config, fisher_type="fisher_mc", loss_type="cross_entropy")
    covered = dict(model.named_modules())
    n = sum(p.numel() for name, _ in gm.named_modules_for_curvature
            for p in covered[name.replace("/", ".")].parameters(recurse=False))
    return gm, n / sum(p.numel() for p in model.parameters())


def make_arm(arm: str, batch: int) -> tuple[Any, torch.nn.Module, float]:
    """(step(X, y), its model, the fraction of parameters with curvature) of one arm (module docstring)."""
    from curvkit.architectures import vit
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton

    model = vit(**VIT, seed=0)  # type: ignore[arg-type]
    lik = CrossEntropy("mean")
    coverage = 1.0
    if arm == "gradient pass":
        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            model.zero_grad()
            lik(model(xb), yb).backward()
    elif arm == "AdamW":
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            adamw.zero_grad()
            lik(model(xb), yb).backward()
            adamw.step()
    elif arm == "ASDL KFAC + SGD":
        gm, coverage = _asdl(model, batch)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            sgd.zero_grad()
            dummy = gm.setup_model_call(model, xb)
            gm.setup_loss_call(torch.nn.functional.cross_entropy, dummy, yb)
            gm.forward_and_backward()
            sgd.step()
    else:
        every = 10 if arm.endswith("every 10") else 1
        quadratic = 5 if "alpha*" in arm else 1
        sharing = "reduce" if arm.endswith("reduce") else "expand"
        gn = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature="kfac", weight_decay=1e-5,
                         curvature_every=every, quadratic_every=quadratic, weight_sharing=sharing)

        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            gn.step(batch=(xb, yb))
    return step, model, coverage


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """``kind='memory'``: the peak memory of ``spec['arm']`` in this fresh process; ``kind='timing'``: every arm
    of ``spec['arms']`` in this process, interleaved step by step (module docstring)."""
    torch.set_num_threads(int(spec["threads"]))
    batch, warmup, steps = int(spec["batch"]), int(spec["warmup"]), int(spec["steps"])
    batches = _batches(batch, 4)
    if spec["kind"] == "memory":
        step, model, coverage = make_arm(spec["arm"], batch)
        out = time_steps(step, batches, warmup, steps)
        return {"peak_delta_mib": out["peak_delta_mib"], "params": sum(p.numel() for p in model.parameters()),
                "coverage": coverage}
    arms = {arm: make_arm(arm, batch) for arm in spec["arms"]}
    wall: dict[str, list[float]] = {arm: [] for arm in arms}
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    names = list(arms)
    failed: dict[str, str] = {}  # an arm that raises stops; the others go on
    for k in range(warmup + steps):
        for arm in names[k % len(names):] + names[:k % len(names)]:
            if arm in failed:
                continue
            c0, t0 = time.process_time(), time.perf_counter()
            try:
                arms[arm][0](*batches[k % len(batches)])
            except Exception as exc:
                failed[arm] = f"step {k + 1}: {type(exc).__name__}: {exc}"
                continue
            if k >= warmup:
                wall[arm].append(time.perf_counter() - t0)
                cpu[arm].append(time.process_time() - c0)
    return {arm: {"error": failed[arm]} if arm in failed else
            {"wall_s": statistics.fmean(wall[arm]), "cpu_s": statistics.fmean(cpu[arm]),
             "params": sum(p.numel() for p in arms[arm][1].parameters()), "coverage": arms[arm][2]}
            for arm in names}


def table(timing: list[dict[str, Any]], memory: dict[str, dict[str, Any]], args: argparse.Namespace,
          load: tuple[float, float]) -> str:
    """The markdown table: per arm the medians over the timing processes of its mean wall and CPU time per step,
    the CPU-time ratios to AdamW, the gradient pass and ASDL (same processes), and its peak memory."""
    def median(arm: str, key: str) -> float | None:
        ok = [t[arm][key] for t in timing if key in t.get(arm, {})]
        return statistics.median(ok) if ok else None

    ref = {name: median(name, "cpu_s") for name in ("AdamW", "gradient pass", "ASDL KFAC + SGD")}
    notes: list[str] = []
    lines = [f"### GaussNewton (KFAC) step on a ViT vs AdamW and ASDL ({datetime.date.today()})", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores, torch "
             f"{torch.__version__}, {args.threads} torch thread(s); load average (1 min) {load[0]:.2f} at the start, "
             f"{load[1]:.2f} at the end (shared machine). Batch {args.batch}, float32; every arm in one process, "
             f"{args.warmup} warm-up and {args.steps} timed steps each, interleaved; median over {args.rounds} "
             "process(es). Ratios of CPU time.", "",
             "| arm | params | coverage | wall time / step | CPU time / step | vs AdamW | vs gradient pass | vs ASDL | "
             "peak memory (MiB) |", "|---|---|---|---|---|---|---|---|---|"]
    errors = [t["error"] for t in timing if "error" in t]
    for arm in ARMS:
        wall, cpu = median(arm, "wall_s"), median(arm, "cpu_s")
        failures = [t[arm]["error"] for t in timing if "error" in t.get(arm, {})]
        if cpu is None:
            why = ("not run (optional dependency asdfghjkl missing)" if not any(arm in t for t in timing)
                   and not errors else f"error: {(failures or errors or ['?'])[0][:160]}")
            lines.append(f"| {arm} | - | - | {why} | - | - | - | - | - |")
            continue
        if failures:  # failed in some timing processes: the median is over the others
            notes.append(f"{arm}: failed in {len(failures)} of {len(timing)} process(es) ({failures[0][:160]})")
        first = next(t[arm] for t in timing if "cpu_s" in t.get(arm, {}))
        mem = memory.get(arm, {}).get("peak_delta_mib")
        ratios = " | ".join(fmt_ratio(cpu / r if r else None) for r in ref.values())
        lines.append(f"| {arm} | {first['params']:,} | {100 * first['coverage']:.0f} % | {fmt_seconds(wall)} | "
                     f"{fmt_seconds(cpu)} | {ratios} | {fmt_mib(mem)} |")
    return "\n".join(lines + [""] + [f"Note: {n}." for n in notes]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=1, help="timing processes (median over them)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 10, 1
    if args.steps % 10:
        ap.error(f"--steps must be a multiple of 10 (tau adapted every 5 steps, factors every 10 in one arm), "
                 f"got {args.steps}")
    asdl = require_library("ASDL KFAC + SGD", "asdl", "benchmarks/gauss_newton_vit.py", optional=True)
    arms = [a for a in ARMS if asdl or a != "ASDL KFAC + SGD"]
    load0 = os.getloadavg()[0]
    common = {"batch": args.batch, "steps": args.steps, "warmup": args.warmup, "threads": args.threads}
    timing = []
    for r in range(args.rounds):
        res = run_worker(__file__, {**common, "kind": "timing", "arms": arms}, timeout=7200)
        timing.append(res)
        for arm in arms:
            got = res.get(arm) or {"error": res.get("error", "?")}
            print(f"timing {r + 1} {arm:36s} " + (got["error"] if "error" in got else
                  f"wall {fmt_seconds(got['wall_s'])}, CPU {fmt_seconds(got['cpu_s'])}"), file=sys.stderr)
    memory: dict[str, dict[str, Any]] = {}
    for arm in [] if args.no_memory else arms:
        memory[arm] = run_worker(__file__, {**common, "kind": "memory", "arm": arm}, timeout=3600)
        print(f"memory {arm:36s} " + memory[arm].get("error", fmt_mib(memory[arm].get("peak_delta_mib"))),
              file=sys.stderr)
    text = table(timing, memory, args, (load0, os.getloadavg()[0]))
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
