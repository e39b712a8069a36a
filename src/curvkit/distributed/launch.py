"""Starting and ending processes: :func:`init` and :func:`finish` under ``torchrun``, :func:`spawn` for tests
and benchmarks.

The one documented launch is ``torchrun --nproc_per_node=N`` (it sets RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and LOCAL_RANK; ``curvkit reproduce NAME --distributed`` and any script then call
:func:`init`). :func:`spawn` starts N local processes (start method ``spawn``) with a file rendezvous and
a wall-clock limit: if one process fails, the others are given a moment to stop and then terminated, and
the tracebacks of every failed process are raised in the caller (the first to fail first); if the limit
passes, all are terminated and a ``TimeoutError`` is raised, so a bug can never hang a test run.

Clean exits. A process that has used a process group ends through :func:`finish`: after a successful run
every rank meets at a barrier and destroys the process group, then the process ends at once with
``os._exit`` after flushing its output, skipping the interpreter's teardown, in which a gloo or NCCL
background thread that still holds a job can abort the process ("terminate called without an active
exception", SIGABRT) after correct work. After an error the process group is abandoned (aborted on NCCL)
and the process ends with exit code 1 without waiting for its peers. So the exit code of every rank is 0
after correct work and 1 after an error, deterministically; :func:`spawn`'s workers and ``curvkit
reproduce`` under torchrun end this way, and training scripts should too (``docs/usage.md``).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

__all__ = ["destroy", "env_world_size", "finish", "init", "spawn"]


def env_world_size() -> int:
    """WORLD_SIZE from the environment (torchrun sets it); 1 when absent."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def init(backend: str | None = None, timeout: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment (idempotent); returns
    (rank, world_size). ``backend``: by default ``'cpu:gloo,cuda:nccl'`` when CUDA is available (CUDA
    tensors travel by NCCL, CPU tensors by gloo, so code that computes on the CPU on a GPU machine works
    too), else ``'gloo'``. With NCCL the current CUDA device is set to LOCAL_RANK and the communicator is
    bound to it. ``timeout`` (seconds) is
    the process group's: on NCCL its watchdog ends a process whose collective has not completed by then
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default); each :class:`~curvkit.distributed.Reducer` has
    its own, usually shorter, timeout (``docs/usage.md``, GPU clusters)."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of PyTorch")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"curvkit.distributed.init: {', '.join(missing)} not set; launch with "
                           "`torchrun --nproc_per_node=N ...` (or set the torch.distributed environment variables)")
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    kwargs: dict[str, Any] = {}
    if "nccl" in backend:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=float(timeout)), **kwargs)
    return dist.get_rank(), dist.get_world_size()


def destroy() -> None:
    """Destroy the default process group if one exists (the process goes on; to end a process of a
    data-parallel run use :func:`finish`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _abandon() -> None:
    """After an error: abort the process group where torch can (NCCL), never wait for a peer."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        with contextlib.suppress(Exception):
            dist.distributed_c10d._abort_process_group()


