#!/usr/bin/env bash
# Run the curvkit command line (set up .venv/ on first use). Example: bash scripts/curvkit.sh reproduce curvature
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/python" -m curvkit "$@"
