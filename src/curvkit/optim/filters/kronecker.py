"""Kronecker-factored Bayesian-filtering optimisers (Aitchison 2018, Sec. 2.1.3, Eqs. 22-28, SI Sec. 4.3): the math
of the three filters and the bookkeeping they share (``_KroneckerBase``: layer records, the diagonal form, the
posterior mean, diagnostics). The filters themselves: :mod:`.kfbayes` (KFBayes, KFNatGrad) and :mod:`.kfwhiten`
(KFWhiten); the factor algebra: :mod:`.kron_math`; the capture of x and delta: :mod:`.kron_capture`.

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
per-sample loop up to rounding (tested); a layer with T > 1 rows per example takes its examples one after the
other (O(min(T, M, N) (N^2 + M^2)) each, :func:`~.kron_math.project_first_order_rows`). Lambda_x, Lambda_delta
use a Cholesky factor, not an inverse.

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
unknown module with trainable parameters, a module registered twice, random or sample-coupling modules in
training mode). The Kronecker posterior is kept on the layers whose handler has paired rows
(:meth:`curvkit.layerkinds.LayerHandler.paired_rows`; a kind registered with them is taken the same way):
``nn.Linear`` (on (B, in) inputs, and weight-shared over positions, inputs (B, *S, in)) and groups=1
``nn.Conv1d/2d/3d`` (unfolded patches per output location). Example n's rows are its T positions (T = 1 for
(B, in) inputs), so its per-example gradient is E_n = L_n^T R_n (L_n (T, M) its output-gradient rows, R_n (T, N)
its input rows with the bias column), of rank up to T:

* KFNatGrad/KFBayes: with T = 1 the rank-one data step (corrected Eq. 24, the fast span recursion above); with
  T > 1 its generalisation to any E_n (:func:`~.kron_math.project_first_order_rows`: SI Eq. 32's first-order
  projection of the rank-one Kalman step with e_n = vec(E_n), linear in the Kronecker terms of
  vec(F) vec(F)^T, F = Sd E Sx; derived here, tested against the exact KL projection), or with
  ``projection='exact'`` the dense Kalman step with e_n = vec(E_n). ``fisher_samples=K`` takes the first K
  examples' rows (data-parallel: the union's first K examples' rows, :mod:`._distributed`).
* KFWhiten: the covariance EMAs take every row (KFC-style), whatever T.

A parameter shared by several modules (weight tying: a language model's token embedding and output layer) is ONE
Kronecker record in its head's view [W | b] (:func:`~.kron_capture.collect_layers`): its per-example gradient is
the sum of its uses', ``E_n = D_h^T [X_h 1] + U^T [Delta_e 0]`` (U the embedding's one-hot rows, Delta_e its
output gradients, a zero bias column since the embedding does not read the head's bias), i.e. the rows
L = [D_h; U], R = [[X_h, 1]; [Delta_e, 0]] stacked per example (:meth:`~.kron_capture.LayerRecord.rows`).
KFNatGrad/KFBayes take both uses exactly in the Kalman step (the posterior stays one Kronecker product by the
filter's own projection); KFWhiten's covariance EMAs take the stacked rows as more rows of the head's view
(KFC-style; each use's output-gradient rows carry the loss scale: the head's delta on the output side, the
embedding's delta_e on the input side). Taken: a head in the weight's standard view (a Linear layer, with or
without a bias) with embedding lookups of its table or Linear uses without a bias, up to
``kron_capture.TIED_OUTPUT_LIMIT`` = 8192 outputs (the record's output factor is a dense (V, V) matrix); other
tied parameters, and larger vocabularies, get the diagonal form below, with the layers that hold them (their
Fisher sample is the parameter's own gradient, the sum of its uses'; ``DiagonalParam.kind`` 'tied').

Every other trainable parameter - embeddings, normalisation layers, attention projections, grouped convolutions,
raw parameters (a ViT's class token and position table) - gets the DIAGONAL form of the same filter:
the factorised equations (Sec. 2.1.1) with the Fisher sample e = g, the minibatch's ascent gradient in summed
units (the factorised filters' ``curvature='empirical'``; per-example gradients of arbitrary layers are not
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
from curvkit.optim.filters._base import LossScale, Reduction, all_finite
from curvkit.optim.filters.kron_capture import DiagonalParam, LayerRecord, check_captured, collect_layers


def _store_posterior(st: dict[str, Any], W_post: Tensor, W_next: Tensor) -> None:
    """Keep the posterior mean only when it differs from the next prior mean held by the parameters
    (decay or momentum); ``posterior_mean()`` swaps it in when present."""
    if W_next is W_post:
        st.pop("mu_post", None)
    else:
        st["mu_post"] = W_post


class _KroneckerBase(CurvatureOptimizer):
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
        self.layers, self.capture, self.diagonal = collect_layers(model, type(self).__name__, given)
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
            return rec.rows(scale * math.sqrt(B / k), k)
        return rec.rows(scale)

    def _example_rows(self, rec: LayerRecord, scale: float, k: int | None) -> tuple[Tensor, Tensor]:
        """The captured rows grouped per example, (L (K, T, M), R (K, T, N)) in summed-log-likelihood units: example
        n's per-example gradient is E_n = L_n^T R_n (T = the layer's positions per example: a weight-shared
        Linear layer's positions, a convolution's output locations). ``k`` keeps the first k examples, L scaled
        by sqrt(B/k) as :meth:`_samples` does."""
        rec.check_positions()
        T, B = rec.positions, rec.examples
        m = B if k is None or k >= B else k
        X, D = rec.rows(scale * (math.sqrt(B / m) if m < B else 1.0), m * T)
        return D.reshape(m, T, -1), X.reshape(m, T, -1)

    @staticmethod
    def _grad_factors(rec: LayerRecord, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
        """Per-row factors (D (K, M), X (K, N)) of the ascent gradient, G = D^T X, from the captured layer
        input and output gradient (None if nothing was captured); used for the cheaper products."""
        if rec.a is None or rec.delta is None:
            return None
        X, D = rec.rows(scale)
        return D.to(dtype).neg_(), X.to(dtype)

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
