"""Atomic checkpoint files: the one writer and reader every long run uses.

* :func:`save` writes with ``torch.save`` to a temporary file in the same directory, flushes it to disk
  and renames it over the target (``os.replace`` is atomic on POSIX and Windows), so an interrupted
  write leaves the previous checkpoint intact and never a truncated one.
* :func:`load` reads one back with ``torch.load(weights_only=True)``: tensors, numbers, strings, ``None``,
  torch dtypes/sizes and plain containers (dict, list, tuple, set, OrderedDict) only, so loading a file
  never runs code (output directories get shared, copied and downloaded; a pickle can execute whatever it
  says). Every checkpoint curvkit writes holds only such values. A file that does not load that way (one
  holding other objects, e.g. crafted or written by older code) or cannot be read at all (truncated,
  corrupt, not a checkpoint) raises :class:`CheckpointError` naming the file and saying how to recover
  (delete it: the run then redoes only the stage it covered); nothing in it is executed.
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
import pickle
import re
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "load", "remove_orphans", "save", "write_text"]


class CheckpointError(RuntimeError):
    """A checkpoint file exists but cannot be read, or holds objects a weights-only load refuses."""


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


def load(path: str | Path, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)`` with a clear :class:`CheckpointError` for a file that holds
    anything but tensors and plain containers (refused before any of it runs) or cannot be read."""
    path = Path(path)
    remove_orphans(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as err:
        if "weights only" not in str(err).lower():
            raise _unreadable(path, err) from err
        raise CheckpointError(
            f"checkpoint {path} holds objects other than tensors and plain containers, so curvkit refuses to "
            "load it (unpickling such objects can run arbitrary code; nothing in the file was executed). "
            "curvkit's own checkpoints never hold such objects: the file was written by other or older code, or "
            "crafted. Delete it to redo the stage it covers (other finished stages are kept), or restore it "
            f"from a trusted copy. ({_first_line(err)})") from None
    except Exception as err:  # zip reader, EOF: the file is unusable
        raise _unreadable(path, err) from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(("WeightsUnpickler", "Unsupported"))]
    return lines[0] if lines else text.splitlines()[0] if text else type(err).__name__


def _unreadable(path: Path, err: BaseException) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} cannot be read ({type(err).__name__}: {err}); it is probably truncated by an "
        f"interrupted write or corrupt. Delete it to redo the stage it covers (other finished stages are "
        f"kept), or restore it from a backup")
