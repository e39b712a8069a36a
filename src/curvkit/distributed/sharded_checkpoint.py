"""Checkpoints of FSDP2-sharded runs (issue 33): the model's shards through ``torch.distributed.checkpoint``, curvkit's
own state in its atomic format, resumable on the same or on another number of processes.

A sharded run holds two kinds of state. The user's MODEL is sharded: rank r holds rows of every parameter
(``fully_shard``'s DTensors), and no rank should have to hold it whole to save it. curvkit's own state is WHOLE
and identical on every rank: a GaussNewton optimiser's factor statistics, previous update and adaptive scalars, a
Laplace posterior's statistics and mean (both in the full parameter layout, as every curvkit route on sharded
models computes them), plus what a rank holds alone (``rank_state``: the generator of sampled labels). So:

* the model goes through DCP (:func:`torch.distributed.checkpoint.save` with a ``FileSystemWriter``): every rank
  writes its own shards in parallel into ``PATH/model/`` and rank 0 the metadata; loading reshards, so the
  checkpoint resumes on any number of processes (each rank reads the rows of its new shard);
* curvkit's state goes through :func:`curvkit.distributed.save_checkpoint`: rank 0 writes ``PATH/curvkit.pt``
  atomically (``state`` plus every rank's ``rank_state``), readable with ``torch.load(weights_only=True)``.
  A state that does not depend on the number of processes (everything curvkit reduces over the union) resumes
  on any P; per-rank states only on the same P (``rank_state_required``: a different P is refused with
  :class:`~curvkit.distributed.DistributedCheckpointError`, as for data-parallel checkpoints).

Atomicity. A save writes into ``PATH.partial/`` (removed first), ``curvkit.pt`` last, after every rank's shards;
rank 0 then moves the complete directory to ``PATH`` (the previous one to ``PATH.old`` for the moment between two
renames, then deleted). A load reads ``PATH``, or ``PATH.old`` when a save was interrupted between the renames;
an interrupted save never leaves a checkpoint that mixes two saves. ``PATH`` must be on a file system every
rank sees (DCP's requirement).

Safety. DCP's metadata file is a pickle, and DCP reads it with ``pickle.load``; curvkit reads it with an
unpickler that builds only DCP's metadata dataclasses and enums, ``torch.Size``, dtypes, layouts and paths, and
refuses anything else (a crafted file raises :class:`~curvkit.checkpoint.CheckpointError`; nothing in it is run).
The tensor data DCP reads with ``torch.load(weights_only=True)``. Only tensor entries of the model's state_dict are
saved (a module's non-tensor extra state would be read back by DCP with a full unpickler, so it is refused).

Collectives. curvkit's own (the rank states, the barriers around each part) go through the ``Reducer``; DCP's plan
exchange runs on the reducer's process group (``process_group=reducer.group``) under that group's timeout.

Memory and I/O: DCP writes and reads each rank's shards only (no rank holds the whole model); rank 0 writes
curvkit's state, which every rank holds anyway.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from curvkit.checkpoint import CheckpointError
from curvkit.distributed.checkpoint import DistributedCheckpointError, load_checkpoint, save_checkpoint
from curvkit.distributed.reducer import Reducer

__all__ = ["load_sharded_checkpoint", "save_sharded_checkpoint"]

FORMAT = "curvkit.sharded/1"
STATE_FILE = "curvkit.pt"
MODEL_DIR = "model"


def _model_state(model: nn.Module, what: str) -> dict[str, Tensor]:
    """The model's state_dict (DTensor shards for FSDP2 parameters), tensors only."""
    sd = model.state_dict()
    other = [k for k, v in sd.items() if not isinstance(v, Tensor)]
    if other:
        raise DistributedCheckpointError(
            f"{what}: the model's state_dict holds non-tensor entries {other} (a module's get_extra_state); a "
            "sharded checkpoint stores tensors only (DCP would read other objects back with a full unpickler, which "
            "can run code): return tensors from get_extra_state, or save those values in state=")
    return sd


def _check_reducer(distributed: Any, what: str) -> Reducer:
    if not isinstance(distributed, Reducer):
        raise TypeError(f"{what}: distributed must be a curvkit.distributed.Reducer, got {type(distributed).__name__}")
    return distributed


