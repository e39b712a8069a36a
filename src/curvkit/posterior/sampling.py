"""Functional weight sampling for a mean-field Gaussian posterior over a plain ``nn.Module``.

The posterior is q(w) = N(mu, diag(sigma^2)) with one mu and one sigma per scalar parameter (MESU paper,
section 2: w = mu + eps * sigma, eps ~ N(0, 1)). ``mu`` are the module's own parameters; ``sigma`` lives
elsewhere (in the optimiser state) and is passed in as a name -> tensor dict. Weights are sampled
functionally, never written into the module:

    w_k = mu + sigma * eps_k,   eps_k ~ N(0, I),   k = 1..K                      (reparameterisation)

with **one eps per scalar weight per Monte Carlo sample, shared by every example of the minibatch** (weight
sampling; the MESU paper does not say, and this is what Zeno et al.'s BGD code and the MESU authors' later
code do; not the local reparameterisation trick, which would change the sigma-gradient estimator). The K
samples are evaluated together with ``torch.func.vmap`` over ``functional_call``, so any module that
``functional_call`` supports (MLPs, CNNs, ...) works, and the module itself is never changed
(:meth:`curvkit.structure.ModelStructure.functional_call`).

Gradient estimators (paper Eq. 1, Bayes by Backprop), for C = E_q[L(w)]:

    g_mu    = (1/K) sum_k grad_w L(w_k)            ~ dC/dmu       (1a)
    g_sigma = (1/K) sum_k grad_w L(w_k) * eps_k    ~ dC/dsigma    (1b)

Shapes: ``mu[name]`` and ``sigma[name]`` have the parameter's shape; ``eps[name]`` has shape
``(K, *shape)``; the returned gradients have the parameter's shape; ``losses`` has shape (K,).
Parameters of the module that are not keys of ``mu`` stay deterministic at their current values.
Inputs are passed to the module as they are (any shape, e.g. (B, T, F) token features, and any dtype,
e.g. integer token ids for an ``nn.Embedding``); only ``loss_fn`` interprets the outputs.

Running statistics (BatchNorm in training mode): every weight sample normalises with its own batch
statistics, as in training, and updates its own copy of the running statistics
(:func:`running_stat_buffers`); the module's buffers are never written here. :attr:`MCGradients.buffers`
holds the mean over the K samples of the updated statistics (the integer step counter once), which the
optimiser writes back once per step (so one step updates them once, with the batch statistics averaged over
the posterior samples, where ordinary training uses those of its single weight vector).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import grad_and_value, vmap

from curvkit.likelihoods import Likelihood
from curvkit.structure import read_model

LossFn = Callable[[Tensor, Tensor], Tensor]
"""loss_fn(outputs, targets) -> scalar loss of one weight sample on the whole minibatch (e.g. a
:class:`curvkit.likelihoods.Likelihood` with ``reduction='sum'``)."""


@dataclass
class MCGradients:
    """Monte Carlo gradient estimates of one step (paper Eq. 1).

    Attributes:
        g_mu: name -> (shape) mean over samples of grad_w L(w_k)  (Eq. 1a).
        g_sigma: name -> (shape) mean over samples of grad_w L(w_k) * eps_k  (Eq. 1b).
        losses: (K,) loss of each weight sample.
        eps: name -> (K, *shape) the noise that was used.
        buffers: buffer name -> the running statistics after this batch (module docstring), or None when
            no module updates running statistics.
    """

    g_mu: dict[str, Tensor]
    g_sigma: dict[str, Tensor]
    losses: Tensor
    eps: dict[str, Tensor]
    buffers: dict[str, Tensor] | None = None

    @property
    def loss(self) -> Tensor:
        """MC estimate of C = E_q[L]: the mean of ``losses``."""
        return self.losses.mean()


def likelihood_loss(lik: Likelihood) -> LossFn:
    """A vmap-safe, fast ``loss_fn`` from a :class:`~curvkit.likelihoods.Likelihood`: its reduced NLL
    without the data-dependent validity checks (which cannot run under ``vmap``). For
    :class:`~curvkit.likelihoods.CrossEntropy` without padding it uses ``log_softmax`` + ``gather`` over the
    last (class) dimension, several times faster under ``vmap`` than ``F.cross_entropy`` (which has no
    batching rule of its own); logits (B, *P, C) with targets (B, *P) give one term per position."""
    return lik.vmap_loss()


def _check_posterior(mu: Mapping[str, Tensor], sigma: Mapping[str, Tensor]) -> None:
    if set(mu) != set(sigma):
        raise ValueError(f"mu and sigma must have the same parameter names; got {sorted(mu)} vs {sorted(sigma)}")
    for name, m in mu.items():
        if sigma[name].shape != m.shape:
            raise ValueError(f"sigma[{name!r}] has shape {tuple(sigma[name].shape)}, expected {tuple(m.shape)}")


def sample_eps(
    mu: Mapping[str, Tensor], mc_samples: int, generator: torch.Generator | None = None
) -> dict[str, Tensor]:
    """Standard normal noise, one draw per scalar weight per sample: name -> (K, *shape).

    Drawn parameter by parameter in the iteration order of ``mu`` from ``generator``, so that the
    vectorised and the looped estimators see exactly the same noise for the same generator state.
    """
    if int(mc_samples) < 1:
        raise ValueError(f"mc_samples must be >= 1, got {mc_samples}")
    return {
        name: torch.randn((int(mc_samples), *m.shape), generator=generator, dtype=m.dtype, device=m.device)
        for name, m in mu.items()
    }


def sample_weights(
    mu: Mapping[str, Tensor], sigma: Mapping[str, Tensor], eps: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """w_k = mu + sigma * eps_k for every parameter: name -> (K, *shape)."""
    _check_posterior(mu, sigma)
    return {name: torch.addcmul(mu[name].detach(), sigma[name].detach(), eps[name]) for name in mu}


def _fixed_tensors(model: nn.Module, exclude: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The deterministic parameters, detached (no graph through them)."""
    return {n: p.detach() for n, p in model.named_parameters() if n not in exclude}


