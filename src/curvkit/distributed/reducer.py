"""The :class:`Reducer`: every collective curvkit's data-parallel code runs goes through one of its methods,
and every one of those through ONE entry point, :meth:`Reducer._collective`.

It is a thin layer over ``torch.distributed`` (gloo on CPUs, NCCL on GPUs; nothing home-made travels
between processes): coalesced ``all_reduce`` of tensor lists (one flat buffer per dtype, so a layer's
factors and the batch count go out as one message), packed symmetric matrices (the upper triangle only,
n(n+1)/2 numbers instead of n^2), ``broadcast`` from an owner rank, small Python values pickled into byte
tensors, and a byte counter (:attr:`Reducer.stats`) that the benchmark reads.

The communication device. A backend moves tensors of one device: gloo CPU tensors, NCCL CUDA tensors of
the current device, the combined ``'cpu:gloo,cuda:nccl'`` both (:func:`communication_devices`;
``Reducer(device=...)`` for other backends).
:meth:`Reducer._collective` refuses a tensor on any other device with :class:`CommunicationDeviceError`
BEFORE anything is sent, so a tensor built on the CPU in a code path that the gloo tests run is caught
without a GPU (the tests declare another communication device); every tensor the reducer builds itself
(counts, scalars, pickled objects, generator states, the barrier's token) is built on it.

Timeouts. Every collective is issued with ``async_op=True`` and waited for on the host by
:func:`wait_for` with the reducer's ``timeout`` (seconds): with gloo's blocking ``wait(timeout)``, and on
every other backend by polling ``work.is_completed()`` against the deadline, so the timeout holds on NCCL
too, where ``work.wait()`` only makes the CUDA stream wait unless ``TORCH_NCCL_BLOCKING_WAIT`` is set. A rank that never arrives makes the others raise
:class:`CollectiveTimeout` ("did not complete within T s"); a rank whose process ended makes the others'
pending collectives fail at once with :class:`CollectiveError` ("failed after t s"). Object collectives
(``all_gather_object``, ``broadcast_object``, ``check_same``) travel as byte tensors through the same entry
point and so keep the same timeout; subgroups are created with it. After a :class:`CollectiveError` the
process group is unusable: end the process (:func:`curvkit.distributed.finish`). Data-dependent errors (NaN
statistics) are checked AFTER the reduction where possible, so every rank raises the same error.

Identical replicas. A collective returns bitwise the same result on every rank, and every quantity an
optimiser computes from it is computed from identical tensors laid out identically: results an owner rank
computes are handed out with :meth:`Reducer.share` (fresh contiguous tensors on every rank, the owner's
included: a BLAS product can round differently for a transposed layout), so replicas stay bitwise
identical step after step (:meth:`Reducer.check_identical` verifies it).

Weights for unequal shards (the rule every data-parallel reduction follows). Rank r holds B_r of the
B = sum_r B_r samples, and M_r of the M = sum_r M_r COUNTED TERMS of the loss: a likelihood's
``num_terms`` (the positions that are not padding; = B_r for (B, C) outputs without padding). A
``reduction='mean'`` loss is the mean over the counted terms, so with padding or sequences of unequal
length M_r is not proportional to B_r, and a reduction weighted by samples is silently not the union's.

* Quantities that are SUMS over the terms (Kronecker factor sums ``sum_n a_n a_n^T``, the gradient of a
  ``reduction='sum'`` loss, a GGN product of a summed loss) are all-reduced with weight 1.
* Quantities that are MEANS over the rank's terms (the loss, its gradient and its GGN quadratic forms
  of a ``reduction='mean'`` loss on the shard) travel as the rank's SUM S_r over its terms together with
  its count M_r in the same message, and the union's mean is sum_r S_r / sum_r M_r
  (:meth:`Reducer.mean_of_sums`; :meth:`Reducer.weighted_mean` takes the rank's mean x_r and sends
  S_r = M_r x_r): exactly the mean over the union of the shards, never the mean of the per-rank means.
  Computing the sum directly (the rank's loss with ``reduction='sum'``) also takes a rank whose every
  term is padding (M_r = 0, where the rank's own mean is undefined); only M = 0 is refused, as one
  process refuses the mean over no term.
* The count is what the mean divides by: the counted terms for a curvkit likelihood (GaussNewton,
  MESU/BGD/BBB, ``DistributedOperator``, ``ddp``, the estimators' ``num_terms``); the samples where the
  quantity is a per-sample mean by definition (the LLC's per-sample loss, KFRA's batch means, BatchNorm's
  running statistics, the Kronecker filters' ``reduction='mean'``, which is the mean over examples); the
  rows for a covariance of rows (KFWhiten's C_x). A component that cannot read the count of a mean (a
  loss callable whose denominator curvkit does not know) refuses the mean data-parallel and says how to
  pass it (a curvkit likelihood, or the summed loss).
"""

