"""The ``curvkit`` command line: listing, unknown names, bad scales."""

from __future__ import annotations

import runpy
import sys

import pytest

from curvkit.cli import main


def test_list_shows_curvature(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("curvature "))
    assert "smoke/medium/paper" in line


def test_unknown_experiment_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "no-such-experiment", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "unknown experiment 'no-such-experiment'" in err and "curvature" in err


def test_bad_scale_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "curvature", "--scale", "huge"])
    assert exc.value.code == 2


def test_module_entry_point_exit_code(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m curvkit`` exits with status 2 for an unknown name (the process status, not only main()'s
    return value); run in-process through runpy to avoid re-importing every experiment."""
    monkeypatch.setattr(sys, "argv", ["curvkit", "reproduce", "no-such-experiment"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("curvkit", run_name="__main__")
    assert exc.value.code == 2
    assert "unknown experiment" in capsys.readouterr().err
