"""Kronecker-factored Bayesian-filtering optimisers (Aitchison 2018, Sec. 2.1.3, Eqs. 22-28, SI Sec. 4.3).

Per layer the latent is the weight matrix W_hat = [W | b] (M = out, N = in + 1), with posterior
covariance Sigma^x (x) Sigma^delta in the paper's column-stacking vec (:mod:`.kron_math`). Each step:

* :class:`KFBayes` (Eqs. 25-28, with Eqs. 22-24 for the data step):
    1. prior step for the covariance (Eq. 28, first-order KL projection of (1-a)^2 Sigma + eta^2 I (x) I;
       Lambda_x = tr(Sigma^x^{-1})/N, Lambda_delta = tr(Sigma^delta^{-1})/M refreshed every ``inv_every`` steps);
    2. data step: Eq. 24, corrected, per Fisher sample x_n (x) delta_n (as printed, Eq. 24 disagrees with its
       own derivation from SI Eq. 32; see :func:`~.kron_math.project_first_order`);
    3. mean: W_post = W_prior + Sigma^delta G Sigma^x, G = sum_n delta^g_n x_n^T (ascent gradient of the
       summed log-likelihood, from ``p.grad``);
    4. the parameters are set to the next prior mean (1 - a) W_post, a = eta^2/(2 sigma^2) (Eq. 26).
* :class:`KFNatGrad` (Eqs. 22-24): the same with eta = 0 (static weights): minibatch-online natural gradient
  whose factor shapes approach E[x x^T]^{-1}, E[delta delta^T]^{-1}.
* :class:`KFWhiten` (end of Sec. 2.1.3): the steady state of KFBayes, Sigma^x ~ sqrt(eta) C_x^{-1/2},
  Sigma^delta ~ sqrt(eta) C_delta^{-1/2}: W <- W + eta C_delta^{-1/2} G C_x^{-1/2}, with
  C_x = EMA(mean_n x x^T), C_delta = EMA(sum_n delta delta^T) (summed units), damping ``damping * tr(C)/dim``.
  The eigenbases are recomputed every ``inv_every`` steps; the second moments along them are updated at every
  step, so the normaliser is never stale (see the class docstring: stale inverse roots made the step
  unbounded). Optional momentum ``eta_p`` (an extrapolation by analogy with :class:`~.momentum.BFAdamSS`,
  Eqs. 18-21; the paper does not derive it).

Products with the factors: Sigma^delta G Sigma^x (KFNatGrad/KFBayes) and the whitening (KFWhiten) use the
gradient's per-example factors G = D^T X when that is cheaper (minibatch small against the layer widths), with
an exact correction for any part of G the factors do not explain (:mod:`.kron_math`). In KFNatGrad/KFBayes the
K Eq. 24 updates (sequential or batched) are computed in the span of the K samples (a K x K recursion, then
one rank-K product per factor) and the drift and rebalancing are folded into that product, so a step costs
O(K(N^2 + M^2)) for the factors plus the mean product, not K passes over each factor; the result equals the
per-sample loop up to rounding (tested). Lambda_x, Lambda_delta use a Cholesky factor, not an inverse.

Diagnostics: ``effective_lr()`` (per weight, the posterior variance times the loss scale) and
``diagnostics()`` (per layer: effective-lr statistics and the SGD-like / Adam-like regime) cost no
inversion and can be logged every step.

Fisher samples (the paper, Sec. 2.1.3, asks for rank-1 samples e = x (x) delta with delta centred or computed
from labels sampled from the model, and leaves their number per minibatch open; the per-example empirical
samples are the choice made here): by default the per-example *empirical* samples delta_n = the per-example
gradient of the summed loss with respect to the layer output (captured by hooks); ``fisher_samples=K``
uses the first K examples of the (shuffled) minibatch with delta scaled by sqrt(B/K), so that the
per-step Fisher estimate stays unbiased. Sampled-label or exact Fisher samples can be given per step:
``step(fisher_samples={layer_name: (X (K, N), D (K, M))})`` in summed-log-likelihood units.

``projection="exact"`` (tiny layers only, N*M <= 4096) replaces Eqs. 24/28 by the exact dense Kalman step
followed by the exact KL projection (flip-flop); it equals the full Kalman filter whenever the posterior
stays Kronecker (one output, one input, or isotropic output noise; derived, not in the paper, and tested).

Models: every model the layer kinds take (:func:`curvkit.layerkinds.plan`, which refuses, naming the module, an
unknown module with trainable parameters, weight tying, a module registered twice, random or sample-coupling
modules in training mode). The Kronecker posterior is kept on the layers these equations are written for:

* ``nn.Linear`` on (B, in) inputs (all three filters);
* KFWhiten also on weight-shared ``nn.Linear`` layers (inputs (B, *S, in): every position is a row, as KFC's
  patches) and groups=1 ``nn.Conv2d`` layers (the KFC-style patch statistics): its covariance EMAs take any rows.
  The rank-1 updates of KFNatGrad/KFBayes need a per-example gradient x (x) delta, which the per-example gradient
  of a weight shared over positions (a sum over them) is not; such a Linear layer gets the diagonal form at the
  first step (its input shape is known only then; a layer started as Kronecker that later gets positions is
  refused).

Every other trainable parameter - embeddings, normalisation layers, attention projections, grouped or 1-D
convolutions, raw parameters (a ViT's class token and position table) - gets the DIAGONAL form of the same filter:
the factorised equations (Sec. 2.1.1) with the Fisher sample e = g, the minibatch's ascent gradient in summed
units (the factorised filters' ``fisher='empirical'``; per-example gradients of arbitrary layers are not
captured): KFNatGrad/KFBayes s <- 1/(1/(decay^2 s + eta^2) + g^2), W <- decay (W + s g) (s_0 = ``s0``);
KFWhiten v = EMA_beta(g^2), W <- W + eta g / sqrt(v_hat + damping mean(v_hat)) (with its momentum and decay).
``diagonal`` lists those parameters; ``curvature()`` gives them exact diagonal blocks ``[[1]] (x) diag(1/s)``,
and ``effective_lr()``/``diagnostics()`` report them by parameter name. Data-parallel steps take only Kronecker
layers. ``reduction='mean'`` is the loss divided by the number of examples B (the filters turn ``p.grad`` into the
summed gradient by multiplying with B, and data-parallel steps weight the ranks by their examples): a loss averaged
over positions (tokens) or over counted targets (padding, ``ignore_index``) is not that mean, and the filters, which
never see the targets, cannot tell; back-propagate the summed loss with ``reduction='sum'`` (data-parallel: the
ranks' sums are summed, the union's summed gradient whatever the padding; tests/test_distributed_padding.py). The filters read the user's own loss and backward pass: the model's
outputs, padding (``CrossEntropy(ignore_index=...)``, which refuses out-of-range targets without it) and the data
are checked by that loss; a step checks every gradient for NaN/inf before it writes anything.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from curvkit.optim.base import CurvatureOptimizer, check_step_extras, legacy_model_first, trainable_params
from curvkit.optim.filters._base import LossScale, Reduction, all_finite, check_positive, check_unit_interval
from curvkit.optim.filters.kron_capture import DiagonalParam, LayerRecord, check_captured, collect_layers
from curvkit.optim.filters.kron_math import (
    apply_root,
    first_order_coefficients,
    gradient_residual,
    kl_project,
    kron_sandwich,
    mean_inverse_diagonal,
    robust_eigh,
    rows_after_update,
    sandwich_costs,
    symmetrise,
    whitened_gradient,
    whitening_low_rank_is_cheaper,
)
from curvkit.structure import UnsupportedModelError


def _store_posterior(st: dict[str, Any], W_post: Tensor, W_next: Tensor) -> None:
    """Keep the posterior mean only when it differs from the next prior mean held by the parameters
    (decay or momentum); ``posterior_mean()`` swaps it in when present."""
    if W_next is W_post:
        st.pop("mu_post", None)
    else:
        st["mu_post"] = W_post


class _KroneckerBase(CurvatureOptimizer):
    supported: tuple[type[nn.Module], ...] = (nn.Linear,)
    #: whether a Kronecker layer may share its weight over positions (rows B*T; KFWhiten's covariances take
    #: them, KFNatGrad/KFBayes need rank-1 per-example samples and give such a layer the diagonal form)
    positions_ok = False

    def __init__(self, params: Any, model: nn.Module | None, defaults: dict[str, Any], reduction: Reduction,
                 batch_size: int | None, distributed: Any = None):
        params, model = legacy_model_first(type(self).__name__, params, model)
        if not isinstance(model, nn.Module):
            raise TypeError(f"{type(self).__name__} needs the model for its layer structure: "
                            f"{type(self).__name__}(model.parameters(), model=model, ...)")
        self.loss_scale = LossScale(reduction, batch_size)
        given = None if params is None else list(params)
        if given is not None and any(isinstance(g, dict) for g in given):
            raise ValueError(f"{type(self).__name__} takes one set of hyperparameters (no param groups)")
        if given is not None:  # frozen parameters are never optimised (curvkit.optim.base): no block for them
            given = trainable_params(given)
        self.layers, self.capture, self.diagonal = collect_layers(model, self.supported, type(self).__name__, given)
        if distributed is not None and self.diagonal:
            self.capture.close()
            raise ValueError(f"{type(self).__name__}: data-parallel steps take only Kronecker layers, but "
                             f"{', '.join(repr(d.name) for d in self.diagonal)} would get the diagonal form; "
                             "freeze them or train in one process")
        ordered = []
        for rec in self.layers:
            ordered.append(rec.weight)
            if rec.bias is not None:
                ordered.append(rec.bias)
        ordered += [d.param for d in self.diagonal]
        super().__init__(ordered, defaults)
        self._init_names(model)
        self._work: dict[tuple[str, str], Tensor] = {}
        # data-parallel (curvkit.optim.filters._distributed): rank 0's parameters on every rank, then union steps
        self.distributed = distributed
        if distributed is not None:
            distributed.sync_tensors_(ordered)

    def close(self) -> None:
        """Remove the capture hooks from the model (idempotent; also on ``with``-exit and deletion)."""
        capture = getattr(self, "capture", None)
        if capture is not None:
            capture.close()

    def _begin_step(self, closure: Any, fisher_samples: dict[str, Any] | None, batch_size: int | None,
                    extras: dict[str, Any]) -> tuple[Any, float]:
        """Common start of a step: refuse unknown inputs, run the closure, check the capture, and return
        (loss, the loss scale from the captured rows)."""
        check_step_extras(type(self).__name__, extras, ("fisher_samples", "batch_size"))
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        check_captured(self.layers, type(self).__name__)
        self._demote_shared()
        if fisher_samples is not None:
            known = {rec.name for rec in self.layers}
            unknown = sorted(set(fisher_samples) - known)
            if unknown:
                raise ValueError(f"fisher_samples has unknown layer name(s) {unknown}; the Kronecker layers are "
                                 f"{sorted(known)}")
        for rec in self.layers:  # every gradient before anything is written: a NaN changes nothing
            self._check_finite(rec)
        for d in self.diagonal:
            if d.param.grad is None:
                raise ValueError(f"parameter {d.name!r} has no gradient; call loss.backward() before step()")
            if not all_finite(d.param.grad):
                raise ValueError(f"gradient of parameter {d.name!r} ({d.kind} layer {d.layer!r}) contains NaN or "
                                 "inf (NaN or inf in the batch, or a diverged loss); nothing was changed")
        return loss, self._scale(batch_size)

    def _demote_shared(self) -> None:
        """Without :attr:`positions_ok`, a Linear layer that shares its weight over positions (an input
        (B, *S, in)) has no rank-1 per-example Fisher samples: before its first step it gets the diagonal form
        (for good); after it, such an input is refused."""
        if self.positions_ok:
            return
        for rec in list(self.layers):
            if rec.a is None or rec.positions == 1:
                continue
            if "Sx" in self.state.get(rec.weight, {}):  # a resumed diagonal state ('s') is demoted again
                raise UnsupportedModelError(
                    f"{type(self).__name__}: layer {rec.name!r} got inputs with {rec.positions} positions per "
                    "example after its Kronecker posterior was started on (batch, features) inputs; give it one "
                    "input shape")
            self.layers.remove(rec)
            for param, pname in ((rec.weight, rec.weight_name), (rec.bias, rec.bias_name)):
                if param is not None and pname is not None:
                    self.diagonal.append(DiagonalParam(pname, param, rec.name, "linear (weight-shared)"))

    def _scale(self, batch_size: int | None) -> float:
        """The factor turning ``p.grad`` into the gradient of the summed log-likelihood. With a mean loss the
        batch size is read off the captured rows (so a last, partial batch is scaled by its own size); a
        ``batch_size`` that contradicts them is refused."""
        if self.loss_scale.reduction == "sum":
            return 1.0
        sizes = next((cap.pass_sizes for cap in self.capture.records if cap.pass_sizes), [])  # any captured layer
        if not sizes:
            return self.loss_scale.factor(batch_size)
        if len(set(sizes)) > 1:
            raise ValueError(f"{len(sizes)} backward passes of different batch sizes {sizes} were accumulated with "
                             "reduction='mean'; the summed gradient is ambiguous: use reduction='sum'")
        if batch_size is not None and int(batch_size) != sizes[0]:
            raise ValueError(f"step(batch_size={batch_size}) but the captured minibatch has {sizes[0]} examples")
        return float(sizes[0])

    def _buffer(self, rec: LayerRecord, role: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A per-layer scratch tensor reused across steps (not optimiser state: never saved). Reusing the large
        per-step temporaries avoids a fresh allocation, and its page faults, every step."""
        buf = self._work.get((rec.name, role))
        if buf is None or buf.shape != shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._work[(rec.name, role)] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buf

    def _layout(self) -> Any:
        return self.layout()

    def _group(self) -> dict[str, Any]:
        return self.param_groups[0]

    def _samples(self, rec: LayerRecord, scale: float, given: dict[str, Any] | None, k: int | None
                 ) -> tuple[Tensor, Tensor]:
        """Fisher samples (X (K, N), D (K, M)) in summed-log-likelihood units."""
        if given is not None and rec.name in given:
            X, D = given[rec.name]
            if X.shape[-1] != rec.in_dim or D.shape[-1] != rec.out_dim or X.shape[0] != D.shape[0]:
                raise ValueError(f"fisher_samples[{rec.name!r}] must be (K, {rec.in_dim}) and (K, {rec.out_dim}), "
                                 f"got {tuple(X.shape)} and {tuple(D.shape)}")
            return X, D
        if rec.a is None or rec.delta is None:
            raise ValueError(f"no activations captured for layer {rec.name!r}: run forward and backward (with "
                             "autograd enabled) on the minibatch before step()")
        B = rec.a.shape[0]
        if k is not None and k < B:
            return rec.x_rows(k), rec.delta[:k] * (scale * math.sqrt(B / k))
        return rec.x_rows(), rec.delta * scale

    @staticmethod
    def _grad_factors(rec: LayerRecord, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
        """Per-row factors (D (K, M), X (K, N)) of the ascent gradient, G = D^T X, from the captured layer
        input and output gradient (None if nothing was captured); used for the cheaper products."""
        if rec.a is None or rec.delta is None:
            return None
        return rec.delta.to(dtype) * -scale, rec.x_rows().to(dtype)

    def _clear(self) -> None:
        self.capture.reset()

    @contextmanager
    def posterior_mean(self) -> Iterator[None]:
        """Temporarily load the posterior mean W_post into the layers (parameters hold the prior mean)."""
        saved = []
        for rec in self.layers:
            st = self.state.get(rec.weight, {})
            if "mu_post" in st:
                saved.append((rec, rec.weight_matrix().clone()))
                rec.write_matrix(st["mu_post"])
        saved_diag = []
        for d in self.diagonal:
            st = self.state.get(d.param, {})
            if "mu_post" in st:
                saved_diag.append((d.param, d.param.detach().clone()))
                with torch.no_grad():
                    d.param.copy_(st["mu_post"])
        try:
            yield
        finally:
            for rec, W in saved:
                rec.write_matrix(W)
            with torch.no_grad():
                for param, value in saved_diag:
                    param.copy_(value)

    @staticmethod
    def _check_finite(rec: LayerRecord) -> None:
        gW, gb = rec.grad_parts()
        if not (all_finite(gW) and (gb is None or all_finite(gb))):
            raise ValueError(f"gradient of layer {rec.name!r} contains NaN or inf")

    def _precision_blocks(self) -> list[tuple[LayerRecord, Tensor, Tensor]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def posterior_precision(self) -> Any:
        """Deprecated name of :meth:`curvature`."""
        warnings.warn(f"{type(self).__name__}.posterior_precision() is deprecated; use curvature()",
                      DeprecationWarning, stacklevel=2)
        return self.curvature()

    def curvature(self) -> Any:
        """Posterior precision as a :class:`curvkit.linalg.kron.KroneckerOperator` (one block per layer,
        G = output-side, A = input-side factor, row-major W_hat layout), in summed-log-likelihood units."""
        from curvkit.linalg.kron import KroneckerBlock, KroneckerOperator

        blocks = [KroneckerBlock(G, A, rec.weight_name, rec.bias_name) for rec, G, A in self._precision_blocks()]
        for d in self.diagonal:  # [[1]] (x) diag(1 / variance): the diagonal form's precision, exactly
            var = self._diag_variance(self._diag_state(d)).reshape(-1)
            blocks.append(KroneckerBlock(var.new_ones(1, 1), 1.0 / var, d.name,
                                         index=torch.arange(var.numel(), device=var.device).reshape(1, -1),
                                         label=d.name, factored=False))
        return KroneckerOperator(self._layout(), blocks)

    # ------------------------------------------------------------------ the diagonal form
    def _diag_state(self, d: DiagonalParam) -> dict[str, Any]:
        st = self.state.get(d.param)
        if not st:
            raise RuntimeError("the optimiser has no posterior yet: call step() first")
        return st

    def _diag_variance(self, st: dict[str, Any]) -> Tensor:  # pragma: no cover - abstract
        """The posterior variance per entry of a diagonal parameter (summed-log-likelihood units)."""
        raise NotImplementedError

    def _diag_update(self, d: DiagonalParam, st: dict[str, Any], g: Tensor) -> tuple[Tensor, Tensor]:  # pragma: no cover
        """One step of the diagonal form for the ascent gradient ``g`` (summed units): updates ``st`` and
        returns (posterior mean, next prior mean)."""
        raise NotImplementedError

    def _diagonal_step(self, scale: float) -> None:
        """The diagonal form on every parameter outside the Kronecker layers (gradients checked already)."""
        for d in self.diagonal:
            g = d.param.grad.detach().mul(-scale)  # type: ignore[union-attr]
            W_post, W_next = self._diag_update(d, self.state[d.param], g)
            _store_posterior(self.state[d.param], W_post, W_next)
            d.param.copy_(W_next)

    def _cov_diagonals(self, rec: LayerRecord) -> tuple[Tensor, Tensor]:  # pragma: no cover - abstract
        """Diagonals of (Sigma^delta (M,), Sigma^x (N,)) of one layer (summed-log-likelihood units)."""
        raise NotImplementedError

    def _regime(self, rec: LayerRecord, s: Tensor) -> tuple[float, float]:  # pragma: no cover - abstract
        """(sgd_like, adam_like) of one layer given its per-weight posterior variances ``s`` (M, N)."""
        raise NotImplementedError

    def _user_scale(self) -> float:
        ls = self.loss_scale
        return ls.factor() if ls.reduction == "mean" and ls.batch_size else 1.0

    def _variance_matrix(self, rec: LayerRecord) -> Tensor:
        """Per-weight posterior variance diag(Sigma^delta) diag(Sigma^x)^T, shaped like W_hat (M, N)."""
        dd, dx = self._cov_diagonals(rec)
        return torch.outer(dd, dx)

    def effective_lr(self) -> dict[str, Tensor]:
        """Per-weight effective SGD learning rate on the user's loss: the posterior variance of each weight
        (the diagonal of Sigma^x (x) Sigma^delta) times the loss scale, returned per parameter tensor
        (weight and bias) like the factorised filters. It is the SGD step size that would move that weight
        by the same amount for a gradient along it alone; the Kronecker step also mixes weights.
        Costs O(M N) (KFWhiten: O(M^2 + N^2)), cheap enough to log every step."""
        scale = self._user_scale()
        out = {}
        for rec in self.layers:
            if not self.state.get(rec.weight):
                continue
            S = self._variance_matrix(rec) * scale
            k = rec.weight[0].numel()
            out[rec.weight_name] = S[:, :k].reshape(rec.weight.shape)
            if rec.bias_name is not None:
                out[rec.bias_name] = S[:, k]
        for d in self.diagonal:
            if self.state.get(d.param):
                out[d.name] = self._diag_variance(self.state[d.param]) * scale
        return out

    def diagnostics(self) -> list[dict[str, Any]]:
        """Per-layer effective learning rate (statistics over the layer's weights, bias included) and
        regime indicators in [0, 1] (:func:`~curvkit.optim.filters.mapping.regime`, not in this version of
        the paper, adapted per class: see ``_regime`` of each optimiser;
        medians, as for the factorised filters): ``sgd_like`` -> 1 in the SGD limit, ``adam_like`` -> 1 in
        the Adam (whitening) limit; ``regime`` names the larger. Cheap (no inversions)."""
        rows = []
        scale = self._user_scale()
        for rec in self.layers:
            if not self.state.get(rec.weight):
                continue
            s = self._variance_matrix(rec)
            lr = s * scale
            sgd, adam = self._regime(rec, s)
            rows.append(_diagnostic_row(rec.name, lr, sgd, adam))
        for d in self.diagonal:
            st = self.state.get(d.param)
            if st:
                s = self._diag_variance(st)
                rows.append(_diagnostic_row(d.name, s * scale, *self._diag_regime(st, s)))
        return rows

    def _diag_regime(self, st: dict[str, Any], s: Tensor) -> tuple[float, float]:  # pragma: no cover - abstract
        """(sgd_like, adam_like) of a diagonal parameter with posterior variances ``s``."""
        raise NotImplementedError


def _diagnostic_row(name: str, lr: Tensor, sgd: float, adam: float) -> dict[str, Any]:
    return {"name": name, "lr_mean": float(lr.mean()), "lr_median": float(lr.median()), "lr_min": float(lr.min()),
            "lr_max": float(lr.max()), "sgd_like": sgd, "adam_like": adam, "regime": "sgd" if sgd > adam else "adam"}


class KFBayes(_KroneckerBase):
    """Kronecker-factored filter with weight drift (Eqs. 25-28). ``lr`` = eta; eta = 0 gives
    :class:`KFNatGrad`.

    Args:
        params: the parameters to optimise (default: all of ``model``'s trainable ones): the weights and
            biases of its ``nn.Linear`` layers get the Kronecker posterior, every other one the diagonal form
            (module docstring). Frozen parameters (``requires_grad=False``) are left out: a frozen layer gets no
            block and never changes.
        model: the network (required: the filter reads its layer structure and captures each layer's
            input and output gradient with hooks, removed by ``close()``).
        lr: eta, the per-step diffusion sd of the optimum.
        sigma2: stationary prior variance (inf: no weight decay).
        s0: initial posterior variance per weight; Sigma^x = Sigma^delta = sqrt(s0) I (the paper gives no
            initialisation; this is the choice made here);
            default ``lr_sgd / batch_size``.
        fisher_samples: examples per step used for the covariance update (None: all); see module doc.
        sample_update: 'sequential' (Eq. 24 per sample, paper) or 'batched' (summed first-order increments).
        projection: 'first_order' (Eqs. 24, 28) or 'exact' (dense + KL flip-flop; tiny layers).
        inv_every: refresh period of Lambda_x, Lambda_delta in Eq. 28.
    """

    def __init__(self, params: Any = None, *, model: nn.Module | None = None, lr: float = 1e-3,
                 sigma2: float = math.inf, s0: float | None = None, lr_sgd: float = 0.1,
                 fisher_samples: int | None = 8, sample_update: str = "sequential", projection: str = "first_order",
                 inv_every: int = 10, reduction: Reduction = "mean", batch_size: int | None = None,
                 distributed: Any = None):
        check_positive("lr", lr, allow_zero=True)
        check_positive("sigma2", sigma2, allow_inf=True)
        check_positive("lr_sgd", lr_sgd)
        if s0 is not None:
            check_positive("s0", s0)
        if fisher_samples is not None and (int(fisher_samples) != fisher_samples or fisher_samples < 1):
            raise ValueError(f"fisher_samples must be a positive integer or None, got {fisher_samples!r}")
        if sample_update not in ("sequential", "batched"):
            raise ValueError(f"sample_update must be 'sequential' or 'batched', got {sample_update!r}")
        if projection not in ("first_order", "exact"):
            raise ValueError(f"projection must be 'first_order' or 'exact', got {projection!r}")
        if int(inv_every) != inv_every or inv_every < 1:
            raise ValueError(f"inv_every must be a positive integer, got {inv_every!r}")
        s_init = s0 if s0 is not None else lr_sgd / (batch_size or 1)
        defaults = {"lr": float(lr), "sigma2": float(sigma2), "s0": float(s_init), "fisher_samples": fisher_samples,
                    "sample_update": sample_update, "projection": projection, "inv_every": int(inv_every)}
        super().__init__(params, model, defaults, reduction, batch_size, distributed)
        if projection == "exact":
            for rec in self.layers:
                if rec.in_dim * rec.out_dim > 4096:
                    raise ValueError(f"projection='exact' forms dense covariances; layer {rec.name!r} has "
                                     f"{rec.in_dim * rec.out_dim} weights (limit 4096)")

    def _decay(self) -> float:
        g = self._group()
        return 1.0 if math.isinf(g["sigma2"]) else 1.0 - g["lr"] ** 2 / (2.0 * g["sigma2"])

    def _init(self, rec: LayerRecord) -> dict[str, Any]:
        st = self.state[rec.weight]
        if not st:
            r = math.sqrt(self._group()["s0"])
            dt, dev = rec.weight.dtype, rec.weight.device
            st["Sx"] = torch.eye(rec.in_dim, dtype=dt, device=dev) * r
            st["Sd"] = torch.eye(rec.out_dim, dtype=dt, device=dev) * r
            st["step"] = 0
        return st

    def _drift(self, st: dict[str, Any]) -> tuple[float, Tensor | float, Tensor | float]:
        """Coefficients (c, ex, ed) of the prior step (Eq. 28, :func:`~.kron_math.drift_project`):
        Sx_prior = c Sx + ex I, Sd_prior = c Sd + ed I, with c = decay - eta^2 Lx Ld / 2, ex = eta^2 Ld,
        ed = eta^2 Lx; Lambda_x = tr(Sx^{-1})/N, Lambda_delta = tr(Sd^{-1})/M refreshed every ``inv_every``
        steps (the paper finds inverting the factors "not desirable" and leaves the approximation open; the
        periodic refresh is the choice made here). (1, 0, 0) without drift (KFNatGrad)."""
        grp = self._group()
        eta = grp["lr"]
        if eta == 0 and math.isinf(grp["sigma2"]):
            return 1.0, 0.0, 0.0
        if st["step"] % grp["inv_every"] == 0 or "lam_x" not in st:
            st["lam_x"] = mean_inverse_diagonal(st["Sx"])
            st["lam_d"] = mean_inverse_diagonal(st["Sd"])
        e2 = eta * eta
        cf = self._decay() - 0.5 * e2 * float(st["lam_x"]) * float(st["lam_d"])
        return cf, e2 * st["lam_d"], e2 * st["lam_x"]

    def _exact_step(self, st: dict[str, Any], X: Tensor, D: Tensor) -> None:
        grp = self._group()
        Sx, Sd = st["Sx"], st["Sd"]
        N, M = Sx.shape[0], Sd.shape[0]
        S = torch.kron(Sx, Sd)
        if grp["lr"] > 0 or math.isfinite(grp["sigma2"]):
            S = self._decay() ** 2 * S + grp["lr"] ** 2 * torch.eye(N * M, dtype=S.dtype, device=S.device)
        for x, d in zip(X, D):
            e = torch.kron(x, d)
            Se = S @ e
            S = S - torch.outer(Se, Se) / (1.0 + e @ Se)
        st["Sx"], st["Sd"] = kl_project(0.5 * (S + S.T), N, M, init=(Sx, Sd))

    def _first_order_step(self, rec: LayerRecord, st: dict[str, Any], X: Tensor, D: Tensor, scale: float,
                          own: bool) -> Tensor:
        """Prior step (Eq. 28), data step (corrected Eq. 24 for the K Fisher samples, sequential or batched),
        rebalance (the common scale of the two factors is arbitrary and the paper leaves its split open; it
        is moved so that tr(Sigma^x)/N = tr(Sigma^delta)/M), and the mean increment Sigma^delta G Sigma^x
        with the updated factors.
        Updates ``st`` and returns the increment (M, N).

        Work-saving forms, all equal (up to rounding) to drift_project, the per-sample loop of
        :func:`~.kron_math.project_first_order` (or :func:`~.kron_math.project_first_order_batched`),
        rebalance and Sd' G Sx' (G = the ascent gradient of the summed log-likelihood):

        * the prior factors S0 = c S + e I are never formed: U0 = X S0 = c X S + e X;
        * the K updates act in the span of the samples (:func:`~.kron_math.first_order_coefficients`):
          Sx' = alpha S0x - W^T W with W = R U0 (K, N); with the rebalancing scale r (computed from traces,
          tr(W^T W) = ||W||_F^2) the new factor is a single product r alpha c Sx - r W^T W (+ diagonal), one pass
          over the N x N matrix instead of K (sequential) or several;
        * the mean increment goes through the gradient's per-example factors G = Dg^T Xg (B rows) when that is
          cheaper (:func:`~.kron_math.sandwich_costs`): Xg Sx' = alpha Xg S0x - (Xg W^T) W reuses Y = Xg S0x,
          whose first K rows are U0 when the Fisher samples are the minibatch's own (X = Xg[:K],
          D = -sqrt(B/K) Dg[:K]); r cancels in Sd' G Sx'. A part of G the factors do not explain (an L2 term)
          is added by the direct route. The large temporaries (Y, Z, the increment) live in reused buffers, so
          the returned increment is only valid until the next step.
        """
        grp = self._group()
        Sx, Sd = st["Sx"], st["Sd"]
        N, M = Sx.shape[0], Sd.shape[0]
        K = X.shape[0]
        cf, ex, ed = self._drift(st)
        low = None
        if self.distributed is None and rec.a is not None and rec.delta is not None:
            B = rec.a.shape[0]
            shared = own and K <= B
            c_low, c_dense = sandwich_costs(B, K, M, N, shared)
            if c_low < c_dense:   # the per-example factors (B rows) are needed only on this route
                factors = self._grad_factors(rec, scale, X.dtype)
                assert factors is not None
                Dg, Xg = factors
                Y = torch.mm(Xg, Sx, out=self._buffer(rec, "Y", (B, N), Xg))
                Z = torch.mm(Dg, Sd, out=self._buffer(rec, "Z", (B, M), Dg))
                low = (Dg, Xg, self._prior_rows(Y, Xg, cf, ex), self._prior_rows(Z, Dg, cf, ed))
        if low is not None and shared:
            U0, V0 = low[2][:K], low[3][:K] * (-math.sqrt(B / K) if K < B else -1.0)
        else:
            U0, V0 = self._prior_rows(X @ Sx, X, cf, ex), self._prior_rows(D @ Sd, D, cf, ed)
        if grp["sample_update"] == "sequential":
            up = first_order_coefficients(U0 @ X.T, V0 @ D.T, N, M, True)
        else:   # only the Gram diagonals x_j^T Sx x_j are needed
            up = first_order_coefficients((U0 * X).sum(1), (V0 * D).sum(1), N, M, False)
        Wx, Wd = apply_root(up.Rx, U0), apply_root(up.Rd, V0)
        # mean diagonals of Sx' = alpha S0x - W^T diag(s) W (before rebalancing) -> rebalancing scale r
        mx = up.alpha * (cf * torch.diagonal(Sx).mean() + ex) - (Wx.square().sum(1) * up.sx).sum() / N
        md = up.alpha * (cf * torch.diagonal(Sd).mean() + ed) - (Wd.square().sum(1) * up.sd).sum() / M
        r = float(torch.sqrt(md / mx))
        refresh = st["step"] % grp["inv_every"] == 0   # remove any rounding asymmetry now and then
        st["Sx"] = self._new_factor(Sx, Wx, up.sx, up.alpha, cf, ex, r, refresh)
        st["Sd"] = self._new_factor(Sd, Wd, up.sd, up.alpha, cf, ed, 1.0 / r, refresh)
        if low is None and self.distributed is not None:   # the union's ascent gradient
            return st["Sd"] @ self._union[rec.name][2] @ st["Sx"]
        if low is None:   # dense route: -scale Sd' [dW | db] Sx', the gradient gathered into a reused buffer
            G = rec.weight_matrix_grad(out=self._buffer(rec, "G", (M, N), Sx))
            return torch.mm(st["Sd"] @ G, st["Sx"], out=self._buffer(rec, "inc", (M, N), G)).mul_(-scale)
        Dg, Xg, Y, Z = low
        Zn, Yn = rows_after_update(Z, Dg, Wd, up.alpha, up.sd), rows_after_update(Y, Xg, Wx, up.alpha, up.sx)
        inc = torch.mm(Zn.T, Yn, out=self._buffer(rec, "inc", (M, N), Yn))
        assert rec.delta is not None
        res = gradient_residual(rec.grad_parts(), rec.delta.to(X.dtype), Xg)   # unscaled: G = -scale dW_hat
        return inc if res is None else inc.add_(st["Sd"] @ res.mul_(-scale) @ st["Sx"])

    @staticmethod
    def _prior_rows(RS: Tensor, R: Tensor, cf: float, e: Tensor | float) -> Tensor:
        """R S0 = cf (R S) + e R for the prior factor S0 = cf S + e I, given RS = R S (updated in place)."""
        if cf != 1.0:
            RS = RS.mul_(cf)
        return RS.add_(R, alpha=float(e)) if float(e) != 0.0 else RS

    @staticmethod
    def _new_factor(S: Tensor, W: Tensor, sign: Tensor, alpha: float, cf: float, e: Tensor | float, r: float,
                    symmetrise_now: bool) -> Tensor:
        """r (alpha (cf S + e I) - W^T diag(sign) W) in one product (plus a diagonal update), in place in S
        (like the moment buffers of torch.optim.Adam; ``factors()`` returns the live tensors)."""
        Wl = W if bool((sign > 0).all()) else W * sign[:, None]
        out = S.addmm_(Wl.T, W, beta=r * alpha * cf, alpha=-r)
        if float(e) != 0.0:
            out.diagonal().add_(r * alpha * float(e))
        if symmetrise_now or Wl is not W:
            out = symmetrise(out)
        return out

    @torch.no_grad()
    def step(self, closure: Any = None, *, fisher_samples: dict[str, Any] | None = None,
             batch_size: int | None = None, **extras: Any) -> Any:
        loss, scale = self._begin_step(closure, fisher_samples, batch_size, extras)
        grp = self._group()
        decay = self._decay()
        if self.distributed is not None:
            from curvkit.optim.filters._distributed import bayes_inputs

            self._union = bayes_inputs(self, scale, fisher_samples, grp["fisher_samples"])
        for rec in self.layers:
            st = self._init(rec)
            if self.distributed is None:
                X, D = self._samples(rec, scale, fisher_samples, grp["fisher_samples"])
            else:
                X, D = self._union[rec.name][:2]
            dtype = rec.weight.dtype
            X, D = X.to(dtype), D.to(dtype)
            if grp["projection"] == "exact":
                self._exact_step(st, X, D)
                if self.distributed is None:
                    G = rec.weight_matrix_grad().mul(-scale)
                    inc = kron_sandwich(st["Sd"], G, st["Sx"], self._grad_factors(rec, scale, dtype))
                else:
                    inc = kron_sandwich(st["Sd"], self._union[rec.name][2], st["Sx"], None)
            else:
                own = fisher_samples is None or rec.name not in fisher_samples
                inc = self._first_order_step(rec, st, X, D, scale, own)
            st["step"] += 1
            if decay == 1.0:   # the posterior mean is the next prior mean: update the parameters in place
                st.pop("mu_post", None)
                rec.add_to_matrix(inc)
            else:
                W_post = rec.weight_matrix().add_(inc)
                st["mu_post"] = W_post
                rec.write_matrix(W_post * decay)
        self._diagonal_step(scale)
        self._clear()
        return loss

    def _diag_update(self, d: DiagonalParam, st: dict[str, Any], g: Tensor) -> tuple[Tensor, Tensor]:
        """The factorised filter of the same equations (paper Eqs. 8-12; :class:`~.factorised.BFRMSProp`
        with ``drift='paper'``, :class:`~.factorised.BFNatGrad` when eta = 0): s_prior = decay^2 s + eta^2,
        s <- 1 / (1/s_prior + g^2), W_post = W + s g, next prior mean decay W_post, with s_0 = ``s0`` (the
        Kronecker layers' initial per-weight variance) and the Fisher sample e = g, the minibatch's ascent
        gradient in summed units (the factorised filters' ``fisher='empirical'``)."""
        grp = self._group()
        if not st:
            st["s"] = torch.full_like(g, grp["s0"])
            st["step"] = 0
        decay = self._decay()
        s = st["s"]
        if grp["lr"] > 0 or decay != 1.0:
            s.mul_(decay * decay).add_(grp["lr"] ** 2)
        s.reciprocal_().add_(g * g).reciprocal_()
        st["step"] += 1
        W_post = d.param.detach() + s * g
        return W_post, (W_post if decay == 1.0 else W_post * decay)

    def _diag_variance(self, st: dict[str, Any]) -> Tensor:
        return st["s"]  # type: ignore[no-any-return]

    def _diag_regime(self, st: dict[str, Any], s: Tensor) -> tuple[float, float]:
        return self._regime(None, s)  # type: ignore[arg-type]

    def factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """Posterior covariance factors per layer: {name: (Sigma^x (N, N), Sigma^delta (M, M))} (the live state
        tensors, updated in place by later steps: clone them to keep a snapshot)."""
        return {rec.name: (self.state[rec.weight]["Sx"], self.state[rec.weight]["Sd"])
                for rec in self.layers if self.state.get(rec.weight)}

    def _precision_blocks(self) -> list[tuple[LayerRecord, Tensor, Tensor]]:
        out = []
        for rec in self.layers:
            st = self.state.get(rec.weight)
            if not st:
                raise RuntimeError("the optimiser has no posterior yet: call step() first")
            out.append((rec, torch.linalg.inv(st["Sd"]), torch.linalg.inv(st["Sx"])))
        return out

    def _cov_diagonals(self, rec: LayerRecord) -> tuple[Tensor, Tensor]:
        st = self.state.get(rec.weight)
        if not st:
            raise RuntimeError("the optimiser has no posterior yet: call step() first")
        return torch.diagonal(st["Sd"]), torch.diagonal(st["Sx"])

    def _regime(self, rec: LayerRecord, s: Tensor) -> tuple[float, float]:
        """As the factorised filters without a running v: ``sgd_like`` = s/cap (cap = sigma^2, or s0 when
        sigma^2 = inf), clipped to 1, and ``adam_like`` = sqrt(1 - sgd_like) from the steady-state identity
        v s^2 = eta^2 (1 - s/sigma^2); 0 when eta = 0 (KFNatGrad has no steady state, its s decays like
        1/t)."""
        grp = self._group()
        cap = grp["sigma2"] if math.isfinite(grp["sigma2"]) else grp["s0"]
        sgd = (s / cap).clamp(max=1.0)
        adam = (1 - sgd).sqrt() if grp["lr"] > 0 else torch.zeros_like(sgd)
        return float(sgd.median()), float(adam.median())


class KFNatGrad(KFBayes):
    """Kronecker-factored natural gradient with static weights (Eqs. 22-24): :class:`KFBayes` with eta = 0."""

    def __init__(self, params: Any = None, *, model: nn.Module | None = None, s0: float | None = None,
                 lr_sgd: float = 0.1, fisher_samples: int | None = 8, sample_update: str = "sequential",
                 projection: str = "first_order", reduction: Reduction = "mean", batch_size: int | None = None,
                 distributed: Any = None):
        super().__init__(params, model=model, lr=0.0, sigma2=math.inf, s0=s0, lr_sgd=lr_sgd, fisher_samples=fisher_samples,
                         sample_update=sample_update, projection=projection, reduction=reduction,
                         batch_size=batch_size, distributed=distributed)


def _damped_gains(d: Tensor, bc: float, damping: float) -> tuple[Tensor, float]:
    """Per-direction gains (d/bc + lam)^{-1/2} of one factor and lam = damping * mean(d/bc).

    ``d`` holds the second moments of the factor along its (possibly stale) eigenbasis, so mean(d/bc) is
    tr(C_hat)/dim, the mean eigenvalue of the bias-corrected covariance C_hat = C/bc. The damping is
    therefore relative to the factor's own scale, which keeps the whitened step invariant to the loss scale;
    it is floored at 1e-30 so that an all-zero factor (e.g. a layer whose ReLUs are all inactive) gives
    finite gains (its gradient is zero then)."""
    dh = d / bc
    lam = max(damping * float(dh.mean()), 1e-30)
    return (dh + lam).rsqrt(), lam


class KFWhiten(_KroneckerBase):
    """Steady-state Kronecker filter, the whitening "Kronecker RMSProp/Adam" (paper, end of Sec. 2.1.3).

    Math: the steady state of the full updates (Eqs. 23 and 25), 0 ~ eta^2 I (x) I - Sigma^x E[x x^T] Sigma^x
    (x) Sigma^delta E[delta delta^T] Sigma^delta (the paper's unnumbered equation, which drops the x and the
    expectation), gives Sigma^x = sqrt(eta) C_x^{-1/2}, Sigma^delta = sqrt(eta) C_delta^{-1/2}, so the mean
    update (6) is W_post = W_prior + eta C_delta^{-1/2} G C_x^{-1/2}, with

        C_x = EMA_beta(mean_n x_n x_n^T)  (N, N),   C_delta = EMA_beta(sum_n delta_n delta_n^T)  (M, M),

    bias-corrected (divided by 1 - beta^t), delta_n in summed-log-likelihood units and G (M, N) the ascent
    gradient of the summed log-likelihood (``-batch_size * p.grad`` for a mean loss).

    Amortised inversion (``inv_every = k``). Every k steps (and at step 1) each factor is eigendecomposed,
    C = V diag(d) V^T. In between, the basis V is kept but the second moments along it,
    d = diag(V^T C V), are updated at every step from the new samples (cost K*dim^2, like the EMA itself),
    and the update uses C ~ V diag(d) V^T. At a refresh step this is exactly C^{-1/2}. Keeping the
    *normaliser* current is what the filter requires (Sec. 2.2.5: the posterior includes the current
    sample before the step): a whitening step whose inverse roots are frozen for k steps is not scale
    invariant, since it grows linearly with any growth of the gradient since the last refresh. In a deep
    network that growth feeds back (larger steps in the top layers enlarge the backpropagated delta of the
    lower ones), which made an earlier version with frozen inverse roots diverge within a few steps at
    eta = 1e-3 on a repeated minibatch. With current d the step obeys, for every entry in the rotated basis,
        |(V_d^T (W_post - W_prior) V_x)_ij| <= eta sqrt(K) (1 - beta^t) / (1 - beta)
    for empirical Fisher samples (K = rows of the minibatch), whatever the gradient scale (Cauchy-Schwarz;
    the current samples enter C with weight (1 - beta)/(1 - beta^t)). The bound holds for any orthonormal
    basis; note that inside a degenerate eigenspace of C at a refresh (typically the null space of a
    rank-deficient C early on) the kept basis is arbitrary, so the gains there depend on it, and a
    rounding-level change of C can change later steps by more than rounding.

    The eigendecompositions go through :func:`curvkit.linalg.kron.psd_eigh`: LAPACK's float32 ``eigh`` can fail to
    converge on the many repeated zero eigenvalues of a rank-deficient factor (it did after ~240 steps on a
    repeated batch of the 784-512-512-10 MLP); the fallbacks are float64, a tiny jitter, the kept basis.

    Damping (not in the paper; the choice made here): each factor gets lam = ``damping`` * tr(C_hat)/dim added
    to its eigenvalues, i.e. relative to its own mean eigenvalue, so the update stays invariant to the loss
    scale. Directions the statistics have not seen (a rank-deficient single-batch C at step 1) get the gain
    of lam, which is at most sqrt(1/damping) times the typical gain.

    Args:
        params: the parameters to optimise (default: all of ``model``'s trainable ones; frozen ones are
            left out).
        model: network whose trainable parameters sit in ``nn.Linear`` or ``nn.Conv2d`` layers (Conv2d: the
            KFC-style patch statistics, x = unfolded patches, delta per position); required.
        lr: eta (the Adam/RMSProp learning rate of the steady state).
        beta: EMA factor of the covariances (bias-corrected).
        damping: relative Tikhonov damping (see above).
        inv_every: eigendecomposition period k.
        eta_p: momentum (0 = none): M_p <- (1 - eta_p) M_p + eta_p U, W <- W + eta M_p. An extrapolation by
            analogy with :class:`~.momentum.BFAdamSS` (Eqs. 18-21); the paper does not derive it.
        sigma2: prior variance; the parameters decay by 1 - eta^2/(2 sigma^2) per step (inf: none).
    """

    supported = (nn.Linear, nn.Conv2d)
    positions_ok = True

    def __init__(self, params: Any = None, *, model: nn.Module | None = None, lr: float = 1e-3, beta: float = 0.99,
                 damping: float = 1e-3, inv_every: int = 20, eta_p: float = 0.0, sigma2: float = math.inf,
                 reduction: Reduction = "mean", batch_size: int | None = None, distributed: Any = None):
        check_positive("lr", lr)
        check_unit_interval("beta", beta)
        check_positive("damping", damping)
        check_positive("sigma2", sigma2, allow_inf=True)
        check_unit_interval("eta_p", eta_p, closed_left=True)
        if int(inv_every) != inv_every or inv_every < 1:
            raise ValueError(f"inv_every must be a positive integer, got {inv_every!r}")
        defaults = {"lr": float(lr), "beta": beta, "damping": damping, "inv_every": int(inv_every),
                    "eta_p": eta_p, "sigma2": float(sigma2)}
        super().__init__(params, model, defaults, reduction, batch_size, distributed)

    def _decay(self) -> float:
        g = self._group()
        return 1.0 if math.isinf(g["sigma2"]) else 1.0 - g["lr"] ** 2 / (2.0 * g["sigma2"])

    def _update_statistics(self, st: dict[str, Any], X: Tensor, D: Tensor) -> tuple[Tensor, Tensor] | None:
        """EMA of the factors, then either a fresh eigendecomposition (returns None) or the per-step update
        of d along the kept basis (returns the rotated samples (D V_d, X V_x) for reuse)."""
        grp = self._group()
        beta, K = grp["beta"], X.shape[0]
        st["Cx"].mul_(beta).addmm_(X.T, X, alpha=(1 - beta) / K)
        st["Cd"].mul_(beta).addmm_(D.T, D, alpha=1 - beta)
        if (st["step"] - 1) % grp["inv_every"] == 0:
            for C, d, V in (("Cx", "dx", "Vx"), ("Cd", "dd", "Vd")):
                st[d], st[V] = robust_eigh(st[C], st.get(V))
            return None
        XV, DV = X @ st["Vx"], D @ st["Vd"]
        st["dx"].mul_(beta).add_(XV.square().sum(0), alpha=(1 - beta) / K)
        st["dd"].mul_(beta).add_(DV.square().sum(0), alpha=1 - beta)
        return DV, XV

    def _gains(self, st: dict[str, Any]) -> tuple[Tensor, float, Tensor, float]:
        grp = self._group()
        bc = 1.0 - grp["beta"] ** st["step"]
        sx, lx = _damped_gains(st["dx"], bc, grp["damping"])
        sd, ld = _damped_gains(st["dd"], bc, grp["damping"])
        return sx, lx, sd, ld

    @torch.no_grad()
    def step(self, closure: Any = None, *, fisher_samples: dict[str, Any] | None = None,
             batch_size: int | None = None, **extras: Any) -> Any:
        loss, scale = self._begin_step(closure, fisher_samples, batch_size, extras)
        grp = self._group()
        check_positive("lr", grp["lr"])
        union = None
        if self.distributed is not None:
            from curvkit.optim.filters._distributed import whiten_inputs, whiten_statistics

            union = whiten_inputs(self, scale, fisher_samples)
        for rec in self.layers:
            st = self.state[rec.weight]
            G = rec.weight_matrix_grad().mul(-scale) if union is None else union[rec.name]["G"]
            X, D = self._samples(rec, scale, fisher_samples, None)
            X, D = X.to(G.dtype), D.to(G.dtype)
            if not st:
                st["Cx"] = torch.zeros(rec.in_dim, rec.in_dim, dtype=G.dtype, device=G.device)
                st["Cd"] = torch.zeros(rec.out_dim, rec.out_dim, dtype=G.dtype, device=G.device)
                st["step"] = 0
                if grp["eta_p"] > 0:
                    st["mu_p"] = torch.zeros_like(G)
            st["step"] += 1
            rotated = None
            if union is None:
                rotated = self._update_statistics(st, X, D)
            else:
                whiten_statistics(self, rec, st, union[rec.name])
            sx, _, sd, _ = self._gains(st)
            factors = self._grad_factors(rec, scale, G.dtype) if union is None else None
            own = fisher_samples is None or rec.name not in fisher_samples   # then D = -D_ascent
            reuse = (-rotated[0], rotated[1]) if rotated is not None and own else None
            if factors is not None and whitening_low_rank_is_cheaper(factors[0].shape[0], rec.out_dim, rec.in_dim,
                                                                     reuse is not None):
                U = whitened_gradient(G, st["Vd"], sd, st["Vx"], sx, factors, reuse)
            else:
                U = whitened_gradient(G, st["Vd"], sd, st["Vx"], sx)
            W = rec.weight_matrix()
            if grp["eta_p"] > 0:
                st["mu_p"].mul_(1 - grp["eta_p"]).add_(U, alpha=grp["eta_p"])
                W_post = W
                W_next = W_post * self._decay() + grp["lr"] * st["mu_p"]
            else:
                W_post = W.add_(U, alpha=grp["lr"])
                W_next = W_post if self._decay() == 1.0 else W_post * self._decay()
            _store_posterior(st, W_post, W_next)
            rec.write_matrix(W_next)
        self._diagonal_step(scale)
        self._clear()
        return loss

    def _diag_gains(self, st: dict[str, Any]) -> tuple[Tensor, Tensor, float]:
        """(v_hat, the gains (v_hat + lam)^{-1/2}, lam) of a diagonal parameter, lam = ``damping`` mean(v_hat)
        as for a factor."""
        grp = self._group()
        bc = 1.0 - grp["beta"] ** st["step"]
        gains, lam = _damped_gains(st["v"], bc, grp["damping"])
        return st["v"] / bc, gains, lam

    def _diag_update(self, d: DiagonalParam, st: dict[str, Any], g: Tensor) -> tuple[Tensor, Tensor]:
        """The diagonal steady state of the same filter (:class:`~.factorised.BFRMSPropSS`'s fixed point with
        the factors' relative damping): v = EMA_beta(g^2) (bias-corrected v_hat, the Fisher sample e = g, the
        minibatch's ascent gradient in summed units), U = g / sqrt(v_hat + lam), then the update, momentum and
        decay of the Kronecker layers with U."""
        grp = self._group()
        if not st:
            st["v"] = torch.zeros_like(g)
            st["step"] = 0
            if grp["eta_p"] > 0:
                st["mu_p"] = torch.zeros_like(g)
        st["step"] += 1
        st["v"].mul_(grp["beta"]).addcmul_(g, g, value=1 - grp["beta"])
        U = g * self._diag_gains(st)[1]
        W = d.param.detach().clone()
        if grp["eta_p"] > 0:
            st["mu_p"].mul_(1 - grp["eta_p"]).add_(U, alpha=grp["eta_p"])
            return W, W * self._decay() + grp["lr"] * st["mu_p"]
        W_post = W.add_(U, alpha=grp["lr"])
        return W_post, (W_post if self._decay() == 1.0 else W_post * self._decay())

    def _diag_variance(self, st: dict[str, Any]) -> Tensor:
        """eta (v_hat + lam)^{-1/2}, as eta C^{-1/2} of the Kronecker layers."""
        return self._diag_gains(st)[1] * self._group()["lr"]

    def _diag_regime(self, st: dict[str, Any], s: Tensor) -> tuple[float, float]:
        """As :meth:`_regime` for one factor: sqrt(lam) gain and sqrt(v_hat) gain, medians."""
        v_hat, gains, lam = self._diag_gains(st)
        return float((gains * math.sqrt(lam)).median()), float((gains * v_hat.sqrt()).median())

    def _state(self, rec: LayerRecord) -> dict[str, Any]:
        st = self.state.get(rec.weight)
        if not st:
            raise RuntimeError("the optimiser has no posterior yet: call step() first")
        return st

    def _precision_blocks(self) -> list[tuple[LayerRecord, Tensor, Tensor]]:
        """Precision (Sigma^x (x) Sigma^delta)^{-1} = eta^{-1} C_x^{1/2} (x) C_delta^{1/2}, split evenly."""
        out = []
        r = 1.0 / math.sqrt(self._group()["lr"])
        for rec in self.layers:
            st = self._state(rec)
            sx, _, sd, _ = self._gains(st)
            Rx = (st["Vx"] / sx) @ st["Vx"].T
            Rd = (st["Vd"] / sd) @ st["Vd"].T
            out.append((rec, 0.5 * (Rd + Rd.T) * r, 0.5 * (Rx + Rx.T) * r))
        return out

    def _cov_diagonals(self, rec: LayerRecord) -> tuple[Tensor, Tensor]:
        st = self._state(rec)
        sx, _, sd, _ = self._gains(st)
        r = math.sqrt(self._group()["lr"])
        return st["Vd"].square() @ sd * r, st["Vx"].square() @ sx * r

    def _regime(self, rec: LayerRecord, s: Tensor) -> tuple[float, float]:
        """Per eigen-direction pair (i, j) the gain is eta ((d_i + lam_d)(d_j + lam_x))^{-1/2}: SGD-like
        (a constant gain eta/sqrt(lam_d lam_x), the damping acting as the prior) when the damping dominates,
        Adam-like (eta/sqrt(d_i d_j), whitening) when the curvature does. ``sgd_like`` = gain/(SGD gain),
        ``adam_like`` = gain * sqrt(d_i d_j)/eta, both medians over all M N pairs."""
        st = self._state(rec)
        bc = 1.0 - self._group()["beta"] ** st["step"]
        sx, lx, sd, ld = self._gains(st)
        sgd = torch.outer(sd * math.sqrt(ld), sx * math.sqrt(lx))
        adam = torch.outer(sd * (st["dd"] / bc).sqrt(), sx * (st["dx"] / bc).sqrt())
        return float(sgd.median()), float(adam.median())
