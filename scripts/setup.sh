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
    touch "$stamp"
fi
