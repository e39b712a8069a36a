"""Experiment ``filtering-vs-adam``: the Bayesian-filtering optimisers (Aitchison 2018) against SGD(+momentum),
Adam, AdamW and RMSprop. The paper has no experiments (it leaves them to future work); this is curvkit's own
demonstration.

Tasks:

* ``drift``: linear-Gaussian regression whose true weights follow a random walk, w*(t+1) = w*(t) + tau xi (sd
  ``tau`` per step, d = 10), y = x^T w* + N(0, s^2), minibatches of 16 fresh points. The dense Kalman filter
  (Sec. 2.1, Eqs. 1-7) with the true drift is the exact Bayes filter here; the factorised and Kronecker
  filters use eta = tau and the exact Fisher samples x/s. The baselines use the hyperparameters the filters
  map to (:mod:`curvkit.optim.filters.mapping`): Adam/AdamW/RMSprop lr = eta, SGD lr = the filter's
  steady-state effective rate B eta / sqrt(E[e^2]) = 0.04 (SGD+momentum 0.004 with momentum 0.9: the same
  steady rate). Metric: tracking error ||w - w*||^2 of the evaluated (posterior) mean.
* ``mnist``: the bundled MNIST (to_unit + flatten), MLP 784-h-10 (ReLU), cross-entropy with mean reduction;
  library defaults: filters eta = 1e-3 (the Adam lr), lr_sgd = 0.1 (s0 = lr_sgd / B), empirical Fisher;
  SGD 0.1, SGD+momentum 0.01/0.9, Adam/RMSprop 1e-3, AdamW 1e-3 with weight decay 1e-2. Metrics: minibatch
  training loss per step, test accuracy during and after training (filters at their posterior mean).

Effective learning rate (both tasks): the median over the first layer's weights of the SGD step size on the
mean loss that moves a weight as far as the optimiser does in its steady state: filters ``effective_lr()``
(posterior variance, or the momentum filters' steady gain, times B); Adam/AdamW lr/(sqrt(v_hat)+eps) (its
momentum averages g without amplifying it); RMSprop lr/(sqrt(v)+eps); SGD lr; SGD+momentum lr/(1-momentum).
The filters also report their regime (SGD-like vs Adam-like, :func:`curvkit.optim.filters.regime`; not in
this version of the paper) at the end of training.

A run that produces a non-finite loss, or a gradient a filter refuses, is recorded as diverged (with the step)
and reported, not hidden. Each (task, optimiser, seed) run is saved to ``out/runs/*.json`` as soon as it
finishes; a rerun with the same configuration reuses them (resume after interruption, same result).

Scales: ``smoke`` (MNIST subset, 3 seeds, one torch thread: the models are tiny and one thread avoids
OpenMP spin-waiting on a shared machine; about one minute of CPU) and ``medium`` (full MNIST, MLP 784-256-10,
3 seeds, 3 epochs, torch's default threads; roughly 10-20 minutes on 2 cores).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from curvkit.checkpoint import write_text
from curvkit.experiments._report import (
    machine_info,
    markdown_table,
    new_figure,
    save_figure,
    to_jsonable,
    torch_threads,
    write_json,
)
from curvkit.experiments.registry import register
from curvkit.optim.filters import (
    BFAdam,
    BFAdamSS,
    BFNatGrad,
    BFRMSProp,
    BFRMSPropSS,
    DenseKalmanFilter,
    KFBayes,
    KFWhiten,
)

SCALES: dict[str, dict[str, Any]] = {
    "smoke": {"seeds": 3, "drift_steps": 300, "mnist_train": 8000, "mnist_test": 2000, "hidden": 64,
              "mnist_steps": 300, "batch": 64, "eval_every": 75, "threads": 1},
    "medium": {"seeds": 3, "drift_steps": 3000, "mnist_train": 60000, "mnist_test": 10000, "hidden": 256,
               "mnist_steps": 2811, "batch": 64, "eval_every": 469, "threads": None},   # 3 epochs of 937 batches
}
BASELINES = ("SGD", "SGD+momentum", "Adam", "AdamW", "RMSprop")
FILTERS = ("BFNatGrad", "BFRMSProp", "BFRMSPropSS", "BFAdam", "BFAdamSS", "KFBayes", "KFWhiten")
DRIFT = (*BASELINES, *FILTERS, "DenseKalman")
MNIST = (*BASELINES, *FILTERS)
DRIFT_D, DRIFT_B, DRIFT_TAU, DRIFT_S = 10, 16, 0.02, 0.5


def _make_opt(name: str, model: nn.Module, B: int, drift: bool) -> Any:
    """The optimisers with the settings described in the module docstring."""
    eta = DRIFT_TAU if drift else 1e-3
    fisher = "given" if drift else "empirical"
    ps = model.parameters
    table: dict[str, Callable[[], Any]] = {
        "SGD": lambda: torch.optim.SGD(ps(), lr=0.04 if drift else 0.1),
        "SGD+momentum": lambda: torch.optim.SGD(ps(), lr=0.004 if drift else 0.01, momentum=0.9),
        "Adam": lambda: torch.optim.Adam(ps(), lr=eta),
        "AdamW": lambda: torch.optim.AdamW(ps(), lr=eta, weight_decay=1e-2),
        "RMSprop": lambda: torch.optim.RMSprop(ps(), lr=eta),
        "BFNatGrad": lambda: BFNatGrad(model.named_parameters(), batch_size=B, curvature=fisher),
        "BFRMSProp": lambda: BFRMSProp(model.named_parameters(), lr=eta, batch_size=B, curvature=fisher),
        "BFRMSPropSS": lambda: BFRMSPropSS(model.named_parameters(), lr=eta, batch_size=B, curvature=fisher),
        "BFAdam": lambda: BFAdam(model.named_parameters(), lr=eta, batch_size=B, curvature=fisher),
        "BFAdamSS": lambda: BFAdamSS(model.named_parameters(), lr=eta, batch_size=B, curvature=fisher),
        "KFBayes": lambda: KFBayes(model.parameters(), model=model, lr=eta, batch_size=B, sample_update="batched", fisher_samples=None,
                                   inv_every=20),
        "KFWhiten": lambda: KFWhiten(model.parameters(), model=model, lr=eta, batch_size=B, inv_every=20),
    }
    if name == "DenseKalman":
        d = sum(p.numel() for p in model.parameters())
        eye = torch.eye(d, dtype=torch.float64)
        return DenseKalmanFilter(model.parameters(), prior_cov=eye, process_noise=DRIFT_TAU**2 * eye,
                                 reduction="mean", batch_size=B)
    return table[name]()


def _effective_lr(opt: Any, first: Any) -> float:
    """Median effective SGD learning rate (on the mean loss) of the first layer's weights; see module doc."""
    if hasattr(opt, "effective_lr"):
        lrs = opt.effective_lr()
        v = lrs[next(iter(lrs))] if len(lrs) == 1 else next(t for t in lrs.values() if t.shape == first.shape)
        return float(v.median())
    grp = opt.param_groups[0]
    st = opt.state.get(first, {})
    if "exp_avg_sq" in st:
        vhat = st["exp_avg_sq"] / (1 - grp["betas"][1] ** float(st["step"]))
        return float((grp["lr"] / (vhat.sqrt() + grp["eps"])).median())
    if "square_avg" in st:
        return float((grp["lr"] / (st["square_avg"].sqrt() + grp["eps"])).median())
    return float(grp["lr"] / (1 - grp.get("momentum", 0.0)))


