"""Online / Non-Online / EWC Laplace for continual learning (thesis Sec. 5.3), float64 references.

* The penalty and its gradient equal the dense formula sum_i c_i d_i^T (G_i (x) A_i) d_i / 2 built with
  explicit Kronecker products (kron) or diagonals, for every mode, and autograd of :meth:`loss` equals the
  analytic :meth:`gradient`.
* Online Laplace with lam = 1 on linear-Gaussian tasks (where the Laplace approximation is exact) gives the
  joint posterior: mean and precision of all tasks' data at once.
* Checkpoint/resume: the continual runner and the task-sequence trainer resume to the same results as an
  uninterrupted run; a task that ends with a dead network raises instead of being reported as forgetting.
"""

import numpy as np
import pytest
import torch
from torch import nn

from curvkit import checkpoint
from curvkit.continual import (
    AbruptSchedule,
    ContinualRunner,
    DatasetSequence,
    PermutedTasks,
    RunnerConfig,
    TaskStream,
)
from curvkit.continual.laplace import LaplacePenalty, LRDecayLearner, MultiHead, decayed_lr
from curvkit.continual.task_sequence import SequenceConfig, TrainingCollapsed, train_task_sequence
from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.likelihoods import CrossEntropy, Gaussian
from curvkit.models import mlp
from curvkit.structure import UnsupportedModelError

DT = torch.float64


def _tasks(n_tasks=3, n=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 4, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)) for _ in range(n_tasks)]


