"""lm-eval with our decoder (finetune/evals/lm_eval_mars.py): the local tasks in tests/lm_eval_task (generate_until,
multiple choice, rolling log-likelihood) on the embedded tiny-mars, offline. τ = 1 scores exactly like AR, lossless
MARS too; generation at τ = 1 equals lm-eval's own transformers model (`--model hf`), and so do the
log-likelihoods; the command prints tokens per forward and writes them into the results JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval",
                    reason="lm-eval is not installed (the [eval] extra): pip install -r requirements-dev.txt")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from finetune.evals import lm_eval_mars  # noqa: E402  (registers --model mars)

REPO = Path(__file__).resolve().parent.parent
TASK_DIR = REPO / "tests" / "lm_eval_task"
TASKS = ["mars_tiny_gen", "mars_tiny_mc", "mars_tiny_ppl"]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module", autouse=True)
def offline():
    old = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def tasks():
    return TaskManager(include_path=str(TASK_DIR))


def evaluate(tasks, model: str, model_args: str, names=TASKS, batch_size: int = 1) -> dict:
    return simple_evaluate(model=model, model_args=model_args, tasks=list(names), task_manager=tasks,
                           apply_chat_template=True, log_samples=True, device="cpu", batch_size=batch_size,
                           bootstrap_iters=0)


def responses(out: dict, task: str) -> list:
    """Each document's raw model responses (generated text, or (logprob, is_greedy) per choice)."""
    return [s["resps"] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]


def scored(resps: list) -> list[tuple[float, object]]:
    """One document's score responses as (logprob, is_greedy or None) per request."""
    out = []
    for (r,) in resps:   # one response per request
        out.append((float(r[0]), r[1]) if isinstance(r, (list, tuple)) else (float(r), None))
    return out


def scores(out: dict) -> dict:
    return {t: {k: v for k, v in r.items() if "stderr" not in k} for t, r in out["results"].items()}


@pytest.fixture(scope="module")
def runs(tasks) -> dict:
    """Each decoding mode of --model mars through lm-eval on the local tasks (tiny-mars, fp32); tens of seconds on
    one core, so the tests that read it are marked slow."""
    base = "model=tiny-mars,dtype=float32,block_size=4"
    args = {"ar": "mode=ar", "tau1": "mode=mars,tau=1.0", "mars": "mode=mars,tau=0.95",
            "lossless": "mode=lossless,tau=0.9"}
    return {name: evaluate(tasks, "mars", f"{base},{a}") for name, a in args.items()}


@pytest.mark.slow
def test_tau_one_scores_exactly_like_ar_on_every_task(runs):
    ar, one = runs["ar"], runs["tau1"]
    assert scores(one) == scores(ar)
    for task in TASKS:
        assert responses(one, task) == responses(ar, task)
    assert ar["results"]["mars_tiny_gen"]["exact_match,answer-line"] > 0.5   # the task really scores answers


@pytest.mark.slow
def test_lossless_mars_scores_exactly_like_ar_and_writes_several_tokens_per_forward(runs):
    assert scores(runs["lossless"]) == scores(runs["ar"])
    assert responses(runs["lossless"], "mars_tiny_gen") == responses(runs["ar"], "mars_tiny_gen")
    assert runs["lossless"]["config"]["tokens_per_forward"]["mars_tiny_gen"]["tokens_per_forward"] > 1.5


@pytest.mark.slow
def test_tokens_per_forward_is_in_the_results_one_for_ar_and_above_one_for_mars(runs):
    per = {name: out["config"]["tokens_per_forward"] for name, out in runs.items()}
    for name in ("ar", "tau1"):
        gen = per[name]["mars_tiny_gen"]
        assert gen["tokens_per_forward"] == 1.0 and gen["tokens"] == gen["forwards"] and gen["sequences"] == 8
    assert per["mars"]["mars_tiny_gen"]["tokens_per_forward"] > 2.0
    assert set(per["mars"]) == {"mars_tiny_gen"}   # scored tasks use the AR forward: nothing decoded there
    info = runs["mars"]["config"]["mars"]
    assert (info["mode"], info["tau"], info["block_size"], info["device"]) == ("mars", 0.95, 4, "cpu")
    # the multiple-choice and perplexity tasks never depend on the decoding mode
    assert scores(runs["mars"])["mars_tiny_mc"] == scores(runs["ar"])["mars_tiny_mc"]


@pytest.mark.slow
def test_batched_requests_get_exactly_their_answers_alone(runs, tasks):
    """--batch_size 3: generations decode three rows at a time (8 requests: batches of 3, 3, 2) and scores run
    three per forward, right-padded; every document's response is the one it got alone, in its own place."""
    batched = evaluate(tasks, "mars", "model=tiny-mars,dtype=float32,block_size=4,mode=mars,tau=0.95", batch_size=3)
    assert responses(batched, "mars_tiny_gen") == responses(runs["mars"], "mars_tiny_gen")
    mine = [scored(r) for r in responses(batched, "mars_tiny_mc")]
    alone = [scored(r) for r in responses(runs["mars"], "mars_tiny_mc")]
    for a, b in zip(mine, alone):   # a padded batch may round differently in the last bits
        assert [lp for lp, _ in a] == pytest.approx([lp for lp, _ in b], rel=1e-5, abs=1e-5)
    assert batched["config"]["tokens_per_forward"] == runs["mars"]["config"]["tokens_per_forward"]