def _regime(opt: Any) -> str:
    """``"sgd 0.12 / adam 0.99"`` for the first layer of a filter (``diagnostics()``), "-" otherwise."""
    if not hasattr(opt, "diagnostics"):
        return "-"
    row = opt.diagnostics()[0]
    return f"{row['regime']} ({row['sgd_like']:.2f} / {row['adam_like']:.2f})"


def _eval_ctx(opt: Any) -> Any:
    return opt.posterior_mean() if hasattr(opt, "posterior_mean") else nullcontext()


def _pad(xs: list[float], n: int) -> list[float]:
    return xs + [math.nan] * (n - len(xs))


# ------------------------------------------------------------------------------------------ drift task
def run_drift(name: str, seed: int, steps: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1000 + seed)
    w_true = torch.randn(DRIFT_D, generator=gen, dtype=torch.float64)
    model = nn.Linear(DRIFT_D, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    opt = _make_opt(name, model, DRIFT_B, drift=True)
    err: list[float] = []
    loss_hist: list[float] = []
    lr_hist: list[float] = []
    diverged = None
    for t in range(steps):
        w_true = w_true + DRIFT_TAU * torch.randn(DRIFT_D, generator=gen, dtype=torch.float64)
        X = torch.randn(DRIFT_B, DRIFT_D, generator=gen, dtype=torch.float64)
        y = X @ w_true + DRIFT_S * torch.randn(DRIFT_B, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        loss = 0.5 * ((model(X).squeeze(1) - y) ** 2).mean() / DRIFT_S**2   # mean negative log-likelihood
        loss.backward()
        if not math.isfinite(loss.item()):
            diverged = f"non-finite loss at step {t}"
            break
        loss_hist.append(loss.item())
        e = X / DRIFT_S                                                     # exact Fisher samples
        try:
            if name == "DenseKalman":
                opt.step(fisher=e)
            elif name.startswith("BF"):
                opt.step(fisher_diag=[(e**2).sum(0, keepdim=True)])
            elif name.startswith("KF"):
                opt.step(fisher_samples={"": (X, torch.full((DRIFT_B, 1), 1.0 / DRIFT_S, dtype=torch.float64))})
            else:
                opt.step()
        except ValueError as exc:
            diverged = f"step {t}: {exc}"
            break
        with torch.no_grad(), _eval_ctx(opt):
            err.append(float(((model.weight.squeeze(0) - w_true) ** 2).sum()))
        lr_hist.append(_effective_lr(opt, model.weight))
    return {"tracking_error": _pad(err, steps), "loss": _pad(loss_hist, steps), "effective_lr": _pad(lr_hist, steps),
            "diverged": diverged, "regime": _regime(opt)}


# ------------------------------------------------------------------------------------------ MNIST task
def _mnist(n_train: int, n_test: int) -> tuple[torch.Tensor, ...]:
    from curvkit.data import mnist_vectors

    return (*mnist_vectors(train=True, n=n_train), *mnist_vectors(train=False, n=n_test))


def _accuracy(model: nn.Module, opt: Any, X: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad(), _eval_ctx(opt):
        return float((model(X).argmax(1) == y).float().mean())


def run_mnist(name: str, seed: int, data: tuple[torch.Tensor, ...], cfg: dict[str, Any]) -> dict[str, Any]:
    from curvkit.data.loader import iterate_batches

    Xtr, ytr, Xte, yte = data
    steps, B = cfg["mnist_steps"], cfg["batch"]
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(784, cfg["hidden"]), nn.ReLU(), nn.Linear(cfg["hidden"], 10))
    opt = _make_opt(name, model, B, drift=False)
    gen = torch.Generator().manual_seed(seed)
    loss_hist: list[float] = []
    lr_hist: list[float] = []
    acc_hist: list[tuple[int, float]] = [(0, _accuracy(model, opt, Xte, yte))]
    diverged = None
    t0, c0 = time.perf_counter(), time.process_time()
    while len(loss_hist) < steps and diverged is None:
        for X, y in iterate_batches(Xtr, ytr, B, shuffle=True, generator=gen, drop_last=True):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(X), y)
            if not math.isfinite(loss.item()):
                diverged = f"non-finite loss at step {len(loss_hist)}"
                break
            loss.backward()
            try:
                opt.step()
            except ValueError as exc:
                diverged = f"step {len(loss_hist)}: {exc}"
                break
            loss_hist.append(loss.item())
            lr_hist.append(_effective_lr(opt, model[0].weight))
            if len(loss_hist) % cfg["eval_every"] == 0 or len(loss_hist) == steps:
                acc_hist.append((len(loss_hist), _accuracy(model, opt, Xte, yte)))
            if len(loss_hist) >= steps:
                break
    return {"loss": _pad(loss_hist, steps), "effective_lr": _pad(lr_hist, steps), "test_acc_curve": acc_hist,
            "test_acc": math.nan if diverged else acc_hist[-1][1], "diverged": diverged, "regime": _regime(opt),
            "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}


# ------------------------------------------------------------------------------------------ resume
def _cached(path: Path, key: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Load a finished run with the same configuration, or run it and save it (resume granularity: one run)."""
    key = to_jsonable(key)
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["result"]
    result = fn()
    write_json(path, {"key": key, "result": result})
    return json.loads(path.read_text())["result"]


# ------------------------------------------------------------------------------------------ report
def _arr(runs: list[dict[str, Any]], key: str) -> np.ndarray:
    return np.asarray([[math.nan if isinstance(v, str) else v for v in r[key]] for r in runs], dtype=float)


def _smooth(a: np.ndarray, k: int) -> np.ndarray:
    if len(a) < k:
        return a
    return np.convolve(a, np.ones(k) / k, mode="valid")


def _color(i: int) -> Any:
    import matplotlib

    return matplotlib.colormaps["tab20"](i % 20)


def _plot(results: dict[str, list[dict[str, Any]]], key: str, path: Path, title: str, ylabel: str,
          smooth: int = 1, log: bool = True) -> None:
    fig, axes = new_figure(size=(7.5, 4.5))
    ax = axes[0][0]
    for i, (name, runs) in enumerate(results.items()):
        mean = np.nanmean(_arr(runs, key), axis=0) if runs else np.array([])
        if not np.isfinite(mean).any():
            continue
        x = np.arange(len(mean))[smooth - 1:] if smooth > 1 and len(mean) >= smooth else np.arange(len(mean))
        ax.plot(x + 1, _smooth(mean, smooth), label=name, lw=1.2,
                ls="-" if name in FILTERS or name == "DenseKalman" else "--", color=_color(i))
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def _plot_accuracy(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    fig, axes = new_figure(size=(7.5, 4.5))
    ax = axes[0][0]
    for i, (name, runs) in enumerate(results.items()):
        steps = [s for s, _ in runs[0]["test_acc_curve"]]
        accs = [[a for _, a in r["test_acc_curve"]] for r in runs if len(r["test_acc_curve"]) == len(steps)]
        if accs:
            ax.plot(steps, 100 * np.mean(accs, axis=0), marker="o", ms=3, label=name, color=_color(i),
                    ls="-" if name in FILTERS else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("MNIST MLP: test accuracy (mean over seeds)", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def _ms(xs: list[float], fmt: str, scale: float = 1.0) -> str:
    a = np.asarray(xs, dtype=float) * scale
    if not np.isfinite(a).all():
        return "diverged" if not np.isfinite(a).any() else f"{np.nanmean(a):{fmt}} (some runs diverged)"
    return f"{a.mean():{fmt}} ± {a.std():{fmt}}"


def _tail(xs: list[float], frac: float = 0.2) -> float:
    a = np.asarray([math.nan if isinstance(v, str) else v for v in xs], dtype=float)
    return float(np.mean(a[-max(1, int(len(a) * frac)):]))


def _at(xs: list[float], i: int) -> float:
    v = xs[i]
    return math.nan if isinstance(v, str) else float(v)


@register("filtering-vs-adam", "Bayesian-filtering optimisers (Aitchison 2018) vs SGD/Adam/AdamW/RMSprop on a "
          "drifting linear-Gaussian regression and MNIST", scales=("smoke", "medium"),
          paper="Aitchison 2018, A unified theory of adaptive SGD as Bayesian filtering")
def run(scale: str, out: Path, seed: int = 0) -> dict[str, Any]:
    if scale not in SCALES:
        raise ValueError(f"filtering-vs-adam has scales {tuple(SCALES)}, got {scale!r}")
    cfg = SCALES[scale]
    threads = torch.get_num_threads() if cfg["threads"] is None else cfg["threads"]
    with torch_threads(threads):
        return _run(scale, cfg, Path(out), seed, threads)


def _run(scale: str, cfg: dict[str, Any], out: Path, seed: int, threads: int) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    seeds = [seed + i for i in range(cfg["seeds"])]
    t0, c0 = time.perf_counter(), time.process_time()
    drift = {n: [_cached(out / "runs" / f"drift-{n}-s{s}.json", {"task": "drift", "name": n, "seed": s,
                                                                  "steps": cfg["drift_steps"]},
                         partial(run_drift, n, s, cfg["drift_steps"])) for s in seeds] for n in DRIFT}
    t_drift = time.perf_counter() - t0
    data = _mnist(cfg["mnist_train"], cfg["mnist_test"])
    mn = {n: [_cached(out / "runs" / f"mnist-{n}-s{s}.json", {"task": "mnist", "name": n, "seed": s, **cfg},
                      partial(run_mnist, n, s, data, cfg)) for s in seeds] for n in MNIST}

    # ---------------------------------------------------------------- tables
    mid = cfg["mnist_steps"] // 2
    drift_rows = []
    for n in DRIFT:
        rs = drift[n]
        drift_rows.append([n, _ms([_tail(r["tracking_error"]) for r in rs], ".4g"),
                           _ms([_tail(r["loss"]) for r in rs], ".4f"),
                           f"{np.nanmedian([_at(r['effective_lr'], -1) for r in rs]):.3g}", rs[0]["regime"],
                           "; ".join(f"seed {s}: {r['diverged']}" for s, r in zip(seeds, rs) if r["diverged"]) or "no"])
    mnist_rows = []
    for n in MNIST:
        rs = mn[n]
        mnist_rows.append([n, _ms([_tail(r["loss"], 0.1) for r in rs], ".4f"),
                           _ms([float(np.nanmean(r["loss"][mid - 10:mid + 10])) for r in rs], ".4f"),
                           _ms([r["test_acc"] for r in rs], ".2f", 100.0),
                           f"{np.nanmedian([_at(r['effective_lr'], -1) for r in rs]):.3g}", rs[0]["regime"],
                           "; ".join(f"seed {s}: {r['diverged']}" for s, r in zip(seeds, rs) if r["diverged"]) or "no"])
    drift_headers = ["optimiser", "tracking error: squared distance to w* (last 20%)", "loss (last 20%)",
                     "final effective lr (median)", "regime at end, seed 0 (sgd-like / adam-like)", "diverged"]
    mnist_headers = ["optimiser", "train loss (last 10%)", f"train loss (steps {mid - 10}-{mid + 10})",
                     "test acc (%)", "final effective lr (layer 1, median)",
                     "regime at end, layer 1, seed 0 (sgd-like / adam-like)", "diverged"]
    diverged = [f"{task} {n} seed {s}: {r['diverged']}" for task, res in (("drift", drift), ("MNIST", mn))
                for n, rs in res.items() for s, r in zip(seeds, rs) if r["diverged"]]

    # ---------------------------------------------------------------- figures
    figs = {
        "drift_tracking_error.png": lambda p: _plot(drift, "tracking_error", p,
                                                    "drifting regression: tracking error (mean over seeds)",
                                                    "||w - w*||^2", smooth=5),
        "drift_effective_lr.png": lambda p: _plot(drift, "effective_lr", p, "drifting regression: effective lr",
                                                  "SGD-equivalent lr on the mean loss"),
        "mnist_loss.png": lambda p: _plot(mn, "loss", p, "MNIST MLP: minibatch training loss (mean over seeds, "
                                          "moving average of 10 steps)", "cross-entropy", smooth=10),
        "mnist_effective_lr.png": lambda p: _plot(mn, "effective_lr", p, "MNIST MLP: effective lr (layer 1, median)",
                                                  "SGD-equivalent lr on the mean loss"),
        "mnist_test_accuracy.png": lambda p: _plot_accuracy(mn, p),
    }
    for fname, draw in figs.items():
        draw(out / fname)

    info = machine_info()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    report = [
        f"# filtering-vs-adam ({scale})", "",
        "Bayesian-filtering optimisers (Aitchison 2018) against SGD(+momentum), Adam, AdamW and "
        f"RMSprop. Seeds {seeds}; every number is mean ± sd over the seeds (effective lr: median over seeds).",
        "", "## Drifting linear-Gaussian regression (the filters' model is exact here)", "",
        f"d = {DRIFT_D}, minibatch {DRIFT_B} fresh points per step, random-walk sd tau = {DRIFT_TAU} per step, "
        f"noise sd s = {DRIFT_S}, {cfg['drift_steps']} steps. Filters: eta = tau and the exact Fisher samples x/s; "
        "DenseKalman = the exact Kalman filter (O1) with the true drift. Baselines at the mapped hyperparameters "
        "(Adam/AdamW/RMSprop lr = eta; SGD lr 0.04 = the filters' steady effective rate; SGD+momentum 0.004/0.9). "
        "Filters are evaluated at their posterior mean.", "",
        markdown_table(drift_headers, drift_rows), "",
        "## MNIST MLP", "",
        f"{cfg['mnist_train']} training / {cfg['mnist_test']} test images of the bundled MNIST, MLP 784-"
        f"{cfg['hidden']}-10 (ReLU), batch {cfg['batch']}, {cfg['mnist_steps']} steps "
        f"({cfg['mnist_steps'] * cfg['batch'] / cfg['mnist_train']:.1f} epochs). Library defaults: filters "
        "eta = 1e-3, lr_sgd = 0.1 (s0 = lr_sgd/B), empirical Fisher, KFBayes batched over the minibatch, "
        "Kronecker refresh every 20 steps; SGD 0.1, SGD+momentum 0.01/0.9, Adam/RMSprop 1e-3, AdamW 1e-3 with "
        "weight decay 1e-2. Test accuracy after the last step (filters at the posterior mean).", "",
        markdown_table(mnist_headers, mnist_rows), "",
        "Effective lr: median over the first layer's weights of the SGD learning rate on the mean loss that "
        "matches the optimiser's steady step (module docstring). Regime: the filters' `diagnostics()` for the "
        "first layer, SGD-likeness / Adam-likeness in [0, 1] (an indicator of this library, not in the paper).", "",
        "Divergence: " + ("none; every run stayed finite." if not diverged else "; ".join(diverged)), "",
        "## Figures", "",
        *[f"- `{f}`" for f in figs], "",
        f"Time: {wall:.0f} s wall, {cpu:.0f} s CPU (drift task {t_drift:.0f} s wall) on {info['cpu']}, "
        f"{threads} torch thread(s); runs reused from `runs/` count as 0. Per-step costs of the optimisers: "
        "`benchmarks/filters.py`, not this experiment.",
    ]
    write_text(out / "report.md", "\n".join(report) + "\n")
    result = {"scale": scale, "seeds": seeds, "config": cfg, "machine": info,
              "drift_table": {"headers": drift_headers, "rows": drift_rows},
              "mnist_table": {"headers": mnist_headers, "rows": mnist_rows}, "diverged": diverged,
              "seconds": wall, "cpu_seconds": cpu}
    write_json(out / "results.json", result)
    return result
