"""``benchmarks/gpt2_scale.py`` (issue 22, section 3) does not rot: its ``--tiny`` mode (a 2-layer GPT-2 with
random weights, workers in-process) runs the exact-product, curvlinops, KFAC and LoRA (Kronecker Laplace,
GaussNewton) arms, writes its table, and
the arms compute the same GGN product."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_gpt2_scale_tiny_runs_every_arm(tmp_path: Path) -> None:
    import gpt2_scale

    arms = ["gradient", "curvkit GGN", "curvkit GGN live", "curvkit KFAC expand", "curvkit KFAC reduce", "LoRA gradient",
            "LoRA Kronecker Laplace", "LoRA GLM predictive", "LoRA GaussNewton", "tied gradient", "tied KFAC expand",
            "tied GaussNewton", "tied Kronecker Laplace"]
    if importlib.util.find_spec("curvlinops") is not None:
        arms.append("curvlinops GGN")
    out, js = tmp_path / "scale.md", tmp_path / "scale.json"
    rc = gpt2_scale.main(["--tiny", "--steady", "1", "--output-factor", "low_rank", "--arms", ",".join(arms),
                          "--out", str(out), "--json", str(js)])
    assert rc == 0
    results = json.loads(js.read_text())["results"]
    assert set(results) == set(arms)
    assert not [a for a, r in results.items() if "error" in r]
    text = out.read_text()
    assert "tiny GPT-2" in text and "failed" not in text and "load average" in text
    for arm in [a for a in arms if "gradient" not in a]:
        assert results[arm]["steady_s"] > 0 and results[arm]["first"]["peak_delta_mib"] is not None
    assert results["curvkit GGN live"]["value"] == pytest.approx(results["curvkit GGN"]["value"], rel=1e-6)
    if "curvlinops GGN" in results:  # the same matrix: the same product norm
        assert results["curvlinops GGN"]["value"] == pytest.approx(results["curvkit GGN"]["value"], rel=1e-4)
    assert results["curvkit KFAC expand"]["inverse_s"] > 0


@pytest.mark.slow
def test_llama_scale_quick_runs_every_row(tmp_path: Path) -> None:
    """``benchmarks/llama_scale.py --quick`` (issue 30 §5) runs every row and writes its table: KFAC on every
    parameter (RMSNorm scales and the head included) is measured, not refused."""
    pytest.importorskip("peft")
    import torch

    import llama_scale

    out = tmp_path / "llama.md"  # the test process keeps its thread count
    assert llama_scale.main(["--quick", "--threads", str(torch.get_num_threads()), "--out", str(out)]) == 0
    text = out.read_text()
    for row in ("curvkit KFAC expand, every parameter |", "curvkit KFAC reduce |", "GaussNewton step, every parameter", "LoRA Kronecker Laplace", "LoRA GLM predictive",
                "LoRA GaussNewton step"):
        line = next(line for line in text.splitlines() if row in line)
        assert "refused" not in line and " - |" not in line.split("|")[3], line
