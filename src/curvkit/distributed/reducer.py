"""The :class:`Reducer`: every collective curvkit's data-parallel code runs goes through one of its methods.

It is a thin layer over ``torch.distributed`` (gloo on CPUs, NCCL on GPUs; nothing home-made travels
between processes): coalesced ``all_reduce`` of tensor lists (one flat buffer per dtype, so a layer's
factors and the batch count go out as one message), packed symmetric matrices (the upper triangle only,
n(n+1)/2 numbers instead of n^2), ``broadcast`` from an owner rank, ``all_gather_object`` for small
Python values, and a byte counter (:attr:`Reducer.stats`) that the benchmark reads.

Timeouts. Every collective is issued with ``async_op=True`` and waited for with the reducer's ``timeout``
(seconds), so a rank that died or never arrives makes the others raise instead of hanging; a rank whose
process exits makes gloo fail the others' pending collectives at once. Data-dependent errors (NaN
statistics) are checked AFTER the reduction where possible, so every rank raises the same error.

Weights for unequal shards (the rule every hook follows). Rank r holds B_r of the B = sum_r B_r examples.

* Quantities that are SUMS over examples (Kronecker factor sums ``sum_n a_n a_n^T``, the gradient of a
  ``reduction='sum'`` loss, a GGN product of a summed loss) are all-reduced with weight 1.
* Quantities that are MEANS over the rank's examples (the gradient or the loss of a ``reduction='mean'``
  loss on the shard, a batch-mean statistic) are all-reduced as ``sum_r B_r x_r`` together with ``B_r``
  in the same message, then divided by B: exactly the mean over the union of the shards
  (:meth:`Reducer.weighted_mean`), never the mean of the per-rank means.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["CollectiveTimeout", "CommStats", "Reducer", "derive_seed", "shard_range"]

GradMode = Literal["local", "synced"]


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the reducer's timeout (another rank failed or is stuck)."""


def derive_seed(seed: int, index: int) -> int:
    """The seed of stream ``index`` (a rank, a chain) derived from one base ``seed``: ``seed`` itself for
    index 0 (so a one-process run equals the non-distributed one), otherwise 63 bits of
    SHA-256("curvkit:{seed}:{index}") (independent of the platform and of Python's hash seed)."""
    if int(index) == 0:
        return int(seed)
    digest = hashlib.sha256(f"curvkit:{int(seed)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def shard_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of n rows: sizes differ by at most one, the first n %
    world_size ranks get the larger share (concatenating the shards in rank order gives the rows back)."""
    base, extra = divmod(int(n), int(world_size))
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass
class CommStats:
    """Payload bytes this rank handed to each kind of collective (``all_reduce``, ``broadcast``,
    ``all_gather``), and the number of calls. Wire traffic depends on the algorithm: for a ring
    all-reduce of S bytes each rank sends and receives 2 S (P - 1)/P, for a broadcast about S."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1

    def total(self) -> int:
        return int(sum(self.bytes.values()))

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, Any]:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls), "total_bytes": self.total()}


