"""mars_core/native.py, which builds our C++ kernels on first use: a failed build is a reason, never an error,
and leaves nothing half-written in the cache."""
import pytest

import mars_core.avx2 as avx2
import mars_core.vnni as vnni


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
    import mars_core.native as native

    monkeypatch.setattr(native, "cpu_flags", lambda: ["fpu", "sse2"])
    for kernel in (vnni, avx2):
        monkeypatch.setattr(kernel.OP, "state", {})
        assert not kernel.load() and kernel.why_not().startswith("this CPU lacks one of")
