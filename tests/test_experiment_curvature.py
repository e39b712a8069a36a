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


def test_block_errors_are_sane(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    _, res = tiny_run
    probe, exact, se = res["block_rel_error_probe"], res["block_rel_error_exact"], res["block_rel_error_probe_se"]
    for n in probe:
        assert all(math.isfinite(e) and e >= 0 for e in probe[n]), n
        assert exact[n][0] is None and exact[n][1] is not None
        # the probe estimate agrees with the exact value on the output layer (within 5 s.e. or 25%)
        assert abs(probe[n][1] - exact[n][1]) <= max(5 * se[n][1], 0.25 * exact[n][1]), n
    # KFLR and KFRA both use the batch-mean output Hessian on the last layer: identical blocks
    assert exact["KFLR"][1] == pytest.approx(exact["KFRA"][1], rel=1e-9)
    # the factored-expectation error of KFLR on the output layer is small, and below KFAC's (MC noise added)
    assert exact["KFLR"][1] < 0.2
    assert exact["KFLR"][1] < exact["KFAC"][1]
    # a diagonal cannot represent the off-diagonal mass of the block: its error is large
    assert exact["exact diagonal"][1] > 0.5
    # the exact diagonal as a block approximation is optimal among diagonals (Frobenius projection)
    for n in ("Hutchinson diagonal", "MC Fisher diagonal", "empirical Fisher diagonal"):
        assert exact["exact diagonal"][1] <= exact[n][1] + 1e-12


def test_diagonals_and_traces(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    _, res = tiny_run
    assert "exact diagonal" in res["diagonal_rel_error"]
    assert all(e == 0 for e in res["diagonal_rel_error"]["exact diagonal"])
    ex = res["traces"]["exact"]
    assert ex > 0
    # every trace estimate within 50% (Hutchinson with 64 probes, MC with one label per point)
    for name, t in res["traces"].items():
        assert abs(t - ex) / ex < 0.5, name
    assert abs(res["traces"]["KFLR"] - ex) / ex < 0.05  # tr(G (x) A) = tr(G) tr(A): factored mean only


def test_step_cosines(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    _, res = tiny_run
    cfg = cr.CONFIGS["tiny"]
    assert set(res["steps"]) == {str(lam) for lam in cfg.dampings}
    for lam, st in res["steps"].items():
        assert st["cg_relative_residual"] <= 10 * cfg.cg_tol, lam
        assert st["block_cg_relative_residual"] <= 10 * cfg.cg_tol, lam
        for n, c in st["full"].items():
            assert -1 - 1e-12 <= c <= 1 + 1e-12, (lam, n)
            assert all(-1 - 1e-12 <= x <= 1 + 1e-12 for x in st["per_layer"][n]), (lam, n)
        # the exact block step is its own per-layer reference
        assert st["per_layer"]["exact block-diagonal GGN"] == pytest.approx([1.0, 1.0], abs=1e-9)
        # curvature helps: the Kronecker steps are closer to the exact GGN step than the plain gradient
        assert st["full"]["KFLR"] > st["full"]["gradient (no curvature)"]
        assert st["per_layer"]["KFLR"][1] > 0.95  # near-exact factors on the output layer
    # cosines grow with damping (every preconditioner tends to the gradient direction)
    lo, hi = (str(lam) for lam in sorted(cfg.dampings)[:2])
    assert res["steps"][hi]["full"]["gradient (no curvature)"] > res["steps"][lo]["full"]["gradient (no curvature)"]


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


def test_shifted_cg_matches_direct_solves() -> None:
    gen = torch.Generator().manual_seed(0)
    M = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    A = M @ M.T  # PSD, rank 5: singular without the shift
    B = torch.randn(12, 3, generator=gen, dtype=torch.float64)
    shifts = torch.tensor([1e-2, 1e-1, 1.0], dtype=torch.float64)
    X, iters, resid = cr.shifted_cg(lambda P: A @ P, B, shifts, tol=1e-12, max_iter=100)
    for j in range(3):
        ref = torch.linalg.solve(A + shifts[j] * torch.eye(12, dtype=torch.float64), B[:, j])
        assert torch.allclose(X[:, j], ref, atol=1e-9)
        assert resid[j] < 1e-10 and 0 < iters[j] <= 12


def test_probe_error_limits() -> None:
    gen = torch.Generator().manual_seed(0)
    GV = torch.randn(30, 8, generator=gen, dtype=torch.float64)
    assert cr.probe_error(GV, GV, 20, gen)[0] == 0.0
    est, se = cr.probe_error(torch.zeros_like(GV), GV, 20, gen)
    assert est == pytest.approx(1.0) and se == pytest.approx(0.0, abs=1e-12)