def _tri_indices(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    return torch.triu_indices(n, n, device=device).unbind(0)  # type: ignore[return-value]


class Reducer:
    """Data-parallel communication for curvkit's optimisers, estimators and operators.

    Pass it as ``distributed=`` (``KroneckerEstimator``, ``DiagonalEstimator``, ``MESU``/``BGD``/
    ``BBBSGD``/``MESUNoReg``, ``KFWhiten``/``KFBayes``/``KFNatGrad``, ``GaussNewton``,
    ``estimate_llc``), or wrap an operator built on the local shard with
    :class:`curvkit.distributed.DistributedOperator`.

    Args:
        group: the ``torch.distributed`` process group (default: the world). The group must be
            initialised (:func:`curvkit.distributed.init`, or torchrun + ``init_process_group``).
        grads: how the gradients an optimiser reads from ``p.grad`` came about: ``'local'`` (default; the
            model is not wrapped in DistributedDataParallel, each rank back-propagated its own shard's
            loss, and the optimiser all-reduces the gradient with the weights of the module docstring)
            or ``'synced'`` (already the gradient of the loss over the union of the shards, e.g. from
            :func:`curvkit.distributed.ddp` or from plain DDP with a mean loss and equal shards; the
            optimiser does not reduce it again). Gradients an optimiser computes itself
            (``step(batch=...)``) are always local.
        placement: where the per-layer inverses/eigendecompositions are computed (KAISA, Pauloski et al.
            2021): ``'comm-opt'`` (default: each layer's inverse on one owner rank, broadcast to all, every
            rank preconditions every layer), ``'mem-opt'`` (the owner also preconditions the layer's
            gradient and broadcasts only the result; the inverse stays on the owner) or ``'hybrid'``
            (``grad_worker_fraction`` of the ranks per layer hold the inverse). Owners are chosen by cost
            (:func:`curvkit.distributed.placement.assign_owners`).
        grad_worker_fraction: for ``'hybrid'``, the fraction of ranks that hold each layer's inverse.
        shard_batches: an optimiser given ``step(batch=(X, y))`` keeps only this rank's contiguous share
            of the rows (:func:`shard_range`), for code in which every rank sees the whole minibatch
            (the experiments under ``torchrun``). Off by default: each rank passes its own shard.
        timeout: seconds to wait for any one collective before raising :class:`CollectiveTimeout`
            (default 300; tests use a few seconds).
    """

    def __init__(self, group: Any = None, *, grads: GradMode = "local",
                 placement: Literal["comm-opt", "mem-opt", "hybrid"] = "comm-opt",
                 grad_worker_fraction: float | None = None, shard_batches: bool = False,
                 timeout: float = 300.0):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("curvkit.distributed.Reducer needs an initialised torch.distributed process group: "
                               "launch with torchrun and call curvkit.distributed.init() (or "
                               "torch.distributed.init_process_group) first")
        if grads not in ("local", "synced"):
            raise ValueError(f"grads must be 'local' or 'synced', got {grads!r}")
        if placement not in ("comm-opt", "mem-opt", "hybrid"):
            raise ValueError(f"placement must be 'comm-opt', 'mem-opt' or 'hybrid', got {placement!r}")
        if placement == "hybrid":
            if grad_worker_fraction is None or not 0 < float(grad_worker_fraction) <= 1:
                raise ValueError("placement='hybrid' needs grad_worker_fraction in (0, 1], got "
                                 f"{grad_worker_fraction!r}")
        elif grad_worker_fraction is not None:
            raise ValueError(f"grad_worker_fraction is only used with placement='hybrid' (got placement={placement!r})")
        if not (math.isfinite(float(timeout)) and float(timeout) > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.group = group
        self.grads: GradMode = grads
        self.placement = placement
        self.grad_worker_fraction = None if grad_worker_fraction is None else float(grad_worker_fraction)
        self.shard_batches = bool(shard_batches)
        self.timeout = float(timeout)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.stats = CommStats()
        self._subgroups: dict[tuple[int, ...], Any] = {}

    def __repr__(self) -> str:
        return (f"Reducer(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
                f"grads={self.grads!r}, placement={self.placement!r})")

    # ------------------------------------------------------------------ basics
    @property
    def is_primary(self) -> bool:
        """True on rank 0 (the rank that writes files)."""
        return self.rank == 0

    def global_rank(self, group_rank: int) -> int:
        """The world rank of ``group_rank`` in this reducer's group (collectives name world ranks)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def seed(self, seed: int) -> int:
        """This rank's own seed derived from ``seed`` (:func:`derive_seed`; rank 0 keeps ``seed``)."""
        return derive_seed(seed, self.rank)

    def shard(self, n: int) -> slice:
        """This rank's contiguous share of n rows (:func:`shard_range`)."""
        return slice(*shard_range(n, self.rank, self.world_size))

    def _wait(self, work: Any, what: str) -> None:
        if work is None:
            return
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as err:
            raise CollectiveTimeout(f"rank {self.rank}: {what} failed or timed out after {self.timeout:g} s "
                                    f"({err}); another rank has probably raised an error or stopped") from err
        if ok is False:
            raise CollectiveTimeout(f"rank {self.rank}: {what} did not complete within {self.timeout:g} s; another "
                                    "rank has probably raised an error or stopped")

    def barrier(self) -> None:
        """Wait until every rank arrives (with the timeout)."""
        self._wait(dist.barrier(group=self.group, async_op=True), "barrier")

    # ------------------------------------------------------------------ all-reduce
    def all_reduce_(self, tensors: Sequence[Tensor], what: str = "all_reduce") -> list[Tensor]:
        """Sum every tensor over the ranks, in place, coalesced into one message per (dtype, device).
        Returns the tensors."""
        tensors = list(tensors)
        if self.world_size == 1 or not tensors:
            return tensors
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = defaultdict(list)
        for i, t in enumerate(tensors):
            groups[(t.dtype, t.device)].append(i)
        for idx in groups.values():
            parts = [tensors[i] for i in idx]
            flat = torch.cat([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0].reshape(-1).clone()
            self.stats.add("all_reduce", flat.numel() * flat.element_size())
            self._wait(dist.all_reduce(flat, group=self.group, async_op=True), what)
            off = 0
            for p in parts:
                n = p.numel()
                p.copy_(flat[off:off + n].view_as(p))
                off += n
        return tensors

    def sum(self, tensors: Sequence[Tensor], what: str = "all_reduce") -> list[Tensor]:
        """Sums over the ranks (new tensors; the inputs are not changed)."""
        return self.all_reduce_([t.detach().clone() for t in tensors], what)

    def sum_symmetric(self, tensors: Sequence[Tensor], symmetric: Sequence[bool], what: str = "all_reduce"
                      ) -> list[Tensor]:
        """Sums over the ranks where ``symmetric[i]`` marks a square symmetric matrix that travels as its
        upper triangle (n(n+1)/2 numbers) and comes back exactly symmetric. Other tensors travel whole."""
        packed = []
        for t, sym in zip(tensors, symmetric):
            if sym:
                i, j = _tri_indices(t.shape[0], t.device)
                packed.append(t.detach()[i, j])
            else:
                packed.append(t.detach().clone())
        self.all_reduce_(packed, what)
        out = []
        for t, sym, p in zip(tensors, symmetric, packed):
            if sym:
                i, j = _tri_indices(t.shape[0], t.device)
                m = t.new_empty(t.shape)
                m[i, j] = p
                m[j, i] = p
                out.append(m)
            else:
                out.append(p)
        return out

    def sum_scalars(self, *values: float, dtype: torch.dtype = torch.float64,
                    device: torch.device | str = "cpu") -> list[float]:
        """Sums of Python numbers over the ranks (one float64 message)."""
        t = torch.tensor([float(v) for v in values], dtype=dtype, device=device)
        self.all_reduce_([t], "all_reduce of scalars")
        return [float(v) for v in t]

    def sum_int(self, n: int, device: torch.device | str = "cpu") -> int:
        """The sum over the ranks of an integer (e.g. the examples each rank holds)."""
        t = torch.tensor([int(n)], dtype=torch.int64, device=device)
        self.all_reduce_([t], "all_reduce of a count")
        return int(t[0])

    def weighted_mean(self, tensors: Sequence[Tensor], count: int | float) -> tuple[list[Tensor], float]:
        """(sum_r count_r x_r / sum_r count_r for every x, sum_r count_r): per-rank means over
        ``count`` examples turned into the mean over the union (module docstring), in one message per
        dtype (the count travels with the first tensor's dtype)."""
        if self.world_size == 1:
            return [t.detach().clone() for t in tensors], float(count)
        first = tensors[0]
        parts = [t.detach() * count for t in tensors] + [torch.tensor([float(count)], dtype=first.dtype,
                                                                      device=first.device)]
        self.all_reduce_(parts, "all_reduce of weighted means")
        total = float(parts[-1][0])
        if not total > 0:
            raise ValueError("weighted_mean: no rank holds any example (the counts sum to 0)")
        return [p / total for p in parts[:-1]], total

    # ------------------------------------------------------------------ broadcast / gather
    def broadcast_(self, tensors: Sequence[Tensor], src: int, what: str = "broadcast", group: Any = None) -> list[Tensor]:
        """Overwrite ``tensors`` on every rank with ``src``'s values (one message per dtype/device);
        ``src`` is a rank of this reducer's group. ``group``: a subgroup (:meth:`subgroup`) to broadcast in."""
        tensors = list(tensors)
        if self.world_size == 1 or not tensors:
            return tensors
        g = self.group if group is None else group
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = defaultdict(list)
        for i, t in enumerate(tensors):
            groups[(t.dtype, t.device)].append(i)
        for idx in groups.values():
            parts = [tensors[i] for i in idx]
            flat = torch.cat([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0].reshape(-1).contiguous()
            if self.rank == src:
                self.stats.add("broadcast", flat.numel() * flat.element_size())
            self._wait(dist.broadcast(flat, src=self.global_rank(src), group=g, async_op=True), what)
            off = 0
            for p in parts:
                n = p.numel()
                if flat.data_ptr() != p.data_ptr():
                    p.copy_(flat[off:off + n].view_as(p))
                off += n
        return tensors

    def broadcast_symmetric_(self, tensors: Sequence[Tensor], src: int, lower: bool = False,
                             what: str = "broadcast", group: Any = None) -> list[Tensor]:
        """Broadcast square matrices that are symmetric (or triangular: ``lower=True`` sends the lower
        triangle and zero-fills the rest) as n(n+1)/2 numbers each."""
        packs = []
        for t in tensors:
            n = t.shape[0]
            i, j = (torch.tril_indices if lower else torch.triu_indices)(n, n, device=t.device).unbind(0)
            packs.append((i, j, t[i, j].contiguous()))
        self.broadcast_([p for _, _, p in packs], src, what, group)
        for t, (i, j, p) in zip(tensors, packs):
            if self.rank != src:
                t.zero_()
                t[i, j] = p
                if not lower:
                    t[j, i] = p
        return list(tensors)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        t0 = time.perf_counter()
        dist.all_gather_object(out, obj, group=self.group)
        self.stats.add("all_gather", len(repr(obj)))  # an estimate: pickles travel as bytes of about this size
        del t0
        return out

    def all_gather_rows(self, t: Tensor) -> Tensor:
        """Concatenate (in rank order) every rank's tensor along dim 0; the leading sizes may differ."""
        if self.world_size == 1:
            return t
        sizes = [int(s) for s in self.all_gather_object(int(t.shape[0]))]
        m = max(sizes)
        pad = t.new_zeros((m, *t.shape[1:]))
        pad[: t.shape[0]] = t
        outs = [torch.empty_like(pad) for _ in range(self.world_size)]
        self.stats.add("all_gather", pad.numel() * pad.element_size())
        self._wait(dist.all_gather(outs, pad.contiguous(), group=self.group, async_op=True), "all_gather")
        return torch.cat([o[:s] for o, s in zip(outs, sizes)])

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``src``'s ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group)
        self.stats.add("broadcast", len(repr(obj)) if self.rank == src else 0)
        return box[0]

    def subgroup(self, ranks: Sequence[int]) -> Any:
        """A process group of the given ranks of this reducer's group (created once; every rank must call
        this in the same order for the same ranks, as ``torch.distributed.new_group`` requires)."""
        key = tuple(sorted(int(r) for r in ranks))
        if len(key) == self.world_size:
            return self.group
        if key not in self._subgroups:
            self._subgroups[key] = dist.new_group([self.global_rank(r) for r in key])
        return self._subgroups[key]

    # ------------------------------------------------------------------ consistency checks
    def sync_generator(self, generator: torch.Generator, src: int = 0) -> torch.Generator:
        """Copy ``src``'s generator state into ``generator`` on every rank (shared Monte Carlo noise)."""
        if self.world_size == 1:
            return generator
        state = generator.get_state()
        device = "cpu" if self.backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        buf = state.to(device)
        self.broadcast_([buf], src, "broadcast of a generator state")
        generator.set_state(buf.cpu())
        return generator

    def shared_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A new generator seeded identically on every rank (rank 0 draws the seed from the global RNG,
        as a non-distributed routine given no generator would consume it)."""
        seed = int(torch.randint(0, 2**62, (1,))) if self.rank == 0 else 0
        seed = int(self.broadcast_object(seed, 0))
        return torch.Generator(device=device).manual_seed(seed)

    def sync_tensors_(self, tensors: Sequence[Tensor], src: int = 0) -> None:
        """Broadcast ``src``'s values of ``tensors`` (e.g. the parameters at the start, as DDP does)."""
        with torch.no_grad():
            self.broadcast_([t.data if hasattr(t, "data") else t for t in tensors], src, "broadcast of parameters")

    def check_same(self, value: Any, what: str) -> None:
        """Raise (on every rank) unless every rank passes the same ``value`` (e.g. a configuration)."""
        values = self.all_gather_object(value)
        if any(v != values[0] for v in values):
            raise ValueError(f"{what} differs between the ranks: {values}; every rank must use the same")
