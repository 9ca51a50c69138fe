"""Shared fixtures: tiny random causal LMs with a tiny character tokenizer (built by tests/tiny_fixtures.py).

Seeds are fixed so every run sees the same weights; the models are small (2 layers, hidden 64)
so the whole equivalence suite runs on a CPU in seconds.
"""
from __future__ import annotations

import pytest

from mars_core.models.loading import wrap_model
from tests.tiny_fixtures import make_model, make_tiny_model_dir, make_tokenizer, write_addition_chats


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session", params=[("llama", "hf"), ("llama", "lean"), ("qwen2", "hf"), ("qwen2", "lean")],
                ids=lambda p: "-".join(p))
def tiny_lm(request, tokenizer):
    """Each architecture through both backends the decoder can run (fp32): the transformers model itself, and
    mars_core.engine.lean's forward built from it; every equivalence test that takes tiny_lm holds on both."""
    arch, backend = request.param
    model = make_model(arch, len(tokenizer))
    return wrap_model(model, tokenizer, name=f"tiny-{arch}", backend=backend)


@pytest.fixture(scope="session")
def llama_lm(tokenizer):
    return wrap_model(make_model("llama", len(tokenizer)), tokenizer, name="tiny-llama")


PROMPTS = ["What is 2+3?", "Sort: c a b", "Hello there, tell me a long story about cats."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model folder and an addition-chat training file (finetune.train's inputs; tests.tiny_fixtures
    .train_flags turns them into flags). tests/test_bad_input.py has its own."""
    root = tmp_path_factory.mktemp("tiny")
    return make_tiny_model_dir(root / "model"), write_addition_chats(root / "data.jsonl")
