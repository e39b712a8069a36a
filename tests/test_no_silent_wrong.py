"""Regression tests for the classes of silently wrong results, corrupted models and unclear crashes found by
trying curvkit outside its test zoo: each gives the right number (against an independent dense reference)
or a clear error now."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from curvkit.curvature import (
    GGNOperator,
    HessianOperator,
    MCFisherOperator,
    kfac,
    kflr,
    piecewise_linear_reason,
)
from curvkit.curvature._functional import FunctionalModel
from curvkit.curvature._layerwise import layer_specs
from curvkit.likelihoods import BernoulliBCE, CrossEntropy, Gaussian
from curvkit.linalg.kron import KroneckerBlock, KroneckerOperator
from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import DenseOperator, DiagonalOperator
from curvkit.optim import BGD, MESU, SGLD, DenseKalmanFilter, KaldiNGD, KFNatGrad, NaturalGradient
from curvkit.optim.meanfield import MeanReductionWarning
from curvkit.structure import UnsupportedModelError, read_model
from reference import dense_ggn, dense_hessian

D64 = torch.float64


def _data(n=6, d=4, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=D64), torch.randint(0, c, (n,), generator=g)


# ------------------------------------------------------------------------------ 1. shared parameters
def _tied_sequential(act=nn.Tanh):
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight  # weight tying between two layers of one plain Sequential
    return nn.Sequential(a, act(), b, act(), nn.Linear(4, 3)).double()


class _TiedTree(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.enc, self.dec, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.dec.weight = self.enc.weight

    def forward(self, x):
        return self.out(torch.tanh(self.dec(torch.tanh(self.enc(x)))))


@pytest.mark.parametrize("make", [_tied_sequential, lambda: _TiedTree().double()])
def test_shared_parameters_give_exact_products_diagonal_and_trace(make):
    model = make()
    s = read_model(model)
    assert list(s.shared_parameters) == [next(iter(s.shared_parameters))] and len(s.shared_parameters) == 1
    assert layer_specs(FunctionalModel(model)) is None and piecewise_linear_reason(model) is not None
    X, y = _data()
    lik = CrossEntropy("sum")
    ref = dense_ggn(model, lik, (X, y))
    G = GGNOperator(model, lik, (X, y))
    torch.testing.assert_close(G.to_dense(), ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(G.diagonal().flat, ref.diagonal(), atol=1e-10, rtol=0)
    torch.testing.assert_close(G.trace(), ref.trace(), atol=1e-10, rtol=0)
    V = torch.randn(G.layout.dim, 3, dtype=D64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(G @ V, ref @ V, atol=1e-10, rtol=0)
    torch.testing.assert_close(G.quadratic_form(V), ((ref @ V) * V).sum(0), atol=1e-10, rtol=0)


def test_tied_relu_net_trace_is_the_hessian_trace_not_the_ggn_shortcut():
    """A tied weight makes a ReLU net quadratic in it, so tr(H) != tr(G); the trace must not take the
    piecewise-linear shortcut (it once did: relative errors up to 0.6)."""
    model = _tied_sequential(nn.ReLU)
    X, y = _data(8)
    lik = CrossEntropy("sum")
    H = HessianOperator(model, lik, (X, y))
    ref = dense_hessian(model, lik, (X, y)).trace()
    assert abs(float(ref - dense_ggn(model, lik, (X, y)).trace())) > 1e-3  # the shortcut would be wrong
    torch.testing.assert_close(H.trace(), ref, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="shared"):
        H.trace(piecewise_linear=True)


def test_kronecker_factors_refuse_a_tied_weight_they_cannot_sum():
    """Two Linear layers with biases of their own sharing a weight: a sum over three parameters, refused."""
    with pytest.raises(UnsupportedModelError, match=r"shares 0.weight with 1 other use.*3 parameters"):
        kfac(_tied_sequential(), CrossEntropy(), _data())


# ------------------------------------------------------------------------------ 2. a module called twice
class _Twice(nn.Module):
    """One Linear registered under two names (a and b) and called twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(4, 4)
        self.b = self.a
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _twice_reference(model, lik, X, y):
    """Dense GGN of the same function written out by hand (no functional_call)."""
    W, b, V, c = (p.detach().clone() for p in (model.a.weight, model.a.bias, model.out.weight, model.out.bias))
    sizes = [W.numel(), b.numel(), V.numel(), c.numel()]

    def f(theta, x):
        w, bb, v, cc = torch.split(theta, sizes)
        w, v = w.reshape(W.shape), v.reshape(V.shape)
        h = torch.tanh(torch.tanh(x @ w.T + bb) @ w.T + bb)
        return h @ v.T + cc

    theta = torch.cat([W.reshape(-1), b, V.reshape(-1), c])
    J = torch.func.jacrev(f)(theta, X)  # (B, C, d)
    HL = lik.output_hessian(f(theta, X))
    return torch.einsum("bci,bcd,bdj->ij", J, HL, J)


