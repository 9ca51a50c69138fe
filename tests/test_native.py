"""mars_core/engine/native.py, which builds our C++ kernels on first use: a failed build is a reason, never an error,
and leaves nothing half-written in the cache."""
import pytest

import mars_core.engine.avx2 as avx2
import mars_core.engine.vnni as vnni


@pytest.mark.parametrize("kernel", [vnni, avx2], ids=["vnni", "avx2"])
def test_a_failed_build_is_a_reason_not_an_error(kernel, monkeypatch, tmp_path):
    if not kernel.cpu_supported():
        pytest.skip(f"this CPU lacks {', '.join(kernel.CPU_FLAGS)}: the build is never tried here")
    monkeypatch.setattr(kernel.OP, "state", {})
    monkeypatch.setenv("MARS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")   # a "compiler" on PATH that fails
    assert not kernel.load() and kernel.why_not().startswith("building it failed")
    assert not list(tmp_path.rglob("*.so"))                                   # nothing half-written is kept


def test_a_cpu_without_the_instructions_is_a_reason(monkeypatch):
    import mars_core.engine.native as native

    monkeypatch.setattr(native, "cpu_flags", lambda: ["fpu", "sse2"])
    for kernel in (vnni, avx2):
        monkeypatch.setattr(kernel.OP, "state", {})
        assert not kernel.load() and kernel.why_not().startswith("this CPU lacks one of")


@pytest.mark.slow
@pytest.mark.parametrize("kernel", [vnni, avx2], ids=["vnni", "avx2"])
def test_a_fresh_machine_builds_the_kernel_from_source(kernel, tmp_path):
    """The cached library hides the build from every other test: here a new process with an empty cache compiles
    the kernel's source with g++ and loads it, as on a user's first w8a8 load."""
    import os
    import subprocess
    import sys

    if not kernel.cpu_supported():
        pytest.skip(f"this CPU lacks {', '.join(kernel.CPU_FLAGS)}: the build is never tried here")
    env = dict(os.environ, MARS_CACHE_DIR=str(tmp_path))
    env.pop(kernel.OP.switch, None)
    code = f"import {kernel.__name__} as k, sys; ok = k.load(); print(k.why_not()); sys.exit(0 if ok else 1)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(list((tmp_path / "kernels").glob(f"{kernel.OP.name}-*.so"))) == 1
