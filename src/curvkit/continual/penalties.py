"""Quadratic consolidation penalties for boundary-based continual learning: EWC, online EWC and SI.

Every penalty implements the small :class:`Penalty` interface, which is also the plug-in point for a
(Kronecker-factored) online Laplace approximation:

* ``loss(model) -> Tensor`` - the scalar added to the data loss of every training step (0 before the
  first task boundary);
* ``on_task_end(model, data)`` - called by the runner at a task boundary (the *only* place task
  information reaches a learner; see :meth:`curvkit.continual.streams.Schedule.boundaries`);
  ``data = (X, y)`` is a sample of the ending task's training set;
* ``after_step(model, grads, deltas)`` - called after every optimiser step with the data-loss gradient
  and the parameter change (SI's path integral needs them; a no-op elsewhere);
* ``state_dict()`` / ``load_state_dict()`` - everything needed to resume bit-exactly.

Penalties act on the trainable parameters in ``named_parameters()`` order and are expressed in the units
of a **mean-reduced** data loss (per-example average NLL), as in the original papers.

Diagonal Fisher (EWC, Kirkpatrick et al. 2017), for the categorical likelihood p(y | x, theta) =
softmax(f(x; theta))_y and N examples:

    empirical:  F_i = (1/N) sum_n (d log p(y_n | x_n) / d theta_i)^2                  (true labels)
    true:       F_i = (1/N) sum_n sum_c p(c | x_n) (d log p(c | x_n) / d theta_i)^2   (exact expectation)

computed by the curvature engine's diagonal estimator (:func:`diagonal_fisher`), in chunks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from curvkit.curvature.config import renamed_option
from curvkit.curvature.diagonal_estimator import DiagonalEstimator
from curvkit.likelihoods import CrossEntropy
from curvkit.linalg.operator import DiagonalOperator
from curvkit.validation import integer

FisherKind = Literal["empirical", "true"]


def _named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def diagonal_fisher(
    model: nn.Module, X: Tensor, y: Tensor | None = None, curvature: FisherKind = "empirical", chunk_size: int = 64,
    kind: FisherKind | None = None,
) -> DiagonalOperator:
    """Diagonal Fisher of a softmax classifier, averaged over the N examples (formulas in the module doc),
    as the engine's :class:`~curvkit.linalg.operator.DiagonalOperator` over the trainable parameters.

    ``X``: (N, ...) inputs; ``y``: (N,) labels (needed for ``curvature='empirical'``). ``curvature='true'`` is the
    exact expectation over the model's labels, which for softmax cross-entropy is the GGN diagonal (thesis
    Eqs. 3.37-3.38): :class:`~curvkit.curvature.diagonal_estimator.DiagonalEstimator` with ``method='ggn'``
    (``'empirical'`` for the empirical Fisher), over chunks of ``chunk_size`` examples. (``kind``: the former name
    of ``curvature``, deprecated.)
    """
    kind = renamed_option(curvature, kind, "diagonal_fisher", "curvature", "kind", "empirical")
    if kind not in ("empirical", "true"):
        raise ValueError(f"curvature must be 'empirical' or 'true', got {kind!r}")
    if kind == "empirical" and (y is None or y.shape[0] != X.shape[0]):
        raise ValueError("the empirical Fisher needs labels y of shape (N,) matching X")
    if X.shape[0] == 0:
        raise ValueError("diagonal_fisher needs at least one example")
    integer("chunk_size", chunk_size)
    N = X.shape[0]
    targets = y if y is not None else torch.zeros(N, dtype=torch.long, device=X.device)
    est = DiagonalEstimator(model, CrossEntropy("mean"), "empirical" if kind == "empirical" else "ggn")
    est.update([(X[i:i + chunk_size], targets[i:i + chunk_size]) for i in range(0, N, chunk_size)])
    return est.operator()


class Penalty(ABC):
    """Interface of a consolidation penalty (see the module docstring)."""

    #: the runner passes task boundaries only to learners whose penalty declares it needs them
    needs_boundaries: bool = True

    @abstractmethod
    def loss(self, model: nn.Module) -> Tensor:
        """Scalar penalty at the model's current parameters (a zero tensor before any boundary)."""

    def on_task_end(self, model: nn.Module, data: tuple[Tensor, Tensor]) -> None:  # noqa: B027
        """Consolidate the task that just ended (default: nothing)."""

    def after_step(self, model: nn.Module, grads: Sequence[Tensor], deltas: Sequence[Tensor]) -> None:  # noqa: B027
        """Observe one optimiser step: data-loss gradients and parameter changes (default: nothing)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _zero(model: nn.Module) -> Tensor:
    p = next(iter(model.parameters()))
    return torch.zeros((), dtype=p.dtype, device=p.device)


def _quadratic(model: nn.Module, weights: list[Tensor], anchors: list[Tensor]) -> Tensor:
    params = [p for _, p in _named_trainable(model)]
    if len(params) != len(weights):
        raise ValueError("the model's parameters changed since the penalty was consolidated")
    return sum(((w * (p - a).pow(2)).sum() for p, w, a in zip(params, weights, anchors)), _zero(model))


class EWC(Penalty):
    """Elastic weight consolidation (Kirkpatrick et al. 2017), diagonal Fisher.

    After tasks k = 1..K have ended, with Fisher F^(k) and anchor theta*^(k) taken at each task's end:

        offline (``online=False``):  R(theta) = (lam / 2) sum_k sum_i F_i^(k) (theta_i - theta*_i^(k))^2
        online  (``online=True``, Schwarz et al. 2018):
            F~ <- gamma F~ + F^(K),  theta* <- theta at the end of task K,
            R(theta) = (lam / 2) sum_i F~_i (theta_i - theta*_i)^2

    ``curvature`` (formerly ``fisher``, deprecated) selects the empirical (true labels) or true (model-sampled, exact expectation) Fisher; the
    Fisher is computed on the ``data`` the boundary hook receives. ``gamma = 1`` makes online EWC sum all
    Fishers with a single anchor; ``gamma < 1`` decays old tasks' importance geometrically.
    """

    def __init__(self, lam: float, curvature: FisherKind = "empirical", online: bool = False, gamma: float = 1.0,
                 chunk_size: int = 64,
                 fisher: FisherKind | None = None):
        fisher = renamed_option(curvature, fisher, "EWC", "curvature", "fisher", "empirical")
        if not lam >= 0:
            raise ValueError(f"lam must be >= 0, got {lam}")
        if fisher not in ("empirical", "true"):
            raise ValueError(f"curvature must be 'empirical' or 'true', got {fisher!r}")
        if not 0 <= gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got {gamma}")
        if not online and gamma != 1.0:
            raise ValueError("gamma only applies to online EWC; pass online=True")
        self.lam, self.fisher, self.online, self.gamma = float(lam), fisher, bool(online), float(gamma)
        self.chunk_size = int(chunk_size)
        self.fishers: list[list[Tensor]] = []  # one entry (offline) per task, or a single running one
        self.anchors: list[list[Tensor]] = []
        self.tasks_seen = 0

    def loss(self, model: nn.Module) -> Tensor:
        total = _zero(model)
        for F, a in zip(self.fishers, self.anchors):
            total = total + _quadratic(model, F, a)
        return 0.5 * self.lam * total

    def on_task_end(self, model: nn.Module, data: tuple[Tensor, Tensor]) -> None:
        X, y = data
        F = diagonal_fisher(model, X, y, curvature=self.fisher, chunk_size=self.chunk_size).tensors
        anchor = [p.detach().clone() for _, p in _named_trainable(model)]
        if self.online and self.fishers:
            self.fishers = [[self.gamma * old + new for old, new in zip(self.fishers[0], F)]]
            self.anchors = [anchor]
        else:
            self.fishers.append(F)
            self.anchors.append(anchor)
        self.tasks_seen += 1

    def state_dict(self) -> dict[str, Any]:
        return {"fishers": self.fishers, "anchors": self.anchors, "tasks_seen": self.tasks_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fishers = [list(f) for f in state["fishers"]]
        self.anchors = [list(a) for a in state["anchors"]]
        self.tasks_seen = int(state["tasks_seen"])


class SynapticIntelligence(Penalty):
    """Synaptic intelligence (Zenke, Poole & Ganguli 2017).

    During task k the path integral of each parameter is accumulated step by step,

        omega_i += - g_i(t) * Delta theta_i(t)

    with g the gradient of the *data* loss (no penalty term) and Delta theta the actual parameter change.
    At the end of task k, with Delta_i = theta_i(end of k) - theta_i(start of k),

        Omega_i += omega_i / (Delta_i^2 + xi),     omega <- 0,     theta~ <- theta(end of k)

    and the penalty is R(theta) = c * sum_i Omega_i (theta_i - theta~_i)^2. ``xi`` is the damping
    (the MESU paper does not give it; 1e-3 is the value in the MESU authors' later code; Zenke et al. use
    0.1 or 1e-3).
    With plain SGD and no penalty each step adds lr * g_i^2 >= 0, but with momentum, Adam or a penalty
    gradient a coordinate's omega can be negative; ``clip_negative=True`` (default) clips each task's
    contribution omega_i / (Delta_i^2 + xi) at 0 so that Omega stays a non-negative importance.
    :meth:`importance` exposes the running omega and Omega for Hessian comparisons (MESU paper Fig. 2d).
    """

    def __init__(self, c: float, xi: float = 1e-3, clip_negative: bool = True):
        if not c >= 0:
            raise ValueError(f"c must be >= 0, got {c}")
        if not xi > 0:
            raise ValueError(f"xi must be > 0, got {xi}")
        self.c, self.xi, self.clip_negative = float(c), float(xi), bool(clip_negative)
        self.omega: list[Tensor] | None = None  # running path integral of the current task
        self.Omega: list[Tensor] | None = None  # consolidated importance
        self.start: list[Tensor] | None = None  # parameters at the start of the current task
        self.anchor: list[Tensor] | None = None  # parameters at the end of the last task

    def _init(self, model: nn.Module, deltas: Sequence[Tensor] | None = None) -> None:
        if self.omega is None:  # first use: the task started before the step that produced ``deltas``
            params = [p.detach() for _, p in _named_trainable(model)]
            self.omega = [torch.zeros_like(p) for p in params]
            if deltas is None:
                self.start = [p.clone() for p in params]
            else:
                self.start = [p - d for p, d in zip(params, deltas)]

    def loss(self, model: nn.Module) -> Tensor:
        if self.Omega is None or self.anchor is None:
            return _zero(model)
        return self.c * _quadratic(model, self.Omega, self.anchor)

    def after_step(self, model: nn.Module, grads: Sequence[Tensor], deltas: Sequence[Tensor]) -> None:
        self._init(model, deltas)
        assert self.omega is not None
        if len(grads) != len(self.omega) or len(deltas) != len(self.omega):
            raise ValueError("grads and deltas must have one tensor per trainable parameter")
        for w, g, d in zip(self.omega, grads, deltas):
            w.sub_(g * d)

    def importance(self, model: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
        """(omega, omega / ((theta - theta_start)^2 + xi)) for the current task, without consolidating."""
        self._init(model)
        assert self.omega is not None and self.start is not None
        params = [p.detach() for _, p in _named_trainable(model)]
        normed = [w / ((p - s).pow(2) + self.xi) for w, p, s in zip(self.omega, params, self.start)]
        return [w.clone() for w in self.omega], normed

    def on_task_end(self, model: nn.Module, data: tuple[Tensor, Tensor] | None = None) -> None:
        _, contribution = self.importance(model)
        if self.clip_negative:
            contribution = [c.clamp_min(0) for c in contribution]
        self.Omega = contribution if self.Omega is None else [a + b for a, b in zip(self.Omega, contribution)]
        params = [p.detach().clone() for _, p in _named_trainable(model)]
        self.anchor = [p.clone() for p in params]
        self.start = params
        self.omega = [torch.zeros_like(p) for p in params]

    def state_dict(self) -> dict[str, Any]:
        return {"omega": self.omega, "Omega": self.Omega, "start": self.start, "anchor": self.anchor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.omega, self.Omega = state["omega"], state["Omega"]
        self.start, self.anchor = state["start"], state["anchor"]
