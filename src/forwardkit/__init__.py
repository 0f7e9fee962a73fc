"""forwardkit: the model-execution layer of an LLM inference engine.

Forward context, data-parallel coordination, the compilation config, piecewise
``torch.compile`` with an on-disk cache, and a small reference engine, re-implementing
what vLLM 0.14.0 documents as ``vllm.forward_context`` and ``vllm.config.CompilationConfig``.
"""

__version__ = "0.1.0"
