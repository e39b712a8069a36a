"""SGLD from the localized tempered posterior, several chains vectorised together.

Target density (paper eq. 20, in devinterp's convention, digest section 2.5 and ambiguity 7):

    p(w | D_n, w*) ∝ exp( -nβ L_n(w) - (γ/2) ||w - w*||² ),

sampled by the SGLD update (paper eq. 21 with the 1/m of Lau et al. restored, digest ambiguity 8)

    w <- w - (ε/2) (nβ ∇ℓ_B(w) + γ (w - w*)) + sqrt(ε) ξ,    ξ ~ N(0, I),

where ℓ_B is the *mean* loss over a minibatch B of size m (or the full data set). Conventions, made
explicit (all are fields of :class:`SGLDConfig`):

* ``nbeta`` = nβ, the inverse temperature times n. ``"m/log m"`` (default) is devinterp's
  ``default_nbeta`` = batch size / ln(batch size), which the paper's results used (26.38 for m = 128);
  ``"n/log n"`` is the theory value β* = 1/ln n of Watanabe/Lau et al.; a float is used as given.
* ``gamma`` = γ multiplies (w - w*) in the drift, i.e. the localizing potential is (γ/2)||w - w*||²
  (devinterp; paper eq. 20 prints γ||w - w*||²).
* ``epsilon`` = ε, the step size; the injected noise has variance ε.
* ``num_burnin`` steps are discarded; then one draw is kept every ``thinning`` steps until
  ``num_draws`` draws per chain exist. The recorded loss of a draw is the minibatch loss evaluated
  *before* that step's update (devinterp).

All chains advance together: parameters are stacked along a leading chain axis (C, *shape) and the
per-chain loss gradient is one ``torch.func.vmap(grad_and_value(loss))`` call through
``torch.func.functional_call``; the model stays a plain ``nn.Module``. With minibatches every chain
reads its own shuffled stream of the data (independent chains); with ``batch_size=None`` all chains
use the full data set. Randomness (minibatch order, noise) comes from one ``torch.Generator``.

A chain whose loss or parameters become NaN/inf raises :class:`SGLDDivergenceError` naming the
setting (ε, γ, nβ) rather than returning a number.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

Params = dict[str, Tensor]
LossFn = Callable[[Params, Any], Tensor]


class SGLDDivergenceError(RuntimeError):
    """A chain's loss or parameters became NaN/inf: the sampler settings are unstable."""


