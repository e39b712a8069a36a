"""Where a Kronecker block's matrix ``W_hat`` (out, in_aug) sits in the flat parameter vector: the standard
``[W | b]`` view and the transposed view as strides (:class:`StridedIndex`), explicit integer maps otherwise, and
:class:`BlockIndex`, the gather/scatter between a :class:`~curvkit.linalg.layout.ParamLayout` vector and the
blocks (layout conventions: :mod:`curvkit.linalg.kron`)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Protocol

import torch
from torch import Tensor

from curvkit.linalg.layout import ParamLayout


@dataclass(frozen=True)
class StridedIndex:
    """The index of a block whose matrix ``W_hat`` is a row range of the STANDARD or the TRANSPOSED view of a
    weight, held as a few integers (never as an (out, in_aug) integer tensor: 8 bytes per parameter).

    With ``V`` the (rows, cols) view of the weight ``w`` (any shape with ``rows * cols`` entries),

        V = w.reshape(rows, cols)          (standard:   ``nn.Linear``, a convolution's (out, C*kh*kw)),
        V = w.reshape(cols, rows)^T        (transposed: GPT-2's ``Conv1D`` (in, out), an embedding's (V, D)),

    the block's matrix is ``W_hat = [V[start:stop] | b[start:stop]]`` (the bias column only with ``bias``;
    the bias has ``rows`` entries). Entry ``W_hat[o, i]`` (row ``r = start + o``) sits at position
    ``r * cols + i`` (standard) or ``i * rows + r`` (transposed) of ``w.flatten()``, its bias entry at
    ``rows * cols + r`` of ``[w.flatten(), b]`` (:meth:`materialize` writes these out). Slicing rows
    (``index[j * n:(j + 1) * n]``: one q/k/v projection of a packed weight, one convolution group) gives a
    StridedIndex again. :meth:`gather` and :meth:`scatter` read and write ``W_hat`` through views of the
    parameters (a reshape, a transpose, a row slice), so a product never builds an integer map.
    """

    rows: int
    cols: int
    transposed: bool = False
    start: int = 0
    stop: int = -1  # -1: rows
    bias: bool = False

    def __post_init__(self) -> None:
        if self.stop == -1:
            object.__setattr__(self, "stop", self.rows)
        for name in ("rows", "cols", "start", "stop"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise TypeError(f"StridedIndex.{name} must be an int, got {getattr(self, name)!r}")
        if self.rows < 1 or self.cols < 1 or not 0 <= self.start < self.stop <= self.rows:
            raise ValueError(f"StridedIndex: need rows >= 1, cols >= 1 and 0 <= start < stop <= rows, got "
                             f"rows={self.rows}, cols={self.cols}, start={self.start}, stop={self.stop}")

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in_aug) of ``W_hat``."""
        return self.stop - self.start, self.cols + int(self.bias)

    def __getitem__(self, rows: slice) -> StridedIndex:
        """The rows ``rows`` (a slice with step 1) of ``W_hat``, as a StridedIndex."""
        r = range(self.start, self.stop)[rows] if isinstance(rows, slice) else range(0)
        if r.step != 1 or len(r) == 0:
            raise ValueError(f"a StridedIndex takes a non-empty row slice with step 1, got {rows!r}")
        return replace(self, start=r.start, stop=r.stop)

    def materialize(self, device: torch.device | str = "cpu") -> Tensor:
        """The (out, in_aug) int64 positions in ``[w.flatten(), b]`` (for consumers that need positions;
        allocates 8 bytes per entry)."""
        r = torch.arange(self.start, self.stop, device=device)[:, None]
        c = torch.arange(self.cols, device=device)[None, :]
        idx = c * self.rows + r if self.transposed else r * self.cols + c
        return torch.cat([idx, self.rows * self.cols + r], dim=1) if self.bias else idx

    def _weight_view(self, w: Tensor) -> Tensor:
        """The (out, cols, *t) view of ``W_hat``'s weight columns in ``w`` (rows * cols, *t)."""
        t = w.shape[1:]
        V = w.view(self.cols, self.rows, *t).transpose(0, 1) if self.transposed else w.view(self.rows, self.cols, *t)
        return V[self.start:self.stop]

    def gather(self, w: Tensor, b: Tensor | None) -> Tensor:
        """``W_hat`` (out, in_aug, *t) from the flat weight ``w`` (rows * cols, *t) and bias ``b`` (rows, *t)
        (a view of ``w`` without a bias column; differentiable)."""
        W = self._weight_view(w)
        return W if b is None else torch.cat([W, b[self.start:self.stop].unsqueeze(1)], dim=1)

    def scatter(self, X: Tensor, w: Tensor, b: Tensor | None) -> None:
        """Write ``X`` (out, in_aug, *t) into the flat ``w`` (rows * cols, *t) and ``b`` (rows, *t) in place."""
        W, Xw = self._weight_view(w), X[:, :self.cols]
        if W.dim() == 3 and W.shape[2] == 1:  # one column: a 2-D copy (torch's 3-D strided copy is 2x slower)
            W, Xw = W[:, :, 0], Xw[:, :, 0]
        W.copy_(Xw)
        if b is not None:
            b[self.start:self.stop].copy_(X[:, self.cols])

    def state(self) -> dict[str, int | bool]:
        """Plain numbers (``torch.load(weights_only=True)`` reads them); :func:`index_from_state` inverts it."""
        return asdict(self)


