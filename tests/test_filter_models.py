"""The Kronecker filter optimisers (KFNatGrad, KFBayes, KFWhiten) on the models the layer kinds support, against
dense float64 references written from the equations (Aitchison 2018, Sec. 2.1.1-2.1.3).

A filter keeps its Kronecker posterior on ``nn.Linear`` layers (also when the weight is shared over positions) and
groups=1 ``nn.Conv1d``/``nn.Conv2d`` (the rows of every position). Every other trainable parameter - embeddings,
normalisation layers, attention projections, grouped convolutions, raw parameters (class token, position table) -
gets the diagonal form of the same filter (the factorised equations with the minibatch gradient as Fisher sample).
The references below rebuild one step from plain autograd: the Kronecker layers' whitened step (KFWhiten); for
KFNatGrad/KFBayes the step of the same filter on the layer alone with the same Fisher samples (one row per
example; single-layer steps are tested against the dense Kalman filter in test_filter_kronecker.py) or, for
layers with T > 1 rows per example, the step written from the per-example gradients E_n = sum_t delta_t x_t^T
(``reference.kron_filter_step``; tests/test_filter_positions.py has it against torch.func per-sample gradients);
and the scalar equations on the diagonal parameters.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from curvkit.architectures import causal_lm
from curvkit.likelihoods import CrossEntropy
from curvkit.optim.filters import KFBayes, KFNatGrad, KFWhiten
from curvkit.structure import UnsupportedModelError
from reference import kron_filter_step
from tiny_models import tiny_case

pytestmark = pytest.mark.usefixtures("float64_default")

CASES = ("transformer", "vit", "resnet", "tagger")


def _case(name: str):
    """(model, summed loss fn, batch, B): the tagger's per-token loss is summed (the filters' reduction='mean' is
    a mean over examples), the others' is the mean over examples."""
    model, lik, (X, y) = tiny_case(name)
    if name == "tagger":
        lik = CrossEntropy("sum", ignore_index=-100)
    return model, lik, (X, y)


def _kron_modules(model: nn.Module, whiten: bool) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules()
            if type(m) is nn.Linear or (whiten and type(m) in (nn.Conv1d, nn.Conv2d) and m.groups == 1)}


def _rows(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Input rows (K, in[+1]) of a Linear (any leading dims) or a Conv1d/Conv2d (unfolded patches; a Conv1d as a
    1 x k Conv2d), with the ones column."""
    if isinstance(m, nn.Conv2d):
        x = F.unfold(x, m.kernel_size, m.dilation, m.padding, m.stride).transpose(1, 2)
    elif isinstance(m, nn.Conv1d):
        x = F.unfold(x[:, :, None, :], (1, m.kernel_size[0]), (1, m.dilation[0]), (0, m.padding[0]),
                     (1, m.stride[0])).transpose(1, 2)
    x = x.reshape(-1, x.shape[-1])
    return torch.cat([x, x.new_ones(x.shape[0], 1)], 1) if m.bias is not None else x


def _out_rows(m: nn.Module, g: torch.Tensor) -> torch.Tensor:
    if isinstance(m, (nn.Conv1d, nn.Conv2d)):
        g = g.flatten(2).transpose(1, 2)
    return g.reshape(-1, g.shape[-1])


def _reference_pass(model, lik, X, y, whiten):
    """Plain autograd on a copy: per Kronecker module its input rows, output-gradient rows (of the loss as given),
    its positions per example, and every parameter's gradient."""
    ref = copy.deepcopy(model)
    rec: dict[str, dict] = {}
    handles = []
    for name, m in _kron_modules(ref, whiten).items():
        def hook(mod, inp, out, name=name):
            rec[name] = {"x": _rows(mod, inp[0].detach()), "T": (inp[0][0].numel() // inp[0].shape[-1])
                         if isinstance(mod, nn.Linear) else out[0, 0].numel()}
            out.register_hook(lambda g, name=name, mod=mod: rec[name].__setitem__("d", _out_rows(mod, g)))
        handles.append(m.register_forward_hook(hook))
    lik(ref(X), y).backward()
    for h in handles:
        h.remove()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    return rec, grads, ref


def _inv_sqrt(C: torch.Tensor, damping: float) -> torch.Tensor:
    """(C + damping tr(C)/n I)^{-1/2}."""
    w, V = torch.linalg.eigh(C)
    lam = damping * float(w.mean())
    return (V * (w.clamp(min=0) + lam).rsqrt()) @ V.T


def _snapshot(model):
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()}, model.training,
            {n: p.requires_grad for n, p in model.named_parameters()})


