"""Data-parallel training and curvature on ``torch.distributed`` (gloo on CPUs, NCCL on GPUs).

One object, the :class:`Reducer`, carries every collective; the curvkit classes take it through one
keyword, ``distributed=``, and then compute the quantity of the UNION of the ranks' shards, the same on
every rank (the weights for unequal shards are in :mod:`curvkit.distributed.reducer`):

* estimators (``KroneckerEstimator``, ``DiagonalEstimator``): each update's statistics and counts are
  all-reduced (symmetric factors as upper triangles), so ``operator()`` is the curvature of the union;
* exact operators over sharded data: :class:`DistributedOperator` (products, diagonals, traces with
  shared Hutchinson probes, Lanczos, CG);
* mean-field optimisers (``MESU``, ``MESUNoReg``, ``BGD``, ``BBBSGD``): the same weight samples on every
  rank (the noise generator is synchronised from rank 0), g_mu, g_sigma and the loss all-reduced;
* Kronecker filters (``KFWhiten``, ``KFBayes``, ``KFNatGrad``) and ``GaussNewton``: factors all-reduced when
  they are refreshed, inverses computed once per layer on an owner rank and broadcast
  (:mod:`curvkit.distributed.placement`: KAISA's comm-opt, mem-opt, hybrid), damping and step-size
  scalars from all-reduced quantities, so every rank takes the identical step;
* ``Laplace`` posteriors: the curvature sources' reductions above, the posterior of the union whole on every rank
  (an FSDP2 model's on its whole-parameter replica, :mod:`curvkit.distributed.sharded`);
* LLC: chains spread over ranks or data-parallel gradients within a chain (:mod:`curvkit.slt._distributed`);
* checkpoints: :func:`save_checkpoint` / :func:`load_checkpoint`; of FSDP2-sharded runs (the model's shards through
  ``torch.distributed.checkpoint``, curvkit's whole state beside them, resumable on another number of processes):
  :func:`save_sharded_checkpoint` / :func:`load_sharded_checkpoint`;
* launching: ``torchrun --nproc_per_node=N`` + :func:`init`, and :func:`finish` to end every process
  cleanly (exit code 0 after correct work, 1 after an error); :func:`spawn` for tests; :func:`ddp` for
  DistributedDataParallel with the union gradient on unequal shards (:func:`set_loss_terms` for a padded mean).

Every collective goes through one entry point (``Reducer._collective``) that refuses a tensor off the
backend's communication device (CPU for gloo, the current CUDA device for NCCL) and waits with the
reducer's timeout on every backend; replicas stay bitwise identical (``Reducer.check_identical``).
"""

from curvkit.distributed.checkpoint import DistributedCheckpointError, load_checkpoint, save_checkpoint
from curvkit.distributed.ddp import ddp, set_loss_terms
from curvkit.distributed.launch import destroy, env_world_size, finish, init, spawn
from curvkit.distributed.operator import DistributedOperator
from curvkit.distributed.placement import Assignment, assign_owners, factor_cost
from curvkit.distributed.reducer import (
    CollectiveError,
    CollectiveTimeout,
    CommStats,
    CommunicationDeviceError,
    Reducer,
    ReplicaMismatch,
    communication_device,
    communication_devices,
    derive_seed,
    shard_range,
    wait_for,
)
from curvkit.distributed.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint

__all__ = [
    "Assignment",
    "CollectiveError",
    "CollectiveTimeout",
    "CommStats",
    "CommunicationDeviceError",
    "DistributedCheckpointError",
    "DistributedOperator",
    "Reducer",
    "ReplicaMismatch",
    "assign_owners",
    "communication_device",
    "communication_devices",
    "current",
    "ddp",
    "derive_seed",
    "destroy",
    "env_world_size",
    "factor_cost",
    "finish",
    "init",
    "load_checkpoint",
    "load_sharded_checkpoint",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "set_current",
    "set_loss_terms",
    "shard_range",
    "spawn",
    "wait_for",
]

_CURRENT: Reducer | None = None


def current() -> Reducer | None:
    """The reducer set by :func:`set_current` (``curvkit reproduce --distributed`` sets one with
    ``shard_batches=True``); optimisers built with ``distributed=None`` use it. None outside such a run."""
    return _CURRENT


def set_current(reducer: Reducer | None) -> None:
    """Make ``reducer`` the default of the optimisers constructed afterwards (None: none)."""
    global _CURRENT
    _CURRENT = reducer
