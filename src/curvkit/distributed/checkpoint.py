"""Checkpoints of a data-parallel run: rank 0 writes atomically, every rank loads.

:func:`save_checkpoint` gathers each rank's own state (``rank_state``: what differs between the ranks,
such as the generator of sampled labels seeded per rank) to rank 0, which writes ``{"state", "world_size",
"rank_states"}`` with :func:`curvkit.checkpoint.save` (temporary file, fsync, atomic rename); then every
rank waits at a barrier, so no rank reads a checkpoint before it is complete.

:func:`load_checkpoint` reads it on every rank. Resuming with a different number of processes:

* the shared ``state`` (parameters, optimiser state, all-reduced factor statistics, damping, shared
  Monte Carlo generators) is the same whatever the number of ranks, because every reduction is defined on
  the union of the shards; a run resumed on P' != P processes that feeds the same union batches
  continues exactly (to rounding);
* per-rank states cannot be re-split (rank r's stream of sampled labels has no counterpart on P'
  processes): when the checkpoint holds them and ``rank_state_required=True``, loading on a different
  number of processes raises :class:`DistributedCheckpointError` saying so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from curvkit import checkpoint
from curvkit.distributed.reducer import Reducer

__all__ = ["DistributedCheckpointError", "load_checkpoint", "save_checkpoint"]


class DistributedCheckpointError(ValueError):
    """A distributed checkpoint cannot be resumed in this configuration (the message says why and how)."""


def save_checkpoint(path: str | Path, state: Any, distributed: Reducer, rank_state: Any = None) -> None:
    """Rank 0 writes ``state`` plus every rank's ``rank_state`` to ``path`` atomically; all ranks return
    after the file is complete."""
    rank_states = distributed.all_gather_object(rank_state)
    if distributed.is_primary:
        checkpoint.save({"state": state, "world_size": distributed.world_size,
                         "rank_states": None if all(s is None for s in rank_states) else rank_states,
                         "format": "curvkit.distributed/1"}, path)
    distributed.barrier()


def load_checkpoint(path: str | Path, distributed: Reducer, *, rank_state_required: bool = False,
                    map_location: Any = "cpu") -> tuple[Any, Any]:
    """(state, this rank's rank_state or None) from a checkpoint written by :func:`save_checkpoint`.

    Raises :class:`DistributedCheckpointError` if the file is not such a checkpoint, or if it holds
    per-rank states, ``rank_state_required`` is set and the number of processes differs."""
    distributed.barrier()
    blob = checkpoint.load(path, map_location=map_location)
    if not isinstance(blob, dict) or blob.get("format") != "curvkit.distributed/1":
        raise DistributedCheckpointError(f"{path} was not written by curvkit.distributed.save_checkpoint")
    saved = int(blob["world_size"])
    rank_states = blob["rank_states"]
    if rank_states is None:
        return blob["state"], None
    if saved != distributed.world_size:
        if rank_state_required:
            raise DistributedCheckpointError(
                f"{path} was written by {saved} processes and holds per-rank random state (e.g. the labels "
                f"each rank samples for a KFAC or projection curvature); it cannot be split over "
                f"{distributed.world_size} processes. Resume with torchrun --nproc_per_node={saved}, or use a "
                "deterministic curvature (kflr, kfra) whose state does not depend on the number of processes")
        return blob["state"], None
    return blob["state"], rank_states[distributed.rank]
