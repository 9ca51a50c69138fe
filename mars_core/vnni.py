"""w8a8's products through a small AVX512-VNNI kernel of our own (`mars_core/vnni.cpp`), built on first use.

fbgemm's dynamic int8 linear, w8a8's default kernel, costs more the more rows it multiplies: on an AVX512-VNNI
CPU a 7-position forward took ~1.5 times a 1-position one, and that ratio is what MARS's extra positions pay
(docs/experiments.md, "the VNNI kernel"). This kernel reads each weight block once for up to 24 rows, so the
weights' memory traffic, which dominates at a few rows, no longer grows with them. It also does a whole product in
one call (row scaling, quantization, the second pass, rescale, bias) where the torch version runs about ten ops.

It computes bitwise what `mars_core.w8a8.W8A8Linear` computes through fbgemm (same quantization, exact int32
sums, fbgemm's rescale, the same fp32 epilogue; tests/test_vnni.py holds it to that on every SmolLM2 shape), so a
model's answers do not depend on which of the two ran. That is why it is chosen whenever it builds: where it
cannot (no AVX512-VNNI, no C++ compiler, another OS), w8a8 runs fbgemm and nothing else changes.

The build is one g++ call against the installed torch's headers (~30 s, once); the library is cached under
`MARS_CACHE_DIR`/kernels by a hash of the source, the torch version and the compiler flags.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("vnni.cpp")
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma",
         "-ffp-contract=off", "-fno-math-errno"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma")
_STATE: dict = {}   # "ok": bool, "why": str (the reason it is not available)
_LOCK = threading.Lock()   # the app may load two w8a8 models from two threads: one build, one load


def cpu_supported() -> bool:
    """Whether this CPU has the instructions the kernel is compiled for (Linux's /proc/cpuinfo; else False)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return all(f in flags for f in CPU_FLAGS)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _library_path(cxx: str) -> Path:
    from mars_core.sources import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([torch.__version__, cxx, *FLAGS]).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"mars_vnni-{key}.so"


def _build(cxx: str, target: Path) -> None:
    """Compile vnni.cpp into `target`, atomically: a half-written library never sits at the cached path."""
    from torch.utils import cpp_extension

    torch_lib = str(Path(torch.__file__).parent / "lib")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [cxx, *FLAGS, abi, *includes, str(SOURCE), "-o", str(out), f"-L{torch_lib}", "-lc10", "-ltorch_cpu",
               f"-Wl,-rpath,{torch_lib}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            raise RuntimeError(errors[0].strip() if errors else f"{cxx} exited with {done.returncode}")
        os.replace(out, target)


def load() -> bool:
    """Build (once) and load the kernel; True where `torch.ops.mars_vnni` is ready. Never raises: a reason it is
    not available is kept for `why_not()`, and w8a8 then runs fbgemm."""
    with _LOCK:
        if "ok" not in _STATE:
            _STATE.update(_load())
        return _STATE["ok"]


def _load() -> dict:
    state = {"ok": False, "why": ""}
    cxx = _compiler()
    if os.environ.get("MARS_VNNI", "1") == "0":
        state["why"] = "MARS_VNNI=0"
    elif not sys.platform.startswith("linux") or not cpu_supported():
        state["why"] = f"this CPU lacks one of {', '.join(CPU_FLAGS)}"
    elif cxx is None:
        state["why"] = "no C++ compiler (g++ or $CXX) on PATH"
    else:
        try:
            path = _library_path(cxx)
            if not path.exists():
                _build(cxx, path)
            torch.ops.load_library(str(path))
            state["ok"] = True
        except (OSError, RuntimeError, ValueError) as e:
            state["why"] = f"building it failed: {e}"
    return state


def why_not() -> str:
    """Why the kernel is not in use ('' when it is)."""
    load()
    return _STATE["why"]


class VnniWeights:
    """One product's int8 weight in the kernel's layout, and its rescale: `scale` = fp32(2/255 * w_scale) per
    channel, the product fbgemm multiplies its int32 sums by."""

    def __init__(self, q: torch.Tensor, w_scale: torch.Tensor, step: torch.Tensor):
        self.packed = torch.ops.mars_vnni.pack(q.contiguous())
        self.scale = (step * w_scale.float()).contiguous()
