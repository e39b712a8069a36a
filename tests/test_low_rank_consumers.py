"""Every consumer of Kronecker curvature takes a low-rank output factor (issue 30, section 3): with the
threshold ``LOW_RANK_OUTPUTS`` lowered, the output layer of a tiny float64 MLP and of a tiny causal LM gets a
:class:`~curvkit.linalg.kron.LowRankFactor`, and GaussNewton (factored and exact inversion, ``'auto'``),
Kronecker Laplace (both prior forms: log-determinant, marginal likelihood, GLM variances, samples' covariance,
state_dict), the continual Kronecker penalty (both memories), KFAC natural gradient and EKFAC equal the same
computation with the dense factor to 1e-10 (EKFAC in a basis from other data: its complement row is the mean
second moment off the factor's span). Refusals that suggest an option name one the caller accepts; a
head just above the real threshold (8,192 outputs) runs through every consumer."""

from __future__ import annotations

import copy
import inspect
import io
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from curvkit.architectures import causal_lm
from curvkit.continual.laplace import LaplacePenalty
from curvkit.curvature import estimators
from curvkit.curvature.ekfac import EKFACEstimator
from curvkit.curvature.estimators import LOW_RANK_OUTPUTS, KroneckerEstimator
from curvkit.laplace import Laplace
from curvkit.likelihoods import CrossEntropy
from curvkit.optim import GaussNewton
from curvkit.optim.natural_gradient import NaturalGradient
from curvkit.structure import UnsupportedModelError

DT = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)
DENSE = 10**9  # a threshold no layer reaches: every output factor dense


def mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A 3-4-12 MLP, 6 samples: the 12-output head's KFAC factor has rank <= 6 (a true complement)."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 12)).to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=DT) * 0.5)
    X = torch.randn(6, 3, generator=g, dtype=DT)
    return model, X, torch.randint(0, 12, (6,), generator=g)


