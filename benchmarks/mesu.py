"""Benchmark of one MESU step (issue 3, section 6): the K Monte Carlo samples evaluated together
(``vmap`` + ``functional_call``) against K sequential forward/backward passes and against one Adam step.

Setting (the permuted-MNIST network of the MESU paper): 1024-200-200-10 ReLU MLP (247,210 parameters),
float32, CPU, batch 128 of real MNIST images padded to 32x32 and scaled to [0, 1], softmax cross-entropy
(sum over the batch for MESU, as in training), K = 10 samples.

Timed callables (each from the batch to the updated parameters):

* ``mesu_vmap``: ``MESU.step(batch=(X, y))``: the vectorised MC gradients (Eq. 1) + the Eq. 3 update;
* ``mesu_closure``: ``MESU.step(closure)``: the torch.optim closure path, K sequential forward/backward
  passes with the sampled weights written into the module + the same update;
* ``loop_fwd_bwd``: the same K gradient samples by K sequential ``functional_call`` forward/backward passes
  (``curvkit.posterior.mc_gradients_loop``), no update: the baseline of the target ratio <= 0.5;
* ``adam``: one ``torch.optim.Adam`` step (zero_grad, forward, backward, step; mean loss) on the same net;
* ``fwd_bwd``: one plain forward/backward pass (the unit cost).

All callables are warmed up, then ``--repeats`` rounds run one call of each per round in rotating order
(``_common.time_rounds``); the table reports the median wall time over rounds, its minimum, and ratios of the
median wall times against the loop and against Adam from the same run (interleaving keeps ratios fair on a
shared machine whose load drifts), then the median CPU time of the process (``time.process_time``, every
thread) over the same calls and the threads kept busy (CPU / wall time). Default one torch thread.

Run: ``.venv/bin/python benchmarks/mesu.py`` (``--repeats``, ``--threads``, ``--mc-samples``, ``--out FILE.md``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_busy, time_rounds
from curvkit.likelihoods import CrossEntropy
from curvkit.models import mlp
from curvkit.optim import MESU
from curvkit.posterior import likelihood_loss, mc_gradients_loop


def batch(n: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    from curvkit.data import mnist
    from curvkit.data.transforms import flatten, pad, to_unit

    X, y = mnist(train=True)
    return flatten(to_unit(pad(X[:n], 2))), y[:n]


def build(mc_samples: int) -> dict[str, Callable[[], object]]:
    X, y = batch()
    loss = likelihood_loss(CrossEntropy("sum"))
    fns: dict[str, Callable[[], object]] = {}

    m1 = mlp([1024, 200, 200, 10], "relu", seed=0)
    o1 = MESU(m1.parameters(), model=m1, mc_samples=mc_samples, seed=0)
    fns["mesu_vmap"] = lambda: o1.step(batch=(X, y))

    m2 = mlp([1024, 200, 200, 10], "relu", seed=0)
    o2 = MESU(m2.parameters(), model=m2, mc_samples=mc_samples, seed=0)

    def closure() -> torch.Tensor:
        out = nn.functional.cross_entropy(m2(X), y, reduction="sum")
        out.backward()
        return out

    fns["mesu_closure"] = lambda: o2.step(closure)

    m3 = mlp([1024, 200, 200, 10], "relu", seed=0)
    mu = {n: p.detach() for n, p in m3.named_parameters()}
    sig = {n: torch.full_like(p, 0.04) for n, p in mu.items()}
    g3 = torch.Generator().manual_seed(0)
    fns["loop_fwd_bwd"] = lambda: mc_gradients_loop(m3, loss, X, y, mu, sig, mc_samples, g3)

    m4 = mlp([1024, 200, 200, 10], "relu", seed=0)
    adam = torch.optim.Adam(m4.parameters(), lr=1e-3)

    def adam_step() -> None:
        adam.zero_grad()
        nn.functional.cross_entropy(m4(X), y).backward()
        adam.step()

    fns["adam"] = adam_step

    m5 = mlp([1024, 200, 200, 10], "relu", seed=0)

    def fwd_bwd() -> None:
        m5.zero_grad()
        nn.functional.cross_entropy(m5(X), y, reduction="sum").backward()

    fns["fwd_bwd"] = fwd_bwd
    return fns


def measure(fns: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict[str, dict[str, Any]]:
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    return time_rounds(fns, repeats)


def table(results: dict[str, dict[str, Any]], mc_samples: int) -> str:
    med = {n: r["median_s"] for n, r in results.items()}
    desc = {
        "mesu_vmap": f"MESU step, K = {mc_samples} samples vectorised (vmap)",
        "mesu_closure": f"MESU step, closure path (K = {mc_samples} sequential passes)",
        "loop_fwd_bwd": f"K = {mc_samples} sequential forward/backward passes (baseline)",
        "adam": "one Adam step",
        "fwd_bwd": "one forward/backward pass",
    }
    lines = ["| operation | median wall time (ms) | min (ms) | / sequential loop | / Adam step | CPU time (ms) | "
             "threads busy |", "|---|---|---|---|---|---|---|"]
    for n, r in results.items():
        lines.append(f"| {desc[n]} | {1e3 * med[n]:.2f} | {1e3 * r['min_s']:.2f} | "
                     f"{med[n] / med['loop_fwd_bwd']:.2f}x | {med[n] / med['adam']:.2f}x | {1e3 * r['cpu_s']:.2f} | "
                     f"{fmt_busy(r['threads_busy'])} |")
    ratio = med["mesu_vmap"] / med["loop_fwd_bwd"]
    lines.append("")
    lines.append(f"Target (issue 3): vectorised step <= 0.5x the sequential loop. Measured: {ratio:.2f}x -> "
                 f"{'met' if ratio <= 0.5 else 'NOT met'}.")
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mc-samples", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = measure(build(args.mc_samples), args.repeats, args.warmup)
    header = (f"Machine: {cpu_model()}, {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.1f} at the "
              f"end, {platform.system()}, torch {torch.__version__}, "
              f"{args.threads} torch thread(s), float32 CPU; 1024-200-200-10 ReLU MLP, batch 128 (MNIST padded to "
              f"32x32), K = {args.mc_samples}; median wall and CPU time of {args.repeats} interleaved rounds after "
              f"{args.warmup} warm-up calls.\nCommand: `.venv/bin/python benchmarks/mesu.py --repeats {args.repeats} --threads "
              f"{args.threads} --mc-samples {args.mc_samples}`\n")
    text = header + "\n" + table(results, args.mc_samples) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
