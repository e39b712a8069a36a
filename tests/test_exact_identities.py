"""Thesis identities (digest 002, section 2.9) checked with the exact operators on tiny float64 nets.

* GGN == type-2 Fisher for softmax CE, sigmoid BCE and Gaussian heads (Eqs. 3.36-3.38), with the output
  Fisher computed from its definition; the empirical Fisher differs (negative test with a margin).
* Lemma 3.20, exact discrete version: E_{y ~ model}[H_theta(x, y)] == G_theta(x).
* Rank (Sec. 3.6, Eq. 3.39): rank(G) <= N * rank(H_L); K - 1 per sample for softmax.
* Piecewise-linear nets (Lemmas 3.17, 3.18, 3.23): Hessian and GGN diagonal blocks coincide and are PSD,
  trace(H) >= 0; for tanh nets the blocks differ.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from curvkit.curvature import (
    EmpiricalFisherOperator,
    FisherOperator,
    GGNOperator,
    HessianOperator,
    output_fisher,
    output_fisher_sqrt,
)
from curvkit.likelihoods import BernoulliBCE, CrossEntropy, Gaussian
from curvkit.models import mlp
from reference import dense_fisher_categorical

D64 = torch.float64




def _data(n: int, lik_name: str, in_dim: int = 3, out_dim: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, in_dim, generator=g, dtype=D64)
    if lik_name == "ce":
        y = torch.randint(0, out_dim, (n,), generator=g)
    elif lik_name == "bce":
        y = torch.randint(0, 2, (n, out_dim), generator=g).to(D64)
    else:
        y = torch.randn(n, out_dim, generator=g, dtype=D64)
    return X, y


LIKS = {"ce": lambda r: CrossEntropy(r), "bce": lambda r: BernoulliBCE(r), "gauss": lambda r: Gaussian(r, sigma=0.6)}


# ---------------------------------------------------------------------------------------- GGN == Fisher
@pytest.mark.parametrize("lik_name", ["ce", "bce", "gauss"])
def test_output_fisher_by_definition_equals_output_hessian(lik_name):
    """F_L = E_{y~p(y|f)}[g g^T] (Eq. 3.36) equals H_L for the three heads (Eqs. 3.37-3.38)."""
    lik = LIKS[lik_name]("sum")
    f = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), dtype=D64)
    S = output_fisher_sqrt(lik, f)
    torch.testing.assert_close(S @ S.transpose(1, 2), output_fisher(lik, f), atol=1e-14, rtol=0)
    torch.testing.assert_close(output_fisher(lik, f), lik.output_hessian(f), atol=1e-14, rtol=0)
    # and E[g g^T] by explicit enumeration / sampling, independently of output_fisher_sqrt
    if lik_name == "ce":
        p = f.softmax(-1)
        F = sum(p[:, c, None, None] * torch.einsum("bi,bj->bij", *(2 * [lik.output_grad(f, torch.full((4,), c))]))
                for c in range(3))
        torch.testing.assert_close(F, lik.output_hessian(f), atol=1e-14, rtol=0)
    elif lik_name == "bce":
        s = torch.sigmoid(f)
        F = torch.zeros(4, 3, 3, dtype=D64)
        for bits in itertools.product([0.0, 1.0], repeat=3):
            y = torch.tensor(bits, dtype=D64).expand(4, 3)
            prob = (s**y * (1 - s) ** (1 - y)).prod(-1)
            g = lik.output_grad(f, y)
            F += prob[:, None, None] * torch.einsum("bi,bj->bij", g, g)
        torch.testing.assert_close(F, lik.output_hessian(f), atol=1e-14, rtol=0)
    else:  # Gaussian: Monte Carlo with 4 standard errors (each entry of g g^T has variance <= 2/sigma^4)
        gen = torch.Generator().manual_seed(0)
        m = 40_000
        fm = f.repeat(m, 1)  # (m * B, C): m independent draws per sample
        g = lik.output_grad(fm, lik.sample(fm, gen)).reshape(m, 4, 3)
        F = torch.einsum("mbi,mbj->bij", g, g) / m
        se = (2.0 / lik.sigma**4 / m) ** 0.5
        assert float((F - lik.output_hessian(f)).abs().max()) < 4 * se


@pytest.mark.parametrize("lik_name", ["ce", "bce", "gauss"])
def test_ggn_equals_type2_fisher(lik_name):
    torch.manual_seed(3)
    model = mlp([3, 5, 3], "tanh", dtype=D64)
    data = [_data(3, lik_name, seed=1), _data(2, lik_name, seed=2)]
    lik = LIKS[lik_name]("mean")
    G = GGNOperator(model, lik, data)
    F = FisherOperator(model, lik, data)
    torch.testing.assert_close(F.to_dense(), G.to_dense(), atol=1e-12, rtol=0)
    v = torch.randn(G.layout.dim, dtype=D64)
    torch.testing.assert_close(F @ v, G @ v, atol=1e-12, rtol=0)
    torch.testing.assert_close(F.diagonal().flat, G.diagonal().flat, atol=1e-12, rtol=0)
    if lik_name == "ce":  # against the reference's per-class-gradient definition sum_n sum_c p_c g g^T
        torch.testing.assert_close(F.to_dense(), dense_fisher_categorical(model, data, "mean"), atol=1e-12, rtol=0)


@pytest.mark.parametrize("lik_name", ["ce", "bce", "gauss"])
def test_empirical_fisher_differs_from_ggn(lik_name):
    torch.manual_seed(4)
    model = mlp([3, 5, 3], "tanh", dtype=D64)
    data = _data(6, lik_name, seed=3)
    lik = LIKS[lik_name]("sum")
    G = GGNOperator(model, lik, data).to_dense()
    E = EmpiricalFisherOperator(model, lik, data).to_dense()
    rel = float(torch.linalg.norm(E - G) / torch.linalg.norm(G))
    assert rel > 0.2, f"empirical Fisher unexpectedly close to the GGN (relative difference {rel:.3f})"
    # rank: the empirical Fisher has rank <= N, the GGN generically more
    assert int(torch.linalg.matrix_rank(E)) <= 6 < int(torch.linalg.matrix_rank(G))


# ---------------------------------------------------------------------------------------- Lemma 3.20
def test_lemma_3_20_discrete_categorical():
    """sum_c p(c|x) H_theta(x, c) == G_theta(x) exactly, while H(x, c) != G(x) for the single labels."""
    torch.manual_seed(5)
    model = mlp([3, 4, 3], "tanh", dtype=D64)
    x = torch.randn(1, 3, dtype=D64)
    lik = CrossEntropy("sum")
    p = model(x).detach().softmax(-1)[0]
    G = GGNOperator(model, lik, (x, torch.tensor([0]))).to_dense()
    Hs = [HessianOperator(model, lik, (x, torch.tensor([c]))).to_dense() for c in range(3)]
    torch.testing.assert_close(sum(p[c] * Hs[c] for c in range(3)), G, atol=1e-12, rtol=0)
    assert max(float((H - G).abs().max()) for H in Hs) > 1e-2  # the residual term is not zero per label


def test_lemma_3_20_discrete_bernoulli():
    torch.manual_seed(6)
    model = mlp([3, 4, 2], "tanh", dtype=D64)
    x = torch.randn(1, 3, dtype=D64)
    lik = BernoulliBCE("sum")
    s = torch.sigmoid(model(x).detach())[0]
    G = GGNOperator(model, lik, (x, torch.zeros(1, 2, dtype=D64))).to_dense()
    EH = torch.zeros_like(G)
    for bits in itertools.product([0.0, 1.0], repeat=2):
        y = torch.tensor([bits], dtype=D64)
        prob = float((s**y[0] * (1 - s) ** (1 - y[0])).prod())
        EH += prob * HessianOperator(model, lik, (x, y)).to_dense()
    torch.testing.assert_close(EH, G, atol=1e-12, rtol=0)


def test_lemma_3_20_gaussian_residual_vanishes_at_the_mean():
    """The Gaussian Hessian is affine in y, so E_y[H(x, y)] = H(x, f(x)) = G(x)."""
    torch.manual_seed(7)
    model = mlp([3, 4, 2], "tanh", dtype=D64)
    x = torch.randn(2, 3, dtype=D64)
    lik = Gaussian("sum", sigma=0.5)
    f = model(x).detach()
    G = GGNOperator(model, lik, (x, f)).to_dense()
    torch.testing.assert_close(HessianOperator(model, lik, (x, f)).to_dense(), G, atol=1e-12, rtol=0)
    y = f + torch.randn(2, 2, dtype=D64)
    assert float((HessianOperator(model, lik, (x, y)).to_dense() - G).abs().max()) > 1e-2


# ---------------------------------------------------------------------------------------- rank
@pytest.mark.parametrize("lik_name,per_sample_rank", [("ce", 2), ("bce", 3), ("gauss", 3)])
def test_rank_of_ggn(lik_name, per_sample_rank):
    torch.manual_seed(8)
    model = mlp([3, 6, 3], "tanh", dtype=D64)  # d = 45 > N * C
    lik = LIKS[lik_name]("sum")
    one = GGNOperator(model, lik, _data(1, lik_name, seed=4)).to_dense()
    assert int(torch.linalg.matrix_rank(one)) == per_sample_rank  # rank(H_L): K - 1 for softmax
    for n in (2, 4):
        G = GGNOperator(model, lik, _data(n, lik_name, seed=5)).to_dense()
        r = int(torch.linalg.matrix_rank(G))
        assert r <= n * 3 and r == n * per_sample_rank


# ---------------------------------------------------------------------------------------- piecewise linear
def _layer_blocks(layout) -> list[torch.Tensor]:
    """Index sets of each layer's parameters (weight and bias of one Linear = one diagonal block)."""
    groups: dict[str, list[int]] = {}
    for name, sl in layout.slices().items():
        groups.setdefault(name.rsplit(".", 1)[0], []).extend(range(sl.start, sl.stop))
    return [torch.tensor(ix) for ix in groups.values()]


