"""Every registered experiment at its smoke scale.

The main job (``curvkit reproduce curvature --scale smoke``, the README's first command) runs in the
default suite and must get the numbers right that hold at any scale: KFLR is exact for a single datum
(thesis Sec. 4.3.1), the probe estimate of each block error agrees with the exact value where the block
is formed, and the CG reference steps converged. Every other experiment has dedicated tests of its parts
(tests/test_experiment_*.py, test_mesu_hessian_exp.py, test_filter_api.py, test_ngd.py,
test_continual_runner.py) and runs end to end here under ``-m slow`` (several minutes in all).
"""

import json

import pytest

from curvkit.experiments import registry

NAMES = sorted(registry.load_all())


def test_main_job_smoke_scale_gets_the_scale_free_numbers_right(tmp_path):
    registry.run("curvature", "smoke", tmp_path, seed=0)
    res = json.loads((tmp_path / "results.json").read_text())
    assert all(v < 1e-10 for v in res["kflr_single_datum_rel_error"].values())
    probe, exact, se = res["block_rel_error_probe"], res["block_rel_error_exact"], res["block_rel_error_probe_se"]
    for name in probe:
        i = next(j for j, e in enumerate(exact[name]) if e is not None)  # the output layer's exact block
        assert abs(probe[name][i] - exact[name][i]) <= 4 * se[name][i], name
    for lam, st in res["steps"].items():
        assert st["cg_relative_residual"] <= 10 * 1e-6 and st["block_cg_relative_residual"] <= 10 * 1e-6, lam
    assert "## What the numbers mean" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in NAMES if n != "curvature"])
def test_smoke_scale_writes_a_report(name, tmp_path):
    registry.run(name, "smoke", tmp_path, seed=0)
    report = tmp_path / "report.md"
    assert report.exists(), f"{name} wrote no report.md"
    assert len(report.read_text()) > 200
    assert list(tmp_path.rglob("*.png")), f"{name} wrote no figure"


def test_every_experiment_has_a_smoke_scale():
    assert NAMES, "no experiment registered"
    for name in NAMES:
        assert "smoke" in registry.get(name).scales
