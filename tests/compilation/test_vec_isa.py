"""The recorded CPU vector-ISA probes: replayed only when they match this host, else Inductor probes.

Inductor's probes are replaced by a fake ``check_build`` (a real one compiles and dlopens, which
takes seconds); the fake answers from a table and counts its calls.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys

import pytest

from forwardkit.compilation import vec_isa

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="the ISA record is only used on x86_64 Linux (elsewhere Inductor always probes)",
)


@pytest.fixture
def isa(monkeypatch):
    """Inductor's ISA module with empty caches and a fake probe; everything restored after."""
    from torch._inductor import cpu_vec_isa

    saved_list = cpu_vec_isa.valid_vec_isa_list
    snapshot = vec_isa._snapshot()
    fresh = functools.cache(saved_list.__wrapped__)  # a new cache around the same code
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", fresh)
    vec_isa._restore(snapshot)  # clears the per-ISA answer caches
    calls: list[str] = []
    works = {"fail": set()}  # str(isa) whose probes fail

    def fake_check_build(self, code):
        calls.append(str(self))
        return str(self) not in works["fail"]

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", fake_check_build)
    yield cpu_vec_isa, calls, works
    vec_isa._restore(snapshot)  # answers cached under the fake probe must not leak
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", saved_list)


def _names(isas) -> list[str]:
    return [str(i) for i in isas]


def test_probe_is_recorded_then_replayed_without_probing(tmp_path, isa):
    cpu_vec_isa, calls, works = isa
    works["fail"] = {"avx512"}  # an ISA whose test program does not build here
    assert vec_isa.prime_vec_isa_list(str(tmp_path)) == "probed"
    probed = _names(cpu_vec_isa.valid_vec_isa_list())
    n_probes = len(calls)
    assert n_probes > 0 and "avx512" not in probed
    with open(vec_isa.vec_isa_record_path(str(tmp_path))) as f:
        record = json.load(f)
    assert record["key"] == vec_isa._host_key() and len(record["answers"]) > 0

    # a "new process": caches emptied; the record answers every probe
    vec_isa._restore(vec_isa._snapshot())
    assert vec_isa.prime_vec_isa_list(str(tmp_path)) == "primed"
    assert len(calls) == n_probes  # no probe ran
    assert _names(cpu_vec_isa.valid_vec_isa_list()) == probed
    assert vec_isa.prime_vec_isa_list(str(tmp_path)) == "computed"


@pytest.mark.parametrize("fault", ["garbage", "other_compiler", "other_torch", "missing_answer"])
def test_unusable_record_means_real_probes(tmp_path, isa, fault):
    cpu_vec_isa, calls, works = isa
    assert vec_isa.prime_vec_isa_list(str(tmp_path)) == "probed"
    expected = _names(cpu_vec_isa.valid_vec_isa_list())
    path = vec_isa.vec_isa_record_path(str(tmp_path))
    with open(path) as f:
        record = json.load(f)
    if fault == "garbage":
        text = '{"key": '
    else:
        if fault == "other_compiler":
            record["key"]["cxx_version"] = "gcc version 0.0 (elsewhere)"
        elif fault == "other_torch":
            record["key"]["torch"] = "0.0.1"
        else:
            if not record["answers"]:
                pytest.skip("this CPU reports no vector ISA, so nothing is probed")
            record["answers"].pop(sorted(record["answers"])[0])
        text = json.dumps(record)
    with open(path, "w") as f:
        f.write(text)

    vec_isa._restore(vec_isa._snapshot())
    works["fail"] = {"avx2"}  # the host changed: only real probes can know
    before = len(calls)
    assert vec_isa.prime_vec_isa_list(str(tmp_path)) == "probed"
    assert len(calls) > before  # really probed
    got = _names(cpu_vec_isa.valid_vec_isa_list())
    assert "avx2" not in got
    assert got == [n for n in expected if n != "avx2"]
    with open(path) as f:  # and the record now describes the real answers
        assert json.load(f)["key"] == vec_isa._host_key()


def test_nothing_is_done_when_already_known_or_vec_isa_ok_set(tmp_path, isa, monkeypatch):
    cpu_vec_isa, calls, works = isa
    from torch._inductor import config

    # NOTE: torch's own config.patch, not monkeypatch: a config entry that a test deletes or
    # leaves overridden breaks every later Inductor compile in the process.
    with config.patch({"cpp.vec_isa_ok": True}):
        assert vec_isa.prime_vec_isa_list(str(tmp_path)) == "computed"
    assert config.cpp.vec_isa_ok is None
    assert not os.path.exists(vec_isa.vec_isa_record_path(str(tmp_path)))
    cpu_vec_isa.valid_vec_isa_list()
    assert vec_isa.prime_vec_isa_list(str(tmp_path)) == "computed"
    assert not os.path.exists(vec_isa.vec_isa_record_path(str(tmp_path)))
