"""The compatibility table (``config/compat.py``) against the code, both ways: every field of
vLLM's config classes that nothing outside ``config/`` reads is listed with what it does here,
no listed field is read outside ``config/`` (it would act, and the table would lie), and the
README carries the generated table."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from forwardkit.config.cache import CacheConfig
from forwardkit.config.compat import COMPAT_FIELDS, markdown_table
from forwardkit.config.compilation import CompilationConfig
from forwardkit.config.model import ModelConfig
from forwardkit.config.observability import ObservabilityConfig
from forwardkit.config.parallel import EPLBConfig, ParallelConfig
from forwardkit.config.pass_config import DynamicShapesConfig, PassConfig
from forwardkit.config.scheduler import SchedulerConfig, SpeculativeConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "forwardkit"
CLASSES = [ParallelConfig, EPLBConfig, SchedulerConfig, SpeculativeConfig, CacheConfig, ModelConfig,
           CompilationConfig, PassConfig, DynamicShapesConfig, ObservabilityConfig]


def _outside_config() -> str:
    return "\n".join(p.read_text() for p in sorted(SRC.rglob("*.py")) if "config" not in p.parts)


def _read_outside(name: str, text: str) -> bool:
    return re.search(r"\." + re.escape(name) + r"\b", text) is not None


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_field_acts_or_is_listed(cls):
    text = _outside_config()
    listed = COMPAT_FIELDS.get(cls.__name__, {})
    names = [f.name for f in dataclasses.fields(cls)]
    unlisted = [n for n in names if not _read_outside(n, text) and n not in listed]
    assert not unlisted, (f"{cls.__name__} fields nothing outside config/ reads, missing from "
                          f"config/compat.py: {unlisted}")
    acting = [n for n in listed if _read_outside(n, text)]
    assert not acting, (f"{cls.__name__} fields listed as not acting in config/compat.py but read "
                        f"outside config/: {acting}")
    assert set(listed) <= set(names), f"config/compat.py lists fields {cls.__name__} lacks"


def test_table_covers_only_known_classes():
    assert set(COMPAT_FIELDS) <= {c.__name__ for c in CLASSES}


def test_readme_carries_the_generated_table():
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- compat-fields:start -->\n(.*?)\n<!-- compat-fields:end -->", readme, re.S)
    assert found, "README lacks the compat-fields section"
    assert found.group(1).strip() == markdown_table().strip(), (
        "README's compatibility table is stale: python -m forwardkit.config.compat")
