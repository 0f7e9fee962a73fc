"""forwardkit models vs Hugging Face transformers on tiny random fp32 checkpoints."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
RTOL = 1e-5


def _hf_logits(model_dir: str, sequences: list[list[int]],
               dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        return [model(torch.tensor([seq])).logits[0].float() for seq in sequences]


def _sequences(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> float:
    err = (ours - ref).abs().max().item()
    print(f"{name}: max abs error {err:.2e}")  # shown with -s; tolerances go in the report
    assert torch.allclose(ours, ref, atol=ATOL, rtol=RTOL), f"{name}: max abs error {err:.3g}"
    return err


def _prefill_then_decode(driver, sequences, prompt_lens, pad_to=None):
    """Batched prefill of the prompts, then batched one-token decode steps; logits per position."""
    out = {rid: [] for rid in range(len(sequences))}
    first = driver.step({rid: seq[: prompt_lens[rid]] for rid, seq in enumerate(sequences)}, pad_to=pad_to)
    for rid, logits in first.items():
        out[rid].append(logits)
    steps = max(len(s) - p for s, p in zip(sequences, prompt_lens))
    for i in range(steps):
        batch = {
            rid: [seq[prompt_lens[rid] + i]]
            for rid, seq in enumerate(sequences)
            if prompt_lens[rid] + i < len(seq)
        }
        res = driver.step(batch, pad_to=(len(batch) + 3) if pad_to else None)
        for rid, logits in res.items():
            out[rid].append(logits)
    return {rid: torch.cat(chunks) for rid, chunks in out.items()}


@pytest.mark.parametrize("fixture", ["llama_dir", "llama_variant_dir", "mixtral_dir", "qwen2_dir"])
def test_prefill_and_decode_match_transformers(fixture, request, load_fk):
    model_dir = request.getfixturevalue(fixture)
    driver = load_fk(model_dir, block_size=4)
    vocab = driver.model.config["vocab_size"]
    sequences = _sequences(vocab, [9, 17, 5, 12], seed=3)
    prompt_lens = [5, 13, 2, 12]  # the last one never decodes
    ref = _hf_logits(model_dir, sequences)
    ours = _prefill_then_decode(driver, sequences, prompt_lens, pad_to=64)
    for rid in range(len(sequences)):
        _check(f"{fixture} request {rid}", ours[rid], ref[rid])


@pytest.mark.parametrize("fixture", ["llama_dir", "mixtral_dir"])
def test_chunked_prefill_mixed_with_decode(fixture, request, load_fk):
    """A long prompt arrives in pieces while another request decodes in the same batches."""
    model_dir = request.getfixturevalue(fixture)
    driver = load_fk(model_dir, block_size=4)
    vocab = driver.model.config["vocab_size"]
    long_seq, short_seq = _sequences(vocab, [23, 10], seed=5)
    ref_long, ref_short = _hf_logits(model_dir, [long_seq, short_seq])
    got_long, got_short = [], []
    got_short.append(driver.step({1: short_seq[:6]})[1])
    pieces = [(0, 7), (7, 8), (8, 15), (15, 23)]  # includes a 1-token chunk (decode path)
    for i, (a, b) in enumerate(pieces):
        res = driver.step({0: long_seq[a:b], 1: [short_seq[6 + i]]}, pad_to=b - a + 5)
        got_long.append(res[0])
        got_short.append(res[1])
    _check(f"{fixture} chunked", torch.cat(got_long), ref_long)
    _check(f"{fixture} decode", torch.cat(got_short), ref_short)


def test_padding_rows_do_not_change_results(llama_dir, load_fk):
    vocab = 160
    seqs = _sequences(vocab, [7, 11], seed=9)
    a = load_fk(llama_dir).step({0: seqs[0], 1: seqs[1]})
    b = load_fk(llama_dir).step({0: seqs[0], 1: seqs[1]}, pad_to=40)
    for rid in a:
        assert torch.equal(a[rid], b[rid])


# bf16: both sides round every op's result to bf16 but run different kernels (oneDNN packed
# matmuls, the native few-row kernel, paged attention vs transformers' dense attention), so
# their logits differ by a few bf16 rounding steps that the layers compound. On the
# BF16_INIT_SCALE checkpoints (logits up to ~6, where one bf16 step is 0.03) the largest
# difference seen is 0.13, 2.4% of max |ref| (llama/qwen2/mixtral variants, 2 requests each).
# Stated tolerance: max |ours - ref| <= 0.05 * max |ref| + 0.01, about 2x the largest seen.
# What it can see: rotary switched off moves the logits by 3-8 (50-150% of max |ref|, over 10x
# the tolerance; test_bf16_parity_check_fails_with_rotary_off keeps that true). Finer defects
# are the fp32 tests' job (ATOL/RTOL above).
BF16_REL, BF16_ABS = 0.05, 0.01
BF16_FIXTURES = ["llama_variant_bf16_dir", "qwen2_bf16_dir"]


@pytest.fixture(autouse=True)
def _untimed_linear_paths(monkeypatch):
    """Every test here takes the fixed linear paths: with timing on, which kernel a small
    weight uses (and so the rounding) would depend on this machine's speed."""
    from forwardkit.kernels.cpu.router import CpuLinearRouter

    monkeypatch.setattr(CpuLinearRouter, "timing_default", False)


