"""Laplace posteriors (thesis Ch. 5) against closed forms and dense torch.func references (float64).

* Bayesian linear regression: where the Laplace posterior is exact (Gaussian likelihood, linear model,
  exact GGN), posterior mean/precision, the GLM predictive and the log marginal likelihood equal the
  closed forms, for ``full``, ``diag`` (diagonal of the exact precision) and ``kron`` with the exact prior.
* Tiny nets: diag and full precisions equal N times the dense GGN (mean) plus the prior; the Kronecker
  posterior's covariance, log-determinant and GLM variance agree with its own dense matrix; the
  factored form equals Eq. 5.14 built from the per-datum factors.
* Monte Carlo: Kronecker sampling covariance equals the Kronecker inverse, MC predictive of a linear
  model equals the closed form (fixed seeds, tolerances stated per test).
"""

import math

import pytest
import torch
from tests.reference import dense_ggn
from torch import nn
from torch.func import functional_call, jacrev

from curvkit.checkpoint import load, save
from curvkit.curvature import GGNOperator
from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.laplace import Laplace, grid_search, optimize_prior_precision, predictive_nll
from curvkit.likelihoods import CrossEntropy, Gaussian
from curvkit.linalg.krylov import NotPositiveDefiniteError
from curvkit.models import mlp
from curvkit.structure import UnsupportedModelError

DT = torch.float64


