"""Task-by-task training for the online Laplace experiments (thesis Sec. 5.4.1): per task a fresh optimiser
with the decayed learning rate ``lr0 / (1 + k t)``, at least ``min_epochs`` epochs, early stopping once the
validation error has not improved for ``patience`` epochs (the best-validation parameters are kept), then
the penalty's consolidation on the task's training data and a test evaluation on every task. Single-head
or multi-head (:class:`curvkit.continual.laplace.MultiHead`: the task's head is selected while it trains
and is evaluated); ``joint=True`` trains on the union of all tasks seen so far instead (the upper bound of
Fig. 5.7), continuing from the previous network.

The continual runner (:class:`curvkit.continual.ContinualRunner`) trains for a fixed number of iterations
per task and never tells a learner the task, which early stopping and multi-head models need; this trainer
is the task-aware protocol. It checkpoints after every task (model, penalty, results; atomically through
:mod:`curvkit.checkpoint`) and resumes from the last finished task: every batch order is a function of
(seed, task, epoch), so a resumed run equals an uninterrupted one.

A task that ends with a network whose output is the same for every validation input of that task raises
:class:`TrainingCollapsed` instead of being consolidated and reported: such a network has stopped learning
(dead units), and its accuracies would read as catastrophic forgetting.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from curvkit import checkpoint
from curvkit.continual.laplace import decayed_lr
from curvkit.continual.penalties import Penalty
from curvkit.continual.streams import TaskSet
from curvkit.validation import integer, nonnegative, positive

__all__ = ["SequenceConfig", "SequenceResult", "TrainingCollapsed", "task_batches", "train_task_sequence"]


class TrainingCollapsed(FloatingPointError):
    """The network stopped depending on its input while a task was trained: at the best validation epoch its
    output is the same for every validation input of that task (whose labels are not all one class). The
    usual cause is a dead ReLU layer after too large steps at the task's start (a fresh head on a trained
    trunk gives large gradients); a smaller learning rate or a larger ``lr_decay_k`` avoids it. A subclass of
    ``FloatingPointError`` because it is a divergence of the optimisation without a NaN, and callers that
    retry diverged runs (the thesis tunes k "to prevent the objective from diverging") treat both alike."""


@dataclass
class SequenceConfig:
    """Optimisation protocol (thesis Sec. 5.4.1 defaults: momentum SGD, lr 1e-2, momentum 0.95)."""

    optimizer: Literal["momentum", "nesterov", "adam"] = "momentum"
    lr: float = 1e-2
    momentum: float = 0.95
    lr_decay_k: float = 0.0
    step_decay_every: int | None = None  # epochs between lr /= 10 within a task (Nesterov: 5)
    batch_size: int = 250
    min_epochs: int = 10
    max_epochs: int = 20
    patience: int = 5
    val_size: int = 10000
    eval_max_test: int | None = None
    curvature_batch: int = 1000
    multi_head: bool = False
    joint: bool = False
    task_lr_factor: tuple[float, ...] = ()  # extra factor on task t's initial lr (disjoint MNIST: 1/max(1, lam/10))
    lr_cap: bool = False  # cap a task's lr at (1 + momentum) / L, L = the penalty's curvature bound (half the
    # heavy-ball stability limit 2 (1 + momentum) / L): our safeguard where the thesis tunes k by hand
    seed: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in ("momentum", "nesterov", "adam"):
            raise ValueError(f"optimizer must be 'momentum', 'nesterov' or 'adam', got {self.optimizer!r}")
        positive("lr", self.lr)
        nonnegative("lr_decay_k", self.lr_decay_k)
        integer("batch_size", self.batch_size)
        integer("min_epochs", self.min_epochs)
        if integer("max_epochs", self.max_epochs) < self.min_epochs:
            raise ValueError(f"max_epochs ({self.max_epochs}) must be >= min_epochs ({self.min_epochs})")
        integer("patience", self.patience)
        integer("val_size", self.val_size, minimum=0)


@dataclass
class SequenceResult:
    """``acc[t][m]``: test accuracy on task m after training task t (every task, seen or not);
    ``val_acc[t][m]``: the same on task m's validation split (tasks seen so far; the thesis selects
    hyperparameters by the final validation error over all tasks); ``val_err[t]``: best validation error of
    task t while it was trained; ``epochs[t]``; ``seconds[t]`` (wall time)."""

    acc: list[list[float]] = field(default_factory=list)
    val_acc: list[list[float]] = field(default_factory=list)
    val_err: list[float] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)

    def mean_seen(self) -> list[float]:
        """Mean test accuracy over the tasks seen so far, after each task (Fig. 5.7)."""
        return [float(np.mean(row[:t + 1])) for t, row in enumerate(self.acc)]


def _split(tasks: TaskSet, task: int, val_size: int) -> tuple[Tensor, Tensor]:
    n = tasks.train_size(task)
    v = min(val_size, n // 5)
    return torch.arange(n - v), torch.arange(n - v, n)


def task_batches(tasks: TaskSet, task: int, batch_size: int = 1000, val_size: int = 10000) -> Iterator[tuple[Tensor, Tensor]]:
    """The training part of ``task`` (validation held out) in order, ``batch_size`` at a time (for
    curvature passes, e.g. Non-Online Laplace's ``task_data``)."""
    train, _ = _split(tasks, task, val_size)
    for i in range(0, train.numel(), batch_size):
        yield tasks.train_batch(task, train[i:i + batch_size])


def _outputs(model: nn.Module, X: Tensor, device: torch.device) -> Tensor:
    with torch.no_grad():
        return torch.cat([model(X[i:i + 2000].to(device)).cpu() for i in range(0, X.shape[0], 2000)])


def _accuracy(model: nn.Module, X: Tensor, y: Tensor, device: torch.device) -> float:
    if X.shape[0] == 0:
        return 0.0
    return float((_outputs(model, X, device).argmax(-1) == y.cpu()).float().mean())


def _check_not_collapsed(model: nn.Module, tasks: TaskSet, task: int, val: Tensor, best_err: float,
                         device: torch.device) -> None:
    """Raise :class:`TrainingCollapsed` when the model's output is the same for every validation input of
    ``task`` (to float rounding: a relative spread of at most 1e-5) although their labels differ."""
    X, y = tasks.train_batch(task, val)
    if X.shape[0] < 2 or int(y.unique().numel()) < 2:
        return
    out = _outputs(model, X, device).double()
    spread = float((out - out[0]).abs().max())
    if spread <= 1e-5 * max(1.0, float(out.abs().max())):
        raise TrainingCollapsed(
            f"task {task}: the trained network gives the same output for every validation input (largest "
            f"difference {spread:.1e}; best validation error {best_err:.3f}): it no longer depends on the input, "
            "typically dead ReLUs after too large steps at the task's start; lower the learning rate or raise "
            "lr_decay_k (the checkpoint keeps the tasks finished before this one)")


def _optimizer(params: list[Tensor], cfg: SequenceConfig, lr: float) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.optimizer == "nesterov")


