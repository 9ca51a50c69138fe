"""finetune.distill: prompts in, the model's own greedy answers out as chat JSONL."""

import json

import pytest
import torch


def _tiny_model_dir(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.tokenizer import build_tokenizer

    tok = build_tokenizer(vocab_size=300, n_examples=200)
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_distill_writes_the_models_greedy_answers(tmp_path):
    from finetune.distill import main
    from mars_core import DecodeConfig, generate, load_model

    model_dir = _tiny_model_dir(tmp_path / "m")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 + 3?\n\n# a comment\nSort in ascending order: 5, 1, 3\n")
    out = tmp_path / "d" / "data.jsonl"
    main(["--model", str(model_dir), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "6",
          "--keep-truncated", "--device", "cpu"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in rows] == ["What is 2 + 3?", "Sort in ascending order: 5, 1, 3"]
    lm = load_model(str(model_dir), device="cpu")
    want = generate(lm, ["What is 2 + 3?"], DecodeConfig(mode="ar", max_new_tokens=6))[0].text
    assert rows[0]["messages"][1] == {"role": "assistant", "content": want}


def test_truncated_answers_are_dropped_by_default(tmp_path):
    from finetune.distill import distill
    from mars_core import load_model

    lm = load_model(str(_tiny_model_dir(tmp_path / "m")), device="cpu")
    # a random model almost never emits <|im_end|> within 3 tokens
    rows, dropped = distill(lm, ["What is 2 + 3?", "Reverse the letters: a b c"], max_new_tokens=3)
    assert len(rows) + dropped == 2 and dropped >= 1


def test_bad_prompt_files_name_the_problem(tmp_path):
    from finetune.distill import read_prompts

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
