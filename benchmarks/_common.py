"""Timing and peak-memory utilities shared by the benchmark scripts.

How numbers are measured (and why they can be trusted):

* **Time**: :func:`time_call` runs the callable ``warmup`` times (lazy initialisation, allocator warm-up,
  vmap tracing) and then ``repeats`` times, reporting the median wall-clock time (``time.perf_counter``)
  and all samples. The median is robust to the occasional slow run on a shared machine. Beside it, the
  process's CPU time (``time.process_time``, every thread) of the same runs: ``cpu_s`` and
  ``threads_busy`` = CPU / wall, which says whether a call uses the threads torch is given (on a loaded
  machine CPU time is the steadier measure of work, wall time the one a user waits). :func:`time_rounds`
  times several callables the same way in interleaved rounds; :func:`summed_cpu_fields` adds up the CPU time of
  the processes of a multi-process benchmark.
* **Peak memory**: :func:`peak_rss_delta` measures the peak resident set size (RSS) of the process
  DURING one call minus the RSS just before it. torch allocates CPU tensors with the C allocator, so
  Python's ``tracemalloc`` does not see them; RSS does. Linux lets a process reset its RSS high-water
  mark (``echo 5 > /proc/self/clear_refs``; ``VmHWM`` in ``/proc/self/status``), so the peak belongs to
  this call only. To stop glibc from keeping freed memory (which would hide part of the peak), workers
  run with ``MALLOC_MMAP_THRESHOLD_=65536`` (every allocation >= 64 KiB is its own ``mmap`` and goes back
  to the OS when freed) and ``malloc_trim(0)`` is called before the baseline is read. A TIMING worker
  (``spec["kind"] == "timing"``) runs with the allocator as a user's process has it: an ``mmap`` and a page
  fault per allocation slow every call, the more the more temporaries it makes (a byte-GPT's gradient pass
  94 ms with the setting, 51 ms without, 2026-11-29), which no user pays.
* **Isolation**: :func:`run_worker` runs each measurement in a fresh Python process, so caches,
  allocator state or hooks left by one library cannot affect another library's numbers. A worker that
  fails gives a table cell with its error (the exception line), never pieces of a traceback.
* **Libraries**: before anything is measured, :func:`require_library` imports each compared library in a
  fresh interpreter; one that is installed but fails to import (PyPI's torchvision beside the CPU torch
  build: "operator torchvision::nms does not exist") stops the benchmark with that error, so no table is
  made of a broken environment. ``bash scripts/bench.sh`` builds the environment in which they all import;
  ``python benchmarks/_common.py`` checks it.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def time_call(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> dict[str, Any]:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs, and the median CPU
    seconds of the process over the same runs (``cpu_s``: all threads; ``cpu_s / median_s`` is the number
    of threads kept busy, ``threads_busy``)."""
    for _ in range(warmup):
        fn()
    samples, cpu = [], []
    for _ in range(repeats):
        gc.collect()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "samples_s": samples,
            **cpu_fields(samples, cpu)}


def cpu_fields(wall: list[float], cpu: list[float]) -> dict[str, Any]:
    """``cpu_s`` (median CPU seconds), ``cpu_samples_s`` and ``threads_busy`` (median of CPU / wall per run)."""
    busy = [c / w for c, w in zip(cpu, wall) if w > 0]
    return {"cpu_s": statistics.median(cpu), "cpu_samples_s": cpu,
            "threads_busy": statistics.median(busy) if busy else None}


def time_rounds(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, dict[str, Any]]:
    """``repeats`` rounds of one call of each of ``calls`` in rotating order (load changes on a shared machine hit
    every callable alike; warm-up is the caller's): per key the median wall seconds over the rounds (``median_s``,
    ``min_s``, ``samples_s``) and the CPU seconds of the same calls (:func:`cpu_fields`)."""
    keys = list(calls)
    wall: dict[str, list[float]] = {k: [] for k in keys}
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(repeats):
        for k in keys[r % len(keys):] + keys[: r % len(keys)]:
            t = time_call(calls[k], repeats=1, warmup=0)
            wall[k].append(t["median_s"])
            cpu[k].append(t["cpu_s"])
    return {k: {"median_s": statistics.median(wall[k]), "min_s": min(wall[k]), "samples_s": wall[k],
                **cpu_fields(wall[k], cpu[k])} for k in keys}


def summed_cpu_fields(wall: list[float], cpu_by_rank: list[list[float]]) -> dict[str, Any]:
    """:func:`cpu_fields` of several processes timing the same steps (one list of per-step CPU seconds per rank,
    ``wall`` the per-step wall seconds of one of them): per step the sum of every rank's CPU seconds, so
    ``threads_busy`` counts the threads kept busy in all the processes together."""
    return cpu_fields(wall, [sum(c) for c in zip(*cpu_by_rank)])


def time_and_peak(fn: Callable[[], Any], repeats: int, slow_s: float = 30.0) -> dict[str, Any]:
    """A timed warm-up call, then the peak memory of one call (:func:`peak_rss_delta`) and the median time of
    ``repeats`` calls. A warm-up slower than ``slow_s`` seconds is the only call, measured for both time and
    peak memory (``runs`` = 1; its peak then includes one-time allocations): slow arms of a comparison cost
    one call instead of ``repeats + 2``."""
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    mem = peak_rss_delta(fn)
    first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
    if first > slow_s:
        return {"median_s": first, "min_s": first, "samples_s": [first], "runs": 1,
                **cpu_fields([first], [first_cpu]), **mem}
    mem = peak_rss_delta(fn)
    return {**time_call(fn, repeats=repeats, warmup=0), "runs": repeats, **mem}