def _select(model: nn.Module, task: int, cfg: SequenceConfig) -> None:
    if cfg.multi_head:
        model.set_task(task)  # type: ignore[operator]


def _train_epoch(model: nn.Module, tasks: TaskSet, seen: list[tuple[int, Tensor]], opt: torch.optim.Optimizer,
                 penalty: Penalty | None, cfg: SequenceConfig, gen: torch.Generator, device: torch.device) -> None:
    pairs = torch.cat([torch.stack([torch.full_like(idx, m), idx], 1) for m, idx in seen])
    order = pairs[torch.randperm(pairs.shape[0], generator=gen)]
    params = [p for p in model.parameters() if p.requires_grad]
    for s in range(0, order.shape[0], cfg.batch_size):
        chunk = order[s:s + cfg.batch_size]
        xs, ys = [], []
        for m in torch.unique(chunk[:, 0]).tolist():
            Xm, ym = tasks.train_batch(m, chunk[chunk[:, 0] == m, 1])
            xs.append(Xm)
            ys.append(ym)
        X, y = torch.cat(xs).to(device), torch.cat(ys).to(device)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(X), y)
        if not bool(torch.isfinite(loss)):
            raise FloatingPointError(f"training loss is {float(loss.detach())}; lower the learning rate or raise "
                                     "lr_decay_k")
        loss.backward()
        if penalty is None:
            opt.step()
            continue
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        pen = penalty.loss(model)
        if pen.requires_grad:
            pen.backward()
        before = [p.detach().clone() for p in params]
        opt.step()
        penalty.after_step(model, grads, [p.detach() - b for p, b in zip(params, before)])


