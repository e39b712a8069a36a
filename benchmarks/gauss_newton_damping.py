"""Damping schedules of the Gauss-Newton optimiser (thesis ch. 4; issue 24, item 5): the thesis's schedule
(the default, kept by the reproductions) against ``FAST_ADAPTATION`` and against a scale-aware start, on
problems other than the logistic regression of the issue. Prints a markdown table.

Schedules (``GaussNewton`` with KFRA curvature, factored damping, weight decay 1e-5, everything else default):

* ``thesis``: tau_0 = zeta_0 = 1; tau every 5 steps by 0.95, zeta every 20 steps by 0.95 (the defaults);
* ``fast``: ``curvkit.optim.second_order.FAST_ADAPTATION`` (tau every step by 0.8, zeta every 5 steps by 1/2),
  and ``fast, tau x 2/3``: the same with the classical Levenberg-Marquardt factor 2/3 for tau (Martens 2010);
* ``scaled start``: tau_0 = zeta_0 = the mean eigenvalue of the first minibatch's Kronecker curvature,
  tr(G~) / dim = sum_l tr(G_l) tr(A_l) / dim, with the thesis's schedule, and ``scaled + fast`` with the fast
  one (the scale-aware initialisation considered for the issue; not offered, see the results).

Problems (float64, CPU, 1 thread; each with 3 seeds for the initial weights and the minibatch order):

* ``digits full batch``: sklearn's 1,797 8x8 digits / 16, MLP 64-32-10 tanh, softmax cross-entropy (mean);
* ``digits full batch, sum``: the same with the summed cross-entropy (the curvature 1,797x larger);
* ``digits ReLU, batch 128``: MLP 64-64-64-10 ReLU, minibatches of 128;
* ``teacher-student, batch 100``: 1,000 points from a 10-32-32-2 tanh teacher plus noise 0.1, a student of
  the same shape, Gaussian likelihood (mean);
* ``MNIST autoencoder, batch 250``: the first 2,000 bundled MNIST images, 784-128-32-128-784 tanh, Bernoulli
  cross-entropy (mean);
* ``logistic regression`` (the kind of problem the issue reports; NOT used to choose the schedule): 2,000
  points in 20 dimensions from a logistic teacher, one Linear layer to 2 classes, full batch; its optimum is
  computed by a dense damped Newton method, and the table also gives the steps to a relative objective gap
  of 1e-8.

Measured: the full-data objective (loss + weight decay) after 10, 25, 50 and 100 steps (median over the
seeds, and the worst seed); the number of steps the schedule needs to reach the thesis schedule's 100-step
objective (median); the largest increase of the full-data objective between two steps (worst seed); the
wall-clock per step (``optimizer.step`` only, mean over the run, median over the seeds), the process's CPU time
per step over the same steps (``time.process_time``, every thread) and the threads kept busy (CPU / wall time);
the wall-clock per step relative to the thesis's schedule on the same problem and seed (every (problem, seed)
runs all schedules back to back, in rotating order, so machine load affects them alike). A diverged run
(a non-finite objective or a step the optimiser refuses) counts as inf.

Run: ``.venv/bin/python benchmarks/gauss_newton_damping.py [--steps 100] [--seeds 3] [--out FILE.md]``.
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
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_fields, fmt_busy, fmt_seconds

Problem = tuple[Callable[[int], nn.Module], Any, Tensor, Tensor, int | None]


def problems() -> dict[str, Problem]:
    from curvkit.data.sklearn_digits import digits
    from curvkit.data.synthetic import teacher_student
    from curvkit.experiments._second_order import load_mnist
    from curvkit.likelihoods import BernoulliBCE, CrossEntropy, Gaussian
    from curvkit.models import mlp

    D = torch.float64
    X, y = digits(D)
    X = X.reshape(-1, 64) / 16
    Xr, yr, _ = teacher_student(1000, [10, 32, 32, 2], "tanh", noise=0.1, seed=0)
    Xm = load_mnist(2000)[0].to(D)
    g = torch.Generator().manual_seed(0)
    Xl = torch.randn(2000, 20, generator=g, dtype=D)
    yl = (torch.rand(2000, generator=g, dtype=D) < torch.sigmoid(Xl @ torch.randn(20, generator=g, dtype=D))).long()
    return {
        "digits full batch": (lambda s: mlp([64, 32, 10], "tanh", dtype=D, seed=s), CrossEntropy("mean"), X, y, None),
        "digits full batch, sum": (lambda s: mlp([64, 32, 10], "tanh", dtype=D, seed=s), CrossEntropy("sum"), X, y,
                                   None),
        "digits ReLU, batch 128": (lambda s: mlp([64, 64, 64, 10], "relu", dtype=D, seed=s), CrossEntropy("mean"),
                                   X, y, 128),
        "teacher-student, batch 100": (lambda s: mlp([10, 32, 32, 2], "tanh", dtype=D, seed=s), Gaussian("mean"), Xr,
                                       yr, 100),
        "MNIST autoencoder, batch 250": (lambda s: mlp([784, 128, 32, 128, 784], "tanh", dtype=D, seed=s),
                                         BernoulliBCE("mean"), Xm, Xm, 250),
        "logistic regression (the issue's kind)": (lambda s: mlp([20, 2], dtype=D, seed=s), CrossEntropy("mean"),
                                                   Xl, yl, None),
    }


WEIGHT_DECAY = 1e-5
SCHEDULES = ["thesis", "fast", "fast, tau x 2/3", "scaled start", "scaled + fast"]


def _mean_eigenvalue(model: nn.Module, lik: Any, batch: tuple[Tensor, Tensor]) -> float:
    from curvkit.curvature.estimators import KroneckerEstimator

    op = KroneckerEstimator(model, lik, "kfra").update(batch).operator()
    return sum(float(b.G.trace()) * float(b.A.trace()) for b in op.blocks) / op.layout.dim


def _objective(model: nn.Module, lik: Any, X: Tensor, Y: Tensor) -> float:
    with torch.no_grad():
        reg = 0.5 * WEIGHT_DECAY * sum(float((p**2).sum()) for p in model.parameters())
        return float(lik(model(X), Y)) + reg


def run(problem: Problem, schedule: str, seed: int, steps: int) -> dict[str, Any]:
    """One run: the full-data objective before every step and after the last, and the wall and CPU time per
    step."""
    from curvkit.optim import GaussNewton
    from curvkit.optim.second_order import FAST_ADAPTATION

    make, lik, X, Y, B = problem
    model = make(seed)
    gen = torch.Generator().manual_seed(1000 + seed)

    def batch() -> tuple[Tensor, Tensor]:
        if B is None:
            return X, Y
        idx = torch.randint(0, X.shape[0], (B,), generator=gen)
        return X[idx], Y[idx]

    kw: dict[str, Any] = dict(FAST_ADAPTATION) if "fast" in schedule else {}
    if schedule == "fast, tau x 2/3":
        kw["omega_tau"] = 2 / 3
    b = batch()
    if schedule.startswith("scaled"):
        kw["tau"] = kw["zeta"] = _mean_eigenvalue(model, lik, b)
    opt = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature="kfra", weight_decay=WEIGHT_DECAY,
                      **kw)
    curve, spent, spent_cpu = [], 0.0, 0.0
    for _ in range(steps):
        curve.append(_objective(model, lik, X, Y))
        c0, t0 = time.process_time(), time.perf_counter()
        try:
            opt.step(batch=b)
        except (FloatingPointError, ValueError):
            curve.append(math.inf)
            break
        spent += time.perf_counter() - t0
        spent_cpu += time.process_time() - c0
        b = batch()
    else:
        curve.append(_objective(model, lik, X, Y))
    curve = [v if math.isfinite(v) else math.inf for v in curve]
    n = max(1, len(curve) - 1)
    return {"curve": curve, "time_per_step": spent / n, "cpu_per_step": spent_cpu / n}


def newton_optimum(problem: Problem, seed: int) -> float:
    """The objective's minimum for the one-layer (convex) problem: dense Newton with a backtracking line
    search, to a gradient norm of 1e-12."""
    from torch.func import functional_call, grad, hessian

    make, lik, X, Y, _ = problem
    model = make(seed)
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]

    def E(th: Tensor) -> Tensor:
        ps, o = {}, 0
        for n, s in zip(names, shapes):
            k = math.prod(s)
            ps[n] = th[o:o + k].reshape(s)
            o += k
        return lik(functional_call(model, ps, (X,)), Y) + 0.5 * WEIGHT_DECAY * (th**2).sum()

    th = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for _ in range(100):
        g = grad(E)(th)
        if float(g.norm()) < 1e-12:
            break
        d = torch.linalg.lstsq(hessian(E)(th), -g[:, None]).solution[:, 0]
        t = 1.0
        while float(E(th + t * d)) > float(E(th)) and t > 1e-10:
            t /= 2
        th = th + t * d
    return float(E(th))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", help="substring of the problem names to run")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    probs = {k: v for k, v in problems().items() if not args.only or args.only in k}
    loads = [os.getloadavg()[0]]
    t_start = time.time()
    lines = [f"### Damping schedules ({datetime.date.today()})", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores, torch "
             f"{torch.__version__}, {args.threads} torch thread(s), float64; {args.steps} steps, seeds 0..{args.seeds - 1}.",
             "", f"| problem | schedule | objective after 10 / 25 / 50 / {args.steps} steps (median; worst seed at the end) | "
             f"steps to the thesis's {args.steps}-step objective | largest objective increase (ratio) | time / step | "
             "CPU time / step | threads busy | time / step vs thesis |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, prob in probs.items():
        res: dict[str, list[dict[str, Any]]] = {s: [] for s in SCHEDULES}
        for seed in range(args.seeds):
            order = SCHEDULES[seed % len(SCHEDULES):] + SCHEDULES[:seed % len(SCHEDULES)]
            for sch in order:
                res[sch].append(run(prob, sch, seed, args.steps))
            loads.append(os.getloadavg()[0])
        opt_value = [newton_optimum(prob, s) for s in range(args.seeds)] if name.startswith("logistic") else None
        targets = [r["curve"][-1] for r in res["thesis"]]
        for sch in SCHEDULES:
            runs = res[sch]

            def at(i: int, runs: list[dict[str, Any]] = runs) -> float:
                return statistics.median(r["curve"][min(i, len(r["curve"]) - 1)] for r in runs)

            worst = max(r["curve"][-1] for r in runs)
            hits = [next((i for i, v in enumerate(r["curve"]) if v <= t), None) for r, t in zip(runs, targets)]
            hit = statistics.median(h if h is not None else math.inf for h in hits)
            jump = max(max((b / a for a, b in zip(r["curve"], r["curve"][1:]) if a > 0), default=1.0) for r in runs)
            ratio = statistics.median(r["time_per_step"] / t["time_per_step"] for r, t in zip(runs, res["thesis"]))
            cpu = cpu_fields([r["time_per_step"] for r in runs], [r["cpu_per_step"] for r in runs])
            wall = statistics.median(r["time_per_step"] for r in runs)
            extra = ""
            if opt_value is not None:
                gaps = [next((i for i, v in enumerate(r["curve"]) if (v - o) <= 1e-8 * abs(o)), None)
                        for r, o in zip(runs, opt_value)]
                extra = "; to a 1e-8 gap: " + ", ".join("-" if g is None else str(g) for g in gaps)
            lines.append(f"| {name} | {sch} | {at(10):.4g} / {at(25):.4g} / {at(50):.4g} / {at(args.steps):.4g} "
                         f"(worst {worst:.4g}) | {'not reached' if math.isinf(hit) else f'{hit:g}'}{extra} | "
                         f"{jump:.3g} | {fmt_seconds(wall)} | {fmt_seconds(cpu['cpu_s'])} | "
                         f"{fmt_busy(cpu['threads_busy'])} | {ratio:.2f}x |")
        print(f"{name}: done ({time.time() - t_start:.0f} s)", flush=True)
    lines += ["", f"Load average (1 min) during the run: {min(loads):.1f} to {max(loads):.1f} (shared machine); "
              f"total {time.time() - t_start:.0f} s.", ""]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
