"""Predictions of a mean-field Gaussian posterior: MC-averaged softmax and the MAP (mean) prediction.

    p_MC(y | x) = (1/K_test) sum_k softmax(f(x; mu + sigma * eps_k))
    p_MAP(y | x) = softmax(f(x; mu))

(The MESU paper does not state its predictor; the MC-averaged softmax is the choice made here, and the
MAP prediction is provided as well.)

One eps per weight per sample, shared across all inputs (as in training). Inputs are processed in
chunks of ``batch_size`` rows to bound memory; the same K weight samples are used for every chunk. The
module is never changed: a BatchNorm in training mode normalises with the chunk's statistics and updates
only private copies of its running statistics, which are discarded.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.func import vmap

from curvkit.posterior.sampling import (
    _check_posterior,
    _fixed_tensors,
    sample_buffers,
    sample_eps,
    sample_weights,
)
from curvkit.structure import read_model


@torch.no_grad()
def predict_mc(
    model: nn.Module,
    inputs: Tensor,
    sigma: Mapping[str, Tensor],
    mc_samples: int = 10,
    generator: torch.Generator | None = None,
    batch_size: int | None = 1024,
    eps: Mapping[str, Tensor] | None = None,
) -> Tensor:
    """MC-averaged class probabilities, shape (N, C), of the posterior N(model params, sigma^2).

    ``sigma``: name -> tensor for the Bayesian parameters (others stay at their values); ``inputs``: (N, ...).
    """
    mu = {n: p.detach() for n, p in model.named_parameters() if n in sigma}
    _check_posterior(mu, sigma)
    if eps is None:
        eps = sample_eps(mu, mc_samples, generator)
    weights = sample_weights(mu, sigma, eps)
    fixed = _fixed_tensors(model, mu)

    structure = read_model(model)

    def probs(w: dict[str, Tensor], b: dict[str, Tensor], x: Tensor) -> Tensor:
        return structure.functional_call({**fixed, **w}, (x,), b).softmax(-1)

    batched = vmap(probs, in_dims=(0, 0, None), randomness="different")
    K = next(iter(eps.values())).shape[0]
    n = inputs.shape[0]
    step = n if batch_size is None else int(batch_size)
    if step < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    return torch.cat([batched(weights, sample_buffers(model, K), inputs[i:i + step]).mean(0)
                      for i in range(0, n, step)], dim=0)


@torch.no_grad()
def predict_map(model: nn.Module, inputs: Tensor, batch_size: int | None = 1024) -> Tensor:
    """Class probabilities (N, C) of the mean network w = mu (the MAP / deterministic prediction)."""
    n = inputs.shape[0]
    step = n if batch_size is None else int(batch_size)
    if step < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    return torch.cat([model(inputs[i:i + step]).softmax(-1) for i in range(0, n, step)], dim=0)