#: A block's ``index``: an explicit integer tensor (out, in_aug) or a :class:`StridedIndex`.
Index = Tensor | StridedIndex


def index_state(index: Index | None) -> Tensor | dict[str, int | bool] | None:
    """A block's index in a form a ``weights_only=True`` checkpoint holds (a tensor stays a tensor)."""
    return index.state() if isinstance(index, StridedIndex) else index


def index_from_state(state: Any, device: torch.device | str = "cpu") -> Index | None:
    """The inverse of :func:`index_state` (a tensor is moved to ``device``)."""
    if state is None or isinstance(state, StridedIndex):
        return state
    if isinstance(state, Tensor):
        return state.to(device)
    if isinstance(state, Mapping) and set(state) == {f.name for f in fields(StridedIndex)}:
        return StridedIndex(**state)
    raise ValueError(f"a saved block index must be a tensor, None or a StridedIndex's state "
                     f"({', '.join(f.name for f in fields(StridedIndex))}), got {state!r}")


def standard_index(weight_shape: Sequence[int], bias: bool) -> StridedIndex:
    """The index of ``W_hat = [W.reshape(out, -1) | b]`` (the standard view; :class:`StridedIndex`)."""
    out = int(weight_shape[0])
    return StridedIndex(out, int(math.prod(weight_shape[1:])), bias=bias)


def transposed_index(n_in: int, n_out: int, bias: bool) -> StridedIndex:
    """The index of ``W_hat = [W^T | b]`` (out, in_aug) for a weight ``W`` of shape (in, out) (GPT-2's
    ``Conv1D``, an embedding's (V, D) table; :class:`StridedIndex`)."""
    return StridedIndex(int(n_out), int(n_in), transposed=True, bias=bias)


class BlockView(Protocol):
    """What :func:`block_matrix` and :func:`write_block_matrix` read of a block: its parameters' names and its
    ``index`` (a :class:`KroneckerBlock`, or a consumer's record of one)."""

    @property
    def weight_name(self) -> str: ...

    @property
    def bias_name(self) -> str | None: ...

    @property
    def index(self) -> Index | None: ...


def _view_index(block: BlockView, w: Tensor, b: Tensor | None) -> Index:
    return block.index if block.index is not None else standard_index(w.shape, b is not None)


def block_matrix(block: BlockView, tensors: Mapping[str, Tensor]) -> Tensor:
    """The block's matrix ``W_hat`` (out, in_aug) read from parameter-shaped tensors by name (the parameters,
    their gradients, a direction): views of them for a :class:`StridedIndex` (the standard ``[W | b]`` view
    for None, a transposed weight, a q/k/v or group row slice), else the entries
    ``[w.flatten(), b.flatten()][index]`` (a (1, P) row). Differentiable: autograd reaches ``tensors``.
    Inverse of :func:`write_block_matrix`."""
    w = tensors[block.weight_name]
    b = None if block.bias_name is None else tensors[block.bias_name]
    index = _view_index(block, w, b)
    if isinstance(index, StridedIndex):
        return index.gather(w.reshape(-1), None if b is None else b.reshape(-1))
    flat = w.reshape(-1) if b is None else torch.cat([w.reshape(-1), b.reshape(-1)])
    return flat[index.to(flat.device)]


