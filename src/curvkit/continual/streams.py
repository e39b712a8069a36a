"""Task sets, task schedules and the task-agnostic batch stream of the continual-learning harness.

Three pieces, each with one job:

* a :class:`TaskSet` says what the tasks are: :class:`PermutedTasks` (fixed-seed pixel permutations of
  one dataset, domain-incremental), :class:`SplitTasks` (disjoint class groups of one dataset) and
  :class:`DatasetSequence` (a list of datasets). Tasks are *views*: a permuted task never stores a
  permuted copy of the data; batches are transformed when drawn.
* a :class:`Schedule` says, for every iteration t in [0, T), which tasks the batch is drawn from:
  ``probs(t)`` is a probability vector over the M tasks. :class:`AbruptSchedule` (one task at a time,
  hard boundaries) and :class:`ContinuousSchedule` (the task-agnostic blend of Zeno et al. 2018, taken
  from their code ``igolan/bgd``, beta = 4; the MESU paper's Fig. 3a shows such a blend without giving
  its formula).
* a :class:`TaskStream` draws the batch of iteration t: each of the B slots draws a task from
  Categorical(p(t)), then an example of that task. The batch of iteration t is a **pure function of
  (seed, t)** (its random numbers come from a generator seeded with ``SeedSequence([seed, t])``), so the
  stream position is a single integer and a resumed run sees exactly the batches an uninterrupted run
  would.

Index sampling within a task (not stated in the MESU paper): under the continuous schedule every slot draws a
uniformly random training index (with replacement, as Zeno's sampler does). Under the abrupt schedule each
virtual epoch of a task walks through a fresh seeded permutation of its training set (sampling without
replacement; the last batch of an epoch wraps around when N is not a multiple of B).

The learner is never told which task a batch comes from. :class:`Batch` carries the per-slot task ids
and the per-task counts only so that the runner can record the task mix (MESU Fig. 3a).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


def iters_per_epoch(num_examples: int, batch_size: int) -> int:
    """Iterations of one virtual epoch, ceil(N / B) (469 for MNIST with B = 128).

    Without task boundaries the MESU paper's "epoch" has no natural end; a virtual epoch of ceil(N / B)
    iterations is the choice made here (as in Zeno et al.'s code)."""
    if num_examples < 1 or batch_size < 1:
        raise ValueError(f"need num_examples >= 1 and batch_size >= 1, got {num_examples}, {batch_size}")
    return math.ceil(num_examples / batch_size)


def _check_xy(X: Tensor, y: Tensor, what: str) -> None:
    if not isinstance(X, Tensor) or not isinstance(y, Tensor):
        raise TypeError(f"{what}: inputs and labels must be torch tensors")
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"{what}: {X.shape[0]} inputs but {y.shape[0]} labels")
    if y.dim() != 1:
        raise ValueError(f"{what}: labels must have shape (N,), got {tuple(y.shape)}")
    if X.shape[0] == 0:
        raise ValueError(f"{what}: empty data set")
    if X.is_floating_point() and not torch.isfinite(X).all():
        raise ValueError(f"{what}: inputs contain NaN or inf")


# --------------------------------------------------------------------------------------------- task sets
class TaskSet(ABC):
    """M tasks, each with a training set (drawn by index) and a test set."""

    num_tasks: int

    @abstractmethod
    def train_size(self, task: int) -> int:
        """Number of training examples of ``task``."""

    @abstractmethod
    def train_batch(self, task: int, index: Tensor) -> tuple[Tensor, Tensor]:
        """Training examples ``index`` (LongTensor (n,)) of ``task``: inputs (n, ...) and labels (n,)."""

    @abstractmethod
    def test_data(self, task: int, max_examples: int | None = None) -> tuple[Tensor, Tensor]:
        """The first ``max_examples`` test examples of ``task`` (all when None)."""

    def _check_task(self, task: int) -> None:
        if not 0 <= task < self.num_tasks:
            raise IndexError(f"task {task} out of range [0, {self.num_tasks})")


