"""The installable package: `pip install .` of a copy of the project into a fresh folder, then its console scripts
and modules run from outside the repository (offline: --no-index, --no-deps, --no-build-isolation)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
PROJECT = ("pyproject.toml", "requirements.txt", "README.md", "mars_core", "finetune", "app", "assets",
           "custom_generate")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("package")
    src = root / "src"
    src.mkdir()
    for name in PROJECT:    # a copy, so the build leaves nothing (build/, *.egg-info) in the checkout
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    target = root / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
                           "--no-cache-dir", "--target", str(target), str(src)],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("MARS_ASSETS", "PYTHONPATH")}
    env.update(PYTHONPATH=str(target), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    work = root / "elsewhere"          # the current directory: neither the checkout nor the install
    work.mkdir()
    return target, env, work


def run(cmd, env, cwd, timeout=240):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_packages_console_scripts_and_embedded_models_are_installed(installed):
    target, env, work = installed
    for name in ("mars_core/decode/decoding.py", "mars_core/models/export.py", "finetune/train.py", "app/launch.py",
                 "mars_core/assets/tiny-mars/model.safetensors", "mars_core/assets/tiny-ar-sft/config.json",
                 "mars_core/assets/smollm2-mars/adapter.safetensors", "mars_core/assets/prompts/tasks-heldout.txt",
                 "mars_core/custom_generate/generate.py", "mars_core/custom_generate/requirements.txt",
                 "bin/mars", "bin/mars-playground"):
        assert (target / name).is_file(), name
    where = run([sys.executable, "-c", "import mars_core.models.sources as l, finetune.train, app.launch; "
                 "print(l.__file__); print(l.ASSETS); print(app.launch.__file__)"], env, work)
    assert where.returncode == 0, where.stderr[-2000:]
    assert all(line.startswith(str(target)) for line in where.stdout.split()), where.stdout


def test_requirements_are_requirements_txt_exactly(installed):
    target, _, _ = installed
    meta = next(target.glob("mars_playground-*.dist-info")) / "METADATA"
    declared = [line.split(":", 1)[1].strip() for line in meta.read_text().splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]   # optional extras ([eval]) aside
    pins = [line.strip() for line in (REPO / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    parse = lambda specs: sorted((r.name, str(r.specifier)) for r in map(Requirement, specs))
    assert parse(declared) == parse(pins) and ("torch", ">=2.4") in parse(declared)


@pytest.mark.slow
def test_mars_help_and_a_tiny_generate_from_the_installed_script(installed):
    target, env, work = installed
    helped = run([str(target / "bin" / "mars"), "--help"], env, work)
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert all(word in helped.stdout for word in ("generate", "bench", "export"))
    done = run([str(target / "bin" / "mars"), "generate", "--prompt", "What is 17 + 25?", "--max-new-tokens", "8",
                "--device", "cpu", "--json"], env, work)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["model"] == str(target / "mars_core" / "assets" / "tiny-mars")
    assert 1 <= len(out["token_ids"]) <= 8 and out["forwards"] < len(out["token_ids"])   # MARS: > 1 per pass
    app_help = run([str(target / "bin" / "mars-playground"), "--help"], env, work)
    assert app_help.returncode == 0 and "--runs-dir" in app_help.stdout, app_help.stderr[-2000:]


@pytest.mark.slow
def test_missing_assets_name_mars_assets(installed, tmp_path):
    target, env, work = installed
    done = run([sys.executable, "-m", "mars_core", "generate", "--prompt", "hi", "--device", "cpu"],
               {**env, "MARS_ASSETS": str(tmp_path / "nowhere")}, work)
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert str(tmp_path / "nowhere") in line and "MARS_ASSETS" in line


CUSTOM_GENERATE = """
import json, torch
from mars_core import DecodeConfig, generate, load_model
from mars_core import custom_generate_path
lm = load_model("tiny-mars", device="cpu", cpu_layout=False)
ids = torch.tensor([lm.encode("What is 17 + 25?")])
out = lm.model.generate(ids, custom_generate=custom_generate_path(), trust_remote_code=True, tau=0.95,
                        mask_token_id=lm.mask_id, max_new_tokens=12, return_dict_in_generate=True)
ref = generate(lm, [ids[0].tolist()], DecodeConfig(tau=0.95, max_new_tokens=12))[0]
print(json.dumps({"path": custom_generate_path(), "same": out.sequences[0, ids.shape[1]:].tolist() == ref.token_ids,
                  "counts": out.accepted_counts[0]}))
"""


@pytest.mark.slow
def test_custom_generate_runs_from_the_installed_package(installed, tmp_path):
    target, env, work = installed
    done = run([sys.executable, "-c", CUSTOM_GENERATE], {**env, "HF_MODULES_CACHE": str(tmp_path / "modules")}, work)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["path"] == str(target / "mars_core") and out["same"] and max(out["counts"]) > 1
