"""One vocabulary (issue 32): every public entry point that gathers Kronecker statistics takes the options of
:class:`curvkit.curvature.CurvatureConfig` under the same names with the same defaults (read from their
signatures), the function forms take the classes' options, and a Kronecker Laplace posterior with default
settings is ``N x`` the estimator's per-datum curvature plus the prior."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch
from torch import nn

from curvkit.continual import LaplacePenalty
from curvkit.curvature import CurvatureConfig, EKFACEstimator, KroneckerEstimator, kfac, kflr
from curvkit.laplace import Laplace
from curvkit.likelihoods import CrossEntropy
from curvkit.optim.second_order.gauss_newton import GaussNewton

D64 = torch.float64

#: every public entry point that builds Kronecker statistics, and the options it does not take (with why)
ENTRY_POINTS = {
    KroneckerEstimator: set(),
    EKFACEstimator: {"batch_statistics", "output_factor"},  # per-sample rows: dense factors, one coupled batch no
    GaussNewton: {"output_factor"},  # factorises G itself: dense output factors only (refused otherwise)
    Laplace: {"batch_statistics", "output_factor", "distribution"},  # eval mode; dense G; no projections' choice
    LaplacePenalty: {"batch_statistics", "output_factor", "distribution"},  # eval mode; dense G
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS), ids=lambda e: e.__name__)
def test_shared_options_have_one_name_and_one_default(entry):
    params = inspect.signature(entry.__init__).parameters
    defaults = CurvatureConfig.defaults()
    missing = [n for n in CurvatureConfig.names() if n not in params and n not in ENTRY_POINTS[entry]]
    assert not missing, f"{entry.__name__} lacks the options {missing}"
    for name, default in defaults.items():
        if name in params:
            assert params[name].default == default, (f"{entry.__name__}({name}=...) defaults to "
                                                     f"{params[name].default!r}, CurvatureConfig to {default!r}")
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, f"{entry.__name__}: {name} is keyword-only"
    # no entry point re-declares an option under another name of the same idea
    for old in ("fisher", "kind", "method_options", "norm", "sharing"):
        assert old not in params


def test_config_validates_once_with_one_wording():
    for name, bad in (("weight_sharing", "mean"), ("norm_structure", "block"), ("output_factor", "thin"),
                      ("batch_statistics", "yes"), ("distribution", "uniform"), ("parameter_structure", "kron")):
        with pytest.raises(ValueError, match=rf"{name} must be one of .*got '{bad}'"):
            CurvatureConfig(**{name: bad})
    with pytest.raises(ValueError, match="mc_samples"):
        CurvatureConfig(mc_samples=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        CurvatureConfig().norm_structure = "diag"  # type: ignore[misc]


def _norm_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3)).to(D64)


def _data(n: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=D64), torch.randint(0, 3, (n,), generator=g)


def test_every_entry_point_hands_its_options_to_the_estimator():
    model, lik = _norm_mlp(), CrossEntropy()
    opts = dict(weight_sharing="reduce", norm_structure="diag", parameter_structure="full", mc_samples=3)
    cfg = CurvatureConfig(**opts)
    assert KroneckerEstimator(model, lik, "kflr", **opts).config == cfg
    assert KroneckerEstimator(model, lik, "kflr", config=cfg).config == cfg
    assert EKFACEstimator(model, lik, config=cfg).config == cfg
    gn = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature="kflr", **opts)
    assert gn.estimator.config == cfg
    post = Laplace(model, lik, "kron", **opts)
    assert post._kron_source(post.names).estimator.config == cfg
    pen = LaplacePenalty(reduction="sum", **opts)
    assert pen.config == cfg
    with pytest.raises(ValueError, match="differ from config"):
        KroneckerEstimator(model, lik, "kflr", config=cfg, weight_sharing="expand", norm_structure="full",
                           mc_samples=2)


def test_function_forms_take_the_classes_options():
    model, lik = _norm_mlp(), CrossEntropy()
    X, y = _data()
    for options in (dict(weight_sharing="reduce"), dict(norm_structure="diag"),
                    dict(config=CurvatureConfig(norm_structure="diag"))):
        got = kflr(model, lik, (X, y), **options).to_dense()
        ref = KroneckerEstimator(model, lik, "kflr", **options).update((X, y)).operator().to_dense()
        torch.testing.assert_close(got, ref, atol=0, rtol=0)
    diag = kflr(model, lik, (X, y), norm_structure="diag").to_dense()
    full = kflr(model, lik, (X, y)).to_dense()
    assert not torch.allclose(diag, full)  # the option takes effect (LayerNorm's block)
    got = kfac(model, lik, (X, y), mc_samples=2, seed=4, output_factor="dense").to_dense()
    ref = KroneckerEstimator(model, lik, "kfac", mc_samples=2, seed=4).update((X, y)).operator().to_dense()
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_kronecker_laplace_with_defaults_is_n_times_kflr_plus_the_prior():
    """The issue's 2-17 % difference came from Laplace's norm_structure='diag' against the estimator's 'full':
    with one default the exact-prior Kronecker precision is the estimator's summed curvature plus lam I (float64,
    a model with a LayerNorm block; tolerance 1e-10)."""
    model, lam = _norm_mlp(), 0.7
    X, y = _data()
    post = Laplace(model, CrossEntropy(), "kron", prior_form="exact", prior_precision=lam).fit([(X[:5], y[:5]),
                                                                                                (X[5:], y[5:])])
    est = KroneckerEstimator(model, CrossEntropy("sum"), "kflr").update((X, y)).operator().to_dense()
    P = post.precision().to_dense()
    torch.testing.assert_close(P, est + lam * torch.eye(P.shape[0], dtype=D64), atol=1e-10, rtol=1e-10)


def test_renamed_and_moved_names():
    from curvkit.slt import TraceEstimate, hessian_trace, hessian_trace_estimate

    model, lik = _norm_mlp(), CrossEntropy()
    X, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        est = hessian_trace_estimate(model, lik, (X, y), method="exact")
    assert isinstance(est, TraceEstimate)
    with pytest.warns(DeprecationWarning, match="hessian_trace_estimate"):
        old = hessian_trace(model, lik, (X, y), method="exact")
    assert isinstance(old, TraceEstimate)
    from curvkit.layerkinds import BATCH_STATISTICS_HINT
    from curvkit.layerkinds import __all__ as kinds

    assert "BATCH_STATISTICS_HINT" in kinds and "batch_statistics='couple'" in BATCH_STATISTICS_HINT


def test_laplace_penalty_speaks_laplaces_words():
    """structure= (kron | diag) and curvature= (the source) as in Laplace; the former curvature='kron' and method=
    keep working for one release with a DeprecationWarning."""
    pen = LaplacePenalty(structure="diag", curvature="mc_fisher", reduction="sum")
    assert (pen.structure, pen.curvature) == ("diag", "mc_fisher")
    assert (LaplacePenalty(reduction="sum").structure, LaplacePenalty(reduction="sum").curvature) == ("kron", "kflr")
    with pytest.warns(DeprecationWarning, match="pass structure='diag'"):
        old = LaplacePenalty(curvature="diag", reduction="sum")
    assert (old.structure, old.curvature) == ("diag", "ggn")
    with pytest.warns(DeprecationWarning, match="renamed curvature="):
        old = LaplacePenalty(structure="kron", method="kfac", reduction="sum")
    assert old.curvature == old.method == "kfac"
    with pytest.raises(ValueError, match="disagree"), pytest.warns(DeprecationWarning):
        LaplacePenalty(curvature="kron", structure="diag", reduction="sum")
    with pytest.raises(ValueError, match="structure must be"):
        LaplacePenalty(structure="full", reduction="sum")  # type: ignore[arg-type]


def test_the_curvature_source_is_named_curvature_everywhere():
    """The estimators name their curvature source ``curvature`` as GaussNewton and Laplace do (issue 32); the
    former ``method=`` keyword still works for one release, with a DeprecationWarning, and means the same."""
    from curvkit.curvature import DiagonalEstimator

    for entry in (KroneckerEstimator, EKFACEstimator, DiagonalEstimator, GaussNewton, Laplace, LaplacePenalty):
        assert "curvature" in inspect.signature(entry.__init__).parameters, entry.__name__
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    data = (torch.randn(5, 3, dtype=D64), torch.randint(0, 2, (5,)))
    lik = CrossEntropy()
    for cls, source in ((KroneckerEstimator, "kflr"), (EKFACEstimator, "kfac"), (DiagonalEstimator, "empirical")):
        new = cls(model, lik, curvature=source).update(data).operator().to_dense()
        with pytest.warns(DeprecationWarning, match=r"method=\.\.\.\) is renamed curvature="):
            old = cls(model, lik, method=source).update(data).operator().to_dense()
        torch.testing.assert_close(old, new, atol=0, rtol=0)
        with pytest.raises(ValueError, match="name one option"), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            cls(model, lik, curvature="projection", method=source)


def test_natural_gradient_speaks_the_same_words():
    """NaturalGradient names its Fisher representation ``curvature`` and its Kronecker damping ``inversion``, as
    GaussNewton does; the former ``fisher=`` / ``kronecker_inverse=`` still work for one release (warned) and
    give the same step."""
    from curvkit.optim import NaturalGradient

    assert {"curvature", "inversion"} <= set(inspect.signature(NaturalGradient.__init__).parameters)
    assert {"curvature", "inversion"} <= set(inspect.signature(GaussNewton.__init__).parameters)
    data = (torch.randn(6, 3, dtype=D64), torch.randint(0, 2, (6,)))
    steps = []
    for kwargs in ({"curvature": "kfac", "inversion": "eigen"}, {"fisher": "kfac", "kronecker_inverse": "eigen"}):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt = NaturalGradient(model.parameters(), model=model, likelihood=CrossEntropy(), lr=0.1, **kwargs)
        assert len([w for w in seen if issubclass(w.category, DeprecationWarning)]) == (2 if "fisher" in kwargs else 0)
        opt.zero_grad()
        CrossEntropy()(model(data[0]), data[1]).backward()
        opt.step(batch=data)
        steps.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(steps[0], steps[1], atol=0, rtol=0)
