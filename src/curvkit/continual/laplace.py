"""Online structured Laplace for continual learning (thesis Sec. 5.3; Ritter, Botev & Barber 2018).

Assumed density filtering with a Gaussian ``q(theta) = N(mu_t, Lambda_t^{-1})`` (Eqs. 5.19-5.23): task t+1
is trained on ``-log p(D_{t+1} | theta) + (1/2) (theta - mu_t)^T Lambda_t (theta - mu_t)`` and afterwards

    Online Laplace (Eq. 5.25):       Lambda_{t+1} = lam * G_{t+1}(mu_{t+1}) + Lambda_t,  Lambda_0 = lam_0 I
    Non-Online Laplace (Eq. 5.24):   Lambda_{t+1} = lam_0 I + lam * sum_{i <= t+1} G_i(mu_{t+1})   (needs old data)
    EWC Laplace (Eq. 5.26):          penalty sum_i (1/2) (theta - mu_i)^T lam G_i(mu_i) (theta - mu_i)

where ``G_i`` is the curvature of task i's SUMMED log-likelihood, ``N_i`` times its per-datum mean
(stored as per-datum factors and the coefficient ``lam * N_i``), either Kronecker-factored per block
(``structure='kron'``, Eq. 5.14's ``G_{i,l} (x) A_{i,l}`` in PyTorch's output-first layout) or diagonal
(``structure='diag'``). The penalty's gradient for a Kronecker block is

    sum_i lam N_i G_i (W_hat - M_i) A_i + lam_0 (W_hat - M_0)

computed for all stored tasks at once with batched matrix products and never a Kronecker product
(:class:`_KroneckerQuadratic`: the forward pass computes this gradient and the value
``(1/2) <W_hat - M, gradient>``, the backward pass only scales it). ``W_hat`` is the block's matrix view of
its parameters (:func:`curvkit.linalg.kron.block_matrix`): ``[W | b]`` of a Linear or Conv layer, and on the
other layer kinds of the Kronecker engine (:mod:`curvkit.layerkinds`) ``W^T`` of an Embedding (its A the
diagonal of token counts, a vector: ``G D diag(A)``), the query/key/value rows of a packed attention weight,
one group of a grouped convolution, and the (1, P) row of a normalisation layer's or a raw parameter's
per-sample-gradient block (``G`` the (1, 1) scale).

Storage (Sec. 5.3.1): sums of Kronecker products do not factorise, so ``memory='per_task'`` keeps one
(G, A) pair per task per layer (memory and cost grow with the tasks, as in the thesis's experiments);
``memory='summed'`` keeps one pair, the constant-memory approximation the thesis mentions without
experiments: ``(sum_i c_i) (sum_i w_i G_i) (x) (sum_i w_i A_i)`` with weights ``w_i = c_i / sum_j c_j``
(our choice where the thesis only says "adding up the Kronecker factors separately": exact when all tasks
share their factors, and the total curvature scale ``sum_i c_i`` is kept). Diagonal curvature adds
exactly, so ``memory`` only matters for ``kron``.

Choices where the thesis is silent (digest ambiguities): the prior precision ``lam_0`` is on the
summed-loss scale (default 1e-2, the only prior precision the thesis states, Sec. 5.2.2) and is part of
the task-1 objective; Online and Non-Online Laplace centre it at the latest mode (it is part of
Lambda_t), EWC keeps it at the prior mean 0 (EWC's penalties are the tasks' likelihood terms only); the
multiplier ``lam`` also multiplies the Non-Online curvature for comparability; the per-datum curvature
of ``kron`` defaults to KFLR (exact output factor) and of ``diag`` to the exact GGN diagonal.

Units. With ``reduction='mean'`` the penalty is divided by the CURRENT task's training-set size
(``task_size``, changed with :meth:`LaplacePenalty.set_task_size`), so it adds to a mean-reduced data
loss as :class:`curvkit.continual.penalties.Penalty` requires; ``'sum'`` adds it to a summed loss. Sizes
count LOSS TERMS, what a mean-reduced loss divides by: examples for (B, C) outputs, counted positions
(tokens, time steps without padding) for outputs with positions (B, *P, C); ``N_i`` times the curvature of
the mean loss over task i's terms is the curvature of its summed loss.

Multi-head models: penalise only the shared parameters (``params=``); when the model has a
``set_task(i)`` method (:class:`MultiHead`) the penalty selects task i's head while it computes task i's
curvature.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from curvkit import layerkinds, precision
from curvkit.continual.learners import TorchLearner
from curvkit.continual.penalties import Penalty
from curvkit.curvature import estimators
from curvkit.curvature.config import CurvatureConfig, NormStructure, WeightSharing
from curvkit.curvature.diagonal_estimator import DiagonalEstimator
from curvkit.curvature.estimators import KroneckerEstimator, OptionWords, wide_blocks
from curvkit.laplace._subset import only_trainable
from curvkit.likelihoods import CrossEntropy, Likelihood
from curvkit.linalg.kron import Index, LowRankFactor, block_matrix, write_block_matrix
from curvkit.structure import LayerInfo, curvature_kernels, read_model, uncompiled
from curvkit.validation import (
    input_tensors,
    inputs_to,
    integer,
    nonnegative,
    num_samples,
    positive,
    take_samples,
)

__all__ = ["LRDecayLearner", "LaplacePenalty", "MultiHead", "decayed_lr"]

Mode = Literal["online", "non_online", "ewc"]
TaskData = Callable[[int], Any]


def decayed_lr(lr0: float, k: float, task: int) -> float:
    """The per-task learning rate ``lr0 / (1 + k t)`` of thesis Sec. 5.4.1 (t = 0 for the first task)."""
    return positive("lr0", lr0) / (1.0 + nonnegative("k", k) * integer("task", task, minimum=0))


class MultiHead(nn.Module):
    """A shared trunk and one output head per task (thesis Sec. 5.4.3): ``forward(x)`` uses the head of
    the active task, set with :meth:`set_task`. Parameters: ``trunk.*`` and ``heads.<i>.*``."""

    def __init__(self, trunk: nn.Module, heads: Sequence[nn.Module]):
        super().__init__()
        if not heads:
            raise ValueError("MultiHead needs at least one head")
        self.trunk, self.heads = trunk, nn.ModuleList(heads)
        self.task = 0

    def set_task(self, task: int) -> None:
        if not 0 <= int(task) < len(self.heads):
            raise IndexError(f"task {task} out of range [0, {len(self.heads)})")
        self.task = int(task)

    def forward(self, x: Tensor) -> Tensor:
        return self.heads[self.task](self.trunk(x))  # type: ignore[no-any-return]

    def shared_parameters(self) -> list[str]:
        """Names of the trunk's parameters (the ones a consolidation penalty should act on)."""
        return [f"trunk.{n}" for n, p in self.trunk.named_parameters() if p.requires_grad]


