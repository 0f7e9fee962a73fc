"""Steps 15 and 17 of ``EngineConfig``'s resolution: CUDA-graph capture sizes and the padding
table, and the Inductor compile ranges; and the graph mode the runner serves
(:func:`served_graph_mode`, read through ``EngineConfig.served_cudagraph_mode``).

Where the graph mode is decided: resolution sets vLLM's ``compilation_config.cudagraph_mode``
(what vLLM's config holds; NONE when the platform has no static graphs, step 15). The mode
the runner serves is that one lowered once more, also here: NONE with ``enforce_eager`` or
when the config's platform cannot capture now, else lowered to what the selected attention
backend supports (:func:`resolve_graph_mode`; vLLM does this step in its GPU runner). The
planner, dispatcher and runner read the result; none of them decides again.

The functions take the sub-configs of the ``EngineConfig`` being resolved (never the engine
config itself, so this module does not import :mod:`.engine`) and change its compilation
config in place, in vLLM 0.14.0's order (see :mod:`.engine` for the whole sequence and the
deliberate differences from the reference).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from forwardkit.config.attention import AttentionCGSupport, attention_cudagraph_support
from forwardkit.config.compilation_enums import CUDAGraphMode
from forwardkit.config.levels import default_capture_sizes
from forwardkit.config.utils import ConfigAssertionError
from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from forwardkit.config.compilation import CompilationConfig
    from forwardkit.config.model import ModelConfig
    from forwardkit.config.parallel import ParallelConfig
    from forwardkit.config.scheduler import SchedulerConfig
    from forwardkit.platforms import Platform

__all__ = [
    "resolve_graph_mode",
    "resolve_static_graphs",
    "served_graph_mode",
    "set_compile_ranges",
    "sequence_parallel_multiple",
    "sizes_for_sequence_parallelism",
]

logger = init_logger(__name__)


def resolve_static_graphs(cc: CompilationConfig, model: ModelConfig | None, sched: SchedulerConfig,
                          parallel: ParallelConfig, platform: Platform,
                          uniform_decode_query_len: int) -> None:
    """Step 15: the cudagraph mode the platform and model allow, then the capture sizes
    (``uniform_decode_query_len``: tokens per request in a decode step, 1 + speculative
    tokens)."""
    if not platform.supports_static_graph():
        if cc.cudagraph_mode not in (None, CUDAGraphMode.NONE):
            logger.info_once("CUDA graphs are off: platform %s cannot capture them; steps run "
                             "eagerly (runtime mode NONE).", platform.name)
        cc.cudagraph_mode = CUDAGraphMode.NONE  # sizes untouched, no padding table
        return
    if model is not None:
        mode = cc.resolved_cudagraph_mode()
        if mode.has_full_cudagraphs() and model.is_pooling_model:
            logger.warning_once("Pooling models do not support full cudagraphs; using PIECEWISE.")
            cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
        elif model.is_encoder_decoder and mode not in (
                CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY):
            logger.info_once("Encoder-decoder models support only FULL_DECODE_ONLY cudagraphs.")
            cc.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    if model is not None and model.enforce_eager:
        cc.cudagraph_mode = CUDAGraphMode.NONE
        cc.max_cudagraph_capture_size = 0
        cc.cudagraph_capture_sizes = []
    else:
        cc.cudagraph_num_of_warmups = 1
    _set_cudagraph_sizes(cc, model, sched, sequence_parallel_multiple(cc, parallel),
                         uniform_decode_query_len)


def _set_cudagraph_sizes(cc: CompilationConfig, model: ModelConfig | None, sched: SchedulerConfig,
                         sp_multiple: int, uniform_decode_query_len: int) -> None:
    """Capture sizes and their maximum, then the padding table (``sp_multiple``: what every
    size must divide by, :func:`sequence_parallel_multiple`)."""
    if model is None or model.enforce_eager or cc.cudagraph_mode == CUDAGraphMode.NONE:
        cc.max_cudagraph_capture_size = 0
        cc.cudagraph_capture_sizes = []
        cc.post_init_cudagraph_sizes()
        return
    tokens = sched.max_num_batched_tokens
    user_max, user_sizes = cc.max_cudagraph_capture_size, cc.cudagraph_capture_sizes
    limit = user_max
    if limit is None:
        limit = min(sched.max_num_seqs * uniform_decode_query_len * 2, 512)
    limit = min(tokens, limit)
    if limit < 1:
        raise ConfigAssertionError(
            "Maximum cudagraph size should be greater than or equal to 1 when using cuda "
            f"graph (got {limit}); raise max_cudagraph_capture_size or set cudagraph_mode NONE.")
    if user_sizes is not None:
        if not user_sizes:
            raise ConfigAssertionError(
                "cudagraph_capture_sizes should contain at least one element when using cuda "
                "graph (use cudagraph_mode NONE to turn graphs off).")
        sizes = sorted(s for s in set(user_sizes) if s <= tokens)
        if not sizes:  # graphs on with nothing to capture: no resolved state says that
            raise ValueError(
                f"cudagraph_capture_sizes {sorted(user_sizes)} are all above "
                f"max_num_batched_tokens={tokens}, so no CUDA graph could be captured; give "
                "sizes <= max_num_batched_tokens or set cudagraph_mode NONE")
    else:
        sizes = default_capture_sizes(limit)
    if sp_multiple > 1:
        sizes = sizes_for_sequence_parallelism(sizes, sp_multiple)
    valid_max = sizes[-1] if sizes else 0
    if user_max is not None and user_max != valid_max:
        if user_sizes is not None:
            raise ValueError(
                f"customized max_cudagraph_capture_size(={user_max}) should be consistent "
                f"with the max value of cudagraph_capture_sizes(={valid_max})")
        logger.warning("Truncating max_cudagraph_capture_size to %d", valid_max)
    cc.max_cudagraph_capture_size = valid_max
    if user_sizes is not None and len(sizes) < len(user_sizes):
        logger.warning("cudagraph_capture_sizes %s reduced to %s (sizes above "
                       "max_num_batched_tokens=%d or not divisible by TP dropped)",
                       sorted(user_sizes), sizes, tokens)
    cc.cudagraph_capture_sizes = sizes
    cc.post_init_cudagraph_sizes()


def sequence_parallel_multiple(cc: CompilationConfig, parallel: ParallelConfig) -> int:
    """The one sequence-parallelism padding rule: with the SP pass on and TP > 1, every
    step's token count (and every capture size) is a multiple of the TP size, which this
    returns; otherwise 1. Read through ``EngineConfig.sequence_parallel_multiple``."""
    tp = parallel.tensor_parallel_size
    return tp if tp > 1 and cc.pass_config.enable_sp else 1


def sizes_for_sequence_parallelism(sizes: list[int], tp: int) -> list[int]:
    """Keep the sizes divisible by the TP size (sequence parallelism needs that)."""
    kept = [s for s in sizes if s % tp == 0]
    removed = [s for s in sizes if s % tp != 0]
    if removed:
        logger.warning("Batch sizes %s are removed because they are not multiple of "
                       "tp_size %d when sequence parallelism is enabled", removed, tp)
    return kept


def set_compile_ranges(cc: CompilationConfig, model: ModelConfig | None, sched: SchedulerConfig,
                       parallel: ParallelConfig, platform: Platform | None = None) -> None:
    """Step 17: split points of the Inductor compile ranges: the token budget, the all-reduce
    fusion limit when that fusion is on (for ``platform``'s device; None: the current
    platform), and the user's points strictly between 1 and the budget."""
    tokens = sched.max_num_batched_tokens
    points: list[int] = [tokens] if tokens is not None else []
    if cc.pass_config.fuse_allreduce_rms and model is not None:
        size = cc.pass_config.flashinfer_max_size(parallel.tensor_parallel_size, platform)
        if size is not None:
            n = size // (model.get_hidden_size() * model.dtype.itemsize)
            if tokens is not None and n < tokens:
                points.append(n)
            else:
                logger.debug("allreduce-rms fusion limit %d tokens >= the token budget", n)
    for x in cc.compile_ranges_split_points or []:
        if not isinstance(x, int) or isinstance(x, bool):
            raise ConfigAssertionError(f"Invalid compile range split point: {x!r} (not an int)")
        if x <= 0:
            raise ConfigAssertionError(f"Invalid compile range split point: {x}")
        if tokens is not None and 1 < x < tokens:
            points.append(x)
    cc.compile_ranges_split_points = sorted(set(points))  # NOTE: deduplicated (idempotence)


