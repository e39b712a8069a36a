"""The damped Gauss-Newton optimiser of thesis chapter 4 against dense float64 references.

Every quantity the optimiser computes is rebuilt here independently on tiny models: the direction from
the same Kronecker factors as a dense (G~ + (lambda + zeta) I)^{-1} g (factored, Eq. 4.25, and exact),
alpha* from the dense exact minibatch GGN (Eqs. 4.17-4.20), rho (Eq. 4.21), the greedy zeta (Eq. 4.22),
the 2-D momentum model; Lemma 4.1 on a deep linear net; convergence on linear least squares; resume
equality, reproducibility and the error paths.
"""

from __future__ import annotations

import copy
import io
import itertools
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad

from curvkit.likelihoods import BernoulliBCE, CrossEntropy, Gaussian
from curvkit.linalg.layout import ParamLayout
from curvkit.models import mlp
from curvkit.optim import GaussNewton
from curvkit.optim.second_order.quadratic import (
    levenberg_marquardt,
    line_minimum,
    reduction_ratio,
    two_direction_minimum,
)
from curvkit.structure import UnsupportedModelError
from reference import NotSequential, dense_ggn, make_data

pytestmark = pytest.mark.usefixtures("float64_default")


# ---------------------------------------------------------------------------------------------- helpers
def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _objective_grad(model: nn.Module, lik, X, y, wd: float) -> tuple[float, torch.Tensor]:
    """E = lik(f, y) + wd/2 |theta|^2 and its gradient, by torch.func on the flat vector of the trainable
    parameters (frozen ones keep their values and are not in theta)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    shapes = [p.shape for p in model.parameters() if p.requires_grad]

    def E(theta):
        ps, o = {}, 0
        for n, s in zip(names, shapes):
            k = int(torch.Size(s).numel())
            ps[n] = theta[o:o + k].reshape(s)
            o += k
        return lik(functional_call(model, ps, (X,)), y) + 0.5 * wd * (theta**2).sum()

    th = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])
    return float(E(th)), grad(E)(th)


def _hat_index(layout: ParamLayout, weight: str, bias: str | None) -> torch.Tensor:
    """Flat parameter index of every entry of W_hat = [W | b] in row-major order (written out here)."""
    sl = layout.slices()
    shapes = dict(zip(layout.names, layout.shapes))
    o = shapes[weight][0]
    i = math.prod(shapes[weight][1:])
    rows = []
    for r in range(o):
        row = [sl[weight].start + r * i + c for c in range(i)]
        if bias is not None:
            row.append(sl[bias].start + r)
        rows.append(row)
    return torch.tensor(rows).reshape(-1)


def _dense_direction(opt: GaussNewton, g: torch.Tensor, zeta: float, exact: bool) -> torch.Tensor:
    """(G~ + (lambda + zeta) I)^{-1} g from the optimiser's factors, dense, per layer (Eq. 4.25 or exact)."""
    op = opt.estimator.operator()
    lam = opt.hp["weight_decay"] + zeta
    k = math.sqrt(lam)
    out = torch.zeros_like(g)
    for b in op.blocks:
        idx = _hat_index(op.layout, b.weight_name, b.bias_name)
        G, A = b.G, b.A
        if exact:
            M = torch.kron(G, A) + lam * torch.eye(G.shape[0] * A.shape[0])
        elif float(G.trace()) == 0 or float(A.trace()) == 0:  # a zero block: the omega -> inf limit, lam I
            M = lam * torch.eye(G.shape[0] * A.shape[0])
        else:
            om = math.sqrt((float(A.trace()) / A.shape[0]) / (float(G.trace()) / G.shape[0]))
            M = torch.kron(G + (k / om) * torch.eye(G.shape[0]), A + (om * k) * torch.eye(A.shape[0]))
        out[idx] = torch.linalg.solve(M, g[idx])
    return out


def _tiny(seed: int = 0, sizes=(4, 5, 3), act: str = "tanh") -> nn.Sequential:
    return mlp(list(sizes), act, dtype=torch.float64, seed=seed)


# ---------------------------------------------------------------------------------------------- quadratic
def test_line_minimum_is_the_minimiser_of_the_model():
    alpha, q = line_minimum(2.0, 4.0)
    assert alpha == -0.5 and q == -0.5
    model = lambda a: a * 2.0 + 0.5 * a * a * 4.0  # noqa: E731
    assert model(alpha) == pytest.approx(q) and model(alpha + 1e-3) > q and model(alpha - 1e-3) > q
    with pytest.raises(FloatingPointError, match="d\\^T C d"):
        line_minimum(1.0, 0.0)


def test_two_direction_minimum_solves_the_2x2_model():
    M = [[3.0, 1.0], [1.0, 2.0]]
    v = [1.0, -2.0]
    a, b, q = two_direction_minimum(M, v)
    sol = -torch.linalg.solve(torch.tensor(M), torch.tensor(v))
    assert a == pytest.approx(float(sol[0])) and b == pytest.approx(float(sol[1]))
    assert q == pytest.approx(-0.5 * float(torch.tensor(v) @ torch.linalg.solve(torch.tensor(M), torch.tensor(v))))
    assert two_direction_minimum([[1.0, 1.0], [1.0, 1.0]], v) is None  # collinear directions


def test_reduction_ratio_and_levenberg_marquardt_rules():
    assert reduction_ratio(-1.0, -2.0) == 0.5
    assert reduction_ratio(math.inf, -2.0) == -math.inf
    assert math.isnan(reduction_ratio(-1.0, 0.0))
    w = 0.95
    # band (default): decrease above 3/4, increase below 1/4, unchanged in between
    assert levenberg_marquardt(1.0, 0.9, w) == w
    assert levenberg_marquardt(1.0, 0.1, w) == 1 / w
    assert levenberg_marquardt(1.0, 0.5, w) == 1.0
    assert levenberg_marquardt(1.0, -math.inf, w) == 1 / w
    assert levenberg_marquardt(1.0, math.nan, w) == 1.0
    # thesis single threshold: anything at or below 3/4 increases
    assert levenberg_marquardt(1.0, 0.5, w, "threshold") == 1 / w
    assert levenberg_marquardt(1.0, 0.9, w, "threshold") == w


