"""The Kronecker estimator (the estimator protocol, accumulation and scale: :mod:`.estimator`; the diagonal
estimator: :mod:`.diagonal_estimator`; both re-exported here).

* :class:`KroneckerEstimator` - per layer ``G_l (x) A_l`` (thesis Eqs. 4.2-4.3, PyTorch row-major layout,
  output factor first) with the output factor from ``method``:

  - ``kflr``: the R columns of ``S`` with ``S S^T = H_L`` back-propagated (exact low rank, Sec. 4.3.1);
  - ``kfac``: ``mc_samples`` labels sampled from the model, their NLL gradients back-propagated (Monte
    Carlo Fisher, Sec. 4.3.3; unbiased for KFLR's G);
  - ``projection``: ``mc_samples`` random projections ``S v`` with ``E[v v^T] = I`` (Rademacher or
    Gaussian ``v``, Sec. 4.3.4, Eqs. 4.10-4.11);
  - ``kfra``: the batch-mean recursion ``G_l = (W_{l+1}^T G_{l+1} W_{l+1}) o (Phi_l^T Phi_l / B)``,
    ``Phi_l = phi'(h_l)`` (Sec. 4.3.2, Eq. 4.7, Algorithm 1 erratum fixed), MLP chains only; the recursion
    runs through frozen Linear layers of the chain (their h_l recomputed from the layer before), which get
    no block;
  - ``empirical``: gradients at the DATA labels (empirical Fisher; for comparison, not a GGN estimator).

  One block per block of a layer kind (:mod:`curvkit.layerkinds`: Linear and convolutions with weight
  sharing, grouped convolutions, Embedding, normalisation layers, multi-head attention, raw parameters).
  Positions that share a weight (tokens, patches, convolution locations) follow ``weight_sharing``:
  ``expand`` (default; ``A`` sums over the R positions, ``G`` averages over them, the KFC convention) or
  ``reduce`` (``A`` from the mean input, ``G`` from the summed gradient of each sample); see
  ``docs/architecture.md`` for the relation to curvlinops' factors and the cross-position terms of KFLR
  with sequence outputs.

  ``kflr`` on one datum (one position) equals that datum's exact diagonal GGN block (Lemmas 3.21/3.22).

Per-step use inside an optimiser shares the forward pass::

    with est.capture() as cap:     # also runs the pass under curvature_kernels (math attention)
        f = model(X)
    est.accumulate(cap, f, y)      # back-propagates the estimator's vectors (retain_graph)
    loss = lik(f, y); loss.backward()
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal

import torch
from torch import Tensor, nn

from curvkit import layerkinds, precision
from curvkit.curvature._graph import lowest_tensors
from curvkit.curvature._vjp import vector_grad
from curvkit.curvature.capture import (
    BlockCapture,
    SiteOutput,
    check_sample_rows,
    check_sample_shapes,
    grad_inputs,
    indexed_hook,
    per_sample_grads,
)
from curvkit.curvature.config import (
    BatchStatistics,
    CurvatureConfig,
    Distribution,
    NormStructure,
    OutputFactor,
    WeightSharing,
    renamed_method,
    resolve_config,
)
from curvkit.curvature.diagonal_estimator import DiagonalEstimator
from curvkit.curvature.estimator import CurvatureEstimator
from curvkit.curvature.recursion import activation_derivatives, kfra_chain
from curvkit.hf import require_wrapped
from curvkit.layerkinds import BlockSpec, Site, UnfoldedSite
from curvkit.likelihoods import Likelihood
from curvkit.linalg.factors import _symmetrise, _symmetrise_
from curvkit.linalg.kron import (
    KroneckerBlock,
    KroneckerOperator,
    LowRankFactor,
    StridedIndex,
    block_positions,
    dense_sum,
    pair_in_view,
)
from curvkit.linalg.operator import sub_layout
from curvkit.structure import (
    UnsupportedModelError,
    differentiable,
    kept_running_statistics,
    read_model,
    refuse,
)
from curvkit.validation import Inputs, num_samples, take_samples
from curvkit.validation import storage_key as _rows_key  # the inputs' identity (a name tests patch)

__all__ = ["CurvatureEstimator", "DiagonalEstimator", "KroneckerEstimator", "OptionWords", "PerSample", "wide_blocks"]

KroneckerMethod = Literal["kfac", "kflr", "kfra", "projection", "empirical"]

LOW_RANK_OUTPUTS = 8192
"""``output_factor="auto"`` keeps the output factor G of a Kronecker block with more outputs than this as a
:class:`~curvkit.linalg.kron.LowRankFactor` (a dense one would hold more than 8192^2 floats, 256 MiB in
float32; GPT-2's 50,257-token output layer: 10 GB)."""

ROWS_OUTPUTS = 2048
"""``output_factor="auto"`` holds the output factor G of a Kronecker block with at least this many (and at most
:data:`LOW_RANK_OUTPUTS`) outputs, of a method whose G is a sum of few outer products (``kfac``, ``empirical``,
``projection``) and of a parameter that is not shared, as its rows while they are FEWER than its outputs (a
:class:`~curvkit.linalg.kron.LowRankFactor` in the operator), and as the dense Gram matrix from the update where
they would be more (:class:`GramRows` ``dense_above``). Both are exact. With 256 tokens a batch, TinyLlama's
5,632- and 2,048-output layers then skip the Gram products of 256 x n^2 multiply-adds each and the (n, n)
matrices: a KFAC-expand refresh of the whole 1.1 B model costs 1.64x a gradient pass instead of 2.61x, within
12.7 GiB instead of 18.2 (docs/benchmarks.md, ``llama_scale.py``). Narrower layers keep the dense factor from
the first update (the thesis's form; below 2,048 outputs the dense factor is at most 16 MiB in float32)."""


@dataclass(frozen=True)
class OptionWords:
    """How the caller of an estimator spells the options its refusals of a wide output layer suggest (a
    consumer builds the estimator itself, so its users know its own keywords, not the estimator's):
    ``sampled`` names the methods whose output factor is exactly low rank, ``dense`` forces a dense output
    factor (None: the caller has no such option; the refusal then offers freezing the layer)."""

    sampled: str = "curvature='kfac' or 'empirical'"
    dense: str | None = "output_factor='dense'"


def wide_blocks(plans: Sequence[Any]) -> list[str]:
    """Labels of the Kronecker blocks of ``plans`` (:func:`curvkit.layerkinds.plan`) with more than
    :data:`LOW_RANK_OUTPUTS` outputs: the blocks whose output factor ``output_factor='auto'`` keeps low rank,
    and that KFLR and KFRA refuse (consumers choosing a method by default take ``kfac`` when there are any)."""
    return [spec.label for lp in plans for spec in lp.blocks
            if spec.form == "kron" and spec.out_features > LOW_RANK_OUTPUTS]


SHARED_DENSE_LIMIT = 4096
"""The largest sum of a shared parameter's uses (parameter entries, e.g. a tied embedding and head, V x D)
that the operator holds as one exact dense block (a 4096^2 matrix: 128 MiB in float64)."""


def _nonzero(b: KroneckerBlock) -> bool:
    """Whether a block's factors are both nonzero (a use that saw data)."""
    G = b.G.s if isinstance(b.G, LowRankFactor) else b.G
    return bool(G.abs().sum() > 0) and bool(b.A.abs().sum() > 0)


_BUDGET = 2**22  # scalars of output-space vectors formed at once (KFLR's square-root columns)

#: Per model, the layouts whose rows an estimator's samples-first trace passed (:func:`check_sample_rows`): a
#: later batch, or a later estimator of the same model planned the same, skips the trace for them (it is a
#: forward and a backward pass of two samples: a fifth of a small GPT's refresh). Key (:func:`_modules_now`
#: and ``_statistics``): every module's identity, class and plain attributes (``training``, ``batch_first``, a
#: rebound ``forward``), the planned layers and their handlers, the shared parameters, the kind of pass (raw
#: per-sample copies, compute dtype, batch statistics), the batch size and each site's output shape. A module
#: whose layout changes without any of these changing (through its config object, say) is not seen; one whose
#: plain attributes change at every call (a call counter) is traced at every batch. The last
#: :data:`_TRACED_KEPT` layouts per model are kept (insertion-ordered dict used as a set).
_TRACED: weakref.WeakKeyDictionary[nn.Module, dict[Any, None]] = weakref.WeakKeyDictionary()
_TRACED_KEPT = 16
_PLAIN = (bool, int, float, str, type(None))


def _modules_now(model: nn.Module) -> tuple[Any, ...]:
    """Every module's identity, class, plain attributes and own ``forward`` (if one is bound to it): the part of
    a layout key (:data:`_TRACED`) that says the code of the pass is the traced one. 0.1 ms for a 24-module
    GPT, 2 ms for a 22-layer Llama."""
    return tuple((id(m), type(m), tuple((k, v) for k, v in vars(m).items() if isinstance(v, _PLAIN)),
                  id(vars(m).get("forward"))) for m in model.modules())


class KroneckerEstimator(CurvatureEstimator):
    """Kronecker-factored curvature ``blockdiag_b G_b (x) A_b``, one block per layer kind's block (module
    docstring for the methods, the layer kinds and the scaling conventions).

    Args:
        model: every trainable parameter must belong to a layer kind of :mod:`curvkit.layerkinds`
            (``kfra``: an MLP chain); :func:`curvkit.layerkinds.plan` names any module it cannot take.
        likelihood: the loss head (its ``reduction`` sets the scale; outputs (B, C) or (B, *P, C)).
        method: ``kfac`` (default, the Monte Carlo Fisher) | ``kflr`` | ``kfra`` | ``projection`` |
            ``empirical``.
        weight_sharing: ``expand`` (default) or ``reduce``: how the R positions that share a weight
            (tokens, patches, time steps, convolution locations) enter the factors (module docstring;
            Eschenhagen et al. 2023). An ``nn.Embedding`` always uses expand.
        norm_structure: ``full`` (default: the exact per-layer block of a normalisation layer's
            parameters, 2D x 2D) or ``diag`` (its diagonal).
        parameter_structure: ``diag`` (default) or ``full``: the block of a raw parameter (a ViT's class
            token and position table, :class:`curvkit.layerkinds.ParameterHandler`): the diagonal of its
            per-sample-gradient block, or the dense block (P x P; for small P).
        mc_samples: labels (``kfac``) or projections (``projection``) per datum (default 1, the thesis's).
        distribution: ``rademacher`` | ``gaussian`` probe vectors for ``projection``.
        ema: moving-average factor rho in [0, 1) (None: sum over all data).
        seed / generator: the only randomness (labels, projections); a generator on the model's device is
            created from ``seed`` on first use. Batches consume it in order. With ``distributed`` each rank
            seeds its own generator with ``distributed.seed(seed)`` (rank 0 keeps ``seed``).
        distributed: a :class:`curvkit.distributed.Reducer` (class :class:`CurvatureEstimator`): the
            factors of the union of the ranks' batches. ``kfra`` is not linear in the batch (its
            recursion multiplies batch means), so its batch means of H_L and of Phi_l^T Phi_l are
            all-reduced first (one message): the factors of the union batch as one batch.
        output_factor: ``auto`` (default) | ``dense`` | ``low_rank``: how a Kronecker block's output factor
            ``G = (s/N) sum_j g_j g_j^T`` is held. ``low_rank``: as the rows g_j themselves while gathering
            and a :class:`~curvkit.linalg.kron.LowRankFactor` (thin eigendecomposition, rank <= the number
            of back-propagated vectors: tokens x ``mc_samples`` per batch, summed over updates) in the
            operator; exact, not an approximation, and never an (out, out) matrix. ``auto``: ``low_rank``
            for the blocks with more than :data:`LOW_RANK_OUTPUTS` outputs (a language model's vocabulary);
            for those with :data:`ROWS_OUTPUTS` (2,048) to :data:`LOW_RANK_OUTPUTS` outputs of a sampled method
            and an unshared parameter, the rows while they are fewer than the outputs and the dense matrix from
            the update where they would be more (exact either way; an LLM's projections at a few hundred tokens
            a batch); ``dense`` for the others. Low-rank factors need a method whose G is a sum of few outer
            products (``kfac``, ``empirical``, ``projection``): ``kflr`` and ``kfra`` refuse them (KFLR's G has full
            rank and costs one backward pass per output). With ``distributed`` the ranks' rows are
            gathered (k_r x n values from each rank per update, never an n x n matrix).
        config: a :class:`~curvkit.curvature.CurvatureConfig` holding the options above (``weight_sharing``,
            ``norm_structure``, ``parameter_structure``, ``mc_samples``, ``distribution``, ``output_factor``,
            ``batch_statistics``) instead of the keywords; a keyword that differs from it is refused.
        keep_per_sample: keep the last batch's per-sample rows in :attr:`per_sample` (block label ->
            :class:`PerSample`) for estimators built on top (e.g. eigenbasis corrections).
        batch_statistics: ``refuse`` (default) | ``couple``: a model with a module that normalises with the
            statistics of the batch (BatchNorm in training mode, or without running statistics) has no
            per-sample curvature to factorise, and is refused by default. ``couple`` is the explicit opt-in to
            the factors researchers train ResNets with (Osawa et al. 2019; kfac-pytorch, ASDL), an
            approximation beyond the per-sample case. For one batch of B samples with the network f(theta)
            evaluated on the WHOLE batch (the batch statistics are functions of every sample's layer outputs):

            - ``A = sum_n sum_r a_hat a_hat^T`` (expand) or ``sum_n a_bar a_bar^T`` (reduce) from the captured
              layer inputs, as always;
            - ``G`` from ``g_n = d(sum_m v_m^T f_m) / d h_n``, the gradient of the coupled batch loss with respect
              to sample n's layer output h_n (the terms through the batch means and variances of every
              normalisation layer above h_n included), for each back-propagated vector set v: sampled-label
              gradients (``kfac``), the columns of the output Hessians' square roots (``kflr``: column c of
              every sample's square root in one backward pass, so G has the cross-sample terms
              ``J_mn^T s_mc s_m'c^T J_m'n``, m != m', that a per-sample factor does not have), projections;
              ``G = sum_n (1/R) sum_r g g^T`` (expand) or ``sum_n g_hat g_hat^T`` (reduce) as always;
            - a BatchNorm layer's (weight, bias) block from the per-sample gradients
              ``u_n = [sum_positions g_n * x_hat_n, sum_positions g_n]`` with ``x_hat`` normalised by the batch
              mean and the BIASED batch variance of each channel (as BatchNorm in training mode), g_n as above.

            The forward passes the estimator runs itself (:meth:`update`) leave the model's running statistics
            unchanged. Not with ``distributed`` (each rank's BatchNorm would normalise with its own shard's
            statistics: the factors would not be those of one coupled batch).
        statistics_dtype: the dtype of the factors (None: float32 for a bf16/fp16 model, else the model's;
            or torch.float32/float64): the rows are cast to it before their products are formed and summed
            (:mod:`curvkit.precision`).
        compute_dtype: None (the estimator's own passes run in the model's dtype) or torch.float32/float64:
            :meth:`update` runs the passes on an upcast copy of the model's state and inputs. A pass the
            caller runs (:meth:`capture`) is the caller's.

    Attributes:
        plans: the model's layers (:class:`curvkit.layerkinds.LayerPlan`), each with its blocks.
        blocks: (layer plan, block spec) per block, in the operator's block order.
        layers: the :class:`~curvkit.structure.LayerInfo` of every planned layer.
    """

    def __init__(self, model: nn.Module, likelihood: Likelihood, curvature: KroneckerMethod = "kfac", *,
                 weight_sharing: WeightSharing = "expand", norm_structure: NormStructure = "full",
                 parameter_structure: NormStructure = "diag", mc_samples: int = 1,
                 distribution: Distribution = "rademacher", ema: float | None = None, seed: int = 0,
                 generator: torch.Generator | None = None, keep_per_sample: bool = False, distributed: Any = None,
                 output_factor: OutputFactor = "auto", batch_statistics: BatchStatistics = "refuse",
                 statistics_dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None,
                 option_words: OptionWords = OptionWords(), config: CurvatureConfig | None = None,
                 method: KroneckerMethod | None = None):
        method = renamed_method(curvature, method, "KroneckerEstimator", "kfac")
        if method not in ("kfac", "kflr", "kfra", "projection", "empirical"):
            raise ValueError(f"unknown Kronecker method {method!r}; use 'kfac', 'kflr', 'kfra', 'projection' "
                             "or 'empirical'")
        given = dict(weight_sharing=weight_sharing, norm_structure=norm_structure,
                     parameter_structure=parameter_structure, mc_samples=mc_samples, distribution=distribution,
                     output_factor=output_factor, batch_statistics=batch_statistics)
        cfg = resolve_config(config, given, "KroneckerEstimator")
        self.config = cfg
        if cfg.batch_statistics == "couple" and distributed is not None:
            raise ValueError("KroneckerEstimator: batch_statistics='couple' cannot be used with distributed=: each "
                             "rank's BatchNorm normalises with its own shard's statistics, so the ranks' factors are "
                             "not those of one coupled batch; use one process, or model.eval() (running statistics)")
        batch_statistics, output_factor = cfg.batch_statistics, cfg.output_factor
        self.batch_statistics: BatchStatistics = batch_statistics
        self.output_factor: OutputFactor = output_factor
        self._words = option_words
        require_wrapped(model, "KroneckerEstimator")
        self.method = method
        self.weight_sharing: WeightSharing = cfg.weight_sharing
        self.norm_structure: NormStructure = cfg.norm_structure
        self.parameter_structure: NormStructure = cfg.parameter_structure
        self.mc_samples = cfg.mc_samples
        self.distribution = cfg.distribution
        self.seed = int(seed) if distributed is None else distributed.seed(int(seed))
        self.generator = generator
        self.keep_per_sample = bool(keep_per_sample)
        self.per_sample: dict[str, PerSample] = {}
        #: per block of the last operator, the positions in :attr:`blocks` of the terms it sums (one, except
        #: for the sum of a shared parameter's uses)
        self.members: list[list[int]] = []
        self._pass_tensors: dict[str, Tensor] = {}  # an upcast pass's parameter tensors (compute_dtype)
        structure = read_model(model, sharded=True)
        self.structure = structure
        if structure.sharded:
            _check_sharded(method, distributed, model=model)
        self.chain = kfra_chain(structure) if method == "kfra" else None
        self.plans = layerkinds.plan(structure, method, batch_statistics=batch_statistics)
        if structure.sharded:
            _check_sharded(method, distributed, self.plans)
        #: trainable parameters shared by several modules (weight tying): their block is the sum of their uses'
        self.shared = [n for n in structure.shared_parameters if any(n in spec.names for lp in self.plans
                                                                     for spec in lp.blocks)]
        if self.shared and method == "kfra":
            layerkinds.refuse_shared(structure, "kfra")
        self._raw = any(lp.handler.per_sample_copies for lp in self.plans)
        self._raw_checked = False
        self._planned = (tuple((id(lp.module), type(lp.handler)) for lp in self.plans),  # the trace's key (_TRACED)
                         tuple(self.shared), self._raw, compute_dtype, self.batch_statistics)
        self._fed: BlockCapture | None = None  # the capture of the last forward() (its raw sites)
        self.blocks = [(lp, spec) for lp in self.plans for spec in lp.blocks]
        self.layers = [lp.info for lp in self.plans]
        self.low_rank = [self._low_rank_output(lp, spec) for lp, spec in self.blocks]
        #: per block: its rows become the dense Gram matrix once they outnumber its outputs (ROWS_OUTPUTS)
        self.dense_above = [low and self.output_factor == "auto" and spec.out_features <= LOW_RANK_OUTPUTS
                            for low, (_, spec) in zip(self.low_rank, self.blocks)]
        if self.shared:
            self._check_shared()
        if self.chain is not None:  # the trainable layers are some of the chain's (frozen ones propagate)
            position = {id(m): i for i, m in enumerate(self.chain.linears)}
            if any(id(lp.module) not in position for lp in self.plans):
                raise UnsupportedModelError("kfra: the trainable layers must be nn.Linear layers of the chain")
            self._chain_pos = [position[id(lp.module)] for lp in self.plans]  # increasing (module order)
        super().__init__(model, likelihood, ema, distributed, statistics_dtype, compute_dtype)

    def _low_rank_output(self, lp: Any, spec: BlockSpec) -> bool:
        """Whether block ``spec`` keeps a low-rank output factor (``output_factor``), or the refusal of a
        combination that cannot have one (class docstring)."""
        if spec.form != "kron" or self.output_factor == "dense":
            return False
        if self.output_factor == "auto" and spec.out_features <= LOW_RANK_OUTPUTS:  # ROWS_OUTPUTS
            return (self.method in ("kfac", "empirical", "projection") and spec.out_features >= ROWS_OUTPUTS
                    and not set(spec.names) & set(self.shared))
        n = spec.out_features
        size = f"{n} outputs: a dense output factor would hold {n}^2 floats ({n * n * 4 / 2**30:.1f} GiB in float32)"
        if self.method in ("kflr", "kfra") and self.output_factor == "low_rank":
            raise ValueError(f"output_factor='low_rank' needs a method whose output factor is a sum of few outer "
                             f"products ('kfac', 'empirical' or 'projection'), got curvature={self.method!r}")
        words, freeze = self._words, "freeze the layer (requires_grad_(False))"
        if self.method in ("kflr", "kfra"):
            how = (f"use {words.sampled}, whose output factor is exactly low rank and kept as a thin "
                   "eigendecomposition" + (f", or {words.dense} to form it anyway" if words.dense else f", or {freeze}"))
            raise refuse(self.method, lp.label, lp.module, f"has {size}, and {self.method.upper()}'s has full rank "
                         "(it back-propagates every column of the output Hessian's square root)", how)
        return True

    # ------------------------------------------------------------------ per-batch statistics
    def capture(self) -> BlockCapture:
        """A capture to run one forward pass in (``with est.capture() as cap: f = model(X)``); the pass
        inside runs under :func:`curvkit.structure.curvature_kernels`. Each block's input statistic is formed
        inside the pass, when its layer runs, and its input rows are dropped there (:meth:`_taker`)."""
        return BlockCapture(self.plans, self.method, take=None if self.keep_per_sample else self._taker(),
                            lean=self.method != "kfra")  # KFRA reads the outputs' values

    def _taker(self) -> Any:
        """The ``take`` of a capture (:class:`BlockCapture`): a Kronecker block's input statistic the moment
        its layer runs, after which its input rows are dropped (replaced by an empty (B, 0) tensor, which
        keeps the batch size for the checks), so the pass never holds more than one layer's rows (a
        convolution's patches, unfolded a few samples at a time, :class:`~curvkit.layerkinds.UnfoldedSite`).
        The blocks fed by one input (q, k, v of self-attention, an MLP's gate and up projections, emitted one
        after the other) share one statistic: the last input is remembered, and an input is the same when its
        memory, layout and version are (:func:`_rows_key`: each module's hook sees its own view of it)."""
        cache: dict[tuple[Any, str, bool], Tensor] = {}
        last: list[Tensor] = []  # the input the cache is about (held, so that its id stays its own)

        def take(i: int, site: Site) -> Tensor | None:
            spec = self.blocks[i][1]
            if spec.form != "kron":
                return None
            lazy = isinstance(site, UnfoldedSite) and not site.formed
            a = None if lazy else site.inputs
            if a is None or not last or _rows_key(a) != _rows_key(last[0]):
                cache.clear()
                last[:] = [] if a is None else [a]
            stat = self._input_stat(spec, site, cache)
            _drop_rows(i, site)
            return stat

        return take

    def _fsdp(self, what: str) -> Any:
        """On an FSDP2 model, whose passes run FSDP2's own collectives: report their failure in curvkit's words
        (:func:`curvkit.distributed.sharded.fsdp_collectives`)."""
        if not self.structure.sharded:
            return contextlib.nullcontext()
        from curvkit.distributed.sharded import fsdp_collectives

        return fsdp_collectives(self.distributed, f"KroneckerEstimator({self.method!r}).{what}")

    def _batch_statistics(self, X: Inputs, y: Tensor) -> tuple[list[Tensor], int, int]:
        with self._fsdp("update"):
            return self._pass_statistics(X, y)

    def _pass_statistics(self, X: Inputs, y: Tensor) -> tuple[list[Tensor], int, int]:
        if self._raw and not self._raw_checked:
            self._check_raw(X)
        with self.capture() as cap, torch.enable_grad(), kept_running_statistics(self.model):
            f = self._own_forward(cap, X)
        cap.own = True  # this pass's graph is the estimator's: its last backward pass may free it
        try:
            return self._statistics(cap, f, y, X)
        finally:
            self._pass_tensors = {}

    def _own_forward(self, cap: BlockCapture, X: Inputs) -> Tensor:
        """The estimator's own forward pass of ``X`` inside ``cap`` (entered): ``model(X)``, a functional call
        with per-sample copies of raw parameters, or one on an upcast copy of the state (``compute_dtype``)."""
        cap.batch = num_samples(X)
        if self.compute_dtype is not None:  # on an upcast copy of the model's state (curvkit.precision)
            dt = self.compute_dtype
            params = precision.upcast_state(dict(self.model.named_parameters()), dt, grad=True)
            buffers = precision.upcast_state(dict(self.model.named_buffers()), dt)
            if self._raw:
                params.update(cap.substitute(num_samples(X), params))
            self._pass_tensors = params  # the tensors the pass reads (_check_uses)
            return self.structure.functional_call(params, (precision.upcast_inputs(X, dt),), buffers)
        if self._raw:
            return self.structure.functional_call(cap.substitute(num_samples(X)), (X,))
        return self.model(X)  # type: ignore[no-any-return]

    def _traced_on_two(self, X: Inputs, sites: list[Any], f: Tensor) -> bool:
        """The samples-first trace (:func:`~curvkit.curvature.capture.check_sample_rows`) of the estimator's own
        pass of ``X``, run on a forward pass of its first TWO samples instead of on the batch's graph, which
        would have to be kept through one more backward pass of the whole batch (its peak memory: every
        activation plus a backward pass's temporaries; its time: a backward pass). True when that trace
        stands in for the batch's: the batch's rows pass the shape check (every site's first dimension is the
        batch B, checked here on the batch itself), the two-sample pass has the same sites, each one of
        ``shared`` as before and of B / 2 times the size otherwise (a per-sample layout scales with the
        batch; a first dimension that only coincides with B, positions or ids without a batch dimension, does
        not: T == B != 2), and the trace concludes there. False (the caller traces the batch itself, with its
        own error) for B <= 2, a sharded model (every rank runs the same passes), coupled samples (shapes
        only), a different layout or a failed trace. The global RNG is restored after the two-sample pass (a
        module that draws from it in its forward pass draws nothing the user would see)."""
        B = int(f.shape[0])
        if B <= 2 or self.structure.sharded or self.batch_statistics == "couple":
            return False
        live = [i for i, site in enumerate(sites) if site is not None]
        check_sample_shapes([self.blocks[i] for i in live], [sites[i] for i in live], B, self.method)
        device = f.device
        rng = (torch.random.fork_rng(devices=[]) if device.type == "cpu" else
               torch.random.fork_rng(devices=[device], device_type=device.type))
        cap = BlockCapture(self.plans, self.method, take=_drop_rows, lean=True)
        batch_tensors = self._pass_tensors
        try:
            with cap, torch.enable_grad(), kept_running_statistics(self.model), rng:
                f2 = self._own_forward(cap, take_samples(X, slice(0, 2)))
            two = cap.sites(f2)
            if f2.numel() * B != f.numel() * 2:
                return False
            for a, b in zip(sites, two):
                if (a is None) != (b is None) or (a is not None and (a.shared != b.shared or math.prod(
                        b.output.shape) * (1 if a.shared else B) != math.prod(a.output.shape) * (1 if a.shared else 2))):
                    return False
            check_sample_rows([self.blocks[i] for i in live], [two[i] for i in live], f2, self.method)
            if self.shared:
                self._check_uses(two, f2)
        except UnsupportedModelError:
            return False
        finally:
            self._pass_tensors = batch_tensors  # the batch's own (its trace, if this one stands in for none)
        return True

    def forward(self, capture: BlockCapture, X: Inputs) -> tuple[Tensor, dict[str, Tensor]]:
        """Run the model on ``X`` (a tensor or a mapping of tensors) inside ``capture`` for :meth:`accumulate`,
        as the estimator's own pass does:
        ``model(X)``, or with raw parameters (a ViT's class token) a functional call on per-sample copies
        ``P = p.expand(B, ...)`` (checked once to act per sample). Returns (f, {canonical name: P}); the
        gradient of a loss with respect to such a p is that with respect to P summed over its first dimension."""
        capture.batch = num_samples(X)
        if not self._raw:
            return self.model(X), {}
        if not self._raw_checked:
            self._check_raw(X)
        copies = capture.substitute(num_samples(X))
        self._fed = capture
        return self.structure.functional_call(copies, (X,)), copies

    @differentiable()
    def accumulate(self, capture: BlockCapture, f: Tensor, y: Tensor | None) -> None:
        """Add the statistics of a forward pass the caller ran inside ``capture`` (output ``f``, targets y;
        with raw parameters the pass of :meth:`forward`); f's graph is kept for the caller's own backward pass."""
        fed, self._fed = self._fed, None
        if self._raw and fed is not capture:
            raw = [lp.label for lp in self.plans if lp.handler.per_sample_copies]
            raise UnsupportedModelError(f"{self.method}: the raw parameter(s) {', '.join(map(repr, raw))} get their "
                                        "per-sample gradients from the estimator's own forward pass: run the "
                                        "pass with f, _ = est.forward(cap, X), use update((X, y)), or freeze them")
        with self._fsdp("accumulate"):
            self._combine(*self._statistics(capture, f, y))

    def _check_raw(self, X: Inputs) -> None:
        """Verify once that every raw parameter p (1, *S) acts per sample (:mod:`curvkit.layerkinds.parameter`):
        two samples with independently perturbed copies of p give the outputs of two one-sample passes."""
        x = take_samples(X, slice(0, 2) if num_samples(X) >= 2 else [0, 0])
        raw = [lp for lp in self.plans if lp.handler.per_sample_copies]
        gen = torch.Generator(device=getattr(raw[0].module, raw[0].handler.attr).device).manual_seed(0)  # type: ignore[attr-defined]
        copies = {}
        for lp in raw:
            p = getattr(lp.module, lp.handler.attr).detach()  # type: ignore[attr-defined]
            noise = torch.randn((2, *p.shape[1:]), generator=gen, device=p.device, dtype=p.dtype)
            copies[lp.label] = p + noise * (0.1 * float(p.abs().mean()) + 0.1)
        names = ", ".join(repr(lp.label) for lp in raw)
        error: Exception | None = None
        try:
            with torch.no_grad():
                both = self.structure.functional_call(copies, (x,))
                ones = [self.structure.functional_call({n: c[i:i + 1] for n, c in copies.items()},
                                                       (take_samples(x, slice(i, i + 1)),)) for i in range(2)]
            ok = all(torch.allclose(both[i:i + 1], ones[i], rtol=1e-4, atol=1e-5 * float(ones[i].abs().max()) + 1e-7)
                     for i in range(2))
        except Exception as exc:  # an operation that cannot take per-sample copies
            ok, error = False, exc
        if not ok:
            raise UnsupportedModelError(
                f"{self.method}: raw parameter(s) {names} (used directly in a forward pass, owned by no layer kind) "
                "do not act per sample along their leading dimension of size 1 (a sample's output depends on another "
                "sample's copy, or the copies cannot be used); freeze them (requires_grad_(False)) or use an exact "
                "or diagonal curvature") from error
        self._raw_checked = True

    def _statistics(self, cap: BlockCapture, f: Tensor, y: Tensor | None,
                    X: Inputs | None = None) -> tuple[list[Tensor], int, int]:
        """The statistics of a pass (output f) the capture recorded; ``X``: the inputs of the estimator's own
        pass (its samples-first trace may then run on two of them, :meth:`_traced_on_two`)."""
        if not isinstance(f, Tensor) or f.dim() < 2:
            raise ValueError(f"{self.method}: the model must return a single (batch, outputs) or (batch, "
                             f"positions..., outputs) tensor, got "
                             f"{tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__}")
        if self.method == "kfra" and f.dim() != 2:
            raise ValueError(f"kfra: the recursion needs (batch, outputs) outputs, got shape {tuple(f.shape)}; use "
                             "curvature='kflr' or 'kfac' for outputs with positions")
        self.likelihood.check(f.detach(), y)
        sites = cap.sites(f)  # None: one use of a shared parameter that this pass did not call
        B, terms = int(f.shape[0]), self.likelihood.num_terms(f, y)
        layout = (_modules_now(self.model), self._planned, B,
                  tuple(None if site is None else tuple(site.output.shape) for site in sites))
        known = _TRACED.setdefault(self.model, {})
        traced = layout not in known
        if self.structure.sharded:  # each backward pass runs FSDP2's collectives: every rank the same passes
            traced = self.distributed.sum_int(int(traced)) > 0
        if traced and not (X is not None and self._traced_on_two(X, sites, f)):  # samples first, traced once
            live = [i for i, site in enumerate(sites) if site is not None]  # per layout (check_sample_rows)
            check_sample_rows([self.blocks[i] for i in live], [sites[i] for i in live], f, self.method,
                              coupled=self.batch_statistics == "couple", always_pass=bool(self.structure.sharded))
            if self.shared:
                self._check_uses(sites, f)
        known[layout] = None
        while len(known) > _TRACED_KEPT:
            del known[next(iter(known))]
        A: list[Tensor | None]
        if cap.take is not None:  # formed in the pass (:meth:`_taker`)
            A = [cap.taken.get(i) for i in range(len(sites))]
        else:
            grams: dict[tuple[Any, str, bool], Tensor] = {}  # blocks fed by one input (q, k, v of self-attention)
            A = [None if site is None else self._input_stat(spec, site, grams)
                 for (_, spec), site in zip(self.blocks, sites)]
        if self.method == "kfra":
            G = self._kfra(sites, f, y)
        else:
            G = self._backprop(sites, f, y, A, free=cap.own)
        shapes = self._reference_shapes()
        assert shapes is not None
        K = len(self.blocks)
        for i, site in enumerate(sites):
            if site is None:  # an uncalled use of a shared parameter contributes nothing
                A[i] = f.new_zeros(shapes[i], dtype=self.statistics_dtype)
                if self.blocks[i][1].form == "kron":
                    zero = f.new_zeros(shapes[K + i], dtype=self.statistics_dtype)
                    G[i] = (GramRows(zero[:0], self.dense_above[i]) if self.low_rank[i]  # type: ignore[assignment]
                            else zero)
        return [a for a in A if a is not None] + G, B, terms  # type: ignore[operator]

    def _check_uses(self, sites: list[Site | None], f: Tensor) -> None:
        """Refuse a shared parameter used in the forward pass more often than by the planned layers that
        were called (e.g. also directly in a module's own forward): such a use would be missing from the sum.
        The uses are counted in the autograd graph below f, as the edges into the parameter's gradient
        accumulator (one per operation that reads it: a Linear's product, an embedding's lookup)."""
        tensors = dict(self.model.named_parameters())
        wanted = {id(tensors[n]): n for n in self.shared}
        wanted.update({id(self._pass_tensors[n]): n for n in self.shared if n in self._pass_tensors})
        count = dict.fromkeys(self.shared, 0)
        seen: set[Any] = set()
        stack = [f.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)
                if var is not None and id(var) in wanted:
                    count[wanted[id(var)]] += 1
                stack.append(nxt)
        for n in self.shared:
            layers = {lp.label for (lp, spec), site in zip(self.blocks, sites) if site is not None and n in spec.names}
            if count[n] > len(layers):
                raise UnsupportedModelError(
                    f"{self.method}: parameter {n!r} (shared by modules {', '.join(map(repr, self.structure.shared_parameters[n]))}) "
                    f"is read {count[n]} times in the forward pass, but only {len(layers)} of those reads are layers "
                    f"the Kronecker engine takes ({', '.join(sorted(layers)) or 'none'}); the others (a module using "
                    "it directly in its own forward) would be missing from its curvature; freeze it "
                    "(requires_grad_(False)), untie the weights, or use an exact or diagonal curvature")

    def _sharing(self, spec: BlockSpec) -> WeightSharing:
        return self.weight_sharing if spec.sharing == "any" else "expand"

    def _input_stat(self, spec: BlockSpec, site: Site,
                    cache: dict[tuple[Any, str, bool], Tensor]) -> Tensor | None:
        """The input statistic of one batch: ``sum_n sum_r a_hat a_hat^T`` (expand; a_hat = [a, 1]) or
        ``sum_n a_bar a_bar^T`` (reduce; a_bar = [mean_r a, 1]); token counts for an embedding; None for a
        block from per-sample gradients (formed with the output side). Blocks with the same input rows share
        one statistic (``cache``). Rows that are not formed yet (:class:`~curvkit.layerkinds.UnfoldedSite`),
        or that are not a view of (B * R, in) rows, are taken a few samples at a time (:data:`_BUDGET`
        scalars): expand sums the chunks' Gram matrices, reduce stacks their position means (or takes them from
        the site without the rows, :meth:`~curvkit.layerkinds.UnfoldedSite.position_means`: a convolution's)."""
        if spec.form == "grad":
            return None
        mode, bias = self._sharing(spec), spec.bias is not None
        if isinstance(site, UnfoldedSite) and not site.formed:
            key: tuple[Any, str, bool] = (id(site), mode, bias)
            if key not in cache:
                means = site.position_means() if mode == "reduce" else None
                chunk = max(1, _BUDGET // max(1, site.row_size))
                cache[key] = (self._input_gram(means, bias) if means is not None else
                              self._chunked_gram(site.sample_rows, site.batch, chunk, mode, bias))
            return cache[key]
        a = site.inputs
        if spec.ids:
            keep = a[a >= 0]
            return torch.bincount(keep, minlength=spec.in_features).to(self.statistics_dtype)
        key = (_rows_key(a), mode, bias)
        if key not in cache:
            if mode == "reduce":
                cache[key] = self._input_gram(a.mean(1), bias)
            else:
                rows = _view_rows(a)
                chunk = max(1, _BUDGET // max(1, a[0].numel()))
                if rows is None and chunk >= a.shape[0]:
                    rows = a.reshape(-1, a.shape[-1])
                cache[key] = (self._input_gram(rows, bias) if rows is not None else
                              self._chunked_gram(lambda lo, hi: a[lo:hi], a.shape[0], chunk, mode, bias))
        return cache[key]

    def _chunked_gram(self, rows: Any, B: int, chunk: int, mode: WeightSharing, bias: bool) -> Tensor:
        """The input statistic from ``rows(lo, hi)`` -> (hi - lo, R, in), ``chunk`` samples at a time."""
        if mode == "reduce":
            return self._input_gram(torch.cat([rows(lo, min(B, lo + chunk)).mean(1) for lo in range(0, B, chunk)]),
                                    bias)
        out: Tensor | None = None
        for lo in range(0, B, chunk):
            a = rows(lo, min(B, lo + chunk))
            part = self._input_gram(a.reshape(-1, a.shape[-1]), bias)
            out = part if out is None else out.add_(part)
        assert out is not None
        return out

    def _input_gram(self, a: Tensor, bias: bool) -> Tensor:
        """sum over rows of a_hat a_hat^T (in_aug, in_aug), a_hat = [a, 1] with a bias; the bias row and
        column come from sum(a) and the count (no concatenated copy of the inputs). The rows are taken to the
        statistics dtype first (:mod:`curvkit.precision`)."""
        a = a.to(self.statistics_dtype)
        if not bias:
            return _gram(a)
        n = a.shape[1]
        out = a.new_empty(n + 1, n + 1)
        out[:n, :n] = _gram(a)  # (mm into the strided slice directly is slower: 9.7 vs 7.8 ms at 500 x 784)
        s = a.sum(0)
        out[:n, n] = s
        out[n, :n] = s
        out[n, n] = a.shape[0]
        return out

    def _gen(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    def _vectors(self, f: Tensor, y: Tensor | None) -> Iterator[tuple[Tensor, float]]:
        """Output-space vectors shaped like f, with weights w: G accumulates ``sum w c c^T`` at the output.

        With positions, one vector holds a value at EVERY position (as curvlinops' type-2 and MC): ``kflr``
        back-propagates column c of every position's square root at once (C passes, not C * T), so its G
        has the cross-position terms ``S_t S_t'^T`` (module docstring)."""
        lik = self.likelihood
        if self.method == "kflr":
            rank = lik.sqrt_rank(f)
            step = max(1, _BUDGET // max(1, f.numel()))
            for c0 in range(0, rank, step):
                S = lik.output_hessian_sqrt_columns(f, slice(c0, min(rank, c0 + step)), y)  # (..., C, r)
                for column in S.movedim(-1, 0).contiguous():  # contiguous columns: no copies downstream
                    yield column, 1.0
            return
        if self.method == "empirical":
            if y is None:
                raise ValueError("empirical: the empirical Fisher needs the data targets y")
            yield lik.output_grad(f, y), 1.0
            return
        K = self.mc_samples
        if self.method == "projection":
            S = lik.output_hessian_sqrt(f, y)  # (..., C, R); E[S v v^T S^T] = S S^T = H_L per position
            gen = self._gen(f.device)
            shape = (K, *S.shape[:-2], S.shape[-1])
            if self.distribution == "gaussian":
                v = torch.randn(shape, generator=gen, device=f.device, dtype=f.dtype)
            else:
                v = torch.randint(0, 2, shape, generator=gen, device=f.device).to(f.dtype).mul_(2).sub_(1)
            for k in range(K):
                yield torch.einsum("...cr,...r->...c", S, v[k]), 1.0 / K
            return
        # kfac: all K draws in one call on f repeated K times (sample-major: row k * B + n)
        reps = (K,) + (1,) * (f.dim() - 1)
        f_rep = f.repeat(*reps)
        y_rep = None if y is None else y.repeat(*((K,) + (1,) * (y.dim() - 1)))
        Vs = lik.output_grad(f_rep, lik.sample(f_rep, self._gen(f.device), y_rep)).reshape(K, *f.shape)
        C = f.shape[-1]
        if K <= C or f.dim() != 2:
            for v in Vs:
                yield v, 1.0 / K
            return
        # More draws than outputs: back-propagate a square root of each datum's sampled output Fisher
        # (1/K) sum_k v_k v_k^T instead (C passes instead of K; the same G in exact arithmetic).
        Fn = torch.einsum("sbc,sbd->bcd", Vs, Vs) / K
        lam, U = torch.linalg.eigh(Fn)
        R = U * lam.clamp_min(0).sqrt()[:, None, :]
        for c in range(C):
            yield R[:, :, c], 1.0

    def _backprop(self, sites: list[Site], f: Tensor, y: Tensor | None, A: list[Tensor | None],
                  free: bool = False) -> list[Tensor]:
        """Back-propagate the vectors to every site: G per Kronecker block (expand: ``sum_n (1/R) sum_r
        g g^T``; reduce: ``sum_n g_hat g_hat^T``, g_hat = sum_r g), the block of per-sample gradients u
        (``sum_n u u^T`` or its diagonal) for the other blocks (stored as their input statistic, in A).

        The statistics are formed by tensor hooks on the sites' outputs while the gradient passes through
        them, and the backward pass asks only for the lowest sites (:func:`~curvkit.curvature._graph.lowest_tensors`), so the layer-output
        gradients are never all held at once; with ``free`` the last vector's pass frees the graph as it
        goes (the estimator's own forward pass; a caller's graph is kept)."""
        outs: list[Tensor] = []
        where: dict[int, int] = {}
        feeds: list[list[int]] = []
        shared: dict[int, list[int]] = {}  # sites whose output every sample uses (Site.shared), by output
        shared_outs: list[Tensor] = []
        for i, s in enumerate(sites):
            if s is None:
                continue
            if s.shared:
                if id(s.output) not in shared:
                    shared[id(s.output)] = []
                    shared_outs.append(s.output)
                shared[id(s.output)].append(i)
                continue
            if id(s.output) not in where:
                where[id(s.output)] = len(outs)
                outs.append(s.output)
                feeds.append([])
            feeds[where[id(s.output)]].append(i)
        stats: list[Any] = [None] * len(sites)  # Tensor, GramRows (low-rank output factors) or None
        per: list[list[Tensor]] = [[] for _ in sites]
        weights: list[float] = []
        fired = [False] * len(outs)
        batched = [False]  # inside the per-sample backward pass of the shared outputs
        last = [False]  # the last vector of a pass that frees the graph (the sites are released after it)
        pending: list[tuple[Tensor, float]] = []  # vectors whose per-sample pass is still to run

        def consume(j: int, g: Tensor) -> None:
            if batched[0]:  # the hooks also see the per-sample pass of the shared outputs: not theirs
                return
            fired[j] = True
            read(feeds[j], g)
            if last[0]:  # the sites' last read: what they hold (a norm layer's input) goes with the graph
                for i in feeds[j]:
                    sites[i].release()

        def read(idx: list[int], g: Tensor, w: float | None = None) -> None:
            w = weights[-1] if w is None else w
            for i in idx:
                r = sites[i].read(g.detach())
                term = self._output_term(self.blocks[i][1], r, self.low_rank[i], self.dense_above[i]) * w
                stats[i] = term if stats[i] is None else stats[i] + term  # type: ignore[operator]
                if self.keep_per_sample:
                    per[i].append(r)

        roots = [j for j, o in enumerate(outs) if o is f]  # the model output itself: its gradient is V
        closed = [j for j in roots if self._closed_form_root([sites[i] for i in feeds[j]], [i for i in feeds[j]], f)]
        low = [j for j in lowest_tensors(outs) if j not in roots]
        targets = [outs[j] for j in low] or [f]
        handles = [o.register_hook(indexed_hook(consume, j)) for j, o in enumerate(outs) if j not in roots]
        try:
            vectors = self._vectors(f.detach(), y)
            current = next(vectors, None)
            while current is not None:
                V, w = current
                following = next(vectors, None)
                last[0] = free and following is None and not self.keep_per_sample
                weights.append(w)
                V = V.to(f.dtype)
                for j in roots:
                    if j not in closed:
                        consume(j, V)
                if shared_outs:  # per-sample gradients of the outputs every sample uses (Site.shared), for
                    pending.append((V, w))  # several vectors in one batched pass (L * B vectors of f's size)
                    if following is None or (len(pending) + 1) * f.shape[0] * f.numel() > _BUDGET:
                        batched[0] = True
                        try:
                            per_sample = per_sample_grads(f, shared_outs, torch.stack([v for v, _ in pending]))
                        finally:
                            batched[0] = False
                        for o, g in zip(shared_outs, per_sample):
                            for l, (_, wl) in enumerate(pending):
                                read(shared[id(o)], g[l], wl)
                        pending.clear()
                if len(targets) > 1 or targets[0] is not f:
                    grads = vector_grad(f, grad_inputs(targets), V, retain_graph=not (free and following is None),
                                        allow_unused=True)
                    for j, g in zip(low, grads):  # a lean output asked for: its node did not run (grad_inputs)
                        if isinstance(outs[j], SiteOutput) and g is not None:
                            consume(j, g)
                current = following
        finally:
            for h in handles:
                h.remove()
        if closed:  # KFLR at the output layer: sum_c s_c s_c^T = H_L per position, in closed form
            H = self.likelihood.output_hessian_sum(f.detach().to(self.statistics_dtype), y)
            R = math.prod(f.shape[1:-1])
            for j in closed:
                fired[j] = True
                for i in feeds[j]:
                    stats[i] = H / R
        for j, ok in enumerate(fired):
            if not ok:
                lp = self.blocks[feeds[j][0]][0]
                raise UnsupportedModelError(f"{self.method}: the output does not depend on module {lp.label!r}; "
                                            "freeze it or remove it")
        G = []
        for i, (_, spec) in enumerate(self.blocks):
            if spec.form == "grad":
                A[i] = stats[i]
                G.append(f.new_full((1, 1), float(f.shape[0])))
            else:
                G.append(stats[i])  # type: ignore[arg-type]
        if self.keep_per_sample:
            wt = torch.tensor(weights, dtype=f.dtype, device=f.device)
            self.per_sample = {spec.label: PerSample(self._per_sample_inputs(spec, site), torch.stack(p), wt)
                               for (_, spec), site, p in zip(self.blocks, sites, per) if site is not None}
        return G

    def _closed_form_root(self, sites: list[Site], idx: list[int], f: Tensor) -> bool:
        """Whether KFLR's output factor of these sites on the model output is ``sum H_L / R`` in closed form:
        every column of the square root back-propagated (``kflr``, weights 1), no per-sample rows kept, and
        each site a Kronecker block (expand, or one position) whose output rows are f's positions themselves
        (a head applied to every position), so that ``sum_c gram(s_c) = sum_positions H_L``."""
        if self.method != "kflr" or self.keep_per_sample:
            return False
        R = math.prod(f.shape[1:-1])
        for site, i in zip(sites, idx):
            spec = self.blocks[i][1]
            if spec.form != "kron" or spec.ids or (R > 1 and self._sharing(spec) != "expand"):
                return False
            probe = torch.arange(f.numel(), device=f.device).remainder_(16777213).to(f.dtype).reshape(f.shape)
            try:
                rows = site.read(probe)
            except RuntimeError:
                return False
            if tuple(rows.shape) != (f.shape[0], R, f.shape[-1]) or not torch.equal(rows.reshape(-1), probe.reshape(-1)):
                return False
        return True

    def _grad_structure(self, spec: BlockSpec) -> NormStructure:
        if spec.roles == ("raw",):
            return self.parameter_structure
        if spec.roles[:1] == ("module",) and spec.in_features > layerkinds.DENSE_LIMIT:  # the generic fallback
            return "diag"
        return self.norm_structure

    def _output_term(self, spec: BlockSpec, r: Tensor, low_rank: bool = False,
                     dense_above: bool = False) -> Tensor | GramRows:
        r = r.to(self.statistics_dtype)  # products of the rounded rows, summed in float32 or wider
        if spec.form == "grad":  # per-sample gradients (B, P)
            return (r * r).sum(0) if self._grad_structure(spec) == "diag" else r.T @ r
        if self._sharing(spec) == "reduce":
            return GramRows(r.sum(1), dense_above) if low_rank else _gram(r.sum(1))
        if low_rank:  # (1/R) sum g g^T = sum (g / sqrt R)(g / sqrt R)^T
            return GramRows(_rows(r) * (1.0 / r.shape[1]) ** 0.5, dense_above)
        return _gram(_rows(r)).div_(r.shape[1])

    @staticmethod
    def _per_sample_inputs(spec: BlockSpec, site: Site) -> Tensor | None:
        if spec.form == "grad":
            return None
        if spec.ids or spec.bias is None:
            return site.inputs
        a = site.inputs
        return torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)

    def _kfra(self, sites: list[Site], f: Tensor, y: Tensor | None) -> list[Tensor]:
        assert self.chain is not None
        B = f.shape[0]
        # KFRA's G_L (Eq. 4.7): the batch mean of H_L; padded samples contribute zero and still count in the mean
        # (the estimator's scale divides by the counted terms)
        G = self.likelihood.output_hessian_sum(f.detach(), y) / f.shape[0]
        chain, L, first = self.chain, len(self.chain.linears), self._chain_pos[0]
        h = {l: site.output.detach() for l, site in zip(self._chain_pos, sites)}
        grams = {}
        a_prev: Tensor | None = None  # the previous layer's activation
        for l in range(first, L - 1):  # the recursion stops at the first trainable layer
            if l not in h:  # a frozen layer (not captured): its pre-activation from the previous activation
                assert a_prev is not None
                lin = chain.linears[l]
                h[l] = torch.nn.functional.linear(a_prev, lin.weight.detach(),
                                                  None if lin.bias is None else lin.bias.detach())
            a_prev, Phi, _ = activation_derivatives(chain.activations[l], h[l])
            grams[l] = Phi.T @ Phi / B
        if self.distributed is not None:  # batch means of the union (class docstring)
            keys = sorted(grams)
            means, total = self.distributed.weighted_mean([G] + [grams[l] for l in keys], B)
            G, grams = means[0], dict(zip(keys, means[1:]))
            B = round(total)  # the union's: the same numbers on every rank, so identical replicas (_reduce)
        per = {L - 1: G}
        for l in range(L - 2, first - 1, -1):
            W = chain.linears[l + 1].weight.detach()
            G = (W.T @ G @ W) * grams[l]
            per[l] = G
        return [B * per[l] for l in self._chain_pos]  # summed form: B times the batch mean (the thesis: per batch)

    # ------------------------------------------------------------------ output
    def _stat_names(self) -> list[str]:
        return ([f"A of block {spec.label!r}" for _, spec in self.blocks] +
                [f"G of block {spec.label!r}" for _, spec in self.blocks])

    def _symmetric(self, stats: list[Tensor]) -> list[bool]:
        return [t.dim() == 2 for t in stats]

    def _settled(self, stats: list[Any]) -> list[Any]:
        """The accumulated statistics with each ``dense_above`` output statistic whose rows outnumber its outputs
        made its dense Gram matrix (:meth:`GramRows.settled`, :data:`ROWS_OUTPUTS`)."""
        return [t.settled() if isinstance(t, GramRows) else t for t in stats]

    def _reduce(self, stats: list[Tensor], B: int, terms: int) -> tuple[list[Tensor], int, int]:
        low = [i for i, t in enumerate(stats) if isinstance(t, GramRows)]
        if low:  # a low-rank output statistic R^T R: the union's is the ranks' rows stacked in rank order
            dense, N, T = self._reduce([t for t in stats if not isinstance(t, GramRows)], B, terms)
            gathered: dict[int, Any] = {i: GramRows.stacked(self.distributed.all_gather_rows(
                stats[i].rows.detach().contiguous()), stats[i].dense_above)  # type: ignore[attr-defined]
                for i in low}
            rest = iter(dense)
            return [gathered[i] if i in gathered else next(rest) for i in range(len(stats))], N, T
        if self.method != "kfra":
            return super()._reduce(stats, B, terms)
        # kfra's G are already the union's (N times its batch means, computed from identical all-reduced
        # means, so bitwise the same on every rank): only A and the counts travel
        L = len(self.blocks)
        A, N, T = super()._reduce(stats[:L], B, terms)
        return A + list(stats[L:]), N, T

    def _reference_shapes(self) -> list[tuple[int, ...]] | None:
        a_shapes: list[tuple[int, ...]] = []
        g_shapes: list[tuple[int, ...]] = []
        for _, spec in self.blocks:
            n = spec.in_features + int(spec.bias is not None and spec.form == "kron")
            if spec.form == "grad":
                a_shapes.append((n,) if self._grad_structure(spec) == "diag" else (n, n))
                g_shapes.append((1, 1))
            else:
                a_shapes.append((n,) if spec.ids else (n, n))
                g_shapes.append((spec.out_features, spec.out_features))
        return a_shapes + g_shapes

    def state_dict(self) -> dict[str, Any]:
        """As :meth:`CurvatureEstimator.state_dict`; a low-rank output statistic is saved as ``{"rows": R}``
        (plain tensors: loadable with ``weights_only=True``)."""
        out = super().state_dict()
        if out["stats"] is not None:
            out["stats"] = [{"rows": t.rows} if isinstance(t, GramRows) else t for t in out["stats"]]
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stats = state.get("stats")
        if stats is not None:
            K = len(self.blocks)
            dense_above = [False] * K + self.dense_above if len(stats) == 2 * K else [False] * len(stats)
            state = {**state, "stats": [GramRows(t["rows"], d) if isinstance(t, dict) else t
                                        for t, d in zip(stats, dense_above)]}
            held = [isinstance(t, GramRows) for t in state["stats"][K:]]
            if len(stats) == 2 * K and any(h != low and not d for h, low, d in zip(held, self.low_rank,
                                                                                   self.dense_above)):
                raise ValueError("state_dict output factors do not match this estimator's output_factor "
                                 f"({self.output_factor!r}): low-rank and dense blocks differ")
        super().load_state_dict(state)

    def factors(self) -> list[tuple[str, Tensor, Tensor]]:
        """(weight name, G, A) per block at the operator's scale (G carries the 'sum' factor N)."""
        return [(b.weight_name, b.G, b.A) for b in self.operator().blocks]

    def operator(self, release: bool = False) -> KroneckerOperator:
        """The Kronecker-factored estimate (module docstring), built from copies of the statistics, which stay
        for further updates.

        ``release=True`` hands the statistics to the operator instead: each dense factor is symmetrised and
        scaled in place (the same entries, bitwise), and the estimator is :meth:`reset` (it holds nothing
        afterwards; the next :meth:`update` starts afresh). The peak memory of building the operator is then ONE
        set of factors, not two: for callers that would reset before their next update anyway (the
        one-shot :func:`~curvkit.curvature.kronecker.kfac` and its siblings, a refresh of every factor). Not
        with ``ema``, whose statistics are a running state (refused)."""
        if release and self.ema is not None:
            raise ValueError("operator(release=True) would consume the running average of an estimator with "
                             f"ema={self.ema}; call operator() (it copies the statistics)")
        if self._stats is None or self.ema is not None:
            return self._operator(self._means(), self.scale())
        # the per-sample means taken inside each factor's one symmetrising pass (no copy of every statistic)
        op = self._operator(list(self._stats), self.scale(), float(self.num_data), in_place=release)
        if release:
            self.reset()
        return op

    def _operator(self, means: list[Tensor], scale: float, count: float = 1.0,
                  in_place: bool = False) -> KroneckerOperator:
        blocks = self.use_blocks(means, scale, count, in_place)
        self.members = [[i] for i in range(len(blocks))]
        if self.shared:
            blocks = self._sum_shared(blocks)
        return KroneckerOperator(self.layout, blocks)

    def use_blocks(self, means: list[Tensor], scale: float, count: float = 1.0,
                   in_place: bool = False) -> list[KroneckerBlock]:
        """One block per planned block (:attr:`blocks`) from the statistics ``means`` (sums over ``count``
        samples: their means are ``means / count``) at ``scale``: each use of a shared parameter still its own
        (:meth:`_sum_shared` sums them for the operator). Blocks fed by one statistic (q, k, v) share one
        symmetrised input factor. ``in_place``: ``means`` are not used again, so the dense factors are
        symmetrised and scaled where they are (:meth:`operator` with ``release=True``)."""
        K = len(self.blocks)
        blocks = []
        inputs: dict[int, Tensor] = {}
        for (_, spec), A, G in zip(self.blocks, means[:K], means[K:]):
            scale_G = scale / count
            if isinstance(G, GramRows):
                rows = (G / count).rows
                scale_G = scale
                G = (LowRankFactor.from_rows(rows) if rows.shape[0] else  # type: ignore[assignment]
                     LowRankFactor.scalar(rows.shape[1], 0.0, rows))
            if id(A) not in inputs:
                if A.dim() == 1:
                    inputs[id(A)] = A.div_(count) if in_place else A / count
                else:
                    inputs[id(A)] = _symmetrise_(A, 0.5 / count) if in_place else _symmetrise(A, 0.5 / count)
            explicit = spec.index is not None
            blocks.append(KroneckerBlock.from_gram(G, inputs[id(A)], spec.weight, spec.bias, scale_G=scale_G,
                                                   index=spec.index, label=spec.label if explicit else None,
                                                   factored=spec.form == "kron", symmetric_A=True,
                                                   in_place=in_place))
        return blocks

    def shared_per_sample(self, members: Sequence[int], block: KroneckerBlock) -> PerSample:
        """The per-sample rows (``keep_per_sample``) of a sum block of a shared parameter (:meth:`_sum_shared`)
        as per-sample gradients (V, B, P) of its entries: each use's ``dW_{n,v} = sum_r g_{n,v,r} a_{n,r}^T``
        placed at its entries and summed over the uses (a use not called in the batch adds nothing)."""
        sub = sub_layout(self.layout, block.names)
        u: Tensor | None = None
        weights = None
        for j in members:
            spec = self.blocks[j][1]
            ps = self.per_sample.get(spec.label)
            if ps is None:
                continue
            weights = ps.weights
            if ps.inputs is None:  # per-sample gradients of a (1, P) block
                dW = ps.vectors
            else:
                a = ps.inputs
                if spec.ids:  # one-hot rows; -1 selects nothing
                    a = torch.nn.functional.one_hot(a.clamp_min(0), spec.in_features).to(ps.vectors.dtype)
                    a = a * (ps.inputs >= 0)[..., None]
                dW = torch.einsum("vbro,bri->vboi", ps.vectors, a.to(ps.vectors.dtype)).flatten(2)
            pos = block_positions(sub, spec.weight, spec.bias, spec.index, dW.device).reshape(-1)
            if u is None:
                u = dW.new_zeros(*dW.shape[:2], sub.dim)
            u[..., pos] += dW
        assert u is not None and weights is not None
        return PerSample(None, u, weights)

    def _sum_shared(self, blocks: list[KroneckerBlock]) -> list[KroneckerBlock]:
        """The blocks with each shared parameter's uses replaced by their sum (docs/architecture.md, "Shared
        and tied weights"): the blocks that read a shared parameter form one group
        (:func:`curvkit.layerkinds.shared_groups`), which becomes ONE exact dense block
        (:func:`~curvkit.linalg.kron.dense_sum`, labelled :func:`curvkit.layerkinds.sum_label`) when it has at
        most :data:`SHARED_DENSE_LIMIT` entries. Above that, the uses of one whole weight that
        :func:`shared_terms` accepts (a tied head and its embedding, GPT-2's 50,257 x 768; a head and several
        lookups of its table, merged by :func:`merge_terms`) become ONE block that is the sum of two Kronecker
        terms, ``G (x) A + G2 (x) A2`` in the head's view (:func:`~curvkit.linalg.kron.pair_in_view`;
        :attr:`~curvkit.linalg.kron.KroneckerBlock.second`), never dense; anything else is refused at
        construction, naming the fixes. Uses that saw no data (a module never called: zero factors) are left out
        of the sum where the others cover its parameters."""
        out: list[KroneckerBlock] = []
        self.members = layerkinds.shared_groups(self.plans, self.shared)
        for members in self.members:
            if len(members) == 1:
                out.append(blocks[members[0]])
                continue
            names = {n for j in members for n in blocks[j].names}
            live = [j for j in members if _nonzero(blocks[j])]
            terms = [blocks[j] for j in (live if live and {n for j in live for n in blocks[j].names} == names
                                         else members)]
            label = layerkinds.sum_label(self.plans, members)
            if self._entries(names) <= SHARED_DENSE_LIMIT:
                out.append(dense_sum(self.layout, terms, label))
                continue
            terms_of = shared_terms([self.blocks[j][1] for j in members])
            assert terms_of is not None  # checked at construction (_check_shared)
            first = blocks[members[terms_of[0]]]  # a use without data: its zero term
            rest = [blocks[members[i]] for i in terms_of[1]]
            second = rest[0] if len(rest) == 1 else merge_terms(rest)
            G1, A1, G2, A2 = pair_in_view(first, second)
            out.append(KroneckerBlock(G1, A1, first.weight_name, first.bias_name, first.index, label,
                                      second=(G2, A2)))
        return out

    def _entries(self, names: set[str] | Sequence[str]) -> int:
        """The number of entries of the parameters ``names``."""
        return sum(self.structure.model.get_parameter(n).numel() for n in names)

    def _check_shared(self) -> None:
        """Refuse, at construction, a sum of a shared parameter's uses that :meth:`_sum_shared` cannot hold: more
        than two parameters (a weight shared by two layers with biases of their own), or more than
        :data:`SHARED_DENSE_LIMIT` entries in uses that :func:`shared_terms` cannot hold as two Kronecker terms."""
        for members in layerkinds.shared_groups(self.plans, self.shared):
            if len(members) == 1:
                continue
            names = {n for j in members for n in self.blocks[j][1].names}
            size = self._entries(names)
            label = layerkinds.sum_label(self.plans, members)
            lp = self.blocks[members[0]][0]
            tied = ", ".join(sorted(n for n in names if n in self.shared))
            fix = ("untie the weights (e.g. a Hugging Face model built with config.tie_word_embeddings=False), "
                   "freeze the shared parameter (requires_grad_(False)), or use an exact or diagonal curvature")
            if len(names) > 2:
                raise refuse(self.method, lp.label, lp.module, f"shares {tied} with {len(members) - 1} other use(s) "
                             f"({label}), which read {len(names)} parameters together ({', '.join(sorted(names))}); "
                             "the sum block of a shared parameter holds a weight and one bias", fix)
            if size > SHARED_DENSE_LIMIT and shared_terms([self.blocks[j][1] for j in members]) is None:
                raise refuse(self.method, lp.label, lp.module, f"shares {tied} with {len(members) - 1} other use(s) "
                             f"({label}); their sum has {size} entries, more than SHARED_DENSE_LIMIT = "
                             f"{SHARED_DENSE_LIMIT} (held as one exact dense block up to there), and above it only "
                             "two uses of one whole weight (one in its standard view, e.g. a tied head and its "
                             "embedding, or a head and several lookups of its table) are kept as a sum of two "
                             "Kronecker terms", fix)


def shared_terms(specs: Sequence[BlockSpec]) -> tuple[int, list[int]] | None:
    """How the uses ``specs`` of one shared weight above :data:`SHARED_DENSE_LIMIT` become two Kronecker terms:
    ``(first, rest)`` with ``first`` the use in the weight's standard view (index None: a Linear head, with or
    without a bias) and ``rest`` the other uses, all in one view of the same weight without a bias (the
    standard view or the whole transposed one: an embedding table), their terms summed by
    :func:`~curvkit.linalg.kron.pair_in_view` (one use: exactly) or first merged by :func:`merge_terms`
    (several embedding lookups of the table: T5's encoder and decoder); None for anything else."""
    if len(specs) < 2 or len({s.weight for s in specs}) != 1:
        return None
    for i, first in enumerate(specs):
        rest = [j for j in range(len(specs)) if j != i]
        if first.index is not None or first.form != "kron":
            continue
        if any(specs[j].form != "kron" or specs[j].bias is not None or specs[j].index != specs[rest[0]].index
               for j in rest):
            continue
        if len(rest) > 1 and not all(specs[j].ids for j in rest):  # only lookups are merged (see merge_terms)
            continue
        index = specs[rest[0]].index
        if index is None or (isinstance(index, StridedIndex) and index.transposed and not index.bias):
            return i, rest
    return None


def merge_terms(terms: Sequence[KroneckerBlock]) -> KroneckerBlock:
    """ONE Kronecker term for several embedding lookups of one table (the same view, no bias), where their
    exact sum ``sum_u G_u (x) diag(c_u)`` is not a Kronecker product:

        G = sum_u t_u G_u / sum_u t_u,   A = sum_u diag(c_u),   t_u = tr(diag(c_u)) (the use's counted positions),

    the factors KFAC-expand gives ONE lookup applied at the union of the uses' positions (its own approximation
    over positions, Sec. "Weight sharing: expand and reduce"): exact when the uses' G agree, and the trace
    ``sum_u tr(G_u) tr(A_u)`` is kept exactly. Uses without data (t_u = 0) add nothing."""
    first = terms[0]
    if any(isinstance(t.G, LowRankFactor) or t.A.dim() != 1 for t in terms):
        raise ValueError(f"merge_terms({first.name!r}): only lookups with dense output and diagonal input factors "
                         "are merged")
    weights = [float(t.A.sum()) for t in terms]
    total = sum(weights)
    G = sum((w * t.G for w, t in zip(weights, terms)), torch.zeros_like(first.G)) / total if total > 0 else first.G
    A = sum((t.A for t in terms[1:]), first.A)
    return KroneckerBlock.from_gram(G, A, first.weight_name, None, index=first.index, label=first.label)


def _check_sharded(method: str, distributed: Any, plans: Sequence[Any] = (), model: nn.Module | None = None) -> None:
    """Refuse what the Kronecker statistics cannot do on an FSDP2 (``fully_shard``) model.

    Under FSDP2 every rank runs the whole model on ITS shard of the data (the weights are all-gathered inside
    each layer's forward and backward pass), so the statistics of one rank are those of its data only: the
    factors of the union need ``distributed=`` (a :class:`curvkit.distributed.Reducer` over the ranks that
    hold the data shards), which sums them as for data parallelism. The factors and the operator are then
    whole (every rank holds every factor, in the full parameter layout: products take and return full flat
    vectors). HSDP (a 2-D (replicate, shard) mesh) is the same: every rank has its own data, and the reducer
    sums over all of them. Refused: no ``distributed=``; a layout that is not FSDP2's or HSDP's, or a mesh that
    is not the reducer's ranks (:func:`curvkit.distributed.sharded.check_layouts`: tensor parallelism, where the
    ranks of a group see the same data, would be counted once per rank); KFRA (its recursion reads the weights);
    layer kinds that read their weights or replace them with per-sample copies (raw parameters, the per-sample
    fallback, attention, transposed linear), which would meet a shard."""
    if distributed is None:
        raise ValueError(
            "KroneckerEstimator: the model's parameters are FSDP2 (DTensor) shards, so each rank runs it on its "
            "own shard of the data and its statistics are not the union's; pass distributed=Reducer() (the "
            "ranks' statistics are summed: the factors of all the data, on every rank)")
    if model is not None:
        from curvkit.distributed.sharded import check_layouts

        check_layouts(model, distributed, f"KroneckerEstimator({method!r})")
    if method == "kfra":
        raise UnsupportedModelError("kfra on an FSDP2-sharded model: the recursion reads the weights, which are "
                                    "shards; use curvature='kflr' or 'kfac'")
    for lp in plans:
        if not lp.handler.takes_shards:
            kinds = sorted({h.kind for h in layerkinds.registered().values() if h.takes_shards})
            raise UnsupportedModelError(
                f"{method}: module {lp.label!r} ({type(lp.module).__name__}, layer kind {lp.handler.kind!r}) on an "
                f"FSDP2-sharded model: only the kinds {', '.join(kinds)} take sharded weights (their "
                "statistics read only a layer's inputs and output gradients); freeze it (requires_grad_(False)) "
                "or use data parallelism (every rank holds the whole model)")


def _drop_rows(i: int, site: Site) -> None:
    """Drop a site's input rows (an empty (B, 0) tensor keeps the batch size for the shape check; rows not yet
    formed, a convolution's patches, never are): after its statistic is formed (:meth:`KroneckerEstimator
    ._taker`), or as the ``take`` of a capture that needs none (:meth:`KroneckerEstimator._traced_on_two`)."""
    site.inputs = site.output.new_empty(site.samples(), 0)


def _view_rows(t: Tensor) -> Tensor | None:
    """(B, R, n) -> (B * R, n) rows in any order (a Gram matrix does not depend on it) as a view when the
    strides allow it in the (B, R) or the (R, B) order (the sequence-first tensors inside attention), else
    None."""
    for u in (t, t.transpose(0, 1)):
        try:
            return u.view(-1, t.shape[-1])
        except RuntimeError:
            continue
    return None


def _rows(t: Tensor) -> Tensor:
    """:func:`_view_rows`, or a copy where no view exists."""
    rows = _view_rows(t)
    return t.reshape(-1, t.shape[-1]) if rows is None else rows


#: the narrowest rows whose Gram matrix :func:`_gram` forms by blocks
_GRAM_MIN = 128
#: the fewest scalars of rows (m x n) whose Gram matrix :func:`_gram` forms by blocks: below, the mirrored copies
#: cost more than the products they save (single-thread float32: 16 x 1,152 rows 1.7 ms by blocks, 0.66 ms whole;
#: 16 x 513 0.33 against 0.20 ms; 1,024 x 128 even)
_GRAM_MIN_SIZE = 2**17


def _gram(a: Tensor) -> Tensor:
    """a^T a (n, n) for rows a (m, n). For n >= :data:`_GRAM_MIN` only the upper block triangle of k column
    blocks is multiplied (one product per block row, (k + 1) / 2k of the full product) and mirrored: the Gram
    matrices dominate the statistics of KFAC-expand (6,400 rows per block on a ViT), and only for m n >=
    :data:`_GRAM_MIN_SIZE` (few rows, KFAC-reduce's one per sample: the whole product). k = 4 up to 1,024 columns,
    n / 256 above (single-thread float32, m = 512-6,400 rows: 0.63-0.83x the time of the full product at n =
    128-3,072; k = n // 128, the previous rule, left n < 384 whole)."""
    n = a.shape[1]
    if n < _GRAM_MIN or a.numel() < _GRAM_MIN_SIZE:
        return a.T @ a
    k = max(4, n // 256)
    edges = [n * i // k for i in range(k + 1)]
    out = a.new_empty(n, n)
    for lo, hi in pairwise(edges):
        part = a[:, lo:hi].T @ a[:, lo:]  # rows lo:hi, columns lo:n
        out[lo:hi, lo:] = part
        out[hi:, lo:hi] = part[:, hi - lo:].T
    return out


class GramRows:
    """A Gram matrix ``R^T R`` (n, n) held as its rows R (k, n): the statistic of a low-rank output factor
    (``output_factor``). The arithmetic the accumulation uses stays in rows: ``+`` stacks them, a
    non-negative scalar ``c`` scales them by ``sqrt(c)``, ``/ c`` by ``1 / sqrt(c)``; :attr:`shape` is the
    matrix's. Memory n x k (k = the vectors back-propagated so far, summed over updates, e.g. with ``ema``).
    Once k would exceed n the rows are replaced by the (n, n) triangle of their QR decomposition (the same
    Gram matrix; the size of a dense factor), or, with ``dense_above`` (``output_factor='auto'`` on a block of
    :data:`ROWS_OUTPUTS` to :data:`LOW_RANK_OUTPUTS` outputs), by the dense Gram matrix itself when the update
    is complete (:meth:`settled`, after the ranks' rows are gathered, so every rank holds the same kind), which
    further updates then add to as a plain tensor."""

    def __init__(self, rows: Tensor, dense_above: bool = False):
        self.rows = rows
        self.dense_above = dense_above

    @property
    def shape(self) -> torch.Size:
        n = self.rows.shape[1]
        return torch.Size((n, n))

    @classmethod
    def stacked(cls, rows: Tensor, dense_above: bool = False) -> GramRows:
        """The Gram matrix of ``rows`` (k, n): the rows themselves, or the (n, n) triangle T of their QR
        decomposition R = Q T (T^T T = R^T R) when k > n and not ``dense_above`` (whose rows wait for
        :meth:`settled`)."""
        if rows.shape[0] > rows.shape[1] and not dense_above:
            rows = torch.linalg.qr(rows, mode="r")[1]
        return cls(rows, dense_above)

    def settled(self) -> GramRows | Tensor:
        """The dense Gram matrix ``R^T R`` when ``dense_above`` and the rows outnumber the columns, else self."""
        return _gram(self.rows) if self.dense_above and self.rows.shape[0] > self.rows.shape[1] else self

    def __add__(self, other: GramRows | Tensor) -> GramRows | Tensor:
        if isinstance(other, Tensor):  # a dense_above statistic that is already the Gram matrix
            return other + _gram(self.rows)
        if not isinstance(other, GramRows):
            return NotImplemented
        return GramRows.stacked(torch.cat([self.rows, other.rows]), self.dense_above)

    __radd__ = __add__

    def __mul__(self, c: float) -> GramRows:
        c = float(c)
        if c < 0:
            raise ValueError(f"GramRows: a Gram matrix can only be scaled by a non-negative number, got {c}")
        return GramRows(self.rows * c**0.5, self.dense_above)

    __rmul__ = __mul__

    def __truediv__(self, c: float) -> GramRows:
        return self * (1.0 / float(c))

    def to(self, dtype: torch.dtype) -> GramRows:
        return GramRows(self.rows.to(dtype), self.dense_above)

    def sum(self) -> Tensor:
        """The sum of the rows' entries (finite exactly when the rows are)."""
        return self.rows.sum()

    def clone(self) -> GramRows:
        return GramRows(self.rows.clone(), self.dense_above)


@dataclass
class PerSample:
    """One block's per-sample rows of the last batch (``keep_per_sample``).

    Attributes:
        inputs: input rows (B, R, in_aug) with the bias column, token ids (B, R) (-1: no row), or None for a
            block from per-sample gradients.
        vectors: per back-propagated vector, the output rows (V, B, R, out), or the per-sample gradients
            (V, B, P).
        weights: (V,) the vectors' weights.
    """

    inputs: Tensor | None
    vectors: Tensor
    weights: Tensor