def _hessian_and_ggn(activation: nn.Module):
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(3, 4), activation, nn.Linear(4, 4), type(activation)(),
                          nn.Linear(4, 3)).to(D64)
    data = _data(6, "ce", seed=6)
    lik = CrossEntropy("mean")
    return HessianOperator(model, lik, data), GGNOperator(model, lik, data)


def test_relu_hessian_and_ggn_diagonal_blocks_coincide_and_are_psd():
    H_op, G_op = _hessian_and_ggn(nn.ReLU())
    H, G = H_op.to_dense(), G_op.to_dense()
    assert float((H - G).abs().max()) > 1e-3  # the off-diagonal (first-order) blocks do differ
    for ix in _layer_blocks(H_op.layout):
        Hb, Gb = H[ix][:, ix], G[ix][:, ix]
        torch.testing.assert_close(Hb, Gb, atol=1e-12, rtol=0)  # Lemma 3.23
        assert float(torch.linalg.eigvalsh(Hb).min()) > -1e-12  # Lemma 3.17
    tr = H_op.trace()
    assert float(tr) >= 0  # Lemma 3.18
    torch.testing.assert_close(tr, G_op.trace(), atol=1e-12, rtol=0)


def test_tanh_hessian_and_ggn_diagonal_blocks_differ():
    H_op, G_op = _hessian_and_ggn(nn.Tanh())
    H, G = H_op.to_dense(), G_op.to_dense()
    gaps = [float((H[ix][:, ix] - G[ix][:, ix]).abs().max()) for ix in _layer_blocks(H_op.layout)]
    assert max(gaps[:-1]) > 1e-3  # hidden layers: D_l terms (phi'' != 0) make the blocks differ
    assert gaps[-1] < 1e-12  # the output layer's block is always H_L-based (no activation after it)
