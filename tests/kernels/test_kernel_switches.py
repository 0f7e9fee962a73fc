"""One switch per native CPU kernel: the custom op of the layers that call it
(``compilation_config.custom_ops``; ``config/custom_ops.py``). ``cpu_linear`` switches the native
linear and the native quantized linear, ``cpu_attention`` the native decode attention; the
deprecated ``FORWARDKIT_CPU_NATIVE_*`` variables are read into that list at engine-config
resolution and never by a kernel. Kernel use is read from the production counter
(``native_build.kernel_calls``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forwardkit.config.engine import EngineConfig, set_current_engine_config
from forwardkit.kernels.cpu import native_build, native_linear, native_quant, router
from forwardkit.layers.linear import Linear, linear_op_weights
from forwardkit.quantization.linear_method import QuantizedLinearMethod
from forwardkit.quantization.ops import reference_linear

F32 = torch.float32
needs_linear_kernel = pytest.mark.skipif(
    not any(native_linear.isa_supported(isa, F32) for isa in ("avx512", "avx2")),
    reason="the CPU has neither AVX-512 nor AVX2+FMA (the native linear kernel's instructions)")


def _config(custom_ops: list[str]) -> EngineConfig:
    return EngineConfig(compilation_config={"custom_ops": custom_ops})


def _dense_layer(config: EngineConfig) -> Linear:
    with set_current_engine_config(config):
        layer = Linear(64, 24, bias=True, dtype=F32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(24, 64, generator=gen))
        layer.bias.copy_(torch.randn(24, generator=gen))
    return layer


def _linear_calls(layer: Linear, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The layer's output for ``x`` with a router bound (as the runner binds it each step), and
    the native linear kernel's calls it took."""
    routes = router.CpuLinearRouter(timing=False)  # the fast paths themselves, never timed away
    routes.route_weights(linear_op_weights(layer))
    before = native_build.kernel_calls.snapshot()
    with router.bind(routes):
        out = layer(x)
    return out, native_build.kernel_calls.since(before)["linear"]


@needs_linear_kernel
def test_cpu_linear_switches_the_native_linear_kernel():
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    on = _dense_layer(_config([]))
    out_on, calls_on = _linear_calls(on, x)
    assert on.forward_form == "cpu" and calls_on == 1  # the kernel served the product
    off = _dense_layer(_config(["-cpu_linear"]))
    out_off, calls_off = _linear_calls(off, x)
    assert off.forward_form == "native" and calls_off == 0  # F.linear served it
    assert torch.equal(out_off, F.linear(x, off.weight, off.bias))
    torch.testing.assert_close(out_on, out_off, rtol=1e-5, atol=1e-5)


def _quant_layer(config: EngineConfig) -> Linear:
    with set_current_engine_config(config):
        layer = Linear(64, 24, bias=True, dtype=F32, quant_method=QuantizedLinearMethod("q8_0"))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(24, 64, generator=gen))
        layer.bias.copy_(torch.randn(24, generator=gen))
    assert layer.quant_method is not None
    layer.quant_method.process_weights_after_loading(layer, "w")
    return layer


def test_cpu_linear_switches_the_native_quantized_kernel():
    """A quantized projection is a ``cpu_linear`` layer: on, its products take the native
    quantized kernel (counted); ``"-cpu_linear"``, dequantize-then-``F.linear`` in plain torch."""
    assert native_quant.available()  # the generic build runs on every CPU with a compiler
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    on, off = _quant_layer(_config([])), _quant_layer(_config(["-cpu_linear"]))
    before = native_build.kernel_calls.snapshot()
    out_on = on(x)
    assert native_build.kernel_calls.since(before)["quant"] == 1
    before = native_build.kernel_calls.snapshot()
    out_off = off(x)
    assert native_build.kernel_calls.since(before)["quant"] == 0
    assert torch.equal(out_off, reference_linear(x, off.weight, off.bias, "q8_0"))
    # int8 activations: within 2% of the largest output of the reference
    tol = 0.02 * float(out_off.abs().max())
    torch.testing.assert_close(out_on, out_off, rtol=tol, atol=tol)


@pytest.mark.parametrize(("var", "op"), [("FORWARDKIT_CPU_NATIVE_LINEAR", "cpu_linear"),
                                         ("FORWARDKIT_CPU_NATIVE_ATTENTION", "cpu_attention")])
def test_deprecated_variable_is_read_into_custom_ops(monkeypatch, fk_log_records, var, op):
    monkeypatch.setenv(var, "0")
    config = _config([])
    assert f"-{op}" in config.compilation_config.custom_ops
    said = [r.getMessage() for r in fk_log_records if var in r.getMessage()]
    assert said and f"'-{op}'" in said[0] and "deprecated" in said[0]
    # the list wins where it names the op; a true value changes nothing
    assert "-" + op not in _config([f"+{op}"]).compilation_config.custom_ops
    monkeypatch.setenv(var, "1")
    assert "-" + op not in _config([]).compilation_config.custom_ops
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ValueError, match=var):
        _config([])


@needs_linear_kernel
def test_deprecated_linear_variable_reaches_the_same_decision(monkeypatch):
    """``FORWARDKIT_CPU_NATIVE_LINEAR=0`` builds the layers ``"-cpu_linear"`` builds (F.linear,
    no kernel call); the variable never reaches the kernel, which still serves a direct call
    (so no cached state leaks into a later test or engine)."""
    monkeypatch.setenv("FORWARDKIT_CPU_NATIVE_LINEAR", "0")
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    layer = _dense_layer(_config([]))
    out, calls = _linear_calls(layer, x)
    assert layer.forward_form == "native" and calls == 0
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    native_linear.cache_clear()  # loaded again with the variable set
    before = native_build.kernel_calls.snapshot()
    assert native_linear.linear_rows(x, layer.weight, layer.bias) is not None
    assert native_build.kernel_calls.since(before)["linear"] == 1


def test_deprecated_attention_variable_reaches_the_same_decision(monkeypatch):
    """``FORWARDKIT_CPU_NATIVE_ATTENTION=0``: an engine decodes without one native attention
    call (the production counter), as with ``"-cpu_attention"``; without it, every decode step
    of every layer takes the kernel."""
    from forwardkit import LLM, SamplingParams
    from forwardkit.kernels.cpu import native_attention

    assert native_attention.available(F32)  # the generic build runs on every CPU with a compiler
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    served = {}
    for env in (None, "0"):
        if env is not None:
            monkeypatch.setenv("FORWARDKIT_CPU_NATIVE_ATTENTION", env)
        llm = LLM(enforce_eager=True, max_num_seqs=2)
        before = native_build.kernel_calls.snapshot()
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params, use_tqdm=False)
        served[env] = native_build.kernel_calls.since(before)["attention"]
        layers = [m for m in llm.runner.module.modules() if hasattr(m, "native_decode")]
        assert layers and all(m.native_decode == (env is None) for m in layers)
    assert served[None] > 0 and served["0"] == 0
