"""The damped Gauss-Newton optimiser (thesis ch. 4) on the models the Kronecker engine supports, against dense
float64 references written from the thesis's equations.

Tiny float64 models: a transformer classifier (Embedding, nn.TransformerEncoderLayer), a ViT (raw class token and
position table, MultiheadAttention), a ResNet in eval mode (BatchNorm), a Conv1d tagger (grouped convolution,
GroupNorm, per-time-step outputs with padding) and a LoRA-adapted GPT (frozen base, sequence outputs with
padding). For one step the reference rebuilds, with the SAME block-diagonal curvature (the dense blocks of the
estimator's operator, read through each block's index), the direction d = (G~ + (lambda + zeta) I)^{-1} g
(factored Tikhonov damping, Eq. 4.25, on true Kronecker blocks; exact damping on plain-matrix blocks; or the
exact damped inverse), alpha* = -d^T g / d^T (G + (lambda + tau) I) d with the dense exact GGN (Eqs. 4.17-4.20),
rho (Eq. 4.21), the tau and zeta updates (Sec. 4.4.1, Eq. 4.22). Then: the automatic curvature source, its
state_dict round trip, float32, data-parallel replicas, and bad input.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torch import nn

from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.likelihoods import CrossEntropy
from curvkit.linalg.kron import StridedIndex
from curvkit.linalg.layout import ParamLayout
from curvkit.models import mlp
from curvkit.optim import GaussNewton
from curvkit.optim.second_order.direction import FactoredInverse, split_with_zero_blocks
from curvkit.structure import UnsupportedModelError
from reference import dense_ggn_flat, flat_model, flat_terms
from tiny_models import gen as _gen
from tiny_models import tiny_case as _case

pytestmark = pytest.mark.usefixtures("float64_default")


# ---------------------------------------------------------------------------------------------- references
def _positions(layout: ParamLayout, b) -> torch.Tensor:
    """Flat parameter positions of the block's W_hat entries (row-major), written out from its index."""
    sl = layout.slices()
    shapes = dict(zip(layout.names, layout.shapes))
    w0, wn = sl[b.weight_name].start, math.prod(shapes[b.weight_name])
    if b.index is None:
        out, n = shapes[b.weight_name][0], wn // shapes[b.weight_name][0]
        rows = [[w0 + r * n + c for c in range(n)] + ([sl[b.bias_name].start + r] if b.bias_name else [])
                for r in range(out)]
        return torch.tensor(rows).reshape(-1)
    local = (b.index.materialize() if isinstance(b.index, StridedIndex) else b.index).reshape(-1)
    if b.bias_name is None:
        return w0 + local
    return torch.where(local < wn, w0 + local, sl[b.bias_name].start + local - wn)


def _reference_zeta_step(op, g: torch.Tensor, C: torch.Tensor, wd: float, zeta: float, w: float,
                         exact: bool) -> tuple[float, torch.Tensor, float, float]:
    """The thesis's zeta search (Eq. 4.22): the damped direction d for zeta, w zeta and zeta / w, each with its
    alpha* = -d^T g / d^T C d and predicted change q = -(d^T g)^2 / (2 d^T C d) under the exact damped GGN C;
    returns (best zeta, its d, q, alpha*)."""
    qs = {}
    for z in (zeta, w * zeta, zeta / w):
        d = _dense_direction(op, g, wd + z, exact=exact)
        qs[z] = (d, -0.5 * float(d @ g) ** 2 / float(d @ C @ d))
    best = min(qs, key=lambda z: qs[z][1])
    d, q = qs[best]
    return best, d, q, -float(d @ g) / float(d @ C @ d)


