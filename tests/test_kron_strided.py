"""Structured block indices (``linalg.kron.StridedIndex``): the standard and transposed views of a weight and
row slices of them (attention's packed q/k/v, convolution groups) gather and scatter through views, with no
integer map of a block's size, and give exactly what the explicit int64 index of the same positions gives:
products, dense matrix, diagonal, inverse products (eigen and factored), eigenbasis (EKFAC) operators,
sampling, block matrices, Laplace posterior blocks; coverage and shape validation; checkpoint round trips."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import Tensor

from curvkit.laplace._blocks import KroneckerBlock as LaplaceBlock
from curvkit.linalg.kron import (
    BlockIndex,
    KroneckerBlock,
    KroneckerOperator,
    KroneckerSpectralOperator,
    StridedIndex,
    block_matrix,
    block_positions,
    index_from_state,
    index_state,
    standard_index,
    transposed_index,
    write_block_matrix,
)
from curvkit.linalg.layout import ParamLayout
from reference import int_tensors

pytestmark = pytest.mark.usefixtures("float64_default")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spd(n: int, seed: int) -> Tensor:
    X = torch.randn(n, n + 2, generator=_gen(seed))
    return X @ X.T / n + 0.1 * torch.eye(n)


# ---------------------------------------------------------------------------------------------- references
def _standard_ref(shape: tuple[int, ...], bias: bool) -> Tensor:
    """Positions of [W.reshape(out, -1) | b] in [W.flatten(), b], written out entry by entry."""
    out, n = shape[0], math.prod(shape[1:])
    return torch.tensor([[r * n + c for c in range(n)] + ([out * n + r] if bias else []) for r in range(out)])


def _transposed_ref(n_in: int, n_out: int, bias: bool) -> Tensor:
    """Positions of [W^T | b] for W (in, out): W_hat[o, i] = W[i, o] at i * out + o."""
    return torch.tensor([[i * n_out + o for i in range(n_in)] + ([n_in * n_out + o] if bias else [])
                         for o in range(n_out)])


@pytest.mark.parametrize("bias", [False, True])
def test_materialize_equals_the_written_out_positions(bias):
    assert torch.equal(standard_index((4, 3, 2), bias).materialize(), _standard_ref((4, 3, 2), bias))
    assert torch.equal(transposed_index(5, 3, bias).materialize(), _transposed_ref(5, 3, bias))
    assert torch.equal(standard_index((6, 2), bias)[2:4].materialize(), _standard_ref((6, 2), bias)[2:4])
    assert torch.equal(transposed_index(4, 6, bias)[1:5][1:3].materialize(), _transposed_ref(4, 6, bias)[2:4])
    assert standard_index((6, 2), bias)[2:4].shape == (2, 2 + int(bias))


# ---------------------------------------------------------------------------------------------- a layout with every view
def _case(bias: bool) -> tuple[ParamLayout, list[tuple[str, str | None, StridedIndex | None, str]]]:
    """A standard Linear (None), a transposed Conv1D-like weight (in 4, out 3), a packed (3E, E) weight split
    into q/k/v row slices, a grouped convolution (6, 2, 3) in 3 groups, an embedding-like transposed table
    without bias."""
    shapes: dict[str, tuple[int, ...]] = {"lin.w": (3, 5), "t.w": (4, 3), "qkv.w": (6, 2), "conv.w": (6, 2, 3),
                                          "emb.w": (7, 2)}
    if bias:
        shapes.update({"lin.b": (3,), "t.b": (3,), "qkv.b": (6,), "conv.b": (6,)})
    layout = ParamLayout(list(shapes), [torch.Size(s) for s in shapes.values()])

    def b(name: str) -> str | None:
        return name if bias else None

    specs: list[tuple[str, str | None, StridedIndex | None, str]] = [
        ("lin.w", b("lin.b"), None, "lin"), ("t.w", b("t.b"), transposed_index(4, 3, bias), "t")]
    qkv = standard_index((6, 2), bias)
    specs += [("qkv.w", b("qkv.b"), qkv[2 * i:2 * (i + 1)], f"qkv.{p}") for i, p in enumerate("qkv")]
    conv = standard_index((6, 2, 3), bias)
    specs += [("conv.w", b("conv.b"), conv[2 * j:2 * (j + 1)], f"conv.group{j}") for j in range(3)]
    specs.append(("emb.w", None, transposed_index(7, 2, False), "emb"))
    return layout, specs


def _operators(bias: bool, diagonal_emb: bool = True) -> tuple[KroneckerOperator, KroneckerOperator]:
    """The same blocks with structured indices and with their explicit int64 maps (written out independently)."""
    layout, specs = _case(bias)
    refs = {"t": _transposed_ref(4, 3, bias), "emb": _transposed_ref(7, 2, False)}
    refs.update({f"qkv.{p}": _standard_ref((6, 2), bias)[2 * i:2 * (i + 1)] for i, p in enumerate("qkv")})
    refs.update({f"conv.group{j}": _standard_ref((6, 2, 3), bias)[2 * j:2 * (j + 1)] for j in range(3)})
    strided, explicit = [], []
    for k, (w, bb, ix, label) in enumerate(specs):
        out, in_aug = ix.shape if ix is not None else (3, 5 + int(bias))
        A = torch.rand(in_aug, generator=_gen(50 + k)) + 0.1 if label == "emb" and diagonal_emb else _spd(in_aug, 10 + k)
        G = _spd(out, 30 + k)
        strided.append(KroneckerBlock(G, A, w, bb, ix, label))
        explicit.append(KroneckerBlock(G, A, w, bb, refs.get(label), label))
    return KroneckerOperator(layout, strided), KroneckerOperator(layout, explicit)


@pytest.mark.parametrize("bias", [False, True])
def test_structured_operator_equals_the_explicit_index_operator(bias):
    S, E = _operators(bias)
    assert all(isinstance(b.index, StridedIndex) for b in S.blocks if b.label != "lin")
    d = S.layout.dim
    V = torch.randn(d, 3, generator=_gen(1))
    torch.testing.assert_close(S @ V, E @ V, atol=0, rtol=0)
    torch.testing.assert_close(S @ V[:, 0], E @ V[:, 0], atol=0, rtol=0)
    torch.testing.assert_close(S.to_dense(), E.to_dense(), atol=0, rtol=0)
    torch.testing.assert_close(S.to_dense() @ V, S @ V, atol=1e-12, rtol=0)
    torch.testing.assert_close(S.diagonal().to_dense(), E.diagonal().to_dense(), atol=0, rtol=0)
    torch.testing.assert_close(S.diagonal().to_dense(), torch.diag(S.to_dense().diagonal()), atol=1e-13, rtol=0)
    for inv_s, inv_e in ((S.inverse(0.3), E.inverse(0.3)),
                         (S.inverse(0.3, method="factored"), E.inverse(0.3, method="factored"))):
        torch.testing.assert_close(inv_s @ V, inv_e @ V, atol=1e-13, rtol=0)
        torch.testing.assert_close(inv_s.diagonal().to_dense(), inv_e.diagonal().to_dense(), atol=1e-13, rtol=0)
    dense_inv = torch.linalg.inv(S.to_dense() + 0.3 * torch.eye(d))
    torch.testing.assert_close(S.inverse(0.3) @ V, dense_inv @ V, atol=1e-10, rtol=0)
    spectra = [torch.rand(b.out_dim, b.in_dim, generator=_gen(70 + i)) + 0.5 for i, b in enumerate(S.blocks)]
    KS, KE = (KroneckerSpectralOperator.in_eigenbasis_of(op, spectra) for op in (S, E))
    torch.testing.assert_close(KS @ V, KE @ V, atol=1e-13, rtol=0)
    torch.testing.assert_close(KS.diagonal().to_dense(), KE.diagonal().to_dense(), atol=1e-13, rtol=0)
    mean = torch.randn(d, generator=_gen(2))
    torch.testing.assert_close(S.add_identity(0.2).sample(mean, _gen(3), 4), E.add_identity(0.2).sample(mean, _gen(3), 4),
                               atol=1e-13, rtol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_block_matrix_and_write_block_matrix_equal_the_explicit_maps(bias):
    """``block_matrix`` reads the entries the explicit map selects (and autograd reaches the tensors);
    ``write_block_matrix`` of the blocks of a split parameter fills it exactly; ``block_positions`` writes
    out the same positions as the explicit map."""
    S, E = _operators(bias)
    shapes = dict(zip(S.layout.names, S.layout.shapes))
    tensors = {n: torch.randn(s, generator=_gen(i), requires_grad=True) for i, (n, s) in enumerate(shapes.items())}
    out = {n: torch.full(s, math.nan) for n, s in shapes.items()}
    for bs, be in zip(S.blocks, E.blocks):
        M = block_matrix(bs, tensors)
        torch.testing.assert_close(M, block_matrix(be, tensors), atol=0, rtol=0)
        write_block_matrix(bs, 2 * M.detach(), out)
        assert torch.equal(block_positions(S.layout, bs.weight_name, bs.bias_name, bs.index),
                           block_positions(E.layout, be.weight_name, be.bias_name, be.index))
    for n, t in tensors.items():
        torch.testing.assert_close(out[n], 2 * t.detach(), atol=0, rtol=0)
    loss = sum(block_matrix(b, tensors).pow(2).sum() for b in S.blocks)
    grads = torch.autograd.grad(loss, list(tensors.values()))
    for g, t in zip(grads, tensors.values()):
        torch.testing.assert_close(g, 2 * t.detach(), atol=0, rtol=0)


@pytest.mark.parametrize("form", ["factored", "exact"])
def test_laplace_block_with_structured_indices_equals_the_explicit_one(form):
    """A Laplace posterior block (sampling, GLM terms, log-determinant) reads its factors' entries through the
    structured views exactly as through the explicit maps."""
    S, E = _operators(True, diagonal_emb=False)
    lam = torch.tensor([0.7])
    N = torch.tensor(5.0)
    LS, LE = (LaplaceBlock(op.layout, 0, op.blocks, form) for op in (S, E))
    torch.testing.assert_close(LS.sample(5.0, lam, 3, _gen(4)), LE.sample(5.0, lam, 3, _gen(4)), atol=0, rtol=0)
    torch.testing.assert_close(LS.logdet(N, lam), LE.logdet(N, lam), atol=0, rtol=0)
    torch.testing.assert_close(LS.precision(5.0, lam).to_dense(), LE.precision(5.0, lam).to_dense(), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------- no map of the block's size
def test_structured_blocks_hold_no_integer_map_of_their_size():
    """After products, a diagonal, inverse products and sampling, no integer tensor with as many entries as
    the smallest structured block is referenced by the operator or its inverses (an explicit-index operator
    does hold them: the check can fail)."""
    S, E = _operators(True)
    V = torch.randn(S.layout.dim, 2, generator=_gen(1))
    smallest = min(b.out_dim * b.in_dim for b in S.blocks)
    for op in (S, E):
        inv = op.inverse(0.1)
        _ = (op @ V, op.diagonal(), inv @ V, op.inverse(0.1, method="factored") @ V, op.add_identity(0.1).sample(V[:, 0]))
        big = [t for t in int_tensors([op, inv]) if t.numel() >= smallest]
        assert (big == []) == (op is S), [tuple(t.shape) for t in big]


# ---------------------------------------------------------------------------------------------- validation
def test_coverage_and_shapes_are_checked_for_structured_indices():
    layout, specs = _case(True)

    def op(specs):
        blocks = []
        for w, b, ix, label in specs:
            out, in_aug = ix.shape if ix is not None else (3, 6)
            blocks.append(KroneckerBlock(torch.eye(out), torch.eye(in_aug), w, b, ix, label))
        return KroneckerOperator(layout, blocks)

    op(specs)  # every entry exactly once
    qkv = standard_index((6, 2), True)
    overlap = [s for s in specs if s[3] != "qkv.k"] + [("qkv.w", "qkv.b", qkv[1:3], "qkv.k")]
    with pytest.raises(ValueError, match=r"entry 2 of parameter 'qkv.w' is covered by 2 Kronecker blocks"):
        op(overlap)
    gap = [s for s in specs if s[3] != "qkv.k"] + [("qkv.w", "qkv.b", qkv[3:4], "qkv.k")]
    with pytest.raises(ValueError, match=r"entry 4 of parameter 'qkv.w' is covered by 0 Kronecker blocks"):
        op(gap)
    t = transposed_index(4, 3, True)
    split = [s for s in specs if s[3] != "t"] + [("t.w", "t.b", t[0:1], "t0"), ("t.w", "t.b", t[0:2], "t1")]
    with pytest.raises(ValueError, match=r"entry 0 of parameter 't.w' is covered by 2"):
        op(split)
    # a structured and an explicit block on one parameter: counted entry by entry
    mixed = [s for s in specs if s[3] != "qkv.k"] + [("qkv.w", "qkv.b", _standard_ref((6, 2), True)[2:4], "qkv.k")]
    op(mixed)
    mixed[-1] = ("qkv.w", "qkv.b", _standard_ref((6, 2), True)[3:5], "qkv.k")
    with pytest.raises(ValueError, match=r"entry 4 of parameter 'qkv.w' is covered by 0"):
        op(mixed)
    wrong = [s for s in specs if s[3] != "t"] + [("t.w", "t.b", transposed_index(3, 4, True), "t")]
    with pytest.raises(ValueError, match=r"block 't': its StridedIndex\(rows=4, cols=3.*needs a weight of 4 x 3 "
                                         r"entries and a bias of 4, got weight 't.w' \(4, 3\) and bias 't.b' \(3,\)"):
        op(wrong)
    with pytest.raises(ValueError, match=r"needs a weight of 3 x 4 entries and no bias"):
        BlockIndex(layout, "t.w", "t.b", torch.device("cpu"), transposed_index(4, 3, False))
    sub = ParamLayout(["t.w", "t.b"], [torch.Size((4, 3)), torch.Size((3,))])
    with pytest.raises(ValueError, match=r"G is \(3, 3\) and A is \(4, 4\), but its index has shape \(3, 5\)"):
        KroneckerOperator(sub, [KroneckerBlock(torch.eye(3), torch.eye(4), "t.w", "t.b", t, "t")])
    with pytest.raises(ValueError, match=r"non-empty row slice with step 1, got slice\(0, 4, 2\)"):
        t[0:4:2]
    with pytest.raises(ValueError, match=r"non-empty row slice"):
        t[2:2]
    with pytest.raises(ValueError, match=r"0 <= start < stop <= rows, got rows=3, cols=2, start=0, stop=4"):
        StridedIndex(3, 2, stop=4)
    with pytest.raises(TypeError, match=r"StridedIndex.cols must be an int"):
        StridedIndex(3, 2.0)  # type: ignore[arg-type]


def test_index_state_round_trips_through_a_weights_only_checkpoint():
    idx = [transposed_index(4, 3, True)[1:3], standard_index((6, 2, 3), False), _standard_ref((2, 2), True), None]
    buf = io.BytesIO()
    torch.save([index_state(i) for i in idx], buf)
    buf.seek(0)
    loaded = [index_from_state(s) for s in torch.load(buf, weights_only=True)]
    assert loaded[:2] == idx[:2] and torch.equal(loaded[2], idx[2]) and loaded[3] is None
    with pytest.raises(ValueError, match=r"a saved block index must be a tensor, None or a StridedIndex's state"):
        index_from_state({"rows": 3})
