"""Helpers of the ``mesu-hessian`` experiment: the exact expected-loss diagonals H_D(mu), H_D(sigma)
against dense autograd Hessians (a tiny ReLU net: the a.e. Hessian diagonal equals the GGN diagonal) and
the correlation / binning metrics."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from curvkit.experiments.mesu_hessian import binned_ratio, correlations, exact_diagonals
from curvkit.likelihoods import CrossEntropy
from reference import dense_hessian

DT = torch.float64




def test_exact_diagonals_match_dense_hessian_averaged_over_the_same_weight_samples():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3)).to(DT)
    X, y = torch.randn(10, 3, dtype=DT), torch.randint(0, 3, (10,))
    sigma = {n: torch.full_like(p, 0.05) for n, p in model.named_parameters()}
    h_mu, h_sig = exact_diagonals(model, sigma, X, y, draws=2, seed=7, scale=0.5)
    # the same eps draws, replayed: generator seeded 7, one randn per parameter in order
    g = torch.Generator().manual_seed(7)
    ref_mu = torch.zeros(h_mu.size, dtype=DT)
    ref_sig = torch.zeros(h_mu.size, dtype=DT)
    for _ in range(2):
        m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3)).to(DT)
        eps = []
        with torch.no_grad():
            for (_, p), (_, q) in zip(model.named_parameters(), m.named_parameters()):
                e = torch.randn(p.shape, generator=g, dtype=DT)
                q.copy_(p + 0.05 * e)
                eps.append(e.reshape(-1))
        d = dense_hessian(m, CrossEntropy("sum"), (X, y)).diagonal() * 0.5
        ref_mu += d / 2
        ref_sig += d * torch.cat(eps) ** 2 / 2
    np.testing.assert_allclose(h_mu, ref_mu.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(h_sig, ref_sig.numpy(), rtol=1e-10, atol=1e-12)


def test_correlations_and_binning():
    true = np.logspace(-6, 0, 50)
    c = correlations(2 * true, true)
    assert abs(c["pearson_log"] - 1) < 1e-12 and abs(c["spearman"] - 1) < 1e-12
    assert c["median_ratio"] == 2.0 and c["n_positive"] == 50
    est = np.maximum(true, 1e-3)  # a floor, like Eq. 9
    bins = binned_ratio(est, true, 10.0 ** np.arange(-6, 1))
    assert bins[-1]["median_ratio"] == 1.0
    assert bins[0]["median_estimate"] == 1e-3
