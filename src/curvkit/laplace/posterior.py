"""The Laplace posterior (thesis chapter 5, Sec. 5.1): one entry point, :class:`Laplace`, parametrised by
its structure and its curvature source.

    post = Laplace(model, CrossEntropy(), structure="kron", curvature="kflr", prior_precision=1e-2)
    post.fit(train_batches)                   # curvature summed over the data set, once
    post.num_data, post.prior_precision = 10 * post.num_data, 1.0   # no recomputation
    probs = post.predict(X_test, method="mc", num_samples=100)      # thesis Eq. 5.9

The posterior is ``N(theta*, P^{-1})`` over the parameters of ``subset`` (``'all'``, ``'last_layer'`` or
names), the others fixed at their fitted values, with theta* the model's parameters at :meth:`Laplace.fit`
and the precision

    P = N * C_bar + prior            (thesis Eq. 5.7: N times the per-datum curvature plus the prior)

built per layer by the ``structure``:

* ``'kron'`` (thesis Eqs. 5.12-5.14): every block of the Kronecker engine's layer kinds
  (:mod:`curvkit.layerkinds`: Linear with weight sharing, convolutions (one block per group), embeddings
  (``W^T`` with a diagonal input factor), packed attention (query, key, value row slices and the output
  projection), each read through its ``index``) gets the matrix-normal posterior
  ``W_hat ~ MN(W_hat*, (sqrt(N) G + sqrt(lam) I)^{-1}, (sqrt(N) A + sqrt(lam) I)^{-1})`` in PyTorch's
  output-first layout (``prior_form='factored'``, omega = 1 as Eq. 5.14; ``trace_balance=True`` splits
  ``sqrt(lam)`` by the trace-norm ratio of Eq. 4.27 instead); ``prior_form='exact'`` uses
  ``N G (x) A + lam I`` exactly through the factors' eigendecompositions. Normalisation layers (LayerNorm,
  GroupNorm, BatchNorm in eval mode) and raw parameters (a ViT's class token and position table) have
  blocks from per-sample gradients instead (``factored=False``), their exact or diagonal per-layer
  Laplace ``N F + lam I`` (``norm_structure``, ``parameter_structure``), as the thesis's "standard Laplace"
  for BatchNorm (Sec. 5.2.4). A layer the engine cannot take is an error naming it, raised when the
  posterior is built.
* ``'diag'`` (Eqs. 5.10-5.11): ``N diag(F) + lam`` per parameter (any differentiable model).
* ``'full'``: ``N F + diag(lam)`` over all parameters of the subset (small nets or small subsets only).

Curvature sources (``curvature``): for ``kron`` ``'kflr'`` (exact output factor, default; the default is
``'kfac'`` when a block has more than :data:`curvkit.curvature.estimators.LOW_RANK_OUTPUTS` outputs, a language
model's vocabulary, whose sampled output factor is exactly low rank and kept thin: every posterior quantity then
works in its thin eigendecomposition, never an (out, out) matrix), ``'kfac'``
(``mc_samples`` labels sampled from the model per datum), ``'kfra'`` (MLP chains only), ``'projection'``,
``'empirical'``, with ``weight_sharing`` ``'expand'`` (default) or ``'reduce'`` for the positions that
share a weight (tokens, patches, convolution locations; docs/architecture.md); the per-sample-gradient
blocks use the same back-propagated vectors (KFLR's: the exact GGN block for (B, C) outputs). For ``diag``
and ``full`` ``'mc_fisher'`` (per-example gradients at ``mc_samples`` sampled labels: the Fisher identity of
Eq. 5.10 with one sample per point, the thesis's choice and the default), ``'ggn'`` (exact) or
``'empirical'``.

Outputs with positions (B, *P, C) (a per-token classifier, a language model; padding through the
likelihood's ``ignore_index``/``ignore_value``): the curvature is that of the summed log-likelihood of all
counted positions, N counts SAMPLES (sequences), and the predictives are per position (B, *P, C).

LoRA and other frozen bases: the posterior covers exactly the trainable parameters of the subset
(``requires_grad=False`` parameters are never covered, counted or given curvature).

Prior precision: a scalar, or one value per layer (a sequence in :attr:`Laplace.layer_names` order or a
dict by layer name). It is the precision of the Gaussian prior on the SUMMED log-likelihood (lambda of
Eq. 5.14, the ICLR paper's tau); ``N`` defaults to the number of data seen by :meth:`fit` (pass
``num_data`` there when the batches hold augmented copies of a smaller data set).

BatchNorm must be in eval mode (running statistics; thesis Sec. 5.2.4), Dropout too (``model.eval()``).

Data-parallel and sharded fits (``distributed=`` a :class:`~curvkit.distributed.Reducer`; issue 33). Each rank
passes :meth:`Laplace.fit` ITS shard of the data, as equally many batches (sizes may differ; a rank that runs out
first makes every rank raise). The fit is that of the union D = U_r D_r: the curvature sources all-reduce each
batch's sums with their sample and counted-term counts, as the estimators with ``distributed=`` do (Kronecker
factors as upper triangles; KFRA's batch means are the union's batch by batch; a diagonal's d-vector), the
``'full'`` structure's dense sum once at the end, and the count N and the log-likelihood of theta* once at the
end (two scalars). Sampled sources (``kfac``, ``projection``, ``mc_fisher``) draw their labels with each rank's
own seed (``Reducer.seed``), so they equal the data-parallel posterior, not a single process. The fit first
checks that every rank holds bitwise the same parameters and buffers (one SHA-256 digest per rank; a difference
raises :class:`~curvkit.distributed.ReplicaMismatch` on every rank). After the fit every
posterior quantity is WHOLE and identical on every rank, in the full layout of the covered parameters: the mean,
the statistics, :meth:`precision`, :meth:`covariance`, :meth:`log_marginal_likelihood` (and prior optimisation),
:meth:`sample` (same generator, same draws); predictions are local to the rank's inputs and need no collective
(:func:`~curvkit.laplace.grid_search` scores the union of the ranks' validation shards: two scalars per point).
Communication of a fit: one digest per rank (the replicas' check), per batch the statistics (the factors' upper
triangles, or the d-vector) and one count, at the end two scalars (plus, for ``'full'``, d(d+1)/2 numbers).
Memory: the statistics and the mean, whole on every rank (the Kronecker factors are not spread by layer
ownership). A block with a vocabulary-sized output (more than
:data:`~curvkit.curvature.estimators.LOW_RANK_OUTPUTS`) keeps its low-rank output factor: the ranks' rows are
gathered per batch (k_r x V values per rank), never a V x V matrix.

An FSDP2 model (``fully_shard``: DTensor parameters sharded on dim 0, FSDP2's default) is taken through
:class:`~curvkit.distributed.sharded.ShardedReplica`, the route of ``GaussNewton`` and ``sharded_operator``: the
module tree without FSDP2's hooks whose whole parameters are all-gathered at construction and at every
:meth:`Laplace.fit` (one all-gather, about |theta| values received per rank) and freed after them; :attr:`model`
is that replica, and the posterior runs on it as on a data-parallel replica, so every structure, curvature
source and layer kind works (raw parameters, KFRA, ``subset='last_layer'``). The user's model is never changed.
Memory per rank: one whole copy of the covered parameters (the posterior mean, as on one process) beside the
shards, and during a fit one whole copy of all parameters (the replica). Without ``distributed=`` a sharded model
is refused (each rank alone has neither the union's data nor the whole parameters).

Inputs: ``X`` is a tensor (B, ...) or a mapping of tensors sharing the batch dimension
(:data:`curvkit.validation.Inputs`: a Hugging Face batch ``{"input_ids": ..., "attention_mask": ...}``
through :class:`curvkit.hf.HuggingFace`), in :meth:`Laplace.fit`'s data and in the predictions alike; the
model is called as ``model(X)`` for the curvature, the Jacobians of the GLM predictive and the samples of
the MC predictive, so every entry (the attention mask) takes part in all of them. ``N`` counts samples.

Input checks: a covered parameter the output does not depend on is named in an
:class:`~curvkit.curvature._graph.UnusedParameterWarning` at :meth:`Laplace.fit`; ``num_data`` and prior
precisions are checked wherever they are passed (tensors that require grad included, their graph kept);
predictions check the inputs against the dtype and shape of those :meth:`Laplace.fit` saw (for a mapping:
the same keys, and per key the dtype and shape).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self

import torch
from torch import Tensor, nn

from curvkit import precision
from curvkit.curvature._graph import warn_unused
from curvkit.curvature.config import CurvatureConfig, NormStructure, WeightSharing
from curvkit.distributed.reducer import Reducer, ReplicaMismatch
from curvkit.distributed.sharded import ShardedReplica, is_sharded
from curvkit.laplace._blocks import DenseBlock, DiagonalBlock, KroneckerBlock, PosteriorBlock, factors_state
from curvkit.laplace._curvature import (
    ELEMENT_METHODS,
    KRON_METHODS,
    DenseSource,
    DiagonalSource,
    KroneckerSource,
)
from curvkit.laplace._subset import (
    last_layer_names,
    only_trainable,
    resolve_subset,
    subset_layers,
    traced_forward,
)
from curvkit.laplace.operators import BlockSumOperator
from curvkit.likelihoods import Likelihood
from curvkit.linalg.kron import KroneckerBlock as KFactors
from curvkit.linalg.kron import factor_from_state, index_from_state
from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import CurvatureOperator, _indices, sub_layout
from curvkit.structure import LayerInfo, curvature_kernels, differentiable, read_model, uncompiled
from curvkit.validation import (
    Inputs,
    input_tensors,
    integer,
    iter_batches,
    num_samples,
    positive,
    take_samples,
)

__all__ = ["Laplace", "log_likelihood"]

#: What :meth:`Laplace.fit` saw of the inputs: (dtype, shape without the batch dimension) of a tensor, or of
#: every tensor of a mapping by key.
InputSpec = tuple[torch.dtype, tuple[int, ...]] | dict[str, tuple[torch.dtype, tuple[int, ...]]]


def input_spec(X: Inputs) -> InputSpec:
    """The :data:`InputSpec` of a batch of inputs."""
    if isinstance(X, Tensor):
        return X.dtype, tuple(X.shape[1:])
    return {k: (v.dtype, tuple(v.shape[1:])) for k, v in X.items()}


def _spec_state(spec: InputSpec | None) -> Any:
    """The spec for a state_dict (dtypes as strings): [dtype, shape], or {key: [dtype, shape]}."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        return {k: [str(d), list(s)] for k, (d, s) in spec.items()}
    return [str(spec[0]), list(spec[1])]


