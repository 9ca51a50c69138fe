"""w8a8's products through a small AVX2 kernel of our own (`mars_core/engine/avx2.cpp`), built on first use.

On a CPU without AVX512-VNNI, fbgemm multiplies int8 by int8 with vpmaddubsw, whose int16 pair sums saturate: its
w8a8 products are not exact there (on an AVX2 AMD EPYC, several times the relative error of the exact product:
docs/experiments/amx-and-kernels.md, "fbgemm's int8 sums are not exact here"). This kernel widens the bytes to int16
first (vpmaddwd), so its int32 sums are exact, and it computes bitwise what mars_core/engine/vnni.cpp computes on an
AVX512-VNNI CPU, so a model's answers in w8a8 are the same on both. Like that kernel it does a whole product in one call
(the torch version runs about ten ops around fbgemm, which on one thread of a slow core cost more than the small
products themselves) and skips the second pass on a lossless step's mask positions (`tail`).

Chosen where the VNNI kernel cannot run and this one builds (AVX2 and FMA, a C++ compiler, Linux); built by
mars_core.engine.native.
"""
from __future__ import annotations

from pathlib import Path

from mars_core.engine.native import BASE_FLAGS, NativeOp

CPU_FLAGS = ("avx2", "fma")
OP = NativeOp(Path(__file__).with_name("avx2.cpp"), "mars_avx2", BASE_FLAGS + ["-mavx2", "-mfma"], CPU_FLAGS,
              "MARS_AVX2")

# load(): build (once) and load the kernel, True where `torch.ops.mars_avx2` is ready; it never raises, and a reason it
# is not available is kept for why_not(); w8a8 then runs another kernel (mars_core.engine.w8a8.pick_kernel)
load, why_not, cpu_supported = OP.load, OP.why_not, OP.cpu_supported

# The same source built as w8a16 (`torch.ops.mars_avx2w`, dtype="w8a16"): int16 activation levels, one pass, where
# w8a8 multiplies the products of TWO_PASS twice (mars_core/engine/avx2.cpp, MARS_WIDE). Switched off with the same
# MARS_AVX2=0.
WIDE = NativeOp(OP.source, "mars_avx2w", OP.flags + ["-DMARS_WIDE"], CPU_FLAGS, "MARS_AVX2")
