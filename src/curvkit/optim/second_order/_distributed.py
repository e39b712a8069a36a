"""Data-parallel pieces of :class:`curvkit.optim.GaussNewton` (thesis ch. 4) and their math.

Per step on P ranks (rank r holds B_r of the minibatch's B examples):

* loss and gradient: each rank differentiates its shard's SUMMED loss (the likelihood with
  ``reduction='sum'``, :attr:`GaussNewton._shard_likelihood`; a closure's mean loss and gradient are
  multiplied by the shard's counted terms M_r), and the sums travel with M_r in one message: summed for
  ``reduction='sum'``, divided by M = sum_r M_r for ``'mean'`` (:func:`reduce_sums`), the minibatch
  loss and gradient of the union. M_r is ``likelihood.num_terms``, the positions that are not padding,
  never the number of sequences (:mod:`curvkit.distributed.reducer`, "Weights for unequal shards"); a
  rank whose every target is padding contributes nothing;
* Kronecker factors (on refresh steps only): the estimator's ``_combine`` all-reduces the factor sums and
  the count (upper triangles), KFRA's batch means first (:class:`curvkit.curvature.KroneckerEstimator`);
* inverses (:class:`DistributedKroneckerInverse`): the inverses of each parameter UNIT (the blocks that
  read the same parameters: one layer's, or the q/k/v blocks of a packed attention weight, or the groups of a
  convolution) are computed once, by the unit's owner rank (:func:`curvkit.distributed.placement.assign_owners`,
  by cost n_G^3 + n_A^3 per block, a diagonal A costing nothing), and sent to its gradient workers: for
  ``inversion='factored'`` the Cholesky factors of the damped factors (lower triangles; a diagonal A as it
  is) per damping, for ``'eigen'`` the eigendecompositions once per refresh (any damping is then local);
  a vocabulary-sized head's low-rank G (:class:`~curvkit.linalg.factors.LowRankFactor`, identical on every
  rank: its rows were gathered) is thin and never travels: each worker takes its own inverse or eigenpairs;
  ``comm-opt`` sends them to every rank, ``mem-opt`` keeps them on the owner and broadcasts the unit's
  direction instead, ``hybrid`` does both within KAISA's gradient-worker and receiver groups. A block that
  is the SUM of two Kronecker terms (a tied weight: :attr:`curvkit.linalg.kron.KroneckerBlock.second`; its
  second term's factors are all-reduced with the first's, as every use's statistics are) is placed like any
  other unit, at the cost of both terms: for ``'factored'`` its owner computes the generalised
  eigendecompositions of the damped pair (:class:`~curvkit.linalg.kron.KroneckerPairEigh`: ``W_G``, ``W_A``,
  ``g``, ``a``) and shares them like Cholesky factors (with a low-rank head G every worker computes the thin
  ones itself); for ``'eigen'`` (``G (x) A + G2 (x) A2 + delta I`` has
  no closed form: conjugate gradients on the block alone, as in one process) its owner solves for the unit's
  direction and shares that with every rank, whatever the placement;
* the exact-GGN quadratic model: the k x k Gram matrix d_i^T G d_j of the candidate directions (Eq. 4.18)
  is a sum over the counted terms, evaluated on the shard with the summed loss and reduced like the loss
  (:func:`reduce_sums`), and the objective after the step (rho, Eq. 4.21) likewise. alpha*, rho, tau and zeta are then computed from identical numbers on
  every rank, and the owners' results reach every rank (the owner included) as identically laid-out
  tensors (:meth:`~curvkit.distributed.Reducer.share`), so every rank takes the bitwise identical step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from curvkit.distributed.placement import Assignment, assign_owners, factor_cost
from curvkit.distributed.reducer import Reducer
from curvkit.linalg.factors import LowRankFactor

__all__ = ["DistributedKroneckerInverse", "reduce_step_inputs", "reduce_sums"]


def reduce_sums(distributed: Reducer, sums: list[Tensor], terms: int, reduction: str) -> list[Tensor]:
    """The union's loss-like quantities from this rank's SUMS over its ``terms`` counted loss terms: summed
    over the ranks (``'sum'``), or divided by the union's count sum_r M_r (``'mean'``, one message)."""
    if reduction == "mean":
        return distributed.mean_of_sums(sums, terms)[0]
    return distributed.sum(sums, "all_reduce of loss terms")