def _spec_from_state(state: Any) -> InputSpec | None:
    def one(entry: Any) -> tuple[torch.dtype, tuple[int, ...]]:
        return getattr(torch, str(entry[0]).removeprefix("torch.")), tuple(int(n) for n in entry[1])

    if state is None:
        return None
    if isinstance(state, Mapping):
        return {str(k): one(v) for k, v in state.items()}
    return one(state)


StructureName = Literal["kron", "diag", "full"]


@dataclass
class _Selection:
    """The parameters a posterior covers and the layers owning them (``Laplace._select``)."""

    names: list[str]
    layer_info: list[LayerInfo]
    layer_names: list[str]
    layout: ParamLayout
    layer_of: dict[str, int]


def _check_positive_entries(name: str, value: Tensor) -> None:
    """Raise ValueError naming ``name`` unless every entry of ``value`` is a finite number > 0 (checked on
    the detached values, so a tensor that requires grad keeps its graph)."""
    v = value.detach()
    bad = ~(torch.isfinite(v) & (v > 0))
    if bool(bad.any()):
        where = "" if v.dim() == 0 else f" (entry {int(bad.nonzero()[0, 0])} of {v.numel()})"
        raise ValueError(f"{name} must be a finite number > 0, got {v.tolist()}{where}")


def log_likelihood(likelihood: Likelihood, f: Tensor, y: Tensor) -> Tensor:
    """Per-sample log-likelihood (B,) (the sum over a sample's counted positions), with every normaliser
    included (the evidence needs it): the likelihood's own :meth:`~curvkit.likelihoods.Likelihood.log_likelihood`."""
    return likelihood.log_likelihood(f, y)


