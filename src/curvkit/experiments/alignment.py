"""``alignment``: thesis Figs. 4.2-4.3 - how well the Kronecker-factored updates align with the exact block-
diagonal and the exact full Gauss-Newton updates along a training run.

Along one KFRA training run of the MNIST autoencoder (the damped Gauss-Newton optimiser at its default
damping; the thesis plots "throughout the optimisation"), at chosen updates and on that update's minibatch
(gradient g of E = loss + weight decay, lambda = weight decay, zeta = the optimiser's current zeta):

* four approximate updates d = (G~ + (lambda + zeta) I)^{-1} g, the factors estimated on the minibatch:
  KFAC and KFRA with factored Tikhonov damping (Eq. 4.25, trace-norm omega), and KFAC*, KFRA* with the exact
  damped inverse of the Kronecker product through the factors' eigendecompositions;
* the exact block-diagonal GN update, per layer (G_ll + (lambda + zeta) I) x_l = g_l, and the exact full GN
  update (G + (lambda + zeta) I) x = g, both by conjugate gradients on exact minibatch GGN products
  (one Jacobian-vector product, the output Hessian, one backward pass), relative tolerance 1e-6 and at most
  ``cg_iters`` iterations (the relative residual ||b - A x|| / ||b|| is recomputed and reported);
* Fig. 4.2: per layer, cos(d_l, x_block_l) for each variant; Fig. 4.3: cos(d, x_full) for each variant
  and for the exact block-diagonal update.

The reference solves use the damping lambda + zeta (the thesis writes (G + lambda I) delta = grad L, and notes
that its block-diagonal GN "does not include the extra zeta"; with the weight decay alone, 1e-5, CG on the
exact GGN would not converge in a usable number of iterations, so both references take the damping the
approximate updates use, as digest 002 recommends). KFAC draws one label per data point.

Claims checked (Sec. 4.5.2): the per-layer similarity falls with the distance from the output; KFRA aligns
better than KFAC on average; the layers around the 30-unit bottleneck (4 and 5) are relatively high; the
exact block-diagonal GN can align worse with the full GN than the approximations; the factored (approximate)
inversion aligns better than the exact one on MNIST.

Scales: ``smoke`` - a narrow autoencoder (widths x 0.1), 1,000 images, batch 100, updates 1 and 8, CG <= 100;
``medium`` - the full-width autoencoder, batch 250 (the thesis found 250, 500 and 1000 similar), a 200-update
trajectory with alignment at updates 1, 25, 50, 100, 200, CG <= 250; ``paper`` - batch 1000, 5,000 updates,
alignment every 250 updates. Each alignment point is saved when done (``out/alignment.pt`` with the
trajectory's checkpoint), so an interrupted run resumes without redoing finished points.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from curvkit import checkpoint, layerkinds
from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.experiments._report import (
    machine_info,
    markdown_table,
    new_figure,
    save_figure,
    to_jsonable,
    torch_threads,
)
from curvkit.experiments._second_order import GAUSS_NEWTON_FORMAT, _Batches, glorot_, load_mnist
from curvkit.experiments.registry import register
from curvkit.likelihoods import BernoulliBCE, Likelihood
from curvkit.linalg.krylov import conjugate_gradient
from curvkit.linalg.layout import ParamLayout
from curvkit.models import autoencoder
from curvkit.optim import GaussNewton
from curvkit.optim.second_order.linearisation import Linearisation, apply_output_hessian
from curvkit.structure import read_model

SETTINGS: dict[str, dict[str, Any]] = {
    "smoke": dict(n=1000, width=0.1, batch=100, steps=8, points=[1, 8], cg_iters=100, threads=1),
    "medium": dict(n=50_000, width=1.0, batch=250, steps=200, points=[1, 25, 50, 100, 200], cg_iters=250,
                   threads=None),
    "paper": dict(n=50_000, width=1.0, batch=1000, steps=5000, points=[1, *range(250, 5001, 250)], cg_iters=250,
                  threads=None),
}
WEIGHT_DECAY = 1e-5
VARIANTS = [("KFAC", "kfac", "factored"), ("KFRA", "kfra", "factored"), ("KFAC*", "kfac", "eigen"),
            ("KFRA*", "kfra", "eigen")]
CG_TOL = 1e-6


class MinibatchGGN:
    """Exact products with G + damping I, G the minibatch GGN of ``likelihood`` at the model's current
    parameters: (G v) = J^T (w H_L (J v)) with J v from :class:`Linearisation` and J^T u from one backward
    pass through the recorded forward pass; k columns at once. Flat vectors in ``ParamLayout`` order."""

    def __init__(self, model: nn.Module, likelihood: Likelihood, X: Tensor, y: Tensor, damping: float = 0.0):
        self.model, self.likelihood, self.y, self.damping = model, likelihood, y, float(damping)
        self.layout = ParamLayout.from_module(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.lin = Linearisation(model, read_model(model), list(self.layout.names))
        with torch.enable_grad():
            self.f = self.lin.record(X)
        self.products = 0

    def matmat(self, M: Tensor) -> Tensor:
        """(G + damping I) M for M of shape (d, k)."""
        k = M.shape[1]
        V = [t.movedim(-1, 0) for t in self.layout.unflatten(M)]  # each (k, *shape)
        JV = self.lin([[v[j] for v in V] for j in range(k)])
        U = apply_output_hessian(self.likelihood, self.f, self.y, JV)
        with torch.enable_grad():
            grads = torch.autograd.grad(self.f, self.params, U, retain_graph=True, is_grads_batched=True)
        self.products += k
        out = torch.cat([g.reshape(k, -1) for g in grads], 1).T
        return out + self.damping * M if self.damping else out


def _masks(layout: ParamLayout, model: nn.Module) -> tuple[list[str], Tensor]:
    """Layer labels and a (d, L) 0/1 matrix whose column l marks the parameters of layer l's blocks
    (:func:`curvkit.layerkinds.plan`: a Linear layer's weight and bias)."""
    plans = layerkinds.plan(read_model(model), "alignment")
    sl = layout.slices()
    M = torch.zeros(layout.dim, len(plans))
    for j, lp in enumerate(plans):
        for name in {n for spec in lp.blocks for n in spec.names}:
            M[sl[name], j] = 1.0
    return [lp.label for lp in plans], M


def _cos(a: Tensor, b: Tensor) -> float:
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


def align_point(model: nn.Module, likelihood: Likelihood, X: Tensor, y: Tensor, weight_decay: float, zeta: float,
                cg_iters: int, seed: int = 0, tol: float = CG_TOL) -> dict[str, Any]:
    """Every quantity of one alignment point (module docstring) on the minibatch (X, y); ``tol`` is CG's
    relative tolerance."""
    damping = weight_decay + zeta
    layout = ParamLayout.from_module(model)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.enable_grad():
        loss = likelihood(model(X), y)
        grads = torch.autograd.grad(loss, params)
    g = layout.flatten([gr + weight_decay * p.detach() for gr, p in zip(grads, params)])
    names, mask = _masks(layout, model)
    mask = mask.to(g)
    dirs: dict[str, Tensor] = {}
    ops = {}
    for method in ("kfac", "kfra"):
        est = KroneckerEstimator(model, likelihood, method, seed=seed)
        ops[method] = est.update((X, y)).operator()
    for name, method, inversion in VARIANTS:
        inv = ops[method].inverse(damping, method="factored") if inversion == "factored" else \
            ops[method].inverse(damping, method="eigen")
        dirs[name] = inv @ g
    ggn = MinibatchGGN(model, likelihood, X, y, damping)
    x_full = conjugate_gradient(ggn.matmat, g, tol=tol, max_iter=cg_iters)
    full_products = ggn.products
    B = g[:, None] * mask  # column l: the gradient of layer l

    def block_matmat(P: Tensor) -> Tensor:
        # P holds active columns; each column is supported on one layer (CG keeps the support)
        owner = (P.abs() > 0).to(P.dtype).T @ mask  # (k, L): which layer each column lives in
        sel = mask @ (owner > 0).to(P.dtype).T  # (d, k) mask of each column's layer
        return ggn.matmat(P) * sel

    X_block = conjugate_gradient(block_matmat, B, tol=tol, max_iter=cg_iters)
    x_block = X_block.sum(1)
    res_full = float((g - ggn.matmat(x_full[:, None])[:, 0]).norm() / g.norm())
    res_block = [float((B[:, j] - block_matmat(X_block[:, j:j + 1])[:, 0]).norm() / B[:, j].norm().clamp_min(1e-300))
                 for j in range(len(names))]
    per_layer = {v: [_cos(d[mask[:, j] > 0], x_block[mask[:, j] > 0]) for j in range(len(names))]
                 for v, d in dirs.items()}
    full = {v: _cos(d, x_full) for v, d in dirs.items()}
    full["block-diagonal GN"] = _cos(x_block, x_full)
    return {"layers": names, "per_layer": per_layer, "full": full, "loss": float(loss.detach()), "zeta": zeta,
            "damping": damping, "cg_residual_full": res_full, "cg_residual_block": res_block,
            "cg_products": {"full": full_products, "total": ggn.products}}


@register("alignment", "Alignment of KFAC/KFRA(*) updates with exact block and full Gauss-Newton updates",
          paper="002 Botev thesis, Figs. 4.2-4.3")
def run(scale: str, out: Path, seed: int = 0) -> dict[str, Any]:
    st = SETTINGS[scale]
    with torch_threads(st["threads"] or None):
        return _run(scale, st, Path(out), seed)


def _run(scale: str, st: dict[str, Any], out: Path, seed: int) -> dict[str, Any]:
    X = load_mnist(st["n"])[0]
    lik = BernoulliBCE("mean")
    model = glorot_(autoencoder(784, width=st["width"]), seed)
    opt = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature="kfra", weight_decay=WEIGHT_DECAY)
    batches = _Batches(int(X.shape[0]), st["batch"], seed)
    key = {"settings": st, "seed": seed, "gauss_newton": GAUSS_NEWTON_FORMAT}
    state_path = out / "alignment.pt"
    points: list[dict[str, Any]] = []
    start = 0
    if state_path.exists():
        ck = checkpoint.load(state_path)
        if ck.get("key") == key:
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            batches.load(ck["batches"])
            points, start = ck["points"], int(ck["step"])
    for t in range(start, st["steps"]):
        idx = batches.next()
        xb = X[idx]
        if t + 1 in st["points"] and not any(p["step"] == t + 1 for p in points):
            res = align_point(model, lik, xb, xb, WEIGHT_DECAY, opt.zeta, st["cg_iters"], seed=seed + t)
            points.append({"step": t + 1, **res})
            # save the trajectory BEFORE this update with the finished point: resuming redoes the update only
            batches_state = batches.state()
            batches_state["pos"] -= st["batch"]
            checkpoint.save({"key": key, "model": model.state_dict(), "opt": opt.state_dict(),
                             "batches": batches_state, "points": points, "step": t}, state_path)
        opt.step(batch=(xb, xb))
    results = _summarise(scale, st, points)
    results["machine"] = machine_info()
    checkpoint.write_text(out / "results.json", json.dumps(to_jsonable(results), indent=1) + "\n")
    _figures(points, out)
    checkpoint.write_text(out / "report.md", _report(scale, st, results))
    return results