def train_task_sequence(model: nn.Module, tasks: TaskSet, penalty: Penalty | None, config: SequenceConfig,
                        out_dir: Path | str | None = None, max_tasks: int | None = None,
                        progress: bool = False) -> SequenceResult:
    """Train ``model`` on the tasks in order (module docstring); resume from ``out_dir/sequence.pt`` when it
    exists. ``max_tasks`` stops after that many tasks in total (for interrupting and resuming).

    Raises ``FloatingPointError`` when the training loss becomes NaN/inf and :class:`TrainingCollapsed` when
    a trained task ends with a network whose output is the same for all its validation inputs; both leave
    the checkpoint of the last finished task untouched."""
    cfg = config
    device = next(model.parameters()).device
    ckpt = None if out_dir is None else Path(out_dir) / "sequence.pt"
    result, start = SequenceResult(), 0
    if ckpt is not None and ckpt.exists():
        state = checkpoint.load(ckpt)
        if state["config"] != asdict(cfg):
            raise ValueError(f"checkpoint {ckpt} was written with another configuration; use a fresh directory")
        model.load_state_dict(state["model"])
        if penalty is not None:
            penalty.load_state_dict(state["penalty"])
        result, start = SequenceResult(**state["result"]), int(state["task"])
    stop = tasks.num_tasks if max_tasks is None else min(tasks.num_tasks, int(max_tasks))
    for t in range(start, stop):
        t0 = time.perf_counter()
        _select(model, t, cfg)
        seen = list(range(t + 1)) if cfg.joint else [t]
        splits = {m: _split(tasks, m, cfg.val_size) for m in seen}
        n_train = int(splits[t][0].numel())
        if penalty is not None and hasattr(penalty, "set_task_size"):
            penalty.set_task_size(n_train)
        lr = decayed_lr(cfg.lr, cfg.lr_decay_k, t) * (cfg.task_lr_factor[t] if t < len(cfg.task_lr_factor) else 1.0)
        bound = getattr(penalty, "curvature_bound", None)
        if cfg.lr_cap and cfg.optimizer != "adam" and callable(bound) and bound() > 0:
            lr = min(lr, (1 + cfg.momentum) / bound())
        opt = _optimizer([p for p in model.parameters() if p.requires_grad], cfg, lr)
        best_err, best_state, since, epochs = float("inf"), copy.deepcopy(model.state_dict()), 0, 0
        for epoch in range(cfg.max_epochs):
            if cfg.step_decay_every and epoch and epoch % cfg.step_decay_every == 0:
                for g in opt.param_groups:
                    g["lr"] *= 0.1
            gen = torch.Generator().manual_seed(int(np.random.SeedSequence([cfg.seed, t, epoch]).generate_state(1)[0]))
            model.train()
            _train_epoch(model, tasks, [(m, splits[m][0]) for m in seen], opt, penalty, cfg, gen, device)
            model.eval()
            errs = []
            for m in seen:
                _select(model, m, cfg)
                Xv, yv = tasks.train_batch(m, splits[m][1])
                errs.append(1.0 - _accuracy(model, Xv, yv, device))
            _select(model, t, cfg)
            err = float(np.mean(errs))
            epochs = epoch + 1
            if err < best_err:
                best_err, best_state, since = err, copy.deepcopy(model.state_dict()), 0
            else:
                since += 1
            if epochs >= cfg.min_epochs and since >= cfg.patience:
                break
        model.load_state_dict(best_state)
        model.eval()
        _check_not_collapsed(model, tasks, t, splits[t][1], best_err, device)
        if penalty is not None:
            data = task_batches(tasks, t, cfg.curvature_batch, cfg.val_size)
            consolidate = getattr(penalty, "consolidate", None)
            if callable(consolidate):
                consolidate(model, data, num_data=n_train)
            else:  # other penalties (SI, EWC) get the first curvature batch of the task
                penalty.on_task_end(model, next(iter(data)))
        row, vrow = [], []
        for m in range(tasks.num_tasks):
            if cfg.multi_head and m > t:
                row.append(float("nan"))  # its head is untrained
                continue
            _select(model, m, cfg)
            X, y = tasks.test_data(m, cfg.eval_max_test)
            row.append(_accuracy(model, X, y, device))
            if m <= t:
                Xv, yv = tasks.train_batch(m, _split(tasks, m, cfg.val_size)[1])
                vrow.append(_accuracy(model, Xv, yv, device))
        _select(model, t, cfg)
        result.acc.append(row)
        result.val_acc.append(vrow)
        result.val_err.append(best_err)
        result.epochs.append(epochs)
        result.lr.append(lr)
        result.seconds.append(time.perf_counter() - t0)
        if progress:
            print(f"task {t + 1}/{tasks.num_tasks}: {epochs} epochs, mean acc seen {np.mean(row[:t + 1]):.4f}",
                  flush=True)
        if ckpt is not None:
            checkpoint.save({"config": asdict(cfg), "task": t + 1, "model": model.state_dict(),
                             "penalty": penalty.state_dict() if penalty is not None else None,
                             "result": asdict(result)}, ckpt)
    return result


def describe(result: SequenceResult) -> dict[str, Any]:
    """JSON-able summary: accuracy matrix, mean over seen tasks, first and latest task accuracy."""
    return {"acc": result.acc, "mean_seen": result.mean_seen(), "val_acc": result.val_acc,
            "first": [row[0] for row in result.acc], "latest": [row[t] for t, row in enumerate(result.acc)],
            "val_err": result.val_err, "epochs": result.epochs, "seconds": result.seconds, "lr": result.lr}
