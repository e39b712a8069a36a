"""Kronecker factors and the damped Gauss-Newton optimiser on a network with BatchNorm in TRAINING mode, through the
explicit opt-in ``batch_statistics='couple'`` (docs/architecture.md, "BatchNorm with batch statistics").

A tiny float64 conv net with two BatchNorm2d layers in training mode. The references are written from the
definition, independently of the estimator: the network run on the whole batch with hooks that keep every
layer's input and output, the coupled batch loss at the sampled labels (KFAC) or at the output-Hessian
square-root columns (KFLR) differentiated by autograd with respect to each layer's output (so the per-sample
output gradients g_n include the terms through the batch statistics), then sums of outer products; BatchNorm's
block from its per-sample gradients with x_hat normalised by the batch mean and the biased batch variance. The
Gauss-Newton step is checked against the dense float64 step of the thesis's equations (the helpers of
``tests/test_gauss_newton_models.py``), the running statistics against plain training passes, and the default
against its refusal (which now names the option) with the model left as it was.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.likelihoods import CrossEntropy
from curvkit.optim import GaussNewton
from curvkit.structure import UnsupportedModelError
from reference import dense_ggn_flat
from test_gauss_newton_models import _flat, _objective, _reference_zeta_step

pytestmark = pytest.mark.usefixtures("float64_default")

EPS = 1e-5


def _net(seed: int = 0) -> nn.Module:
    """Conv -> BN -> ReLU -> Conv -> BN -> ReLU -> Flatten -> Linear, in training mode, non-trivial BN affine
    parameters and running statistics."""
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                        nn.Conv2d(3, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.7 * torch.randn(p.shape, generator=g))
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.add_(1.0)
                m.running_mean.uniform_(-0.5, 0.5, generator=g)
                m.running_var.uniform_(0.5, 1.5, generator=g)
    return net.train()


def _data(B: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 1, 4, 4, generator=g), torch.randint(0, 3, (B,), generator=g)


def _state(model: nn.Module) -> dict:
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "modes": [m.training for m in model.modules()],
            "grads": {n: p.requires_grad for n, p in model.named_parameters()}}


def _same_state(a: dict, b: dict) -> bool:
    return (a["modes"] == b["modes"] and a["grads"] == b["grads"]
            and all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
            and all(torch.equal(a["buffers"][n], b["buffers"][n]) for n in a["buffers"]))


# ---------------------------------------------------------------------------------------------- dense reference
def _coupled_pass(model: nn.Module, X: torch.Tensor):
    """(f, {module: (input, output)}) of one training-mode pass of a COPY of the model on the whole batch."""
    net = copy.deepcopy(model)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [m.register_forward_hook(lambda m, i, o: seen.__setitem__(id(m), (i[0].detach(), o)))
             for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear, nn.BatchNorm2d))]
    f = net(X)
    for h in hooks:
        h.remove()
    mods = [(n, m) for n, m in net.named_modules() if id(m) in seen]
    return f, [(n, m, *seen[id(m)]) for n, m in mods]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Layer output (B, C, H, W) or (B, C) -> (B, R, C)."""
    return t.flatten(2).transpose(1, 2) if t.dim() == 4 else t[:, None, :]


