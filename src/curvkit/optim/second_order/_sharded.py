"""GaussNewton on an FSDP2-sharded model (``fully_shard``; issue 33): what it takes, and the route.

Every rank runs the step on its own data shard, on a whole-parameter replica of the model
(:class:`curvkit.distributed.sharded.ShardedReplica`: the module tree without FSDP2's hooks, the parameters
all-gathered from the ranks' shards at the start of the step and their storage freed at its end), exactly as
the data-parallel optimiser runs on each rank's replica (:mod:`curvkit.optim.second_order._distributed`): the
loss and the gradient of the union (one all-reduce of the whole gradient), the Kronecker factors of the union
(their all-reduce, on refresh steps), the damped inverses by owner rank, the exact-GGN Gram matrix of the
candidate directions and rho's objective (scalars, all-reduced), so every rank computes the identical whole
update ``alpha* d (+ beta prev)``. Each rank then adds ITS rows of it to its local shard (and the replica):
the user's model stays sharded, and equals the single-process optimiser on the union of the ranks' data.

Communication per step on P ranks, |theta| the number of parameters: the parameter all-gather (|theta| values
received per rank), the gradient all-reduce (|theta|), the factor all-reduce on refresh steps (the upper
triangles of every G and A), the inverses' broadcasts (KAISA placement, the reducer's ``placement``) and a few
scalars; the updates themselves never travel (every rank computes the whole update and keeps its rows).
Memory per rank during a step: the whole parameters, their gradient and the candidate directions (each
|theta|), on top of the whole Kronecker factors that every rank holds anyway; between steps only the shards.

Refused by name: no ``distributed=`` (each rank's data alone is not the minibatch); ``step(closure)`` (the
closure's ``backward()`` runs FSDP2's own gradient reduce-scatter, which averages the ranks' gradients without
their counted terms and writes ``p.grad`` shards: use ``step(batch=(X, y))``); parameters sharded otherwise than
FSDP2's (``Shard(0)`` on a 1-D mesh, or HSDP's ``(Replicate(), Shard(0))`` on a 2-D mesh, of the reducer's
ranks; :data:`curvkit.distributed.sharded.LAYOUTS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from curvkit.distributed.sharded import ShardedReplica

__all__ = ["check_sharded_step", "sharded_replica"]


def sharded_replica(model: nn.Module, distributed: Any) -> ShardedReplica:
    """The whole-parameter replica of an FSDP2 model for GaussNewton, or the refusal of what it cannot do."""
    if distributed is None:
        raise ValueError("GaussNewton: the model's parameters are FSDP2 (DTensor) shards, so each rank runs it on "
                         "its own shard of the data; pass distributed=Reducer() (the step of the union of the "
                         "ranks' data, every rank updating its own shard)")
    return ShardedReplica(model, distributed, "GaussNewton")


def check_sharded_step(closure: Callable[[], Any] | None) -> None:
    if closure is not None:
        raise TypeError("GaussNewton.step(closure) on an FSDP2-sharded model: the closure's backward() runs FSDP2's "
                        "gradient reduce-scatter (a plain average over the ranks, not the union's loss) and writes "
                        "p.grad shards; use step(batch=(X, y)), which computes the union's gradient itself")
