"""A GaussNewton (KFAC) step on a ViT against an AdamW step, a gradient pass and ASDL's KFAC, all measured in the
same run (issue 21, section 4, the GaussNewton part). Prints a markdown table.

Model and data (float32, CPU, train mode with dropout 0, softmax cross-entropy with mean reduction):
``curvkit.architectures.vit`` on real MNIST (bundled), 28x28 images in 4x4 patches (49 patches and a class
token = 50 tokens), width 256, 2 pre-norm blocks of 4 heads, MLP width 672: 1,238,858 parameters; minibatches
of ``--batch`` = 128, cycling over 4 of them.

Arms (each in its own fresh process, ``_common.run_worker``):

* ``gradient pass``: forward, loss and ``backward()`` (plain PyTorch, the user's default kernels);
* ``AdamW``: ``torch.optim.AdamW`` (lr 1e-3): a gradient pass and the update; the baseline of every ratio;
* ``GaussNewton KFAC``: ``curvkit.optim.GaussNewton(curvature='kfac')`` with the thesis's settings: factors
  of the current minibatch (one sampled label per example) and their factored damped inverses every step,
  alpha* from one Jacobian-vector product of the exact GGN, rho with one extra forward pass on one step in
  five (``tau_every=5``; a whole number of 5-step periods is timed, so the mean is exact). Every trainable
  parameter has a block (packed attention projections, LayerNorm, class token and position table included);
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

Measurement: ``--warmup`` steps, then ``--steps`` timed steps (a multiple of 10) per process; the per-step time
is the mean over the timed steps, the peak memory the peak RSS increase during the timed steps over the RSS
before them (model, data and optimiser state already allocated). ``--rounds`` rounds run the arms in rotating
order, so that machine load affects all alike; the table gives the median over rounds and the ratios to
AdamW's and to the gradient pass's medians. One torch thread by default (``--threads``).

Target (issue 21): a GaussNewton step at most 3x an AdamW step. Run: ``.venv/bin/python
benchmarks/gauss_newton_vit.py`` (``--quick``: one round of 10 steps; ``--out FILE.md`` also writes the table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_mib, fmt_ratio, fmt_seconds, require_library, run_worker, time_steps

ARMS = ("gradient pass", "AdamW", "GaussNewton KFAC", "GaussNewton KFAC, factors every 10", "ASDL KFAC + SGD")
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


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Time ``spec['arm']`` in this process (module docstring)."""
    torch.set_num_threads(int(spec["threads"]))
    from curvkit.architectures import vit
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton

    arm, batch = spec["arm"], int(spec["batch"])
    model = vit(**VIT, seed=0)  # type: ignore[arg-type]
    lik = CrossEntropy("mean")
    batches = _batches(batch, 4)
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
        gn = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature="kfac", weight_decay=1e-5,
                         curvature_every=every)

        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            gn.step(batch=(xb, yb))
    out = time_steps(step, batches, int(spec["warmup"]), int(spec["steps"]))
    return {**out, "params": sum(p.numel() for p in model.parameters()), "coverage": coverage}


def table(samples: dict[str, list[dict[str, Any]]], args: argparse.Namespace, load: tuple[float, float]) -> str:
    def median(arm: str) -> float | None:
        ok = [s["mean_s"] for s in samples.get(arm, []) if "mean_s" in s]
        return statistics.median(ok) if ok else None

    adamw, grad = median("AdamW"), median("gradient pass")
    lines = [f"### GaussNewton (KFAC) step on a ViT vs AdamW and ASDL ({datetime.date.today()})", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores, torch "
             f"{torch.__version__}, {args.threads} torch thread(s); load average (1 min) {load[0]:.2f} at the start, "
             f"{load[1]:.2f} at the end (shared machine). Batch {args.batch}, float32; {args.warmup} warm-up and "
             f"{args.steps} timed steps per process, median over {args.rounds} round(s).", "",
             "| arm | params | coverage | time / step | vs AdamW | vs gradient pass | peak memory (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        got = samples.get(arm)
        if got is None:
            lines.append(f"| {arm} | - | - | not run (optional dependency asdfghjkl missing) | - | - | - |")
            continue
        ok = [s for s in got if "mean_s" in s]
        if not ok:
            lines.append(f"| {arm} | - | - | error: {got[0].get('error', '?')[:100]} | - | - | - |")
            continue
        t = median(arm)
        assert t is not None
        mem = [s["peak_delta_mib"] for s in ok if s["peak_delta_mib"] is not None]
        lines.append(f"| {arm} | {ok[0]['params']:,} | {100 * ok[0]['coverage']:.0f} % | {fmt_seconds(t)} | "
                     f"{fmt_ratio(t / adamw if adamw else None)} | {fmt_ratio(t / grad if grad else None)} | "
                     f"{fmt_mib(max(mem) if mem else None)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
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
    samples: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            spec = {"arm": arm, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
                    "threads": args.threads}
            res = run_worker(__file__, spec, timeout=3600)
            samples.setdefault(arm, []).append(res)
            print(f"round {r + 1} {arm:18s} " + (res["error"] if "error" in res else fmt_seconds(res["mean_s"])),
                  file=sys.stderr)
    text = table(samples, args, (load0, os.getloadavg()[0]))
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
