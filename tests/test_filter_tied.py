"""The Kronecker filters on a tied weight (issue 30 §2): a nanoGPT-style model whose head (with or without a bias)
is tied to the token embedding. The tied weight is ONE Kronecker record in the head's view [W | b] (V, D[+1]) whose
rows are the head's (x, 1; delta) and the embedding's (delta_e, 0; one-hot u) stacked per example, so example n's
per-example gradient is E_n = D_h^T [X_h 1] + U^T [Delta_e 0], the tied weight's own per-sample gradient.

References: KFNatGrad/KFBayes's step from E_n computed by torch.func per-sample gradients of the tied parameter
(``reference.kron_filter_step``); KFWhiten's covariance EMAs from the stacked-row Grams written from hooks on the
head and the embedding, and its whitened step. Float64."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from curvkit.optim.filters import KFBayes, KFNatGrad, KFWhiten, kron_capture
from reference import kron_filter_step

pytestmark = pytest.mark.usefixtures("float64_default")
V, DIM = 7, 4


class TiedGPT(nn.Module):
    """nanoGPT as written: token and position tables (the position table on ``arange(T)``), one MLP block, a
    final norm and the head tied to the token table."""

    def __init__(self, bias: bool):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, DIM), nn.Embedding(8, DIM)
        self.fc, self.ln_f = nn.Linear(DIM, DIM), nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, V, bias=bias)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        x = x + torch.tanh(self.fc(x))
        return self.lm_head(self.ln_f(x))


def _case(bias: bool, B: int = 3, T: int = 4):
    torch.manual_seed(0)
    model = TiedGPT(bias).double()
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1), reduction="sum")


def _per_example_gradients(model, X, y) -> torch.Tensor:
    """E_n (B, V, D[+1]): the per-sample ascent gradient of the tied weight (both uses) and the head's bias."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(p, x, t):
        return -_loss(functional_call(model, p, (x[None],)), t[None])

    gs = vmap(grad(one), in_dims=(None, 0, 0))(params, X, y)
    E = gs["wte.weight"]
    return torch.cat([E, gs["lm_head.bias"][:, :, None]], 2) if model.lm_head.bias is not None else E