def _assignment(op: Any, units: list[list[int]], distributed: Reducer) -> Assignment:
    """KAISA placement of the parameter units (:func:`~curvkit.optim.second_order.direction.parameter_units`)
    by their factorisation cost (a diagonal input factor costs nothing to invert)."""
    def cost(b: Any) -> float:  # a pair block: both terms' factors; a thin G: every rank's own, free
        G = 0.0 if isinstance(b.G, LowRankFactor) else factor_cost(b.G.shape[0])
        return (1 + b.pair) * (G + (0.0 if b.A.dim() == 1 else factor_cost(b.A.shape[0])))

    costs = [sum(cost(op.blocks[l]) for l in unit) for unit in units]
    return assign_owners(costs, distributed.world_size, distributed.placement, distributed.grad_worker_fraction)


def _empty_like(t: Tensor) -> Tensor:
    return t.new_empty(t.shape)


class DistributedKroneckerInverse:
    """``(G~ + delta I)^{-1}`` applied to a gradient with owner-computed per-unit inverses (module docstring).

    Placement, broadcasts and the preconditioned-gradient exchange are per parameter UNIT (the blocks that
    read the same parameters: the q/k/v blocks of a packed attention weight, the groups of a convolution;
    any other block alone), so every parameter's direction is written by one rank.

    Args:
        op: the (all-reduced, identical on every rank) undamped :class:`~curvkit.linalg.kron.KroneckerOperator`.
        damping: delta = lambda + zeta.
        inversion: ``'factored'`` (Eq. 4.25, with ``omegas``) or ``'eigen'``.
        omegas: per block, for ``'factored'``.
        distributed: the reducer (its ``placement``).
    """

    def __init__(self, op: Any, damping: float, inversion: str, omegas: list[float] | None, distributed: Reducer):
        from curvkit.optim.second_order.direction import parameter_units  # a sibling module

        self.op, self.damping, self.inversion, self.red = op, float(damping), inversion, distributed
        cached = getattr(op, "_curvkit_assignment", None)
        if cached is None:
            units = parameter_units(op)
            cached = (units, _assignment(op, units, distributed))
            setattr(op, "_curvkit_assignment", cached)  # noqa: B010
        self.units: list[list[int]] = cached[0]
        self.assign: Assignment = cached[1]
        red, rank = distributed, distributed.rank
        self.mine = [u for u, w in enumerate(self.assign.grad_workers) if rank in w]  # units this rank preconditions
        #: units with a pair block, whose direction their owner solves for and shares with every rank ('eigen')
        self.solved = ([u for u, unit in enumerate(self.units) if any(op.blocks[l].pair for l in unit)]
                       if inversion == "eigen" else [])
        # subgroups are created by every rank in the same order (torch.distributed.new_group's rule): the
        # gradient-worker groups and, when directions are broadcast, KAISA's receiver blocks
        P = red.world_size
        self._groups = {w: red.subgroup(w) for w in sorted(set(self.assign.grad_workers)) if 1 < len(w) < P}
        for size in sorted({len(w) for w in self.assign.grad_workers if len(w) < P}):
            if P % size:
                raise ValueError(f"hybrid placement: {P} ranks cannot be split into gradient-worker groups of {size}; "
                                 "choose grad_worker_fraction so that 1/fraction divides the number of processes")
            n = P // size
            for c in range(P // n):
                red.subgroup(tuple(range(c * n, c * n + n)))
        if inversion == "factored":
            assert omegas is not None
            self._factored_blocks(omegas)
        elif inversion == "eigen":
            self._eigen_blocks()
        else:
            raise ValueError(f"unknown inversion {inversion!r}")

    def _factored_blocks(self, omegas: list[float]) -> None:
        """Owner Cholesky factors of the damped factors (lower triangles; a diagonal A as it is), shared with
        the unit's gradient workers."""
        from curvkit.optim.second_order.direction import FactoredInverse, cholesky_factors, damped_blocks

        op, red, assign, rank = self.op, self.red, self.assign, self.red.rank
        damped = damped_blocks(op, self.damping, omegas)
        entries: list[tuple[Any, Any, Any]] = []
        for u in self.mine:
            workers, owner = assign.grad_workers[u], assign.owner[u]
            for l in self.units[u]:
                d = damped.blocks[l]
                if d.pair:  # the sum of two terms: the owner's generalised eigendecompositions
                    entries.append((op.blocks[l], self._pair_eigh(d, owner, workers), None))
                    continue
                if rank == owner:
                    LG, LA = cholesky_factors(d)
                elif isinstance(d.G, LowRankFactor):  # thin, from identical factors: every worker's own
                    LG, LA = d.G.inverse(f"{d.name!r} G"), _empty_like(d.A)
                else:
                    LG, LA = _empty_like(d.G), _empty_like(d.A)
                if len(workers) > 1 and isinstance(LG, LowRankFactor):  # only A's factor travels
                    group = red.subgroup(workers)
                    if LA.dim() == 1:
                        (LA,) = red.share([LA], owner, "broadcast of diagonal factors", group=group)
                    else:
                        (LA,) = red.share_symmetric([LA], owner, lower=True, what="broadcast of Cholesky factors",
                                                    group=group)
                elif len(workers) > 1:  # the same fresh tensors on every worker, the owner's included
                    group = red.subgroup(workers)
                    if LA.dim() == 1:
                        (LG,) = red.share_symmetric([LG], owner, lower=True, what="broadcast of Cholesky factors",
                                                    group=group)
                        (LA,) = red.share([LA], owner, "broadcast of diagonal factors", group=group)
                    else:
                        LG, LA = red.share_symmetric([LG, LA], owner, lower=True,
                                                     what="broadcast of Cholesky factors", group=group)
                entries.append((op.blocks[l], LG, LA))
        self._factored = FactoredInverse.of_blocks(entries)

    def _pair_eigh(self, d: Any, owner: int, workers: tuple[int, ...]) -> Any:
        """The owner's :class:`~curvkit.linalg.kron.KroneckerPairEigh` of the damped pair block ``d`` (the
        damping already on its second term), shared with the unit's gradient workers (the owner included)."""
        from curvkit.linalg.kron import KroneckerPairEigh, pair_eigh

        red = self.red
        if d.low_rank_output:  # thin (O(V r^2)) from factors identical on every rank: each worker's own
            return pair_eigh(d)
        if red.rank == owner:
            pe = pair_eigh(d)
        else:  # the shapes of KroneckerPairEigh.of for a dense G: W_A a vector when both A's are diagonal
            G, A, (_, A2) = d.G, d.A, d.second
            diagonal = A.dim() == 1 and A2.dim() == 1
            pe = KroneckerPairEigh(G.new_empty(G.shape), A.new_empty(A.shape if diagonal else (A.shape[0],) * 2),
                                   G.new_empty(G.shape[0]), A.new_empty(A.shape[0]), G.new_empty(()))
        if len(workers) > 1:
            WG, WA, g, a, base = red.share([pe.WG, pe.WA, pe.g, pe.a, pe.logdet_base], owner,
                                           "broadcast of pair eigendecompositions", group=red.subgroup(workers))
            pe = KroneckerPairEigh(WG, WA, g, a, base)
        return pe

    def _eigen_blocks(self) -> None:
        """Owner eigendecompositions (cached on the operator: independent of the damping), broadcast to the
        gradient workers; a sub-operator of this rank's units carries them."""
        from curvkit.linalg.kron import KroneckerEigh, stable_eigh

        op, red, assign, rank = self.op, self.red, self.assign, self.red.rank
        eig: dict[int, Any] | None = getattr(op, "_curvkit_eigh", None)
        if eig is None:
            eig = {}
            for u in (u for u in self.mine if u not in self.solved):
                workers, owner = assign.grad_workers[u], assign.owner[u]
                for l in self.units[u]:
                    b = op.blocks[l]
                    diagonal = b.A.dim() == 1  # its eigenvectors are the identity (None), its eigenvalues A
                    thin = isinstance(b.G, LowRankFactor)  # already an eigendecomposition, identical everywhere
                    rest = (b.G.complement, b.G.c) if thin else (0, 0.0)
                    if thin:
                        lG, QG = b.G.s, b.G.U
                    elif rank == owner:
                        lG, QG = stable_eigh(b.G, f"factor G of {b.name!r}")
                    else:
                        lG, QG = b.G.new_empty(b.G.shape[0]), b.G.new_empty(b.G.shape)
                    if rank == owner:
                        lA, QA = (b.A.clone(), None) if diagonal else stable_eigh(b.A, f"factor A of {b.name!r}")
                    else:
                        lA, QA = b.A.new_empty(b.A.shape[0]), None if diagonal else b.A.new_empty(b.A.shape)
                    if len(workers) > 1:  # the same fresh tensors on every worker (eigh's Q is column-major)
                        shared = red.share(([] if thin else [QG, lG]) + [lA] + ([] if QA is None else [QA]), owner,
                                           "broadcast of eigendecompositions", group=red.subgroup(workers))
                        if not thin:
                            QG, lG, shared = shared[0], shared[1], shared[2:]
                        lA = shared[0]
                        QA = None if diagonal else shared[1]
                    eig[l] = KroneckerEigh(lG, QG, lA, QA, *rest)
            setattr(op, "_curvkit_eigh", eig)  # noqa: B010
        mine_blocks = [l for u in self.mine if u not in self.solved for l in self.units[u]]
        names = list(dict.fromkeys(n for l in mine_blocks for n in op.blocks[l].names))
        if len(mine_blocks) == len(op.blocks):
            sub = op
        else:
            sub = op.block(names) if names else None
        if sub is not None:
            if sub._eigh is None:
                sub._eigh = [eig[l] for l in sorted(mine_blocks)]  # op.block keeps the operator's block order
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
        for u in self.solved:  # pair units under 'eigen': the owner's conjugate-gradient direction, to every rank
            names = list(dict.fromkeys(n for l in self.units[u] for n in self.op.blocks[l].names))
            if self.red.rank == self.assign.owner[u]:
                inv = self.op.block(names).inverse(self.damping, method="eigen")
                tensors = list(inv @ [grads[n] for n in names])
            else:
                tensors = [torch.empty_like(grads[n]) for n in names]
            out.update(zip(names, self.red.share(tensors, self.assign.owner[u], "broadcast of pair directions")))
        for u, unit in enumerate(self.units):
            workers = self.assign.grad_workers[u]
            if len(workers) == P or u in self.solved:
                continue
            names = list(dict.fromkeys(n for l in unit for n in self.op.blocks[l].names))
            # receiver blocks: ranks c*n .. c*n + n - 1 receive from the worker among them (KAISA's receivers)
            n = P // len(workers)
            block_start = (self.red.rank // n) * n
            block = tuple(range(block_start, block_start + n))
            src = next(r for r in block if r in workers)
            tensors = [out[nm] if self.red.rank == src else torch.empty_like(grads[nm]) for nm in names]
            tensors = self.red.share(tensors, src, "broadcast of preconditioned gradients",
                                     group=self.red.subgroup(block))
            out.update(zip(names, tensors))
        return out


def reduce_step_inputs(opt: Any, terms: int, data_loss: Tensor, grads: list[Tensor], evaluate: Any,
                       from_closure: bool) -> tuple[Tensor, list[Tensor], Any]:
    """GaussNewton's hook: the union's data loss and gradient, and an ``evaluate()`` of the union's
    objective (the weight-decay term is identical on every rank and is added once). ``terms``: the shard's
    counted loss terms M_r. The batch form evaluated the shard's sums; a closure returns its shard's mean
    (the user's loss; padding is refused there, so M_r > 0), turned into the sum here."""
    import math

    red: Reducer = opt.distributed
    reduction = opt.likelihood.reduction
    synced = from_closure and red.grads == "synced"
    w = float(terms) if from_closure and reduction == "mean" else 1.0
    local = [data_loss.reshape(1).to(grads[0].dtype) * w] + ([] if synced else [g * w for g in grads])
    out = reduce_sums(red, local, terms, reduction)
    loss, grads = out[0].reshape(()).to(data_loss.dtype), grads if synced else out[1:]
    params = opt._working_params()  # the whole parameters (an FSDP2 model's replica)

    def evaluate_union() -> float:
        reg = opt._objective(params[0].new_zeros(()), params)
        local = (evaluate() - reg) * w
        if not math.isfinite(local):
            local = math.inf
        t = red.tensor([local], torch.float64)  # on the communication device
        value = float(reduce_sums(red, [t], terms, reduction)[0][0])
        return value + reg if math.isfinite(value) else math.inf

    return loss, grads, evaluate_union
