"""Jacobian-vector products from a recorded forward pass of a plain nn.Sequential (curvature._tangent).

J v for k directions at once must equal ``torch.func.jvp`` of the functional model for every supported
layer (Linear with/without bias, Conv1d/Conv2d/Conv3d with stride, padding, dilation and groups, elementwise
activations, pooling, reshapes, eval-mode dropout, nested Sequentials, frozen parameters), and the exact
operators that use it must equal the dense references. Unsupported models are recognised, so the
operators fall back to torch.func.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import jvp

from curvkit.curvature import EmpiricalFisherOperator, GGNOperator, HessianOperator, MCFisherOperator
from curvkit.curvature._functional import FunctionalModel, cols_to_params
from curvkit.curvature._layerwise import layer_specs
from curvkit.curvature._tangent import SequentialTangent, sequential_layers
from curvkit.likelihoods import CrossEntropy, Gaussian
from reference import dense_empirical_fisher, dense_ggn

D64 = torch.float64


def _models():
    torch.manual_seed(0)
    frozen = nn.Sequential(nn.Linear(4, 5), nn.Sigmoid(), nn.Linear(5, 3, bias=False))
    frozen[0].weight.requires_grad_(False)
    return {
        "mlp": (nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3)), (6, 4)),
        "leaky-nobias-nested": (nn.Sequential(nn.Sequential(nn.Linear(4, 5, bias=False), nn.LeakyReLU(0.1)),
                                              nn.Identity(), nn.Dropout(0.5).eval(), nn.Linear(5, 3)), (6, 4)),
        "frozen": (frozen, (6, 4)),
        "cnn2d": (nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.ReLU(),
                                nn.Conv2d(4, 4, 2, dilation=2, groups=2), nn.MaxPool2d(2), nn.Flatten(),
                                nn.Linear(4, 3)), (5, 2, 9, 9)),
        "cnn2d-plain": (nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Flatten(), nn.Linear(12, 3)), (5, 2, 9, 9)),
        "cnn1d": (nn.Sequential(nn.Conv1d(1, 3, 3, padding="same"), nn.Tanh(), nn.AvgPool1d(2), nn.Flatten(),
                                nn.Unflatten(1, (3, 4)), nn.Flatten(), nn.Linear(12, 2)), (5, 1, 8)),
        "cnn3d": (nn.Sequential(nn.Conv3d(2, 3, 2, stride=2, padding=1, padding_mode="circular"), nn.ReLU(),
                                nn.Conv3d(3, 3, 1, groups=3, bias=False), nn.Flatten(), nn.Linear(24, 2)),
                  (4, 2, 3, 3, 3)),
    }


@pytest.mark.parametrize("name", list(_models()))
def test_tangent_equals_jvp(name):
    model, xshape = _models()[name]
    model = model.to(D64)
    fm = FunctionalModel(model)
    X = torch.randn(*xshape, dtype=D64, generator=torch.Generator().manual_seed(1))
    layers = sequential_layers(model)
    assert layers is not None
    tan = SequentialTangent(layers, {n: i for i, n in enumerate(fm.names)}, fm.structure)
    f = tan.record(lambda: fm(fm.params, X))
    torch.testing.assert_close(f, fm(fm.params, X))
    k = 3
    M = torch.randn(fm.layout.dim, k, dtype=D64, generator=torch.Generator().manual_seed(2))
    V = cols_to_params(fm.layout, M)
    Jv = tan(V)
    assert Jv.shape == (k, *f.shape)
    for j in range(k):
        ref = jvp(lambda p: fm(p, X), (fm.params,), (tuple(v[j] for v in V),))[1]
        torch.testing.assert_close(Jv[j], ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", list(_models()))
@pytest.mark.parametrize("cached", [True, False])
def test_operators_on_sequential_models_match_dense(name, cached):
    model, xshape = _models()[name]
    model = model.to(D64)
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(*xshape, dtype=D64, generator=gen)
    C = model(X).shape[1]
    y = torch.randint(0, C, (X.shape[0],), generator=gen)
    data = (X, y) if cached else [(X[:3], y[:3]), (X[3:], y[3:])]
    lik = CrossEntropy("mean")
    G = GGNOperator(model, lik, data)
    assert G.caches_linearisation is cached
    ref = dense_ggn(model, lik, data)
    M = torch.randn(G.layout.dim, 4, dtype=D64, generator=gen)
    for _ in range(2):  # the first product and a repeated one
        torch.testing.assert_close(G @ M[:, 0], ref @ M[:, 0], atol=1e-12, rtol=0)
    torch.testing.assert_close(G @ M, ref @ M, atol=1e-12, rtol=0)
    torch.testing.assert_close(G.quadratic_form(M), (M * (ref @ M)).sum(0), atol=1e-12, rtol=0)
    assert G._sequential_layers() is not None  # the recorded-tangent path ran
    E = EmpiricalFisherOperator(model, lik, data)
    torch.testing.assert_close(E @ M, dense_empirical_fisher(model, lik, data) @ M, atol=1e-12, rtol=0)
    F = MCFisherOperator(model, lik, data, mc_samples=2, seed=0)
    torch.testing.assert_close(F @ M, F.to_dense() @ M, atol=1e-12, rtol=0)


def test_regression_head_and_piecewise_linear_trace():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 2)).to(D64)
    X, Y = torch.randn(8, 3, dtype=D64), torch.randn(8, 2, dtype=D64)
    lik = Gaussian(reduction="sum")
    G = GGNOperator(model, lik, (X, Y))
    torch.testing.assert_close(G.to_dense(), dense_ggn(model, lik, (X, Y)))
    M = torch.randn(G.layout.dim, 2, dtype=D64)
    torch.testing.assert_close(G @ M, dense_ggn(model, lik, (X, Y)) @ M, atol=1e-12, rtol=0)
    H = HessianOperator(model, lik, (X, Y))  # piecewise linear: tr(H) = tr(G) (thesis Lemma 3.23)
    torch.testing.assert_close(H.trace("exact", piecewise_linear=True), H.trace("exact"))


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(self.lin(x))


@pytest.mark.parametrize("model", [
    nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True), nn.Linear(3, 2)),  # overwrites an activation
    nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)),  # a layer with state
    nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.Linear(3, 2)),  # random in train mode
    nn.Sequential(_Twice()),  # a container that is not an nn.Sequential
    _Twice(),
])
def test_unsupported_models_are_recognised_and_still_exact(model):
    assert sequential_layers(model) is None
    model = model.to(D64).eval() if any(isinstance(m, nn.BatchNorm1d) for m in model.modules()) else model.to(D64)
    if any(isinstance(m, nn.Dropout) for m in model.modules()):
        return  # a random model has no fixed GGN; recognising it is the point
    torch.manual_seed(1)
    X, y = torch.randn(5, 3, dtype=D64), torch.randint(0, 2, (5,))
    lik = CrossEntropy("sum")
    G = GGNOperator(model, lik, (X, y))
    M = torch.randn(G.layout.dim, 2, dtype=D64)
    torch.testing.assert_close(G @ M, dense_ggn(model, lik, (X, y)) @ M, atol=1e-12, rtol=0)


def test_shared_module_is_rejected():
    lin = nn.Linear(3, 3)
    assert sequential_layers(nn.Sequential(lin, nn.ReLU(), lin)) is None


def test_reduced_output_factor_drops_only_common_null_directions():
    from curvkit.curvature.output_space import reduced_factor

    f = torch.randn(6, 4, dtype=D64, generator=torch.Generator().manual_seed(0))
    S = CrossEntropy("sum").output_hessian_sqrt(f)
    R = reduced_factor(S)
    assert R.shape == (6, 4, 3)  # softmax: the all-ones direction is null for every sample
    torch.testing.assert_close(R @ R.mT, S @ S.mT, atol=1e-14, rtol=0)
    G = Gaussian(reduction="sum").output_hessian_sqrt(f)
    assert reduced_factor(G) is G  # full rank: nothing to drop
    S2 = S.clone()
    S2[0] = torch.randn(4, 4, dtype=D64)  # one sample of full rank keeps every direction
    assert reduced_factor(S2).shape == (6, 4, 4)


def test_reduced_output_factor_falls_back_when_eigh_fails(failing_eigh):
    """LAPACK's eigh can fail on saturated softmax outputs (seen on a LeNet in dataset-sequence): float32
    failures are retried in float64, and if that fails too the unreduced factor is returned (still exact)."""
    from curvkit.curvature import output_space

    f = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    S = CrossEntropy("sum").output_hessian_sqrt(f)
    calls = failing_eigh("float32")
    R = output_space.reduced_factor(S)
    assert calls == [torch.float32, torch.float64] and R.dtype == S.dtype and R.shape == (5, 4, 3)
    torch.testing.assert_close(R @ R.mT, S @ S.mT, atol=1e-6, rtol=1e-5)

    failing_eigh("always")
    assert output_space.reduced_factor(S) is S

    failing_eigh("nan")  # LAPACK can also return NaN without raising
    assert output_space.reduced_factor(S) is S


@pytest.mark.parametrize("name", ["mlp", "leaky-nobias-nested", "cnn2d-plain"])
def test_diagonal_from_the_cached_forward_pass(name):
    model, xshape = _models()[name]
    model = model.to(D64)
    gen = torch.Generator().manual_seed(4)
    X = torch.randn(*xshape, dtype=D64, generator=gen)
    y = torch.randint(0, model(X).shape[1], (X.shape[0],), generator=gen)
    lik = CrossEntropy("sum")
    cached = GGNOperator(model, lik, (X, y))
    plain = GGNOperator(model, lik, (X, y), cache_linearisation=False)
    assert cached._recorded_layers(0, layer_specs(cached.fmodel)) is not None  # the reuse path applies
    ref = dense_ggn(model, lik, (X, y)).diagonal()
    torch.testing.assert_close(cached.diagonal().flat, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(plain.diagonal().flat, ref, atol=1e-12, rtol=0)
    v = torch.randn(cached.layout.dim, dtype=D64, generator=gen)  # the cached graph is still usable
    torch.testing.assert_close(cached @ v, dense_ggn(model, lik, (X, y)) @ v, atol=1e-12, rtol=0)
