"""The SGLD torch optimiser (devinterp convention) and the optional devinterp parity check (C7)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from curvkit.optim.sgld import SGLD
from curvkit.slt import quadratic_llc

DT = torch.float64


def test_stationary_expectation_on_quadratic():
    """K = ½Σh w² with 256 independent chains stored as the rows of one parameter; the stationary
    E[nβ K] per chain is ½ Σ nβh/(a(1 - εa/4)), a = nβh + γ (exact for the discretised chain)."""
    h = torch.tensor([1.0, 2.0, 5.0, 0.5, 3.0], dtype=DT)
    w = nn.Parameter(torch.zeros(256, 5, dtype=DT))
    opt = SGLD([w], lr=1e-3, nbeta=100.0, localization=1.0, generator=torch.Generator().manual_seed(0))
    vals = []
    for step in range(2500):
        opt.zero_grad()
        K = 0.5 * (h * w * w).sum(dim=1)  # per-chain loss; summing keeps the chains independent
        K.sum().backward()
        if step >= 500:
            vals.append(100.0 * K.detach().mean())
        opt.step()
    est = float(torch.stack(vals).mean())
    assert est == pytest.approx(quadratic_llc(h, 100.0, 1.0, 1e-3), abs=0.1)


def test_anchor_in_state_dict_and_nan_guard():
    p = nn.Parameter(torch.ones(3, dtype=DT))
    opt = SGLD([p], lr=1e-2, nbeta=1.0, localization=2.0, generator=torch.Generator().manual_seed(0))
    p.grad = torch.zeros(3, dtype=DT)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert torch.equal(sd["state"][0]["anchor"], torch.ones(3, dtype=DT))
    p.grad = torch.tensor([float("nan"), 0.0, 0.0], dtype=DT)
    with pytest.raises(FloatingPointError, match=r"lr=0\.01"):
        opt.step()
    with pytest.raises(ValueError):
        SGLD([p], lr=-1.0)


def test_localization_pulls_to_anchor_without_noise():
    p = nn.Parameter(torch.zeros(2, dtype=DT))
    opt = SGLD([p], lr=0.1, nbeta=1.0, localization=1.0, noise_level=0.0)
    with torch.no_grad():
        p.add_(1.0)
    for _ in range(200):
        p.grad = torch.zeros(2, dtype=DT)
        opt.step()
    assert torch.allclose(p, torch.zeros(2, dtype=DT), atol=1e-4)


def test_devinterp_parity():
    """C7: same model, data and settings as devinterp 2.0.1 (lr 1e-4, localization 100, nβ = m/ln m, 4 chains
    x 300 draws, burn-in 0, all chains on the same minibatch sequence as devinterp's default) and the *same*
    reference loss L(w*) = L_n(w*) for both (devinterp's from its per-step loss trace): the means agree
    within 3 combined standard errors (RNG streams differ, so no per-step equality). Runs only where
    devinterp >= 2.0 is importable (it is not a dependency)."""
    pytest.importorskip("devinterp")
    datasets = pytest.importorskip("datasets")
    from devinterp.slt.llc import llc

    from curvkit.slt import SGLDConfig, estimate_llc

    torch.manual_seed(0)
    n, m, C = 2000, 128, 4
    X, y = torch.randn(n, 20), torch.randint(0, 5, (n,))
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))
    ds = datasets.Dataset.from_dict({"input_ids": [[i, 0] for i in range(n)]}).with_format("torch")

    def loss_fn(net, input_ids):
        idx = input_ids[:, 0]
        return nn.functional.cross_entropy(net(X[idx]), y[idx], reduction="none")[:, None]

    nbeta = m / math.log(m)
    with torch.no_grad():
        ref = float(nn.functional.cross_entropy(model(X), y))
    dv = llc(copy.deepcopy(model), ds, {}, lr=1e-4, n_beta=nbeta, loss_fn=loss_fn, num_chains=C,
             num_draws=300, batch_size=m, localization=100.0, device="cpu")
    dv_chains = nbeta * (torch.as_tensor(dv.loss_trace.values, dtype=torch.float64).mean(dim=1) - ref)
    ours = estimate_llc(model, (X, y), batch_size=m, seed=0, init_loss=ref, config=SGLDConfig(
        epsilon=1e-4, gamma=100.0, nbeta="m/log m", num_chains=C, num_draws=300, shared_batches=True))
    se = math.sqrt(float(dv_chains.var()) / C + ours.llc_stderr ** 2)
    assert abs(float(dv_chains.mean()) - ours.llc_mean) < 3 * se + 0.05