def _dense_direction(op, g: torch.Tensor, delta: float, exact: bool) -> torch.Tensor:
    """(G~ + delta I)^{-1} g, block by block from dense blocks: Eq. 4.25 with the trace-norm omega of Eq. 4.27
    (delta I for a zero block) on true Kronecker blocks, exact damping on plain-matrix blocks (factored=False)
    and with ``exact``."""
    k = math.sqrt(delta)
    out = torch.full_like(g, math.nan)
    for b in op.blocks:
        idx = _positions(op.layout, b)
        G, A = b.G, (torch.diag(b.A) if b.A.dim() == 1 else b.A)
        I_G, I_A = torch.eye(G.shape[0]), torch.eye(A.shape[0])
        if exact or not b.factored:
            M = torch.kron(G, A) + delta * torch.eye(idx.numel())
        elif float(G.trace()) == 0 or float(A.trace()) == 0:
            M = delta * torch.eye(idx.numel())
        else:
            om = math.sqrt((float(A.trace()) / A.shape[0]) / (float(G.trace()) / G.shape[0]))
            M = torch.kron(G + (k / om) * I_G, A + (om * k) * I_A)
        out[idx] = torch.linalg.solve(M, g[idx])
    assert bool(torch.isfinite(out).all())  # every entry belongs to a block
    return out


def _objective(model, lik, X, y, wd):
    """theta -> E(theta) = (mean over counted positions of the per-position losses) + wd/2 |theta|^2 (Eq. 4.12)
    by plain torch (unfused attention), and theta_0."""
    f, theta0 = flat_model(model)

    def E(theta):
        terms, counted = flat_terms(lik, f(theta, X), y)
        return terms.sum() / counted + 0.5 * wd * (theta**2).sum()

    return E, theta0


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


# ---------------------------------------------------------------------------------------------- one step
STEP_CASES = [
    ("transformer", "auto", "factored", {}),
    ("vit", "kflr", "factored", {"parameter_structure": "full"}),
    ("vit", "kfac", "eigen", {"weight_sharing": "reduce", "mc_samples": 2}),
    ("resnet", "auto", "factored", {"norm_structure": "diag"}),
    ("resnet", "kfac", "eigen", {}),
    ("tagger", "auto", "factored", {}),
    ("tagger", "kflr", "eigen", {"weight_sharing": "reduce"}),
    ("lora_gpt", "auto", "factored", {}),
    ("vit", "projection", "factored", {"mc_samples": 2, "distribution": "gaussian"}),
    ("transformer", "projection", "eigen", {"weight_sharing": "reduce"}),
    ("recognised", "auto", "factored", {}),
    ("recognised", "kflr", "eigen", {"norm_structure": "diag"}),
]


@pytest.mark.parametrize(("name", "curvature", "inversion", "options"), STEP_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in STEP_CASES])
def test_one_step_equals_the_dense_reference(name, curvature, inversion, options):
    """theta_1 - theta_0 = alpha* d with d from the dense blocks of the estimator's own curvature, the greedy zeta
    of Eq. 4.22 among {zeta, w zeta, zeta / w}, alpha* and the predicted change from the dense exact GGN, rho of
    Eq. 4.21 from a plain-torch objective, and tau moved by the band rule."""
    model, lik, (X, y) = _case(name)
    wd, tau, zeta, w = 1e-2, 0.3, 0.2, 0.5
    opt = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature=curvature, inversion=inversion,
                      weight_decay=wd, tau=tau, zeta=zeta, tau_every=1, zeta_every=1, omega_zeta=w,
                      omega_tau=0.8, seed=3, **options)
    for key, value in options.items():
        if key in ("weight_sharing", "norm_structure", "parameter_structure"):
            assert getattr(opt.estimator if opt.estimator is not None else opt, key, value) == value
    E, theta0 = _objective(model, lik, X, y, wd)
    th = theta0.clone().requires_grad_()
    E0 = E(th)
    g = torch.autograd.grad(E0, th)[0]
    E0 = E0.detach()
    Gd = dense_ggn_flat(model, lik, (X, y))
    C = Gd + (wd + tau) * torch.eye(g.numel())
    loss = opt.step(batch=(X, y))
    assert float(loss) == pytest.approx(float(E0), rel=1e-12)
    rec = opt.history[-1]
    op = opt.estimator.operator()  # the curvature of this minibatch at theta_0 (ema=None)
    best, d, q, alpha = _reference_zeta_step(op, g, C, wd, zeta, w, exact=inversion == "eigen")
    assert rec["zeta"] == pytest.approx(best) and opt.zeta == pytest.approx(best)
    assert rec["alpha"] == pytest.approx(alpha, rel=1e-8) and alpha < 0
    assert rec["predicted_change"] == pytest.approx(q, rel=1e-8)
    assert torch.allclose(_flat(model) - theta0, alpha * d, atol=1e-12, rtol=1e-8)
    E1 = float(E(_flat(model)))
    rho = (E1 - float(E0)) / q
    assert rec["rho"] == pytest.approx(rho, rel=1e-7, abs=1e-9)
    assert opt.tau == pytest.approx(tau * 0.8 if rho > 0.75 else (tau / 0.8 if rho < 0.25 else tau))
    # curvature() is the damped operator whose inverse gives the direction of this step's zeta
    K = opt.curvature()
    layout = ParamLayout.from_module(model)
    got = layout.flatten(list(K.inverse() @ layout.unflatten(g)))
    assert torch.allclose(got, d, atol=1e-12, rtol=1e-8)