def save_sharded_checkpoint(path: str | Path, distributed: Reducer, *, model: nn.Module | None = None,
                            state: Any = None, rank_state: Any = None) -> None:
    """Save ``model``'s shards (DCP) and curvkit's ``state`` (whole, identical on every rank; plain containers of
    tensors, numbers and strings) plus this rank's ``rank_state`` into the directory ``path`` (module docstring).
    Every rank calls it; all return once the checkpoint is complete and in place."""
    what = "save_sharded_checkpoint"
    red = _check_reducer(distributed, what)
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if red.is_primary:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    red.barrier()
    keys = None
    if model is not None:
        import torch.distributed.checkpoint as dcp

        sd = _model_state(model, what)
        keys = sorted(sd)
        dcp.save({"model": sd}, storage_writer=dcp.FileSystemWriter(partial / MODEL_DIR, thread_count=1),
                 process_group=red.group)
        red.barrier()  # every rank's shards are written before the state file marks the checkpoint complete
    save_checkpoint(partial / STATE_FILE, {"format": FORMAT, "model": keys, "state": state}, red,
                    rank_state=rank_state)  # ends with a barrier
    if red.is_primary:
        old = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    red.barrier()


def _complete(path: Path) -> Path:
    """``path``, or ``path.old`` where a save was interrupted between its two renames; else the refusal."""
    for where in (path, path.with_name(path.name + ".old")):
        if (where / STATE_FILE).is_file():
            return where
    raise DistributedCheckpointError(f"{path} holds no complete sharded checkpoint (no {STATE_FILE}); it was not "
                                     "written by curvkit.distributed.save_sharded_checkpoint, or its save did not finish")


def load_sharded_checkpoint(path: str | Path, distributed: Reducer, *, model: nn.Module | None = None,
                            rank_state_required: bool = False, map_location: Any = None) -> tuple[Any, Any]:
    """Load a checkpoint written by :func:`save_sharded_checkpoint`: ``model``'s parameters and buffers in place
    (each rank its own shard, whatever the number of processes that saved it), and return ``(state, this rank's
    rank_state or None)``. ``rank_state_required``: refuse (:class:`DistributedCheckpointError`) a checkpoint
    with per-rank states written by another number of processes. ``map_location``: where curvkit's state is
    loaded (None: :func:`~curvkit.distributed.load_checkpoint`'s default, the host). Every rank calls it."""
    what = "load_sharded_checkpoint"
    red = _check_reducer(distributed, what)
    where = _complete(Path(path))
    where_to = {} if map_location is None else {"map_location": map_location}
    blob, own = load_checkpoint(where / STATE_FILE, red, rank_state_required=rank_state_required, **where_to)
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise DistributedCheckpointError(f"{where / STATE_FILE} was not written by save_sharded_checkpoint")
    if model is not None:
        if blob["model"] is None:
            raise DistributedCheckpointError(f"{where} holds no model (saved without model=); load it with model=None")
        import torch.distributed.checkpoint as dcp

        sd = _model_state(model, what)
        if sorted(sd) != list(blob["model"]):
            missing, unknown = sorted(set(blob["model"]) - set(sd)), sorted(set(sd) - set(blob["model"]))
            raise DistributedCheckpointError(f"{where}: the model's state_dict keys differ from the saved ones "
                                             f"(saved only: {missing}; model only: {unknown})")
        _read_metadata(where / MODEL_DIR / ".metadata")  # refused here, on every rank, before DCP's exchange
        dcp.load({"model": sd}, storage_reader=_SafeReader(where / MODEL_DIR), process_group=red.group)
        model.load_state_dict(sd)
        red.barrier()
    return blob["state"], own


# ---------------------------------------------------------------------------------------------- DCP metadata
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else (module docstring, "Safety")."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        elif module == "torch.serialization" and name == "_get_layout":  # a layout by its name
            return super().find_class(module, name)
        elif module == "pathlib" and name in _PATHS:
            return getattr(pathlib, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def _read_metadata(file: Any, stream: Any = None) -> Any:
    """DCP's metadata from ``file`` (or the open ``stream`` of it) through :class:`_MetadataUnpickler`."""
    try:
        if stream is not None:
            return _MetadataUnpickler(stream).load()
        with open(file, "rb") as f:
            return _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: not DCP metadata that curvkit reads safely ({e}); nothing in it was run. "
                              "Delete the checkpoint directory, or load it with torch's own tools if you trust its "
                              "origin") from e


def _safe_reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        """DCP's file reader whose metadata is read by :class:`_MetadataUnpickler`."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            file = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(file, "rb") as stream:
                metadata = _read_metadata(file, stream)
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def _SafeReader(path: Path) -> Any:  # a factory standing for the class (DCP is imported lazily)
    return _safe_reader_class()(path)
