"""finetune.recipes.distill: prompts in, the model's own greedy answers out as chat JSONL."""

import json

import pytest
import torch


def _tiny_model_dir(path):
    from tests.tiny_fixtures import make_task_tokenizer, save_model_dir, tiny_causal_lm

    tok = make_task_tokenizer()
    model = tiny_causal_lm(len(tok), kv_heads=4, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.no_grad():   # special tokens get logit 0 and lose to the best random one: answers are real text
        for tid in tok.added_tokens_decoder:
            model.lm_head.weight[tid] = 0.0
    return save_model_dir(path, tok, model)


def test_distill_writes_the_models_greedy_answers(tmp_path):
    from finetune.recipes.distill import main
    from mars_core import DecodeConfig, generate, load_model

    model_dir = _tiny_model_dir(tmp_path / "m")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 + 3?\n\n# a comment\nSort in ascending order: 5, 1, 3\n")
    out = tmp_path / "d" / "data.jsonl"
    main(["--model", str(model_dir), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "6",
          "--keep-truncated", "--device", "cpu"])
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    side = out.with_name(out.name + ".dropped.jsonl")
    dropped = [json.loads(line) for line in side.read_text().splitlines()] if side.exists() else []
    lm = load_model(str(model_dir), device="cpu")
    kept = {r["messages"][0]["content"]: r["messages"][1] for r in rows}
    for prompt in ["What is 2 + 3?", "Sort in ascending order: 5, 1, 3"]:
        want = generate(lm, [prompt], DecodeConfig(mode="ar", max_new_tokens=6))[0].text
        assert want.strip() and kept[prompt] == {"role": "assistant", "content": want}
    assert dropped == []


def test_truncated_answers_are_dropped_by_default(tmp_path):
    from finetune.recipes.distill import distill
    from mars_core import load_model

    lm = load_model(str(_tiny_model_dir(tmp_path / "m")), device="cpu")
    # a random model almost never emits <|im_end|> within 3 tokens
    rows, dropped = distill(lm, ["What is 2 + 3?", "Reverse the letters: a b c"], max_new_tokens=3)
    assert len(rows) + dropped == 2 and dropped >= 1


def test_bad_prompt_files_name_the_problem(tmp_path):
    from mars_core.models.textfile import read_prompts

    with pytest.raises(ValueError, match="does not exist"):
        read_prompts(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n# only a comment\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts(empty)
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2"):
        read_prompts(bad)
    good = tmp_path / "q.jsonl"
    good.write_text('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert read_prompts(good) == ["a", "b"]


def test_prompt_lines_are_stripped_and_escaped_and_binary_files_refused(tmp_path):
    from mars_core.models.textfile import read_prompts

    path = tmp_path / "p.txt"
    path.write_bytes("\ufeff  What is 2 + 3?  \n\n# a comment\nline\\nbreak\r\n".encode())
    assert read_prompts(path) == ["What is 2 + 3?", "line\nbreak"]   # no byte-order mark, no "\r"
    path.write_bytes(b"fine\n\x00\x00")
    with pytest.raises(ValueError, match=r"p.txt:2: holds NUL bytes \(a binary file\?\)"):
        read_prompts(path)


def test_distill_resumes_without_repeating_a_prompt(tmp_path, monkeypatch):
    import finetune.recipes.distill as distill_mod
    from finetune.recipes.distill import dropped_path, main

    model_dir = _tiny_model_dir(tmp_path / "m")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"What is {i} + 1?\n" for i in range(6)))
    out = tmp_path / "data.jsonl"
    flags = ["--model", str(model_dir), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "4",
             "--keep-truncated", "--device", "cpu", "--batch-size", "2"]
    answered = []
    real = distill_mod.distill_batches

    def counting(lm, todo, *a, **k):
        answered.extend(todo)
        yield from real(lm, todo, *a, **k)

    monkeypatch.setattr(distill_mod, "distill_batches", counting)
    main(flags + ["--shard", "0/2"])                       # prompts 0, 2, 4
    first = out.read_text()
    with out.open("a") as fh:                               # a run killed mid-write leaves a torn line
        fh.write('{"messages": [{"role": "user", "con')
    main(flags)                                             # all six: only 1, 3, 5 are new
    assert sorted(answered) == sorted(f"What is {i} + 1?" for i in range(6))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    kept_or_dropped = [r["messages"][0]["content"] for r in rows]
    if dropped_path(out).exists():
        kept_or_dropped += [json.loads(x)["prompt"] for x in dropped_path(out).read_text().splitlines()]
    assert sorted(kept_or_dropped) == sorted(f"What is {i} + 1?" for i in range(6))
    assert out.read_text().startswith(first)
    answered.clear()
    main(flags)                                             # nothing left to do: the model is not even loaded
    assert answered == []


def test_out_equal_to_the_prompts_file_is_refused_and_the_prompts_survive(tmp_path):
    from finetune.recipes.distill import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 + 3?\n")
    with pytest.raises(ValueError, match="prompts file"):
        main(["--model", "tiny-mars", "--prompts", str(prompts), "--out", str(tmp_path / "." / "prompts.txt")])
    assert prompts.read_text() == "What is 2 + 3?\n"
    with pytest.raises(ValueError, match="K/N"):
        main(["--model", "tiny-mars", "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"), "--shard", "2"])


def test_looping_answers_are_recognised():
    from finetune.evals.evaluate_common import repeats_itself

    assert repeats_itself([1, 2, 3, 4, 5, 6, 7, 8] * 3)
    assert not repeats_itself(list(range(40)))
    assert not repeats_itself([1, 2, 3, 4, 5, 6, 7, 8] * 2)


def test_check_answers_drops_a_wrong_result_and_keeps_a_right_one():
    from types import SimpleNamespace

    from finetune.evals.structured import prompt_table
    from finetune.recipes.distill import drop_reason

    prompt = next(p for c, s, p in prompt_table("train") if c == "arithmetic" and p.startswith("What is")
                  and " + " in p)
    a, b = (int(x) for x in prompt[len("What is "):-1].split(" + "))
    answer = lambda text: SimpleNamespace(finish_reason="eos", token_ids=list(range(12)), text=text)
    assert drop_reason(answer(f"It is {a + b}."), prompt=prompt) is None
    assert drop_reason(answer(f"It is {a + b + 2}."), prompt=prompt) == f"wrong: want {a + b}, wrote {a + b + 2}"
    assert drop_reason(answer(f"It is {a + b + 2}.")) is None          # without --check-answers: kept
    assert drop_reason(answer("The sky is blue."), prompt="Why is the sky blue?") is None   # nothing to check
