"""Online / EWC / Non-Online Laplace penalties (thesis Sec. 5.3) on the models the Kronecker engine supports:
a transformer classifier, a ViT (raw class token and position table), a ResNet in eval mode, a Conv1d tagger
(grouped convolution, GroupNorm, per-time-step outputs with padding) and a LoRA-adapted GPT (frozen base).

The penalty, its autograd gradient and its analytic gradient equal the dense formula
sum_i c_i (theta - mu_i)^T P_i (theta - mu_i) / 2 + lam_0 |theta - mu_0|^2 / 2 with P_i the dense Kronecker
operator of the task's curvature (every block kind: embeddings with a diagonal input factor, q/k/v slices,
convolution groups, the plain (1, P) blocks of normalisation layers and raw parameters) or the exact GGN
diagonal, and c_i = lam N_i with N_i the task's LOSS TERMS (counted positions for sequence outputs).
"""

from __future__ import annotations

import pytest
import torch

from curvkit.continual.laplace import LaplacePenalty
from curvkit.curvature import GGNOperator
from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.linalg.layout import ParamLayout
from tiny_models import CASES, gen, tiny_case

pytestmark = pytest.mark.usefixtures("float64_default")


def _theta(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def _perturb(model, scale: float, seed: int) -> None:
    g = gen(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g))


def _tasks(X, y):
    return [(X, y), (X.flip(0), y.flip(0))]


def _terms(lik, model, X, y) -> int:
    with torch.no_grad():
        return lik.num_terms(model(X), y)


def _curvature(model, lik, data, curvature: str) -> torch.Tensor:
    """Dense curvature of the mean loss over the task's terms: the Kronecker operator of every block, or the
    exact GGN diagonal."""
    if curvature == "kron":
        return KroneckerEstimator(model, lik, "kflr").update(data).operator().to_dense()
    return torch.diag(GGNOperator(model, lik, data).diagonal().flat)


@pytest.mark.parametrize("mode", ["online", "ewc"])
@pytest.mark.parametrize("curvature", ["kron", "diag"])
@pytest.mark.parametrize("name", CASES)
def test_penalty_and_gradients_equal_the_dense_formula(name, curvature, mode):
    model, lik, (X, y) = tiny_case(name)
    model.eval()
    lam, lam0, size = 2.0, 0.1, 7
    pen = LaplacePenalty(structure=curvature, mode=mode, lam=lam, prior_precision=lam0, task_size=size,
                         likelihood=lik, curvature="kflr" if curvature == "kron" else "ggn")
    stored = []
    for i, (Xi, yi) in enumerate(_tasks(X, y)):
        _perturb(model, 0.2, i)
        pen.consolidate(model, (Xi, yi))
        terms = _terms(lik, model, Xi, yi)
        assert pen.sizes[-1] == terms  # N_i: the task's loss terms (counted positions for sequences)
        stored.append((_curvature(model, lik, (Xi, yi), curvature), lam * terms, _theta(model)))
    _perturb(model, 0.1, 9)
    theta = _theta(model).requires_grad_(True)
    ref = torch.zeros(())
    for P, c, anchor in stored:
        a = anchor if mode == "ewc" else stored[-1][2]
        ref = ref + 0.5 * c * (theta - a) @ P @ (theta - a)
    a0 = torch.zeros_like(theta) if mode == "ewc" else stored[-1][2]
    ref = (ref + 0.5 * lam0 * ((theta - a0) ** 2).sum()) / size
    got = pen.loss(model)
    torch.testing.assert_close(got, ref.detach(), rtol=1e-10, atol=1e-12)
    params = [p for p in model.parameters() if p.requires_grad]
    auto = torch.cat([g.reshape(-1) for g in torch.autograd.grad(got, params)])
    (gref,) = torch.autograd.grad(ref, theta)
    torch.testing.assert_close(auto, gref, rtol=1e-10, atol=1e-12)
    analytic = torch.cat([g.reshape(-1) for g in pen.gradient(model)])
    torch.testing.assert_close(analytic, gref, rtol=1e-10, atol=1e-12)
    assert pen.curvature_bound() >= float(torch.linalg.eigvalsh(
        sum(c * P for P, c, _ in stored) / size)[-1]) * (1 - 1e-9)


