"""docs/structure.md names every module of the package (and nothing that is gone)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_structure_doc_lists_every_module():
    text = (ROOT / "docs" / "structure.md").read_text()
    documented = {m if m.startswith("forwardkit/") else f"forwardkit/{m}"
                  for m in re.findall(r"`((?:forwardkit/)?[a-z_/]+\.py)`", text)}
    src = ROOT / "src"
    actual = {str(p.relative_to(src)) for p in (src / "forwardkit").rglob("*.py")
              if p.name != "__init__.py" or p.parent.name == "models"}
    assert sorted(actual - documented) == [], "modules missing from docs/structure.md"
    assert sorted(documented - actual) == [], "docs/structure.md names modules that do not exist"
