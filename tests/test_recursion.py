"""Block-diagonal Hessian/GGN recursions (thesis Lemmas 3.16, 3.22) against dense torch.func references."""

import pytest
import torch
from torch import nn

from curvkit.curvature.recursion import blockdiag_ggn, blockdiag_hessian
from curvkit.likelihoods import BernoulliBCE, CrossEntropy, Gaussian
from curvkit.linalg.kron import BlockDiagonalOperator
from curvkit.models import mlp
from reference import block_mask, dense_ggn, dense_hessian, make_data

pytestmark = pytest.mark.usefixtures("float64_default")


LIKS = {"ce": CrossEntropy, "bce": BernoulliBCE, "mse": Gaussian}


@pytest.mark.parametrize("act", ["tanh", "relu"])
@pytest.mark.parametrize("lik_name", ["ce", "bce", "mse"])
@pytest.mark.parametrize("reduction,n", [("mean", 1), ("mean", 5), ("sum", 5)])
def test_recursion_equals_autograd_blocks(act, lik_name, reduction, n):
    """4-5-3-3 MLP: recursion blocks == diagonal blocks of the autograd Hessian / GGN (per sample, batch)."""
    model = mlp([4, 5, 3, 3], act, seed=1, dtype=torch.float64)
    lik = LIKS[lik_name](reduction=reduction)
    data = make_data(lik_name, n, seed=2)
    M = block_mask(model)
    H = dense_hessian(model, lik, data)
    G = dense_ggn(model, lik, data)
    rh = blockdiag_hessian(model, lik, data)
    rg = blockdiag_ggn(model, lik, data)
    Hop = rh.to_operator()
    assert isinstance(Hop, BlockDiagonalOperator)
    assert torch.allclose(Hop.to_dense(), H * M, atol=1e-10)
    assert torch.allclose(rg.to_operator().to_dense(), G * M, atol=1e-10)
    # output layer: H_L = G_L = likelihood's output Hessian
    f = model(data[0]).detach()
    assert torch.allclose(rh.pre_activation[-1], lik.output_hessian(f))
    assert torch.allclose(rg.pre_activation[-1], lik.output_hessian(f))
    assert [tuple(a.shape) for a in rh.inputs] == [(n, 5), (n, 6), (n, 4)]


def test_no_bias_multiple_batches_and_signatures():
    model = mlp([4, 5, 3], "sigmoid", bias=False, seed=3, dtype=torch.float64)
    lik = CrossEntropy("mean")
    X, y = make_data("ce", 6, seed=4)
    batches = [(X[:2], y[:2]), (X[2:], y[2:])]
    M = block_mask(model)
    H = dense_hessian(model, lik, batches)
    rh = blockdiag_hessian(model, lik, batches)
    assert torch.allclose(rh.to_operator().to_dense(), H * M, atol=1e-10)
    assert rh.scale == 1 / 6 and [tuple(a.shape) for a in rh.inputs] == [(6, 4), (6, 5)]
    assert torch.allclose(blockdiag_hessian(model, lik, X, y).block(0), rh.block(0))
    G = dense_ggn(model, lik, batches)
    assert torch.allclose(blockdiag_ggn(model, lik, iter(batches)).to_operator().to_dense(), G * M, atol=1e-10)


def test_composed_activations_and_flatten():
    """Several elementwise activations in a row (chain rule for phi', phi'') and a leading Flatten."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.Tanh(), nn.Sigmoid(), nn.Identity(),
                          nn.Linear(3, 3), nn.LeakyReLU(0.1), nn.Linear(3, 2)).double()
    lik = Gaussian("sum")
    X = torch.randn(3, 2, 2, dtype=torch.float64)
    y = torch.randn(3, 2, dtype=torch.float64)
    M = block_mask(model)
    assert torch.allclose(blockdiag_hessian(model, lik, (X, y)).to_operator().to_dense(),
                          dense_hessian(model, lik, (X, y)) * M, atol=1e-10)


def test_unsupported_models_raise():
    lik = CrossEntropy()
    X, y = make_data("ce", 2)
    bn = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 3)).double()
    with pytest.raises(ValueError, match=r"module '1' \(BatchNorm1d\) is not supported"):
        blockdiag_hessian(bn, lik, (X, y))
    out_act = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3), nn.Softmax(-1)).double()
    with pytest.raises(ValueError, match=r"module '3' \(Softmax\)"):
        blockdiag_ggn(out_act, lik, (X, y))
    tail_act = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3), nn.Tanh()).double()
    with pytest.raises(ValueError, match="ends with an activation"):
        blockdiag_ggn(tail_act, lik, (X, y))
    with pytest.raises(ValueError, match=r"nn\.Sequential"):
        blockdiag_ggn(nn.Linear(4, 3).double(), lik, (X, y))
    model = mlp([4, 3], seed=0, dtype=torch.float64)
    with pytest.raises(ValueError, match="NaN"):
        blockdiag_hessian(model, lik, (X * float("nan"), y))
    with pytest.raises(TypeError, match="pass the targets"):
        blockdiag_hessian(model, lik, X)
