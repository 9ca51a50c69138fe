"""Tokens: the chat template with user text kept as text, the mask id, and every end-of-turn id.

`encode_chat` renders a chat so that special-token text typed in a message stays characters, never a control id;
`resolve_mask_id` picks the mask id (docs/algorithm.md, "Tokens"); `end_of_turn_ids` lists the ids that end a turn.
Used by `mars_core.models.loading` for every model and by finetune.data for training; no torch import.
"""
from __future__ import annotations

MASK_TOKEN = "<|mask|>"

# User text is text: "<|im_end|>", "<|mask|>" or "<repo_name>" typed in a message are characters, never the
# control ids, while the chat template's own control tokens stay real. The template is rendered once with a
# marker in place of each message's content to find where the content lies in the rendered text; only when some
# content holds the text of a special token is the text tokenised in pieces (that content with
# split_special_tokens=True), so every other prompt is tokenised exactly as before.
_MARK = "\ue000{}\ue001"   # private-use characters: never in a template


def special_token_texts(tokenizer) -> list[str]:
    """The text of every special token (the ones a tokenizer would turn into control ids), longest first."""
    texts = {a.content for a in getattr(tokenizer, "added_tokens_decoder", {}).values() if a.special}
    texts.update(t for t in getattr(tokenizer, "all_special_tokens", []) if t)
    return sorted(texts, key=len, reverse=True)


def has_special_text(tokenizer, text: str) -> bool:
    return any(t in text for t in special_token_texts(tokenizer))


def chat_spans(tokenizer, messages: list[dict], **template_kwargs) -> tuple[str, list[tuple[int, int]] | None]:
    """(the chat template's text for `messages`, the (start, end) of each message's content in it), or None for
    the spans when the template does not copy the content verbatim (it strips or rewrites it)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    marks = [_MARK.format(i) for i in range(len(messages))]
    marked = tokenizer.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)],
                                           tokenize=False, **template_kwargs)
    spans, rebuilt, pos = [], "", 0
    for m, mark in zip(messages, marks):
        at = marked.find(mark, pos)
        if at < 0 or marked.count(mark) != 1:
            return text, None
        rebuilt += marked[pos:at]
        spans.append((len(rebuilt), len(rebuilt) + len(m["content"])))
        rebuilt += m["content"]
        pos = at + len(mark)
    rebuilt += marked[pos:]
    return text, (spans if rebuilt == text else None)


def encode_with_text_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> list[int]:
    """Token ids of `text` (no BOS added) where the characters inside `spans` are plain text: special-token text
    there is split into ordinary tokens. Without special-token text in any span: one call, the usual ids."""
    risky = [(a, b) for a, b in sorted(spans) if b > a and has_special_text(tokenizer, text[a:b])]
    if not risky:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids, pos = [], 0
    for a, b in risky:
        if a > pos:
            ids += tokenizer(text[pos:a], add_special_tokens=False)["input_ids"]
        ids += tokenizer(text[a:b], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        pos = b
    if pos < len(text):
        ids += tokenizer(text[pos:], add_special_tokens=False)["input_ids"]
    return list(ids)


def encode_chat(tokenizer, messages: list[dict], **template_kwargs) -> list[int]:
    """The chat template's token ids for `messages`, the messages' content tokenised as plain text."""
    text, spans = chat_spans(tokenizer, messages, **template_kwargs)
    if spans is None:
        typed = next((t for t in special_token_texts(tokenizer) for m in messages if t in m["content"]), None)
        if typed is not None:
            raise ValueError(f"a message contains the text {typed!r}, and this tokenizer's chat template rewrites "
                             "message text, so it could not be kept as plain text: remove it from the message")
        spans = []
    return encode_with_text_spans(tokenizer, text, spans)


def resolve_mask_id(tokenizer, model, mask_token: str | None = None) -> tuple[int, str]:
    """The mask id per docs/algorithm.md ("Tokens"): the tokenizer's own mask token; else a spare embedding row;
    else a special token that chat never emits. Never resizes the embeddings."""
    vocab = tokenizer.get_vocab()
    if mask_token is not None:
        if mask_token not in vocab:
            raise ValueError(f"mask_token={mask_token!r} is not in the tokenizer's vocabulary: name an existing token")
        return vocab[mask_token], "tokenizer" if mask_token == tokenizer.mask_token else f"reused:{mask_token}"
    if tokenizer.mask_token is not None and tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id, "tokenizer"
    if MASK_TOKEN in vocab:
        return vocab[MASK_TOKEN], "tokenizer"
    rows = model.get_input_embeddings().weight.shape[0]
    if rows > len(tokenizer):
        # Lands in the first spare row (Qwen2.5: id 151665 of 151936 rows): no new parameter.
        tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
        mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        assert mask_id < rows, "a spare-row mask token must fit in the existing embedding matrix"
        return mask_id, "spare-row"
    reused = _unused_special_token(tokenizer)
    if reused is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no mask token, no spare embedding row and no unused special "
            "token: pass mask_token=<an existing token> or add one and resize the model deliberately"
        )
    return vocab[reused], f"reused:{reused}"


def _unused_special_token(tokenizer) -> str | None:
    """A special token that neither the chat template nor turn/padding logic uses (SmolLM2: <repo_name>)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    taken = {tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token, tokenizer.unk_token}
    for tid, added in sorted(tokenizer.added_tokens_decoder.items()):
        text = added.content
        if not added.special or text in taken or text in template:
            continue
        if "end" in text.lower() or "eos" in text.lower():
            continue
        return text
    return None


def end_of_turn_ids(tokenizer, model=None) -> list[int]:
    """Every id that ends a turn, in ascending order: the tokenizer's eos, ``<|im_end|>`` when the vocabulary has
    it, and with a ``model`` its generation config's eos ids. The decoder stops at any of them. Training
    (finetune.data) cuts a rendered answer after the last of them in it; an answer with none gets the list's
    first id appended, and batches are padded with that id when the tokenizer has no pad token."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    if "<|im_end|>" in vocab:
        ids.add(vocab["<|im_end|>"])
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if not ids:
        raise ValueError("the tokenizer has no eos token and no <|im_end|>: set tokenizer.eos_token before decoding "
                         "or training")
    return sorted(ids)
