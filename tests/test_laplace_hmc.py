"""The HMC sampler behind ``laplace-regression``'s ground truth, on Gaussian targets with known moments."""

import torch

from curvkit.experiments._laplace_hmc import hmc


def test_hmc_recovers_a_correlated_gaussian():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(4, 4, generator=g, dtype=torch.float64)
    cov = A @ A.T + 0.5 * torch.eye(4, dtype=torch.float64)
    mean = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    prec = torch.linalg.inv(cov)

    def log_prob(x):
        d = x - mean
        return -0.5 * d @ prec @ d

    def vg(x):
        return log_prob(x), -prec @ (x - mean)

    res = hmc(log_prob, torch.zeros(4, dtype=torch.float64), 2000, burn_in=300, step_size=0.1, max_leapfrog=12,
              generator=torch.Generator().manual_seed(1), value_and_grad=vg)
    short = [hmc(log_prob, torch.zeros(4, dtype=torch.float64), 5, burn_in=0, step_size=0.1, max_leapfrog=12,
                 generator=torch.Generator().manual_seed(1), value_and_grad=f).samples for f in (vg, None)]
    torch.testing.assert_close(short[0], short[1])  # autograd gives the same chain
    assert 0.6 < res.accept_rate < 0.99
    # 2000 correlated draws: mean within 0.15 of each std, covariance within 15% of its scale
    sd = cov.diagonal().sqrt()
    assert float(((res.samples.mean(0) - mean).abs() / sd).max()) < 0.15
    emp = torch.cov(res.samples.T)
    assert float((emp - cov).abs().max()) < 0.15 * float(cov.abs().max())


def test_hmc_on_a_badly_scaled_diagonal_gaussian_adapts_its_step():
    scales = torch.tensor([0.05, 1.0, 2.0], dtype=torch.float64)

    def log_prob(x):
        return -0.5 * ((x / scales) ** 2).sum()

    res = hmc(log_prob, torch.zeros(3, dtype=torch.float64), 2000, burn_in=500, step_size=1.0, max_leapfrog=60,
              generator=torch.Generator().manual_seed(2), value_and_grad=lambda x: (log_prob(x), -x / scales**2))
    assert res.step_size < 0.1  # adapted to the narrowest direction (the unadapted 1.0 would reject everything)
    torch.testing.assert_close(res.samples.std(0), scales, rtol=0.2, atol=0)
