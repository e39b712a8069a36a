"""Benchmark: LLC estimation with vectorised SGLD chains vs a sequential chain loop (and devinterp when it
is importable), same settings, same run.

Settings (issue 5, section 5): MNIST (bundled), 2-hidden-layer 256-unit ReLU MLP trained for one SGD epoch,
4 chains x 1000 draws, batch 128, ε = 1e-4, γ = 100, nβ = m/ln m, burn-in 0.

* ``vectorised`` - :func:`curvkit.slt.estimate_llc` (all chains in one vmap'd step).
* ``sequential`` - the same estimator written the usual way: one chain after another, each with its own
  model copy, ``loss.backward()`` and the :class:`curvkit.optim.SGLD` optimiser (this is how devinterp
  runs chains when ``cores=1``).
* ``devinterp`` - only if ``import devinterp`` works and exposes the v1 API
  ``estimate_learning_coeff_with_summary``; otherwise the row is omitted and the table says so.

Prints a markdown table with times, time per SGLD step of one chain, speed-up over the sequential loop
and the estimates (mean ± std over chains). Usage:
``python benchmarks/llc.py [--draws 1000] [--chains 4] [--threads 1] [--repeats 1] [--no-devinterp]``.
Runs with the project venv alone (devinterp absent: the table compares against our sequential loop and
says so) or, for the devinterp row, from a venv that has devinterp: ``PYTHONPATH=src /path/to/venv/bin/python
benchmarks/llc.py``. ``--threads`` defaults to 1: on a shared machine several torch threads per process
oversubscribe the cores and make every arm many times slower and noisier (the cause of the earlier
104 s / 277 s measurements for 100 draws, see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import platform
import time

import torch
from torch import nn

import curvkit.data as cd
from curvkit.models import mlp
from curvkit.optim.sgld import SGLD
from curvkit.slt import SGLDConfig, estimate_llc


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
    for s in range(0, X.shape[0], 128):
        idx = perm[s:s + 128]
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()
    return model


def sequential(model: nn.Module, X: torch.Tensor, y: torch.Tensor, chains: int, draws: int, m: int, eps: float,
               gamma: float, seed: int) -> tuple[float, float]:
    nbeta = m / math.log(m)
    gen = torch.Generator().manual_seed(seed)
    n = X.shape[0]
    first = [torch.randperm(n, generator=gen)[:m] for _ in range(chains)]
    with torch.no_grad():
        init = sum(float(nn.functional.cross_entropy(model(X[i]), y[i])) for i in first) / chains
    per_chain = []
    for _ in range(chains):
        net = copy.deepcopy(model)
        opt = SGLD(net.parameters(), lr=eps, nbeta=nbeta, localization=gamma, generator=gen)
        losses, perm, pos = [], torch.randperm(n, generator=gen), 0
        for _ in range(draws):
            if pos + m > n:
                perm, pos = torch.randperm(n, generator=gen), 0
            idx = perm[pos:pos + m]
            pos += m
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(X[idx]), y[idx])
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        per_chain.append(nbeta * (sum(losses) / len(losses) - init))
    t = torch.tensor(per_chain)
    return float(t.mean()), float(t.std())


def devinterp_llc(model: nn.Module, X: torch.Tensor, y: torch.Tensor, chains: int, draws: int, m: int, eps: float,
                  gamma: float, seed: int) -> tuple[float, float]:
    """devinterp >= 2.0 (``devinterp.slt.llc.llc``): its sampler expects an HF dataset of token ids and a
    per-token loss, so each example is the "sequence" [index, 0] and the loss looks the example up."""
    import sys

    # transformers (imported by devinterp) imports torchvision when present; PyPI's torchvision wheel does
    # not match the CPU build of torch here, so hide it (devinterp does not need it).
    sys.modules.setdefault("torchvision", None)  # type: ignore[arg-type]
    from datasets import Dataset
    from devinterp.slt.llc import llc

    ds = Dataset.from_dict({"input_ids": [[i, 0] for i in range(X.shape[0])]}).with_format("torch")

    def loss_fn(net: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        idx = input_ids[:, 0]
        return nn.functional.cross_entropy(net(X[idx]), y[idx], reduction="none")[:, None]

    out = llc(copy.deepcopy(model), ds, {}, lr=eps, n_beta=m / math.log(m), loss_fn=loss_fn, num_chains=chains,
              num_draws=draws, batch_size=m, localization=gamma, init_seed=seed, device="cpu")
    return float(out.llc_mean), float(out.llc_std)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=1000)
    ap.add_argument("--chains", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-devinterp", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    X, y = load()
    model = trained_model(X, y)
    cfg = SGLDConfig(epsilon=1e-4, gamma=100.0, nbeta="m/log m", num_chains=args.chains, num_draws=args.draws)
    rows = []
    t_vec, t_seq = [], []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        res = estimate_llc(model, (X, y), batch_size=128, config=cfg, seed=r)
        t_vec.append(time.perf_counter() - t0)
        print(f"vectorised: {t_vec[-1]:.1f} s, llc {res.llc_mean:.2f} ± {res.llc_std:.2f}", flush=True)
        t0 = time.perf_counter()
        seq = sequential(model, X, y, args.chains, args.draws, 128, 1e-4, 100.0, seed=100 + r)
        t_seq.append(time.perf_counter() - t0)
        print(f"sequential: {t_seq[-1]:.1f} s, llc {seq[0]:.2f} ± {seq[1]:.2f}", flush=True)
    tv, ts = min(t_vec), min(t_seq)
    rows.append(("sequential chains (curvkit SGLD optimiser, baseline)", ts, 1.0, f"{seq[0]:.2f} ± {seq[1]:.2f}"))
    rows.append(("vectorised chains (curvkit.slt.estimate_llc)", tv, ts / tv,
                 f"{res.llc_mean:.2f} ± {res.llc_std:.2f}"))
    note = "devinterp row: devinterp.slt.llc.llc (v2 API), same model, data and settings"
    if args.no_devinterp:
        note = "devinterp skipped (--no-devinterp); baseline = our own sequential loop"
    elif importlib.util.find_spec("devinterp") is None:
        note = ("devinterp is not installed in this environment; baseline = our own sequential loop "
                "(run from a venv with devinterp, PYTHONPATH=src, for the devinterp row)")
    else:
        try:
            t0 = time.perf_counter()
            dv = devinterp_llc(model, X, y, args.chains, args.draws, 128, 1e-4, 100.0, seed=0)
            t_dv = time.perf_counter() - t0
            print(f"devinterp: {t_dv:.1f} s, llc {dv[0]:.2f} ± {dv[1]:.2f}", flush=True)
            rows.append(("devinterp (sequential chains)", t_dv, ts / t_dv, f"{dv[0]:.2f} ± {dv[1]:.2f}"))
        except Exception as err:
            note = f"devinterp not available ({type(err).__name__}: {err}); baseline = our own sequential loop"
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}; {args.chains} chains x {args.draws} draws, batch 128, "
          f"2HL-256 MLP (d = 269,322), MNIST; best of {args.repeats}")
    print(f"note: {note}\n")
    print("| method | seconds | ms per chain-step | speed-up vs sequential | λ̂ (mean ± std over chains) |")
    print("|---|---|---|---|---|")
    for name, sec, sp, est in rows:
        print(f"| {name} | {sec:.1f} | {1e3 * sec / (args.chains * args.draws):.2f} | {sp:.2f}x | {est} |")
    for name, sec, _, est in rows:
        if name.startswith("devinterp"):
            print(f"\nvectorised vs devinterp: {sec / tv:.2f}x faster (devinterp {est})")
    se = math.sqrt((res.llc_std**2 + seq[1] ** 2) / args.chains)
    print(f"\n|difference of means| = {abs(res.llc_mean - seq[0]):.2f}; combined standard error = {se:.2f} "
          "(over chains only: each arm's L(w*) is the mean of its own first minibatches, an error shared by "
          "all its chains and not in this standard error; short runs also still carry the transient from w*)")


if __name__ == "__main__":
    main()