def write_block_matrix(block: BlockView, M: Tensor, out: MutableMapping[str, Tensor]) -> None:
    """Write ``M`` (out, in_aug), a matrix in the block's ``W_hat`` view, into the parameter-shaped, contiguous
    tensors ``out[weight_name]`` (and ``out[bias_name]``) in place: exactly the entries the block covers are
    set (:func:`block_matrix` reads them back), so the blocks of a parameter split into several (q/k/v,
    convolution groups) fill it together."""
    w = out[block.weight_name]
    b = None if block.bias_name is None else out[block.bias_name]
    index = _view_index(block, w, b)
    if isinstance(index, StridedIndex):
        index.scatter(M, w.view(-1), None if b is None else b.view(-1))
        return
    idx, vals = index.to(w.device).reshape(-1), M.reshape(-1)
    if b is None:
        w.view(-1)[idx] = vals
        return
    in_w = idx < w.numel()
    w.view(-1)[idx[in_w]] = vals[in_w]
    b.view(-1)[idx[~in_w] - w.numel()] = vals[~in_w]


class BlockIndex:
    """Reads and writes a block's ``W_hat`` (out, in_aug) in flat parameter vectors of a layout: through views
    for a :class:`StridedIndex` (None: the standard view), through the flat positions :attr:`perm` for an
    explicit integer index (validated: 2-D, in range)."""

    def __init__(self, layout: ParamLayout, weight_name: str, bias_name: str | None, device: torch.device,
                 index: Index | None = None, label: str | None = None, *,
                 slices: dict[str, slice] | None = None, shapes: dict[str, Any] | None = None):
        slices = layout.slices() if slices is None else slices
        shapes = dict(zip(layout.names, layout.shapes)) if shapes is None else shapes
        wshape = tuple(shapes[weight_name])
        bn = int(math.prod(shapes[bias_name])) if bias_name is not None else 0
        what = label if label is not None else weight_name
        self.weight_name, self.bias_name, self.has_bias = weight_name, bias_name, bias_name is not None
        self._w0, self._wn = slices[weight_name].start, int(math.prod(wshape))
        self._b0 = slices[bias_name].start if bias_name is not None else None
        self._bn, self._device = bn, device
        self.strided: StridedIndex | None = None
        self._local: Tensor | None = None
        if index is None:
            if len(wshape) < 2:
                raise ValueError(f"parameter {weight_name!r} of shape {wshape} is not a weight matrix "
                                 "(need at least 2 dimensions: (out, in) or (out, C, kh, kw)); pass the block "
                                 "an explicit index")
            if bias_name is not None and tuple(shapes[bias_name]) != (wshape[0],):
                raise ValueError(f"bias {bias_name!r} has shape {tuple(shapes[bias_name])}, expected ({wshape[0]},) "
                                 f"to match weight {weight_name!r} of shape {wshape}")
            index = standard_index(wshape, self.has_bias)
        if isinstance(index, StridedIndex):
            if index.rows * index.cols != self._wn or index.bias != self.has_bias or (self.has_bias and bn != index.rows):
                raise ValueError(f"block {what!r}: its {index} needs a weight of {index.rows} x {index.cols} entries"
                                 f"{f' and a bias of {index.rows}' if index.bias else ' and no bias'}, got weight "
                                 f"{weight_name!r} {wshape}" + (f" and bias {bias_name!r} ({bn},)" if self.has_bias
                                                              else " and no bias"))
            self.strided = index
            self.out, self.in_aug = index.shape
        else:
            total = self._wn + bn
            if not isinstance(index, Tensor) or index.dim() != 2 or index.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"block {what!r}: index must be a 2-D integer tensor or a StridedIndex, got "
                                 f"{type(index).__name__ if not isinstance(index, Tensor) else (index.dtype, tuple(index.shape))}")
            if index.numel() and (int(index.min()) < 0 or int(index.max()) >= total):
                raise ValueError(f"block {what!r}: index entries must lie in [0, {total - 1}] (the entries of its "
                                 "parameters), got values outside")
            self.out, self.in_aug = int(index.shape[0]), int(index.shape[1])
            self._local = index.to(device=device, dtype=torch.int64)
        self.in_w = self.in_aug - int(self.has_bias)  # the weight columns
        self._perm: Tensor | None = None
        self.size = self.out * self.in_aug

    @property
    def perm(self) -> Tensor:
        """W_hat row-major position -> flat parameter index (size,). Kept for an explicit index (as large as
        it); built on each use for a :class:`StridedIndex`, whose products never need it (``to_dense`` and
        :func:`block_positions` do)."""
        if self._perm is not None:
            return self._perm
        local = self.strided.materialize(self._device) if self.strided is not None else self._local
        assert local is not None
        loc = local.reshape(-1)
        perm = loc + self._w0
        if self._b0 is not None:
            perm = torch.where(loc < self._wn, perm, loc - self._wn + self._b0)
        if self.strided is None:
            self._perm = perm
        return perm

    def _parts(self, M: Tensor) -> tuple[Tensor, Tensor | None]:
        """The rows of a flat (d, ...) tensor that hold the weight and the bias."""
        b = None if self._b0 is None else M[self._b0:self._b0 + self._bn]
        return M[self._w0:self._w0 + self._wn], b

    def gather(self, M: Tensor) -> Tensor:
        """(d, k) flat -> (out, in_aug, k): column j of M as the matrix W_hat[:, :, j] (a view of M where the
        block is a weight without a bias column)."""
        if self.strided is not None:
            return self.strided.gather(*self._parts(M))
        return M.index_select(0, self.perm).reshape(self.out, self.in_aug, -1)

    def scatter(self, Y: Tensor, out: Tensor) -> None:
        """Write (out, in_aug, k) into the rows of the flat (d, k) ``out`` (any strides)."""
        if self.strided is not None:
            self.strided.scatter(Y.reshape(self.out, self.in_aug, -1), *self._parts(out))
            return
        out.index_copy_(0, self.perm, Y.reshape(self.size, -1))

    @property
    def names(self) -> tuple[str, ...]:
        return (self.weight_name,) if self.bias_name is None else (self.weight_name, self.bias_name)

    def row_view(self, name: str) -> tuple[Any, ...] | None:
        """For a :class:`StridedIndex`, the view whose rows ``[start, stop)`` this block takes of parameter
        ``name``: ``('weight', rows, cols, transposed)`` or ``('bias', rows)``; None for an explicit index."""
        s = self.strided
        if s is None:
            return None
        return ("weight", s.rows, s.cols, s.transposed) if name == self.weight_name else ("bias", s.rows)


