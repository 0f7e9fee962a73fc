"""The native paged decode attention (``kernels/cpu/native_attention.py``) against the torch
path and a float64 reference, how the ``cpu_attention`` custom op switches it, and how it is
built and what happens without a compiler."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from forwardkit.compilation import kernel_cache
from forwardkit.compilation.counters import compilation_counter
from forwardkit.forward_context import set_forward_context
from forwardkit.kernels.cpu import native_attention, native_build
from forwardkit.layers import attention_backend
from forwardkit.layers.attention import Attention, build_attention_metadata
from forwardkit.layers.attention_backend import paged_attention
from forwardkit.layers.kv_cache import bind_kv_cache

BF16 = torch.bfloat16
DTYPES = [torch.float32, BF16]
ISAS = ["avx512", "avx2", "generic"]
BS = 16
LENGTHS = [1, BS - 1, BS, BS + 1, 5 * BS + 3, 300]  # one block, its edges, across score chunks


def _require(isa: str) -> None:
    if not native_attention.isa_supported(isa):
        pytest.skip(f"the CPU lacks the instructions of the {isa} build")


@pytest.fixture
def fresh_kernel(monkeypatch):
    """The kernel loader re-run under this test's environment, and again after it."""
    native_attention.cache_clear()
    yield monkeypatch
    native_attention.cache_clear()