def _input_rows(m: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """(B, R, in + 1): unfolded patches (Conv2d) or the input (Linear), with the bias's column of ones."""
    if isinstance(m, nn.Conv2d):
        a = F.unfold(a, m.kernel_size, padding=m.padding, stride=m.stride).transpose(1, 2)
    else:
        a = a[:, None, :]
    return torch.cat([a, torch.ones(*a.shape[:-1], 1)], -1)


def _xhat(x: torch.Tensor) -> torch.Tensor:
    """BatchNorm2d's normalised input in training mode: batch mean and BIASED batch variance per channel."""
    mean = x.mean((0, 2, 3), keepdim=True)
    var = ((x - mean) ** 2).mean((0, 2, 3), keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS)


def _reference(model: nn.Module, X: torch.Tensor, y: torch.Tensor, method: str, sharing: str, seed: int):
    """{layer name: (G, A)} for Conv/Linear (G summed over samples, A the per-sample mean: the operator's split
    for CrossEntropy('sum')) and {BN name: sum_n u_n u_n^T}, from the definition (module docstring)."""
    f, layers = _coupled_pass(model, X)
    B = X.shape[0]
    lik = CrossEntropy("sum")
    if method == "kfac":
        ys = lik.sample(f.detach(), torch.Generator().manual_seed(seed), y)
        losses = [F.cross_entropy(f, ys, reduction="sum")]  # the coupled batch loss at the sampled labels
    else:
        S = lik.output_hessian_sqrt(f.detach())  # (B, C, C): column c of every sample's square root at once
        losses = [(f * S[:, :, c]).sum() for c in range(S.shape[-1])]
    outs = [o for *_, o in layers]
    grads = [torch.autograd.grad(L, outs, retain_graph=True) for L in losses]  # g_n of the coupled pass
    kron, norm = {}, {}
    for j, (name, m, a, _) in enumerate(layers):
        if isinstance(m, nn.BatchNorm2d):
            u = torch.stack([torch.cat([(gs[j] * _xhat(a)).sum((2, 3)), gs[j].sum((2, 3))], 1) for gs in grads])
            norm[name] = torch.einsum("vbi,vbj->ij", u, u)
            continue
        rows = _input_rows(m, a)
        R = rows.shape[1]
        gr = torch.stack([_rows(gs[j]) for gs in grads])  # (V, B, R, out)
        if sharing == "expand":
            A = torch.einsum("bri,brj->ij", rows, rows)
            G = torch.einsum("vbri,vbrj->ij", gr, gr) / R
        else:
            abar = rows.mean(1)
            A = abar.T @ abar
            G = torch.einsum("vbi,vbj->ij", gr.sum(2), gr.sum(2))
        kron[name] = (G, A / B)
    return kron, norm


# ---------------------------------------------------------------------------------------------- (a), (b) factors
@pytest.mark.parametrize(("method", "sharing"), [("kfac", "expand"), ("kfac", "reduce"), ("kflr", "expand"),
                                                 ("kflr", "reduce")])
def test_factors_equal_the_coupled_dense_reference(method, sharing):
    """A and G of every Conv/Linear layer and BatchNorm's (weight, bias) block equal the definition: the coupled
    backward pass (batch statistics differentiated through) at the sampled labels or square-root columns."""
    model = _net()
    X, y = _data()
    before = _state(model)
    est = KroneckerEstimator(model, CrossEntropy("sum"), method, weight_sharing=sharing, seed=7,
                             batch_statistics="couple").update((X, y))
    assert _same_state(before, _state(model))  # the estimator's own pass leaves the running statistics alone
    kron, norm = _reference(model, X, y, method, sharing, seed=7)
    blocks = {b.name: b for b in est.operator().blocks}
    for name, (G, A) in kron.items():
        b = blocks[f"{name}.weight"]
        assert torch.allclose(b.A, A, atol=1e-12, rtol=1e-10), (name, "A")
        assert torch.allclose(b.G, G, atol=1e-12, rtol=1e-10), (name, "G")
    for name, U in norm.items():
        b = blocks[name]
        assert torch.allclose(float(b.G) * b.A, U, atol=1e-12, rtol=1e-10), name
    # the coupling matters: the per-sample factors of the same network in eval mode are different
    assert not torch.allclose(blocks["0.weight"].G, _reference(model.eval(), X, y, method, sharing, 7)[0]["0"][0])


def test_batchnorm_block_uses_the_biased_batch_variance():
    """BatchNorm's diagonal block (norm_structure='diag') is the diagonal of sum_n u_n u_n^T with x_hat from the
    batch mean and the biased variance (not the running statistics, not the unbiased variance)."""
    model = _net(seed=3)
    X, y = _data(B=4, seed=2)
    est = KroneckerEstimator(model, CrossEntropy("sum"), "kflr", norm_structure="diag",
                             batch_statistics="couple").update((X, y))
    _, norm = _reference(model, X, y, "kflr", "expand", seed=0)
    for b in est.operator().blocks:
        if b.name in norm:
            assert torch.allclose(float(b.G) * b.A, torch.diagonal(norm[b.name]), atol=1e-12, rtol=1e-10)
    # a reference with the unbiased variance differs: the check above can tell them apart
    _, layers = _coupled_pass(model, X)
    x = layers[1][2]
    unbiased = (x - x.mean((0, 2, 3), keepdim=True)) / torch.sqrt(x.var((0, 2, 3), keepdim=True) + EPS)
    assert not torch.allclose(unbiased, _xhat(x), rtol=1e-3)


# ---------------------------------------------------------------------------------------------- (c) one step
@pytest.mark.parametrize(("curvature", "inversion", "sharing"), [("kflr", "factored", "expand"),
                                                                 ("kfac", "eigen", "reduce")])
def test_gauss_newton_step_in_training_mode_equals_the_dense_reference(curvature, inversion, sharing):
    """theta_1 - theta_0 = alpha* d: d from the coupled Kronecker factors (checked against the definition) with
    factored (Eq. 4.25) or exact damping and the greedy zeta (Eq. 4.22); alpha*, the predicted change and rho from
    the dense exact GGN and objective of the coupled minibatch loss (the network on the whole batch with its batch
    statistics, Eqs. 4.17-4.21); tau moved by the band rule."""
    model = _net()
    X, y = _data()
    lik = CrossEntropy()
    wd, tau, zeta, w = 1e-2, 0.3, 0.2, 0.5
    opt = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature=curvature, inversion=inversion,
                      weight_decay=wd, tau=tau, zeta=zeta, tau_every=1, zeta_every=1, omega_zeta=w, omega_tau=0.8,
                      seed=3, weight_sharing=sharing, batch_statistics="couple")
    E, theta0 = _objective(model, lik, X, y, wd)  # train mode: batch statistics, buffers copied
    th = theta0.clone().requires_grad_()
    E0 = E(th)
    g = torch.autograd.grad(E0, th)[0]
    E0 = E0.detach()
    Gd = dense_ggn_flat(model, lik, (X, y))  # the exact GGN of the coupled minibatch loss
    C = Gd + (wd + tau) * torch.eye(g.numel())
    ref_model = copy.deepcopy(model)
    loss = opt.step(batch=(X, y))
    assert float(loss) == pytest.approx(float(E0), rel=1e-12)
    rec = opt.history[-1]
    op = opt.estimator.operator()
    if curvature == "kflr":  # the factors the direction used are the coupled ones of the definition (x B: mean)
        kron, _ = _reference(ref_model, X, y, "kflr", sharing, seed=0)
        for name, (Gr, Ar) in kron.items():
            b = next(b for b in op.blocks if b.name == f"{name}.weight")
            assert torch.allclose(b.G * X.shape[0], Gr, atol=1e-12, rtol=1e-10) and torch.allclose(b.A, Ar)
    best, d, q, alpha = _reference_zeta_step(op, g, C, wd, zeta, w, exact=inversion == "eigen")
    assert rec["zeta"] == pytest.approx(best)
    assert rec["alpha"] == pytest.approx(alpha, rel=1e-8) and alpha < 0
    assert rec["predicted_change"] == pytest.approx(q, rel=1e-8)
    assert torch.allclose(_flat(model) - theta0, alpha * d, atol=1e-12, rtol=1e-8)
    rho = (float(E(_flat(model))) - float(E0)) / q
    assert rec["rho"] == pytest.approx(rho, rel=1e-7, abs=1e-9)
    assert opt.tau == pytest.approx(tau * 0.8 if rho > 0.75 else (tau / 0.8 if rho < 0.25 else tau))


