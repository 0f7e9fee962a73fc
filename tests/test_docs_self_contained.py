"""The repository's docs stand alone: docs/design.md exists, README links it, nothing cites
files outside the repository, and the modules design.md names exist."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Spelled with a character class and an escape so that this file does not match itself.
SPEC_CITATION = re.compile(r"\.\.[/]shared|spec \u00a7|spec/(config|runtime|compilation)\.md")


def _texts() -> list[pathlib.Path]:
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    for folder in ("src", "tests", "benchmarks", "examples"):
        files += (ROOT / folder).rglob("*.py")
    return [f for f in files if f != pathlib.Path(__file__)]


def test_nothing_cites_files_outside_the_repository():
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in _texts()
            for i, line in enumerate(p.read_text().splitlines(), 1) if SPEC_CITATION.search(line)]
    assert hits == []


def test_readme_links_the_design_doc():
    assert "(docs/design.md)" in (ROOT / "README.md").read_text()


def test_modules_named_in_the_design_doc_exist():
    text = (ROOT / "docs" / "design.md").read_text()
    named = set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py)`", text))
    assert named, "design.md names no module"
    missing = [m for m in sorted(named) if not any(
        (base / m).exists() for base in (ROOT, ROOT / "src" / "forwardkit", ROOT / "src"))]
    assert missing == []
