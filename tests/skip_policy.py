"""``--strict-skips``: fail the run when a test skips for a reason the policy does not allow.

Allowed are skips that say the machine lacks something the test needs and CI cannot provide:
a CUDA GPU, a CPU feature (AVX-512, native bf16 matmuls, a vector ISA) or the operating system;
and, by their exact reasons, the llama.cpp benchmark contender's binding and llama.cpp's
``llama-quantize`` tool (third-party software CI does not install; the GGUF layout and reading
they exercise are checked without them).
Anything else (a missing dev dependency such as transformers or torchrun, a skip added to hide
a failure) fails the run, listed with its reason. Loaded by ``tests/conftest.py``; CI passes
the option (``.ci/run``).
"""

from __future__ import annotations

import re

import pytest

# (pattern searched in the skip reason, why such a skip is honest)
ALLOWED_SKIP_REASONS: tuple[tuple[str, str], ...] = (
    (r"needs CUDA", "no GPU on this machine"),
    (r"AVX-512", "the CPU lacks the instructions of the native kernel under test"),
    (r"the CPU lacks the instructions of the \w+ build", "a native kernel build (AVX-512 or "
     "AVX2) this CPU cannot run"),
    (r"no native bf16 matmul", "the CPU has no AVX-512-BF16 / AMX"),
    (r"reports no vector ISA", "the CPU has no vector ISA Inductor probes"),
    (r"(?:are|is) Linux\b|only used on x86_64 Linux", "the feature exists on Linux only"),
    (r"^the llama\.cpp binding \(llama-cpp-python, an optional benchmark contender\) is not "
     r"installed; the GGUF layout it would read is checked without it$",
     "an optional third-party contender CI does not install; what forwardkit gives it (the GGUF "
     "export's layout) is tested without it in the same file"),
    (r"^llama\.cpp's llama-quantize tool \(optional, not installed by CI\) is not on PATH or "
     r"in LLAMA_QUANTIZE; GGUF reading and ggml's rounding are checked without it$",
     "an optional third-party tool CI does not install; GGUF reading and ggml's reference "
     "rounding are tested without it (test_gguf.py, test_formats.py)"),
)

def skip_allowed(reason: str) -> bool:
    """Whether the policy allows a skip with this reason."""
    return any(re.search(pattern, reason) for pattern, _ in ALLOWED_SKIP_REASONS)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--strict-skips", action="store_true", default=False,
                     help="fail the run when a test skips for a reason other than a missing GPU, "
                          "CPU feature or operating system (tests/skip_policy.py)")


class _StrictSkips:
    """Collects skip reasons during the run and fails the session on a disallowed one."""

    def __init__(self) -> None:
        self.skips: list[tuple[str, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        self.skips.append((report.nodeid, reason.removeprefix("Skipped: ")))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        bad = [(nodeid, reason) for nodeid, reason in self.skips if not skip_allowed(reason)]
        if not bad:
            return
        lines = [f"--strict-skips: {len(bad)} test(s) skipped for a reason the policy does not "
                 "allow (tests/skip_policy.py ALLOWED_SKIP_REASONS):"]
        lines += [f"  {nodeid}: {reason}" for nodeid, reason in bad]
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--strict-skips"):
        config.pluginmanager.register(_StrictSkips(), "forwardkit-strict-skips")
