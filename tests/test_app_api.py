"""The page's API: exactly the user-facing actions, by name, callable through gradio_client.

Internal events (notices, warnings, polls, ledger views) are private, so `view_api()` lists only what a
user does on the page; one test launches the real page on 127.0.0.1 and calls it as a client would.
"""
from __future__ import annotations

import json
import os
import socket

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from app import generate, inputs, ui  # noqa: E402

NAMED = {"/load_model", "/race", "/sweep", "/one_step", "/mask", "/finetune_start", "/finetune_stop",
         "/finetune_kill"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return ui.build_ui("tiny-mars", runs_dir=tmp_path_factory.mktemp("runs"))


def test_the_api_lists_exactly_the_named_user_facing_endpoints(demo):
    info = demo.get_api_info()
    assert set(info["named_endpoints"]) == NAMED == {f"/{n}" for n in ui.API_NAMES}
    assert not info.get("unnamed_endpoints")
    params = {e: [p["parameter_name"] for p in v["parameters"]] for e, v in info["named_endpoints"].items()}
    assert params["/one_step"] == ["choice", "free_text", "prompt", "tau", "tau_off", "block_size", "criterion"]
    assert params["/sweep"][:3] == ["choice", "free_text", "source"] and params["/finetune_stop"] == []
    # the race is listed once (the button), though Enter in the prompt runs it too
    assert sum(1 for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "race_fn") == 2


def test_slow_motion_takes_what_the_api_documents(demo):
    race = next(v for k, v in demo.get_api_info()["named_endpoints"].items() if k == "/race")
    slow = next(p for p in race["parameters"] if p["parameter_name"] == "slow_motion")
    assert slow["python_type"]["type"] == "Literal['1', '10', '50', '200']"
    for documented, factor in (("1", 1), ("10", 10), ("50", 50), ("200", 200), (10, 10), (" 50 ", 50)):
        assert inputs.check_slow_motion(documented) == factor
    for bad in ("3", 3, 2.5, True, "fast"):
        with pytest.raises(ValueError, match="pick one of .*1 \\| 10 \\| 50 \\| 200"):
            inputs.check_slow_motion(bad)
    for empty in (None, ""):
        with pytest.raises(ValueError, match="slow motion is empty"):
            inputs.check_slow_motion(empty)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def client(demo):
    gradio_client = pytest.importorskip("gradio_client")
    demo.queue(default_concurrency_limit=1).launch(server_name="127.0.0.1", server_port=_free_port(), share=False,
                                                   prevent_thread_lock=True, quiet=True, ssr_mode=False)
    try:
        yield gradio_client.Client(demo.local_url, verbose=False, download_files=False)
    finally:
        demo.close()


def test_a_client_sees_and_calls_the_named_endpoints(client):
    assert set(client.view_api(print_info=False, return_format="dict")["named_endpoints"]) == NAMED
    html, _fig = client.predict("tiny-mars", "", "What is 12 + 30?", 0.9, False, 4, "prob", api_name="/one_step")
    assert "model: <b>tiny-mars</b>" in html and html.count("<tr class=") == 4
    out = client.predict("tiny-mars", "", "same", "What is 12 + 30?", 0.9, False, 4, 8, 0.0, "1", "prob", 0,
                         False, "linear", False, api_name="/race")
    # the page's outputs less the race state (gr.State never leaves the server)
    assert len(out) == generate.N_OUTPUTS - 1
    assert out[0].startswith("✓ Done") and "AR 8 forwards" in out[0], out[0]
    with pytest.raises(Exception):          # internal events are not callable
        client.predict(api_name="/clear_warning")


GOOD_RACE = dict(choice="tiny-mars", free_text="", ar_choice="same", prompt="What is 12 + 30?", tau=0.9,
                 tau_off=False, block_size=4, max_new_tokens=8, temperature=0.0, slow_motion="1", criterion="prob",
                 seed=0, measure_after=False, draft_layout="linear", copy_drafts=False)
GOOD_SWEEP = dict(choice="tiny-mars", free_text="", source="builtin", n=2, taus_text="1.0", prompts_text="",
                  block_size=4, max_new_tokens=8, criterion="prob", lossless=False)
GOOD_STEP = dict(choice="tiny-mars", free_text="", prompt="What is 12 + 30?", tau=0.9, tau_off=False, block_size=4,
                 criterion="prob")
GOOD_START = dict(base="tiny-ar-sft", data_source="builtin", upload=None, stage="mars", block_size=4, ar_weight=1.0,
                  steps=10, lr=1e-3, lora=False)
# (endpoint, good values, field, bad value, words the message must hold): a bad value in each kind of field
BAD_VALUES = [
    ("/race", GOOD_RACE, "choice", "nope", "model 'nope' is not in the list"),
    ("/race", GOOD_RACE, "ar_choice", 5, "the model is 5"),
    ("/race", GOOD_RACE, "prompt", "", "the prompt is empty"),
    ("/race", GOOD_RACE, "tau", "abc", "τ is 'abc': type a number"),
    ("/race", GOOD_RACE, "tau_off", "maybe", "τ off is 'maybe': send true or false"),
    ("/race", GOOD_RACE, "block_size", "x", "block size B is 'x'"),
    ("/race", GOOD_RACE, "max_new_tokens", "many", "max new tokens is 'many'"),
    ("/race", GOOD_RACE, "temperature", "hot", "temperature is 'hot'"),
    ("/race", GOOD_RACE, "slow_motion", "7", "slow motion '7': pick one of"),
    ("/race", GOOD_RACE, "criterion", "nope", "confidence criterion 'nope' is unknown"),
    ("/race", GOOD_RACE, "seed", "seed", "seed is 'seed'"),
    ("/race", GOOD_RACE, "measure_after", "yes", "then time again is 'yes'"),
    ("/race", GOOD_RACE, "draft_layout", "zigzag", "draft layout 'zigzag' is unknown"),
    ("/race", GOOD_RACE, "copy_drafts", 3, "copy drafts from the prompt is 3"),
    ("/sweep", GOOD_SWEEP, "source", "sideways", "prompts 'sideways' is unknown"),
    ("/sweep", GOOD_SWEEP, "n", "many", "number of built-in tasks is 'many'"),
    ("/sweep", GOOD_SWEEP, "taus_text", "0.9, fast", "τ value 'fast' is not a number"),
    ("/sweep", GOOD_SWEEP, "block_size", "b", "block size B is 'b'"),
    ("/sweep", GOOD_SWEEP, "max_new_tokens", 1000, "max new tokens 1000 is not a whole number in 8..256"),
    ("/sweep", GOOD_SWEEP, "criterion", 1, "confidence criterion 1 is unknown"),
    ("/sweep", GOOD_SWEEP, "lossless", "yes", "add the lossless curve is 'yes'"),
    ("/one_step", GOOD_STEP, "tau", "abc", "τ is &#x27;abc&#x27;"),
    ("/one_step", GOOD_STEP, "tau_off", "no", "τ off is &#x27;no&#x27;"),
    ("/one_step", GOOD_STEP, "block_size", "four", "block size B is &#x27;four&#x27;"),
    ("/one_step", GOOD_STEP, "criterion", "nope", "confidence criterion &#x27;nope&#x27; is unknown"),
    ("/load_model", dict(choice="tiny-mars", free_text=""), "free_text", "/no/such/dir", "does not exist"),
    ("/finetune_start", GOOD_START, "steps", "ten", "steps 'ten' is not a number"),
    ("/finetune_start", GOOD_START, "lr", "fast", "learning rate 'fast' is not a number"),
    ("/finetune_start", GOOD_START, "block_size", "b", "block size B 'b' is not a number"),
    ("/finetune_start", GOOD_START, "ar_weight", 7, "ar_weight 7 is out of range"),
    ("/finetune_start", GOOD_START, "stage", "stage9", "stage 'stage9' is unknown"),
    ("/finetune_start", GOOD_START, "data_source", "sideways", "dataset 'sideways' is unknown"),
    ("/finetune_start", GOOD_START, "lora", "maybe", "LoRA is 'maybe'"),
    ("/finetune_start", GOOD_START, "base", "gpt-9", "base model 'gpt-9' is not in the list"),
]


@pytest.mark.parametrize("endpoint, good, field, bad, words", BAD_VALUES,
                         ids=[f"{e[1:]}-{f}" for e, _, f, _, _ in BAD_VALUES])
def test_a_bad_value_sent_to_an_endpoint_gets_the_handlers_message_in_the_page(client, endpoint, good, field, bad,
                                                                               words):
    out = client.predict(**{**good, field: bad}, api_name=endpoint)   # never Gradio's generic exception
    message = out[0] if isinstance(out, (list, tuple)) else out
    assert "⚠" in message and words in message, message


def test_the_mask_endpoint_names_a_bad_value_in_its_figure(client):
    for n, b, words in (("x", 4, "sequence length n is 'x'"), (12, "y", "block size B is 'y'"),
                        (1000, 4, "sequence length n 1000 is not a whole number in 2..32")):
        fig = json.loads(client.predict(n=n, block_size=b, api_name="/mask")["plot"])
        texts = " ".join(a["text"] for a in fig["layout"].get("annotations", []))
        assert words in texts and not fig["data"], texts


def test_a_bad_value_starts_no_finetune_run(demo):
    assert demo.jobs.latest_job() is None


def test_a_client_gets_the_races_answers_before_its_timing(client):
    job = client.submit(**{**GOOD_RACE, "max_new_tokens": 32, "measure_after": True}, api_name="/race")
    job.result()
    statuses = [out[0] for out in job.outputs()]
    ended = next(k for k, s in enumerate(statuses) if s.startswith("✓ Race finished"))
    done = next(k for k, s in enumerate(statuses) if s.startswith("✓ Done"))
    assert ended < done and "tokens/forward" in statuses[ended]
    assert "stat-tpf-mars" in job.outputs()[ended][5]                  # the table is out with the answers
    assert 'id="speedup-value" data-median' in job.outputs()[done][5]   # the timed number follows


def test_the_race_and_the_sweep_start_each_model_at_its_block_size_and_follow_a_model_change(tmp_path):
    """smollm2-mars starts the race, the τ sweep and Learn (its mask and its steps) at B = 3
    (app.models.DEFAULT_BLOCK_SIZES), Finetune's B (what a new run trains) and every other model at 4; changing the
    model (either field) moves the three sliders, so Learn steps through what the race ran."""
    from app import models
    page = ui.build_ui("smollm2-mars", runs_dir=tmp_path)
    sliders = [b for b in page.blocks.values() if getattr(b, "label", None) == "block size B"]
    followers = [b for b in sliders if b.value == models.default_block_size("smollm2-mars") == 3]
    assert len(followers) == 3 and sorted(b.value for b in sliders) == [3, 3, 3, 4]
    learn_b = next(f.inputs[5] for f in page.fns.values()
                   if getattr(getattr(f.fn, "func", f.fn), "__name__", "") == "one_step")   # its B input
    assert learn_b in followers
    for slider in followers:
        follow = [f.fn for f in page.fns.values() if any(o._id == slider._id for o in f.outputs)]
        assert len(follow) == 2   # the model list's change and the free field's submit
        for fn in follow:
            assert fn("smollm2-mars", "")["value"] == 3 and fn("tiny-mars", "")["value"] == 4
    tiny = ui.build_ui("tiny-mars", runs_dir=tmp_path)
    assert [b.value for b in tiny.blocks.values() if getattr(b, "label", None) == "block size B"] == [4, 4, 4, 4]
