"""The continual-learning runner: train a :class:`~curvkit.continual.learners.Learner` on a
:class:`~curvkit.continual.streams.TaskStream`, evaluate on all tasks periodically, checkpoint, resume.

Per run it records (all in :class:`RunResult`, written to ``results.json``):

* ``acc_mc`` / ``acc_map``: accuracy matrices of shape [evaluations x tasks] (MC-averaged softmax over
  ``eval_mc_samples`` weight samples, and the mean network; identical for deterministic learners);
  ``eval_iters[e]`` is the number of training iterations done before evaluation e. Every task is
  evaluated every time (not-yet-seen tasks included), as in the MESU paper (Sec. 3: "the test accuracy in
  each of 100 tasks is evaluated after each epoch");
* ``sigma``: per-parameter sigma statistics at each evaluation (Bayesian learners);
* ``mix``: the per-batch task mix, as sparse triples (iteration, task, count) for every ``mix_stride``-th
  batch (MESU Fig. 3a);
* ``boundary_calls``: the (iteration, task) boundary hooks that were delivered (empty for boundary-free
  learners: the record that makes comparisons honest);
* ``train_loss``: the mean training loss over each evaluation period.

Checkpoint/resume. Every ``checkpoint_every`` iterations (and when stopping) the runner atomically writes
(tmp file, then ``os.replace``) the learner state (model, optimiser incl. sigma and noise generator,
penalty), the torch/numpy/python global RNG states, the stream position t and the results so far. The
batch of iteration t and the evaluation noise of evaluation e are pure functions of (seed, t) and
(seed, e), so a run killed at any point and resumed from its last checkpoint reproduces an uninterrupted
run's accuracy matrix exactly (``tests/test_continual_runner.py`` checks it bitwise).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from curvkit import checkpoint
from curvkit.continual.learners import Learner
from curvkit.continual.streams import TaskStream

CHECKPOINT = "checkpoint.pt"
RESULTS = "results.json"


@dataclass
class RunnerConfig:
    """Evaluation, logging and checkpoint settings of one run.

    Attributes:
        eval_every: iterations between evaluations (one virtual epoch in the MESU protocol).
        eval_mc_samples: K_test for the MC-averaged prediction (the MESU paper does not give it; 10, Zeno
            et al.'s setting for this benchmark).
        eval_max_test: test examples per task (None: the whole test set).
        eval_map: also evaluate the mean network (always identical for deterministic learners).
        checkpoint_every: iterations between checkpoints (None: ``eval_every``; 0: only when stopping).
        mix_stride: record the task mix of every ``mix_stride``-th batch.
        boundary_samples: training examples of the ending task handed to the boundary hook.
        seed: seed of the evaluation noise (the stream and the learner carry their own seeds).
        progress: show a tqdm progress bar.
        name: label used in the progress bar and the results.
    """

    eval_every: int
    eval_mc_samples: int = 10
    eval_max_test: int | None = None
    eval_map: bool = True
    checkpoint_every: int | None = None
    mix_stride: int = 1
    boundary_samples: int = 1000
    seed: int = 0
    progress: bool = True
    name: str = "run"

    def __post_init__(self) -> None:
        if self.eval_every < 1:
            raise ValueError(f"eval_every must be >= 1, got {self.eval_every}")
        if self.eval_mc_samples < 1:
            raise ValueError(f"eval_mc_samples must be >= 1, got {self.eval_mc_samples}")
        if self.mix_stride < 1:
            raise ValueError(f"mix_stride must be >= 1, got {self.mix_stride}")
        if self.checkpoint_every is not None and self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 or None, got {self.checkpoint_every}")
        if self.eval_max_test is not None and self.eval_max_test < 1:
            raise ValueError(f"eval_max_test must be >= 1 or None, got {self.eval_max_test}")


@dataclass
class RunResult:
    """Everything a run records (see the module docstring). Lists grow as the run proceeds."""

    name: str
    num_tasks: int
    total_iters: int
    uses_task_boundaries: bool
    eval_iters: list[int] = field(default_factory=list)
    acc_mc: list[list[float]] = field(default_factory=list)
    acc_map: list[list[float]] = field(default_factory=list)
    sigma: list[dict[str, dict[str, float]]] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    mix: list[tuple[int, int, int]] = field(default_factory=list)
    boundary_calls: list[tuple[int, int]] = field(default_factory=list)
    diagnostics: dict[str, Any] = field(default_factory=dict)
    complete: bool = False

    def accuracy(self, mode: str = "mc") -> np.ndarray:
        """Accuracy matrix [evaluations x tasks] as a numpy array."""
        rows = self.acc_mc if mode == "mc" else self.acc_map
        return np.asarray(rows, dtype=float).reshape(len(rows), self.num_tasks)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not np.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return _json_safe(float(x))
    return x


def _numpy_state() -> dict[str, Any]:
    """numpy's global RNG state as a tensor and plain values (a checkpoint holds nothing else:
    :mod:`curvkit.checkpoint`)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()  # noqa: NPY002
    return {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _set_numpy_state(state: dict[str, Any]) -> None:
    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state((state["name"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"]))  # noqa: NPY002


def _eval_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(np.random.SeedSequence([seed, 7, index]).generate_state(1)[0]))
    return g


class ContinualRunner:
    """Train ``learner`` on ``stream`` with the settings of ``config``; checkpoint under ``out_dir``.

    ``run(max_steps=None)`` continues from the checkpoint in ``out_dir`` if there is one (a checkpoint
    written with a different configuration raises), trains until the stream ends or ``max_steps``
    iterations have been done in this call, and returns the :class:`RunResult`. The learner's own state
    is part of the checkpoint, so pass a freshly built learner with the same construction arguments.
    """

    def __init__(self, learner: Learner, stream: TaskStream, config: RunnerConfig, out_dir: Path | str | None = None):
        self.learner, self.stream, self.config = learner, stream, config
        self.out_dir = Path(out_dir) if out_dir is not None else None
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.t = 0
        self.result = RunResult(config.name, stream.schedule.num_tasks, stream.total_iters,
                                learner.uses_task_boundaries)
        self._loss_sum = 0.0
        self._loss_count = 0
        self._acc_ema: float | None = None
        self._boundaries = stream.schedule.boundaries() if learner.uses_task_boundaries else {}

    # -- identity of a run (checked on resume) ---------------------------------------------------------
    def _fingerprint(self) -> str:
        cfg = {k: v for k, v in asdict(self.config).items() if k != "progress"}
        key = {
            "config": cfg,
            "stream": [type(self.stream.tasks).__name__, type(self.stream.schedule).__name__,
                       self.stream.schedule.num_tasks, self.stream.schedule.iters_per_task,
                       self.stream.batch_size, self.stream.seed],
            "learner": [type(self.learner).__name__, self.learner.uses_task_boundaries],
            "params": [[n, list(p.shape)] for n, p in self.learner.model.named_parameters()],
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]

    # -- checkpointing ----------------------------------------------------------------------------------
    def checkpoint_path(self) -> Path | None:
        return None if self.out_dir is None else self.out_dir / CHECKPOINT

    def save_checkpoint(self) -> None:
        path = self.checkpoint_path()
        if path is None:
            return
        state = {
            "fingerprint": self._fingerprint(),
            "t": self.t,
            "learner": self.learner.state_dict(),
            "result": self.result.to_json(),
            "loss_acc": (self._loss_sum, self._loss_count, self._acc_ema),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": _numpy_state()},
        }
        checkpoint.save(state, path)
        self.write_results()

    def load_checkpoint(self) -> bool:
        path = self.checkpoint_path()
        if path is None or not path.exists():
            return False
        state = checkpoint.load(path)
        if state["fingerprint"] != self._fingerprint():
            raise ValueError(f"checkpoint {path} was written by a run with a different configuration; use a "
                             "fresh output directory or delete the checkpoint")
        self.learner.load_state_dict(state["learner"])
        self.t = int(state["t"])
        res = state["result"]
        res["mix"] = [tuple(x) for x in res["mix"]]
        res["boundary_calls"] = [tuple(x) for x in res["boundary_calls"]]
        self.result = RunResult(**res)
        self._loss_sum, self._loss_count, self._acc_ema = state["loss_acc"]
        torch.set_rng_state(state["rng"]["torch"])
        _set_numpy_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        return True

    def write_results(self) -> None:
        if self.out_dir is None:
            return
        checkpoint.write_text(self.out_dir / RESULTS, json.dumps(_json_safe(self.result.to_json())) + "\n")

    # -- evaluation -------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> tuple[list[float], list[float]]:
        """Accuracy of the learner on every task's test data: (MC-averaged, MAP), each of length M."""
        cfg, learner, tasks = self.config, self.learner, self.stream.tasks
        device = next(learner.model.parameters()).device
        gen = _eval_generator(cfg.seed, len(self.result.eval_iters), device)
        acc_mc, acc_map = [], []
        for m in range(tasks.num_tasks):
            X, y = tasks.test_data(m, cfg.eval_max_test)
            X, y = X.to(device), y.to(device)
            p_map = learner.predict(X, mode="map") if (cfg.eval_map or not learner.is_bayesian) else None
            p_mc = (learner.predict(X, mode="mc", mc_samples=cfg.eval_mc_samples, generator=gen)
                    if learner.is_bayesian else p_map)
            assert p_mc is not None
            acc_mc.append(float((p_mc.argmax(-1) == y).double().mean()))
            acc_map.append(float((p_map.argmax(-1) == y).double().mean()) if p_map is not None else float("nan"))
        return acc_mc, acc_map

    def _record_eval(self) -> None:
        acc_mc, acc_map = self.evaluate()
        r = self.result
        r.eval_iters.append(self.t)
        r.acc_mc.append(acc_mc)
        r.acc_map.append(acc_map)
        stats = self.learner.sigma_stats()
        if stats is not None:
            r.sigma.append(stats)
        r.train_loss.append(self._loss_sum / max(self._loss_count, 1))
        self._loss_sum, self._loss_count = 0.0, 0
        diag = getattr(self.learner, "diagnostics", None)
        if callable(diag):
            r.diagnostics = dict(diag())

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self, max_steps: int | None = None, resume: bool = True) -> RunResult:
        if max_steps is not None and max_steps < 0:
            raise ValueError(f"max_steps must be >= 0 or None, got {max_steps}")
        if resume:
            self.load_checkpoint()
        cfg, stream = self.config, self.stream
        T = stream.total_iters
        ckpt_every = cfg.eval_every if cfg.checkpoint_every is None else cfg.checkpoint_every
        device = next(self.learner.model.parameters()).device
        end = T if max_steps is None else min(T, self.t + max_steps)
        from tqdm.auto import tqdm

        bar = tqdm(total=T, initial=self.t, desc=cfg.name, disable=not cfg.progress, dynamic_ncols=True)
        try:
            while self.t < end:
                t = self.t
                if t in self._boundaries:
                    task = self._boundaries[t]
                    X, y = stream.task_data(task, cfg.boundary_samples)
                    self.learner.on_task_end(task, (X.to(device), y.to(device)))
                    self.result.boundary_calls.append((t, task))
                batch = stream.batch(t)
                info = self.learner.train_step(batch.x.to(device), batch.y.to(device))
                self._loss_sum += info["loss"]
                self._loss_count += 1
                a = info.get("batch_acc")
                if a is not None:
                    self._acc_ema = a if self._acc_ema is None else 0.98 * self._acc_ema + 0.02 * a
                if t % cfg.mix_stride == 0:
                    self.result.mix.extend((t, int(m), int(c)) for m, c in enumerate(batch.counts) if c > 0)
                self.t = t + 1
                if self.t % cfg.eval_every == 0 or self.t == T:
                    self._record_eval()
                if self.t == T:
                    self.result.complete = True
                if self.t == T or (ckpt_every and self.t % ckpt_every == 0):
                    self.save_checkpoint()
                bar.update(1)
                if cfg.progress:
                    post = {"task": int(np.argmax(batch.counts)),
                            "acc": f"{self._acc_ema:.3f}" if self._acc_ema is not None else "-"}
                    if self.result.acc_mc:
                        post["eval_mean"] = f"{np.mean(self.result.acc_mc[-1]):.3f}"
                    bar.set_postfix(post, refresh=False)
        finally:
            bar.close()
        if self.t < T or not (self.checkpoint_path() and self.checkpoint_path().exists()):  # type: ignore[union-attr]
            self.save_checkpoint()
        return self.result
