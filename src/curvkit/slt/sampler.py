"""SGLD from the localized tempered posterior, several chains vectorised together.

Target density (paper eq. 20 in the convention of devinterp, which the paper's authors used: eq. 20
prints the localizing term as γ||w - w*||², devinterp's drift gives (γ/2)||w - w*||²):

    p(w | D_n, w*) ∝ exp( -nβ L_n(w) - (γ/2) ||w - w*||² ),

sampled by the SGLD update (paper eq. 21, which drops the 1/m of Lau et al.'s minibatch sum; restored here)

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
:meth:`curvkit.structure.ModelStructure.functional_call` (which never changes the user's module); the
model stays a plain ``nn.Module``. For an MLP chain (``curvkit.structure.read_model(model).mlp_chain``:
``nn.Sequential`` of [``nn.Flatten``] ``nn.Linear`` and elementwise activations)
:func:`stacked_mlp_grad_fn` computes the same gradients with batched matrix products and one
``autograd.grad`` call, which avoids vmap's per-step overhead (about 5% of a step on a CPU); both give
the same numbers up to rounding. A batch larger than a memory budget is processed in pieces whose
gradients and losses are combined with weights m_k/m (:func:`chunked_grad_fn`): the same numbers up to
rounding, with memory bounded by a piece.

Minibatch policy (``shared_batches``): by default every chain reads its own shuffled stream of the
data (independent chains); ``shared_batches=True`` gives all chains the same sequence of minibatches
(devinterp's default ``match_sampling_input_ids_across_chains=True``), so the chains differ only
through the noise. Each chain's distribution is the same either way; shared batches make the chains'
estimates positively correlated, so the spread over chains then leaves out the minibatch-sequence
error. With ``batch_size=None`` all chains use the full data set. Randomness (minibatch order, noise)
comes from one ``torch.Generator``.

The update is applied as three in-place passes per step, w <- w + (εγ/2)(w* - w) (``lerp``),
w <- w - (εnβ/2) g, w <- w + sqrt(ε) ξ, which is the update above regrouped (same distribution;
results equal the earlier five-pass form up to floating-point rounding). The noise ξ is drawn with
``torch.randn(..., generator=, out=)`` into preallocated buffers, one call per parameter (on a CPU this
is bound by the Mersenne-Twister generator; ``normal_`` and one flat draw cost the same).

A chain whose loss or parameters become NaN/inf raises :class:`SGLDDivergenceError` naming the
setting (ε, γ, nβ) rather than returning a number; a loss that is already NaN/inf at w*, before any
update, is not a divergence and raises a ``ValueError`` pointing at the data and the model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad_and_value, vmap

from curvkit.structure import UnsupportedModelError, read_model
from curvkit.validation import integer, map_inputs, nonnegative, num_samples, positive, take_samples

Params = dict[str, Tensor]
LossFn = Callable[[Params, Any], Tensor]
# chain-batched gradient: (params stacked (C, *shape), batch) -> (gradients (C, *shape), losses (C,))
GradFn = Callable[[Params, Any], tuple[Params, Tensor]]


class SGLDDivergenceError(RuntimeError):
    """A chain's loss or parameters became NaN/inf: the sampler settings are unstable."""


