"""Exact curvature operators (curvkit.curvature.exact) against the dense torch.func references.

Every operator's ``@`` (flat vector, (d, k) matrix, parameter list), ``to_dense``, ``diagonal`` and
``trace`` on tiny float64 models: MLPs (relu with bias, tanh without bias, sigmoid with bias), a tiny
CNN (Conv2d + ReLU + Flatten + Linear on 5x5 inputs) and an MLP with LayerNorm (which exercises the
generic per-sample diagonal instead of the Linear/Conv2d fast path), all three likelihoods, one batch
with ``sum`` and several batches with ``mean`` (and ``sum``) reduction.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from curvkit.curvature import (
    EmpiricalFisherOperator,
    FisherOperator,
    GGNOperator,
    HessianOperator,
    MCFisherOperator,
    empirical_fisher,
    fisher,
    ggn,
    hessian,
    mc_fisher,
)
from curvkit.curvature._layerwise import layer_specs
from curvkit.likelihoods import BernoulliBCE, CrossEntropy, Gaussian
from curvkit.linalg.operator import DiagonalOperator
from curvkit.models import mlp
from reference import dense_empirical_fisher, dense_ggn, dense_hessian, per_sample_jacobians

D64 = torch.float64
ATOL = 1e-10
N = 5




def make_model(name: str) -> nn.Module:
    torch.manual_seed(1)
    if name == "mlp_relu":
        return mlp([3, 4, 3], "relu", bias=True, dtype=D64)
    if name == "mlp_tanh_nobias":
        return mlp([3, 4, 4, 3], "tanh", bias=False, dtype=D64)
    if name == "mlp_sigmoid":
        return mlp([3, 3, 3], "sigmoid", bias=True, dtype=D64)
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(18, 3)).to(D64)
    if name == "layernorm":
        return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 3)).to(D64)
    raise KeyError(name)


def make_lik(name: str, reduction: str):
    if name == "ce":
        return CrossEntropy(reduction)  # type: ignore[arg-type]
    if name == "bce":
        return BernoulliBCE(reduction)  # type: ignore[arg-type]
    return Gaussian(reduction, sigma=0.7)  # type: ignore[arg-type]


def make_data(model_name: str, lik_name: str, split: bool):
    g = torch.Generator().manual_seed(2)
    shape = (N, 1, 5, 5) if model_name == "cnn" else (N, 3)
    X = torch.randn(*shape, generator=g, dtype=D64)
    if lik_name == "ce":
        y = torch.randint(0, 3, (N,), generator=g)
    elif lik_name == "bce":
        y = torch.randint(0, 2, (N, 3), generator=g).to(D64)
    else:
        y = torch.randn(N, 3, generator=g, dtype=D64)
    return [(X[:2], y[:2]), (X[2:], y[2:])] if split else (X, y)


def mc_reference(op: MCFisherOperator, model: nn.Module, lik, data) -> torch.Tensor:
    """w sum_n (1/M) sum_m J_n^T g_nm g_nm^T J_n from the operator's sampled labels (reference Jacobians)."""
    batches = [data] if isinstance(data, tuple) else data
    d = op.layout.dim
    out = torch.zeros(d, d, dtype=D64)
    for (X, _y), labels in zip(batches, op.labels):
        J = per_sample_jacobians(model, X)  # (B, C, d)
        f = model(X).detach()
        for ym in labels:
            u = torch.einsum("bcd,bc->bd", J, lik.output_grad(f, ym))
            out += u.T @ u / op.mc_samples
    return out * (1.0 if lik.reduction == "sum" else 1.0 / N)


CASES = [
    (m, lk, split, red)
    for m in ["mlp_relu", "mlp_tanh_nobias", "mlp_sigmoid", "cnn", "layernorm"]
    for lk in ["ce", "bce", "gauss"]
    for split, red in [(False, "sum"), (True, "mean")]
]


@functools.cache
def _case(model_name: str, lik_name: str, split: bool, reduction: str):
    model = make_model(model_name)
    lik = make_lik(lik_name, reduction)
    data = make_data(model_name, lik_name, split)
    return model, lik, data


