"""llama.cpp as a contender of ``forwardkit bench --generation`` (when ``llama_cpp`` is installed).

The contender runs forwardkit's own weights: they are written to a GGUF file
(:mod:`forwardkit.bench.gguf_export`) and llama.cpp loads it through its C API
(``llama_cpp``'s ctypes bindings). Generation is greedy over equal-length token-id prompts,
one llama.cpp sequence per prompt in one batch (prefill of every prompt in one decode call,
then one decode call per step with one token per sequence), with the same thread count as
forwardkit. The next token is the argmax of each sequence's logits, as forwardkit's greedy
sampler takes it.

llama.cpp is not a dependency: ``pip install llama-cpp-python`` builds it from source (about
6 minutes on 2 cores; ``CMAKE_ARGS="-DGGML_NATIVE=ON"`` for this CPU's instructions).

llama.cpp's CPU backend moves quantized weights into "extra buffer types" at load (AMX tiles,
or rows repacked for its AVX2 / AVX-512 kernels). Its AMX path crashes the whole process with
a segmentation fault on some AMX Xeons (a ``GGML_NATIVE`` build there). Before the first load
of a GGUF in a process, a child process loads it and runs a 32-token prompt with those buffers;
if the child dies by a signal (or hangs), llama.cpp runs here without them, and a logged
warning says so (a build without AMX keeps its repacked rows: ``-DGGML_NATIVE=OFF`` with
``GGML_AVX512`` and its siblings on and ``GGML_AMX_TILE`` / ``GGML_AMX_INT8`` off).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import torch

from forwardkit.logger import init_logger

logger = init_logger(__name__)

__all__ = ["LlamaCppGenerator", "llamacpp_available", "llamacpp_missing_note"]


def llamacpp_available() -> bool:
    """Whether llama.cpp's Python binding and the ``gguf`` writer are importable."""
    from forwardkit.bench.gguf_export import gguf_available

    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):  # OSError: the shared library failed to load
        return False
    return gguf_available()


def llamacpp_missing_note() -> str:
    """Why the llama.cpp contender is left out, and how to add it."""
    return ("llama.cpp contender skipped: its Python binding is not installed "
            "(CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install llama-cpp-python gguf; a source build, "
            "about 6 minutes on 2 cores)")


# Run in a child: load argv[1] with llama.cpp's extra buffer types on (the default) and run
# one 32-token prompt through it. Exit status 0 when it survives.
_PROBE = """
import sys
import llama_cpp as lc
lc.llama_backend_init()
model = lc.llama_model_load_from_file(sys.argv[1].encode(), lc.llama_model_default_params())
if not model:
    sys.exit(3)
cparams = lc.llama_context_default_params()
cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 64
cparams.n_threads = cparams.n_threads_batch = int(sys.argv[2])
ctx = lc.llama_init_from_model(model, cparams)
if not ctx:
    sys.exit(4)
n = min(32, lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model)))
batch = lc.llama_batch_init(64, 0, 1)
for i in range(32):
    batch.token[i], batch.pos[i], batch.n_seq_id[i] = i % n, i, 1
    batch.seq_id[i][0], batch.logits[i] = 0, 1
batch.n_tokens = 32
sys.exit(0 if lc.llama_decode(ctx, batch) == 0 else 5)
"""
PROBE_TIMEOUT_S = 600.0
_UNBLOCKED_TYPES = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")
"""ggml types of one value a weight: llama.cpp's extra buffer types (AMX tiles, repacked rows)
take none of them, only block-quantized ones."""


def holds_block_quantized(path: str) -> bool:
    """Whether the GGUF at ``path`` has a block-quantized tensor (Q8_0, Q4_0, Q4_K, ...): only
    those reach llama.cpp's extra buffer types, so only such a file needs the crash probe."""
    from forwardkit.config.gguf import open_gguf
    from forwardkit.quantization.gguf_types import TYPE_NAMES

    return any(TYPE_NAMES.get(t.type_id) not in _UNBLOCKED_TYPES for t in open_gguf(path).tensors)


