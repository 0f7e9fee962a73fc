"""Piecewise dispatch: ranges vs sizes, identical pieces sharing one artifact, failure + retry."""

from __future__ import annotations

import pytest
import torch
from toy_model import CompiledToyModel, ToyModel

from forwardkit.compilation import compiler as compiler_mod
from forwardkit.compilation.counters import compilation_counter
from forwardkit.config.compilation_enums import Range


@pytest.fixture
def recorded(monkeypatch):
    """Replace compile_or_load: every artifact records the entry it was built for when it runs."""
    built: list[tuple[str, Range]] = []
    used: list[Range] = []

    def fake_compile(self, graph, example_inputs, entry, fingerprint, label):
        built.append((fingerprint, entry))

        def run(*args, _entry=entry):
            used.append(_entry)
            return graph(*args)

        return run, "compiled"

    monkeypatch.setattr(compiler_mod.PieceCompiler, "compile_or_load", fake_compile)
    return built, used


def test_sizes_beat_ranges_and_edges_belong_to_their_range(make_config, recorded):
    built, used = recorded
    cfg = make_config(mode=3, compile_sizes=[4, 8, 100], compile_ranges_split_points=[8, 512])
    model, ref = CompiledToyModel(engine_config=cfg, num_layers=1), ToyModel(num_layers=1)
    expected = {
        2: Range(1, 8), 1: Range(1, 8), 4: Range(4, 4), 8: Range(8, 8), 7: Range(1, 8),
        9: Range(9, 512), 100: Range(100, 100), 512: Range(9, 512), 513: Range(513, 2048),
        2048: Range(513, 2048),
    }
    for n, entry in expected.items():
        used.clear()
        x = torch.randn(n, 32)
        torch.testing.assert_close(model(x), ref(x))
        assert used == [entry, entry], (n, used)  # both compiled pieces of the one layer
    piece = model._fk_backend.piece_backends[0]
    with pytest.raises(ValueError, match="outside every compile range"):
        piece.entry_for(4096)


def test_identical_middle_pieces_compile_once(make_config, recorded):
    built, _ = recorded
    cfg = make_config(mode=3)
    model = CompiledToyModel(engine_config=cfg, num_layers=4)
    # inference: no piece input requires grad, so the middles are identical
    with torch.no_grad(), compilation_counter.expect(
        num_piecewise_graphs_seen=9, num_splits=4, num_piecewise_capturable_graphs_seen=5,
        num_backend_compilations=5, num_shared_artifacts=2,
    ):
        model(torch.randn(10, 32))
    # first piece, the 3 identical middles (one artifact), last piece
    assert len(built) == 3
    fingerprints = [p.fingerprint for p in model._fk_backend.piece_backends]
    assert len(set(fingerprints[1:4])) == 1 and len(set(fingerprints)) == 3


def test_attention_runs_eagerly_between_pieces(make_config):
    import toy_model

    model = CompiledToyModel(engine_config=make_config(mode=3), num_layers=3)
    model(torch.randn(10, 32))
    before = toy_model.CALLS["attn"]
    model(torch.randn(12, 32))
    assert toy_model.CALLS["attn"] - before == 3  # the real op ran once per layer


def test_compile_failure_names_piece_and_size_then_retries(make_config, monkeypatch):
    calls = {"n": 0}
    real = compiler_mod.PieceCompiler.compile_or_load

    def flaky(self, graph, example_inputs, entry, fingerprint, label):
        calls["n"] += 1
        if calls["n"] == 1:
            raise compiler_mod.PieceCompileError(f"compiling {label} for range {entry} failed: boom")
        return real(self, graph, example_inputs, entry, fingerprint, label)

    monkeypatch.setattr(compiler_mod.PieceCompiler, "compile_or_load", flaky)
    model, ref = CompiledToyModel(engine_config=make_config(mode=3), num_layers=1), ToyModel(num_layers=1)
    x = torch.randn(5, 32)
    with pytest.raises(compiler_mod.PieceCompileError, match=r"piece 0/2 \(submod_0\) for range \(1, 8\)"):
        model(x)
    torch.testing.assert_close(model(x), ref(x))  # retried, not poisoned


def test_inductor_failure_is_wrapped(monkeypatch):
    import torch.fx

    def boom(*a, **k):
        raise RuntimeError("inductor exploded")

    monkeypatch.setattr(torch._inductor, "standalone_compile", boom)
    c = compiler_mod.PieceCompiler("inductor", {}, None)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(compiler_mod.PieceCompileError, match=r"piece 3/5 for size \(4, 4\).*inductor exploded"):
        c.compile_or_load(gm, [torch.randn(4)], Range(4, 4), "f", "piece 3/5")
    with pytest.raises(ValueError, match="'tvm'"):
        compiler_mod.PieceCompiler("tvm", {}, None)


def test_piece_wrapper_wraps_every_compiled_piece_and_nothing_else(make_config):
    """The runner's seam: a factory set on the model wraps each compiled piece (with its index
    and the piece count); splitting ops stay outside and run eagerly."""
    import toy_model

    from forwardkit.compilation.backend import set_piece_wrapper
    from forwardkit.compilation.piecewise import PiecewiseBackend

    made, calls = [], []

    def factory(piece, index, total):
        assert isinstance(piece, PiecewiseBackend)
        made.append((index, total, piece.name))

        def run(*args):
            calls.append(index)
            return piece(*args)

        return run

    model, ref = CompiledToyModel(engine_config=make_config(mode=3), num_layers=2), ToyModel(num_layers=2)
    assert set_piece_wrapper(model, factory) == 1  # one compiled module
    x = torch.randn(6, 32)
    expected = ref(x)
    before = toy_model.CALLS["attn"]
    torch.testing.assert_close(model(x), expected)
    assert made == [(0, 3, "submod_0"), (1, 3, "submod_2"), (2, 3, "submod_4")]
    assert calls == [0, 1, 2]  # each wrapper in graph order, once
    assert toy_model.CALLS["attn"] - before == 2  # attention ran between the wrapped pieces
    with pytest.raises(RuntimeError, match="before the first forward pass"):
        set_piece_wrapper(model, factory)


def test_no_piece_wrapper_leaves_bare_pieces(make_config):
    from forwardkit.compilation.piecewise import PiecewiseBackend

    model = CompiledToyModel(engine_config=make_config(mode=3), num_layers=1)
    model(torch.randn(3, 32))
    split = model._fk_backend.split_gm
    assert all(isinstance(split.__dict__[n], PiecewiseBackend) for n in ("submod_0", "submod_2"))
