"""The learner protocol of the continual-learning harness and its adapters.

A :class:`Learner` sees only minibatches ``(x, y)``; it is never told the task. Its interface:

* ``train_step(x, y) -> dict`` - one update; returns at least ``loss`` and ``batch_acc`` (accuracy of
  the pre-step MAP prediction on the batch; used for the progress bar only);
* ``predict(x, mode, mc_samples, generator) -> (N, C)`` class probabilities; ``mode='mc'`` is the
  MC-averaged softmax of a Bayesian learner, ``mode='map'`` the mean network; deterministic learners
  return the same for both;
* ``on_task_end(task, data)`` - the **boundary hook**: the runner calls it only if
  ``uses_task_boundaries`` is True (EWC, SI), at the iterations of
  :meth:`curvkit.continual.streams.Schedule.boundaries`, with ``data = (X, y)`` a sample of the ending
  task's training set. Boundary-free learners (MESU, BGD, fine-tuning) never receive task information;
  results record which learners used the hook so comparisons stay honest;
* ``sigma_stats()`` - per-parameter statistics of the posterior standard deviations (None if none);
* ``state_dict()`` / ``load_state_dict()`` - model, optimiser (incl. sigma and noise generator) and
  penalty state, for bit-exact resume.

Adapters: :class:`MeanFieldLearner` wraps :class:`curvkit.optim.MeanFieldOptimizer` (MESU, MESU w/o reg,
BGD, BBB-SGD; loss reduction set by the optimiser, by default the minibatch sum), and
:class:`TorchLearner` wraps any ``torch.optim`` optimiser on a mean-reduced cross-entropy, optionally with
a :class:`curvkit.continual.penalties.Penalty` (EWC, online EWC, SI).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from curvkit.continual.penalties import Penalty
from curvkit.optim.meanfield import MeanFieldOptimizer

PredictMode = Literal["mc", "map"]


def _check_batch(x: Tensor, y: Tensor) -> None:
    if x.shape[0] != y.shape[0] or y.dim() != 1:
        raise ValueError(f"need inputs (B, ...) and labels (B,), got {tuple(x.shape)} and {tuple(y.shape)}")
    if not x.is_floating_point() or not bool(torch.isfinite(x).all()):
        raise ValueError("inputs must be finite floating-point tensors (convert uint8 images with to_unit)")


def _sigma_summary(sigma: Tensor) -> dict[str, float]:
    s = sigma.detach().abs().double().flatten()
    q = torch.quantile(s, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)) if s.numel() <= 2**24 else None
    out = {"mean": float(s.mean()), "std": float(s.std()) if s.numel() > 1 else 0.0,
           "min": float(s.min()), "max": float(s.max())}
    if q is not None:
        out |= {"p05": float(q[0]), "median": float(q[1]), "p95": float(q[2])}
    return out


class Learner(ABC):
    """Protocol of a continual learner (see the module docstring)."""

    model: nn.Module
    #: True only for methods that need task boundaries (EWC, SI); see ``on_task_end``
    uses_task_boundaries: bool = False

    @abstractmethod
    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]: ...

    @abstractmethod
    def predict(self, x: Tensor, mode: PredictMode = "mc", mc_samples: int = 10,
                generator: torch.Generator | None = None) -> Tensor: ...

    def on_task_end(self, task: int, data: tuple[Tensor, Tensor]) -> None:  # noqa: B027
        """Boundary hook (only called when ``uses_task_boundaries``)."""

    def sigma_stats(self) -> dict[str, dict[str, float]] | None:
        return None

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    @property
    def is_bayesian(self) -> bool:
        return False


class MeanFieldLearner(Learner):
    """Adapter for the mean-field optimisers (MESU, MESU w/o reg, BGD, BBB-SGD): boundary-free.

    A step is ``optimizer.step(batch=(x, y))`` (K weight samples, vectorised). Predictions use
    ``optimizer.predict`` (MC-averaged softmax with the given generator) and ``optimizer.predict_map``.
    """

    def __init__(self, model: nn.Module, optimizer: MeanFieldOptimizer):
        if not isinstance(optimizer, MeanFieldOptimizer):
            raise TypeError(f"MeanFieldLearner needs a curvkit.optim.MeanFieldOptimizer, got {type(optimizer).__name__}")
        if optimizer.model is not model:
            raise ValueError("the optimiser was built for a different model")
        self.model, self.optimizer = model, optimizer

    @property
    def is_bayesian(self) -> bool:
        return True

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        _check_batch(x, y)
        with torch.no_grad():
            acc = float((self.model(x).argmax(-1) == y).double().mean())
        loss = self.optimizer.step(batch=(x, y))
        return {"loss": float(loss) / x.shape[0], "batch_acc": acc}

    @torch.no_grad()
    def predict(self, x: Tensor, mode: PredictMode = "mc", mc_samples: int = 10,
                generator: torch.Generator | None = None) -> Tensor:
        if mode == "map":
            return self.optimizer.predict_map(x)
        if mode != "mc":
            raise ValueError(f"mode must be 'mc' or 'map', got {mode!r}")
        return self.optimizer.predict(x, mc_samples=mc_samples, generator=generator)

    def sigma_stats(self) -> dict[str, dict[str, float]]:
        sig = self.optimizer.sigma_dict()
        stats = {n: _sigma_summary(s) for n, s in sig.items()}
        stats["all"] = _sigma_summary(torch.cat([s.detach().flatten() for s in sig.values()]))
        return stats

    def diagnostics(self) -> dict[str, int]:
        return self.optimizer.diagnostics

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class TorchLearner(Learner):
    """Deterministic network trained by a ``torch.optim`` optimiser on the mean cross-entropy.

    Loss per step: (1/B) sum_b -log softmax(f(x_b))[y_b] + penalty.loss(model). Without a penalty this is
    plain fine-tuning (SGD, Adam). With a penalty that ``needs_boundaries`` (EWC, online EWC, SI), the
    learner declares ``uses_task_boundaries`` and forwards the runner's boundary hook to the penalty.
    The penalty's ``after_step`` receives the data-loss gradient and the parameter change of each step.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, penalty: Penalty | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer over the model's parameters, got "
                            f"{type(optimizer).__name__}")
        if penalty is not None and not isinstance(penalty, Penalty):
            raise TypeError(f"penalty must be a curvkit.continual.Penalty (EWC, SynapticIntelligence, ...) or None, "
                            f"got {type(penalty).__name__}")
        owned = {id(p) for p in model.parameters()}
        for g in optimizer.param_groups:
            if any(id(p) not in owned for p in g["params"]):
                raise ValueError("the optimiser holds parameters that are not the model's")
        self.model, self.optimizer, self.penalty = model, optimizer, penalty
        self.uses_task_boundaries = bool(penalty is not None and penalty.needs_boundaries)

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        _check_batch(x, y)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        if not bool(torch.isfinite(loss)):
            raise ValueError(f"training loss is not finite ({float(loss)}); lower the learning rate")
        loss.backward()
        out = {"loss": float(loss.detach()), "batch_acc": float((logits.detach().argmax(-1) == y).double().mean())}
        if self.penalty is None:
            self.optimizer.step()
            return out
        data_grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        pen = self.penalty.loss(self.model)
        if pen.requires_grad:
            pen.backward()
        before = [p.detach().clone() for p in params]
        self.optimizer.step()
        deltas = [p.detach() - b for p, b in zip(params, before)]
        self.penalty.after_step(self.model, data_grads, deltas)
        out["penalty"] = float(pen.detach())
        return out

    @torch.no_grad()
    def predict(self, x: Tensor, mode: PredictMode = "mc", mc_samples: int = 10,
                generator: torch.Generator | None = None) -> Tensor:
        if mode not in ("mc", "map"):
            raise ValueError(f"mode must be 'mc' or 'map', got {mode!r}")
        return torch.cat([self.model(x[i:i + 1024]).softmax(-1) for i in range(0, x.shape[0], 1024)])

    def on_task_end(self, task: int, data: tuple[Tensor, Tensor]) -> None:
        if self.penalty is not None:
            self.penalty.on_task_end(self.model, data)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "penalty": self.penalty.state_dict() if self.penalty is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.penalty is not None:
            self.penalty.load_state_dict(state["penalty"])