def _check_operator(op, ref: torch.Tensor) -> None:
    d = op.layout.dim
    assert ref.abs().max() > 1e-3, "reference is (nearly) zero: the test would be vacuous"
    g = torch.Generator().manual_seed(0)
    v = torch.randn(d, generator=g, dtype=D64)
    V = torch.randn(d, 3, generator=g, dtype=D64)
    torch.testing.assert_close(op @ v, ref @ v, atol=ATOL, rtol=0)
    torch.testing.assert_close(op @ V, ref @ V, atol=ATOL, rtol=0)
    out_list = op @ op.layout.unflatten(v)
    assert [t.shape for t in out_list] == list(op.layout.shapes)
    torch.testing.assert_close(op.layout.flatten(out_list), ref @ v, atol=ATOL, rtol=0)
    torch.testing.assert_close(op.to_dense(), ref, atol=ATOL, rtol=0)
    diag = op.diagonal()
    assert isinstance(diag, DiagonalOperator)
    torch.testing.assert_close(diag.flat, ref.diagonal(), atol=ATOL, rtol=0)
    torch.testing.assert_close(op.trace(), ref.trace(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_output_factor_operators_match_dense(case):
    model, lik, data = _case(*case)
    G = dense_ggn(model, lik, data)
    _check_operator(GGNOperator(model, lik, data), G)
    _check_operator(FisherOperator(model, lik, data), G)  # F_L == H_L for these heads (Eqs. 3.36-3.38)
    _check_operator(EmpiricalFisherOperator(model, lik, data), dense_empirical_fisher(model, lik, data))


@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "layernorm"], ids=lambda c: "-".join(map(str, c)))
def test_hessian_operator_matches_dense(case):
    model, lik, data = _case(*case)
    _check_operator(HessianOperator(model, lik, data), dense_hessian(model, lik, data))


@pytest.mark.parametrize("model_name", ["mlp_tanh_nobias", "cnn"])
@pytest.mark.parametrize("lik_name", ["ce", "bce", "gauss"])
def test_mc_fisher_matches_reference_for_its_labels(model_name, lik_name):
    model, lik, data = _case(model_name, lik_name, True, "mean")
    op = MCFisherOperator(model, lik, data, mc_samples=3, seed=5)
    assert len(op.labels) == 2 and len(op.labels[0]) == 3
    _check_operator(op, mc_reference(op, model, lik, data))


def test_multi_batch_sum_equals_single_batch_sum():
    model, lik, data = _case("mlp_tanh_nobias", "ce", True, "sum")
    X = torch.cat([b[0] for b in data])
    y = torch.cat([b[1] for b in data])
    one = GGNOperator(model, lik, (X, y)).to_dense()
    torch.testing.assert_close(GGNOperator(model, lik, data).to_dense(), one, atol=ATOL, rtol=0)
    H_one = HessianOperator(model, lik, (X, y)).to_dense()
    torch.testing.assert_close(HessianOperator(model, lik, iter(data)).to_dense(), H_one, atol=ATOL, rtol=0)
    torch.testing.assert_close(dense_hessian(model, lik, data), H_one, atol=ATOL, rtol=0)


def test_mean_reduction_weights_batches_by_size():
    model, lik_mean, data = _case("mlp_relu", "gauss", True, "mean")
    lik_sum = make_lik("gauss", "sum")
    torch.testing.assert_close(GGNOperator(model, lik_mean, data).to_dense(),
                               GGNOperator(model, lik_sum, data).to_dense() / N, atol=ATOL, rtol=0)


def test_convenience_functions_return_the_operators():
    model, lik, data = _case("mlp_relu", "ce", False, "sum")
    assert isinstance(hessian(model, lik, data), HessianOperator)
    assert isinstance(ggn(model, lik, data), GGNOperator)
    assert isinstance(fisher(model, lik, data), FisherOperator)
    assert isinstance(empirical_fisher(model, lik, data), EmpiricalFisherOperator)
    op = mc_fisher(model, lik, data, mc_samples=2, seed=3)
    assert isinstance(op, MCFisherOperator) and op.mc_samples == 2 and op.seed == 3
    assert "GGNOperator(d=31, N=5" in repr(ggn(model, lik, data))


def test_mc_fisher_is_seeded_and_fixed():
    model, lik, data = _case("mlp_relu", "ce", True, "mean")
    a = MCFisherOperator(model, lik, data, mc_samples=2, seed=0).to_dense()
    b = MCFisherOperator(model, lik, data, mc_samples=2, seed=0).to_dense()
    c = MCFisherOperator(model, lik, data, mc_samples=2, seed=1).to_dense()
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-6