@dataclass(frozen=True)
class SGLDConfig:
    """SGLD settings (devinterp names in brackets: lr, localization, nbeta, num_chains, num_draws,
    num_burnin_steps, num_steps_bw_draws). Defaults are the paper's repository settings (digest 2.5)
    except ``num_chains`` (4 instead of 1-2)."""

    epsilon: float = 1e-4
    gamma: float = 100.0
    nbeta: float | str = "m/log m"
    num_chains: int = 4
    num_draws: int = 1000
    num_burnin: int = 0
    thinning: int = 1
    init_loss: str = "minibatch"  # "minibatch" (devinterp) or "full" (L_n(w*) on all data)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"SGLD step size epsilon must be a positive finite number, got {self.epsilon}")
        if not (math.isfinite(self.gamma) and self.gamma >= 0):
            raise ValueError(f"localization gamma must be finite and >= 0, got {self.gamma}")
        if isinstance(self.nbeta, str):
            if self.nbeta not in ("m/log m", "n/log n"):
                raise ValueError(f"nbeta must be a positive number, 'm/log m' or 'n/log n', got {self.nbeta!r}")
        elif not (math.isfinite(self.nbeta) and self.nbeta > 0):
            raise ValueError(f"nbeta must be positive and finite, got {self.nbeta}")
        for name in ("num_chains", "num_draws", "thinning"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if int(self.num_burnin) < 0:
            raise ValueError(f"num_burnin must be >= 0, got {self.num_burnin}")
        if self.init_loss not in ("minibatch", "full"):
            raise ValueError(f"init_loss must be 'minibatch' or 'full', got {self.init_loss!r}")

    @property
    def num_steps(self) -> int:
        return int(self.num_burnin) + int(self.num_draws) * int(self.thinning)

    def resolve_nbeta(self, batch_size: int, n: int) -> float:
        """nβ as a number: 'm/log m' uses the batch size m, 'n/log n' the data-set size n."""
        if isinstance(self.nbeta, str):
            k = batch_size if self.nbeta == "m/log m" else n
            if k < 2:
                raise ValueError(f"nbeta={self.nbeta!r} needs a size >= 2, got {k}")
            return k / math.log(k)
        return float(self.nbeta)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class MinibatchStream:
    """Per-chain shuffled minibatches of (X, y): ``next()`` returns (X (C, m, ...), y (C, m, ...)).

    Each chain walks through its own random permutation of the n points in batches of m (the last
    incomplete batch of a pass is dropped so that shapes stay fixed), then draws a new permutation.
    ``batch_size=None`` (or >= n) gives the full data set, shared by all chains (no chain axis).
    """

    def __init__(self, X: Tensor, y: Tensor, batch_size: int | None, num_chains: int,
                 generator: torch.Generator):
        if X.shape[0] != y.shape[0]:
            raise ValueError(f"X has {X.shape[0]} rows but y has {y.shape[0]}")
        self.X, self.y, self.C, self.gen = X, y, num_chains, generator
        self.n = X.shape[0]
        self.full = batch_size is None or batch_size >= self.n
        self.m = self.n if self.full else int(batch_size)  # type: ignore[arg-type]
        if self.m < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self._perm: Tensor | None = None
        self._pos = 0

    @property
    def chain_axis(self) -> int | None:
        return None if self.full else 0

    def __next__(self) -> tuple[Tensor, Tensor]:
        if self.full:
            return self.X, self.y
        if self._perm is None or self._pos + self.m > self.n:
            self._perm = torch.stack([torch.randperm(self.n, generator=self.gen) for _ in range(self.C)])
            self._perm = self._perm.to(self.X.device)
            self._pos = 0
        idx = self._perm[:, self._pos:self._pos + self.m]
        self._pos += self.m
        return self.X[idx], self.y[idx]


@dataclass
class SGLDRun:
    """Raw output of :func:`run_sgld`: losses (C, T) of the kept draws, final parameters (C, ...)."""

    losses: Tensor
    final_params: Params
    nbeta: float
    seconds: float


def _divergence_message(cfg: SGLDConfig, nbeta: float, step: int, chains: list[int], what: str) -> str:
    return (
        f"SGLD diverged ({what}) at step {step} in chain(s) {chains} with epsilon={cfg.epsilon:g}, "
        f"gamma={cfg.gamma:g}, nbeta={nbeta:g}. The step is unstable when epsilon*(nbeta*curvature + gamma) "
        "approaches 4; reduce epsilon, or increase gamma, or lower nbeta."
    )


def run_sgld(loss_fn: LossFn, w_star: Params, batches: Callable[[], Any], batch_axis: int | None,
             config: SGLDConfig, nbeta: float, generator: torch.Generator,
             check_every: int = 100) -> SGLDRun:
    """Run ``config.num_chains`` SGLD chains from ``w_star`` in lock-step.

    ``loss_fn(params, batch) -> scalar`` is the mean loss of one chain (params: name -> tensor of the
    parameter's own shape); ``batches()`` returns the next batch, stacked over chains along
    ``batch_axis`` (or shared when ``batch_axis`` is None). Returns the pre-update losses of the kept
    draws as a (C, num_draws) tensor.

    Cost per step: one vmap'd forward/backward (the matrix products), C·d Gaussian draws and four
    in-place passes over the (C, d) parameters. Nothing is copied to the host inside the loop: the
    losses of all steps stay in a (C, num_steps) buffer on the parameters' device, checked for NaN/inf
    every ``check_every`` steps and at the end (a divergence is still reported at its first step).
    """
    if check_every < 1:
        raise ValueError(f"check_every must be a positive integer, got {check_every}")
    C = int(config.num_chains)
    anchor = {k: v.detach() for k, v in w_star.items()}
    names = list(anchor)
    params = {k: v.unsqueeze(0).repeat(C, *([1] * v.dim())).clone() for k, v in anchor.items()}
    plist = [params[k] for k in names]
    alist = [anchor[k].unsqueeze(0) for k in names]  # broadcast over the chain axis
    # noise buffers on the generator's device (same draws as torch.randn(shape, generator=...))
    noise = [torch.empty(p.shape, dtype=p.dtype, device=generator.device) for p in plist]
    step_fn = vmap(grad_and_value(loss_fn), in_dims=(0, batch_axis))
    eps, gamma = float(config.epsilon), float(config.gamma)
    noise_scale = math.sqrt(eps)
    T = config.num_steps
    trace: Tensor | None = None  # (C, T) losses of every step, allocated with the loss's dtype/device
    checked = 0

    def check(upto: int) -> None:
        nonlocal checked
        if trace is not None and upto > checked:
            block = trace[:, checked:upto]
            finite = torch.isfinite(block)
            if not bool(finite.all()):
                col = int((~finite).any(dim=0).nonzero()[0])
                bad = (~finite[:, col]).nonzero().flatten().tolist()
                raise SGLDDivergenceError(_divergence_message(config, nbeta, checked + col, bad,
                                                              "loss is NaN/inf"))
            checked = upto

    t0 = time.perf_counter()
    for step in range(T):
        grads, values = step_fn(params, batches())
        if trace is None:
            trace = torch.empty(C, T, dtype=values.dtype, device=values.device)
        trace[:, step] = values.detach()
        with torch.no_grad():
            # w <- w - (ε/2)(nβ g + γ (w - w*)) + sqrt(ε) ξ, written as in-place passes
            diffs = torch._foreach_sub(plist, alist)
            torch._foreach_mul_(diffs, gamma)
            torch._foreach_add_(diffs, [grads[k] for k in names], alpha=nbeta)
            torch._foreach_add_(plist, diffs, alpha=-0.5 * eps)
            for z in noise:
                torch.randn(z.shape, generator=generator, dtype=z.dtype, device=z.device, out=z)
            if noise[0].device == plist[0].device:
                torch._foreach_add_(plist, noise, alpha=noise_scale)
            else:
                torch._foreach_add_(plist, [z.to(plist[0].device) for z in noise], alpha=noise_scale)
        if (step + 1) % check_every == 0:
            check(step + 1)
    check(T)
    kept = torch.arange(int(config.num_burnin), T, int(config.thinning))[: int(config.num_draws)]
    assert trace is not None  # num_steps >= 1
    losses = trace[:, kept.to(trace.device)].to(torch.float64).cpu()
    bad_params = [c for c in range(C) if not all(bool(torch.isfinite(p[c]).all()) for p in params.values())]
    if bad_params:
        raise SGLDDivergenceError(_divergence_message(config, nbeta, config.num_steps, bad_params,
                                                      "parameters are NaN/inf"))
    return SGLDRun(losses, params, nbeta, time.perf_counter() - t0)


def module_loss_fn(model: nn.Module, criterion: Callable[[Tensor, Tensor], Tensor]) -> LossFn:
    """``loss(params, (x, y)) = criterion(model(x; params), y)`` via ``functional_call`` (buffers fixed)."""
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss(params: Params, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        out = functional_call(model, (params, buffers), (x,))
        return criterion(out, y)

    return loss


def model_params(model: nn.Module) -> Params:
    """Trainable parameters (detached copies), in ``named_parameters()`` order."""
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