def test_factored_inverse_equals_the_operator_inverse_on_every_block_kind():
    """The Cholesky hot path (blocks read through their index: embedding W^T with a diagonal A, q/k/v row slices,
    convolution groups, (1, P) norm and raw-parameter rows damped exactly) is the operator's own factored
    inverse, and a zero true-Kronecker block gets the delta I limit."""
    for name in ("transformer", "vit", "tagger"):
        model, lik, (X, y) = _case(name)
        op = KroneckerEstimator(model, lik, "kflr").update((X, y)).operator()
        kinds = {("index" if b.index is not None else "std", b.A.dim(), b.factored) for b in op.blocks}
        assert len(kinds) >= 3, kinds
        op, omegas, zero = split_with_zero_blocks(op, "trace")
        names = op.layout.names
        grads = [torch.randn(s, generator=_gen(len(zero) + i)) for i, s in enumerate(op.layout.shapes)]
        fi = FactoredInverse(op, 0.37, omegas).apply(dict(zip(names, grads)))
        ref = op.inverse(0.37, method="factored", pi=omegas) @ grads
        for n, r in zip(names, ref):
            assert torch.allclose(fi[n], r, atol=1e-12, rtol=1e-9), n
    # a zero true-Kronecker block read through an index (a q/k/v slice with G = 0) is damped as delta I
    model, lik, (X, y) = _case("vit")
    op = KroneckerEstimator(model, lik, "kflr").update((X, y)).operator()
    i = next(i for i, b in enumerate(op.blocks) if b.index is not None and b.factored)
    blocks = list(op.blocks)
    blocks[i] = blocks[i].with_factors(torch.zeros_like(blocks[i].G), blocks[i].A)
    op = type(op)(op.layout, blocks)
    op2, omegas, zero = split_with_zero_blocks(op, "trace")
    assert zero == [blocks[i].name] and omegas[i] == 1.0
    grads = dict(zip(op.layout.names, [torch.randn(s, generator=_gen(9)) for s in op.layout.shapes]))
    d = FactoredInverse(op2, 0.1, omegas).apply(grads)
    from curvkit.linalg.kron import block_matrix

    assert torch.allclose(block_matrix(blocks[i], d), block_matrix(blocks[i], grads) / 0.1, atol=1e-12)


def test_closure_equals_batch_with_raw_parameters():
    """step(closure) on the ViT (its class token and position table run as per-sample copies in the captured pass)
    takes the step of step(batch=)."""
    model_a, lik, (X, y) = _case("vit")
    model_b = copy.deepcopy(model_a)
    kw = dict(likelihood=lik, curvature="kfac", tau_every=1, zeta_every=2, seed=7)
    opt_a = GaussNewton(model_a.parameters(), model=model_a, **kw)
    opt_b = GaussNewton(model_b.parameters(), model=model_b, **kw)
    for _ in range(3):
        opt_a.step(batch=(X, y))

        def closure():
            opt_b.zero_grad()
            loss = lik(model_b(X), y)
            loss.backward()
            return loss

        opt_b.step(closure)
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-10)
    assert opt_a.tau == opt_b.tau


