"""finetune.host_memory: a CPU trainer keeps its freed memory instead of page-faulting it back every step."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import finetune.train as train_cli
from finetune.host_memory import _glibc

REPO = Path(__file__).resolve().parent.parent

# A training step's pattern: a dozen float32 tensors of 12-52 MB (364 MiB in all) held together, then freed, four
# times over (the allocator a step uses: torch's, through glibc). Reports the minor page faults of each round (pages
# the kernel had to hand over and zero) and the bytes glibc held in blocks of their own mapping in the last one.
PROBE = r"""
import ctypes, json, resource, sys
import torch
import finetune.host_memory as hm

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
torch.set_num_threads(1)
kept = hm.keep_freed_memory() if sys.argv[1] == "keep" else None
sizes = [(3 + i * 7 % 11) << 20 for i in range(12)]
faults, mapped = [], 0
for _ in range(4):
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [torch.ones(n) for n in sizes]
    mapped = libc.mallinfo2().hblkhd
    del held
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
print(json.dumps({"kept": kept, "faults": faults, "mapped": mapped, "pages": sum(sizes) * 4 // 4096}))
"""

glibc_only = pytest.mark.skipif(_glibc() is None or not hasattr(_glibc(), "mallinfo2"),
                                reason="glibc's malloc (2.33 or later, for mallinfo2) is what this setting tunes")


def probe(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def probe_after_program(module: str, argv: list[str]) -> dict:
    """`python -m module argv` run in a fresh process (as its entry point, `__main__`), then PROBE's rounds there."""
    script = PROBE.replace('kept = hm.keep_freed_memory() if sys.argv[1] == "keep" else None', f"""
import runpy
sys.argv = [{module!r}, *{argv!r}]
try:
    runpy.run_module({module!r}, run_name="__main__")
except SystemExit as stop:
    assert not stop.code, stop.code
kept = None
""")
    done = subprocess.run([sys.executable, "-c", script, "cli"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc_only
def test_a_steps_freed_tensors_are_reused_instead_of_page_faulted_in_again():
    default, kept = probe("default"), probe("keep")
    pages = default["pages"]
    # glibc's default: each tensor gets a mapping of its own, unmapped when freed: every round faults most pages in
    assert default["mapped"] > 0.25 * pages * 4096 and min(default["faults"]) > 0.5 * pages, default
    # kept: the tensors come from the heap, which keeps the pages: after the first round nearly all are reused
    assert kept["kept"] is True
    assert kept["mapped"] < 0.05 * pages * 4096 and min(kept["faults"][1:]) < 0.05 * pages, kept
    assert sum(kept["faults"][1:]) < 0.2 * sum(default["faults"][1:]), (kept, default)


def test_only_the_trainers_own_process_changes_the_policy(monkeypatch, tmp_path):
    # main() called in-process (tests, notebooks) must not retune the caller's malloc; the CLI entry point does,
    # on a CPU, unless --keep-freed-memory false.
    calls = []
    monkeypatch.setattr(train_cli, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(train_cli, "train", lambda cfg, stop, restart=False: 0)
    monkeypatch.setattr(train_cli, "uses_cpu", lambda: True)
    flags = ["--base-model", "tiny-mars", "--output-dir", str(tmp_path / "run")]
    assert train_cli.main(flags) == 0 and calls == []
    assert train_cli.main(flags, own_process=True) == 0 and calls == [1]
    assert train_cli.main([*flags, "--keep-freed-memory", "false"], own_process=True) == 0 and calls == [1]
    monkeypatch.setattr(train_cli, "uses_cpu", lambda: False)
    assert train_cli.main(flags, own_process=True) == 0 and calls == [1]


@glibc_only
def test_python_m_finetune_train_sets_it_in_its_own_process(tmp_path):
    # The module run as a program (what the app, accelerate launch and torchrun start), here with --dry-run so that
    # it returns at once; afterwards the same process runs PROBE's rounds.
    report = probe_after_program("finetune.train", ["--base-model", "tiny-mars", "--output-dir", str(tmp_path / "run"),
                                                    "--dry-run"])
    # glibc's defaults fault more than half the pages in each of rounds 2-4 (the test above): 1.5x pages or more
    pages = report["pages"]
    assert report["mapped"] < 0.05 * pages * 4096 and sum(report["faults"][1:]) < 0.3 * pages, report


def test_the_setting_changes_no_number_a_step_computes(tiny, tmp_path):
    # The same 3 MARS steps in two trainer processes, policy on and off: identical losses and weights.
    from safetensors.torch import load_file

    from tests.tiny_fixtures import train_flags, train_metrics

    runs = {}
    for keep in ("true", "false"):
        out = tmp_path / keep
        flags = train_flags(tiny, out, "--stage", "mars", "--max-steps", "3", "--lr", "3e-3", "--decay", "constant",
                            "--keep-freed-memory", keep)
        subprocess.run([sys.executable, "-m", "finetune.train", *flags], cwd=REPO, check=True, timeout=600)
        runs[keep] = out
    assert [r["loss"] for r in train_metrics(runs["true"])] == [r["loss"] for r in train_metrics(runs["false"])]
    a, b = (load_file(str(runs[k] / "checkpoint-3" / "model.safetensors")) for k in ("true", "false"))
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def _distill_flags(tmp_path, out_name: str) -> list[str]:
    from tests.test_distill import _tiny_model_dir

    model_dir = tmp_path / "m"
    if not model_dir.exists():
        _tiny_model_dir(model_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 + 3?\nSort in ascending order: 5, 1, 3\nName a colour.\n")
    return ["--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / out_name),
            "--max-new-tokens", "6", "--keep-truncated", "--device", "cpu"]


def test_only_the_distillers_own_process_on_a_cpu_changes_the_policy(monkeypatch, tmp_path):
    import finetune.recipes.distill as distill_cli

    calls = []
    monkeypatch.setattr(distill_cli, "keep_freed_memory", lambda: calls.append(1) or True)
    flags = _distill_flags(tmp_path, "a.jsonl")
    assert distill_cli.main(flags) == 0 and calls == []
    flags = _distill_flags(tmp_path, "b.jsonl")
    assert distill_cli.main(flags, own_process=True) == 0 and calls == [1]
    flags = _distill_flags(tmp_path, "c.jsonl")
    assert distill_cli.main([*flags, "--keep-freed-memory", "false"], own_process=True) == 0 and calls == [1]
    assert distill_cli.runs_on_cpu("cpu") and not distill_cli.runs_on_cpu("cuda")


@glibc_only
def test_python_m_distill_sets_it_in_its_own_process_and_writes_the_same_answers(tmp_path):
    # The distiller run as a program, then PROBE's rounds in that same process; and with the policy off, the same
    # bytes out.
    outs = {}
    for keep in ("true", "false"):
        flags = [*_distill_flags(tmp_path, f"{keep}.jsonl"), "--keep-freed-memory", keep]
        outs[keep] = probe_after_program("finetune.recipes.distill", flags)
    pages = outs["true"]["pages"]
    assert outs["true"]["mapped"] < 0.05 * pages * 4096 and sum(outs["true"]["faults"][1:]) < 0.3 * pages, outs
    assert outs["false"]["mapped"] > 0.25 * pages * 4096 and min(outs["false"]["faults"]) > 0.5 * pages, outs
    written = [(tmp_path / f"{keep}.jsonl").read_bytes() for keep in ("true", "false")]
    assert written[0] == written[1] and written[0].count(b"\n") == 3
