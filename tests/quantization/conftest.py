"""A tiny float32 Llama checkpoint and its twins whose projection weights (and token
embedding / LM head, in ``q8_0``) are replaced by their dequantized values (the reference a
quantized load must match)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


EMBEDDING_FORMAT = "q8_0"  # the token embedding / LM head of a model quantized on load


def _tiny_llama(**overrides: object):
    """Weights at std 0.2 so logits spread (greedy tokens are not decided by near-ties)."""
    torch.manual_seed(0)
    settings: dict[str, object] = {**TINY, "tie_word_embeddings": False, **overrides}
    cfg = transformers.LlamaConfig(**settings, rope_theta=10000.0, initializer_range=0.2,
                                   torch_dtype="float32")
    return transformers.LlamaForCausalLM(cfg)


def dequantize_like_load(model, fmt: str) -> None:
    """Replace ``model``'s (transformers) projection weights by their ``fmt`` values and its
    embedding and head by their ``q8_0`` values: what a load with ``quantization=fmt`` holds."""
    from forwardkit.quantization.formats import dequantize, quantize

    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head is the embedding: listed once
            leaf = name.split(".")[-2]
            if name.endswith(".weight") and leaf in PROJECTIONS:
                p.copy_(dequantize(quantize(p, fmt), fmt))
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                p.copy_(dequantize(quantize(p, EMBEDDING_FORMAT), EMBEDDING_FORMAT))


@pytest.fixture
def tiny_llama():
    """The tiny Llama (transformers) with config overrides."""
    return _tiny_llama


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qllama")
    _tiny_llama().save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def dequantized_dir(tmp_path_factory):
    """``fmt -> checkpoint dir`` of the tiny Llama with each projection weight replaced by
    dequantize(quantize(w)) and the embedding / head by their ``q8_0`` values (float32, exact)."""
    made: dict[str, str] = {}

    def make(fmt: str) -> str:
        if fmt not in made:
            model = _tiny_llama()
            dequantize_like_load(model, fmt)
            path: Path = tmp_path_factory.mktemp(f"qllama_deq_{fmt}")
            model.save_pretrained(str(path))
            made[fmt] = str(path)
        return made[fmt]

    return make


@pytest.fixture
def watch_loading(monkeypatch):
    """``watch(check)``: makes ``load_model`` call ``check(model, name)`` before each checkpoint
    tensor ``name`` is handed to the model (``model`` is None until ``load_weights`` starts),
    so a test can look at what is already packed while the load streams."""
    from forwardkit.models import loader

    def watch(check) -> None:
        state: dict[str, object] = {}
        real_iterate, real_class = loader.iterate_safetensors, loader.get_model_class

        def watching(files, lazy=False):
            for name, tensor in real_iterate(files, lazy):
                check(state.get("model"), name)
                yield name, tensor

        def capture_class(archs):
            cls = real_class(archs)

            class Capturing(cls):  # type: ignore[misc, valid-type]
                def load_weights(self, weights):
                    state["model"] = self
                    return super().load_weights(weights)

            return Capturing

        monkeypatch.setattr(loader, "iterate_safetensors", watching)
        monkeypatch.setattr(loader, "get_model_class", capture_class)

    return watch


@pytest.fixture
def forwardkit_ops():
    """``run(module, *inputs) -> (compiled output, forwardkit ops in the Dynamo graph)``: the
    module compiled with a recording backend (fullgraph), run once."""

    def run(module: torch.nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm

        out = torch.compile(module, backend=backend, fullgraph=True)(*inputs)
        targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
        return out, [t for t in targets if t.startswith("forwardkit.")]

    return run
