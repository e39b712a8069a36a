"""Every registered experiment runs end to end at its smoke scale and writes a report and figures
(about 2 minutes for all of them on 2 idle cores, so they are part of the default suite)."""

import pytest

from curvkit.experiments import registry

NAMES = sorted(registry.load_all())


@pytest.mark.parametrize("name", NAMES)
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
