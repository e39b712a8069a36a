"""The curvature report (``curvkit reproduce curvature``) at its ``tiny`` configuration, plus its helpers.

The tiny configuration (784-16-10 MLP, 600 training images, 64 evaluation points) goes through every code
path of the real scales: the output layer (170 parameters) gets an exact block, the first layer (12,560)
the probe estimate.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from curvkit.experiments import curvature_report as cr
from curvkit.experiments.registry import load_all
from curvkit.models import mlp

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    """Tiny models: one torch thread is fastest, and robust when the CPU is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("curvature_tiny")
    cr.run_config(cr.config_for("tiny", show_progress=False), out, seed=0, scale="tiny")
    return out, json.loads((out / "results.json").read_text())


def test_outputs_written(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    out, res = tiny_run
    for name in ("report.md", "results.json", *res["figures"]):
        assert (out / name).stat().st_size > 0, name
    assert len(res["figures"]) == 4
    for png in res["figures"]:
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    report = (out / "report.md").read_text()
    for heading in ("## Settings", "## Relative Frobenius error of each layer block", "## Cosine of damped steps",
                    "## What the numbers mean", "## Machine", "KFLR is exact for a single datum"):
        assert heading in report
    assert "nan" not in report.split("## Figures")[0].lower().replace("nan ", "")


def test_estimators_and_layers(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    _, res = tiny_run
    names = list(cr.DIAGONAL_ESTIMATORS) + list(cr.KRONECKER_ESTIMATORS)
    assert list(res["block_rel_error_probe"]) == names
    assert [L["num_params"] for L in res["layers"]] == [784 * 16 + 16, 16 * 10 + 10]
    assert [L["exact_block"] for L in res["layers"]] == [False, True]
    assert res["num_params"] == 784 * 16 + 16 + 16 * 10 + 10


def test_block_errors(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    _, res = tiny_run
    probe, exact, se = res["block_rel_error_probe"], res["block_rel_error_exact"], res["block_rel_error_probe_se"]
    for n in probe:
        assert all(math.isfinite(e) and e >= 0 for e in probe[n]), n
        assert exact[n][0] is None and exact[n][1] is not None
        # the probe estimate agrees with the exact value on the output layer within 4 bootstrap standard
        # errors (the largest deviation seen over the estimators is 1.1 s.e.)
        assert abs(probe[n][1] - exact[n][1]) <= 4 * se[n][1], n
    # KFLR and KFRA both use the batch-mean output Hessian on the last layer: identical blocks
    assert exact["KFLR"][1] == pytest.approx(exact["KFRA"][1], rel=1e-9)
    # KFAC is KFLR plus Monte Carlo noise (one sampled label per point), so its error is larger
    assert exact["KFLR"][1] < exact["KFAC"][1]
    # the exact diagonal is the Frobenius projection of the block onto diagonals: no diagonal does better
    for n in ("Hutchinson diagonal", "MC Fisher diagonal", "empirical Fisher diagonal"):
        assert exact["exact diagonal"][1] <= exact[n][1] + 1e-12


def test_exact_trace_by_an_independent_route(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    """The report's exact trace (batched backward passes to the layer outputs) equals the trace from
    per-sample gradients of the same trained model on the same evaluation batch, and the Hutchinson
    estimate lies within 4 of its standard errors."""
    from curvkit import checkpoint
    from curvkit.curvature import GGNOperator
    from curvkit.likelihoods import CrossEntropy

    out, res = tiny_run
    cfg = cr.config_for("tiny", show_progress=False)
    X, y, _, _ = cr.load_data(cfg, 0)
    model = mlp([784, cfg.hidden, 10], "relu", seed=0)
    model.load_state_dict(checkpoint.load(out / "checkpoint.pt")["model"])
    idx = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(2))[: cfg.eval_size]
    G = GGNOperator(model.double(), CrossEntropy("mean"), (X[idx].double(), y[idx]))
    per_sample = float(G._diagonal_per_sample().flat.sum())
    assert res["traces"]["exact"] == pytest.approx(per_sample, rel=1e-10)
    name = f"Hutchinson ({cfg.hutchinson_probes} probes)"
    assert abs(res["traces"][name] - per_sample) <= 4 * res["trace_standard_errors"][name]


def test_step_cosines(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    _, res = tiny_run
    cfg = cr.CONFIGS["tiny"]
    assert set(res["steps"]) == {str(lam) for lam in cfg.dampings}
    for lam, st in res["steps"].items():
        assert st["cg_relative_residual"] <= 10 * cfg.cg_tol, lam
        assert st["block_cg_relative_residual"] <= 10 * cfg.cg_tol, lam
        # curvature helps: the Kronecker steps are closer to the exact GGN step than the plain gradient
        assert st["full"]["KFLR"] > st["full"]["gradient (no curvature)"]
        assert st["per_layer"]["KFLR"][1] > 0.95  # near-exact factors on the output layer
    # cosines grow with damping (every preconditioner tends to the gradient direction)
    lo, hi = (str(lam) for lam in sorted(cfg.dampings)[:2])
    assert res["steps"][hi]["full"]["gradient (no curvature)"] > res["steps"][lo]["full"]["gradient (no curvature)"]


def test_rerun_keeps_the_finished_stages(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    """A re-run of the same configuration reuses the training checkpoint and every finished evaluation
    stage (estimators, block errors, CG steps, KFLR check) and reports the same numbers."""
    out, res = tiny_run
    stages = sorted(p.name for p in (out / "stages").iterdir())
    assert stages == ["block_errors_0.pt", "block_errors_2.pt", "estimators.pt", "kflr_check.pt",
                      "reference_steps.pt"]
    again = cr.run_config(cr.config_for("tiny", show_progress=False), out, seed=0, scale="tiny")
    assert again["traces"] == res["traces"] and again["steps"] == res["steps"]
    assert again["block_rel_error_exact"] == res["block_rel_error_exact"]


def test_kflr_single_datum_is_exact(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    _, res = tiny_run
    assert all(v < 1e-10 for v in res["kflr_single_datum_rel_error"].values())


def test_registered_with_scales() -> None:
    exp = load_all()["curvature"]
    assert exp.scales == ("smoke", "medium", "paper")
    assert set(cr.CONFIGS) >= {"tiny", "smoke", "medium", "paper"}
    for name, cfg in cr.CONFIGS.items():
        cfg.validate()
        assert cfg.hidden == (16 if name == "tiny" else 100)
    with pytest.raises(ValueError, match="unknown scale"):
        cr.run("huge", Path("unused"))


def test_invalid_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="main_damping"):
        cr.config_for("tiny", main_damping=0.5).validate()
    with pytest.raises(ValueError, match="positive"):
        cr.config_for("tiny", dampings=(0.0, 1e-2)).validate()
    with pytest.raises(ValueError, match="eval_size"):
        cr.config_for("tiny", n_train=10).validate()


def test_training_resumes_to_the_same_weights(tmp_path: Path) -> None:
    """Two epochs in one go == one epoch, stop, resume for the second (checkpoint holds optimiser + RNG)."""
    gen = torch.Generator().manual_seed(0)
    X, y = torch.rand(60, 784, generator=gen), torch.randint(0, 10, (60,), generator=gen)
    cfg2 = cr.config_for("tiny", hidden=4, epochs=2, batch_size=20)
    straight = mlp([784, 4, 10], "relu", seed=0)
    log2 = cr.train(straight, X, y, cfg2, seed=0, ckpt=tmp_path / "a.pt")
    resumed = mlp([784, 4, 10], "relu", seed=0)
    cr.train(resumed, X, y, cr.config_for("tiny", hidden=4, epochs=1, batch_size=20), seed=0, ckpt=tmp_path / "b.pt")
    again = mlp([784, 4, 10], "relu", seed=0)
    log_resumed = cr.train(again, X, y, cfg2, seed=0, ckpt=tmp_path / "b.pt")
    assert [r["train_loss"] for r in log_resumed] == [r["train_loss"] for r in log2]
    for p, q in zip(straight.parameters(), again.parameters()):
        assert torch.equal(p, q)
    # a checkpoint of a different configuration is ignored, never silently reused
    other = mlp([784, 4, 10], "relu", seed=0)
    log_other = cr.train(other, X, y, cr.config_for("tiny", hidden=4, epochs=2, batch_size=20, lr=1e-2),
                         seed=0, ckpt=tmp_path / "b.pt")
    # (had the checkpoint been reused, the first log entry would be the old run's)
    assert len(log_other) == 2 and log_other[0]["train_loss"] != log2[0]["train_loss"]


def test_probe_error_limits() -> None:
    gen = torch.Generator().manual_seed(0)
    GV = torch.randn(30, 8, generator=gen, dtype=torch.float64)
    assert cr.probe_error(GV, GV, 20, gen)[0] == 0.0
    est, se = cr.probe_error(torch.zeros_like(GV), GV, 20, gen)
    assert est == pytest.approx(1.0) and se == pytest.approx(0.0, abs=1e-12)
