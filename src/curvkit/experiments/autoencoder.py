"""``autoencoder``: thesis Fig. 4.1 - the damped Gauss-Newton optimiser (KFRA, KFAC; with and without the
0.9 moving average of the factors) at its default damping against Adam at its default learning rate and
Adam tuned over the thesis's grid, on deep autoencoders.

Protocol (thesis Sec. 4.5-4.5.1; the gaps filled as digest 002 recommends): D-1000-500-250-30-250-500-1000-D,
tanh hidden units (the code layer too), logits out; MNIST and CURVES with the Bernoulli cross-entropy summed
over pixels, FACES with the squared error (1/2)||h - x||^2, both averaged over the minibatch; minibatches of
1000; weight decay 1e-5 on every parameter; Glorot-uniform weights and zero biases shared by every
optimiser; MNIST = the first 50,000 training images. Adam: default betas, learning rate halved every T
updates, grid 2^-6..2^-13 x T in {100, 50, 25, 12.5, 6.25}% of the run, ranked by the final smoothed
objective, with the mean of the top-1/10/20 settings. Reported: the minibatch objective E (loss + weight
decay, smoothed over 10 updates as the thesis's figure) against updates and against training wall-clock,
and on a fixed subset of the training images the loss and the classic reconstruction error
sum_pixels (mean - x)^2 per image, so numbers from other papers can be compared.

Scales: ``smoke`` - a narrow autoencoder (widths x 0.25) on 2,000 images, batch 200, KFRA, KFAC and KFRA
with the moving average for 15 updates, Adam (default, 2^-6, 2^-9) for 45 (tens of seconds); ``medium`` - the full-width network on the 50,000 MNIST images, 250
second-order updates, Adam with 750 updates at its default and over a reduced grid (2^-7, 2^-9, 2^-11 x T
100%, 25%), about an hour on 2 cores; ``paper`` - the thesis's protocol: 5,000 second-order and 40,000
Adam updates (FACES 20,000 / 160,000) over the full 40-setting grid. CURVES and FACES run only from
user-supplied files (``CURVKIT_CURVES``, ``CURVKIT_FACES``; :func:`curvkit.experiments._second_order.
load_user_dataset`); otherwise the report says they were not run. Every run checkpoints and resumes
(``out/runs/DATASET/RUN``); finished runs are reused.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from curvkit.checkpoint import write_text
from curvkit.experiments._report import (
    machine_info,
    markdown_table,
    new_figure,
    save_figure,
    to_jsonable,
    torch_threads,
)
from curvkit.experiments._second_order import (
    RunSpec,
    Task,
    adam_grid,
    glorot_,
    load_mnist,
    load_user_dataset,
    smooth,
    topk_mean,
    train_run,
    value_at,
)
from curvkit.experiments.registry import register
from curvkit.likelihoods import BernoulliBCE, Gaussian
from curvkit.models import autoencoder

SETTINGS: dict[str, dict[str, Any]] = {
    "smoke": dict(n=2000, width=0.25, batch=200, gn_steps=15, adam_steps=45, lrs=[-6, -9], fractions=[1.0],
                  eval_n=2000, gn_eval=5, adam_eval=15, threads=1, second_order=3),
    "medium": dict(n=50_000, width=1.0, batch=1000, gn_steps=250, adam_steps=750, lrs=[-7, -9, -11],
                   fractions=[1.0, 0.25], eval_n=10_000, gn_eval=50, adam_eval=150, threads=None, second_order=4),
    "paper": dict(n=50_000, width=1.0, batch=1000, gn_steps=5000, adam_steps=40_000, lrs=list(range(-6, -14, -1)),
                  fractions=[1.0, 0.5, 0.25, 0.125, 0.0625], eval_n=50_000, gn_eval=100, adam_eval=800,
                  threads=None, second_order=4),
}
WEIGHT_DECAY = 1e-5
SECOND_ORDER = [("KFRA", "kfra", None), ("KFAC", "kfac", None), ("KFRA (EMA 0.9)", "kfra", 0.9),
                ("KFAC (EMA 0.9)", "kfac", 0.9)]


def _metrics(bernoulli: bool):
    def metrics(f: Tensor, x: Tensor) -> dict[str, float]:
        if bernoulli:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(f, x, reduction="sum")
            mean = torch.sigmoid(f)
        else:
            loss = 0.5 * ((f - x) ** 2).sum()
            mean = f
        return {"loss": float(loss), "sq_err": float(((mean - x) ** 2).sum())}

    return metrics


def make_task(dataset: str, X: Tensor, st: dict[str, Any], seed: int) -> Task:
    bernoulli = dataset != "faces"
    D = int(X.shape[1])

    def model_fn() -> torch.nn.Module:
        return glorot_(autoencoder(D, width=st["width"]), seed)

    lik = BernoulliBCE("mean") if bernoulli else Gaussian("mean")
    return Task(dataset, model_fn, lik, X, X, st["batch"], WEIGHT_DECAY, _metrics(bernoulli),
                min(st["eval_n"], int(X.shape[0])))


def run_specs(st: dict[str, Any], budget: float = 1.0) -> tuple[list[RunSpec], list[RunSpec]]:
    """(second-order runs, Adam runs: default first, then the grid); ``budget`` scales the update counts."""
    gn_steps, adam_steps = round(st["gn_steps"] * budget), round(st["adam_steps"] * budget)
    ck = max(st["gn_eval"], 50)
    gn = [RunSpec(name, "gauss_newton", gn_steps, curvature=c, ema=e, eval_every=st["gn_eval"], checkpoint_every=ck)
          for name, c, e in SECOND_ORDER[:st["second_order"]]]
    adam = [RunSpec("adam-default (1e-3)", "adam", adam_steps, lr=1e-3, eval_every=st["adam_eval"],
                    checkpoint_every=max(st["adam_eval"], 200))]
    adam += adam_grid(st["lrs"], st["fractions"], adam_steps, st["adam_eval"], max(st["adam_eval"], 200))
    return gn, adam


def claims(gn: dict[str, dict[str, Any]], adam: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The thesis's claims, checked on the recorded curves (smoothed minibatch objective)."""
    grid = list(adam.values())
    best, _ = topk_mean(grid, 1)
    b = best[0]
    out: dict[str, Any] = {"best_adam": b["name"], "per_method": {}}
    for name, r in gn.items():
        U = len(r["loss"])
        T = r["time"][-1] if r["time"] else math.nan
        mine = value_at(r, update=U)
        at_u = value_at(b, update=U)
        # equal wall-clock: at the end of the shorter of the two runs (beyond Adam's budget its curve is unknown)
        t_eq = min(T, b["time"][-1]) if b["time"] else math.nan
        mine_t, adam_t = value_at(r, time_s=t_eq), value_at(b, time_s=t_eq)
        out["per_method"][name] = {
            "updates": U, "train_time_s": T, "objective": mine, "best_adam_same_updates": at_u,
            "equal_time_s": t_eq, "objective_at_equal_time": mine_t, "best_adam_same_time": adam_t,
            "best_adam_end": value_at(b, update=len(b["loss"])), "best_adam_time_s": b["time"][-1] if b["time"] else 0.0,
            "beats_best_adam_per_update": bool(mine < at_u), "beats_best_adam_per_time": bool(mine_t < adam_t),
        }
    pairs: list[dict[str, Any]] = []
    for a, c in (("KFRA", "KFAC"), ("KFRA (EMA 0.9)", "KFAC (EMA 0.9)")):
        if a in gn and c in gn:
            ra, rc = gn[a], gn[c]
            U = min(len(ra["loss"]), len(rc["loss"]))
            T = min(ra["time"][-1], rc["time"][-1]) if ra["time"] and rc["time"] else math.nan
            pairs.append({"kfra": a, "kfac": c, "updates": U, "kfra_objective": value_at(ra, update=U),
                          "kfac_objective": value_at(rc, update=U), "time_s": T,
                          "kfra_at_time": value_at(ra, time_s=T), "kfac_at_time": value_at(rc, time_s=T)})
    for p in pairs:
        p["kfra_faster_per_update"] = bool(p["kfra_objective"] < p["kfac_objective"])
        p["kfra_faster_per_time"] = bool(p["kfra_at_time"] < p["kfac_at_time"])
    out["kfra_vs_kfac"] = pairs
    return out