@pytest.mark.parametrize("name", CASES)
def test_kfwhiten_step_equals_the_dense_reference(name):
    """KFWhiten's first step: (C_d + lam_d)^{-1/2} G (C_x + lam_x)^{-1/2} on Linear (also weight-shared) and
    groups=1 Conv1d/Conv2d layers from every position's rows (C_x the mean, C_d the sum of the summed-loss output
    gradients' outer products), g / sqrt(g^2 + damping mean(g^2)) on every other parameter (g the ascent
    gradient of the summed log-likelihood); a curvature operator over every trainable parameter."""
    model, lik, (X, y) = _case(name)
    lr, beta, damping = 0.05, 0.9, 0.1
    B = X.shape[0]
    scale = 1.0 if lik.reduction == "sum" else float(B)
    rec, grads, _ = _reference_pass(model, lik, X, y, whiten=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = KFWhiten(model.parameters(), model=model, lr=lr, beta=beta, damping=damping,
                   reduction="sum" if lik.reduction == "sum" else "mean")
    lik(model(X), y).backward()
    opt.step()
    kron = _kron_modules(model, whiten=True)
    assert sorted(r.name for r in opt.layers) == sorted(kron)
    assert {d.name for d in opt.diagonal} == set(grads) - {f"{n}.{a}" for n in kron for a in ("weight", "bias")}
    expect = {}
    for mname, m in kron.items():
        x, d = rec[mname]["x"], rec[mname]["d"] * scale
        W = before[f"{mname}.weight"].reshape(m.weight.shape[0], -1)
        gW = grads[f"{mname}.weight"].reshape(W.shape)
        if m.bias is not None:
            W = torch.cat([W, before[f"{mname}.bias"][:, None]], 1)
            gW = torch.cat([gW, grads[f"{mname}.bias"][:, None]], 1)
        U = _inv_sqrt(d.T @ d, damping) @ (-scale * gW) @ _inv_sqrt(x.T @ x / x.shape[0], damping)
        Wn = W + lr * U
        k = m.weight[0].numel()
        expect[f"{mname}.weight"] = Wn[:, :k].reshape(m.weight.shape)
        if m.bias is not None:
            expect[f"{mname}.bias"] = Wn[:, k]
    for n, g in grads.items():
        if n not in expect:
            a = -scale * g
            expect[n] = before[n] + lr * a / (a * a + damping * float((a * a).mean())).sqrt()
    params = dict(model.named_parameters())
    for n, want in expect.items():
        torch.testing.assert_close(params[n].detach(), want, rtol=1e-9, atol=1e-12, msg=n)
    P = opt.curvature()
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert P.shape == (n_train, n_train)
    opt.close()


@pytest.mark.parametrize("cls", [KFNatGrad, KFBayes])
@pytest.mark.parametrize("name", CASES)
def test_kfnatgrad_and_kfbayes_steps_equal_the_references(cls, name):
    """KFNatGrad / KFBayes: the Linear layers with (batch, features) inputs take the step the same filter takes
    on the layer alone with the same Fisher samples and gradient; weight-shared Linear layers and groups=1
    convolutions the step written from their per-example gradients E_n (T rows per example); every other parameter
    the scalar filter step s = 1 / (1/(decay^2 s0 + eta^2) + g^2), W <- decay (W + s g)."""
    model, lik, (X, y) = _case(name)
    kw = {"s0": 0.3, "fisher_samples": None}
    if cls is KFBayes:
        kw.update(lr=0.2, sigma2=4.0)
    red = "sum" if lik.reduction == "sum" else "mean"
    B = X.shape[0]
    scale = 1.0 if red == "sum" else float(B)
    rec, grads, _ = _reference_pass(model, lik, X, y, whiten=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = cls(model.parameters(), model=model, reduction=red, **kw)
    lik(model(X), y).backward()
    opt.step()
    every = _kron_modules(model, whiten=True)
    assert sorted(r.name for r in opt.layers) == sorted(every)
    kron = {n: m for n, m in every.items() if rec[n]["T"] == 1 and isinstance(m, nn.Linear)}
    params = dict(model.named_parameters())
    eta, sigma2 = kw.get("lr", 0.0), kw.get("sigma2", math.inf)
    decay = 1.0 - eta**2 / (2 * sigma2)
    done = set()
    for mname, m in every.items():  # T > 1 rows per example: E_n = sum_t delta_t x_t^T
        if mname in kron:
            continue
        T, x, d = rec[mname]["T"], rec[mname]["x"], rec[mname]["d"] * scale
        E = torch.einsum("btm,btn->bmn", d.reshape(B, T, -1), x.reshape(B, T, -1))
        W = before[f"{mname}.weight"].reshape(m.weight.shape[0], -1)
        if m.bias is not None:
            W = torch.cat([W, before[f"{mname}.bias"][:, None]], 1)
        r0 = math.sqrt(kw["s0"])
        _, _, inc = kron_filter_step(torch.eye(E.shape[2]) * r0, torch.eye(E.shape[1]) * r0, E, -E.sum(0), eta,
                                     sigma2, sequential=True, exact=False)
        Wn = decay * (W + inc)
        k = m.weight[0].numel()
        torch.testing.assert_close(params[f"{mname}.weight"].detach(), Wn[:, :k].reshape(m.weight.shape),
                                   rtol=1e-9, atol=1e-12)
        done.add(f"{mname}.weight")
        if m.bias is not None:
            torch.testing.assert_close(params[f"{mname}.bias"].detach(), Wn[:, k], rtol=1e-9, atol=1e-12)
            done.add(f"{mname}.bias")
    for mname, m in kron.items():  # the layer alone, the same samples and gradient
        alone = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        with torch.no_grad():
            alone.weight.copy_(before[f"{mname}.weight"])
            alone.weight.grad = grads[f"{mname}.weight"].clone()
            if m.bias is not None:
                alone.bias.copy_(before[f"{mname}.bias"])
                alone.bias.grad = grads[f"{mname}.bias"].clone()
        ref = cls(alone.parameters(), model=alone, reduction=red, batch_size=None if red == "sum" else B, **kw)
        ref.step(fisher_samples={"": (rec[mname]["x"], rec[mname]["d"] * scale)})
        for a in ("weight", "bias"):
            if getattr(m, a) is not None:
                torch.testing.assert_close(params[f"{mname}.{a}"].detach(), getattr(alone, a).detach(),
                                           rtol=1e-9, atol=1e-12)
                done.add(f"{mname}.{a}")
        ref.close()
    for n, g in grads.items():
        if n in done:
            continue
        a = -scale * g
        s = 1.0 / (1.0 / (decay**2 * kw["s0"] + eta**2) + a * a)
        torch.testing.assert_close(params[n].detach(), decay * (before[n] + s * a), rtol=1e-9, atol=1e-12, msg=n)
        torch.testing.assert_close(opt.effective_lr()[n], s, rtol=1e-12, atol=0)  # no batch_size: summed units
    assert {r["name"] for r in opt.diagnostics()} >= {n for n in grads if n not in done}
    # the precision operator covers every trainable parameter; the diagonal ones hold 1/s exactly
    P = opt.curvature().to_dense()
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert P.shape == (n_train, n_train)
    if cls is KFBayes:  # posterior_mean() swaps W_post in and back
        with opt.posterior_mean():
            for n in grads:
                if n not in done:
                    a = -scale * grads[n]
                    s = 1.0 / (1.0 / (decay**2 * kw["s0"] + eta**2) + a * a)
                    torch.testing.assert_close(params[n].detach(), before[n] + s * a, rtol=1e-9, atol=1e-12)
    opt.close()


def test_a_layer_may_get_positions_after_a_kronecker_start():
    """KFNatGrad's Kronecker layer started on (batch, features) inputs takes inputs with positions at a later step
    (its rows grouped per example); passes of different positions accumulated into one step are refused."""
    lin = nn.Sequential(nn.Linear(3, 2))
    opt = KFNatGrad(lin.parameters(), model=lin)
    F.cross_entropy(lin(torch.randn(4, 3)), torch.randint(0, 2, (4,))).backward()
    opt.step()
    lin.zero_grad()
    F.cross_entropy(lin(torch.randn(4, 5, 3)).mean(1), torch.randint(0, 2, (4,))).backward()
    opt.step()
    assert all(bool(torch.isfinite(S).all()) for S in opt.factors()["0"])
    lin.zero_grad()
    F.cross_entropy(lin(torch.randn(4, 5, 3)).mean(1), torch.randint(0, 2, (4,))).backward()
    F.cross_entropy(lin(torch.randn(4, 2, 3)).mean(1), torch.randint(0, 2, (4,))).backward()
    W = lin[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"layer '0': the backward passes accumulated since the last step have "
                                         "different positions per example"):
        opt.step()
    assert torch.equal(W, lin[0].weight)
    opt.close()


@pytest.mark.parametrize("cls", [KFNatGrad, KFBayes, KFWhiten])
def test_bad_input_is_refused_and_changes_nothing(cls):
    """NaN in a batch, a module registered twice: a clear error naming what is
    wrong; the model's parameters, buffers, train/eval mode and requires_grad flags and the optimiser's state
    are unchanged."""
    model, _, (X, y) = _case("vit")
    snap = _snapshot(model)
    opt = cls(model.parameters(), model=model)
    Xbad = X.clone()
    Xbad[0, 0, 1, 1] = math.nan
    F.cross_entropy(model(Xbad), y).backward()  # the user's own loss, unchecked
    with pytest.raises(ValueError, match="contains NaN or inf"):
        opt.step()
    after = _snapshot(model)
    assert all(torch.equal(after[0][n], v) for n, v in snap[0].items())
    assert all(torch.equal(after[1][n], v) for n, v in snap[1].items())
    assert after[2:] == snap[2:] and not any(opt.state.values())
    opt.close()
    tied = causal_lm(vocab_size=5, max_len=4, dim=4, depth=1, heads=2, mlp_dim=4, tie_weights=True,
                     dtype=torch.float64)  # taken: the tied weight as one record (tests/test_shared_weights.py)
    with cls(tied.parameters(), model=tied) as taken:
        assert [r.kind for r in taken.layers].count("tied") == 1 and "tied" not in {d.kind for d in taken.diagonal}
    lin = nn.Linear(4, 4)  # (an unregistered class such as PReLU is taken: curvkit.layerkinds.generic)
    odd = nn.Sequential(nn.Linear(3, 4), lin, nn.Tanh(), lin)
    with pytest.raises(UnsupportedModelError, match=r"'1' \(Linear\) is registered under 2 names"):
        cls(odd.parameters(), model=odd)
    assert not any(m._forward_hooks for m in odd.modules())  # nothing attached to a refused model


def test_loss_scale_is_read_from_the_rows_of_a_layer_with_positions():
    """reduction='mean' without batch_size: the batch size comes from the captured passes, also when the only
    Kronecker layer shares its weight over positions (4 examples of 6 rows: g = 4 * the mean loss's gradient on the
    diagonal embedding)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 2))
    ids, y = torch.randint(0, 5, (4, 6)), torch.randint(0, 2, (4,))
    before = model[0].weight.detach().clone()
    opt = KFNatGrad(model.parameters(), model=model, s0=0.5)
    F.cross_entropy(model(ids).mean(1), y).backward()
    g = model[0].weight.grad.clone()
    opt.step()
    assert [r.name for r in opt.layers] == ["1"] and [d.name for d in opt.diagonal] == ["0.weight"]
    a = -4.0 * g
    torch.testing.assert_close(model[0].weight.detach(), before + a / (1 / 0.5 + a * a), rtol=1e-12, atol=1e-14)
    opt.close()


@pytest.mark.parametrize("cls", [KFNatGrad, KFBayes, KFWhiten])
def test_state_dict_round_trip_with_diagonal_parameters(cls):
    """Stopped after one step and resumed in a fresh optimiser (whose weight-shared layers are not yet known to
    be diagonal): the same parameters as running on."""
    model_a, lik, (X, y) = _case("transformer")
    model_b = copy.deepcopy(model_a)
    opt_a = cls(model_a.parameters(), model=model_a)
    opt_b = cls(model_b.parameters(), model=model_b)
    for model, opt in ((model_a, opt_a), (model_b, opt_b)):
        lik(model(X), y).backward()
        opt.step()
        model.zero_grad()
    sd = copy.deepcopy(opt_b.state_dict())
    opt_b.close()
    opt_c = cls(model_b.parameters(), model=model_b)
    opt_c.load_state_dict(sd)
    for model, opt in ((model_a, opt_a), (model_b, opt_c)):
        lik(model(X.flip(0)), y.flip(0)).backward()
        opt.step()
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    opt_a.close()
    opt_c.close()