def lm() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A one-block causal LM over 40 tokens, 3 x 6 tokens (the head: 40 outputs, rank <= 18)."""
    model = causal_lm(vocab_size=40, max_len=6, dim=8, depth=1, heads=2, mlp_dim=16, seed=0, dtype=DT)
    ids = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(0))
    return model, ids[:, :-1], ids[:, 1:]


MODELS = {"mlp": (mlp, 8), "lm": (lm, 32)}


def both(monkeypatch: pytest.MonkeyPatch, which: str, run: Callable[[nn.Module, Any, Any], Any]) -> tuple[Any, Any]:
    """``run`` on fresh copies of the model with the low-rank head and with every factor dense."""
    make, threshold = MODELS[which]
    out = []
    for t in (threshold, DENSE):
        monkeypatch.setattr(estimators, "LOW_RANK_OUTPUTS", t)
        model, X, y = make()
        out.append(run(model, X, y))
    return out[0], out[1]


def close(a: Any, b: Any) -> None:
    torch.testing.assert_close(a, b, **TOL)  # type: ignore[arg-type]


@pytest.mark.parametrize("which", ["mlp", "lm"])
@pytest.mark.parametrize("inversion", ["factored", "eigen"])
def test_gauss_newton_steps_equal_the_dense_factor(monkeypatch: pytest.MonkeyPatch, which: str, inversion: str) -> None:
    def run(model: nn.Module, X: Any, y: Any) -> list[torch.Tensor]:
        opt = GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy(), curvature="kfac",
                          inversion=inversion, zeta=0.1, tau_every=1, zeta_every=2)  # type: ignore[arg-type]
        for _ in range(3):
            opt.step(batch=(X, y))
        flags = [b.low_rank_output for b in opt.estimator.operator().blocks]
        return [p.detach().clone() for p in model.parameters()] + [torch.tensor(float(any(flags)))]

    low, dense = both(monkeypatch, which, run)
    assert float(low[-1]) == 1.0 and float(dense[-1]) == 0.0
    for a, b in zip(low[:-1], dense[:-1]):
        close(a, b)


def test_gauss_newton_auto_takes_kfac_for_a_wide_head(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(estimators, "LOW_RANK_OUTPUTS", 8)
    model, X, y = mlp()  # an MLP chain: KFRA otherwise
    opt = GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy())
    opt.step(batch=(X, y))
    assert opt.source == "kfac" and "more than 8 outputs" in opt.source_reason
    assert any(b.low_rank_output for b in opt.estimator.operator().blocks)
    monkeypatch.setattr(estimators, "LOW_RANK_OUTPUTS", DENSE)
    model, X, y = mlp()
    opt = GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy())
    opt.step(batch=(X, y))
    assert opt.source == "kfra"


def _laplace_quantities(form: str) -> Callable[[nn.Module, Any, Any], dict[str, Any]]:
    def run(model: nn.Module, X: Any, y: Any) -> dict[str, Any]:
        post = Laplace(model, CrossEntropy(), "kron", "kfac", prior_form=form, prior_precision=0.7, seed=3)
        post.fit([(X, y)])
        _, var = post.functional_variance(X, diagonal=True)
        _, cov = post.functional_variance(X[:2])
        out = {"lml": post.log_marginal_likelihood(), "logdet": post.log_det_precision(num_data=5.0,
                                                                                        prior_precision=0.3),
               "var": var, "cov": cov, "probit": post.predict(X, link="probit"),
               "covariance": post.covariance().to_dense(), "precision": post.precision().to_dense()}
        buf = io.BytesIO()
        torch.save(post.state_dict(), buf)
        buf.seek(0)
        again = Laplace(model, CrossEntropy(), "kron", "kfac", prior_form=form, prior_precision=0.7, seed=3)
        again.load_state_dict(torch.load(buf, weights_only=True))
        out["reloaded_lml"] = again.log_marginal_likelihood()
        out["low"] = any(b.low_rank_output for blk in post.blocks for b in getattr(blk, "factors", []))
        return out

    return run


@pytest.mark.parametrize("which", ["mlp", "lm"])
@pytest.mark.parametrize("form", ["factored", "exact"])
def test_kronecker_laplace_equals_the_dense_factor(monkeypatch: pytest.MonkeyPatch, which: str, form: str) -> None:
    low, dense = both(monkeypatch, which, _laplace_quantities(form))
    assert low["low"] and not dense["low"]
    for key in ("lml", "logdet", "var", "cov", "probit", "covariance", "precision", "reloaded_lml"):
        close(low[key], dense[key])
    close(low["reloaded_lml"], low["lml"])


@pytest.mark.parametrize("form", ["factored", "exact"])
def test_laplace_samples_have_the_posterior_covariance(monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    """The sampler is linear in its standard normal draws: fed the unit vectors, its draws are the columns of
    a square root S of the covariance, so S S^T must equal the (dense-factor) covariance exactly."""
    monkeypatch.setattr(estimators, "LOW_RANK_OUTPUTS", 8)
    model, X, y = mlp()
    post = Laplace(model, CrossEntropy(), "kron", "kfac", subset=["2.weight", "2.bias"], prior_form=form,
                   prior_precision=0.7).fit([(X, y)])
    assert post.blocks[0].factors[0].low_rank_output  # type: ignore[attr-defined]
    d = post.layout.dim
    real = torch.randn

    def unit(*shape: int, **kw: Any) -> torch.Tensor:
        if shape and shape[0] == d:
            return torch.eye(d, dtype=kw.get("dtype"), device=kw.get("device")).reshape(d, *shape[1:])
        return real(*shape, **kw)

    monkeypatch.setattr(torch, "randn", unit)
    S = post.sample(d) - post.mean
    monkeypatch.setattr(torch, "randn", real)
    monkeypatch.setattr(estimators, "LOW_RANK_OUTPUTS", DENSE)
    model, X, y = mlp()
    ref = Laplace(model, CrossEntropy(), "kron", "kfac", subset=["2.weight", "2.bias"], prior_form=form,
                  prior_precision=0.7).fit([(X, y)])
    close(S.T @ S, ref.covariance().to_dense())
    probs = post.predict(X, method="mc", num_samples=4, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(probs).all() and probs.shape == (6, 12)


def test_laplace_default_curvature_takes_kfac_for_a_wide_head(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(estimators, "LOW_RANK_OUTPUTS", 8)
    model, X, y = mlp()
    post = Laplace(model, CrossEntropy(), "kron").fit([(X, y)])
    assert post.curvature == "kfac" and torch.isfinite(post.log_marginal_likelihood())
    assert Laplace(model, CrossEntropy(), "kron", subset=["0.weight", "0.bias"]).curvature == "kflr"


@pytest.mark.parametrize("which", ["mlp", "lm"])
@pytest.mark.parametrize("memory", ["per_task", "summed"])
def test_continual_kronecker_penalty_equals_the_dense_factor(monkeypatch: pytest.MonkeyPatch, which: str,
                                                             memory: str) -> None:
    def run(model: nn.Module, X: Any, y: Any) -> list[Any]:
        pen = LaplacePenalty(structure="kron", curvature="kfac", memory=memory, task_size=6, prior_precision=0.1)  # type: ignore[arg-type]
        pen.consolidate(model, [(X, y)])
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.sin(torch.arange(p.numel(), dtype=DT)).reshape(p.shape))
        pen.consolidate(model, [(X[1:], y[1:])])
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.1)
        loss = pen.loss(model)
        auto = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
        low = any("GR" in s for s in pen.store.values())
        return [loss.detach(), *pen.gradient(model), *auto, torch.tensor(pen.curvature_bound()), low]

    low, dense = both(monkeypatch, which, run)
    assert low[-1] and not dense[-1]
    for a, b in zip(low[:-1], dense[:-1]):
        close(a, b)


@pytest.mark.parametrize("which", ["mlp", "lm"])
@pytest.mark.parametrize("inverse", ["factored", "eigen"])
def test_kfac_natural_gradient_equals_the_dense_factor(monkeypatch: pytest.MonkeyPatch, which: str,
                                                       inverse: str) -> None:
    def run(model: nn.Module, X: Any, y: Any) -> list[torch.Tensor]:
        opt = NaturalGradient(model.parameters(), model=model, likelihood=CrossEntropy(), curvature="kfac", lr=0.1,
                              inversion=inverse)  # type: ignore[arg-type]
        for _ in range(2):
            opt.zero_grad()
            CrossEntropy()(model(X), y).backward()
            opt.step(batch=(X, y))
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(*both(monkeypatch, which, run)):
        close(a, b)


@pytest.mark.parametrize("which", ["mlp", "lm"])
def test_ekfac_equals_the_dense_factor(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """In the basis of the batch's own KFAC factors every per-sample row lies in span(QG): the complement row is
    0 and the operator equals EKFAC with the dense factor (whose null-space scalings are 0 too)."""
    def run(model: nn.Module, X: Any, y: Any) -> tuple[torch.Tensor, torch.Tensor, bool]:
        E = EKFACEstimator(model, CrossEntropy(), "kfac", seed=1).update((X, y)).operator()
        v = torch.randn(E.shape[0], 3, generator=torch.Generator().manual_seed(4), dtype=DT)
        low = any(e.G_rest for e in E._eigh)
        return E @ v, E.inverse(damping=0.3) @ v, low

    low, dense = both(monkeypatch, which, run)
    assert low[2] and not dense[2]
    close(low[0], dense[0])
    close(low[1], dense[1])


def test_ekfac_complement_row_is_the_mean_second_moment_off_the_span(monkeypatch: pytest.MonkeyPatch) -> None:
    """A basis from other data: along QG the scalings are the exact second moments (as for a dense factor), and
    the complement row is, per input direction j, sum_n sum_v w_v ||(I - QG QG^T) dW_{n,v} QA[:, j]||^2 / G_rest,
    computed here from dense per-sample gradients."""
    monkeypatch.setattr(estimators, "LOW_RANK_OUTPUTS", 8)
    model, X, y = mlp()
    lik = CrossEntropy("sum")
    basis = KroneckerEstimator(model, lik, "kfac", seed=7).update((X[:3], y[:3])).operator()
    est = EKFACEstimator(model, lik, "kfac", seed=1, basis=basis)
    E = est.update((X[3:], y[3:])).operator()
    e, spectrum = E._eigh[-1], E._spectra[-1]
    assert e.G_rest == 12 - e.G_eigvals.numel() > 0 and spectrum.shape[0] == e.G_eigvals.numel() + 1
    ps = est.vectors.per_sample[est.vectors.blocks[-1][1].label]
    dW = torch.einsum("vbro,bri->vboi", ps.vectors, ps.inputs)  # (V, B, out, in_aug) per-sample gradients
    U, QA = e.G_eigvecs, e.A_eigvecs
    along = torch.einsum("v,vboi->oi", ps.weights, (U.T @ dW @ QA).square())
    off = torch.einsum("v,vboi->i", ps.weights, ((dW - U @ (U.T @ dW)) @ QA).square()) / e.G_rest
    close(spectrum, torch.cat([along, off[None]]) * est.scale() / est.num_data)  # sum: the data's sum
    assert float(off.min()) > 0  # other data: the rows leave the basis's span


# ---------------------------------------------------------------------------------------------- refusals
def _accepted(obj: Any) -> set[str]:
    target = obj.__init__ if isinstance(obj, type) else obj
    return set(inspect.signature(target).parameters)


REFUSED = {  # what a caller writes with KFLR/KFRA on a wide head, and whose keywords the refusal may name
    "GaussNewton": (lambda m, X, y: GaussNewton(m.parameters(), model=m, likelihood=CrossEntropy(),
                                                curvature="kflr"), GaussNewton),
    "Laplace": (lambda m, X, y: Laplace(m, CrossEntropy(), "kron", "kflr"), Laplace),
    "LaplacePenalty": (lambda m, X, y: LaplacePenalty(structure="kron", curvature="kflr", task_size=6).consolidate(
        m, [(X, y)]), LaplacePenalty),
    "EKFACEstimator(kflr)": (lambda m, X, y: EKFACEstimator(m, CrossEntropy(), "kflr"), EKFACEstimator),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refusals_name_only_options_the_caller_accepts(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(estimators, "LOW_RANK_OUTPUTS", 8)
    model, X, y = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    build, caller = REFUSED[name]
    with pytest.raises(UnsupportedModelError) as err:
        build(model, X, y)
    msg = str(err.value)
    assert "module '2' (Linear)" in msg and "12 outputs" in msg
    named = set(re.findall(r"(\w+)='", msg.split(";", 1)[1]))  # the options the fix names
    assert named <= _accepted(caller), (named, msg)
    assert named
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# ---------------------------------------------------------------------------------------------- a real wide head
def test_a_head_above_the_real_threshold_runs_through_every_consumer() -> None:
    wide = LOW_RANK_OUTPUTS + 8
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, wide))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    X, y = torch.randn(6, 3, generator=g), torch.randint(0, wide, (6,), generator=g)
    m = copy.deepcopy(model)
    gn = GaussNewton(m.parameters(), model=m, likelihood=CrossEntropy())
    assert torch.isfinite(torch.as_tensor(gn.step(batch=(X, y)))) and gn.source == "kfac"
    post = Laplace(model, CrossEntropy(), "kron").fit([(X, y)])
    assert post.curvature == "kfac" and torch.isfinite(post.log_marginal_likelihood())
    probs = post.predict(X)
    assert probs.shape == (6, wide) and torch.isfinite(probs).all()
    assert torch.isfinite(post.sample(2)).all()
    pen = LaplacePenalty(structure="kron", task_size=6)
    pen.consolidate(model, [(X, y)])
    assert torch.isfinite(pen.loss(model))
    m = copy.deepcopy(model)
    ng = NaturalGradient(m.parameters(), model=m, likelihood=CrossEntropy(), curvature="kfac")
    CrossEntropy()(m(X), y).backward()
    ng.step(batch=(X, y))
    assert all(torch.isfinite(p).all() for p in m.parameters())
    E = EKFACEstimator(model, CrossEntropy(), "kfac").update((X, y)).operator()
    assert E._eigh[-1].G_rest > 0 and torch.isfinite(E.inverse(damping=0.1) @ torch.ones(E.shape[0])).all()
