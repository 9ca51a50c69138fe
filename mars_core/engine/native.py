"""Building and loading our two small C++ kernels (mars_core/engine/vnni.cpp, mars_core/engine/avx2.cpp) on first use.

Each is one g++ call against the installed torch's headers (once; its time: docs/experiments/amx-and-kernels.md,
"The VNNI kernel"). The library is cached under
`MARS_CACHE_DIR`/kernels by a hash of the source (with mars_core's headers), the torch version and the compiler
flags, and written atomically, so a half-built library never sits at the cached path. Loading never raises: where
a kernel cannot be had (switched off, wrong CPU or OS, no compiler, a failed build) the reason is kept and w8a8
runs another kernel.
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

BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno"]


def cpu_flags() -> list[str]:
    """This CPU's instruction-set flags (Linux's /proc/cpuinfo; else none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])


class NativeOp:
    """One C++ source built into a torch op library: `load()` (True once its ops are registered), `why_not()`."""

    def __init__(self, source: Path, name: str, flags: list[str], cpu: tuple[str, ...], switch: str):
        self.source, self.name, self.flags, self.cpu, self.switch = source, name, flags, cpu, switch
        self.state: dict = {}   # "ok": bool, "why": str (the reason it is not available)
        self.lock = threading.Lock()   # the app may load two w8a8 models from two threads: one build, one load

    def cpu_supported(self) -> bool:
        flags = cpu_flags()
        return all(f in flags for f in self.cpu)

    def load(self) -> bool:
        with self.lock:
            if "ok" not in self.state:
                self.state.update(self._load())
            return self.state["ok"]

    def why_not(self) -> str:
        self.load()
        return self.state["why"]

    def _load(self) -> dict:
        state = {"ok": False, "why": ""}
        cxx = shutil.which(os.environ.get("CXX", "g++"))
        if os.environ.get(self.switch, "1") == "0":
            state["why"] = f"{self.switch}=0"
        elif not sys.platform.startswith("linux") or not self.cpu_supported():
            state["why"] = f"this CPU lacks one of {', '.join(self.cpu)}"
        elif cxx is None:
            state["why"] = "no C++ compiler (g++ or $CXX) on PATH"
        else:
            try:
                path = self.library_path(cxx)
                if not path.exists():
                    self._build(cxx, path)
                torch.ops.load_library(str(path))
                state["ok"] = True
            except (OSError, RuntimeError, ValueError) as e:
                state["why"] = f"building it failed: {e}"
        return state

    def library_path(self, cxx: str) -> Path:
        from mars_core.engine.cache import cache_dir

        headers = b"".join(h.read_bytes() for h in sorted(self.source.parent.glob("*.h")))   # what it #includes
        key = self.source.read_bytes() + headers + " ".join([torch.__version__, cxx, *self.flags]).encode()
        return cache_dir() / "kernels" / f"{self.name}-{hashlib.sha256(key).hexdigest()[:16]}.so"

    def _build(self, cxx: str, target: Path) -> None:
        from torch.utils import cpp_extension

        torch_lib = str(Path(torch.__file__).parent / "lib")
        abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
        includes = [f"-I{p}" for p in cpp_extension.include_paths()]
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [cxx, *self.flags, abi, *includes, str(self.source), "-o", str(out), f"-L{torch_lib}", "-lc10",
                   "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
                raise RuntimeError(errors[0].strip() if errors else f"{cxx} exited with {done.returncode}")
            os.replace(out, target)
