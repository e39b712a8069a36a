"""Kaldi online NGD invariants (digest 003 C6) and the textbook damped NGD (C5)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from curvkit.curvature import FisherOperator, kfac
from curvkit.likelihoods import CrossEntropy
from curvkit.optim.kaldi_ngd import (
    KaldiNGD,
    _core,
    beta_of,
    default_rank,
    precondition_axis,
    smoothed_fisher,
)
from curvkit.optim.natural_gradient import NaturalGradient, damped_direction, paper_kappa
from reference import dense_ggn

DT = torch.float64


def _mlp(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 5)).to(DT)
    X = torch.randn(64, 20, dtype=DT)
    y = torch.randint(0, 5, (64,))
    return net, X, y


def _run(net, X, y, opt, steps):
    """Run ``steps`` steps; return per-tensor (update, gradient) pairs of the last step."""
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(net(X), y).backward()
        before = [p.detach().clone() for p in net.parameters()]
        grads = [p.grad.detach().clone() for p in net.parameters()]
        opt.step()
    return [(p.detach() - b, g) for p, b, g in zip(net.parameters(), before, grads)]


def _cos(a, b):
    return float((a * b).sum() / (a.norm() * b.norm()))


@pytest.mark.parametrize("alpha", [0.01, 0.1, 4.0])
def test_norm_preservation(alpha):
    """C6(a): with momentum 0 every tensor's update has norm lr·||g||."""
    net, X, y = _mlp()
    pairs = _run(net, X, y, KaldiNGD(net.parameters(), lr=0.1, momentum=0, nesterov=False, alpha=alpha), 12)
    for upd, g in pairs:
        assert float(upd.norm()) == pytest.approx(0.1 * float(g.norm()), rel=1e-6)


def test_direction_changes_for_small_alpha_and_sgd_limit():
    """C6(b, c): small α changes the direction; α = 1e8 reproduces SGD (Nesterov) for 10 steps."""
    net, X, y = _mlp()
    pairs = _run(net, X, y, KaldiNGD(net.parameters(), lr=0.1, momentum=0, nesterov=False, alpha=0.01), 12)
    assert min(_cos(-u, g) for u, g in pairs) < 0.7
    a, b = _mlp(1)[0], None
    b = copy.deepcopy(a)
    _, X, y = _mlp(1)
    _run(a, X, y, KaldiNGD(a.parameters(), lr=0.05, alpha=1e8), 10)
    _run(b, X, y, torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9, nesterov=True), 10)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-9)


def test_rank_axes_and_bias():
    """C6(d): rank = min((D+1)//2, 80); axes of size 1 untouched; a bias (N = 1) keeps its norm."""
    assert default_rank(2) == 1 and default_rank(16) == 8 and default_rank(256) == 80
    p = nn.Parameter(torch.randn(1, 1, dtype=DT))
    opt = KaldiNGD([p], lr=1.0, momentum=0, nesterov=False)
    g = torch.randn(1, 1, dtype=DT)
    assert torch.equal(opt.precondition(p, g, opt.param_groups[0]), g)
    b = nn.Parameter(torch.randn(7, dtype=DT))
    opt = KaldiNGD([b], lr=1.0, momentum=0, nesterov=False)
    for _ in range(5):
        g = torch.randn(7, dtype=DT)
        out = opt.precondition(b, g, opt.param_groups[0])
        assert float(out.norm()) == pytest.approx(float(g.norm()), rel=1e-10)
    assert opt.state[b]["ng_axes"][0]["W"].shape == (4, 7)


def _random_state(D=9, R=4, alpha=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(D, R, generator=g, dtype=DT))
    d = torch.rand(R, generator=g, dtype=DT) * 5 + 0.1
    st = {"t": 0, "d": d, "rho": torch.tensor(0.05, dtype=DT), "W": Q.T}
    e = d / (d + beta_of(st, alpha))
    st["W"] = e.sqrt()[:, None] * Q.T
    return st