@pytest.mark.parametrize("op_cls", [GGNOperator, HessianOperator, MCFisherOperator])
def test_operators_leave_a_module_used_twice_intact(op_cls):
    model = _Twice().double()
    before = {n: (type(p), id(p)) for n, p in model.named_parameters(remove_duplicate=False)}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the operator
    X, y = _data()
    lik = CrossEntropy("sum")
    op = op_cls(model, lik, (X, y))
    op @ torch.ones(op.layout.dim, dtype=D64)
    op.diagonal()
    after = {n: (type(p), id(p)) for n, p in model.named_parameters(remove_duplicate=False)}
    assert after == before and all(t is nn.Parameter for t, _ in after.values())
    w0 = model.a.weight.detach().clone()
    opt.zero_grad()
    nn.functional.cross_entropy(model(X), y).backward()
    opt.step()
    assert not torch.equal(model.a.weight, w0)  # the optimiser still trains it
    if op_cls is GGNOperator:
        torch.testing.assert_close(GGNOperator(model, lik, (X, y)).to_dense(),
                                   _twice_reference(model, lik, X, y), atol=1e-10, rtol=0)


# ------------------------------------------------------------------------------ 3. Kronecker filters, layer used twice
class _CallsTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


def test_kronecker_filters_refuse_a_layer_used_twice():
    shared = nn.Linear(3, 3)
    registered_twice = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(3, 2))
    with pytest.raises(UnsupportedModelError, match="registered under 2 names"):
        KFNatGrad(registered_twice.parameters(), model=registered_twice, batch_size=4)
    model = _CallsTwice()
    opt = KFNatGrad(model.parameters(), model=model, batch_size=4)
    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    nn.functional.cross_entropy(model(X), y).backward()
    w0 = model.lin.weight.detach().clone()
    with pytest.raises(UnsupportedModelError, match="'lin' was called more than once"):
        opt.step()
    assert torch.equal(model.lin.weight, w0)
    opt.close()
    assert not model.lin._forward_hooks and not model._forward_pre_hooks  # close() removes every hook


# ------------------------------------------------------------------------------ 4. dropout / batch norm in train mode
def test_random_modules_in_training_mode_are_refused():
    model = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.3), nn.Tanh(), nn.Linear(5, 3)).double()
    X, y = _data()
    with pytest.raises(UnsupportedModelError, match=r"module '1' \(Dropout\) is random in training mode"):
        GGNOperator(model, CrossEntropy(), (X, y))
    with pytest.raises(UnsupportedModelError, match="Dropout"):
        kflr(model, CrossEntropy(), (X, y))
    model.eval()
    GGNOperator(model, CrossEntropy(), (X, y))  # fine in eval mode


