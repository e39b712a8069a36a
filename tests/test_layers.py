"""Imports point downward through the layers of docs/architecture.md (lazy imports inside functions too)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "curvkit"

# package (first component under curvkit) -> layer; a module may import its own layer or any lower one
LAYERS = {
    "structure": 0, "validation": 0, "checkpoint": 0, "precision": 0,
    "data": 1, "models": 1, "architectures": 1, "likelihoods": 1, "hf": 1,
    "linalg": 2, "distributed": 2, "layerkinds": 2,
    "curvature": 3,
    "posterior": 4,
    "optim": 5, "laplace": 5,
    "continual": 6, "slt": 6,
    "experiments": 7,
    "cli": 8, "__main__": 8, "__init__": 8,
}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_imports_point_downward():
    wrong = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        here = ".".join(rel.parts)
        own = _package(here if rel.name != "__init__" else here + ".__init__")
        if rel.parts[1:] == ("__init__",):
            continue  # the top-level package docstring only
        assert own in LAYERS, f"{here}: add its package to LAYERS (and to docs/architecture.md)"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("curvkit"):
                targets = [node.module] if node.module != "curvkit" else [f"curvkit.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("curvkit")]
            for t in targets:
                pkg = _package(t)
                if pkg in LAYERS and LAYERS[pkg] > LAYERS[own]:
                    wrong.append(f"{here} (layer {LAYERS[own]}) imports {t} (layer {LAYERS[pkg]})")
    assert not wrong, "upward imports:\n" + "\n".join(sorted(wrong))


def test_curvkit_imports_and_works_without_transformers():
    """transformers is optional: with it unimportable, curvkit (the adapter module and the layer kinds included)
    imports and computes; the adapter's module never imports it."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import torch, curvkit.hf, curvkit.layerkinds, curvkit.laplace, curvkit.optim, curvkit.experiments\n"
            "from curvkit.curvature import kfac\n"
            "from curvkit.likelihoods import CrossEntropy\n"
            "net = torch.nn.Sequential(torch.nn.Linear(3, 2))\n"
            "kfac(net, CrossEntropy(), (torch.randn(4, 3), torch.randint(0, 2, (4,))))\n"
            "assert 'transformers' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
