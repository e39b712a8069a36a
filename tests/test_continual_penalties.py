"""EWC (offline and online), SI and the diagonal Fisher of curvkit.continual.penalties."""

from __future__ import annotations

import pytest
import torch

from curvkit.continual import (
    EWC,
    AbruptSchedule,
    DatasetSequence,
    SynapticIntelligence,
    TaskStream,
    TorchLearner,
)
from curvkit.continual.penalties import diagonal_fisher
from curvkit.likelihoods import CrossEntropy
from curvkit.linalg.operator import DiagonalOperator
from curvkit.models import mlp
from reference import dense_empirical_fisher, dense_fisher_categorical


def _tiny(seed=0):
    model = mlp([4, 5, 3], "tanh", dtype=torch.float64, seed=seed)
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(7, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (7,), generator=g)
    return model, X, y


def test_diagonal_fisher_matches_dense_reference():
    model, X, y = _tiny()
    op = diagonal_fisher(model, X, y, curvature="empirical", chunk_size=3)
    assert isinstance(op, DiagonalOperator) and op.layout.names == ("0.weight", "0.bias", "2.weight", "2.bias")
    emp = op.flat
    ref = dense_empirical_fisher(model, CrossEntropy("mean"), (X, y)).diagonal()
    torch.testing.assert_close(emp, ref, rtol=1e-10, atol=1e-12)
    true = diagonal_fisher(model, X, curvature="true", chunk_size=4).flat
    ref_true = dense_fisher_categorical(model, (X, y), reduction="mean").diagonal()
    torch.testing.assert_close(true, ref_true, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="labels"):
        diagonal_fisher(model, X, None, curvature="empirical")
    with pytest.raises(ValueError, match="curvature must be"):
        diagonal_fisher(model, X, y, curvature="hessian")  # type: ignore[arg-type]


@pytest.mark.parametrize("fisher", ["empirical", "true"])
def test_ewc_zero_before_and_exact_quadratic_after_first_task(fisher):
    model, X, y = _tiny()
    ewc = EWC(lam=3.0, curvature=fisher)
    assert float(ewc.loss(model)) == 0.0  # before any boundary
    ewc.on_task_end(model, (X, y))
    assert float(ewc.loss(model).detach()) == 0.0  # at the anchor
    F = diagonal_fisher(model, X, y, curvature=fisher).tensors
    anchor = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    expected = 0.5 * 3.0 * sum(float((f * (p.detach() - a).pow(2)).sum()) for f, p, a in zip(F, model.parameters(), anchor))
    assert expected > 0
    assert float(ewc.loss(model).detach()) == pytest.approx(expected, rel=1e-12)
    # gradient of the penalty is lam F (theta - theta*)
    ewc.loss(model).backward()
    for f, p, a in zip(F, model.parameters(), anchor):
        torch.testing.assert_close(p.grad, 3.0 * f * (p.detach() - a))


def test_online_ewc_decay_and_offline_sum():
    model, X, y = _tiny()
    online = EWC(lam=1.0, online=True, gamma=0.5)
    offline = EWC(lam=1.0)
    F1 = diagonal_fisher(model, X, y).tensors
    online.on_task_end(model, (X, y))
    offline.on_task_end(model, (X, y))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.3)
    F2 = diagonal_fisher(model, X, y).tensors
    online.on_task_end(model, (X, y))
    offline.on_task_end(model, (X, y))
    assert len(online.fishers) == 1 and len(offline.fishers) == 2
    for Fo, f1, f2 in zip(online.fishers[0], F1, F2):
        torch.testing.assert_close(Fo, 0.5 * f1 + f2)
    for a, p in zip(online.anchors[0], model.parameters()):
        assert torch.equal(a, p.detach())  # anchor = the latest task's end
    with pytest.raises(ValueError, match="gamma"):
        EWC(lam=1.0, gamma=0.5)
    with pytest.raises(ValueError, match="lam"):
        EWC(lam=-1.0)