def finish(exit_code: int = 0, timeout: float = 60.0) -> NoReturn:
    """End this process of a data-parallel run, deterministically (module docstring).

    ``exit_code`` 0 (the run succeeded): wait for every rank at a barrier (at most ``timeout`` seconds),
    destroy the process group, flush stdout and stderr, and end the process with exit code 0. Any other
    ``exit_code`` (this rank failed), or a barrier that fails: abandon the process group without waiting
    for the others and end with that code (1 when the barrier failed). Without a process group it only
    flushes and exits. Never returns."""
    code = int(exit_code)
    try:
        if dist.is_available() and dist.is_initialized():
            if code == 0:
                from curvkit.distributed.reducer import Reducer

                try:
                    Reducer(timeout=timeout).barrier()
                    dist.destroy_process_group()
                except Exception:
                    traceback.print_exc()
                    code = 1
            if code != 0:
                _abandon()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _die_with_parent() -> None:
    """Linux: end this process when the process that spawned it dies (as torch.multiprocessing does)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _entry(rank: int, fn: Callable[..., Any], world_size: int, init_file: str, backend: str, timeout: float,
           threads: int, args: tuple[Any, ...], error_file: str) -> None:
    _die_with_parent()
    code = 1
    try:
        torch.set_num_threads(threads)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        fn(rank, world_size, *args)
        code = 0
    except BaseException:
        with contextlib.suppress(Exception):
            Path(error_file).write_text(traceback.format_exc())
    finish(code, timeout=timeout)


def _failure(rank: int, exitcode: int, pid: int | None, error_file: Path) -> Exception:
    if error_file.exists():
        msg = f"\n\n-- Process {rank} terminated with the following error:\n{error_file.read_text()}"
        return ProcessRaisedException(msg, rank, pid or 0)
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        return ProcessExitedException(f"process {rank} terminated with signal {name}", rank, pid or 0,
                                      exitcode, name)
    return ProcessExitedException(f"process {rank} terminated with exit code {exitcode}", rank, pid or 0, exitcode)


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), *, backend: str = "gloo",
          timeout: float = 120.0, collective_timeout: float = 30.0, threads: int = 1) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``nprocs`` fresh processes joined in one process group.

    ``fn`` must be importable (a module-level function). Each process ends through :func:`finish`, so
    the run succeeds only when every process exits with code 0. Otherwise raises
    ``torch.multiprocessing.ProcessRaisedException`` carrying the traceback of every failed rank (the
    first to fail first; others are terminated a few seconds after the first failure), or
    ``ProcessExitedException`` for a process that died without a traceback (a signal, or ``os._exit``
    with a non-zero code), or ``TimeoutError`` after ``timeout`` seconds. ``collective_timeout`` bounds
    each collective inside the processes (the process group's timeout); ``threads`` sets each process's
    intra-op threads.
    """
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="curvkit-dist-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        errors = [Path(tmp) / f"rank{r}.err" for r in range(nprocs)]
        procs = [ctx.Process(target=_entry, args=(r, fn, nprocs, init_file, backend, collective_timeout, threads,
                                                  args, str(errors[r])), daemon=False) for r in range(nprocs)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        grace: float | None = None  # after the first failure: when the others are terminated
        seen: dict[int, float] = {}  # when each process was first seen to have ended
        try:
            while True:
                codes = [p.exitcode for p in procs]
                for r, c in enumerate(codes):
                    if c is not None:
                        seen.setdefault(r, time.time())
                if all(c is not None for c in codes) or (grace is not None and time.monotonic() > grace):
                    break
                if grace is None and any(c not in (None, 0) for c in codes):
                    grace = time.monotonic() + 5.0
                if time.monotonic() > deadline:
                    raise TimeoutError(f"curvkit.distributed.spawn: {nprocs} processes did not finish within "
                                       f"{timeout:g} s; terminated")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        failed = []
        for r, p in enumerate(procs):
            stopped_by_us = grace is not None and p.exitcode == -signal.SIGTERM and not errors[r].exists()
            if p.exitcode != 0 and not stopped_by_us:
                when = errors[r].stat().st_mtime if errors[r].exists() else seen.get(r, float("inf"))
                # on a tie, a traceback or a signal before a bare exit code 1 (finish after a peer's failure)
                follower = p.exitcode == 1 and not errors[r].exists()
                failed.append((when, follower, r))
        if not failed:
            return
        failed.sort()
        excs = [_failure(r, int(procs[r].exitcode or 0), procs[r].pid, errors[r]) for _, _, r in failed]
        first = excs[0]
        if len(excs) > 1:  # every failed rank's story, the first to fail first
            first.msg = "".join([first.msg] + ["\n\n" + e.msg.lstrip("\n") for e in excs[1:]])  # type: ignore[attr-defined]
            first.args = (first.msg,)  # type: ignore[attr-defined]
        raise first


def init_experiment(out: Any) -> Any:
    """``curvkit reproduce NAME --distributed`` under torchrun: initialise the process group, make a
    :class:`~curvkit.distributed.Reducer` with ``shard_batches=True`` the default of the optimisers
    (:func:`curvkit.distributed.set_current`), and return the output directory of this rank: ``out`` on
    rank 0, ``out/.rank{r}`` on the others (their own checkpoints, so that every rank resumes alike; the
    report is rank 0's).

    Every rank runs the experiment with the same seed, hence the same data and minibatches; an optimiser
    that takes ``step(batch=(X, y))`` (MESU, BGD, BBBSGD, MESUNoReg, GaussNewton) keeps its rank's rows of
    each minibatch and all-reduces, so the run equals the single-process run to rounding (Monte Carlo label
    sampling of KFAC curvature excepted: per-rank seeds). Everything else runs replicated.
    """
    from curvkit.distributed import Reducer, set_current

    rank, _ = init()
    set_current(Reducer(shard_batches=True))
    return Path(out) if rank == 0 else Path(out) / f".rank{rank}"


REPORT_FILES = ("report.md", "results.json", "summary.json")


def writes_report() -> bool:
    """False on the ranks other than 0 of a data-parallel experiment (:func:`init_experiment`): they
    keep only their checkpoints; ``curvkit.experiments._report`` renders no figures there."""
    from curvkit.distributed import current

    red = current()
    return red is None or red.is_primary


def discard_report(out: Path) -> None:
    """On a rank other than 0, after the experiment: remove the report files it wrote at the top of its
    directory ``out`` (``REPORT_FILES`` and figures), keeping its checkpoints (nothing reads these files
    back: the report is rank 0's)."""
    if writes_report() or not Path(out).is_dir():
        return
    for path in Path(out).iterdir():
        if path.is_file() and (path.name in REPORT_FILES or path.suffix == ".png"):
            path.unlink()