# ---------------------------------------------------------------------------------------------- one step
CASES = [
    ("kfra", "factored", "ce"), ("kfra", "eigen", "ce"), ("kflr", "factored", "bce"),
    ("kfac", "eigen", "gauss"), ("projection", "factored", "ce"),
]


@pytest.mark.parametrize(("curv", "inv", "lik_name"), CASES)
def test_direction_and_step_size_equal_dense_references(curv, inv, lik_name):
    """theta_1 - theta_0 = alpha* d with d = dense (G~ + (lambda + zeta) I)^{-1} g from the same factors and
    alpha* = -d^T g / d^T (G + (lambda + tau) I) d with the dense exact minibatch GGN."""
    lik = {"ce": CrossEntropy("mean"), "bce": BernoulliBCE("mean"), "gauss": Gaussian("mean")}[lik_name]
    net = _tiny(1)
    X, y = make_data(lik_name, 12, seed=2)
    wd, tau, zeta = 1e-2, 0.3, 0.2
    opt = GaussNewton(net.parameters(), model=net, likelihood=lik, curvature=curv, inversion=inv,
                      weight_decay=wd, tau=tau, zeta=zeta, tau_every=0, zeta_every=0, mc_samples=2)
    E0, g = _objective_grad(net, lik, X, y, wd)
    Gd = dense_ggn(net, lik, (X, y))
    th0 = _flat(net)
    loss = opt.step(batch=(X, y))
    assert float(loss) == pytest.approx(E0, rel=1e-12)
    d = _dense_direction(opt, g, zeta, exact=inv == "eigen")
    C = Gd + (wd + tau) * torch.eye(len(g))
    alpha = -float(d @ g) / float(d @ C @ d)
    rec = opt.history[-1]
    assert rec["alpha"] == pytest.approx(alpha, rel=1e-9)
    assert alpha < 0  # d is a descent direction of -alpha d (no minus sign in Eq. 4.16)
    assert torch.allclose(_flat(net) - th0, alpha * d, atol=1e-12, rtol=1e-9)
    assert rec["predicted_change"] == pytest.approx(-0.5 * float(d @ g) ** 2 / float(d @ C @ d), rel=1e-9)
    # curvature() is the damped Kronecker operator whose inverse gives the direction
    K = opt.curvature()
    assert torch.allclose(K.inverse() @ g, d, atol=1e-12, rtol=1e-9)
    if inv == "factored":
        for b in opt.estimator.operator().blocks:
            om = math.sqrt((float(b.A.trace()) / b.A.shape[0]) / (float(b.G.trace()) / b.G.shape[0]))
            assert rec["omega"][b.weight_name] == pytest.approx(om)


def test_frobenius_omega_and_per_block_split():
    net = _tiny(3)
    X, y = make_data("ce", 10, seed=3)
    opt = GaussNewton(net.parameters(), model=net, likelihood=CrossEntropy(), omega_norm="frobenius",
                      tau_every=0, zeta_every=0)
    opt.step(batch=(X, y))
    op = opt.estimator.operator()
    for b in op.blocks:
        expected = math.sqrt((float(torch.linalg.matrix_norm(b.A)) / math.sqrt(b.A.shape[0]))
                             / (float(torch.linalg.matrix_norm(b.G)) / math.sqrt(b.G.shape[0])))
        assert opt.history[-1]["omega"][b.weight_name] == pytest.approx(expected)
        # the residual bound of Eq. 4.26 in the Frobenius norm is minimised at this omega
        nA = float(torch.linalg.matrix_norm(torch.kron(b.A, torch.eye(b.G.shape[0]))))
        nG = float(torch.linalg.matrix_norm(torch.kron(torch.eye(b.A.shape[0]), b.G)))
        bound = lambda w, nA=nA, nG=nG: nA / w + w * nG  # noqa: E731
        assert bound(expected) <= min(bound(expected * 1.01), bound(expected / 1.01))
    pis = [0.5, 2.0]
    fd = op.factored_damping(0.3, pi=pis)
    for b, fb, p in zip(op.blocks, fd.blocks, pis):
        assert torch.allclose(fb.A - b.A, p * math.sqrt(0.3) * torch.eye(b.A.shape[0]))
        assert torch.allclose(fb.G - b.G, math.sqrt(0.3) / p * torch.eye(b.G.shape[0]))
    with pytest.raises(ValueError, match="one per block"):
        op.factored_damping(0.3, pi=[1.0])


def test_greedy_zeta_picks_the_best_quadratic_model():
    """At a zeta step the optimiser's zeta is the argmin over {zeta, w zeta, zeta / w} of the dense
    q(alpha* d) = -(d^T g)^2 / (2 d^T C d) with the tau-damped exact GGN (Eq. 4.22)."""
    lik = CrossEntropy("mean")
    for seed, zeta0 in ((0, 1.0), (1, 1e-4), (2, 30.0)):
        net = _tiny(seed)
        X, y = make_data("ce", 16, seed=seed)
        wd, tau, w = 1e-3, 0.05, 0.5
        opt = GaussNewton(net.parameters(), model=net, likelihood=lik, curvature="kflr", weight_decay=wd, tau=tau,
                          zeta=zeta0, tau_every=0, zeta_every=1, omega_zeta=w)
        _, g = _objective_grad(net, lik, X, y, wd)
        C = dense_ggn(net, lik, (X, y)) + (wd + tau) * torch.eye(len(g))
        opt.step(batch=(X, y))
        qs = {}
        for z in (zeta0, w * zeta0, zeta0 / w):
            d = _dense_direction(opt, g, z, exact=False)
            qs[z] = -0.5 * float(d @ g) ** 2 / float(d @ C @ d)
        best = min(qs, key=qs.__getitem__)
        assert opt.zeta == pytest.approx(best) and opt.history[-1]["zeta"] == pytest.approx(best)
        assert opt.history[-1]["predicted_change"] == pytest.approx(qs[best], rel=1e-9)


