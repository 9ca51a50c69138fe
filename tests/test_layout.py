"""mars_core's four parts and the direction of their imports: decode < engine < models < tools.

These read the source (ast), so they hold for imports inside functions too, which an import-time check misses."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mars_core"
ORDER = ("decode", "engine", "models", "tools")   # each part may import only the parts before it


def _mars_imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every mars_core import in `path`, `from mars_core import x` read as mars_core.x."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mars_core":
            if node.module == "mars_core":
                found += [(node.lineno, f"mars_core.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "mars_core"]
    return found


def _part_of(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ORDER else None


def test_every_module_lives_in_one_of_the_four_parts():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert loose == [], f"modules outside decode/engine/models/tools: {loose}"
    for part in ORDER:
        assert (PACKAGE / part / "__init__.py").is_file()


@pytest.mark.parametrize("part", ORDER)
def test_a_part_imports_only_the_parts_before_it(part):
    allowed = set(ORDER[:ORDER.index(part) + 1])
    wrong = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {dotted}"
             for path in sorted((PACKAGE / part).glob("*.py")) for line, dotted in _mars_imports(path)
             if _part_of(dotted) not in allowed]
    assert wrong == [], "\n".join(wrong)


def test_the_decoder_sees_no_engine_internals():
    """decode/ is the algorithm alone: what custom_generate vendors. A backend reaches it only as an object."""
    for path in sorted((PACKAGE / "decode").glob("*.py")):
        for line, dotted in _mars_imports(path):
            assert dotted.startswith("mars_core.decode."), f"{path.name}:{line} imports {dotted}"


def test_the_public_api_names_import_from_the_top():
    out = subprocess.run(
        [sys.executable, "-c",
         "from mars_core import (load_model, generate, generate_stream, DecodeConfig, TauControl, wrap_model,\n"
         "    reference_generate, StepEvent, SequenceResult, custom_generate_path, DEFAULT_MODEL, KNOWN_MODELS)"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import mars_core
    for name in mars_core.__all__:
        assert getattr(mars_core, name) is not None
    assert importlib.import_module("mars_core.decode.config").DecodeConfig is mars_core.DecodeConfig


def test_importing_the_catalogue_does_not_import_torch():
    """The parts' __init__ files stay empty of imports, so the app's startup and --help stay quick."""
    out = subprocess.run([sys.executable, "-c", "import sys, mars_core.models.catalogue, mars_core.models.textfile, "
                          "mars_core.tools.timing; print('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_the_old_flat_module_names_are_gone():
    """No shim modules: `mars_core.loading` and friends would hide a stale import behind a working one."""
    for old in ("loading", "decoding", "lean", "bench", "cli"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"mars_core.{old}")
