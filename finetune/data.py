"""Chat data for fine-tuning: read, tokenise through the chat template, collate.

Input format: JSONL, one conversation per line::

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}

Roles are ``system``, ``user`` and ``assistant``; the last message must be the
assistant's. Blank lines are skipped. A malformed row raises ``ValueError``
naming the file, the line number and what is wrong.

Tokenisation: the prompt is everything before the last assistant turn,
rendered by the tokenizer's chat template with ``add_generation_prompt=True``
(exactly what the decoder feeds the model at inference). The supervised
response is the rest of the rendered conversation up to and including the
end-of-turn token (whatever the template puts after it, such as a newline, is
dropped). Prompt tokens get label -100.

Block padding (MARS stage): the response is extended with end-of-turn tokens
(as labels) until the total length is a multiple of the block size B, so the
batch padding never shares a block with real tokens (docs/algorithm.md, "The loss").

Over-long examples (length > ``max_length`` after block padding), chosen by
``overlong``:
- ``"drop"`` (default): the example is skipped; the number skipped is
  reported in one warning.
- ``"truncate"``: prompt tokens are removed from the left until it fits; the
  response is always kept whole. An example whose response alone does not fit
  is dropped (counted in the same warning).

Padding in a batch is tracked by a boolean ``valid`` mask, never by comparing
token ids (pad may equal eos, as in SmolLM2).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from mars_core.models.tokens import chat_spans, encode_with_text_spans, end_of_turn_ids, special_token_texts
from mars_core.models.textfile import json_line, read_lines

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")
OVERLONG = ("drop", "truncate")
# The longest JSONL row read by default (--max-row-bytes): 1 MB is ~250k tokens of text, hundreds of times any
# --max-length trained here; a longer row is a pasted file or a missing newline.
MAX_ROW_BYTES = 1_000_000


@dataclass
class Example:
    """One tokenised conversation; ``labels`` is -100 on the prompt."""

    input_ids: list[int]
    labels: list[int]


def validate_conversation(row, where: str) -> list[dict]:
    """Return the ``messages`` list of one parsed row or raise ValueError naming ``where``."""
    if not isinstance(row, dict) or "messages" not in row:
        raise ValueError(f'{where}: expected an object with a "messages" list, got {str(row)[:80]!r}')
    messages = row["messages"]
    if not isinstance(messages, list) or len(messages) < 2:
        raise ValueError(f'{where}: "messages" must be a list of at least 2 turns (a prompt and an answer)')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f'{where}: message {i} must be {{"role": str, "content": str}}, got {str(m)[:80]!r}')
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {i} has role {m['role']!r}; use one of {', '.join(ROLES)}")
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"{where}: the last message must be the assistant's answer, got role {messages[-1]['role']!r}")
    if not messages[-1]["content"].strip():
        raise ValueError(f"{where}: the last assistant message is empty or only whitespace "
                         f"({messages[-1]['content']!r}): give it an answer to learn, or drop the row")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_chat_jsonl(path: str | Path, max_row_bytes: int = MAX_ROW_BYTES) -> list[list[dict]]:
    """Read a chat JSONL file into a list of message lists (validated). A row over ``max_row_bytes`` is refused
    by its line number before it is parsed: tokenizing one takes minutes or aborts the process."""
    conversations = []
    too_long = (f"split or shorten that row, or raise --max-row-bytes (the default {MAX_ROW_BYTES:,} bytes is far "
                "more than --max-length tokens of text)")
    for lineno, line in read_lines(path, "data file", "pass a .jsonl file or 'builtin'", max_row_bytes, too_long):
        if line.strip():
            conversations.append(validate_conversation(json_line(line, path, lineno), f"{path}:{lineno}"))
    if not conversations:
        raise ValueError(f"data file {str(path)!r} has no conversations")
    return conversations


def builtin_family_cycle(weights: str) -> list[str] | None:
    """The family order for ``--builtin-weights "sorting=3,multiplication=2"``: every family once, plus
    (weight - 1) more turns for each named one, so sorting then comes 3x as often as an unnamed family."""
    if not weights.strip():
        return None
    from finetune import tasks

    cycle = list(tasks.FAMILIES)
    for item in weights.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or name not in tasks.FAMILIES or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--builtin-weights item {item.strip()!r}: write FAMILY=N with N a whole number >= 1 "
                             f"and FAMILY one of {tasks.FAMILIES}")
        cycle += [name] * (int(value) - 1)
    return cycle


def load_conversations(data: str, n_builtin: int = 2000, seed: int = 0, weights: str = "",
                       max_row_bytes: int = MAX_ROW_BYTES) -> list[list[dict]]:
    """``data`` is ``"builtin"`` (finetune.tasks' train split) or a chat JSONL path (rows up to ``max_row_bytes``)."""
    if data == "builtin":
        from finetune import tasks  # imported only when asked for: a JSONL run does not need the suite

        rows = tasks.make_examples("train", n_builtin, seed, families=builtin_family_cycle(weights))
        return [validate_conversation(r, f"builtin example {i}") for i, r in enumerate(rows)]
    if weights.strip():
        raise ValueError(f"--builtin-weights {weights!r} applies only to --data builtin, not to {data!r}: drop it")
    return read_chat_jsonl(data, max_row_bytes)


def tokenize_conversation(tokenizer, messages: list[dict], eos_ids: list[int]) -> Example:
    """Prompt (template + generation prompt) and supervised last assistant turn, up to its end-of-turn token."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}) has no "
                         "chat template, so conversations cannot be rendered: start from a chat model, or set "
                         "tokenizer.chat_template and save it with the base model")
    prompt_text, prompt_spans = chat_spans(tokenizer, messages[:-1], add_generation_prompt=True)
    full_text, spans = chat_spans(tokenizer, messages)
    if not full_text.startswith(prompt_text):
        raise ValueError(
            "the chat template does not render the prompt as a prefix of the conversation; "
            "use a tokenizer whose template appends turns (ChatML-style)"
        )
    if spans is None or prompt_spans is None:
        typed = next((t for t in special_token_texts(tokenizer) for m in messages if t in m["content"]), None)
        if typed is not None:
            raise ValueError(f"a message contains the text {typed!r}, and this tokenizer's chat template rewrites "
                             "message text, so it could not be trained on as plain text: remove it from the data")
        spans, prompt_spans = [], []
    # Message text is text: "<|im_end|>" typed in a message is characters, not the end-of-turn id.
    cut = len(prompt_text)
    prompt = encode_with_text_spans(tokenizer, prompt_text, prompt_spans)
    response_spans = [(max(a - cut, 0), b - cut) for a, b in spans if b > cut]
    response = encode_with_text_spans(tokenizer, full_text[cut:], response_spans)
    ends = [i for i, t in enumerate(response) if t in eos_ids]
    if ends:
        response = response[: ends[-1] + 1]  # drop what the template adds after end-of-turn
    else:
        response = response + [eos_ids[0]]  # template without an end-of-turn token: teach the model to stop
    return Example(prompt + response, [IGNORE_INDEX] * len(prompt) + response)


def pad_to_block(example: Example, block_size: int, eos_id: int) -> Example:
    """Extend the response with ``eos_id`` (labelled) until the length is a multiple of ``block_size``."""
    extra = -len(example.input_ids) % block_size
    return Example(example.input_ids + [eos_id] * extra, example.labels + [eos_id] * extra)


def fit_length(example: Example, max_length: int, overlong: str) -> Example | None:
    """Apply the documented over-long policy; None means drop."""
    n = len(example.input_ids)
    if n <= max_length:
        return example
    if overlong == "drop":
        return None
    n_prompt = next(i for i, t in enumerate(example.labels) if t != IGNORE_INDEX)
    cut = n - max_length
    if cut >= n_prompt:  # the response alone does not fit (we never cut into it)
        return None
    return Example(example.input_ids[cut:], example.labels[cut:])


def build_examples(
    conversations: list[list[dict]],
    tokenizer,
    *,
    max_length: int,
    block_size: int | None = None,
    eos_ids: list[int] | None = None,
    overlong: str = "drop",
) -> list[Example]:
    """Tokenise, block-pad (if ``block_size``) and length-filter conversations. ``eos_ids`` are the ids that end
    a turn, the model's own (``LoadedModel.eos_ids``, as finetune.train passes); without them, the tokenizer's
    (mars_core.models.loading.end_of_turn_ids)."""
    if overlong not in OVERLONG:
        raise ValueError(f"overlong={overlong!r}; use one of {OVERLONG}")
    eos_ids = list(eos_ids) if eos_ids else end_of_turn_ids(tokenizer)
    examples, dropped = [], 0
    for messages in conversations:
        ex = tokenize_conversation(tokenizer, messages, eos_ids)
        if block_size and block_size > 1:
            # the end-of-turn token this response actually ends with is the one to repeat
            ex = pad_to_block(ex, block_size, ex.input_ids[-1])
        ex = fit_length(ex, max_length, overlong)
        if ex is None:
            dropped += 1
        else:
            examples.append(ex)
    if dropped:
        warnings.warn(
            f"{dropped} of {len(conversations)} examples longer than max_length={max_length} were dropped "
            f"(overlong={overlong!r}); raise --max-length to keep them",
            stacklevel=2,
        )
    if not examples:
        raise ValueError(f"no example fits max_length={max_length}; raise --max-length")
    return examples


def pad_id_of(tokenizer, eos_ids: list[int]) -> int:
    """The id batches are padded with: the tokenizer's pad token, else its first eos (pads carry no label)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: ``input_ids``, ``labels`` (-100 on pads), ``valid`` (bool)."""
    n = max(len(e.input_ids) for e in examples)
    b = len(examples)
    input_ids = torch.full((b, n), pad_id, dtype=torch.long)
    labels = torch.full((b, n), IGNORE_INDEX, dtype=torch.long)
    valid = torch.zeros((b, n), dtype=torch.bool)
    for i, e in enumerate(examples):  # once per batch, on lists; not in the model's hot path
        k = len(e.input_ids)
        input_ids[i, :k] = torch.tensor(e.input_ids)
        labels[i, :k] = torch.tensor(e.labels)
        valid[i, :k] = True
    return {"input_ids": input_ids, "labels": labels, "valid": valid}


def epoch_batches(
    n_examples: int, batch_size: int, epoch: int, seed: int, lengths: list[int] | None = None
) -> list[list[int]]:
    """Index lists for one epoch, shuffled deterministically by (seed, epoch); the last partial batch is dropped.

    With ``lengths``, examples of similar length are batched together (shuffle,
    sort inside windows of 50 batches, shuffle the batches) so less compute is
    spent on padding; the order still depends only on (seed, epoch), which is
    what makes resuming mid-epoch exact.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n_examples, generator=g).tolist()
    if lengths is not None:
        window = batch_size * 50
        order = [
            i for s in range(0, len(order), window) for i in sorted(order[s : s + window], key=lambda j: lengths[j])
        ]
    batches = [order[s : s + batch_size] for s in range(0, n_examples - batch_size + 1, batch_size)]
    if lengths is not None:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
    return batches


# ----------------------------------------------------------------------------- data manifests

MANIFEST_FILE = "data_manifest.json"
MANIFEST_FORMAT = "mars-data-manifest-v1"
MANIFEST_KEY = "sha256 of the prompt turns (every message before the last) as JSON, first 16 hex digits"


def prompt_key(messages: list[dict]) -> str:
    """An example's identity in a manifest: its prompt turns. Self-distilled data answers a prompt once, so a
    prompt seen before is an example seen before; a hash keeps the manifest small and the prompts out of it."""
    import hashlib
    import json

    turns = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
    return hashlib.sha256(json.dumps(turns, ensure_ascii=False, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def prompt_text_key(prompt: str) -> str:
    """The key of a plain prompt (a prompts file's line): the same as its distilled conversation's."""
    return prompt_key([{"role": "user", "content": prompt}, {"role": "assistant", "content": ""}])


def manifest_path(path: str | Path) -> Path:
    """A manifest file, or the data_manifest.json inside a folder."""
    p = Path(path).expanduser()
    return p / MANIFEST_FILE if p.is_dir() else p


def read_manifest(path: str | Path, flag: str = "--skip-seen") -> dict:
    """A validated manifest: {"format", "key", "prompts": [key, ...], "sources": [...]}."""
    import json

    p = manifest_path(path)
    if not p.is_file():
        raise ValueError(f"{flag} {str(path)!r}: no {MANIFEST_FILE} there; pass a manifest file or a run, checkpoint "
                         "or adapter folder that holds one (python -m finetune.recipes.recipe_smollm2 --stages "
                         "manifest writes one for the shipped adapter)")
    try:
        record = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{flag} {str(p)!r} cannot be read as JSON ({exc}): restore or rewrite it") from None
    ok = (isinstance(record, dict) and record.get("format") == MANIFEST_FORMAT and
          isinstance(record.get("prompts"), list)
          and all(isinstance(k, str) and len(k) == 16 for k in record["prompts"]))
    if not ok:
        raise ValueError(f"{flag} {str(p)!r} is not a {MANIFEST_FORMAT} manifest (a 'prompts' list of 16-digit keys): "
                         "pass one that finetune.train or finetune.recipes.recipe_smollm2 wrote")
    return record


def write_manifest(path: str | Path, keys, sources: list) -> Path:
    """Write a manifest of ``keys`` (deduplicated, sorted: the same data gives the same file) and its sources."""
    import json

    from mars_core.models.storage import atomic_write_text

    record = {"format": MANIFEST_FORMAT, "key": MANIFEST_KEY, "sources": sources, "prompts": sorted(set(keys))}
    atomic_write_text(Path(path), json.dumps(record, indent=0) + "\n", "the data manifest")
    return Path(path)


def leave_out_seen(conversations: list[list[dict]], seen: set[str]) -> tuple[list[list[dict]], int]:
    """(the conversations whose prompt is not in ``seen``, how many were left out)."""
    new = [c for c in conversations if prompt_key(c) not in seen]
    return new, len(conversations) - len(new)
