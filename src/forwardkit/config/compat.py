"""The config fields forwardkit accepts for vLLM compatibility but that change nothing it runs.

vLLM 0.14.0's config classes are kept whole (code written against them constructs, validates,
hashes and prints them unchanged), but this engine has no pipeline parallelism, no expert load
balancing, no encoder models, no fp8 activations, ... so some fields only take part in
resolution (they change other resolved values, as in vLLM) or are validated and hashed and
then read by nobody. :data:`COMPAT_FIELDS` lists each such field with what it does here;
every other field of these classes acts (something outside ``config/`` reads it).
``tests/config/test_compat_fields.py`` checks the table against the code both ways (a field
nothing outside ``config/`` reads must be listed; a listed field must not be read there), and
the README's differences section carries the table (``python -m forwardkit.config.compat``
prints it; a test compares the two).

Kinds: ``resolution`` (read while resolving the config: it changes other fields, or the run's
checks), ``validated`` (checked and hashed, then unused), ``accepted`` (stored and hashed).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = ["COMPAT_FIELDS", "CompatField", "markdown_table"]

Kind = Literal["resolution", "validated", "accepted"]


class CompatField(NamedTuple):
    """One field that is accepted without acting on this layer."""

    kind: Kind
    note: str


_NO_PP = "no pipeline parallelism here (`LLM` refuses > 1)"
_NO_LB = "no DP load balancer or coordinator process: DP ranks are torchrun / spawn processes"
_NO_EPLB = "no expert load balancing here"
_NO_FP8 = ("filled in by the optimization level as in vLLM; an fp8-activation fusion (CUDA) with "
           "nothing to fuse here")

COMPAT_FIELDS: dict[str, dict[str, CompatField]] = {
    "ParallelConfig": {
        "pipeline_parallel_size": CompatField("resolution", f"> 1 turns async scheduling off; {_NO_PP}"),
        "prefill_context_parallel_size": CompatField("resolution", "counted in the world size; no context parallelism here"),
        "decode_context_parallel_size": CompatField("accepted", "no context parallelism here (`LLM` refuses > 1)"),
        "data_parallel_size_local": CompatField("resolution", "selects vLLM's explicit or environment DP path"),
        "data_parallel_rank_local": CompatField("resolution", "set by the DP environment path; the engine reads `data_parallel_rank`"),
        "data_parallel_rpc_port": CompatField("accepted", _NO_LB),
        "data_parallel_backend": CompatField("resolution", f"`ray` picks the ray executor default; {_NO_LB}"),
        "data_parallel_external_lb": CompatField("validated", f"needs DP > 1; {_NO_LB}"),
        "data_parallel_hybrid_lb": CompatField("accepted", _NO_LB),
        "data_parallel_index": CompatField("resolution", "copied from `data_parallel_rank`"),
        "enable_eplb": CompatField("validated", f"refused off CUDA as in vLLM; {_NO_EPLB}"),
        "eplb_config": CompatField("validated", f"checked with `enable_eplb`; {_NO_EPLB}"),
        "expert_placement_strategy": CompatField("accepted", "experts are split into contiguous ranges per EP rank"),
        "disable_custom_all_reduce": CompatField("accepted", "collectives are torch.distributed's (gloo / NCCL)"),
        "distributed_executor_backend": CompatField("resolution", f"decides whether async scheduling may be on; {_NO_LB}"),
        "nnodes": CompatField("validated", "> 1 needs an mp / uni / external_launcher executor; ranks come from torchrun's environment"),
        "node_rank": CompatField("validated", "ranks come from torchrun's environment"),
        "master_addr": CompatField("accepted", "the rendezvous reads torchrun's `MASTER_ADDR` or `data_parallel_master_ip`"),
        "master_port": CompatField("accepted", "the rendezvous reads torchrun's `MASTER_PORT` or `data_parallel_master_port`"),
    },
    "EPLBConfig": {
        name: CompatField("validated" if name == "num_redundant_experts" else "accepted",
                          ("must be 0 without `enable_eplb`; " if name == "num_redundant_experts"
                           else "") + _NO_EPLB)
        for name in ("window_size", "step_interval", "num_redundant_experts", "log_balancedness",
                     "log_balancedness_interval", "use_async", "policy")
    },
    "SchedulerConfig": {
        "async_scheduling": CompatField("resolution", "resolved by vLLM's rules (sets the DP-sync default); steps run synchronously"),
        "max_num_partial_prefills": CompatField("validated", "the scheduler does not cap concurrent partial prefills"),
        "max_long_partial_prefills": CompatField("validated", "the scheduler does not cap concurrent long prefills"),
        "max_num_encoder_input_tokens": CompatField("resolution", "defaulted from the token budget as in vLLM; no encoder models here"),
        "encoder_cache_size": CompatField("resolution", "defaulted from the token budget as in vLLM; no encoder models here"),
    },
    "SpeculativeConfig": {
        "disable_padded_drafter_batch": CompatField("resolution", "turns async scheduling off as in vLLM; n-gram drafting pads nothing"),
    },
    "ModelConfig": {
        "disable_cascade_attn": CompatField("resolution", "set by DBO resolution as in vLLM; no cascade attention here"),
        "pooler_config": CompatField("resolution", "set to `{}` for the pooling runner; the engine only generates"),
    },
    "CompilationConfig": {
        "level": CompatField("resolution", "deprecated alias of `mode` (warns)"),
        "debug_dump_path": CompatField("resolution", "made absolute, per rank; nothing is dumped there"),
        "compile_mm_encoder": CompatField("accepted", "no multimodal encoders here"),
        "compile_ranges_split_points": CompatField("resolution", "the compile ranges' split points (`get_compile_ranges`)"),
        "cudagraph_copy_inputs": CompatField("accepted", "graph inputs are always the runner's persistent buffers"),
    },
    "PassConfig": {
        "fuse_attn_quant": CompatField("resolution", _NO_FP8),
        "fuse_gemm_comms": CompatField("resolution", "turns `enable_sp` on"),
        "fuse_allreduce_rms": CompatField("resolution", "adds its compile-range split point; no fused all-reduce kernel here"),
        "fi_allreduce_fusion_max_size_mb": CompatField("resolution", "that split point's size"),
        "enable_qk_norm_rope_fusion": CompatField("resolution", "adds `+rotary_embedding` (cleared off CUDA); no QK-norm models here"),
    },
    "DynamicShapesConfig": {
        "assume_32_bit_indexing": CompatField("accepted", "printed and hashed; Dynamo's own default applies"),
    },
}


def markdown_table() -> str:
    """The README's copy of :data:`COMPAT_FIELDS`."""
    lines = ["| field | kind | what it does here |", "| --- | --- | --- |"]
    for cls, fields in COMPAT_FIELDS.items():
        for name, row in fields.items():
            lines.append(f"| `{cls}.{name}` | {row.kind} | {row.note} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
