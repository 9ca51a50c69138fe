"""Model loading: mask-token rules, MARS checkpoints without remote code, SmolLM2 offline, bad names."""
import json

import pytest
import torch

from mars_core import DecodeConfig, generate, load_model, resolve_mask_id
from mars_core.models.sources import KNOWN_MODELS, resolve_source
from tests.tiny_fixtures import make_model, make_tokenizer


def test_mask_token_from_tokenizer():
    tok = make_tokenizer(with_mask=True)
    model = make_model("llama", len(tok))
    assert resolve_mask_id(tok, model) == (tok.convert_tokens_to_ids("<|mask|>"), "tokenizer")


def test_mask_token_in_spare_embedding_row_adds_no_parameter():
    tok = make_tokenizer(with_mask=False)
    model = make_model("qwen2", len(tok), rows=len(tok) + 16)     # Qwen2.5-style padded vocabulary
    before = sum(p.numel() for p in model.parameters())
    rows = model.get_input_embeddings().weight.shape[0]
    mask_id, source = resolve_mask_id(tok, model)
    assert source == "spare-row"
    assert mask_id == len(tok) - 1 and mask_id < rows               # the first spare row
    assert tok.convert_ids_to_tokens(mask_id) == "<|mask|>"
    assert sum(p.numel() for p in model.parameters()) == before
    assert model.get_input_embeddings().weight.shape[0] == rows


def test_mask_token_reuses_an_unused_special_when_no_row_is_spare():
    tok = make_tokenizer(with_mask=False)
    model = make_model("llama", len(tok))
    mask_id, source = resolve_mask_id(tok, model)
    assert source == "reused:<|unused|>" and mask_id == tok.convert_tokens_to_ids("<|unused|>")
    assert model.get_input_embeddings().weight.shape[0] == len(tok)


def test_no_mask_token_possible_raises_with_the_fix():
    tok = make_tokenizer(with_mask=False, spare_special=False)
    model = make_model("llama", len(tok))
    with pytest.raises(ValueError, match="mask_token="):
        resolve_mask_id(tok, model)


def test_unknown_model_name_lists_known_ones():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'.*tiny-mars"):
        resolve_source("no-such-model")


def test_missing_checkpoint_folder_and_gguf(tmp_path):
    with pytest.raises(ValueError, match="without config.json"):
        resolve_source(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_source(str(tmp_path / "model.gguf"))


def test_mars_checkpoint_with_custom_type_loads_into_stock_qwen2(tmp_path):
    """Released MARS checkpoints say model_type 'a2d-qwen2' with an auto_map to remote code; we load
    them into transformers' own Qwen2ForCausalLM and get the same logits."""
    tok = make_tokenizer()
    model = make_model("qwen2", len(tok))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(model_type="a2d-qwen2", architectures=["A2DQwen2LMHeadModel"],
               auto_map={"AutoModelForCausalLM": "modeling_a2d.A2DQwen2LMHeadModel"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    lm = load_model(str(tmp_path), device="cpu")
    assert type(lm.model).__name__ == "Qwen2ForCausalLM"
    ids = torch.tensor([lm.encode("hello")])
    assert torch.allclose(lm.model(ids).logits, model(ids).logits, atol=1e-5)
    assert lm.mask_id == tok.mask_token_id


def test_local_folder_loads_on_cpu_in_fp32(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # what "auto" picks without a GPU
    tok = make_tokenizer()
    make_model("llama", len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path))
    assert lm.device.type == "cpu" and lm.model.dtype == torch.float32
    assert lm.eos_ids == [tok.eos_token_id]


def test_cuda_request_without_a_gpu_is_a_clear_error(monkeypatch):
    from mars_core.models.formats import pick_dtype
    from mars_core.models.loading import pick_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='cuda'.*no CUDA"):
        pick_device("cuda")
    assert pick_device("auto").type == "cpu"
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32


def test_smollm2_loads_offline_and_answers_paris(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "smollm2" in KNOWN_MODELS
    lm = load_model("smollm2")
    assert lm.mask_source == "reused:<repo_name>" and lm.mask_id == 3      # no spare row in SmolLM2
    assert lm.eos_ids == [2]
    result = generate(lm, ["What is the capital of France?"], DecodeConfig(mode="ar", max_new_tokens=24))[0]
    assert "Paris" in result.text


def test_checkpoint_whose_weights_do_not_fit_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    tok = make_tokenizer()
    make_model("qwen2", len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k.replace("model.layers", "transformer.blocks"): v for k, v in weights.items()},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights"):
        load_model(str(tmp_path))


def test_hub_id_with_downloads_off_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="downloads are off"):
        load_model("some-org/some-model")


def test_cpu_layout_converts_linears_and_decodes_the_same_tokens():
    """load_model on a CPU stores linear weights transposed (faster few-row GEMMs); the tied LM head keeps
    the embedding. Logits match the stock modules to float rounding and decoding gives the same tokens."""
    from mars_core.engine.cpu_layout import RowMajorLinear
    from finetune.tasks import make_examples

    fast = load_model("tiny-mars", device="cpu")
    stock = load_model("tiny-mars", device="cpu", cpu_layout=False)
    linears = [n for n, m in fast.model.named_modules() if type(m) is torch.nn.Linear]
    assert linears == ["lm_head"]                                                    # tied: left as it is
    assert sum(isinstance(m, RowMajorLinear) for m in fast.model.modules()) == 7 * 4   # q k v o gate up down
    assert not any(isinstance(m, RowMajorLinear) for m in stock.model.modules())
    assert fast.model.lm_head.weight is fast.model.get_input_embeddings().weight      # still tied
    assert all(p.data_ptr() % 64 == 0 for p in fast.model.parameters())
    layer = fast.model.model.layers[0].mlp.up_proj
    assert layer.weight.shape == stock.model.model.layers[0].mlp.up_proj.weight.shape
    prompts = [ex["messages"][0]["content"] for ex in make_examples("heldout", 8, seed=5)]
    ids = torch.tensor([fast.encode(prompts[0])])
    assert torch.allclose(fast.model(ids).logits, stock.model(ids).logits, atol=1e-5)
    for cfg in (DecodeConfig(mode="ar", max_new_tokens=48), DecodeConfig(tau=0.9, block_size=4, max_new_tokens=48)):
        a, b = generate(fast, prompts, cfg), generate(stock, prompts, cfg)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_training_loads_stock_modules():
    """finetune trains and saves what load_base returns: it must stay plain nn.Linear."""
    from finetune.train_model import load_base

    base = load_base("tiny-ar-sft")
    assert any(type(m) is torch.nn.Linear for m in base.model.modules())
    assert not any(type(m).__name__ == "RowMajorLinear" for m in base.model.modules())
