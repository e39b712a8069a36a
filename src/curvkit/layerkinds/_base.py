"""What a layer-kind handler is: the blocks it owns and the rows it hands the Kronecker estimators.

A handler knows one kind of module (``nn.Linear``, a convolution, ``nn.Embedding``, a normalisation layer,
``nn.MultiheadAttention``, ...) and nothing about curvature estimation. For a module of its kind it says

* which parameters it owns (:meth:`LayerHandler.owned`, attribute paths relative to the module: an
  attention module owns ``out_proj.weight`` too), and which configurations it refuses (:meth:`check`);
* its curvature **blocks** (:class:`BlockSpec`): each one a matrix view ``W_hat`` (out, in_aug) of some
  of the parameters' entries, given as an ``index`` into them (see :class:`curvkit.linalg.kron.KroneckerBlock`),
  and how its statistics are formed (``form``);
* per forward pass, one :class:`Site` per block (:meth:`attach` installs the hooks that emit them): the
  block's INPUT ROWS ``(B, R, in)`` in the weight-sharing format (R positions share the weight: tokens,
  patches, time steps; R = 1 without sharing), or token ids ``(B, R)`` for a diagonal input factor, and
  a tensor on the autograd graph whose gradient the estimator reads back as the block's OUTPUT ROWS
  ``(B, R, out)`` (``form='kron'``) or as per-sample gradients ``(B, P)`` of the block's parameters
  (``form='grad'``: normalisation layers, whose blocks are exact).

Everything after that point (expand/reduce, the vectors back-propagated, scales, the operator) is written
once in :mod:`curvkit.curvature.estimators` and has no layer kinds in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from curvkit.linalg.kron import Index
from curvkit.structure import UnsupportedModelError, refuse

__all__ = ["BlockSpec", "Emit", "LayerHandler", "Site", "UnfoldedSite", "batch_of", "recording", "replay",
           "replaying", "row_index"]

Form = Literal["kron", "grad"]

_ROW_INDICES: dict[int, Tensor] = {}
_ROW_INDEX_KEPT = 1 << 16  # larger rows are made per plan (8 bytes an entry; their check costs as much anyway)


def row_index(P: int) -> Tensor:
    """``arange(P)[None, :]`` on the CPU, the index of a ``form='grad'`` block that reads its P parameter entries
    in order (a normalisation layer's [scale | shift], a raw parameter). ONE tensor per P, shared by every plan,
    never modified: the checked index maps of the operators (:func:`curvkit.linalg.block_index._build_index`)
    are kept by the identity of such indices, so a fresh estimator of the same model finds them built (2.5 ms
    of a byte-GPT's 58 ms refresh). Made outside inference mode (an inference tensor cannot index autograd ops)."""
    ix = _ROW_INDICES.get(P)
    if ix is None:
        with torch.inference_mode(False):
            ix = torch.arange(P, device="cpu")[None, :]
        if P <= _ROW_INDEX_KEPT:
            ix = _ROW_INDICES.setdefault(P, ix)
    return ix


@dataclass(frozen=True)
class BlockSpec:
    """One curvature block of a layer.

    Attributes:
        label: a name for messages and keys: the layer's label, plus which part (``'attn.q'``,
            ``'conv.group1'``) where a layer has several blocks.
        weight: canonical name of the block's first parameter (the weight, or a norm's scale).
        bias: canonical name of its second parameter (the bias), or None.
        out_features: rows of ``W_hat`` (1 for ``form='grad'``).
        in_features: columns of ``W_hat`` without the bias column (the vocabulary for token ids; all
            parameter entries P for ``form='grad'``).
        form: ``'kron'`` (G from output rows, A from input rows) or ``'grad'`` (a block from per-sample
            gradients; G is the (1, 1) unit).
        ids: the input rows are token ids (a one-hot input): the input factor is diagonal (token counts).
        index: positions (out, in_aug) of ``W_hat``'s entries in ``[weight.flatten(), bias.flatten()]``
            (:class:`curvkit.linalg.kron.KroneckerBlock`): None for the standard ``[W.reshape(out, -1) | b]``
            (bias column appended by the estimator), a :class:`~curvkit.linalg.kron.StridedIndex` for a
            transposed view or a row slice (no integer map of the weight's size), or an integer tensor.
        sharing: how the estimator may treat positions: ``'any'`` (expand or reduce, the estimator's
            keyword) or ``'expand'`` (always expand; an embedding's reduce input factor would be a dense
            V x V matrix of count products).
        roles: the attribute paths (relative to the layer) of the block's parameters, in order, where the
            handler needs them (e.g. ``('bias',)`` for a norm layer whose scale is frozen).
    """

    label: str
    weight: str
    bias: str | None
    out_features: int
    in_features: int
    form: Form = "kron"
    ids: bool = False
    index: Index | None = None
    sharing: Literal["any", "expand"] = "any"
    roles: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.weight,) if self.bias is None else (self.weight, self.bias)


@dataclass
class Site:
    """What one call of a layer gives one of its blocks.

    Attributes:
        block: the position of the block in the layer's :meth:`LayerHandler.blocks` list.
        inputs: detached input rows (B, R, in) without a bias column (``form='kron'``), token ids (B, R)
            (``ids``; -1 marks a position that selects no trainable row, e.g. ``padding_idx``), or whatever
            ``read`` needs (``form='grad'``).
        output: a tensor on the autograd graph (the layer's output, or an intermediate of it).
        read: the gradient of ``output`` -> output rows (B, R, out) (``form='kron'``) or per-sample
            gradients (B, P) of the block's parameters, in its index order (``form='grad'``).
        shared: ``output`` has no batch dimension: one output that every sample uses (T5's relative attention
            bias, looked up on (T, T) buckets and broadcast over the batch by the model), so its gradient is the
            samples' sum. ``read`` then takes the PER-SAMPLE gradients (B, *output.shape), which the consumers
            get from one batched backward pass of the per-sample parts of their output vectors
            (:func:`curvkit.curvature.capture.per_sample_grads`).
    """

    block: int
    inputs: Tensor
    output: Tensor
    read: Callable[[Tensor], Tensor]
    shared: bool = False

    def release(self) -> None:
        """Drop what the site holds besides its output's place in the graph (its input rows and the reader,
        whose closure may hold the layer input: a normalisation layer's), once its consumer has read the last
        gradient it will read, so that a layer input the backward pass has finished with is freed there, as
        in a plain training pass. The site cannot be read afterwards."""
        self.inputs = self.output.new_empty(self.samples(), 0)
        self.read = _released

    def samples(self) -> int:
        """B, the number of samples of the rows."""
        return int(self.inputs.shape[0])


class UnfoldedSite(Site):
    """A :class:`Site` whose input rows are formed only when read (a convolution's unfolded patches, many
    times the size of the layer input): :attr:`inputs` forms the rows of every sample on first access and
    keeps them; :meth:`sample_rows` forms those of a range of samples without keeping them, so a consumer
    can reduce them chunk by chunk (the Kronecker estimators' input statistic).

    Args:
        rows: ``rows(lo, hi)`` -> input rows (hi - lo, R, in) of samples lo:hi.
        batch: B.
        row_size: R * in, the scalars of one sample's rows.
        means: ``means()`` -> (B, in) the rows' mean over the R positions of every sample, formed without the
            rows (a convolution's mean patch from strided sums of its input), or None.
    """

    def __init__(self, block: int, output: Tensor, read: Callable[[Tensor], Tensor],
                 rows: Callable[[int, int], Tensor], batch: int, row_size: int,
                 means: Callable[[], Tensor] | None = None):
        self.block, self.output, self.read = block, output, read
        self._rows, self.batch, self.row_size = rows, batch, row_size
        self._means = means
        self._inputs: Tensor | None = None

    @property  # type: ignore[override]
    def inputs(self) -> Tensor:
        if self._inputs is None:
            self._inputs = self._rows(0, self.batch)
        return self._inputs

    @inputs.setter
    def inputs(self, value: Tensor) -> None:
        """Set the rows (or a stand-in once a consumer has reduced them): the lazy ones are not formed any more,
        so the layer input their closures hold is let go."""
        self._inputs = value
        self._rows = self._means = None  # type: ignore[assignment]

    @property
    def formed(self) -> bool:
        """Whether :attr:`inputs` has been formed (or set)."""
        return self._inputs is not None

    def samples(self) -> int:
        return self.batch

    def sample_rows(self, lo: int, hi: int) -> Tensor:
        """Input rows (hi - lo, R, in) of samples lo:hi (from :attr:`inputs` once formed)."""
        return self._rows(lo, hi) if self._inputs is None else self._inputs[lo:hi]

    def position_means(self) -> Tensor | None:
        """(B, in) the input rows' mean over the positions of each sample (KFAC-reduce's input) without forming
        the rows, or None when the layer kind gives no such shortcut (then: :meth:`sample_rows`)."""
        return None if self._means is None or self._inputs is not None else self._means()


Emit = Callable[[Site], None]


def _released(g: Tensor) -> Tensor:
    raise RuntimeError("this site was released (Site.release): its consumer had read its last gradient")


class LayerHandler:
    """Base class of the handlers (module docstring). Subclasses set :attr:`kind` and implement
    :meth:`blocks` and :meth:`attach`; :meth:`owned` and :meth:`check` have defaults."""

    #: the kind's name in the support table and in errors
    kind: ClassVar[str] = "layer"
    #: capability the routes query (never the kind's name): the sites come from the estimator's own
    #: substitution of per-sample copies ``p.expand(B, ...)`` (:meth:`curvkit.curvature.capture.BlockCapture
    #: .substitute`), not from hooks, so the estimator must run the forward pass itself
    per_sample_copies: ClassVar[bool] = False
    #: capability the routes query: the blocks' statistics read only the layer's inputs and output gradients,
    #: never its parameters, so they are the same when the parameters are FSDP2 ``DTensor`` shards (FSDP2
    #: all-gathers a layer's weight inside its own forward and backward pass; the Kronecker estimators on sharded
    #: models take only such layers)
    takes_shards: ClassVar[bool] = False

    def owned(self, module: nn.Module) -> tuple[str, ...]:
        """Attribute paths (relative to ``module``) of the parameters this handler owns."""
        return tuple(a for a in ("weight", "bias") if getattr(module, a, None) is not None)

    def check(self, module: nn.Module, label: str, what: str) -> None:
        """Raise an :class:`UnsupportedModelError` for a configuration the handler cannot take exactly."""

    def blocks(self, module: nn.Module, label: str, names: Mapping[str, str | None], what: str) -> list[BlockSpec]:
        """The layer's blocks; ``names`` maps each owned attribute path to its canonical parameter name, or
        None when that parameter is frozen (a frozen parameter gets no curvature)."""
        raise NotImplementedError

    def attach(self, module: nn.Module, label: str, blocks: Sequence[BlockSpec], emit: Emit, what: str) -> list[Any]:
        """Install hooks on ``module`` that call ``emit(Site)`` once per block on every forward pass with
        autograd enabled; return the removable handles."""
        raise NotImplementedError

    # ------------------------------------------------------------------ optional capabilities
    # The routes outside the Kronecker estimators ask these questions of a module's handler (never its kind's
    # name or the module's class); a handler answers False where it has no such rule.
    def bilinear(self, module: nn.Module) -> bool:
        """Capability: the module maps one input tensor x to ``op(x, weight) + bias`` with ``op`` linear in x
        and in the weight separately (a Linear layer, a convolution), so :meth:`tangent` gives its forward-mode
        map and its output is linear in its parameters for a fixed input (thesis Lemma 3.23). False here."""
        return False

    def tangent(self, module: nn.Module, x: Tensor, t: Tensor | None, values: Mapping[str, Tensor],
                tangents: Mapping[str, Tensor]) -> Tensor | None:
        """The tangent of a :meth:`bilinear` module's output for k directions at once, at its recorded input x
        (B, ...): ``op(t, W) + op(x, dW) + db``, with t (k, B, ...) the input's tangent (None: zero), ``values``
        the parameters of the recorded pass by attribute path (:meth:`owned`) and ``tangents`` (k, *shape) the
        directions of those that have one (absent: zero, a frozen parameter). Returns (k, B, ...), or None when
        every term is zero (no input tangent, no parameter direction)."""
        raise NotImplementedError(f"the {self.kind} handler has no tangent rule")

    def paired_rows(self, module: nn.Module) -> Literal["samples", "positions"] | None:
        """Capability of the consumers that read a layer's block as its weight matrix (the Kronecker filters):
        the module has ONE block, the standard ``W_hat = [weight.reshape(out, -1) | bias]`` (``index`` None), and
        its site's input rows (B, R, in) and output rows (B, R, out) pair, row by row, into the per-sample (and
        per-position) Fisher samples x (x) delta of that matrix. ``'samples'``: R = 1 unless the input has positions
        (a Linear layer on (B, in)); ``'positions'``: the rows are always positions of a shared weight (a
        convolution's output locations), so there are no rank-1 per-sample gradients. None here."""
        return None

    def squares(self, module: nn.Module, x: Tensor | None = None) -> bool:
        """Capability of the batched-backward exact diagonal: :meth:`squared_gradients` is exact for this
        module's parameters (and, where ``x`` is given, on that input: a Linear layer only without positions,
        (B, in)). False here."""
        return False

    def squared_gradients(self, module: nn.Module, x: Tensor, deltas: Tensor) -> dict[str, Tensor]:
        """sum_{r,n} of the squared per-sample gradients g_{r,n} of the module's ``weight`` and ``bias``
        (attribute path -> a tensor of the parameter's shape), for a :meth:`squares` module with input x (B, ...)
        (detached) and the R batched gradients ``deltas`` (R, B, *output shape) at its output: g_{r,n} is the
        gradient of <deltas[r, n], output_n> with respect to the parameter."""
        raise NotImplementedError(f"the {self.kind} handler has no squared-gradient rule")


def weight_and_bias(module: nn.Module, label: str, names: Mapping[str, str | None], what: str) -> tuple[str | None, str | None]:
    """(weight, bias) canonical names of a layer whose block needs its weight: a trainable bias with a
    frozen weight is refused (the block would have no input factor to pair the bias column with)."""
    w, b = names.get("weight"), names.get("bias")
    if w is None and b is not None:
        raise refuse(what, label, module, "has a trainable bias but a frozen weight",
                     "the Kronecker block needs the weight: freeze both or neither")
    return w, b


def batched_input(module: nn.Module, label: str, x: Any, least: int, what: str, expect: str) -> Tensor:
    """The layer's first input, checked to be a tensor with a batch dimension (at least ``least`` dims)."""
    if not isinstance(x, Tensor) or x.dim() < least:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise UnsupportedModelError(f"{what}: module {label!r} ({type(module).__name__}) got an input of shape "
                                    f"{shape}; its curvature blocks need {expect} (samples first)")
    return x


def batch_of(emit: Emit) -> int | None:
    """The number of samples of the pass ``emit`` records, where its capture knows it."""
    return getattr(getattr(emit, "capture", None), "batch", None)


_REPLAY = [0]  # > 0 while a handler re-runs a module sample by sample (curvkit.layerkinds.generic)


@contextmanager
def replay() -> Iterator[None]:
    """Mark a handler's own re-run of a module: the hooks inside record nothing (their sites belong to the
    pass that is being replaced)."""
    _REPLAY[0] += 1
    try:
        yield
    finally:
        _REPLAY[0] -= 1


def replaying() -> bool:
    """Whether a handler is re-running a module (:func:`replay`)."""
    return _REPLAY[0] > 0


def recording(out: Any) -> bool:
    """Whether a forward pass is one to record: autograd on, the output on the graph, not a replay."""
    return torch.is_grad_enabled() and isinstance(out, Tensor) and out.requires_grad and not replaying()
