"""The ``curvkit`` command line: listing, unknown names, bad scales."""

from __future__ import annotations

import os
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


# ----------------------------------------------------------------------------- one-line usage errors (issue 11)
def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert "Traceback" not in cap.err and len(err.splitlines()) == 1 and err.startswith("curvkit reproduce: error:")
    assert "report written" not in cap.out
    return err


def test_out_at_an_existing_file_is_a_usage_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "report.txt"
    target.write_text("keep me")
    err = _one_line_error(capsys, ["reproduce", "curvature", "--out", str(target)])
    assert "exists and is not a directory" in err and str(target) in err
    assert target.read_text() == "keep me"


def test_out_in_an_unwritable_place_is_a_usage_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file in the way of the directory (fails for every user, root included)."""
    (tmp_path / "file").write_text("")
    err = _one_line_error(capsys, ["reproduce", "curvature", "--out", str(tmp_path / "file" / "sub")])
    assert "cannot write to the output directory" in err and "writable" in err


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can write anywhere")
def test_out_without_permission_is_a_usage_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        err = _one_line_error(capsys, ["reproduce", "curvature", "--out", str(locked / "run")])
    finally:
        locked.chmod(0o700)
    assert "cannot write to the output directory" in err


@pytest.mark.parametrize("out", ["", "  "])
def test_empty_out_is_a_usage_error(out: str, tmp_path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``--out ""`` used to fall back silently to results/NAME-SCALE."""
    monkeypatch.chdir(tmp_path)
    err = _one_line_error(capsys, ["reproduce", "curvature", "--out", out])
    assert "--out is empty" in err
    assert not (tmp_path / "results").exists()


def test_scale_an_experiment_lacks_is_a_usage_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """An experiment without a paper scale: the registry's clear message, as one line and exit code 2 (it was a
    traceback); nothing is created."""
    from curvkit.experiments import registry

    name = next(n for n, e in registry.load_all().items() if "paper" not in e.scales)
    err = _one_line_error(capsys, ["reproduce", name, "--scale", "paper", "--out", str(tmp_path / "run")])
    assert f"experiment {name!r} has no 'paper' scale" in err and "smoke" in err
    assert not (tmp_path / "run").exists()


def test_registry_checks_before_running(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """registry.run refuses a bad output directory before the experiment starts (ExperimentError, a ValueError),
    and passes a usable one on as a Path."""
    from curvkit.experiments import registry

    calls: list[tuple[str, object, int]] = []
    fn = lambda scale, out, seed=0: calls.append((scale, out, seed))  # noqa: E731
    monkeypatch.setitem(registry._REGISTRY, "probe-exp", registry.Experiment("probe-exp", "test", fn, ("smoke",)))
    monkeypatch.setattr(registry, "load_all", lambda: dict(registry._REGISTRY))
    (tmp_path / "f").write_text("")
    for bad in ("", tmp_path / "f", tmp_path / "f" / "x"):
        with pytest.raises(registry.ExperimentError):
            registry.run("probe-exp", "smoke", bad)
    with pytest.raises(ValueError, match="has no 'medium' scale"):
        registry.run("probe-exp", "medium", tmp_path / "ok")
    assert calls == []
    registry.run("probe-exp", "smoke", str(tmp_path / "ok" / "deep"), seed=3)
    assert calls == [("smoke", tmp_path / "ok" / "deep", 3)] and (tmp_path / "ok" / "deep").is_dir()