def _blr(n=12, D=3, sigma=0.7, lam=0.4, seed=0):
    """A linear model at the exact posterior mean of Bayesian linear regression, and the closed forms."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, D, generator=g, dtype=DT)
    y = (X @ torch.tensor([1.0, -2.0, 0.5][:D], dtype=DT) + 0.3 + sigma * torch.randn(n, generator=g, dtype=DT))[:, None]
    Phi = torch.cat([X, torch.ones(n, 1, dtype=DT)], 1)
    P = Phi.T @ Phi / sigma**2 + lam * torch.eye(D + 1, dtype=DT)
    m = torch.linalg.solve(P, Phi.T @ y[:, 0] / sigma**2)
    model = nn.Linear(D, 1).to(DT)
    with torch.no_grad():
        model.weight.copy_(m[:D][None])
        model.bias.copy_(m[D:])
    K = sigma**2 * torch.eye(n, dtype=DT) + Phi @ Phi.T / lam
    evidence = torch.distributions.MultivariateNormal(torch.zeros(n, dtype=DT), K).log_prob(y[:, 0])
    return model, X, y, Phi, P, m, evidence, sigma, lam


@pytest.mark.parametrize("structure,curvature,form", [("full", "ggn", "factored"), ("kron", "kflr", "exact")])
def test_bayesian_linear_regression_closed_forms(structure, curvature, form):
    model, X, y, _Phi, P, m, evidence, sigma, lam = _blr()
    post = Laplace(model, Gaussian(sigma=sigma), structure, curvature, prior_precision=lam, prior_form=form)
    post.fit([(X[:5], y[:5]), (X[5:], y[5:])])  # unequal batches
    torch.testing.assert_close(post.mean, m)
    torch.testing.assert_close(post.precision().to_dense(), P)
    torch.testing.assert_close(post.covariance().to_dense(), torch.linalg.inv(P))
    torch.testing.assert_close(post.log_marginal_likelihood(), evidence)
    Xs = torch.randn(5, 3, dtype=DT, generator=torch.Generator().manual_seed(1))
    Phis = torch.cat([Xs, torch.ones(5, 1, dtype=DT)], 1)
    mean, var = post.predict(Xs, "glm")
    torch.testing.assert_close(mean[:, 0], Phis @ m)
    torch.testing.assert_close(var[:, 0], torch.einsum("bi,ij,bj->b", Phis, torch.linalg.inv(P), Phis) + sigma**2)


def test_bayesian_linear_regression_diag_is_the_exact_precision_diagonal():
    model, X, y, _Phi, P, _m, *_ , sigma, lam = _blr()
    post = Laplace(model, Gaussian(sigma=sigma), "diag", "ggn", prior_precision=lam).fit((X, y))
    torch.testing.assert_close(post.precision().diagonal().flat, P.diagonal())


def test_mc_predictive_of_a_linear_model_matches_the_closed_form():
    model, X, y, _Phi, _P, _m, *_ , sigma, lam = _blr()
    post = Laplace(model, Gaussian(sigma=sigma), "full", "ggn", prior_precision=lam).fit((X, y))
    Xs = torch.randn(4, 3, dtype=DT, generator=torch.Generator().manual_seed(2))
    mean_g, var_g = post.predict(Xs, "glm")
    mean, var = post.predict(Xs, "mc", num_samples=20000, generator=torch.Generator().manual_seed(3))
    # 20000 samples: the sample mean is within 5 standard errors, the variance within 5% (its relative
    # standard error is sqrt(2/20000) = 1%)
    se = (var_g - sigma**2).sqrt() / math.sqrt(20000)
    assert bool(((mean - mean_g).abs() <= 5 * se).all())
    torch.testing.assert_close(var, var_g, rtol=0.05, atol=0)


def _net(seed=0):
    return mlp([4, 5, 3], "tanh", dtype=DT, seed=seed)


def _data(n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)


def test_mc_predictive_is_the_average_over_the_draws_whatever_the_sample_groups():
    net, (X, y) = _net(), _data()
    post = Laplace(net, CrossEntropy(), "kron", "kflr", prior_precision=1.0).fit((X, y))
    S = post.sample(7, generator=torch.Generator().manual_seed(2))
    ref = torch.stack([functional_call(net, post.sample_params(s), (X,)).softmax(-1) for s in S]).mean(0)
    for group, batch in [(1, 5), (3, 64), (10, 2)]:
        torch.testing.assert_close(post.predict(X, "mc", samples=S, sample_batch=group, batch_size=batch), ref)
    with pytest.raises(ValueError, match="flat parameter draws"):
        post.predict(X, "mc", samples=S[:, :-1])
    with pytest.raises(ValueError, match="NaN or inf"):
        post.predict(X, "mc", samples=torch.full_like(S, float("nan")))


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_diag_and_full_ggn_posteriors_equal_the_dense_reference(structure):
    net, (X, y) = _net(), _data()
    lam = torch.tensor([0.3, 2.0], dtype=DT)  # per layer
    post = Laplace(net, CrossEntropy(), structure, "ggn", prior_precision=lam).fit([(X[:4], y[:4]), (X[4:], y[4:])])
    G = dense_ggn(net, CrossEntropy("mean"), (X, y))
    prior = torch.cat([torch.full((25,), 0.3), torch.full((18,), 2.0)]).to(DT)
    ref = 9 * G + torch.diag(prior)
    got = post.precision().to_dense()
    if structure == "diag":
        torch.testing.assert_close(got, torch.diag(ref.diagonal()))
    else:
        torch.testing.assert_close(got, ref)
    post.num_data = 40.0  # changed after fitting: no new curvature needed
    ref40 = 40 * G + torch.diag(prior)
    got40 = post.precision().to_dense()
    torch.testing.assert_close(got40, ref40 if structure == "full" else torch.diag(ref40.diagonal()))


def test_mc_fisher_posterior_is_unbiased_for_the_ggn():
    net, (X, y) = _net(), _data(n=4)
    post = Laplace(net, CrossEntropy(), "full", "mc_fisher", mc_samples=4000, seed=1, prior_precision=1.0).fit((X, y))
    G = 4 * dense_ggn(net, CrossEntropy("mean"), (X, y)) + torch.eye(43, dtype=DT)
    # 4000 sampled labels per point: entries within 0.05 of the largest GGN entry (about 10 standard errors
    # of the largest ones at this seed)
    assert float((post.precision().to_dense() - G).abs().max()) < 0.05 * float(G.abs().max())


def test_kron_factored_precision_is_eq_5_14_and_its_algebra_is_consistent():
    net, (X, y) = _net(), _data()
    lam, N = 0.5, 30.0
    post = Laplace(net, CrossEntropy(), "kron", "kflr", prior_precision=lam).fit((X, y), num_data=N)
    est = KroneckerEstimator(net, CrossEntropy("mean"), "kflr").update((X, y))
    P = post.precision().to_dense()
    for blk in est.operator().blocks:
        PG = math.sqrt(N) * blk.G + math.sqrt(lam) * torch.eye(blk.G.shape[0], dtype=DT)
        PA = math.sqrt(N) * blk.A + math.sqrt(lam) * torch.eye(blk.A.shape[0], dtype=DT)
        # the weight part of the block, row-major (out, in), is the leading in x in sub-block of kron(PG, PA)
        out, inn = blk.G.shape[0], blk.A.shape[0] - 1
        keep = torch.arange(out * (inn + 1)).reshape(out, inn + 1)[:, :inn].reshape(-1)
        w = post.layout.slices()[blk.weight_name]
        torch.testing.assert_close(P[w, w], torch.kron(PG, PA)[keep[:, None], keep[None, :]])
    C = post.covariance().to_dense()
    torch.testing.assert_close(C @ P, torch.eye(43, dtype=DT))
    torch.testing.assert_close(post.log_det_precision(), torch.linalg.slogdet(P)[1])


def test_kron_eigendecompositions_are_computed_on_first_use_and_survive_an_eigh_failure(monkeypatch, failing_eigh):
    """The factored form samples and predicts through Cholesky factors: fit, sample and the GLM predictive never
    eigendecompose; the log-determinant does, once per block, and a LAPACK failure in the factor's dtype is
    retried in float64 (``psd_eigh``) instead of ending the fit."""
    from curvkit.laplace import _blocks

    net, (X, y) = _net(), _data()
    calls: list[int] = []
    real = _blocks.psd_eigh

    def counted(C, previous=None):
        calls.append(C.shape[0])
        return real(C, previous)

    monkeypatch.setattr(_blocks, "psd_eigh", counted)
    post = Laplace(net, CrossEntropy(), "kron", "kflr", prior_precision=0.5).fit((X, y))
    post.sample(3, generator=torch.Generator().manual_seed(0))
    post.predict(X[:4], method="glm")
    assert calls == []
    ref = torch.linalg.slogdet(post.precision().to_dense())[1]
    torch.testing.assert_close(post.log_det_precision(), ref)
    assert len(calls) == 2 * len(post.blocks)
    post.log_det_precision()
    assert len(calls) == 2 * len(post.blocks)  # cached

    failing_eigh("float32")
    net32 = _net().float()
    post32 = Laplace(net32, CrossEntropy(), "kron", "kflr", prior_form="exact").fit((X.float(), y))
    dense = post32.precision().to_dense().double()
    torch.testing.assert_close(post32.log_det_precision().double(), torch.linalg.slogdet(dense)[1], rtol=1e-4,
                               atol=1e-4)


def test_kron_exact_prior_equals_n_kron_plus_identity_and_one_datum_equals_the_exact_block():
    net, (X, y) = _net(), _data(n=1)
    post = Laplace(net, CrossEntropy(), "kron", "kflr", prior_form="exact", prior_precision=0.2).fit((X, y))
    G = dense_ggn(net, CrossEntropy("mean"), (X, y))
    from tests.reference import block_mask

    mask = block_mask(net)  # KFLR on one datum is the exact diagonal GGN block (Lemma 3.21)
    torch.testing.assert_close(post.precision().to_dense(), G * mask + 0.2 * torch.eye(43, dtype=DT))


def test_trace_balancing_splits_the_prior_by_the_trace_ratio():
    net, (X, y) = _net(), _data()
    post = Laplace(net, CrossEntropy(), "kron", "kflr", trace_balance=True, prior_precision=0.3).fit((X, y))
    for blk in post.blocks:
        (b,), ((PG, PA),) = blk.factors, blk.damped(9.0, post.prior_precision)
        pi = math.sqrt((float(b.A.trace()) / b.A.shape[0]) / (float(b.G.trace()) / b.G.shape[0]))
        torch.testing.assert_close(PG - 3 * b.G, math.sqrt(0.3) / pi * torch.eye(b.G.shape[0], dtype=DT))
        torch.testing.assert_close(PA - 3 * b.A, math.sqrt(0.3) * pi * torch.eye(b.A.shape[0], dtype=DT))


def test_kron_sampling_covariance_equals_the_kronecker_inverse():
    lay = nn.Linear(3, 2).to(DT)
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(20, 3, generator=g, dtype=DT), torch.randint(0, 2, (20,), generator=g)
    post = Laplace(lay, CrossEntropy(), "kron", "kflr", prior_precision=0.5).fit((X, y))
    S = 40000
    draws = post.sample(S, generator=torch.Generator().manual_seed(1))
    C = post.covariance().to_dense()
    emp = torch.cov(draws.T)
    # standard error of a sample covariance entry: sqrt((C_ii C_jj + C_ij^2) / S); all 64 entries within 5
    se = ((C.diagonal()[:, None] * C.diagonal()[None, :] + C**2) / S).sqrt()
    assert float(((emp - C).abs() / se).max()) < 5
    torch.testing.assert_close(draws.mean(0), post.mean, atol=float(5 * (C.diagonal().max() / S) ** 0.5), rtol=0)


def _jac_reference(model, names, X):
    p0 = {n: p.detach() for n, p in model.named_parameters()}
    J = jacrev(lambda p: functional_call(model, {**p0, **p}, (X,)))({n: p0[n] for n in names})
    return torch.cat([J[n].reshape(X.shape[0], -1, J[n][0, 0].numel()) for n in names], -1)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(2 * 3 * 3, 3)).to(DT)


def _bn_net():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    with torch.no_grad():
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2.0)
        net[1].weight.uniform_(0.5, 1.5)
    return net.eval()


@pytest.mark.parametrize("model_fn,shape", [(_net, (4,)), (_cnn, (1, 6, 6)), (_bn_net, (4,))])
@pytest.mark.parametrize("structure,form", [("kron", "factored"), ("kron", "exact"), ("diag", "factored"),
                                            ("full", "factored")])
def test_glm_variance_equals_j_sigma_jt_from_a_dense_jacobian(model_fn, shape, structure, form):
    net = model_fn()
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(7, *shape, generator=g, dtype=DT), torch.randint(0, 3, (7,), generator=g)
    post = Laplace(net, CrossEntropy(), structure, "ggn" if structure != "kron" else "kflr", prior_form=form,
                   prior_precision=0.7, norm_structure="full").fit((X, y))
    f, V = post.functional_variance(X, batch_size=3)
    J = _jac_reference(net, post.names, X)
    torch.testing.assert_close(V, torch.einsum("bcd,de,bfe->bcf", J, post.covariance().to_dense(), J))
    torch.testing.assert_close(f, net(X))


def test_conv_kron_factors_come_from_the_kronecker_estimator():
    net = _cnn()
    X, y = torch.randn(6, 1, 6, 6, dtype=DT), torch.randint(0, 3, (6,))
    post = Laplace(net, CrossEntropy(), "kron", "kflr", prior_form="exact", prior_precision=1.0).fit((X, y))
    ref = KroneckerEstimator(net, CrossEntropy("sum"), "kflr").update((X, y)).operator().to_dense()
    torch.testing.assert_close(post.precision().to_dense(), ref + torch.eye(ref.shape[0], dtype=DT))


@pytest.mark.parametrize("norm_structure", ["diag", "full"])
def test_batchnorm_parameters_get_a_per_layer_laplace_from_the_ggn(norm_structure):
    net = _bn_net()
    X, y = torch.randn(8, 4, dtype=DT), torch.randint(0, 3, (8,))
    post = Laplace(net, CrossEntropy(), "kron", "kflr", norm_structure=norm_structure, prior_precision=1.0).fit((X, y))
    names = ["1.weight", "1.bias"]
    ref = GGNOperator(net, CrossEntropy("sum"), (X, y)).block(names).to_dense() + torch.eye(10, dtype=DT)
    got = post.precision().block(names).to_dense()
    torch.testing.assert_close(got, ref if norm_structure == "full" else torch.diag(ref.diagonal()))


def test_last_layer_posterior_is_the_ggn_block_of_the_last_layer():
    net, (X, y) = _net(), _data()
    post = Laplace(net, CrossEntropy(), "full", "ggn", subset="last_layer", prior_precision=0.1).fit((X, y))
    assert post.names == ["2.weight", "2.bias"]
    ref = GGNOperator(net, CrossEntropy("sum"), (X, y)).block(["2.weight", "2.bias"]).to_dense()
    torch.testing.assert_close(post.precision().to_dense(), ref + 0.1 * torch.eye(18, dtype=DT))
    assert all(p.requires_grad for p in net.parameters())  # flags restored after fitting
    kpost = Laplace(net, CrossEntropy(), "kron", "kflr", subset="last_layer").fit((X, y))
    assert kpost.layout.dim == 18 and len(kpost.blocks) == 1


def test_unequal_batches_and_augmented_copies_give_the_same_posterior():
    net, (X, y) = _net(), _data()
    one = Laplace(net, CrossEntropy(), "kron", "kflr").fit((X, y))
    split = Laplace(net, CrossEntropy(), "kron", "kflr").fit([(X[:2], y[:2]), (X[2:7], y[2:7]), (X[7:], y[7:])])
    torch.testing.assert_close(split.precision().to_dense(), one.precision().to_dense())
    # two passes over the data set (a trivially "augmented" data set) with N = data set size
    twice = Laplace(net, CrossEntropy(), "kron", "kflr").fit([(X, y), (X[:4], y[:4]), (X[4:], y[4:])], num_data=9)
    torch.testing.assert_close(twice.precision().to_dense(), one.precision().to_dense())
    assert twice.num_seen == 18 and twice.num_data == 9


def test_log_marginal_likelihood_and_its_optimisation():
    model, X, y, Phi, _P, _m, _evidence, sigma, lam = _blr()
    post = Laplace(model, Gaussian(sigma=sigma), "full", "ggn", prior_precision=lam).fit((X, y))
    n = X.shape[0]

    def closed(l):
        K = sigma**2 * torch.eye(n, dtype=DT) + Phi @ Phi.T / l
        return float(torch.distributions.MultivariateNormal(torch.zeros(n, dtype=DT), K).log_prob(y[:, 0]))

    for l in (0.05, 1.0, 7.0):  # exact at theta* for the prior it was fitted with; Laplace's value elsewhere
        val = post.log_marginal_likelihood(prior_precision=l)
        assert math.isfinite(float(val))
    torch.testing.assert_close(float(post.log_marginal_likelihood(prior_precision=lam)), closed(lam))
    best = optimize_prior_precision(post, steps=300, lr=0.1)
    grid = torch.logspace(-3, 3, 601, dtype=DT)
    vals = torch.stack([post.log_marginal_likelihood(prior_precision=float(v)) for v in grid])
    assert float(post.log_marginal_likelihood()) >= float(vals.max()) - 1e-4
    assert abs(math.log(float(best[0])) - math.log(float(grid[vals.argmax()]))) < 0.03


def test_per_layer_prior_optimisation_improves_the_evidence():
    net, (X, y) = _net(), _data()
    post = Laplace(net, CrossEntropy(), "kron", "kflr", prior_precision=1.0).fit((X, y))
    before = float(post.log_marginal_likelihood())
    lam = optimize_prior_precision(post, per_layer=True, steps=100, lr=0.2)
    assert lam.shape == (2,) and float(post.log_marginal_likelihood()) > before


def test_grid_search_picks_the_lowest_validation_nll_and_sets_it():
    net, (X, y) = _net(), _data()
    Xv, yv = _data(n=6, seed=5)
    post = Laplace(net, CrossEntropy(), "kron", "kflr").fit((X, y))
    res = grid_search(post, (Xv, yv), [9.0, 90.0], [0.1, 1.0, 10.0], method="mc", num_samples=20, seed=0)
    best = min(res["table"], key=lambda r: r[2])
    assert res["best"] == best[:2] and post.num_data == best[0]
    assert float(post.prior_precision[0]) == pytest.approx(best[1])
    gen = torch.Generator().manual_seed(0)
    assert predictive_nll(post, post.predict(Xv, "mc", num_samples=20, generator=gen), yv) == pytest.approx(best[2])


def test_probit_glm_predictive_is_a_distribution_and_bounded_by_the_map():
    net, (X, y) = _net(), _data()
    post = Laplace(net, CrossEntropy(), "kron", "kflr", prior_precision=0.01).fit((X, y))
    p = post.predict(X, "glm")
    torch.testing.assert_close(p.sum(1), torch.ones(9, dtype=DT))
    pm = post.predict(X, "glm", link="mc", num_samples=2000, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(pm.sum(1), torch.ones(9, dtype=DT))
    # the predictive is less confident than the MAP
    assert bool((p.max(1).values <= net(X).softmax(-1).max(1).values + 1e-12).all())


def test_state_dict_round_trip_through_a_checkpoint_file(tmp_path):
    net, (X, y) = _net(), _data()
    post = Laplace(net, CrossEntropy(), "kron", "kfac", mc_samples=2, prior_precision=[0.5, 2.0]).fit((X, y))
    post.num_data = 50.0
    save(post.state_dict(), tmp_path / "post.pt")
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)  # the model moved on; the posterior keeps its mean
    other = Laplace(net, CrossEntropy(), "kron", "kfac", mc_samples=2)
    other.load_state_dict(load(tmp_path / "post.pt"))
    torch.testing.assert_close(other.precision().to_dense(), post.precision().to_dense())
    torch.testing.assert_close(other.mean, post.mean)
    a = post.sample(3, torch.Generator().manual_seed(0))
    b = other.sample(3, torch.Generator().manual_seed(0))
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(other.predict(X, "glm"), post.predict(X, "glm"))
    with pytest.raises(ValueError, match="structure"):
        Laplace(net, CrossEntropy(), "diag").load_state_dict(post.state_dict())


def test_clear_errors():
    net, (X, y) = _net(), _data()
    with pytest.raises(ValueError, match="not fitted"):
        Laplace(net, CrossEntropy()).precision()
    with pytest.raises(ValueError, match="prior_precision"):
        Laplace(net, CrossEntropy(), prior_precision=-1.0)
    with pytest.raises(ValueError, match="2 layers"):
        Laplace(net, CrossEntropy(), prior_precision=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="not available for structure 'diag'"):
        Laplace(net, CrossEntropy(), "diag", "kfac")
    with pytest.raises(ValueError, match="not available for structure 'kron'"):
        Laplace(net, CrossEntropy(), "kron", "ggn")
    with pytest.raises(ValueError, match="subset entry"):
        Laplace(net, CrossEntropy(), subset=["nope"])
    post = Laplace(net, CrossEntropy()).fit((X, y))
    with pytest.raises(ValueError, match="NaN"):
        post.predict(torch.full((2, 4), float("nan"), dtype=DT))
    with pytest.raises(ValueError, match="num_data"):
        post.num_data = 0
    emb = nn.Sequential(nn.Linear(4, 4), nn.PReLU(), nn.Linear(4, 3)).to(DT)
    Laplace(emb, CrossEntropy(), "kron").fit((X, y))  # PReLU: the per-sample fallback (layerkinds.generic)
    drop = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 3)).to(DT)
    with pytest.raises(UnsupportedModelError, match=r"model\.eval"):
        Laplace(drop, CrossEntropy(), "kron").fit((X, y))
    with pytest.raises(ValueError, match="NaN or inf"):
        Laplace(net, CrossEntropy()).fit((torch.full((2, 4), float("inf"), dtype=DT), y[:2]))
    tiny = Laplace(nn.Linear(4, 3).to(DT), CrossEntropy(), "kron", "kflr", prior_precision=1e-300).fit((X[:1], y[:1]))
    with pytest.raises(NotPositiveDefiniteError):
        tiny.sample(1)
