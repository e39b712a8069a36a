"""Many classes: output-space products never hold a (C, C) matrix per position.

Structural test: the likelihoods' dense output-Hessian forms (``output_hessian``, the full square root, the
output Fisher's dense factor, ``reduced_factor``) are patched to raise, and every product path of every exact
output-factor operator (products of one and several columns, quadratic forms, Hutchinson traces and diagonals,
Lanczos, CG) still runs, on (B, C) and (B, T, C) outputs, through the recorded-tangent, forward-mode (dual
numbers, vmapped jvp) and reverse-over-reverse routes, cached or not; a dispatch mode also refuses any tensor
ending in (C, C). The exact diagonal takes the square root's columns in chunks and gives the same answer in
any chunking. A GGN-vector product with a 50,000-class head (GPT-2's vocabulary) runs on a tiny net.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, jvp, vjp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import curvkit.curvature.exact as exact_mod
import curvkit.curvature.output_space as output_space
from curvkit.architectures import causal_lm
from curvkit.curvature import EmpiricalFisherOperator, FisherOperator, GGNOperator, MCFisherOperator
from curvkit.likelihoods import CrossEntropy, Likelihood
from curvkit.models import mlp
from reference import NotSequential, dense_ggn_flat, unfused_attention

D64 = torch.float64
C = 97  # > output_space.SMALL_C, and prime: no other dimension of these models equals it


class NoSquare(TorchDispatchMode):
    """Raises when any operation returns a tensor whose last two dimensions are both ``c``."""

    def __init__(self, c: int):
        super().__init__()
        self.c = c

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.c and t.shape[-2] == self.c:
                raise AssertionError(f"{func} built a tensor of shape {tuple(t.shape)}")
        return out


@pytest.fixture
def no_dense_output_hessian(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a dense output-space form was used")

    for name in ("output_hessian", "output_hessian_sqrt"):
        monkeypatch.setattr(Likelihood, name, refuse)
    monkeypatch.setattr(CrossEntropy, "_hessian", refuse)
    for name in ("output_fisher_sqrt", "output_fisher", "reduced_factor"):
        monkeypatch.setattr(output_space, name, refuse)
    monkeypatch.setattr(exact_mod, "reduced_factor", refuse)


def _models():
    torch.manual_seed(0)
    seq = mlp([4, 5, C], "tanh", dtype=D64)
    gpt = causal_lm(vocab_size=C, max_len=3, dim=4, depth=1, heads=2, mlp_dim=4, seed=0, dtype=D64)
    g = torch.Generator().manual_seed(1)
    return {
        "sequential": (seq, (torch.randn(3, 4, generator=g, dtype=D64), torch.randint(0, C, (3,), generator=g))),
        "wrapped": (NotSequential(seq), (torch.randn(3, 4, generator=g, dtype=D64),
                                         torch.randint(0, C, (3,), generator=g))),
        "gpt": (gpt, (torch.randint(0, C, (2, 3), generator=g), torch.randint(0, C, (2, 3), generator=g))),
    }


@pytest.mark.filterwarnings("ignore:conjugate gradients did not converge")
@pytest.mark.parametrize(("cache", "reverse"), [(None, False), (False, False), (None, True)])
@pytest.mark.parametrize("name", ["sequential", "wrapped", "gpt"])
@pytest.mark.parametrize("cls", [GGNOperator, FisherOperator, MCFisherOperator, EmpiricalFisherOperator])
def test_products_use_no_dense_output_hessian(cls, name, cache, reverse, no_dense_output_hessian):
    model, data = _models()[name]
    op = cls(model, CrossEntropy("mean"), data, cache_linearisation=cache, reverse_tangents=reverse)
    d = op.layout.dim
    g = torch.Generator().manual_seed(0)
    with NoSquare(C):
        v, V = torch.randn(d, generator=g, dtype=D64), torch.randn(d, 3, generator=g, dtype=D64)
        Gv, GV = op @ v, op @ V
        op.quadratic_form(V)
        op.trace("hutchinson", num_probes=3, generator=g)
        op.diagonal("hutchinson", num_probes=2, generator=g)
        op.eigenvalues(1, num_iter=3, generator=g)
        op.solve(v, damping=1.0, max_iter=3)
    assert Gv.abs().max() > 0 and GV.shape == (d, 3)


def test_products_without_dense_forms_are_right():
    model, data = _models()["gpt"]
    lik = CrossEntropy("sum")
    ref = dense_ggn_flat(model, lik, data)
    G, F_ = GGNOperator(model, lik, data), FisherOperator(model, lik, data)
    V = torch.randn(G.layout.dim, 2, generator=torch.Generator().manual_seed(0), dtype=D64)
    torch.testing.assert_close(G @ V, ref @ V, atol=1e-10, rtol=0)
    torch.testing.assert_close(F_ @ V, ref @ V, atol=1e-10, rtol=0)
    torch.testing.assert_close(G.quadratic_form(V), (V * (ref @ V)).sum(0), atol=1e-10, rtol=0)


@pytest.mark.parametrize("cls", [GGNOperator, FisherOperator])
def test_exact_diagonal_takes_square_root_columns_in_chunks(cls, monkeypatch):
    model, data = _models()["gpt"]
    lik = CrossEntropy("mean")
    whole = cls(model, lik, data).diagonal().flat
    torch.testing.assert_close(whole, dense_ggn_flat(model, lik, data).diagonal(), atol=1e-10, rtol=0)
    monkeypatch.setattr(exact_mod, "_ROW_BUDGET", 600)  # a few columns per chunk
    asked: list[slice] = []
    columns = cls.output_sqrt_columns

    def spy(self, i, f, y, cols):
        asked.append(cols)
        return columns(self, i, f, y, cols)

    monkeypatch.setattr(cls, "output_sqrt_columns", spy)
    with NoSquare(C):
        chunked = cls(model, lik, data).diagonal().flat
    assert len(asked) >= 10 and all(c.stop - c.start <= 600 // (2 * 3 * C) + 1 for c in asked)
    torch.testing.assert_close(chunked, whole, atol=1e-12, rtol=0)


def _ggn_vector_reference(model: nn.Module, X: torch.Tensor, y: torch.Tensor, v) -> torch.Tensor:
    """J^T (d^2 loss / df^2) J v with the output Hessian by forward-over-reverse on F.cross_entropy (sum)."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def f(p):
        return torch.func.functional_call(model, p, (X,))

    with unfused_attention():
        out, Jv = jvp(f, (params,), (v,))
        loss_grad = grad(lambda o: F.cross_entropy(o.reshape(-1, o.shape[-1]), y.reshape(-1), reduction="sum"))
        HJv = jvp(loss_grad, (out,), (Jv,))[1]
        return vjp(f, params)[1](HJv)[0]


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_ggn_vector_product_with_a_50k_class_head(name):
    """GPT-2's vocabulary: (B, C, C) would be 2 x 50,257^2 numbers (40 GB in float64); the product holds
    tensors of the logits' size."""
    V = 50_257
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        torch.manual_seed(0)
        model = mlp([4, 3, V], "tanh")
        X, y = torch.randn(2, 4, generator=g), torch.randint(0, V, (2,), generator=g)
    else:
        model = causal_lm(vocab_size=V, max_len=3, dim=2, depth=1, heads=1, mlp_dim=2, seed=0)
        X, y = torch.randint(0, V, (2, 3), generator=g), torch.randint(0, V, (2, 3), generator=g)
    G = GGNOperator(model, CrossEntropy("sum"), (X, y))
    v = [torch.randn(p.shape, generator=g) for p in model.parameters()]
    with NoSquare(V):
        Gv = G @ v
        q = G.quadratic_form(G.layout.flatten(v))
    ref = _ggn_vector_reference(model, X, y, dict(zip([n for n, _ in model.named_parameters()], v)))
    for a, b in zip(Gv, ref.values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(q, sum((a * b).sum() for a, b in zip(v, ref.values())), atol=1e-4, rtol=1e-4)