from __future__ import annotations

import datetime
import hashlib
import math
import pickle
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["CollectiveError", "CollectiveTimeout", "CommStats", "CommunicationDeviceError", "Reducer",
           "ReplicaMismatch", "communication_device", "communication_devices", "derive_seed", "shard_range",
           "wait_for"]

GradMode = Literal["local", "synced"]


class CollectiveError(RuntimeError):
    """A collective failed: another rank closed its connection (it raised an error or its process ended)."""


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within the reducer's timeout (another rank failed or is stuck)."""


class CommunicationDeviceError(ValueError):
    """A tensor handed to a collective is not on the communication device of the process group's backend."""


class ReplicaMismatch(RuntimeError):
    """The ranks' replicas of tensors that must be identical differ (:meth:`Reducer.check_identical`)."""


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


def communication_devices(backend: str, device: torch.device | str | None = None) -> tuple[torch.device, ...]:
    """The devices whose tensors ``backend`` moves, the first being the one where a reducer builds the
    tensors it sends itself: ``(device,)`` when given; gloo: the CPU; NCCL (or another backend of torch's
    device-backend map, e.g. xccl): the current device of that type; a combined backend such as
    ``'cpu:gloo,cuda:nccl'``: its accelerator, then the CPU. Raises ValueError for a backend whose device is
    unknown (pass ``device=``)."""
    if device is not None:
        return (torch.device(device),)
    by_backend: dict[str, str] = {}
    for dev, name in dist.Backend.default_device_backend_map.items():
        by_backend.setdefault(name, dev)  # gloo -> cpu (listed before mps)
    types = []
    for part in str(backend).split(","):
        dev, _, name = part.rpartition(":")
        types.append(dev.strip() or by_backend.get(name.strip().lower(), ""))
    out = []
    for kind in dict.fromkeys(t for t in types if t and t != "cpu"):
        index = torch.cuda.current_device() if kind == "cuda" else torch.accelerator.current_device_index()
        out.append(torch.device(kind, index))
    if "cpu" in types:
        out.append(torch.device("cpu"))
    if not out:
        raise ValueError(f"curvkit.distributed.Reducer: the communication device of backend {backend!r} is unknown; "
                         "pass Reducer(device=...) (the device whose tensors this backend moves)")
    return tuple(out)


def communication_device(backend: str, device: torch.device | str | None = None) -> torch.device:
    """The device where a reducer on ``backend`` builds the tensors it sends (the first of
    :func:`communication_devices`): the CPU for gloo, the current CUDA device for NCCL."""
    return communication_devices(backend, device)[0]


def wait_for(work: Any, timeout: float, what: str, rank: int, blocking: bool = False) -> None:
    """Wait on the host until ``work`` (a ``torch.distributed`` Work) completes, at most ``timeout`` seconds.

    ``blocking=False`` (NCCL and every backend whose ``wait()`` need not block the host): poll
    ``work.is_completed()`` (sleeping 10 us doubling up to 1 ms) against the deadline, then ``work.wait()``
    raises the backend's error, if any (on NCCL it also makes the current stream wait for the collective).
    ``blocking=True`` (gloo, whose ``wait(timeout)`` blocks until completion or the timeout): one
    ``work.wait(timeout)``. Raises :class:`CollectiveTimeout` at the deadline and :class:`CollectiveError`
    when the collective failed before it (a peer closed its connection)."""
    t0 = time.monotonic()
    deadline = t0 + float(timeout)

    def late() -> CollectiveTimeout:
        return CollectiveTimeout(f"rank {rank}: {what} did not complete within {timeout:g} s; another rank has "
                                 "probably raised an error or stopped")

    try:
        if blocking:
            if work.wait(timeout=datetime.timedelta(seconds=float(timeout))) is False:
                raise late()
            return
        pause = 1e-5
        while not work.is_completed():
            now = time.monotonic()
            if now >= deadline:
                raise late()
            time.sleep(min(pause, deadline - now))
            pause = min(2 * pause, 1e-3)
        work.wait()
    except CollectiveTimeout:
        raise
    except RuntimeError as err:
        elapsed = time.monotonic() - t0
        if elapsed >= 0.99 * timeout:  # gloo's wait(timeout) raises at the deadline
            raise late() from err
        raise CollectiveError(f"rank {rank}: {what} failed after {elapsed:.1f} s ({err}); another rank has "
                              "probably raised an error or stopped") from err


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