@pytest.mark.slow
def test_generation_and_log_likelihoods_equal_lm_evals_own_transformers_model(runs, tasks):
    """lm-eval's `hf` model on the same checkpoint: the same greedy texts as our τ = 1, the same scores."""
    hf = evaluate(tasks, "hf", f"pretrained={REPO / 'assets' / 'tiny-mars'},dtype=float32")
    ours = runs["tau1"]
    assert responses(ours, "mars_tiny_gen") == responses(hf, "mars_tiny_gen")
    for task in ("mars_tiny_mc", "mars_tiny_ppl"):
        mine, theirs = [scored(r) for r in responses(ours, task)], [scored(r) for r in responses(hf, task)]
        assert len(mine) == len(theirs) and all(len(a) == len(b) for a, b in zip(mine, theirs))
        for a, b in zip(mine, theirs):
            assert [lp for lp, _ in a] == pytest.approx([lp for lp, _ in b], rel=1e-5, abs=1e-5)
            assert [g for _, g in a] == [g for _, g in b]   # is_greedy (None for a rolling score)
    assert scores(ours)["mars_tiny_mc"]["acc,none"] == scores(hf)["mars_tiny_mc"]["acc,none"] == 1.0


@pytest.mark.slow
def test_the_command_runs_lm_evals_cli_with_mars_registered_and_prints_tokens_per_forward(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "finetune.evals.lm_eval_mars", "--model", "mars", "--model_args",
         "model=tiny-mars,tau=0.95,block_size=4,mode=mars,dtype=float32", "--tasks", "mars_tiny_gen",
         "--include_path", str(TASK_DIR), "--apply_chat_template", "--limit", "3", "--output_path", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **OFFLINE})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "|mars_tiny_gen|" in out.stdout and "exact_match" in out.stdout          # lm-eval's own table
    row = next(line for line in out.stdout.splitlines() if line.startswith("|tiny-mars|mars|0.95|4|mars_tiny_gen|"))
    assert float(row.split("|")[6]) > 2.0 and row.split("|")[7] == "3"
    assert "tokens per forward" in out.stderr                                     # logged when the task finishes
    results = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    assert results["config"]["tokens_per_forward"]["mars_tiny_gen"]["sequences"] == 3


@pytest.mark.parametrize("model_args, word", [
    ("model=tiny-mars,tau=0", "tau=0"),
    ("model=tiny-mars,mode=fast", "mode='fast'"),
    ("model=tiny-mars,temp=1", "temp=1"),
    ("model=no-such-model-here", "no-such-model-here"),
    ("model=tiny-mars,dtype=float13", "float13"),
    ("model=tiny-mars,batch_size=auto", "batch_size='auto'"),
])
def test_bad_model_args_exit_2_with_one_line_naming_the_value(model_args, word, capsys):
    """Checked before lm-eval reads its task index (seconds of work): nothing loads, one line, exit 2."""
    code = lm_eval_mars.main(["--model", "mars", "--model_args", model_args, "--tasks", "mars_tiny_gen",
                              "--include_path", str(TASK_DIR)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: --model mars:") and word in err[-1]


def test_an_unsupported_generation_kwarg_is_named_with_the_fix():
    lm = lm_eval_mars.MarsLM(model="tiny-mars", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"\['top_k'\] are not supported.*drop them"):
        lm._config({"until": ["\n"], "top_k": 5})
    cfg, until = lm._config({"until": "\n\n", "max_gen_toks": 7})
    assert until == ["\n\n"] and cfg.max_new_tokens == 7 and cfg.stop_strings == ("\n\n",) and cfg.temperature == 0


def test_the_eval_extra_pins_the_lm_eval_that_requirements_dev_installs():
    import re   # (tomllib is 3.11+; the project supports 3.10)

    from packaging.requirements import Requirement

    line = re.search(r"^eval = \[(.*)\]", (REPO / "pyproject.toml").read_text(), re.M)
    extra = json.loads(f"[{line.group(1)}]")
    dev = [line.split(" #")[0].strip() for line in (REPO / "requirements-dev.txt").read_text().splitlines()]
    pins = {Requirement(r).name: str(Requirement(r).specifier) for r in extra + [d for d in dev if d and d[0] != "-"]}
    assert [Requirement(r).name for r in extra] == ["lm-eval"] and pins["lm-eval"].startswith("==")
    assert str(Requirement(extra[0]).specifier) == pins["lm-eval"]
    from importlib.metadata import version
    assert "==" + version("lm_eval") == pins["lm-eval"]   # the version these tests ran against
