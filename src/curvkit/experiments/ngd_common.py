"""Shared machinery of the NGD-vs-SGD experiments (Saghir et al. 2024, Sec. 3 and App. A): data per scale,
one training run with per-epoch λ̂ / Tr(H) / losses / update norms, checkpointing after every epoch (a rerun
resumes and gives the same result), and report helpers. Registers nothing itself.

Protocol (the paper's Sec. 2 and captions; where they are silent, the authors' code): MLP Flatten ->
[Linear(h), ReLU] x L -> Linear(10), PyTorch default init, CE loss, batch 128, both optimisers with Nesterov
momentum 0.9, no weight decay. NGD = Kaldi online NG (:class:`curvkit.optim.KaldiNGD`, eta 0.9, delta 5e-4,
update period 4). λ̂: SGLD ε = 1e-4, γ = 100, nβ = m/ln m, burn-in 0, minibatch init loss. Tr(H): Rademacher
Hutchinson on a *fixed* seeded subset of 1,280 training points (the paper's App. B says Gaussian probes; the
authors' code used Rademacher probes on 1,280 points drawn afresh at every checkpoint; the fixed subset is our
choice and removes that resampling noise). The data order has its own generator per seed, shared by the
optimisers (our choice; the authors' code does not seed it, so their SGD and NGD runs saw different orders).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from curvkit import checkpoint
from curvkit.likelihoods import CrossEntropy
from curvkit.models import mlp
from curvkit.optim.kaldi_ngd import KaldiNGD
from curvkit.slt import SGLDConfig, estimate_llc, hessian_trace_estimate

SMOKE_NOTE = ("**Smoke scale is a plumbing check** (CI-sized: synthetic blobs, tiny networks, short chains); "
              "its numbers test that the pipeline runs end to end, not the paper's claims.")

@dataclass(frozen=True)
class Measure:
    """What to measure and how often."""

    llc_chains: int = 2
    llc_draws: int = 1000
    llc_epochs: tuple[int, ...] | None = None  # None = every epoch
    trace_probes: int = 100
    trace_points: int = 1280
    trace_epochs: tuple[int, ...] | None = ()  # None = every epoch, () = never
    sgld_epsilon: float = 1e-4
    sgld_gamma: float = 100.0


@dataclass(frozen=True)
class RunSpec:
    """One training run. ``optimizer`` is 'sgd' or 'ngd'; with ``switch_epoch`` = K the run trains with
    SGD at ``lr_before`` for epochs 1..K and with ``optimizer`` at ``lr`` afterwards (paper Sec. 3.3)."""

    name: str
    hidden: int
    layers: int
    optimizer: str
    lr: float = 1e-2
    alpha: float = 0.1
    epsilon: float = 1e-10
    epochs: int = 20
    seed: int = 1
    batch_size: int = 128
    switch_epoch: int | None = None
    lr_before: float = 1e-2


@dataclass
class Data:
    X: Tensor
    y: Tensor
    Xte: Tensor
    yte: Tensor
    name: str
    extra: dict[str, Any] = field(default_factory=dict)


def load_data(scale: str, dataset: str = "mnist", seed: int = 0) -> Data:
    """smoke: synthetic 10-class Gaussian blobs (32-d, 2,000 train / 1,000 test; always available).
    medium/paper: MNIST (bundled) or Fashion-MNIST (user files via CURVKIT_FASHION_MNIST_DIR), flattened,
    normalised as the authors' code does ((0.1307, 0.3081) for MNIST, (0.5, 0.5) for Fashion-MNIST)."""
    if scale == "smoke":
        from curvkit.data.synthetic import classification

        X, y = classification(3000, 32, 10, seed=seed, dtype=torch.float32, separation=3.0)
        return Data(X[:2000], y[:2000], X[2000:], y[2000:], "synthetic-blobs-32d")
    import curvkit.data as cd

    if dataset == "fashion_mnist":
        root = os.environ.get("CURVKIT_FASHION_MNIST_DIR")
        Xtr, ytr = cd.fashion_mnist(train=True, root=root)
        Xte, yte = cd.fashion_mnist(train=False, root=root)
        mean, std = 0.5, 0.5
    else:
        Xtr, ytr = cd.mnist(train=True)
        Xte, yte = cd.mnist(train=False)
        mean, std = 0.1307, 0.3081

    from curvkit.data.transforms import image_vectors

    return Data(image_vectors(Xtr, mean=mean, std=std), ytr, image_vectors(Xte, mean=mean, std=std), yte, dataset)


def build_model(spec: RunSpec, in_dim: int) -> nn.Module:
    torch.manual_seed(spec.seed)
    return mlp([in_dim] + [spec.hidden] * spec.layers + [10], "relu")


def make_optimizer(kind: str, model: nn.Module, lr: float, alpha: float, epsilon: float) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
    if kind == "ngd":
        return KaldiNGD(model.parameters(), lr=lr, alpha=alpha, epsilon=epsilon, eta=0.9, delta=5e-4,
                        update_period=4, momentum=0.9, nesterov=True)
    raise ValueError(f"optimizer must be 'sgd' or 'ngd', got {kind!r}")


@torch.no_grad()
def _full_loss(model: nn.Module, X: Tensor, y: Tensor, chunk: int = 10000) -> float:
    tot = 0.0
    for s in range(0, X.shape[0], chunk):
        tot += float(nn.functional.cross_entropy(model(X[s:s + chunk]), y[s:s + chunk], reduction="sum"))
    return tot / X.shape[0]


