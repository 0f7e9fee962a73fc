"""``--strict-skips`` (tests/skip_policy.py): only skips for a missing GPU, CPU feature or
operating system are allowed; any other skip fails the run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from skip_policy import skip_allowed

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("reason", [
    "needs CUDA", "needs CUDA with 2+ GPUs",
    "the CPU has no AVX-512-BF16 (the native bf16 kernel's instructions)",
    "the CPU has no AVX-512F/BW/VL (the native float32 kernel's instructions)",
    "this CPU has no native bf16 matmul (AVX-512-BF16 / AMX)",
    "transparent huge pages are Linux", "madvise is Linux",
    "the llama.cpp binding (llama-cpp-python, an optional benchmark contender) is not installed; "
    "the GGUF layout it would read is checked without it",
])
def test_machine_capability_skips_are_allowed(reason):
    assert skip_allowed(reason)


@pytest.mark.parametrize("reason", [
    "could not import 'transformers': No module named 'transformers'",
    "torchrun not installed", "flaky", "the deferred move is for CPU weights", "",
    "llama.cpp not installed", "the llama.cpp binding is not installed",
])
def test_other_skips_are_not(reason):
    assert not skip_allowed(reason)


SAMPLE = '''
import pytest

@pytest.mark.skipif(True, reason="needs CUDA")
def test_gpu():
    pass

def test_runs():
    pass
'''
MISSING_DEP = '''
def test_dependency():
    import pytest
    pytest.importorskip("no_such_module_for_forwardkit")
'''


def _pytest(tmp_path, source: str, *options: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(source)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "skip_policy",
         "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), *options,
         str(tmp_path / "test_sample.py")],
        capture_output=True, text=True, timeout=120, env=env)


def test_a_disallowed_skip_fails_the_run(tmp_path):
    proc = _pytest(tmp_path, SAMPLE + MISSING_DEP, "--strict-skips")
    assert proc.returncode == 1, proc.stdout
    assert "--strict-skips: 1 test(s) skipped" in proc.stdout
    assert "test_dependency: could not import 'no_such_module_for_forwardkit'" in proc.stdout
    assert "test_gpu" not in proc.stdout.split("--strict-skips:")[1]  # allowed, not listed


def test_allowed_skips_pass_and_the_option_is_opt_in(tmp_path):
    assert _pytest(tmp_path, SAMPLE, "--strict-skips").returncode == 0
    assert _pytest(tmp_path, SAMPLE + MISSING_DEP).returncode == 0  # without the option