def block_positions(layout: ParamLayout, weight_name: str, bias_name: str | None = None, index: Index | None = None,
                    device: torch.device | str = "cpu") -> Tensor:
    """(out, in_aug) flat positions in ``layout`` of the entries of a block's matrix ``W_hat`` (its ``index``
    into ``[weight.flatten(), bias.flatten()]``, or the standard ``[W | b]`` view for None, as
    :class:`KroneckerBlock`): ``flat[block_positions(...)]`` is ``W_hat``. Allocates 8 bytes per entry: to read
    or write a block's part of flat vectors use :class:`BlockIndex`'s ``gather``/``scatter``."""
    ix = BlockIndex(layout, weight_name, bias_name, torch.device(device), index)
    return ix.perm.reshape(ix.out, ix.in_aug)


_INDEX_MEMO: OrderedDict[Any, tuple[tuple[Any, ...], list[BlockIndex]]] = OrderedDict()
_INDEX_MEMO_SIZE = 32


def _build_index(layout: ParamLayout, named: Sequence[tuple[Any, ...]], device: torch.device,
                 kind: str) -> list[BlockIndex]:
    """Check that the blocks cover every layout entry exactly once; build their index maps.

    ``named``: per block (weight name, bias name) or (weight name, bias name, index, label). The checked maps
    of the last few block sets are kept (a :class:`BlockIndex` is not changed after it is built): an
    estimator's operators, rebuilt at every refresh, name the same blocks with the same index objects, and
    the coverage count is a tenth of a small model's refresh (2 ms of a GPT's 20 ms of bookkeeping). The
    key holds the layout, the names, labels and each explicit index (:func:`_index_key`: a strided index by
    value, a tensor by identity and version; an index made under ``torch.inference_mode()`` has no version
    counter: its maps are built every time)."""
    indices = [s[2] if len(s) > 2 else None for s in named]
    if any(isinstance(ix, Tensor) and ix.is_inference() for ix in indices):  # no version counter: not kept
        return _check_and_build(layout, named, device, kind)
    key = (tuple(layout.names), tuple(tuple(t) for t in layout.shapes), str(device), kind, tuple(
        (s[0], s[1], _index_key(s[2] if len(s) > 2 else None), s[3] if len(s) > 3 else None) for s in named))
    hit = _INDEX_MEMO.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], indices) if isinstance(a, Tensor)):
        _INDEX_MEMO.move_to_end(key)
        return list(hit[1])
    out = _check_and_build(layout, named, device, kind)
    _INDEX_MEMO[key] = (tuple(indices), out)  # the indices held: their ids stay valid
    if len(_INDEX_MEMO) > _INDEX_MEMO_SIZE:
        _INDEX_MEMO.popitem(last=False)
    return list(out)