def test_operators_snapshot_the_parameters():
    model = make_model("mlp_relu")
    _, lik, data = _case("mlp_relu", "ce", False, "sum")
    op = GGNOperator(model, lik, data)
    H = HessianOperator(model, lik, data)
    before, H_before = op.to_dense(), H.to_dense()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    torch.testing.assert_close(op.to_dense(), before, atol=0, rtol=0)
    torch.testing.assert_close(H.to_dense(), H_before, atol=0, rtol=0)
    assert (GGNOperator(model, lik, data).to_dense() - before).abs().max() > 1e-3


def test_frozen_parameters_are_excluded_from_the_layout():
    model = make_model("mlp_relu")
    model[0].weight.requires_grad_(False)
    _, lik, data = _case("mlp_relu", "ce", False, "sum")
    op = GGNOperator(model, lik, data)
    assert op.layout.names == ("0.bias", "2.weight", "2.bias")
    G = dense_ggn(model, lik, data)  # the reference also uses trainable parameters only
    torch.testing.assert_close(op.to_dense(), G, atol=ATOL, rtol=0)
    torch.testing.assert_close(op.diagonal().flat, G.diagonal(), atol=ATOL, rtol=0)  # generic path


def test_hessian_diagonal_guard():
    model, lik, data = _case("mlp_relu", "ce", False, "sum")
    op = HessianOperator(model, lik, data)
    with pytest.raises(ValueError, match="max_dim"):
        op.diagonal(max_dim=10)
    torch.testing.assert_close(op.diagonal(max_dim=None).flat, dense_hessian(model, lik, data).diagonal(),
                               atol=ATOL, rtol=0)


def test_small_chunk_size_gives_the_same_products():
    model, lik, data = _case("cnn", "ce", True, "mean")
    ref = GGNOperator(model, lik, data).to_dense()
    op = GGNOperator(model, lik, data, chunk_size=5)
    torch.testing.assert_close(op @ torch.eye(op.layout.dim, dtype=D64), ref, atol=ATOL, rtol=0)
    H = HessianOperator(model, lik, data, chunk_size=7)
    torch.testing.assert_close(H.to_dense(), dense_hessian(model, lik, data), atol=ATOL, rtol=0)


@pytest.mark.parametrize("cls", [HessianOperator, GGNOperator, EmpiricalFisherOperator])
def test_float32(cls):
    model64, lik, data64 = _case("mlp_tanh_nobias", "ce", True, "mean")
    model32 = make_model("mlp_tanh_nobias").float()
    data32 = [(X.float(), y) for X, y in data64]
    op = cls(model32, lik, data32)
    assert op.dtype == torch.float32
    ref = {HessianOperator: dense_hessian, GGNOperator: dense_ggn,
           EmpiricalFisherOperator: dense_empirical_fisher}[cls](model64, lik, data64)
    v = torch.randn(op.layout.dim, dtype=torch.float64)
    out = op @ v
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref @ v, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(op.diagonal().flat.double(), ref.diagonal(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("model_name", ["mlp_relu", "mlp_tanh_nobias", "cnn", "cnn_strided", "layernorm"])
def test_diagonal_fast_path_and_generic_path_agree(model_name):
    """Linear/Conv2d-only models take the layer-wise diagonal; others the per-sample one. Both exact."""
    if model_name == "cnn_strided":
        torch.manual_seed(3)
        model = nn.Sequential(nn.Conv2d(1, 2, 3, stride=2, padding=1), nn.Tanh(),
                              nn.Conv2d(2, 3, 2, dilation=(1, 2), bias=False), nn.Flatten(),
                              nn.Linear(6, 3)).to(D64)
        data = make_data("cnn", "ce", True)
        lik = make_lik("ce", "mean")
    else:
        model, lik, data = _case(model_name, "bce", True, "mean")
    for cls in (GGNOperator, MCFisherOperator, EmpiricalFisherOperator):
        op = cls(model, lik, data)
        ref = op.to_dense().diagonal()  # per-sample factor rows
        fast = op.diagonal().flat
        torch.testing.assert_close(fast, ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(op._diagonal_per_sample().flat, ref, atol=ATOL, rtol=0)
        assert bool(op._layer_specs) == (model_name != "layernorm")
    if model_name == "layernorm":
        assert layer_specs(op.fmodel) is None
    else:
        torch.testing.assert_close(GGNOperator(model, lik, data).diagonal().flat,
                                   dense_ggn(model, lik, data).diagonal(), atol=ATOL, rtol=0)
