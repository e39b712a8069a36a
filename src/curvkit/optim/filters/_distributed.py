"""Data-parallel steps of the Kronecker-factored filters (:mod:`curvkit.optim.filters.kronecker`).

What travels, per step (P ranks, rank r holding B_r examples; B = sum_r B_r):

* :class:`~curvkit.optim.filters.KFWhiten`: per layer the batch statistics sum_n x_n x_n^T (as an upper
  triangle), the row count K_r, sum_n delta_n delta_n^T (triangle) and the ascent gradient in summed
  units, all layers in ONE all-reduce. Then C_x's batch term is sum_r X_r^T X_r / sum_r K_r (the mean over
  the union's rows), C_delta's is the sum, and the gradient is the union's. On a refresh step each layer's
  two eigendecompositions are computed by the layer's owner rank (placement by cost,
  :func:`curvkit.distributed.placement.assign_owners`) and shared (comm-opt; every rank, the owner
  included, then holds identically laid-out copies, so the steps stay bitwise identical); between refreshes the
  second moments along the kept basis, diag(V^T C_batch V), come from the reduced statistics on every rank.
* :class:`~curvkit.optim.filters.KFBayes` / ``KFNatGrad``: their Eq. 24 updates are sequential in the
  Fisher samples, so the samples themselves are gathered: each rank contributes the rows of its first
  min(k, B_r) examples (x, delta in summed units; T rows per example for a layer shared over positions, a
  convolution or a tied weight's stacked uses, T checked equal on every rank), the union's first k examples'
  rows are kept (delta scaled by sqrt(B / k) when k < B, as the single process does with its batch), plus the
  union's gradient by one all-reduce. Every rank then runs the same update.

The result is the single-process step on the union minibatch (shards in rank order), to rounding.
Gradients: ``distributed.grads='local'`` all-reduces sum_r (-s_r p.grad_r) with s_r the rank's loss
scale (B_r for a mean loss: the filters' ``'mean'`` is over examples); ``'synced'`` (DDP) takes p.grad as the
union's gradient, scaled by B (:func:`curvkit.distributed.ddp` weighs a mean by the output's positions, the
examples of (B, C) outputs; with positions or padding both use the summed loss, ``reduction='sum'``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from curvkit.distributed.placement import assign_owners, factor_cost
from curvkit.linalg.kron import psd_eigh as robust_eigh

__all__ = ["bayes_inputs", "whiten_inputs", "whiten_statistics"]


def _ascent_gradients(opt: Any, scale: float, batch: int) -> list[Tensor]:
    """Per layer the ascent gradient of the summed log-likelihood over the union (module docstring);
    local gradients are returned unreduced (they travel in the caller's message)."""
    red = opt.distributed
    if red.grads == "synced":
        total = batch if opt.loss_scale.reduction == "mean" else 1
        return [rec.weight_matrix_grad().mul(-float(total)) for rec in opt.layers]
    return [rec.weight_matrix_grad().mul(-scale) for rec in opt.layers]


def _union_batch(opt: Any) -> tuple[int, int]:
    """(this rank's batch size, the union's) from the captured rows; one all-reduce."""
    rec = opt.layers[0]
    local = rec.examples
    return local, opt.distributed.sum_int(local)


def whiten_inputs(opt: Any, scale: float, fisher_samples: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """KFWhiten: every layer's reduced batch statistics and gradient (module docstring), one message."""
    red = opt.distributed
    _local_b, union_b = _union_batch(opt) if red.grads == "synced" else (0, 0)
    grads = _ascent_gradients(opt, scale, union_b)
    parts: list[Tensor] = []
    sym: list[bool] = []
    for rec, G in zip(opt.layers, grads):
        X, D = opt._samples(rec, scale, fisher_samples, None)
        X, D = X.to(G.dtype), D.to(G.dtype)
        parts += [X.T @ X, G.new_tensor([float(X.shape[0])]), D.T @ D]
        sym += [True, False, True]
        if red.grads == "local":
            parts.append(G)
            sym.append(False)
    out = red.sum_symmetric(parts, sym, "KFWhiten statistics")
    res: dict[str, dict[str, Any]] = {}
    i = 0
    for rec, G in zip(opt.layers, grads):
        XtX, K, DtD = out[i], float(out[i + 1][0]), out[i + 2]
        i += 3
        if red.grads == "local":
            G = out[i]
            i += 1
        _check_union(rec.name, G, XtX, DtD)
        res[rec.name] = {"XtX": XtX, "K": K, "DtD": DtD, "G": G}
    return res


def _check_union(name: str, *tensors: Tensor) -> None:
    """The reduced quantities carry a NaN/inf from any rank: every rank raises the same error."""
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        raise ValueError(f"the all-reduced gradient or statistics of layer {name!r} contain NaN or inf (on at least "
                         "one rank); nothing was changed")


def whiten_statistics(opt: Any, rec: Any, st: dict[str, Any], stats: dict[str, Any]) -> None:
    """KFWhiten's ``_update_statistics`` from reduced statistics: EMA, then the owner's eigendecompositions
    broadcast on a refresh step, else d = diag(V^T C_batch V) along the kept basis."""
    red = opt.distributed
    grp = opt._group()
    beta = grp["beta"]
    XtX, K, DtD = stats["XtX"], stats["K"], stats["DtD"]
    st["Cx"].mul_(beta).add_(XtX, alpha=(1 - beta) / K)
    st["Cd"].mul_(beta).add_(DtD, alpha=1 - beta)
    if (st["step"] - 1) % grp["inv_every"] == 0:
        owners = getattr(opt, "_owners", None)
        if owners is None:
            costs = [factor_cost(r.in_dim, r.out_dim) for r in opt.layers]
            owners = opt._owners = assign_owners(costs, red.world_size).owner
        owner = owners[[r.name for r in opt.layers].index(rec.name)]
        for C, d, V in (("Cx", "dx", "Vx"), ("Cd", "dd", "Vd")):
            n = st[C].shape[0]
            if red.rank == owner:
                w, Q = robust_eigh(st[C], st.get(V))
            else:
                w, Q = st[C].new_empty(n), st[C].new_empty(n, n)
            # the same fresh tensors on every rank, the owner's included (eigh's Q is column-major)
            st[V], st[d] = red.share([Q, w], owner, "broadcast of KFWhiten eigendecompositions")
        return
    st["dx"].mul_(beta).add_(((XtX @ st["Vx"]) * st["Vx"]).sum(0), alpha=(1 - beta) / K)
    st["dd"].mul_(beta).add_(((DtD @ st["Vd"]) * st["Vd"]).sum(0), alpha=1 - beta)


def bayes_inputs(opt: Any, scale: float, fisher_samples: dict[str, Any] | None, k: int | None
                 ) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
    """KFBayes/KFNatGrad: per layer the union's Fisher samples (X, D) and ascent gradient (module
    docstring)."""
    red = opt.distributed
    local_b, union_b = _union_batch(opt)
    grads = _ascent_gradients(opt, scale, union_b)
    if red.grads == "local":
        grads = red.sum(grads, "all_reduce of KFBayes gradients")
    own = [fisher_samples is None or rec.name not in fisher_samples for rec in opt.layers]
    positions = [rec.positions if o else 1 for rec, o in zip(opt.layers, own)]
    every = red.all_gather_object(positions, "all_gather of KFBayes positions per example")
    for j, rec in enumerate(opt.layers):   # every rank sees every rank's: all raise together
        if len({p[j] for p in every}) > 1:
            raise ValueError(f"layer {rec.name!r} got {sorted({p[j] for p in every})} rows per example on different "
                             "ranks; the union's examples need one shape: give every rank inputs of one shape")
    out = {}
    for rec, G, o, T in zip(opt.layers, grads, own, positions):
        if not o:
            X, D = opt._samples(rec, scale, fisher_samples, None)
            keep = None
        else:
            if rec.a is None or rec.delta is None:
                raise ValueError(f"no activations captured for layer {rec.name!r} on rank {red.rank}: run forward "
                                 "and backward on this rank's shard before step()")
            rec.check_positions()
            m = local_b if k is None else min(k, local_b)
            X, D = rec.rows(scale, m * T)
            keep = k
        rows = red.all_gather_rows(torch.cat([X.to(G.dtype), D.to(G.dtype)], dim=1))
        X, D = rows[:, :X.shape[1]], rows[:, X.shape[1]:]
        if keep is not None and keep < union_b:
            X, D = X[:keep * T], D[:keep * T] * (union_b / keep) ** 0.5
        _check_union(rec.name, G, X, D)
        out[rec.name] = (X, D, G)
    return out
