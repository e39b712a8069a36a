"""Every curvature entry point under every grad mode (issue 31, item 1): inside ``torch.inference_mode()``, with
inputs created inside it, the exact operators' products, diagonals and eigenvalues, the estimators, kfac,
Laplace (diag and Kronecker: fit, predictives, prior selection) and the Gauss-Newton step give the numbers of
the same calls in normal mode (float64, atol 1e-12), and the caller's mode is left as it was."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

from curvkit.curvature import EmpiricalFisherOperator, FisherOperator, GGNOperator, HessianOperator
from curvkit.curvature.estimators import DiagonalEstimator, KroneckerEstimator
from curvkit.curvature.kronecker import kfac
from curvkit.laplace import Laplace
from curvkit.laplace.selection import optimize_prior_precision
from curvkit.likelihoods import CrossEntropy
from curvkit.optim.second_order.gauss_newton import GaussNewton

D64 = torch.float64
ATOL = 1e-12
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(D64)


class Residual(nn.Module):  # not a plain Sequential: the forward-mode tangent route
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x + torch.tanh(self.a(x)))


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g, dtype=D64), torch.randint(0, 3, (8,), generator=g)


def made_inside(mode, X, y):
    """Copies of X, y created inside ``mode`` (inference tensors under inference mode)."""
    with mode():
        return X.clone(), y.clone()


def close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls", [GGNOperator, FisherOperator, EmpiricalFisherOperator, HessianOperator])
@pytest.mark.parametrize("model", [net, lambda: Residual().to(D64)], ids=["sequential", "residual"])
def test_exact_operators_equal_normal_mode(mode, cls, model):
    m, (X, y), lik = model(), data(), CrossEntropy("mean")
    ref = cls(m, lik, (X, y))
    v = torch.randn(ref.layout.dim, dtype=D64, generator=torch.Generator().manual_seed(2))
    Xi, yi = made_inside(MODES[mode], X, y)
    with MODES[mode]():
        op = cls(m, lik, (Xi, yi))
        vi = v.clone()
        close(op @ vi, ref @ v)
        close(ref @ vi, ref @ v)  # built outside, used inside
        close(op.diagonal().flat, ref.diagonal().flat)
        close(op.eigenvalues(2), ref.eigenvalues(2))
        close(op.quadratic_form(vi) if hasattr(op, "quadratic_form") else op.trace(), ref.quadratic_form(v)
              if hasattr(ref, "quadratic_form") else ref.trace())
        assert torch.is_inference_mode_enabled() == (mode == "inference_mode")
        assert not torch.is_grad_enabled()


@pytest.mark.parametrize("mode", MODES)
def test_estimators_laplace_and_gauss_newton_equal_normal_mode(mode):
    m, (X, y), lik = net(), data(), CrossEntropy("mean")
    Xi, yi = made_inside(MODES[mode], X, y)
    ctx = MODES[mode]

    def run(X, y, ctx):
        out = {}
        m2 = copy.deepcopy(m)
        with ctx():
            out["diag_est"] = DiagonalEstimator(m, lik).update((X, y)).operator().flat
            out["kfac"] = kfac(m, lik, (X, y)).to_dense()
            out["kflr"] = KroneckerEstimator(m, lik, "kflr").update((X, y)).operator().to_dense()
            for structure in ("diag", "kron"):
                la = Laplace(m, lik, structure=structure).fit((X, y))
                out[f"{structure}_lml"] = la.log_marginal_likelihood()
                out[f"{structure}_glm"] = la.predict(X, method="glm")
                out[f"{structure}_mc"] = la.predict(X, method="mc", generator=torch.Generator().manual_seed(0))
                out[f"{structure}_prior"] = optimize_prior_precision(la, steps=3)
            opt = GaussNewton(m2.parameters(), model=m2, likelihood=lik)
            out["gn_loss"] = opt.step(batch=(X, y))
            out["gn_params"] = torch.cat([p.detach().reshape(-1) for p in m2.parameters()])
        return out

    ref = run(X, y, contextlib.nullcontext)
    got = run(Xi, yi, ctx)
    for key, value in ref.items():
        close(got[key], value)


def test_own_forward_without_autograd_is_named():
    """A capture around a forward pass the user runs without autograd says so (not only 'called 0 times')."""
    m, (X, y), lik = net(), data(), CrossEntropy("mean")
    est = KroneckerEstimator(m, lik, "kfac")
    with torch.inference_mode(), est.capture() as cap:
        f = m(X)
    with pytest.raises(ValueError, match=r"called 0 times.*autograd"):
        est.accumulate(cap, f, y)


def test_model_built_inside_inference_mode_is_refused():
    with torch.inference_mode():
        m = net()
    X, y = data()
    for build in (lambda: GGNOperator(m, CrossEntropy(), (X, y)), lambda: KroneckerEstimator(m, CrossEntropy())):
        with pytest.raises(ValueError, match=r"created inside torch\.inference_mode"):
            build()


def test_gpt2_under_inference_mode():
    """A tiny GPT-2 (transformers) under inference mode: GGN products and diagonal, kfac."""
    test_hf = pytest.importorskip("test_hf")
    from curvkit.hf import HuggingFace

    old = torch.get_default_dtype()
    torch.set_default_dtype(D64)
    try:
        hf = HuggingFace(test_hf.gpt2(seed=1))
        X, y = test_hf.lm_batch(seed=2)
        lik = CrossEntropy("mean", ignore_index=-100)
        ref = GGNOperator(hf, lik, (X, y))
        v = torch.randn(ref.layout.dim, dtype=D64, generator=torch.Generator().manual_seed(3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_diag, ref_k = ref.diagonal().flat, kfac(hf, lik, (X, y)).to_dense()
            with torch.inference_mode():
                Xi, yi = {k: t.clone() for k, t in X.items()}, y.clone()
                op = GGNOperator(hf, lik, (Xi, yi))
                close(op @ v, ref @ v)
                close(op.diagonal().flat, ref_diag)
                close(kfac(hf, lik, (Xi, yi)).to_dense(), ref_k)
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("mode", MODES)
def test_other_entry_points_equal_normal_mode(mode):
    """EKFAC, MESU's step, the SLT Hessian trace and LLC, and the continual penalties (their curvature passes)."""
    from curvkit.continual.laplace import LaplacePenalty
    from curvkit.continual.penalties import EWC
    from curvkit.curvature.ekfac import EKFACEstimator
    from curvkit.optim import MESU
    from curvkit.slt.hessian import hessian_trace_estimate as hessian_trace
    from curvkit.slt.llc import estimate_llc

    (X, y), lik = data(), CrossEntropy("mean")
    Xi, yi = made_inside(MODES[mode], X, y)

    def run(X, y, ctx):
        m, trained, other = net(), net(), net(seed=1)
        out = {}
        with ctx():
            out["ekfac"] = EKFACEstimator(m, lik).update((X, y)).operator().to_dense()
            opt = MESU(trained.parameters(), model=trained, loss_fn=CrossEntropy("sum"), mc_samples=2, seed=0)
            opt.step(batch=(X, y))
            out["mesu"] = torch.cat([p.detach().reshape(-1) for p in trained.parameters()])
            out["hessian_trace"] = torch.as_tensor(hessian_trace(m, lik, (X, y)).value)
            out["llc"] = torch.as_tensor(estimate_llc(m, (X, y), batch_size=8, seed=0).llc_mean)
            for name, penalty in (("laplace", LaplacePenalty(structure="kron", task_size=8)), ("ewc", EWC(1.0))):
                penalty.on_task_end(m, (X, y))
                out[name] = penalty.loss(other).detach()
        return out

    ref, got = run(X, y, contextlib.nullcontext), run(Xi, yi, MODES[mode])
    for key, value in ref.items():
        close(got[key], value)