class PermutedTasks(TaskSet):
    """Permuted-MNIST-style tasks: task m applies a fixed pixel permutation to flat inputs (N, D).

    The permutations come from :func:`curvkit.data.transforms.pixel_permutation` with seed
    ``permutation_seed * 100_003 + m``; with ``identity_first=True`` task 0 keeps the original pixel
    order (Zeno's code). The MESU paper does not say which it uses, and for an MLP it does not matter
    (an MLP is equivariant to a fixed permutation of its inputs); the default uses M random permutations.
    The permutations are independent of the run seed, so every seed and every method sees the same tasks.
    """

    def __init__(
        self,
        X_train: Tensor,
        y_train: Tensor,
        X_test: Tensor,
        y_test: Tensor,
        num_tasks: int,
        permutation_seed: int = 0,
        identity_first: bool = False,
    ):
        from curvkit.data.transforms import pixel_permutation

        _check_xy(X_train, y_train, "PermutedTasks train")
        _check_xy(X_test, y_test, "PermutedTasks test")
        if X_train.dim() != 2 or X_test.dim() != 2 or X_train.shape[1] != X_test.shape[1]:
            raise ValueError(
                "PermutedTasks needs flat inputs (N, D) with the same D for train and test; got "
                f"{tuple(X_train.shape)} and {tuple(X_test.shape)} (use curvkit.data.transforms.flatten)"
            )
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        self.X_train, self.y_train, self.X_test, self.y_test = X_train, y_train, X_test, y_test
        self.num_tasks = int(num_tasks)
        d = X_train.shape[1]
        self.permutations = [
            torch.arange(d) if (identity_first and m == 0)
            else pixel_permutation(d, permutation_seed * 100_003 + m).long()
            for m in range(self.num_tasks)
        ]

    def train_size(self, task: int) -> int:
        return int(self.X_train.shape[0])

    def train_batch(self, task: int, index: Tensor) -> tuple[Tensor, Tensor]:
        self._check_task(task)
        return self.X_train[index][:, self.permutations[task]], self.y_train[index]

    def test_data(self, task: int, max_examples: int | None = None) -> tuple[Tensor, Tensor]:
        self._check_task(task)
        n = self.X_test.shape[0] if max_examples is None else min(int(max_examples), self.X_test.shape[0])
        return self.X_test[:n][:, self.permutations[task]], self.y_test[:n]


class SplitTasks(TaskSet):
    """Disjoint class groups of one dataset (e.g. split MNIST: [[0, 1], [2, 3], ...]).

    Labels keep their original values (class-incremental); with ``relabel=True`` they are mapped to
    0..len(group)-1 within each task (a shared multi-head-free "domain" variant).
    """

    def __init__(
        self,
        X_train: Tensor,
        y_train: Tensor,
        X_test: Tensor,
        y_test: Tensor,
        class_groups: Sequence[Sequence[int]],
        relabel: bool = False,
    ):
        _check_xy(X_train, y_train, "SplitTasks train")
        _check_xy(X_test, y_test, "SplitTasks test")
        groups = [sorted({int(c) for c in g}) for g in class_groups]
        if not groups or any(not g for g in groups):
            raise ValueError("class_groups must be a non-empty list of non-empty class lists")
        flat = [c for g in groups for c in g]
        if len(flat) != len(set(flat)):
            raise ValueError(f"class groups must be disjoint, got {groups}")
        self.groups = groups
        self.relabel = bool(relabel)
        self.num_tasks = len(groups)
        self.X_train, self.y_train, self.X_test, self.y_test = X_train, y_train, X_test, y_test
        self._train_idx, self._test_idx = [], []
        for g in groups:
            gt = torch.tensor(g, dtype=y_train.dtype)
            tr = torch.nonzero(torch.isin(y_train, gt)).flatten()
            te = torch.nonzero(torch.isin(y_test, gt)).flatten()
            if tr.numel() == 0 or te.numel() == 0:
                raise ValueError(f"class group {g} has no training or no test examples")
            self._train_idx.append(tr)
            self._test_idx.append(te)

    def _labels(self, task: int, y: Tensor) -> Tensor:
        if not self.relabel:
            return y
        lut = {c: i for i, c in enumerate(self.groups[task])}
        return torch.tensor([lut[int(v)] for v in y], dtype=y.dtype)

    def train_size(self, task: int) -> int:
        self._check_task(task)
        return int(self._train_idx[task].numel())

    def train_batch(self, task: int, index: Tensor) -> tuple[Tensor, Tensor]:
        self._check_task(task)
        rows = self._train_idx[task][index]
        return self.X_train[rows], self._labels(task, self.y_train[rows])

    def test_data(self, task: int, max_examples: int | None = None) -> tuple[Tensor, Tensor]:
        self._check_task(task)
        rows = self._test_idx[task]
        if max_examples is not None:
            rows = rows[: int(max_examples)]
        return self.X_test[rows], self._labels(task, self.y_test[rows])


