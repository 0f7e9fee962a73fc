"""``SchedulerConfig``: the batch limits the compilation/cudagraph resolution reads."""

from __future__ import annotations

from dataclasses import InitVar, field

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from forwardkit.config.frozen import FreezableConfig
from forwardkit.config.utils import hash_factors

__all__ = ["SPEC_METHODS", "SPEC_METHODS_RUN", "SchedulerConfig", "SpeculativeConfig"]

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(config=ConfigDict(extra="forbid"))
class SchedulerConfig(FreezableConfig):
    """Per-step limits of the scheduler (vLLM ``SchedulerConfig`` subset).

    ``max_model_len`` and ``is_encoder_decoder`` are init-only inputs used for the checks;
    encoder-decoder models force ``enable_chunked_prefill`` off.
    """

    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    """Most tokens (over all requests) in one step; also the largest compile range end."""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    """Most requests in one step."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps."""
    async_scheduling: bool | None = None
    """Overlap scheduling with execution; None: on unless an unsupported feature rules it out."""
    max_num_partial_prefills: int = 1
    """Most requests with a partial (chunked) prefill in one step."""
    max_long_partial_prefills: int = 1
    """Most long requests with a partial prefill in one step."""
    max_model_len: InitVar[int] = DEFAULT_MAX_MODEL_LEN
    """Longest sequence (init-only; used for the chunked-prefill check)."""
    is_encoder_decoder: InitVar[bool] = False
    """The model is encoder-decoder (init-only; turns chunked prefill off)."""
    max_num_encoder_input_tokens: int = field(init=False, default=0)
    """Encoder token budget per step; equals ``max_num_batched_tokens``."""
    encoder_cache_size: int = field(init=False, default=0)
    """Encoder cache size in tokens; equals ``max_num_batched_tokens``."""

    def __post_init__(self, max_model_len: int, is_encoder_decoder: bool) -> None:
        if is_encoder_decoder:
            self.enable_chunked_prefill = False
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) must be greater than or equal to 1.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than "
                "or equal to 1."
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than "
                f"or equal to max_num_seqs ({self.max_num_seqs})."
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({max_model_len}) while chunked prefill is disabled, so the "
                "longest prompt could never be scheduled; raise max_num_batched_tokens or "
                "enable chunked prefill."
            )
        if self.max_num_partial_prefills < 1 or self.max_long_partial_prefills < 1:
            raise ValueError("max_num_partial_prefills and max_long_partial_prefills must be >= 1")
        self.max_num_encoder_input_tokens = self.max_num_batched_tokens
        self.encoder_cache_size = self.max_num_batched_tokens

    def compute_hash(self) -> str:
        """Hash of what changes the compiled graph: only ``max_num_batched_tokens``."""
        return hash_factors({"max_num_batched_tokens": self.max_num_batched_tokens})


_EAGLE_LIKE_METHODS = frozenset({"eagle", "eagle3", "mtp", "deepseek_mtp", "draft_model"})


# vLLM's methods; the engine runs the ones in SPEC_METHODS_RUN (the others are accepted by the
# config, whose capture-size arithmetic they steer, and refused by ``LLM``)
SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp", "deepseek_mtp", "medusa",
                "mlp_speculator", "suffix")
SPEC_METHODS_RUN = ("ngram", "draft_model")


@dataclass(config=ConfigDict(extra="forbid"))
class SpeculativeConfig(FreezableConfig):
    """Speculative decoding: the drafting method and how many tokens it drafts.

    ``num_speculative_tokens`` draft tokens per request make a uniform decode step
    ``1 + num_speculative_tokens`` tokens long, which changes the default capture sizes.
    """

    num_speculative_tokens: int = 1
    """Draft tokens proposed per request per step (>= 1)."""
    method: str = "ngram"
    """Drafting method (``ngram``, ``draft_model``, ``eagle``, ``eagle3``, ``mtp``, ...)."""
    disable_padded_drafter_batch: bool = False
    """Do not pad the drafter batch (incompatible with async scheduling)."""
    prompt_lookup_min: int | None = None
    """n-gram: shortest suffix matched (>= 1); None = ``prompt_lookup_max``, or 5 when both
    are None."""
    prompt_lookup_max: int | None = None
    """n-gram: longest suffix matched; None = ``prompt_lookup_min``, or 5 when both are None."""
    model: str | None = None
    """draft_model: the draft checkpoint (same vocabulary as the target)."""
    draft_tensor_parallel_size: int | None = None
    """draft_model: TP ranks of the draft (1 or the target's)."""
    disable_by_batch_size: int | None = None
    """No drafts in a step while more requests than this are running (None = always draft)."""

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method={self.method!r:.60} is invalid; expected "
                             f"one of {', '.join(repr(m) for m in SPEC_METHODS)}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = 5
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            assert lo is not None and hi is not None
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if value < 1:
                    raise ValueError(f"speculative_config.{name}={value} is invalid; expected "
                                     "an integer >= 1")
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min={lo} is invalid; it must "
                                 f"not exceed prompt_lookup_max={hi}")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if self.method == "draft_model":
            if not self.model:
                raise ValueError("speculative_config.model is required for method 'draft_model': "
                                 "the draft checkpoint's directory (same vocabulary as the target)")
            dtp = self.draft_tensor_parallel_size
            if dtp is not None and dtp < 1:
                raise ValueError(f"speculative_config.draft_tensor_parallel_size={dtp} is invalid; "
                                 "expected None, 1 or the target's tensor_parallel_size")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config.disable_by_batch_size="
                             f"{self.disable_by_batch_size} is invalid; expected None or >= 1")

    def check_draft_model(self, target_vocab_size: int, target_tp: int) -> None:
        """For ``draft_model``: ``ValueError`` naming the field when the draft checkpoint's
        vocabulary differs from the target's (``target_vocab_size``) or its
        ``draft_tensor_parallel_size`` is neither 1 nor ``target_tp``. Reads the draft's
        ``config.json``; no weights."""
        if self.method != "draft_model":
            return
        from forwardkit.config.model import ModelConfig

        assert self.model is not None
        try:
            draft = ModelConfig.from_pretrained(self.model)
        except ValueError as exc:
            raise ValueError(f"speculative_config.model={self.model!r:.200}: {exc}") from None
        vocab = draft.get_vocab_size()
        if vocab != target_vocab_size:
            raise ValueError(f"speculative_config.model={self.model!r} has vocab_size={vocab}, but "
                             f"the target model's is {target_vocab_size}; a draft model must "
                             "share the target's vocabulary")
        dtp = self.draft_tensor_parallel_size
        if dtp is not None and dtp not in (1, target_tp):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={dtp} is invalid; "
                             f"expected 1 or the target's tensor_parallel_size ({target_tp})")

    def use_eagle(self) -> bool:
        """The drafter is EAGLE/MTP-like (the only kind async scheduling supports)."""
        return self.method in _EAGLE_LIKE_METHODS

    def compute_hash(self) -> str:
        """Hash of the method and the number of draft tokens."""
        return hash_factors({"method": self.method, "num_speculative_tokens": self.num_speculative_tokens})
