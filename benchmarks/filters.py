"""Per-step time and optimiser-state memory of the Bayesian-filtering optimisers (issue 4, section 4)
relative to ``torch.optim.Adam``, all measured in the same run. Prints a markdown table.

Setting: 784-512-512-10 ReLU MLP (669,706 parameters), float32, CPU, cross-entropy with mean reduction,
minibatches of the bundled real MNIST (scaled to [0, 1]), a pool of 32 distinct minibatches used in turn.

* **Time**: wall time per training step (zero_grad, forward, backward, ``step``) and of ``optimizer.step()``
  alone, averaged over the timed steps of a fresh model + optimiser, after 3 warm-up steps. Kronecker
  filters time a whole number of their refresh periods k (eigendecomposition / inversion every k steps),
  so the amortised cost is exact. Beside each wall time, the process's CPU time (``time.process_time``, every
  thread) of the same steps, and the threads kept busy (CPU / wall time). ``--rounds`` rounds interleave the
  optimisers (rotating order) so that machine load affects all alike; the table gives the median over rounds
  and the ratio of the median wall time to Adam's.
* **Memory**: bytes of the tensors held in the optimiser state after the run (Adam: 2 x parameters).
  Transient per-step allocations are not included.
* **Targets** (issue 4): factorised filters <= 1.3x Adam per training step; Kronecker filters <= 2x Adam
  with the factor inversion amortised every k steps.

Run: ``.venv/bin/python benchmarks/filters.py`` (full) or ``--quick`` (one short round, for development);
``--batch B`` sets the minibatch size (default 128), ``--only KF`` times only the matching optimisers (and Adam).
``--out FILE.md`` also writes the table to a file. Default: one torch thread (``--threads``), the most stable
setting on a shared CPU.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_fields, fmt_busy
from curvkit.optim.filters import (
    BFAdam,
    BFAdamSS,
    BFNatGrad,
    BFRMSProp,
    BFRMSPropSS,
    KFBayes,
    KFNatGrad,
    KFWhiten,
)

WARMUP = 3


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10))


class Entry:
    """One row: how to build the optimiser, its family (target) and its refresh period (1 if none)."""

    def __init__(self, factory: Callable[[torch.nn.Module], Any], family: str, period: int = 1):
        self.factory, self.family, self.period = factory, family, period


def optimisers(B: int, k: int) -> dict[str, Entry]:
    return {
        "Adam (baseline)": Entry(lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), "baseline"),
        "SGD+momentum": Entry(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), "baseline"),
        "RMSprop": Entry(lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3), "baseline"),
        "BFNatGrad (O2)": Entry(lambda m: BFNatGrad(m.parameters(), batch_size=B), "factorised"),
        "BFRMSProp (O3)": Entry(lambda m: BFRMSProp(m.parameters(), lr=1e-3, batch_size=B), "factorised"),
        "BFRMSPropSS (O4)": Entry(lambda m: BFRMSPropSS(m.parameters(), lr=1e-3, batch_size=B), "factorised"),
        "BFAdam (O5)": Entry(lambda m: BFAdam(m.parameters(), lr=1e-3, batch_size=B), "factorised"),
        "BFAdamSS (O6)": Entry(lambda m: BFAdamSS(m.parameters(), lr=1e-3, batch_size=B), "factorised"),
        f"KFWhiten (O9, k={k})": Entry(lambda m: KFWhiten(m.parameters(), model=m, lr=1e-3, batch_size=B, inv_every=k), "kronecker", k),
        f"KFWhiten (O9, k={5 * k})": Entry(lambda m: KFWhiten(m.parameters(), model=m, lr=1e-3, batch_size=B, inv_every=5 * k),
                                           "kronecker", 5 * k),
        f"KFBayes (O8, batched all rows, k={k})": Entry(
            lambda m: KFBayes(m.parameters(), model=m, lr=1e-3, batch_size=B, sample_update="batched", fisher_samples=None, inv_every=k),
            "kronecker", k),
        f"KFBayes (O8, default: sequential 8, k={k})": Entry(
            lambda m: KFBayes(m.parameters(), model=m, lr=1e-3, batch_size=B, fisher_samples=8, inv_every=k), "kronecker", k),
        f"KFBayes (O8, sequential 8, k={5 * k})": Entry(
            lambda m: KFBayes(m.parameters(), model=m, lr=1e-3, batch_size=B, fisher_samples=8, inv_every=5 * k), "kronecker", 5 * k),
        "KFNatGrad (O7, batched all rows)": Entry(
            lambda m: KFNatGrad(m.parameters(), model=m, batch_size=B, sample_update="batched", fisher_samples=None), "kronecker"),
        "KFNatGrad (O7, default: sequential 8)": Entry(lambda m: KFNatGrad(m.parameters(), model=m, batch_size=B), "kronecker"),
        "KFNatGrad (O7, sequential all rows)": Entry(lambda m: KFNatGrad(m.parameters(), model=m, batch_size=B, fisher_samples=None),
                                                     "kronecker"),
    }


TARGETS = {"factorised": 1.3, "kronecker": 2.0}


def state_bytes(opt: Any) -> int:
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


def mnist_batches(B: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from curvkit.data import mnist
    from curvkit.data.transforms import flatten, to_unit

    X, y = mnist(train=True)
    X = flatten(to_unit(X[: B * count])).float()
    return [(X[i * B:(i + 1) * B], y[i * B:(i + 1) * B]) for i in range(count)]


def run_one(entry: Entry, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int
            ) -> tuple[float, float, int, float, float]:
    """(mean training-step seconds, mean step() seconds, state bytes, mean training-step CPU seconds, mean step()
    CPU seconds) over ``steps`` timed steps."""
    model = make_model()
    opt = entry.factory(model)
    it = iter(range(10**9))

    def one() -> tuple[float, float]:
        X, y = batches[next(it) % len(batches)]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(X), y).backward()
        c0, t0 = time.process_time(), time.perf_counter()
        opt.step()
        return time.perf_counter() - t0, time.process_time() - c0

    for _ in range(WARMUP):
        one()
    c_start, t_start = time.process_time(), time.perf_counter()
    step_times = [one() for _ in range(steps)]
    total = (time.perf_counter() - t_start) / steps
    total_cpu = (time.process_time() - c_start) / steps
    if not all(math.isfinite(float(p.detach().sum())) for p in model.parameters()):
        raise RuntimeError("parameters became non-finite")
    return (total, sum(t for t, _ in step_times) / steps, state_bytes(opt), total_cpu,
            sum(c for _, c in step_times) / steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40, help="timed steps (Kronecker: rounded up to whole periods)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inv-every", type=int, default=20, help="refresh period k of the Kronecker filters")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="one round of 10 steps (development only)")
    ap.add_argument("--only", default=None,
                    help="comma-separated substrings: time only the optimisers whose name contains one (Adam always)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 10
    torch.set_num_threads(args.threads)
    batches = mnist_batches(args.batch, 32)
    opts = optimisers(args.batch, args.inv_every)
    if args.only:
        keys = [w.strip() for w in args.only.split(",")]
        opts = {n: e for n, e in opts.items() if n == "Adam (baseline)" or any(w in n for w in keys)}
    res: dict[str, list[tuple[float, float, int, float, float]]] = {n: [] for n in opts}
    failed: dict[str, str] = {}
    names = list(opts)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name in failed:
                continue
            entry = opts[name]
            steps = math.ceil(args.steps / entry.period) * entry.period
            try:
                res[name].append(run_one(entry, batches, steps))
            except (ValueError, RuntimeError) as err:   # report, do not hide, a divergence
                failed[name] = str(err).splitlines()[0]
    base = res["Adam (baseline)"]
    base_total = statistics.median(r[0] for r in base)
    base_step = statistics.median(r[1] for r in base)
    base_mem = base[0][2]
    lines = [
        f"784-512-512-10 ReLU MLP (669,706 parameters), float32, real MNIST minibatches of {args.batch}, "
        f"{args.steps} timed steps (Kronecker: whole refresh periods) x {args.rounds} rounds, median wall and CPU "
        "time; "
        f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} CPUs "
        f"({platform.processor() or platform.machine()}), load average at the end {os.getloadavg()[0]:.1f}, "
        f"{datetime.date.today().isoformat()}.",
        "",
        "Targets (issue 4): factorised filters <= 1.3x Adam per training step; Kronecker filters <= 2x Adam "
        "with the inversion amortised every k steps.",
        "",
        "| optimiser | train step (ms) | vs Adam | target | met | train step CPU (ms) | threads busy | "
        "optimizer.step (ms) | vs Adam | optimizer.step CPU (ms) | state (MiB) | vs Adam |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rs in res.items():
        target = TARGETS.get(opts[name].family)
        tgt = f"<= {target:.1f}x" if target else "-"
        if name in failed:
            lines.append(f"| {name} | failed: {failed[name]} | | {tgt} | no | | | | | | | |")
            continue
        tot = statistics.median(r[0] for r in rs)
        st = statistics.median(r[1] for r in rs)
        mem = rs[0][2]
        cpu = cpu_fields([r[0] for r in rs], [r[3] for r in rs])
        st_cpu = statistics.median(r[4] for r in rs)
        met = "-" if target is None else ("yes" if tot / base_total <= target else "no")
        lines.append(f"| {name} | {tot * 1e3:.2f} | {tot / base_total:.2f}x | "
                     f"{tgt} | {met} | {cpu['cpu_s'] * 1e3:.2f} | {fmt_busy(cpu['threads_busy'])} | "
                     f"{st * 1e3:.2f} | {st / base_step:.2f}x | {st_cpu * 1e3:.2f} | "
                     f"{mem / 2**20:.1f} | {mem / base_mem:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
