"""Starting processes: :func:`init` under ``torchrun``, :func:`spawn` for tests and benchmarks.

The one documented launch is ``torchrun --nproc_per_node=N`` (it sets RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and LOCAL_RANK; ``curvkit reproduce NAME --distributed`` and any script then call
:func:`init`). :func:`spawn` starts N local processes with ``torch.multiprocessing`` (start method
``spawn``) and a file rendezvous, with a wall-clock limit: if one process raises, the others are
terminated and its traceback is re-raised in the caller; if the limit passes, all are terminated and a
``TimeoutError`` is raised, so a bug can never hang a test run.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["destroy", "env_world_size", "init", "spawn"]


def env_world_size() -> int:
    """WORLD_SIZE from the environment (torchrun sets it); 1 when absent."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def init(backend: str | None = None, timeout: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment (idempotent); returns
    (rank, world_size). ``backend``: ``'nccl'`` when CUDA is available, else ``'gloo'``. On NCCL the
    current CUDA device is set to LOCAL_RANK. ``timeout`` (seconds) bounds every collective."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of PyTorch")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"curvkit.distributed.init: {', '.join(missing)} not set; launch with "
                           "`torchrun --nproc_per_node=N ...` (or set the torch.distributed environment variables)")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=float(timeout)))
    return dist.get_rank(), dist.get_world_size()


def destroy() -> None:
    """Destroy the default process group if one exists."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _entry(rank: int, fn: Callable[..., Any], world_size: int, init_file: str, backend: str, timeout: float,
           threads: int, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        fn(rank, world_size, *args)
    except BaseException:
        # the caller records the traceback and exits; the process group's teardown can wait for a stalled
        # peer at interpreter exit, so the process is ended shortly afterwards in any case
        threading.Timer(3.0, os._exit, (1,)).start()
        raise
    dist.barrier()
    dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), *, backend: str = "gloo",
          timeout: float = 120.0, collective_timeout: float = 30.0, threads: int = 1) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``nprocs`` fresh processes joined in one process group.

    ``fn`` must be importable (a module-level function). Raises the first failing rank's error
    (``torch.multiprocessing.ProcessRaisedException``, its traceback included) after terminating the
    others, or ``TimeoutError`` after ``timeout`` seconds. ``collective_timeout`` bounds each collective
    inside the processes; ``threads`` sets each process's intra-op threads.
    """
    with tempfile.TemporaryDirectory(prefix="curvkit-dist-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(_entry, args=(fn, nprocs, init_file, backend, collective_timeout, threads, args),
                                 nprocs=nprocs, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"curvkit.distributed.spawn: {nprocs} processes did not finish within "
                                       f"{timeout:g} s; terminated")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(5)
                if p.is_alive():
                    p.kill()


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
    from pathlib import Path

    from curvkit.distributed import Reducer, set_current

    rank, _ = init()
    set_current(Reducer(shard_batches=True))
    return Path(out) if rank == 0 else Path(out) / f".rank{rank}"