class DatasetSequence(TaskSet):
    """A sequence of datasets ``[(X_train, y_train, X_test, y_test), ...]``, one per task (same input shape)."""

    def __init__(self, datasets: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]]):
        if not datasets:
            raise ValueError("DatasetSequence needs at least one dataset")
        shapes = set()
        for i, (xa, ya, xb, yb) in enumerate(datasets):
            _check_xy(xa, ya, f"dataset {i} train")
            _check_xy(xb, yb, f"dataset {i} test")
            shapes.add(tuple(xa.shape[1:]))
            shapes.add(tuple(xb.shape[1:]))
        if len(shapes) != 1:
            raise ValueError(f"all datasets must share one input shape, got {sorted(shapes)}")
        self.datasets = list(datasets)
        self.num_tasks = len(self.datasets)

    def train_size(self, task: int) -> int:
        self._check_task(task)
        return int(self.datasets[task][0].shape[0])

    def train_batch(self, task: int, index: Tensor) -> tuple[Tensor, Tensor]:
        self._check_task(task)
        X, y, _, _ = self.datasets[task]
        return X[index], y[index]

    def test_data(self, task: int, max_examples: int | None = None) -> tuple[Tensor, Tensor]:
        self._check_task(task)
        _, _, X, y = self.datasets[task]
        n = X.shape[0] if max_examples is None else min(int(max_examples), X.shape[0])
        return X[:n], y[:n]


# --------------------------------------------------------------------------------------------- schedules
class Schedule(ABC):
    """Which tasks feed iteration t, for t in [0, total_iters)."""

    num_tasks: int
    iters_per_task: int
    #: whether a batch may mix tasks (False: every batch comes from exactly one task)
    blended: bool

    @property
    def total_iters(self) -> int:
        """T = M * D iterations."""
        return self.num_tasks * self.iters_per_task

    @abstractmethod
    def probs(self, t: int) -> np.ndarray:
        """Task probabilities p(t), shape (M,), non-negative, summing to 1."""

    def boundaries(self) -> dict[int, int]:
        """Iteration -> task that ends there: ``{(m + 1) * D: m}`` for m = 0..M-2.

        This is the **only** task information a learner can receive, and only boundary-based methods
        (EWC, SI) receive it, through :meth:`curvkit.continual.learners.Learner.on_task_end`. Under the
        continuous schedule (m + 1) * D is the middle of the cross-fade, where tasks m and m + 1 are 50/50.
        """
        d = self.iters_per_task
        return {(m + 1) * d: m for m in range(self.num_tasks - 1)}

    def _check_t(self, t: int) -> None:
        if not 0 <= t < self.total_iters:
            raise IndexError(f"iteration {t} out of range [0, {self.total_iters})")


def _check_counts(num_tasks: int, iters_per_task: int) -> None:
    if num_tasks < 1 or iters_per_task < 1:
        raise ValueError(f"need num_tasks >= 1 and iters_per_task >= 1, got {num_tasks}, {iters_per_task}")


class AbruptSchedule(Schedule):
    """Task m alone during iterations [m D, (m + 1) D) (the classic task-by-task protocol)."""

    blended = False

    def __init__(self, num_tasks: int, iters_per_task: int):
        _check_counts(num_tasks, iters_per_task)
        self.num_tasks, self.iters_per_task = int(num_tasks), int(iters_per_task)

    def task_at(self, t: int) -> int:
        self._check_t(t)
        return t // self.iters_per_task

    def probs(self, t: int) -> np.ndarray:
        p = np.zeros(self.num_tasks)
        p[self.task_at(t)] = 1.0
        return p


class ContinuousSchedule(Schedule):
    """Zeno et al.'s continuous task-agnostic schedule (from their code ``igolan/bgd``; MESU paper Fig. 3a).

    With T = M D total iterations and the overlap parameter beta (= 4), task m has

        start      = max(floor((beta m - 1) T / (beta M)), 0)
        peak_start = floor((beta m + 1) T / (beta M))
        peak_end   = floor((beta m + beta - 1) T / (beta M))
        end        = min(floor((beta m + beta + 1) T / (beta M)), T)

    and an unnormalised weight that ramps linearly 0 -> 1 on [start, peak_start) (constant 1 for task 0),
    is 1 on [peak_start, peak_end), ramps 1 -> 0 on [peak_end, end) (constant 1 for the last task) and is
    0 elsewhere; p(t) is the normalised weight vector. With beta = 4 the cross-fade between tasks m and
    m + 1 spans [(m + 1) D - D/4, (m + 1) D + D/4) and the tasks are 50/50 at (m + 1) D.
    """

    blended = True

    def __init__(self, num_tasks: int, iters_per_task: int, beta: float = 4.0):
        _check_counts(num_tasks, iters_per_task)
        if not beta > 2:
            raise ValueError(f"beta must be > 2 (each task needs a pure phase), got {beta}")
        self.num_tasks, self.iters_per_task, self.beta = int(num_tasks), int(iters_per_task), float(beta)
        T, M, b = self.total_iters, self.num_tasks, self.beta
        self.windows = []
        for m in range(M):
            start = max(math.floor((b * m - 1) * T / (b * M)), 0)
            peak_start = math.floor((b * m + 1) * T / (b * M))
            peak_end = math.floor((b * m + b - 1) * T / (b * M))
            end = min(math.floor((b * m + b + 1) * T / (b * M)), T)
            self.windows.append((start, peak_start, peak_end, end))

    def weight(self, m: int, t: int) -> float:
        """Unnormalised weight of task m at iteration t (the piecewise-linear formula above)."""
        start, peak_start, peak_end, end = self.windows[m]
        if start <= t < peak_start:
            return 1.0 if m == 0 else (t - start) / (peak_start - start)
        if peak_start <= t < peak_end:
            return 1.0
        if peak_end <= t < end:
            return 1.0 if m == self.num_tasks - 1 else (end - t) / (end - peak_end)
        return 0.0

    def probs(self, t: int) -> np.ndarray:
        self._check_t(t)
        w = np.array([self.weight(m, t) for m in range(self.num_tasks)])
        total = w.sum()
        if total <= 0:  # cannot happen for beta > 2; guard against a silent all-zero vector
            raise RuntimeError(f"no task is active at iteration {t}")
        return w / total


