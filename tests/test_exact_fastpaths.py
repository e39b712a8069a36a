"""The fast paths of the exact operators agree with dense references (float64, tiny models).

* single-column products by forward-mode dual numbers (one forward + one backward pass);
* ``quadratic_form`` (v^T C v = w sum_n ||S_n^T J_n v||^2, jvp only) and Hutchinson traces built on it;
* Hessian products by reverse-over-reverse with a cached differentiable gradient (and their fallback);
* tr(H) = tr(G) and diag(H) = diag(G) for piecewise-linear networks (thesis Lemma 3.23), the
  ``piecewise_linear`` option of ``HessianOperator.trace`` and its structural verification;
* Kronecker blocks built from Gram matrices without validation equal validated blocks.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from curvkit.curvature import (
    EmpiricalFisherOperator,
    FisherOperator,
    GGNOperator,
    HessianOperator,
    MCFisherOperator,
    hessian_trace,
    piecewise_linear_reason,
)
from curvkit.likelihoods import CrossEntropy, Gaussian
from curvkit.linalg.kron import KroneckerBlock
from curvkit.linalg.operator import DenseOperator
from curvkit.linalg.trace import hutchinson
from curvkit.models import lenet, mlp
from reference import NotSequential, dense_empirical_fisher, dense_ggn, dense_hessian

D64 = torch.float64


def _data(act: str = "tanh", n: int = 6, wrap: bool = False):
    model = mlp([3, 4, 3], act, dtype=D64, seed=0)
    model = NotSequential(model) if wrap else model
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(n, 3, dtype=D64, generator=gen)
    y = torch.randint(0, 3, (n,), generator=gen)
    return model, [(X[:4], y[:4]), (X[4:], y[4:])]  # two batches of different sizes


def _small_cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 3)).to(D64)
    X = torch.randn(5, 1, 6, 6, dtype=D64)
    return model, (X, torch.tensor([0, 1, 2, 1, 0]))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_single_column_dual_product_matches_dense_and_batched_path(reduction):
    model, data = _data(wrap=True)
    lik = CrossEntropy(reduction)
    refs = {GGNOperator: dense_ggn(model, lik, data), FisherOperator: dense_ggn(model, lik, data),
            EmpiricalFisherOperator: dense_empirical_fisher(model, lik, data)}
    v = torch.randn(31, dtype=D64, generator=torch.Generator().manual_seed(1))
    for cls, ref in refs.items():
        op = cls(model, lik, data)
        torch.testing.assert_close(op @ v, ref @ v, atol=1e-12, rtol=0)  # one column: dual numbers
        assert op._sequential_layers() is None  # not a plain Sequential: the torch.func paths ran
        assert op._use_forward_mode  # the forward-mode tangents ran (no fallback)
        two = op @ torch.stack([v, 2 * v], 1)  # several columns: vmapped jvp + a batched backward pass
        torch.testing.assert_close(two[:, 0], ref @ v, atol=1e-12, rtol=0)
    mc = MCFisherOperator(model, lik, data, mc_samples=2, seed=3)
    torch.testing.assert_close(mc @ v, (mc.to_dense() @ v), atol=1e-12, rtol=0)


def test_dual_product_falls_back_when_forward_ad_fails(monkeypatch):
    model, data = _data(wrap=True)
    lik = CrossEntropy("sum")
    op = GGNOperator(model, lik, data)

    def broken(*args, **kwargs):
        raise NotImplementedError("no forward-mode formula (simulated)")

    monkeypatch.setattr(op, "_forward_mode", broken)
    v = torch.ones(31, dtype=D64)
    with pytest.warns(RuntimeWarning, match="forward-mode AD failed.*reverse-over-reverse"):
        out = op @ v  # tangents by reverse-over-reverse through the forward graph
    torch.testing.assert_close(out, dense_ggn(model, lik, data) @ v, atol=1e-12, rtol=0)


def test_quadratic_form_matches_dense():
    model, data = _data()
    lik = CrossEntropy("mean")
    V = torch.randn(31, 5, dtype=D64, generator=torch.Generator().manual_seed(2))
    for op, ref in [(GGNOperator(model, lik, data), dense_ggn(model, lik, data)),
                    (EmpiricalFisherOperator(model, lik, data), dense_empirical_fisher(model, lik, data))]:
        op.chunk_size = 2  # exercise the chunking over columns
        torch.testing.assert_close(op.quadratic_form(V), (V * (ref @ V)).sum(0), atol=1e-12, rtol=0)
        torch.testing.assert_close(op.quadratic_form(V[:, 0]), V[:, 0] @ ref @ V[:, 0], atol=1e-12, rtol=0)
        with pytest.raises(ValueError, match="quadratic_form"):
            op.quadratic_form(torch.ones(30, 2, dtype=D64))
    dense = DenseOperator(op.layout, ref)  # base-class default
    torch.testing.assert_close(dense.quadratic_form(V), (V * (ref @ V)).sum(0))


def test_hutchinson_on_quadratic_forms_equals_hutchinson_on_products():
    model, data = _data()
    G = GGNOperator(model, Gaussian(sigma=0.5, reduction="sum"), [(X, torch.randn(X.shape[0], 3, dtype=D64))
                                                                   for X, _ in data])
    via_qf = G.trace("hutchinson", num_probes=40, generator=torch.Generator().manual_seed(5))
    via_mm = hutchinson(G._matmat, G.layout.dim, 40, D64, "cpu", generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(via_qf, via_mm, atol=1e-10, rtol=0)  # same probes, same estimate


@pytest.mark.parametrize("cache_graph", [None, True, False])
def test_hessian_products_with_and_without_graph_cache(cache_graph):
    model, data = _data()
    lik = CrossEntropy("mean")
    ref = dense_hessian(model, lik, data)
    H = HessianOperator(model, lik, data, cache_graph=cache_graph)
    assert H.caches_graph == bool(cache_graph)  # auto: two batches -> no cache
    V = torch.randn(31, 3, dtype=D64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(H @ V, ref @ V, atol=1e-12, rtol=0)
    torch.testing.assert_close(H @ V[:, 1], ref @ V[:, 1], atol=1e-12, rtol=0)  # reuses a cached graph
    with torch.no_grad():  # the operator stays at its snapshot
        for p in model.parameters():
            p.add_(1.0)
    torch.testing.assert_close(H @ V, ref @ V, atol=1e-12, rtol=0)


def test_hessian_single_batch_caches_by_default_and_validates_option():
    model, data = _data()
    lik = CrossEntropy("sum")
    H = HessianOperator(model, lik, data[0])
    assert H.caches_graph
    torch.testing.assert_close(H.to_dense(), dense_hessian(model, lik, data[0]), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="cache_graph"):
        HessianOperator(model, lik, data[0], cache_graph="yes")  # type: ignore[arg-type]


def test_hessian_double_backward_fallback(monkeypatch):
    model, data = _data()
    lik = CrossEntropy("sum")
    H = HessianOperator(model, lik, data[0])

    def broken(M):
        raise RuntimeError("double backward not implemented (simulated)")

    monkeypatch.setattr(H, "_matmat_double_backward", broken)
    with pytest.warns(RuntimeWarning, match="double backward failed"):
        out = H @ torch.eye(31, dtype=D64)
    torch.testing.assert_close(out, dense_hessian(model, lik, data[0]), atol=1e-12, rtol=0)


@pytest.mark.parametrize("which", ["mlp", "cnn"])
def test_lemma_3_23_hessian_and_ggn_diagonal_blocks_coincide_for_relu(which):
    model, data = _data("relu") if which == "mlp" else _small_cnn()
    lik = CrossEntropy("sum")
    H, G = dense_hessian(model, lik, data), dense_ggn(model, lik, data)
    assert float((H - G).abs().max()) > 1e-3  # the off-diagonal blocks differ ...
    torch.testing.assert_close(H.diagonal(), G.diagonal(), atol=1e-12, rtol=0)  # ... the diagonals do not
    torch.testing.assert_close(H.trace(), G.trace(), atol=1e-12, rtol=0)
    op = HessianOperator(model, lik, data)
    torch.testing.assert_close(op.trace("exact", piecewise_linear=True), H.trace(), atol=1e-12, rtol=0)


def test_piecewise_linear_hutchinson_is_unbiased_for_the_hessian_trace():
    model, data = _data("relu")
    lik = CrossEntropy("mean")
    exact = dense_hessian(model, lik, data).trace()
    H = HessianOperator(model, lik, data)
    G = GGNOperator(model, lik, data)
    # same probes: the piecewise-linear Hessian trace IS the GGN's Hutchinson estimate
    est = H.trace("hutchinson", num_probes=64, generator=torch.Generator().manual_seed(7), piecewise_linear=True)
    ref = G.trace("hutchinson", num_probes=64, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(est, ref, atol=1e-12, rtol=0)
    # in expectation: 4000 Rademacher probes, mean within 4 standard errors of the exact tr(H)
    Z = torch.randint(0, 2, (31, 4000), generator=torch.Generator().manual_seed(8)).to(D64) * 2 - 1
    vals = G.quadratic_form(Z)
    stderr = vals.std() / 4000**0.5
    assert float(stderr) > 0
    assert abs(float(vals.mean() - exact)) < 4 * float(stderr)
    assert abs(float(hessian_trace(model, lik, data, method="exact", piecewise_linear="auto") - exact)) < 1e-12


def test_piecewise_linear_verification_and_fallback():
    assert piecewise_linear_reason(mlp([3, 4, 3], "relu")) is None
    assert piecewise_linear_reason(lenet()) is None
    assert "Tanh" in (piecewise_linear_reason(mlp([3, 4, 3], "tanh")) or "")
    shared = nn.Linear(3, 3)
    assert "more than once" in (piecewise_linear_reason(nn.Sequential(shared, nn.ReLU(), shared)) or "")

    class Custom(nn.Sequential):  # a subclass may override forward: not verifiable
        pass

    assert piecewise_linear_reason(Custom(nn.Linear(3, 3))) is not None
    model, data = _data("tanh")
    lik = CrossEntropy("sum")
    H = HessianOperator(model, lik, data)
    with pytest.raises(ValueError, match="not verifiably piecewise linear"):
        H.trace("hutchinson", piecewise_linear=True)
    with pytest.raises(ValueError, match="piecewise_linear must be"):
        H.trace("hutchinson", piecewise_linear="yes")  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = H.trace("hutchinson", num_probes=8, generator=torch.Generator().manual_seed(1),
                       piecewise_linear="auto")
    hvp = H.trace("hutchinson", num_probes=8, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(auto, hvp, atol=1e-12, rtol=0)  # fell back to Hessian-vector products


def test_kronecker_block_from_gram_equals_validated_block():
    gen = torch.Generator().manual_seed(0)
    a, g = torch.randn(7, 4, dtype=D64, generator=gen), torch.randn(7, 3, dtype=D64, generator=gen)
    fast = KroneckerBlock.from_gram(g.T @ g, a.T @ a, "w", "b", scale_G=0.5, scale_A=0.25)
    slow = KroneckerBlock(0.5 * (g.T @ g), 0.25 * (a.T @ a), "w", "b")
    torch.testing.assert_close(fast.G, slow.G, atol=1e-14, rtol=0)
    torch.testing.assert_close(fast.A, slow.A, atol=1e-14, rtol=0)
    assert torch.equal(fast.A, fast.A.T) and torch.equal(fast.G, fast.G.T)