class _KroneckerQuadratic(torch.autograd.Function):
    """``value = (1/2) sum_t c_t <D_t, G_t D_t A_t> + (lam0/2) ||D_0||^2`` with ``D_t = W_hat - M_t``; the
    gradient ``sum_t c_t G_t D_t A_t + lam0 D_0`` is computed in the forward pass (batched over t)."""

    @staticmethod
    def forward(ctx: Any, W: Tensor, G: Tensor, A: Tensor, coef: Tensor, anchors: Tensor, lam0: float,
                prior_anchor: Tensor, rows: bool) -> Tensor:
        grad, value = _kron_grad_value(W, G, A, coef, anchors, lam0, prior_anchor, rows)
        ctx.save_for_backward(grad)
        ctx.dtype = W.dtype
        return value

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
        (grad,) = ctx.saved_tensors
        return (g * grad).to(ctx.dtype), None, None, None, None, None, None, None


def _kron_grad_value(W: Tensor, G: Tensor, A: Tensor, coef: Tensor, anchors: Tensor, lam0: float,
                     prior_anchor: Tensor, rows: bool = False) -> tuple[Tensor, Tensor]:
    """G (T, o, o) or (T, o) (a diagonal output factor: a pair's token counts), or with ``rows`` the rows R
    (T, r, o) of a low-rank ``G = R^T R`` (a vocabulary-sized output: never an (o, o) matrix); A (T, i, i) or
    (T, i) (a diagonal input factor)."""
    dt = G.dtype  # the statistics' (float32 or wider for a bf16/fp16 model: curvkit.precision)
    W, anchors, prior_anchor = W.to(dt), anchors.to(dt), prior_anchor.to(dt)
    D = W - anchors  # (o, i) for one shared anchor, (T, o, i) per task
    if rows:
        GD = torch.matmul(G.transpose(-1, -2), torch.matmul(G, D))
    else:
        GD = G[:, :, None] * D if G.dim() == 2 else torch.matmul(G, D)
    M = GD * A[:, None, :] if A.dim() == 2 else torch.matmul(GD, A)  # (T, o, i)
    grad = torch.einsum("t,toi->oi", coef, M)
    if D.dim() == 2:
        value = 0.5 * (D * grad).sum()
    else:
        value = 0.5 * torch.einsum("t,toi,toi->", coef, D, M)
    if lam0 > 0:
        D0 = W - prior_anchor
        grad = grad + lam0 * D0
        value = value + 0.5 * lam0 * (D0 * D0).sum()
    return grad, value


