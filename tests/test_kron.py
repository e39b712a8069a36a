"""Kronecker algebra and the KroneckerOperator against dense torch.kron references (float64)."""

import math

import pytest
import torch

from curvkit.linalg.kron import (
    BlockDiagonalOperator,
    DenseBlock,
    KroneckerBlock,
    KroneckerInverseOperator,
    KroneckerOperator,
    kron_matvec,
    vec_row,
)
from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import ScaledSumOperator

pytestmark = pytest.mark.usefixtures("float64_default")

# A layout with a conv weight + bias, a bias-free linear weight, and a linear weight + bias.
NAMES = ("conv.weight", "conv.bias", "fc.weight", "out.weight", "out.bias")
SHAPES = ((2, 1, 2, 2), (2,), (3, 4), (2, 3), (2,))
# (weight name, bias name, out, in_w)
LAYERS = (("conv.weight", "conv.bias", 2, 4), ("fc.weight", None, 3, 4), ("out.weight", "out.bias", 2, 3))


def layout() -> ParamLayout:
    return ParamLayout(NAMES, tuple(torch.Size(s) for s in SHAPES))


def spd(n: int, g: torch.Generator, rank: int | None = None) -> torch.Tensor:
    M = torch.randn(n, rank or n + 2, generator=g)
    return M @ M.T / M.shape[1] + (0.0 if rank else 0.1) * torch.eye(n)


def make_op(seed: int = 0, damping: float = 0.0) -> KroneckerOperator:
    g = torch.Generator().manual_seed(seed)
    blocks = [KroneckerBlock(spd(o, g), spd(i + (b is not None), g), w, b) for w, b, o, i in LAYERS]
    return KroneckerOperator(layout(), blocks, damping)


def ref_permutation(lay: ParamLayout, w: str, b: str | None, out: int, in_w: int) -> torch.Tensor:
    """(d, P) matrix mapping a W_hat row-major vector to the flat parameter vector, built by hand."""
    P = out * (in_w + (b is not None))
    cols = []
    for k in range(P):
        e = torch.zeros(P)
        e[k] = 1.0
        Xhat = e.reshape(out, -1)
        tensors = [torch.zeros(s) for s in lay.shapes]
        tensors[lay.names.index(w)] = Xhat[:, :in_w].reshape(lay.shapes[lay.names.index(w)])
        if b is not None:
            tensors[lay.names.index(b)] = Xhat[:, in_w]
        cols.append(lay.flatten(tensors))
    return torch.stack(cols, dim=1)


def ref_dense(op: KroneckerOperator) -> torch.Tensor:
    lay = op.layout
    D = op.damping * torch.eye(lay.dim)
    for (w, b, o, i), blk in zip(LAYERS, op.blocks):
        P = ref_permutation(lay, w, b, o, i)
        D = D + P @ torch.kron(blk.G, blk.A) @ P.T
    return D


