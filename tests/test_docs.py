"""The usage page's examples run (doctest), so the documentation cannot silently go stale.

pytest's ``--doctest-glob='*.md'`` only collects files under ``testpaths`` (tests/), so docs/usage.md is
executed here explicitly. Examples that need an optional package (``transformers``) sit between
``<!-- requires: NAME -->`` and ``<!-- end requires -->``: without the package they are left out (the rest
still runs, and the test reports a skip).
"""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parent.parent / "docs"


# A region between these lines runs only where its package imports (optional dependencies).
_REQUIRES = re.compile(r"^<!-- requires: (\S+) -->$(.*?)^<!-- end requires -->$", re.MULTILINE | re.DOTALL)


def runnable(text: str) -> tuple[str, list[str]]:
    """``text`` without the regions whose required package is missing, and the names of those packages."""
    missing: list[str] = []

    def keep(match: re.Match[str]) -> str:
        try:
            importlib.import_module(match.group(1))
            return match.group(2)
        except ImportError:
            pass
        missing.append(match.group(1))
        return "\n" * match.group(0).count("\n")  # line numbers of later examples stay right

    return _REQUIRES.sub(keep, text), missing


def test_usage_examples_execute() -> None:
    path = DOCS / "usage.md"
    text, missing = runnable(path.read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest and robust on a loaded machine
    try:
        test = doctest.DocTestParser().get_doctest(text, {"__name__": "__main__"}, path.name, str(path), 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        result = runner.run(test)
    finally:
        torch.set_num_threads(threads)
    assert result.attempted >= 30, f"usage.md lost its examples ({result.attempted} found)"
    assert result.failed == 0, f"{result.failed} of {result.attempted} usage.md examples failed (see output)"
    if missing:
        pytest.skip(f"usage.md examples needing {sorted(set(missing))} were not run (not installed); the rest passed")


def test_optional_regions_are_left_out_only_without_their_package() -> None:
    text = "a\n<!-- requires: json -->\n>>> 1\n1\n<!-- end requires -->\n<!-- requires: no_such_pkg_x -->\n>>> 2\n" \
           "2\n<!-- end requires -->\nb\n"
    kept, missing = runnable(text)
    assert kept.count(">>>") == 1 and missing == ["no_such_pkg_x"] and kept.count("\n") == text.count("\n")


def test_benchmarks_page_has_curvature_section() -> None:
    text = (DOCS / "benchmarks.md").read_text()
    assert "## Curvature engine" in text
    assert "benchmarks/curvature.py" in text


def test_results_page_has_one_section_and_one_glance_row_per_experiment() -> None:
    """docs/results.md: every registered experiment has exactly one ``### `NAME``` section and one row in the
    "At a glance" table linking to it, and nothing else does (a renamed or new experiment must update the page)."""
    from curvkit.experiments import registry

    names = set(registry.load_all())
    text = (DOCS / "results.md").read_text()
    sections = re.findall(r"^### `([\w-]+)`$", text, re.MULTILINE)
    assert sorted(sections) == sorted(names), "docs/results.md sections differ from `curvkit reproduce --list`"
    glance = text.split("## At a glance", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \[`([\w-]+)`\]\(#([\w-]+)\)", glance, re.MULTILINE)
    assert sorted(name for name, _ in rows) == sorted(names)
    assert all(name == anchor for name, anchor in rows), "an at-a-glance link points to another section"