def _output(store: dict[str, Tensor]) -> Tensor:
    """A stored block's output factors: G (T, o, o), or the rows "GR" (T, r, o) of a low-rank G = R^T R."""
    return store["GR"] if "GR" in store else store["G"]


def _pad_rows(R: Tensor, r: int) -> Tensor:
    """(T, r', o) rows padded with zero rows to (T, r, o)."""
    return torch.cat([R, R.new_zeros(R.shape[0], r - R.shape[1], R.shape[2])], 1) if R.shape[1] < r else R


#: the estimator's refusals in the penalty's words (``method=``; no ``output_factor``)
_WORDS = OptionWords(sampled="curvature='kfac' or 'empirical'", dense=None)


@dataclass(frozen=True)
class PenaltyBlock:
    """One Kronecker block of the penalty: its label (the store's key), its parameters and the ``index`` of its
    matrix view ``W_hat`` in them (None: ``[W.reshape(out, -1) | b]``; :class:`curvkit.linalg.kron.KroneckerBlock`)."""

    label: str
    weight_name: str
    bias_name: str | None
    index: Index | None
    pair: bool = False  # a tied weight above SHARED_DENSE_LIMIT: two Kronecker terms (the store's G2, A2)


def _batches(data: Any, batch_size: int) -> Iterable[tuple[Any, Tensor]]:
    """One (X, y) pair in batches of ``batch_size`` samples (X a tensor or a mapping of tensors, e.g. a Hugging
    Face batch), or the pairs of an iterable as they come."""
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], (Tensor, Mapping)):
        X, y = data
        for i in range(0, num_samples(X), batch_size):
            yield take_samples(X, slice(i, i + batch_size)), y[i:i + batch_size]
    else:
        yield from data


