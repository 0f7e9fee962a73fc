"""Lazily zeroed CPU buffers, huge pages asked for before the weights are written, and the
deferred huge-page move of what was written earlier."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from forwardkit.kernels.cpu import hugepages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux")


@pytest.mark.parametrize("numel", [100, (1 << 20) + 3, (5 << 20) + 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_zero_leaves_only_zeros_including_partial_end_pages(numel, dtype):
    stale = torch.full((numel + 4096,), 7, dtype=dtype)  # memory a new buffer may reuse
    del stale
    t = torch.empty(numel, dtype=dtype)
    t.fill_(3)
    assert hugepages.zero_(t) is t
    assert int(torch.count_nonzero(t)) == 0


def test_zero_of_an_offset_view_keeps_the_bytes_around_it():
    base = torch.full(((3 << 20) + 10,), 5.0)
    view = base[7:-3]  # not page-aligned at either end
    hugepages.zero_(view)
    assert int(torch.count_nonzero(view)) == 0
    assert torch.equal(base[:7], torch.full((7,), 5.0))
    assert torch.equal(base[-3:], torch.full((3,), 5.0))


def test_zero_falls_back_for_strided_and_meta_tensors():
    t = torch.full((2048, 1024), 2.0).t()  # not contiguous
    assert int(torch.count_nonzero(hugepages.zero_(t))) == 0
    hugepages.zero_(torch.empty(1 << 20, device="meta"))  # no error, nothing to touch


@linux
def test_deferred_collapse_waits_for_the_start_and_skips_freed_tensors():
    queue = hugepages.DeferredCollapse()
    kept = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(2)]  # 4 MiB each
    dropped = torch.nn.Parameter(torch.randn(1 << 20))
    expected = [p.detach().clone() for p in kept]
    queue.defer([*kept, dropped])
    assert queue.pending_bytes() == 3 * (4 << 20)
    del dropped
    gc.collect()
    assert queue.pending_bytes() == 2 * (4 << 20)  # the queue holds no reference
    thread = queue.start()
    assert queue.pending_bytes() == 0
    if thread is not None:
        thread.join(timeout=60)
        assert not thread.is_alive()
    for p, e in zip(kept, expected):
        assert torch.equal(p.detach(), e)
    assert queue.start() is None  # nothing left


def test_the_loader_asks_for_huge_pages_before_it_writes_the_weights(monkeypatch):
    """Memory asked for (``madvise``) before its first write faults in on huge pages as it is
    written; asked for afterwards it stays on 4 KiB pages until a move. The loader asks for
    every weight between building the model and writing its values."""
    from forwardkit import LLM
    from forwardkit.models import loader

    advised: list[int] = []
    at_write: list[set[int]] = []
    monkeypatch.setattr(loader.hugepages, "advise",
                        lambda t: advised.append(t.untyped_storage().data_ptr()) or 0)
    fill = loader.init_random_weights

    def init(model: torch.nn.Module, *args: object, **kwargs: object) -> None:
        at_write.append({p.untyped_storage().data_ptr() for p in model.parameters()})
        fill(model, *args, **kwargs)

    monkeypatch.setattr(loader, "init_random_weights", init)
    llm = LLM(enforce_eager=True)
    if llm.runner.device.type != "cpu":
        pytest.skip("huge pages are asked for CPU weights")
    assert len(at_write) == 1 and at_write[0] and at_write[0] <= set(advised)


def test_a_plain_pytorch_model_is_not_advised(monkeypatch):
    """``-cpu_linear`` (the benchmark's plain PyTorch baselines): weights as PyTorch gives them."""
    from forwardkit import LLM
    from forwardkit.models import loader

    advised: list[torch.Tensor] = []
    monkeypatch.setattr(loader.hugepages, "advise", lambda t: advised.append(t) or 0)
    LLM(enforce_eager=True, compilation_config={"custom_ops": ["-cpu_linear"]})
    assert advised == []


@pytest.mark.parametrize("fast,custom_ops", [(True, ["-cpu_linear"]), (False, [])])
def test_advice_and_router_follow_one_decision(monkeypatch, fast, custom_ops):
    """The loader decides once (``_cpu_fast_paths``, from the modules before any write) whether
    the CPU kernels serve a model: its weights are then advised and it gets a router, or
    neither. Forced against what the model would have, both follow."""
    from forwardkit import LLM
    from forwardkit.models import loader

    advised: list[torch.Tensor] = []
    monkeypatch.setattr(loader.hugepages, "advise", lambda t: advised.append(t) or 0)
    monkeypatch.setattr(loader, "_cpu_fast_paths", lambda model: fast)
    llm = LLM(enforce_eager=True, compilation_config={"custom_ops": custom_ops})
    if llm.runner.device.type != "cpu":
        pytest.skip("the CPU fast paths")
    assert bool(advised) is fast
    assert (llm.runner.cpu_linear_router is not None) is fast


_HUGE_AFTER_LOAD = """
import sys
import torch
from forwardkit import LLM
from forwardkit.kernels.cpu import hugepages

llm = LLM(sys.argv[1], enforce_eager=True, dtype="float32")
assert llm.runner.cpu_linear_router.huge_pages.pending_bytes() > 0  # no step has run: no move
weight = llm.runner.module.model.layers[0].mlp.gate_up_proj.weight  # 8192 x 512 float32: 16 MiB
start = weight.untyped_storage().data_ptr()
interior = -(-start // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE
inside = False
for line in open("/proc/self/smaps", encoding="ascii"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        lo, hi = (int(v, 16) for v in head.split("-"))
        inside = lo <= interior < hi
    elif inside and head == "AnonHugePages:":
        print("huge", int(line.split()[1]) * 1024)
        break
"""


def test_quantized_blocks_are_advised_before_they_are_written(monkeypatch):
    """Quantizing on load asks for huge pages for the packed blocks it allocates, before it
    fills them (best effort: memory the allocator hands back from a freed staging weight is
    already on 4 KiB pages, and the move after the first step takes it)."""
    from forwardkit.quantization import formats

    advised: list[int] = []
    monkeypatch.setattr(formats.hugepages, "advise",
                        lambda t: advised.append(t.untyped_storage().data_ptr()) or 0)
    packed = formats.quantize(torch.randn(64, 96), "q8_0")
    assert advised == [packed.untyped_storage().data_ptr()]


@linux
def test_loaded_weights_sit_on_huge_pages_before_the_first_step(tmp_path):
    """Where the system gives huge pages to memory that asks (``madvise`` or ``always``), a
    weight several huge pages long is on them as soon as the model is loaded, before any step
    (with ``never``, on none). In a fresh process: memory this one has had moved before may
    be handed out again already huge. (Quantized on load, the packed blocks are advised too,
    but may land in a freed staging weight's pages: not checked here.)"""
    import subprocess

    transformers = pytest.importorskip("transformers")
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            mode = f.read()
    except OSError:
        mode = "[never]"
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=512, intermediate_size=4096,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
    run = subprocess.run([sys.executable, "-c", _HUGE_AFTER_LOAD, str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    huge = int(run.stdout.split("huge")[-1])
    if "[never]" in mode:
        assert huge == 0
    else:
        assert huge >= hugepages.HUGE_PAGE


def test_runner_starts_the_move_after_its_first_step_not_during_start_up():
    from forwardkit import LLM, SamplingParams

    llm = LLM(enforce_eager=True)  # the built-in model, loaded with the CPU fast paths
    if llm.runner.device.type != "cpu":
        pytest.skip("the deferred move is for CPU weights")
    router = llm.runner.cpu_linear_router
    assert router is not None  # made by the loader, held by the runner
    queued = router.huge_pages.pending_bytes()
    assert queued == sum(p.untyped_storage().nbytes() for p in llm.runner.module.parameters()) > 0
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=1),
                 use_tqdm=False)
    assert router.huge_pages.pending_bytes() == 0


def test_a_quantized_model_queues_its_packed_weights(tmp_path):
    """A quantized model's layers call no ``forwardkit::linear``; its packed weights are
    streamed every step all the same, so they are queued too."""
    transformers = pytest.importorskip("transformers")
    from forwardkit import LLM, SamplingParams

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), enforce_eager=True, quantization="q8_0")
    router = llm.runner.cpu_linear_router
    assert router is not None
    params = list(llm.runner.module.parameters())
    assert any(p.dtype == torch.uint8 for p in params)  # the packed blocks
    assert router.huge_pages.pending_bytes() == sum(p.untyped_storage().nbytes() for p in params)
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=1),
                 use_tqdm=False)
    assert router.huge_pages.pending_bytes() == 0


def test_wait_for_moves_returns_when_the_moves_are_done(monkeypatch):
    """What the benchmarks call before timing: it waits for a running move and reports whether
    one is still running after the timeout."""
    import threading

    gate = threading.Event()
    worker = threading.Thread(target=gate.wait, daemon=True)
    monkeypatch.setattr(hugepages, "_workers", [worker])
    worker.start()
    assert hugepages.wait_for_moves(timeout=0.05) is False  # still running
    gate.set()
    assert hugepages.wait_for_moves(timeout=5) is True and hugepages._workers == []


def test_a_plain_pytorch_model_queues_nothing():
    """``-cpu_linear`` (the benchmark's baselines): no layer calls the op, the loader makes no
    router, and no weight is queued for huge pages."""
    from forwardkit import LLM

    llm = LLM(enforce_eager=True, compilation_config={"custom_ops": ["-cpu_linear"]})
    assert llm.runner.cpu_linear_router is None


def test_kv_cache_starts_zeroed():
    from forwardkit import LLM

    llm = LLM(enforce_eager=True)
    for cache in llm.runner.kv_caches.values():
        assert int(torch.count_nonzero(cache)) == 0