@functools.cache
def extra_buffers_crash(path: str, threads: int, script: str = _PROBE) -> str | None:
    """Why llama.cpp's extra buffer types cannot run the GGUF at ``path`` here (the child
    process that tried died by a signal, or hung), or None when they ran it. One child per
    file and thread count in a process; ``script`` is the child's code (tests replace it)."""
    try:
        done = subprocess.run([sys.executable, "-c", script, path, str(threads)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return (f"a child process running it with them had not finished a 32-token prompt "
                f"after {PROBE_TIMEOUT_S:.0f} s")
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        return f"a child process running it with them died by {name}"
    return None  # survived (a load or decode error shows again, clearly, in this process)


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet(level: int, text: bytes, user_data: object) -> None:
    """llama.cpp's log callback: errors only (level 4 = GGML_LOG_LEVEL_ERROR)."""
    if level == 4 and text:
        os.write(2, text)


class LlamaCppGenerator:
    """Greedy batched generation with llama.cpp over a GGUF of ``state`` (Hugging Face names).

    ``max_seqs`` sequences of at most ``max_len`` tokens each; ``threads`` for decode and
    prefill; ``formats`` names the packed block-quantized weights of ``state`` (written as
    they are, see :func:`~forwardkit.bench.gguf_export.write_llama_gguf`). The GGUF lives in
    a temporary directory removed by :meth:`close`; :meth:`from_gguf` runs an existing file."""

    def __init__(self, hf_config: Mapping[str, Any], state: Mapping[str, torch.Tensor], *,
                 max_seqs: int, max_len: int, threads: int,
                 formats: Mapping[str, str] | None = None) -> None:
        from forwardkit.bench.gguf_export import write_llama_gguf

        tied = bool(hf_config.get("tie_word_embeddings", False))
        self.weight_bytes = sum(t.numel() * t.element_size() for name, t in state.items()
                                if not (tied and name == "lm_head.weight"))
        self._dir: tempfile.TemporaryDirectory[str] | None = tempfile.TemporaryDirectory(
            prefix="forwardkit-gguf-")
        path = write_llama_gguf(os.path.join(self._dir.name, "model.gguf"), hf_config, state,
                                formats)
        self._open(path, max_seqs=max_seqs, max_len=max_len, threads=threads)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], *, max_seqs: int, max_len: int,
                  threads: int, kv_f32: bool = False) -> LlamaCppGenerator:
        """A generator over an existing GGUF file (kept: :meth:`close` does not remove it);
        ``kv_f32`` keeps llama.cpp's KV cache in float32 (its default is float16)."""
        self = cls.__new__(cls)
        self._dir = None
        self.weight_bytes = os.path.getsize(path)
        self._open(os.fspath(path), max_seqs=max_seqs, max_len=max_len, threads=threads,
                   kv_f32=kv_f32)
        return self

    def _open(self, path: str, *, max_seqs: int, max_len: int, threads: int,
              kv_f32: bool = False) -> None:
        import llama_cpp as lc

        self._lc = lc
        lc.llama_log_set(_quiet, ctypes.c_void_p())
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        # resident like forwardkit's weights, no page faults mid-run (``load_mode`` replaced
        # ``use_mmap`` in newer bindings; 0 = LLAMA_LOAD_MODE_NONE, read into memory)
        fields = {name for name, *_ in type(mparams)._fields_}
        if "use_mmap" in fields:
            mparams.use_mmap = False
        elif "load_mode" in fields:
            mparams.load_mode = 0
        self.extra_buffers_off: str | None = None  # why llama.cpp runs without them, if it does
        # seconds spent in the probe's child: forwardkit's cost, not llama.cpp's start-up
        self.probe_seconds = 0.0
        if ("use_extra_bufts" in fields and mparams.use_extra_bufts
                and holds_block_quantized(path)):
            start = time.perf_counter()
            crash = extra_buffers_crash(os.path.abspath(path), threads)
            self.probe_seconds = time.perf_counter() - start
            if crash is not None:
                mparams.use_extra_bufts = False
                self.extra_buffers_off = crash
                logger.warning("llama.cpp runs without its extra buffer types (AMX tiles, "
                               "repacked rows): %s. A llama.cpp build without AMX keeps its "
                               "repacked rows.", crash)
        self._model = lc.llama_model_load_from_file(path.encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load the GGUF at {path}")
        self.vocab_size = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model)))
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = max_seqs * max_len
        cparams.n_batch = cparams.n_ubatch = max(512, max_seqs * max_len)
        cparams.n_seq_max = max_seqs
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        if kv_f32:
            cparams.type_k = cparams.type_v = lc.GGML_TYPE_F32
        self._ctx = lc.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create a context "
                               f"(n_ctx={max_seqs * max_len}, n_seq_max={max_seqs})")
        self._batch = lc.llama_batch_init(cparams.n_batch, 0, max_seqs)
        self._capacity = int(cparams.n_batch)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits); returns the argmax
        token of every entry that wanted logits, in order."""
        return [int(row.argmax()) for row in self.logits(entries)]

    def logits(self, entries: list[tuple[int, int, int, bool]]) -> torch.Tensor:
        """One llama_decode of (token, position, sequence, wants logits); returns the float32
        logits of every entry that wanted them, one row each, in order."""
        lc, batch = self._lc, self._batch
        if len(entries) > self._capacity:
            raise ValueError(f"{len(entries)} tokens in one step; the context holds "
                             f"{self._capacity}")
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1 if logits else 0
        batch.n_tokens = len(entries)
        status = lc.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        out = []
        for i, (_, _, _, logits) in enumerate(entries):
            if logits:
                row = lc.llama_get_logits_ith(self._ctx, i)
                out.append(torch.frombuffer(
                    (ctypes.c_float * self.vocab_size).from_address(ctypes.addressof(row.contents)),
                    dtype=torch.float32).clone())
        return torch.stack(out) if out else torch.empty(0, self.vocab_size)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy ``new_tokens`` tokens after each prompt (a fresh KV cache per call)."""
        lc = self._lc
        lc.llama_memory_clear(lc.llama_get_memory(self._ctx), True)
        entries = [(tok, pos, seq, pos == len(p) - 1)
                   for seq, p in enumerate(prompts) for pos, tok in enumerate(p)]
        nxt = self._decode(entries)
        outs = [[t] for t in nxt]
        for _ in range(new_tokens - 1):
            nxt = self._decode([(t, len(p) + len(o) - 1, seq, True)
                                for seq, (p, o, t) in enumerate(zip(prompts, outs, nxt))])
            for o, t in zip(outs, nxt):
                o.append(t)
        return outs

    def weight_bytes_per_rank(self) -> list[int]:
        """Bytes of the weights written for llama.cpp (one process)."""
        return [self.weight_bytes]

    def shutdown(self) -> None:
        """Same as :meth:`close` (the benchmark ends every contender this way)."""
        self.close()

    def close(self) -> None:
        """Free llama.cpp's context and model and remove the GGUF."""
        lc = self._lc
        if self._ctx:  # None once closed
            lc.llama_batch_free(self._batch)
            lc.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lc.llama_model_free(self._model)
            self._model = None
        if self._dir is not None:
            self._dir.cleanup()