# ---------------------------------------------------------------------------------------------- (d) running stats
@pytest.mark.parametrize("form", ["batch", "closure"])
def test_running_statistics_are_updated_once_per_step(form):
    """After k GaussNewton steps (first-step output check, rho on every step, the zeta search, the exact GGN
    products) the running statistics equal those of k plain training passes at the same parameters on the same
    batches: one update per step."""
    model = _net()
    ref = copy.deepcopy(model)
    lik = CrossEntropy()
    opt = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature="kflr", tau_every=1, zeta_every=1,
                      batch_statistics="couple")
    for k in range(3):
        X, y = _data(seed=10 + k)
        with torch.no_grad():
            for q, p in zip(ref.parameters(), model.parameters()):
                q.copy_(p)
            ref(X)
        if form == "batch":
            opt.step(batch=(X, y))
        else:
            def closure(X=X, y=y):
                opt.zero_grad()
                loss = lik(model(X), y)
                loss.backward()
                return loss
            opt.step(closure)
    assert opt.source == "kflr" and all(r["rho"] is not None for r in opt.history)
    for (n, b), (_, r) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(b, r), n
    assert int(model[1].num_batches_tracked) == 3


def test_a_refused_step_leaves_params_and_running_statistics(monkeypatch):
    model = _net()
    X, y = _data()
    opt = GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy(), curvature="kfac",
                      batch_statistics="couple")
    before = _state(model)

    def fail(*args, **kwargs):
        raise FloatingPointError("probe: the step is refused after its forward pass")

    monkeypatch.setattr(opt, "_compute", fail)
    with pytest.raises(FloatingPointError, match="probe"):
        opt.step(batch=(X, y))
    assert _same_state(before, _state(model))