def test_si_path_integral_nonnegative_and_accumulating():
    """With plain SGD and no penalty each step adds lr * g^2 to omega (exactly), so omega >= 0."""
    model, X, y = _tiny()
    lr = 0.05
    si = SynapticIntelligence(c=0.0, xi=1e-3)  # c = 0: penalty inactive, pure SGD path
    learner = TorchLearner(model, torch.optim.SGD(model.parameters(), lr=lr), si)
    manual = [torch.zeros_like(p) for p in model.parameters()]
    start = [p.detach().clone() for p in model.parameters()]
    for _ in range(5):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(X), y).backward()
        g = [p.grad.detach().clone() for p in model.parameters()]
        for m, gi in zip(manual, g):
            m.add_(lr * gi * gi)
        learner.train_step(X, y)
    omega, normed = si.importance(model)
    for o, m in zip(omega, manual):
        torch.testing.assert_close(o, m)
        assert (o >= 0).all()
    delta = [p.detach() - s for p, s in zip(model.parameters(), start)]
    for n, o, d in zip(normed, omega, delta):
        torch.testing.assert_close(n, o / (d * d + 1e-3))
    assert float(si.loss(model)) == 0.0
    learner.on_task_end(0, (X, y))
    Omega1 = [t.clone() for t in si.Omega]
    assert all((t >= 0).all() for t in Omega1) and sum(float(t.sum()) for t in Omega1) > 0
    assert all(float(t.abs().sum()) == 0 for t in si.omega)  # reset for the next task
    for _ in range(3):
        learner.train_step(X, 1 - y.clamp(max=1))
    learner.on_task_end(1, (X, y))
    assert all((b >= a).all() for a, b in zip(Omega1, si.Omega))  # importance accumulates


def test_ewc_penalty_is_nonzero_after_first_task_in_a_run():
    """Through the learner + stream: the penalty is exactly 0 during task 0 and > 0 during task 1."""
    g = torch.Generator().manual_seed(1)
    X = torch.randn(64, 4, generator=g, dtype=torch.float64)
    ds = [(X, (X[:, 0] > 0).long(), X, (X[:, 0] > 0).long()), (X, (X[:, 1] > 0).long(), X, (X[:, 1] > 0).long())]
    stream = TaskStream(DatasetSequence(ds), AbruptSchedule(2, 8), 16, seed=0)
    model = mlp([4, 6, 2], dtype=torch.float64, seed=0)
    learner = TorchLearner(model, torch.optim.SGD(model.parameters(), lr=0.1), EWC(lam=10.0))
    assert learner.uses_task_boundaries
    pens = []
    for t in range(16):
        if t in stream.schedule.boundaries():
            learner.on_task_end(stream.schedule.boundaries()[t], stream.task_data(0, 64))
        b = stream.batch(t)
        pens.append(learner.train_step(b.x, b.y)["penalty"])
    assert all(p == 0.0 for p in pens[:9])  # includes the first step after the boundary (at the anchor)
    assert all(p > 0 for p in pens[9:])


def test_kron_penalty_takes_a_mapping_batch_in_batches():
    """A Hugging Face model's batch (a mapping of tensors) is split into ``batch_size`` pieces like a tensor
    batch; the penalty is 0.5 N dtheta^T C dtheta with C the KFLR operator of the whole batch."""
    transformers = pytest.importorskip("transformers")
    from curvkit.continual.laplace import LaplacePenalty
    from curvkit.curvature.estimators import KroneckerEstimator
    from curvkit.hf import HuggingFace
    from curvkit.likelihoods import CrossEntropy

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=20, n_positions=8, n_embd=4, n_layer=1, n_head=2)
    model = HuggingFace(transformers.GPT2LMHeadModel(cfg).to(torch.float64)).eval()
    g = torch.Generator().manual_seed(0)
    X = torch.randint(0, 20, (3, 5), generator=g)
    batch = ({"input_ids": X, "attention_mask": torch.ones_like(X)}, torch.randint(0, 20, (3, 5), generator=g))
    pen = LaplacePenalty(likelihood=CrossEntropy("sum"), structure="kron", curvature="kflr", prior_precision=0.0,
                         reduction="sum", batch_size=2)
    pen.consolidate(model, batch)
    est = KroneckerEstimator(model, CrossEntropy("mean"), "kflr").update(batch)
    params = dict(model.named_parameters())
    dv = 0.01 * torch.randn(est.layout.dim, generator=g, dtype=torch.float64)
    want = 0.5 * est.num_terms * (dv @ (est.operator() @ dv))
    with torch.no_grad():
        for n, t in zip(est.layout.names, est.layout.unflatten(dv)):
            params[n].add_(t)
    torch.testing.assert_close(pen.loss(model), want, atol=0, rtol=1e-9)
