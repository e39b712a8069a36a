"""Custom activation modules that work in place inside a plain ``nn.Sequential`` (issue 31, item 2):
``x.tanh_()``, ``F.silu(x, inplace=True)``, ``x.mul_(torch.sigmoid(x))`` carry no ``inplace`` attribute, so
curvkit reads in-place work off PyTorch's version counters. GGN/Fisher products (cached and uncached), the
exact GGN diagonal, dense matrix and quadratic forms, DiagonalEstimator('ggn') and Laplace(structure='diag')
equal those of the same network with out-of-place activations (float64, atol 1e-12); the Kronecker
estimators refuse clearly; a model that changes its input in place is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvkit.curvature import EmpiricalFisherOperator, GGNOperator, HessianOperator
from curvkit.curvature.estimators import DiagonalEstimator, KroneckerEstimator
from curvkit.laplace import Laplace
from curvkit.likelihoods import CrossEntropy

D64 = torch.float64
ATOL = 1e-12
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


class TanhInPlace(nn.Module):
    def forward(self, x):
        return x.tanh_()


class SiluInPlace(nn.Module):
    def forward(self, x):
        return F.silu(x, inplace=True)


class SwishInPlace(nn.Module):
    def forward(self, x):
        return x.mul_(torch.sigmoid(x))


class Fn(nn.Module):  # the same activation out of place
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


PAIRS = {"tanh_": (TanhInPlace, torch.tanh), "silu_inplace": (SiluInPlace, F.silu),
         "mul_sigmoid": (SwishInPlace, lambda x: x * torch.sigmoid(x))}


def twins(name: str, conv: bool = False):
    inplace, fn = PAIRS[name]
    nets = []
    for act in (inplace, lambda: Fn(fn)):
        torch.manual_seed(0)
        if conv:
            layers = [nn.Conv2d(2, 3, 3, padding=1), act(), nn.Flatten(), nn.Linear(3 * 16, 3)]
        else:
            layers = [nn.Linear(4, 6), act(), nn.Linear(6, 5), act(), nn.Linear(5, 3)]
        nets.append(nn.Sequential(*layers).to(D64))
    g = torch.Generator().manual_seed(1)
    X = torch.randn(8, *((2, 4, 4) if conv else (4,)), generator=g, dtype=D64)
    return nets, (X, torch.randint(0, 3, (8,), generator=g))


def close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("conv", [False, True], ids=["mlp", "conv"])
@pytest.mark.parametrize("name", PAIRS)
def test_exact_routes_equal_the_out_of_place_network(name, conv):
    (a, b), (X, y) = twins(name, conv)
    lik = CrossEntropy("mean")
    split = [(X[:4], y[:4]), (X[4:], y[4:])]
    D = GGNOperator(b, lik, (X, y)).to_dense()
    v = torch.randn(D.shape[0], dtype=D64, generator=torch.Generator().manual_seed(2))
    for data in ((X, y), split):
        G = GGNOperator(a, lik, data)
        close(G @ v, D @ v)
        close(G.diagonal().flat, D.diagonal())
        close(G.quadratic_form(v), v @ D @ v)
    close(GGNOperator(a, lik, (X, y)).to_dense(), D)
    close(EmpiricalFisherOperator(a, lik, (X, y)) @ v, EmpiricalFisherOperator(b, lik, (X, y)) @ v)
    close(HessianOperator(a, lik, (X, y)) @ v, HessianOperator(b, lik, (X, y)) @ v)
    close(DiagonalEstimator(a, lik).update(split).operator().flat, D.diagonal())
    la, lb = (Laplace(m, lik, structure="diag").fit((X, y)) for m in (a, b))
    close(la.log_marginal_likelihood(), lb.log_marginal_likelihood())
    close(la.predict(X), lb.predict(X))


@pytest.mark.parametrize("name", PAIRS)
def test_kronecker_estimators_refuse_with_the_fix(name):
    (a, _), (X, y) = twins(name)
    with pytest.raises(ValueError, match=r"module '0'.*modified in place.*out of place"):
        KroneckerEstimator(a, CrossEntropy(), "kflr").update((X, y))


def test_model_that_changes_its_input_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(TanhInPlace(), nn.Linear(4, 3)).to(D64)
    X, y = torch.randn(8, 4, dtype=D64), torch.randint(0, 3, (8,))
    with pytest.raises(ValueError, match="changed its input X in place"):
        GGNOperator(model, CrossEntropy(), (X, y))