def _figure(dataset: str, gn: dict[str, dict[str, Any]], adam: dict[str, dict[str, Any]], path: Path,
            tops: list[int]) -> None:
    fig, axes = new_figure(1, 2, size=(5.6, 4.0))
    for x_kind, ax in zip(("time", "update"), axes[0]):
        for name, r in list(gn.items()) + [(n, r) for n, r in adam.items() if n.startswith("adam-default")]:
            ys = smooth(r["loss"])
            xs = np.asarray(r["time"]) if x_kind == "time" else np.arange(1, len(ys) + 1)
            ls = "--" if "EMA" in name else "-"
            ax.plot(xs, ys, ls, label=name)
        for k in tops:
            best, mean = topk_mean(list(adam.values()), k)
            if k == 1:
                r = best[0]
                xs = np.asarray(r["time"]) if x_kind == "time" else np.arange(1, len(r["loss"]) + 1)
                ax.plot(xs, smooth(r["loss"]), ":", label=f"Adam best ({r['name']})")
            elif x_kind == "update":
                ax.plot(np.arange(1, len(mean) + 1), mean, ":", label=f"Adam top-{k} mean")
        ax.set_yscale("log")
        ax.set_xlabel("training wall-clock (s)" if x_kind == "time" else "parameter update")
        ax.set_ylabel("minibatch objective (smoothed, window 10)")
        ax.set_title(f"{dataset.upper()} autoencoder")
    axes[0][1].legend(fontsize=7)
    save_figure(fig, path)


