"""Cached linearisation of the output-factor operators (``cache_linearisation``) vs the uncached path."""

import pytest
import torch

from curvkit.curvature import EmpiricalFisherOperator, GGNOperator, MCFisherOperator
from curvkit.likelihoods import CrossEntropy
from curvkit.models import mlp

pytestmark = pytest.mark.usefixtures("float64_default")


def _setup():
    net = mlp([4, 5, 3], "tanh", dtype=torch.float64, seed=0)
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(7, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (7,), generator=gen)
    M = torch.randn(43, 5, generator=gen, dtype=torch.float64)
    return net, X, y, M


@pytest.mark.parametrize("cls", [GGNOperator, EmpiricalFisherOperator, MCFisherOperator])
def test_cached_equals_uncached(cls):
    net, X, y, M = _setup()
    cached = cls(net, CrossEntropy("mean"), (X, y), cache_linearisation=True)
    plain = cls(net, CrossEntropy("mean"), (X, y), cache_linearisation=False)
    assert cached.caches_linearisation and not plain.caches_linearisation
    dense = plain.to_dense()
    # first single product (ordinary jvp + cached graph), second (linearised jvp), then several columns
    for _ in range(2):
        torch.testing.assert_close(cached @ M[:, 0], plain @ M[:, 0])
        torch.testing.assert_close(cached @ M[:, 0], dense @ M[:, 0])
    torch.testing.assert_close(cached @ M, plain @ M)
    torch.testing.assert_close(cached @ M, dense @ M)
    torch.testing.assert_close(cached.quadratic_form(M), plain.quadratic_form(M))
    torch.testing.assert_close(cached.quadratic_form(M), torch.einsum("dk,de,ek->k", M, dense, M))
    torch.testing.assert_close(cached.quadratic_form(M[:, 1]), plain.quadratic_form(M[:, 1]))


def test_default_caches_single_batch_only():
    net, X, y, _ = _setup()
    assert GGNOperator(net, CrossEntropy("sum"), (X, y)).caches_linearisation
    assert not GGNOperator(net, CrossEntropy("sum"), [(X[:3], y[:3]), (X[3:], y[3:])]).caches_linearisation
    with pytest.raises(ValueError, match="cache_linearisation"):
        GGNOperator(net, CrossEntropy("sum"), (X, y), cache_linearisation="yes")  # type: ignore[arg-type]


def test_cache_is_a_snapshot():
    net, X, y, M = _setup()
    G = GGNOperator(net, CrossEntropy("sum"), (X, y))
    before = G @ M
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    torch.testing.assert_close(G @ M, before)
    torch.testing.assert_close(G.quadratic_form(M), (M * before).sum(0))


@pytest.mark.parametrize("cache", [True, False])
def test_nan_output_raises_at_construction(cache):
    net, X, y, _ = _setup()
    X = X.clone()
    X[2, 1] = float("nan")
    with pytest.raises(ValueError):
        GGNOperator(net, CrossEntropy("mean"), (X, y), cache_linearisation=cache)