def test_float32_step_matches_float64():
    """A float32 step on the transformer equals the float64 step to float32 accuracy."""
    model64, lik, (X, y) = _case("transformer")
    model32 = copy.deepcopy(model64).float()
    steps = {}
    for model in (model64, model32):
        before = _flat(model).double()
        opt = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature="kflr", tau_every=1)
        opt.step(batch=(X, y))
        steps[model is model32] = _flat(model).double() - before
        assert all(p.dtype == next(model.parameters()).dtype for p in model.parameters())
    assert torch.allclose(steps[True], steps[False], rtol=1e-3, atol=1e-5 * float(steps[False].abs().max()))


@pytest.mark.parametrize("name", ["transformer", "vit"])
def test_float32_step_size_rho_and_damping_match_float64(name):
    """On attention models, alpha*, the predicted change, rho and the tau and zeta updates of float32 steps equal
    the float64 ones to float32 accuracy (two steps, rho and the greedy zeta on each)."""
    model64, lik, (X, y) = _case(name)
    model32 = copy.deepcopy(model64).float()
    hist = {}
    for model in (model64, model32):
        Xm = X.to(next(model.parameters()).dtype) if X.is_floating_point() else X
        opt = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature="kflr", tau=0.3, zeta=0.2,
                          tau_every=1, zeta_every=1, omega_zeta=0.5)
        for _ in range(2):
            opt.step(batch=(Xm, y))
        hist[model is model32] = opt.history
        assert all(math.isfinite(r["rho"]) for r in opt.history)
    for r32, r64 in zip(hist[True], hist[False]):
        for key in ("alpha", "predicted_change", "rho", "tau", "zeta", "dCd"):
            assert r32[key] == pytest.approx(r64[key], rel=2e-3, abs=1e-6), key


def test_user_attention_settings_are_restored():
    """The optimiser's passes run with math attention and no fast path; the user's settings stay as they were."""
    model, lik, (X, y) = _case("vit")
    torch.backends.mha.set_fastpath_enabled(True)
    opt = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature="kfac", tau_every=1)
    opt.step(batch=(X, y))
    assert torch.backends.mha.get_fastpath_enabled()


# ---------------------------------------------------------------------------------------------- source rule
def test_default_source_follows_the_model(caplog):
    """curvature='auto': KFRA on an MLP chain with (B, C) outputs; KFLR on other (B, C) models where its C
    backward passes per refresh cost at most KFLR_MAX_EXTRA_PASSES per step more than KFAC's mc_samples
    ((C - mc_samples) / curvature_every <= 1), KFAC beyond that and for outputs with positions; the reason states
    the price; the choice is logged (INFO), kept in state_dict and taken by a resumed optimiser; an explicit
    different source refuses that state."""
    g = _gen(0)
    net = mlp([4, 5, 3], "tanh", dtype=torch.float64, seed=0)
    ten = (torch.randn(6, 4, generator=g), torch.randint(0, 10, (6,), generator=g))

    def ten_classes():
        return mlp([4, 5, 10], "tanh", dtype=torch.float64, seed=0).append(nn.LayerNorm(10))

    cases = [  # (model, batch, options, source, words of the reason)
        (net, (torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)), {}, "kfra", "MLP chain"),
        (*_case("transformer")[::2], {}, "kfac",  # 3 classes: 2 passes per step more than KFAC
         "KFLR costs 3 backward pass(es) per refresh against KFAC's 1, with a refresh every 1 step(s) 2 more per "
         "step than KFAC, against the step's one gradient pass (> 1): KFAC (sampled labels); curvature='kflr'"),
        (*_case("transformer")[::2], {"curvature_every": 2}, "kflr", "every 2 step(s) 1 more per step"),
        (ten_classes(), ten, {"curvature_every": 4}, "kfac", "every 4 step(s) 2.25 more per step"),
        (ten_classes(), ten, {"curvature_every": 10}, "kflr", "every 10 step(s) 0.9 more per step than KFAC, "
         "against the step's one gradient pass (<= 1): KFLR"),
        (ten_classes(), ten, {"curvature_every": 3, "mc_samples": 8}, "kflr", "KFAC's 8"),
        (*_case("lora_gpt")[::2], {"curvature_every": 50}, "kfac", "positions"),
    ]
    for model, batch, options, source, why in cases:
        lik = CrossEntropy(ignore_index=-100)
        opt = GaussNewton(model.parameters(), model=model, likelihood=lik, tau_every=1, **options)
        assert opt.source is None and opt.estimator is None
        with caplog.at_level(logging.INFO, logger="curvkit.optim.second_order.gauss_newton"):
            caplog.clear()
            opt.step(batch=batch)
        assert opt.source == source and why in opt.source_reason, opt.source_reason
        assert any(f"chose {source!r}" in r.getMessage() and why in r.getMessage() for r in caplog.records)
        sd = opt.state_dict()
        assert sd["gauss_newton"]["config"]["curvature"] == source
        resumed_model = copy.deepcopy(model)
        resumed = GaussNewton(resumed_model.parameters(), model=resumed_model, likelihood=lik, tau_every=1, **options)
        resumed.load_state_dict(sd)
        assert resumed.source == source and resumed.estimator.method == source
        other = "kfac" if source != "kfac" else "kflr"
        explicit = GaussNewton(resumed_model.parameters(), model=resumed_model, likelihood=lik, curvature=other,
                               **options)
        with pytest.raises(ValueError, match="state_dict is for"):
            explicit.load_state_dict(sd)
        # the resumed run takes the same steps as the uninterrupted one
        opt.step(batch=batch)
        resumed.step(batch=batch)
        assert torch.equal(_flat(model), _flat(resumed_model))


