"""Where each layer's inverse (Cholesky factors or eigendecomposition) is computed: KAISA's placements
(Pauloski et al., "KAISA: an adaptive second-order optimizer framework for deep neural networks", SC 2021).

Every layer l has a cost c_l (flops of its factorisations: sum over its factors of n^3) and is assigned
to ONE owner rank, which computes it; owners are balanced by the greedy longest-processing-time rule
(layers in decreasing cost, each to the least loaded rank; ties to the lowest rank), so the slowest rank
carries at most 4/3 of the optimum. The placements differ in who else receives the result:

* ``comm-opt`` (grad-worker fraction 1): the owner broadcasts the inverse to every rank; each rank then
  preconditions every layer itself. Per refresh: one broadcast of the inverse; nothing per step.
* ``mem-opt`` (fraction 1/P): the inverse stays on the owner, which preconditions that layer's
  gradient every step and broadcasts the preconditioned gradient (out x in numbers). Least memory.
* ``hybrid`` (fraction f): the P ranks are split into ``round(1/f)`` interleaved gradient-worker groups
  of about fP ranks; the owner broadcasts the inverse within its group (every rank of the group can
  precondition the layer) and the group's first rank broadcasts the preconditioned gradient to the
  other ranks. f = 1 is comm-opt, f = 1/P is mem-opt.

Every rank computes the same assignment from the same costs (no communication).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Assignment", "assign_owners", "factor_cost"]


def factor_cost(*dims: int) -> float:
    """Flops-proportional cost of factorising square factors of sizes ``dims``: sum n^3."""
    return float(sum(int(n) ** 3 for n in dims))


@dataclass(frozen=True)
class Assignment:
    """The placement of L layers over P ranks.

    ``owner[l]``: the rank that computes layer l's inverse; ``grad_workers[l]``: the ranks that receive
    it and can precondition layer l (all ranks for comm-opt, ``(owner,)`` for mem-opt);
    ``load[r]``: the summed cost owned by rank r.
    """

    owner: tuple[int, ...]
    grad_workers: tuple[tuple[int, ...], ...]
    load: tuple[float, ...]
    strategy: str

    def broadcasts_inverse(self, layer: int, world_size: int) -> bool:
        return len(self.grad_workers[layer]) > 1

    def broadcasts_gradient(self, layer: int, world_size: int) -> bool:
        return len(self.grad_workers[layer]) < world_size


def assign_owners(costs: Sequence[float], world_size: int, strategy: str = "comm-opt",
                  grad_worker_fraction: float | None = None) -> Assignment:
    """Owners and gradient workers of every layer (module docstring)."""
    P = int(world_size)
    if P < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if strategy == "comm-opt":
        frac = 1.0
    elif strategy == "mem-opt":
        frac = 1.0 / P
    elif strategy == "hybrid":
        if grad_worker_fraction is None or not 0 < grad_worker_fraction <= 1:
            raise ValueError(f"hybrid placement needs grad_worker_fraction in (0, 1], got {grad_worker_fraction!r}")
        frac = float(grad_worker_fraction)
    else:
        raise ValueError(f"unknown placement {strategy!r}; use 'comm-opt', 'mem-opt' or 'hybrid'")
    n_groups = max(1, min(P, round(1.0 / frac)))
    groups = [tuple(r for r in range(P) if r % n_groups == g) for g in range(n_groups)]
    group_of = {r: gi for gi, g in enumerate(groups) for r in g}
    load = [0.0] * P
    owner = [0] * len(costs)
    for l in sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i)):
        r = min(range(P), key=lambda q: (load[q], q))
        owner[l] = r
        load[r] += float(costs[l])
    workers = []
    for l in range(len(costs)):
        if n_groups == 1:
            workers.append(tuple(range(P)))
        else:
            workers.append(groups[group_of[owner[l]]])
    return Assignment(tuple(owner), tuple(workers), tuple(load), strategy)