def test_batchnorm_in_training_mode_is_exact_on_the_whole_batch():
    """BatchNorm with batch statistics couples the samples: the exact operators take the batch-coupled
    Jacobian (per-sample routes step aside), so diagonal() and to_dense() agree with the dense reference."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5, affine=False, track_running_stats=False), nn.Tanh(),
                          nn.Linear(5, 3)).double()
    X, y = _data(8)
    lik = CrossEntropy("sum")
    G = GGNOperator(model, lik, (X, y))
    assert G.fmodel.batch_coupled
    ref = dense_ggn(model, lik, (X, y))  # the Jacobian of the whole batch's output
    torch.testing.assert_close(G.diagonal().flat, ref.diagonal(), atol=1e-10, rtol=0)
    torch.testing.assert_close(G.to_dense(), ref, atol=1e-10, rtol=0)


def test_batchnorm_in_training_mode_never_changes_the_module_state():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).double()
    X, y = _data(8)
    bn = model[1]
    state = {k: v.clone() for k, v in bn.state_dict().items()}
    G = GGNOperator(model, CrossEntropy("sum"), (X, y))
    G @ torch.ones(G.layout.dim, dtype=D64)
    G.diagonal()
    with pytest.raises(UnsupportedModelError, match=r"module '1' \(BatchNorm1d\) normalises with batch statistics"):
        kfac(model, CrossEntropy(), (X, y))
    assert all(torch.equal(v, bn.state_dict()[k]) for k, v in state.items())  # running stats, batches tracked
    frozen = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5, affine=False), nn.Linear(5, 3)).double()
    with pytest.raises(UnsupportedModelError, match="BatchNorm1d"):  # no trainable parameters, still refused
        kflr(frozen, CrossEntropy(), (X, y))


# ------------------------------------------------------------------------------ 5. non-finite right-hand sides
def _operators():
    layout = ParamLayout.from_tensors([torch.zeros(2, 3), torch.zeros(2)], ["w", "b"])
    A = torch.randn(8, 8, dtype=D64, generator=torch.Generator().manual_seed(5))
    dense = DenseOperator(layout, A @ A.T + torch.eye(8, dtype=D64))
    diag = DiagonalOperator.from_flat(layout, torch.linspace(0.5, 2.0, 8, dtype=D64))
    kron = KroneckerOperator(layout, [KroneckerBlock(torch.eye(2, dtype=D64) * 2, torch.eye(4, dtype=D64), "w", "b")])
    return [dense, diag, kron, dense + diag]


@pytest.mark.parametrize("op", _operators(), ids=["dense", "diagonal", "kronecker", "sum"])
def test_solve_refuses_non_finite_input_and_damping(op):
    b = torch.ones(8, dtype=D64)
    with pytest.raises(ValueError, match="NaN or inf"):
        op.solve(b * float("nan"))
    with pytest.raises(ValueError, match="NaN or inf"):
        op.solve(torch.cat([b[:7], torch.tensor([math.inf], dtype=D64)]))
    for bad in (float("nan"), math.inf):
        with pytest.raises(ValueError, match="finite"):
            op.solve(b, damping=bad)
        with pytest.raises(ValueError, match="finite"):
            op.inverse(bad)
        with pytest.raises(ValueError, match="finite"):
            op.logdet(bad)
    with pytest.raises(ValueError, match=r"cannot take a tensor of shape \(7,\)"):
        op.solve(b[:7])
    x = op.solve(b, damping=0.5)
    torch.testing.assert_close((op.to_dense() + 0.5 * torch.eye(8, dtype=D64)) @ x, b, atol=1e-8, rtol=0)


def test_exact_operator_solve_refuses_nan():
    X, y = _data()
    model = nn.Sequential(nn.Linear(4, 3)).double()
    G = GGNOperator(model, CrossEntropy(), (X, y))
    with pytest.raises(ValueError, match="NaN or inf"):
        G.solve(torch.full((15,), float("nan"), dtype=D64), damping=1.0)


# ------------------------------------------------------------------------------ 6. NaN gradient with a finite loss
def _nan_grad_model():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    model[0].weight.register_hook(lambda g: g * float("nan"))  # finite loss, NaN gradient
    return model


def _state(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [s["sigma"].clone() for s in opt.state.values() if "sigma" in s])


@pytest.mark.parametrize("cls", [MESU, BGD])
def test_mean_field_optimisers_refuse_nan_gradients_without_changing_state(cls):
    model = _nan_grad_model()
    opt = cls(model.parameters(), model=model, mc_samples=2)
    X, y = _data()
    params, sigmas = _state(model, opt)

    def closure():
        loss = nn.functional.cross_entropy(model(X), y, reduction="sum")
        loss.backward()
        return loss

    with pytest.raises(FloatingPointError, match="NaN or inf"):
        opt.step(closure)
    p2, s2 = _state(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(params, p2)) and all(torch.equal(a, b) for a, b in zip(sigmas, s2))
    assert opt.num_steps == 0
    grads = opt.mc_gradients(X, y)
    grads.g_mu["0.bias"] = grads.g_mu["0.bias"] * float("nan")
    with pytest.raises(FloatingPointError):
        opt.step(grads=grads)
    grads.g_mu["0.bias"] = torch.zeros(5, dtype=D64)
    with pytest.raises(ValueError, match=r"g_mu\['0.bias'\] has shape \(5,\), expected the parameter's shape \(3,\)"):
        opt.step(grads=grads)


def test_natural_gradient_and_kaldi_refuse_nan_gradients():
    X, y = _data()
    model = _nan_grad_model()
    ng = NaturalGradient(model.parameters(), model=model, likelihood=CrossEntropy(), curvature="exact")
    kaldi = KaldiNGD(model.parameters(), lr=0.1)
    w0 = model[0].weight.detach().clone()
    for opt, kw in ((ng, {"batch": (X, y)}), (kaldi, {})):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        with pytest.raises(FloatingPointError, match="NaN or inf"):
            opt.step(**kw)
        assert torch.equal(model[0].weight, w0)


# ------------------------------------------------------------------------------ 7. invalid hyperparameters
@pytest.mark.parametrize("make, match", [
    (lambda p, m: KaldiNGD(p, lr=math.inf), "lr"),
    (lambda p, m: KaldiNGD(p, weight_decay=float("nan")), "weight_decay"),
    (lambda p, m: KaldiNGD(p, rank=-1), "rank"),
    (lambda p, m: NaturalGradient(p, model=m, likelihood=CrossEntropy(), lr=float("nan")), "lr"),
    (lambda p, m: NaturalGradient(p, model=m, likelihood=CrossEntropy(), alpha=math.inf), "alpha"),
    (lambda p, m: NaturalGradient(p, model=m, likelihood=CrossEntropy(), epsilon=float("nan")), "epsilon"),
    (lambda p, m: SGLD(p, localization=math.inf), "localization"),
    (lambda p, m: SGLD(p, noise_level=float("nan")), "noise_level"),
    (lambda p, m: DenseKalmanFilter(p, prior_cov=torch.eye(15, dtype=D64),
                                    process_noise=torch.full((15, 15), float("nan"), dtype=D64)), "process_noise"),
    (lambda p, m: DenseKalmanFilter(p, prior_cov=torch.eye(15, dtype=D64),
                                    process_noise=-torch.eye(15, dtype=D64)), "process_noise"),
])
def test_non_finite_and_negative_hyperparameters_are_refused(make, match):
    model = nn.Sequential(nn.Linear(4, 3)).double()
    with pytest.raises(ValueError, match=match):
        make(model.parameters(), model)


# ------------------------------------------------------------------------------ 8. unknown keys, stale batch sizes
def _kf_run(batch_size_ctor, X, y, seed=7):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    opt = KFNatGrad(model.parameters(), model=model, batch_size=batch_size_ctor, fisher_samples=None, s0=0.1)
    opt.zero_grad()
    nn.functional.cross_entropy(model(X), y).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


def test_kronecker_filter_refuses_unknown_layer_names_and_reads_the_batch_size_off_the_rows():
    X, y = _data(5)
    stale, opt = _kf_run(8, X, y)  # a last, partial batch of 5 with batch_size=8 given at construction
    right, _ = _kf_run(5, X, y)
    assert all(torch.equal(a, b) for a, b in zip(stale, right))
    model = opt.model
    nn.functional.cross_entropy(model(X), y).backward()
    with pytest.raises(ValueError, match=r"unknown layer name\(s\) \['O'\]"):
        opt.step(fisher_samples={"O": (torch.zeros(2, 5), torch.zeros(2, 5))})
    with pytest.raises(ValueError, match="captured minibatch has 5 examples"):
        opt.step(batch_size=8)
    with pytest.raises(TypeError, match="unknown keyword"):
        opt.step(fisher_sample={"0": None})


# ------------------------------------------------------------------------------ 10. likelihood targets
def test_bce_and_gaussian_targets_are_validated():
    f = torch.zeros(4, 3, dtype=D64)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        BernoulliBCE().nll(f, torch.full((4, 3), 1.5, dtype=D64))
    with pytest.raises(ValueError, match="NaN"):
        BernoulliBCE().nll(f, torch.full((4, 3), float("nan"), dtype=D64))
    with pytest.raises(ValueError, match="NaN"):
        Gaussian().nll(f, torch.full((4, 3), float("nan"), dtype=D64))
    model = nn.Sequential(nn.Linear(4, 3)).double()
    X = torch.randn(4, 4, dtype=D64)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        HessianOperator(model, BernoulliBCE(), (X, torch.full((4, 3), -0.5, dtype=D64)))


# ------------------------------------------------------------------------------ crashes and unclear errors
def test_natural_gradient_defaults_train_on_mnist_with_the_kfac_route():
    """784-100-10 MLP, KFAC route, the class's defaults: once failed on the first step with "not positive
    definite after damping ... (smallest eigenvalue 1.62e-06)"."""
    from curvkit.data import mnist_vectors
    from curvkit.models import mlp

    X, y = mnist_vectors(train=True, n=256)
    model = mlp([784, 100, 10], "relu", seed=0)
    opt = NaturalGradient(model.parameters(), model=model, likelihood=CrossEntropy())
    assert opt.fisher_kind == "kfac"
    losses = []
    for i in range(4):
        xb, yb = X[64 * i: 64 * (i + 1)], y[64 * i: 64 * (i + 1)]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step(batch=(xb, yb))
        losses.append(float(loss.detach()))
    with torch.no_grad():
        assert float(nn.functional.cross_entropy(model(X), y)) < losses[0]


