"""Identities proved in the thesis (digest 002 sections 2.4-2.5, 2.9, 3.1, 3.3), checked numerically."""

import pytest
import torch

from curvkit.curvature.kronecker import kfac, kflr, kfra
from curvkit.curvature.recursion import blockdiag_ggn, blockdiag_hessian
from curvkit.likelihoods import BernoulliBCE, CrossEntropy, Gaussian
from curvkit.models import mlp
from reference import block_mask, dense_ggn, dense_hessian, make_data, per_sample_jacobians

pytestmark = pytest.mark.usefixtures("float64_default")

LIKS = {"ce": CrossEntropy, "bce": BernoulliBCE, "mse": Gaussian}


@pytest.mark.parametrize("lik_name", ["ce", "bce", "mse"])
def test_relu_hessian_blocks_equal_ggn_blocks_and_psd(lik_name):
    """Lemmas 3.17, 3.18, 3.23: for a ReLU net the diagonal Hessian and GGN blocks coincide, are PSD, and
    trace(H) >= 0; per sample H_l == G_l for every layer."""
    model = mlp([4, 5, 3, 3], "relu", seed=6, dtype=torch.float64)
    lik = LIKS[lik_name]("mean")
    data = make_data(lik_name, 7, seed=7)
    rh, rg = blockdiag_hessian(model, lik, data), blockdiag_ggn(model, lik, data)
    for Hl, Gl in zip(rh.pre_activation, rg.pre_activation):
        assert torch.allclose(Hl, Gl, atol=1e-12)
    H = dense_hessian(model, lik, data)
    M = block_mask(model)
    assert torch.allclose(H * M, dense_ggn(model, lik, data) * M, atol=1e-10)
    for blk in rh.blocks():
        assert float(torch.linalg.eigvalsh(blk).min()) > -1e-10
    assert float(H.trace()) >= 0
    assert torch.allclose(H.trace(), rh.to_operator().trace())  # trace = sum of diagonal-block traces


def test_tanh_hessian_blocks_differ_from_ggn():
    """tanh: the blocks differ, by exactly scale * sum_n (H_l - G_l) (x) a_hat a_hat^T (the D_l terms)."""
    model = mlp([4, 5, 3, 3], "tanh", seed=6, dtype=torch.float64)
    lik = CrossEntropy("mean")
    data = make_data("ce", 7, seed=7)
    rh, rg = blockdiag_hessian(model, lik, data), blockdiag_ggn(model, lik, data)
    H, G = dense_hessian(model, lik, data), dense_ggn(model, lik, data)
    M = block_mask(model)
    diff = (H - G) * M
    assert float(diff.abs().max()) > 1e-3
    assert torch.allclose(rh.to_operator().to_dense() - rg.to_operator().to_dense(), diff, atol=1e-10)
    assert torch.allclose(rh.pre_activation[-1], rg.pre_activation[-1])  # H_L = G_L at the output


@pytest.mark.parametrize("act", ["tanh", "relu"])
@pytest.mark.parametrize("lik_name", ["ce", "bce", "mse"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_kflr_and_kfra_exact_for_one_datum(act, lik_name, reduction):
    """Lemma 3.21/3.22 + Eq. 4.6: for ONE datum KFLR (and KFRA, Sec. 4.3.2) equal the exact GGN diagonal
    blocks G_l (x) a_hat a_hat^T, in the flat parameter order, for either reduction."""
    model = mlp([4, 5, 3, 3], act, seed=8, dtype=torch.float64)
    lik = LIKS[lik_name](reduction)
    data = make_data(lik_name, 1, seed=9)
    exact = dense_ggn(model, lik, data) * block_mask(model)
    assert torch.allclose(kflr(model, lik, data).to_dense(), exact, atol=1e-12)
    assert torch.allclose(kfra(model, lik, data).to_dense(), exact, atol=1e-12)


def test_kfra_biased_for_batches():
    """KFRA's nested expectation is biased for B > 1 (differs from KFLR below the output layer), while its
    output layer G_L = mean H_L equals KFLR's exactly."""
    model = mlp([4, 5, 3, 3], "tanh", seed=10, dtype=torch.float64)
    lik = CrossEntropy("mean")
    data = make_data("ce", 7, seed=11)
    a, b = kfra(model, lik, data), kflr(model, lik, data)
    assert torch.allclose(a.blocks[-1].G, b.blocks[-1].G)
    err = float((a.blocks[0].G - b.blocks[0].G).norm() / b.blocks[0].G.norm())
    assert err > 1e-3
    # and KFAC with many samples is close to KFLR, not to KFRA (the targets differ)
    c = kfac(model, lik, data, mc_samples=500, seed=0)
    assert float((c.blocks[0].G - b.blocks[0].G).norm()) < float((c.blocks[0].G - a.blocks[0].G).norm())


def test_kflr_not_exact_for_batches():
    """The factored expectation (Eqs. 4.2-4.3) is an approximation for N > 1: KFLR != exact block."""
    model = mlp([4, 5, 3], "tanh", seed=12, dtype=torch.float64)
    lik = CrossEntropy("mean")
    data = make_data("ce", 6, seed=13)
    exact = blockdiag_ggn(model, lik, data).to_operator().to_dense()
    assert float((kflr(model, lik, data).to_dense() - exact).norm() / exact.norm()) > 1e-3


def test_lemma_4_1_deep_linear_network():
    """Lemma 4.1 (digest 3.1): deep linear net, no bias, square layers (d=3, L=3), squared loss, N=50.
    With V = (1/N) sum_n J_n^T v_n: G_full (G_diag^{-1} V) == L V (G_full is singular, rank 9/27).
    Under the same assumptions the factored blocks are exact: KFLR == KFRA == G_diag."""
    d, L, N = 3, 3, 50
    model = mlp([d] * (L + 1), "identity", bias=False, seed=14, dtype=torch.float64)
    lik = Gaussian("mean")
    g = torch.Generator().manual_seed(15)
    X, y = torch.randn(N, d, generator=g), torch.randn(N, d, generator=g)
    G_full = dense_ggn(model, lik, (X, y))
    assert int(torch.linalg.matrix_rank(G_full)) == 9
    G_diag = blockdiag_ggn(model, lik, (X, y)).to_operator()
    assert torch.allclose(G_diag.to_dense(), G_full * block_mask(model), atol=1e-12)
    J = per_sample_jacobians(model, X)  # (N, d, 27)
    v = torch.randn(N, d, generator=g)
    V = torch.einsum("ncp,nc->p", J, v) / N
    U = G_diag.solve(V)
    assert torch.allclose(G_full @ U, L * V, atol=1e-10)
    assert torch.allclose(kflr(model, lik, (X, y)).to_dense(), G_diag.to_dense(), atol=1e-12)
    assert torch.allclose(kfra(model, lik, (X, y)).to_dense(), G_diag.to_dense(), atol=1e-12)
    # the Kronecker inverse gives the same preconditioned vector
    assert torch.allclose(kfra(model, lik, (X, y)).solve(V), U, atol=1e-10)
