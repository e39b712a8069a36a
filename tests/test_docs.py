"""The usage page's examples run (doctest), so the documentation cannot silently go stale.

pytest's ``--doctest-glob='*.md'`` only collects files under ``testpaths`` (tests/), so docs/usage.md is
executed here explicitly.
"""

from __future__ import annotations

import doctest
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_usage_examples_execute() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest and robust on a loaded machine
    try:
        result = doctest.testfile(str(DOCS / "usage.md"), module_relative=False,
                                  optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    finally:
        torch.set_num_threads(threads)
    assert result.attempted >= 30, f"usage.md lost its examples ({result.attempted} found)"
    assert result.failed == 0, f"{result.failed} of {result.attempted} usage.md examples failed (see output)"


def test_benchmarks_page_has_curvature_section() -> None:
    text = (DOCS / "benchmarks.md").read_text()
    assert "## Curvature engine" in text
    assert "benchmarks/curvature.py" in text
