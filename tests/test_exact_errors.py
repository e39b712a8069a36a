"""Bad input to the exact operators raises the documented, explanatory errors; the vmap fallback works."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import curvkit.curvature.exact as exact_mod
from curvkit.curvature import (
    EmpiricalFisherOperator,
    FisherOperator,
    GGNOperator,
    HessianOperator,
    MCFisherOperator,
)
from curvkit.likelihoods import CrossEntropy, Likelihood
from curvkit.models import mlp
from reference import NotSequential, dense_ggn, dense_hessian

D64 = torch.float64
OPERATORS = [HessianOperator, GGNOperator, FisherOperator, MCFisherOperator, EmpiricalFisherOperator]


def _setup():
    torch.manual_seed(0)
    model = mlp([3, 4, 3], "relu", dtype=D64)
    X = torch.randn(4, 3, dtype=D64)
    y = torch.tensor([0, 1, 2, 1])
    return model, CrossEntropy("sum"), (X, y)


@pytest.mark.parametrize("cls", OPERATORS)
def test_nan_in_model_output(cls):
    model, lik, (X, y) = _setup()
    X = X.clone()
    X[1, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        cls(model, lik, [(X[:2], y[:2]), (X[2:], y[2:])])
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        cls(model, lik, (torch.ones(4, 3, dtype=D64), y))


@pytest.mark.parametrize("cls", OPERATORS)
def test_wrong_vector_and_list_shapes(cls):
    model, lik, data = _setup()
    op = cls(model, lik, data)
    d = op.layout.dim
    with pytest.raises(ValueError, match=f"flat vector of length {d}"):
        op @ torch.ones(d + 1, dtype=D64)
    with pytest.raises(ValueError, match="cannot multiply a tensor of shape"):
        op @ torch.ones(d - 1, 2, dtype=D64)
    with pytest.raises(ValueError, match="expected 4 parameter-shaped tensors"):
        op @ [p.detach() for p in model.parameters()][:3]
    with pytest.raises(ValueError, match="has shape"):
        op @ [torch.ones(3, 4, dtype=D64), *[p.detach() for p in model.parameters()][1:]]


def test_model_output_not_batch_by_outputs():
    conv = nn.Sequential(nn.Conv2d(1, 2, 3)).to(D64)  # output (B, 2, 3, 3): read as positions (2, 3), 3 classes
    X = torch.randn(2, 1, 5, 5, dtype=D64)
    with pytest.raises(ValueError, match=r"batch 0: .*targets must be integer class indices of shape \(2, 2, 3\)"):
        GGNOperator(conv, CrossEntropy("sum"), (X, torch.tensor([0, 1])))  # never re-read as (B,) labels
    flat = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0)).to(D64)  # output (B,): no output dimension
    with pytest.raises(ValueError, match=r"shape \(batch, outputs\) = \(2, C\) or \(batch, positions"):
        GGNOperator(flat, CrossEntropy("sum"), (torch.randn(2, 3, dtype=D64), torch.tensor([0, 1])))


def test_bad_data_and_arguments():
    model, lik, (X, y) = _setup()
    with pytest.raises(TypeError, match="pair"):
        GGNOperator(model, lik, X)
    with pytest.raises(TypeError, match="not an \\(X, y\\) pair"):
        GGNOperator(model, lik, [(X, y, y)])
    with pytest.raises(ValueError, match="leading batch size"):
        GGNOperator(model, lik, (X, y[:3]))
    with pytest.raises(ValueError, match="empty"):
        GGNOperator(model, lik, [])
    with pytest.raises(TypeError, match="Likelihood"):
        GGNOperator(model, torch.nn.CrossEntropyLoss(), (X, y))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Module"):
        GGNOperator(lambda x: x, lik, (X, y))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="targets must lie"):
        GGNOperator(model, lik, (X, torch.tensor([0, 1, 2, 3])))
    with pytest.raises(ValueError, match="mc_samples"):
        MCFisherOperator(model, lik, (X, y), mc_samples=0)
    with pytest.raises(ValueError, match="chunk_size"):
        HessianOperator(model, lik, (X, y), chunk_size=0)
    frozen = mlp([3, 3], dtype=D64)
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        GGNOperator(frozen, lik, (X, y))


def test_fisher_for_unknown_likelihood_suggests_mc_fisher():
    class Poissonish(CrossEntropy):
        pass

    class Custom(Likelihood):
        def nll_per_sample(self, f, y):
            return (f - y).pow(2).sum(-1)

    model, _, (X, _y) = _setup()
    FisherOperator(model, Poissonish("sum"), (X, _y))  # a subclass of a known head is fine
    with pytest.raises(TypeError, match="MCFisherOperator"):
        FisherOperator(model, Custom("sum"), (X, torch.zeros(4, 3, dtype=D64)))


class DataDependent(nn.Module):
    """Python control flow on tensor values: vmap over samples cannot trace it, loops can."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3).to(D64)

    def forward(self, x):
        h = self.lin(x)
        if float(h.detach().abs().sum()) > 1e9:
            h = 2 * h
        return torch.tanh(h)


def test_vmap_fallback_over_samples_gives_exact_results():
    torch.manual_seed(1)
    model = DataDependent()
    X, y = torch.randn(4, 3, dtype=D64), torch.tensor([0, 2, 1, 1])
    lik = CrossEntropy("mean")
    op = GGNOperator(model, lik, (X, y))
    with pytest.warns(RuntimeWarning, match="falling back"):
        dense = op.to_dense()  # per-sample rows: vmap over samples hits the data-dependent branch
    torch.testing.assert_close(dense, dense_ggn(model, lik, (X, y)), atol=1e-12, rtol=0)


def test_vmap_fallback_over_columns(monkeypatch):
    model, lik, data = _setup()
    ref_G, ref_H = dense_ggn(model, lik, data), dense_hessian(model, lik, data)

    def broken_vmap(fn):
        def run(*args):
            raise RuntimeError("vmap unsupported (simulated)")
        return run

    monkeypatch.setattr(exact_mod, "vmap", broken_vmap)
    for cls, ref in [(GGNOperator, ref_G), (HessianOperator, ref_H)]:
        op = cls(NotSequential(model), lik, data)  # not a plain Sequential: products go through torch.func's vmap
        if isinstance(op, HessianOperator):  # its default double-backward products use no vmap:
            op._use_double_backward = False  # test the vmapped forward-over-reverse fallback here
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = op @ torch.eye(op.layout.dim, dtype=D64)
        assert any("falling back" in str(w.message) for w in caught)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