def test_kfac_on_empty_data_and_zero_sized_batches():
    model = nn.Sequential(nn.Linear(4, 3)).double()
    with pytest.raises(ValueError, match="data is empty"):
        kfac(model, CrossEntropy(), [])
    with pytest.raises(ValueError, match="positive leading batch size"):
        kfac(model, CrossEntropy(), (torch.zeros(0, 4, dtype=D64), torch.zeros(0, dtype=torch.long)))


def test_dense_kalman_filter_fisher_shape():
    model = nn.Sequential(nn.Linear(4, 3)).double()
    opt = DenseKalmanFilter(model.parameters(), prior_cov=torch.eye(15, dtype=D64))
    X, y = _data()
    nn.functional.cross_entropy(model(X), y, reduction="sum").backward()
    with pytest.raises(ValueError, match=r"fisher must be a \(K, 15\) tensor"):
        opt.step(fisher=torch.ones(3, 14, dtype=D64))


def test_mesu_warns_about_a_mean_reduced_loss():
    model = nn.Sequential(nn.Linear(4, 3)).double()
    for loss in (CrossEntropy("mean"), nn.CrossEntropyLoss()):
        with pytest.warns(MeanReductionWarning, match="SUMMED over the minibatch"):
            MESU(model.parameters(), model=model, loss_fn=loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MeanReductionWarning)
        MESU(model.parameters(), model=model)  # the default summed loss: no warning


