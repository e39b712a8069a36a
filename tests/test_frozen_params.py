"""Frozen parameters (``requires_grad=False``) in every curvkit optimiser and in the continual-learning
harness (issue 25, item 1): ``model.parameters()`` of a model with a frozen base is accepted, and a frozen
parameter is exactly unchanged, holds no state, gets no curvature and is not counted in any dimension.

The reference for every optimiser is the same optimiser built on the trainable parameters alone (the
path that never saw a frozen tensor): both must take identical steps and report identical curvature.
Models: a frozen base with LoRA adapters written as modules and as raw parameters (``tests/adapters.py``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from adapters import assert_frozen_unchanged, frozen_snapshot, module_lora, num_trainable, raw_lora
from curvkit.continual.laplace import LaplacePenalty
from curvkit.continual.learners import MeanFieldLearner, TorchLearner
from curvkit.continual.penalties import EWC, SynapticIntelligence
from curvkit.likelihoods import CrossEntropy
from curvkit.optim import BBBSGD, BGD, MESU, SGLD, KaldiNGD, MESUNoReg, NaturalGradient
from curvkit.optim.filters import (
    BFAdam,
    BFAdamSS,
    BFNatGrad,
    BFRMSProp,
    BFRMSPropSS,
    DenseKalmanFilter,
    KFBayes,
    KFNatGrad,
    KFWhiten,
)

MODELS = {"module_lora": module_lora, "raw_lora": raw_lora}


def _batches(n=3, B=8, d_in=6, classes=3):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(B, d_in, generator=g, dtype=torch.float64), torch.randint(0, classes, (B,), generator=g))
            for _ in range(n)]


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _assert_same_trainable(m1, m2):
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"parameter {n} differs")


def _assert_no_state_for_frozen(opt, model):
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not [n for n, p in model.named_parameters() if n in frozen and (p in opt.state or id(p) in held)]


# ------------------------------------------------------------------------------------------ mean field
MEANFIELD = {
    "mesu": lambda ps, m: MESU(ps, model=m, sigma_prior=0.05, mc_samples=3, seed=1),
    "mesu_noreg": lambda ps, m: MESUNoReg(ps, model=m, mc_samples=3, seed=1),
    "bgd": lambda ps, m: BGD(ps, model=m, mc_samples=3, seed=1),
    "bbb": lambda ps, m: BBBSGD(ps, model=m, lr=1e-2, mc_samples=3, seed=1),
}


@pytest.mark.parametrize("model_kind", list(MODELS))
@pytest.mark.parametrize("kind", list(MEANFIELD))
def test_meanfield_optimisers_leave_frozen_parameters_alone(kind, model_kind):
    model, ref = MODELS[model_kind](), MODELS[model_kind]()
    snap = frozen_snapshot(model)
    opt = MEANFIELD[kind](model.parameters(), model)
    ref_opt = MEANFIELD[kind](_trainable(ref), ref)
    for batch in _batches():
        loss, ref_loss = opt.step(batch=batch), ref_opt.step(batch=batch)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert_frozen_unchanged(model, snap)
    _assert_same_trainable(model, ref)
    _assert_no_state_for_frozen(opt, model)
    d = num_trainable(model)
    assert opt.layout().dim == d                          # 82 / 50, not 245 / 133
    H = opt.curvature("stein")
    assert H.shape == (d, d)
    torch.testing.assert_close(H.flat, ref_opt.curvature("stein").flat, rtol=0, atol=0)
    assert set(opt.sigma_dict()) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_meanfield_closure_path_leaves_frozen_parameters_alone():
    model = module_lora()
    snap = frozen_snapshot(model)
    opt = MESU(model.parameters(), model=model, mc_samples=2)
    X, y = _batches(1)[0]

    def closure():
        loss = F.cross_entropy(model(X), y, reduction="sum")
        loss.backward()
        return loss

    opt.step(closure)
    assert_frozen_unchanged(model, snap)


def test_meanfield_refuses_a_parameter_frozen_after_construction():
    model = module_lora()
    opt = MESU(model.parameters(), model=model, mc_samples=2)
    model[0].lora_A.weight.requires_grad_(False)
    before = model[0].lora_A.weight.detach().clone()
    with pytest.raises(ValueError, match=r"\['0.lora_A.weight'\] were frozen"):
        opt.step(batch=_batches(1)[0])
    assert torch.equal(model[0].lora_A.weight, before)


def test_an_optimiser_without_any_trainable_parameter_is_refused():
    model = module_lora()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="none of the given parameters is trainable"):
        MESU(model.parameters(), model=model)
    with pytest.raises(ValueError, match="none of the given parameters is trainable"):
        BFRMSProp(model.parameters())


def test_param_groups_keep_their_indices_when_a_group_is_all_frozen():
    model = module_lora()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    opt = MESU([{"params": frozen, "sigma_prior": 0.1}, {"params": _trainable(model)}], model=model, mc_samples=2)
    assert opt.param_groups[0]["params"] == [] and opt.param_groups[0]["sigma_prior"] == 0.1
    assert opt.layout().dim == num_trainable(model)


def test_unfreezing_later_means_unfreeze_then_add_param_group():
    model = module_lora()
    base = list(model[2].base.parameters())
    opt = BFRMSProp(_trainable(model), lr=1e-2, batch_size=8)
    with pytest.raises(ValueError, match=r"every parameter of the group is frozen.*requires_grad_\(True\) on "
                                         r"them first"):
        opt.add_param_group({"params": base})             # the wrong order is refused, not dropped silently
    for p in base:
        p.requires_grad_(True)
    opt.add_param_group({"params": base})
    assert opt.param_groups[-1]["params"] == base
    _train(model, opt, _batches(1))
    assert opt.curvature().shape == (num_trainable(model),) * 2


# ------------------------------------------------------------------------------------------ filters
FACTORISED = {
    "natgrad": lambda ps: BFNatGrad(ps, batch_size=8),
    "rmsprop": lambda ps: BFRMSProp(ps, lr=1e-2, sigma2=0.5, batch_size=8),
    "rmsprop_ss": lambda ps: BFRMSPropSS(ps, lr=1e-2, sigma2=0.5, batch_size=8),
    "adam": lambda ps: BFAdam(ps, lr=1e-2, sigma2=0.5, batch_size=8),
    "adam_ss": lambda ps: BFAdamSS(ps, lr=1e-2, batch_size=8),
}
KRONECKER = {
    "kf_natgrad": lambda ps, m: KFNatGrad(ps, model=m, batch_size=8),
    "kf_bayes": lambda ps, m: KFBayes(ps, model=m, lr=1e-2, sigma2=1.0, batch_size=8, inv_every=2),
    "kf_whiten": lambda ps, m: KFWhiten(ps, model=m, lr=1e-2, batch_size=8, inv_every=2),
}


def _train(model, opt, batches):
    for X, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(X), y).backward()
        opt.step()


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("model_kind", list(MODELS))
@pytest.mark.parametrize("kind", list(FACTORISED))
def test_factorised_filters_leave_frozen_parameters_alone(kind, model_kind, named):
    model, ref = MODELS[model_kind](), MODELS[model_kind]()
    snap = frozen_snapshot(model)
    opt = FACTORISED[kind](model.named_parameters() if named else model.parameters())
    ref_opt = FACTORISED[kind]([(n, p) for n, p in ref.named_parameters() if p.requires_grad] if named
                               else _trainable(ref))
    data = _batches()
    _train(model, opt, data)
    _train(ref, ref_opt, data)
    assert_frozen_unchanged(model, snap)
    _assert_same_trainable(model, ref)
    _assert_no_state_for_frozen(opt, model)
    P = opt.curvature()                                   # raised "no posterior yet" for the frozen base
    assert P.shape == (num_trainable(model),) * 2
    torch.testing.assert_close(P.flat, ref_opt.curvature().flat, rtol=0, atol=0)
    if named:
        assert list(P.layout.names) == [n for n, p in model.named_parameters() if p.requires_grad]
    assert set(opt.effective_lr()) == set(ref_opt.effective_lr())


@pytest.mark.parametrize("kind", list(KRONECKER))
def test_kronecker_filters_give_frozen_layers_no_block(kind):
    model, ref = module_lora(), module_lora()
    snap = frozen_snapshot(model)
    opt = KRONECKER[kind](model.parameters(), model)      # refused the frozen base weight before
    ref_opt = KRONECKER[kind](_trainable(ref), ref)
    data = _batches()
    _train(model, opt, data)
    _train(ref, ref_opt, data)
    assert_frozen_unchanged(model, snap)
    _assert_same_trainable(model, ref)
    _assert_no_state_for_frozen(opt, model)
    P = opt.curvature()
    assert P.shape == (num_trainable(model),) * 2
    assert [b.weight_name for b in P.blocks] == ["0.lora_A.weight", "0.lora_B.weight", "2.lora_A.weight",
                                                  "2.lora_B.weight"]
    torch.testing.assert_close(P.to_dense(), ref_opt.curvature().to_dense(), rtol=0, atol=0)
    opt.close()
    ref_opt.close()


def test_kronecker_filter_names_the_module_of_raw_adapters():
    model = raw_lora()
    with pytest.raises(ValueError, match=r"module 'lora_A' \(ParameterList\) owns trainable parameter\(s\) 'lora_A.0'"):
        KFWhiten(model.parameters(), model=model)


def test_dense_kalman_filter_covers_only_the_trainable_parameters():
    model, ref = raw_lora(), raw_lora()
    snap = frozen_snapshot(model)
    d = num_trainable(model)
    cov = 0.01 * torch.eye(d, dtype=torch.float64)
    opt = DenseKalmanFilter(model.parameters(), prior_cov=cov, reduction="mean", batch_size=8)
    ref_opt = DenseKalmanFilter(_trainable(ref), prior_cov=cov, reduction="mean", batch_size=8)
    data = _batches()
    _train(model, opt, data)
    _train(ref, ref_opt, data)
    assert_frozen_unchanged(model, snap)
    _assert_same_trainable(model, ref)
    assert opt.covariance.shape == (d, d)


# ------------------------------------------------------------------------------------------ NGD, SGLD
@pytest.mark.parametrize("model_kind", list(MODELS))
def test_kaldi_ngd_and_sgld_leave_frozen_parameters_alone(model_kind):
    for make in (lambda ps: KaldiNGD(ps, lr=1e-2),
                 lambda ps: SGLD(ps, lr=1e-4, nbeta=10.0, localization=1.0,
                                 generator=torch.Generator().manual_seed(0))):
        model, ref = MODELS[model_kind](), MODELS[model_kind]()
        snap = frozen_snapshot(model)
        opt, ref_opt = make(model.parameters()), make(_trainable(ref))
        data = _batches()
        _train(model, opt, data)
        _train(ref, ref_opt, data)
        assert_frozen_unchanged(model, snap)
        _assert_same_trainable(model, ref)
        _assert_no_state_for_frozen(opt, model)   # SGLD kept an anchor copy of every frozen tensor before


@pytest.mark.parametrize("fisher", ["exact", "kfac"])
def test_natural_gradient_accepts_model_parameters_with_a_frozen_base(fisher):
    model, ref = module_lora(), module_lora()
    snap = frozen_snapshot(model)
    lik = CrossEntropy()
    opt = NaturalGradient(model.parameters(), model=model, likelihood=lik, curvature=fisher, fisher_ema=None)
    ref_opt = NaturalGradient(_trainable(ref), model=ref, likelihood=lik, curvature=fisher, fisher_ema=None)
    for m, o in ((model, opt), (ref, ref_opt)):
        for X, y in _batches(2):
            o.zero_grad()
            F.cross_entropy(m(X), y).backward()
            o.step(batch=(X, y))
    assert_frozen_unchanged(model, snap)
    _assert_same_trainable(model, ref)
    assert opt.curvature().shape == (num_trainable(model),) * 2


# ------------------------------------------------------------------------------------------ continual
def _penalised(penalty):
    """Shapes of what a penalty holds per parameter (or layer label for the Kronecker Laplace penalty)."""
    if isinstance(penalty, EWC):
        return [tuple(t.shape) for t in penalty.fishers[0]]
    if isinstance(penalty, SynapticIntelligence):
        return [tuple(t.shape) for t in penalty.Omega]
    return sorted(penalty.store)


def test_continual_learners_and_penalties_leave_frozen_parameters_alone():
    data = _batches(4)
    task = (torch.cat([X for X, _ in data]), torch.cat([y for _, y in data]))
    model = module_lora()
    shapes = [tuple(p.shape) for p in _trainable(model)]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    layers = ["0.lora_A", "0.lora_B", "2.lora_A", "2.lora_B"]
    for penalty, covered in ((EWC(lam=10.0), shapes), (EWC(lam=10.0, curvature="true", online=True, gamma=0.9), shapes),
                             (SynapticIntelligence(c=0.5), shapes),
                             (LaplacePenalty(structure="kron", lam=1.0, task_size=32), layers),
                             (LaplacePenalty(structure="diag", lam=1.0, task_size=32), sorted(names))):
        model = module_lora()
        snap = frozen_snapshot(model)
        learner = TorchLearner(model, torch.optim.SGD(model.parameters(), lr=0.1), penalty)
        for t in range(2):
            for X, y in data:
                learner.train_step(X, y)
            learner.on_task_end(t, task)
        learner.train_step(*data[0])                     # away from the anchor: the penalty acts
        assert float(penalty.loss(model).detach()) > 0
        assert_frozen_unchanged(model, snap)
        assert _penalised(penalty) == covered, type(penalty).__name__
    model = module_lora()
    snap = frozen_snapshot(model)
    learner = MeanFieldLearner(model, MESU(model.parameters(), model=model, mc_samples=2))
    for X, y in data:
        learner.train_step(X, y)
    assert_frozen_unchanged(model, snap)
    assert set(learner.sigma_stats()) - {"all"} == set(names)


def test_laplace_penalty_covers_only_trainable_parameters_and_refuses_frozen_names():
    model = module_lora()
    X, y = _batches(1, B=16)[0]
    pen = LaplacePenalty(structure="diag", lam=1.0, reduction="sum")
    pen.on_task_end(model, (X, y))
    assert set(pen.store) == {n for n, p in model.named_parameters() if p.requires_grad}
    bad = LaplacePenalty(structure="diag", lam=1.0, reduction="sum", params=["0.base.weight", "0.lora_A.weight"])
    with pytest.raises(ValueError, match=r"\['0.base.weight'\] are frozen"):
        bad.on_task_end(model, (X, y))
    assert math.isfinite(float(pen.loss(model).detach()))
