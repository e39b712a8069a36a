"""Common machinery of the mean-field Gaussian optimisers (MESU, MESU w/o reg, BGD, BBB-SGD).

The model stays a plain ``nn.Module``; its parameters are the posterior means mu. The optimiser owns one
standard deviation sigma per scalar parameter (biases included; raw sigma, no softplus: the MESU paper
writes its rule for sigma itself and does not single out biases) in ``self.state[p]['sigma']``. One step:

1. draw eps_k ~ N(0, I), k = 1..K (one per scalar weight per sample, shared by the minibatch) from the
   optimiser's own ``torch.Generator`` (seeded, saved in ``state_dict``);
2. estimate g_mu = dC/dmu and g_sigma = dC/dsigma (paper Eq. 1) from the K samples w_k = mu + sigma*eps_k;
3. apply the rule of the subclass to every scalar weight (all rules use the pre-step sigma);
4. count diagnostics (always on) and apply the optional safeguards (off by default).

Three ways to feed a step (exactly one per call):

* ``opt.step(batch=(X, y))`` - the fast path: the K samples are evaluated together with
  ``vmap`` + ``functional_call`` (:func:`curvkit.posterior.mc_gradients`) using ``loss_fn``;
* ``opt.step(closure)`` - torch.optim-compatible: ``closure()`` must compute the loss of the module *as it
  currently is* and call ``backward()``; the optimiser writes each weight sample into the parameters in
  turn, calls the closure K times, accumulates the gradients and restores mu (K sequential passes);
* ``opt.step(grads=MCGradients(...))`` - apply precomputed estimates (tests, custom estimators).

Inputs may have any shape and dtype the model takes ((B, T, F) token features, integer token ids for an
``nn.Embedding``, images); a model may return one output row per input or flatten tokens into rows
((B*T, C) logits with (B*T,) targets). BatchNorm in training mode: on the ``batch=`` path every weight
sample normalises with the batch statistics and the running statistics are updated once per step, with the
statistics averaged over the K samples (:mod:`curvkit.posterior.sampling`), written together with mu and
sigma; the closure path runs the module itself K times, so its running statistics move K times per step.

(``step(inputs=X, targets=y)`` is the deprecated spelling of ``batch=``.) A step checks the new mu and
sigma before writing them: a NaN or inf gradient raises FloatingPointError and changes nothing.

Loss reduction (the MESU paper does not state it): there is no global learning rate, so the scale of the loss
sets the step size. The default ``loss_fn`` is ``CrossEntropy(reduction='sum')``: L = sum over the minibatch
of the per-example NLL (as in Zeno et al.'s BGD code and the MESU authors' later code). A ``mean`` loss makes
every step B times smaller, and such a run barely learns (9.9% after 60 MNIST steps where the summed loss
reaches 76%): a ``loss_fn`` that says it averages (a curvkit likelihood or a torch loss with
``reduction='mean'``) gets a :class:`MeanReductionWarning`; a closure cannot be inspected, so sum its loss
over the batch.

Diagnostics (not in the paper, which uses no clamp, clipping or sigma floor; always on; ``opt.diagnostics``):
``steps``; ``steps_large_sigma_grad`` / ``weights_large_sigma_grad`` (steps with any weight, and the total
number of weight-updates, where sigma * g_sigma >= 1, i.e. the step may overshoot);
``steps_nonpositive_sigma`` / ``weights_nonpositive_sigma`` (where the rule gives sigma <= 0, counted every
step, so a weight whose sigma stays negative is counted again each step); ``sigma_sign_flips`` (weight-updates
from sigma > 0 to sigma <= 0); all counted before the safeguards. A negative sigma is not fatal in itself:
only |sigma| matters for sampling, and the dynamics are odd-symmetric (Lemma 1 gives E[g_sigma] = sigma H also
for sigma < 0, and the prior term of Eq. 3 then pulls towards -sigma_prior; derived, not in the paper).
Safeguards (off by default, per param group): ``sigma_min`` (floor sigma <- max(sigma, sigma_min)) and
``max_ratio`` r (clamp |dmu| <= r |sigma| and |dsigma| <= r |sigma|; the authors' later code uses r = 0.1,
which is not in this paper).

Hessian-diagonal estimates: :meth:`MeanFieldOptimizer.curvature` returns a
:class:`curvkit.linalg.DiagonalOperator` (float64) over the Bayesian parameters in the module's
``named_parameters`` order. ``method='state'`` reads the estimate off sigma (Eq. 7 for MESU, Eq. 9 for
MESU w/o reg, 1/(n sigma^2) for BGD); ``method='stein'`` is Lemma 1 (Eq. 11), g_sigma / sigma of the last
step. Both estimate the Hessian of the *per-step loss* (the minibatch loss under ``loss_fn``), i.e. with
the default sum reduction B times the per-example average Hessian.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypedDict

import torch
from torch import Tensor, nn

from curvkit.likelihoods import CrossEntropy, Likelihood
from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import DiagonalOperator
from curvkit.optim.base import CurvatureOptimizer, check_finite, check_step_extras, legacy_model_first
from curvkit.posterior.predict import predict_map, predict_mc
from curvkit.posterior.sampling import (
    LossFn,
    MCGradients,
    likelihood_loss,
    mc_gradients,
    sample_buffers,
    sample_eps,
)
from curvkit.structure import read_model, uncompiled
from curvkit.validation import integer, positive

_DIAG_KEYS = (
    "steps",
    "steps_large_sigma_grad",
    "weights_large_sigma_grad",
    "steps_nonpositive_sigma",
    "weights_nonpositive_sigma",
    "sigma_sign_flips",
)


class MeanReductionWarning(UserWarning):
    """The loss given to a mean-field optimiser averages over the batch; these rules assume a sum."""


def _warn_if_mean(loss_fn: Any, cls: str) -> None:
    reduction = getattr(loss_fn, "reduction", None)
    if reduction == "mean":
        warnings.warn(
            f"{cls}: loss_fn has reduction='mean'; MESU, BGD and the other mean-field rules have no learning "
            "rate and assume the loss SUMMED over the minibatch (paper Eq. 3), so a mean makes every step "
            "batch-size times smaller and training barely moves. Use reduction='sum' (silence this warning "
            "with warnings.filterwarnings('ignore', category=MeanReductionWarning) if intended)",
            MeanReductionWarning, stacklevel=4)


class MeanFieldOptions(TypedDict, total=False):
    """The keyword arguments every mean-field optimiser (:class:`~curvkit.optim.MESU`, :class:`~curvkit.optim.BGD`,
    :class:`~curvkit.optim.BBBSGD`) takes beside its own hyperparameters, with one meaning and one default each
    (documented on :class:`MeanFieldOptimizer`; ``sigma_min``/``max_ratio`` are per-group safeguards)."""

    mc_samples: int
    loss_fn: LossFn | Likelihood | None
    sigma_min: float | None
    max_ratio: float | None
    seed: int
    generator: torch.Generator | None
    chunk_size: int | None
    distributed: Any


class MeanFieldOptimizer(CurvatureOptimizer):
    """Base class; see the module docstring. Subclasses implement :meth:`_deltas` and
    :meth:`_state_hessian` and validate their own hyperparameters in :meth:`_check_group`.

    Args:
        params: parameters (or param-group dicts) of ``model`` to treat as Bayesian; None means all its
            trainable parameters. Parameters of ``model`` left out stay deterministic (never sampled,
            never updated); so do frozen ones (``requires_grad=False``), which are dropped from the groups
            (``model.parameters()`` of a model with a frozen base is fine: :mod:`curvkit.optim.base`).
        defaults: per-group hyperparameters (subclass-specific plus ``sigma_init``).
        sigma_min, max_ratio: optional per-group safeguards (default off; module docstring).
        model: the module whose parameters are the posterior means mu (required: the vectorised step
            evaluates it at sampled weights).
        mc_samples: K, Monte Carlo samples per step (>= 1).
        loss_fn: per-sample-of-weights minibatch loss ``loss_fn(outputs, targets) -> scalar``; a
            :class:`~curvkit.likelihoods.Likelihood` or any callable; default ``CrossEntropy('sum')``.
        seed: seed of the optimiser's noise generator (ignored if ``generator`` is given).
        generator: a ``torch.Generator`` on the parameters' device to draw eps from.
        chunk_size: optional ``vmap`` chunk size over the K samples (bounds memory).
        distributed: a :class:`curvkit.distributed.Reducer` for data-parallel steps (default: the one set by
            ``curvkit.distributed.set_current``, else none). At construction rank 0's parameters (mu) and
            noise-generator state are broadcast, so every rank draws the SAME eps_k; each step's g_mu,
            g_sigma and per-sample losses, computed on the rank's shard, are then all-reduced: summed for
            a summed loss (the default; a closure's loss is taken as summed over its shard), and for a
            curvkit likelihood with ``reduction='mean'`` computed on the shard as sums over its counted loss
            terms M_r (``num_terms``: positions that are not padding) and divided by sum_r M_r (the mean over
            the union of unequal, padded shards; :mod:`curvkit.distributed.reducer`). The step is then the
            single-process step on the union of the shards, on every rank. Another ``loss_fn`` with
            ``reduction='mean'`` (a torch loss) is refused data-parallel: curvkit cannot read how many terms
            its mean divides by (ignored targets, positions). With ``distributed.grads='synced'`` (a DDP model) a closure's gradients are taken
            as already reduced. ``distributed.shard_batches``: ``batch=`` is cut to the rank's rows.
    """

    model: nn.Module

    def __init__(
        self,
        params: Iterable[Any] | None,
        defaults: dict[str, Any],
        *,
        model: nn.Module | None,
        mc_samples: int = 10,
        loss_fn: LossFn | Likelihood | None = None,
        sigma_min: float | None = None,
        max_ratio: float | None = None,
        seed: int = 0,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
        distributed: Any = None,
    ):
        defaults = {**defaults, "sigma_min": sigma_min, "max_ratio": max_ratio}
        params, model = legacy_model_first(type(self).__name__, params, model)
        if model is None:
            raise TypeError(f"{type(self).__name__} needs the model: {type(self).__name__}(model.parameters(), "
                            "model=model, ...)")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.mc_samples = integer("mc_samples", mc_samples)
        if chunk_size is not None:
            integer("chunk_size", chunk_size)
        model = self.model = uncompiled(model)  # the same parameters (curvkit.structure.uncompiled)
        self._names = {id(p): n for n, p in model.named_parameters()}
        self.chunk_size = chunk_size
        if loss_fn is None:
            loss_fn = CrossEntropy(reduction="sum")
        _warn_if_mean(loss_fn, type(self).__name__)
        self.loss_fn: LossFn | Likelihood = loss_fn
        self._loss = likelihood_loss(loss_fn) if isinstance(loss_fn, Likelihood) else loss_fn
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, defaults)
        self._init_names(model)
        first = self.first_param()
        if generator is None:
            generator = torch.Generator(device=first.device)
            generator.manual_seed(int(seed))
        self.generator = generator
        if distributed is None:
            from curvkit.distributed import current

            distributed = current()
        self.distributed = distributed
        if distributed is not None and not isinstance(loss_fn, Likelihood) and getattr(loss_fn, "reduction", None) == "mean":
            raise ValueError(f"{type(self).__name__}(distributed=...): loss_fn {type(loss_fn).__name__} has "
                             "reduction='mean', a mean whose number of terms (ignored targets, positions) curvkit "
                             "cannot read, so the ranks could not be weighted by it; pass a curvkit likelihood "
                             "(e.g. curvkit.likelihoods.CrossEntropy('mean', ignore_index=-100), which counts its "
                             "terms) or the summed loss (reduction='sum', which these rules assume)")
        #: the loss of a data-parallel step on this rank's shard: a mean likelihood's SUM over the shard's
        #: counted terms (the ranks' sums travel with their counts, _reduce_grads)
        self._shard_loss = self._loss
        if distributed is not None and isinstance(loss_fn, Likelihood) and loss_fn.reduction == "mean":
            self._shard_loss = likelihood_loss(loss_fn.with_reduction("sum"))
        if distributed is not None:  # the same mu and the same noise on every rank
            distributed.sync_tensors_([p for g in self.param_groups for p in g["params"]])
            distributed.sync_generator(self.generator)
        self._step = 0
        self._diagnostics = dict.fromkeys(_DIAG_KEYS, 0)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["sigma"] = torch.full_like(p, float(group["sigma_init"]), memory_format=torch.preserve_format)

    # -- hyperparameters ------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if id(p) not in self._names:
                raise ValueError("every optimised parameter must be a parameter of `model` "
                                 "(got a tensor that model.named_parameters() does not list)")
            if not p.is_floating_point():
                raise ValueError(f"parameter {self._names[id(p)]!r} is not floating point")
        self._check_group(group)
        for name in (*self.POSITIVE, "sigma_init"):
            positive(name, group[name])
        for name in ("sigma_min", "max_ratio"):  # optional
            if group[name] is not None:
                positive(name, group[name])
        if hasattr(self, "_step"):  # groups added after construction get their sigma now
            for p in group["params"]:
                self.state[p]["sigma"] = torch.full_like(p, float(group["sigma_init"]))

    #: the rule's own hyperparameters that must be finite numbers > 0, checked in every param group (with the
    #: shared ``sigma_init``, ``sigma_min``, ``max_ratio``) by :meth:`add_param_group`
    POSITIVE: tuple[str, ...] = ()

    def _check_group(self, group: dict[str, Any]) -> None:
        """Fill in derived defaults of a param group (before :attr:`POSITIVE` is checked)."""

    # -- accessors ------------------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        """n, the number of updates applied so far."""
        return self._step

    @property
    def diagnostics(self) -> dict[str, int]:
        """Copy of the always-on counters (see the module docstring)."""
        return dict(self._diagnostics)

    def _bayes_params(self) -> list[tuple[str, Tensor, dict[str, Any]]]:
        """(name, param, group) of every optimised parameter, in the module's named_parameters order."""
        owner = {id(p): g for g in self.param_groups for p in g["params"]}
        return [(n, p, owner[id(p)]) for n, p in self.model.named_parameters() if id(p) in owner]

    def layout(self) -> ParamLayout:
        """Layout of the Bayesian parameters (module order); the layout of :meth:`curvature`."""
        items = self._bayes_params()
        return ParamLayout(tuple(n for n, _, _ in items), tuple(p.shape for _, p, _ in items))

    def sigma_dict(self) -> dict[str, Tensor]:
        """name -> sigma (the live state tensors; do not modify in place)."""
        return {n: self.state[p]["sigma"] for n, p, _ in self._bayes_params()}

    def mu_dict(self) -> dict[str, Tensor]:
        """name -> mu (detached views of the module's parameters)."""
        return {n: p.detach() for n, p, _ in self._bayes_params()}

    # -- prediction -----------------------------------------------------------------------------------
    def predict(self, inputs: Tensor, mc_samples: int = 10, generator: torch.Generator | None = None,
                batch_size: int | None = 1024) -> Tensor:
        """MC-averaged softmax (N, C) over ``mc_samples`` weight samples (|sigma| is used). Uses
        ``generator`` if given, else a fresh generator seeded 0, so it never disturbs training noise."""
        if generator is None:
            generator = torch.Generator(device=inputs.device)
            generator.manual_seed(0)
        sig = {n: s.abs() for n, s in self.sigma_dict().items()}
        return predict_mc(self.model, inputs, sig, mc_samples, generator, batch_size)

    def predict_map(self, inputs: Tensor, batch_size: int | None = 1024) -> Tensor:
        """Softmax (N, C) of the mean network w = mu."""
        return predict_map(self.model, inputs, batch_size)

    # -- gradient estimation --------------------------------------------------------------------------
    def _draw_eps(self, mu: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return sample_eps(mu, self.mc_samples, self.generator)

    def _closure_gradients(self, closure: Callable[[], Any], mu: dict[str, Tensor],
                           sigma: dict[str, Tensor]) -> MCGradients:
        params = {n: p for n, p, _ in self._bayes_params()}
        eps = self._draw_eps(mu)
        saved = {n: p.detach().clone() for n, p in params.items()}
        g_mu = {n: torch.zeros_like(m) for n, m in mu.items()}
        g_sigma = {n: torch.zeros_like(m) for n, m in mu.items()}
        losses = []
        K = self.mc_samples
        try:
            for k in range(K):
                with torch.no_grad():
                    for n, p in params.items():
                        p.copy_(saved[n] + sigma[n] * eps[n][k])
                        p.grad = None
                with torch.enable_grad():
                    loss = closure()
                if loss is None:
                    raise ValueError("the closure must return the loss it back-propagated")
                losses.append(torch.as_tensor(loss).detach().reshape(()))
                for n, p in params.items():
                    if p.grad is None:
                        raise ValueError(f"after closure() parameter {n!r} has no gradient; the closure must "
                                         "compute the loss of the model and call loss.backward()")
                    g_mu[n] += p.grad / K
                    g_sigma[n] += p.grad * eps[n][k] / K
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(saved[n])
                    p.grad = None
        return MCGradients(g_mu, g_sigma, torch.stack(losses), eps)

    def mc_gradients(self, inputs: Tensor, targets: Tensor) -> MCGradients:
        """Vectorised MC estimates (Eq. 1) at the current (mu, sigma) with the optimiser's noise generator
        (advances it). ``inputs``: (B, ...) minibatch; ``targets``: what ``loss_fn`` expects."""
        return self._gradients(inputs, targets, self._loss)[0]

    def _gradients(self, inputs: Tensor, targets: Tensor, loss: LossFn) -> tuple[MCGradients, int | None]:
        """:meth:`mc_gradients` with ``loss``, and the batch's counted loss terms (:meth:`_check_batch`)."""
        terms = self._check_batch(inputs, targets)
        mu, sigma = self.mu_dict(), self.sigma_dict()
        return mc_gradients(self.model, loss, inputs, targets, mu, sigma, self.mc_samples,
                            eps=self._draw_eps(mu), chunk_size=self.chunk_size), terms

    def _check_batch(self, inputs: Tensor, targets: Tensor) -> int | None:
        """Validate a minibatch outside ``vmap``: inputs of any dtype (integer token ids included) with a
        batch dimension and, if floating point, finite; for a curvkit likelihood, targets that fit the
        model's output. The output is evaluated at mu on the first two rows (one output row per input row:
        the batch's output shape follows), else on the whole batch (e.g. tokens flattened to (B*T, C)),
        functionally and with private copies of any running statistics, so the module is not changed.
        Returns the batch's counted loss terms for a curvkit likelihood (``num_terms``), else None."""
        if not isinstance(inputs, Tensor) or inputs.dim() == 0 or inputs.shape[0] == 0:
            shape = tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__
            raise ValueError(f"inputs must be a tensor with a non-empty batch dimension (B, ...), got {shape}")
        if inputs.is_floating_point() and not bool(torch.isfinite(inputs).all()):
            raise ValueError(f"inputs must be finite; they contain NaN or inf ({int((~torch.isfinite(inputs)).sum())} entries)")
        if not isinstance(self.loss_fn, Likelihood):
            return None
        structure = read_model(self.model)
        B, n = int(inputs.shape[0]), min(2, int(inputs.shape[0]))

        def output(x: Tensor) -> Tensor:
            own = {name: b[0] for name, b in sample_buffers(self.model, 1).items()}
            return structure.functional_call({}, (x,), own)  # type: ignore[no-any-return]

        with torch.no_grad():
            f = output(inputs[:n])
            f = f[:1].expand(B, *f.shape[1:]) if f.shape[0] == n else output(inputs)
        self.loss_fn.check(f, targets)
        return self.loss_fn.num_terms(f, targets)

    # -- the step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], Any] | None = None,
        *,
        batch: tuple[Tensor, Tensor] | None = None,
        grads: MCGradients | None = None,
        **extras: Any,
    ) -> Tensor:
        """One update; returns the MC estimate of the loss C (mean over the K samples; NaN when only
        ``grads`` without losses are given). Exactly one of ``closure``, ``batch=(X, y)``, ``grads=``.

        Nothing is written unless every new mu and sigma is finite (else FloatingPointError)."""
        if "inputs" in extras or "targets" in extras:
            inputs, targets = extras.pop("inputs", None), extras.pop("targets", None)
            warnings.warn("step(inputs=X, targets=y) is deprecated; use step(batch=(X, y))", DeprecationWarning,
                          stacklevel=3)
            if inputs is None or targets is None:
                raise ValueError("pass inputs= and targets= together (better: batch=(X, y))")
            if batch is not None:
                raise ValueError("pass either batch= or inputs=/targets=, not both")
            batch = (inputs, targets)
        check_step_extras(type(self).__name__, extras, ())
        self._check_still_trainable()
        given = sum(x is not None for x in (closure, batch, grads))
        if given != 1:
            raise ValueError("pass exactly one of: closure, batch=(X, y), or grads=")
        mu, sigma = self.mu_dict(), self.sigma_dict()
        if grads is None:
            if closure is not None:
                grads = self._closure_gradients(closure, mu, sigma)
                if self.distributed is not None:
                    grads = self._reduce_grads(grads, None, None, self.distributed.grads == "synced")
            else:
                assert batch is not None
                if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                    raise TypeError("batch must be an (inputs, targets) pair")
                if self.distributed is not None and self.distributed.shard_batches:
                    rows = self.distributed.shard(int(batch[0].shape[0]))
                    batch = (batch[0][rows], batch[1][rows])
                with torch.enable_grad():
                    grads, terms = self._gradients(batch[0], batch[1], self._shard_loss)
                if self.distributed is not None:
                    mean = self._shard_loss is not self._loss  # the shard's sums of a mean likelihood
                    grads = self._reduce_grads(grads, terms if mean else None, int(batch[0].shape[0]), False)
        self._check_grads(grads, mu)
        loss = grads.loss if grads.losses.numel() else torch.tensor(float("nan"))
        if not bool(torch.isfinite(loss)):
            raise ValueError(f"the Monte Carlo loss is not finite ({float(loss)}); sigma or mu has diverged "
                             "(see opt.diagnostics) or the data contain NaN/inf")
        # phase 1: every update, counted and checked; phase 2: written (nothing changes if a value is bad)
        updates = []
        counts = dict.fromkeys(("flips", "large", "nonpos"), 0)
        any_large = any_nonpos = False
        for name, p, group in self._bayes_params():
            s = self.state[p]["sigma"]
            g_mu, g_sig = grads.g_mu[name], grads.g_sigma[name]
            d_mu, new_sigma = self._deltas(group, s, g_mu, g_sig)
            large = int(((s * g_sig) >= 1).sum())
            nonpos = int((new_sigma <= 0).sum())
            counts["flips"] += int(((s > 0) & (new_sigma <= 0)).sum())
            counts["large"] += large
            counts["nonpos"] += nonpos
            any_large |= large > 0
            any_nonpos |= nonpos > 0
            r = group["max_ratio"]
            if r is not None:
                bound = r * s.abs()
                d_mu = torch.maximum(torch.minimum(d_mu, bound), -bound)
                new_sigma = s + torch.maximum(torch.minimum(new_sigma - s, bound), -bound)
            if group["sigma_min"] is not None:
                new_sigma = new_sigma.clamp_min(group["sigma_min"])
            updates.append((name, p, d_mu, new_sigma, g_sig / s))
        check_finite(self._step + 1, [(f"mu of {n}", d) for n, _, d, _, _ in updates]
                     + [(f"sigma of {n}", ns) for n, _, _, ns, _ in updates], type(self).__name__)
        if grads.buffers:
            check_finite(self._step + 1, [(f"buffer {n}", b) for n, b in grads.buffers.items()],
                         type(self).__name__)
        for _name, p, d_mu, new_sigma, stein in updates:
            st = self.state[p]
            # Lemma 1 estimate with the sigma the gradients were taken at (pre-step); 0/0 -> nan.
            st["stein"] = stein.detach()
            p.add_(d_mu)
            st["sigma"].copy_(new_sigma)
        if grads.buffers:  # the running statistics, updated once per step (curvkit.posterior.sampling)
            own = dict(self.model.named_buffers())
            for n, b in grads.buffers.items():
                own[n].copy_(b)
        self._diagnostics["sigma_sign_flips"] += counts["flips"]
        self._diagnostics["weights_large_sigma_grad"] += counts["large"]
        self._diagnostics["weights_nonpositive_sigma"] += counts["nonpos"]
        self._step += 1
        self._diagnostics["steps"] += 1
        self._diagnostics["steps_large_sigma_grad"] += int(any_large)
        self._diagnostics["steps_nonpositive_sigma"] += int(any_nonpos)
        return loss.detach()

    def _check_still_trainable(self) -> None:
        """Refuse to step when a Bayesian parameter was frozen after construction: the rule would move it
        (MESU samples and updates every parameter it holds, whatever its ``requires_grad``)."""
        frozen = [n for n, p, _ in self._bayes_params() if not p.requires_grad]
        if frozen:
            raise ValueError(f"{type(self).__name__}: parameter(s) {frozen} were frozen (requires_grad=False) after "
                             "the optimiser was built, and a frozen parameter is never changed; build a new "
                             "optimiser over the trainable parameters (frozen ones are left out automatically)")

    def _reduce_grads(self, grads: MCGradients, terms: int | None, samples: int | None, synced: bool) -> MCGradients:
        """All-reduce one step's MC estimates over the ranks (``distributed`` in the class docstring): sums
        over the ranks, divided by the union's counted loss terms where ``terms`` (this shard's) is given
        (a mean likelihood evaluated as the shard's sums). ``samples``: the shard's samples, the weights of
        the running statistics (per-sample batch means)."""
        red = self.distributed
        names = list(grads.g_mu)
        parts = [grads.losses]
        if not synced:
            parts = [grads.g_mu[n] for n in names] + [grads.g_sigma[n] for n in names] + parts
        if terms is not None:
            parts, _ = red.mean_of_sums(parts, terms)
        else:
            parts = red.sum(parts, "all_reduce of Monte Carlo gradients")
        buffers = grads.buffers
        if buffers and samples is not None:  # running statistics: the mean over the ranks, weighted by shard
            floats = [n for n, b in buffers.items() if b.is_floating_point()]
            means, _ = red.weighted_mean([buffers[n] for n in floats], samples)
            buffers = {**buffers, **dict(zip(floats, means))}
        if synced:
            return MCGradients(grads.g_mu, grads.g_sigma, parts[0], grads.eps, buffers)
        k = len(names)
        return MCGradients(dict(zip(names, parts[:k])), dict(zip(names, parts[k:2 * k])), parts[-1], grads.eps,
                           buffers)

    def _check_grads(self, grads: MCGradients, mu: dict[str, Tensor]) -> None:
        if not isinstance(grads, MCGradients):
            raise TypeError(f"grads must be an MCGradients, got {type(grads).__name__}")
        for what, d in (("g_mu", grads.g_mu), ("g_sigma", grads.g_sigma)):
            missing = [n for n in mu if n not in d]
            if missing:
                raise ValueError(f"grads.{what} lacks entries for parameters {missing}")
            for n, m in mu.items():
                if tuple(d[n].shape) != tuple(m.shape):
                    raise ValueError(f"grads.{what}[{n!r}] has shape {tuple(d[n].shape)}, expected the "
                                     f"parameter's shape {tuple(m.shape)}")

    def _deltas(self, group: dict[str, Any], sigma: Tensor, g_mu: Tensor, g_sigma: Tensor) -> tuple[Tensor, Tensor]:
        """(delta_mu, new_sigma) of the rule from the pre-step sigma and the MC gradients."""
        raise NotImplementedError

    # -- Hessian-diagonal estimates -------------------------------------------------------------------
    def _state_hessian(self, group: dict[str, Any], sigma: Tensor, debias: bool) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no sigma-state Hessian estimate; use method='stein'")

    def hessian_diagonal(self, method: str = "state", debias: bool = False) -> DiagonalOperator:
        """Deprecated name of :meth:`curvature`."""
        warnings.warn(f"{type(self).__name__}.hessian_diagonal() is deprecated; use curvature()", DeprecationWarning,
                      stacklevel=2)
        return self.curvature(method, debias)

    def curvature(self, method: str = "state", debias: bool = False) -> DiagonalOperator:
        """Current estimate of the Hessian diagonal of the per-step loss, as a float64 DiagonalOperator.

        ``method='state'``: read off sigma (Eq. 7 / Eq. 9 / 1/(n sigma^2), see the subclass);
        ``debias=True`` removes the known transient of the sigma recursion (derived from Eq. 6 with constant
        curvature, not in the paper: 1/sigma^2 integrates the curvature, with a leak
        1 - 2 sigma_prior^2/sigma_res^2 per step for MESU and none without regularisation; assumes sigma
        started at ``sigma_init``). ``method='stein'``: Lemma 1 (Eq. 11),
        H ~ g_sigma / sigma, with the g_sigma of the last step and the sigma it was computed at.
        """
        if method not in ("state", "stein"):
            raise ValueError(f"method must be 'state' or 'stein', got {method!r}")
        layout = self.layout()
        out = []
        for _name, p, group in self._bayes_params():
            st = self.state[p]
            if method == "stein":
                if "stein" not in st:
                    raise RuntimeError("method='stein' needs at least one step (it uses the last MC gradients)")
                out.append(st["stein"].to(torch.float64))
            else:
                if self._step == 0:
                    raise RuntimeError(f"{type(self).__name__}.curvature(method='state') needs at least "
                                       "one step")
                out.append(self._state_hessian(group, st["sigma"].to(torch.float64), debias))
        return DiagonalOperator(layout, out)

    # -- checkpointing --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["meanfield"] = {
            "step": self._step,
            "diagnostics": dict(self._diagnostics),
            "generator_state": self.generator.get_state(),
            "mc_samples": self.mc_samples,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        extra = sd.pop("meanfield", None)
        if extra is None:
            raise ValueError("not a mean-field optimiser state_dict (no 'meanfield' entry)")
        super().load_state_dict(sd)
        self._step = int(extra["step"])
        self._diagnostics = dict.fromkeys(_DIAG_KEYS, 0) | {k: int(v) for k, v in extra["diagnostics"].items()}
        self.generator.set_state(extra["generator_state"])
        self.mc_samples = int(extra["mc_samples"])
