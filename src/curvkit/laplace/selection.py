"""Choosing a Laplace posterior's hyperparameters without recomputing its curvature.

* :func:`optimize_prior_precision` - maximise Laplace's log marginal likelihood
  (:meth:`curvkit.laplace.Laplace.log_marginal_likelihood`) over the prior precision (one value, or one
  per layer) by Adam on its logarithm; N stays fixed. Not in the thesis (it mentions the evidence only as
  future work, Ch. 1); the usual choice of Laplace libraries.
* :func:`grid_search` - the thesis's selection (Sec. 5.1.1, "treated as hyperparameters ... selected by the
  performance of the approximate predictive distribution on a validation set"): every (N, prior
  precision) pair of two grids, scored by the validation negative log predictive density; the best pair
  is set on the posterior. The thesis gives no grids; :func:`default_grids` follows the recommendation of
  logarithmic grids around the natural point (N = data size, lambda = the training prior precision).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from curvkit.laplace.predictive import glm_predictive, mc_predictive, predictive_nll
from curvkit.linalg.krylov import NotPositiveDefiniteError
from curvkit.structure import differentiable
from curvkit.validation import integer, positive

__all__ = ["default_grids", "grid_search", "optimize_prior_precision"]


@differentiable()
@torch.enable_grad()
def optimize_prior_precision(post: Any, per_layer: bool = False, steps: int = 200, lr: float = 0.1,
                             init: Any = None) -> Tensor:
    """Set (and return) the prior precision that maximises the log marginal likelihood.

    ``per_layer``: one value per layer instead of one shared value. ``steps`` Adam steps of size ``lr`` on
    log(lambda), started from ``init`` (default: the current prior precision). Runs with autograd on under any
    grad mode (``torch.no_grad``, ``torch.inference_mode``).
    """
    post._require_fit()
    steps, lr = integer("steps", steps), positive("lr", lr)
    start = post.prior_precision if init is None else post._as_prior(init)
    L = len(post.layer_names)
    log_lam = (start.log() if per_layer else start.log().mean().reshape(1)).clone().requires_grad_(True)
    opt = torch.optim.Adam([log_lam], lr=lr)
    best_val, best = -float("inf"), log_lam.detach().clone()
    for _ in range(steps):
        opt.zero_grad()
        lam = log_lam.exp() if per_layer else log_lam.exp().expand(L)
        value = post.log_marginal_likelihood(prior_precision=lam)
        if not bool(torch.isfinite(value)):
            raise FloatingPointError("the log marginal likelihood became non-finite; lower lr or give init")
        if float(value.detach()) > best_val:
            best_val, best = float(value.detach()), log_lam.detach().clone()
        (-value).backward()
        opt.step()
    lam = best.exp() if per_layer else best.exp().expand(L)
    post.prior_precision = lam.detach()
    return post.prior_precision


def _union_nll(post: Any, prediction: Any, y: Tensor) -> float:
    """The validation NLL of the union of the ranks' validation shards (a posterior with ``distributed=``): the
    ranks' sums over their counted targets divided by the union's count (one all-reduce of two scalars)."""
    lik = post.likelihood
    y = y.to(post.device)
    terms = lik.predictive_nll_terms(prediction, y)
    keep = lik.mask(y)
    total, count = (terms.sum(), terms.numel()) if keep is None else (terms[keep].sum(), int(keep.sum()))
    total, count = post.distributed.sum_scalars(float(total), count)
    if count == 0:
        raise ValueError("grid_search: every validation target of every rank is padding; there is nothing to score")
    return total / count


def default_grids(num_data: float, prior_precision: float) -> tuple[list[float], list[float]]:
    """N in num_data * {1, 10, ..., 1e6}; lambda in prior_precision * {1e-4, ..., 1e4} plus the natural
    values (7 x 9 points)."""
    return ([num_data * 10.0**k for k in range(7)], [prior_precision * 10.0**k for k in range(-4, 5)])


def grid_search(post: Any, val_data: tuple[Tensor, Tensor], num_data_grid: Sequence[float],
                prior_grid: Sequence[float], method: str = "mc", num_samples: int = 100, seed: int = 0,
                batch_size: int = 1024, link: str = "probit") -> dict[str, Any]:
    """Score every (N, lambda) pair by the validation NLL of the ``method`` predictive ('mc': Eq. 5.9 with
    ``num_samples`` samples from a generator seeded ``seed`` for every pair, so pairs differ only by the
    hyperparameters; 'glm' with ``link``); set the best pair on ``post``. Pairs whose precision is not
    positive definite score inf. Returns ``{'best': (N, lambda), 'nll': best score, 'table': [(N, lambda,
    nll), ...]}``. A posterior fitted with ``distributed=`` scores the union of the ranks' ``val_data`` shards
    (every rank passes its own, and gets the same table and the same choice)."""
    X, y = val_data
    if not num_data_grid or not prior_grid:
        raise ValueError("both grids need at least one value")
    table = []
    best: tuple[float, float, float] | None = None
    for N in num_data_grid:
        for lam in prior_grid:
            post.num_data, post.prior_precision = positive("N", N), positive("prior precision", lam)
            try:
                if method == "mc":
                    gen = torch.Generator(device=post.device).manual_seed(int(seed))
                    pred = mc_predictive(post, X, num_samples=num_samples, generator=gen, batch_size=batch_size)
                elif method == "glm":
                    pred = glm_predictive(post, X, link=link, batch_size=batch_size)  # type: ignore[arg-type]
                else:
                    raise ValueError(f"method must be 'mc' or 'glm', got {method!r}")
                nll = predictive_nll(post, pred, y) if post.distributed is None else _union_nll(post, pred, y)
            except NotPositiveDefiniteError:
                nll = float("inf")
            table.append((float(N), float(lam), nll))
            if best is None or nll < best[2]:
                best = (float(N), float(lam), nll)
    assert best is not None
    post.num_data, post.prior_precision = best[0], best[1]
    return {"best": (best[0], best[1]), "nll": best[2], "table": table}
