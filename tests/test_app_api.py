"""The page's API: exactly the user-facing actions, by name, callable through gradio_client.

Internal events (notices, warnings, polls, ledger views) are private, so `view_api()` lists only what a
user does on the page; one test launches the real page on 127.0.0.1 and calls it as a client would.
"""
from __future__ import annotations

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
