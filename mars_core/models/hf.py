"""Where transformers finds MARS decoding: the folder to pass as `model.generate(..., custom_generate=...)`.

transformers wants a folder that holds `custom_generate/generate.py`. In a checkout that is the repository
root; `pip install .` ships the same file as `mars_core/custom_generate/generate.py`, so there it is the
installed `mars_core` folder.
"""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]   # mars_core/
_CANDIDATES = (_PACKAGE, _PACKAGE.parent)   # installed package first, then the checkout


def custom_generate_path() -> str:
    """The folder to pass as `custom_generate=` (with `trust_remote_code=True`, which you pass yourself)."""
    for folder in _CANDIDATES:
        if (folder / "custom_generate" / "generate.py").is_file():
            return str(folder)
    raise FileNotFoundError(
        f"custom_generate/generate.py is in neither {_CANDIDATES[0]} nor {_CANDIDATES[1]}: reinstall "
        "mars-playground (`pip install .` from a checkout) or pass the path of a checkout")
