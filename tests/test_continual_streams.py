"""Task sets, schedules and the task-agnostic stream of curvkit.continual (MESU digest Appendix A)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from curvkit.continual import (
    AbruptSchedule,
    ContinuousSchedule,
    DatasetSequence,
    PermutedTasks,
    SplitTasks,
    TaskStream,
    iters_per_epoch,
)


def _distinct_data(n_train=48, n_test=12, d=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n_train + n_test, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n_train + n_test,), generator=g)
    return X[:n_train], y[:n_train], X[n_train:], y[n_train:]


def _zeno_probs(M, D, beta, t):
    """Appendix A written out independently: piecewise-linear weights, then normalised."""
    T = M * D
    w = []
    for m in range(M):
        s = max(math.floor((beta * m - 1) * T / (beta * M)), 0)
        ps = math.floor((beta * m + 1) * T / (beta * M))
        pe = math.floor((beta * m + beta - 1) * T / (beta * M))
        e = min(math.floor((beta * m + beta + 1) * T / (beta * M)), T)
        if s <= t < ps:
            w.append(1.0 if m == 0 else (t - s) / (ps - s))
        elif ps <= t < pe:
            w.append(1.0)
        elif pe <= t < e:
            w.append(1.0 if m == M - 1 else (e - t) / (e - pe))
        else:
            w.append(0.0)
    w = np.array(w)
    return w / w.sum()


def test_continuous_schedule_matches_formula_and_hand_values():
    M, D = 4, 40
    sched = ContinuousSchedule(M, D, beta=4)
    assert sched.total_iters == 160
    for t in range(sched.total_iters):
        p = sched.probs(t)
        np.testing.assert_allclose(p, _zeno_probs(M, D, 4, t), atol=1e-15)
        assert p.min() >= 0 and abs(p.sum() - 1) < 1e-12
    # hand values: windows of task 0 (0, 10, 30, 50) and task 1 (30, 50, 70, 90)
    np.testing.assert_allclose(sched.probs(35), [0.75, 0.25, 0, 0])
    np.testing.assert_allclose(sched.probs(40), [0.5, 0.5, 0, 0])  # 50/50 at the boundary (m+1) D
    for m in range(M):  # pure phase [m D + D/4, m D + 3 D/4)
        for t in range(m * D + D // 4, m * D + 3 * D // 4):
            assert sched.probs(t)[m] == 1.0
    assert sched.boundaries() == {40: 0, 80: 1, 120: 2}


def test_abrupt_schedule_is_one_hot():
    sched = AbruptSchedule(3, 5)
    for t in range(15):
        p = sched.probs(t)
        assert p[t // 5] == 1.0 and p.sum() == 1.0
    with pytest.raises(IndexError):
        sched.probs(15)


def test_stream_composition_matches_schedule():
    """Per-task counts summed over the cross-fade window agree with sum_t B p_m(t) within 4 std."""
    Xa, ya, Xb, yb = _distinct_data()
    M, D, B = 3, 40, 64
    stream = TaskStream(PermutedTasks(Xa, ya, Xb, yb, M), ContinuousSchedule(M, D), B, seed=3)
    counts = np.zeros(M)
    expected = np.zeros(M)
    var = np.zeros(M)
    for t in range(25, 56):  # around the first boundary (t = 40)
        b = stream.batch(t)
        assert b.counts.sum() == B and b.x.shape == (B, 9)
        np.testing.assert_array_equal(b.counts, np.bincount(b.tasks.numpy(), minlength=M))
        p = stream.schedule.probs(t)
        counts += b.counts
        expected += B * p
        var += B * p * (1 - p)
    assert np.all(np.abs(counts - expected) <= 4 * np.sqrt(var) + 1e-9), (counts, expected)
    assert counts[0] > 0 and counts[1] > 0 and counts[2] == 0


def test_stream_rows_come_from_their_task_and_are_reproducible():
    Xa, ya, Xb, yb = _distinct_data()
    tasks = PermutedTasks(Xa, ya, Xb, yb, 3, permutation_seed=1)
    stream = TaskStream(tasks, ContinuousSchedule(3, 20), 32, seed=5)
    b = stream.batch(20)  # a mixed batch
    assert len(torch.unique(b.tasks)) == 2
    for row, label, m in zip(b.x, b.y, b.tasks.tolist()):
        inv = torch.argsort(tasks.permutations[m])
        original = row[inv]
        match = torch.nonzero((Xa == original).all(1)).flatten()
        assert match.numel() == 1 and ya[match[0]] == label
    b2 = stream.batch(20)
    assert torch.equal(b.x, b2.x) and torch.equal(b.tasks, b2.tasks)  # pure function of (seed, t)
    b3 = TaskStream(tasks, ContinuousSchedule(3, 20), 32, seed=6).batch(20)
    assert not torch.equal(b.x, b3.x)


def test_abrupt_stream_epochs_sample_without_replacement():
    Xa, ya, Xb, yb = _distinct_data(n_train=48)
    B = 16
    ipe = iters_per_epoch(48, B)
    stream = TaskStream(DatasetSequence([(Xa, ya, Xb, yb), (Xa + 1, ya, Xb + 1, yb)]), AbruptSchedule(2, 2 * ipe), B)
    for epoch in range(2):
        rows = torch.cat([stream.batch(epoch * ipe + j).x for j in range(ipe)])
        assert torch.unique(rows, dim=0).shape[0] == 48  # every example exactly once per epoch
    assert torch.equal(stream.batch(2 * ipe).tasks, torch.ones(B, dtype=torch.long))


def test_split_tasks_and_errors():
    Xa, ya, Xb, yb = _distinct_data()
    split = SplitTasks(Xa, ya, Xb, yb, [[0], [1, 2]])
    assert split.num_tasks == 2
    _, y = split.train_batch(1, torch.arange(split.train_size(1)))
    assert set(y.tolist()) <= {1, 2}
    _, yt = split.test_data(0)
    assert set(yt.tolist()) == {0}
    _, yr = SplitTasks(Xa, ya, Xb, yb, [[0], [1, 2]], relabel=True).train_batch(1, torch.arange(3))
    assert set(yr.tolist()) <= {0, 1}
    with pytest.raises(ValueError, match="disjoint"):
        SplitTasks(Xa, ya, Xb, yb, [[0, 1], [1]])
    with pytest.raises(ValueError, match="flat inputs"):
        PermutedTasks(Xa.reshape(48, 3, 3), ya, Xb, yb, 2)
    with pytest.raises(ValueError, match="tasks"):
        TaskStream(split, AbruptSchedule(3, 4), 8)
    with pytest.raises(ValueError, match="beta"):
        ContinuousSchedule(3, 10, beta=2)
    with pytest.raises(ValueError, match="NaN"):
        DatasetSequence([(Xa * float("nan"), ya, Xb, yb)])