def _summarise(scale: str, st: dict[str, Any], points: list[dict[str, Any]]) -> dict[str, Any]:
    names = points[0]["layers"]
    L = len(names)
    variants = [v for v, _, _ in VARIANTS]
    per_layer_mean = {v: [float(np.mean([p["per_layer"][v][j] for p in points])) for j in range(L)] for v in variants}
    full_mean = {v: float(np.mean([p["full"][v] for p in points])) for v in [*variants, "block-diagonal GN"]}
    # distance from the output: layer L-1 is the output layer
    slopes = {v: float(np.corrcoef(np.arange(L), per_layer_mean[v])[0, 1]) for v in variants}
    mean_all = {v: float(np.mean(per_layer_mean[v])) for v in variants}
    bottleneck = [3, 4]  # layers 4 and 5 (1-based) around the 30-unit code
    others = [j for j in range(L) if j not in bottleneck]
    claims = {
        "similarity_falls_with_distance_from_output": {v: slopes[v] > 0 for v in variants},
        "corr_layer_index_vs_cosine": slopes,
        "kfra_better_than_kfac_per_layer": mean_all["KFRA"] > mean_all["KFAC"],
        "kfra_star_better_than_kfac_star_per_layer": mean_all["KFRA*"] > mean_all["KFAC*"],
        "kfra_better_than_kfac_full": full_mean["KFRA"] > full_mean["KFAC"],
        "bottleneck_high": {v: float(np.mean([per_layer_mean[v][j] for j in bottleneck]))
                            > float(np.mean([per_layer_mean[v][j] for j in others])) for v in variants},
        "block_gn_below_approximations_full": full_mean["block-diagonal GN"] < min(full_mean[v] for v in variants),
        "factored_better_than_exact_full": {"KFAC": full_mean["KFAC"] > full_mean["KFAC*"],
                                            "KFRA": full_mean["KFRA"] > full_mean["KFRA*"]},
    }
    return {"scale": scale, "settings": st, "layers": names, "points": points, "per_layer_mean": per_layer_mean,
            "full_mean": full_mean, "mean_per_layer_cosine": mean_all, "claims": claims,
            "max_cg_residual": max(max(p["cg_residual_full"], *p["cg_residual_block"]) for p in points)}


