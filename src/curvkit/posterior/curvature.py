"""Curvature of a model under a mean-field Gaussian posterior N(mu, diag(sigma^2)).

The MESU paper's Hessian analysis (Lemma 1 and Eq. 4) compares the optimiser's sigma with the expected
curvature of the loss over the posterior,

    H_D(mu)    = E_eps[ diag H(mu + |sigma| eps) ],
    H_D(sigma) = E_eps[ eps^2 * diag H(mu + |sigma| eps) ],        eps ~ N(0, I),

estimated here with the exact GGN diagonal (which equals the Hessian diagonal almost everywhere for
piecewise-linear networks, thesis Lemma 3.23) at ``num_samples`` weight samples.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from curvkit.likelihoods import Likelihood
from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import DiagonalOperator
from curvkit.validation import integer

__all__ = ["expected_ggn_diagonal"]


def expected_ggn_diagonal(model: nn.Module, likelihood: Likelihood, data: Any, sigma: Mapping[str, Tensor],
                          num_samples: int, generator: torch.Generator,
                          dtype: torch.dtype = torch.float64) -> tuple[DiagonalOperator, DiagonalOperator]:
    """(H_D(mu), H_D(sigma)) of the module docstring as DiagonalOperators over the trainable parameters.

    ``model`` holds mu (it is copied, never changed); ``sigma``: parameter name -> standard deviations of
    the parameter's shape (|sigma| is used); ``data``: an ``(X, y)`` pair or iterable of pairs on which
    the GGN of ``likelihood`` (its reduction) is taken. The noise is drawn from ``generator`` sample by
    sample, parameter by parameter in ``named_parameters`` order, in ``dtype`` (the copy's precision).
    """
    from curvkit.curvature.exact import GGNOperator

    integer("num_samples", num_samples)
    base = copy.deepcopy(model).to(dtype)
    mu = {n: p.detach().clone() for n, p in base.named_parameters() if p.requires_grad}
    missing = [n for n in mu if n not in sigma]
    if missing:
        raise ValueError(f"sigma lacks entries for parameters {missing}")
    for n, m in mu.items():
        if tuple(sigma[n].shape) != tuple(m.shape):
            raise ValueError(f"sigma[{n!r}] has shape {tuple(sigma[n].shape)}, expected {tuple(m.shape)}")
    h_mu: Tensor | None = None
    h_sig: Tensor | None = None
    params = dict(base.named_parameters())
    for _ in range(int(num_samples)):
        eps = {n: torch.randn(m.shape, generator=generator, dtype=dtype, device=generator.device).to(m.device)
               for n, m in mu.items()}
        with torch.no_grad():
            for n in mu:
                params[n].copy_(mu[n] + sigma[n].to(dtype).abs() * eps[n])
        d = GGNOperator(base, likelihood, data, snapshot=False).diagonal().flat
        e2 = torch.cat([eps[n].reshape(-1) for n in mu]) ** 2
        h_mu = d if h_mu is None else h_mu + d
        h_sig = d * e2 if h_sig is None else h_sig + d * e2
    assert h_mu is not None and h_sig is not None
    layout = ParamLayout.from_module(base)
    return (DiagonalOperator.from_flat(layout, h_mu / num_samples),
            DiagonalOperator.from_flat(layout, h_sig / num_samples))
