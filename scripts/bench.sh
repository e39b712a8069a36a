#!/usr/bin/env bash
# The benchmark environment in one command, on a fresh machine:
#
#     bash scripts/bench.sh                                  # set up .venv/ and check it
#     bash scripts/bench.sh benchmarks/laplace.py --quick    # ... then run a benchmark in it
#
# Creates .venv/ (or $CURVKIT_VENV) if needed and installs curvkit (editable) with its dev and bench extras,
# torch pinned to the tested CPU build by constraints.txt. PyPI's torchvision, which laplace-torch and
# backpack-for-pytorch declare but neither the benchmarks nor their imports use, is built for PyPI's CUDA
# torch: beside the pinned CPU torch its compiled operators do not load ("operator torchvision::nms does
# not exist") and `import laplace` fails through torchmetrics. It is removed when it does not import
# (torchmetrics then leaves out its image metrics); `pip check` will say that torchvision is missing.
# Finally every library of the bench extra must import, or the script stops with the library's error.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CURVKIT_VENV:-$root/.venv}"
stamp="$venv/.curvkit-bench-installed"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ] || [ "$root/constraints.txt" -nt "$stamp" ]; then
    "$py" -m pip install -q -c "$root/constraints.txt" -e "$root[dev,bench]" 2> >(grep -v "^WARNING: Location" >&2)
    if "$py" -m pip show -q torchvision >/dev/null 2>&1 && ! "$py" -c "import torchvision" >/dev/null 2>&1; then
        echo "scripts/bench.sh: removing torchvision: it does not import beside the pinned CPU torch" >&2
        "$py" -m pip uninstall -q -y torchvision
    fi
    "$py" "$root/benchmarks/_common.py"   # every bench library imports, or stop with its error
    touch "$stamp"
fi
if [ "$#" -gt 0 ]; then
    cd "$root"
    exec "$py" "$@"
fi
