"""Resuming never runs code from a checkpoint (issue 25, item 6).

A crafted checkpoint - a real ``torch.save`` file whose unpickling would create a marker file, as a shell
command would - is placed where each resume path looks for its checkpoint (``curvkit reproduce`` training
checkpoints and cached stages, the continual-learning runner, the task-sequence trainer, the MESU-Hessian
pre-training); every one refuses it with :class:`curvkit.checkpoint.CheckpointError` naming the file, and
the marker is never created. Every other reader goes through :func:`curvkit.checkpoint.load`, checked
structurally below; ``tests/conftest.py`` checks that every checkpoint the tests write loads with
``weights_only=True``.
"""

from __future__ import annotations

import ast
import pathlib
import re
import shutil

import pytest
import torch

from curvkit import checkpoint
from curvkit.checkpoint import CheckpointError

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "curvkit"


class _Touch:
    """Unpickling this object calls ``pathlib.Path.touch(marker)``: the stand-in for arbitrary code."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def plant(path: pathlib.Path, marker: pathlib.Path, payload=None) -> pathlib.Path:
    """Write a crafted checkpoint at ``path`` (plain ``torch.save``, not curvkit's writer)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    obj = {"key": None, "value": _Touch(marker)} if payload is None else payload(_Touch(marker))
    torch.save(obj, path)
    return path


def _refused(path: pathlib.Path):
    return pytest.raises(CheckpointError, match=rf"checkpoint {re.escape(str(path))} holds objects other than "
                                                r"tensors and plain containers.*nothing in the file was executed")


def test_the_crafted_file_would_run_code_with_a_plain_unpickler(tmp_path):
    marker = tmp_path / "marker"
    path = plant(tmp_path / "ck.pt", marker)
    torch.load(path, weights_only=False)                      # what every resume path did before
    assert marker.exists()


def test_checkpoint_load_refuses_it_and_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    path = plant(tmp_path / "ck.pt", marker)
    with _refused(path):
        checkpoint.load(path)
    assert not marker.exists()
    checkpoint.save({"w": torch.ones(2), "meta": {"step": 3, "names": ["a"], "dtype": torch.float64}}, path)
    assert checkpoint.load(path)["meta"]["step"] == 3         # plain checkpoints still load


def test_curvkit_reproduce_refuses_a_crafted_training_checkpoint(tmp_path):
    from curvkit.cli import main

    marker, out = tmp_path / "marker", tmp_path / "out"
    path = plant(out / "checkpoint.pt", marker)
    with _refused(path):
        main(["reproduce", "curvature", "--scale", "smoke", "--out", str(out)])
    assert not marker.exists()


def test_cached_stages_refuse_a_crafted_stage(tmp_path):
    from curvkit.experiments._report import cached_stage

    marker = tmp_path / "marker"
    path = plant(tmp_path / "stages" / "estimators.pt", marker)
    with _refused(path):
        cached_stage(path, {"config": "abc"}, lambda: pytest.fail("the stage must not be recomputed silently"))
    assert not marker.exists()


def test_continual_runner_refuses_a_crafted_checkpoint(tmp_path):
    from curvkit.continual import ContinualRunner
    from test_continual_runner import _config, _mesu_learner, _stream

    marker, out = tmp_path / "marker", tmp_path / "run"
    path = plant(out / "checkpoint.pt", marker,
                 lambda evil: {"fingerprint": "x", "t": 0, "learner": {}, "result": {}, "rng": evil})
    with _refused(path):
        ContinualRunner(_mesu_learner(), _stream(), _config(), out).run()
    assert not marker.exists()


def test_task_sequence_trainer_refuses_a_crafted_checkpoint(tmp_path, make_linear_tasks):
    from curvkit.continual import DatasetSequence
    from curvkit.continual.task_sequence import SequenceConfig, train_task_sequence
    from curvkit.models import mlp

    marker = tmp_path / "marker"
    path = plant(tmp_path / "sequence.pt", marker, lambda evil: {"config": evil})
    model = mlp([8, 6, 3], "relu", seed=0)
    with _refused(path):
        train_task_sequence(model, DatasetSequence(make_linear_tasks()), None, SequenceConfig(), tmp_path)
    assert not marker.exists()


def test_mesu_hessian_pretraining_refuses_a_crafted_model_file(tmp_path):
    from curvkit.experiments.mesu_hessian import _pretrain

    marker = tmp_path / "marker"
    path = plant(tmp_path / "pretrained.pt", marker, lambda evil: {"0.weight": evil})
    with _refused(path):
        _pretrain(torch.zeros(4, 784), torch.zeros(4, dtype=torch.long), 1, 0, path, False)
    assert not marker.exists()


def _calls(path: pathlib.Path, owner: str, names: tuple[str, ...]) -> list[ast.Call]:
    """The calls ``owner.name(...)`` in a module's code (docstrings and comments are not code)."""
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr in names
            and isinstance(node.func.value, ast.Name) and node.func.value.id == owner]


def test_every_reader_of_a_pickle_is_the_weights_only_loader():
    """Structural: ``torch.load`` is called only in ``curvkit/checkpoint.py``, with ``weights_only=True``;
    ``pickle.load(s)`` only in the CIFAR reader (a restricted unpickler) and in the Reducer's object
    collectives (bytes from the ranks of the same job, as torch.distributed's ``*_object`` collectives; never
    a file); ``np.load`` never with pickles."""
    offenders = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if _calls(path, "torch", ("load",)) and rel != "checkpoint.py":
            offenders.append(f"{rel}: torch.load")
        if _calls(path, "pickle", ("load", "loads")) and rel not in ("data/vision_sets.py", "distributed/reducer.py"):
            offenders.append(f"{rel}: pickle.load")
        for call in _calls(path, "np", ("load",)):
            if any(k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                   for k in call.keywords):
                offenders.append(f"{rel}: np.load(allow_pickle=...)")
    assert not offenders, offenders
    (call,) = _calls(SRC / "checkpoint.py", "torch", ("load",))
    flags = {k.arg: k.value.value for k in call.keywords if isinstance(k.value, ast.Constant)}
    assert flags.get("weights_only") is True


def test_distributed_checkpoints_go_through_the_weights_only_loader():
    text = (SRC / "distributed" / "checkpoint.py").read_text()
    assert "checkpoint.load(" in text and "torch.load" not in text


def test_reused_checkpoint_of_an_output_directory_still_resumes(tmp_path):
    """A copied output directory with curvkit's own (plain) checkpoint resumes as before."""
    from curvkit.continual import ContinualRunner
    from test_continual_runner import _config, _mesu_learner, _stream

    first = tmp_path / "a"
    ContinualRunner(_mesu_learner(), _stream(), _config(checkpoint_every=5), first).run(max_steps=7)
    shutil.copytree(first, tmp_path / "b")
    runner = ContinualRunner(_mesu_learner(), _stream(), _config(checkpoint_every=5), tmp_path / "b")
    assert runner.load_checkpoint() and runner.t == 7