def test_preconditioner_identity():
    """C6(e): X̂ = X - X WᵀW = β X (RᵀDR + βI)⁻¹ on random states (float64 to 1e-10)."""
    alpha = 0.3
    st = _random_state(alpha=alpha)
    X = torch.randn(11, 9, dtype=DT)
    st["t"] = 13  # t >= 10 and t % 4 != 0: not an update step, the state is only read
    Xh = _core(st, X, (X * X).sum(), alpha, 0.9, 1e-10, 5e-4, update_period=4)
    ref = beta_of(st, alpha) * X @ torch.linalg.inv(smoothed_fisher(st, alpha))
    assert torch.allclose(Xh, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rank_deficient", [False, True])
def test_orthonormality_after_every_update(rank_deficient):
    """C6(f): W Wᵀ ⊙ (e^{-½} e^{-½ᵀ}) ≈ I_R after every update (also for rank-deficient gradients)."""
    alpha, st = 0.1, None
    g = torch.Generator().manual_seed(0)
    for _ in range(25):
        if rank_deficient:
            X = torch.randn(30, 3, generator=g, dtype=DT) @ torch.randn(3, 12, generator=g, dtype=DT)
        else:
            X = torch.randn(30, 12, generator=g, dtype=DT) * torch.linspace(0.1, 3, 12, dtype=DT)
        _, st = precondition_axis(st, X, alpha, 0.9, 1e-10, 5e-4, None, 1)
        e = st["d"] / (st["d"] + beta_of(st, alpha))
        M = st["W"] @ st["W"].T / torch.outer(e.sqrt(), e.sqrt())
        assert float((M - torch.eye(M.shape[0], dtype=DT)).abs().max()) < 1e-3


def test_update_schedule():
    """C6(g): the estimate changes on the first 10 calls, then only every update_period-th call."""
    g = torch.Generator().manual_seed(0)
    st, changed = None, []
    for _ in range(22):
        X = torch.randn(20, 8, generator=g, dtype=DT)
        before = None if st is None else st["W"].clone()
        _, st = precondition_axis(st, X, 0.1, 0.9, 1e-10, 5e-4, None, 4)
        changed.append(before is None or not torch.equal(before, st["W"]))
    # calls t = 0..21: update when t < 10 or t % 4 == 0
    assert changed == [t < 10 or t % 4 == 0 for t in range(22)]


def test_ema_converges_to_smoothed_fisher():
    """C6(h): repeated identical X with rank(XᵀX) <= R -> direction of X (S + α tr(S)/D I)⁻¹, cos > 0.99."""
    g = torch.Generator().manual_seed(0)
    D, N, alpha = 12, 40, 0.1
    X = torch.randn(N, 4, generator=g, dtype=DT) @ torch.randn(4, D, generator=g, dtype=DT)
    st = None
    for _ in range(100):
        Xh, st = precondition_axis(st, X, alpha, 0.9, 1e-10, 5e-4, None, 1)
    S = X.T @ X / N
    ref = X @ torch.linalg.inv(S + alpha * torch.trace(S) / D * torch.eye(D, dtype=DT))
    assert _cos(Xh, ref) > 0.99


def test_state_dict_roundtrip():
    net, X, y = _mlp()
    opt = KaldiNGD(net.parameters(), lr=0.05, alpha=0.1)
    _run(net, X, y, opt, 6)
    net2 = copy.deepcopy(net)
    opt2 = KaldiNGD(net2.parameters(), lr=0.05, alpha=0.1)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    _run(net, X, y, opt, 5)
    _run(net2, X, y, opt2, 5)
    for p, q in zip(net.parameters(), net2.parameters()):
        assert torch.equal(p, q)


def test_invalid_hyperparameters():
    p = [nn.Parameter(torch.zeros(3))]
    for kw in ({"lr": 0.0}, {"eta": 1.0}, {"alpha": -1.0}, {"update_period": 0}, {"epsilon": -1.0}):
        with pytest.raises(ValueError):
            KaldiNGD(p, **kw)


# ------------------------------------------------------------------ textbook damped NGD (paper eq. 5-7)
def test_paper_kappa_by_hand():
    F = torch.tensor([[2.0, 1.0], [1.0, 4.0]], dtype=DT)
    g = torch.tensor([1.0, -1.0], dtype=DT)
    direction, kappa = damped_direction(F, g, alpha=0.5, epsilon=1e-10)
    assert kappa == pytest.approx(0.5 / 2 * 6.0)  # (α/d) max(tr F, ε)
    assert torch.allclose(direction, torch.linalg.solve(F + 1.5 * torch.eye(2, dtype=DT), g))
    assert paper_kappa(0.0, 10, 0.1, 1e-3) == pytest.approx(1e-5)  # ε floors the trace
    # κ -> ∞: κ (F + κI)⁻¹ g -> g (NGD with lr ηκ = SGD with lr η)
    direction, kappa = damped_direction(F, g, alpha=1e10, epsilon=1e-10)
    assert torch.allclose(kappa * direction, g, rtol=1e-8)


def test_fisher_equals_ggn_and_exact_ngd_step():
    """C5: the exact Fisher equals the GGN for softmax CE; one NGD step = damped Gauss-Newton step."""
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    X, y = torch.randn(16, 4, dtype=DT), torch.randint(0, 3, (16,))
    lik = CrossEntropy()
    G = dense_ggn(net, lik, (X, y))
    F = FisherOperator(net, lik, (X, y)).to_dense()
    assert torch.allclose(F, G, atol=1e-12)
    before = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    opt = NaturalGradient(net.parameters(), model=net, likelihood=lik, lr=0.1, alpha=0.05, curvature="exact")
    opt.zero_grad()
    nn.functional.cross_entropy(net(X), y).backward()
    g = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    opt.step(batch=(X, y))
    after = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    kappa = 0.05 / G.shape[0] * float(torch.trace(G))
    expected = before - 0.1 * torch.linalg.solve(G + kappa * torch.eye(G.shape[0], dtype=DT), g)
    assert opt.last_kappa == pytest.approx(kappa)
    assert torch.allclose(after, expected, atol=1e-10)
    torch.testing.assert_close(opt.curvature().to_dense(), G, atol=1e-12, rtol=0)


@pytest.mark.parametrize("inverse, ema", [("eigen", None), ("factored", 0.9)])
def test_kfac_ngd_step_is_the_damped_kronecker_step_and_decreases_loss(inverse, ema):
    """The KFAC route takes -lr (K + kappa I)^{-1} g with K = kfac(...) on the same batch and seed (exact
    damped Kronecker inverse, or the factored Tikhonov damping of thesis Eq. 4.25), kappa from K's exact
    trace; five steps lower the loss."""
    net, X, y = _mlp()
    lik = CrossEntropy()
    opt = NaturalGradient(net.parameters(), model=net, likelihood=lik, lr=0.5, alpha=0.1, curvature="kfac",
                          inversion=inverse, fisher_ema=ema)
    first = float(nn.functional.cross_entropy(net(X), y).detach())
    K = kfac(net, lik, (X, y), seed=0)
    opt.zero_grad()
    nn.functional.cross_entropy(net(X), y).backward()
    g = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    before = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    opt.step(batch=(X, y))
    kappa = 0.1 / K.layout.dim * float(K.trace())
    if inverse == "eigen":
        expected = before - 0.5 * torch.linalg.solve(K.to_dense() + kappa * torch.eye(K.layout.dim, dtype=DT), g)
    else:
        expected = before - 0.5 * torch.linalg.solve(K.factored_damping(kappa).to_dense(), g)
    after = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    assert opt.last_kappa == pytest.approx(kappa)
    torch.testing.assert_close(after, expected, atol=1e-10, rtol=1e-8)
    for _ in range(4):
        opt.zero_grad()
        nn.functional.cross_entropy(net(X), y).backward()
        opt.step(batch=(X, y))
    assert float(nn.functional.cross_entropy(net(X), y).detach()) < first


def test_switch_to_sgd_at_another_learning_rate_changes_the_optimiser(tmp_path):
    """ngd-switch's raised-SGD-lr branch: after the cut-off the run must train at the NEW learning rate
    (a regression test: the phase label once named only the optimiser, so SGD -> SGD kept the old lr)."""
    from curvkit.experiments.ngd_common import Measure, RunSpec, load_data, train_run

    data = load_data("smoke", "mnist", seed=0)
    measure = Measure(llc_chains=1, llc_draws=2, llc_epochs=(), trace_epochs=())
    runs = {}
    for lr in (1e-4, 1e-1):
        spec = RunSpec(f"sw-{lr:g}", 8, 1, "sgd", lr=lr, epochs=2, seed=0, switch_epoch=1, lr_before=1e-4,
                       batch_size=64)
        runs[lr] = train_run(spec, data, measure, tmp_path)
    assert runs[1e-4][1]["train_loss"] == runs[1e-1][1]["train_loss"]  # identical before the switch
    assert runs[1e-4][2]["phase"] == "sgd@0.0001" and runs[1e-1][2]["phase"] == "sgd@0.1"
    assert runs[1e-1][2]["update_norm"] > 10 * runs[1e-4][2]["update_norm"]
