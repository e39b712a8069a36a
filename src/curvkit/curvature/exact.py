"""Exact curvature operators of a model's loss: Hessian, GGN, type-2 Fisher, MC Fisher, empirical Fisher.

Every operator is built as ``XOperator(model, likelihood, data)`` and is a
:class:`curvkit.linalg.operator.CurvatureOperator` over the model's trainable parameters (flat layout
:class:`curvkit.linalg.layout.ParamLayout`: ``named_parameters()`` order, each tensor row-major). Nothing
of size (d, d) is formed unless ``to_dense()`` is asked for.

Data and reduction. ``data`` is an ``(X, y)`` pair or an iterable of pairs, ``X`` a tensor (B, ...) or a
mapping of tensors sharing B (``{"input_ids": ..., "attention_mask": ...}``; the model is called as
``model(X)``, :mod:`curvkit.validation`); it is materialised into a list once (moved to the model's device)
and every product loops over all of it again (one pass per product). Outputs are (B, C), or (B, *P, C)
with position dimensions P (tokens, time steps; classes last, targets (B, *P) or the output's shape): the loss is L(theta) = w * sum_n sum_p L^np(theta) over ALL N
samples and their counted positions (padding, the likelihood's ``ignore_index`` / ``ignore_value``, is left
out of the loss and of every curvature), with w = 1 for ``likelihood.reduction == 'sum'`` and
w = 1 / (counted positions of all the data) for ``'mean'`` (= 1/N without positions: batches are weighted
by their size, exactly as if the data were one batch; with positions exactly ``nn.CrossEntropyLoss`` on the
logits flattened to (B * T, C)). Every operator below carries the same factor w (``weight``; ``num_terms``
the counted positions, ``num_data`` the samples).

Models. Any differentiable ``nn.Module``: every evaluation runs through
:meth:`curvkit.structure.ModelStructure.functional_call`, inside :func:`curvkit.structure.curvature_kernels`
(math attention, no multi-head-attention fast path: the fused kernels have no forward-mode derivative and no
double backward, and the eval-mode fast path skips Python-level changes such as LoRA adapters), with the
user's settings restored afterwards.

Evaluation point. The operators are evaluated at the model's parameters AT CONSTRUCTION: they are
snapshotted with ``.detach().clone()`` (buffers and frozen parameters too), so later training does not
change an existing operator; build a new one to follow the model. ``snapshot=False`` holds the model's own
tensors instead of copies (one copy of the model less: the products of a large model at the memory of
curvlinops' operators, which read the live parameters) and makes every later evaluation raise a
``RuntimeError`` once one of them has been changed in place (PyTorch's version counters; changes through
``.data`` are not seen), so an operator is still never silently evaluated elsewhere than where it was built. See
:class:`curvkit.curvature._functional.FunctionalModel` for the train/eval-mode caveat.

The operators (thesis chapter 3; f_np = model output at sample n and position p (C,), J_np = df_np/dtheta
(C, d); without positions p takes one value):

* :class:`HessianOperator` - H = w sum_np d^2 L^np / dtheta^2 (thesis Lemma 3.15 structure), products by
  reverse-over-reverse differentiation (one double-backward pass per column through the graph of the
  gradient, which is cached between products for single-batch data; ``cache_graph``). For networks that
  are piecewise linear in each layer's parameters, ``trace()`` uses (by default, ``piecewise_linear="auto"``)
  tr(H) = tr(G) (thesis Lemma 3.23; :func:`piecewise_linear_reason` verifies the structure).
* :class:`GGNOperator` - G = w sum_np J_np^T H_L^np J_np (Def. 3.19 with the output Hessian H_L, Lemma 3.20).
* :class:`FisherOperator` - type-2 Fisher F = w sum_np J_np^T F_L^np J_np with the exact expectation over
  model labels (Eqs. 3.35-3.36); F_L from its definition in :mod:`curvkit.curvature.output_space`.
  Equal to the GGN for the three built-in heads (Eqs. 3.37-3.38).
* :class:`MCFisherOperator` - F_L replaced by (1/M) sum_m g(f_np, y_npm) g(f_np, y_npm)^T with M labels per
  sample and position sampled from the model ONCE at construction (seeded), so the operator is a fixed
  matrix; with M = 1 this is the curvature that KFAC factorises (thesis Sec. 4.3.3: one label sampled from
  the model per data point).
* :class:`EmpiricalFisherOperator` - F_L replaced by g(f_np, y_np) g(f_np, y_np)^T at the DATA labels: the
  outer products of each POSITION's loss gradient (curvlinops' convention; not the thesis's Fisher, and it
  differs from the GGN in general).

The last four share one form, w sum_np J_np^T M_np J_np with an output-space matrix M = S S^T: products
apply J (a Jacobian-vector product), M in output space (``likelihood.output_hessian_matvec`` and its
relatives: O(C) per position, never a (C, C) matrix), then J^T (a backward pass through the graph of a
forward pass, cached for single-batch data). For plain ``nn.Sequential`` models J v comes from the
activations recorded in that forward pass by tangent propagation alone (:mod:`curvkit.curvature._tangent`);
for other models from one forward-mode pass without a graph (dual numbers for one column, ``jvp`` vmapped
over several), or by reverse-over-reverse through the forward graph (``reverse_tangents=True``, and the
fallback for modules without forward-mode derivatives). A fresh operator's first product costs what every
later one costs. Quadratic forms v^T C v = w sum_np (J_np v)^T M_np (J_np v) (``quadratic_form``, and hence
``trace('hutchinson')``) need only the Jacobian-vector products.
Their exact ``diagonal()`` is w sum_np sum_r (J_np^T s_npr)^2 and ``to_dense()`` is w V^T V with
V = [J_np^T s_npr] stacked over n, p and r; they need N * T * R per-sample backward passes (vmapped; R = C
for softmax: one backward pass per sample, position and class, with S taken in chunks of columns), not d
products, and the diagonal of a model with (B, C) outputs whose parameters all sit in Linear/Conv2d layers
only R batched backward passes per batch (:mod:`curvkit.curvature._layerwise`). ``trace('exact')`` sums that
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
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn
from torch.func import grad, jvp, vjp, vmap

from curvkit import precision
from curvkit.curvature._dual_rules import dual_rules
from curvkit.curvature._functional import (
    FunctionalModel,
    Params,
    as_batches,
    check_output,
    checked_output,
    cols_to_params,
    params_to_cols,
    params_to_rows,
)
from curvkit.curvature._graph import warn_unused, warn_unused_functional
from curvkit.curvature._layerwise import (
    LayerSpec,
    Unsupported,
    layer_specs,
    layerwise_diagonal,
    squared_gradients,
)
from curvkit.curvature._tangent import SequentialTangent, tangent_chain
from curvkit.curvature._tangent import piecewise_linear_reason as _piecewise_linear_reason
from curvkit.curvature._vjp import vector_grad
from curvkit.curvature.output_space import (
    SMALL_C,
    output_fisher_matvec,
    output_fisher_rank,
    output_fisher_sqrt_columns,
    reduced_factor,
)
from curvkit.likelihoods import Likelihood
from curvkit.linalg.operator import CurvatureOperator, DiagonalOperator, TraceMethod
from curvkit.structure import differentiable, read_model
from curvkit.validation import Inputs, input_tensors, num_samples, ordinary, split_samples, take_samples

# Per-sample factor rows are produced in chunks of at most this many scalars (rows * d).
_ROW_BUDGET = 2**24
# The forward-mode tangent pass runs over the batch in up to this many pieces (its transient memory / pieces)
# of at least this many samples (smaller pieces cost more time than they save memory).
_TANGENT_PIECES, _TANGENT_PIECE_MIN = 4, 8


class ExactCurvatureOperator(CurvatureOperator):
    """Common set-up of the exact operators: parameter snapshot, data, reduction weight, validation.

    Args:
        model: any ``nn.Module`` mapping X (B, ...) to outputs (B, C) or (B, *P, C) (positions P, classes
            last; targets (B, *P) or the output's shape, as the likelihood says).
        likelihood: a :class:`curvkit.likelihoods.Likelihood`; its ``reduction`` sets w (module doc).
        data: an ``(X, y)`` pair or an iterable of pairs (materialised to a list, re-read per product).
        chunk_size: at most this many columns are pushed through ``vmap`` at once in a matrix product
            (bounds memory to about ``chunk_size`` copies of the activations).
        snapshot: True (default) evaluates at copies of the parameters, frozen parameters and buffers taken
            at construction; False holds the model's own tensors (no copy) and refuses every evaluation
            after one of them was changed in place (module doc, "Evaluation point").
        compute_dtype: None (default: the passes run in the model's dtype) or torch.float32/float64: every
            pass runs on an upcast copy of the parameters, frozen parameters, buffers and floating inputs
            (:mod:`curvkit.precision`; the operator's products are then in that dtype).
        statistics_dtype: the dtype the exact diagonal and the dense matrix are summed in over samples and
            batches (None: float32 for a bf16/fp16 pass, else the pass's dtype; :mod:`curvkit.precision`).
            Products stay in the pass's dtype.

    Raises at construction: TypeError for a non-module / non-likelihood / malformed data; ValueError if
    the model output is not (B, C) / (B, *P, C) or contains NaN/inf, the targets do not fit the likelihood
    (the likelihood's own ``check``), or a ``mean`` is asked over data whose every position is padding.

    Attributes: ``num_data`` (samples N), ``num_terms`` (counted loss terms: positions that are not padding,
    = N for (B, C) outputs) and ``weight`` w = ``likelihood.scale(num_terms)``.
    """

    @differentiable()
    def __init__(self, model: nn.Module, likelihood: Likelihood, data: Any, chunk_size: int = 64,
                 snapshot: bool = True, compute_dtype: torch.dtype | None = None,
                 statistics_dtype: torch.dtype | None = None):
        if not isinstance(likelihood, Likelihood):
            raise TypeError(f"likelihood must be a curvkit.likelihoods.Likelihood, got {type(likelihood).__name__}")
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
        self.fmodel = FunctionalModel(model, type(self).__name__, snapshot=snapshot, compute_dtype=compute_dtype)
        super().__init__(self.fmodel.layout, self.fmodel.dtype, self.fmodel.device)
        self.statistics_dtype = precision.statistics_dtype(self.dtype, statistics_dtype)
        self.likelihood = likelihood
        self.batches = as_batches(data, self.device)
        self.num_data = sum(num_samples(X) for X, _ in self.batches)
        self.chunk_size = int(chunk_size)
        self._use_vmap = True
        versions = [[t._version for _, t in input_tensors(X)] for X, _ in self.batches]
        outputs = [self._construction_output(i, X, y) for i, (X, y) in enumerate(self.batches)]
        for i, ((X, _), before) in enumerate(zip(self.batches, versions)):
            if [t._version for _, t in input_tensors(X)] != before:
                raise ValueError(
                    f"batch {i}: the model changed its input X in place (a first operation such as x.tanh_() or "
                    "F.relu(x, inplace=True)); curvkit evaluates the model many times on one batch, so the model "
                    "must leave its input unchanged: make that operation out of place")
        self.num_terms = sum(likelihood.num_terms(f, y) for f, (_, y) in zip(outputs, self.batches))
        self.weight = likelihood.scale(self.num_terms)
        self._setup(outputs)
        graph = self._construction_graph()
        if graph is None:  # one more forward pass, with fresh leaves, to read the graph
            warn_unused_functional(type(self).__name__, self.fmodel, self.batches[0][0])
        else:
            warn_unused(type(self).__name__, self.fmodel.module, self.fmodel.names, *graph)

    def _construction_output(self, batch_index: int, X: Inputs, y: Tensor) -> Tensor:
        """The validated output (B, [*P,] C) of one batch at construction (subclasses may keep its graph)."""
        return checked_output(self.fmodel, self.likelihood, X, y, batch_index)

    def _setup(self, outputs: list[Tensor]) -> None:
        """Hook for subclasses that need the outputs at the snapshot (e.g. to sample labels)."""

    def _construction_graph(self) -> tuple[Params, Tensor] | None:
        """(leaves, output with its graph) of the first batch's construction pass, where it was kept (the
        unused-parameter check reads it instead of running another forward pass), else None."""
        return None

    def _leaves(self) -> Params:
        """Fresh autograd leaves sharing the snapshot's storage (the snapshot itself never requires grad)."""
        return tuple(p.detach().requires_grad_() for p in self.params)

    def _sibling(self, cls: type[ExactCurvatureOperator]) -> Any:
        """An operator of class ``cls`` on the SAME snapshot and data (no re-validation, no new snapshot)."""
        op = cls.__new__(cls)
        CurvatureOperator.__init__(op, self.layout, self.dtype, self.device)
        op.fmodel, op.likelihood, op.batches = self.fmodel, self.likelihood, self.batches
        op.num_data, op.num_terms, op.weight = self.num_data, self.num_terms, self.weight
        op.chunk_size, op._use_vmap = self.chunk_size, True
        op.statistics_dtype = self.statistics_dtype
        return op

    @property
    def params(self) -> Params:
        return self.fmodel.params

    @differentiable()
    def _matmat(self, M: Tensor) -> Tensor:
        self.fmodel.check_unchanged()
        M = ordinary(M.to(device=self.device, dtype=self.dtype))
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

    Products (reverse-over-reverse): per batch, the gradient g(theta) = grad L_batch is formed once with
    ``create_graph=True``; then H v = d(g^T v)/dtheta is one more backward pass through that graph per
    column v of the (d, k) input. Cost per product with k columns ~ one gradient pass (building the
    graph, unless cached) + k double-backward passes over the data.

    Graph caching (``cache_graph``): with ``True`` the differentiable gradient of every batch is kept
    between products (built from the construction-time forward pass), so repeated products (traces,
    Lanczos, CG) pay only the double-backward passes. The memory trade-off: the operator then holds the
    batch's activations plus the gradient's graph (a few times the memory of one gradient pass per batch,
    O(B * width), never O(d^2)) for as long as it lives. ``None`` (default) caches when ``data`` is a
    single batch and recomputes per product otherwise; ``False`` never caches. A cached graph freezes
    the module's train/eval mode as it was at construction.

    If the model has an operation without a double-backward formula, products fall back (once, with a
    warning) to forward-over-reverse differentiation (``torch.func.jvp`` of ``torch.func.grad``, vmapped
    over the columns). The Hessian is symmetric but NOT positive semi-definite in general: ``solve`` (CG)
    raises if it meets negative curvature; add damping or use the GGN.
    """

    def __init__(self, model: nn.Module, likelihood: Likelihood, data: Any, chunk_size: int = 64,
                 cache_graph: bool | None = None, snapshot: bool = True, compute_dtype: torch.dtype | None = None,
                 statistics_dtype: torch.dtype | None = None):
        if cache_graph not in (None, True, False):
            raise ValueError(f"cache_graph must be None (auto), True or False, got {cache_graph!r}")
        self.cache_graph = cache_graph
        self._graphs: dict[int, tuple[Params, Any]] = {}  # batch -> (leaves, output f or gradient tuple)
        self._use_double_backward = True
        super().__init__(model, likelihood, data, chunk_size=chunk_size, snapshot=snapshot,
                         compute_dtype=compute_dtype, statistics_dtype=statistics_dtype)

    @property
    def caches_graph(self) -> bool:
        """Whether differentiable gradients are kept between products (see the class doc)."""
        return self.cache_graph if self.cache_graph is not None else len(self.batches) == 1

    def _construction_output(self, batch_index: int, X: Inputs, y: Tensor) -> Tensor:
        if not self.caches_graph:
            return super()._construction_output(batch_index, X, y)
        leaves = self._leaves()
        with torch.enable_grad():
            f = check_output(self.fmodel(leaves, X), self.likelihood, X, y, batch_index)
        self._graphs[batch_index] = (leaves, f)  # the gradient is formed lazily on the first product
        return f.detach()

    def _construction_graph(self) -> tuple[Params, Tensor] | None:
        cached = self._graphs.get(0)
        return cached if cached is not None and isinstance(cached[1], Tensor) else None

    def _batch_loss(self, params: Params, X: Inputs, y: Tensor) -> Tensor:
        f = self.fmodel(params, X)
        return self.likelihood.nll_per_sample(f, y).sum() * self.weight

    def _batch_gradient(self, i: int, X: Inputs, y: Tensor) -> tuple[Params, Params]:
        """(leaves, differentiable gradient of batch i's weighted loss w.r.t. the leaves)."""
        cached = self._graphs.get(i)
        if cached is not None and isinstance(cached[1], tuple):
            return cached
        with torch.enable_grad():
            if cached is not None:
                leaves, f = cached
            else:
                leaves = self._leaves()
                f = self.fmodel(leaves, X)
            loss = self.likelihood.nll_per_sample(f, y).sum() * self.weight
            g = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True, materialize_grads=True)
        if self.caches_graph:
            self._graphs[i] = (leaves, g)
        return leaves, g

    def _matmat_chunk(self, M: Tensor) -> Tensor:
        if self._use_double_backward:
            try:
                return self._matmat_double_backward(M)
            except (RuntimeError, NotImplementedError) as err:
                self._use_double_backward = False
                self._graphs.clear()
                warnings.warn(f"HessianOperator: double backward failed ({err}); falling back to "
                              "forward-over-reverse products", RuntimeWarning, stacklevel=3)
        try:
            return self._matmat_forward_over_reverse(M)
        except (RuntimeError, NotImplementedError) as err:
            raise _no_second_derivative(err, self.fmodel.structure) from err

    def _matmat_double_backward(self, M: Tensor) -> Tensor:
        Mt = M.T.contiguous()  # (k, d): every column's parameter pieces are contiguous views
        rows = torch.zeros_like(Mt)
        pieces = list(zip(self.layout.offsets, self.layout.numels, self.layout.shapes))
        for i, (X, y) in enumerate(self.batches):
            leaves, g = self._batch_gradient(i, X, y)
            live = [j for j, t in enumerate(g) if t.requires_grad]  # entries depending on theta
            if not live:
                continue  # the loss is linear in theta on this batch: zero Hessian
            for c in range(M.shape[1]):
                v = [Mt[c, o:o + n].view(shape) for o, n, shape in pieces]
                hv = torch.autograd.grad([g[j] for j in live], leaves, [v[j] for j in live],
                                         retain_graph=True, allow_unused=True, materialize_grads=True)
                for (o, n, _), t in zip(pieces, hv):
                    rows[c, o:o + n] += t.reshape(-1)
        return rows.T

    def _matmat_forward_over_reverse(self, M: Tensor) -> Tensor:
        V = cols_to_params(self.layout, M)
        out = torch.zeros_like(M)
        for X, y in self.batches:
            g = grad(lambda p, X=X, y=y: self._batch_loss(p, X, y))

            def hvp(v: Params, g: Callable[[Params], Params] = g) -> Params:
                return jvp(g, (self.params,), (v,))[1]

            out += params_to_cols(self._map(hvp, (V,), M.shape[1]))
        return out

    def trace(
        self,
        method: TraceMethod = "exact",
        num_probes: int = 100,
        generator: torch.Generator | None = None,
        distribution: Literal["rademacher", "gaussian"] = "rademacher",
        piecewise_linear: bool | Literal["auto"] = "auto",
    ) -> Tensor:
        """Trace of H: ``exact`` (sum of the exact diagonal, d products) or ``hutchinson``/``hutch++``.

        ``piecewise_linear``: for networks that are piecewise linear in every layer's parameters (only
        Linear/Conv layers, each used once, and piecewise-linear parameter-free modules such as ReLU or
        max-pooling, see :func:`piecewise_linear_reason`), the diagonal blocks of H and of the GGN G
        coincide (thesis Lemma 3.23), hence tr(H) = tr(G) EXACTLY. With ``True`` the trace is then taken
        of G instead: ``exact`` from G's cheap exact diagonal, ``hutchinson`` from G's quadratic forms
        z^T G z = w sum_n ||S_n^T J_n z||^2 (one Jacobian-vector product per probe, no backward pass).
        The Hutchinson estimate stays unbiased for tr(H) (E[z^T G z] = tr(G) = tr(H)) but its variance is
        that of z^T G z, not z^T H z (the off-diagonal blocks differ). ``True`` raises a ValueError if the
        model cannot be verified to be piecewise linear; ``"auto"`` (default) uses G when verified and
        Hessian-vector products otherwise; ``False`` always uses Hessian-vector products (z^T H z per probe,
        e.g. to reproduce another library's per-probe values).
        """
        self.fmodel.check_unchanged()
        if piecewise_linear not in (True, False, "auto"):
            raise ValueError(f"piecewise_linear must be True, False or 'auto', got {piecewise_linear!r}")
        if piecewise_linear:
            reason = _piecewise_linear_reason(self.fmodel.structure)
            if reason is None:
                ggn_op: GGNOperator = self._sibling(GGNOperator)
                return ggn_op.trace(method, num_probes=num_probes, generator=generator,
                                    distribution=distribution)
            if piecewise_linear is True:
                raise ValueError(f"piecewise_linear=True, but the model is not verifiably piecewise linear in "
                                 f"its parameters: {reason}; pass piecewise_linear='auto' (falls back to "
                                 "Hessian-vector products) or False")
        return super().trace(method, num_probes=num_probes, generator=generator, distribution=distribution)

    @differentiable()
    def diagonal(self, method: Literal["exact", "hutchinson"] = "exact", num_probes: int = 100,
                 generator: torch.Generator | None = None, max_dim: int | None = 20_000) -> DiagonalOperator:
        """The diagonal: ``exact`` by d unit-vector Hessian-vector products (chunks of ``chunk_size``
        columns), or the ``hutchinson`` estimate from ``num_probes`` products.

        Exact cost: d HVPs, i.e. about d gradient passes over all the data; only for small models. Raises
        a ValueError if d > ``max_dim`` (pass ``max_dim=None`` to force it). For large models use
        ``trace(method='hutchinson')`` for the trace, or the GGN's exact diagonal, which needs only
        R batched backward passes per batch (and equals the Hessian's diagonal for piecewise-linear
        networks, whose diagonal blocks coincide with the GGN's, thesis Lemma 3.23).
        """
        self.fmodel.check_unchanged()
        if method != "exact":
            return super().diagonal(method, num_probes, generator)
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
    """C = w sum_n sum_p J_np^T M_np J_np with a PSD output-space matrix M_np = S_np S_np^T per position.

    n runs over the samples, p over the positions of an output (B, *P, C) (a single position for (B, C));
    J_np = df_np/dtheta (C, d). Subclasses define M through three hooks, all zero at padded positions:

    * ``output_matvec(i, f, y, V)`` - M V per position for V (k, B, *P, C), in O(C R) or better and never
      forming a (C, C) matrix (products, quadratic forms, Hutchinson traces);
    * ``output_sqrt_rank(i, f, y)`` - R, and ``output_sqrt_columns(i, f, y, cols)`` - the columns ``cols``
      of S (B, *P, C, r) (the exact diagonal and the dense matrix take S in chunks of columns).

    A product C v = w sum J^T M (J v) is a tangent pass J v, M in output space and one backward pass through
    the graph of a forward pass at the snapshot (cached, or a fresh one per product). The tangent pass:

    * plain ``nn.Sequential`` of Linear/Conv layers and parameter-free modules
      (:func:`curvkit.curvature._tangent.sequential_layers`): from the activations recorded in that forward
      pass, by tangent propagation alone (:class:`curvkit.curvature._tangent.SequentialTangent`);
    * any other model: one forward-mode pass (dual numbers for one column, ``jvp`` vmapped over several; the
      primal is recomputed alongside but no graph is recorded, and the batch is taken in up to four pieces,
      so its memory is transient and small). Every product costs the same, the first as well as the
      hundredth: no ``torch.func.linearize`` tracing;
    * with ``reverse_tangents=True`` (or where a module has no forward-mode derivative: then once, with a
      warning): reverse-over-reverse on the forward graph, J v = d/du [(J^T u)^T v], through the graph of
      J^T u, built once per cached batch at about the cost of one backward pass. Steady-state products are
      then about 10-20 % cheaper (no primal recomputation), at the price of holding that graph too: about two
      to three times the memory of one gradient pass for the operator's lifetime.

    Linearisation caching (``cache_linearisation``): ``True`` keeps, for the operator's lifetime, each
    batch's autograd graph (and recorded activations) from the construction-time (validating) forward pass,
    so a product costs a tangent pass + a backward pass, and a quadratic form a tangent pass, with no further
    forward pass. Memory trade-off: the batch's activations (what one gradient pass holds, O(B * width), never
    O(d^2)) are held as long as the operator lives. ``None`` (default) caches for single-batch ``data`` only;
    ``False`` never caches (every product then repeats the forward pass). The parameters are snapshotted in
    any case, so the cache never goes stale; a cached graph freezes the module's train/eval mode as it was at
    construction.
    """

    _layer_specs: list[LayerSpec] | None = None  # resolved on the first diagonal() call
    _use_forward_mode = True  # tangents of non-Sequential models by forward mode (falls back once on error)
    _split_tangents = True  # the forward-mode pass in pieces of the batch (off once a model mixes samples)
    _no_double_backward = False  # the compiler-free first route (double backward) failed once: forward mode
    reverse_tangents = False

    def __init__(self, model: nn.Module, likelihood: Likelihood, data: Any, chunk_size: int = 64,
                 cache_linearisation: bool | None = None, reverse_tangents: bool = False, snapshot: bool = True,
                 compute_dtype: torch.dtype | None = None, statistics_dtype: torch.dtype | None = None):
        if cache_linearisation not in (None, True, False):
            raise ValueError(f"cache_linearisation must be None (auto), True or False, got {cache_linearisation!r}")
        if reverse_tangents not in (True, False):
            raise ValueError(f"reverse_tangents must be True or False, got {reverse_tangents!r}")
        self.cache_linearisation = cache_linearisation
        self.reverse_tangents = bool(reverse_tangents)
        super().__init__(model, likelihood, data, chunk_size=chunk_size, snapshot=snapshot,
                         compute_dtype=compute_dtype, statistics_dtype=statistics_dtype)

    # ------------------------------------------------------------------ output space (subclasses)
    def output_matvec(self, batch_index: int, f: Tensor, y: Tensor, V: Tensor) -> Tensor:
        """M V per position for V (*K, B, *P, C) and batch ``batch_index``'s outputs f (B, *P, C)."""
        raise NotImplementedError

    def output_sqrt_rank(self, batch_index: int, f: Tensor, y: Tensor) -> int:
        """R, the number of columns of the factor S (S S^T = M)."""
        raise NotImplementedError

    def output_sqrt_columns(self, batch_index: int, f: Tensor, y: Tensor, cols: slice) -> Tensor:
        """(B, *P, C, r) the columns ``cols`` of S."""
        raise NotImplementedError

    def output_factor(self, batch_index: int, f: Tensor, y: Tensor) -> Tensor:
        """(B, *P, C, R) the whole factor S (holds C x R numbers per position: for small C)."""
        return self.output_sqrt_columns(batch_index, f, y, slice(None))

    # ------------------------------------------------------------------ forward passes and caches
    @property
    def caches_linearisation(self) -> bool:
        """Whether each batch's forward graph is kept between products (see the class doc)."""
        flag = self.__dict__.get("cache_linearisation")
        return bool(flag) if flag is not None else len(self.batches) == 1

    def _sequential_layers(self) -> list[nn.Module] | None:
        """The recorded-tangent route's layers (plain Sequential models), else None (decided once)."""
        if "_seq_layers" not in self.__dict__:
            self._seq_layers = tangent_chain(self.fmodel.structure)[0]
        return self._seq_layers

    def _lin_cache(self) -> dict[int, dict[str, Any]]:
        return self.__dict__.setdefault("_lin", {})  # type: ignore[no-any-return]

    def _construction_output(self, batch_index: int, X: Inputs, y: Tensor) -> Tensor:
        if not self.caches_linearisation:
            return super()._construction_output(batch_index, X, y)
        entry = self._forward(X, graph=True)
        check_output(entry["f"], self.likelihood, X, y, batch_index)
        self._lin_cache()[batch_index] = entry
        return entry["f"].detach()  # type: ignore[no-any-return]

    def _construction_graph(self) -> tuple[Params, Tensor] | None:
        entry = self.__dict__.get("_lin", {}).get(0)
        return None if entry is None else (entry["leaves"], entry["f"])

    def _forward(self, X: Inputs, graph: bool) -> dict[str, Any]:
        """One forward pass at the snapshot: {"leaves", "f", "tangent"}.

        ``graph``: record the autograd graph of f w.r.t. fresh leaves (for J^T u by one backward pass).
        ``tangent``: a :class:`curvkit.curvature._tangent.SequentialTangent` holding the pass's
        activations (J v without recomputing the primal) for plain ``nn.Sequential`` models, else None.
        """
        leaves = self._leaves() if graph else self.params
        layers = self._sequential_layers()
        tangent = None if layers is None else SequentialTangent(
            layers, {n: j for j, n in enumerate(self.layout.names)}, self.fmodel.structure)
        with torch.set_grad_enabled(graph):
            if tangent is None:
                f = self.fmodel(leaves, X)
            else:
                try:
                    f = tangent.record(lambda: self.fmodel(leaves, X))
                except RuntimeError:
                    self._seq_layers, tangent = None, None
                    f = self.fmodel(leaves, X)
        return {"leaves": leaves, "f": f, "tangent": tangent}

    def _cached(self, i: int, X: Inputs) -> dict[str, Any]:
        """Batch i's cache (leaves, output f with its graph, tangent), built on first use for a sibling."""
        c = self._lin_cache().get(i)
        if c is None:  # e.g. a sibling operator sharing an already validated snapshot
            c = self._lin_cache()[i] = self._forward(X, graph=True)
        return c

    def _entry(self, i: int, X: Inputs, graph: bool) -> dict[str, Any]:
        """Batch i's forward pass: the cache, or a fresh pass (with its graph if ``graph``)."""
        return self._cached(i, X) if self.caches_linearisation else self._forward(X, graph=graph)

    # ------------------------------------------------------------------ tangents J v
    def _tangents(self, X: Inputs, entry: dict[str, Any], V: Params, k: int) -> Tensor:
        """J v for every column (k, B, *P, C) at the forward pass ``entry`` (class doc for the routes)."""
        if entry["tangent"] is not None:
            return entry["tangent"](V)  # type: ignore[no-any-return]
        if self.reverse_tangents and entry["f"].requires_grad:
            try:
                return self._reverse_tangents(entry, V, k)
            except (RuntimeError, NotImplementedError) as err:
                self.reverse_tangents = False
                entry.pop("JTu", None)
                warnings.warn(f"{type(self).__name__}: double backward failed ({err}); falling back to "
                              "forward-mode Jacobian-vector products", RuntimeWarning, stacklevel=4)
        if (self._use_forward_mode and "torch._dynamo" not in sys.modules and entry["f"].requires_grad
                and not self._no_double_backward):
            # torch's forward-mode rules of elementwise products run Python decompositions whose first use
            # imports the compiler stack (torch._dynamo, about a second in a fresh process); until something
            # else has imported it, the double-backward route (the same J v, no import) is taken, its graph
            # of J^T u dropped after the product (transient memory, as forward mode's)
            try:
                return self._reverse_tangents(entry, V, k)
            except (RuntimeError, NotImplementedError):  # a module without double backward: forward mode
                self._no_double_backward = True
            finally:
                entry.pop("JTu", None)
        if self._use_forward_mode:
            try:
                return self._forward_mode(X, V, k, full=entry["f"].detach())[1]
            except (RuntimeError, NotImplementedError) as err:
                self._use_forward_mode = False
                warnings.warn(f"{type(self).__name__}: forward-mode AD failed ({err}); falling back to "
                              "reverse-over-reverse Jacobian-vector products", RuntimeWarning, stacklevel=4)
        if not entry["f"].requires_grad:
            entry = self._forward(X, graph=True)
        return self._reverse_tangents(entry, V, k)

    def _forward_mode(self, X: Inputs, V: Params, k: int, full: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(f, J v (k, B, *P, C)) by forward mode, no graph recorded: dual numbers for one column (with the
        closed-form rules of :mod:`curvkit.curvature._dual_rules` for linear maps, layer norms and attention:
        0.89-0.95x the steady product's time on the transformers of ``benchmarks/modern_products.py``), ``jvp``
        vmapped over several (the primal computed once per block).

        The pass holds primal, tangent and their temporaries of a layer at once (about three times a no-grad
        forward pass), so given the batch's full output ``full`` it runs over the batch in up to
        ``_TANGENT_PIECES`` pieces of at least ``_TANGENT_PIECE_MIN`` samples (each sample's tangent depends
        only on its own input), and keeps the split
        only if the pieces' outputs equal ``full``: a model that mixes the samples of a batch (undetected by
        the structure reader) is then evaluated whole, from then on.
        """
        pieces = min(num_samples(X) // _TANGENT_PIECE_MIN, _TANGENT_PIECES)
        if full is not None and pieces > 1 and self._split_tangents and not self.fmodel.batch_coupled:
            parts = [self._forward_mode_pass(Xs, V, k) for Xs in split_samples(X, pieces)]
            f = torch.cat([part[0] for part in parts])
            tol = torch.finfo(f.dtype).eps ** 0.5 * (1 + float(full.abs().max()))
            if f.shape == full.shape and float((f - full).abs().max()) <= tol:
                return f, torch.cat([part[1] for part in parts], dim=1)
            self._split_tangents = False
        return self._forward_mode_pass(X, V, k)

    def _forward_mode_pass(self, X: Inputs, V: Params, k: int) -> tuple[Tensor, Tensor]:
        def fn(p: Params) -> Tensor:
            return self.fmodel(p, X)

        if k == 1:  # closed-form rules for linear maps, layer norm and attention (curvature._dual_rules)
            with torch.no_grad(), fwAD.dual_level(), dual_rules():
                f, Jv = fwAD.unpack_dual(fn(tuple(fwAD.make_dual(p, v[0]) for p, v in zip(self.params, V))))
            return f, (torch.zeros_like(f) if Jv is None else Jv)[None]
        fs, Jv = self._map(lambda v: jvp(fn, (self.params,), (v,)), (V,), k)
        return fs[0], Jv

    def _reverse_tangents(self, entry: dict[str, Any], V: Params, k: int) -> Tensor:
        """J v = d/du [(J^T u)^T v] through the graph of g(u) = J^T u (built once per forward pass, with
        u = 0: g is linear in u, so its derivative does not depend on where it is taken)."""
        f = entry["f"]
        if "JTu" not in entry:
            u = torch.zeros_like(f, requires_grad=True)
            with torch.enable_grad():
                g = vector_grad(f, entry["leaves"], u, create_graph=True, retain_graph=True,
                                allow_unused=True, materialize_grads=True)
            live = [j for j, t in enumerate(g) if t.requires_grad]
            entry["JTu"] = (u, [g[j] for j in live], live)
        u, g, live = entry["JTu"]
        if not live:
            return torch.zeros(k, *f.shape, dtype=f.dtype, device=f.device)
        if k == 1:
            out = vector_grad(g, u, [V[j][0] for j in live], retain_graph=True, allow_unused=True,
                              materialize_grads=True)[0]
            return out[None]
        return torch.autograd.grad(g, u, [V[j] for j in live], retain_graph=True, allow_unused=True,
                                   materialize_grads=True, is_grads_batched=True)[0]

    # ------------------------------------------------------------------ products
    def _backward_product(self, i: int, y: Tensor, entry: dict[str, Any], Jv: Tensor, out: Tensor,
                          first: bool = False) -> None:
        """Add the (d, k) columns w J^T M (J v) to ``out`` from the tangents Jv (k, B, *P, C) and the graph of
        the forward pass ``entry`` (each parameter's gradient is written into its rows: no concatenated
        copy). ``first``: ``out`` is uninitialised and gets the columns written instead (no zero fill and
        no extra read of a parameter-sized matrix)."""
        f, k = entry["f"], out.shape[1]
        if not f.requires_grad:
            if first:
                out.zero_()
            return
        U = self.output_matvec(i, f.detach(), y, Jv)
        del Jv  # (the caller holds no other reference: freed before the backward pass)
        U.mul_(self.weight)
        if k == 1:
            grads = vector_grad(f, entry["leaves"], U[0], retain_graph=True, allow_unused=True,
                                materialize_grads=True)
        else:
            grads = torch.autograd.grad(f, entry["leaves"], U, retain_graph=True, allow_unused=True,
                                        materialize_grads=True, is_grads_batched=True)
        for o, n, g in zip(self.layout.offsets, self.layout.numels, grads):
            # one column: write the flat 1-D view (a (n, 1) copy from a (1, n) transpose takes torch's
            # general strided kernel, 25x slower: 0.3 s for GPT-2's 38.6 M-entry head, most of a product)
            dst, src = (out[o:o + n, 0], g.reshape(n)) if k == 1 else (out[o:o + n], g.reshape(k, n).T)
            if first:
                dst.copy_(src)
            else:
                dst.add_(src)

    def _matmat_chunk(self, M: Tensor) -> Tensor:
        """C M for a (d, k) block: J (tangent), M in output space, J^T (backward), per batch (class doc)."""
        k = M.shape[1]
        V = cols_to_params(self.layout, M)
        out = torch.empty_like(M)
        for i, (X, y) in enumerate(self.batches):
            entry = self._entry(i, X, graph=True)
            self._backward_product(i, y, entry, self._tangents(X, entry, V, k), out, first=i == 0)
        return out

    @differentiable()
    def quadratic_form(self, M: Tensor) -> Tensor:
        """v^T C v for every column v of M (d, k) (or a flat (d,) vector): shape (k,) (or 0-d).

        v^T C v = w sum_np (J_np v)^T M_np (J_np v) needs only the Jacobian-vector products (a tangent
        pass; no backward pass), about half the cost of a product. Used by ``trace(method='hutchinson')``.
        """
        self.fmodel.check_unchanged()
        if M.dim() == 1:
            return self.quadratic_form(M[:, None])[0]
        M = ordinary(M.to(device=self.device, dtype=self.dtype))
        if M.dim() != 2 or M.shape[0] != self.layout.dim:
            raise ValueError(f"quadratic_form needs a ({self.layout.dim}, k) matrix or a flat vector of length "
                             f"{self.layout.dim}, got shape {tuple(M.shape)}")
        return torch.cat([self._quadratic_form_chunk(M[:, s:s + self.chunk_size])
                          for s in range(0, M.shape[1], self.chunk_size)])

    def _quadratic_form_chunk(self, M: Tensor) -> Tensor:
        k = M.shape[1]
        V = cols_to_params(self.layout, M)
        out = torch.zeros(k, dtype=self.dtype, device=self.device)
        for i, (X, y) in enumerate(self.batches):
            if self.caches_linearisation or self._sequential_layers() is not None or not self._use_forward_mode:
                entry = self._entry(i, X, graph=not self._use_forward_mode)
                f, Jv = entry["f"], self._tangents(X, entry, V, k)
            else:  # uncached, forward mode: the primal comes with the tangents
                try:
                    f, Jv = self._forward_mode(X, V, k)
                except (RuntimeError, NotImplementedError):
                    entry = self._entry(i, X, graph=True)
                    f, Jv = entry["f"], self._tangents(X, entry, V, k)  # falls back (with its warning)
            MJv = self.output_matvec(i, f.detach(), y, Jv)
            out += (Jv * MJv).reshape(k, -1).sum(1) * self.weight
        return out

    # ------------------------------------------------------------------ exact diagonal and dense matrix
    def _sqrt_chunks(self, i: int, f: Tensor, y: Tensor) -> Iterator[Tensor]:
        """Batch i's factor S (B, *P, C, R) in chunks of columns (B, *P, C, r) of at most ~2^24 numbers; for
        C <= ``SMALL_C`` in one piece with the directions null at every position dropped (``reduced_factor``)."""
        C = f.shape[-1]
        if C <= SMALL_C:
            S = self.output_factor(i, f, y)
            red = reduced_factor(S.reshape(-1, C, S.shape[-1]))
            if red.shape[-1]:  # none left when every position is padding
                yield red.reshape(*S.shape[:-1], red.shape[-1])
            return
        R = self.output_sqrt_rank(i, f, y)
        step = max(1, _ROW_BUDGET // f.numel())
        for s in range(0, R, step):
            yield self.output_sqrt_columns(i, f, y, slice(s, s + step))

    def _factor_rows(self) -> Iterator[Tensor]:
        """Yield chunks (m, d) of the rows J_np^T s_npr (all n, p, r) of the factor V with C = w V^T V."""
        d = self.layout.dim
        for i, (X, y) in enumerate(self.batches):
            with torch.no_grad():
                f = self.fmodel(self.params, X)
            for S in self._sqrt_chunks(i, f, y):
                rows = math.prod(S.shape[1:-2]) * S.shape[-1]  # per sample: positions x columns
                n = max(1, _ROW_BUDGET // (rows * max(d, math.prod(S.shape[1:-1]))))
                for s in range(0, num_samples(X), n):
                    Xs, Ss = take_samples(X, slice(s, s + n)), S[s:s + n]
                    yield self._map(self._sample_rows, (Xs, Ss), Ss.shape[0]).reshape(-1, d)

    def _sample_rows(self, x: Inputs, s: Tensor) -> Tensor:
        """(T r, d) rows J_p^T s_pr for one sample x (no batch dim) and its factor s (*P, C, r), T = prod(P):
        one backward pass per (position, column), the cotangent s_pr placed at position p."""
        vjp_fn = vjp(lambda p: self.fmodel.single(p, x), self.params)[1]
        return params_to_rows(vmap(lambda u: vjp_fn(u)[0])(_position_cotangents(s)), 1)

    @differentiable()
    def _exact_diagonal(self) -> DiagonalOperator:
        """Exact diagonal w sum_np sum_r (J_np^T s_npr)^2: one backward pass per column r of S and position p
        (R = C for softmax: C per sample, so for large C prefer ``diagonal('hutchinson')`` or a Monte Carlo
        operator).

        If every trainable parameter belongs to an ``nn.Linear`` / ``nn.Conv2d`` layer (none shared) and the
        outputs are (B, C), R batched backward passes per batch to the layer outputs suffice
        (:mod:`curvkit.curvature._layerwise`); otherwise N * T * R per-sample gradients are formed with
        vmapped vjps (chunks of ~2^24 scalars). A model that couples samples (BatchNorm in training mode) has
        no per-sample rows: d unit-vector products.
        """
        self.fmodel.check_unchanged()
        if self.fmodel.batch_coupled:
            return super()._exact_diagonal()
        if self._layer_specs is None:
            self._layer_specs = layer_specs(self.fmodel) or []
        if self._layer_specs:
            try:
                return self._diagonal_layerwise(self._layer_specs)
            except Unsupported:
                self._layer_specs = []
        return self._diagonal_per_sample()

    def _diagonal_per_sample(self) -> DiagonalOperator:
        diag = torch.zeros(self.layout.dim, dtype=self.statistics_dtype, device=self.device)
        for rows in self._factor_rows():
            diag += (rows.to(self.statistics_dtype)**2).sum(0)
        return DiagonalOperator.from_flat(self.layout, diag * self.weight)

    def _diagonal_layerwise(self, specs: list[LayerSpec]) -> DiagonalOperator:
        acc = {n: torch.zeros(s, dtype=self.statistics_dtype, device=self.device)
               for n, s in zip(self.layout.names, self.layout.shapes)}

        def add(values: dict[str, Tensor]) -> None:
            for name, val in values.items():
                acc[name] += val.to(self.statistics_dtype)

        for i, (X, y) in enumerate(self.batches):
            recorded = self._recorded_layers(i, specs)
            if recorded is not None:  # reuse the cached forward pass: batched backwards to the layer outputs
                c = self._cached(i, X)
                if c["f"].dim() != 2:
                    raise Unsupported("outputs with positions")
                for S in self._sqrt_chunks(i, c["f"].detach(), y):
                    add(squared_gradients(specs, recorded[0], c["f"], recorded[1], S, retain_graph=True))
                continue

            def chunks(f: Tensor, i: int = i, y: Tensor = y) -> Iterator[Tensor]:  # S from the hooked forward
                return self._sqrt_chunks(i, f, y)

            add(layerwise_diagonal(self.fmodel, specs, X, chunks))
        return DiagonalOperator(self.layout, [acc[n] * self.weight for n in self.layout.names])

    def _recorded_layers(self, i: int, specs: list[LayerSpec]) -> tuple[list[Tensor], list[Tensor]] | None:
        """(inputs, outputs on the graph) of every layer in ``specs`` from batch i's cached forward pass, or
        None when there is no such cache (uncached operator, not a plain Sequential, no graph)."""
        c = self._lin_cache().get(i) if self.caches_linearisation else None
        tangent = None if c is None else c.get("tangent")
        if tangent is None:
            return None
        ios = [tangent.layer_io(spec.module) for spec in specs]
        if any(io is None or io[1] is None or not spec.handler.squares(spec.module, io[0])
               for io, spec in zip(ios, specs)):
            return None
        return [io[0] for io in ios], [io[1] for io in ios]  # type: ignore[index,misc]

    @differentiable()
    def to_dense(self) -> Tensor:
        """Exact (d, d) matrix w V^T V from the per-sample factor rows (O(d^2) memory; one backward pass per
        sample, position and column of S); d products for a model that couples samples."""
        self.fmodel.check_unchanged()
        if self.fmodel.batch_coupled:
            return super().to_dense()
        d = self.layout.dim
        out = torch.zeros(d, d, dtype=self.statistics_dtype, device=self.device)
        for rows in self._factor_rows():
            rows = rows.to(self.statistics_dtype)
            out += rows.T @ rows
        return out * self.weight


def _no_second_derivative(err: Exception, structure: Any) -> Exception:
    """The error of a Hessian product that PyTorch cannot form: ``err`` when it is not about a missing second
    derivative, else a NotImplementedError naming the operation, the modules that run it (matched by class
    name: ``aten::hardsigmoid_backward`` -> ``nn.Hardsigmoid``) and the alternatives."""
    found = re.search(r"aten::(\w+?)(?:_backward)?\b", str(err))
    if found is None or ("derivative" not in str(err) and "forward AD" not in str(err)):
        return err
    op = found.group(1)
    users = [f"{structure.label(m)!r} ({type(m).__name__})" for _, m in structure.modules
             if type(m).__name__.lower() == op.replace("_", "")]
    where = f"module {', '.join(users)}" if users else "an operation of the forward pass"
    hint = {"hardsigmoid": " (nn.Hardsigmoid is F.relu6(x + 3) / 6, nn.Hardswish x * F.relu6(x + 3) / 6: the "
                           "same functions, with every derivative)"}.get(op, "")
    return NotImplementedError(
        f"HessianOperator: {where} runs aten::{op}, whose second derivative PyTorch does not implement (neither "
        "double backward nor forward-over-reverse), so Hessian-vector products cannot be formed; use the GGN "
        "(GGNOperator, its diagonal, KFAC), which needs first derivatives only, or write that operation with "
        f"differentiable primitives{hint}")


def _position_cotangents(s: Tensor) -> Tensor:
    """(T r, *P, C) cotangents of one sample's output for its factor s (*P, C, r): for position p and column
    j, s[p, :, j] at position p and zero elsewhere ((r, C) = s^T without positions)."""
    P, (C, r) = s.shape[:-2], s.shape[-2:]
    if not P:
        return s.T
    T = math.prod(P)
    cols = s.reshape(T, C, r).transpose(1, 2)  # (T, r, C)
    eye = torch.eye(T, dtype=s.dtype, device=s.device)
    return (eye[:, None, :, None] * cols[:, :, None, :]).reshape(T * r, *P, C)


class GGNOperator(OutputFactorOperator):
    """Generalised Gauss-Newton G = w sum_n sum_p J_np^T H_L^np J_np (thesis Def. 3.19; G_L = H_L, Lemma 3.20).

    Products apply H_L by ``likelihood.output_hessian_matvec`` (softmax: p * v - p (p^T v), O(C));
    the exact diagonal / dense matrix take the columns of S (S S^T = H_L; for softmax
    diag(sqrt p) - p sqrt(p)^T) in chunks from ``likelihood.output_hessian_sqrt_columns``.
    Positive semi-definite; rank <= N * T * rank(H_L) (thesis Sec. 3.6).
    """

    def output_matvec(self, batch_index: int, f: Tensor, y: Tensor, V: Tensor) -> Tensor:
        return self.likelihood.output_hessian_matvec(f, V, y)

    def output_sqrt_rank(self, batch_index: int, f: Tensor, y: Tensor) -> int:
        return self.likelihood.sqrt_rank(f)

    def output_sqrt_columns(self, batch_index: int, f: Tensor, y: Tensor, cols: slice) -> Tensor:
        return self.likelihood.output_hessian_sqrt_columns(f, cols, y)


class FisherOperator(OutputFactorOperator):
    """Type-2 Fisher F = w sum_n sum_p J_np^T F_L^np J_np, exact expectation over model labels (Eq. 3.36).

    F_L = E_{y~p(y|f_np)}[g g^T] is applied from its definition
    (:func:`curvkit.curvature.output_space.output_fisher_matvec`, O(C) per position; the columns of its
    factor from :func:`~curvkit.curvature.output_space.output_fisher_sqrt_columns`); it equals H_L for
    softmax CE, sigmoid BCE and the fixed-variance Gaussian (Eqs. 3.37-3.38), so F equals the GGN for
    these heads. The data labels y are used only for their padding (padded positions have no curvature).
    """

    def _setup(self, outputs: list[Tensor]) -> None:
        output_fisher_rank(self.likelihood, outputs[0][:1])  # fail early for a head without a closed form

    def _keep(self, y: Tensor) -> Tensor | None:
        return self.likelihood.mask(y)

    def output_matvec(self, batch_index: int, f: Tensor, y: Tensor, V: Tensor) -> Tensor:
        out = output_fisher_matvec(self.likelihood, f, V)
        keep = self._keep(y)
        return out if keep is None else out * keep[..., None].to(out.dtype)

    def output_sqrt_rank(self, batch_index: int, f: Tensor, y: Tensor) -> int:
        return output_fisher_rank(self.likelihood, f)

    def output_sqrt_columns(self, batch_index: int, f: Tensor, y: Tensor, cols: slice) -> Tensor:
        out = output_fisher_sqrt_columns(self.likelihood, f, cols)
        keep = self._keep(y)
        return out if keep is None else out * keep[..., None, None].to(out.dtype)


class _SmallFactorOperator(OutputFactorOperator):
    """An output-space factor S with few columns R, given whole by ``output_factor`` (B, *P, C, R):
    M V = S (S^T V) costs O(C R) per position."""

    def output_factor(self, batch_index: int, f: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError

    def output_matvec(self, batch_index: int, f: Tensor, y: Tensor, V: Tensor) -> Tensor:
        S = self.output_factor(batch_index, f, y)
        return (S * (S * V[..., None]).sum(-2, keepdim=True)).sum(-1)

    def output_sqrt_rank(self, batch_index: int, f: Tensor, y: Tensor) -> int:
        return int(self.output_factor(batch_index, f, y).shape[-1])

    def output_sqrt_columns(self, batch_index: int, f: Tensor, y: Tensor, cols: slice) -> Tensor:
        return self.output_factor(batch_index, f, y)[..., cols]


class MCFisherOperator(_SmallFactorOperator):
    """Monte Carlo type-2 Fisher with ``mc_samples`` = M model labels per data point and position.

    F_MC = w sum_n sum_p (1/M) sum_m J_np^T g_npm g_npm^T J_np, g_npm = dL(f_np, y_npm)/df_np,
    y_npm ~ p(y | f_np): one label per POSITION and sample m (padded positions keep their padding target, so
    they have no curvature). The labels are drawn ONCE at construction from
    ``torch.Generator(device).manual_seed(seed)``, batch by batch in data order (M draws per batch), so the
    operator is a fixed PSD matrix of rank <= N * T * M; E[F_MC] = F (the type-2 Fisher).
    S_np columns = g_npm / sqrt(M).
    """

    def __init__(self, model: nn.Module, likelihood: Likelihood, data: Any, mc_samples: int = 1,
                 seed: int = 0, chunk_size: int = 64, cache_linearisation: bool | None = None,
                 reverse_tangents: bool = False, snapshot: bool = True, compute_dtype: torch.dtype | None = None,
                 statistics_dtype: torch.dtype | None = None):
        if int(mc_samples) < 1:
            raise ValueError(f"mc_samples must be a positive integer, got {mc_samples}")
        self.mc_samples = int(mc_samples)
        self.seed = int(seed)
        self.labels: list[list[Tensor]] = []
        super().__init__(model, likelihood, data, chunk_size=chunk_size, cache_linearisation=cache_linearisation,
                         reverse_tangents=reverse_tangents, snapshot=snapshot, compute_dtype=compute_dtype,
                         statistics_dtype=statistics_dtype)

    def _setup(self, outputs: list[Tensor]) -> None:
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        self.labels = [[self.likelihood.sample(f, generator=gen, y=y) for _ in range(self.mc_samples)]
                       for f, (_, y) in zip(outputs, self.batches)]

    def output_factor(self, batch_index: int, f: Tensor, y: Tensor) -> Tensor:
        grads = [self.likelihood.output_grad(f, ym) for ym in self.labels[batch_index]]
        return torch.stack(grads, dim=-1) / math.sqrt(self.mc_samples)


class EmpiricalFisherOperator(_SmallFactorOperator):
    """Empirical Fisher w sum_n sum_p g_np g_np^T (in parameter space, g_np = J_np^T dL^np/df_np) at the DATA
    labels (S_np = dL^np/df_np, R = 1).

    For outputs with positions the outer products are those of each POSITION's loss gradient, not of each
    sequence's total gradient (sum_p g_np)(sum_p g_np)^T: curvlinops' ``EFLinearOperator`` convention (it
    flattens the positions into the batch), and the curvature that KFAC's empirical Fisher factorises.
    Not the thesis's Fisher (which samples labels from the model, Eq. 3.35): it differs from
    the GGN in general and is provided for comparison only. Rank <= N * T.
    """

    def output_factor(self, batch_index: int, f: Tensor, y: Tensor) -> Tensor:
        return self.likelihood.output_grad(f, y)[..., None]


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


def piecewise_linear_reason(model: nn.Module) -> str | None:
    """None if ``model`` is VERIFIABLY piecewise linear in each layer's parameters, else the reason why not
    (:func:`curvkit.curvature._tangent.piecewise_linear_reason`: a plain ``nn.Sequential`` of layers linear
    in their input and parameters separately (Linear, convolutions: the layer kinds' ``bilinear`` capability) and
    piecewise-linear parameter-free modules, each used once, no tied weights).
    Then the loss Hessian's diagonal blocks equal the GGN's (thesis Lemma 3.23)."""
    if not isinstance(model, nn.Module):
        return f"{type(model).__name__} is not an nn.Module"
    return _piecewise_linear_reason(read_model(model))


def hessian_trace(model: nn.Module, likelihood: Likelihood, data: Any, method: TraceMethod = "hutchinson",
                  num_probes: int = 100, generator: torch.Generator | None = None,
                  distribution: Literal["rademacher", "gaussian"] = "rademacher",
                  piecewise_linear: bool | Literal["auto"] = "auto", **kwargs: Any) -> Tensor:
    """tr(H) of ``likelihood`` on ``data``: :meth:`HessianOperator.trace` (see there for ``piecewise_linear``)."""
    return HessianOperator(model, likelihood, data, **kwargs).trace(
        method, num_probes=num_probes, generator=generator, distribution=distribution,
        piecewise_linear=piecewise_linear)
