"""The CLI contract: `python -m mars_core generate --json` and `bench` on a tiny local checkpoint."""
import json
import subprocess
import sys

import pytest

from tests.tiny_fixtures import make_model, make_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tok = make_tokenizer()
    make_model("llama", len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "mars_core", *args], capture_output=True, text=True, timeout=300)


def test_bench_reads_a_jsonl_prompts_file_as_distill_does(tmp_path, capsys):
    from mars_core.tools import cli

    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "no prompt key"}\n')
    assert cli.main(["bench", "--model", "no-such-model", "--prompts", str(bad)]) == 2   # read before any load
    assert f"{bad}:2: not a prompt row" in capsys.readouterr().err


def test_generate_json_contract(model_dir):
    out = run_cli("generate", "--model", str(model_dir), "--prompt", "What is 2+3?", "--tau", "0.9",
                  "--block-size", "4", "--max-new-tokens", "12", "--mode", "mars", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for key in ("model", "prompt_ids", "token_ids", "text", "forwards", "tokens_per_forward", "steps"):
        assert key in data
    assert data["model"] == str(model_dir.resolve())
    assert [t for s in data["steps"] for t in s] == data["token_ids"]
    assert data["forwards"] == len(data["steps"])
    assert data["tokens_per_forward"] == pytest.approx(len(data["token_ids"]) / data["forwards"])
    # The chat template was applied: the prompt ids start with <|im_start|>.
    assert data["prompt_ids"][0] == make_tokenizer().convert_tokens_to_ids("<|im_start|>")


def test_generate_plain_text_marks_forward_boundaries(model_dir):
    out = run_cli("generate", "--model", str(model_dir), "--prompt", "hi", "--mode", "ar", "--max-new-tokens", "5",
                  "--no-chat")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("|") == 5 and "5 forwards, 5 tokens, 1.00 tokens/forward" in out.stdout


def test_generate_lossless_with_every_draft_option_prints_ars_answer(capsys, monkeypatch):
    from types import SimpleNamespace

    from mars_core.tools import cli

    def answer(*extra):
        assert cli.main(["generate", "--model", "tiny-mars", "--prompt", "What is 17 + 25?", "--max-new-tokens", "40",
                         "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    ar = answer("--mode", "ar")
    for extra in (("--draft-layout", "quadratic"), ("--prompt-lookup", "3"),
                  ("--draft-layout", "quadratic", "--prompt-lookup", "3"), ("--draft-layout", "tree"),
                  ("--draft-layout", "tree", "--block-size", "2", "--tree-width", "3"), ("--draft-layout", "auto")):
        lossless = answer("--mode", "verify", "--tau", "0.3", *extra)
        assert lossless["token_ids"] == ar["token_ids"], extra
        # auto follows this machine's measured forward costs (under load drafting may not pay): checked below
        assert lossless["forwards"] < ar["forwards"] or extra == ("--draft-layout", "auto"), extra
        assert len(lossless["positions"]) == lossless["forwards"]
    assert cli.main(["generate", "--model", "tiny-mars", "--prompt", "What is 17 + 25?", "--max-new-tokens", "8",
                     "--mode", "verify", "--draft-layout", "auto"]) == 0
    assert "draft_layout auto: forward cost by positions 1.00 " in capsys.readouterr().err
    # on free positions (a flat measured curve) auto drafts, and saves forwards
    monkeypatch.setattr(cli, "row_costs", lambda lm, ids, max_rows, **kw: [SimpleNamespace(cost=1.0)] * max_rows)
    lossless = answer("--mode", "verify", "--tau", "0.3", "--draft-layout", "auto")
    assert lossless["token_ids"] == ar["token_ids"] and lossless["forwards"] < ar["forwards"]


def test_draft_options_outside_lossless_mode_exit_2_naming_the_value(capsys):
    from mars_core.tools import cli

    assert cli.main(["generate", "--model", "tiny-mars", "--prompt", "hi", "--mode", "mars",
                     "--draft-layout", "quadratic"]) == 2
    assert "draft_layout='quadratic' with mode='mars'" in capsys.readouterr().err
    assert cli.main(["bench", "--model", "tiny-mars", "--prompt-lookup", "-1"]) == 2
    assert "--prompt-lookup -1 must be >= 0" in capsys.readouterr().err
    assert cli.main(["bench", "--model", "tiny-mars", "--tree-width", "0"]) == 2
    assert "--tree-width 0 must be >= 1" in capsys.readouterr().err
    assert cli.main(["generate", "--model", "tiny-mars", "--prompt", "hi", "--mode", "verify", "--draft-layout", "tree",
                     "--tree-width", "0"]) == 2
    assert "tree_width=0 must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_errors_name_the_value(model_dir):
    out = run_cli("generate", "--model", str(model_dir), "--prompt", "hi", "--tau", "nan")
    assert out.returncode == 2 and "tau=nan" in out.stderr
    out = run_cli("generate", "--model", "no-such-model", "--prompt", "hi")
    assert out.returncode == 2 and "unknown model 'no-such-model'" in out.stderr


@pytest.mark.slow
def test_bench_prints_table_and_json(model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is 2+3?\nSort: c a b\nHello\n")
    out = run_cli("bench", "--model", str(model_dir), "--prompts", str(prompts), "--batch-sizes", "1", "2",
                  "--max-new-tokens", "8", "--repeats", "1", "--tau", "0.9", "--criterion", "margin")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[1].startswith("batch | transformers s | AR s | MARS s | tok/fwd")
    data = json.loads(lines[-1])
    assert [r["batch_size"] for r in data["rows"]] == [1, 2] and data["criterion"] == "margin"
    assert data["backend"] == "lean" and data["layout"] == "lean (fused)" and data["device"] == "cpu"   # CPU default
    for row in data["rows"]:
        assert row["speedup"] == pytest.approx(row["ar_time"] / row["mars_time"])
        assert row["forward_cost"] > 0 and row["reference_time"] > 0 and row["tokens_per_forward"] >= 1
        fastest = min(row["ar_time"], row["hf_time"])                     # speedups divide the fastest AR
        assert row["mars_speedup"] == pytest.approx(fastest / row["mars_time"])
        assert row["fastest_ar"] == ("transformers" if row["hf_time"] < row["ar_time"] else "ours")
        assert row["hf_equals_ar"] is True and row["verify_equals_ar"] is True   # fp32: the same tokens
        assert row["verify_speedup"] == pytest.approx(fastest / row["verify_time"])
        assert set(row["time_ranges"]) == {"transformers", "ar", "mars", "verify"}
        assert all(lo <= hi for lo, hi in row["time_ranges"].values())
        assert set(row["overhead_ms"]) == {"ar", "mars", "verify"}
        assert all(0 <= v < 1 for v in row["overhead_share"].values())
        assert len(row["draft_acceptance"]) == 3


def test_bench_decodes_with_the_chosen_criterion():
    # bench's MARS side must be the decoder under the same criterion: its tokens/forward equals generate()'s,
    # and on this model the criteria accept differently at τ = 0.5.
    from mars_core import DecodeConfig, generate, wrap_model
    from mars_core.tools.bench import BenchSettings, bench

    tok = make_tokenizer()
    lm = wrap_model(make_model("llama", len(tok)), tok)
    prompts = ["What is 2+3?", "Sort: c a b", "Hello"]
    tpf = {}
    for criterion in ("prob", "margin"):
        (row,) = bench(lm, prompts, BenchSettings(batch_sizes=(1,), tau=0.5, max_new_tokens=8, repeats=1,
                                                 reference=False, criterion=criterion))
        want = generate(lm, prompts, DecodeConfig(tau=0.5, max_new_tokens=8, criterion=criterion))
        assert row.tokens_per_forward == pytest.approx(sum(r.tokens_per_forward for r in want) / len(want))
        tpf[criterion] = row.tokens_per_forward
    assert tpf["prob"] != pytest.approx(tpf["margin"])


def test_bench_times_lossless_in_the_chosen_draft_layout():
    # the lossless side decodes with the layout asked for: AR's tokens, generate()'s tokens/forward, and the
    # quadratic layout feeds more columns per forward than the linear one
    from mars_core import DecodeConfig, generate, load_model
    from mars_core.tools.bench import BenchSettings, bench

    lm = load_model("tiny-mars", device="cpu")
    prompts = ["What is 17 + 25?", "Sort: pear fig apple", "Reverse the word: planet"]
    rows = {}
    for layout in ("linear", "quadratic"):
        (row,) = bench(lm, prompts, BenchSettings(batch_sizes=(1,), tau=0.3, max_new_tokens=24, repeats=1,
                                                 reference=False, transformers=False, draft_layout=layout))
        want = generate(lm, prompts, DecodeConfig(mode="verify", tau=0.3, max_new_tokens=24, draft_layout=layout))
        assert row.verify_equals_ar
        assert row.verify_tokens_per_forward == pytest.approx(sum(r.tokens_per_forward for r in want) / len(want))
        assert row.verify_forward_cost > 0
        rows[layout] = row
    assert rows["quadratic"].verify_positions_per_forward > rows["linear"].verify_positions_per_forward


@pytest.mark.slow
def test_bench_row_costs_times_every_row_count(model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is 2+3?\n")
    out = run_cli("bench", "--model", str(model_dir), "--prompts", str(prompts), "--row-costs", "--rounds", "3",
                  "--block-size", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1] == "rows | ms/forward | cost vs 1 row"
    assert "A MARS step after accepting all B = 3 feeds 5 rows" in out.stdout
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["rows"] for r in data["row_costs"]] == [1, 2, 3, 4, 5] and data["rounds"] == 3
    assert all(r["forward_ms"] > 0 for r in data["row_costs"])


def test_row_costs_times_each_count_on_the_same_prompt_cache_and_rejects_bad_counts():
    # Every timed forward must see exactly the prompt in the cache (the previous call's rows cropped away),
    # feed r positions after it and ask the LM head for min(r, B) rows, as a decoding step does.
    from mars_core import wrap_model
    from mars_core.tools.bench import row_costs

    tok = make_tokenizer()
    lm = wrap_model(make_model("llama", len(tok)), tok)
    prompt = lm.encode("What is 2+3?")
    seen, forward = [], lm.model.forward

    def spy(*args, **kwargs):
        if kwargs["cache"].get_seq_length() > 0:   # not the prompt's own forward
            seen.append((kwargs["cache"].get_seq_length(), kwargs["input_ids"].shape[1],
                         kwargs["position_ids"][0, 0].item(), len(kwargs["logits_to_keep"])))
        return forward(*args, **kwargs)

    lm.model.forward = spy
    rows = row_costs(lm, prompt, max_rows=5, block_size=3, rounds=2)
    assert [r.rows for r in rows] == [1, 2, 3, 4, 5]
    assert sorted(seen) == sorted((len(prompt), r, len(prompt), min(r, 3)) for r in [1, 2, 3, 4, 5] * 3)  # warm-up + 2
    with pytest.raises(ValueError, match="max_rows=0"):
        row_costs(lm, "hi", max_rows=0)
    with pytest.raises(ValueError, match="rounds=0.*--rounds"):
        row_costs(lm, "hi", rounds=0)
    with pytest.raises(ValueError, match="exceeds the context"):
        row_costs(lm, [5] * lm.context_length, max_rows=2)


@pytest.mark.parametrize("result, code", [(None, 0), ([{"rows": 1}], 0), (0, 0), (3, 3)])
def test_finetune_commands_exit_with_mains_int_code_else_0(result, code):
    from finetune.config import run_main

    with pytest.raises(SystemExit) as done:
        run_main(lambda: result)
    assert done.value.code == code


def test_finetune_commands_turn_bad_input_into_one_line_and_exit_2(capsys):
    from finetune.config import run_main

    def main():
        raise ValueError("--n -3 must be >= 1")

    with pytest.raises(SystemExit) as done:
        run_main(main)
    assert done.value.code == 2 and capsys.readouterr().err == "error: --n -3 must be >= 1\n"


def test_bench_times_both_backends_side_by_side(model_dir):
    out = run_cli("bench", "--model", str(model_dir), "--batch-sizes", "1", "--n-prompts", "2", "--max-new-tokens", "6",
                  "--repeats", "1", "--no-reference", "--backend", "lean", "--ar-backend", "hf", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.strip().splitlines()[-1])
    row = data["rows"][0]
    assert data["backend"] == "lean" and row["other_ar_label"] == "ours, float32, hf" and row["other_ar_time"] > 0
    assert row["other_ar_agreement"] == 1                     # fp32: both backends write the same tokens
    assert set(row["ms_per_token"]) >= {"ar", "mars", "verify", "transformers", "other_ar"}
    assert row["per_token_speedup"][row["fastest_ar_per_token"]] == pytest.approx(1.0)


@pytest.mark.parametrize("flag, module, fix", [("--llamacpp", "llamacpp", "pip install llama-cpp-python"),
                                               ("--onnxruntime", "ortgenai", "pip install onnxruntime-genai")])
def test_bench_other_runtime_without_its_package_is_one_clear_line(monkeypatch, capsys, flag, module, fix):
    import importlib

    from mars_core.tools.cli import main

    monkeypatch.setattr(importlib.import_module(f"mars_core.tools.{module}"), "available", lambda: False)
    assert main(["bench", "--model", "tiny-mars", flag, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fix in err


def test_bench_llamacpp_installed_without_its_dependencies_is_one_clear_line(monkeypatch, capsys, tmp_path):
    """llama-cpp-python installed with --no-deps imports diskcache at import time: one line naming the missing
    module, exit 2, not a traceback."""
    import builtins

    import mars_core.tools.llamacpp as llamacpp
    from mars_core.tools.cli import main

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ModuleNotFoundError("No module named 'diskcache'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(llamacpp, "available", lambda: True)
    monkeypatch.setattr(builtins, "__import__", broken)
    assert main(["bench", "--model", "tiny-mars", "--llamacpp", str(gguf), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not import (No module named 'diskcache')" in err
