"""Atomic checkpoint files: the one writer and reader every long run uses.

* :func:`save` writes with ``torch.save`` to a temporary file in the same directory, flushes it to disk
  and renames it over the target (``os.replace`` is atomic on POSIX and Windows), so an interrupted
  write leaves the previous checkpoint intact and never a truncated one.
* :func:`load` reads one back; a file that cannot be read (truncated, corrupt, not a checkpoint) raises
  :class:`CheckpointError` naming the file and saying how to recover (delete it: the run then redoes
  only the stage it covered).
* :func:`write_text` is the same atomic write for text (JSON results, reports).

Orphans. The temporary file is named ``.{name}.{pid}@{host}.{random}.tmp`` (``host``: 8 hex digits of a
hash of the host name). A write interrupted so hard that its cleanup could not run (SIGKILL, ``os._exit``,
a power cut) leaves it behind; the next :func:`save`/:func:`write_text` or :func:`load` of the same target
removes the temporary files of that target whose writer process no longer exists on this host (or, for
files of another host or without a process id, that are more than a day old). A live writer's file is
never touched.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "load", "remove_orphans", "save", "write_text"]


class CheckpointError(RuntimeError):
    """A checkpoint file exists but cannot be read."""


STALE_AFTER_S = 86400.0  # a temporary file of an unknown writer older than this is an orphan


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists, owned by someone else
        return True
    return True


def remove_orphans(path: str | Path) -> list[Path]:
    """Remove the temporary files that interrupted writes of ``path`` left behind (module docstring);
    returns the removed paths."""
    path = Path(path)
    pattern = re.compile(r"^\." + re.escape(path.name) + r"\.(?:(\d+)@([0-9a-f]{8})\.)?[A-Za-z0-9_]+\.tmp$")
    host = _host_tag()
    removed: list[Path] = []
    try:
        candidates = list(path.parent.iterdir())
    except OSError:
        return removed
    for tmp in candidates:
        m = pattern.match(tmp.name)
        if m is None:
            continue
        pid, tag = m.group(1), m.group(2)
        try:
            if pid is not None and tag == host:
                orphan = int(pid) != os.getpid() and not _process_exists(int(pid))
            else:
                orphan = time.time() - tmp.stat().st_mtime > STALE_AFTER_S
            if orphan:
                tmp.unlink()
                removed.append(tmp)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    return removed


def _atomic_write(path: Path, write: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}@{_host_tag()}.", suffix=".tmp", dir=path.parent)
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
    remove_orphans(path)
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
