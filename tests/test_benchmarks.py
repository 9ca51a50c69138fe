"""benchmarks/gpu.sh, the prepared GPU benchmark, runs the same bench commands on any device: here its quick
form on the CPU, which must write one JSON run in bf16 at batch 1, 4 and 16 with AR == transformers."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_benchmark_script_runs_on_a_cpu_and_writes_bf16_rows_at_batch_1_4_16(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "QUICK": "1", "OUT": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads((tmp_path / "tiny-mars.json").read_text())
    assert run["dtype"] == "bfloat16" and run["device"] == "cpu"
    assert [r["batch_size"] for r in run["rows"]] == [1, 4, 16]
    assert all(r["hf_equals_ar"] for r in run["rows"])
    assert all(r["tokens_per_forward"] > 1.5 for r in run["rows"])   # tiny-mars really decodes several per forward


@pytest.mark.slow
def test_products_benchmark_times_each_side_or_says_why_it_cannot(tmp_path):
    """benchmarks/products.py: a table row per side that runs here, with our w8a16 rows independent of each other
    where its kernel builds, and a one-line reason for each side that cannot run (ONNX Runtime is not a dependency)."""
    sides = ["w8a16", "int8", "fp32", "ort-int4"]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "products.py"), "--rows", "1", "2", "--rounds",
                           "1", "--sides", *sides], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    rows = {line.split(" | ")[0]: line.split(" | ") for line in lines if " | " in line}
    skipped = {line.split(":")[0] for line in lines if ": skipped (" in line}
    assert set(rows) - {"side", "----"} | skipped == set(sides), done.stdout
    assert "fp32" in rows and float(rows["fp32"][1].split()[0]) > 0
    from mars_core.engine import avx2
    if avx2.WIDE.load():
        assert rows["w8a16"][-2] == "yes", rows["w8a16"]