# ---------------------------------------------------------------------------------------------- vec identities
def test_vec_identities():
    """Digest 002 section 2.9 check 1: column- and row-major vec identities, mixed product, det, eig."""
    g = torch.Generator().manual_seed(1)
    A, X, B = torch.randn(3, 4, generator=g), torch.randn(4, 5, generator=g), torch.randn(5, 2, generator=g)
    vec_col = lambda M: M.T.reshape(-1)  # noqa: E731
    assert torch.allclose(vec_col(A @ X @ B), torch.kron(B.T.contiguous(), A) @ vec_col(X))
    # row-major: (G (x) A) vec_row(X) = vec_row(G X A^T), also for non-symmetric A
    G, An, Y = torch.randn(3, 3, generator=g), torch.randn(4, 4, generator=g), torch.randn(3, 4, generator=g)
    assert torch.allclose(torch.kron(G, An) @ vec_row(Y), vec_row(G @ Y @ An.T))
    assert torch.allclose(vec_row(kron_matvec(G, An, Y)), torch.kron(G, An) @ vec_row(Y))
    Ys = torch.randn(7, 3, 4, generator=g)  # batched
    assert torch.allclose(vec_row(kron_matvec(G, An, Ys)), (torch.kron(G, An) @ vec_row(Ys).T).T)
    # mixed product, inverse, determinant, eigenvalues
    C, D = torch.randn(3, 3, generator=g), torch.randn(4, 4, generator=g)
    assert torch.allclose(torch.kron(G, An) @ torch.kron(C, D), torch.kron(G @ C, An @ D))
    Gs, As = spd(3, g), spd(4, g)
    assert torch.allclose(torch.linalg.inv(torch.kron(Gs, As)), torch.kron(torch.linalg.inv(Gs), torch.linalg.inv(As)))
    assert torch.allclose(torch.det(torch.kron(Gs, As)), torch.det(Gs) ** 4 * torch.det(As) ** 3)
    ev = torch.sort(torch.outer(torch.linalg.eigvalsh(Gs), torch.linalg.eigvalsh(As)).reshape(-1)).values
    assert torch.allclose(ev, torch.linalg.eigvalsh(torch.kron(Gs, As)))
    assert torch.linalg.matrix_rank(torch.kron(spd(3, g, rank=2), spd(4, g, rank=3))) == 6
    with pytest.raises(ValueError, match="kron_matvec"):
        kron_matvec(G, An, torch.randn(4, 3))


# ---------------------------------------------------------------------------------------------- products
def test_layout_semantics_matches_W_hat_product():
    """op @ [dW, db] equals G [dW | db] A for each layer (the PyTorch row-major layout)."""
    op = make_op()
    g = torch.Generator().manual_seed(2)
    V = [torch.randn(s, generator=g) for s in SHAPES]
    out = op @ V
    # conv: W viewed as (2, 4), bias column last
    Vc = torch.cat([V[0].reshape(2, 4), V[1][:, None]], dim=1)
    Rc = op.blocks[0].G @ Vc @ op.blocks[0].A
    assert torch.allclose(out[0], Rc[:, :4].reshape(2, 1, 2, 2))
    assert torch.allclose(out[1], Rc[:, 4])
    assert torch.allclose(out[2], op.blocks[1].G @ V[2] @ op.blocks[1].A)
    Vo = torch.cat([V[3], V[4][:, None]], dim=1)
    Ro = op.blocks[2].G @ Vo @ op.blocks[2].A
    assert torch.allclose(out[3], Ro[:, :3]) and torch.allclose(out[4], Ro[:, 3])


@pytest.mark.parametrize("damping", [0.0, 0.3])
def test_dense_diagonal_trace_matvec(damping):
    op = make_op(damping=damping)
    D = ref_dense(op)
    assert torch.allclose(op.to_dense(), D, atol=1e-12)
    g = torch.Generator().manual_seed(3)
    v, M = torch.randn(op.layout.dim, generator=g), torch.randn(op.layout.dim, 5, generator=g)
    assert torch.allclose(op @ v, D @ v) and torch.allclose(op @ M, D @ M)
    assert torch.allclose(op.diagonal().flat, D.diagonal())
    assert torch.allclose(op.trace(), D.trace())
    # Hutchinson (delegated to the base class): within 4 standard errors, sd^2 = 2 (|D|_F^2 - sum D_ii^2) / m
    m = 200
    est = op.trace("hutchinson", num_probes=m, generator=torch.Generator().manual_seed(0))
    sd = math.sqrt(2 * float((D**2).sum() - (D.diagonal() ** 2).sum()) / m)
    assert abs(float(est) - float(D.trace())) < 4 * sd
    ev = torch.linalg.eigvalsh(D)
    assert torch.allclose(op.eigenvalues(k=op.layout.dim), ev.flip(0))
    assert torch.allclose(op.eigenvalues(k=3, which="smallest"), ev[:3].flip(0))
    assert torch.allclose(op.logdet(), torch.linalg.slogdet(D)[1])
    assert torch.allclose(op.logdet(0.2), torch.linalg.slogdet(D + 0.2 * torch.eye(len(D)))[1])


