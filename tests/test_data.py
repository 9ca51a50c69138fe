"""Chat JSONL reading, tokenisation through the chat template, over-long policy, collation."""

import copy
import json
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from finetune.data import (
    IGNORE_INDEX,
    build_examples,
    collate,
    epoch_batches,
    read_chat_jsonl,
    tokenize_conversation,
)
from mars_core.models.tokens import end_of_turn_ids
from tests.tiny_fixtures import make_tiny_model_dir

CHAT = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "The answer is 4."}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_tiny_model_dir(tmp_path_factory.mktemp("tok")))


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "bad_line, why",
    [
        ('{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
        ('{"text": "hello"}', '"messages"'),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "at least 2 turns"),
        ('{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}', "role 'bot'"),
        ('{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}', "last message"),
        ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}', "message 0"),
    ],
)
def test_malformed_row_error_names_file_line_and_problem(tmp_path, bad_line, why):
    good = json.dumps({"messages": CHAT})
    path = write_lines(tmp_path / "data.jsonl", [good, "", good, bad_line, good])
    with pytest.raises(ValueError) as info:
        read_chat_jsonl(path)
    assert f"{path}:4:" in str(info.value)  # blank lines still count as lines
    assert why in str(info.value)


def test_missing_file_and_empty_file_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_chat_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="no conversations"):
        read_chat_jsonl(write_lines(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(ValueError, match="is a directory"):
        read_chat_jsonl(tmp_path)


def test_end_of_turn_ids_are_the_tokenizers_in_ascending_order_plus_the_models(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(tokenizer) == [eos]
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, eos]))
    assert end_of_turn_ids(tokenizer, model) == sorted({7, eos})
    other = copy.deepcopy(tokenizer)
    other.eos_token = "<|mask|>"   # eos and <|im_end|> differ: both end a turn, smallest first
    assert end_of_turn_ids(other) == sorted({other.eos_token_id, eos})
    # without eos_ids, build_examples takes the tokenizer's (finetune.train passes the loaded model's)
    assert build_examples([CHAT], tokenizer, max_length=256) == build_examples([CHAT], tokenizer, max_length=256,
                                                                                eos_ids=[eos])


def test_prompt_is_ignored_and_the_assistant_turn_is_supervised_through_end_of_turn(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ex = tokenize_conversation(tokenizer, CHAT, [eos])
    prompt_ids = tokenizer.apply_chat_template(CHAT[:1], add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    n_prompt = len(prompt_ids)
    assert ex.input_ids[:n_prompt] == list(prompt_ids)  # exactly what the decoder will be fed
    assert ex.labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
    response = ex.labels[n_prompt:]
    assert IGNORE_INDEX not in response
    assert response == ex.input_ids[n_prompt:]
    assert response[-1] == eos  # the end-of-turn token is learnt (so the model stops)
    assert tokenizer.decode(response, skip_special_tokens=True) == "The answer is 4."
    assert ex.input_ids[-1] == eos  # nothing after the end-of-turn token (the template's "\n" is dropped)


def test_mars_block_padding_repeats_end_of_turn_as_labels(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    plain = build_examples([CHAT], tokenizer, max_length=256)[0]
    padded = build_examples([CHAT], tokenizer, max_length=256, block_size=4)[0]
    assert len(padded.input_ids) % 4 == 0 and len(padded.input_ids) - len(plain.input_ids) < 4
    extra = padded.labels[len(plain.labels) :]
    assert extra == [eos] * len(extra) and padded.input_ids[len(plain.input_ids) :] == extra


def long_chat(n_words):
    return [{"role": "user", "content": "word " * n_words}, {"role": "assistant", "content": "ok"}]


def test_overlong_examples_are_dropped_with_a_counted_warning(tokenizer):
    conversations = [CHAT, long_chat(200), CHAT, long_chat(300)]
    with pytest.warns(UserWarning, match="2 of 4 examples longer than max_length=40 were dropped"):
        examples = build_examples(conversations, tokenizer, max_length=40, overlong="drop")
    assert len(examples) == 2 and all(len(e.input_ids) <= 40 for e in examples)


def test_overlong_truncate_cuts_the_prompt_from_the_left_and_keeps_the_response(tokenizer):
    full = build_examples([long_chat(100)], tokenizer, max_length=10_000)[0]
    (cut,) = build_examples([long_chat(100)], tokenizer, max_length=40, overlong="truncate")
    assert len(cut.input_ids) == 40
    assert cut.input_ids == full.input_ids[-40:] and cut.labels == full.labels[-40:]
    n_response = sum(1 for t in full.labels if t != IGNORE_INDEX)
    assert sum(1 for t in cut.labels if t != IGNORE_INDEX) == n_response


def test_truncate_drops_an_example_whose_response_alone_is_too_long(tokenizer):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 100}]
    with pytest.warns(UserWarning, match="1 of 2"):
        examples = build_examples([chat, CHAT], tokenizer, max_length=40, overlong="truncate")
    assert len(examples) == 1


def test_collate_tracks_padding_with_a_mask_even_when_pad_equals_eos(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    short, long = build_examples([CHAT, long_chat(30)], tokenizer, max_length=256)
    assert len(short.input_ids) < len(long.input_ids)
    batch = collate([short, long], pad_id=eos)  # pad == eos, as in SmolLM2
    n_short = len(short.input_ids)
    assert batch["valid"][0].sum() == n_short and batch["valid"][1].all()
    assert (batch["labels"][0, n_short:] == IGNORE_INDEX).all()
    assert batch["labels"][0, n_short - 1] == eos  # the real final eos is still a label


def test_epoch_batches_are_deterministic_disjoint_and_length_grouped():
    lengths = [i % 17 for i in range(200)]
    a = epoch_batches(200, 8, epoch=1, seed=3, lengths=lengths)
    assert a == epoch_batches(200, 8, epoch=1, seed=3, lengths=lengths)
    assert a != epoch_batches(200, 8, epoch=2, seed=3, lengths=lengths)
    flat = [i for b in a for i in b]
    assert len(flat) == len(set(flat)) == 200 and all(len(b) == 8 for b in a)
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in a) / len(a)
    assert spread < 4  # random batches of 8 from 0..16 would spread ~12


def test_builtin_weights_draw_named_families_more_often_and_reject_bad_items():
    from collections import Counter

    from finetune.data import builtin_family_cycle, load_conversations
    from finetune.tasks import FAMILIES

    assert builtin_family_cycle("") is None
    cycle = builtin_family_cycle("sorting=3, code=1")
    assert Counter(cycle) == Counter(FAMILIES + ["sorting", "sorting"])
    rows = load_conversations("builtin", 200, seed=0, weights="sorting=3")
    questions = Counter("sorting" if r[0]["content"].startswith("Sort") else "other" for r in rows)
    assert questions["sorting"] == 3 * 200 // (len(FAMILIES) + 2)
    for bad in ("sorting", "sorting=0", "sortin=2", "sorting=x"):
        with pytest.raises(ValueError, match="FAMILY=N"):
            builtin_family_cycle(bad)
    with pytest.raises(ValueError, match="only to --data builtin"):
        load_conversations("my.jsonl", weights="sorting=3")
