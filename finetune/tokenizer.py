"""A small byte-level BPE tokenizer trained on the built-in task suite.

Digits are always single tokens (optionally with the space before them), so a
number's digits line up one token each and column arithmetic stays learnable.
Saved as a transformers PreTrainedTokenizerFast directory with a ChatML chat
template and the special tokens the trainer, the decoder and the app expect:
<|im_start|>, <|im_end|> (eos, end of turn), <|pad|> (pad), <|mask|> (mask_token).

    python -m finetune.tokenizer --out assets/tokenizer --vocab-size 512
"""

from __future__ import annotations

import argparse

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from finetune.tasks import make_examples

PAD, IM_START, IM_END, MASK = "<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, MASK]

# ChatML; add_generation_prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# GPT-2 style split, except that a digit is never merged with another digit.
_SPLIT = r" ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def render_chat(messages: list[dict]) -> str:
    """The ChatML text of a conversation (same as CHAT_TEMPLATE renders it)."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def train_tokenizer(texts: list[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on `texts`; returns a ready PreTrainedTokenizerFast."""
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size={vocab_size} is too small; use at least {256 + len(SPECIAL_TOKENS) + 1}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        mask_token=MASK,
        additional_special_tokens=[IM_START],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tokenizer(vocab_size: int = 512, n_examples: int = 20_000, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train the suite's tokenizer on rendered chats of the train split only."""
    texts = [render_chat(ex["messages"]) for ex in make_examples("train", n_examples, seed=seed)]
    return train_tokenizer(texts, vocab_size=vocab_size)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory to save the tokenizer into")
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--n-examples", type=int, default=20_000, help="train examples to learn merges from")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    tok = build_tokenizer(args.vocab_size, args.n_examples, args.seed)
    tok.save_pretrained(args.out)
    print(f"saved tokenizer ({len(tok)} tokens) to {args.out}")


if __name__ == "__main__":
    main()
