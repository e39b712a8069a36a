"""Atomic checkpoint files: the one writer and reader every long run uses.

* :func:`save` writes with ``torch.save`` to a temporary file in the same directory, flushes it to disk
  and renames it over the target (``os.replace`` is atomic on POSIX and Windows), so an interrupted
  write leaves the previous checkpoint intact and never a truncated one.
* :func:`load` reads one back; a file that cannot be read (truncated, corrupt, not a checkpoint) raises
  :class:`CheckpointError` naming the file and saying how to recover (delete it: the run then redoes
  only the stage it covered).
* :func:`write_text` is the same atomic write for text (JSON results, reports).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "load", "save", "write_text"]


class CheckpointError(RuntimeError):
    """A checkpoint file exists but cannot be read."""


def _atomic_write(path: Path, write: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)``, atomically (see the module docstring)."""
    _atomic_write(Path(path), lambda fh: torch.save(obj, fh))


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    _atomic_write(Path(path), lambda fh: fh.write(text.encode("utf-8")))


def load(path: str | Path, map_location: Any = "cpu", weights_only: bool = False) -> Any:
    """``torch.load`` with a clear error for an unreadable file.

    ``weights_only=False`` (the default here) unpickles arbitrary objects: load only checkpoints this
    library or you wrote.
    """
    path = Path(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except FileNotFoundError:
        raise
    except Exception as err:  # zip reader, unpickling, EOF: all mean the file is unusable
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(err).__name__}: {err}); it is probably truncated by an "
            f"interrupted write or corrupt. Delete it to redo the stage it covers (other finished stages are "
            f"kept), or restore it from a backup"
        ) from err