@pytest.mark.parametrize("memory", ["per_task", "summed"])
def test_non_online_and_summed_memory_on_a_vit(memory):
    """Non-Online Laplace recomputes every task's curvature at the latest mode; 'summed' keeps one pair of
    factors per block, (sum c_i) (sum w_i G_i) (x) (sum w_i A_i) with w_i = c_i / sum c_j."""
    model, lik, (X, y) = tiny_case("vit")
    tasks = _tasks(X, y)
    pen = LaplacePenalty(structure="kron", mode="non_online", lam=1.5, prior_precision=0.2, task_size=5,
                         likelihood=lik, memory=memory, task_data=lambda j: tasks[j])
    for i, task in enumerate(tasks):
        _perturb(model, 0.2, i)
        pen.consolidate(model, task)
    mode = _theta(model)
    ops = [KroneckerEstimator(model, lik, "kflr").update(t).operator() for t in tasks]  # at the latest mode
    cs = [1.5 * t[0].shape[0] for t in tasks]
    if memory == "per_task":
        P = sum(c * op.to_dense() for c, op in zip(cs, ops))
    else:
        from curvkit.linalg.kron import KroneckerBlock, KroneckerOperator

        w = [c / sum(cs) for c in cs]
        blocks = [KroneckerBlock(w[0] * b0.G + w[1] * b1.G, w[0] * b0.A + w[1] * b1.A, b0.weight_name, b0.bias_name,
                                 b0.index, b0.label, b0.factored) for b0, b1 in zip(ops[0].blocks, ops[1].blocks)]
        P = sum(cs) * KroneckerOperator(ops[0].layout, blocks).to_dense()
    _perturb(model, 0.1, 9)
    d = _theta(model) - mode
    ref = (0.5 * d @ P @ d + 0.5 * 0.2 * d @ d) / 5
    torch.testing.assert_close(pen.loss(model), ref, rtol=1e-10, atol=1e-12)
    assert len(pen.store) == len(ops[0].blocks) and all(len(s["coef"]) == (2 if memory == "per_task" else 1)
                                                       for s in pen.store.values())


def test_state_dict_round_trip_and_lora_subset():
    """A LoRA-adapted GPT: only the adapters are penalised (the frozen base has no blocks); the state_dict
    restores the same penalty in a fresh object."""
    model, lik, (ids, y) = tiny_case("lora_gpt")
    pen = LaplacePenalty(structure="kron", lam=1.0, task_size=9, likelihood=lik)
    pen.consolidate(model, (ids, y))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    layout = ParamLayout.from_module(model)
    assert set(layout.names) == trainable and all("lora_" in n for n in trainable)
    assert {k for k in pen.store} == {b.label for b in pen.layers(model)}
    _perturb(model, 0.1, 3)
    fresh = LaplacePenalty(structure="kron", lam=1.0, task_size=9, likelihood=lik)
    fresh.load_state_dict(pen.state_dict())
    torch.testing.assert_close(fresh.loss(model), pen.loss(model))


def test_unsupported_layer_and_tied_weight_are_named():
    from torch import nn

    from curvkit.architectures import causal_lm
    from curvkit.structure import UnsupportedModelError

    tied = causal_lm(vocab_size=5, max_len=4, dim=4, depth=1, heads=2, mlp_dim=4, tie_weights=True)
    assert "tok_embed + lm_head" in [lay.label for lay in LaplacePenalty(task_size=3).layers(tied)]
    lin = nn.Linear(4, 4)  # (an unregistered class such as PReLU is taken: curvkit.layerkinds.generic)
    odd = nn.Sequential(nn.Linear(3, 4), lin, nn.Tanh(), lin)
    with pytest.raises(UnsupportedModelError, match=r"'1' \(Linear\) is registered under 2 names"):
        LaplacePenalty(task_size=3).loss(odd)


class _Wrap(torch.nn.Module):
    def __init__(self, inner, how):
        super().__init__()
        self.inner, self.how = inner, how

    def forward(self, x):
        f = self.inner(x)
        return (f, x) if self.how == "tuple" else f.softmax(-1)


def _snapshot(model):
    return ([p.detach().clone() for p in model.parameters()], [b.clone() for b in model.buffers()], model.training,
            [p.requires_grad for p in model.parameters()])


@pytest.mark.parametrize("curvature", ["kron", "diag"])
def test_bad_input_is_refused_and_changes_nothing(curvature):
    """NaN in a task's batch, padding without ignore_index, a model that returns a tuple or probabilities: a clear
    error naming what is wrong (not a misleading one from deeper in the engine), and the model (parameters,
    buffers, train/eval mode, requires_grad) and the penalty are unchanged."""
    import copy
    import math

    from curvkit.likelihoods import CrossEntropy

    vit, lik, (X, y) = tiny_case("vit")
    vit.train()
    gpt, _, (ids, yt) = tiny_case("lora_gpt")
    Xbad = X.clone()
    Xbad[1, 0, 2, 2] = math.nan
    cases = [
        (vit, lik, (Xbad, y), ValueError, r"batch 0 X contains NaN or inf \(1 of 80 entries\)"),
        (gpt, CrossEntropy(), (ids, yt), ValueError, r"padding is not enabled: for padded positions pass "
                                                     r"CrossEntropy\(ignore_index=...\)"),
        (_Wrap(copy.deepcopy(vit), "tuple"), lik, (X, y), TypeError, r"one tensor .* got tuple"),
        (_Wrap(copy.deepcopy(vit), "probs"), lik, (X, y), ValueError, r"look like probabilities"),
    ]
    for model, likelihood, data, err, match in cases:
        before = _snapshot(model)
        pen = LaplacePenalty(structure=curvature, task_size=5, likelihood=likelihood)
        with pytest.raises(err, match=match):
            pen.on_task_end(model, data)
        after = _snapshot(model)
        assert all(torch.equal(a, b) for a, b in zip(after[0] + after[1], before[0] + before[1]))
        assert after[2:] == before[2:]
        assert pen.tasks_seen == 0 and pen.store == {} and pen.sizes == []
