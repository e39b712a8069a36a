"""``torch.compile``d models (issue 31, item 4): every entry point takes the compiled model, before or after it
has run, and gives the uncompiled model's numbers (float32, atol 0: the curvature passes run the module it
compiles, ``_orig_mod``), with the same parameter names and the same automatic choices; the compiled model
stays the one that trains (a Gauss-Newton closure calling it, and its own forward after curvkit's steps).
Backend ``eager`` here; ``aot_eager`` is ``slow``; one ``inductor`` test."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from curvkit.curvature import GGNOperator, HessianOperator, piecewise_linear_reason
from curvkit.curvature.estimators import DiagonalEstimator
from curvkit.curvature.kronecker import kfac
from curvkit.laplace import Laplace
from curvkit.likelihoods import CrossEntropy
from curvkit.optim.second_order.gauss_newton import GaussNewton

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def entry_points(model, batch, full: bool = True):
    lik = CrossEntropy()
    v = torch.randn(51, generator=torch.Generator().manual_seed(3))
    G = GGNOperator(model, lik, batch)
    out = {"ggn@v": G @ v, "ggn_diag": G.diagonal().flat, "names": G.layout.names,
           "kfac": kfac(model, lik, batch).to_dense()}
    if full:
        out["hessian@v"] = HessianOperator(model, lik, batch) @ v
        out["diag_est"] = DiagonalEstimator(model, lik).update(batch).operator().flat
        out["piecewise"] = piecewise_linear_reason(model)
        for structure in ("diag", "kron"):
            la = Laplace(model, lik, structure=structure).fit(batch)
            out[f"laplace_{structure}"] = (la.log_marginal_likelihood(), la.predict(batch[0]), la.names)
    return out


def gauss_newton(model, batch):
    opt = GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy())
    losses = [opt.step(batch=batch) for _ in range(2)]
    return opt.source, losses, opt.param_names()


def assert_same(got, ref):
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, atol=0, rtol=0, msg=key)
        elif isinstance(value, tuple):
            for a, b in zip(got[key], value):
                torch.testing.assert_close(a, b, atol=0, rtol=0, msg=key) if isinstance(b, torch.Tensor) else None
                assert isinstance(b, torch.Tensor) or a == b, key
        else:
            assert got[key] == value, key


def check_backend(backend: str, full: bool = True):
    batch = data()
    ref = entry_points(mlp(), batch, full)
    for has_run in (False, True):
        model = mlp()
        compiled = torch.compile(model, backend=backend)
        if has_run:
            compiled(batch[0])
        assert_same(entry_points(compiled, batch, full), ref)
    plain = mlp()
    source, losses, names = gauss_newton(plain, batch)
    model = mlp()
    compiled = torch.compile(model, backend=backend)
    compiled(batch[0])
    assert gauss_newton(compiled, batch) == (source, losses, names)  # 'auto' picks as for the plain model
    torch.testing.assert_close(flat(model), flat(plain), atol=0, rtol=0)
    torch.testing.assert_close(compiled(batch[0]), plain(batch[0]))  # the compiled model has the new weights


def test_compiled_eager_backend_every_entry_point():
    check_backend("eager")


@pytest.mark.slow
def test_compiled_aot_eager_backend_every_entry_point():
    check_backend("aot_eager")


def test_compiled_inductor_backend():
    check_backend("inductor", full=False)


def test_gauss_newton_closure_trains_the_compiled_model():
    """The closure calls the compiled model (the user's training pass); the steps equal the uncompiled ones."""
    batch, lik = data(), CrossEntropy()
    results = []
    for compile_it in (False, True):
        model = mlp()
        run = torch.compile(model, backend="eager") if compile_it else model
        opt = GaussNewton(run.parameters(), model=run, likelihood=lik)

        def closure(opt=opt, run=run):
            opt.zero_grad()
            loss = lik(run(batch[0]), batch[1])
            loss.backward()
            return loss

        losses = [float(opt.step(closure)) for _ in range(2)]
        results.append((losses, flat(model)))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-6, rtol=1e-6)


def test_compiled_gpt2_through_the_adapter():
    """A tiny GPT-2: compiled inside the adapter and the adapter compiled, GGN products equal the plain ones."""
    test_hf = pytest.importorskip("test_hf")
    from curvkit.hf import HuggingFace

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        X, y = test_hf.lm_batch(seed=2)
        lik = CrossEntropy("mean", ignore_index=-100)
        ref = GGNOperator(HuggingFace(test_hf.gpt2(seed=1)), lik, (X, y))
        v = torch.randn(ref.layout.dim, generator=torch.Generator().manual_seed(3))
        for wrap in (lambda m: HuggingFace(torch.compile(m, backend="eager")),
                     lambda m: torch.compile(HuggingFace(m), backend="eager")):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                G = GGNOperator(wrap(test_hf.gpt2(seed=1)), lik, (X, y))
            assert G.layout.names == ref.layout.names
            torch.testing.assert_close(G @ v, ref @ v, atol=1e-12, rtol=0)
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("curvature", ["kron", "diag"])
def test_continual_laplace_penalty_takes_the_compiled_model(curvature):
    from curvkit.continual.laplace import LaplacePenalty

    batch, out = data(), []
    for compile_it in (False, True):
        model = mlp()
        run = torch.compile(model, backend="eager") if compile_it else model
        penalty = LaplacePenalty(structure=curvature, task_size=8)
        penalty.on_task_end(run, batch)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1)
        out.append((penalty.loss(run), penalty.gradient(run)))
    torch.testing.assert_close(out[1][0], out[0][0], atol=0, rtol=0)
    for a, b in zip(out[1][1], out[0][1]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_llc_hessian_trace_and_mesu_take_the_compiled_model():
    from curvkit.optim import MESU
    from curvkit.slt.hessian import hessian_trace_estimate as hessian_trace
    from curvkit.slt.llc import estimate_llc

    batch, out = data(), []
    for compile_it in (False, True):
        model, trained = mlp(), mlp()
        run, run_trained = ((torch.compile(m, backend="eager") for m in (model, trained)) if compile_it
                            else (model, trained))
        opt = MESU(run_trained.parameters(), model=run_trained, loss_fn=CrossEntropy("sum"), mc_samples=2, seed=0)
        opt.step(batch=batch)
        out.append((estimate_llc(run, batch, batch_size=4, seed=0).llc_mean,
                    hessian_trace(run, CrossEntropy(), batch).value, flat(trained)))
    assert out[1][:2] == out[0][:2]
    torch.testing.assert_close(out[1][2], out[0][2], atol=0, rtol=0)
