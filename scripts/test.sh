#!/usr/bin/env bash
# The test command: set up .venv/ on first use, then lint (ruff), type-check (mypy) and run pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m slow`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
py="$root/.venv/bin/python"
echo "== ruff"; "$py" -m ruff check src tests benchmarks
echo "== mypy"; "$py" -m mypy
echo "== pytest"; "$py" -m pytest -q "$@"