def measure_epoch(model: nn.Module, data: Data, spec: RunSpec, measure: Measure, epoch: int) -> dict[str, Any]:
    rec: dict[str, Any] = {"epoch": epoch, "val_loss": _full_loss(model, data.Xte, data.yte)}
    if measure.llc_epochs is None or epoch in measure.llc_epochs:
        cfg = SGLDConfig(epsilon=measure.sgld_epsilon, gamma=measure.sgld_gamma, nbeta="m/log m",
                         num_chains=measure.llc_chains, num_draws=measure.llc_draws)
        r = estimate_llc(model, (data.X, data.y), batch_size=spec.batch_size, config=cfg,
                         seed=10_000 * spec.seed + epoch)
        rec.update(llc=r.llc_mean, llc_std=r.llc_std, wbic=r.wbic, nbeta=r.nbeta, llc_rhat=r.rhat)
    if measure.trace_epochs is None or epoch in measure.trace_epochs:
        g = torch.Generator().manual_seed(spec.seed)
        idx = torch.randperm(data.X.shape[0], generator=g)[: measure.trace_points]
        est = hessian_trace_estimate(model, CrossEntropy(), (data.X[idx], data.y[idx]), num_probes=measure.trace_probes,
                            generator=torch.Generator().manual_seed(epoch))
        rec.update(trace_h=est.value, trace_h_stderr=est.stderr)
    return rec


def train_run(spec: RunSpec, data: Data, measure: Measure, ckpt_dir: Path) -> list[dict[str, Any]]:
    """Train, measuring after every epoch; checkpoint ``ckpt_dir/<name>.pt`` after every epoch and resume."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"{spec.name}.pt"
    model = build_model(spec, data.X.shape[1])
    data_gen = torch.Generator().manual_seed(spec.seed)
    switch = spec.switch_epoch or 0

    def opt_for(epoch: int) -> tuple[str, torch.optim.Optimizer]:
        """(phase label, optimiser) of an epoch. The label names optimiser AND learning rate, so a switch
        from SGD to SGD at another learning rate also replaces the optimiser."""
        if epoch <= switch:
            return f"sgd@{spec.lr_before:g}", make_optimizer("sgd", model, spec.lr_before, spec.alpha, spec.epsilon)
        return (f"{spec.optimizer}@{spec.lr:g}",
                make_optimizer(spec.optimizer, model, spec.lr, spec.alpha, spec.epsilon))

    phase, opt = opt_for(1)
    records: list[dict[str, Any]] = []
    start = 1
    if path.exists():
        ck = checkpoint.load(path)
        if ck["spec"] != asdict(spec):
            raise ValueError(f"checkpoint {path} was written for a different run spec; delete it or use another --out")
        model.load_state_dict(ck["model"])
        phase, opt = opt_for(ck["epoch"] + 1)
        if ck["phase"] == phase:
            opt.load_state_dict(ck["opt"])
        data_gen.set_state(ck["gen"])
        records, start = ck["records"], ck["epoch"] + 1
    else:
        rec0 = measure_epoch(model, data, spec, replace(measure, llc_epochs=(), trace_epochs=()), 0)
        rec0["train_loss"] = _full_loss(model, data.X, data.y)
        records.append(rec0)
    for epoch in range(start, spec.epochs + 1):
        new_phase, new_opt = opt_for(epoch)
        if new_phase != phase:
            phase, opt = new_phase, new_opt
        losses, norms = [], []
        for xb, yb in _batches(data.X, data.y, spec.batch_size, data_gen):
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            norms.append(sum(float((p.detach() - b).norm()) for p, b in zip(model.parameters(), before)))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"run {spec.name}: training loss became {losses[-1]} at epoch {epoch}")
        rec = measure_epoch(model, data, spec, measure, epoch)
        rec.update(train_loss=sum(losses) / len(losses), update_norm=sum(norms) / len(norms), phase=phase)
        records.append(rec)
        checkpoint.save({"spec": asdict(spec), "epoch": epoch, "model": model.state_dict(), "opt": opt.state_dict(),
                    "phase": phase, "gen": data_gen.get_state(), "records": records}, path)
    return records


def _batches(X: Tensor, y: Tensor, m: int, gen: torch.Generator) -> Any:
    perm = torch.randperm(X.shape[0], generator=gen)
    for s in range(0, X.shape[0], m):
        idx = perm[s:s + m]
        yield X[idx], y[idx]


def welch_one_sided(sgd: Sequence[float], ngd: Sequence[float]) -> dict[str, float]:
    """One-sided Welch t-test of mean(SGD) < mean(NGD) (the authors' test), plus the two-sided p."""
    from scipy import stats

    if len(sgd) < 2 or len(ngd) < 2:
        return {"t": math.nan, "p_one_sided": math.nan, "p_two_sided": math.nan}
    one = stats.ttest_ind(sgd, ngd, equal_var=False, alternative="less")
    two = stats.ttest_ind(sgd, ngd, equal_var=False)
    return {"t": float(one.statistic), "p_one_sided": float(one.pvalue), "p_two_sided": float(two.pvalue)}


def mean_std(v: Sequence[float]) -> tuple[float, float]:
    t = torch.tensor(list(v), dtype=torch.float64)
    return float(t.mean()), float(t.std(unbiased=False)) if t.numel() > 1 else 0.0


def plot_series(path: Path, series: dict[str, list[tuple[int, float]]], ylabel: str, title: str) -> Path:
    from curvkit.experiments._report import new_figure, save_figure

    fig, axes = new_figure()
    ax = axes[0][0]
    for label, pts in series.items():
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", ms=3, label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, path)
