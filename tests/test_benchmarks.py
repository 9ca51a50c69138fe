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