def _check_finite_batch(i: int, X: Inputs, y: Tensor, dtypes: frozenset[torch.dtype] = frozenset()) -> None:
    """Name a batch whose inputs (any tensor of a mapping) or targets hold NaN or inf, or whose
    floating-point inputs are of none of the model's floating ``dtypes`` (a bf16 model with float32 adapters
    takes bf16 inputs), before anything is computed from it (torch would answer the dtype with "mat1 and mat2
    must have the same dtype")."""
    if dtypes:
        for what, t in input_tensors(X, "inputs X"):
            if t.is_floating_point() and t.dtype not in dtypes:
                want = sorted(dtypes, key=str)[0]
                raise ValueError(f"batch {i} of the data: the {what} have dtype {t.dtype}, but the model's parameters "
                                 f"are {', '.join(sorted(map(str, dtypes)))}; convert the inputs (X.to({want})) or the "
                                 f"model (model.to({t.dtype})) before fitting")
    for what, t in [*input_tensors(X, "inputs X"), ("targets y", y)]:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"batch {i} of the data: the {what} contain NaN or inf ({int((~torch.isfinite(t)).sum())} "
                             f"of {t.numel()} entries); clean or drop them before fitting")


def _components(blocks: Sequence[KFactors]) -> list[list[KFactors]]:
    """The Kronecker blocks grouped by shared parameters (the query, key and value row slices of one packed
    attention weight, the groups of one convolution), each group in block order."""
    parent = list(range(len(blocks)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, b in enumerate(blocks):
        for n in b.names:
            if n in owner:
                parent[root(i)] = root(owner[n])
            else:
                owner[n] = i
    groups: dict[int, list[KFactors]] = {}
    for i, b in enumerate(blocks):
        groups.setdefault(root(i), []).append(b)
    return list(groups.values())


class Laplace:
    """A Laplace posterior over (a subset of) a model's parameters; see the module docstring.

    Args:
        model: the trained network (its parameters at :meth:`fit` are the posterior mean theta*).
        likelihood: :class:`~curvkit.likelihoods.CrossEntropy`, :class:`~curvkit.likelihoods.BernoulliBCE`
            or :class:`~curvkit.likelihoods.Gaussian` (its ``reduction`` is irrelevant here).
        structure: ``'kron'`` | ``'diag'`` | ``'full'``.
        curvature: the curvature source (module docstring); default ``'kflr'`` for ``kron``,
            ``'mc_fisher'`` otherwise.
        subset: ``'all'`` | ``'last_layer'`` | module labels and/or parameter names (frozen parameters are
            never covered). ``'last_layer'`` is the module that produces the output, found from the forward
            pass of the first batch :meth:`fit` sees (:mod:`curvkit.laplace._subset`; an error lists the
            candidates when there is none); :attr:`names` says which parameters were chosen.
        prior_precision: scalar, per-layer sequence or dict (changeable after fitting).
        mc_samples: sampled labels per datum for ``kfac``/``mc_fisher`` (random projections for
            ``projection``).
        seed: seed of the curvature's sampled labels (predictions take their own generator).
        prior_form: ``'factored'`` (Eq. 5.14) | ``'exact'`` (kron only).
        trace_balance: split the prior term by the trace-norm ratio (factored kron only).
        norm_structure: ``'full'`` (default, the exact per-layer block) | ``'diag'`` per normalisation layer
            (kron only; the default was ``'diag'`` before curvkit 0.3: it is now
            :class:`~curvkit.curvature.CurvatureConfig`'s, so the precision is ``N x`` the estimator's
            per-datum curvature plus the prior).
        weight_sharing: ``'expand'`` | ``'reduce'`` (kron only; :class:`~curvkit.curvature.CurvatureConfig`).
        parameter_structure: ``'diag'`` | ``'full'`` per raw parameter (kron only).
        statistics_dtype: the dtype of the curvature statistics and of everything built from them (precision,
            covariance, log-determinants, samples, predictive variances): None (float32 for a bf16/fp16
            model, else the model's) or torch.float32/float64 (:mod:`curvkit.precision`). :attr:`dtype`.
        compute_dtype: None (the curvature passes run in the model's dtype) or torch.float32/float64 (on an
            upcast copy of the model's state; :mod:`curvkit.precision`). Predictions run the model as it is.
        distributed: a :class:`~curvkit.distributed.Reducer`: each rank fits on its shard of the data and gets
            the posterior of the union (module docstring, "Data-parallel and sharded fits"); required for an
            FSDP2-sharded model. Every rank must construct, fit and select the prior alike.
    """

    def __init__(self, model: nn.Module, likelihood: Likelihood, structure: StructureName = "kron",
                 curvature: str | None = None, *, subset: Any = "all", prior_precision: Any = 1.0,
                 mc_samples: int = 1, seed: int = 0, prior_form: str = "factored", trace_balance: bool = False,
                 norm_structure: NormStructure = "full", weight_sharing: WeightSharing = "expand",
                 parameter_structure: NormStructure = "diag", statistics_dtype: torch.dtype | None = None,
                 compute_dtype: torch.dtype | None = None, distributed: Reducer | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        model = uncompiled(model)  # the same parameters (curvkit.structure.uncompiled)
        if distributed is not None and not isinstance(distributed, Reducer):
            raise TypeError(f"Laplace: distributed must be a curvkit.distributed.Reducer, got "
                            f"{type(distributed).__name__}")
        #: the Reducer of a data-parallel or sharded fit (module docstring, "Data-parallel and sharded fits")
        self.distributed = distributed
        #: an FSDP2 model's whole-parameter replica (:class:`~curvkit.distributed.sharded.ShardedReplica`), else None
        self.replica: ShardedReplica | None = None
        if is_sharded(model):
            if distributed is None:
                raise ValueError("Laplace: the model's parameters are FSDP2 (DTensor) shards, so each rank fits on "
                                 "its own shard of the data; pass distributed=Reducer() (the posterior of the union "
                                 "of the ranks' data, whole on every rank)")
            self.replica = ShardedReplica(model, distributed, "Laplace")
            model = self.replica.module  # the posterior is built, fitted and evaluated on the replica
        if not isinstance(likelihood, Likelihood) or type(likelihood).mean is Likelihood.mean:
            raise TypeError("likelihood must be a curvkit Likelihood with a predictive mean (mean(f): CrossEntropy, "
                            f"BernoulliBCE, Gaussian or a head of your own that defines it), got "
                            f"{type(likelihood).__name__}")
        if structure not in ("kron", "diag", "full"):
            raise ValueError(f"structure must be 'kron', 'diag' or 'full', got {structure!r}")
        #: the curvature was not given: 'kron' takes kflr, or kfac where a block has a vocabulary-sized output
        self._default_curvature = curvature is None
        if curvature is None:
            curvature = "kflr" if structure == "kron" else "mc_fisher"
        allowed = KRON_METHODS if structure == "kron" else ELEMENT_METHODS
        if curvature not in allowed:
            hint = ("'ggn' is exact; Kronecker factors of the exact GGN's output side are 'kflr'"
                    if structure == "kron" else "'kfac' is a Kronecker method; its diagonal analogue is 'mc_fisher'")
            raise ValueError(f"curvature {curvature!r} is not available for structure {structure!r}; use one of "
                             f"{allowed} ({hint})")
        if prior_form not in ("factored", "exact"):
            raise ValueError(f"prior_form must be 'factored' (thesis Eq. 5.14) or 'exact', got {prior_form!r}")
        #: the Kronecker statistics' options (:class:`curvkit.curvature.CurvatureConfig`, validated there)
        self.config = CurvatureConfig(weight_sharing=weight_sharing, norm_structure=norm_structure,
                                      parameter_structure=parameter_structure, mc_samples=mc_samples)
        self.model, self.likelihood = model, likelihood
        self.structure, self.curvature = structure, curvature
        self.mc_samples, self.seed = self.config.mc_samples, int(seed)
        self.prior_form, self.trace_balance = prior_form, bool(trace_balance)
        self.norm_structure, self.weight_sharing = self.config.norm_structure, self.config.weight_sharing
        self.parameter_structure = self.config.parameter_structure
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError(f"{type(model).__name__} has no trainable parameters")
        self.device = trainable[0].device
        self.compute_dtype = None if compute_dtype is None else precision.compute_dtype(trainable[0].dtype,
                                                                                        compute_dtype)
        #: the dtype of the statistics and the posterior (curvkit.precision)
        self.dtype = precision.statistics_dtype(self.compute_dtype or trainable[0].dtype, statistics_dtype)
        self.subset = subset
        self._selection: _Selection | None = None
        self._prior_value: Any = prior_precision
        if subset == "last_layer":  # found from the forward pass of the first batch of fit (laplace._subset)
            if not isinstance(prior_precision, (Mapping, Sequence, Tensor)):
                positive("prior_precision", prior_precision)
        else:
            self._select(resolve_subset(model, subset))
        if self.replica is not None:  # gathered again by fit
            self.replica.release()
        #: (dtype, shape without the batch dimension) of the inputs fit saw first (per key for a mapping:
        #: :data:`InputSpec`); predictions are checked against it
        self.input_spec: InputSpec | None = None
        self._num_data: float | None = None
        self.num_seen = 0
        self.loglik = 0.0
        self.blocks: list[PosteriorBlock] = []
        self.params: dict[str, Tensor] = {}
        self.buffers: dict[str, Tensor] = {}

    # ------------------------------------------------------------------ the covered parameters
    def _select(self, names: list[str]) -> None:
        """Fix the parameters the posterior covers (``names``, canonical, ``named_parameters()`` order)."""
        layer_info = subset_layers(self.model, names)
        if self.structure == "kron":  # the layer kinds must take every covered parameter: refused here, by name
            self._kron_source(names)
        shapes = dict(self.model.named_parameters())
        layout = ParamLayout(tuple(names), tuple(shapes[n].shape for n in names))
        layer_of = {n: i for i, lay in enumerate(layer_info) for n in lay.params}
        self._selection = _Selection(list(names), layer_info, [lay.label for lay in layer_info], layout, layer_of)
        self._prior = self._as_prior(self._prior_value)

    def _selected(self) -> _Selection:
        if self._selection is None:
            raise ValueError("subset='last_layer' is found from the model's forward pass: the parameters it covers "
                             "are known once fit(data) has seen the first batch")
        return self._selection

    @property
    def names(self) -> list[str]:
        """Canonical names of the parameters the posterior covers (flat :attr:`layout` order): for
        ``subset='last_layer'`` the parameters of the layer that produces the output, known after :meth:`fit`."""
        return self._selected().names

    @property
    def layer_info(self) -> list[LayerInfo]:
        """The layers owning :attr:`names` (weights and biases restricted to them)."""
        return self._selected().layer_info

    @property
    def layer_names(self) -> list[str]:
        """Labels of :attr:`layer_info` (the order of per-layer prior precisions)."""
        return self._selected().layer_names

    @property
    def layout(self) -> ParamLayout:
        """The flat layout of the covered parameters (of :meth:`precision`, :meth:`sample`, :attr:`mean`)."""
        return self._selected().layout

    @property
    def _layer_of(self) -> dict[str, int]:
        return self._selected().layer_of

    # ------------------------------------------------------------------ hyperparameters
    def _as_prior(self, value: Any) -> Tensor:
        L = len(self.layer_names)
        if isinstance(value, Mapping):
            unknown = [k for k in value if k not in self.layer_names]
            missing = [k for k in self.layer_names if k not in value]
            if unknown or missing:
                raise ValueError(f"prior_precision dict needs exactly the layers {self.layer_names}; unknown "
                                 f"{unknown}, missing {missing}")
            vals = [positive(f"prior_precision[{k!r}]", value[k]) for k in self.layer_names]
        elif isinstance(value, (Sequence, Tensor)) and not (isinstance(value, Tensor) and value.dim() == 0):
            vals = [positive("prior_precision", v) for v in value]
            if len(vals) != L:
                raise ValueError(f"prior_precision has {len(vals)} values but the posterior has {L} layers "
                                 f"({', '.join(self.layer_names)})")
        else:
            vals = [positive("prior_precision", value)] * L
        return torch.tensor(vals, dtype=self.dtype, device=self.device)

    @property
    def prior_precision(self) -> Tensor:
        """Per-layer prior precisions (L,), in :attr:`layer_names` order."""
        self._selected()
        return self._prior.clone()

    @prior_precision.setter
    def prior_precision(self, value: Any) -> None:
        if self._selection is None:
            if not isinstance(value, (Mapping, Sequence, Tensor)):
                positive("prior_precision", value)
            self._prior_value = value
            return
        self._prior = self._as_prior(value)
        self._prior_value = value

    @property
    def num_data(self) -> float:
        """The pseudo-data count N (default: the number of data seen by :meth:`fit`)."""
        self._require_fit()
        assert self._num_data is not None
        return self._num_data

    @num_data.setter
    def num_data(self, value: Any) -> None:
        self._num_data = positive("num_data", value)

    def _require_fit(self) -> None:
        if not self.blocks:
            raise ValueError("the posterior is not fitted yet: call fit(data) first")

    def _hyper(self, num_data: Any = None, prior_precision: Any = None) -> tuple[float, Tensor]:
        self._require_fit()
        N = self.num_data if num_data is None else positive("num_data", num_data)
        lam = self._prior if prior_precision is None else self._as_prior(prior_precision)
        return N, lam

    # ------------------------------------------------------------------ fitting
    @differentiable()
    def fit(self, data: Any, num_data: float | None = None) -> Self:
        """Sum the curvature over ``data`` (an ``(X, y)`` pair or an iterable of pairs, read once; X a tensor
        or a mapping of tensors) at the model's current parameters, which become the posterior mean.
        ``num_data`` sets N (default: the number of data seen). Replaces any earlier fit; on an error (NaN in
        a batch, targets that do not fit the outputs, a model the structure cannot take) the posterior keeps
        its earlier fit, if any."""
        N = None if num_data is None else positive("num_data", num_data)
        if self.replica is not None:  # the shards as they are now (the model may have been trained since)
            self.replica.gather()
            try:
                return self._fit(data, N)
            finally:
                self.replica.release()
        return self._fit(data, N)

    def _fit(self, data: Any, N: float | None) -> Self:
        model, lik = self.model, self.likelihood
        structure = read_model(model)
        structure.require_deterministic("Laplace")
        structure.require_independent_samples("Laplace")
        self._check_parameters()
        if self.distributed is not None:
            self._check_replicas()
        saved = (self._selection, getattr(self, "_prior", None))
        try:
            sources: dict[str, Any] | None = None
            count, ll = 0, 0.0
            dtypes = frozenset(p.dtype for p in model.parameters() if p.is_floating_point())
            for i, (X, y) in enumerate(self._lockstep(iter_batches(data, self.device, mappings=True))):
                _check_finite_batch(i, X, y, dtypes)
                if sources is None:
                    self._inspect(X, y)
                    sources = self._sources()
                outputs = [src.update(X, y) for src in sources.values()]
                f = next((o for o in outputs if o is not None), None)  # the Kronecker source's forward pass
                with torch.no_grad(), curvature_kernels():
                    if f is None:
                        f = model(X)
                    lik.check(f, y)
                    ll += float(log_likelihood(lik, f.to(self.dtype), y).sum())
                count += num_samples(X)
            assert sources is not None  # iter_batches refuses data without a batch
            if self.distributed is not None:  # the union's count and log-likelihood (the statistics are reduced)
                total, ll = self.distributed.sum_scalars(count, ll)
                count = round(total)
            stats = self._statistics(sources)
            blocks = self._build(stats)
        except BaseException:
            self._selection = saved[0]
            if saved[1] is not None:
                self._prior = saved[1]
            raise
        self.num_seen, self.loglik = count, ll
        self.params = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        self._install(blocks, stats)
        self._num_data = float(count) if N is None else N
        self.input_spec = self._first_input
        return self

    def _lockstep(self, batches: Iterable[tuple[Inputs, Tensor]]) -> Iterator[tuple[Inputs, Tensor]]:
        """``batches``, and with ``distributed=`` a check before each one that every rank has a batch too: the
        statistics are all-reduced batch by batch, so the ranks must pass equally many batches (one count per
        batch travels; a rank that runs out first makes every rank raise, instead of pairing one rank's
        statistics with another's next message)."""
        if self.distributed is None:
            yield from batches
            return
        red, it = self.distributed, iter(batches)
        for i in itertools.count():
            batch = next(it, None)
            ranks = red.sum_int(batch is not None)
            if ranks == 0:
                return
            if ranks != red.world_size:
                raise ValueError(f"Laplace.fit with distributed=: {ranks} of {red.world_size} ranks have a batch {i} "
                                 f"(rank {red.rank} {'has' if batch is not None else 'has none'}); every rank must pass "
                                 "the same number of batches (their sizes may differ): split each rank's shard into "
                                 "equally many batches, or pass one (X, y) pair per rank")
            assert batch is not None
            yield batch

    def _check_replicas(self) -> None:
        """Raise on every rank unless every rank holds bitwise the same parameters and buffers (the replica's
        gathered ones for a sharded model): the posterior of the union is centred on ONE theta* (one digest per
        rank travels)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        try:
            self.distributed.check_identical(tensors, "the model's parameters and buffers")  # type: ignore[union-attr]
        except ReplicaMismatch as e:
            raise ReplicaMismatch(f"Laplace.fit with distributed=: {e.args[0].split('; ')[0]}; the posterior of the "
                                  "union is centred on one theta*: fit the same trained model on every rank (e.g. "
                                  "broadcast rank 0's with reducer.sync_tensors_(model.parameters()))") from None

    def _check_parameters(self) -> None:
        """A covered parameter with NaN or inf is named before anything is computed from it."""
        if self._selection is None:
            names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        else:
            names = self.names
        own = dict(self.model.named_parameters())
        for n in names:
            if n in own and not bool(torch.isfinite(own[n].detach()).all()):
                raise ValueError(f"parameter {n!r} of the model contains NaN or inf; a Laplace posterior is centred "
                                 "on trained, finite parameters")

    def _inspect(self, X: Inputs, y: Tensor) -> None:
        """One forward pass of the first batch with its graph: checks that the output is what the likelihood
        takes (logits, not probabilities), resolves ``subset='last_layer'`` from it and warns (once) about
        covered parameters the output does not depend on. The graph's structure is what is read, so two rows
        suffice (every batch's outputs and targets are checked again in :meth:`fit`); with the covered
        parameters known, the graph spans only them."""
        n = num_samples(X)
        X = take_samples(X, slice(0, 2))
        if self._selection is None:
            f, calls = traced_forward(self.model, X, record=True)
        else:
            with only_trainable(self.model, self.names):
                f, calls = traced_forward(self.model, X, record=False)
        if not isinstance(f, Tensor) or f.dim() < 2:
            shape = ("(" + ", ".join(["batch", *map(str, f.shape[1:])]) + (",)" if f.dim() == 1 else ")")
                     if isinstance(f, Tensor) else type(f).__name__)
            raise TypeError(f"the model must return one tensor of shape (batch, outputs) or (batch, positions..., "
                            f"outputs), got {shape}")
        self.likelihood.check_logits(f, "Laplace")
        self.likelihood.check(f.detach()[:1].expand(n, *f.shape[1:]), y)  # the targets against the whole batch
        if self._selection is None:
            self._select(last_layer_names(self.model, f, calls))
        named = dict(self.model.named_parameters())
        warn_unused("Laplace.fit", self.model, self.names, [named[n] for n in self.names], f)
        self._first_input = input_spec(X)

    def _kron_source(self, names: Sequence[str]) -> KroneckerSource:
        """The Kronecker statistics of ``names`` (the estimator refuses a layer the engine cannot take, naming it)."""
        options = {"config": self.config, "statistics_dtype": self.dtype, "compute_dtype": self.compute_dtype,
                   "distributed": self.distributed}
        source = KroneckerSource(self.model, self.likelihood, names, self.curvature, self.mc_samples, self.seed,
                                 options, default=self._default_curvature)
        self.curvature = source.method
        return source

    def _sources(self) -> dict[str, Any]:
        m, lik, k, s = self.model, self.likelihood, self.mc_samples, self.seed
        dtypes: dict[str, Any] = {"statistics_dtype": self.dtype, "compute_dtype": self.compute_dtype,
                                  "distributed": self.distributed}
        if self.structure == "diag":
            return {"diag": DiagonalSource(m, lik, self.names, self.curvature, k, s, **dtypes)}
        if self.structure == "full":
            return {"dense": DenseSource(m, lik, self.names, self.curvature, k, s, **dtypes)}
        return {"kron": self._kron_source(self.names)}

    def _statistics(self, sources: dict[str, Any]) -> list[dict[str, Any]]:
        """Per-block statistics (per-datum means), the form :meth:`state_dict` stores."""
        stats: list[dict[str, Any]] = []
        if "diag" in sources:
            mean = sources["diag"].mean()
            for lay in self.layer_info:
                stats.append({"type": "diag", "layer": lay.label,
                              "f": torch.cat([mean[n].reshape(-1) for n in self._ordered(lay.params)])})
            return stats
        if "dense" in sources:
            return [{"type": "dense", "F": sources["dense"].mean()}]
        for group in _components(sources["kron"].blocks()):
            layer = self._layer_of[group[0].weight_name]
            stats.append({"type": "kron", "layer": self.layer_names[layer],
                          "blocks": [factors_state(b) for b in group]})
        return stats

    def _ordered(self, names: Iterable[str]) -> list[str]:
        wanted = set(names)
        return [n for n in self.names if n in wanted]

    def _build(self, stats: list[dict[str, Any]]) -> list[PosteriorBlock]:
        """The posterior blocks of ``stats`` (:meth:`_statistics`' form, or a version-1 state_dict's)."""
        by_label = {lay.label: (i, lay) for i, lay in enumerate(self.layer_info)}
        blocks: list[PosteriorBlock] = []
        inputs: list[Any] = []  # the input factors' eigendecompositions, shared by the Kronecker blocks
        for s in stats:
            if s["type"] == "dense" and "layer" not in s:  # the full posterior
                blocks.append(DenseBlock(self.layout, [self._layer_of[n] for n in self.names], s["F"]))
                continue
            if s["type"] == "kron":
                blocks.append(self._kron_block(s, by_label, inputs))
                continue
            i, lay = by_label[s["layer"]]
            names = self._ordered(lay.params)
            layout = sub_layout(self.layout, names)
            if s["type"] == "diag":
                blocks.append(DiagonalBlock(layout, [i] * len(names), s["f"]))
            else:
                blocks.append(DenseBlock(layout, [i] * len(names), s["F"]))
        return blocks

    def _kron_block(self, s: Mapping[str, Any], by_label: Mapping[str, Any],
                    inputs: list[Any] | None = None) -> KroneckerBlock:
        """One :class:`KroneckerBlock` from its statistics (version 1: one standard block of a layer)."""
        if "blocks" not in s:
            _, lay = by_label[s["layer"]]
            specs = [{"G": s["G"], "A": s["A"], "weight": lay.weight, "bias": lay.bias}]
        else:
            specs = list(s["blocks"])
        factors = [KFactors(factor_from_state(b["G"], self.device), b["A"].to(self.device), b["weight"], b.get("bias"),
                            index_from_state(b.get("index"), self.device), b.get("label"),
                            bool(b.get("factored", True)),
                            None if b.get("second") is None else tuple(t.to(self.device) for t in b["second"]))
                   for b in specs]
        names = self._ordered({n for b in factors for n in b.names})
        layers = {self._layer_of[n] for n in names}
        shared = [n for n in names if n in read_model(self.model).shared_parameters] if len(layers) > 1 else []
        if shared:  # the sum of a shared parameter's uses (a tied head's bias with it)
            layers = {self._layer_of[shared[0]]}  # the prior precision of the shared parameter's layer
        if len(layers) != 1:
            raise ValueError(f"Kronecker blocks over {names} span the layers "
                             f"{[self.layer_names[i] for i in sorted(layers)]}; one prior precision per block is needed")
        return KroneckerBlock(sub_layout(self.layout, names), layers.pop(), factors, self.prior_form,
                              self.trace_balance, inputs)

    def _install(self, blocks: list[PosteriorBlock], stats: list[dict[str, Any]]) -> None:
        self.blocks = blocks
        self._block_index = [_indices(self.layout, b.layout.names, self.device) for b in blocks]
        self._stats = stats

    # ------------------------------------------------------------------ the posterior
    @property
    def mean(self) -> Tensor:
        """The posterior mean theta* (flat, :attr:`layout` order)."""
        self._require_fit()
        return self.layout.flatten([self.params[n].to(self.dtype) for n in self.names])

    def _combine(self, parts: list[CurvatureOperator]) -> CurvatureOperator:
        return parts[0] if len(parts) == 1 else BlockSumOperator(self.layout, parts)

    def precision(self, num_data: Any = None, prior_precision: Any = None) -> CurvatureOperator:
        """The posterior precision as a :class:`~curvkit.linalg.operator.CurvatureOperator` (current or
        given hyperparameters)."""
        N, lam = self._hyper(num_data, prior_precision)
        return self._combine([b.precision(N, lam) for b in self.blocks])

    def covariance(self, num_data: Any = None, prior_precision: Any = None) -> CurvatureOperator:
        """The posterior covariance (the inverse of :meth:`precision`, in closed form per block)."""
        N, lam = self._hyper(num_data, prior_precision)
        return self._combine([b.covariance(N, lam) for b in self.blocks])

    def log_det_precision(self, num_data: Any = None, prior_precision: Any = None) -> Tensor:
        N, lam = self._hyper(num_data, prior_precision)
        return self._logdet(torch.tensor(N, dtype=self.dtype, device=self.device), lam)

    def _logdet(self, N: Tensor, lam: Tensor) -> Tensor:
        return sum((b.logdet(N, lam) for b in self.blocks), torch.zeros((), dtype=self.dtype, device=self.device))

    def sample(self, num_samples: int = 1, generator: torch.Generator | None = None) -> Tensor:
        """(S, d) draws ``theta ~ N(theta*, P^{-1})`` (flat, :attr:`layout` order); Kronecker blocks by two
        triangular solves per layer (``W = W* + L_G^{-T} Z L_A^{-1}``)."""
        S = integer("num_samples", num_samples)
        N, lam = self._hyper()
        out = self.mean.expand(S, -1).clone()
        for b, idx in zip(self.blocks, self._block_index):
            out[:, idx] += b.sample(N, lam, S, generator)
        return out

    def sample_params(self, flat: Tensor) -> dict[str, Tensor]:
        """The full parameter dict (every parameter of the model) for one flat sample (d,)."""
        params = dict(self.params)
        params.update((n, t.to(params[n].dtype)) for n, t in zip(self.names, self.layout.unflatten(flat)))
        return params

    # ------------------------------------------------------------------ evidence
    def log_marginal_likelihood(self, prior_precision: Any = None, num_data: Any = None) -> Tensor:
        """Laplace's log evidence (thesis Ch. 1; MacKay 1992):

            log p(D) ~ (N / n) log p(D | theta*) - sum_l lam_l ||theta*_l||^2 / 2
                       + sum_l d_l log(lam_l) / 2 - log det P / 2

        (n = data seen by :meth:`fit`; N = n gives the usual formula). Differentiable in a tensor
        ``prior_precision``/``num_data``, which is how :func:`curvkit.laplace.optimize_prior_precision`
        uses it. Exact for Bayesian linear regression with ``structure='full'`` and ``curvature='ggn'``.
        """
        self._require_fit()
        lam = self._prior_tensor(prior_precision)
        N = self._num_data_tensor(num_data)
        sq = torch.zeros(len(self.layer_names), dtype=self.dtype, device=self.device)
        dims = torch.zeros_like(sq)
        for n in self.names:
            sq[self._layer_of[n]] += (self.params[n].to(self.dtype) ** 2).sum()
            dims[self._layer_of[n]] += self.params[n].numel()
        fit = (N / self.num_seen) * self.loglik
        return fit - 0.5 * (lam * sq).sum() + 0.5 * (dims * lam.log()).sum() - 0.5 * self._logdet(N, lam)

    def _num_data_tensor(self, value: Any) -> Tensor:
        """N as a tensor: a tensor that requires grad is kept (differentiable) once its value is checked."""
        if value is None:
            value = self.num_data
        elif isinstance(value, Tensor) and value.requires_grad:
            if value.dim() != 0:
                raise ValueError(f"num_data must be a scalar, got a tensor of shape {tuple(value.shape)}")
            _check_positive_entries("num_data", value)
            return value
        return torch.tensor(positive("num_data", value), dtype=self.dtype, device=self.device)

    def _prior_tensor(self, value: Any) -> Tensor:
        """The per-layer prior precisions (L,); a tensor that requires grad (prior optimisation) is kept,
        differentiable, once its shape and values are checked like any other prior precision."""
        if value is None:
            return self._prior
        if isinstance(value, Tensor) and value.requires_grad:
            L = len(self.layer_names)
            if value.dim() > 1 or (value.dim() == 1 and value.shape[0] != L):
                raise ValueError(f"prior_precision must be a scalar or one value per layer ({L}: "
                                 f"{', '.join(self.layer_names)}), got a tensor of shape {tuple(value.shape)}")
            _check_positive_entries("prior_precision", value)
            return value.expand(L) if value.dim() == 0 else value
        return self._as_prior(value)

    # ------------------------------------------------------------------ predictions
    def predict(self, X: Inputs, method: Literal["glm", "mc"] = "glm", **kwargs: Any) -> Any:
        """The predictive distribution at inputs ``X`` (:mod:`curvkit.laplace.predictive`): ``'mc'`` the Monte
        Carlo average of thesis Eq. 5.9, ``'glm'`` the linearised predictive. Classification returns
        probabilities (B, C); regression ``(mean, variance)`` (B, C) each; outputs with positions give
        (B, *P, C) per position."""
        from curvkit.laplace import predictive

        if method == "mc":
            return predictive.mc_predictive(self, X, **kwargs)
        if method == "glm":
            return predictive.glm_predictive(self, X, **kwargs)
        raise ValueError(f"method must be 'glm' or 'mc', got {method!r}")

    def functional_variance(self, X: Inputs, batch_size: int = 256, diagonal: bool = False) -> tuple[Tensor, Tensor]:
        """``(f(X; theta*), J Sigma J^T)``: outputs (B, C) and their linearised covariance (B, C, C); with
        positions (B, *P, C) and per-position covariances (B, *P, C, C); ``diagonal=True``: the variances
        only, shaped like the outputs (:func:`curvkit.laplace.predictive.functional_variance`)."""
        from curvkit.laplace import predictive

        return predictive.functional_variance(self, X, batch_size=batch_size, diagonal=diagonal)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything a fitted posterior needs (statistics, mean, hyperparameters), for ``torch.save``."""
        self._require_fit()
        return {"version": 2, "structure": self.structure, "curvature": self.curvature, "names": list(self.names),
                "layer_names": list(self.layer_names), "prior_form": self.prior_form,
                "trace_balance": self.trace_balance, "norm_structure": self.norm_structure,
                "weight_sharing": self.weight_sharing, "parameter_structure": self.parameter_structure,
                "num_data": self.num_data, "num_seen": self.num_seen, "loglik": self.loglik,
                "prior_precision": self._prior.clone(), "params": dict(self.params), "buffers": dict(self.buffers),
                "stats": self._stats,
                "input": _spec_state(self.input_spec)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a fitted posterior saved by :meth:`state_dict` (built with the same model and settings;
        version 1, the Linear/Conv2d-only Kronecker blocks of earlier releases, is read too)."""
        if not isinstance(state, Mapping) or state.get("version") not in (1, 2):
            raise ValueError("not a Laplace state_dict (version 1 or 2)")
        defaults = {"weight_sharing": "expand", "parameter_structure": "diag"}
        keys = ["structure", "curvature", "prior_form", "trace_balance"]
        if self.structure == "kron":  # the Kronecker statistics' options (CurvatureConfig)
            keys += ["norm_structure", "weight_sharing", "parameter_structure"]
        if self._selection is None:  # subset='last_layer' before any fit: the layer the saved posterior found
            self._select(resolve_subset(self.model, list(state["names"])))
        for key in keys:
            if state.get(key, defaults.get(key)) != getattr(self, key):
                hint = (" (Laplace's norm_structure default was 'diag' before curvkit 0.3; pass norm_structure='diag' "
                        "to load it)") if key == "norm_structure" else ""
                raise ValueError(f"state_dict has {key}={state.get(key, defaults.get(key))!r}, this posterior "
                                 f"{getattr(self, key)!r}{hint}")
        if list(state["names"]) != list(self.names) or list(state["layer_names"]) != list(self.layer_names):
            raise ValueError("state_dict covers other parameters/layers than this posterior")
        own = dict(self.model.named_parameters())
        for n, t in state["params"].items():
            if n not in own or tuple(own[n].shape) != tuple(t.shape):
                raise ValueError(f"state_dict parameter {n!r} does not match the model")
        self.params = {n: t.to(self.device) for n, t in state["params"].items()}
        self.buffers = {n: t.to(self.device) for n, t in state["buffers"].items()}
        self.num_seen, self.loglik = int(state["num_seen"]), float(state["loglik"])
        self._prior = state["prior_precision"].to(device=self.device, dtype=self.dtype)
        self._install(self._build(state["stats"]), list(state["stats"]))
        self._num_data = float(state["num_data"])
        self.input_spec = _spec_from_state(state.get("input"))

    def __repr__(self) -> str:
        fitted = f"N={self._num_data:g}" if self._num_data is not None else "not fitted"
        if self._selection is None:
            return f"Laplace(structure={self.structure!r}, curvature={self.curvature!r}, subset='last_layer', {fitted})"
        return (f"Laplace(structure={self.structure!r}, curvature={self.curvature!r}, d={self.layout.dim}, "
                f"layers={len(self.layer_names)}, {fitted})")