def test_state_dict_round_trip_on_a_transformer():
    """Stopped after 2 steps and resumed in a fresh optimiser: the same parameters and damping as running on."""
    model_a, lik, (X, y) = _case("vit")
    batches = [(X, y), (X.flip(0), y.flip(0)), (X * 0.5, y), (X, y.flip(0))]
    kw = dict(likelihood=lik, curvature="kfac", ema=0.9, tau_every=1, zeta_every=2, curvature_every=2,
              momentum=True, seed=5, parameter_structure="full")
    model_b = copy.deepcopy(model_a)
    opt_a = GaussNewton(model_a.parameters(), model=model_a, **kw)
    for b in batches:
        opt_a.step(batch=b)
    opt_b = GaussNewton(model_b.parameters(), model=model_b, **kw)
    for b in batches[:2]:
        opt_b.step(batch=b)
    sd, params = copy.deepcopy(opt_b.state_dict()), copy.deepcopy(model_b.state_dict())
    model_c = copy.deepcopy(model_b)
    model_c.load_state_dict(params)
    opt_c = GaussNewton(model_c.parameters(), model=model_c, **kw)
    opt_c.load_state_dict(sd)
    for b in batches[2:]:
        opt_c.step(batch=b)
    assert torch.equal(_flat(model_a), _flat(model_c))
    assert (opt_a.tau, opt_a.zeta) == (opt_c.tau, opt_c.zeta)
    with pytest.raises(ValueError, match="'weight_sharing': 'reduce'"):
        GaussNewton(model_c.parameters(), model=model_c, **{**kw, "weight_sharing": "reduce"}).load_state_dict(sd)


# ---------------------------------------------------------------------------------------------- bad input
def _unchanged(model, opt, before_params, before_state):
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before_params))
    assert opt.num_steps == 0 and opt.history == [] and opt.state_dict()["gauss_newton"]["tau"] == before_state