def _nbytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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
            (default 300; tests use a few seconds), on every backend (:func:`wait_for`).
        device: the communication device (default: the backend's, :func:`communication_devices`: the CPU
            for gloo, the current CUDA device for NCCL, both for ``'cpu:gloo,cuda:nccl'``). The model and the
            data must live on one of ``reducer.devices``; the reducer builds its own tensors on
            ``reducer.device`` (the first).
        blocking_wait: whether the backend's ``Work.wait(timeout)`` blocks the host until the collective
            completes or the timeout passes (default: True for gloo only); otherwise the reducer polls
            ``Work.is_completed()`` against its deadline (NCCL: ``wait()`` returns at once without
            ``TORCH_NCCL_BLOCKING_WAIT``), see :func:`wait_for`.
    """

    def __init__(self, group: Any = None, *, grads: GradMode = "local",
                 placement: Literal["comm-opt", "mem-opt", "hybrid"] = "comm-opt",
                 grad_worker_fraction: float | None = None, shard_batches: bool = False,
                 timeout: float = 300.0, device: torch.device | str | None = None,
                 blocking_wait: bool | None = None):
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
        self.devices = communication_devices(self.backend, device)
        self.device = self.devices[0]
        self.blocking_wait = self.backend == "gloo" if blocking_wait is None else bool(blocking_wait)
        self.stats = CommStats()
        self._subgroups: dict[tuple[int, ...], Any] = {}

    def __repr__(self) -> str:
        return (f"Reducer(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
                f"device={str(self.device)!r}, grads={self.grads!r}, placement={self.placement!r})")

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

    # ------------------------------------------------------------------ the one entry point
    def _collective(self, kind: str, what: str, tensors: Sequence[Tensor], issue: Callable[[], Any],
                    nbytes: int | None = None, wait: bool = True) -> Any:
        """Every collective of curvkit: refuse a tensor that is not on the communication device, count
        ``nbytes`` under ``kind``, ``issue()`` the asynchronous collective, and wait for it with the timeout
        (:func:`wait_for`); ``wait=False`` returns the Work instead (the DDP hook chains its future)."""
        self._check_device(tensors, what)
        if nbytes is not None:
            self.stats.add(kind, nbytes)
        work = issue()
        if not wait:
            return work
        wait_for(work, self.timeout, what, self.rank, self.blocking_wait)
        return None

    def _check_device(self, tensors: Iterable[Tensor], what: str) -> None:
        for t in tensors:
            if t.device not in self.devices:
                raise CommunicationDeviceError(
                    f"rank {self.rank}: {what}: a {tuple(t.shape)} {t.dtype} tensor on {t.device}, but the "
                    f"{self.backend!r} process group communicates {' and '.join(map(str, self.devices))} tensors; "
                    "create it on the reducer's device (reducer.device), or move the model and the data there")

    def tensor(self, values: Sequence[float] | Sequence[int], dtype: torch.dtype) -> Tensor:
        """A 1-D tensor of ``values`` on the communication device (for counts and scalars that travel)."""
        return torch.tensor(list(values), dtype=dtype, device=self.device)

    def barrier(self) -> None:
        """Wait until every rank arrives (with the timeout): an all-reduce of one number."""
        token = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._collective("barrier", "barrier", [token],
                         lambda: dist.all_reduce(token, group=self.group, async_op=True))

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
            self._collective("all_reduce", what, [flat],
                             lambda flat=flat: dist.all_reduce(flat, group=self.group, async_op=True),  # type: ignore[misc]
                             _nbytes([flat]))
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

    def sum_scalars(self, *values: float, dtype: torch.dtype = torch.float64) -> list[float]:
        """Sums of Python numbers over the ranks (one message, on the communication device)."""
        t = self.tensor([float(v) for v in values], dtype)
        self.all_reduce_([t], "all_reduce of scalars")
        return [float(v) for v in t]

    def sum_int(self, n: int) -> int:
        """The sum over the ranks of an integer (e.g. the examples each rank holds)."""
        t = self.tensor([int(n)], torch.int64)
        self.all_reduce_([t], "all_reduce of a count")
        return int(t[0])

    def mean_of_sums(self, sums: Sequence[Tensor], count: int | float) -> tuple[list[Tensor], float]:
        """(sum_r S_r / sum_r count_r for every S, sum_r count_r): the union's mean from each rank's SUMS S_r
        over its ``count`` terms (module docstring; a rank may hold no term, count 0), in one message per
        dtype. The count travels in float64 (exact up to 2^53) with the float64 tensors, or as its own
        float64 part. Raises ValueError on every rank when the counts sum to 0."""
        sums = list(sums)
        if not sums:
            raise ValueError("mean_of_sums: no tensor to reduce")
        first = sums[0]
        n = first.new_tensor([float(count)], dtype=torch.float64)
        parts = self.all_reduce_([t.detach().clone() for t in sums] + [n], "all_reduce of sums and counts")
        total = float(parts[-1][0])
        if not total > 0:
            raise ValueError("the mean over the union of the ranks' shards is undefined: every rank's count of "
                             "terms is 0 (every target is padding, or every shard is empty)")
        return [p / total for p in parts[:-1]], total

    def weighted_mean(self, tensors: Sequence[Tensor], count: int | float) -> tuple[list[Tensor], float]:
        """(sum_r count_r x_r / sum_r count_r for every x, sum_r count_r): per-rank means over ``count``
        terms turned into the mean over the union (module docstring; :meth:`mean_of_sums` of count_r x_r).
        A rank with count 0 contributes nothing (its x_r is not read)."""
        c = float(count)
        return self.mean_of_sums([t.detach() * c if c else torch.zeros_like(t) for t in tensors], count)

    # ------------------------------------------------------------------ broadcast / gather
    def _broadcast_flat(self, flat: Tensor, src: int, what: str, group: Any) -> None:
        g = self.group if group is None else group
        self._collective("broadcast", what, [flat],
                         lambda: dist.broadcast(flat, src=self.global_rank(src), group=g, async_op=True),
                         _nbytes([flat]) if self.rank == src else None)  # counted by the sender

    def broadcast_(self, tensors: Sequence[Tensor], src: int, what: str = "broadcast", group: Any = None) -> list[Tensor]:
        """Overwrite ``tensors`` on every rank with ``src``'s values (one message per dtype/device);
        ``src`` is a rank of this reducer's group. ``group``: a subgroup (:meth:`subgroup`) to broadcast in.
        The tensors keep their own memory layout: for results ``src`` computed, use :meth:`share`."""
        tensors = list(tensors)
        if self.world_size == 1 or not tensors:
            return tensors
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = defaultdict(list)
        for i, t in enumerate(tensors):
            groups[(t.dtype, t.device)].append(i)
        for idx in groups.values():
            parts = [tensors[i] for i in idx]
            flat = torch.cat([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0].reshape(-1).contiguous()
            self._broadcast_flat(flat, src, what, group)
            off = 0
            for p in parts:
                n = p.numel()
                if flat.data_ptr() != p.data_ptr():
                    p.copy_(flat[off:off + n].view_as(p))
                off += n
        return tensors

    def share(self, tensors: Sequence[Tensor], src: int, what: str = "broadcast", group: Any = None) -> list[Tensor]:
        """``src``'s ``tensors`` on every rank as NEW contiguous tensors laid out identically on every rank,
        ``src`` included (views into one buffer per dtype), so that any arithmetic on them afterwards is
        bitwise the same on every rank. The other ranks pass tensors of the same shapes and dtypes (e.g.
        ``new_empty``); their values are ignored. ``group``: a subgroup to share within."""
        tensors = list(tensors)
        if self.world_size == 1:
            return [t.contiguous() for t in tensors]
        out: list[Tensor | None] = [None] * len(tensors)
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = defaultdict(list)
        for i, t in enumerate(tensors):
            groups[(t.dtype, t.device)].append(i)
        for idx in groups.values():
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
            self._broadcast_flat(flat, src, what, group)
            off = 0
            for i in idx:
                n = tensors[i].numel()
                out[i] = flat[off:off + n].view(tensors[i].shape)
                off += n
        return out  # type: ignore[return-value]

    def share_symmetric(self, tensors: Sequence[Tensor], src: int, lower: bool = False, what: str = "broadcast",
                        group: Any = None) -> list[Tensor]:
        """:meth:`share` for square matrices that are symmetric (or triangular: ``lower=True`` sends the
        lower triangle and zero-fills the rest), as n(n+1)/2 numbers each; every rank, ``src`` included,
        rebuilds the matrices from the packed triangles the same way."""
        packs = []
        for t in tensors:
            n = t.shape[0]
            i, j = (torch.tril_indices if lower else torch.triu_indices)(n, n, device=t.device).unbind(0)
            packs.append((i, j, t.detach()[i, j]))
        shared = self.share([p for _, _, p in packs], src, what, group)
        out = []
        for t, (i, j, _), p in zip(tensors, packs, shared):
            m = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
            m[i, j] = p
            if not lower:
                m[j, i] = p
            out.append(m)
        return out

    def _all_gather(self, t: Tensor, what: str, group: Any = None) -> list[Tensor]:
        """Every rank's ``t`` (the same shape on every rank), in rank order (of ``group``, default this
        reducer's)."""
        g = self.group if group is None else group
        outs = [torch.empty_like(t) for _ in range(self.world_size if group is None else dist.get_world_size(g))]
        self._collective("all_gather", what, [t, *outs],
                         lambda: dist.all_gather(outs, t, group=g, async_op=True), _nbytes([t]))
        return outs

    def all_gather(self, t: Tensor, what: str = "all_gather", group: Any = None) -> list[Tensor]:
        """Every rank's ``t`` (the same shape and dtype on every rank), in rank order. ``group``: a process
        group of some of this reducer's ranks to gather within (e.g. one shard group of an FSDP2 device mesh);
        the result is then in that group's rank order, and only its members call."""
        if (self.world_size if group is None else dist.get_world_size(group)) == 1:
            return [t]
        return self._all_gather(t, what, group)

    def all_gather_rows(self, t: Tensor) -> Tensor:
        """Concatenate (in rank order) every rank's tensor along dim 0; the leading sizes may differ."""
        if self.world_size == 1:
            return t
        self._check_device([t], "all_gather")  # before the row counts travel
        sizes = [int(s[0]) for s in self._all_gather(self.tensor([int(t.shape[0])], torch.int64),
                                                      "all_gather of row counts")]
        pad = t.new_zeros((max(sizes), *t.shape[1:]))
        pad[: t.shape[0]] = t
        outs = self._all_gather(pad.contiguous(), "all_gather")
        return torch.cat([o[:s] for o, s in zip(outs, sizes)])

    def _to_bytes(self, obj: Any) -> Tensor:
        return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)

    @staticmethod
    def _from_bytes(t: Tensor) -> Any:
        return pickle.loads(t.cpu().numpy().tobytes())  # our own ranks' pickles, as torch's *_object collectives

    def all_gather_object(self, obj: Any, what: str = "all_gather_object") -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order: pickled into a byte tensor on the communication
        device and gathered through the entry point (so with the reducer's timeout)."""
        if self.world_size == 1:
            return [obj]
        payload = self._to_bytes(obj)
        sizes = [int(s[0]) for s in self._all_gather(self.tensor([payload.numel()], torch.int64), what)]
        buf = torch.zeros(max(sizes), dtype=torch.uint8, device=self.device)
        buf[: payload.numel()] = payload
        return [self._from_bytes(o[:s]) for o, s in zip(self._all_gather(buf, what), sizes)]

    def broadcast_object(self, obj: Any, src: int = 0, what: str = "broadcast_object") -> Any:
        """``src``'s ``obj`` on every rank (pickled, through the entry point)."""
        if self.world_size == 1:
            return obj
        payload = self._to_bytes(obj) if self.rank == src else self.tensor([], torch.uint8)
        size = self.tensor([payload.numel()], torch.int64)
        self._broadcast_flat(size, src, what, None)
        buf = payload if self.rank == src else torch.empty(int(size[0]), dtype=torch.uint8, device=self.device)
        self._broadcast_flat(buf, src, what, None)
        return obj if self.rank == src else self._from_bytes(buf)

    def subgroup(self, ranks: Sequence[int]) -> Any:
        """A process group of the given ranks of this reducer's group (created once, with the reducer's
        timeout; every rank must call this in the same order for the same ranks, as
        ``torch.distributed.new_group`` requires)."""
        key = tuple(sorted(int(r) for r in ranks))
        if len(key) == self.world_size:
            return self.group
        if key not in self._subgroups:
            t0 = time.monotonic()
            try:
                self._subgroups[key] = dist.new_group([self.global_rank(r) for r in key],
                                                      timeout=datetime.timedelta(seconds=self.timeout))
            except RuntimeError as err:  # the store wait of a member that never arrives
                late = time.monotonic() - t0 >= 0.99 * self.timeout
                cls = CollectiveTimeout if late else CollectiveError
                raise cls(f"rank {self.rank}: creating the subgroup {list(key)} "
                          + (f"did not complete within {self.timeout:g} s" if late else
                             f"failed after {time.monotonic() - t0:.1f} s")
                          + f" ({err}); another rank has probably raised an error or stopped") from err
        return self._subgroups[key]

    # ------------------------------------------------------------------ consistency
    def sync_generator(self, generator: torch.Generator, src: int = 0) -> torch.Generator:
        """Copy ``src``'s generator state into ``generator`` on every rank (shared Monte Carlo noise)."""
        if self.world_size == 1:
            return generator
        buf = generator.get_state().to(self.device)
        self.broadcast_([buf], src, "broadcast of a generator state")
        generator.set_state(buf.cpu())
        return generator

    def shared_generator(self, device: torch.device | str | None = None) -> torch.Generator:
        """A new generator on ``device`` (default: the communication device) seeded identically on every
        rank (rank 0 draws the seed from the global RNG, as a non-distributed routine given no generator
        would consume it)."""
        seed = int(torch.randint(0, 2**62, (1,))) if self.rank == 0 else 0
        seed = int(self.broadcast_object(seed, 0, "broadcast of a shared seed"))
        return torch.Generator(device=self.device if device is None else device).manual_seed(seed)

    def sync_tensors_(self, tensors: Sequence[Tensor], src: int = 0) -> None:
        """Broadcast ``src``'s values of ``tensors`` (e.g. the parameters at the start, as DDP does)."""
        with torch.no_grad():
            self.broadcast_([t.data if hasattr(t, "data") else t for t in tensors], src, "broadcast of parameters")

    def check_same(self, value: Any, what: str) -> None:
        """Raise (on every rank) unless every rank passes the same ``value`` (e.g. a configuration)."""
        values = self.all_gather_object(value, f"all_gather_object of {what}")
        if any(v != values[0] for v in values):
            raise ValueError(f"{what} differs between the ranks: {values}; every rank must use the same")

    def check_identical(self, tensors: Iterable[Tensor], what: str = "the replicated tensors") -> None:
        """Raise :class:`ReplicaMismatch` on every rank unless every rank holds bitwise the same
        ``tensors`` (shapes, dtypes and bytes; e.g. ``model.parameters()`` and an optimiser's state):
        one SHA-256 digest per rank travels. The bytes are read from a transient copy: numpy's view of a tensor
        makes its storage non-resizable for good, which would break FSDP2 and
        :meth:`curvkit.distributed.sharded.ShardedReplica.release`."""
        h = hashlib.sha256()
        for t in tensors:
            t = t.detach()
            h.update(f"{tuple(t.shape)}{t.dtype};".encode())
            u = t.reshape(-1).contiguous().view(torch.uint8)
            host = u.cpu()  # u itself where it is on the host already
            h.update((host.clone() if host is u else host).numpy().tobytes())
        digests = self.all_gather_object(h.hexdigest(), f"all_gather_object of the digests of {what}")
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            raise ReplicaMismatch(f"{what} differ between the ranks: rank(s) {differ} differ from rank 0 "
                                  "(bitwise); every rank must take the identical step")
