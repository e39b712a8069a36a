"""Interface checks for the Bayesian-filtering optimisers: checkpoint round trip, validation errors,
layer support, hyperparameter maps, regime diagnostics (K11) and the curvature types returned."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from curvkit.linalg.kron import KroneckerOperator
from curvkit.linalg.operator import DiagonalOperator
from curvkit.optim.filters import (
    BFAdam,
    BFAdamSS,
    BFNatGrad,
    BFRMSProp,
    BFRMSPropSS,
    KFBayes,
    KFNatGrad,
    KFWhiten,
    sigma2_from_weight_decay,
    weight_decay_from_sigma2,
)
from curvkit.optim.filters.mapping import regime, rmsprop_fixed_point

FACTORISED = {
    "natgrad": lambda ps: BFNatGrad(ps, batch_size=8),
    "rmsprop": lambda ps: BFRMSProp(ps, lr=1e-2, sigma2=0.5, batch_size=8, curvature="centered"),
    "rmsprop_ss": lambda ps: BFRMSPropSS(ps, lr=1e-2, sigma2=0.5, batch_size=8),
    "adam": lambda ps: BFAdam(ps, lr=1e-2, sigma2=0.5, batch_size=8),
    "adam_ss": lambda ps: BFAdamSS(ps, lr=1e-2, combine=True, eta_w=1e-3, batch_size=8),
}
KRONECKER = {
    "kf_natgrad": lambda m: KFNatGrad(m.parameters(), model=m, batch_size=8),
    "kf_bayes": lambda m: KFBayes(m.parameters(), model=m, lr=1e-2, sigma2=1.0, batch_size=8, inv_every=2),
    "kf_whiten": lambda m: KFWhiten(m.parameters(), model=m, lr=1e-2, batch_size=8, inv_every=2, eta_p=0.1),
}


def _batches(n=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


def _train(net, opt, batches):
    for X, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(X), y).backward()
        opt.step()


@pytest.mark.parametrize("kind", [*FACTORISED, *KRONECKER])
def test_state_dict_round_trip_gives_identical_steps(kind, make_mlp):
    def make(net):
        return FACTORISED[kind](net.named_parameters()) if kind in FACTORISED else KRONECKER[kind](net)

    data = _batches()
    net = make_mlp((5, 4, 3), "tanh")
    opt = make(net)
    _train(net, opt, data[:3])
    sd_model = {k: v.clone() for k, v in net.state_dict().items()}
    sd_opt = copy.deepcopy(opt.state_dict())   # what torch.save would persist
    _train(net, opt, data[3:])
    net2 = make_mlp((5, 4, 3), "tanh", seed=5)
    net2.load_state_dict(sd_model)
    opt2 = make(net2)
    opt2.load_state_dict(sd_opt)
    _train(net2, opt2, data[3:])
    for a, b in zip(net.parameters(), net2.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    prec = opt.curvature()
    assert isinstance(prec, KroneckerOperator if kind in KRONECKER else DiagonalOperator)
    assert prec.shape == (sum(p.numel() for p in net.parameters()),) * 2
    assert bool((torch.linalg.eigvalsh(prec.to_dense()) > 0).all())
    assert all(torch.isfinite(v).all() for v in opt.effective_lr().values())


def _stored_posterior_means(opt, net):
    """Parameter tensors as the optimiser stores its posterior mean (None where it holds none)."""
    if hasattr(opt, "layers"):  # Kronecker: W_hat = [W | b] per layer
        out = []
        for rec in opt.layers:
            W = opt.state[rec.weight].get("mu_post")
            w, b = (None, None) if W is None else rec._split(W)
            out += [w] + ([b] if rec.bias is not None else [])
        return out
    return [opt.state[p].get("mu_post") for p in net.parameters()]


@pytest.mark.parametrize("kind", [*FACTORISED, *KRONECKER])
def test_posterior_mean_swaps_in_the_stored_mean_and_restores_the_prior(kind, make_mlp):
    """Inside ``posterior_mean()`` the parameters are the stored posterior mean mu_post; outside they are
    the prior mean of the next step, restored exactly (also after an exception in the block)."""
    net = make_mlp((5, 4, 3), "tanh")
    opt = FACTORISED[kind](net.named_parameters()) if kind in FACTORISED else KRONECKER[kind](net)
    _train(net, opt, _batches(3))
    prior = [p.detach().clone() for p in net.parameters()]
    stored = _stored_posterior_means(opt, net)
    assert any(m is not None for m in stored) == (kind in ("rmsprop", "rmsprop_ss", "adam", "adam_ss",
                                                           "kf_bayes", "kf_whiten"))
    with opt.posterior_mean():
        inside = [p.detach().clone() for p in net.parameters()]
    for p, q, m, i in zip(prior, net.parameters(), stored, inside):
        assert torch.equal(q, p)  # restored exactly
        assert torch.equal(i, p if m is None else m.to(p.dtype))
    if any(m is not None for m in stored):
        assert any(not torch.equal(i, p) for i, p in zip(inside, prior))  # something was swapped
    with pytest.raises(RuntimeError, match="boom"), opt.posterior_mean():
        raise RuntimeError("boom")
    assert all(torch.equal(q, p) for p, q in zip(prior, net.parameters()))


@pytest.mark.parametrize(("factory", "match"), [
    (lambda ps: BFRMSProp(ps, lr=-1.0), "lr"),
    (lambda ps: BFRMSProp(ps, sigma2=0.0), "sigma2"),
    (lambda ps: BFRMSProp(ps, curvature="bogus"), "fisher"),
    (lambda ps: BFRMSProp(ps, drift="linear"), "drift"),
    (lambda ps: BFRMSProp(ps, reduction="avg"), "reduction"),
    (lambda ps: BFRMSPropSS(ps, beta2=1.0), "beta2"),
    (lambda ps: BFRMSPropSS(ps, eps=float("nan")), "eps"),
    (lambda ps: BFAdam(ps, eta_p=1.5), "eta_p"),
    (lambda ps: BFAdamSS(ps, eta_w=-1.0), "eta_w"),
    (lambda ps: BFNatGrad(ps, s0=0.0), "s0"),
    (lambda ps: BFRMSProp(ps, batch_size=0), "batch_size"),
])
def test_invalid_hyperparameters_raise(factory, match, make_mlp):
    with pytest.raises(ValueError, match=match):
        factory(make_mlp((5, 4, 3), "tanh").parameters())


def test_kronecker_invalid_hyperparameters_raise(make_mlp):
    for factory, match in [(lambda m: KFBayes(m.parameters(), model=m, lr=-1), "lr"), (lambda m: KFBayes(m.parameters(), model=m, projection="x"), "projection"),
                           (lambda m: KFBayes(m.parameters(), model=m, fisher_samples=0), "fisher_samples"),
                           (lambda m: KFWhiten(m.parameters(), model=m, beta=1.5), "beta"), (lambda m: KFWhiten(m.parameters(), model=m, damping=0), "damping"),
                           (lambda m: KFWhiten(m.parameters(), model=m, inv_every=0), "inv_every")]:
        with pytest.raises(ValueError, match=match):
            factory(make_mlp((5, 4, 3), "tanh"))


def test_runtime_errors_are_clear(make_mlp):
    net = make_mlp((5, 4, 3), "tanh")
    opt = BFRMSProp(net.parameters())     # mean reduction without batch size
    torch.nn.functional.cross_entropy(net(_batches(1)[0][0]), _batches(1)[0][1]).backward()
    with pytest.raises(ValueError, match="batch_size"):
        opt.step()
    opt.step(batch_size=8)                # per-call batch size works
    next(net.parameters()).grad.fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        opt.step(batch_size=8)
    next(net.parameters()).grad.zero_()
    with pytest.raises(ValueError, match="fisher_diag"):
        BFRMSProp(net.parameters(), curvature="given", batch_size=8).step()
    net2 = make_mlp((5, 4, 3), "tanh")
    kf = KFBayes(net2.parameters(), model=net2, batch_size=8)
    with pytest.raises(RuntimeError, match="step"):
        kf.curvature()


def test_unsupported_layers_are_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'1'.*BatchNorm1d"):
        KFBayes(model.parameters(), model=model)
    odd = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.PReLU(4), torch.nn.Linear(4, 2))
    assert [d.name for d in KFNatGrad(odd.parameters(), model=odd).diagonal] == ["1.weight"]  # diagonal form
    # a groups=1 convolution keeps the Kronecker posterior (its locations are an example's rows: E_n of rank > 1)
    conv = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(2 * 4 * 4, 3))
    nat = KFNatGrad(conv.parameters(), model=conv)
    assert nat.diagonal == [] and [r.name for r in nat.layers] == ["0", "2"]
    nat.close()
    # KFWhiten supports Conv2d (KFC-style patch statistics)
    opt = KFWhiten(conv.parameters(), model=conv, lr=1e-2, batch_size=4)
    X, y = torch.randn(4, 1, 6, 6), torch.randint(0, 3, (4,))
    before = conv[0].weight.detach().clone()
    torch.nn.functional.cross_entropy(conv(X), y).backward()
    opt.step()
    assert not torch.equal(before, conv[0].weight)
    prec = opt.curvature()
    assert prec.blocks[0].A.shape == (1 * 3 * 3 + 1,) * 2


def test_adamw_mapping_gives_the_same_decoupled_decay():
    lr, wd = 1e-3, 1e-2
    s2 = sigma2_from_weight_decay(lr, wd)
    assert weight_decay_from_sigma2(lr, s2) == pytest.approx(wd)
    p = torch.nn.Parameter(torch.tensor([2.0], dtype=torch.float64))
    q = torch.nn.Parameter(torch.tensor([2.0], dtype=torch.float64))
    opt = BFRMSProp([p], lr=lr, sigma2=s2, drift="paper", reduction="sum")
    ref = torch.optim.AdamW([q], lr=lr, weight_decay=wd)
    p.grad, q.grad = torch.zeros_like(p), torch.zeros_like(q)
    opt.step()
    ref.step()
    torch.testing.assert_close(p, q, atol=1e-15, rtol=0)


# ------------------------------------------------------------------------------------------------ K11
@pytest.mark.parametrize(("B", "s", "sgd", "adam"), [(1, 9.9501e-4, 0.0100, 0.9950), (100, 9.5125e-5, 0.0951, 0.9512),
                                                     (1e4, 6.1803e-6, 0.6180, 0.6180), (4e4, 2.0711e-6, 0.8284, 0.4142),
                                                     (1e6, 9.9020e-8, 0.9902, 0.0990)])
def test_k11_noise_dominated_regimes(B, s, sgd, adam):
    eta, lr_sgd = 1e-3, 0.1
    sigma2, v = lr_sgd / B, float(B)
    got = rmsprop_fixed_point(eta, v, sigma2)
    assert got == pytest.approx(s, rel=1e-4)
    r = regime(got, eta, sigma2, v)
    assert r["sgd_like"] == pytest.approx(sgd, abs=1e-4) and r["adam_like"] == pytest.approx(adam, abs=1e-4)


@pytest.mark.parametrize(("m", "sgd", "adam"), [(0.1, 0.0951, 0.9512), (0.01, 0.6180, 0.6180), (1e-3, 0.9902, 0.0990)])
def test_k11_signal_dominated_regimes_do_not_depend_on_batch(m, sgd, adam):
    for B in (1, 10, 1000):
        sigma2, v = 0.1 / B, (B * m) ** 2
        r = regime(rmsprop_fixed_point(1e-3, v, sigma2), 1e-3, sigma2, v)
        assert r["sgd_like"] == pytest.approx(sgd, abs=1e-4) and r["adam_like"] == pytest.approx(adam, abs=1e-4)


def test_diagnostics_report_regime():
    for scale, want in ((1e-6, "sgd"), (1e3, "adam")):
        p = torch.nn.Parameter(torch.zeros(10, dtype=torch.float64))
        opt = BFRMSPropSS([p], lr=1e-3, sigma2=0.1, reduction="sum")
        for _ in range(5):
            p.grad = torch.full_like(p, scale)
            opt.step()
        row = opt.diagnostics()[0]
        assert row["regime"] == want
        assert math.isfinite(row["lr_mean"])


def test_diagnostics_of_momentum_and_exact_filters():
    """O6 uses its steady gain (not Sigma_ww) for the regime: Adam-like under a large gradient. The exact
    filter (O3, sigma^2 = inf) still at its SGD-like warm start s0 reports 'sgd'."""
    p = torch.nn.Parameter(torch.zeros(10, dtype=torch.float64))
    opt = BFAdamSS([p], lr=1e-3, reduction="sum")
    for _ in range(5):
        p.grad = torch.full_like(p, -1e3)
        opt.step()
    row = opt.diagnostics()[0]
    assert row["regime"] == "adam" and row["adam_like"] == pytest.approx(1.0, abs=1e-6)
    assert row["sgd_like"] == 0.0                 # sigma^2 = inf: the steady-state filter has no SGD regime
    p2 = torch.nn.Parameter(torch.zeros(10, dtype=torch.float64))
    fin = BFAdamSS([p2], lr=1e-3, sigma2=1e-5, reduction="sum")
    for _ in range(5):
        p2.grad = torch.full_like(p2, -1e3)
        fin.step()
    assert fin.diagnostics()[0]["sgd_like"] == pytest.approx(1e-3 / 1e3 / 1e-5, rel=1e-3)   # gain / sigma^2
    q = torch.nn.Parameter(torch.zeros(10, dtype=torch.float64))
    exact = BFRMSProp([q], lr=1e-3, reduction="sum")
    q.grad = torch.full_like(q, 1e-6)
    exact.step()
    row = exact.diagnostics()[0]
    assert row["regime"] == "sgd" and row["sgd_like"] == 1.0 and row["adam_like"] == 0.0


def test_filtering_vs_adam_drift_task_and_resume(tmp_path):
    """The experiment's drift task runs for filters and baselines (finite, the exact Kalman filter tracks),
    and a finished run is reused from its JSON file instead of being recomputed."""
    from curvkit.experiments.filtering_vs_adam import _cached, run_drift

    for name in ("DenseKalman", "KFWhiten", "BFAdam", "Adam"):
        r = run_drift(name, seed=0, steps=40)
        assert r["diverged"] is None and all(math.isfinite(v) for v in r["tracking_error"])
    kf = run_drift("DenseKalman", seed=0, steps=40)["tracking_error"]
    assert kf[-1] < 0.2 * kf[0]
    calls = []

    def work():
        calls.append(1)
        return {"x": [1.0, 2.0]}

    key = {"task": "t", "seed": 0}
    assert _cached(tmp_path / "r.json", key, work) == {"x": [1.0, 2.0]}
    assert _cached(tmp_path / "r.json", key, work) == {"x": [1.0, 2.0]}
    assert len(calls) == 1
    _cached(tmp_path / "r.json", {"task": "t", "seed": 1}, work)   # another configuration: recomputed
    assert len(calls) == 2