def test_rho_and_tau_on_a_tau_step():
    """rho = (E(theta_1) - E(theta_0)) / (q(step) - q(0)) on the same minibatch; tau moves by omega_tau."""
    lik = CrossEntropy("mean")
    net = _tiny(4)
    X, y = make_data("ce", 16, seed=4)
    opt = GaussNewton(net.parameters(), model=net, likelihood=lik, weight_decay=1e-3, tau=0.5, zeta=0.1,
                      tau_every=1, zeta_every=0, omega_tau=0.8)
    for _ in range(3):
        E0, _ = _objective_grad(net, lik, X, y, 1e-3)
        tau0 = opt.tau
        opt.step(batch=(X, y))
        E1, _ = _objective_grad(net, lik, X, y, 1e-3)
        rec = opt.history[-1]
        rho = (E1 - E0) / rec["predicted_change"]
        assert rec["rho"] == pytest.approx(rho, rel=1e-9)
        expected = tau0 * 0.8 if rho > 0.75 else (tau0 / 0.8 if rho < 0.25 else tau0)
        assert opt.tau == pytest.approx(expected)


def test_quadratic_objective_has_rho_between_one_and_two():
    """On a quadratic objective the exact GGN is the Hessian, so with tau > 0
    rho = 2 - d^T (G + lambda) d / d^T (G + lambda + tau) d lies in (1, 2) and tau decreases every time."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2, dtype=torch.float64)
    X, Y = torch.randn(20, 3), torch.randn(20, 2)
    opt = GaussNewton(net.parameters(), model=net, likelihood=Gaussian("mean"), curvature="kflr", tau=2.0,
                      tau_every=1, zeta_every=0, zeta=1e-3, lm_rule="threshold", omega_tau=0.9)
    taus = []
    for _ in range(4):
        opt.step(batch=(X, Y))
        assert 1.0 < opt.history[-1]["rho"] < 2.0
        taus.append(opt.tau)
    assert taus == pytest.approx([2.0 * 0.9 ** (i + 1) for i in range(4)])


# ---------------------------------------------------------------------------------------------- thesis results
def test_lemma_4_1_block_diagonal_step_is_a_full_gauss_newton_step():
    """Deep linear net (no bias, square invertible W_l, constant G_L = I, invertible input covariance):
    the block-diagonal step equals (1/L) G_diag^{-1} g and is a full Gauss-Newton step, G (alpha* d) = -g,
    with alpha* = -1/L (Lemma 4.1; the full GGN is singular, so it is checked as G_full U = L V)."""
    L, d_ = 3, 3
    g_ = torch.Generator().manual_seed(0)
    net = nn.Sequential(*[nn.Linear(d_, d_, bias=False) for _ in range(L)]).to(torch.float64)
    with torch.no_grad():
        for lay in net:
            lay.weight.copy_(torch.eye(d_) + 0.3 * torch.randn(d_, d_, generator=g_))
    X, Y = torch.randn(50, d_, generator=g_), torch.randn(50, d_, generator=g_)
    lik = Gaussian("mean")
    Gfull = dense_ggn(net, lik, (X, Y))
    assert int(torch.linalg.matrix_rank(Gfull)) < Gfull.shape[0]  # singular: rescaling symmetries
    _, gvec = _objective_grad(net, lik, X, Y, 0.0)
    for curv in ("kfra", "kflr"):
        model = copy.deepcopy(net)
        opt = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature=curv, inversion="eigen",
                          zeta=1e-12, tau=0.0, tau_every=0, zeta_every=0)
        opt.step(batch=(X, Y))
        update = _flat(model) - _flat(net)
        assert opt.history[-1]["alpha"] == pytest.approx(-1 / L, rel=1e-6)
        assert torch.allclose(Gfull @ update, -gvec, atol=1e-8)
        # and the Kronecker blocks ARE the exact diagonal blocks here: G_diag U = V per layer
        Gdiag = torch.block_diag(*[Gfull[i * 9:(i + 1) * 9, i * 9:(i + 1) * 9] for i in range(L)])
        U = torch.linalg.solve(Gdiag, gvec)
        assert torch.allclose(Gfull @ U, L * gvec, atol=1e-8)
        assert torch.allclose(update, -U / L, atol=1e-8)


@pytest.mark.parametrize("inversion", ["factored", "eigen"])
def test_linear_least_squares_converges_in_a_few_steps(inversion):
    """One Linear layer, squared error: the Kronecker curvature IS the exact Hessian (G = I, A = E[x x^T]),
    so with tiny damping the first step is a Newton step onto the least-squares solution."""
    g_ = torch.Generator().manual_seed(5)
    X, Y = torch.randn(40, 5, generator=g_), torch.randn(40, 2, generator=g_)
    net = nn.Sequential(nn.Linear(5, 2)).to(torch.float64)
    opt = GaussNewton(net.parameters(), model=net, likelihood=Gaussian("mean"), curvature="kfra",
                      inversion=inversion, zeta=1e-10, tau=1e-10, tau_every=1, zeta_every=0)
    Xh = torch.cat([X, torch.ones(40, 1)], 1)
    sol = torch.linalg.lstsq(Xh, Y).solution.T  # (2, 6) = [W | b]
    for _ in range(3):
        opt.step(batch=(X, Y))
    assert torch.allclose(torch.cat([net[0].weight, net[0].bias[:, None]], 1), sol, atol=1e-7)
    assert opt.history[0]["alpha"] == pytest.approx(-1.0, abs=1e-4)  # factored damping: O(sqrt(zeta)) error


# ---------------------------------------------------------------------------------------------- momentum
def test_momentum_step_minimises_the_two_direction_model():
    lik = CrossEntropy("mean")
    net = _tiny(6)
    X, y = make_data("ce", 16, seed=6)
    wd, tau = 1e-3, 0.2
    opt = GaussNewton(net.parameters(), model=net, likelihood=lik, weight_decay=wd, tau=tau, zeta=0.3,
                      tau_every=0, zeta_every=0, momentum=True)
    opt.step(batch=(X, y))
    u = torch.cat([opt.state[p]["previous_update"].reshape(-1) for p in net.parameters()])
    _, g = _objective_grad(net, lik, X, y, wd)
    C = dense_ggn(net, lik, (X, y)) + (wd + tau) * torch.eye(len(g))
    th = _flat(net)
    opt.step(batch=(X, y))
    s = _flat(net) - th
    d = _dense_direction(opt, g, 0.3, exact=False)
    # s lies in span{d, u} and the model's gradient vanishes on that span
    basis = torch.stack([d, u], 1)
    coef = torch.linalg.lstsq(basis, s[:, None]).solution
    assert torch.allclose(basis @ coef, s[:, None], atol=1e-10)
    assert torch.allclose(basis.T @ (g + C @ s), torch.zeros(2), atol=1e-10)
    q = lambda v: float(v @ g + 0.5 * v @ C @ v)  # noqa: E731
    alpha1 = -float(d @ g) / float(d @ C @ d)
    assert q(s) <= q(alpha1 * d) + 1e-12
    assert opt.history[-1]["beta"] is not None


# ---------------------------------------------------------------------------------------------- checkpoints
def _run(model, opt, batches):
    for b in batches:
        opt.step(batch=b)


def _batches(n, seed=7):
    g_ = torch.Generator().manual_seed(seed)
    return [(torch.randn(10, 4, generator=g_), torch.randint(0, 3, (10,), generator=g_)) for _ in range(n)]


def _make(seed=0, **kw):
    net = _tiny(seed)
    cfg = dict(curvature="kfac", ema=0.9, momentum=True, tau_every=2, zeta_every=3, curvature_every=2,
               weight_decay=1e-3, seed=11)
    cfg.update(kw)
    return net, GaussNewton(net.parameters(), model=net, likelihood=CrossEntropy(), **cfg)


def test_stopped_and_resumed_equals_uninterrupted():
    batches = _batches(9)
    net_a, opt_a = _make()
    _run(net_a, opt_a, batches)
    net_b, opt_b = _make()
    _run(net_b, opt_b, batches[:4])
    buf = io.BytesIO()
    torch.save({"model": net_b.state_dict(), "opt": opt_b.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    net_c, opt_c = _make(seed=99)  # a fresh process: different initial weights, then the checkpoint
    net_c.load_state_dict(ck["model"])
    opt_c.load_state_dict(ck["opt"])
    _run(net_c, opt_c, batches[4:])
    for pa, pc in zip(net_a.parameters(), net_c.parameters()):
        assert torch.equal(pa, pc)
    assert (opt_a.tau, opt_a.zeta, opt_a.num_steps) == (opt_c.tau, opt_c.zeta, opt_c.num_steps)
    assert [r["alpha"] for r in opt_a.history[4:]] == [r["alpha"] for r in opt_c.history]


def test_state_dict_round_trip_and_config_check():
    net, opt = _make()
    _run(net, opt, _batches(3))
    sd = opt.state_dict()
    net2, opt2 = _make()
    opt2.load_state_dict(sd)
    sd2 = opt2.state_dict()
    assert sd2["gauss_newton"]["tau"] == sd["gauss_newton"]["tau"]
    assert sd2["gauss_newton"]["num_steps"] == 3
    for a, b in zip(sd["gauss_newton"]["estimator"]["stats"], sd2["gauss_newton"]["estimator"]["stats"]):
        assert torch.equal(a, b)
    _, other = _make(curvature="kfra")
    with pytest.raises(ValueError, match="state_dict is for"):
        other.load_state_dict(sd)
    with pytest.raises(ValueError, match="not written by GaussNewton"):
        opt2.load_state_dict(torch.optim.SGD(net2.parameters(), lr=0.1).state_dict())


def test_seeded_runs_are_reproducible():
    batches = _batches(3)
    runs = []
    for seed in (11, 11, 12):
        net = _tiny(0)
        opt = GaussNewton(net.parameters(), model=net, likelihood=CrossEntropy(), curvature="kfac", seed=seed)
        _run(net, opt, batches)
        runs.append(_flat(net))
    assert torch.equal(runs[0], runs[1])
    assert not torch.allclose(runs[0], runs[2])


def test_closure_equals_batch():
    batches = _batches(4)
    net_a, opt_a = _make(curvature="kfra", momentum=False)
    _run(net_a, opt_a, batches)
    net_b, opt_b = _make(curvature="kfra", momentum=False)
    lik = CrossEntropy()
    for X, y in batches:
        def closure(X=X, y=y):
            opt_b.zero_grad()
            loss = lik(net_b(X), y)
            loss.backward()
            return loss
        opt_b.step(closure)
    for pa, pb in zip(net_a.parameters(), net_b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-12)
    assert opt_a.tau == opt_b.tau


# ---------------------------------------------------------------------------------------------- routes
def test_torch_func_route_and_conv_layers():
    """A model that is not a plain Sequential takes the dual-number JVP route; the step matches the tangent
    route. A Conv2d model (KFAC factors, KFC expansion) gets the dense-GGN alpha*."""
    X, y = make_data("ce", 8, seed=8)
    a, b = _tiny(8), NotSequential(_tiny(8))
    oa = GaussNewton(a.parameters(), model=a, likelihood=CrossEntropy(), curvature="kflr")
    ob = GaussNewton(b.parameters(), model=b, likelihood=CrossEntropy(), curvature="kflr")
    assert oa._linearisation.route == "tangent" and ob._linearisation.route == "dual"
    oa.step(batch=(X, y))
    ob.step(batch=(X, y))
    assert torch.allclose(_flat(a), _flat(b), atol=1e-12)
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 3 * 3, 3)).to(torch.float64)
    Xc, yc = torch.randn(6, 1, 5, 5), torch.randint(0, 3, (6,))
    lik = CrossEntropy()
    opt = GaussNewton(cnn.parameters(), model=cnn, likelihood=lik, curvature="kflr", tau=0.1, zeta=0.1,
                      tau_every=0, zeta_every=0)
    _, g = _objective_grad(cnn, lik, Xc, yc, 0.0)
    C = dense_ggn(cnn, lik, (Xc, yc)) + 0.1 * torch.eye(len(g))
    th = _flat(cnn)
    opt.step(batch=(Xc, yc))
    s = _flat(cnn) - th
    d = s / opt.history[-1]["alpha"]
    assert opt.history[-1]["alpha"] == pytest.approx(-float(d @ g) / float(d @ C @ d), rel=1e-9)


# ---------------------------------------------------------------------------------------------- errors
def test_invalid_hyperparameters_are_refused():
    net = _tiny()
    mk = lambda **kw: GaussNewton(net.parameters(), model=net, likelihood=CrossEntropy(), **kw)  # noqa: E731
    for kw, msg in [({"curvature": "hessian"}, "curvature must be"), ({"inversion": "chol"}, "inversion"),
                    ({"tau": -1.0}, "tau"), ({"zeta": math.nan}, "zeta"), ({"weight_decay": math.inf}, "weight_decay"),
                    ({"omega_tau": 1.0}, "omega_tau"), ({"omega_zeta": 0.0}, "omega_zeta"), ({"ema": 1.0}, "ema"),
                    ({"tau_every": -1}, "tau_every"), ({"curvature_every": 0}, "curvature_every"),
                    ({"lm_rule": "trust"}, "lm_rule"), ({"omega_norm": "spectral"}, "omega_norm"),
                    ({"zeta": 0.0}, "weight_decay \\+ zeta"), ({"mc_samples": 0}, "mc_samples"),
                    ({"momentum": 0.9}, "momentum"), ({"distribution": "uniform"}, "distribution")]:
        with pytest.raises(ValueError, match=msg):
            mk(**kw)
    with pytest.raises(ValueError, match="optimiser-wide"):
        GaussNewton([{"params": list(net.parameters()), "tau": 2.0}], model=net, likelihood=CrossEntropy())
    with pytest.raises(ValueError, match="every trainable parameter"):
        GaussNewton([net[0].weight], model=net, likelihood=CrossEntropy())
    with pytest.raises(TypeError, match="Likelihood"):
        GaussNewton(net.parameters(), model=net, likelihood=nn.CrossEntropyLoss())


def test_unsupported_layers_name_the_module():
    """A layer no registered kind takes (PReLU's per-channel slope) gets the per-sample fallback
    (curvkit.layerkinds.generic) for every source including 'auto'; KFRA on a model that is not an MLP chain
    is refused, naming the module."""
    net = nn.Sequential(nn.Linear(4, 5), nn.PReLU(5), nn.Linear(5, 3)).to(torch.float64)
    for curvature in ("auto", "kfac", "kflr"):
        opt = GaussNewton(net.parameters(), model=net, likelihood=CrossEntropy(), curvature=curvature)
        assert opt.estimator is None or "module" in {lp.handler.kind for lp in opt.estimator.plans}
    cnn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(18, 3)).to(torch.float64)
    with pytest.raises(UnsupportedModelError, match=r"'0'.*Conv2d"):
        GaussNewton(cnn.parameters(), model=cnn, likelihood=CrossEntropy(), curvature="kfra")


def _nan_outputs(net: nn.Module, X: torch.Tensor):
    """A forward hook that makes the outputs NaN for the batch ``X`` only (a finite batch, a NaN loss)."""
    return net.register_forward_hook(lambda m, i, o: o * math.nan if i[0].shape == X.shape and torch.equal(i[0], X)
                                     else o)


def test_step_errors_change_nothing():
    X, y = _batches(1)[0]
    Xbad = X.clone()
    Xbad[0, 0] = math.nan
    Xnan = X + 1.0  # a finite batch whose outputs the hook makes NaN
    net, opt = _make(momentum=False)  # curvature_every=2: step 1 refreshes the factors, step 2 reuses them
    hook = _nan_outputs(net, Xnan)
    gen0 = opt.state_dict()["gauss_newton"]["generator"].clone()
    with pytest.raises(ValueError, match=r"batch X contains NaN or inf \(1 of 40 entries\); nothing was changed"):
        opt.step(batch=(Xbad, y))
    with pytest.raises(FloatingPointError, match="step 1: the loss is not finite"):
        opt.step(batch=(Xnan, y))
    sd = opt.state_dict()["gauss_newton"]
    assert sd["num_steps"] == 0 and sd["estimator"]["num_updates"] == 0 and torch.equal(sd["generator"], gen0)
    opt.step(batch=(X, y))
    before = [p.clone() for p in net.parameters()]
    state = copy.deepcopy(opt.state_dict()["gauss_newton"])
    with pytest.raises(TypeError, match="unknown keyword"):
        opt.step(batch=(X, y), lr=0.1)
    with pytest.raises(TypeError, match="needs the minibatch"):
        opt.step()
    with pytest.raises(FloatingPointError, match="step 2: the loss is not finite"):
        opt.step(batch=(Xnan, y))
    hook.remove()
    for p, b in zip(net.parameters(), before):
        assert torch.equal(p, b)
    sd = opt.state_dict()["gauss_newton"]
    assert (sd["num_steps"], sd["tau"], sd["zeta"]) == (state["num_steps"], state["tau"], state["zeta"])
    assert len(opt.history) == 1


def test_factored_inverse_by_cholesky_solves_equals_the_operator_inverse():
    """The optimiser's hot path (two Cholesky solves per layer, W_hat layout) is the matrix of
    KroneckerOperator.inverse(method='factored'), for biased, bias-free and convolution layers."""
    from curvkit.curvature.estimators import KroneckerEstimator
    from curvkit.optim.second_order.direction import FactoredInverse

    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(1, 2, 3, bias=False), nn.Tanh(), nn.Flatten(), nn.Linear(18, 4), nn.Tanh(),
                        nn.Linear(4, 3, bias=False)).to(torch.float64)
    X, y = torch.randn(7, 1, 5, 5), torch.randint(0, 3, (7,))
    op = KroneckerEstimator(net, CrossEntropy(), "kflr").update((X, y)).operator()
    g = [torch.randn_like(p) for p in net.parameters()]
    names = [n for n, _ in net.named_parameters()]
    for norm in ("trace", "frobenius"):
        fast = FactoredInverse(op, 0.37, op.damping_split(norm)).apply(dict(zip(names, g)))
        ref = op.inverse(0.37, method="factored", norm=norm) @ g
        for n, r in zip(names, ref):
            assert torch.allclose(fast[n], r, atol=1e-12)


# ---------------------------------------------------------------------------------------------- issue 24
def _factors(op) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b.G.clone(), b.A.clone()) for b in op.blocks]


def _own_factors(net: nn.Module, lik, batch, curvature: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The Kronecker factors of ONE minibatch at the model's current parameters (a fresh estimator)."""
    from curvkit.curvature.estimators import KroneckerEstimator

    return _factors(KroneckerEstimator(copy.deepcopy(net), lik, curvature).update(batch).operator())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("curvature", ["kfra", "kflr"])
def test_default_curvature_is_the_current_minibatch(curvature, reduction):
    """ema=None (the default): after steps on b1 then b2 the factors are b2's own at the parameters of step 2
    (thesis Algorithm 1), not the running mean (A(b1) + A(b2)) / 2 of curvkit 0.1; with 'sum' they do not
    grow with the data seen. The input factor is also checked against its definition A = [X 1]^T [X 1] / B."""
    lik = CrossEntropy(reduction)
    net = _tiny(0)
    b1 = make_data("ce", 8, seed=1)
    X2, y2 = make_data("ce", 8, seed=2)
    b2 = (3.0 * X2, y2)  # a different input scale: the two batches' A differ a lot
    opt = GaussNewton(net.parameters(), model=net, likelihood=lik, curvature=curvature, tau_every=0, zeta_every=0)
    own1 = _own_factors(net, lik, b1, curvature)
    opt.step(batch=b1)
    held1 = _factors(opt.estimator.operator())
    own2 = _own_factors(net, lik, b2, curvature)
    _, g = _objective_grad(net, lik, *b2, 0.0)
    opt.step(batch=b2)
    held2 = _factors(opt.estimator.operator())
    for (G, A), (Go, Ao) in zip(held1 + held2, own1 + own2):
        assert torch.allclose(G, Go, atol=1e-12, rtol=1e-10) and torch.allclose(A, Ao, atol=1e-12, rtol=1e-10)
    Xh = torch.cat([b2[0], torch.ones(8, 1)], 1)
    assert torch.allclose(held2[0][1], Xh.T @ Xh / 8, atol=1e-12)
    assert not torch.allclose(held2[0][1], 0.5 * (own1[0][1] + own2[0][1]), atol=1e-3)  # not the running mean
    # the direction of step 2 is that of b2's own curvature (dense, Eq. 4.25)
    assert opt.history[-1]["refreshed"]
    assert torch.allclose(opt.curvature().inverse() @ g, _dense_direction(opt, g, 1.0, exact=False), atol=1e-12)


def test_running_mean_and_ema_are_explicit_options():
    """ema='running_mean' is curvkit 0.1's behaviour (mean of the per-batch factors, each at its step's
    parameters); ema=0.9 the thesis's moving average: 0.9 * old + 0.1 * new."""
    lik = CrossEntropy("mean")
    b1, b2 = make_data("ce", 8, seed=1), make_data("ce", 8, seed=2)
    for ema in ("running_mean", 0.9):
        net = _tiny(0)
        opt = GaussNewton(net.parameters(), model=net, likelihood=lik, curvature="kflr", ema=ema, tau_every=0,
                          zeta_every=0)
        own1 = _own_factors(net, lik, b1, "kflr")
        opt.step(batch=b1)
        own2 = _own_factors(net, lik, b2, "kflr")
        opt.step(batch=b2)
        w = 0.5 if ema == "running_mean" else 0.9
        for (G, A), (G1, A1), (G2, A2) in zip(_factors(opt.estimator.operator()), own1, own2):
            assert torch.allclose(G, w * G1 + (1 - w) * G2, atol=1e-12)
            assert torch.allclose(A, w * A1 + (1 - w) * A2, atol=1e-12)
    with pytest.raises(ValueError, match="running_mean"):
        GaussNewton(net.parameters(), model=net, likelihood=lik, ema="mean")


def test_curvkit_0_1_checkpoints_say_how_to_resume_them():
    """A state_dict written before the change (no 'format'; its ema=None meant the running mean) is refused
    by the new default with a message that says how to resume it, and resumes with ema='running_mean'."""
    batches = _batches(3)
    net, opt = _make(ema="running_mean", momentum=False)
    _run(net, opt, batches[:2])
    old = opt.state_dict()
    old["gauss_newton"] = dict(old["gauss_newton"], config=dict(old["gauss_newton"]["config"], ema=None))
    del old["gauss_newton"]["format"]
    _, fresh = _make(ema=None, momentum=False)
    with pytest.raises(ValueError, match="ema='running_mean' to continue that run exactly"):
        fresh.load_state_dict(old)
    net_b, resumed = _make(ema="running_mean", momentum=False)
    net_b.load_state_dict(net.state_dict())
    resumed.load_state_dict(old)
    _run(net, opt, batches[2:])
    _run(net_b, resumed, batches[2:])
    assert torch.equal(_flat(net), _flat(net_b))


def _saturated(seed: int = 0) -> nn.Sequential:
    """A softmax classifier so confident that p is exactly one-hot in float64: H_L = diag p - p p^T = 0."""
    net = _tiny(seed)
    with torch.no_grad():
        net[2].weight.mul_(1e6)
    return net


@pytest.mark.parametrize(("curvature", "inversion"), [("kfra", "factored"), ("kflr", "factored"),
                                                      ("kfac", "factored"), ("kflr", "eigen")])
def test_zero_curvature_takes_the_limit_step(curvature, inversion):
    """Output Hessian exactly zero: every Kronecker block is zero, the trace-norm split does not exist, and
    the damped step is its omega -> infinity limit d = g / (lambda + zeta); the exact GGN is zero too, so
    alpha* = -(lambda + zeta) / (lambda + tau) and the update is -g / (lambda + tau). Later steps go on."""
    lik = CrossEntropy("mean")
    net = _saturated()
    X, y = make_data("ce", 12, seed=3)
    p = net(X).softmax(-1)
    assert bool(((p == 0) | (p == 1)).all()) and not bool((p.argmax(1) == y).all())  # one-hot, some wrong
    wd, tau, zeta = 1e-3, 0.3, 0.2
    opt = GaussNewton(net.parameters(), model=net, likelihood=lik, curvature=curvature, inversion=inversion,
                      weight_decay=wd, tau=tau, zeta=zeta, tau_every=0, zeta_every=0)
    _, g = _objective_grad(net, lik, X, y, wd)
    th0 = _flat(net)
    opt.step(batch=(X, y))
    rec = opt.history[-1]
    assert rec["zero_curvature"] == ["0.weight", "2.weight"]
    assert rec["alpha"] == pytest.approx(-(wd + zeta) / (wd + tau), rel=1e-12)
    assert torch.allclose(_flat(net) - th0, -g / (wd + tau), atol=1e-12, rtol=1e-10)
    assert torch.allclose(opt.curvature().to_dense(), (wd + zeta) * torch.eye(len(g)), atol=1e-12)
    for _ in range(3):  # no dead end: every later step works
        opt.step(batch=(X, y))


def test_zero_factor_in_one_block_and_zero_gradient():
    """A block with a zero input factor (bias-free layer fed only zeros) is damped as delta I while the other
    block keeps its trace-norm split; a zero gradient (a saturated network that is right everywhere, no
    weight decay) gives a zero step (alpha = 0), not an error."""
    lik = CrossEntropy("mean")
    net = nn.Sequential(nn.Linear(4, 5, bias=False), nn.Tanh(), nn.Linear(5, 3)).to(torch.float64)
    X, y = torch.zeros(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    opt = GaussNewton(net.parameters(), model=net, likelihood=lik, curvature="kflr", tau_every=0, zeta_every=0,
                      zeta=0.5)
    _, g = _objective_grad(net, lik, X, y, 0.0)
    th0 = _flat(net)
    opt.step(batch=(X, y))
    rec = opt.history[-1]
    assert rec["zero_curvature"] == ["0.weight"] and rec["omega"]["0.weight"] == 1.0
    b = opt.estimator.operator().blocks[1]
    assert rec["omega"]["2.weight"] == pytest.approx(
        math.sqrt((float(b.A.trace()) / b.A.shape[0]) / (float(b.G.trace()) / b.G.shape[0])))
    d = _dense_direction(opt, g, 0.5, exact=False)  # block 0's gradient is zero, so its direction is too
    assert torch.allclose(_flat(net) - th0, rec["alpha"] * d, atol=1e-12)
    # zero gradient
    net = _saturated(1)
    X, _ = make_data("ce", 10, seed=4)
    y = net(X).argmax(1)
    opt = GaussNewton(net.parameters(), model=net, likelihood=lik, curvature="kfra")
    th0 = _flat(net)
    for _ in range(5):
        opt.step(batch=(X, y))
    assert torch.equal(_flat(net), th0) and all(r["alpha"] == 0.0 for r in opt.history)
    assert opt.tau == 1.0  # no predicted change: rho undefined, tau left alone


def _frozen_net(where: int) -> nn.Sequential:
    net = _tiny(5, sizes=(4, 5, 4, 3))
    net[2 * where].requires_grad_(False)
    return net


@pytest.mark.parametrize("where", [0, 1, 2])
@pytest.mark.parametrize("curvature", ["kfra", "kflr", "kfac"])
def test_frozen_layers_are_left_alone(curvature, where):
    """GaussNewton(model.parameters()) with a frozen layer (first, middle or last): the frozen layer gets no
    block and no update; the step on the others equals the dense reference over the trainable parameters
    only (direction from their blocks, alpha* from the dense GGN w.r.t. them)."""
    lik = CrossEntropy("mean")
    net = _frozen_net(where)
    frozen = [p.clone() for p in net[2 * where].parameters()]
    X, y = make_data("ce", 10, seed=5)
    wd, tau, zeta = 1e-2, 0.3, 0.2
    opt = GaussNewton(net.parameters(), model=net, likelihood=lik, curvature=curvature, weight_decay=wd, tau=tau,
                      zeta=zeta, tau_every=0, zeta_every=0)
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    assert opt.param_names() == trainable and len(trainable) == 4
    _, g = _objective_grad(net, lik, X, y, wd)
    C = dense_ggn(net, lik, (X, y)) + (wd + tau) * torch.eye(len(g))
    th0 = torch.cat([p.detach().reshape(-1) for p in net.parameters() if p.requires_grad])
    opt.step(batch=(X, y))
    assert [b.weight_name for b in opt.estimator.operator().blocks] == [n for n in trainable if "weight" in n]
    for p, f in zip(net[2 * where].parameters(), frozen):
        assert torch.equal(p, f)
    d = _dense_direction(opt, g, zeta, exact=False)
    alpha = -float(d @ g) / float(d @ C @ d)
    th1 = torch.cat([p.detach().reshape(-1) for p in net.parameters() if p.requires_grad])
    assert opt.history[-1]["alpha"] == pytest.approx(alpha, rel=1e-9)
    assert torch.allclose(th1 - th0, alpha * d, atol=1e-12, rtol=1e-9)


@pytest.mark.parametrize("where", [0, 1, 2])
def test_kfra_runs_its_recursion_through_frozen_layers(where):
    """KFRA's factors of the trainable layers are the same with the other layer frozen as without (the
    recursion (W^T G W) o Phi^T Phi / B passes through the frozen layer), and with one datum they are the
    exact GGN diagonal blocks of the trainable parameters (thesis Sec. 4.3.2)."""
    from curvkit.curvature.estimators import KroneckerEstimator
    from curvkit.linalg.layout import ParamLayout

    lik = CrossEntropy("mean")
    X, y = make_data("ce", 7, seed=6)
    full = _tiny(5, sizes=(4, 5, 4, 3))
    ref = {b.weight_name: (b.G, b.A) for b in KroneckerEstimator(full, lik, "kfra").update((X, y)).operator().blocks}
    net = _frozen_net(where)
    got = KroneckerEstimator(net, lik, "kfra").update((X, y)).operator()
    assert len(got.blocks) == 2
    for b in got.blocks:
        assert torch.allclose(b.G, ref[b.weight_name][0], atol=1e-12) and torch.allclose(b.A, ref[b.weight_name][1])
    one = (X[:1], y[:1])
    op = KroneckerEstimator(net, lik, "kfra").update(one).operator()
    Gd = dense_ggn(net, lik, one)
    layout = ParamLayout.from_module(net)
    for b in op.blocks:
        idx = _hat_index(layout, b.weight_name, b.bias_name)
        assert torch.allclose(torch.kron(b.G, b.A), Gd[idx[:, None], idx[None, :]], atol=1e-12)


def test_frozen_parameter_errors():
    lik = CrossEntropy()
    net = _tiny(0)
    for p in net.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="nothing to optimise"):
        GaussNewton(net.parameters(), model=net, likelihood=lik)
    net = _tiny(0)
    opt = GaussNewton(net.parameters(), model=net, likelihood=lik, curvature="kflr")
    net[0].requires_grad_(False)  # after construction: the blocks no longer match
    with pytest.raises(ValueError, match=r"requires_grad of 0\.weight, 0\.bias changed"):
        opt.step(batch=make_data("ce", 6))


def test_misuse_gets_clear_errors():
    """Empty batches (batch= and closure), a float64 batch for a float32 model, and closure together with
    batch= are refused with curvkit's own errors, before anything changes."""
    lik = CrossEntropy()
    net = _tiny(0)
    opt = GaussNewton(net.parameters(), model=net, likelihood=lik)
    X, y = make_data("ce", 6)
    with pytest.raises(ValueError, match=r"batch X is empty \(shape \(0, 4\)\)"):
        opt.step(batch=(X[:0], y[:0]))

    def empty_closure():
        opt.zero_grad()
        loss = lik(net(X[:0]), y[:0])
        loss.backward()
        return loss

    with pytest.raises(ValueError, match="the closure's model input is empty"):
        opt.step(empty_closure)
    with pytest.raises(ValueError, match="batch y has shape"):
        opt.step(batch=(X, y[:3]))

    def closure():
        opt.zero_grad()
        loss = lik(net(X), y)
        loss.backward()
        return loss

    with pytest.raises(TypeError, match="both a closure and batch="):
        opt.step(closure, batch=(X, y))
    assert opt.num_steps == 0 and opt.history == []
    net32 = mlp([4, 5, 3], "tanh", dtype=torch.float32, seed=0)
    opt32 = GaussNewton(net32.parameters(), model=net32, likelihood=lik)
    with pytest.raises(ValueError, match=r"batch X has dtype torch\.float64 but the model's parameters are torch\.float32"):
        opt32.step(batch=(X, y))
    with pytest.raises(ValueError, match=r"batch y has dtype torch\.float64"):
        GaussNewton(net32.parameters(), model=net32, likelihood=Gaussian()).step(
            batch=(X.float(), torch.randn(6, 3, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"closure's model input has dtype torch\.float64"):
        opt32.step(lambda: lik(net32(X), y))
    opt32.step(batch=(X.float(), y))  # and the right dtype works


def test_fast_adaptation_schedule():
    """FAST_ADAPTATION: rho and tau on every step (tau moves by 0.8), zeta searched every 5 steps over
    {zeta/2, zeta, 2 zeta}; on a full-batch problem it gets further than the thesis's schedule in 30 steps.
    It is read-only (a shared default must not be changed by one user)."""
    from curvkit.optim.second_order import FAST_ADAPTATION

    assert dict(FAST_ADAPTATION) == {"tau_every": 1, "omega_tau": 0.8, "zeta_every": 5, "omega_zeta": 0.5}
    with pytest.raises(TypeError):
        FAST_ADAPTATION["tau_every"] = 5  # type: ignore[index]
    lik = CrossEntropy("mean")
    X, _ = make_data("ce", 64, seed=9)
    y = (X @ torch.randn(4, 3, generator=torch.Generator().manual_seed(9))).argmax(1)  # a learnable teacher
    final = {}
    for name, kw in (("thesis", {}), ("fast", dict(FAST_ADAPTATION))):
        net = _tiny(9)
        opt = GaussNewton(net.parameters(), model=net, likelihood=lik, weight_decay=1e-5, **kw)
        for _ in range(30):
            opt.step(batch=(X, y))
        final[name] = _objective_grad(net, lik, X, y, 1e-5)[0]
        if name == "fast":
            assert all(r["rho"] is not None for r in opt.history)
            taus = [1.0] + [r["tau"] for r in opt.history]
            assert all(b / a in (pytest.approx(0.8), 1.0, pytest.approx(1.25)) for a, b in itertools.pairwise(taus))
            zetas = [1.0] + [r["zeta"] for r in opt.history]
            changes = [i + 1 for i, (a, b) in enumerate(itertools.pairwise(zetas)) if a != b]
            assert changes and all(k % 5 == 0 for k in changes)
            assert all(math.log2(z) == round(math.log2(z)) for z in zetas)
    assert final["fast"] < 0.5 * final["thesis"], final
