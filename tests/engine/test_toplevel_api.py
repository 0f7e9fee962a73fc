"""``from forwardkit import LLM, SamplingParams, ...`` works, and ``import forwardkit`` stays light
(no Dynamo, Inductor or transformers; checked in a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import forwardkit

HEAVY = ("torch._dynamo", "torch._inductor", "transformers")
NAMES = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineConfig",
         "CompilationConfig", "CompilationMode", "CUDAGraphMode", "ForwardContext",
         "BatchDescriptor", "set_forward_context", "get_forward_context",
         "override_forward_context", "create_forward_context", "is_forward_context_available"]


def _loaded_after(code: str) -> list[str]:
    """Heavy modules present in ``sys.modules`` after running ``code`` in a new interpreter."""
    probe = code + f"\nimport json, sys\nprint(json.dumps([m for m in sys.modules if m.startswith({HEAVY!r})]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**os.environ}, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_names_resolve_to_their_modules():
    from forwardkit.config.compilation import CompilationConfig
    from forwardkit.config.compilation_enums import CUDAGraphMode
    from forwardkit.engine.llm import LLM
    from forwardkit.engine.sampling_params import SamplingParams
    from forwardkit.forward_context import set_forward_context

    assert forwardkit.LLM is LLM and forwardkit.SamplingParams is SamplingParams
    assert forwardkit.CompilationConfig is CompilationConfig and forwardkit.CUDAGraphMode is CUDAGraphMode
    assert forwardkit.set_forward_context is set_forward_context
    for name in NAMES:
        assert getattr(forwardkit, name) is not None and name in forwardkit.__all__
        assert name in dir(forwardkit)


def test_unknown_name_is_attribute_error():
    import pytest

    with pytest.raises(AttributeError, match="has no attribute 'NotAThing'"):
        forwardkit.NotAThing  # noqa: B018


def test_import_forwardkit_is_light():
    assert _loaded_after("import forwardkit") == []
    # The config and forward-context names do not need the compiler either.
    assert _loaded_after(
        "from forwardkit import SamplingParams, CompilationConfig, EngineConfig, set_forward_context"
    ) == []
    # Sampling parameters and result types need only the standard library, not even torch.
    probe = "from forwardkit import SamplingParams, RequestOutput, CompletionOutput, Logprob\n"
    out = subprocess.run([sys.executable, "-c", probe + "import sys; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
    # Even LLM imports Dynamo / Inductor only when it compiles.
    assert _loaded_after("from forwardkit import LLM") == []
