"""finetune/'s three parts and the direction of their imports: the training library (finetune/) < the evaluation
suites (finetune/evals/) < the experiment drivers (finetune/recipes/).

These read the source (ast), so they hold for imports inside functions too, which an import-time check misses."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "finetune"
ORDER = ("library", "evals", "recipes")   # each part may import only itself and the parts before it
MAX_LINES = 500


def _part(dotted: str) -> str:
    """The part a finetune module belongs to: finetune.evals.x -> evals, finetune.recipes.x -> recipes, else library."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ORDER[1:] else "library"


def _module_of(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    names = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(names)


def _finetune_imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every finetune import in `path`: `from finetune import x` and
    `from finetune.evals import x` read as finetune.x and finetune.evals.x, relative imports resolved."""
    here = _module_of(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            if base.split(".")[0] != "finetune":
                continue
            if base in ("finetune", "finetune.evals", "finetune.recipes"):
                found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, base))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "finetune"]
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_lives_in_one_of_the_three_parts():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == ["evals", "recipes"], folders
    for part in ORDER[1:]:
        assert (PACKAGE / part / "__init__.py").is_file()
    for path in _modules():
        assert len(path.relative_to(PACKAGE).parts) <= 2, f"{path}: nested deeper than finetune/<part>/"


@pytest.mark.parametrize("part", ORDER)
def test_a_part_imports_only_itself_and_the_parts_before_it(part):
    allowed = set(ORDER[:ORDER.index(part) + 1])
    wrong = [f"{path.relative_to(REPO)}:{line} imports {dotted}"
             for path in _modules() if _part(_module_of(path)) == part
             for line, dotted in _finetune_imports(path) if _part(dotted) not in allowed]
    assert wrong == [], "\n".join(wrong)


def test_no_import_circles_among_finetune_modules():
    modules = {_module_of(p): p for p in _modules()}
    graph = {name: {d for _, d in _finetune_imports(path) if d in modules and d != name}
             for name, path in modules.items()}
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_wheel_lists_every_part():
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+

    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    parts = {f"finetune.{p.parent.name}" for p in PACKAGE.glob("*/__init__.py")}
    assert parts == {"finetune.evals", "finetune.recipes"} and parts | {"finetune"} <= set(packages), packages


def test_no_finetune_module_is_over_500_lines():
    long = [f"{p.relative_to(REPO)}: {n} lines" for p in _modules()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert long == [], "\n".join(long)


@pytest.mark.parametrize("module", [
    "finetune.train",
    "finetune.recipes.recipe",
    "finetune.recipes.recipe_smollm2",
    "finetune.recipes.ab",
    "finetune.recipes.distill",
    "finetune.recipes.export_adapter",
    "finetune.recipes.export_delta",
    "finetune.evals.evaluate",
    "finetune.evals.devscore",
    "finetune.evals.natural",
    "finetune.evals.structured",
])
def test_the_commands_run_from_their_new_homes(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout
