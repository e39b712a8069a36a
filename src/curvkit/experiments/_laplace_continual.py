"""Shared machinery of the online-Laplace experiments (thesis Sec. 5.4): method specifications, one
checkpointed run per (method, hyperparameter, seed) in its own directory, and report helpers.

A method is ``(family, curvature, hyperparameter)``: family ``online`` | ``ewc`` | ``non_online``
(:class:`curvkit.continual.laplace.LaplacePenalty`, Eqs. 5.24-5.26), ``si`` (Synaptic Intelligence,
:class:`curvkit.continual.penalties.SynapticIntelligence`), ``joint`` (one network trained on all tasks
seen so far: the upper bound of Fig. 5.7) or ``none`` (plain fine-tuning).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from torch import nn

from curvkit import checkpoint
from curvkit.continual.laplace import LaplacePenalty
from curvkit.continual.penalties import Penalty, SynapticIntelligence
from curvkit.continual.streams import TaskSet
from curvkit.continual.task_sequence import SequenceConfig, describe, task_batches, train_task_sequence


@dataclass(frozen=True)
class Method:
    family: str  # online | ewc | non_online | si | joint | none
    curvature: str = "kron"  # kron | diag (Laplace families)
    hyper: float = 1.0  # lambda (Laplace) or c (SI)
    memory: str = "per_task"

    @property
    def label(self) -> str:
        if self.family in ("joint", "none"):
            return self.family
        if self.family == "si":
            return f"si c={self.hyper:g}"
        tag = "KF" if self.curvature == "kron" else "D"
        mem = "" if self.memory == "per_task" else " summed"
        return f"{self.family} {tag}{mem} lam={self.hyper:g}"


def make_penalty(m: Method, tasks: TaskSet, cfg: SequenceConfig, params: list[str] | None, seed: int,
                 prior_precision: float) -> Penalty | None:
    if m.family in ("joint", "none"):
        return None
    if m.family == "si":
        return SynapticIntelligence(c=m.hyper, xi=1e-3)
    provider = None
    if m.family == "non_online":
        def provider(j: int) -> Any:
            return task_batches(tasks, j, cfg.curvature_batch, cfg.val_size)
    return LaplacePenalty(structure=m.curvature, mode=m.family, lam=m.hyper,  # type: ignore[arg-type]
                          prior_precision=prior_precision, memory=m.memory, task_size=1,  # type: ignore[arg-type]
                          params=params, task_data=provider, seed=seed)


def _check_same_protocol(res: dict[str, Any], requested: dict[str, Any], path: Path) -> None:
    """A finished run is read back only when it was made with the protocol asked for now (summaries written
    before the configuration was recorded are checked on their learning rate and decay when not restarted)."""
    if "config" in res:
        differ = sorted(k for k in requested if res["config"].get(k) != requested[k])
    elif res.get("lr_retries", 0) == 0:
        differ = [k for k, v in (("lr", res.get("lr0")), ("lr_decay_k", res.get("lr_decay_k")))
                  if v is not None and v != requested[k]]
    else:
        differ = []
    if differ:
        raise ValueError(f"{path} was written with another protocol ({', '.join(differ)} differ from this run's "
                         "settings): use a fresh --out directory or delete that run's directory")


def run_method(m: Method, model_fn: Callable[[int], nn.Module], tasks: TaskSet, cfg: SequenceConfig, out: Path,
               seed: int, prior_precision: float = 1e-2, params_fn: Callable[[nn.Module], list[str]] | None = None,
               progress: bool = False) -> dict[str, Any]:
    """Train (or resume, or read back) one method; returns :func:`describe` of its result."""
    slug = m.label.replace(" ", "_").replace("=", "")
    run_dir = out / "runs" / f"{slug}_seed{seed}"
    done = run_dir / "summary.json"
    cfg = replace(cfg, seed=seed, joint=m.family == "joint")
    if m.family == "si":  # thesis Sec. 5.4.1: SI did best with Adam (lr 1e-3)
        cfg = replace(cfg, optimizer="adam", lr=1e-3, lr_decay_k=0.0, step_decay_every=None)
    requested = json.loads(json.dumps(asdict(cfg)))
    if done.exists():
        res = json.loads(done.read_text())
        _check_same_protocol(res, requested, done)
        return res  # type: ignore[no-any-return]
    # The thesis tunes the per-task lr decay k of lr0 / (1 + k t) "to prevent the objective from diverging towards
    # the end of training" (Sec. 5.4.1); here a run that diverges (its loss becomes non-finite, or a task ends with
    # a network whose output no longer depends on the input: TrainingCollapsed) is restarted from scratch with a
    # 10x larger k (1 if k was 0), which keeps the first task's lr; after 3 such restarts the initial lr is cut.
    retries = 0
    while True:
        model = model_fn(seed)
        params = params_fn(model) if params_fn is not None else None
        pen = make_penalty(m, tasks, cfg, params, seed, prior_precision)
        try:
            res = describe(train_task_sequence(model, tasks, pen, cfg, run_dir / f"lr{cfg.lr:g}_k{cfg.lr_decay_k:g}",
                                               progress=progress))
            break
        except FloatingPointError:
            if retries == 5:
                raise
            retries += 1
            if retries <= 3:
                cfg = replace(cfg, lr_decay_k=10 * cfg.lr_decay_k if cfg.lr_decay_k > 0 else 1.0)
            else:
                cfg = replace(cfg, lr=cfg.lr / 10)
    res["method"] = m.label
    res["lr0"], res["lr_decay_k"], res["lr_retries"] = cfg.lr, cfg.lr_decay_k, retries
    res["config"] = requested
    if isinstance(pen, LaplacePenalty):
        res["stored_scalars"] = pen.memory_numel()
    checkpoint.write_text(done, json.dumps(res) + "\n")
    return res
