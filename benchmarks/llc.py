"""Benchmark: LLC estimation with vectorised SGLD chains vs devinterp, same settings, same run.

Settings (issue 5, section 5): MNIST (bundled, 60,000 points), 2-hidden-layer 256-unit ReLU MLP trained
for one SGD epoch, 4 chains x 1000 draws, batch m = 128, ε = 1e-4, γ = 100, nβ = m/ln m, burn-in 0.

Arms (run interleaved, ``--repeats`` times, each repeat with its own seed):

* ``devinterp`` - ``devinterp.slt.llc.llc`` (v2 API, 2.0.1), chains one after another. Its defaults are
  kept: every chain reads the *same* minibatch sequence (``match_sampling_input_ids_across_chains``),
  the batches of one shuffled epoch are replayed (``epoch_mode="cycle"``), and its L(w*) is the mean
  over its first 32 batches (``num_init_loss_batches``). The MLP is fed to its token-oriented API as
  "sequences" [index, 0] with a per-example loss. Needs a venv with devinterp (see below).
* ``shared`` - :func:`curvkit.slt.estimate_llc` with ``shared_batches=True``: all chains read the same
  minibatches, as devinterp does (the like-for-like arm).
* ``independent`` - :func:`curvkit.slt.estimate_llc` with its default: every chain its own minibatches.
* ``vmap`` (opt-in) - the shared arm with ``vectorise="vmap"`` (the generic path, no MLP fast path).
* ``sequential`` (opt-in) - our own loop: one chain after another with :class:`curvkit.optim.SGLD`.

Parity: every arm's λ̂ is computed with the *same* reference loss L(w*) = L_n(w*), the full-data loss at
w* (``estimate_llc(..., init_loss=...)``, computed inside each of our timed arms, as devinterp's time
includes its own L(w*); for devinterp from its per-step ``loss_trace``:
λ̂_c = nβ (mean_t ℓ_{c,t} - L_n(w*))). devinterp's own number (its 32-batch L(w*)) is printed as well.
Differences to devinterp are printed in units of the combined standard error
sqrt(se_a² + se_b²), se = std over chains (ddof 1) / sqrt(C).

Timing: wall-clock and process CPU time of each arm (CPU time is less affected by a machine shared with
other jobs); the load average is printed before and after every arm. Speed-ups are the median over
repeats of the paired (same repeat) ratios. Usage:
``PYTHONPATH=src /path/to/devinterp-venv/bin/python benchmarks/llc.py [--draws 1000] [--chains 4]
[--threads 1] [--repeats 3] [--arms devinterp,shared,independent]``. Without devinterp installed the
devinterp arm is skipped and the table says so. ``--threads`` (default 1) sets torch's thread count for
all arms.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import curvkit.data as cd
from _common import require_library
from curvkit.models import mlp
from curvkit.optim.sgld import SGLD
from curvkit.slt import SGLDConfig, estimate_llc

EPS, GAMMA, M = 1e-4, 100.0, 128


def load(n_train: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    X, y = cd.mnist(train=True)
    X = ((X.reshape(X.shape[0], -1).float() / 255.0) - 0.1307) / 0.3081
    return (X, y) if n_train is None else (X[:n_train], y[:n_train])


def trained_model(X: torch.Tensor, y: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    model = mlp([784, 256, 256, 10], "relu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(X.shape[0], generator=g)
    for s in range(0, X.shape[0], M):
        idx = perm[s:s + M]
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()
    return model


@dataclass
class Outcome:
    per_chain: torch.Tensor  # λ̂_c with the shared L_n(w*)
    own: float | None = None  # the implementation's own λ̂ (its own L(w*)), where it differs

    @property
    def mean(self) -> float:
        return float(self.per_chain.mean())

    @property
    def se(self) -> float:
        return float(self.per_chain.std(unbiased=True)) / math.sqrt(self.per_chain.numel())


def ours(model: nn.Module, X: torch.Tensor, y: torch.Tensor, chains: int, draws: int, seed: int, ref: float,
         shared: bool, vectorise: str = "auto") -> Outcome:
    cfg = SGLDConfig(epsilon=EPS, gamma=GAMMA, nbeta="m/log m", num_chains=chains, num_draws=draws,
                     shared_batches=shared)
    own_ref = full_loss(model, X, y)[0]  # recomputed inside the timed arm (devinterp's time has its L(w*))
    assert own_ref == ref or X.shape[0] != 60000
    res = estimate_llc(model, (X, y), batch_size=M, config=cfg, seed=seed, init_loss=own_ref, vectorise=vectorise)
    return Outcome(res.llc_per_chain)


def sequential(model: nn.Module, X: torch.Tensor, y: torch.Tensor, chains: int, draws: int, seed: int,
               ref: float) -> Outcome:
    nbeta = M / math.log(M)
    gen = torch.Generator().manual_seed(seed)
    n = X.shape[0]
    per_chain = []
    for _ in range(chains):
        net = copy.deepcopy(model)
        opt = SGLD(net.parameters(), lr=EPS, nbeta=nbeta, localization=GAMMA, generator=gen)
        losses, perm, pos = [], torch.randperm(n, generator=gen), 0
        for _ in range(draws):
            if pos + M > n:
                perm, pos = torch.randperm(n, generator=gen), 0
            idx = perm[pos:pos + M]
            pos += M
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(X[idx]), y[idx])
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        per_chain.append(nbeta * (float(torch.stack(losses).double().mean()) - ref))
    return Outcome(torch.tensor(per_chain, dtype=torch.float64))


def devinterp_llc(model: nn.Module, X: torch.Tensor, y: torch.Tensor, chains: int, draws: int, seed: int,
                  ref: float) -> Outcome:
    """devinterp >= 2.0 (``devinterp.slt.llc.llc``): its sampler expects an HF dataset of token ids and a
    per-token loss, so each example is the "sequence" [index, 0] and the loss looks the example up."""
    import sys
    import warnings

    # transformers (imported by devinterp) imports torchvision when present; PyPI's torchvision wheel does
    # not match the CPU build of torch here, so hide it (devinterp does not need it).
    sys.modules.setdefault("torchvision", None)  # type: ignore[arg-type]
    from datasets import Dataset
    from devinterp.slt.llc import llc

    ds = Dataset.from_dict({"input_ids": [[i, 0] for i in range(X.shape[0])]}).with_format("torch")

    def loss_fn(net: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        idx = input_ids[:, 0]
        return nn.functional.cross_entropy(net(X[idx]), y[idx], reduction="none")[:, None]

    nbeta = M / math.log(M)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = llc(copy.deepcopy(model), ds, {}, lr=EPS, n_beta=nbeta, loss_fn=loss_fn, num_chains=chains,
                  num_draws=draws, batch_size=M, localization=GAMMA, init_seed=seed, device="cpu")
    trace = torch.as_tensor(out.loss_trace.values, dtype=torch.float64)  # (chain, step), pre-update losses
    return Outcome(nbeta * (trace.mean(dim=1) - ref), own=float(out.llc_mean))


def full_loss(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """L_n(w*) (float64 mean of the per-example losses) and the per-example loss standard deviation."""
    with torch.no_grad():
        per = nn.functional.cross_entropy(model(X), y, reduction="none").double()
    return float(per.mean()), float(per.std())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=1000)
    ap.add_argument("--chains", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default="devinterp,shared,independent",
                    help="comma-separated subset of devinterp,shared,independent,vmap,sequential")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(arms) - {"devinterp", "shared", "independent", "vmap", "sequential"}
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}")
    note = "devinterp 2.0.1 (devinterp.slt.llc.llc), same model, data and settings"
    if "devinterp" in arms and not require_library("devinterp", "devinterp", "benchmarks/llc.py", optional=True):
        arms.remove("devinterp")
        note = ("devinterp is not installed in this environment: its arm is skipped (run from a venv with "
                "devinterp, PYTHONPATH=src)")
    X, y = load()
    model = trained_model(X, y)
    ref, loss_std = full_loss(model, X, y)
    nbeta = M / math.log(M)
    C, T = args.chains, args.draws
    runners: dict[str, Callable[[int], Outcome]] = {
        "devinterp": lambda r: devinterp_llc(model, X, y, C, T, 100 + r, ref),
        "shared": lambda r: ours(model, X, y, C, T, r, ref, shared=True),
        "independent": lambda r: ours(model, X, y, C, T, r, ref, shared=False),
        "vmap": lambda r: ours(model, X, y, C, T, r, ref, shared=True, vectorise="vmap"),
        "sequential": lambda r: sequential(model, X, y, C, T, 1000 + r, ref),
    }
    ours(model, X[:1024], y[:1024], C, 5, 0, full_loss(model, X[:1024], y[:1024])[0], shared=True)  # warm-up
    wall: dict[str, list[float]] = {a: [] for a in arms}
    cpu: dict[str, list[float]] = {a: [] for a in arms}
    est: dict[str, list[Outcome]] = {a: [] for a in arms}
    loads: list[float] = []
    for r in range(args.repeats):
        for a in arms:
            loads.append(os.getloadavg()[0])
            w0, c0 = time.perf_counter(), time.process_time()
            o = runners[a](r)
            wall[a].append(time.perf_counter() - w0)
            cpu[a].append(time.process_time() - c0)
            est[a].append(o)
            own = f" (own L(w*): {o.own:.2f})" if o.own is not None else ""
            print(f"repeat {r} {a}: {wall[a][-1]:.1f} s wall, {cpu[a][-1]:.1f} s CPU, "
                  f"λ̂ {o.mean:.2f} ± {o.se:.2f} (se){own}; load {loads[-1]:.2f}", flush=True)
    loads.append(os.getloadavg()[0])

    base = "devinterp" if "devinterp" in arms else arms[0]
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, torch threads {torch.get_num_threads()}; {C} chains x {T} draws, batch {M}, "
          f"eps {EPS:g}, gamma {GAMMA:g}, nbeta {nbeta:.2f}, 2HL-256 ReLU MLP (d = 269,322), MNIST n = 60,000; "
          f"{args.repeats} interleaved repeats; 1-min load average during the run: "
          f"{min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f})")
    print(f"note: {note}")
    print(f"L_n(w*) = {ref:.5f} (per-example loss std {loss_std:.3f}): the reference loss of every λ̂ below\n")
    print(f"| arm | wall s (median) | CPU s (median) | ms per chain-step (CPU) | {base} / arm, wall | "
          f"{base} / arm, CPU | λ̂ per repeat (mean ± se) | Δ vs {base} in combined se, per repeat |")
    print("|---|---|---|---|---|---|---|---|")
    for a in arms:
        sp_w = statistics.median(wall[base][r] / wall[a][r] for r in range(args.repeats))
        sp_c = statistics.median(cpu[base][r] / cpu[a][r] for r in range(args.repeats))
        ests = "; ".join(f"{o.mean:.2f} ± {o.se:.2f}" for o in est[a])
        if a == base:
            owns = [o.own for o in est[a] if o.own is not None]
            dz = "-" if not owns else "own L(w*): " + "; ".join(f"{v:.2f}" for v in owns)
        else:
            dz = "; ".join(
                f"{(o.mean - b.mean) / math.sqrt(o.se ** 2 + b.se ** 2):+.2f}" for o, b in zip(est[a], est[base]))
        print(f"| {a} | {statistics.median(wall[a]):.1f} | {statistics.median(cpu[a]):.1f} | "
              f"{1e3 * statistics.median(cpu[a]) / (C * T):.2f} | {sp_w:.2f}x | {sp_c:.2f}x | {ests} | {dz} |")
    pooled = {a: torch.cat([o.per_chain for o in est[a]]) for a in arms}
    print(f"\npooled over repeats ({args.repeats * C} chains per arm): "
          + "; ".join(f"{a} {float(p.mean()):.2f} ± {float(p.std()) / math.sqrt(p.numel()):.2f}"
                      for a, p in pooled.items()))
    for a in arms:
        if a != base:
            pa, pb = pooled[a], pooled[base]
            se = math.sqrt(float(pa.var()) / pa.numel() + float(pb.var()) / pb.numel())
            print(f"pooled difference {a} - {base}: {float(pa.mean() - pb.mean()):+.2f} = "
                  f"{float(pa.mean() - pb.mean()) / se:+.2f} combined se")
    print(f"error of a minibatch L(w*) (shared by all chains of a run): nβ·std/sqrt(k·m) = "
          f"{nbeta * loss_std / math.sqrt(C * M):.2f} for k = {C} batches, "
          f"{nbeta * loss_std / math.sqrt(32 * M):.2f} for devinterp's k = 32")


if __name__ == "__main__":
    main()