@register("autoencoder", "Gauss-Newton (KFRA/KFAC) vs default and tuned Adam on deep autoencoders",
          paper="002 Botev thesis, Fig. 4.1")
def run(scale: str, out: Path, seed: int = 0) -> dict[str, Any]:
    st = SETTINGS[scale]
    with torch_threads(st["threads"] or None):
        return _run(scale, st, Path(out), seed)


def _run(scale: str, st: dict[str, Any], out: Path, seed: int) -> dict[str, Any]:
    datasets: dict[str, Tensor | None] = {"mnist": load_mnist(st["n"])[0]}
    if scale != "smoke":
        for name in ("curves", "faces"):
            datasets[name] = load_user_dataset(name)
    results: dict[str, Any] = {"scale": scale, "seed": seed, "settings": st, "weight_decay": WEIGHT_DECAY,
                               "datasets": {}, "not_run": [], "machine": machine_info()}
    md = [f"# autoencoder ({scale})", "",
          "Thesis Fig. 4.1: the damped Gauss-Newton optimiser at its default damping against Adam at its default "
          "and over a learning-rate x halving-period grid. Objective = minibatch loss + weight decay, smoothed over "
          "10 updates; wall-clock = training steps only (evaluation excluded).", ""]
    for dataset, X in datasets.items():
        if X is None:
            results["not_run"].append(dataset)
            md += [f"## {dataset.upper()}: not run", "",
                   f"{dataset.upper()} is not available offline; point CURVKIT_{dataset.upper()} at the file to run "
                   "it (see curvkit.experiments._second_order.load_user_dataset).", ""]
            continue
        budget = 4.0 if (dataset == "faces" and scale == "paper") else 1.0
        task = make_task(dataset, X, st, seed)
        gn_specs, adam_specs = run_specs(st, budget)
        done: dict[str, dict[str, Any]] = {}
        for s in _run_order(gn_specs, adam_specs):  # a partial (interrupted) run still holds a comparison
            r = train_run(task, s, out / "runs" / dataset / _slug(s.name), batch_seed=seed)
            assert r is not None
            done[s.name] = r
        gn_r = {s.name: done[s.name] for s in gn_specs}
        adam_r = {s.name: done[s.name] for s in adam_specs}
        tops = [k for k in (1, 10, 20) if k <= len(adam_r)] or [1]
        if len(adam_r) < 10:
            tops = sorted({1, min(3, len(adam_r)), len(adam_r)})
        _figure(dataset, gn_r, adam_r, out / f"fig4_1_{dataset}.png", tops)
        cl = claims(gn_r, adam_r)
        summary = {name: _summary(r) for name, r in {**gn_r, **adam_r}.items()}
        top_means = {k: float(topk_mean(list(adam_r.values()), k)[1][-1]) for k in tops}
        results["datasets"][dataset] = {"runs": summary, "claims": cl, "adam_topk_final": top_means,
                                        "curves": {n: {"loss": r["loss"], "time": r["time"], "evals": r["evals"]}
                                                   for n, r in {**gn_r, **adam_r}.items()}}
        md += _report_section(dataset, task, summary, cl, top_means)
    md += ["## Machine", "", _machine(results["machine"])]
    write_text(out / "results.json", __import__("json").dumps(to_jsonable(results), indent=1) + "\n")
    write_text(out / "report.md", "\n".join(md) + "\n")
    return results