def running_stat_buffers(model: nn.Module) -> list[str]:
    """Canonical names of the buffers a forward pass writes: the running statistics (``running_mean``,
    ``running_var``, ``num_batches_tracked``) of every BatchNorm module in training mode that tracks them."""
    owner = {id(b): n for n, b in model.named_buffers()}
    names = []
    for _, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training and mod.track_running_stats:
            names += [owner[id(b)] for b in mod._buffers.values() if b is not None and id(b) in owner]
    return names


def sample_buffers(model: nn.Module, mc_samples: int) -> dict[str, Tensor]:
    """One private copy per weight sample of every buffer the forward pass writes: name -> (K, *shape)."""
    own = dict(model.named_buffers())
    return {n: own[n].detach().unsqueeze(0).expand(int(mc_samples), *own[n].shape).clone()
            for n in running_stat_buffers(model)}


def mean_buffers(buffers: Mapping[str, Tensor]) -> dict[str, Tensor] | None:
    """The K per-sample buffer copies reduced to one update: floating-point statistics averaged, integer
    counters (identical across samples) taken once; None when there are none."""
    if not buffers:
        return None
    return {n: b.mean(0) if b.is_floating_point() else b[0] for n, b in buffers.items()}


def _loss_of(model: nn.Module, loss_fn: LossFn, fixed: dict[str, Tensor]) -> Callable[..., Tensor]:
    structure = read_model(model)

    def f(weights: dict[str, Tensor], buffers: dict[str, Tensor], inputs: Tensor, targets: Tensor) -> Tensor:
        out = structure.functional_call({**fixed, **weights}, (inputs,), buffers)
        return loss_fn(out, targets)

    return f


def mc_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Tensor,
    targets: Tensor,
    mu: Mapping[str, Tensor],
    sigma: Mapping[str, Tensor],
    mc_samples: int = 10,
    generator: torch.Generator | None = None,
    eps: Mapping[str, Tensor] | None = None,
    chunk_size: int | None = None,
) -> MCGradients:
    """Vectorised MC estimates of dC/dmu and dC/dsigma (Eq. 1) from K weight samples.

    The K samples are evaluated in one ``vmap(grad_and_value(...))`` call (``chunk_size`` limits how
    many are processed at once to bound memory). Pass ``eps`` (name -> (K, *shape)) to reuse given noise;
    otherwise it is drawn with :func:`sample_eps` from ``generator``. ``mu`` defaults to the module's
    values for those names; the estimate does not build a graph through ``mu``/``sigma``. The module itself
    is not changed (running statistics: the module docstring).
    """
    _check_posterior(mu, sigma)
    if eps is None:
        eps = sample_eps(mu, mc_samples, generator)
    weights = sample_weights(mu, sigma, eps)
    buffers = sample_buffers(model, next(iter(eps.values())).shape[0])
    f = _loss_of(model, loss_fn, _fixed_tensors(model, mu))
    batched = vmap(grad_and_value(f), in_dims=(0, 0, None, None), chunk_size=chunk_size, randomness="different")
    grads, losses = batched(weights, buffers, inputs, targets)
    g_mu = {n: g.mean(0) for n, g in grads.items()}
    g_sigma = {n: g.mul_(eps[n]).mean(0) for n, g in grads.items()}   # per-sample grads are ours: in place
    return MCGradients(g_mu, g_sigma, losses.detach(), dict(eps), mean_buffers(buffers))


def mc_gradients_loop(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Tensor,
    targets: Tensor,
    mu: Mapping[str, Tensor],
    sigma: Mapping[str, Tensor],
    mc_samples: int = 10,
    generator: torch.Generator | None = None,
    eps: Mapping[str, Tensor] | None = None,
) -> MCGradients:
    """Reference implementation of :func:`mc_gradients`: K sequential forward/backward passes.

    Same inputs, same noise (for the same ``eps`` or generator state), same result up to float
    rounding. Used by the tests and as the baseline of ``benchmarks/mesu.py``.
    """
    _check_posterior(mu, sigma)
    if eps is None:
        eps = sample_eps(mu, mc_samples, generator)
    K = next(iter(eps.values())).shape[0]
    fixed = _fixed_tensors(model, mu)
    f = _loss_of(model, loss_fn, fixed)
    buffers = sample_buffers(model, K)
    names = list(mu)
    g_mu = {n: torch.zeros_like(mu[n]) for n in names}
    g_sigma = {n: torch.zeros_like(mu[n]) for n in names}
    losses = []
    for k in range(K):
        w = {n: (mu[n].detach() + sigma[n].detach() * eps[n][k]).requires_grad_(True) for n in names}
        loss = f(w, {n: b[k] for n, b in buffers.items()}, inputs, targets)
        grads = torch.autograd.grad(loss, [w[n] for n in names])
        for n, g in zip(names, grads):
            g_mu[n] += g / K
            g_sigma[n] += g * eps[n][k] / K
        losses.append(loss.detach())
    return MCGradients(g_mu, g_sigma, torch.stack(losses), dict(eps), mean_buffers(buffers))