def test_the_option_accepts_either_mode_at_every_step():
    """Built in eval mode with the option, a later model.train() is accepted by the per-step mode check (and
    the step then uses batch statistics); without the option it is refused, naming the option."""
    model = _net().eval()
    X, y = _data()
    opt = GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy(), curvature="kfac",
                      batch_statistics="couple")
    opt.step(batch=(X, y))
    model.train()
    opt.step(batch=(X, y))
    assert int(model[1].num_batches_tracked) == 1
    other = _net().eval()
    plain = GaussNewton(other.parameters(), model=other, likelihood=CrossEntropy(), curvature="kfac")
    plain.step(batch=(X, y))
    other.train()
    with pytest.raises(UnsupportedModelError, match="batch_statistics='couple'"):
        plain.step(batch=(X, y))


# ---------------------------------------------------------------------------------------------- (e) the default
def test_default_refuses_with_the_hint_and_changes_nothing():
    model = _net()
    X, y = _data()
    before = _state(model)
    with pytest.raises(UnsupportedModelError, match=r"BatchNorm2d.*batch statistics.*batch_statistics='couple'"):
        KroneckerEstimator(model, CrossEntropy(), "kfac").update((X, y))
    for curvature in ("auto", "kfac"):
        with pytest.raises(UnsupportedModelError, match="batch_statistics='couple'"):
            GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy(), curvature=curvature)
    assert _same_state(before, _state(model))
    with pytest.raises(ValueError, match="batch_statistics must be"):
        KroneckerEstimator(model, CrossEntropy(), batch_statistics="sync")
    with pytest.raises(ValueError, match="batch_statistics must be"):
        GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy(), batch_statistics="sync")
    assert _same_state(before, _state(model))


def test_users_without_the_option_refuse_without_naming_it():
    """The Kronecker filters and the continual penalty do not take batch_statistics: their refusal names the
    fix they offer (eval mode), not an option of other classes."""
    from curvkit.continual.laplace import LaplacePenalty
    from curvkit.optim.filters import KFNatGrad

    model = _net()
    X, y = _data()
    for refused in (lambda: KFNatGrad(model.parameters(), model=model),
                    lambda: LaplacePenalty(structure="kron", task_size=5).consolidate(model, [(X, y)])):
        with pytest.raises(UnsupportedModelError, match="batch statistics") as err:
            refused()
        assert "batch_statistics" not in str(err.value) and "model.eval()" in str(err.value)


def test_data_parallel_is_refused_with_the_option():
    """Each rank's BatchNorm would normalise with its own shard's statistics: refused, with the reason."""
    from curvkit.distributed import Reducer

    model = _net()
    reducer = Reducer.__new__(Reducer)  # never used: the refusal comes first
    with pytest.raises(ValueError, match="own shard's statistics"):
        KroneckerEstimator(model, CrossEntropy(), batch_statistics="couple", distributed=reducer)
    with pytest.raises(ValueError, match="own shard's statistics"):
        GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy(), batch_statistics="couple",
                    distributed=reducer)
