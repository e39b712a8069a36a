"""Registry of reproducible experiments for ``curvkit reproduce NAME --scale S --out DIR``.

An experiment module under :mod:`curvkit.experiments` registers itself with :func:`register`; the CLI
imports every module of the package (so adding an experiment needs no edit elsewhere).

Scales: ``smoke`` (CI-sized, a couple of minutes on 2 cores), ``medium`` (bundled data, about an hour),
``paper`` (the paper's protocol; may be GPU-sized but must run anywhere, and resume after interruption).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCALES = ("smoke", "medium", "paper")


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


def run(name: str, scale: str, out: Path | str, seed: int = 0) -> Any:
    exp = get(name)
    if scale not in exp.scales:
        raise ValueError(f"experiment {name!r} has scales {exp.scales}, not {scale!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return exp.run(scale=scale, out=out, seed=seed)
