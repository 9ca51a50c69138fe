"""The tests' one factory for tiny models and tokenizers, built in memory in about a second, no network.

Every tiny model is the same shape (2 layers, hidden 64, 4 heads) and is seeded just before it is built,
so every run sees the same weights and the whole suite runs on a CPU. What varies is named by a keyword:
the architecture, the vocabulary, the KV heads, the context, tied embeddings and a sharpened head.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAR_SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<|unused|>"]
BPE_SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CORPUS = [
    "What is 12 + 30? The answer is 42.",
    "Sort the list: 3, 1, 2. Sorted: 1, 2, 3.",
    "Reverse the word hello: olleh.",
    "Convert 2 km to m: 2000 m.",
    "user assistant system step by step",
] * 20


# ----------------------------------------------------------------------------- tokenizers
def make_tokenizer(with_mask: bool = True, spare_special: bool = True):
    """A character-level tokenizer with ChatML specials; optionally without <|mask|> or spare specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [s for s in CHAR_SPECIALS if (with_mask or s != "<|mask|>") and (spare_special or s != "<|unused|>")]
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


def make_bpe_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on CORPUS, with ChatML specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=BPE_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        mask_token="<|mask|>",
    )
    tok.chat_template = CHATML
    return tok


def make_task_tokenizer():
    """The project's own task tokenizer (finetune.tokenizer), small: what the finetune/evaluate tests use."""
    from finetune.tokenizer import build_tokenizer

    return build_tokenizer(vocab_size=300, n_examples=200)


def token_ids(tok) -> dict:
    """The config's bos/eos/pad ids taken from a tokenizer."""
    return dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


# ----------------------------------------------------------------------------- models
def tiny_causal_lm(vocab_size: int, kind: str = "llama", *, seed: int = 0, kv_heads: int = 2, context: int = 256,
                   tie: bool = False, head_scale: float | None = None, layers: int = 2, **config):
    """A random ``layers``-layer ``kind`` ("llama" or "qwen2") causal LM in eval mode, seeded just before it is built.

    ``config`` passes further config fields (token ids); ``head_scale`` multiplies the LM head, which
    spreads the confidences over (0, 1) instead of the init's near-uniform ones.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if kind not in classes:
        raise ValueError(kind)
    config_cls, model_cls = classes[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=kv_heads,
                                 max_position_embeddings=context, tie_word_embeddings=tie, **config))
    if head_scale is not None:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    return model.eval()


def make_model(kind: str, vocab_size: int, seed: int = 0, rows: int | None = None):
    """The decoding suite's model for the character tokenizer; ``rows`` pads the vocabulary (Qwen2.5-style)."""
    # Sharper than the default init, so that confidences spread over (0, 1) and MARS accepts runs
    # of several tokens at τ = 0.9 on some steps and one token on others.
    return tiny_causal_lm(rows or vocab_size, kind, seed=seed, eos_token_id=2, pad_token_id=0, bos_token_id=None,
                          head_scale=60.0 if kind == "llama" else 120.0)


def save_model_dir(path: Path, tok, model) -> Path:
    """Write a tokenizer and a model to ``path`` as a model directory load_model reads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(path)
    model.save_pretrained(path)
    return path


def make_tiny_model_dir(path: Path, seed: int = 0, vocab_size: int = 320) -> Path:
    """Write a byte-level BPE tokenizer (ChatML template) and a random tiny Llama (tied, 512 context) to ``path``."""
    tok = make_bpe_tokenizer(vocab_size)
    model = tiny_causal_lm(len(tok), seed=seed, context=512, tie=True, **token_ids(tok))
    return save_model_dir(path, tok, model)


def write_addition_chats(path: Path, n: int = 40) -> Path:
    """A chat-format training file of n one-line addition questions and their answers (finetune.train's input)."""
    with Path(path).open("w") as f:
        for a in range(n):
            b = (a * 7) % 10
            question = {"role": "user", "content": f"What is {a} + {b}?"}
            answer = {"role": "assistant", "content": f"{a} + {b} = {a + b}. The answer is {a + b}."}
            f.write(json.dumps({"messages": [question, answer]}) + "\n")
    return Path(path)


def train_flags(tiny: tuple, out, *extra) -> list[str]:
    """finetune.train's flags for a tiny run: `tiny` is (model folder, write_addition_chats's file)."""
    model_dir, data = tiny
    return ["--base-model", str(model_dir), "--data", str(data), "--output-dir", str(out), "--batch-size", "4",
            "--max-length", "64", "--threads", "1", *extra]


def train_metrics(out) -> list[dict]:
    """The rows of a finetune.train run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def own_w8a8_kernels() -> list[str]:
    """Our own w8a8 kernels (mars_core.engine.w8a8.OWN) that build and load here: the ones whose native layer stack
    tests can run (none without g++ or AVX2)."""
    from mars_core.engine.w8a8 import OWN, own_kernel
    return [k for k in OWN if own_kernel(k).load()]


# ----------------------------------------------------------------------------- our kernels' products
def kernel_case(n: int, k: int, bias, passes: int, kernel: str, seed: int = 0):
    """(a W8A8Linear on `kernel`, its fp32 weight, a generator for its inputs): a seeded [n, k] weight with an
    outlier input channel, and a bias where `bias` is truthy (as Qwen2's q/k/v have)."""
    import torch

    from mars_core.engine.w8a8 import W8A8Linear

    gen = torch.Generator().manual_seed(n + k + seed)
    weight = torch.randn(n, k, generator=gen) * 0.05
    weight[:, 1] *= 20                                                       # an outlier input channel
    b = torch.randn(n, generator=gen) if bias else None
    return W8A8Linear(weight, b, passes=passes, kernel=kernel), weight, gen


def kernel_rows(gen, rows: int, k: int):
    """`rows` inputs of width k for a kernel test: an outlier channel, and row 0 all zeros (magnitude 1e-30)."""
    import torch

    x = torch.randn(rows, k, generator=gen) * 3
    x[:, 2] *= 40
    x[0, :] = 0.0
    return x


def int8_weights(weight):
    """W8A8Linear's per-channel int8 weights (as float64, exact) and their fp32 scales, for a [n, k] fp32 weight."""
    import warnings

    import torch

    n = weight.shape[0]
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0                # the rails' zero columns change no max
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(weight, scale.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8)
    return q.int_repr().double(), scale
