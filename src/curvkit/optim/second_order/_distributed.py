"""Data-parallel pieces of :class:`curvkit.optim.GaussNewton` (thesis ch. 4) and their math.

Per step on P ranks (rank r holds B_r of the minibatch's B examples):

* loss and gradient: each rank differentiates its shard's loss; the gradient and the loss are
  all-reduced in one message, summed for ``reduction='sum'`` and as sum_r B_r x_r / B for ``'mean'``
  (:func:`reduce_loss_and_grads`): the minibatch loss and gradient of the union;
* Kronecker factors (on refresh steps only): the estimator's ``_combine`` all-reduces the factor sums and
  the count (upper triangles), KFRA's batch means first (:class:`curvkit.curvature.KroneckerEstimator`);
* inverses (:class:`DistributedKroneckerInverse`): each layer's inverse is computed once, by its owner rank
  (:func:`curvkit.distributed.placement.assign_owners`, by cost n_G^3 + n_A^3), and sent to the layer's
  gradient workers: for ``inversion='factored'`` the two Cholesky factors of the damped factors (lower
  triangles) per damping, for ``'eigen'`` the two eigendecompositions once per refresh (any damping is then
  local); ``comm-opt`` sends them to every rank, ``mem-opt`` keeps them on the owner and broadcasts the
  layer's direction instead, ``hybrid`` does both within KAISA's gradient-worker and receiver groups;
* the exact-GGN quadratic model: the k x k Gram matrix d_i^T G d_j of the candidate directions (Eq. 4.18)
  is a sum over examples, all-reduced like the loss (:func:`reduce_like_loss`), and the objective after
  the step (rho, Eq. 4.21) likewise. alpha*, rho, tau and zeta are then computed from identical numbers on
  every rank, and the owners' results reach every rank (the owner included) as identically laid-out
  tensors (:meth:`~curvkit.distributed.Reducer.share`), so every rank takes the bitwise identical step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from curvkit.distributed.placement import Assignment, assign_owners, factor_cost
from curvkit.distributed.reducer import Reducer

__all__ = ["DistributedKroneckerInverse", "reduce_like_loss", "reduce_loss_and_grads"]


def reduce_like_loss(distributed: Reducer, tensors: list[Tensor], batch_size: int, reduction: str) -> list[Tensor]:
    """Sums over the ranks (``'sum'``) or the union mean sum_r B_r x_r / sum_r B_r (``'mean'``)."""
    if reduction == "mean":
        return distributed.weighted_mean(tensors, batch_size)[0]
    return distributed.sum(tensors, "all_reduce of loss terms")


def reduce_loss_and_grads(distributed: Reducer, loss: Tensor, grads: list[Tensor], batch_size: int,
                          reduction: str, synced: bool) -> tuple[Tensor, list[Tensor]]:
    """The union's loss and gradient (module docstring); ``synced`` gradients are kept, only the loss travels."""
    if synced:
        return reduce_like_loss(distributed, [loss.reshape(1)], batch_size, reduction)[0].reshape(()), grads
    out = reduce_like_loss(distributed, [loss.reshape(1).to(grads[0].dtype), *list(grads)], batch_size, reduction)
    return out[0].reshape(()).to(loss.dtype), out[1:]


def _assignment(op: Any, distributed: Reducer) -> Assignment:
    costs = [factor_cost(b.G.shape[0], b.A.shape[0]) for b in op.blocks]
    return assign_owners(costs, distributed.world_size, distributed.placement, distributed.grad_worker_fraction)