def _figures(points: list[dict[str, Any]], out: Path) -> None:
    names = points[0]["layers"]
    steps = [p["step"] for p in points]
    L = len(names)
    cols = 4
    fig, axes = new_figure((L + cols - 1) // cols, cols, size=(3.2, 2.6))
    for j in range(L):
        ax = axes[j // cols][j % cols]
        for v, _, _ in VARIANTS:
            ax.plot(steps, [p["per_layer"][v][j] for p in points], "o-" if "*" in v else "s--", label=v, ms=3)
        ax.set_title(f"layer {j + 1} ({names[j]})", fontsize=8)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("update", fontsize=7)
    axes[0][0].legend(fontsize=6)
    save_figure(fig, out / "fig4_2_per_layer.png")
    fig, axes = new_figure(1, 1, size=(5.0, 3.6))
    ax = axes[0][0]
    for v in [*(v for v, _, _ in VARIANTS), "block-diagonal GN"]:
        ax.plot(steps, [p["full"][v] for p in points], "o-", label=v, ms=3)
    ax.set_xlabel("update")
    ax.set_ylabel("cosine with the exact full GN update")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=7)
    save_figure(fig, out / "fig4_3_full.png")


def _report(scale: str, st: dict[str, Any], r: dict[str, Any]) -> str:
    names = r["layers"]
    variants = [v for v, _, _ in VARIANTS]
    c = r["claims"]
    rows = [[f"{j + 1} ({names[j]})", *(r["per_layer_mean"][v][j] for v in variants)] for j in range(len(names))]
    rows.append(["mean", *(r["mean_per_layer_cosine"][v] for v in variants)])
    full_rows = [[v, r["full_mean"][v], *(p["full"][v] for p in r["points"])] for v in [*variants, "block-diagonal GN"]]
    yes = lambda b: "**holds**" if b else "**does not hold**"  # noqa: E731
    md = [f"# alignment ({scale})", "",
          f"Thesis Figs. 4.2-4.3 along one KFRA run of the MNIST autoencoder (width x {st['width']}, batch "
          f"{st['batch']}, {st['steps']} updates); alignment at updates {st['points']} on that update's minibatch. "
          "References: exact block-diagonal and full GN updates by CG on exact GGN products with damping "
          f"weight decay + zeta (relative tolerance {CG_TOL:g}, at most {st['cg_iters']} iterations; largest relative "
          f"residual {r['max_cg_residual']:.2e}).", "",
          "## Per-layer cosine with the exact block GN update (Fig. 4.2), mean over the alignment points", "",
          markdown_table(["layer", *variants], rows),
          "## Full-update cosine with the exact full GN update (Fig. 4.3)", "",
          markdown_table(["update", "mean", *(str(p["step"]) for p in r["points"])], full_rows),
          "## Claims", "",
          "- Similarity falls with the distance from the output (correlation of layer index with the mean cosine "
          "> 0): " + ", ".join(f"{v} {c['corr_layer_index_vs_cosine'][v]:.2f} {yes(c['similarity_falls_with_distance_from_output'][v])}"
                               for v in variants) + ".",
          f"- KFRA aligns better than KFAC on average (per layer): KFRA {r['mean_per_layer_cosine']['KFRA']:.3f} vs KFAC "
          f"{r['mean_per_layer_cosine']['KFAC']:.3f} {yes(c['kfra_better_than_kfac_per_layer'])}; exact inversion KFRA* "
          f"{r['mean_per_layer_cosine']['KFRA*']:.3f} vs KFAC* {r['mean_per_layer_cosine']['KFAC*']:.3f} "
          f"{yes(c['kfra_star_better_than_kfac_star_per_layer'])}; full update KFRA {r['full_mean']['KFRA']:.3f} vs KFAC "
          f"{r['full_mean']['KFAC']:.3f} {yes(c['kfra_better_than_kfac_full'])}.",
          "- Layers 4 and 5 (around the bottleneck) above the other layers' mean: "
          + ", ".join(f"{v} {yes(c['bottleneck_high'][v])}" for v in variants) + ".",
          f"- The exact block-diagonal GN aligns worse with the full GN than every approximation (MNIST): "
          f"{r['full_mean']['block-diagonal GN']:.3f} {yes(c['block_gn_below_approximations_full'])}.",
          f"- Factored (approximate) inversion aligns better than the exact one (MNIST, full update): KFAC "
          f"{r['full_mean']['KFAC']:.3f} vs KFAC* {r['full_mean']['KFAC*']:.3f} {yes(c['factored_better_than_exact_full']['KFAC'])}; "
          f"KFRA {r['full_mean']['KFRA']:.3f} vs KFRA* {r['full_mean']['KFRA*']:.3f} {yes(c['factored_better_than_exact_full']['KFRA'])}.",
          "", "Figures: fig4_2_per_layer.png, fig4_3_full.png.", "", "## Machine", "",
          "\n".join(f"- {k}: {v}" for k, v in r["machine"].items()), ""]
    return "\n".join(md)

