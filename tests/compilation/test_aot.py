"""AOT precompile: a warm process loads Dynamo's saved result instead of tracing; a stale, corrupt
or switched-off entry means tracing again, always with the right answer."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from forwardkit.compilation.aot import ENTRY
from forwardkit.compilation.cache import CompileCache, code_hash

WORKER = os.path.join(os.path.dirname(__file__), "cache_worker.py")
_BASE_ENV = {k: v for k, v in os.environ.items() if k != "FORWARDKIT_USE_AOT_COMPILE"}


def _run(size: str, tag: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, WORKER, size, tag], capture_output=True, text=True,
                         timeout=600, env={**_BASE_ENV, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _aot_dir(root: str) -> str:
    base = os.path.join(root, "torch_aot_compile")
    (digest,) = [d for d in os.listdir(base)]
    return os.path.join(base, digest, "rank_0_0", "backbone")


@pytest.mark.slow
def test_warm_process_skips_the_trace_and_falls_back_when_stale_or_corrupt(tmp_path):
    root = str(tmp_path / "cache")
    os.mkdir(root, 0o700)
    env = {"FORWARDKIT_CACHE_ROOT": root, "FORWARDKIT_USE_AOT_COMPILE": "1"}
    cold = _run("5", "1101", **env)
    c = cold["counters"]
    assert c["num_dynamo_traces"] == 1 and c["num_aot_saves"] == 1 and c["num_aot_loads"] == 0, c
    assert cold["max_err"] < 1e-5

    warm = _run("6", "1101", **env)
    c = warm["counters"]
    assert c["num_dynamo_traces"] == 0 and c["num_aot_loads"] == 1, c
    assert c["num_inductor_compiles"] == 0 and c["num_cache_errors"] == 0, c
    assert warm["max_err"] < 1e-5

    # Stale: the entry says it traced one more file, which then changes. Rewritten through the
    # cache (valid checksum), so only the source check can catch it.
    local = _aot_dir(root)
    cache = CompileCache(root, local)
    with open(os.path.join(local, ENTRY), "rb") as f:
        payload = pickle.load(f)
    extra = str(tmp_path / "helper.py")
    with open(extra, "w") as f:
        f.write("X = 1\n")
    files = {*payload["traced_files"], extra}
    payload.update(traced_files=sorted(files), code_hash=code_hash(files))
    data = pickle.dumps(payload)

    def saver(path: str) -> None:
        with open(path, "wb") as f:
            f.write(data)

    cache.save(ENTRY, saver)
    with open(extra, "w") as f:
        f.write("X = 2\n")
    stale = _run("7", "1101", **env)
    c = stale["counters"]
    assert c["num_dynamo_traces"] == 1 and c["num_aot_loads"] == 0 and c["num_aot_saves"] == 1, c
    assert c["num_inductor_compiles"] == 0, c  # the pieces' artifacts still apply
    assert stale["max_err"] < 1e-5

    # Corrupt: truncated entry -> checksum fault, traced again, right answer, entry rewritten.
    path = os.path.join(local, ENTRY)
    os.truncate(path, os.path.getsize(path) // 2)
    corrupt = _run("8", "1101", **env)
    c = corrupt["counters"]
    assert c["num_cache_errors"] == 1 and c["num_dynamo_traces"] == 1 and c["num_aot_saves"] == 1, c
    assert corrupt["max_err"] < 1e-5
    again = _run("9", "1101", **env)
    assert again["counters"]["num_aot_loads"] == 1 and again["max_err"] < 1e-5


def test_on_by_default_off_by_the_switch(monkeypatch):
    from forwardkit import envs

    monkeypatch.delenv("FORWARDKIT_USE_AOT_COMPILE", raising=False)
    assert envs.FORWARDKIT_USE_AOT_COMPILE is True
    monkeypatch.setenv("FORWARDKIT_USE_AOT_COMPILE", "0")
    assert envs.FORWARDKIT_USE_AOT_COMPILE is False


@pytest.mark.slow
def test_switched_off_saves_nothing(tmp_path):
    root = str(tmp_path / "cache")
    os.mkdir(root, 0o700)
    out = _run("5", "1102", FORWARDKIT_CACHE_ROOT=root, FORWARDKIT_USE_AOT_COMPILE="0")
    c = out["counters"]
    assert c["num_aot_saves"] == 0 and c["num_dynamo_traces"] == 1, c
    assert not os.path.exists(os.path.join(root, "torch_aot_compile"))
    assert out["max_err"] < 1e-5


def test_model_fingerprint_tracks_what_a_guard_free_trace_bakes_in():
    import torch
    from toy_model import ToyModel

    from forwardkit.compilation.aot import model_fingerprint

    def fp(model, n=5, hidden=16, dtype=torch.float32):
        return model_fingerprint(model, {"x": torch.zeros(n, hidden, dtype=dtype)}, {"x": 0})

    base = ToyModel(hidden=16, num_layers=1)
    assert fp(base) == fp(base, n=9)  # the token count is dynamic
    assert fp(base) == fp(ToyModel(hidden=16, num_layers=1))  # weights' values do not matter
    assert fp(base) != fp(ToyModel(hidden=32, num_layers=1), hidden=32)  # shapes
    assert fp(base) != fp(ToyModel(hidden=16, num_layers=2))  # structure
    assert fp(base) != fp(ToyModel(hidden=16, num_layers=1, prefix="other."))  # baked-in names
    assert fp(base) != fp(base, dtype=torch.float64)  # argument dtype
    changed = ToyModel(hidden=16, num_layers=1)
    changed.layers[0].eps = 1e-3  # a plain attribute a trace would read as a constant
    assert fp(base) != fp(changed)
