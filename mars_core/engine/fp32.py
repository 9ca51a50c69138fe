"""fp32 products of our own for the lean forward's float32 loop (`mars_core/engine/fp32.cpp`), built on first use.

A decoding step multiplies 1 to ~15 rows by each weight. MKL's fp32 GEMM for so few rows of a small model's
matrices is far from the core's FMA peak (on an AVX2 AMD EPYC a few rows of tiny-mars cost several times one:
docs/experiments/cpu-speed-issue-27.md, "One mask per group"), and its per-row results may change with the number of
rows. This kernel reads each packed weight panel once for up to three rows and sums every row in one fixed order, so a
product's row is the same bits whatever other rows share the call (attention, still torch's fp32 ops, is what can make a
position's logits depend on the rest of the forward). Its sums are ordered differently from MKL's, so logits differ from
transformers' in the last bits, as MKL's own do.

Chosen where it builds (AVX2 and FMA, a C++ compiler, Linux) unless MARS_FP32=0; elsewhere the loop multiplies with
torch's `@` as before. Built by mars_core.engine.native.
"""
from __future__ import annotations

from pathlib import Path

from mars_core.engine.native import BASE_FLAGS, NativeOp

CPU_FLAGS = ("avx2", "fma")
OP = NativeOp(Path(__file__).with_name("fp32.cpp"), "mars_fp32", BASE_FLAGS + ["-mavx2", "-mfma"], CPU_FLAGS,
              "MARS_FP32")

# load(): build (once) and load the kernel, True where `torch.ops.mars_fp32` is ready; it never raises
load, why_not, cpu_supported = OP.load, OP.why_not, OP.cpu_supported
