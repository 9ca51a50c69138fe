"""w8a8's products through a small AVX512-VNNI kernel of our own (`mars_core/engine/vnni.cpp`), built on first use.

fbgemm's dynamic int8 linear, w8a8's default kernel, costs more the more rows it multiplies: on an AVX512-VNNI
CPU a 7-position forward costs clearly more than a 1-position one, and that ratio is what MARS's extra positions
pay (docs/experiments/amx-and-kernels.md, "The VNNI kernel"). This kernel reads each weight block once for up to 24
rows, so the weights' memory traffic, which dominates at a few rows, no longer grows with them. It also does a whole
product in one call (row scaling, quantization, the second pass, rescale, bias) where the torch version runs about ten
ops. On a CPU with AMX it computes the same integer sums on the tile unit, where 2-8 rows cost about what one does.

It computes bitwise what `mars_core.engine.w8a8.W8A8Linear` computes through fbgemm (same quantization, exact int32
sums, fbgemm's rescale, the same fp32 epilogue; tests/test_vnni.py holds it to that on every SmolLM2 shape), so a
model's answers do not depend on which of the two ran. That is why it is chosen whenever it builds: where it
cannot (no AVX512-VNNI, no C++ compiler, another OS), w8a8 runs fbgemm and nothing else changes.

The build (mars_core.engine.native) is one g++ call against the installed torch's headers, once; the library is cached
under `MARS_CACHE_DIR`/kernels by a hash of the source, the torch version and the compiler flags.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from mars_core.engine.native import BASE_FLAGS, NativeOp

CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma")
OP = NativeOp(Path(__file__).with_name("vnni.cpp"), "mars_vnni",
              BASE_FLAGS + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"], CPU_FLAGS, "MARS_VNNI")

# load(): build (once) and load the kernel, True where `torch.ops.mars_vnni` is ready; it never raises, and a reason it
# is not available is kept for why_not(); w8a8 then runs another kernel (mars_core.engine.w8a8.pick_kernel)
why_not, cpu_supported = OP.why_not, OP.cpu_supported


def load() -> bool:
    """OP.load, and on a CPU with AMX the tile unit for its products (the same integer sums, so
    the same bits) unless MARS_AMX=0."""
    ok = OP.load()
    if ok and os.environ.get("MARS_AMX", "1") == "0":
        torch.ops.mars_vnni.use_amx(0)
    return ok


def amx_used() -> bool:
    """Whether the kernel multiplies several rows on AMX tiles here (a CPU with AMX-INT8, Linux letting the process
    use them, and MARS_AMX not 0)."""
    return load() and torch.ops.mars_vnni.use_amx(-1)
