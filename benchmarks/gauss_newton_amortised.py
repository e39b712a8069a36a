"""What GaussNewton's refresh intervals cost in updates and gain in seconds (issue 35): the thesis's step (factors,
inverses and the quadratic model of alpha* every step) against ``quadratic_every``, ``curvature_every`` (the
``AMORTISED`` preset) and both, on the chapter-4 autoencoder (KFRA, the thesis's source) and the ViT of
``benchmarks/gauss_newton_vit.py`` (KFAC), with AdamW beside them. Prints markdown tables.

Every arm starts from the same initialisation and sees the same minibatches, in one process, one after the other
(``--threads`` torch threads, default 1). Columns: wall seconds per update (mean over the run) and its ratio to
the thesis arm's; the CPU seconds of the process per update over the same updates (``time.process_time``, every
thread) and the threads kept busy (CPU / wall time); the minibatch data loss at the end (mean of the last 5 updates); the updates and the seconds each arm
needed to reach the thesis arm's final value and AdamW's (the loss smoothed over 5 updates, wall seconds; "-" if it did not). Machine load
moves the seconds of all arms alike only roughly: the load average is printed; the ratios are of one run.

Models: the autoencoder ``curvkit.models.autoencoder(784, width=0.5)`` (784-500-250-125-15 and back, Glorot
initialised, Bernoulli likelihood with the mean over the minibatch, weight decay 1e-5) on MNIST minibatches of 250;
the ViT (1.25 M parameters, softmax cross-entropy, minibatches of 128). Run: ``python
benchmarks/gauss_newton_amortised.py [--steps N] [--only vit|autoencoder]`` (under ``flock
/tmp/curvkit-bench.lock`` on a shared machine).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_busy

ARMS: dict[str, dict[str, Any]] = {
    "thesis (every step)": {},
    "quadratic_every=5, tau_every=5": {"quadratic_every": 5, "tau_every": 5},
    "curvature_every=5 (AMORTISED)": {"AMORTISED": True},
    "all three every 5": {"curvature_every": 5, "quadratic_every": 5, "tau_every": 5},
}


def _problem(name: str, steps: int) -> tuple[Any, Any, list[tuple[torch.Tensor, torch.Tensor]], str, float]:
    from curvkit.experiments._second_order import glorot_, load_mnist
    from curvkit.likelihoods import BernoulliBCE, CrossEntropy
    from curvkit.models import autoencoder

    if name == "autoencoder":
        X, _ = load_mnist(250 * 20)
        X = X.reshape(X.shape[0], -1)
        batches = [(X[i * 250:(i + 1) * 250], X[i * 250:(i + 1) * 250]) for i in range(20)]
        return (lambda: glorot_(autoencoder(784, width=0.5), 0)), BernoulliBCE("mean"), batches, "kfra", 1e-3
    from curvkit.architectures import vit
    from gauss_newton_vit import VIT, _batches

    return (lambda: vit(**VIT, seed=0)), CrossEntropy("mean"), _batches(128, 20), "kfac", 1e-3


def _run(make: Any, lik: Any, batches: list[Any], steps: int, arm: dict[str, Any] | None, source: str,
         lr: float) -> tuple[list[float], list[float], list[float]]:
    """(data loss of every update, wall seconds and process CPU seconds from the start to the end of every update)."""
    from curvkit.optim import GaussNewton
    from curvkit.optim.second_order import AMORTISED

    model = make()
    losses, times, cpu = [], [], []
    if arm is None:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-5)

        def step(X: torch.Tensor, y: torch.Tensor) -> float:
            opt.zero_grad()
            loss = lik(model(X), y)
            loss.backward()
            opt.step()
            return float(loss.detach())
    else:
        kw = dict(AMORTISED) if arm.get("AMORTISED") else arm
        gn = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature=source, weight_decay=1e-5, **kw)

        def step(X: torch.Tensor, y: torch.Tensor) -> float:
            gn.step(batch=(X, y))
            return float(gn.history[-1]["data_loss"])
    c0, t0 = time.process_time(), time.perf_counter()
    for k in range(steps):
        losses.append(step(*batches[k % len(batches)]))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return losses, times, cpu


def _smooth(x: list[float], w: int = 5) -> list[float]:
    return [sum(x[max(0, i - w + 1):i + 1]) / len(x[max(0, i - w + 1):i + 1]) for i in range(len(x))]


def table(name: str, steps: int) -> str:
    make, lik, batches, source, lr = _problem(name, steps)
    load0 = os.getloadavg()[0]
    runs = {f"GaussNewton {source.upper()}, {arm}": _run(make, lik, batches, steps, cfg, source, lr)
            for arm, cfg in ARMS.items()}
    runs[f"AdamW (lr {lr:g})"] = _run(make, lik, batches, steps, None, source, lr)
    ref_loss, ref_time, _ = next(iter(runs.values()))
    target = _smooth(ref_loss)[-1]
    adamw = _smooth(runs[f"AdamW (lr {lr:g})"][0])[-1]
    per_ref = ref_time[-1] / steps
    lines = [f"### {name}: {steps} updates per arm, load average {load0:.2f} -> {os.getloadavg()[0]:.2f}", "",
             "| arm | s / update | vs thesis | CPU s / update | threads busy | final loss (last 5) | updates to "
             "thesis's final | s to it | updates to AdamW's final | s to it |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, (loss, t, c) in runs.items():
        sm = _smooth(loss)
        cells = []
        for goal in (target, adamw):
            hit = next((i for i, v in enumerate(sm) if v <= goal), None)
            cells += ["-" if hit is None else str(hit + 1), "-" if hit is None else f"{t[hit]:.1f}"]
        lines.append(f"| {arm} | {t[-1] / steps:.3f} | {t[-1] / steps / per_ref:.2f} | {c[-1] / steps:.3f} | "
                     f"{fmt_busy(c[-1] / t[-1] if t[-1] > 0 else None)} | {sm[-1]:.4g} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=("vit", "autoencoder"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in ("autoencoder", "vit"):
        if args.only in (None, name):
            print(table(name, args.steps), flush=True)


if __name__ == "__main__":
    main()
