"""Whole parameters of an FSDP2-sharded model, for the routes that read a parameter as one tensor (issue 33).

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) every trainable parameter is a ``DTensor`` whose rank-r
local tensor is rows ``[r c, min((r + 1) c, n))`` of the whole (n, ...) tensor, ``c = ceil(n / P)`` over the
P ranks of its 1-D mesh (``torch.chunk`` along dim 0; the last ranks may hold fewer rows, or none). FSDP2
all-gathers a module's parameters inside that module's own forward and backward pass, through hooks, so a
``torch.func`` evaluation of the model (``functional_call``, ``jvp``, ``vmap``), a gradient with respect to the
parameters and any code that reads ``module.weight`` meet either the hooks' own tensors or a shard.

:class:`ShardedReplica` is the simple correct route for those: a copy of the module TREE without FSDP2 (each
module's own class, its attributes, its buffers shared with the user's module, its hooks but FSDP2's) whose sharded
parameters are whole tensors gathered from the ranks' shards. Everything curvkit does on a plain model then
runs on the replica unchanged, as on one data-parallel replica (each rank with its own data shard, the
``Reducer`` summing what the ranks computed); the results are in the FULL parameter layout (``named_parameters``
order of the user's model, whole shapes), the layout of the Kronecker operators of sharded models.

Cost. :meth:`ShardedReplica.gather` is one all-gather per parameter dtype through the ``Reducer`` (rank r sends
its local rows, every rank receives all of them: about |theta| values per rank, the size of the model), and
the replica then holds the whole parameters on every rank: **one full copy of the model's parameters per
rank**, as data parallelism does, for as long as it holds them (:meth:`release` frees their storage, the
next :meth:`gather` allocates it again). This is the memory FSDP2 saves elsewhere; the routes that use a
replica say so. Untouched: the user's model (never changed, except where a caller writes its own shard back
with :meth:`write_local_`), its hooks and its FSDP2 state.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import Tensor, nn

from curvkit.distributed.reducer import Reducer

__all__ = ["ShardedReplica", "dtensor_class", "is_sharded"]


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


def _is_fsdp_hook(hook: Any) -> bool:
    """Whether a module hook belongs to FSDP2 (a method of its state object, or a function of its package)."""
    fn = getattr(hook, "func", hook)  # functools.partial
    owner = getattr(fn, "__self__", None)
    where = type(owner).__module__ if owner is not None else getattr(fn, "__module__", None) or ""
    return where.startswith("torch.distributed.")


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
    hooks = {k: v for k, v in state.items() if "hook" in k and isinstance(v, dict)}
    dropped = {h for table in hooks.values() for h, fn in table.items() if callable(fn) and _is_fsdp_hook(fn)}
    for key, table in hooks.items():  # the hook tables and their flag tables (with_kwargs, always_called)
        state[key] = type(table)((h, fn) for h, fn in table.items() if h not in dropped)
    state["_parameters"] = {}
    state["_buffers"] = dict(mod._buffers)
    state["_modules"] = {}
    new.__dict__.update(state)
    memo[id(mod)] = new
    for key, child in mod._modules.items():
        new._modules[key] = None if child is None else _plain_clone(child, memo)
    return new


class ShardedReplica:
    """A hook-free replica of an FSDP2 model holding whole parameters (module docstring).

    Args:
        model: the FSDP2 (``fully_shard``) model; its DTensor parameters must be sharded on dim 0
            (``Shard(0)``, FSDP2's default) over a 1-D mesh of the ranks of ``distributed``, in its rank order.
        distributed: the :class:`~curvkit.distributed.Reducer` of those ranks (every collective goes through it).
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
        self.module = _plain_clone(model, memo)
        self._modules = [(m, memo[id(m)]) for m in model.modules()]
        P, ranks = distributed.world_size, [distributed.global_rank(r) for r in range(distributed.world_size)]
        #: user parameter id -> whole replica parameter; sharded ones with each rank's rows
        self.full: dict[int, nn.Parameter] = {}
        self._sharded: list[tuple[str, Any, nn.Parameter, list[tuple[int, int]]]] = []
        for name, mod in model.named_modules(remove_duplicate=False):
            twin = memo[id(mod)]
            for attr, p in mod._parameters.items():
                if p is None:
                    twin._parameters[attr] = None
                    continue
                if id(p) not in self.full:
                    full_name = f"{name}.{attr}" if name else attr
                    if DTensor is not None and isinstance(p, DTensor):
                        self.full[id(p)] = self._whole(full_name, p, P, ranks)
                    else:
                        self.full[id(p)] = p  # an ordinary parameter is the user's own (read live)
                twin._parameters[attr] = self.full[id(p)]
        self.names = [n for n, _, _, _ in self._sharded]
        self.gather()

    def _whole(self, name: str, p: Any, P: int, ranks: list[int]) -> nn.Parameter:
        from torch.distributed.tensor import Shard

        placements = tuple(p.placements)
        mesh = p.device_mesh
        if placements != (Shard(0),) or mesh.ndim != 1:
            raise NotImplementedError(
                f"{self.what}: parameter {name!r} is a DTensor with placements {placements} on a {mesh.ndim}-D mesh; "
                "curvkit gathers FSDP2's default layout only (Shard(0) on a 1-D mesh of the reducer's ranks): "
                "use fully_shard without shard_placement_fn, HSDP or tensor parallelism")
        if mesh.mesh.flatten().tolist() != ranks:
            raise ValueError(f"{self.what}: parameter {name!r} is sharded over the ranks {mesh.mesh.flatten().tolist()} "
                             f"but distributed= reduces over {ranks}; pass a Reducer of the FSDP2 mesh's process group")
        local = p.to_local()
        rows = _rows(int(p.shape[0]), P)
        start, stop = rows[self.red.rank]
        if tuple(local.shape) != (stop - start, *p.shape[1:]):
            raise NotImplementedError(f"{self.what}: parameter {name!r} ({tuple(p.shape)}) has a local shard of shape "
                                      f"{tuple(local.shape)} on rank {self.red.rank}, not FSDP2's even chunks "
                                      f"({stop - start} rows); curvkit cannot place it in the whole tensor")
        # on the shard's device, or (FSDP2's CPU offloading: shards on the host, compute on the mesh's device) on
        # the reducer's communication device
        device = local.device if local.device.type == mesh.device_type else self.red.device
        whole = nn.Parameter(torch.zeros(tuple(p.shape), dtype=local.dtype, device=device),
                             requires_grad=p.requires_grad)
        self._sharded.append((name, p, whole, rows))
        return whole

    # ------------------------------------------------------------------ data
    def sync_modes(self) -> None:
        """Give every replica module its user module's train/eval mode (the user may switch it)."""
        for mod, twin in self._modules:
            twin.training = mod.training

    @torch.no_grad()
    def gather(self) -> None:
        """Every sharded parameter's whole tensor from the ranks' local rows: one all-gather per dtype (the
        local rows packed flat, padded to the largest rank's), then the modes (:meth:`sync_modes`)."""
        self.sync_modes()
        red, P = self.red, self.red.world_size
        by_dtype: dict[torch.dtype, list[tuple[str, Any, nn.Parameter, list[tuple[int, int]]]]] = {}
        for entry in self._sharded:
            by_dtype.setdefault(entry[2].dtype, []).append(entry)
        for dtype, entries in by_dtype.items():
            sizes = [[(b - a) * math.prod(w.shape[1:]) for a, b in rows] for _, _, w, rows in entries]
            totals = [sum(s[r] for s in sizes) for r in range(P)]
            buf = torch.zeros(max(max(totals), 1), dtype=dtype, device=red.device)
            offset = 0
            for (_, p, _, _), s in zip(entries, sizes):
                n = s[red.rank]
                buf[offset:offset + n] = p.to_local().reshape(-1).to(red.device)
                offset += n
            outs = red.all_gather(buf, f"all_gather of FSDP2 parameter shards ({dtype})")
            offsets = [0] * P
            for (_, _, w, rows), s in zip(entries, sizes):
                if w.untyped_storage().size() == 0:  # released (:meth:`release`)
                    w.untyped_storage().resize_(w.numel() * w.element_size())
                for r, (a, b) in enumerate(rows):
                    w[a:b].copy_(outs[r][offsets[r]:offsets[r] + s[r]].reshape(b - a, *w.shape[1:]))
                    offsets[r] += s[r]

    @torch.no_grad()
    def release(self) -> None:
        """Free the storage of the whole parameters until the next :meth:`gather` (their shapes stay)."""
        for _, _, w, _ in self._sharded:
            w.untyped_storage().resize_(0)

    def rows(self, p: Tensor) -> slice:
        """This rank's rows of the user's sharded parameter ``p`` in its whole tensor."""
        for _, q, _, rows in self._sharded:
            if q is p:
                return slice(*rows[self.red.rank])
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
