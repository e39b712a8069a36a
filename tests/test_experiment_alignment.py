"""The ``alignment`` experiment (thesis Figs. 4.2-4.3): its exact minibatch GGN products against a dense
reference, its reference solves on cases with known answers, and the smoke run's validity."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvkit.experiments import registry
from curvkit.experiments.alignment import MinibatchGGN, align_point
from curvkit.likelihoods import BernoulliBCE, CrossEntropy, Gaussian
from curvkit.models import mlp
from reference import dense_ggn, make_data


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize(("lik", "name"), [(CrossEntropy(), "ce"), (BernoulliBCE(), "bce"), (Gaussian("sum"), "gauss")])
def test_minibatch_ggn_products_equal_the_dense_ggn(lik, name):
    net = mlp([4, 5, 3], "tanh", dtype=torch.float64, seed=1)
    X, y = make_data(name, 9, seed=1)
    ggn = MinibatchGGN(net, lik, X, y, damping=0.3)
    M = torch.randn(ggn.layout.dim, 3, generator=torch.Generator().manual_seed(0))
    ref = dense_ggn(net, lik, (X, y)) @ M + 0.3 * M
    assert torch.allclose(ggn.matmat(M), ref, atol=1e-12)


@pytest.mark.usefixtures("float64_default")
def test_references_where_the_answer_is_known():
    """Deep linear net, squared error: G_l does not depend on the data, so every diagonal GGN block IS
    A_l (x) G_l and KFRA* (exact damped inverse) equals the exact block GN update in every layer (cosine 1);
    KFRA with factored damping does not (cosine < 1)."""
    g = torch.Generator().manual_seed(2)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)).to(torch.float64)
    X, Y = torch.randn(30, 3, generator=g), torch.randn(30, 2, generator=g)
    res = align_point(net, Gaussian("mean"), X, Y, weight_decay=1e-3, zeta=0.05, cg_iters=200, tol=1e-13)
    assert res["cg_residual_full"] < 1e-8 and max(res["cg_residual_block"]) < 1e-8
    assert res["per_layer"]["KFRA*"] == pytest.approx([1.0] * 3, abs=1e-9)
    assert min(res["per_layer"]["KFRA"]) < 1 - 1e-6
    # the last layer's block is exactly Kronecker (G_L = I) for any activation
    net2 = mlp([3, 4, 2], "tanh", dtype=torch.float64, seed=3)
    res2 = align_point(net2, Gaussian("mean"), X, Y, weight_decay=1e-3, zeta=0.05, cg_iters=200, tol=1e-13)
    assert res2["per_layer"]["KFRA*"][-1] == pytest.approx(1.0, abs=1e-9)
    assert res2["per_layer"]["KFRA*"][0] < 1 - 1e-6  # the first layer's block is not Kronecker


@pytest.mark.slow  # its parts are covered by the two tests above; the end-to-end run takes ~10 s
def test_smoke_run_has_valid_references(tmp_path):
    res = registry.run("alignment", "smoke", tmp_path, seed=0)
    assert res["max_cg_residual"] < 1e-4  # the exact references are solved (float32)
    for p in res["points"]:
        for v, cosines in p["per_layer"].items():
            assert all(-1 - 1e-5 <= c <= 1 + 1e-5 for c in cosines), v
        for v, c in p["full"].items():
            assert c > 0.5, (p["step"], v, c)  # every update points the way of the full GN update
    assert (tmp_path / "fig4_2_per_layer.png").exists() and "Claims" in (tmp_path / "report.md").read_text()
