"""Every ISA build of the three native kernels compiles on any x86-64 CPU (compile only, never
run).

The kernels load only the builds the CPU can run, so a machine without AVX-512 (CI's) would
never compile the AVX-512 sources: a syntax, flag or ABI error there would land unseen. This
test compiles each build of each :class:`~forwardkit.kernels.cpu.native_build.NativeKernel`
with the same source, flags and compiler its loader uses (``NativeKernel.compile_only``), into a
scratch directory, and checks the exported entry points are in the library; nothing is loaded.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest

from forwardkit.kernels.cpu import native_attention, native_build, native_linear, native_quant

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")),
    reason="the native kernels are only used on x86_64 Linux")

# (kernel module, every build it has, the symbols the loader reads from each)
KERNELS = {
    "linear": (native_linear, ["avx512", "avx2"],
               ["fk_abi_version", "fk_linear_bf16", "fk_linear_f32"]),
    "attention": (native_attention, ["avx512", "avx2", "generic"],
                  ["fk_attention_abi_version", "fk_attention_layer_args",
                   "fk_attention_step_args", "fk_decode_attention_bf16",
                   "fk_decode_attention_f32"]),
    "quant": (native_quant, ["amx", "avx512_vnni", "avx512", "avx2", "generic"],
              ["fk_quant_abi_version", "fk_quant_max_rows", "fk_quant_linear",
               "fk_quant_linear_tiles", "fk_quant_dequantize", "fk_quant_amx"]),
}
BUILDS = [(kernel, isa) for kernel, (_, isas, _) in KERNELS.items() for isa in isas]


def test_the_list_covers_every_build():
    """A build added to a kernel must be compiled here too."""
    for _kernel, (module, isas, _) in KERNELS.items():
        assert list(module.KERNEL.isas) == isas


@pytest.mark.parametrize(("kernel", "isa"), BUILDS, ids=[f"{k}-{i}" for k, i in BUILDS])
def test_build_compiles_whatever_the_cpu(kernel, isa, tmp_path: Path):
    module, _, symbols = KERNELS[kernel]
    try:
        path = module.KERNEL.compile_only(tmp_path, isa)
    except native_build.NoCompiler as exc:
        pytest.fail(f"{exc}: CI must have the C compiler the native kernels are built with")
    assert path.name == module.KERNEL.library_name(isa)  # the file the loader would load
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF"
    for symbol in symbols:  # in the dynamic string table: exported, never called here
        assert symbol.encode() + b"\0" in data, (kernel, isa, symbol)