def _perturb(net, scale, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _w_hat_flat(net):
    out = []
    for lin in (m for m in net if isinstance(m, nn.Linear)):
        out.append(torch.cat([lin.weight, lin.bias[:, None]], 1).reshape(-1))
    return out


@pytest.mark.parametrize("mode", ["online", "ewc"])
@pytest.mark.parametrize("curvature", ["kron", "diag"])
def test_penalty_and_gradient_equal_the_dense_formula(mode, curvature):
    net = mlp([4, 5, 3], "tanh", dtype=DT, seed=0)
    pen = LaplacePenalty(structure=curvature, mode=mode, lam=3.0, prior_precision=0.1, task_size=30)
    stored = []  # (per-layer factors or diagonals, coefficient, anchors)
    for i, (X, y) in enumerate(_tasks()):
        _perturb(net, 0.3, i)
        pen.consolidate(net, (X, y), num_data=30 + 10 * i)
        if curvature == "kron":
            op = KroneckerEstimator(net, CrossEntropy("mean"), "kflr").update((X, y)).operator()
            curv = [torch.kron(b.G, b.A) for b in op.blocks]
        else:
            from curvkit.curvature import GGNOperator

            d = GGNOperator(net, CrossEntropy("mean"), (X, y)).diagonal()
            # per layer in the W_hat order [W | b]
            curv = []
            for wi, bi in ((0, 1), (2, 3)):
                W, b = d.tensors[wi], d.tensors[bi]
                curv.append(torch.diag(torch.cat([W, b[:, None]], 1).reshape(-1)))
        stored.append((curv, 3.0 * (30 + 10 * i), [w.detach().clone() for w in _w_hat_flat(net)]))
    _perturb(net, 0.2, 99)
    theta = [w for w in _w_hat_flat(net)]
    leaves = [t.detach().requires_grad_(True) for t in theta]
    ref = torch.zeros((), dtype=DT)
    for curv, c, anchors in stored:  # online: every task's curvature around the LATEST mode
        for l, (C, w) in enumerate(zip(curv, leaves)):
            a = anchors[l] if mode == "ewc" else stored[-1][2][l]
            ref = ref + 0.5 * c * (w - a) @ C @ (w - a)
    for l, w in enumerate(leaves):
        a0 = torch.zeros_like(w) if mode == "ewc" else stored[-1][2][l]
        ref = ref + 0.5 * 0.1 * ((w - a0) ** 2).sum()
    ref = ref / 30
    got = pen.loss(net)
    torch.testing.assert_close(got, ref)
    ref_grads = torch.autograd.grad(ref, leaves)
    net.zero_grad()
    got.backward()
    analytic = pen.gradient(net)
    for lin, gref, ga in zip([m for m in net if isinstance(m, nn.Linear)], ref_grads, (analytic[0:2], analytic[2:4])):
        g_hat = torch.cat([lin.weight.grad, lin.bias.grad[:, None]], 1).reshape(-1)
        torch.testing.assert_close(g_hat, gref)
        torch.testing.assert_close(torch.cat([ga[0], ga[1][:, None]], 1).reshape(-1), gref)


def _linear_gaussian_tasks(T=3, n=15, D=3, seed=0, same_inputs=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(D, generator=g, dtype=DT)
    X0 = torch.randn(n, D, generator=g, dtype=DT)
    out = []
    for t in range(T):
        X = X0 if same_inputs else torch.randn(n + 5 * t, D, generator=g, dtype=DT) + t
        out.append((X, (X @ w + 0.5 + 0.3 * torch.randn(X.shape[0], generator=g, dtype=DT))[:, None]))
    return out


def _map(model, pen, X, y, lik):
    opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=500, tolerance_grad=1e-13, tolerance_change=1e-15,
                            history_size=50, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = lik(model(X), y) + pen.loss(model)
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)


@pytest.mark.parametrize("memory,same", [("per_task", False), ("summed", True)])
def test_online_laplace_with_lam_one_is_the_joint_posterior_of_linear_gaussian_tasks(memory, same):
    tasks = _linear_gaussian_tasks(same_inputs=same)
    lik, lam0 = Gaussian("sum", sigma=0.3), 0.5
    model = nn.Linear(3, 1).to(DT)
    pen = LaplacePenalty(structure="kron", mode="online", lam=1.0, prior_precision=lam0, memory=memory,
                         likelihood=lik, reduction="sum")
    for X, y in tasks:
        _map(model, pen, X, y, lik)
        pen.consolidate(model, (X, y))
    Phi = torch.cat([torch.cat([X, torch.ones(X.shape[0], 1, dtype=DT)], 1) for X, _ in tasks])
    Y = torch.cat([y for _, y in tasks])[:, 0]
    P = Phi.T @ Phi / 0.3**2 + lam0 * torch.eye(4, dtype=DT)
    m = torch.linalg.solve(P, Phi.T @ Y / 0.3**2)
    got = torch.cat([model.weight.detach()[0], model.bias.detach()])
    torch.testing.assert_close(got, m, atol=1e-7, rtol=1e-7)
    s = pen.store["<root>"]
    prec = sum(c * torch.kron(G, A) for c, G, A in zip(s["coef"], s["G"], s["A"])) + lam0 * torch.eye(4, dtype=DT)
    torch.testing.assert_close(prec, P)


def test_summed_memory_is_constant_and_per_task_memory_grows():
    net = mlp([4, 5, 3], "tanh", dtype=DT, seed=0)
    per, summ = (LaplacePenalty(memory=m, task_size=30) for m in ("per_task", "summed"))
    sizes = []
    for X, y in _tasks(4):
        per.consolidate(net, (X, y))
        summ.consolidate(net, (X, y))
        sizes.append((per.memory_numel(), summ.memory_numel()))
    assert [s[1] for s in sizes] == [sizes[0][1]] * 4
    inc = np.diff([s[0] for s in sizes])
    assert inc[0] > 0 and np.all(inc == inc[0])


def test_non_online_recomputes_every_task_at_the_latest_mode():
    net = mlp([4, 5, 3], "tanh", dtype=DT, seed=0)
    tasks = _tasks(2)
    pen = LaplacePenalty(mode="non_online", lam=2.0, task_size=30, task_data=lambda j: tasks[j])
    pen.consolidate(net, tasks[0])
    _perturb(net, 0.5, 1)
    pen.consolidate(net, tasks[1])
    s = pen.store["0"]
    for j in range(2):
        op = KroneckerEstimator(net, CrossEntropy("mean"), "kflr").update(tasks[j]).operator()
        torch.testing.assert_close(s["G"][j], op.blocks[0].G)
        torch.testing.assert_close(s["A"][j], op.blocks[0].A)
    torch.testing.assert_close(s["coef"], torch.tensor([60.0, 60.0], dtype=DT))


def test_errors_and_lr_decay():
    assert decayed_lr(0.1, 0.5, 0) == 0.1 and decayed_lr(0.1, 0.5, 4) == pytest.approx(0.1 / 3)
    with pytest.raises(ValueError, match="task_size"):
        LaplacePenalty()
    with pytest.raises(ValueError, match="task_data"):
        LaplacePenalty(mode="non_online", task_size=1)
    with pytest.raises(ValueError, match="summed"):
        LaplacePenalty(mode="ewc", memory="summed", task_size=1)
    lin = nn.Linear(4, 4)  # (an unregistered class such as PReLU is taken: curvkit.layerkinds.generic)
    net = nn.Sequential(nn.Linear(4, 4), lin, nn.Tanh(), lin)
    with pytest.raises(UnsupportedModelError, match="registered under 2 names"):
        LaplacePenalty(task_size=10).loss(net)


def _perm_tasks(n=120, d=12, M=3):
    g = torch.Generator().manual_seed(0)
    X = torch.rand(n + 40, d, generator=g)
    y = (X @ torch.randn(d, 3, generator=g)).argmax(1)
    return PermutedTasks(X[:n], y[:n], X[n:], y[n:], M)


def _runner_learner():
    model = mlp([12, 16, 3], seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    pen = LaplacePenalty(structure="kron", mode="online", lam=3.0, task_size=120)
    return LRDecayLearner(model, opt, pen, k=1.0)


def test_runner_resume_equals_an_uninterrupted_run_and_lr_decays(tmp_path):
    cfg = RunnerConfig(eval_every=6, progress=False, boundary_samples=120)
    stream = TaskStream(_perm_tasks(), AbruptSchedule(3, 12), 16, seed=0)
    full = ContinualRunner(_runner_learner(), stream, cfg, tmp_path / "a").run()
    first = ContinualRunner(_runner_learner(), stream, cfg, tmp_path / "b")
    first.run(max_steps=17)
    learner = _runner_learner()
    resumed = ContinualRunner(learner, stream, cfg, tmp_path / "b").run()
    assert resumed.acc_mc == full.acc_mc and resumed.boundary_calls == full.boundary_calls
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(0.2 / 3)  # task index 2
    assert learner.penalty.tasks_seen == 2


def _cfg(**kw):
    base = dict(optimizer="momentum", lr=0.1, momentum=0.9, batch_size=16, min_epochs=2, max_epochs=4, patience=1,
                val_size=20, lr_decay_k=0.5, curvature_batch=50)
    base.update(kw)
    return SequenceConfig(**base)


def test_sequence_trainer_resumes_to_the_same_results_single_head(tmp_path):
    tasks = _perm_tasks()
    def run(out, max_tasks=None):
        model = mlp([12, 16, 3], seed=0)
        pen = LaplacePenalty(structure="kron", lam=3.0, task_size=1)
        return train_task_sequence(model, tasks, pen, _cfg(), out, max_tasks=max_tasks), pen

    full, _ = run(tmp_path / "a")
    run(tmp_path / "b", max_tasks=2)
    resumed, pen = run(tmp_path / "b")
    assert resumed.acc == full.acc and resumed.val_err == full.val_err
    assert pen.tasks_seen == 3 and pen.task_size == 100  # 120 - 20 held out for validation
    assert all(2 <= e <= 4 for e in full.epochs)
    assert full.lr == pytest.approx([0.1, 0.1 / 1.5, 0.05])
    assert full.mean_seen()[0] > 0.5  # the first task is learnt (chance is 1/3)


def test_multi_head_trainer_penalises_the_trunk_and_keeps_each_head(tmp_path, make_linear_tasks):
    data = make_linear_tasks(n_train=80, n_test=20, uniform=True)
    torch.manual_seed(0)
    model = MultiHead(nn.Sequential(nn.Linear(8, 10), nn.ReLU()), [nn.Linear(10, 3) for _ in range(2)])
    pen = LaplacePenalty(structure="diag", lam=10.0, task_size=1, params=model.shared_parameters())
    res = train_task_sequence(model, DatasetSequence(data), pen, _cfg(multi_head=True), tmp_path)
    assert np.isnan(res.acc[0][1]) and not np.isnan(res.acc[1][0])
    assert set(pen.store) == {"trunk.0.weight", "trunk.0.bias"}
    model.set_task(0)
    assert model.task == 0



def test_a_task_ending_with_a_dead_network_raises_and_keeps_the_finished_tasks(tmp_path, make_linear_tasks):
    # A trunk whose ReLUs are all off makes every output the head's bias: one class for all inputs. Training
    # cannot revive it (no gradient reaches the trunk), so the trainer must refuse to report the task as learnt.
    def model():
        torch.manual_seed(0)
        return MultiHead(nn.Sequential(nn.Linear(8, 10), nn.ReLU()), [nn.Linear(10, 3) for _ in range(2)])

    tasks, cfg = DatasetSequence(make_linear_tasks()), _cfg(multi_head=True)
    first = train_task_sequence(model(), tasks, None, cfg, tmp_path, max_tasks=1)
    y_test = tasks.test_data(0)[1]
    assert first.acc[0][0] > float(y_test.bincount().max()) / len(y_test) + 0.1  # a healthy network learns task 0
    state = checkpoint.load(tmp_path / "sequence.pt")
    state["model"]["trunk.0.bias"].fill_(-1e3)  # the ReLUs die between the tasks
    checkpoint.save(state, tmp_path / "sequence.pt")
    with pytest.raises(TrainingCollapsed, match=r"task 1: .* same output for every validation input"):
        train_task_sequence(model(), tasks, None, cfg, tmp_path)
    kept = checkpoint.load(tmp_path / "sequence.pt")
    assert kept["task"] == 1 and kept["result"]["acc"][0][0] == first.acc[0][0]  # the finished task is kept
    assert issubclass(TrainingCollapsed, FloatingPointError)  # retried like a divergence by the experiments


@pytest.mark.parametrize("curvature", ["kron", "diag"])
def test_curvature_bound_bounds_the_penalty_hessian(curvature):
    net = mlp([4, 5, 3], "tanh", dtype=DT, seed=0)
    pen = LaplacePenalty(structure=curvature, lam=2.0, prior_precision=0.3, task_size=7)
    for i, task in enumerate(_tasks(3)):
        _perturb(net, 0.3, i)
        pen.consolidate(net, task)
    # the penalty's Hessian per layer, formed densely from the stored factors / diagonals
    tops = []
    for blk in pen.store.values():
        if curvature == "kron":
            dense = sum(c * torch.kron(G, A) for c, G, A in zip(blk["coef"], blk["G"], blk["A"]))
        else:
            dense = torch.diag((blk["coef"].reshape(-1, *[1] * (blk["F"].dim() - 1)) * blk["F"]).sum(0).reshape(-1))
        dense = (dense + 0.3 * torch.eye(dense.shape[0], dtype=DT)) / 7
        tops.append(float(torch.linalg.eigvalsh(dense)[-1]))
    top = max(tops)
    assert top <= pen.curvature_bound() * (1 + 1e-9) and pen.curvature_bound() < 50 * top
