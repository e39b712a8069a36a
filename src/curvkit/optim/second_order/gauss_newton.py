"""The damped Gauss-Newton optimiser of thesis chapter 4 (Sec. 4.4, Algorithm 1; Botev, Ritter & Barber 2017).

Objective on a minibatch of B points (thesis Eq. 4.12; ``likelihood.reduction='mean'`` as the thesis):

    E(theta) = L(theta) + (lambda / 2) ||theta||^2,   g = grad E,   lambda = ``weight_decay``.

One step:

1. **Direction** (Eqs. 4.16, 4.23). The block-diagonal Kronecker curvature ``G~ = blockdiag G_l (x) A_l``
   (``curvature``: ``kfra`` Eq. 4.7, ``kflr`` Sec. 4.3.1, ``kfac`` = one or more labels sampled from the
   model Sec. 4.3.3, ``projection`` Rademacher/Gaussian Eqs. 4.10-4.11) is damped by ``lambda + zeta`` and
   inverted per layer, d = (G~ + (lambda + zeta) I)^{-1} g (no minus sign), either with factored Tikhonov
   damping (``inversion='factored'``, Eq. 4.25: ``(G + k/omega I)^{-1} grad_W (A + omega k I)^{-1}``,
   k = sqrt(lambda + zeta), omega from the trace norm of Eq. 4.27 or the Frobenius norm) or exactly
   through the factors' eigendecompositions (``inversion='eigen'``, the thesis's KFAC*/KFRA*).
2. **Step size** from the quadratic model with the EXACT minibatch GGN (Eqs. 4.17-4.20):
   ``alpha* = -d^T g / d^T C d``, ``C = G + (lambda + tau) I``, with one Jacobian-vector product
   (:mod:`curvkit.optim.second_order.linearisation`); theta <- theta + alpha* d (Eq. 4.19).
3. **Levenberg-Marquardt tau** every ``tau_every`` (T_tau = 5) steps: rho of Eq. 4.21 on the SAME minibatch
   (one extra forward pass), tau <- omega_tau tau or tau / omega_tau (``lm_rule``: the classical band
   1/4-3/4 by default; ``'threshold'`` the thesis's single threshold 3/4), omega_tau = 0.95.
4. **Greedy zeta** every ``zeta_every`` (T_zeta = 20) steps: the directions for
   zeta in {zeta, omega_zeta zeta, zeta / omega_zeta} (the thesis prints "{omega_zeta, zeta, ...}", a typo),
   each with its alpha*, and the zeta whose step minimises q(alpha* d) (Eq. 4.22, the tau-damped exact GGN)
   is kept and used for this step (ties keep zeta). omega_zeta = 0.95.

Curvature of which data (``ema``). By default (``ema=None``) the Kronecker factors are those of the CURRENT
minibatch at the current parameters, recomputed on every refresh, as the thesis's algorithm (Sec. 4.4,
Algorithm 1) and its solid curves in Fig. 4.1; ``ema=0.9`` is the moving average of both factors of the
dashed curves (the first batch initialises it); ``ema='running_mean'`` is the mean of the factors of every
minibatch since step 1, each at the parameters of its step (not in the thesis: curvkit 0.1's default, kept
for old runs; with ``CrossEntropy('sum')`` its factors grow with the data seen).

Other options the thesis reports or users expect: ``curvature_every`` (refresh factors and inverses every
k steps from the minibatch of that step; the thesis refreshes every step), ``inverse_every`` and
``quadratic_every`` (the damped inverses and the quadratic model of alpha* at their own intervals, as kfac-jax
and kfac-pytorch amortise them; :data:`AMORTISED`), ``momentum`` (the 2-D quadratic model over {d, previous update},
KFAC-style; off by default as in the thesis, which found plain update momentum unstable), ``weight_decay``.

Damping adaptation. The defaults are the thesis's schedule (tau_0 = zeta_0 = 1 on an absolute scale, tau
moved by 0.95 every 5 steps, zeta by 0.95 every 20), which the reproductions keep; it adapts slowly
(0.95 per 5 steps is about 1% per step: a start that is far too large or too small for the problem's scale
takes hundreds of steps to correct). :data:`FAST_ADAPTATION` is the faster schedule measured in
``benchmarks/gauss_newton_damping.py`` (docs/benchmarks.md): rho and tau on every step with the factor
0.8, zeta searched every 5 steps over {zeta/2, zeta, 2 zeta}; ``GaussNewton(..., **FAST_ADAPTATION)``. It
costs one extra forward pass per step and two more damped inversions every fifth step. Once the damping is
small, a step on a small minibatch can overfit that minibatch (rho, measured on the same minibatch, cannot
see it): the benchmark's ReLU network on minibatches of 128 had transient increases of the full-data
objective (up to about 10x, recovered within a few steps), which the classical Levenberg-Marquardt factor 2/3
made larger. Scaling tau_0 and zeta_0 with the curvature's mean eigenvalue was measured too and is not
offered: it diverged on that network.

Choices where the thesis is silent (documented here, not guessed elsewhere): tau_0 = zeta_0 = 1 (the thesis
says "reasonably large"); rho and its extra forward pass only on the steps that adapt tau; weight decay
on every parameter, biases included; the Kronecker curvature has the scale of ``likelihood``'s reduction
(per-sample mean for ``'mean'``), the same as the gradient, so the step is independent of B. A block whose
Kronecker curvature is exactly zero (a saturated softmax: its output Hessian is zero in floating point) has
no trace-norm split; its damped block is the omega -> infinity limit of Eq. 4.25, ``delta I``, so its
direction is g / delta (:mod:`curvkit.optim.second_order.direction`; the record's ``zero_curvature`` names
such layers). When the direction is zero (a zero gradient) the step is zero, alpha = 0.

Conventions (``curvkit.optim.base``): ``GaussNewton(params, *, model, likelihood, ...)``; every trainable
parameter of ``model`` must be optimised (the curvature covers all of them); parameters with
``requires_grad=False`` are left alone, as in ``torch.optim`` (no Kronecker block, no update, not in the
quadratic model), so ``GaussNewton(model.parameters(), ...)`` works with frozen layers; the hyperparameters are
optimiser-wide (a param group that overrides one is refused: the damping couples the layers through the
quadratic model). ``step(batch=(X, y))`` runs the forward pass, the loss, its gradient and the curvature
itself (no ``backward()`` needed; ``p.grad`` is neither read nor written) and returns the loss E before the
step. ``step(closure)`` instead takes the loss and ``p.grad`` from ``closure()`` (which must evaluate
``likelihood(model(X), y)`` on one minibatch and call ``backward()``), records the model's input, and runs
one more forward pass for the curvature; heads whose output Hessian needs the labels (the Bernoulli
mixture) and likelihoods with padding (``ignore_index`` / ``ignore_value``: only the targets mark the
padded positions the curvature must leave out) need ``batch``. Passing both is refused (which one defines
the minibatch would be a guess). ``X`` is a tensor or a mapping of tensors sharing the batch dimension
(:data:`curvkit.validation.Inputs`: a Hugging Face batch ``{"input_ids": ..., "attention_mask": ...}``
through :class:`curvkit.hf.HuggingFace`); the model is called as ``model(X)`` for the loss, the curvature,
the exact quadratic model and rho alike, so every entry of the mapping (the attention mask) takes part in
all of them (a closure must call ``model(X)`` with the batch as its one positional argument). The
minibatch must be non-empty, every floating-point tensor of X (and a floating-point y, if any) of the
model's dtype (integer token ids and masks are taken as they are). A step checks every value before writing and raises ``FloatingPointError``
naming the quantity and the step without changing the parameters or the optimiser's state.
:meth:`state_dict` carries tau, zeta, the counters, the factor statistics and the random generator, so a
stopped and resumed run equals an uninterrupted one.

Sharded models (FSDP2 ``fully_shard``: DTensor parameters; :mod:`curvkit.optim.second_order._sharded`). With
``distributed=Reducer()`` and ``step(batch=(X_rank, y_rank))`` (each rank its own shard of the minibatch) every
rank computes the step of the union on a whole-parameter replica of the model (the module tree without FSDP2's
hooks, :class:`curvkit.distributed.sharded.ShardedReplica`), as the data-parallel optimiser does, and adds ITS
rows of the identical whole update to its local shard: equal to the single-process optimiser on the union
(tested to 1e-12 in float64). Communication per step on P ranks (|theta| parameters): one all-gather of the
parameters (|theta| values received per rank), one all-reduce of the gradient (|theta|), the factors' all-reduce
on refresh steps and the inverses' broadcasts (as data-parallel), a few scalars (the k x k Gram matrix of the
quadratic model, the loss, rho's objective); the update never travels. Memory per rank during a step: the whole
parameters, their gradient and the candidate directions (|theta| each) beside the whole factors; between steps
the replica's storage is freed and only the shards remain. Every curvature source and layer kind works (the
replica is a plain model); refused: no ``distributed=``, ``step(closure)`` (its ``backward()`` runs FSDP2's own
gradient reduce-scatter), and parameters sharded otherwise than FSDP2 (``Shard(0)``, 1-D mesh) or HSDP (``(Replicate(), Shard(0))``, 2-D mesh) do. Every step appends a record to :attr:`history`
(loss, alpha, rho, tau, zeta, omega per layer, predicted change, wall-clock).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

import torch
from torch import Tensor, nn

from curvkit import layerkinds, precision
from curvkit.curvature import estimators
from curvkit.curvature.config import CurvatureConfig
from curvkit.curvature.estimators import KroneckerEstimator, OptionWords, wide_blocks
from curvkit.layerkinds import BATCH_STATISTICS_HINT
from curvkit.likelihoods import Likelihood
from curvkit.linalg.kron import KroneckerOperator
from curvkit.linalg.operator import CurvatureOperator
from curvkit.optim.base import CurvatureOptimizer, check_step_extras
from curvkit.optim.second_order.direction import FactoredInverse, split_with_zero_blocks
from curvkit.optim.second_order.linearisation import Linearisation, output_gram
from curvkit.optim.second_order.quadratic import (
    levenberg_marquardt,
    line_minimum,
    reduction_ratio,
    two_direction_minimum,
)
from curvkit.structure import (
    UnsupportedModelError,
    curvature_kernels,
    differentiable,
    kept_running_statistics,
    read_model,
    require_fixed_mode,
    running_statistics,
    sharded_parameters,
)
from curvkit.validation import (
    Inputs,
    check_inputs,
    describe_inputs,
    first_nonfinite,
    input_tensors,
    inputs_to,
    integer,
    map_inputs,
    nonnegative,
    num_samples,
    ordinary,
    take_samples,
    unit_interval,
)

__all__ = ["AMORTISED", "FAST_ADAPTATION", "KFLR_MAX_EXTRA_PASSES", "GaussNewton", "default_curvature"]

logger = logging.getLogger(__name__)

#: A faster damping schedule than the thesis's (module docstring, measured in
#: ``benchmarks/gauss_newton_damping.py``): ``GaussNewton(params, model=..., likelihood=..., **FAST_ADAPTATION)``.
FAST_ADAPTATION: Mapping[str, Any] = MappingProxyType(
    {"tau_every": 1, "omega_tau": 0.8, "zeta_every": 5, "omega_zeta": 0.5})

#: Amortised refreshes (module docstring): the factors and their inverses every 5 steps, measured in
#: ``benchmarks/gauss_newton_amortised.py`` (docs/results.md, "Gauss-Newton on the clock": on the chapter-4
#: autoencoder and the ViT 0.50x and 0.79x the seconds per update for at most one update in 25-40). The quadratic
#: model stays on every step: ``quadratic_every`` kept the autoencoder's progress, not quite the ViT's, and both
#: amortised at once failed on the autoencoder. Not the thesis's algorithm (the defaults):
#: ``GaussNewton(params, model=..., likelihood=..., **AMORTISED)``.
AMORTISED: Mapping[str, Any] = MappingProxyType({"curvature_every": 5})

#: The moving-average factor of log |alpha*| whose geometric mean the steps between evaluations of the quadratic
#: model take (``quadratic_every``; :meth:`GaussNewton._reuse_step_size`).
ALPHA_AVERAGE = 0.9

Curvature = Literal["auto", "kfra", "kflr", "kfac", "projection"]
_CURVATURES = ("kfra", "kflr", "kfac", "projection")
_GLOBAL = ("curvature", "inversion", "omega_norm", "weight_decay", "tau", "zeta", "tau_every", "zeta_every",
           "omega_tau", "omega_zeta", "lm_rule", "ema", "curvature_every", "inverse_every", "quadratic_every",
           "momentum", "mc_samples",
           "distribution", "seed", "weight_sharing", "norm_structure", "parameter_structure", "batch_statistics")
_CONFIG = ("curvature", "ema", "mc_samples", "distribution", "weight_sharing", "norm_structure",
           "parameter_structure", "batch_statistics")
_CONFIG_BEFORE = {"weight_sharing": "expand", "norm_structure": "full", "parameter_structure": "diag",  # format 2
                  "batch_statistics": "refuse"}

#: The most backward passes per step that ``curvature='auto'`` lets KFLR cost beyond KFAC's, in units of the one
#: backward pass of the step's own gradient (:func:`default_curvature`): KFLR back-propagates one column of the
#: output Hessian's square root per backward pass (C for a softmax over C classes), KFAC one per sampled label,
#: each once per refresh, i.e. every ``curvature_every`` steps.
KFLR_MAX_EXTRA_PASSES = 1.0

#: the refusals of the optimiser's estimator in its caller's words (``curvature=``; no ``output_factor``)
_WORDS = OptionWords(sampled="curvature='kfac' or 'projection'", dense=None)


def default_curvature(structure: Any, likelihood: Likelihood, f: Tensor, wide: Sequence[str] = (), *,
                      curvature_every: int = 1, mc_samples: int = 1) -> tuple[str, str]:
    """(source, reason): the curvature source ``curvature='auto'`` takes for a model (its
    :class:`~curvkit.structure.ModelStructure`) with outputs ``f`` (one minibatch's), given the refresh period
    and KFAC's labels per example of the optimiser.

    0. ``kfac`` when a block has more outputs than
       :data:`~curvkit.curvature.estimators.LOW_RANK_OUTPUTS` (``wide``, its labels:
       :func:`~curvkit.curvature.estimators.wide_blocks`; a language model's vocabulary): its sampled
       output factor is exactly low rank and kept thin, where KFRA's and KFLR's would be dense and full rank;
    1. ``kfra`` (the thesis's method, Sec. 4.3.2) where its recursion is defined: an MLP chain
       (``structure.mlp_chain``) with (B, C) outputs (no backward pass beyond the gradient's);
    2. otherwise ``kflr`` (exact output factors, Sec. 4.3.1) where its price is small against the step: (B, C)
       outputs and at most :data:`KFLR_MAX_EXTRA_PASSES` backward passes per step more than KFAC, i.e.
       ``(C - mc_samples) / curvature_every <= 1`` with C the columns of the output Hessian's square root (one
       backward pass each per refresh; with outputs (B, *P, C) its back-propagated columns mix the positions:
       its G then holds cross-position terms and is not the GGN's Kronecker factor, docs/architecture.md);
    3. otherwise ``kfac`` (one backward pass per refresh for each of the ``mc_samples`` sampled labels, Sec. 4.3.3).

    The reason states the price that decided (backward passes per refresh and per step against the one of the
    gradient), so a user can choose the other source explicitly.
    """
    if wide:
        return "kfac", (f"block(s) {', '.join(repr(w) for w in wide[:3])} have more than {estimators.LOW_RANK_OUTPUTS} outputs: "
                        "KFAC's output factor is exactly low rank there (KFRA's and KFLR's would be dense)")
    positions = f.dim() > 2
    if not positions:
        try:
            structure.mlp_chain("kfra", frozen=True)
        except UnsupportedModelError as exc:
            why = str(exc)
        else:
            return "kfra", "an MLP chain with (batch, outputs) outputs: KFRA's recursion is defined"
    else:
        return "kfac", (f"outputs with positions {tuple(f.shape)}: KFLR's columns would mix the positions, so KFAC "
                        "(sampled labels)")
    cols = likelihood.sqrt_rank(f)
    extra = (cols - mc_samples) / curvature_every
    price = (f"KFLR costs {cols} backward pass(es) per refresh against KFAC's {mc_samples}, with a refresh every "
             f"{curvature_every} step(s) {max(extra, 0.0):.3g} more per step than KFAC, against the step's one "
             "gradient pass")
    if extra <= KFLR_MAX_EXTRA_PASSES:
        return "kflr", f"not an MLP chain ({why}); {price} (<= {KFLR_MAX_EXTRA_PASSES:g}): KFLR (exact output factors)"
    return "kfac", (f"not an MLP chain ({why}); {price} (> {KFLR_MAX_EXTRA_PASSES:g}): KFAC (sampled labels); "
                    "curvature='kflr' gives exact output factors at that price")


def _check_ema(ema: Any) -> float | str | None:
    if ema is None:
        return None
    if isinstance(ema, str):
        if ema == "running_mean":
            return ema
        raise ValueError(f"ema must be None (the current minibatch), a number in [0, 1) or 'running_mean', got {ema!r}")
    return unit_interval("ema", ema, closed_left=True)


def _dot(a: list[Tensor], b: list[Tensor]) -> Tensor:
    """sum_i <a_i, b_i> (0-d, on the device): one dot product per tensor (bf16/fp16 tensors multiplied and
    summed in float32, curvkit.precision), their sum in one more pass."""
    return torch.stack([(x * y).sum(dtype=torch.float32) if x.dtype in precision.LOW_PRECISION else
                        torch.dot(x.reshape(-1), y.reshape(-1)) for x, y in zip(a, b)]).sum()


class GaussNewton(CurvatureOptimizer):
    """Damped Gauss-Newton with Kronecker-factored directions and exact-GGN step sizes (module docstring).

    Args:
        params: the model's trainable parameters (all of them; any grouping).
        model: the network (every trainable parameter in a layer kind of :mod:`curvkit.layerkinds`: Linear
            with or without weight sharing, convolutions incl. grouped, Embedding, normalisation layers,
            MultiheadAttention, raw (1, ...) parameters; ``kfra`` needs an MLP chain
            ``nn.Sequential([Flatten,] Linear, act, ..., Linear)``; a tied weight gets the sum of its uses' terms,
            docs/architecture.md "Shared and tied weights"); unsupported modules are named in the error. It must return one tensor of logits (B, [*P,] C).
        likelihood: the loss head (:mod:`curvkit.likelihoods`), e.g. ``BernoulliBCE('mean')`` for an
            autoencoder, ``CrossEntropy('mean')``, ``Gaussian('mean')``, ``BernoulliMixture('mean')``.
        curvature: ``'auto'`` (default: :func:`default_curvature`, KFAC for a model with a vocabulary-sized
            output layer (its exactly low-rank output factor is kept thin), else KFRA - the thesis's method - where
            its recursion is defined, else KFLR where its backward passes cost at most :data:`KFLR_MAX_EXTRA_PASSES`
            per step more than KFAC's, else KFAC) | ``'kfra'`` |
            ``'kflr'`` | ``'kfac'`` | ``'projection'``.
        inversion: ``'factored'`` (Eq. 4.25, default) | ``'eigen'`` (exact damped inverse, KFAC*/KFRA*).
        omega_norm: ``'trace'`` (Eq. 4.27 with the trace norm, the thesis's) | ``'frobenius'``.
        weight_decay: lambda >= 0 of Eq. 4.12 (the thesis's autoencoders: 1e-5, digest recommendation).
        tau, zeta: initial Levenberg-Marquardt and factor damping (>= 0; 1.0 each).
        tau_every, zeta_every: adaptation periods T_tau = 5, T_zeta = 20 (0 = never adapt).
        omega_tau, omega_zeta: decay constants in (0, 1) (0.95 each).
        lm_rule: ``'band'`` (rho > 3/4 decrease, rho < 1/4 increase) | ``'threshold'`` (thesis as printed).
        ema: None (default: the factors of the current minibatch, the thesis's), a moving-average factor in
            [0, 1) (0.9: the thesis's dashed curves), or ``'running_mean'`` (the mean over every minibatch
            since step 1; curvkit 0.1's default). Module docstring.
        curvature_every: refresh the factors (and, by default, the inverses) every k steps (1, the thesis's).
        inverse_every: recompute the damped inverses every k steps, a multiple of ``curvature_every`` (None: with
            every factor refresh). Larger than ``curvature_every`` only pays with ``ema``: the factors of the
            steps in between are averaged in, while with ``ema=None`` only the rebuild step's factors are used.
        quadratic_every: evaluate the quadratic model (alpha* from the exact GGN, Eqs. 4.17-4.20) on step 1 and
            every k-th step (1, the thesis's) and on every step that adapts tau or zeta; the steps in between take
            the geometric mean of the past alpha*s (and momentum's last beta) along their own direction, without
            the Jacobian-vector product (about two forward passes' work; docs/results.md); :data:`AMORTISED`
            leaves it at 1.
        keep_primals: on the steps that evaluate the quadratic model, keep the outputs of the linear maps of the
            step's forward pass until the Jacobian-vector products have taken their primals from them (True,
            default: one matrix product in three per linear map less, the same numbers to rounding; it costs the
            memory of those outputs during the step, 69 MiB more peak at the ViT of
            ``benchmarks/gauss_newton_vit.py``, batch 128). False recomputes them. Models that are plain
            ``nn.Sequential`` chains take their tangents from the recorded activations either way.
        momentum: the 2-D quadratic model over {direction, previous update} (False).
        mc_samples: labels (``kfac``) or projections (``projection``) per data point (1, the thesis's).
        distribution: ``'rademacher'`` | ``'gaussian'`` projection vectors.
        seed: seeds the optimiser's own generator (sampled labels, projections).
        batch_statistics: ``'refuse'`` (default) | ``'couple'``: a model with BatchNorm in training mode (batch
            statistics couple the samples) is refused by default; ``'couple'`` is the explicit opt-in to Kronecker
            factors from the coupled backward pass of the minibatch
            (:class:`~curvkit.curvature.estimators.KroneckerEstimator`'s ``batch_statistics``, which defines
            them), an approximation beyond per-sample curvature. Then the step's own forward pass (the one that
            gives the loss and the gradient) is the ordinary training pass and updates the running statistics
            exactly once per step; every other pass (the first step's output check, the exact GGN products of
            alpha* and the damping, rho's re-evaluation, the curvature pass after a closure) runs on copies of
            the buffers (:func:`curvkit.structure.kept_running_statistics`); a refused step puts the running
            statistics back too. alpha*, rho and the quadratic model use the exact GGN of the coupled minibatch
            loss (the network evaluated on the whole minibatch with its batch statistics). The per-step mode
            check accepts BatchNorm in either mode. Not data-parallel (``distributed``): refused.
        distributed: a :class:`curvkit.distributed.Reducer` for data-parallel steps (default: the one set by
            ``curvkit.distributed.set_current``): each rank steps on its shard and every rank takes the step
            of the union minibatch (:mod:`curvkit.optim.second_order._distributed`); the generator is seeded per rank.
            A ``reduction='mean'`` likelihood weights the ranks by their counted loss terms (positions that are
            not padding), so padded token batches with unequal counts per rank take the union's step. Required
            for an FSDP2-sharded model (module docstring, "Sharded models").
        statistics_dtype: the dtype of the Kronecker factors, their damping, inverses and the direction (None:
            float32 for bf16/fp16 parameters, else theirs; or torch.float32/float64, :mod:`curvkit.precision`);
            the forward and backward passes run in the model's dtype and the step is cast to each parameter's.
    """

    def __init__(self, params: Any, *, model: nn.Module, likelihood: Likelihood, curvature: Curvature = "auto",
                 inversion: Literal["factored", "eigen"] = "factored",
                 omega_norm: Literal["trace", "frobenius"] = "trace", weight_decay: float = 0.0,
                 tau: float = 1.0, zeta: float = 1.0, tau_every: int = 5, zeta_every: int = 20,
                 omega_tau: float = 0.95, omega_zeta: float = 0.95, lm_rule: Literal["band", "threshold"] = "band",
                 ema: float | Literal["running_mean"] | None = None, curvature_every: int = 1,
                 inverse_every: int | None = None, quadratic_every: int = 1, momentum: bool = False, mc_samples: int = 1,
                 distribution: Literal["rademacher", "gaussian"] = "rademacher", seed: int = 0,
                 weight_sharing: Literal["expand", "reduce"] = "expand", norm_structure: Literal["full", "diag"] = "full",
                 parameter_structure: Literal["full", "diag"] = "diag",
                 batch_statistics: Literal["refuse", "couple"] = "refuse", distributed: Any = None,
                 statistics_dtype: torch.dtype | None = None, keep_primals: bool = True):
        if curvature != "auto" and curvature not in _CURVATURES:
            raise ValueError(f"curvature must be 'auto' or one of {_CURVATURES}, got {curvature!r}")
        #: the Kronecker statistics' options (validated there), handed to the estimator
        self.config = CurvatureConfig(weight_sharing=weight_sharing, norm_structure=norm_structure,
                                      parameter_structure=parameter_structure, batch_statistics=batch_statistics,
                                      mc_samples=mc_samples, distribution=distribution)
        if inversion not in ("factored", "eigen"):
            raise ValueError(f"inversion must be 'factored' or 'eigen', got {inversion!r}")
        if omega_norm not in ("trace", "frobenius"):
            raise ValueError(f"omega_norm must be 'trace' or 'frobenius', got {omega_norm!r}")
        if lm_rule not in ("band", "threshold"):
            raise ValueError(f"lm_rule must be 'band' or 'threshold', got {lm_rule!r}")
        if not isinstance(momentum, bool):
            raise ValueError(f"momentum must be True or False, got {momentum!r}")
        if not isinstance(keep_primals, bool):
            raise ValueError(f"keep_primals must be True or False, got {keep_primals!r}")
        #: keep the forward pass's linear outputs for the quadratic model's products (docstring)
        self.keep_primals = keep_primals
        defaults: dict[str, Any] = dict(
            curvature=curvature, inversion=inversion, omega_norm=omega_norm,
            weight_decay=nonnegative("weight_decay", weight_decay), tau=nonnegative("tau", tau),
            zeta=nonnegative("zeta", zeta), tau_every=integer("tau_every", tau_every, minimum=0),
            zeta_every=integer("zeta_every", zeta_every, minimum=0),
            omega_tau=unit_interval("omega_tau", omega_tau), omega_zeta=unit_interval("omega_zeta", omega_zeta),
            lm_rule=lm_rule, ema=_check_ema(ema),
            curvature_every=integer("curvature_every", curvature_every),
            inverse_every=None if inverse_every is None else integer("inverse_every", inverse_every),
            quadratic_every=integer("quadratic_every", quadratic_every),
            momentum=momentum, mc_samples=integer("mc_samples", mc_samples), distribution=distribution,
            seed=integer("seed", seed, minimum=0), weight_sharing=weight_sharing, norm_structure=norm_structure,
            parameter_structure=parameter_structure, batch_statistics=batch_statistics,
        )
        if defaults["inverse_every"] is not None and defaults["inverse_every"] % defaults["curvature_every"]:
            raise ValueError(f"inverse_every ({inverse_every}) must be a multiple of curvature_every ({curvature_every}): "
                             "the inverses are recomputed on steps that refresh the factors (inverse_every=None: on "
                             "every refresh)")
        if defaults["weight_decay"] + defaults["zeta"] <= 0:
            raise ValueError("weight_decay + zeta must be > 0: the Kronecker factors of a network are singular "
                             "in general, so the direction needs damping (the thesis starts with zeta = 1)")
        if not isinstance(likelihood, Likelihood):
            raise TypeError(f"likelihood must be a curvkit.likelihoods.Likelihood, got {type(likelihood).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        super().__init__(params, defaults)
        for gi, group in enumerate(self.param_groups):
            for key in _GLOBAL:
                if group[key] != defaults[key]:
                    raise ValueError(f"param group {gi} sets {key}={group[key]!r}, but GaussNewton's "
                                     "hyperparameters are optimiser-wide (the damping couples all layers through "
                                     "the quadratic model); pass it to the constructor instead")
        self._closure_models = [model]  # what a closure may call: the user's model, compiled or not
        model = self._init_names(model)
        if model is not self._closure_models[0]:
            self._closure_models.append(model)
        owned = {id(p) for g in self.param_groups for p in g["params"]}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in owned]
        if missing:
            raise ValueError(f"GaussNewton must optimise every trainable parameter of the model (its curvature "
                             f"covers all of them); missing: {', '.join(missing)}. Freeze them "
                             "(requires_grad_(False)) or pass model.parameters()")
        # frozen parameters (requires_grad=False) are left alone, as in torch.optim (module docstring)
        self._trainable = [p for p in super().ordered_params() if p.requires_grad]
        if not self._trainable:
            raise ValueError("GaussNewton: every parameter it was given has requires_grad=False; there is nothing "
                             "to optimise")
        self.likelihood = likelihood
        self.hp = defaults
        #: the dtype of the factors, their damping and inverses (curvkit.precision); steps are cast to each
        #: parameter's dtype
        self.statistics_dtype = precision.statistics_dtype(self._trainable[0].dtype, statistics_dtype)
        first = self.ordered_params()[0]
        self._device, self._dtype = first.device, first.dtype
        if distributed is None:
            from curvkit.distributed import current

            distributed = current()
        self.distributed = distributed
        #: the likelihood of the step's own loss, gradient and quadratic model on this rank's shard: the
        #: summed one when data-parallel (the ranks' sums travel with their counted terms, _distributed)
        self._shard_likelihood = likelihood if distributed is None else likelihood.with_reduction("sum")
        if distributed is not None and batch_statistics == "couple":
            raise ValueError("GaussNewton: batch_statistics='couple' cannot be used data-parallel (distributed=, or "
                             "a reducer set by curvkit.distributed.set_current): each rank's BatchNorm would normalise "
                             "with its own shard's statistics, so neither the factors nor the exact GGN would be "
                             "those of the coupled minibatch; use one process, or model.eval() (running statistics)")
        seed_r = int(defaults["seed"]) if distributed is None else distributed.seed(int(defaults["seed"]))
        self._generator = torch.Generator(device=self._device).manual_seed(seed_r)
        #: FSDP2: the whole-parameter replica every step computes on (module docstring, "Sharded models")
        self._replica: Any = None
        if sharded_parameters(model):
            from curvkit.optim.second_order._sharded import sharded_replica

            self._replica = sharded_replica(model, distributed)
        #: the module the step evaluates: the model, or the replica of an FSDP2 model
        self._net: nn.Module = model if self._replica is None else self._replica.module
        self._structure = read_model(self._net)
        #: the curvature source in use (``curvature``, or the one ``'auto'`` chose at the first step; None
        #: until then) and why it was chosen
        self.source: str | None = None
        self.source_reason = ""
        self.estimator: KroneckerEstimator = None  # type: ignore[assignment]  # built by _use_source
        self._output_checked = False  # by the first step's _first_pass
        self._wide: list[str] = []  # the blocks with a vocabulary-sized output (curvature='auto' takes kfac)
        if curvature == "auto":  # every layer must have a Kronecker block: refuse what no source takes, now
            self._wide = wide_blocks(layerkinds.plan(self._structure, type(self).__name__,
                                                     batch_statistics=batch_statistics))
        else:
            self._use_source(curvature, "given")
        if distributed is not None and self._replica is None:  # shards differ by rank; the replica is gathered
            distributed.sync_tensors_(self.ordered_params())
        self._names = self.param_names()
        self._linearisation = Linearisation(self._net, self._structure, self._names)
        if self._replica is not None:  # gathered again at each step
            self._replica.release()
        # the adaptive state (saved by state_dict)
        self.num_steps = 0
        self.tau = float(defaults["tau"])
        self.zeta = float(defaults["zeta"])
        self.elapsed_s = 0.0
        #: the step sizes of the quadratic model for the steps in between its evaluations (``quadratic_every``):
        #: the last alpha* and momentum beta, and the bias-corrected moving average (factor
        #: :data:`ALPHA_AVERAGE`) of log |alpha*| over the evaluations, as (sum, weight)
        self._alpha: float | None = None
        self._beta: float | None = None
        self._log_alpha = (0.0, 0.0)
        #: the estimator's statistics the held factors were built from, kept where later factor refreshes change
        #: the statistics before the next rebuild (``inverse_every > curvature_every``), for state_dict
        self._held: dict[str, Any] | None = None
        # caches rebuilt from the estimator's statistics (never saved: they are recomputed exactly)
        self._op: KroneckerOperator | None = None
        self._inverses: dict[float, CurvatureOperator | FactoredInverse] = {}
        self._omega: dict[str, float] = {}
        self._zero_blocks: list[str] = []
        self.history: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ parameters
    def ordered_params(self) -> list[Tensor]:
        """The optimised parameters (those with ``requires_grad`` at construction) in the model's order."""
        return list(self._trainable)

    def _working_params(self) -> list[Tensor]:
        """The tensors a step computes with, in :meth:`ordered_params` order: the parameters themselves, or the
        whole replica parameters of an FSDP2 model's shards."""
        if self._replica is None:
            return self.ordered_params()
        return [self._replica.full[id(p)] for p in self._trainable]

    def param_names(self) -> list[str]:
        """Names of :meth:`ordered_params` in the model's ``named_parameters`` order."""
        assert self.model is not None
        mine = {id(p) for p in self._trainable}
        return [n for n, p in self.model.named_parameters() if id(p) in mine]

    def _check_trainable(self) -> None:
        """The curvature was set up for the parameters trainable at construction; refuse a changed set."""
        assert self.model is not None
        mine = {id(p) for p in self._trainable}
        owned = {id(p) for g in self.param_groups for p in g["params"]}
        changed = [n for n, p in self.model.named_parameters() if id(p) in owned and p.requires_grad != (id(p) in mine)]
        if changed:
            raise ValueError(f"GaussNewton: requires_grad of {', '.join(changed)} changed after the optimiser was "
                             "created (its Kronecker blocks cover the parameters trainable then); create a new "
                             "GaussNewton after freezing or unfreezing layers")

    # ------------------------------------------------------------------ curvature
    def _use_source(self, source: str, reason: str) -> None:
        """Build the Kronecker estimator of ``source`` (with the optimiser's estimator options)."""
        hp = self.hp
        ema_f = hp["ema"] if isinstance(hp["ema"], float) else None
        self.estimator = KroneckerEstimator(
            self._net, self.likelihood, curvature=source,  # type: ignore[arg-type]
            ema=ema_f, generator=self._generator, distributed=self.distributed, config=self.config,
            statistics_dtype=self.statistics_dtype, option_words=_WORDS)
        self.source, self.source_reason = source, reason

    def _first_pass(self, X: Inputs) -> None:
        """Before the first step: one forward pass without autograd that checks the model returns one tensor
        of logits and, for ``curvature='auto'``, picks the source by :func:`default_curvature` from its
        outputs (logged at INFO level and kept in :meth:`state_dict`)."""
        with torch.no_grad(), curvature_kernels(), kept_running_statistics(self._net):
            f = self._logits(self._net(X))
        self.likelihood.check_logits(f, type(self).__name__)
        self._output_checked = True
        if self.estimator is None:
            source, reason = default_curvature(self._structure, self.likelihood, f, self._wide,
                                               curvature_every=self.hp["curvature_every"],
                                               mc_samples=self.hp["mc_samples"])
            self._use_source(source, reason)
            logger.info("GaussNewton: curvature='auto' chose %r: %s", source, reason)

    def _logits(self, f: Any) -> Tensor:
        """The model's output, refused unless it is one tensor of logits (B, [*P,] C)."""
        if not isinstance(f, Tensor):
            raise TypeError(f"{type(self).__name__}: the model must return its outputs (logits) as one tensor of "
                            f"shape (batch, [positions...,] outputs), got {type(f).__name__}; wrap it in a module "
                            "that returns the logits (e.g. output.logits of a Hugging Face ModelOutput, or out[0])")
        return f

    def _hold(self, op: KroneckerOperator) -> None:
        """Hold the undamped Kronecker curvature ``op`` for the next directions: zero blocks in their limit
        form and the factored-damping split (:func:`~curvkit.optim.second_order.direction.split_with_zero_blocks`);
        the cached inverses are dropped."""
        op, omegas, self._zero_blocks = split_with_zero_blocks(op, self.hp["omega_norm"])
        self._op = op
        self._inverses = {}
        self._omega = dict(zip((b.name for b in op.blocks), omegas)) if self.hp["inversion"] == "factored" else {}

    def _direction(self, zeta: float, g: list[Tensor]) -> list[Tensor]:
        """d = (G~ + (lambda + zeta) I)^{-1} g with the held factors; the inverse (Cholesky factors for the
        factored damping, eigendecompositions for the exact one) is cached per zeta until the next refresh."""
        assert self._op is not None
        inv = self._inverses.get(zeta)
        damping = self.hp["weight_decay"] + zeta
        if inv is None and self.distributed is not None:
            from curvkit.optim.second_order._distributed import DistributedKroneckerInverse

            omegas = [self._omega[b.name] for b in self._op.blocks] if self._omega else None
            inv = DistributedKroneckerInverse(self._op, damping, self.hp["inversion"], omegas,  # type: ignore[assignment]
                                              self.distributed)
            self._inverses[zeta] = inv  # type: ignore[assignment]
        if inv is None:
            if self.hp["inversion"] == "eigen":
                inv = self._op.inverse(damping, method="eigen")
            else:
                inv = FactoredInverse(self._op, damping, [self._omega[b.name] for b in self._op.blocks])
            self._inverses[zeta] = inv
        g = [t.to(self.statistics_dtype) for t in g]  # the direction in the factors' dtype (curvkit.precision)
        if hasattr(inv, "apply"):
            d = inv.apply(dict(zip(self._names, g)))  # type: ignore[union-attr]
            return [d[n] for n in self._names]
        return list(inv @ g)

    def curvature(self) -> CurvatureOperator:
        """The current damped approximate curvature ``G~ + (lambda + zeta) I`` as a KroneckerOperator:
        with the factored damping of Eq. 4.25 (``inversion='factored'``) or exact (``'eigen'``), so that
        ``opt.curvature().inverse() @ g`` (``inverse(method='eigen')`` for the exact one; the factored
        operator is itself a Kronecker product, whose exact inverse is the direction's) reproduces the
        direction of the last step's zeta."""
        if self._op is None:
            raise ValueError("GaussNewton has no curvature yet: take a step first")
        damping = self.hp["weight_decay"] + self.zeta
        if self.hp["inversion"] == "eigen":
            return self._op.add_identity(damping)
        return self._op.factored_damping(damping, pi=[self._omega[b.name] for b in self._op.blocks])

    def omegas(self) -> dict[str, float]:
        """The factored-damping split omega (Eq. 4.27) per block of the held factors, keyed by the block's name
        (its weight's name for a whole layer; the layer and part, e.g. ``'attn.q'``, for a slice); 1.0 for a
        block whose curvature is exactly zero (its damped block is delta I, module docstring) and for a
        plain-matrix block (damped exactly)."""
        return dict(self._omega)

    # ------------------------------------------------------------------ stepping
    @torch.no_grad()
    @differentiable()
    def step(self, closure: Callable[[], Any] | None = None, *,  # type: ignore[override]
             batch: tuple[Inputs, Tensor] | None = None, **extras: Any) -> Tensor:
        """One damped Gauss-Newton step on the minibatch ``batch=(X, y)`` (X a tensor or a mapping of tensors)
        or from ``closure`` (module docstring). Returns the objective E (loss plus weight decay) before the step."""
        check_step_extras(type(self).__name__, extras, ())
        if closure is not None and batch is not None:
            raise TypeError(f"{type(self).__name__}.step got both a closure and batch=; pass one of them: "
                            "step(batch=(X, y)) runs the forward pass itself, step(closure) takes the loss and the "
                            "gradient from the closure")
        self._check_trainable()
        couple = self.hp["batch_statistics"] == "couple"
        if self.model is not None:
            require_fixed_mode(self.model, type(self).__name__, batch_statistics=couple, hint=BATCH_STATISTICS_HINT)
        if batch is not None:
            batch = self._checked_batch(batch)
        if self._replica is not None:
            from curvkit.optim.second_order._sharded import check_sharded_step

            check_sharded_step(closure)
            self._replica.gather()  # the whole parameters (one all-gather), released after the step
        try:
            return self._step(closure, batch, couple)
        finally:
            if self._replica is not None:
                self._replica.release()

    def _step(self, closure: Callable[[], Any] | None, batch: tuple[Inputs, Tensor] | None, couple: bool) -> Tensor:
        t0 = time.perf_counter()
        k = self.num_steps + 1
        hp = self.hp
        params = self._working_params()
        refresh = self._op is None or (k - 1) % hp["curvature_every"] == 0
        rebuild = self._op is None or (k - 1) % (hp["inverse_every"] or hp["curvature_every"]) == 0
        est = self.estimator  # None before the first step with curvature='auto'
        saved_est = est.state_dict() if refresh and est is not None else None
        saved_gen = self._generator.get_state() if refresh else None
        saved_cache = (self._op, self._inverses, self._omega)
        saved_source = (self.estimator, self.source, self.source_reason)
        saved_running = ([(b, b.detach().clone()) for _, _, b in running_statistics(self.model)]
                         if couple and self.model is not None else [])  # to undo a refused step
        try:
            if self.distributed is not None and self.distributed.shard_batches and batch is not None:
                rows = self.distributed.shard(num_samples(batch[0]))
                batch = (take_samples(batch[0], rows), batch[1][rows])
            X, y, f, data_loss, grads, evaluate = self._forward(k, params, closure, batch, refresh)
            if self.distributed is not None:  # the union's loss, gradient and objective after the step
                from curvkit.optim.second_order._distributed import reduce_step_inputs

                terms = self.likelihood.num_terms(f, y)  # this rank's counted loss terms (not its samples)
                data_loss, grads, evaluate = reduce_step_inputs(self, terms, data_loss, grads, evaluate,
                                                                closure is not None)
            out = self._compute(k, params, X, y, f, data_loss, grads, rebuild)
        except BaseException:
            self._linearisation.release()  # the primals kept for the quadratic model of a refused step
            if saved_est is not None:
                est.load_state_dict(saved_est)
            if saved_gen is not None:
                self._generator.set_state(saved_gen)
            self._op, self._inverses, self._omega = saved_cache
            self.estimator, self.source, self.source_reason = saved_source
            for b, v in saved_running:  # the step's training pass is undone with the rest
                b.copy_(v)
            raise
        E0, update, record = out
        # ---- write (everything was checked by _compute)
        for p, q, u in zip(params, self.ordered_params(), update):
            p.add_(u)
            if self._replica is not None:  # the user's FSDP2 shard: this rank's rows of the update
                self._replica.write_local_(q, u)
            if hp["momentum"]:
                self.state[q]["previous_update"] = u
        self.zeta = record["zeta"]
        if record["quadratic"]:
            self._alpha, self._beta = record["alpha"], record["beta"]
            if record["alpha"] < 0:  # a zero direction (alpha = 0) says nothing about the step size
                m, w = self._log_alpha
                self._log_alpha = (ALPHA_AVERAGE * m + (1 - ALPHA_AVERAGE) * math.log(-record["alpha"]),
                                   ALPHA_AVERAGE * w + (1 - ALPHA_AVERAGE))
        if rebuild and (hp["inverse_every"] or 0) > hp["curvature_every"]:
            self._held = self.estimator.state_dict()  # later refreshes change the statistics before the next rebuild
        rho = math.nan
        if hp["tau_every"] and k % hp["tau_every"] == 0:
            E1 = evaluate()
            rho = reduction_ratio(E1 - E0, record["predicted_change"])
            self.tau = levenberg_marquardt(self.tau, rho, hp["omega_tau"], hp["lm_rule"])
            record["loss_after"] = E1
        self.num_steps = k
        dt = time.perf_counter() - t0
        self.elapsed_s += dt
        record.update(rho=None if math.isnan(rho) else rho, tau=self.tau, time_s=dt, elapsed_s=self.elapsed_s)
        self.history.append(record)
        return torch.tensor(E0, dtype=self._dtype, device=self._device)

    def _objective(self, data_loss: Tensor, params: list[Tensor]) -> float:
        wd = self.hp["weight_decay"]
        if not wd:
            return float(data_loss)
        detached = [p.detach() for p in params]
        return float(data_loss) + 0.5 * wd * float(_dot(detached, detached))  # one read of the device

    def _forward(self, k: int, params: list[Tensor], closure: Callable[[], Any] | None,
                 batch: tuple[Inputs, Tensor] | None, refresh: bool) -> tuple[Any, ...]:
        """Forward pass (captured for the curvature and the linearisation), loss and gradient.

        Returns (X, y, f, data loss, gradient of the data loss, evaluate) with ``evaluate()`` the objective
        at the current parameters on the same minibatch (for rho).
        """
        model, lik = self._net, self._shard_likelihood
        name = type(self).__name__
        if batch is None and closure is None:
            raise TypeError(f"{name}.step needs the minibatch: step(batch=(X, y)) (the curvature, the exact "
                            "quadratic model and rho are computed on it), or a closure")
        if batch is not None:
            X, y = batch
            if not self._output_checked or self.estimator is None:
                self._first_pass(X)
            with torch.enable_grad():
                f, copies, cap = self._record(k, X, refresh)
                data_loss = self._checked(k, "the loss", lambda: lik(f, y))
                if refresh:
                    self._checked(k, "the curvature", lambda: self._accumulate(cap, f, y))
                # raw parameters ran as per-sample copies P: their gradient is that of P summed over samples
                wrt = [copies.get(n, p) for n, p in zip(self._names, params)]
                grads = [g.sum(0, keepdim=True) if n in copies else g
                         for n, g in zip(self._names, torch.autograd.grad(data_loss, wrt))]

            def evaluate() -> float:
                try:  # the kernels of E(theta) before the step (same rounding); running statistics kept
                    with curvature_kernels(), kept_running_statistics(model):
                        return self._objective(lik(self._logits(model(X)), y), params)
                except ValueError:  # NaN/inf outputs after the step: rho = -inf below
                    return math.inf

            return X, y, f.detach(), data_loss.detach(), grads, evaluate
        # closure: loss and p.grad from the closure, the input from a hook, one more forward pass
        if getattr(lik, "hessian_needs_target", False):
            raise TypeError(f"{name}: the output Hessian of {lik.name} depends on the labels; step(batch=(X, y))")
        padding = {k: getattr(lik, k) for k in ("ignore_index", "ignore_value") if getattr(lik, k, None) is not None}
        if padding:  # the curvature would count the padded positions (the closure's targets are not seen)
            setting = ", ".join(f"{k}={v!r}" for k, v in padding.items())
            raise TypeError(f"{name}: {lik.name} has padding ({setting}), which only the targets mark, and a "
                            "closure does not pass them: the curvature would count the padded positions; use "
                            "step(batch=(X, y))")
        seen: list[Inputs] = []
        called: set[int] = set()

        def record_input(_m: nn.Module, args: tuple[Any, ...]) -> None:
            if len(args) != 1 or not isinstance(args[0], (Tensor, Mapping)):
                raise TypeError(f"{name}: the closure must call the model on the batch as its one positional "
                                "argument, model(X), with X a tensor or a mapping of tensors")
            if id(args[0]) in called:  # the compiled model calling the module it compiles
                return
            called.add(id(args[0]))
            X = self._check_input(args[0], "the closure's model input")  # before the model runs on it
            seen.append(map_inputs(Tensor.detach, X))

        # a compiled model does not run hooks added to the module it compiles: both are watched
        handles = [m.register_forward_pre_hook(record_input) for m in self._closure_models]
        try:
            with torch.enable_grad():
                loss = closure()  # type: ignore[misc]
        finally:
            for handle in handles:
                handle.remove()
        if len(seen) != 1:
            raise ValueError(f"{name}: the closure must call the model exactly once (it called it {len(seen)} "
                             "times)")
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ValueError(f"{name}: the closure must return the scalar loss it back-propagated")
        missing = [n for n, p in zip(self._names, params) if p.grad is None]
        if missing:
            raise ValueError(f"{name}: after closure() parameter(s) {', '.join(missing)} have no gradient; the "
                             "closure must call loss.backward()")
        grads = [p.grad.detach().clone() for p in params]  # type: ignore[union-attr]
        X = seen[0]
        if not self._output_checked or self.estimator is None:
            self._first_pass(X)
        with torch.enable_grad(), kept_running_statistics(model):  # the closure ran the training pass
            f, _, cap = self._record(k, X, refresh)
            if refresh:
                self._checked(k, "the curvature", lambda: self._accumulate(cap, f, None))  # type: ignore[arg-type]

        def evaluate_closure() -> float:
            saved = [None if p.grad is None else p.grad.clone() for p in params]
            with torch.enable_grad(), kept_running_statistics(model):
                try:
                    value = closure()  # type: ignore[misc]
                except ValueError:
                    value = torch.tensor(math.inf)
            for p, g in zip(params, saved):
                p.grad = g
            return self._objective(value.detach(), params)

        return X, None, f.detach(), loss.detach(), grads, evaluate_closure

    def _record(self, k: int, X: Inputs, refresh: bool) -> tuple[Tensor, dict[str, Tensor], Any]:
        """The forward pass on X, recorded for the linearisation (its primal outputs kept when step k evaluates the
        quadratic model) and, on a refresh, captured for the curvature (raw parameters as per-sample copies,
        :meth:`KroneckerEstimator.forward`): (f, copies, capture)."""
        lin, est = self._linearisation, self.estimator
        keep = self.keep_primals and self._quadratic_due(k)
        if not refresh:
            return self._logits(lin.record(X, keep_primals=keep)), {}, None
        copies: dict[str, Tensor] = {}

        def forward() -> Tensor:
            f, c = est.forward(cap, X)
            copies.update(c)
            return self._logits(f)

        with est.capture() as cap:
            f = lin.record(X, forward, keep_primals=keep)
        return f, copies, cap

    def _accumulate(self, cap: Any, f: Tensor, y: Tensor | None) -> None:
        """The curvature statistics of this forward pass: alone (``ema=None``, the thesis's current
        minibatch), or added to the moving average or the running mean."""
        if self.hp["ema"] is None:
            self.estimator.reset()
        self.estimator.accumulate(cap, f, y)  # type: ignore[arg-type]

    def _check_input(self, X: Any, what: str) -> Inputs:
        """X as a checked batch of model inputs (:func:`curvkit.validation.check_inputs`: a tensor, or a mapping
        of tensors read into a dict, with one positive batch size); every floating tensor must have the model's
        dtype (integer inputs, token ids and attention masks, are not converted)."""
        name = type(self).__name__
        if isinstance(X, Tensor) and (X.dim() == 0 or X.shape[0] == 0):
            raise ValueError(f"{name}.step: {what} is empty (shape {tuple(X.shape)}); a step needs at least one "
                             "example")
        try:
            X = check_inputs(X, what)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{name}.step: {err}") from None
        for label, t in input_tensors(X, what):
            if t.is_floating_point() and t.dtype != self._dtype:
                raise ValueError(f"{name}.step: {label} has dtype {t.dtype} but the model's parameters are "
                                 f"{self._dtype}; convert the data (X.to({self._dtype})) or the model")
        return X

    def _checked_batch(self, batch: Any) -> tuple[Inputs, Tensor]:
        """``batch`` as (X, y) on the model's device, refused with a clear error when it is not a pair (X, y)
        of a non-empty batch of inputs (a tensor or a mapping of tensors, :meth:`_check_input`) and a tensor
        with as many targets as samples, a floating y of the model's dtype, or NaN/inf in a floating tensor
        of X or y."""
        name = type(self).__name__
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], (Tensor, Mapping))
                and isinstance(batch[1], Tensor)):
            got = (f"a {type(batch).__name__} of {', '.join(type(t).__name__ for t in batch)}"
                   if isinstance(batch, (tuple, list)) else type(batch).__name__)
            raise TypeError(f"{name}.step: batch must be a pair (X, y), X a tensor or a mapping of tensors (e.g. "
                            f"{{'input_ids': ..., 'attention_mask': ...}}) and y a tensor, got {got}")
        X, y = map_inputs(ordinary, self._check_input(batch[0], "batch X")), ordinary(batch[1])
        if y.dim() == 0 or y.shape[0] != num_samples(X):
            raise ValueError(f"{name}.step: batch y has shape {tuple(y.shape)} for X of shape {describe_inputs(X)}; "
                             "give one target per example (same first dimension)")
        if y.is_floating_point() and y.dtype != self._dtype:
            raise ValueError(f"{name}.step: batch y has dtype {y.dtype} but the model's parameters are "
                             f"{self._dtype}; convert the targets (y.to({self._dtype}))")
        for what, t in [*input_tensors(X, "batch X"), ("batch y", y)]:
            if t.is_floating_point():
                bad = int((~torch.isfinite(t)).sum())
                if bad:
                    raise ValueError(f"{name}.step: {what} contains NaN or inf ({bad} of {t.numel()} entries); "
                                     "nothing was changed: clean the data (or mark padded targets with the "
                                     "likelihood's ignore_index / ignore_value)")
        return inputs_to(X, self._device), y.to(self._device)

    def _checked(self, k: int, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except ValueError as err:
            if "NaN or inf" in str(err):
                raise FloatingPointError(f"{type(self).__name__}: step {k}: {what} is not finite ({err}); "
                                         "nothing was changed") from err
            raise

    def _compute(self, k: int, params: list[Tensor], X: Tensor, y: Tensor | None, f: Tensor, data_loss: Tensor,
                 grads: list[Tensor], rebuild: bool) -> tuple[float, list[Tensor], dict[str, Any]]:
        """Direction, step size, damping choices and the update (nothing is written here). ``rebuild``: hold the
        estimator's current factors and drop the cached inverses first.

        The quadratic model (the exact GGN products of alpha*, the zeta search, rho's prediction) is evaluated
        on the first step, on every step k that ``quadratic_every`` divides and on every step that adapts tau or
        zeta (they need it; with ``tau_every = quadratic_every`` they coincide); any other step takes
        :meth:`_reuse_step_size`."""
        hp = self.hp
        name = type(self).__name__
        E0 = self._objective(data_loss, params)
        if not math.isfinite(E0):
            raise FloatingPointError(f"{name}: step {k}: the loss on this minibatch is {E0}; nothing was changed")
        wd = hp["weight_decay"]
        g = [gr + wd * p.detach() if wd else gr for gr, p in zip(grads, params)]
        bad = first_nonfinite(g)
        if bad is not None:
            raise FloatingPointError(f"{name}: step {k}: the gradient of {self._names[bad]} contains NaN or inf; "
                                     "nothing was changed")
        if rebuild:
            self._hold(self.estimator.operator())
        adapt_zeta = bool(hp["zeta_every"]) and k % hp["zeta_every"] == 0
        quadratic = self._quadratic_due(k)
        # ---- candidate directions (the current zeta first, so that ties keep it)
        zetas = [self.zeta]
        if adapt_zeta:
            zetas += [hp["omega_zeta"] * self.zeta, self.zeta / hp["omega_zeta"]]
        dirs = []
        for z in zetas:
            try:
                d = self._direction(z, g)
            except ValueError as err:
                raise ValueError(f"{name}: step {k}: the damped curvature cannot be inverted with zeta = {z:g} "
                                 f"({err}); nothing was changed") from err
            dirs.append([t.to(p.dtype) for t, p in zip(d, params)])
        prev = None
        if hp["momentum"]:
            prev = [self.state[p].get("previous_update") for p in self.ordered_params()]
            if any(u is None for u in prev):
                prev = None
        if not quadratic:
            return self._reuse_step_size(k, params, E0, data_loss, g, dirs[0], prev, rebuild)
        JV = self._linearisation(dirs + ([prev] if prev is not None else []))  # type: ignore[list-item]
        self._linearisation.release()
        sd = self.statistics_dtype  # the quadratic model of a bf16/fp16 model's tangents in float32 or wider
        M = output_gram(self._shard_likelihood, f.to(sd), y, JV.to(sd))
        if self.distributed is not None:  # d_i^T G d_j summed over the shard's counted terms: the union's
            from curvkit.optim.second_order._distributed import reduce_sums

            M = reduce_sums(self.distributed, [M], self.likelihood.num_terms(f, y), self.likelihood.reduction)[0]
        if not bool(torch.isfinite(M).all()):
            raise FloatingPointError(f"{name}: step {k}: the exact GGN quadratic form is not finite; nothing was "
                                     "changed")
        lam = wd + self.tau
        all_dirs = dirs + ([prev] if prev is not None else [])
        n = len(all_dirs)
        dots = [_dot(a, b) for a in all_dirs for b in all_dirs] + [_dot(d, g) for d in all_dirs]
        read = torch.stack([t.to(M.dtype) for t in dots]).tolist()  # with M: one read of the device
        Mv = M.tolist()
        C = [[Mv[i][j] + lam * read[i * n + j] for j in range(n)] for i in range(n)]
        dg = read[n * n:]
        best, best_q, best_alpha = 0, math.inf, math.nan
        for i in range(len(dirs)):
            try:
                alpha, q = line_minimum(dg[i], C[i][i])
            except FloatingPointError as err:
                raise FloatingPointError(f"{name}: step {k}: {err}; nothing was changed") from err
            if q < best_q:
                best, best_q, best_alpha = i, q, alpha
        d = dirs[best]
        beta = None
        alpha, predicted = best_alpha, best_q
        if prev is not None:
            j = len(dirs)
            sol = two_direction_minimum([[C[best][best], C[best][j]], [C[j][best], C[j][j]]], [dg[best], dg[j]])
            if sol is not None:
                alpha, beta, predicted = sol
        update = self._update(k, params, alpha, d, beta, prev, "alpha*")
        record = dict(step=k, loss=E0, data_loss=float(data_loss), alpha=alpha, beta=beta, zeta=zetas[best],
                      predicted_change=predicted, direction_dot_grad=dg[best], dCd=C[best][best],
                      omega=dict(self._omega), zero_curvature=list(self._zero_blocks), refreshed=rebuild,
                      quadratic=True)
        return E0, update, record

    def _quadratic_due(self, k: int) -> bool:
        """Step k evaluates the quadratic model (:meth:`_compute`)."""
        hp = self.hp
        adapt_zeta = bool(hp["zeta_every"]) and k % hp["zeta_every"] == 0
        adapt_tau = bool(hp["tau_every"]) and k % hp["tau_every"] == 0
        return self._alpha is None or adapt_tau or adapt_zeta or k % hp["quadratic_every"] == 0

    def _update(self, k: int, params: list[Tensor], alpha: float, d: list[Tensor], beta: float | None,
                prev: list[Tensor] | None, what: str) -> list[Tensor]:
        """``alpha d (+ beta prev)``, refused when it would write NaN or inf into a parameter."""
        update = [alpha * t for t in d]
        if beta is not None:
            update = [u + beta * v for u, v in zip(update, prev)]  # type: ignore[arg-type]
        bad = first_nonfinite([p.detach() + u for p, u in zip(params, update)])
        if bad is not None:
            raise FloatingPointError(f"{type(self).__name__}: step {k}: the update would write NaN or inf into "
                                     f"{self._names[bad]} (alpha = {alpha:.3g}, {what}); nothing was changed")
        return update

    def _reuse_step_size(self, k: int, params: list[Tensor], E0: float, data_loss: Tensor, g: list[Tensor],
                         d: list[Tensor], prev: list[Tensor] | None, rebuild: bool
                         ) -> tuple[float, list[Tensor], dict[str, Any]]:
        """A step between evaluations of the quadratic model: ``alpha d (+ beta prev)`` with alpha the geometric
        mean of the past alpha*s (a bias-corrected moving average of log |alpha*| with factor
        :data:`ALPHA_AVERAGE`; alpha* has the sign of -d^T g < 0) and the last beta (no exact GGN product; nothing
        predicted, so no rho). The minibatch's alpha* varies by an order of magnitude from step to step (0.04 to
        1.06 in ten steps of the chapter-4 autoencoder); carrying the last one over cost far more progress than
        the average (benchmarks/gauss_newton_amortised.py)."""
        m, w = self._log_alpha
        alpha, beta = (-math.exp(m / w) if w > 0 else float(self._alpha)), self._beta  # type: ignore[arg-type]
        if prev is None:
            beta = None
        update = self._update(k, params, alpha, d, beta, prev, "the mean of the past alpha*s")
        record = dict(step=k, loss=E0, data_loss=float(data_loss), alpha=alpha, beta=beta, zeta=self.zeta,
                      predicted_change=None, direction_dot_grad=float(_dot(d, g)), dCd=None, omega=dict(self._omega),
                      zero_curvature=list(self._zero_blocks), refreshed=rebuild, quadratic=False)
        return E0, update, record

    # ------------------------------------------------------------------ checkpoints
    def _config(self) -> dict[str, Any]:
        """What a state_dict must agree on: the curvature source in use ('auto' before it is chosen) and the
        estimator's options."""
        cfg = {k: self.hp[k] for k in _CONFIG}
        cfg["curvature"] = self.source if self.source is not None else "auto"
        return cfg

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state (per-parameter previous updates, param groups) plus tau, zeta, the step
        counter, the wall-clock so far, the curvature source (also the one ``'auto'`` chose) with the estimator
        options, the factor statistics and the generator state."""
        sd = super().state_dict()
        sd["gauss_newton"] = {
            "num_steps": self.num_steps, "tau": self.tau, "zeta": self.zeta, "elapsed_s": self.elapsed_s,
            "alpha": self._alpha, "beta": self._beta, "log_alpha": list(self._log_alpha), "held": self._held,
            "estimator": None if self.estimator is None else self.estimator.state_dict(),
            "generator": self._generator.get_state(), "config": self._config(), "source_reason": self.source_reason,
            # 2: ema=None means the current minibatch (format 1, curvkit 0.1: the running mean); 3: the config
            # holds the estimator options and the source 'auto' chose
            "format": 3,
        }
        return sd

    def rank_state(self) -> Tensor | None:
        """What this rank's :meth:`state_dict` holds that the other ranks' do not (data-parallel and sharded runs):
        the state of the generator of sampled labels and projections (``kfac``, ``projection``, and ``'auto'``
        before its first step), or None for the deterministic sources (``kflr``, ``kfra``), which never draw
        from it. Pass it as ``rank_state=`` to :func:`curvkit.distributed.save_checkpoint` or
        :func:`~curvkit.distributed.save_sharded_checkpoint`, with ``rank_state_required=opt.rank_state() is not
        None`` when loading, and give the loaded one back with :meth:`load_rank_state` after
        :meth:`load_state_dict` (which sets rank 0's)."""
        return None if self.source in ("kflr", "kfra") else self._generator.get_state()

    def load_rank_state(self, rank_state: Tensor | None) -> None:
        """Restore this rank's :meth:`rank_state` (None: nothing to restore)."""
        if rank_state is not None:
            self._generator.set_state(rank_state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`. The saved configuration must match this optimiser's, except that an
        optimiser created with ``curvature='auto'`` that has not stepped yet takes the saved source (a resumed
        run keeps the source its first step chose)."""
        sd = dict(state_dict)
        gn = sd.pop("gauss_newton", None)
        if gn is None:
            raise ValueError("this state_dict was not written by GaussNewton (no 'gauss_newton' entry)")
        mine = self._config()
        theirs = {**_CONFIG_BEFORE, **dict(gn["config"])}
        legacy = gn.get("format", 1) == 1 and theirs.get("ema") is None
        if legacy:  # curvkit 0.1's ema=None was the running mean over every minibatch
            theirs["ema"] = "running_mean"
        adopt = self.source is None and theirs["curvature"] in _CURVATURES  # 'auto', not chosen yet
        if adopt:
            mine["curvature"] = theirs["curvature"]
        if theirs != mine:
            hint = (" (written by curvkit 0.1, whose default ema=None was the running mean of the factors over every "
                    "minibatch; resume it with ema='running_mean' to continue that run exactly, or start the "
                    "optimiser afresh for the thesis's current-minibatch curvature)") if legacy else ""
            raise ValueError(f"state_dict is for {theirs}, this optimiser has {mine}{hint}")
        if adopt:
            self._use_source(theirs["curvature"], gn.get("source_reason") or "the source of the resumed run")
        super().load_state_dict(sd)
        if gn["estimator"] is not None:
            self.estimator.load_state_dict(gn["estimator"])
        self._generator.set_state(gn["generator"])
        self.num_steps, self.tau, self.zeta = int(gn["num_steps"]), float(gn["tau"]), float(gn["zeta"])
        self.elapsed_s = float(gn["elapsed_s"])
        self._alpha, self._beta = gn.get("alpha"), gn.get("beta")
        m, w = gn.get("log_alpha", (0.0, 0.0))
        self._log_alpha = (float(m), float(w))
        self._inverses = {}
        self._op = None
        self._omega = {}
        self._zero_blocks = []
        self._held = gn.get("held")
        if self._held is not None:  # the factors held at the last rebuild, then the statistics refreshed since
            self.estimator.load_state_dict(self._held)
            self._hold(self.estimator.operator())
            self.estimator.load_state_dict(gn["estimator"])
        elif self.estimator is not None and self.estimator.num_updates > 0:
            self._hold(self.estimator.operator())