class DistributedKroneckerInverse:
    """``(G~ + delta I)^{-1}`` applied to a gradient with owner-computed per-layer inverses (module docstring).

    Args:
        op: the (all-reduced, identical on every rank) undamped :class:`~curvkit.linalg.kron.KroneckerOperator`.
        damping: delta = lambda + zeta.
        inversion: ``'factored'`` (Eq. 4.25, with ``omegas``) or ``'eigen'``.
        omegas: per block, for ``'factored'``.
        distributed: the reducer (its ``placement``).
    """

    def __init__(self, op: Any, damping: float, inversion: str, omegas: list[float] | None, distributed: Reducer):
        from curvkit.optim.second_order.direction import FactoredInverse, _cholesky  # a sibling module

        self.op, self.damping, self.inversion, self.red = op, float(damping), inversion, distributed
        assign = getattr(op, "_curvkit_assignment", None)
        if assign is None:
            assign = _assignment(op, distributed)
            setattr(op, "_curvkit_assignment", assign)  # noqa: B010
        self.assign: Assignment = assign
        red, rank = distributed, distributed.rank
        self.mine = [l for l, w in enumerate(assign.grad_workers) if rank in w]  # layers this rank preconditions
        # subgroups are created by every rank in the same order (torch.distributed.new_group's rule): the
        # gradient-worker groups and, when directions are broadcast, KAISA's receiver blocks
        P = red.world_size
        self._groups = {w: red.subgroup(w) for w in sorted(set(assign.grad_workers)) if 1 < len(w) < P}
        for size in sorted({len(w) for w in assign.grad_workers if len(w) < P}):
            if P % size:
                raise ValueError(f"hybrid placement: {P} ranks cannot be split into gradient-worker groups of {size}; "
                                 "choose grad_worker_fraction so that 1/fraction divides the number of processes")
            n = P // size
            for c in range(P // n):
                red.subgroup(tuple(range(c * n, c * n + n)))
        if inversion == "factored":
            assert omegas is not None
            k = damping ** 0.5
            fi = FactoredInverse.__new__(FactoredInverse)
            fi.blocks = []
            for l, (b, om) in enumerate(zip(op.blocks, omegas)):
                workers, owner = assign.grad_workers[l], assign.owner[l]
                if rank not in workers:
                    continue
                if rank == owner:
                    Gd = b.G.clone()
                    Gd.diagonal().add_(k / om)
                    Ad = b.A.clone()
                    Ad.diagonal().add_(om * k)
                    LG, LA = _cholesky(Gd, f"{b.weight_name!r} G"), _cholesky(Ad, f"{b.weight_name!r} A")
                else:
                    LG, LA = b.G.new_empty(b.G.shape), b.A.new_empty(b.A.shape)
                if len(workers) > 1:  # the same fresh tensors on every worker, the owner's included
                    LG, LA = red.share_symmetric([LG, LA], owner, lower=True, what="broadcast of Cholesky factors",
                                                 group=red.subgroup(workers))
                fi.blocks.append((b.weight_name, b.bias_name, LG, LA))
            self._factored = fi
        elif inversion == "eigen":
            self._eigen_blocks()
        else:
            raise ValueError(f"unknown inversion {inversion!r}")

    def _eigen_blocks(self) -> None:
        """Owner eigendecompositions (cached on the operator: independent of the damping), broadcast to the
        gradient workers; a sub-operator of this rank's layers carries them."""
        from curvkit.linalg.kron import KroneckerEigh, stable_eigh

        op, red, assign, rank = self.op, self.red, self.assign, self.red.rank
        eig: dict[int, Any] | None = getattr(op, "_curvkit_eigh", None)
        if eig is None:
            eig = {}
            for l, b in enumerate(op.blocks):
                workers, owner = assign.grad_workers[l], assign.owner[l]
                if rank not in workers:
                    continue
                if rank == owner:
                    lG, QG = stable_eigh(b.G, f"factor G of {b.weight_name!r}")
                    lA, QA = stable_eigh(b.A, f"factor A of {b.weight_name!r}")
                else:
                    nG, nA = b.G.shape[0], b.A.shape[0]
                    lG, QG, lA, QA = b.G.new_empty(nG), b.G.new_empty(nG, nG), b.A.new_empty(nA), b.A.new_empty(nA, nA)
                if len(workers) > 1:  # the same fresh tensors on every worker (eigh's Q is column-major)
                    QG, lG, QA, lA = red.share([QG, lG, QA, lA], owner, "broadcast of eigendecompositions",
                                               group=red.subgroup(workers))
                eig[l] = KroneckerEigh(lG, QG, lA, QA)
            setattr(op, "_curvkit_eigh", eig)  # noqa: B010
        names = [n for l in self.mine for n in op.blocks[l].names]
        if len(self.mine) == len(op.blocks):
            sub = op
        else:
            sub = op.block(names) if names else None
        if sub is not None:
            if sub._eigh is None:
                sub._eigh = [eig[l] for l in self.mine]
            self._sub = sub.inverse(self.damping, method="eigen")
            self._sub_names = list(sub.layout.names)
        else:
            self._sub = None
            self._sub_names = []
        self._eig = eig

    def apply(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """The direction for every parameter (by name), identical on every rank."""
        out: dict[str, Tensor] = {}
        if self.inversion == "factored":
            out.update(self._factored.apply(grads))
        elif self._sub is not None:
            out.update(zip(self._sub_names, self._sub @ [grads[n] for n in self._sub_names]))
        P = self.red.world_size
        for l, b in enumerate(self.op.blocks):
            workers = self.assign.grad_workers[l]
            if len(workers) == P:
                continue
            # receiver blocks: ranks c*n .. c*n + n - 1 receive from the worker among them (KAISA's receivers)
            n = P // len(workers)
            block_start = (self.red.rank // n) * n
            block = tuple(range(block_start, block_start + n))
            src = next(r for r in block if r in workers)
            tensors = [out[nm] if self.red.rank == src else torch.empty_like(grads[nm]) for nm in b.names]
            tensors = self.red.share(tensors, src, "broadcast of preconditioned gradients",
                                     group=self.red.subgroup(block))
            out.update(zip(b.names, tensors))
        return out


def reduce_step_inputs(opt: Any, X: Tensor, data_loss: Tensor, grads: list[Tensor], evaluate: Any,
                       from_closure: bool) -> tuple[Tensor, list[Tensor], Any]:
    """GaussNewton's hook: the union's data loss and gradient, and an ``evaluate()`` of the union's
    objective (the weight-decay term is identical on every rank and is added once)."""
    import math

    red: Reducer = opt.distributed
    reduction = opt.likelihood.reduction
    B = int(X.shape[0])
    synced = from_closure and red.grads == "synced"
    loss, grads = reduce_loss_and_grads(red, data_loss, grads, B, reduction, synced)
    params = opt.ordered_params()

    def evaluate_union() -> float:
        reg = opt._objective(params[0].new_zeros(()), params)
        local = evaluate() - reg
        if not math.isfinite(local):
            local = math.inf
        t = red.tensor([local], torch.float64)  # on the communication device
        value = float(reduce_like_loss(red, [t], B, reduction)[0][0])
        return value + reg if math.isfinite(value) else math.inf

    return loss, grads, evaluate_union
