"""The ``autoencoder`` experiment (thesis Fig. 4.1) and the run machinery shared by the chapter-4 experiments:
the smoke run must lower the objective with every optimiser and report the claims consistently, an
interrupted run must resume to the uninterrupted result, and the helpers (Glorot init, Adam's halving
schedule, top-k, values at a time) must do what they say."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from curvkit.experiments import registry
from curvkit.experiments._second_order import (
    RunSpec,
    Task,
    adam_grid,
    glorot_,
    load_user_dataset,
    smooth,
    topk_mean,
    train_run,
    value_at,
)
from curvkit.likelihoods import BernoulliBCE
from curvkit.models import autoencoder


def test_smoke_run_lowers_the_objective_and_reports_the_claims(tmp_path):
    res = registry.run("autoencoder", "smoke", tmp_path, seed=0)
    mn = res["datasets"]["mnist"]
    cl = mn["claims"]["per_method"]
    # 15 updates of 200 images are too few for the thesis's per-update claim to be a stable result (with the
    # current minibatch's curvature, the thesis's, it does not hold at this scale: docs/results.md has the
    # medium run). What must hold: KFRA and KFAC halve the objective within 15 updates (a sign error, a wrong
    # alpha* or a wrong direction would break this) and the claims are read off the curves consistently.
    for name in ("KFRA", "KFAC"):
        c = cl[name]
        assert c["objective"] < 0.6 * mn["curves"][name]["loss"][0], (name, c)
        assert c["beats_best_adam_per_update"] == (c["objective"] < c["best_adam_same_updates"])
        assert c["objective"] == pytest.approx(value_at({"loss": mn["curves"][name]["loss"], "diverged": None},
                                                        update=15))
    for name, curves in mn["curves"].items():
        run = mn["runs"][name]
        assert run["diverged"] is None
        assert curves["evals"][-1]["loss"] < curves["evals"][0]["loss"]  # every optimiser lowered the loss
        assert run["final_objective_smoothed"] == pytest.approx(float(smooth(curves["loss"])[-1]))
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["datasets"]["mnist"]["claims"]["best_adam"] == mn["claims"]["best_adam"]
    text = (tmp_path / "report.md").read_text()
    assert "per update **" in text and (tmp_path / "fig4_1_mnist.png").exists()


def _tiny_task(n=240, batch=40):
    g = torch.Generator().manual_seed(0)
    X = torch.rand(n, 12, generator=g)

    def model_fn():
        net = nn.Sequential(nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 3), nn.Tanh(), nn.Linear(3, 6), nn.Tanh(),
                            nn.Linear(6, 12))
        return glorot_(net, 3)

    def metrics(f, x):
        return {"loss": float(nn.functional.binary_cross_entropy_with_logits(f, x, reduction="sum"))}

    return Task("tiny", model_fn, BernoulliBCE("mean"), X, X, batch, 1e-5, metrics, n)


@pytest.mark.parametrize("spec", [
    RunSpec("kfac-ema", "gauss_newton", 14, curvature="kfac", ema=0.9, eval_every=4, checkpoint_every=3),
    RunSpec("adam-halving", "adam", 14, lr=2**-6, halving=4, eval_every=4, checkpoint_every=3),
])
def test_interrupted_run_resumes_to_the_uninterrupted_result(tmp_path, spec):
    task = _tiny_task()
    full = train_run(task, spec, tmp_path / "full", batch_seed=5)
    assert train_run(task, spec, tmp_path / "cut", batch_seed=5, stop_after=5) is None
    assert (tmp_path / "cut" / "checkpoint.pt").exists() and not (tmp_path / "cut" / "result.pt").exists()
    assert train_run(task, spec, tmp_path / "cut", batch_seed=5, stop_after=4) is None  # interrupted twice
    resumed = train_run(task, spec, tmp_path / "cut", batch_seed=5)
    assert resumed["loss"] == full["loss"]
    assert [{k: v for k, v in e.items() if k != "time"} for e in resumed["evals"]] == \
           [{k: v for k, v in e.items() if k != "time"} for e in full["evals"]]
    assert not (tmp_path / "cut" / "checkpoint.pt").exists()
    # a finished run is reused, not redone
    mtime = (tmp_path / "cut" / "result.pt").stat().st_mtime_ns
    again = train_run(task, spec, tmp_path / "cut", batch_seed=5)
    assert again["loss"] == full["loss"] and (tmp_path / "cut" / "result.pt").stat().st_mtime_ns == mtime
    # a different configuration in the same directory is not mistaken for it
    other = train_run(task, RunSpec(spec.name, spec.kind, 3, curvature=spec.curvature, lr=spec.lr),
                      tmp_path / "cut", batch_seed=5)
    assert len(other["loss"]) == 3


@pytest.mark.parametrize("kind", ["adam", "gauss_newton"])
def test_divergence_is_recorded(tmp_path, kind):
    """A non-finite loss ends the run and is recorded (step, error, infinite final values), not hidden."""
    task = _tiny_task(n=80, batch=40)
    task.X[50, 3] = math.nan  # in the first or the second minibatch; not in the evaluation subset
    task.eval_n = 40
    rec = train_run(task, RunSpec("r", kind, 6, eval_every=2), tmp_path / kind, batch_seed=1)
    bad_step = rec["diverged"]["step"]
    assert 1 <= bad_step <= 2 and ("not finite" in rec["diverged"]["error"] or "NaN" in rec["diverged"]["error"])
    assert len(rec["loss"]) == bad_step - 1 and math.isinf(rec["evals"][-1]["loss"])
    assert math.isinf(value_at(rec, update=6))


def test_glorot_init_is_seeded_and_shared():
    a, b = glorot_(autoencoder(784, width=0.1), 7), glorot_(autoencoder(784, width=0.1), 7)
    c = glorot_(autoencoder(784, width=0.1), 8)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        p, q, r = p.detach(), q.detach(), r.detach()
        assert torch.equal(p, q)
        if n.endswith("bias"):
            assert not p.any()
        else:
            bound = math.sqrt(6 / (p.shape[0] + p.shape[1]))
            assert float(p.abs().max()) <= bound and not torch.equal(p, r)
            assert float(p.std()) == pytest.approx(bound / math.sqrt(3), rel=0.1)


def test_adam_schedule_grid_and_summaries():
    grid = adam_grid([-6, -13], [1.0, 0.25], 400, 50, 100)
    assert [s.name for s in grid] == ["adam-lr2^-6-T100%", "adam-lr2^-6-T25%", "adam-lr2^-13-T100%",
                                      "adam-lr2^-13-T25%"]
    s = grid[1]
    assert s.halving == 100 and s.lr_at(0) == 2**-6 and s.lr_at(99) == 2**-6 and s.lr_at(100) == 2**-7
    assert s.lr_at(399) == 2**-6 / 8 and grid[0].lr_at(399) == 2**-6
    assert np.allclose(smooth([1, 2, 3, 4], window=2), [1, 1.5, 2.5, 3.5])
    recs = [{"name": "a", "loss": [5.0] * 20, "time": list(np.arange(1, 21.0)), "diverged": None},
            {"name": "b", "loss": [3.0] * 20, "time": list(np.arange(1, 21.0) * 2), "diverged": None},
            {"name": "c", "loss": [1.0] * 5, "time": [1.0] * 5, "diverged": {"step": 6}}]
    best, mean = topk_mean(recs, 2)
    assert [r["name"] for r in best] == ["b", "a"] and np.allclose(mean, 4.0)
    assert value_at(recs[1], time_s=10.0) == 3.0 and math.isnan(value_at(recs[1], time_s=1.0))
    assert math.isinf(value_at(recs[2], update=10)) and math.isnan(value_at(recs[0], update=21))


def test_user_datasets_load_or_say_why(tmp_path, monkeypatch):
    monkeypatch.delenv("CURVKIT_CURVES", raising=False)
    assert load_user_dataset("curves") is None  # not available offline: the experiment reports "not run"
    with pytest.raises(FileNotFoundError, match="CURVES"):
        load_user_dataset("curves", tmp_path / "missing.npy")
    good = np.random.default_rng(0).random((30, 784)).astype(np.float32)
    np.save(tmp_path / "curves.npy", good)
    monkeypatch.setenv("CURVKIT_CURVES", str(tmp_path / "curves.npy"))
    assert torch.equal(load_user_dataset("curves"), torch.from_numpy(good))
    np.save(tmp_path / "bad.npy", good[:, :700])
    with pytest.raises(ValueError, match=r"expected \(N, 784\)"):
        load_user_dataset("curves", tmp_path / "bad.npy")
    np.save(tmp_path / "faces.npy", good[:, :625] * 3)
    assert load_user_dataset("faces", tmp_path / "faces.npy").shape == (30, 625)
    with pytest.raises(ValueError, match="unknown dataset"):
        load_user_dataset("cifar")


def test_runs_stored_before_the_current_minibatch_default_are_redone(tmp_path):
    """A finished Gauss-Newton run stored by curvkit 0.1 (ema=None meant the running mean; its key has no
    'gauss_newton' format) is not reused: train_run redoes it."""
    from curvkit import checkpoint

    task = _tiny_task()
    spec = RunSpec("kfra", "gauss_newton", 3, curvature="kfra", eval_every=3, checkpoint_every=3)
    first = train_run(task, spec, tmp_path)
    old = checkpoint.load(tmp_path / "result.pt")
    del old["key"]["gauss_newton"]
    old["loss"] = [1.0, 2.0, 3.0]
    checkpoint.save(old, tmp_path / "result.pt")
    assert train_run(task, spec, tmp_path)["loss"] == first["loss"]
