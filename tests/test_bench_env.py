"""The benchmark environment (issue 23, item 6): a compared library that fails to import stops the benchmark
with its error before anything is measured, a failed measurement is one line in the table (never pieces of
a traceback), and ``scripts/bench.sh`` builds an environment in which every bench library imports (that
one downloads the bench extra from PyPI: ``-m slow``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _common  # noqa: E402  (benchmarks/ is not a package)

NMS = "operator torchvision::nms does not exist"


@pytest.fixture
def broken_laplace(tmp_path, monkeypatch):
    """A ``laplace`` package that fails to import as laplace-torch did beside PyPI's torchvision, first on
    the path of every interpreter started from the test."""
    pkg = tmp_path / "site" / "laplace"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"raise RuntimeError({NMS!r})\n")
    path = os.pathsep.join([str(tmp_path / "site"), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    return tmp_path / "site"


def test_an_arm_whose_library_fails_to_import_stops_the_benchmark(broken_laplace, tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "laplace.py"), "--quick",
                           "--out", str(tmp_path / "table.md")], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert f"the laplace-torch arm cannot run: `import laplace` failed: RuntimeError: {NMS}" in proc.stderr
    assert "scripts/bench.sh" in proc.stderr
    assert "|" not in proc.stdout and not (tmp_path / "table.md").exists()  # no table of a broken environment
    assert time.monotonic() - t0 < 120  # it stopped before preparing the model


def test_import_failures_are_told_apart(broken_laplace):
    assert _common.import_failure("json") is None
    assert _common.import_failure("curvkit_no_such_module") == "not installed"
    assert _common.import_failure("laplace") == f"RuntimeError: {NMS}"
    assert _common.require_library("absent", "curvkit_no_such_module", "x.py", optional=True) is False
    with pytest.raises(SystemExit, match="the absent arm cannot run: `import curvkit_no_such_module` failed: not"):
        _common.require_library("absent", "curvkit_no_such_module", "x.py")
    with pytest.raises(SystemExit, match="nms does not exist"):
        _common.require_library("laplace-torch", "laplace", "x.py", optional=True)  # installed but broken: stop


def test_a_failed_measurement_is_one_line(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("import json, sys\n"
                      "def measure():\n    raise ValueError('boom: the arm failed')\n"
                      "if __name__ == '__main__':\n    print(json.dumps(measure()))\n")
    assert _common.run_worker(script, {}) == {"error": "ValueError: boom: the arm failed"}
    assert _common.error_line("Traceback (most recent call last):\n  File \"x\", line 1\n"
                              "torch.distributed.DistBackendError: NCCL error\n  more\n") == \
        "torch.distributed.DistBackendError: NCCL error"


@pytest.mark.slow
def test_bench_script_builds_an_environment_in_which_every_library_imports(tmp_path):
    venv = tmp_path / "venv"
    env = {**os.environ, "CURVKIT_VENV": str(venv)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "bench.sh"), "benchmarks/_common.py"], env=env,
                          capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(" ok") >= 2 * len(_common.BENCH_LIBRARIES), proc.stdout  # checked twice: setup, run
    freeze = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True)
    assert "torch==2.13.0" in freeze.stdout
