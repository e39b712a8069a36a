"""Exact curvature operators of an FSDP2-sharded model over the ranks' data: :func:`sharded_operator` (issue 33).

The math. Each rank r holds a shard D_r of the data and a shard of every parameter (FSDP2 ``fully_shard``:
DTensor parameters, rows of the whole tensors). The operator of the union is that of the whole parameters
theta on D = union of the D_r,

    C(theta) v = sum_r c_r C_r(theta) v,   c_r = 1 ('sum'),   c_r = M_r / M ('mean', M = sum_r M_r counted terms),

with C_r rank r's operator (:class:`~curvkit.curvature.exact.HessianOperator`, ``GGNOperator``,
``FisherOperator``, ``EmpiricalFisherOperator``, ``MCFisherOperator``: any
:class:`~curvkit.curvature.exact.ExactCurvatureOperator`) of its own data at the whole theta
(:class:`curvkit.distributed.DistributedOperator`'s weights).

The route (simple and exact). The whole parameters are all-gathered once, at construction, into a hook-free
replica of the model (:class:`curvkit.distributed.sharded.ShardedReplica`; one all-gather through the
``Reducer``, about |theta| values received per rank); rank r's operator is built on the replica and its data
shard, and :class:`~curvkit.distributed.DistributedOperator` scales and all-reduces every product (the
products, diagonals, traces, ``to_dense``; Lanczos, CG and the other nonlinear algorithms run on the reduced
products, identical on every rank).

Layout. Vectors are FULL flat vectors over the model's trainable parameters in ``named_parameters`` order,
each whole tensor flattened row-major (the same (d,) vector on every rank): the layout of the Kronecker
operators of sharded models (``KroneckerEstimator(..., distributed=)``), so the two can be compared, summed
and used in each other's algorithms.

Memory per rank. One whole copy of the parameters (the evaluation point, |theta| values: what FSDP2 avoids
holding at once elsewhere) for the operator's lifetime, plus the operator's own cost on the rank's data
(products of k columns at a time, ``chunk_size``). With ``snapshot=True`` (the default) the operator keeps its
snapshot and the replica's storage is freed after construction; with ``snapshot=False`` it holds the
replica's tensors (no second copy during construction), and the buffers and unsharded parameters are the
user's own (an in-place change of them makes every later product raise, as for any operator).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from curvkit.curvature.exact import ExactCurvatureOperator
from curvkit.distributed.operator import DistributedOperator
from curvkit.distributed.reducer import Reducer
from curvkit.distributed.sharded import ShardedReplica, is_sharded
from curvkit.likelihoods import Likelihood
from curvkit.structure import uncompiled

__all__ = ["sharded_operator"]


def sharded_operator(operator: type[ExactCurvatureOperator], model: nn.Module, likelihood: Likelihood, data: Any,
                     *, distributed: Reducer, **options: Any) -> DistributedOperator:
    """``operator(model, likelihood, data, **options)`` of the UNION of the ranks' data shards for a model whose
    parameters are FSDP2 (DTensor) shards (module docstring): a :class:`~curvkit.distributed.DistributedOperator`
    whose products take and return full flat (d,) vectors (or (d, k) matrices), identical on every rank.

    Args:
        operator: an exact operator class (``GGNOperator``, ``HessianOperator``, ``FisherOperator``,
            ``EmpiricalFisherOperator``, ``MCFisherOperator``).
        model: the ``fully_shard`` model (its DTensor parameters sharded on dim 0 over a 1-D mesh of the
            reducer's ranks, FSDP2's default, or HSDP's ``(Replicate(), Shard(0))`` over a 2-D mesh of them:
            gathered within each shard group, the data reduced over all the ranks); a model without DTensor
            parameters is taken as it is (the data-parallel operator).
        likelihood, data: as for ``operator``; ``data`` is THIS rank's shard (every rank its own).
        distributed: the :class:`~curvkit.distributed.Reducer` of the ranks.
        options: the operator's own keywords (``chunk_size``, ``snapshot``, ``compute_dtype``, ...).

    Every rank must call it (collectives), with the same operator class and options.
    """
    if not (isinstance(operator, type) and issubclass(operator, ExactCurvatureOperator)):
        raise TypeError(f"operator must be an exact curvature operator class (GGNOperator, HessianOperator, "
                        f"FisherOperator, EmpiricalFisherOperator, MCFisherOperator), got {operator!r}")
    if not isinstance(distributed, Reducer):
        raise TypeError(f"distributed must be a curvkit.distributed.Reducer, got {type(distributed).__name__}")
    model = uncompiled(model)
    if not is_sharded(model):
        return DistributedOperator(operator(model, likelihood, data, **options), distributed)
    replica = ShardedReplica(model, distributed, operator.__name__)
    local = operator(replica.module, likelihood, data, **options)
    if options.get("snapshot", True):  # the operator evaluates at its own copies: free the gathered ones
        replica.release()
    return DistributedOperator(local, distributed)