def test_eigh_reconstructs_factors():
    op = make_op()
    for e, b in zip(op.eigh(), op.blocks):
        assert torch.allclose(e.G_eigvecs @ torch.diag(e.G_eigvals) @ e.G_eigvecs.T, b.G)
        assert torch.allclose(e.A_eigvecs @ torch.diag(e.A_eigvals) @ e.A_eigvecs.T, b.A)
        Qk = torch.kron(e.G_eigvecs, e.A_eigvecs)  # eigenvectors vec_row(qG qA^T)
        assert torch.allclose(Qk.T @ torch.kron(b.G, b.A) @ Qk, torch.diag(e.eigenvalues().reshape(-1)))


@pytest.mark.parametrize("damping", [0.0, 0.05, 1.0])
def test_eigen_inverse_exact(damping):
    op = make_op(damping=0.1)
    D = ref_dense(op) + damping * torch.eye(op.layout.dim)
    Dinv = torch.linalg.inv(D)
    inv = op.inverse(damping)
    assert isinstance(inv, KroneckerInverseOperator)
    assert torch.allclose(inv.to_dense(), Dinv, atol=1e-10)
    assert torch.allclose(inv.diagonal().flat, Dinv.diagonal())
    assert torch.allclose(inv.trace(), Dinv.trace())
    assert torch.allclose(inv.logdet(), -torch.linalg.slogdet(D)[1])
    assert torch.allclose(inv.eigenvalues(k=4), torch.linalg.eigvalsh(Dinv).flip(0)[:4])
    b = torch.randn(op.layout.dim, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(op.solve(b, damping), torch.linalg.solve(D, b))
    assert torch.allclose(inv.inverse().to_dense(), D)


def test_factored_inverse_equals_definition():
    """(G (x) A + d I)^{-1} ~ (G + sqrt(d)/pi I)^{-1} (x) (A + pi sqrt(d) I)^{-1}, pi = trace-norm split."""
    op = make_op()
    d = 0.3
    inv = op.inverse(d, method="factored")
    assert isinstance(inv, KroneckerOperator)
    lay = op.layout
    ref = torch.zeros(lay.dim, lay.dim)
    for (w, b, o, i), blk in zip(LAYERS, op.blocks):
        G, A = blk.G, blk.A
        pi = math.sqrt((A.trace() / A.shape[0]) / (G.trace() / G.shape[0]))
        Gd = G + math.sqrt(d) / pi * torch.eye(G.shape[0])
        Ad = A + pi * math.sqrt(d) * torch.eye(A.shape[0])
        P = ref_permutation(lay, w, b, o, i)
        ref = ref + P @ torch.kron(torch.linalg.inv(Gd), torch.linalg.inv(Ad)) @ P.T
    assert torch.allclose(inv.to_dense(), ref, atol=1e-12)
    # pi = 1 (Laplace-style) and the damped (uninverted) factors
    fd = op.factored_damping(d, pi=1.0)
    blk = op.blocks[1]
    assert torch.allclose(fd.blocks[1].G, blk.G + math.sqrt(d) * torch.eye(3))
    assert torch.allclose(fd.blocks[1].A, blk.A + math.sqrt(d) * torch.eye(4))
    # (G + a I) (x) (A + b I) = G (x) A + b G (x) I + a I (x) A + ab I with ab = d: the damping is exact,
    # the cross terms are the approximation error (thesis Eq. 4.26)
    fdt = op.factored_damping(d)
    for (w, bn, o, i), blk, fb in zip(LAYERS, op.blocks, fdt.blocks):
        a = float(fb.G[0, 0] - blk.G[0, 0])
        b = float(fb.A[0, 0] - blk.A[0, 0])
        assert math.isclose(a * b, d)
        P = ref_permutation(lay, w, bn, o, i)
        expected = (torch.kron(blk.G, blk.A) + b * torch.kron(blk.G, torch.eye(len(blk.A)))
                    + a * torch.kron(torch.eye(len(blk.G)), blk.A) + d * torch.eye(len(blk.G) * len(blk.A)))
        assert torch.allclose(P.T @ fdt.to_dense() @ P, expected)
    exact = op.inverse(d).to_dense()
    assert float((inv.to_dense() - exact).norm() / exact.norm()) > 1e-3  # an approximation, not exact
    with pytest.raises(ValueError, match="pi must be"):
        op.factored_damping(d, pi=-1.0)


def test_structured_algebra():
    op = make_op()
    D = ref_dense(op)
    s = 2.5 * op
    assert isinstance(s, KroneckerOperator) and torch.allclose(s.to_dense(), 2.5 * D)
    a = op.add_identity(0.7)
    assert isinstance(a, KroneckerOperator) and torch.allclose(a.to_dense(), D + 0.7 * torch.eye(len(D)))
    assert torch.allclose((a * 2.0).to_dense(), 2 * D + 1.4 * torch.eye(len(D)))
    assert torch.allclose(a.logdet(), torch.linalg.slogdet(D + 0.7 * torch.eye(len(D)))[1])
    ssum = op + op
    assert isinstance(ssum, ScaledSumOperator) and torch.allclose(ssum.to_dense(), 2 * D)
    Sp = op.to_scipy()
    x = torch.randn(op.layout.dim, dtype=torch.float64).numpy()
    assert torch.allclose(torch.as_tensor(Sp @ x), D @ torch.as_tensor(x))


@pytest.mark.parametrize("damping", [0.0, 0.5])
def test_sample_covariance_is_inverse(damping):
    """Samples of N(mean, C^{-1}) (operator read as precision): empirical mean and covariance."""
    op = make_op(seed=5, damping=damping)
    cov = torch.linalg.inv(ref_dense(op))
    mean = torch.randn(op.layout.dim, generator=torch.Generator().manual_seed(6))
    S = 40000
    X = op.sample(mean, generator=torch.Generator().manual_seed(7), num_samples=S)
    assert X.shape == (S, op.layout.dim)
    emp = torch.cov(X.T)
    # MC tolerance: standard error of a covariance entry ~ sqrt(2/S) * |cov| ~ 0.007 |cov|
    assert float((emp - cov).norm() / cov.norm()) < 0.03
    assert float((X.mean(0) - mean).abs().max()) < 5 * float(cov.diagonal().max().sqrt()) / math.sqrt(S)
    # scale multiplies the standard deviation; list input gives parameter-shaped samples
    Y = op.sample(op.layout.unflatten(mean), generator=torch.Generator().manual_seed(7), num_samples=S, scale=2.0)
    assert [tuple(t.shape) for t in Y] == [(S, *s) for s in SHAPES]
    Yf = torch.stack([op.layout.flatten([t[i] for t in Y]) for i in range(3)])
    assert torch.allclose(Yf - mean, 2 * (X[:3] - mean))  # same generator seed -> same noise
    # reproducible and independent of the global RNG
    torch.manual_seed(0)
    a = op.sample(mean, torch.Generator().manual_seed(1), 3)
    torch.manual_seed(123)
    assert torch.equal(a, op.sample(mean, torch.Generator().manual_seed(1), 3))


# ---------------------------------------------------------------------------------------------- errors
def test_coverage_and_shape_errors():
    op = make_op()
    blocks = op.blocks
    with pytest.raises(ValueError, match=r"'fc\.weight'.*not covered"):
        KroneckerOperator(layout(), [blocks[0], blocks[2]])
    with pytest.raises(ValueError, match=r"'fc\.weight' is covered by two"):
        KroneckerOperator(layout(), [*blocks, blocks[1]])
    with pytest.raises(ValueError, match="not in the layout"):
        KroneckerOperator(layout(), [*blocks, KroneckerBlock(torch.eye(2), torch.eye(2), "nope.weight")])
    bad = KroneckerBlock(torch.eye(3), torch.eye(5), "fc.weight")  # fc has no bias: A must be 4x4
    with pytest.raises(ValueError, match=r"expected G \(3, 3\) and A \(4, 4\)"):
        KroneckerOperator(layout(), [blocks[0], bad, blocks[2]])
    with pytest.raises(ValueError, match="symmetric"):
        KroneckerBlock(torch.tensor([[1.0, 2.0], [0.0, 1.0]]), torch.eye(2), "w")
    with pytest.raises(ValueError, match="NaN"):
        KroneckerBlock(torch.tensor([[float("nan")]]), torch.eye(2), "w")
    with pytest.raises(ValueError, match="square"):
        KroneckerBlock(torch.ones(2, 3), torch.eye(2), "w")
    with pytest.raises(ValueError, match="operator of shape"):
        _ = op @ torch.zeros(3)


def test_not_positive_definite_errors():
    g = torch.Generator().manual_seed(8)
    blocks = [KroneckerBlock(spd(o, g), spd(i + (b is not None), g), w, b) for w, b, o, i in LAYERS]
    blocks[1] = KroneckerBlock(spd(3, g, rank=1), blocks[1].A, "fc.weight")
    op = KroneckerOperator(layout(), blocks)
    with pytest.raises(ValueError, match=r"'fc\.weight' is not positive definite"):
        op.inverse()
    with pytest.raises(ValueError, match="increase the damping"):
        op.logdet()
    assert torch.isfinite(op.logdet(1e-3))  # damping fixes it
    with pytest.raises(ValueError, match="unknown inverse method"):
        op.inverse(0.1, method="cholesky")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- dense blocks
def test_block_diagonal_operator():
    g = torch.Generator().manual_seed(9)
    lay = layout()
    mats = [spd(o * (i + (b is not None)), g) for w, b, o, i in LAYERS]
    op = BlockDiagonalOperator(lay, [DenseBlock(M, w, b) for M, (w, b, _, _) in zip(mats, LAYERS)])
    ref = sum(ref_permutation(lay, w, b, o, i) @ M @ ref_permutation(lay, w, b, o, i).T
              for M, (w, b, o, i) in zip(mats, LAYERS))
    assert torch.allclose(op.to_dense(), ref)
    v = torch.randn(lay.dim, generator=g)
    assert torch.allclose(op @ v, ref @ v)
    assert torch.allclose(op.diagonal().flat, ref.diagonal())
    eye = torch.eye(lay.dim)
    assert torch.allclose(op.inverse(0.1).to_dense(), torch.linalg.inv(ref + 0.1 * eye))
    assert torch.allclose(op.logdet(0.1), torch.linalg.slogdet(ref + 0.1 * eye)[1])
    assert torch.allclose(op.add_identity(0.1).solve(v), torch.linalg.solve(ref + 0.1 * eye, v))
    bad = [DenseBlock(M, w, b) for M, (w, b, _, _) in zip(mats, LAYERS)]
    bad[1] = DenseBlock(torch.eye(3), "fc.weight")
    with pytest.raises(ValueError, match=r"expected \(12, 12\)"):
        BlockDiagonalOperator(lay, bad)


def test_symmetrise_by_tiles_is_bitwise_the_plain_expression():
    """Large factors are symmetrised tile by tile (a cache-friendly transpose); every entry is the same two-term
    sum times c, so the result equals ``c * (M + M^T)`` bitwise, on and off the tile grid."""
    from curvkit.linalg.factors import _symmetrise, _symmetrise_

    g = torch.Generator().manual_seed(0)
    for n in (7, 1023, 1024, 1500):
        for dtype in (torch.float32, torch.float64):
            M = torch.randn(n, n, generator=g, dtype=dtype)
            for c in (0.5, 0.37):
                S = _symmetrise(M, c)
                assert torch.equal(S, (M + M.T) * c) and torch.equal(S, S.T)
                for tile in (512, 100):  # in place, paired tiles across the diagonal: the same entries
                    N = M.clone()
                    assert _symmetrise_(N, c, tile) is N and torch.equal(N, S)