def count(name: str, value: Any, minimum: int = 1) -> int:
    """:func:`curvkit.validation.integer` that also words NaN/inf like every other refusal."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return integer(name, value, minimum=minimum)


@dataclass(frozen=True)
class SGLDConfig:
    """SGLD settings (devinterp names in brackets: lr, localization, nbeta, num_chains, num_draws,
    num_burnin_steps, num_steps_bw_draws). Defaults are the settings in the paper's code (the paper
    itself states none) except ``num_chains`` (4 instead of 1-2)."""

    epsilon: float = 1e-4
    gamma: float = 100.0
    nbeta: float | str = "m/log m"
    num_chains: int = 4
    num_draws: int = 1000
    num_burnin: int = 0
    thinning: int = 1
    init_loss: str = "minibatch"  # "minibatch" (devinterp) or "full" (L_n(w*) on all data)
    shared_batches: bool = False  # True: all chains see the same minibatches (devinterp's default)

    def __post_init__(self) -> None:
        # numbers are stored as float and int (2.0 is a valid num_chains; 2.5, True, NaN and inf are not)
        object.__setattr__(self, "epsilon", positive("SGLD step size epsilon", self.epsilon))
        object.__setattr__(self, "gamma", nonnegative("localization gamma", self.gamma))
        if isinstance(self.nbeta, str):
            if self.nbeta not in ("m/log m", "n/log n"):
                raise ValueError(f"nbeta must be a positive number, 'm/log m' or 'n/log n', got {self.nbeta!r}")
        else:
            object.__setattr__(self, "nbeta", positive("nbeta", self.nbeta))
        for name, minimum in (("num_chains", 1), ("num_draws", 1), ("thinning", 1), ("num_burnin", 0)):
            object.__setattr__(self, name, count(name, getattr(self, name), minimum=minimum))
        if self.init_loss not in ("minibatch", "full"):
            raise ValueError(f"init_loss must be 'minibatch' or 'full', got {self.init_loss!r}")
        if not isinstance(self.shared_batches, bool):
            raise ValueError(f"shared_batches must be True or False, got {self.shared_batches!r}")

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
    ``shared=True`` draws one permutation for all chains and returns unstacked batches (X (m, ...),
    y (m, ...); no chain axis), as devinterp does by default. ``batch_size=None`` (or >= n) gives the
    full data set, shared by all chains (no chain axis).
    """

    def __init__(self, X: Any, y: Tensor, batch_size: int | None, num_chains: int,
                 generator: torch.Generator, shared: bool = False):
        n = num_samples(X) if not isinstance(X, Tensor) or X.dim() > 0 else 0
        if y.dim() == 0 or n != y.shape[0] or n == 0:
            raise ValueError(f"X and y must share a positive leading (sample) size, got {n} inputs and targets of "
                             f"shape {tuple(y.shape)}")
        self.X, self.y, self.C, self.gen = X, y, count("num_chains", num_chains), generator
        self.n = n
        if batch_size is not None:
            batch_size = count("batch_size", batch_size)
        self.full = batch_size is None or batch_size >= self.n
        self.m = self.n if self.full else int(batch_size)  # type: ignore[arg-type]
        self.shared = bool(shared)
        self._perm: Tensor | None = None
        self._pos = 0

    @property
    def chain_axis(self) -> int | None:
        return None if self.full or self.shared else 0

    def __next__(self) -> tuple[Any, Tensor]:
        if self.full:
            return self.X, self.y
        if self._perm is None or self._pos + self.m > self.n:
            k = 1 if self.shared else self.C
            self._perm = torch.stack([torch.randperm(self.n, generator=self.gen) for _ in range(k)])
            self._perm = self._perm.to(self.y.device)
            self._pos = 0
        idx = self._perm[0 if self.shared else slice(None), self._pos:self._pos + self.m]
        self._pos += self.m
        return take_samples(self.X, idx), self.y[idx]  # a mapping: the same rows of every tensor


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
             check_every: int = 100, grad_fn: GradFn | None = None) -> SGLDRun:
    """Run ``config.num_chains`` SGLD chains from ``w_star`` in lock-step.

    ``loss_fn(params, batch) -> scalar`` is the mean loss of one chain (params: name -> tensor of the
    parameter's own shape); ``batches()`` returns the next batch, stacked over chains along
    ``batch_axis`` (or shared when ``batch_axis`` is None). Returns the pre-update losses of the kept
    draws as a (C, num_draws) tensor. ``grad_fn`` replaces the default
    ``vmap(grad_and_value(loss_fn), in_dims=(0, batch_axis))`` (e.g. :func:`stacked_mlp_grad_fn`).

    Cost per step: one vmap'd forward/backward (the matrix products), C·d Gaussian draws and three
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
    step_fn: GradFn = grad_fn if grad_fn is not None else vmap(grad_and_value(loss_fn), in_dims=(0, batch_axis))
    eps, gamma = float(config.epsilon), float(config.gamma)
    noise_scale = math.sqrt(eps)
    pull, drift = 0.5 * eps * gamma, -0.5 * eps * nbeta
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
                if checked + col == 0:  # the first loss is at w*, before any update: not a divergence
                    raise ValueError(f"the loss at w* (before any SGLD step) is NaN/inf in chain(s) {bad}: the "
                                     "model's output or the loss is not finite on the first minibatch; check the "
                                     "data (NaN/inf inputs, targets the loss cannot take) and the model at w*")
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
            # w <- w - (ε/2)(nβ g + γ (w - w*)) + sqrt(ε) ξ as three in-place passes:
            # w += (εγ/2)(w* - w);  w -= (εnβ/2) g;  w += sqrt(ε) ξ
            if pull != 0.0:
                torch._foreach_lerp_(plist, alist, pull)
            torch._foreach_add_(plist, [grads[k] for k in names], alpha=drift)
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
    """``loss(params, (x, y)) = criterion(model(x; params), y)``, evaluated with
    :meth:`curvkit.structure.ModelStructure.functional_call` (buffers fixed at their current values;
    the user's module is never changed, shared parameters and reused modules included)."""
    structure = read_model(model)
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss(params: Params, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        out = structure.functional_call(params, (x,), buffers)
        return criterion(out, y)

    return loss


def model_params(model: nn.Module) -> Params:
    """Trainable parameters (detached copies), in ``named_parameters()`` order."""
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


def stacked_mlp_grad_fn(model: nn.Module, criterion: Callable[[Tensor, Tensor], Tensor],
                        batch_axis: int | None, input_shape: tuple[int, ...] | None = None) -> GradFn | None:
    """Chain-batched loss gradient of a plain MLP without ``vmap``; None if ``model`` is not one.

    ``model`` must be an MLP chain as :meth:`curvkit.structure.ModelStructure.mlp_chain` reads it: an
    ``nn.Sequential`` of [``nn.Flatten``] ``nn.Linear`` (activations...) ``nn.Linear`` ... ``nn.Linear``,
    activations from :data:`curvkit.structure.ELEMENTWISE`, every parameter trainable, nothing shared;
    anything else returns None (the caller then uses ``vmap``). ``input_shape`` (one sample's shape,
    optional): None is also returned unless such inputs reach the first Linear as vectors.
    With stacked weights W (C, out, in), b (C, out) each layer is hᵀ <- W hᵀ + b as one batched
    matrix product (``baddbmm``; with a batch shared by all chains, ``batch_axis=None``, the first
    layer is one (C·out, in) x (in, m) product); the activations broadcast over the chain axis.
    The per-chain losses ``criterion(f_c (m, k), y_c)`` (a mean over the batch) come from a vmap over
    the small output only, and one ``torch.autograd.grad`` of their sum gives every chain's gradient
    (the chains do not interact). Same numbers as ``vmap(grad_and_value(loss))`` up to rounding.
    """
    if any(True for _ in model.buffers()):
        return None
    try:
        chain = read_model(model).mlp_chain("batched SGLD gradient")
    except UnsupportedModelError:
        return None
    flatten = chain.flatten
    if input_shape is not None:
        probe = torch.empty(1, *input_shape, device="meta")
        if (flatten(probe) if flatten is not None else probe).dim() != 2:
            return None
    plan: list[tuple[str, str | None, list[nn.Module]]] = list(zip(chain.weights, chain.biases,
                                                                    chain.activations))
    loss_per_chain = vmap(criterion, in_dims=(0, batch_axis))

    def grad_fn(params: Params, batch: Any) -> tuple[Params, Tensor]:
        x, y = batch
        if flatten is not None:  # (m, ...) shared, or (C, m, ...) per chain
            x = flatten(x) if batch_axis is None else flatten(x.reshape(-1, *x.shape[2:])).view(*x.shape[:2], -1)
        with torch.enable_grad():
            leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
            # activations are kept transposed, hT (C, features, m), so that every weight gradient
            # g hᵀ comes out of autograd contiguous in W's own (C, out, in) layout (a transposed
            # gradient makes the parameter update ~10x slower)
            h = x if x.dim() == 2 else x.transpose(1, 2)
            for wname, bname, acts in plan:
                W = leaves[wname]
                C, out, _ = W.shape
                b = leaves[bname] if bname is not None else None
                if h.dim() == 2:  # input (m, in) shared by all chains: one (C·out, in) x (in, m) product
                    W2 = W.reshape(C * out, -1)
                    h = (torch.addmm(b.reshape(C * out, 1), W2, h.T) if b is not None else W2 @ h.T)
                    h = h.view(C, out, -1)
                elif b is not None:
                    h = torch.baddbmm(b.unsqueeze(2), W, h)
                else:
                    h = torch.bmm(W, h)
                for act in acts:
                    h = act(h)
            values = loss_per_chain(h.transpose(1, 2), y)
            grads = torch.autograd.grad(values.sum(), list(leaves.values()))
        return dict(zip(leaves, grads)), values.detach()

    return grad_fn


# ---------------------------------------------------------------------------------------------- row pieces
def row_pieces(batch: Any, batch_axis: int | None, rows: int) -> list[tuple[Any, float]]:
    """Split a batch ``(x, y)`` into pieces of at most ``rows`` samples along its sample axis (0 for a
    batch shared by all chains, ``batch_axis=None``; 1 for chain-stacked (C, m, ...) batches), each with
    its weight m_k / m. A batch of at most ``rows`` samples is returned whole (weight 1)."""
    x, y = batch
    dim = 0 if batch_axis is None else batch_axis + 1
    m = int(y.shape[dim])
    if m <= rows:
        return [(batch, 1.0)]
    pieces = []
    for a in range(0, m, rows):
        k = min(rows, m - a)
        pieces.append(((map_inputs(partial(Tensor.narrow, dim=dim, start=a, length=k), x), y.narrow(dim, a, k)),
                       k / m))
    return pieces


def chunked_grad_fn(step_fn: GradFn, batch_axis: int | None, rows: int) -> GradFn:
    """``step_fn`` applied to pieces of at most ``rows`` samples of each batch, the gradients and losses
    combined with weights m_k / m: for a loss that is a mean over the batch this is the gradient and loss
    of the whole batch (same numbers up to rounding), with memory bounded by a piece instead of the batch.
    Batches of at most ``rows`` samples go through ``step_fn`` unchanged (identical numbers)."""

    def fn(params: Params, batch: Any) -> tuple[Params, Tensor]:
        pieces = row_pieces(batch, batch_axis, rows)
        if len(pieces) == 1:
            return step_fn(params, batch)
        grads: Params | None = None
        values: Tensor | None = None
        for piece, w in pieces:
            g, v = step_fn(params, piece)
            if grads is None or values is None:
                grads = {k: t.mul(w) for k, t in g.items()}
                values = v.mul(w)
            else:
                for k, t in g.items():
                    grads[k].add_(t, alpha=w)
                values = values.add(v, alpha=w)
        assert grads is not None and values is not None
        return grads, values

    return fn


def chunked_loss(loss_fn: LossFn, params: Params, batch: Any, rows: int) -> Tensor:
    """``loss_fn(params, batch)`` (a mean over the batch) evaluated in pieces of at most ``rows`` samples."""
    pieces = row_pieces(batch, None, rows)
    total = loss_fn(params, pieces[0][0])
    if len(pieces) == 1:
        return total
    total = total * pieces[0][1]
    for piece, w in pieces[1:]:
        total = total + loss_fn(params, piece) * w
    return total
