"""Shared fixtures: tiny random causal LMs with a tiny character tokenizer, built in memory.

Seeds are fixed so every run sees the same weights. The models are small (2 layers, hidden 64)
so the whole equivalence suite runs on a CPU in seconds.
"""
from __future__ import annotations

import string

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from mars_core.loading import wrap_model

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<|unused|>"]


def make_tokenizer(with_mask: bool = True, spare_special: bool = True) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with ChatML specials; optionally without <|mask|> or spare specials."""
    specials = [s for s in SPECIALS if (with_mask or s != "<|mask|>") and (spare_special or s != "<|unused|>")]
    chars = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|pad|>",
                                  bos_token=None, unk_token="?")
    tok.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in ("<|pad|>", "<|im_end|>")]})
    if with_mask:
        tok.mask_token = "<|mask|>"
    tok.chat_template = CHATML
    return tok


def make_model(kind: str, vocab_size: int, seed: int = 0, rows: int | None = None):
    torch.manual_seed(seed)
    common = dict(vocab_size=rows or vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2,
                  pad_token_id=0, bos_token_id=None)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    else:
        raise ValueError(kind)
    # Sharper than the default init, so that confidences spread over (0, 1) and MARS accepts runs
    # of several tokens at τ = 0.9 on some steps and one token on others.
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0 if kind == "llama" else 120.0)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_lm(request, tokenizer):
    model = make_model(request.param, len(tokenizer))
    return wrap_model(model, tokenizer, name=f"tiny-{request.param}")


@pytest.fixture(scope="session")
def llama_lm(tokenizer):
    return wrap_model(make_model("llama", len(tokenizer)), tokenizer, name="tiny-llama")


PROMPTS = ["What is 2+3?", "Sort: c a b", "Hello there, tell me a long story about cats."]
