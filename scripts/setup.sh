#!/usr/bin/env bash
# Create .venv/ in the repository root and install curvkit (editable) with the dev extra, on first use.
# The tested torch version is pinned through constraints.txt (an unpinned torch pulls a CUDA build).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.curvkit-installed"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ] || [ "$root/constraints.txt" -nt "$stamp" ]; then
    "$venv/bin/python" -m pip install -q -c "$root/constraints.txt" -e "$root[dev]" 2> >(grep -v "^WARNING: Location" >&2)
    # backpack-for-pytorch (required by curvlinops, the dev extra's comparison library) pulls PyPI's torchvision,
    # whose compiled operators do not load beside the pinned CPU torch ("operator torchvision::nms does not
    # exist"); a torchvision that fails to import then breaks every library that imports it optionally
    # (transformers, laplace-torch). curvkit and its tests never need it: remove it when it cannot load.
    if ! "$venv/bin/python" -c "import torchvision" >/dev/null 2>&1; then
        "$venv/bin/python" -m pip uninstall -y -q torchvision >/dev/null 2>&1 || true
    fi
    touch "$stamp"
fi
