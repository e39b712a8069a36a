"""The shared CurvatureOperator interface (curvkit.linalg.operator) on explicit small matrices."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.sparse.linalg import eigsh

from curvkit.linalg.krylov import NotPositiveDefiniteError
from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import (
    CurvatureOperator,
    DenseOperator,
    DiagonalOperator,
    FunctionOperator,
    IdentityOperator,
    ScaledSumOperator,
)

D64 = torch.float64


LAYOUT = ParamLayout(("w", "b"), (torch.Size([2, 3]), torch.Size([2])))  # d = 8


def _spd(seed: int = 0, shift: float = 0.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(8, 8, generator=g, dtype=D64)
    return A @ A.T / 8 + shift * torch.eye(8, dtype=D64)


def test_matmul_vector_matrix_and_parameter_list():
    A = _spd()
    op = DenseOperator(LAYOUT, A)
    v = torch.arange(8, dtype=D64)
    assert torch.allclose(op @ v, A @ v)
    V = torch.randn(8, 3, dtype=D64)
    assert torch.allclose(op @ V, A @ V)
    out = op @ [v[:6].reshape(2, 3), v[6:]]
    assert isinstance(out, list) and [t.shape for t in out] == [torch.Size([2, 3]), torch.Size([2])]
    assert torch.allclose(LAYOUT.flatten(out), A @ v)
    assert torch.allclose(op.matvec(v), A @ v)
    assert op.shape == (8, 8)


def test_matmul_shape_errors():
    op = DenseOperator(LAYOUT, _spd())
    with pytest.raises(ValueError, match="cannot multiply a tensor of shape"):
        op @ torch.ones(7, dtype=D64)
    with pytest.raises(ValueError, match="cannot multiply a tensor of shape"):
        op @ torch.ones(8, 2, 2, dtype=D64)
    with pytest.raises(ValueError, match="expected 2 parameter-shaped tensors"):
        op @ [torch.ones(2, 3, dtype=D64)]
    with pytest.raises(ValueError, match="has shape"):
        op @ [torch.ones(3, 2, dtype=D64), torch.ones(2, dtype=D64)]
    with pytest.raises(TypeError, match="cannot multiply"):
        op @ 3.0  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="does not match"):
        DenseOperator(LAYOUT, torch.eye(7, dtype=D64))


def test_default_to_dense_and_diagonal_from_products():
    A = _spd(1)
    op = FunctionOperator(LAYOUT, lambda M: A @ M, D64)
    assert torch.allclose(op.to_dense(), A)
    d = op.diagonal()
    assert isinstance(d, DiagonalOperator)
    assert torch.allclose(d.flat, A.diagonal())
    assert d.tensors[0].shape == (2, 3)


def test_trace_methods():
    A = _spd(2)
    op = FunctionOperator(LAYOUT, lambda M: A @ M, D64)
    assert torch.allclose(op.trace(), A.trace())
    assert torch.allclose(op.trace("hutch++", num_probes=24), A.trace(), atol=1e-10)  # sketch spans R^8
    est = op.trace("hutchinson", num_probes=2000, generator=torch.Generator().manual_seed(0))
    se = (2 * ((A**2).sum() - (A.diagonal() ** 2).sum()) / 2000).sqrt()
    assert abs(float(est - A.trace())) <= 4 * float(se)
    with pytest.raises(ValueError, match="unknown trace method"):
        op.trace("magic")  # type: ignore[arg-type]


def test_eigenvalues_solve_and_algebra():
    A = _spd(3)
    op = FunctionOperator(LAYOUT, lambda M: A @ M, D64)
    ref = torch.linalg.eigvalsh(A)
    assert torch.allclose(op.eigenvalues(3), ref.flip(0)[:3], atol=1e-10)
    assert torch.allclose(op.eigenvalues(2, which="smallest"), ref[:2].flip(0), atol=1e-10)
    b = torch.randn(8, dtype=D64)
    assert torch.allclose(op.solve(b), torch.linalg.solve(A, b), atol=1e-8)
    Ad = A + 0.3 * torch.eye(8, dtype=D64)
    assert torch.allclose(op.solve(b, damping=0.3), torch.linalg.solve(Ad, b), atol=1e-8)
    sol = op.solve([b[:6].reshape(2, 3), b[6:]], damping=0.3)
    assert torch.allclose(LAYOUT.flatten(sol), torch.linalg.solve(Ad, b), atol=1e-8)
    B = torch.randn(8, 2, dtype=D64)
    assert torch.allclose(op.solve(B), torch.linalg.solve(A, B), atol=1e-8)
    # algebra: sums, scaling, damping
    P = DenseOperator(LAYOUT, _spd(4))
    assert torch.allclose((op + P).to_dense(), A + P.matrix)
    assert torch.allclose((2.0 * op).to_dense(), 2 * A)
    assert torch.allclose((op * 0.5).diagonal().flat, 0.5 * A.diagonal())
    damped = op.add_identity(0.7)
    assert isinstance(damped, ScaledSumOperator)
    assert torch.allclose(damped.to_dense(), A + 0.7 * torch.eye(8, dtype=D64))
    assert torch.allclose(damped.diagonal().flat, A.diagonal() + 0.7)


def test_solve_indefinite_raises_clear_error():
    A = torch.diag(torch.tensor([1.0, -2.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=D64))
    op = DenseOperator(LAYOUT, A)
    with pytest.raises(NotPositiveDefiniteError, match="damping"):
        op.solve(torch.ones(8, dtype=D64))


def test_diagonal_operator():
    flat = torch.linspace(0.5, 4.0, 8, dtype=D64)
    D = DiagonalOperator.from_flat(LAYOUT, flat)
    v = torch.randn(8, dtype=D64)
    assert torch.allclose(D @ v, flat * v)
    assert torch.allclose(D.to_dense(), torch.diag(flat))
    assert torch.allclose(D.inverse(0.5).flat, 1 / (flat + 0.5))
    assert torch.allclose(D.logdet(), torch.log(flat).sum())
    assert torch.allclose(D.solve(v, damping=1.0), v / (flat + 1.0))
    assert torch.allclose(D.eigenvalues(2), flat.flip(0)[:2])
    assert torch.allclose(D.trace(), flat.sum())
    assert isinstance(D.add_identity(1.0), DiagonalOperator)
    with pytest.raises(ValueError, match="non-positive"):
        DiagonalOperator.from_flat(LAYOUT, flat - 1.0).inverse()
    with pytest.raises(ValueError, match="expected"):
        DiagonalOperator(LAYOUT, [torch.ones(3, 2, dtype=D64), torch.ones(2, dtype=D64)])


def test_identity_and_incompatible_sum():
    eye = IdentityOperator(LAYOUT, D64)
    assert torch.allclose(eye.to_dense(), torch.eye(8, dtype=D64))
    assert torch.allclose(eye.diagonal().flat, torch.ones(8, dtype=D64))
    other = IdentityOperator(ParamLayout(("a",), (torch.Size([3]),)), D64)
    with pytest.raises(ValueError, match="cannot add"):
        eye + other


def test_to_scipy_eigsh_and_products():
    A = _spd(5)
    op = FunctionOperator(LAYOUT, lambda M: A @ M, D64)
    lin = op.to_scipy()
    x = np.arange(8, dtype=np.float64)
    assert np.allclose(lin @ x, (A @ torch.as_tensor(x)).numpy())
    X = np.ones((8, 2))
    assert np.allclose(lin @ X, (A @ torch.as_tensor(X)).numpy())
    vals = np.sort(eigsh(lin, k=3, which="LA", return_eigenvectors=False))[::-1]
    assert np.allclose(vals, torch.linalg.eigvalsh(A).flip(0)[:3].numpy(), atol=1e-10)


def test_base_class_requires_matmat():
    op = CurvatureOperator(LAYOUT, D64)
    with pytest.raises(NotImplementedError):
        op @ torch.ones(8, dtype=D64)