def _index_key(ix: Any) -> Any:
    """An explicit index in :func:`_build_index`'s key: a :class:`StridedIndex` by value (frozen: a fresh
    estimator's equal q/k/v slices find the maps built), a tensor by identity and version counter."""
    if isinstance(ix, Tensor):
        return ("tensor", id(ix), ix._version)
    return ix


def _check_and_build(layout: ParamLayout, named: Sequence[tuple[Any, ...]], device: torch.device,
                     kind: str) -> list[BlockIndex]:
    known = set(layout.names)
    seen: dict[str, int] = {}
    partial = False
    for i, spec in enumerate(named):
        w, b = spec[0], spec[1]
        explicit = len(spec) > 2 and spec[2] is not None
        partial |= explicit
        for name in (w,) if b is None else (w, b):
            if name not in known:
                raise ValueError(f"{kind} block {i} refers to parameter {name!r}, which is not in the layout "
                                 f"(parameters: {', '.join(layout.names)})")
            if name in seen and not explicit:
                raise ValueError(f"parameter {name!r} is covered by two {kind} blocks ({seen[name]} and {i}); "
                                 "every parameter must belong to exactly one block")
            seen.setdefault(name, i)
    missing = [n for n in layout.names if n not in seen]
    if missing:
        raise ValueError(f"parameter(s) {', '.join(repr(m) for m in missing)} not covered by any {kind} "
                         "block; give every trainable parameter a block (or build the layout without it)")
    slices, shapes = layout.slices(), dict(zip(layout.names, layout.shapes))
    out = [BlockIndex(layout, s[0], s[1], device, *(s[2:4] if len(s) > 2 else ()), slices=slices, shapes=shapes)
           for s in named]
    if partial:  # blocks that hold parts of parameters: every entry exactly once
        _check_coverage(layout, out, kind)
    return out


def _check_coverage(layout: ParamLayout, blocks: Sequence[BlockIndex], kind: str) -> None:
    """Raise unless every entry of every parameter belongs to exactly one block. A parameter whose blocks all
    take row ranges of one strided view (a whole weight, its q/k/v or group slices, their bias) is checked by
    counting the view's rows (out numbers, not parameters); any other by counting its entries through the
    blocks' positions (an explicit index: a normalisation layer's (1, P) row, a user's map)."""
    touching: dict[str, list[BlockIndex]] = {}
    for ix in blocks:
        for name in ix.names:
            touching.setdefault(name, []).append(ix)
    slices = layout.slices()
    for name, on in touching.items():
        views = {ix.row_view(name) for ix in on}
        view = views.pop() if len(views) == 1 else None
        if view is not None:  # counts per row of the view; row r's first entry is entry r * cols or r
            counts = torch.zeros(view[1], dtype=torch.int32)
            for ix in on:
                assert ix.strided is not None
                counts[ix.strided.start:ix.strided.stop] += 1
            step = view[2] if view[0] == "weight" and not view[3] else 1
        else:
            sl, device = slices[name], on[0]._device
            counts = torch.zeros(sl.stop - sl.start, dtype=torch.int32, device=device)
            for ix in on:
                perm = ix.perm
                perm = perm[(perm >= sl.start) & (perm < sl.stop)] - sl.start
                counts.index_add_(0, perm, torch.ones(perm.shape, dtype=counts.dtype, device=device))
            step = 1
        bad = torch.nonzero(counts != 1)
        if bad.numel():
            pos = int(bad[0, 0])
            raise ValueError(f"entry {pos * step} of parameter {name!r} is covered by {int(counts[pos])} {kind} "
                             "blocks; every entry must belong to exactly one block")
