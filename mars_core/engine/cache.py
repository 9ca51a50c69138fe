"""The folder where mars_core keeps what it builds once: compiled kernels, the dtype probe, converted and merged
checkpoints, ONNX exports. In the engine part because the native kernels and the probe need it and sit below the
model loading that also uses it."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted checkpoints live (`MARS_CACHE_DIR`, else ~/.cache/mars-playground); an empty value counts
    as unset. Checked here, at first use, so a bad value is one ValueError naming it, not an OSError deep in a
    conversion."""
    value = os.environ.get("MARS_CACHE_DIR", "")
    if not value.strip():
        return Path.home() / ".cache" / "mars-playground"
    path = Path(value).expanduser()
    fix = "set MARS_CACHE_DIR to a writable folder, or unset it for ~/.cache/mars-playground"
    if path.exists() and not path.is_dir():
        raise ValueError(f"MARS_CACHE_DIR={value!r} is a file, not a folder: {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"MARS_CACHE_DIR={value!r} cannot be created ({e.strerror or e}): {fix}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"MARS_CACHE_DIR={value!r} is not writable: {fix}")
    return path
