"""The continual runner: accuracy matrix, task-mix record, boundary hook delivery, bit-exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from curvkit.continual import (
    EWC,
    ContinualRunner,
    ContinuousSchedule,
    MeanFieldLearner,
    PermutedTasks,
    RunnerConfig,
    TaskStream,
    TorchLearner,
)
from curvkit.models import mlp
from curvkit.optim import MESU

M, D, B = 3, 24, 16
D_SHORT = 12  # task length of the resume tests (36 iterations in all)


def _stream(seed=0, d=D):
    g = torch.Generator().manual_seed(0)
    X = torch.rand(160, 12, generator=g)
    y = (X @ torch.randn(12, 3, generator=g)).argmax(1)
    return TaskStream(PermutedTasks(X[:120], y[:120], X[120:], y[120:], M), ContinuousSchedule(M, d), B, seed=seed)


def _mesu_learner():
    model = mlp([12, 16, 3], seed=0)
    return MeanFieldLearner(model, MESU(model.parameters(), model=model, sigma_prior=0.04, sigma_res=10.0, mc_samples=3, seed=1))


def _ewc_learner():
    model = mlp([12, 16, 3], seed=0)
    return TorchLearner(model, torch.optim.Adam(model.parameters(), lr=0.01), EWC(lam=5.0, online=True, gamma=0.9))


def _config(**kw):
    return RunnerConfig(eval_every=8, eval_mc_samples=4, progress=False, mix_stride=2, boundary_samples=40, **kw)


def test_accuracy_matrix_mix_and_sigma_of_a_tiny_run(tmp_path):
    model = mlp([12, 16, 3], seed=0)
    learner = TorchLearner(model, torch.optim.SGD(model.parameters(), lr=0.5))
    res = ContinualRunner(learner, _stream(), _config(), tmp_path).run()
    acc = res.accuracy("mc")
    assert acc.shape == (M * D // 8, M) and res.eval_iters == list(range(8, M * D + 1, 8))
    assert np.all((acc >= 0) & (acc <= 1))
    assert np.array_equal(acc, res.accuracy("map"))  # deterministic learner
    # the learner learns: each task, once trained on, is well above chance (1/3)
    final = acc[-1]
    assert final[-1] > 0.6, final
    assert res.complete and not res.uses_task_boundaries and res.boundary_calls == []
    mix = np.array(res.mix)
    iters = np.unique(mix[:, 0])
    assert np.array_equal(iters, np.arange(0, M * D, 2))
    for t in iters:
        assert mix[mix[:, 0] == t, 2].sum() == B
    assert (tmp_path / "results.json").exists() and (tmp_path / "checkpoint.pt").exists()

    res_b = ContinualRunner(_mesu_learner(), _stream(d=D_SHORT), _config()).run()
    assert len(res_b.sigma) == res_b.accuracy().shape[0] == M * D_SHORT // 8 + 1  # + the final evaluation
    assert set(res_b.sigma[0]) == {"0.weight", "0.bias", "2.weight", "2.bias", "all"}
    assert res_b.diagnostics["steps"] == M * D_SHORT


def test_boundary_hook_only_for_boundary_methods(tmp_path):
    res = ContinualRunner(_ewc_learner(), _stream(d=D_SHORT), _config()).run()
    assert res.uses_task_boundaries and res.boundary_calls == [(D_SHORT, 0), (2 * D_SHORT, 1)]


class _Killed(Exception):
    pass


@pytest.mark.parametrize("make", [_mesu_learner, _ewc_learner], ids=["mesu", "online-ewc"])
def test_killed_and_resumed_run_equals_uninterrupted_run(tmp_path, make):
    full_learner = make()
    full = ContinualRunner(full_learner, _stream(d=D_SHORT), _config(checkpoint_every=5), tmp_path / "full").run()

    # 1) a graceful stop via max_steps in the middle of a cross-fade (and not at an eval/checkpoint)
    part = ContinualRunner(make(), _stream(d=D_SHORT), _config(checkpoint_every=5), tmp_path / "b")
    part.run(max_steps=11)
    assert not part.result.complete and part.t == 11
    # 2) a crash: the learner dies at its 9th step after resuming at t = 11 (last checkpoint at t = 15),
    #    after the first task boundary (t = 12) has been delivered
    victim = make()
    calls = {"n": 0}
    orig = victim.train_step

    def dying(x, y):
        calls["n"] += 1
        if calls["n"] == 9:
            raise _Killed
        return orig(x, y)

    victim.train_step = dying  # type: ignore[method-assign]
    with pytest.raises(_Killed):
        ContinualRunner(victim, _stream(d=D_SHORT), _config(checkpoint_every=5), tmp_path / "b").run()
    # 3) resume with a freshly built learner
    resumed_learner = make()
    resumed = ContinualRunner(resumed_learner, _stream(d=D_SHORT), _config(checkpoint_every=5), tmp_path / "b").run()

    assert resumed.complete
    assert np.array_equal(full.accuracy("mc"), resumed.accuracy("mc"))
    assert np.array_equal(full.accuracy("map"), resumed.accuracy("map"))
    assert full.sigma == resumed.sigma and full.mix == resumed.mix and full.train_loss == resumed.train_loss
    assert full.boundary_calls == resumed.boundary_calls
    for a, b in zip(full_learner.model.parameters(), resumed_learner.model.parameters()):
        assert torch.equal(a, b)


def test_resume_refuses_a_different_configuration(tmp_path):
    ContinualRunner(_mesu_learner(), _stream(), _config(), tmp_path).run(max_steps=3)
    with pytest.raises(ValueError, match="different configuration"):
        ContinualRunner(_mesu_learner(), _stream(seed=1), _config(), tmp_path).run()
    with pytest.raises(ValueError, match="eval_every"):
        RunnerConfig(eval_every=0)