def _paged_step(gen: torch.Generator, lengths: list[int], hq: int, hk: int, d: int,
                dtype: torch.dtype, pad: int = 3, bs: int = BS):
    """A random paged cache (blocks of ``bs`` tokens) with shuffled block ids, one decode request
    per length at shuffled token rows among ``pad`` padding rows, and the step's K/V at slots
    (-1 for padding rows)."""
    widths = [-(-s // bs) for s in lengths]
    num_blocks = sum(widths) + 5
    kv_cache = torch.randn(2, num_blocks + 1, bs, hk, d, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(widths)
    table = torch.zeros(len(lengths), width, dtype=torch.int64)
    for i, w in enumerate(widths):
        table[i, :w] = torch.tensor([free.pop() for _ in range(w)])
    t = len(lengths) + pad
    rows = torch.randperm(t, generator=gen)[: len(lengths)].clone()  # not in order
    slots = torch.full((t,), -1, dtype=torch.int64)
    for i, s in enumerate(lengths):
        slots[rows[i]] = table[i, (s - 1) // bs] * bs + (s - 1) % bs
    # the query as the model gives it: a slice of the fused qkv projection (row stride > Hq * D)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return (q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d), kv_cache, rows, table,
            torch.tensor(lengths, dtype=torch.int64), slots)


def _assert_matches_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:  # float32 arithmetic, one rounding to bf16 (half an ulp: 2^-9 relative)
        err = (out.double() - ref).abs()
        assert (err <= ref.abs() * 2.0**-8 + 1e-6).all(), err.max()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_size", [32, 64, 128])
def test_matches_a_float64_reference(isa, dtype, group, head_size):
    _require(isa)
    gen = torch.Generator().manual_seed(group * 1000 + head_size)
    hk = 2
    q, k, v, kv_cache, rows, table, seq_lens, slots = _paged_step(
        gen, LENGTHS, hk * group, hk, head_size, dtype)
    out = torch.full_like(q, 7.0).contiguous()
    index = native_attention.decode_index(rows, table, seq_lens, slots)
    assert native_attention.paged_decode(q, k, v, kv_cache, index, head_size**-0.5, out, isa=isa)
    flat = kv_cache.view(2, -1, hk, head_size)
    for r in range(q.shape[0]):  # the step's K/V were stored (padding rows: in the scratch block)
        if r in rows.tolist():
            assert torch.equal(flat[0, slots[r]], k[r]) and torch.equal(flat[1, slots[r]], v[r])
    ref = native_attention.reference_decode(q, kv_cache[0], kv_cache[1], rows, table, seq_lens,
                                            head_size**-0.5)
    _assert_matches_reference(out[rows], ref, dtype)
    others = [r for r in range(q.shape[0]) if r not in rows.tolist()]
    assert (out[others] == 7.0).all()  # padding rows untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("bs", [8, 24, 32])
def test_other_block_sizes_match_the_reference(dtype, bs):
    """Blocks of other sizes than the kernel's 16-key score chunks: float32 keys are read in
    place where a chunk lies in one block (32) and gathered where it crosses blocks (8, 24)."""
    if not native_attention.available(dtype):
        pytest.fail(f"native decode attention unavailable for {dtype} (no compiler?)")
    gen = torch.Generator().manual_seed(bs)
    hk, d = 2, 64
    lengths = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 200]
    q, k, v, kv_cache, rows, table, seq_lens, slots = _paged_step(gen, lengths, 2 * hk, hk, d,
                                                                   dtype, bs=bs)
    out = torch.full_like(q, 7.0).contiguous()
    index = native_attention.decode_index(rows, table, seq_lens, slots)
    assert native_attention.paged_decode(q, k, v, kv_cache, index, d**-0.5, out)
    ref = native_attention.reference_decode(q, kv_cache[0], kv_cache[1], rows, table, seq_lens,
                                            d**-0.5)
    _assert_matches_reference(out[rows], ref, dtype)


def _mixed_metadata(gen: torch.Generator, hq: int, hk: int, d: int, dtype: torch.dtype):
    """A step of decodes of every length in LENGTHS between a fresh prefill and a chunked one,
    plus padding rows, over shuffled blocks; the cache and the step's q/k/v."""
    q_lens = [1, 1, 9, 1, 1, 5, 1, 1]
    seq_lens = [LENGTHS[0], LENGTHS[1], 9, LENGTHS[2], LENGTHS[3], 40, LENGTHS[4], LENGTHS[5]]
    widths = [-(-s // BS) for s in seq_lens]
    num_blocks = sum(widths) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(w)] for w in widths]
    t = sum(q_lens) + 4
    md = build_attention_metadata(q_lens, seq_lens, tables, t, BS, "cpu")
    kv_cache = torch.randn(2, num_blocks + 1, BS, hk, d, generator=gen).to(dtype)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return md, kv_cache, q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize(("hq", "hk", "d"), [(4, 4, 32), (8, 4, 64), (16, 4, 128)])
def test_equals_the_torch_path_in_a_mixed_step(dtype, hq, hk, d):
    """``paged_attention`` with the native decode against the torch ops on the same step:
    decode rows within float32 (bf16) rounding, prefill rows and the cache identical."""
    if not native_attention.available(dtype):
        pytest.fail(f"native decode attention unavailable for {dtype} (no compiler?)")
    gen = torch.Generator().manual_seed(hq + d)
    md, kv_cache, q, k, v = _mixed_metadata(gen, hq, hk, d, dtype)
    cache_torch, cache_native = kv_cache.clone(), kv_cache.clone()
    out_torch, out_native = torch.empty_like(q), torch.full_like(q, 7.0)
    paged_attention(q, k, v, cache_torch, md, d**-0.5, out_torch)
    before = native_build.kernel_calls.snapshot()
    paged_attention(q, k, v, cache_native, md, d**-0.5, out_native, native_decode=True)
    assert native_build.kernel_calls.since(before)["attention"] == 1  # the kernel served the step
    assert torch.equal(cache_native, cache_torch)
    decode = md.decode_token_idx
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # SDPA rounds its weights to bf16
    torch.testing.assert_close(out_native[decode].float(), out_torch[decode].float(),
                               rtol=tol, atol=tol)
    prefill = [r for c in md.prefill_chunks for r in range(c.start, c.end)]
    assert torch.equal(out_native[prefill], out_torch[prefill])
    assert (out_native[md.num_actual_tokens:] == 0).all()


def test_declines_what_it_does_not_cover():
    gen = torch.Generator().manual_seed(2)
    q, k, v, kv_cache, rows, table, seq_lens, slots = _paged_step(gen, [5, 20], 4, 2, 32,
                                                                  torch.float32)
    index = native_attention.decode_index(rows, table, seq_lens, slots)
    out = torch.zeros_like(q).contiguous()
    decline = [
        (q.to(BF16), k, v, kv_cache, out),  # mixed dtypes
        (q, k, v, kv_cache.to(BF16), out),
        (q, k, v, kv_cache, out.to(BF16)),
        (q.to(torch.float16), k, v, kv_cache, out),  # not bf16 / float32
        (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, kv_cache, out),  # heads strided
        (q, k, v, kv_cache.transpose(2, 3).contiguous().transpose(2, 3), out),  # cache layout
        (q, None, v, kv_cache, out),  # a slot mapping but no keys
    ]
    for args in decline:
        before = kv_cache.clone()
        assert not native_attention.paged_decode(args[0], args[1], args[2], args[3], index, 0.2,
                                                 args[4])
        assert torch.equal(kv_cache, before) and (out == 0).all()
    assert native_attention.decode_index(rows.int(), table, seq_lens) is None  # not int64
    assert native_attention.decode_index(rows, table[:, :1].t(), seq_lens) is None


@pytest.mark.parametrize("what", ["block", "slot", "row", "length"])
def test_an_index_out_of_range_touches_nothing(what):
    gen = torch.Generator().manual_seed(3)
    q, k, v, kv_cache, rows, table, seq_lens, slots = _paged_step(gen, [5, 20], 4, 2, 32,
                                                                  torch.float32)
    if what == "block":
        table[1, 1] = kv_cache.shape[1]
    elif what == "slot":
        slots[0] = kv_cache.shape[1] * BS
    elif what == "row":
        rows[0] = q.shape[0]
    else:
        seq_lens[0] = table.shape[1] * BS + 1
    before, out = kv_cache.clone(), torch.zeros_like(q).contiguous()
    index = native_attention.decode_index(rows, table, seq_lens, slots)
    assert not native_attention.paged_decode(q, k, v, kv_cache, index, 0.2, out)
    assert torch.equal(kv_cache, before) and (out == 0).all()


def _counting(monkeypatch) -> list[bool]:
    """Patch ``paged_decode`` (as the backend calls it) to record each call's result."""
    calls: list[bool] = []
    real = native_attention.paged_decode

    def counting(*args, **kwargs):
        served = real(*args, **kwargs)
        calls.append(served)
        return served

    monkeypatch.setattr(native_attention, "paged_decode", counting)
    return calls


@pytest.mark.parametrize(("custom_ops", "native"), [([], True), (["none"], True),
                                                    (["-cpu_attention"], False),
                                                    (["all", "-cpu_attention"], False)])
def test_custom_op_switches_the_layer(monkeypatch, custom_ops, native):
    """``cpu_attention`` is on unless ``"-cpu_attention"`` (also under "none"); the layer
    decides at construction, and only then does its decode step call the kernel."""
    from forwardkit.config.compilation import CompilationConfig
    from forwardkit.config.engine import EngineConfig, set_current_engine_config

    config = EngineConfig(compilation_config=CompilationConfig(custom_ops=custom_ops))
    with set_current_engine_config(config):
        layer = Attention(4, 32, 32**-0.5, 2, prefix="sw.attn")
        cache = bind_kv_cache(config.compilation_config.static_forward_context, 8, BS,
                              torch.float32, "cpu")["sw.attn"]
    cc = config.compilation_config
    assert layer.native_decode is native and cc.is_custom_op_enabled("cpu_attention") is native
    assert (cc.enabled_custom_ops if native else cc.disabled_custom_ops)["cpu_attention"] == 1
    calls = _counting(monkeypatch)
    md = build_attention_metadata([1, 1], [3, 20], [[2], [4, 1]], 3, BS, "cpu")
    gen = torch.Generator().manual_seed(0)
    cache.normal_(generator=gen)
    q, k = torch.randn(3, 128, generator=gen), torch.randn(3, 64, generator=gen)
    with set_forward_context({"sw.attn": md}, config):
        layer(q, k, k)
    assert calls == ([True] if native else [])


def test_switch_is_part_of_the_compile_hash():
    """The layer's choice follows ``custom_ops``, a factor of the compilation config's hash, so
    a compiled artifact and its cache entry always agree on it."""
    from forwardkit.config.engine import EngineConfig

    def hashed(custom_ops: list[str]) -> str:
        return EngineConfig(compilation_config={"mode": 3, "custom_ops": custom_ops}
                            ).compilation_config.compute_hash()

    assert hashed([]) != hashed(["-cpu_attention"]) and hashed([]) == hashed([])


def test_cuda_layers_never_take_it(cuda_platform):
    from forwardkit.config.engine import EngineConfig, set_current_engine_config

    config = EngineConfig()
    with set_current_engine_config(config):
        layer = Attention(4, 32, 0.2, 2, prefix="gpu.attn")
    assert layer.is_enabled and not layer.native_decode  # counted on, but a CPU kernel


def test_engine_decodes_the_same_tokens_through_it(monkeypatch):
    """The built-in model (float32) decodes the same greedy tokens with the kernel as with the
    torch ops, and one kernel call serves each layer's decode step."""
    from forwardkit import LLM, SamplingParams

    calls = _counting(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], list(range(7, 40)), [9]]
    tokens = {}
    for ops in ([], ["-cpu_attention"]):
        calls.clear()
        llm = LLM(enforce_eager=True, compilation_config={"custom_ops": ops}, max_num_seqs=4)
        before = native_build.kernel_calls.snapshot()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        served = native_build.kernel_calls.since(before)["attention"]
        tokens[bool(ops)] = [o.outputs[0].token_ids for o in outs]
        layers = llm.runner.model_config.hf_config["num_hidden_layers"]
        if ops:
            assert calls == [] and served == 0
        else:  # every decode step: one call per layer (the first step is all prompts)
            assert calls and all(calls) and len(calls) % layers == 0
            assert served == len(calls)  # the production counter saw each served call
    assert tokens[False] == tokens[True]


def test_missing_compiler_serves_the_torch_path(fresh_kernel, tmp_path, fk_log_records):
    """Without a compiler (and no verified build cached) the kernel is off with one log line
    and the step gives the torch path's result."""
    fresh_kernel.setenv("FORWARDKIT_CACHE_ROOT", str(tmp_path))  # nothing built there yet
    fresh_kernel.setenv("CC", "no-such-compiler-xyz")
    for dtype in DTYPES:
        assert not native_attention.available(dtype)
    said = [r.getMessage() for r in fk_log_records if r.name == native_attention.__name__]
    assert len(said) == 1 and "no C compiler 'no-such-compiler-xyz'" in said[0], said
    assert not list((tmp_path / "native").glob("*.so"))
    gen = torch.Generator().manual_seed(5)
    md, kv_cache, q, k, v = _mixed_metadata(gen, 8, 4, 32, torch.float32)
    cache_a, cache_b = kv_cache.clone(), kv_cache.clone()
    out_a, out_b = torch.empty_like(q), torch.empty_like(q)
    paged_attention(q, k, v, cache_a, md, 0.2, out_a, native_decode=True)
    paged_attention(q, k, v, cache_b, md, 0.2, out_b)
    assert torch.equal(out_a, out_b) and torch.equal(cache_a, cache_b)


def _entry(data: bytes) -> list:
    return [hashlib.sha256(data).hexdigest(), len(data)]


def test_build_is_verified_and_a_tampered_one_rebuilt(fresh_kernel, tmp_path):
    fresh_kernel.setenv("FORWARDKIT_CACHE_ROOT", str(tmp_path))
    assert native_attention.available(torch.float32)
    isa = native_attention.kernel_isa(torch.float32)
    native = tmp_path / "native"
    (so,) = native.glob("decode_attention-*.so")
    manifest = json.loads((native / kernel_cache.MANIFEST).read_text())
    assert manifest[so.name] == _entry(so.read_bytes())
    assert so.name == native_attention.KERNEL.library_name(isa)
    good = so.read_bytes()
    tmp = so.with_name(".test-" + so.name)  # a new file: this process has the old one mapped
    tmp.write_bytes(good[: len(good) // 2])
    tmp.replace(so)
    native_attention.cache_clear()
    errors = compilation_counter.num_cache_errors
    assert native_attention.available(torch.float32)  # rebuilt, then loaded
    assert so.read_bytes() != good[: len(good) // 2]
    assert compilation_counter.num_cache_errors == errors + 1


def test_library_name_covers_the_included_header(tmp_path):
    """decode_attention.c includes fk_bf16.h: the build's name hashes both files."""
    src = tmp_path / "csrc"
    shutil.copytree(native_attention.KERNEL.source.parent, src)
    source = src / native_attention.KERNEL.source.name
    assert [p.name for p in native_build.build_inputs(source)] == ["decode_attention.c",
                                                                    "fk_bf16.h"]
    before = native_build.library_name(source, ["-O3"])
    (src / "fk_bf16.h").write_text((src / "fk_bf16.h").read_text() + "\n/* changed */\n")
    assert native_build.library_name(source, ["-O3"]) != before


def test_backend_reads_the_layer_decision(monkeypatch):
    """The backend passes the layer's ``native_decode`` on; a layer spec without it (another
    backend's layer) takes the torch path."""
    seen = []

    class Spec:
        layer_name, num_heads, num_kv_heads, head_size, scale = "x", 4, 2, 32, 0.2

    monkeypatch.setattr(attention_backend, "paged_attention", lambda *args: seen.append(args[-1]))
    gen = torch.Generator().manual_seed(6)
    md, kv_cache, q, k, v = _mixed_metadata(gen, 4, 2, 32, torch.float32)
    backend = attention_backend.TorchNativeAttentionBackend
    backend.forward(Spec(), q, k, v, kv_cache, md, torch.empty_like(q))
    spec = Spec()
    spec.native_decode = True  # type: ignore[attr-defined]
    backend.forward(spec, q, k, v, kv_cache, md, torch.empty_like(q))
    assert seen == [False, True]
