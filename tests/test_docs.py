"""The docs stay true: every test that docs/semantics.md cites exists, and every promise cites one.

A cited test file is named without its folder (`test_cache.py::test_...`); it may live
anywhere under tests/ (the mount tier in tests/, the unit tier in tests/unit/), and the name
must be unique there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def cited_file(fname: str) -> Path:
    """The one file named ``fname`` under tests/ (any depth); fails if none or several."""
    found = sorted(p for p in TESTS.rglob(fname) if "__pycache__" not in p.parts)
    assert found, f"{fname} is cited but no such file is under tests/"
    assert len(found) == 1, f"{fname} is ambiguous: {[str(p.relative_to(ROOT)) for p in found]}"
    return found[0]


def functions_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_semantics_cites_existing_tests():
    text = (ROOT / "docs" / "semantics.md").read_text()
    cited = re.findall(r"`(test_\w+\.py)(?:::(test_\w+))?", text)
    assert len(cited) > 20
    for fname, func in cited:
        path = cited_file(fname)
        if func:
            assert func in functions_in(path), f"{fname}::{func} is cited but does not exist"


def test_every_section_of_semantics_cites_a_test():
    text = (ROOT / "docs" / "semantics.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) >= 9
    for sec in sections:
        assert "test_" in sec, f"section {sec.splitlines()[0]!r} cites no test"


def test_readme_names_the_test_commands_that_ci_runs():
    readme = (ROOT / "README.md").read_text()
    runs = [line.removesuffix(" -q") for line in (ROOT / ".ci" / "run").read_text().splitlines()
            if "./tools/" in line and not line.startswith("#")]
    assert any(r.endswith("./tools/test") for r in runs)
    for r in runs:
        assert r + " " in readme, f"README does not give CI's command {r!r}"


def test_readme_names_each_test_tier():
    readme = (ROOT / "README.md").read_text()
    assert "./tools/test tests/unit" in readme and (TESTS / "unit" / "conftest.py").exists()


def test_design_concurrency_benchmarks_and_operations_cite_existing_tests():
    for doc in ("design.md", "concurrency.md", "benchmarks.md", "operations.md"):
        text = (ROOT / "docs" / doc).read_text()
        for fname, func in re.findall(r"`(?:tests/(?:unit/)?)?(test_\w+\.py)(?:::(test_\w+))?`", text):
            path = cited_file(fname)
            if func:
                assert func in functions_in(path), f"{doc}: {fname}::{func} does not exist"


def test_faults_table_rows_cite_existing_tests():
    text = (ROOT / "docs" / "faults.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| **")]
    assert len(rows) >= 12
    for row in rows:
        cited = re.findall(r"`(test_\w+\.py)::(test_\w+)`", row)
        assert cited, f"row {row[:60]!r} cites no test"
        for fname, func in cited:
            assert func in functions_in(cited_file(fname)), f"{fname}::{func} does not exist"