def _run_order(gn: list[RunSpec], adam: list[RunSpec]) -> list[RunSpec]:
    """KFRA, Adam at its default, KFAC, the Adam grid, then the moving-average variants: the order in which
    an interrupted run has the most to compare (finished runs are kept and reused)."""
    first = [s for s in gn if s.ema is None]
    return first[:1] + adam[:1] + first[1:] + adam[1:] + [s for s in gn if s.ema is not None]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    ev = r["evals"][-1]
    n = len(r["loss"])
    return {"updates": n, "final_objective_smoothed": float(smooth(r["loss"])[-1]) if n else math.nan,
            "eval_loss": ev.get("loss"), "eval_sq_err": ev.get("sq_err"),
            "train_time_s": r["time"][-1] if r["time"] else 0.0,
            "time_per_update_s": (r["time"][-1] / n) if n else math.nan,
            "diverged": r["diverged"]}


def _report_section(dataset: str, task: Task, summary: dict[str, Any], cl: dict[str, Any],
                    top_means: dict[int, float]) -> list[str]:
    rows = [[n, s["updates"], s["final_objective_smoothed"], s["eval_loss"], s["eval_sq_err"], s["train_time_s"],
             s["time_per_update_s"], f"yes (step {s['diverged']['step']})" if s["diverged"] else "no"]
            for n, s in summary.items()]
    md = [f"## {dataset.upper()} ({int(task.X.shape[0])} images, batch {task.batch_size})", "",
          f"Evaluation on the first {task.eval_n} training images (per image): `loss` = the optimised loss, "
          "`sq_err` = sum over pixels of (mean - x)^2.", "",
          markdown_table(["run", "updates", "final objective (smoothed)", "eval loss", "eval sq. error",
                          "train time (s)", "s / update", "diverged"], rows),
          "Adam top-k mean of the final smoothed objective: "
          + ", ".join(f"top-{k}: {v:.4g}" for k, v in top_means.items()) + f" (best: {cl['best_adam']}).", "",
          "### Claims", ""]
    for name, c in cl["per_method"].items():
        md.append(f"- {name} (default damping) vs the best-tuned Adam: after {c['updates']} updates "
                  f"{c['objective']:.4g} vs {c['best_adam_same_updates']:.4g} -> per update "
                  f"**{'holds' if c['beats_best_adam_per_update'] else 'does not hold'}**; at equal training time "
                  f"({c['equal_time_s']:.0f} s, the end of the shorter run) {c['objective_at_equal_time']:.4g} vs "
                  f"{c['best_adam_same_time']:.4g} -> per wall-clock "
                  f"**{'holds' if c['beats_best_adam_per_time'] else 'does not hold'}** (Adam after its whole "
                  f"budget, {c['best_adam_time_s']:.0f} s: {c['best_adam_end']:.4g}; {name} after {c['train_time_s']:.0f} s: "
                  f"{c['objective']:.4g}).")
    for p in cl["kfra_vs_kfac"]:
        md.append(f"- {p['kfra']} vs {p['kfac']}: after {p['updates']} updates {p['kfra_objective']:.4g} vs "
                  f"{p['kfac_objective']:.4g} -> KFRA faster per update **{'holds' if p['kfra_faster_per_update'] else 'does not hold'}**; "
                  f"at {p['time_s']:.0f} s {p['kfra_at_time']:.4g} vs {p['kfac_at_time']:.4g} -> per wall-clock "
                  f"**{'holds' if p['kfra_faster_per_time'] else 'does not hold'}**.")
    md += ["", f"Figure: fig4_1_{dataset}.png (left: against training wall-clock, right: against updates; "
           "dashed: factor moving average 0.9).", ""]
    return md


def _machine(info: dict[str, Any]) -> str:
    return "\n".join(f"- {k}: {v}" for k, v in info.items()) + "\n"