def test_truncated_checkpoint_names_the_file(tmp_path):
    from curvkit import checkpoint

    path = tmp_path / "checkpoint.pt"
    checkpoint.save({"w": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:300])  # an interrupted write by another tool
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoint .*checkpoint\.pt cannot be read.*Delete it"):
        checkpoint.load(path)
    checkpoint.save({"w": torch.zeros(3)}, path)  # the atomic writer replaces it whole
    assert torch.equal(checkpoint.load(path)["w"], torch.zeros(3))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary left behind


@pytest.mark.parametrize("make, group", [
    (lambda groups, model: KaldiNGD(groups), {"lr": float("nan")}),
    (lambda groups, model: KaldiNGD(groups), {"weight_decay": math.inf}),
    (lambda groups, model: SGLD(groups), {"localization": -1.0}),
    (lambda groups, model: MESU(groups, model=model), {"sigma_prior": float("nan")}),
    (lambda groups, model: BGD(groups, model=model), {"eta": -1.0}),
])
def test_param_groups_cannot_smuggle_invalid_hyperparameters(make, group):
    """A param group that overrides a default is checked like the constructor's argument."""
    from curvkit.optim import BFRMSProp

    model = nn.Sequential(nn.Linear(4, 3)).double()
    groups = [{"params": [model[0].weight], **group}, {"params": [model[0].bias]}]
    with pytest.raises(ValueError, match=next(iter(group))):
        make(groups, model)
    with pytest.raises(ValueError, match="lr"):
        BFRMSProp([{"params": [model[0].weight], "lr": math.inf}, {"params": [model[0].bias]}])