# --------------------------------------------------------------------------------------------- stream
@dataclass
class Batch:
    """One training batch. ``x``, ``y`` go to the learner; ``tasks`` (B,) and ``counts`` (M,) are for logging."""

    t: int
    x: Tensor
    y: Tensor
    tasks: Tensor
    counts: np.ndarray


class TaskStream:
    """The batches of a continual run: ``batch(t)`` for t in [0, schedule.total_iters)."""

    def __init__(self, tasks: TaskSet, schedule: Schedule, batch_size: int, seed: int = 0):
        if tasks.num_tasks != schedule.num_tasks:
            raise ValueError(f"task set has {tasks.num_tasks} tasks but the schedule {schedule.num_tasks}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tasks, self.schedule, self.batch_size, self.seed = tasks, schedule, int(batch_size), int(seed)
        self._perm_cache: tuple[tuple[int, int], Tensor] | None = None

    @property
    def total_iters(self) -> int:
        return self.schedule.total_iters

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence([self.seed, *key]))

    def _epoch_permutation(self, task: int, epoch: int) -> Tensor:
        key = (task, epoch)
        if self._perm_cache is None or self._perm_cache[0] != key:
            n = self.tasks.train_size(task)
            perm = torch.from_numpy(self._rng(1, task, epoch).permutation(n))
            self._perm_cache = (key, perm)
        return self._perm_cache[1]

    def batch(self, t: int) -> Batch:
        sched, B = self.schedule, self.batch_size
        if not 0 <= t < sched.total_iters:
            raise IndexError(f"iteration {t} out of range [0, {sched.total_iters})")
        if not sched.blended:
            m = int(np.argmax(sched.probs(t)))
            n = self.tasks.train_size(m)
            ipe = iters_per_epoch(n, B)
            j = t - m * sched.iters_per_task
            perm = self._epoch_permutation(m, j // ipe)
            index = perm[(torch.arange(B) + (j % ipe) * B) % n]
            x, y = self.tasks.train_batch(m, index)
            task_ids = torch.full((B,), m, dtype=torch.long)
        else:
            rng = self._rng(0, t)
            task_ids = torch.from_numpy(rng.choice(sched.num_tasks, size=B, p=sched.probs(t))).long()
            xs: list[Tensor] = []
            ys: list[Tensor] = []
            order: list[Tensor] = []
            for m in torch.unique(task_ids).tolist():
                slots = torch.nonzero(task_ids == m).flatten()
                index = torch.from_numpy(rng.integers(0, self.tasks.train_size(m), size=slots.numel()))
                xm, ym = self.tasks.train_batch(m, index)
                xs.append(xm)
                ys.append(ym)
                order.append(slots)
            inv = torch.empty(B, dtype=torch.long)
            inv[torch.cat(order)] = torch.arange(B)
            x, y = torch.cat(xs)[inv], torch.cat(ys)[inv]
        counts = np.bincount(task_ids.numpy(), minlength=sched.num_tasks)
        return Batch(t, x, y, task_ids, counts)

    def task_data(self, task: int, num_examples: int) -> tuple[Tensor, Tensor]:
        """``num_examples`` seeded random training examples of ``task`` (for boundary hooks: EWC Fisher)."""
        n = self.tasks.train_size(task)
        k = min(int(num_examples), n)
        index = torch.from_numpy(self._rng(2, task).permutation(n)[:k])
        return self.tasks.train_batch(task, index)