def _bf16_errors(model_dir, load_fk) -> list[tuple[float, float, torch.Tensor, torch.Tensor]]:
    """Per request: (max abs error, tolerance bound, our logits, transformers' bf16 logits)."""
    driver = load_fk(model_dir, block_size=4, dtype="bfloat16")
    assert next(driver.model.parameters()).dtype == torch.bfloat16
    from forwardkit.kernels.cpu import router

    if router.route_supported(torch.bfloat16):  # oneDNN bf16 or the native kernel (AVX2)
        qkv = driver.model.model.layers[0].self_attn.qkv_proj
        assert qkv.calls_linear_op and driver.router.is_routed(qkv.weight)  # the fast path is tested
    vocab = driver.model.config["vocab_size"]
    sequences = _sequences(vocab, [9, 14], seed=4)
    ref = _hf_logits(model_dir, sequences, dtype=torch.bfloat16)
    ours = _prefill_then_decode(driver, sequences, [5, 10])
    out = []
    for rid in range(len(sequences)):
        err = (ours[rid] - ref[rid].float()).abs().max().item()
        bound = BF16_REL * ref[rid].abs().max().item() + BF16_ABS
        out.append((err, bound, ours[rid], ref[rid].float()))
    return out


@pytest.mark.parametrize("fixture", BF16_FIXTURES)
def test_bf16_logits_within_tolerance_of_transformers_bf16(fixture, request, load_fk):
    from forwardkit.kernels.cpu import router

    model_dir = request.getfixturevalue(fixture)
    if router.prepack_supported(torch.bfloat16):  # the fast path is the one tested
        driver = load_fk(model_dir, block_size=4, dtype="bfloat16")
        assert driver.router.is_routed(driver.model.model.layers[0].self_attn.qkv_proj.weight)
    for rid, (err, bound, ours, ref) in enumerate(_bf16_errors(model_dir, load_fk)):
        print(f"{fixture} bf16 request {rid}: max abs error {err:.3g} (bound {bound:.3g})")
        assert err <= bound, f"{fixture} request {rid}: {err:.3g} > {bound:.3g}"
        # the greedy choice agrees wherever transformers' top-2 logits are not a near tie
        top2 = ref.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
        assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


def _rotary_off(monkeypatch):
    """Build models whose rotary embedding returns query and key unrotated."""
    from forwardkit.layers.rotary_embedding import RotaryEmbedding

    monkeypatch.setattr(RotaryEmbedding, "dispatch_forward",
                        lambda self: (lambda positions, query, key: (query, key)))


@pytest.mark.parametrize("fixture", BF16_FIXTURES)
def test_bf16_parity_check_fails_with_rotary_off(fixture, request, load_fk, monkeypatch):
    """Control: the bf16 tolerance is tight enough to see a model without rotary (on the
    default 0.02-scale checkpoints that model passed it)."""
    model_dir = request.getfixturevalue(fixture)
    _rotary_off(monkeypatch)
    for rid, (err, bound, _, _) in enumerate(_bf16_errors(model_dir, load_fk)):
        assert err > 5 * bound, f"{fixture} request {rid}: rotary off gives {err:.3g}, bound {bound:.3g}"


def test_fp32_parity_check_fails_with_rotary_off(llama_dir, load_fk, monkeypatch):
    """Control for the fp32 tolerance on the default-scale checkpoints."""
    _rotary_off(monkeypatch)
    driver = load_fk(llama_dir, block_size=4)
    sequences = _sequences(160, [9, 14], seed=4)
    ref = _hf_logits(llama_dir, sequences)
    ours = _prefill_then_decode(driver, sequences, [5, 10])
    for rid in range(len(sequences)):
        assert not torch.allclose(ours[rid], ref[rid], atol=ATOL, rtol=RTOL)