class LaplacePenalty(Penalty):
    """Online / Non-Online / EWC Laplace penalty (module docstring) for the continual harness.

    Args:
        structure: ``'kron'`` (every layer kind of :mod:`curvkit.layerkinds`; module docstring) | ``'diag'``
            (any differentiable model). (Before curvkit 0.3 this was ``curvature=``; that meaning is kept for
            one release with a ``DeprecationWarning``.)
        mode: ``'online'`` (Eq. 5.25) | ``'non_online'`` (Eq. 5.24) | ``'ewc'`` (Eq. 5.26).
        lam: the curvature multiplier lambda (one value for all tasks).
        prior_precision: lam_0, on the summed-loss scale.
        memory: ``'per_task'`` | ``'summed'`` (kron only; see the module docstring).
        curvature: the curvature source, as in :class:`curvkit.laplace.Laplace`: ``kflr`` (default; ``kfac`` for
            a model with a block of more than :data:`~curvkit.curvature.estimators.LOW_RANK_OUTPUTS` outputs,
            whose output factor is then kept as the rows of its exact low-rank form) / ``kfac`` / ... for kron,
            ``ggn`` (default) / ``mc_fisher`` / ``empirical`` for diag (``method=``: its former name, one release
            with a ``DeprecationWarning``).
        mc_samples: sampled labels per datum (kfac, mc_fisher).
        likelihood: the task likelihood (default softmax cross-entropy).
        batch_size: batch size of the curvature pass when the data is one (X, y) pair.
        reduction: ``'mean'`` (divide by the current task size) | ``'sum'``.
        task_size: the current task's training-set size in loss terms (examples; counted positions for
            sequence outputs; required for ``'mean'``; also N_i when :meth:`on_task_end` is given a sample of
            the task, as the continual runner does).
        params: names of the parameters to penalise (default: every trainable parameter at the first
            call); for ``kron`` each must belong to a layer kind of the Kronecker engine (a weight and its bias
            together).
        task_data: ``task_data(i) -> (X, y) or batches`` of task i, required by ``'non_online'``.
        seed: seed of sampled labels.
        weight_sharing, norm_structure, parameter_structure: the Kronecker statistics' options (kron only;
            :class:`curvkit.curvature.CurvatureConfig`, same names and defaults as every entry point).
    """

    def __init__(self, *, structure: Literal["kron", "diag"] = "kron", curvature: str | None = None,
                 mode: Mode = "online", lam: float = 1.0,
                 prior_precision: float = 1e-2, memory: Literal["per_task", "summed"] = "per_task",
                 method: str | None = None, mc_samples: int = 1, likelihood: Likelihood | None = None,
                 batch_size: int = 250, reduction: Literal["mean", "sum"] = "mean", task_size: int | None = None,
                 params: Sequence[str] | None = None, task_data: TaskData | None = None, seed: int = 0,
                 weight_sharing: WeightSharing = "expand", norm_structure: NormStructure = "full",
                 parameter_structure: NormStructure = "diag"):
        #: the Kronecker statistics' options (:class:`curvkit.curvature.CurvatureConfig`, validated there)
        self.config = CurvatureConfig(weight_sharing=weight_sharing, norm_structure=norm_structure,
                                      parameter_structure=parameter_structure, mc_samples=mc_samples)
        if curvature in ("kron", "diag"):  # the former meaning of curvature= (one release)
            warnings.warn(f"LaplacePenalty(curvature={curvature!r}) named the structure: pass structure={curvature!r} "
                          "(curvature= is the curvature source, 'kflr', 'ggn', ..., as in Laplace); the old meaning "
                          "goes in the next release", DeprecationWarning, stacklevel=2)
            if structure not in ("kron", curvature):
                raise ValueError(f"LaplacePenalty: structure={structure!r} and curvature={curvature!r} (its former "
                                 "name) disagree; pass structure only")
            structure, curvature = curvature, None  # type: ignore[assignment]
        if method is not None:
            warnings.warn("LaplacePenalty(method=...) is renamed curvature=... (as in Laplace); the old name goes in "
                          "the next release", DeprecationWarning, stacklevel=2)
            if curvature is not None and curvature != method:
                raise ValueError(f"LaplacePenalty: curvature={curvature!r} and method={method!r} name one option; "
                                 "pass curvature only")
            curvature = method
        if structure not in ("kron", "diag"):
            raise ValueError(f"structure must be 'kron' or 'diag', got {structure!r}")
        if mode not in ("online", "non_online", "ewc"):
            raise ValueError(f"mode must be 'online', 'non_online' or 'ewc', got {mode!r}")
        if memory not in ("per_task", "summed"):
            raise ValueError(f"memory must be 'per_task' or 'summed', got {memory!r}")
        if memory == "summed" and mode == "ewc":
            raise ValueError("EWC keeps one anchor per task; memory='summed' needs one anchor (online/non_online)")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        if reduction == "mean" and task_size is None:
            raise ValueError("reduction='mean' divides the penalty by the current task's training-set size: pass "
                             "task_size (and call set_task_size when it changes)")
        if mode == "non_online" and task_data is None:
            raise ValueError("Non-Online Laplace recomputes every earlier task's curvature: pass task_data")
        self.structure, self.mode, self.memory = structure, mode, memory
        self.lam, self.lam0 = positive("lam", lam), nonnegative("prior_precision", prior_precision)
        default = "kflr" if structure == "kron" else "ggn"
        #: the curvature source (``method`` is its former name)
        self.curvature = self.method = default if curvature is None else curvature
        #: the default kflr becomes kfac for a model with a vocabulary-sized output (its output factor stays thin)
        self._default_method = curvature is None
        self.mc_samples, self.batch_size = self.config.mc_samples, integer("batch_size", batch_size)
        self.likelihood = likelihood if likelihood is not None else CrossEntropy()
        self.reduction = reduction
        self.task_size = None if task_size is None else integer("task_size", task_size)
        self.params = None if params is None else list(params)
        self.task_data, self.seed = task_data, int(seed)
        self.tasks_seen = 0
        self.sizes: list[int] = []
        # kron: block label -> {"G": (T, o, o) or "GR": (T, r, o) (the rows of a low-rank G = R^T R: a vocabulary-
        # sized output), "A": (T, i, i) | (T, i), "coef": (T,), "anchor": (o, i) | (T, o, i)}
        # diag: param name -> {"F": (T, *shape), "coef": (T,), "anchor": shape | (T, *shape)}
        self.store: dict[str, dict[str, Tensor]] = {}
        self._layers: list[PenaltyBlock] | list[LayerInfo] | None = None

    # ------------------------------------------------------------------ set-up
    def set_task_size(self, n: int) -> None:
        """The training-set size of the task now being learnt (the mean-loss scale)."""
        self.task_size = integer("task_size", n)

    def _names(self, model: nn.Module) -> list[str]:
        if self.params is None:
            self.params = [n for n, p in model.named_parameters() if p.requires_grad]
        own = dict(model.named_parameters())
        missing = [n for n in self.params if n not in own]
        if missing:
            raise ValueError(f"penalised parameter(s) {missing} are not parameters of the model")
        frozen = [n for n in self.params if not own[n].requires_grad]
        if frozen:
            raise ValueError(f"penalised parameter(s) {frozen} are frozen (requires_grad=False); a frozen parameter "
                             "gets no curvature and no penalty: leave it out of params")
        return self.params

    def layers(self, model: nn.Module) -> list[Any]:
        """The penalised blocks (``kron``: one :class:`PenaltyBlock` per block of the Kronecker engine's layer
        kinds, for the parameters in ``params``; a tied weight's uses: one block, their sum; an unsupported layer is refused, naming it) or
        layers (``diag``)."""
        model = uncompiled(model)  # a compiled model: the module it compiles (same parameters)
        if self._layers is None:
            names = self._names(model)
            with only_trainable(model, names):
                structure = read_model(model)
                if self.structure == "kron":
                    plans = layerkinds.plan(structure, "Kronecker Laplace penalty")
                    specs = [spec for lp in plans for spec in lp.blocks]
                    order = [n for n, _ in model.named_parameters()]
                    blocks: list[PenaltyBlock] = []
                    for members in layerkinds.shared_groups(plans, set(structure.shared_parameters)):
                        if len(members) == 1:
                            spec = specs[members[0]]
                            blocks.append(PenaltyBlock(spec.label, spec.weight, spec.bias, spec.index))
                            continue
                        # a shared parameter's uses: one dense block, their sum (curvkit.linalg.kron.dense_sum),
                        # or above the limit two Kronecker terms in the first use's view (the estimator's pair)
                        names = sorted({n for i in members for n in specs[i].names}, key=order.index)
                        size = sum(int(model.get_parameter(n).numel()) for n in names)
                        label = layerkinds.sum_label(plans, members)
                        if size > estimators.SHARED_DENSE_LIMIT:
                            terms_of = estimators.shared_terms([specs[i] for i in members])
                            if terms_of is None:
                                raise ValueError(
                                    f"Kronecker Laplace penalty: {', '.join(names)} are shared by {label} and have "
                                    f"{size} entries, more than SHARED_DENSE_LIMIT = {estimators.SHARED_DENSE_LIMIT}, "
                                    "in uses that are not a head and lookups of its table; freeze or untie the "
                                    "shared parameter, or use structure='diag'")
                            first = specs[members[terms_of[0]]]
                            blocks.append(PenaltyBlock(label, first.weight, first.bias, first.index, pair=True))
                            continue
                        device = model.get_parameter(names[0]).device
                        blocks.append(PenaltyBlock(label, names[0],
                                                   names[1] if len(names) > 1 else None,
                                                   torch.arange(size, device=device)[None, :]))
                    self._layers = blocks
                else:
                    self._layers = list(structure.layers)
        return self._layers

    # ------------------------------------------------------------------ penalty
    def _scale(self) -> float:
        if self.reduction == "sum":
            return 1.0
        assert self.task_size is not None
        return 1.0 / self.task_size

    def loss(self, model: nn.Module) -> Tensor:
        model = uncompiled(model)  # a compiled model: the module it compiles (same parameters)
        named = dict(model.named_parameters())
        p0 = named[self._names(model)[0]]
        total = torch.zeros((), dtype=precision.statistics_dtype(p0.dtype), device=p0.device)
        if self.structure == "kron":
            for lay in self.layers(model):
                W = block_matrix(lay, named)
                s = self.store.get(lay.label)
                if s is None:  # before the first task ends: the prior only
                    total = total + 0.5 * self.lam0 * (W * W).sum()
                    continue
                total = total + _KroneckerQuadratic.apply(W, _output(s), s["A"], s["coef"], s["anchor"], self.lam0,
                                                          self._prior_anchor(s["anchor"], W), "GR" in s)
                if "G2" in s:  # a pair's second term (the prior is counted once, above)
                    total = total + _KroneckerQuadratic.apply(W, s["G2"], s["A2"], s["coef"], s["anchor"], 0.0, W,
                                                              False)
        else:
            for n in self._names(model):
                p = named[n]
                s = self.store.get(n)
                if s is None:
                    total = total + 0.5 * self.lam0 * (p * p).sum()
                    continue
                D = p - s["anchor"]  # shape, or (T, *shape) with one anchor per task
                cF = s["F"] * s["coef"].reshape(-1, *[1] * p.dim())
                D0 = p - self._prior_anchor(s["anchor"], p)
                total = total + 0.5 * ((cF * D * D).sum() + self.lam0 * (D0 * D0).sum())
        return total * self._scale()

    def _prior_anchor(self, anchor: Tensor, W: Tensor) -> Tensor:
        if self.mode == "ewc":
            return torch.zeros_like(W)
        return anchor

    def gradient(self, model: nn.Module) -> list[Tensor]:
        """The analytic penalty gradient ``sum_i lam N_i G_i (W_hat - M_i) A_i + lam_0 (W_hat - M_0)`` (scaled as
        :meth:`loss`), one tensor per penalised parameter in ``params`` order, without autograd."""
        model = uncompiled(model)  # a compiled model: the module it compiles (same parameters)
        named = {n: p.detach() for n, p in model.named_parameters()}
        out: dict[str, Tensor] = {}
        if self.structure == "kron":
            out = {n: torch.zeros_like(named[n], memory_format=torch.contiguous_format) for n in self._names(model)}
            for lay in self.layers(model):
                W = block_matrix(lay, named)
                s = self.store.get(lay.label)
                g = self.lam0 * W if s is None else _kron_grad_value(
                    W, _output(s), s["A"], s["coef"], s["anchor"], self.lam0, self._prior_anchor(s["anchor"], W),
                    "GR" in s)[0]
                if s is not None and "G2" in s:
                    g = g + _kron_grad_value(W, s["G2"], s["A2"], s["coef"], s["anchor"], 0.0, W)[0]
                write_block_matrix(lay, g, out)
        else:
            for n in self._names(model):
                p, s = named[n], self.store.get(n)
                if s is None:
                    out[n] = self.lam0 * p
                    continue
                cF = s["F"] * s["coef"].reshape(-1, *[1] * p.dim())
                out[n] = (cF * (p - s["anchor"])).sum(0) + self.lam0 * (p - self._prior_anchor(s["anchor"], p))
        return [(out[n] * self._scale()).to(named[n].dtype) for n in self._names(model)]

    # ------------------------------------------------------------------ consolidation
    def on_task_end(self, model: nn.Module, data: Any) -> None:
        """The task that just ended: its curvature at the current parameters joins the precision. ``data``
        is an (X, y) pair or an iterable of batches of that task; N_i is ``task_size`` when set (the data
        may be a sample of the task), else the number of loss terms in ``data`` (its examples; its counted
        positions for sequence outputs)."""
        model = uncompiled(model)  # a compiled model: the module it compiles (same parameters)
        self.consolidate(model, data, num_data=self.task_size)

    def consolidate(self, model: nn.Module, data: Any, num_data: int | None = None) -> None:
        """As :meth:`on_task_end`, with N_i given explicitly (default: the number of loss terms seen)."""
        model = uncompiled(model)  # a compiled model: the module it compiles (same parameters)
        task = self.tasks_seen
        stats, count = self._task_curvature(model, data, task)
        n_i = count if num_data is None else integer("num_data", num_data)
        self.sizes.append(n_i)
        anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
        if self.mode == "non_online":
            assert self.task_data is not None
            all_stats = []
            for j in range(task):
                s_j, _ = self._task_curvature(model, self.task_data(j), j)
                all_stats.append(s_j)
            all_stats.append(stats)
            self.store = {}
            for j, s_j in enumerate(all_stats):
                self._add(model, s_j, self.lam * self.sizes[j], anchor)
        else:
            self._add(model, stats, self.lam * n_i, anchor)
        self.tasks_seen += 1

    def _task_curvature(self, model: nn.Module, data: Any, task: int) -> tuple[dict[str, Any], int]:
        select = getattr(model, "set_task", None)
        previous = getattr(model, "task", None)
        if callable(select):
            select(task)
        names = self._names(model)
        lik = self.likelihood.with_reduction("mean")
        try:
            with only_trainable(model, names):
                est: Any
                if self.structure == "kron":
                    self.layers(model)  # refuses what the penalty cannot take, in its own words
                    if self._default_method and self.method == "kflr" and wide_blocks(
                            layerkinds.plan(read_model(model), "Kronecker Laplace penalty")):
                        self.curvature = self.method = "kfac"  # a vocabulary-sized output: exactly low-rank G
                    est = KroneckerEstimator(model, lik, self.method, config=self.config,  # type: ignore[arg-type]
                                             seed=self.seed + 7919 * task, option_words=_WORDS)
                else:
                    est = DiagonalEstimator(model, lik, self.method, mc_samples=self.mc_samples,  # type: ignore[arg-type]
                                            seed=self.seed + 7919 * task)
                was_training = model.training
                model.eval()
                try:
                    for i, (X, y) in enumerate(_batches(data, self.batch_size)):
                        p = next(model.parameters())
                        X, y = inputs_to(X, p.device), y.to(p.device)
                        self._check_batch(model, X, y, i)
                        est.update((X, y))
                finally:
                    model.train(was_training)
                op = est.operator()
        finally:
            if callable(select) and previous is not None:
                select(previous)
        if self.structure == "kron":
            stats = {est.blocks[m[0]][1].label if len(m) == 1 else layerkinds.sum_label(est.plans, m):
                     (b.G, b.A, b.second) for m, b in zip(est.members, op.blocks)}
        else:
            stats = dict(zip(op.layout.names, op.tensors))
        return stats, int(est.num_terms)

    def _check_batch(self, model: nn.Module, X: Any, y: Tensor, i: int) -> None:
        """Refuse, naming it, what the curvature pass would misread: NaN or inf in a batch, and (on the first
        batch, one forward pass without autograd) outputs that are not one tensor of logits - a tuple, or
        probabilities for a softmax likelihood."""
        for what, t in (*input_tensors(X), ("y", y)):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"LaplacePenalty: batch {i} {what} contains NaN or inf "
                                 f"({int((~torch.isfinite(t)).sum())} of {t.numel()} entries); nothing was changed")
        if i:
            return
        with torch.no_grad(), curvature_kernels():
            f = model(X)
        if not isinstance(f, Tensor):
            raise TypeError(f"LaplacePenalty: the model must return its outputs (logits) as one tensor of shape "
                            f"(batch, [positions...,] outputs), got {type(f).__name__}; wrap it in a module that "
                            "returns the logits")
        self.likelihood.check_logits(f, "LaplacePenalty")

    def _add(self, model: nn.Module, stats: dict[str, Any], c: float, anchor: dict[str, Tensor]) -> None:
        per_task_anchor = self.mode == "ewc"
        if self.structure == "kron":
            for lay in self.layers(model):
                G, A, second = stats[lay.label]
                a = block_matrix(lay, anchor)
                if isinstance(G, LowRankFactor):  # a vocabulary-sized output: its rows R, G = R^T R
                    if G.c != 0 or not bool((G.s >= 0).all()):
                        raise ValueError(f"LaplacePenalty: the low-rank output factor of {lay.label!r} is not a "
                                         "Gram matrix of rows (c = 0, s >= 0)")
                    new = {"GR": (G.U * G.s.sqrt()).T, "A": A}
                else:
                    new = {"G": G, "A": A}
                if second is not None:  # a pair: its second term (G2 an (o,) vector or (o, o), A2) beside it
                    new.update(G2=second[0], A2=second[1])
                self.store[lay.label] = self._append(self.store.get(lay.label), new, c, a,
                                                     per_task_anchor, summed=self.memory == "summed")
        else:
            for n in self._names(model):
                self.store[n] = self._append(self.store.get(n), {"F": stats[n]}, c, anchor[n], per_task_anchor,
                                             summed=not per_task_anchor)

    @staticmethod
    def _append(old: dict[str, Tensor] | None, new: dict[str, Tensor], c: float, anchor: Tensor,
                per_task_anchor: bool, summed: bool) -> dict[str, Tensor]:
        coef = torch.tensor([c], dtype=anchor.dtype, device=anchor.device)
        fresh = {k: v[None] for k, v in new.items()}
        if old is None:
            out = {**fresh, "coef": coef}
        elif summed:  # one (weighted-mean) set of factors with the total coefficient
            total = old["coef"] + coef
            out = {k: (old[k] * old["coef"].reshape(-1, *[1] * (v.dim() - 1)) + fresh[k] * c) / total.reshape(
                -1, *[1] * (v.dim() - 1)) for k, v in fresh.items() if k != "GR"}
            if "GR" in fresh:  # the weighted mean of R_i^T R_i: the rows of both, scaled by sqrt(weight)
                out["GR"] = torch.cat([old["GR"] * (old["coef"] / total).sqrt(), fresh["GR"] * (c / total).sqrt()], 1)
            out["coef"] = total
        else:
            if "GR" in fresh:  # tasks with fewer rows get zero rows (R^T R unchanged)
                r = max(old["GR"].shape[1], fresh["GR"].shape[1])
                old = {**old, "GR": _pad_rows(old["GR"], r)}
                fresh = {**fresh, "GR": _pad_rows(fresh["GR"], r)}
            out = {k: torch.cat([old[k], fresh[k]]) for k in fresh}
            out["coef"] = torch.cat([old["coef"], coef])
        if per_task_anchor:
            out["anchor"] = anchor[None] if old is None else torch.cat([old["anchor"], anchor[None]])
        else:
            out["anchor"] = anchor
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"tasks_seen": self.tasks_seen, "sizes": list(self.sizes), "task_size": self.task_size,
                "params": None if self.params is None else list(self.params),
                "store": {k: dict(v) for k, v in self.store.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tasks_seen, self.sizes = int(state["tasks_seen"]), list(state["sizes"])
        self.task_size = state["task_size"]
        self.params = None if state["params"] is None else list(state["params"])
        self.store = {k: dict(v) for k, v in state["store"].items()}
        self._layers = None

    def curvature_bound(self) -> float:
        """An upper bound on the largest eigenvalue of the penalty's Hessian (in the units of :meth:`loss`):
        the Hessian is block-diagonal over layers, and per layer
        ``lambda_max(sum_i c_i G_i (x) A_i) <= sum_i c_i lambda_max(G_i) lambda_max(A_i)``, plus lam_0."""
        worst = 0.0
        for s in self.store.values():
            if "G" in s or "GR" in s:
                R = s.get("GR")
                lg = torch.linalg.eigvalsh(s["G"])[:, -1] if R is None else torch.linalg.eigvalsh(
                    R @ R.transpose(1, 2))[:, -1]  # lambda_max(R^T R) = lambda_max(R R^T), (r, r)
                la = s["A"].amax(-1) if s["A"].dim() == 2 else torch.linalg.eigvalsh(s["A"])[:, -1]  # (T, i): diagonal
                bound = s["coef"] * lg * la
                if "G2" in s:  # a pair's second term: its own bound, added
                    G2, A2 = s["G2"], s["A2"]
                    bound = bound + s["coef"] * (G2.amax(-1) if G2.dim() == 2 else torch.linalg.eigvalsh(G2)[:, -1]) * (
                        A2.amax(-1) if A2.dim() == 2 else torch.linalg.eigvalsh(A2)[:, -1])
                worst = max(worst, float(bound.sum()))
            else:
                worst = max(worst, float((s["coef"].reshape(-1, *[1] * (s["F"].dim() - 1)) * s["F"]).sum(0).max()))
        return (worst + self.lam0) * self._scale()

    def memory_numel(self) -> int:
        """Scalars stored (factors, coefficients, anchors): grows with the tasks for ``per_task``."""
        return sum(int(t.numel()) for s in self.store.values() for t in s.values())


class LRDecayLearner(TorchLearner):
    """:class:`~curvkit.continual.learners.TorchLearner` whose learning rate is reset at every task boundary
    to ``lr0 / (1 + k t)`` (thesis Sec. 5.4.1; t = index of the task that starts), for the continual runner.
    The learning rate lives in the optimiser's state, so the runner's checkpoints resume it."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, penalty: Penalty | None = None,
                 k: float = 0.0):
        super().__init__(model, optimizer, penalty)
        self.lr0 = float(optimizer.param_groups[0]["lr"])
        self.k = nonnegative("k", k)
        if math.isnan(self.lr0):
            raise ValueError("the optimiser's lr is NaN")

    def on_task_end(self, task: int, data: tuple[Tensor, Tensor]) -> None:
        super().on_task_end(task, data)
        for g in self.optimizer.param_groups:
            g["lr"] = decayed_lr(self.lr0, self.k, task + 1)
