"""LLM(seed=...) is checked before anything is built (was a torch RuntimeError)."""

from __future__ import annotations

import pytest

from forwardkit.engine import LLM


@pytest.mark.parametrize("seed", ["x", 1.5, True, 2**64, -(2**63) - 1])
def test_bad_seed_is_a_value_error_naming_it(seed):
    with pytest.raises(ValueError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*64\) or None, got"):
        LLM(enforce_eager=True, seed=seed, platform="cpu")
