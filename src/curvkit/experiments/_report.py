"""Small helpers every experiment report uses: markdown tables, machine info, stage timings, JSON output,
PNG figures and a progress bar.

Nothing here knows about a particular experiment. An experiment module typically does::

    timer = StageTimer()
    with progress(total=len(stages), desc="curvature") as bar:
        with timer("train"):
            ...
        bar.update()
    write_json(out / "results.json", {"machine": machine_info(), "timings_s": timer.seconds, ...})
    (out / "report.md").write_text(markdown_table(["a", "b"], [[1, 2.0]]))
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from curvkit import checkpoint
from curvkit.checkpoint import write_text
from curvkit.linalg.kron import KroneckerBlock, KroneckerOperator
from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import CurvatureOperator, DiagonalOperator

T = TypeVar("T")


# --------------------------------------------------------------------------- threads
@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)`` (unchanged for None), restoring the previous
    setting afterwards. The experiments' small networks run one thread by default on the shared 2-core
    machine: a second OpenMP thread spin-waits under load (measured: a 784-100-100-10 training step 50x
    slower with 2 threads under a load of 5 than with 1)."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def single_threaded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run ``fn`` inside :func:`torch_threads` (1)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch_threads(1):
            return fn(*args, **kwargs)

    return wrapper


# --------------------------------------------------------------------------- markdown
def format_number(x: Any, digits: int = 3) -> str:
    """A compact, readable rendering: ints as ints, floats with ``digits`` significant digits."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    if isinstance(x, (float, np.floating)):
        x = float(x)
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        if x == 0:
            return "0"
        if not 1e-3 <= abs(x) < 1e6:
            return f"{x:.{max(digits - 1, 1)}e}"
        if abs(x) >= 10**digits:
            return f"{x:.0f}"
        return f"{x:.{digits}g}"
    return str(x)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 3) -> str:
    """A GitHub-flavoured markdown table; numbers are formatted with :func:`format_number`."""
    if any(len(r) != len(headers) for r in rows):
        raise ValueError(f"every row needs {len(headers)} cells (one per header)")
    cells = [[format_number(c, digits) for c in r] for r in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- machine / config
def machine_info() -> dict[str, Any]:
    """Where the numbers were produced: CPU, cores, threads, OS, Python and torch versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gb = None
    try:
        with open("/proc/meminfo") as fh:
            mem_gb = round(int(fh.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": mem_gb,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cuda_available": torch.cuda.is_available(),
    }


def machine_markdown(info: Mapping[str, Any]) -> str:
    return "\n".join(f"- {k}: {v}" for k, v in info.items()) + "\n"


def config_dict(config: Any) -> dict[str, Any]:
    """A dataclass or mapping as a plain JSON-able dict."""
    if is_dataclass(config) and not isinstance(config, type):
        return {k: to_jsonable(v) for k, v in asdict(config).items()}
    return {k: to_jsonable(v) for k, v in dict(config).items()}


def config_hash(config: Any) -> str:
    """A short stable hash of a configuration (used to decide whether a checkpoint can be reused)."""
    text = json.dumps(config_dict(config), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_stage(path: Path | str, key: Any, compute: Callable[[], T],
                 encode: Callable[[T], Any] | None = None, decode: Callable[[Any], T] | None = None) -> T:
    """``compute()`` once per ``key``: the value is kept in ``path`` (an atomic checkpoint, so an
    interrupted run loses no finished stage) and returned from there while the saved key matches.
    ``key`` must be comparable with ``==`` after a save/load round trip (strings, numbers, dicts of them).
    A checkpoint holds only tensors and plain containers (:mod:`curvkit.checkpoint`): a value of other
    types is stored as ``encode(value)`` and read back with ``decode``."""
    path = Path(path)
    if path.exists():
        saved = checkpoint.load(path)
        if isinstance(saved, dict) and saved.get("key") == key:
            return saved["value"] if decode is None else decode(saved["value"])  # type: ignore[no-any-return]
    value = compute()
    checkpoint.save({"key": key, "value": value if encode is None else encode(value)}, path)
    return value


def operator_state(op: CurvatureOperator) -> dict[str, Any]:
    """A diagonal or Kronecker curvature operator as tensors and plain values (:func:`operator_from_state`
    rebuilds it), for checkpoints."""
    layout = {"names": list(op.layout.names), "shapes": [list(s) for s in op.layout.shapes]}
    if isinstance(op, DiagonalOperator):
        return {"type": "diagonal", "layout": layout, "tensors": list(op.tensors)}
    if isinstance(op, KroneckerOperator):
        return {"type": "kronecker", "layout": layout, "damping": float(op.damping),
                "blocks": [{"G": b.G, "A": b.A, "weight": b.weight_name, "bias": b.bias_name} for b in op.blocks]}
    raise TypeError(f"operator_state: no plain form for {type(op).__name__} (diagonal and Kronecker operators only)")


def operator_from_state(state: dict[str, Any]) -> CurvatureOperator:
    """The operator :func:`operator_state` describes."""
    layout = ParamLayout(tuple(state["layout"]["names"]), tuple(torch.Size(s) for s in state["layout"]["shapes"]))
    if state["type"] == "diagonal":
        return DiagonalOperator(layout, list(state["tensors"]))
    if state["type"] == "kronecker":
        blocks = [KroneckerBlock(b["G"], b["A"], b["weight"], b["bias"]) for b in state["blocks"]]
        return KroneckerOperator(layout, blocks, damping=state["damping"])
    raise ValueError(f"unknown operator state type {state.get('type')!r}")


# --------------------------------------------------------------------------- timings
class StageTimer:
    """Wall-clock seconds per named stage: ``with timer("train"): ...``; ``timer.seconds`` is a dict."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


# --------------------------------------------------------------------------- json
def to_jsonable(x: Any) -> Any:
    """Tensors, numpy values, paths, tuples and nested containers -> JSON-able Python objects.
    Non-finite floats become the strings "nan"/"inf"/"-inf" so that the file stays strict JSON."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return to_jsonable(x.item() if x.dim() == 0 else x.tolist())
    if isinstance(x, np.ndarray):
        return to_jsonable(x.tolist())
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return x if math.isfinite(x) else str(x)
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, Mapping):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if is_dataclass(x) and not isinstance(x, type):
        return config_dict(x)
    return x


def write_json(path: Path | str, obj: Any) -> None:
    write_text(path, json.dumps(to_jsonable(obj), indent=2, sort_keys=False) + "\n")


# --------------------------------------------------------------------------- figures / progress
def new_figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (6.4, 4.0)) -> Any:
    """A matplotlib figure on the non-interactive Agg backend (works without a display)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False)


def save_figure(fig: Any, path: Path | str, dpi: int = 120) -> Path:
    """Write ``fig`` as a PNG to ``path`` and close it; on a rank other than 0 of a data-parallel run the
    figure is only closed (the report is rank 0's: :func:`curvkit.distributed.launch.writes_report`)."""
    import matplotlib.pyplot as plt

    from curvkit.distributed.launch import writes_report

    path = Path(path)
    if writes_report():
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def progress(total: int, desc: str, disable: bool | None = None) -> Any:
    """A tqdm progress bar on stderr (``disable=True`` silences it, e.g. inside tests)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=disable, dynamic_ncols=True, leave=True)