def test_bad_input_is_refused_and_changes_nothing():
    """Padding without ignore_index (targets out of range), NaN in a batch, a model whose output is not one
    tensor of logits, a tied weight, an unsupported layer: a clear error naming what is wrong, and neither the
    model nor the optimiser changes."""
    model, _, (ids, y) = _case("lora_gpt")
    before = [p.clone() for p in model.parameters()]
    opt = GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy())  # no ignore_index
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 4\] \(padding is not enabled.*ignore_index"):
        opt.step(batch=(ids, y))
    _unchanged(model, opt, before, 1.0)
    assert opt.source is None  # the source is chosen again by the first successful step
    # NaN in the batch
    vit_model, lik, (X, yv) = _case("vit")
    before = [p.clone() for p in vit_model.parameters()]
    opt = GaussNewton(vit_model.parameters(), model=vit_model, likelihood=lik, curvature="kfac")
    Xbad = X.clone()
    Xbad[1, 0, 2, 3] = math.nan
    with pytest.raises(ValueError, match=r"batch X contains NaN or inf \(1 of 80 entries\)"):
        opt.step(batch=(Xbad, yv))
    _unchanged(vit_model, opt, before, 1.0)

    # a Hugging-Face-style output: a tuple (logits, hidden) or a dict
    class TupleOut(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x), x

    wrapped = TupleOut(copy.deepcopy(vit_model))
    for curvature in ("auto", "kfac"):
        opt = GaussNewton(wrapped.parameters(), model=wrapped, likelihood=lik, curvature=curvature)
        with pytest.raises(TypeError, match=r"must return its outputs \(logits\) as one tensor.*got tuple"):
            opt.step(batch=(X, yv))
        assert opt.num_steps == 0
    # a module registered twice: refused at construction, naming the module and the fix (tied weights are taken:
    # tests/test_shared_weights.py)
    lin = nn.Linear(4, 4)  # (an unregistered class such as PReLU is taken: curvkit.layerkinds.generic)
    odd = nn.Sequential(nn.Linear(3, 4), lin, nn.Tanh(), lin)
    with pytest.raises(UnsupportedModelError, match=r"'1' \(Linear\) is registered under 2 names"):
        GaussNewton(odd.parameters(), model=odd, likelihood=CrossEntropy())


def test_probabilities_are_refused_and_the_model_state_is_kept():
    """A model that ends in a softmax (probabilities, not logits) is refused at the first step, naming the fix; a
    refused step leaves parameters, buffers (BatchNorm running statistics), train/eval mode and requires_grad as
    they were."""
    vit_model, lik, (X, y) = _case("vit")

    class Probs(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x).softmax(-1)

    probs = Probs(copy.deepcopy(vit_model))
    opt = GaussNewton(probs.parameters(), model=probs, likelihood=lik, curvature="kfac")
    with pytest.raises(ValueError, match=r"look like probabilities .* remove the final softmax"):
        opt.step(batch=(X, y))
    assert opt.num_steps == 0
    log_probs = Probs(copy.deepcopy(vit_model))
    log_probs.forward = lambda x: torch.log_softmax(log_probs.inner(x), -1)  # log-probabilities are logits
    GaussNewton(log_probs.parameters(), model=log_probs, likelihood=lik, curvature="kfac").step(batch=(X, y))
    model, lik, (X, y) = _case("resnet")
    state = ([p.clone() for p in model.parameters()], [b.clone() for b in model.buffers()], model.training,
             [p.requires_grad for p in model.parameters()])
    opt = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature="kfac")
    for bad in ((X * math.nan, y), (X, y[:-1])):
        with pytest.raises(ValueError, match=r"NaN or inf|one target per example"):
            opt.step(batch=bad)
    opt.step(batch=(X, torch.full_like(y, 2)))  # and a good step changes the parameters only
    assert all(torch.equal(b, c) for b, c in zip(model.buffers(), state[1]))
    assert model.training == state[2] and [p.requires_grad for p in model.parameters()] == state[3]
    assert not all(torch.equal(p, c) for p, c in zip(model.parameters(), state[0]))


def test_model_switched_to_train_mode_after_construction_is_refused_at_the_step():
    """GaussNewton reads the model when it is built; model.train() afterwards turns the ResNet's BatchNorm to
    batch statistics: the next step names the layer and model.eval() (it failed inside torch.func with an
    in-place RuntimeError), and changes nothing; back in eval mode the step runs."""
    model, lik, (X, y) = _case("resnet")
    gn = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature="kfac")
    gn.step(batch=(X, y))
    model.train()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(UnsupportedModelError, match=r"BatchNorm2d\) normalises with batch statistics.*model\.eval\(\)"):
        gn.step(batch=(X, y))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert gn.num_steps == 1
    model.eval()
    gn.step(batch=(X, y))
    assert gn.num_steps == 2
