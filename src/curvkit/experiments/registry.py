"""Registry of reproducible experiments for ``curvkit reproduce NAME --scale S --out DIR``.

An experiment module under :mod:`curvkit.experiments` registers itself with :func:`register`; the CLI
imports every module of the package (so adding an experiment needs no edit elsewhere).

Scales: ``smoke`` (CI-sized, a couple of minutes on 2 cores), ``medium`` (bundled data, about an hour),
``paper`` (the paper's protocol; may be GPU-sized but must run anywhere, and resume after interruption).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCALES = ("smoke", "medium", "paper")


class ExperimentError(ValueError):
    """A run the registry refuses before starting (a scale the experiment lacks, an unusable output
    directory); the message says what was wrong and how to fix it. The CLI prints it as one line."""


@dataclass(frozen=True)
class Experiment:
    name: str
    description: str
    run: Callable[..., Any]  # run(scale: str, out: Path, seed: int = 0) -> Any
    scales: tuple[str, ...] = SCALES
    paper: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, Experiment] = {}


def register(name: str, description: str, scales: tuple[str, ...] = SCALES, paper: str = "") -> Callable:
    """Decorator: ``@register("curvature", "...")`` on ``def run(scale, out, seed=0)``."""
    bad = [s for s in scales if s not in SCALES]
    if bad:
        raise ValueError(f"unknown scales {bad}; allowed {SCALES}")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _REGISTRY and _REGISTRY[name].run is not fn:
            raise ValueError(f"experiment {name!r} registered twice")
        _REGISTRY[name] = Experiment(name, description, fn, tuple(scales), paper)
        return fn

    return deco


def load_all() -> dict[str, Experiment]:
    """Import every module in curvkit.experiments so that they register themselves."""
    import curvkit.experiments as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_") and info.name != "registry":
            importlib.import_module(f"{pkg.__name__}.{info.name}")
    return dict(sorted(_REGISTRY.items()))


def get(name: str) -> Experiment:
    exps = load_all()
    if name not in exps:
        raise KeyError(f"unknown experiment {name!r}; available: {', '.join(exps) or 'none'}")
    return exps[name]


def output_dir(out: Path | str) -> Path:
    """``out`` as a directory that exists and can be written, created if needed; otherwise an
    :class:`ExperimentError` saying why (empty path, an existing file, no permission, a file in the way)."""
    if not str(out).strip():
        raise ExperimentError("the output directory is empty; pass a directory path (e.g. --out results/run1)")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ExperimentError(f"the output path {str(path)!r} exists and is not a directory; pass a new or existing "
                              "directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise ExperimentError(f"cannot write to the output directory {str(path)!r} ({why}); pass a directory you "
                              "can write to") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ExperimentError(f"cannot write to the output directory {str(path)!r} (permission denied); pass a "
                              "directory you can write to")
    return path


def run(name: str, scale: str, out: Path | str, seed: int = 0) -> Any:
    """Run experiment ``name`` at ``scale`` into ``out``. The scale and the output directory are checked
    before anything runs (:class:`ExperimentError`); an unknown name raises ``KeyError``."""
    exp = get(name)
    if scale not in exp.scales:
        raise ExperimentError(f"experiment {name!r} has no {scale!r} scale; choose one of: {', '.join(exp.scales)}")
    return exp.run(scale=scale, out=output_dir(out), seed=seed)