def _status_kib(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) if m else None


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss_delta(fn: Callable[[], Any]) -> dict[str, Any]:
    """Peak RSS during ``fn()`` minus RSS before it, in MiB (None where /proc is unavailable).

    The result of ``fn`` is kept alive until the peak is read, so memory of the returned object counts.
    """
    _trim()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
        resettable = True
    except OSError:
        resettable = False
    before = _status_kib("VmRSS")
    out = fn()
    peak = _status_kib("VmHWM")
    del out
    if before is None or peak is None or not resettable:
        return {"peak_delta_mib": None, "rss_before_mib": None}
    return {"peak_delta_mib": max(peak - before, 0) / 1024, "rss_before_mib": before / 1024}


def time_steps(step: Callable[..., Any], batches: list[Any], warmup: int, steps: int) -> dict[str, Any]:
    """Training steps ``step(*batch)`` cycling over ``batches``: ``warmup`` untimed, then ``steps`` timed one
    by one (wall clock and process CPU time). Returns ``mean_s``, ``median_s``, ``samples_s``, the CPU fields of the
    same steps (:func:`cpu_fields`, and their mean ``cpu_mean_s``) and the peak RSS increase of the timed steps
    (``peak_delta_mib``: model, data and optimiser state allocated before)."""
    k = 0
    for _ in range(warmup):
        step(*batches[k % len(batches)])
        k += 1
    times: list[float] = []
    cpu: list[float] = []

    def timed() -> None:
        nonlocal k
        for _ in range(steps):
            c0, t0 = time.process_time(), time.perf_counter()
            step(*batches[k % len(batches)])
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            k += 1

    mem = peak_rss_delta(timed)
    return {"mean_s": statistics.fmean(times), "median_s": statistics.median(times), "samples_s": times,
            **cpu_fields(times, cpu), "cpu_mean_s": statistics.fmean(cpu), "peak_delta_mib": mem["peak_delta_mib"]}


def run_worker(script: Path | str, spec: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """Run ``python SCRIPT --worker JSON`` in a fresh process; it must print one JSON line last. A worker
    that fails or runs past ``timeout`` seconds gives ``{"error": ...}`` (the table says so; the run goes on)."""
    env = {**os.environ, **(WORKER_ENV if spec.get("kind") != "timing" else {})}
    try:
        proc = subprocess.run([sys.executable, str(script), "--worker", json.dumps(spec)], capture_output=True,
                              text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": error_line(proc.stderr or proc.stdout) or f"exit code {proc.returncode}"}
    last = [line for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    if not last:
        return {"error": f"worker printed no result: {proc.stdout[-300:]!r}"}
    result: dict[str, Any] = json.loads(last[-1])
    return result


_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)|[A-Za-z_][\w.]*\.\w+)(:.*)?$")


def error_line(output: str) -> str:
    """The exception line of a traceback in ``output`` (``"RuntimeError: ..."``, the last one), else its
    last non-empty line: one line for a table cell."""
    lines = [line.rstrip() for line in output.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if not line.startswith((" ", "\t")) and _EXCEPTION.match(line):
            return line
    return lines[-1] if lines else ""


# the compared libraries of the bench extra: import name -> distribution (pyproject.toml's bench extra)
BENCH_LIBRARIES = {"curvlinops": "curvlinops-for-pytorch", "backpack": "backpack-for-pytorch",
                   "pyhessian": "pyhessian", "laplace": "laplace-torch", "asdl": "asdfghjkl"}
_NOT_INSTALLED = 3


def import_failure(module: str) -> str | None:
    """None when ``import module`` works in a fresh interpreter (run outside benchmarks/, whose
    ``laplace.py`` would shadow laplace-torch), ``"not installed"`` when there is no such module, else the
    error the import raises."""
    code = (f"import importlib.util, sys\nif importlib.util.find_spec({module!r}) is None: "
            f"sys.exit({_NOT_INSTALLED})\nimport {module}")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp, capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        return None
    if proc.returncode == _NOT_INSTALLED:
        return "not installed"
    return error_line(proc.stderr) or f"exit code {proc.returncode}"


def require_library(arm: str, module: str, script: str, optional: bool = False) -> bool:
    """Whether the arm ``arm`` (library ``module``) can run. A library that fails to import stops the
    benchmark (``SystemExit`` naming the arm and the error); one that is not installed does too, unless
    ``optional`` (then False: the caller skips the arm and says so)."""
    err = import_failure(module)
    if err is None:
        return True
    if err == "not installed" and optional:
        return False
    raise SystemExit(f"{script}: the {arm} arm cannot run: `import {module}` failed: {err}\n"
                     "Set up the benchmark environment with `bash scripts/bench.sh` (it installs the bench extra "
                     "with torch pinned by constraints.txt and removes what cannot load beside it).")


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def fmt_busy(b: float | None) -> str:
    """Threads kept busy (CPU / wall time), for a table's ``threads busy`` column."""
    return "-" if b is None else f"{b:.2f}"


def fmt_mib(m: float | None) -> str:
    return "-" if m is None else f"{m:.1f}"


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/_common.py``: check that every library of the bench extra imports."""
    argparse.ArgumentParser(description=main.__doc__).parse_args(argv)
    failed = 0
    for module, dist in BENCH_LIBRARIES.items():
        err = import_failure(module)
        print(f"{dist:24s} import {module:11s} {'ok' if err is None else 'FAILED: ' + err}")
        failed += err is not None
    if failed:
        print(f"{failed} benchmark librar{'y' if failed == 1 else 'ies'} cannot be imported; run `bash scripts/bench.sh`",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
