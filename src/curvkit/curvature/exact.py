"""Exact curvature operators of a model's loss: Hessian, GGN, type-2 Fisher, MC Fisher, empirical Fisher.

Every operator is built as ``XOperator(model, likelihood, data)`` and is a
:class:`curvkit.linalg.operator.CurvatureOperator` over the model's trainable parameters (flat layout
:class:`curvkit.linalg.layout.ParamLayout`: ``named_parameters()`` order, each tensor row-major). Nothing
of size (d, d) is formed unless ``to_dense()`` is asked for.

Data and reduction. ``data`` is an ``(X, y)`` pair or an iterable of pairs; it is materialised into a
list once (moved to the model's device) and every product loops over all of it again (one pass per
product). The loss is L(theta) = w * sum_{n=1}^N L^n(theta) over ALL N points, with w = 1 for
``likelihood.reduction == 'sum'`` and w = 1/N for ``'mean'`` (so batches are weighted by their size,
exactly as if the data were one batch). Every operator below carries the same factor w.

Evaluation point. The operators are evaluated at the model's parameters AT CONSTRUCTION: they are
snapshotted with ``.detach().clone()`` (buffers and frozen parameters too), so later training does not
change an existing operator; build a new one to follow the model. See
:class:`curvkit.curvature._functional.FunctionalModel` for the train/eval-mode caveat.

The operators (thesis chapter 3; f_n = model output (B, C) = h_L, J_n = df_n/dtheta (C, d)):

* :class:`HessianOperator` - H = w sum_n d^2 L^n / dtheta^2 (thesis Lemma 3.15 structure), products by
  forward-over-reverse differentiation (``torch.func.jvp`` of ``torch.func.grad``).
* :class:`GGNOperator` - G = w sum_n J_n^T H_L^n J_n (Def. 3.19 with the output Hessian H_L, Lemma 3.20).
* :class:`FisherOperator` - type-2 Fisher F = w sum_n J_n^T F_L^n J_n with the exact expectation over
  model labels (Eqs. 3.35-3.36); F_L from its definition in :mod:`curvkit.curvature.output_space`.
  Equal to the GGN for the three built-in heads (Eqs. 3.37-3.38).
* :class:`MCFisherOperator` - F_L replaced by (1/M) sum_m g(f_n, y_nm) g(f_n, y_nm)^T with M labels per
  point sampled from the model ONCE at construction (seeded), so the operator is a fixed matrix; with
  M = 1 this is the curvature that KFAC factorises (digest section 2.6).
* :class:`EmpiricalFisherOperator` - F_L replaced by g(f_n, y_n) g(f_n, y_n)^T at the DATA labels
  (not the thesis's Fisher; differs from the GGN in general).

The last four share one form, w sum_n J_n^T S_n S_n^T J_n with an output-space factor S_n (C, R):
products apply J (``jvp``, batched over columns with ``vmap``), S S^T in output space, then J^T (``vjp``).
Their exact ``diagonal()`` is w sum_n sum_r (J_n^T s_nr)^2 and ``to_dense()`` is w V^T V with
V = [J_n^T s_nr] stacked over n and r; they need N * R per-sample backward passes (vmapped), not d
products, and the diagonal of a model whose parameters all sit in Linear/Conv2d layers only R batched
backward passes per batch (:mod:`curvkit.curvature._layerwise`). ``trace('exact')`` sums that
diagonal. Eigenvalues (Lanczos), ``solve`` (CG) and scipy export come from the base class.

A usage sketch (doctest):

>>> import torch
>>> from curvkit.models import mlp
>>> from curvkit.likelihoods import CrossEntropy
>>> net = mlp([4, 5, 3], "tanh", dtype=torch.float64, seed=0)
>>> X, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
>>> G = GGNOperator(net, CrossEntropy("mean"), (X, y))
>>> G.shape, (G @ torch.ones(43, dtype=torch.float64)).shape
((43, 43), torch.Size([43]))
>>> bool(torch.allclose(G.trace(), G.to_dense().trace()))
True
>>> F = FisherOperator(net, CrossEntropy("mean"), [(X[:3], y[:3]), (X[3:], y[3:])])
>>> bool(torch.allclose(F.to_dense(), G.to_dense()))  # GGN == type-2 Fisher (thesis Eqs. 3.36-3.38)
True
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad, jvp, vjp, vmap

from curvkit.curvature._functional import (
    FunctionalModel,
    Params,
    as_batches,
    checked_output,
    cols_to_params,
    params_to_cols,
    params_to_rows,
)
from curvkit.curvature._layerwise import LayerSpec, Unsupported, layer_specs, layerwise_diagonal
from curvkit.curvature.output_space import output_fisher_sqrt
from curvkit.likelihoods import Likelihood
from curvkit.linalg.operator import CurvatureOperator, DiagonalOperator

# Per-sample factor rows are produced in chunks of at most this many scalars (rows * d).
_ROW_BUDGET = 2**24


class ExactCurvatureOperator(CurvatureOperator):
    """Common set-up of the exact operators: parameter snapshot, data, reduction weight, validation.

    Args:
        model: any ``nn.Module`` mapping X (B, ...) to outputs (B, C).
        likelihood: a :class:`curvkit.likelihoods.Likelihood`; its ``reduction`` sets w (module doc).
        data: an ``(X, y)`` pair or an iterable of pairs (materialised to a list, re-read per product).
        chunk_size: at most this many columns are pushed through ``vmap`` at once in a matrix product
            (bounds memory to about ``chunk_size`` copies of the activations).

    Raises at construction: TypeError for a non-module / non-likelihood / malformed data; ValueError if
    the model output is not (B, C) or contains NaN/inf, or the targets do not fit the likelihood (the
    likelihood's own ``check``).
    """

    def __init__(self, model: nn.Module, likelihood: Likelihood, data: Any, chunk_size: int = 64):
        if not isinstance(likelihood, Likelihood):
            raise TypeError(f"likelihood must be a curvkit.likelihoods.Likelihood, got {type(likelihood).__name__}")
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
        self.fmodel = FunctionalModel(model)
        super().__init__(self.fmodel.layout, self.fmodel.dtype, self.fmodel.device)
        self.likelihood = likelihood
        self.batches = as_batches(data, self.device)
        self.num_data = sum(int(X.shape[0]) for X, _ in self.batches)
        self.weight = 1.0 if likelihood.reduction == "sum" else 1.0 / self.num_data
        self.chunk_size = int(chunk_size)
        self._use_vmap = True
        self._setup([checked_output(self.fmodel, likelihood, X, y, i) for i, (X, y) in enumerate(self.batches)])

    def _setup(self, outputs: list[Tensor]) -> None:
        """Hook for subclasses that need the outputs at the snapshot (e.g. to sample labels)."""

    @property
    def params(self) -> Params:
        return self.fmodel.params

    def _matmat(self, M: Tensor) -> Tensor:
        M = M.to(device=self.device, dtype=self.dtype)
        if M.shape[1] <= self.chunk_size:
            return self._matmat_chunk(M)
        return torch.cat([self._matmat_chunk(M[:, s:s + self.chunk_size])
                          for s in range(0, M.shape[1], self.chunk_size)], dim=1)

    def _matmat_chunk(self, M: Tensor) -> Tensor:
        raise NotImplementedError

    def _map(self, fn: Callable[..., Any], args: tuple[Any, ...], n: int) -> Any:
        """``vmap(fn)(*args)`` over the leading dimension (size n) of every tensor in ``args``.

        Falls back (once and for all, with a warning) to a Python loop if vmap is unsupported by the model.
        """
        tree_map = torch.utils._pytree.tree_map
        if n == 1:  # a single column / sample: no vmap overhead
            return tree_map(lambda t: t.unsqueeze(0), fn(*tree_map(lambda t: t[0], args)))
        if self._use_vmap:
            try:
                return vmap(fn)(*args)
            except (RuntimeError, NotImplementedError) as err:
                self._use_vmap = False
                warnings.warn(f"{type(self).__name__}: torch.func.vmap failed ({err}); falling back to a "
                              "slower Python loop", RuntimeWarning, stacklevel=3)
        outs = [fn(*tree_map(lambda t, i=i: t[i], args)) for i in range(n)]
        return tree_map(lambda *ts: torch.stack(ts), *outs)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(d={self.layout.dim}, N={self.num_data}, batches={len(self.batches)}, "
                f"likelihood={self.likelihood!r}, dtype={self.dtype})")


class HessianOperator(ExactCurvatureOperator):
    """Exact Hessian H = w sum_n d^2 L^n / dtheta^2 of the loss over all data (module doc for w).

    Products: for each batch, Hessian-vector products by forward-over-reverse differentiation,
    ``jvp(grad(loss_batch), (theta,), (v,))``, vmapped over the columns of the (d, k) input (chunks of
    ``chunk_size`` columns). Cost per product with k columns ~ k gradient passes over the data.
    The Hessian is symmetric but NOT positive semi-definite in general: ``solve`` (CG) raises if it meets
    negative curvature; add damping or use the GGN.
    """

    def _batch_loss(self, params: Params, X: Tensor, y: Tensor) -> Tensor:
        f = self.fmodel(params, X)
        return self.likelihood.nll_per_sample(f, y).sum() * self.weight

    def _matmat_chunk(self, M: Tensor) -> Tensor:
        V = cols_to_params(self.layout, M)
        out = torch.zeros_like(M)
        for X, y in self.batches:
            g = grad(lambda p, X=X, y=y: self._batch_loss(p, X, y))

            def hvp(v: Params, g: Callable[[Params], Params] = g) -> Params:
                return jvp(g, (self.params,), (v,))[1]

            out += params_to_cols(self._map(hvp, (V,), M.shape[1]))
        return out

    def diagonal(self, max_dim: int | None = 20_000) -> DiagonalOperator:
        """Exact diagonal by d unit-vector Hessian-vector products, in chunks of ``chunk_size`` columns.

        Cost: d HVPs, i.e. about d gradient passes over all the data; only for small models. Raises a
        ValueError if d > ``max_dim`` (pass ``max_dim=None`` to force it). For large models use
        ``trace(method='hutchinson')`` for the trace, or the GGN's exact diagonal, which needs only
        R batched backward passes per batch (and equals the Hessian's diagonal for piecewise-linear
        networks, whose diagonal blocks coincide with the GGN's, thesis Lemma 3.23).
        """
        d = self.layout.dim
        if max_dim is not None and d > max_dim:
            raise ValueError(
                f"the exact Hessian diagonal needs d = {d} Hessian-vector products (> max_dim = {max_dim}); "
                "use GGNOperator(...).diagonal() (exact, cheap), trace(method='hutchinson'), or pass "
                "max_dim=None to compute it anyway"
            )
        diag = torch.empty(d, dtype=self.dtype, device=self.device)
        for s in range(0, d, self.chunk_size):
            k = min(self.chunk_size, d - s)
            idx = torch.arange(k, device=self.device)
            E = torch.zeros(d, k, dtype=self.dtype, device=self.device)
            E[s + idx, idx] = 1
            diag[s:s + k] = self._matmat_chunk(E)[s + idx, idx]
        return DiagonalOperator.from_flat(self.layout, diag)


class OutputFactorOperator(ExactCurvatureOperator):
    """C = w sum_n J_n^T S_n S_n^T J_n for an output-space factor S_n (C, R) given by ``output_factor``.

    Subclasses implement ``output_factor(batch_index, f, y) -> S`` of shape (B, C, R) from the batch's
    model outputs ``f`` (B, C) at the snapshot and its targets ``y``.
    """

    _layer_specs: list[LayerSpec] | None = None  # resolved on the first diagonal() call

    def output_factor(self, batch_index: int, f: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError

    def _matmat_chunk(self, M: Tensor) -> Tensor:
        k = M.shape[1]
        V = cols_to_params(self.layout, M)
        out = torch.zeros_like(M)
        for i, (X, y) in enumerate(self.batches):
            def fn(p: Params, X: Tensor = X) -> Tensor:
                return self.fmodel(p, X)

            f, vjp_fn = vjp(fn, self.params)[:2]
            Jv = self._map(lambda v, fn=fn: jvp(fn, (self.params,), (v,))[1], (V,), k)  # (k, B, C)
            S = self.output_factor(i, f.detach(), y)  # (B, C, R)
            U = torch.einsum("bcr,kbr->kbc", S, torch.einsum("bcr,kbc->kbr", S, Jv)) * self.weight
            JtU = self._map(lambda u, vjp_fn=vjp_fn: vjp_fn(u)[0], (U,), k)
            out += params_to_cols(JtU)
        return out

    def _factor_rows(self) -> Iterator[Tensor]:
        """Yield chunks (m, d) of the rows J_n^T s_nr (all n, r) of the factor V with C = w V^T V."""
        d = self.layout.dim
        for i, (X, y) in enumerate(self.batches):
            with torch.no_grad():
                f = self.fmodel(self.params, X)
            S = self.output_factor(i, f, y)
            n = max(1, _ROW_BUDGET // (S.shape[2] * d))
            for s in range(0, X.shape[0], n):
                Xs, Ss = X[s:s + n], S[s:s + n]
                yield self._map(self._sample_rows, (Xs, Ss), Xs.shape[0]).reshape(-1, d)

    def _sample_rows(self, x: Tensor, s: Tensor) -> Tensor:
        """(R, d) rows J^T s_r for one sample x (no batch dim) and its factor s (C, R)."""
        vjp_fn = vjp(lambda p: self.fmodel.single(p, x), self.params)[1]
        return params_to_rows(vmap(lambda u: vjp_fn(u)[0])(s.T), 1)

    def diagonal(self) -> DiagonalOperator:
        """Exact diagonal w sum_n sum_r (J_n^T s_nr)^2.

        If every trainable parameter belongs to an ``nn.Linear`` / ``nn.Conv2d`` layer, R batched backward
        passes per batch to the layer outputs suffice (:mod:`curvkit.curvature._layerwise`); otherwise
        N * R per-sample gradients are formed with vmapped vjps (chunks of ~2^24 scalars).
        """
        if self._layer_specs is None:
            self._layer_specs = layer_specs(self.fmodel) or []
        if self._layer_specs:
            try:
                return self._diagonal_layerwise(self._layer_specs)
            except Unsupported:
                self._layer_specs = []
        return self._diagonal_per_sample()

    def _diagonal_per_sample(self) -> DiagonalOperator:
        diag = torch.zeros(self.layout.dim, dtype=self.dtype, device=self.device)
        for rows in self._factor_rows():
            diag += (rows**2).sum(0)
        return DiagonalOperator.from_flat(self.layout, diag * self.weight)

    def _diagonal_layerwise(self, specs: list[LayerSpec]) -> DiagonalOperator:
        acc = {n: torch.zeros(s, dtype=self.dtype, device=self.device)
               for n, s in zip(self.layout.names, self.layout.shapes)}
        for i, (X, y) in enumerate(self.batches):
            with torch.no_grad():
                f = self.fmodel(self.params, X)
            for name, val in layerwise_diagonal(self.fmodel, specs, X, self.output_factor(i, f, y)).items():
                acc[name] += val
        return DiagonalOperator(self.layout, [acc[n] * self.weight for n in self.layout.names])

    def to_dense(self) -> Tensor:
        """Exact (d, d) matrix w V^T V from the per-sample factor rows (O(d^2) memory)."""
        d = self.layout.dim
        out = torch.zeros(d, d, dtype=self.dtype, device=self.device)
        for rows in self._factor_rows():
            out += rows.T @ rows
        return out * self.weight


class GGNOperator(OutputFactorOperator):
    """Generalised Gauss-Newton G = w sum_n J_n^T H_L^n J_n (thesis Def. 3.19; G_L = H_L, Lemma 3.20).

    S_n = ``likelihood.output_hessian_sqrt(f_n)`` (S S^T = H_L; for softmax diag(sqrt p) - p sqrt(p)^T).
    Positive semi-definite; rank <= N * rank(H_L) (thesis Sec. 3.6).
    """

    def output_factor(self, batch_index: int, f: Tensor, y: Tensor) -> Tensor:
        return self.likelihood.output_hessian_sqrt(f)


class FisherOperator(OutputFactorOperator):
    """Type-2 Fisher F = w sum_n J_n^T F_L^n J_n, exact expectation over model labels (thesis Eq. 3.36).

    F_L = E_{y~p(y|f_n)}[g g^T] is computed from its definition
    (:func:`curvkit.curvature.output_space.output_fisher_sqrt`); it equals H_L for softmax CE, sigmoid BCE
    and the fixed-variance Gaussian (Eqs. 3.37-3.38), so F equals the GGN for these heads. The data
    labels y are not used (only the inputs).
    """

    def _setup(self, outputs: list[Tensor]) -> None:
        output_fisher_sqrt(self.likelihood, outputs[0][:1])  # fail early for a head without a closed form

    def output_factor(self, batch_index: int, f: Tensor, y: Tensor) -> Tensor:
        return output_fisher_sqrt(self.likelihood, f)


class MCFisherOperator(OutputFactorOperator):
    """Monte Carlo type-2 Fisher with ``mc_samples`` = M model labels per data point.

    F_MC = w sum_n (1/M) sum_m J_n^T g_nm g_nm^T J_n, g_nm = dL(f_n, y_nm)/df_n, y_nm ~ p(y | f_n).
    The labels are drawn ONCE at construction from ``torch.Generator(device).manual_seed(seed)``, batch
    by batch in data order (M draws per batch), so the operator is a fixed PSD matrix of rank <= N * M;
    E[F_MC] = F (the type-2 Fisher). S_n columns = g_nm / sqrt(M).
    """

    def __init__(self, model: nn.Module, likelihood: Likelihood, data: Any, mc_samples: int = 1,
                 seed: int = 0, chunk_size: int = 64):
        if int(mc_samples) < 1:
            raise ValueError(f"mc_samples must be a positive integer, got {mc_samples}")
        self.mc_samples = int(mc_samples)
        self.seed = int(seed)
        self.labels: list[list[Tensor]] = []
        super().__init__(model, likelihood, data, chunk_size=chunk_size)

    def _setup(self, outputs: list[Tensor]) -> None:
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        self.labels = [[self.likelihood.sample(f, generator=gen) for _ in range(self.mc_samples)]
                       for f in outputs]

    def output_factor(self, batch_index: int, f: Tensor, y: Tensor) -> Tensor:
        grads = [self.likelihood.output_grad(f, ym) for ym in self.labels[batch_index]]
        return torch.stack(grads, dim=-1) / math.sqrt(self.mc_samples)


class EmpiricalFisherOperator(OutputFactorOperator):
    """Empirical Fisher w sum_n grad L^n grad L^n^T at the DATA labels (S_n = dL^n/df_n, R = 1).

    Not the thesis's Fisher (which samples labels from the model, digest section 2.6): it differs from
    the GGN in general and is provided for comparison only. Rank <= N.
    """

    def output_factor(self, batch_index: int, f: Tensor, y: Tensor) -> Tensor:
        return self.likelihood.output_grad(f, y)[:, :, None]


def hessian(model: nn.Module, likelihood: Likelihood, data: Any, **kwargs: Any) -> HessianOperator:
    """:class:`HessianOperator` of ``likelihood`` on ``data`` at the model's current parameters."""
    return HessianOperator(model, likelihood, data, **kwargs)


def ggn(model: nn.Module, likelihood: Likelihood, data: Any, **kwargs: Any) -> GGNOperator:
    """:class:`GGNOperator` of ``likelihood`` on ``data`` at the model's current parameters."""
    return GGNOperator(model, likelihood, data, **kwargs)


def fisher(model: nn.Module, likelihood: Likelihood, data: Any, **kwargs: Any) -> FisherOperator:
    """:class:`FisherOperator` (type-2, exact expectation) at the model's current parameters."""
    return FisherOperator(model, likelihood, data, **kwargs)


def mc_fisher(model: nn.Module, likelihood: Likelihood, data: Any, mc_samples: int = 1, seed: int = 0,
              **kwargs: Any) -> MCFisherOperator:
    """:class:`MCFisherOperator` with ``mc_samples`` seeded model labels per point."""
    return MCFisherOperator(model, likelihood, data, mc_samples=mc_samples, seed=seed, **kwargs)


def empirical_fisher(model: nn.Module, likelihood: Likelihood, data: Any,
                     **kwargs: Any) -> EmpiricalFisherOperator:
    """:class:`EmpiricalFisherOperator` (gradients at the data labels) at the current parameters."""
    return EmpiricalFisherOperator(model, likelihood, data, **kwargs)