def resolve_graph_mode(compilation_config: CompilationConfig, support: AttentionCGSupport | int, *,
                       enforce_eager: bool = False, can_capture: bool = True,
                       uniform_decode_query_len: int = 1) -> CUDAGraphMode:
    """The configured graph mode lowered to what attention supports.

    NONE when the config's mode is NONE, ``enforce_eager`` is set or the device cannot capture
    graphs. Otherwise the configured mode lowered to ``support`` (the attention backend's
    ``AttentionCGSupport``). Without speculative decoding the uniform decode query length is 1,
    so every support level above NEVER can run uniform-decode FULL graphs; with it
    (``uniform_decode_query_len`` = 1 + drafts) a backend that supports only single-token
    decodes serves no FULL graph (decode steps fall to PIECEWISE). A FULL mixed mode with a
    backend that supports no full graph is a ``ValueError``.
    """
    support = AttentionCGSupport(support)
    mode = CUDAGraphMode.parse(compilation_config.cudagraph_mode or CUDAGraphMode.NONE)
    if mode == CUDAGraphMode.NONE or enforce_eager or not can_capture:
        return CUDAGraphMode.NONE
    piecewise_attn = bool(compilation_config.is_attention_compiled_piecewise())
    attn_split = bool(compilation_config.splitting_ops_contain_attention())
    if mode.mixed_mode() == CUDAGraphMode.FULL and support < AttentionCGSupport.ALWAYS:
        if support == AttentionCGSupport.NEVER:
            raise ValueError(
                f"cudagraph_mode={mode} needs full CUDA graphs but the attention backend "
                "supports none; use PIECEWISE or NONE"
            )
        new = CUDAGraphMode.FULL_AND_PIECEWISE if attn_split else CUDAGraphMode.FULL_DECODE_ONLY
        logger.warning_once(
            "cudagraph_mode %s: attention supports full graphs for uniform decode batches only; "
            "using %s", mode, new,
        )
        mode = new
    if mode.decode_mode() == CUDAGraphMode.FULL and (
            support == AttentionCGSupport.NEVER
            or (uniform_decode_query_len > 1
                and support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)):
        if support != AttentionCGSupport.NEVER:
            logger.warning_once(
                "cudagraph_mode %s: attention supports full graphs for single-token decodes "
                "only, and speculative decoding makes decode steps %d tokens per request; "
                "decode steps run without full graphs", mode, uniform_decode_query_len)
        mode = CUDAGraphMode.PIECEWISE if piecewise_attn else CUDAGraphMode.NONE
    return mode


def served_graph_mode(cc: CompilationConfig, model: ModelConfig | None, platform: Platform,
                      attention_backend: str, uniform_decode_query_len: int = 1) -> CUDAGraphMode:
    """The graph mode a runner of this config serves (see the module docstring): NONE when
    ``cc.cudagraph_mode`` is NONE, the model is ``enforce_eager`` or ``platform`` cannot capture
    graphs now; else :func:`resolve_graph_mode` with ``attention_backend``'s support level (the
    backend must be registered then)."""
    configured = CUDAGraphMode.parse(cc.cudagraph_mode or CUDAGraphMode.NONE)
    if configured == CUDAGraphMode.NONE or (model is not None and model.enforce_eager):
        return CUDAGraphMode.NONE
    if not platform.can_capture_graphs():
        logger.info_once("CUDA graphs are off: platform %s cannot capture them here (no device); "
                         "steps run eagerly (runtime mode NONE).", platform.name)
        return CUDAGraphMode.NONE
    return resolve_graph_mode(cc, attention_cudagraph_support(attention_backend),
                              uniform_decode_query_len=uniform_decode_query_len)