def _head_matrix(model) -> torch.Tensor:
    W = model.lm_head.weight.detach()
    return torch.cat([W, model.lm_head.bias.detach()[:, None]], 1) if model.lm_head.bias is not None else W


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("cls", [KFNatGrad, KFBayes])
@pytest.mark.parametrize("bias", [False, True])
def test_the_tied_weight_step_equals_the_per_sample_gradient_reference(bias, cls, exact):
    model, X, y = _case(bias)
    B, k = X.shape[0], 2
    kw = {"s0": 0.3, "fisher_samples": k, "projection": "exact" if exact else "first_order"}
    eta, sigma2 = 0.0, math.inf
    if cls is KFBayes:
        eta, sigma2 = 0.2, 4.0
        kw.update(lr=eta, sigma2=sigma2)
    E = _per_example_gradients(model, X, y)
    W0 = _head_matrix(model).clone()
    opt = cls(model.parameters(), model=model, reduction="sum", **kw)
    (rec,) = [r for r in opt.layers if r.kind == "tied"]
    assert rec.weight_name == "wte.weight" and [u.name for u in rec.uses] == ["wte"]
    assert {d.name for d in opt.diagonal} == {"wpe.weight", "ln_f.weight", "ln_f.bias"}
    _loss(model(X), y).backward()
    torch.testing.assert_close(model.wte.weight.grad, -E[:, :, :DIM].sum(0), rtol=1e-12, atol=1e-12)
    opt.step()
    r0 = math.sqrt(0.3)
    N = E.shape[2]
    Sx, Sd, inc = kron_filter_step(torch.eye(N) * r0, torch.eye(V) * r0, E[:k] * math.sqrt(B / k), E.sum(0), eta,
                                   sigma2, sequential=True, exact=exact)
    torch.testing.assert_close(opt.factors()[rec.name][0], Sx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(opt.factors()[rec.name][1], Sd, rtol=1e-10, atol=1e-12)
    decay = 1.0 - eta**2 / (2 * sigma2)
    torch.testing.assert_close(_head_matrix(model), decay * (W0 + inc), rtol=1e-10, atol=1e-12)
    assert torch.equal(model.wte.weight, model.lm_head.weight)  # still one tensor
    n_train = sum(p.numel() for p in model.parameters())
    assert opt.curvature().shape == (n_train, n_train)  # the tied parameter counted once
    opt.close()


def _inv_sqrt(C: torch.Tensor, damping: float) -> torch.Tensor:
    w, Q = torch.linalg.eigh(C)
    lam = damping * float(w.mean())
    return (Q * (w.clamp(min=0) + lam).rsqrt()) @ Q.T


@pytest.mark.parametrize("bias", [False, True])
def test_kfwhiten_covariances_are_the_stacked_row_grams(bias):
    """C_x = (1 - beta) X^T X / K and C_delta = (1 - beta) D^T D after one step, X, D the head's rows (x, 1; delta)
    and the embedding's (delta_e, 0; one-hot u), K all the rows; the step (C_d + lam)^{-1/2} G (C_x + lam)^{-1/2}
    with G the tied weight's gradient (both uses) and the head's bias gradient."""
    model, X, y = _case(bias)
    beta, damping, lr = 0.9, 0.1, 0.05
    rows: dict[str, torch.Tensor] = {}
    h1 = model.ln_f.register_forward_hook(lambda m, i, o: rows.__setitem__("x", o.detach()))
    h2 = model.lm_head.register_full_backward_hook(lambda m, gi, go: rows.__setitem__("d", go[0].detach()))

    def emb(m, i, o):
        o.register_hook(lambda g: rows.__setitem__("de", g.detach()))
    h3 = model.wte.register_forward_hook(emb)
    W0 = _head_matrix(model).clone()
    opt = KFWhiten(model.parameters(), model=model, lr=lr, beta=beta, damping=damping, reduction="sum")
    _loss(model(X), y).backward()
    for h in (h1, h2, h3):
        h.remove()
    G = -torch.cat([model.wte.weight.grad, model.lm_head.bias.grad[:, None]], 1) if bias else -model.wte.weight.grad
    opt.step()
    x, d, de = rows["x"].reshape(-1, DIM), rows["d"].reshape(-1, V), rows["de"].reshape(-1, DIM)
    u = F.one_hot(X.reshape(-1), V).double()
    if bias:
        x, de = torch.cat([x, torch.ones(len(x), 1)], 1), torch.cat([de, torch.zeros(len(de), 1)], 1)
    K = len(x) + len(de)
    Cx = (1 - beta) * (x.T @ x + de.T @ de) / K
    Cd = (1 - beta) * (d.T @ d + u.T @ u)
    st = opt.state[model.wte.weight]
    torch.testing.assert_close(st["Cx"], Cx, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(st["Cd"], Cd, rtol=1e-12, atol=1e-14)
    bc = 1 - beta
    want = W0 + lr * _inv_sqrt(Cd / bc, damping) @ G @ _inv_sqrt(Cx / bc, damping)
    torch.testing.assert_close(_head_matrix(model), want, rtol=1e-9, atol=1e-12)
    opt.close()


@pytest.mark.parametrize("cls", [KFNatGrad, KFWhiten])
def test_a_vocabulary_above_the_limit_keeps_the_diagonal_form(cls, monkeypatch):
    """Above TIED_OUTPUT_LIMIT outputs the record's dense (V, V) factor is not formed: the tied weight (and the
    head's bias) take the filter's diagonal form, whose Fisher sample is the tied weight's own gradient."""
    monkeypatch.setattr(kron_capture, "TIED_OUTPUT_LIMIT", V - 1)
    model, X, y = _case(True)
    kw = {"lr": 0.05} if cls is KFWhiten else {}
    opt = cls(model.parameters(), model=model, reduction="sum", **kw)
    assert "lm_head" not in {r.name for r in opt.layers}
    kinds = {d.name: d.kind for d in opt.diagonal}
    assert kinds["wte.weight"] == "tied" and "lm_head.bias" in kinds
    _loss(model(X), y).backward()
    opt.step()
    assert torch.equal(model.wte.weight, model.lm_head.weight)
    opt.close()
