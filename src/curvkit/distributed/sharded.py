"""Whole parameters of an FSDP2-sharded model, for the routes that read a parameter as one tensor (issue 33).

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) every trainable parameter is a ``DTensor`` whose rank-r
local tensor is rows ``[r c, min((r + 1) c, n))`` of the whole (n, ...) tensor, ``c = ceil(n / P)`` over the
P ranks of its 1-D mesh (``torch.chunk`` along dim 0; the last ranks may hold fewer rows, or none). Under HSDP
(``fully_shard(module, mesh=...)`` with a 2-D (replicate, shard) mesh of R x S ranks; placements
``(Replicate(), Shard(0))``) the same holds within each shard group (a mesh row of S ranks, r its coordinate
along the shard dimension), and the R shard groups hold identical copies (FSDP2 all-reduces the gradients over
the replicate dimension; curvkit's updates are identical on every rank). Every rank still holds its own shard of
the DATA, so the data terms are reduced over ALL R S ranks (the :class:`Reducer`'s group) while the parameters
are gathered within the shard group. Other layouts (``shard_placement_fn``, tensor parallelism, a mesh that is
not the reducer's ranks) are refused by name (:data:`LAYOUTS`). FSDP2
all-gathers a module's parameters inside that module's own forward and backward pass, through hooks, so a
``torch.func`` evaluation of the model (``functional_call``, ``jvp``, ``vmap``), a gradient with respect to the
parameters and any code that reads ``module.weight`` meet either the hooks' own tensors or a shard.

:class:`ShardedReplica` is the simple correct route for those: a copy of the module TREE without FSDP2 (each
module's own class, its attributes, its buffers shared with the user's module, its hooks but FSDP2's) whose sharded
parameters are whole tensors gathered from the ranks' shards. Everything curvkit does on a plain model then
runs on the replica unchanged, as on one data-parallel replica (each rank with its own data shard, the
``Reducer`` summing what the ranks computed); the results are in the FULL parameter layout (``named_parameters``
order of the user's model, whole shapes), the layout of the Kronecker operators of sharded models.

Cost. :meth:`ShardedReplica.gather` is one all-gather per parameter dtype (and shard group) through the
``Reducer``, within the shard group (rank r sends its local rows, every member receives all of them: about
|theta| values per rank, the size of the model), and
the replica then holds the whole parameters on every rank: **one full copy of the model's parameters per
rank**, as data parallelism does, for as long as it holds them (:meth:`release` frees their storage, the
next :meth:`gather` allocates it again). This is the memory FSDP2 saves elsewhere; the routes that use a
replica say so. Untouched: the user's model (never changed, except where a caller writes its own shard back
with :meth:`write_local_`), its hooks and its FSDP2 state.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from curvkit.distributed.reducer import CollectiveError, CollectiveTimeout, Reducer

__all__ = ["LAYOUTS", "ShardedReplica", "check_layouts", "dtensor_class", "fsdp_collectives", "is_sharded"]


def dtensor_class() -> Any:
    """The ``DTensor`` class where ``torch.distributed.tensor`` is already imported (a model with DTensor
    parameters imported it), else None: importing it costs seconds (:func:`curvkit.structure.sharded_parameters`)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _fsdp_module_class() -> type | None:
    return getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` (trainable or frozen) is a ``DTensor``."""
    DTensor = dtensor_class()
    return DTensor is not None and any(isinstance(p, DTensor) for p in model.parameters())


def _rows(n: int, world: int) -> list[tuple[int, int]]:
    """Each rank's rows [start, stop) of an n-row tensor sharded as FSDP2 does (``torch.chunk`` on dim 0)."""
    c = math.ceil(n / world) if n else 0
    return [(min(r * c, n), min((r + 1) * c, n)) for r in range(world)]


#: The DTensor layouts curvkit gathers (FSDP2's): placements per mesh dimension -> the mesh dimension that shards
LAYOUTS = {
    ("Shard(dim=0)",): 0,  # FSDP: fully_shard(module) over a 1-D mesh
    ("Replicate()", "Shard(dim=0)"): 1,  # HSDP: fully_shard(module, mesh=<2-D (replicate, shard) mesh>)
}


def _fsdp_parameters(model: nn.Module) -> set[int] | None:
    """The ids of the parameters that FSDP2 manages (its modules' parameter groups), or None where this torch's
    FSDP2 state cannot be read (then: those of the modules at or under a ``fully_shard`` module)."""
    fsdp = _fsdp_module_class()
    if fsdp is None:
        return set()
    ids: set[int] = set()
    for mod in model.modules():
        if not isinstance(mod, fsdp):
            continue
        state: Any = getattr(mod, "_get_fsdp_state", lambda: None)()
        if not hasattr(state, "_fsdp_param_group"):
            return None
        group = state._fsdp_param_group
        for fp in [] if group is None else group.fsdp_params:
            ids.add(id(fp.sharded_param))
    return ids


def check_layouts(model: nn.Module, distributed: Reducer, what: str) -> dict[str, int]:
    """The mesh dimension that shards each DTensor parameter of ``model`` (name -> dimension), after refusing
    what curvkit cannot take: a DTensor that FSDP2 does not manage (tensor parallelism: every rank of a
    tensor-parallel group sees the SAME data, which the reducer would count once per rank), a layout that is not
    FSDP2's (:data:`LAYOUTS`: ``shard_placement_fn``, 2-D FSDP + TP), a mesh whose ranks are not the reducer's
    (the data terms are reduced over the reducer's ranks, each holding its own shard of the data)."""
    from torch.distributed.tensor import Replicate, Shard

    DTensor = dtensor_class()
    if DTensor is None:
        return {}
    managed = _fsdp_parameters(model)
    if managed is None:
        fsdp = _fsdp_module_class()
        managed = {id(p) for m in model.modules() if fsdp is not None and isinstance(m, fsdp) for p in m.parameters()}
    ranks = sorted(distributed.global_rank(r) for r in range(distributed.world_size))
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        placements, mesh = tuple(p.placements), p.device_mesh
        if id(p) not in managed:
            raise NotImplementedError(
                f"{what}: parameter {name!r} is a DTensor ({placements} on a {mesh.ndim}-D mesh) that FSDP2 "
                "(fully_shard) does not manage: tensor parallelism (parallelize_module) or distribute_tensor. "
                "curvkit takes FSDP2 and HSDP models only (each rank with its own shard of the data); use "
                "fully_shard, or data parallelism (every rank holds the whole model)")
        exact = all(type(pl) in (Replicate, Shard) for pl in placements)  # not _StridedShard, Partial, ...
        key = tuple(repr(pl) if type(pl) is Shard else "Replicate()" for pl in placements)
        if not (exact and key in LAYOUTS):
            raise NotImplementedError(
                f"{what}: parameter {name!r} is a DTensor with placements {placements} on a {mesh.ndim}-D mesh; "
                "curvkit takes FSDP2's layouts only: Shard(0) on a 1-D mesh (fully_shard(module)) or (Replicate(), "
                "Shard(0)) on a 2-D mesh (HSDP: fully_shard(module, mesh=init_device_mesh(device, (replicas, "
                "shards), mesh_dim_names=('replicate', 'shard')))); use fully_shard without shard_placement_fn "
                "and without tensor parallelism, or data parallelism (every rank holds the whole model)")
        grid = mesh.mesh.flatten().tolist()
        if sorted(grid) != ranks:
            raise ValueError(f"{what}: parameter {name!r} is sharded over the mesh of the ranks {grid} but "
                             f"distributed= reduces over {ranks}; pass a Reducer of the process group of the "
                             "FSDP2 mesh's ranks (every rank holding its own shard of the data)")
        out[name] = LAYOUTS[key]
    return out


def _raised_in_torch_distributed(err: BaseException) -> bool:
    """Whether ``err`` was raised by ``torch.distributed`` code (its innermost Python frame is there): a
    collective's ``wait()``, not an error of the model's own computation."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = "" if tb is None else tb.tb_frame.f_code.co_filename.replace("\\", "/")
    return isinstance(err, torch.distributed.DistError) or "/torch/distributed/" in where


@contextmanager
def fsdp_collectives(distributed: Reducer, what: str) -> Iterator[None]:
    """Report a failure of FSDP2's OWN collectives inside the block (the parameter all-gathers and gradient
    reduce-scatters that its hooks run in a sharded model's forward and backward passes, outside the
    :class:`Reducer`) as curvkit's :class:`CollectiveError` (or :class:`CollectiveTimeout`), as the reducer
    reports its own: a rank that died makes the others' pending all-gather fail at once. FSDP2 waits with the
    process group's timeout, not the reducer's (:func:`curvkit.distributed.init`'s ``timeout``)."""
    t0 = time.monotonic()
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, CollectiveError) or not _raised_in_torch_distributed(err):
            raise
        late = "timed out" in str(err).lower()
        cls = CollectiveTimeout if late else CollectiveError
        raise cls(f"rank {distributed.rank}: {what}: a collective of FSDP2 (a parameter all-gather or gradient "
                  f"reduce-scatter in the sharded model's forward or backward pass) "
                  + ("did not complete" if late else "failed") + f" after {time.monotonic() - t0:.1f} s ({err}); "
                  "another rank has probably raised an error or stopped") from err


def _is_fsdp_hook(hook: Any) -> bool:
    """Whether a module hook belongs to FSDP2 (a method of its state object, or a function of its package)."""
    fn = getattr(hook, "func", hook)  # functools.partial
    owner = getattr(fn, "__self__", None)
    where = type(owner).__module__ if owner is not None else getattr(fn, "__module__", None) or ""
    return where.startswith("torch.distributed.")


def _own_hooks(mod: nn.Module) -> dict[str, Any]:
    """``mod``'s hook tables and their flag tables (with_kwargs, always_called) without FSDP2's hooks."""
    hooks = {k: v for k, v in mod.__dict__.items() if "hook" in k and isinstance(v, dict)}
    dropped = {h for table in hooks.values() for h, fn in table.items() if callable(fn) and _is_fsdp_hook(fn)}
    return {key: type(table)((h, fn) for h, fn in table.items() if h not in dropped) for key, table in hooks.items()}


def _plain_clone(mod: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """``mod`` as its own class without FSDP2: the same attributes and buffers (shared), its hooks without
    FSDP2's (a pruning mask's or a weight norm's pre-hook still runs, on the replica's whole parameters), its
    children cloned (a module registered twice is cloned once); parameters are set by the caller."""
    if id(mod) in memo:
        return memo[id(mod)]
    cls: type = type(mod)
    fsdp = _fsdp_module_class()
    if fsdp is not None and issubclass(cls, fsdp):  # fully_shard's dynamic class FSDP<Cls>(FSDPModule, Cls)
        cls = next(c for c in cls.__mro__ if not issubclass(c, fsdp))
    new: nn.Module = object.__new__(cls)
    state = dict(mod.__dict__)
    state.update(_own_hooks(mod))
    state["_parameters"] = {}
    state["_buffers"] = dict(mod._buffers)
    state["_modules"] = {}
    new.__dict__.update(state)
    memo[id(mod)] = new
    for key, child in mod._modules.items():
        new._modules[key] = None if child is None else _plain_clone(child, memo)
    return new


@dataclass
class _Shard:
    """One sharded parameter: the user's DTensor ``p``, its whole replica tensor ``whole``, every shard index's
    rows ``rows`` (FSDP2's chunks over the S ranks of its shard group), this rank's shard index ``index``, the
    shard group (``group``, ``members``: its global ranks) and, per member in the group's rank order, its
    shard index (``order``)."""

    name: str
    p: Any
    whole: nn.Parameter
    rows: list[tuple[int, int]]
    index: int
    group: Any
    members: tuple[int, ...]
    order: list[int]


class ShardedReplica:
    """A hook-free replica of an FSDP2 model holding whole parameters (module docstring).

    Args:
        model: the FSDP2 (``fully_shard``) model; its DTensor parameters must be laid out as FSDP2 lays them
            out (:data:`LAYOUTS`): ``Shard(0)`` on a 1-D mesh (FSDP) or ``(Replicate(), Shard(0))`` on a 2-D
            (replicate, shard) mesh (HSDP), the mesh's ranks being the ranks of ``distributed``.
        distributed: the :class:`~curvkit.distributed.Reducer` of those ranks (every collective goes through it;
            the data terms are reduced over all of them, the parameters gathered within each shard group).
        what: the route that needs the replica (named in the errors).

    Attributes: ``module`` (the replica: call it, read it with :func:`curvkit.structure.read_model`),
    ``names`` (the sharded parameters' canonical names), ``full`` (user parameter id -> whole replica
    parameter).
    """

    def __init__(self, model: nn.Module, distributed: Reducer, what: str):
        if not isinstance(distributed, Reducer):
            raise TypeError(f"{what}: distributed must be a curvkit.distributed.Reducer, got "
                            f"{type(distributed).__name__}")
        DTensor = dtensor_class()
        self.red, self.what, self.model = distributed, what, model
        memo: dict[int, nn.Module] = {}
        canonical = {id(p): n for n, p in model.named_parameters()}
        self.module = _plain_clone(model, memo)
        self._modules = [(m, memo[id(m)]) for m in model.modules()]
        dims = check_layouts(model, distributed, what)
        #: user parameter id -> whole replica parameter; sharded ones with each rank's rows
        self.full: dict[int, nn.Parameter] = {}
        self._sharded: list[_Shard] = []
        for name, mod in model.named_modules(remove_duplicate=False):
            twin = memo[id(mod)]
            for attr, p in mod._parameters.items():
                if p is None:
                    twin._parameters[attr] = None
                    continue
                if id(p) not in self.full:
                    full_name = f"{name}.{attr}" if name else attr
                    if DTensor is not None and isinstance(p, DTensor):
                        self.full[id(p)] = self._whole(full_name, p, dims[canonical[id(p)]])
                    else:
                        self.full[id(p)] = p  # an ordinary parameter is the user's own (read live)
                twin._parameters[attr] = self.full[id(p)]
        self.names = [e.name for e in self._sharded]
        self.gather()

    def _whole(self, name: str, p: Any, shard_dim: int) -> nn.Parameter:
        mesh = p.device_mesh
        coordinate = mesh.get_coordinate()
        index, S = int(coordinate[shard_dim]), int(mesh.size(shard_dim))
        line = mesh.mesh[tuple(coordinate[:shard_dim])].tolist()  # the global ranks of this rank's shard group
        group = mesh.get_group(shard_dim)
        members = tuple(int(r) for r in torch.distributed.get_process_group_ranks(group))  # the line's ranks
        local = p.to_local()
        rows = _rows(int(p.shape[0]), S)
        start, stop = rows[index]
        if tuple(local.shape) != (stop - start, *p.shape[1:]):
            raise NotImplementedError(f"{self.what}: parameter {name!r} ({tuple(p.shape)}) has a local shard of shape "
                                      f"{tuple(local.shape)} on rank {self.red.rank}, not FSDP2's even chunks "
                                      f"({stop - start} rows); curvkit cannot place it in the whole tensor")
        # on the shard's device, or (FSDP2's CPU offloading: shards on the host, compute on the mesh's device) on
        # the reducer's communication device
        device = local.device if local.device.type == mesh.device_type else self.red.device
        whole = nn.Parameter(torch.zeros(tuple(p.shape), dtype=local.dtype, device=device),
                             requires_grad=p.requires_grad)
        self._sharded.append(_Shard(name, p, whole, rows, index, group, members, [line.index(r) for r in members]))
        return whole

    # ------------------------------------------------------------------ data
    def sync_modes(self) -> None:
        """Give every replica module its user module's train/eval mode and hooks but FSDP2's (the user may
        switch the mode, add or remove hooks after the replica was built)."""
        for mod, twin in self._modules:
            twin.training = mod.training
            twin.__dict__.update(_own_hooks(mod))

    @torch.no_grad()
    def gather(self) -> None:
        """Every sharded parameter's whole tensor from its shard group's local rows: one all-gather per shard
        group and dtype, within the group (the local rows packed flat, padded to the largest member's), then
        the modes (:meth:`sync_modes`). Under HSDP each replicate group gathers its own copy."""
        self.sync_modes()
        red = self.red
        by_key: dict[tuple[tuple[int, ...], torch.dtype], list[_Shard]] = {}
        for entry in self._sharded:
            by_key.setdefault((entry.members, entry.whole.dtype), []).append(entry)
        for (_, dtype), entries in by_key.items():
            first = entries[0]
            sizes = [[(b - a) * math.prod(e.whole.shape[1:]) for a, b in e.rows] for e in entries]
            totals = [sum(s[i] for s in sizes) for i in range(len(first.rows))]
            buf = torch.zeros(max(max(totals), 1), dtype=dtype, device=red.device)
            offset = 0
            for e, s in zip(entries, sizes):
                n = s[e.index]
                buf[offset:offset + n] = e.p.to_local().reshape(-1).to(red.device)
                offset += n
            outs = red.all_gather(buf, f"all_gather of FSDP2 parameter shards ({dtype})", group=first.group)
            by_index = dict(zip(first.order, outs))  # shard index -> that member's packed rows
            offsets = [0] * len(first.rows)
            for e, s in zip(entries, sizes):
                w = e.whole
                if w.untyped_storage().size() == 0:  # released (:meth:`release`)
                    w.untyped_storage().resize_(w.numel() * w.element_size())
                for i, (a, b) in enumerate(e.rows):
                    w[a:b].copy_(by_index[i][offsets[i]:offsets[i] + s[i]].reshape(b - a, *w.shape[1:]))
                    offsets[i] += s[i]

    @torch.no_grad()
    def release(self) -> None:
        """Free the storage of the whole parameters until the next :meth:`gather` (their shapes stay)."""
        for e in self._sharded:
            e.whole.untyped_storage().resize_(0)

    def rows(self, p: Tensor) -> slice:
        """This rank's rows of the user's sharded parameter ``p`` in its whole tensor."""
        for e in self._sharded:
            if e.p is p:
                return slice(*e.rows[e.index])
        raise KeyError("not a sharded parameter of the model")

    @torch.no_grad()
    def write_local_(self, p: Any, update: Tensor) -> None:
        """Add this rank's rows of the whole ``update`` to the user's sharded parameter ``p`` (its local shard,
        in place; an ordinary parameter takes the whole update)."""
        dtensor = dtensor_class()
        if dtensor is not None and isinstance(p, dtensor):
            local = p.to_local()
            local.add_(update[self.rows(p)].to(device=local.device, dtype=local.dtype))
        else:
            p.add_(update)
