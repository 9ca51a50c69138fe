"""custom_generate/: MARS decoding through `model.generate(..., custom_generate=<repo>, trust_remote_code=True)`.

The tests play the user, who opts into the remote code; the repository's own code never does (last test).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import TextStreamer

from mars_core import DecodeConfig, generate, load_model

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["What is 2+3?", "Sort: c a b"]


def mars_generate(model, ids, **kw):
    return model.generate(ids, custom_generate=str(REPO), trust_remote_code=True, **kw)


def ids_of(lm, prompt: str) -> torch.Tensor:
    return torch.tensor([lm.encode(prompt)])


@pytest.mark.parametrize("tau", [0.9, 0.5])
def test_tokens_and_steps_equal_our_own_generate(tiny_lm, tau):
    ids = ids_of(tiny_lm, PROMPTS[0])
    out = mars_generate(tiny_lm.model, ids, tau=tau, block_size=4, mask_token_id=tiny_lm.mask_id, max_new_tokens=24,
                        eos_token_id=tiny_lm.eos_ids, return_dict_in_generate=True)
    ref = generate(tiny_lm, [ids[0].tolist()], DecodeConfig(tau=tau, block_size=4, max_new_tokens=24))[0]
    assert out.sequences[0, : ids.shape[1]].tolist() == ids[0].tolist()
    assert out.sequences[0, ids.shape[1]:].tolist() == ref.token_ids
    assert out.step_tokens[0] == ref.steps
    assert out.accepted_counts[0] == [len(s) for s in ref.steps]
    assert out.finish_reasons[0] == ref.finish_reason


def test_tau_one_equals_plain_greedy_generate(tiny_lm):
    ids = ids_of(tiny_lm, PROMPTS[1])
    plain = tiny_lm.model.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=tiny_lm.eos_ids)
    # no mask id needed in one-token mode: no masks are appended
    ours = mars_generate(tiny_lm.model, ids, tau=1.0, max_new_tokens=30, eos_token_id=tiny_lm.eos_ids)
    assert torch.equal(plain, ours)


def test_verify_mode_is_lossless_and_still_drafts(tiny_lm):
    ids = ids_of(tiny_lm, PROMPTS[0])
    plain = tiny_lm.model.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=tiny_lm.eos_ids)
    out = mars_generate(tiny_lm.model, ids, mode="verify", tau=0.5, mask_token_id=tiny_lm.mask_id, max_new_tokens=30,
                        eos_token_id=tiny_lm.eos_ids, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    ref = generate(tiny_lm, [ids[0].tolist()], DecodeConfig(mode="verify", tau=0.5, max_new_tokens=30))[0]
    assert out.step_tokens[0] == ref.steps
    with pytest.raises(ValueError, match="mode='fast' is unknown"):
        mars_generate(tiny_lm.model, ids, mode="fast", mask_token_id=tiny_lm.mask_id)


def test_embedded_tiny_mars_accepts_several_tokens_and_matches_our_generate_and_plain_generate():
    lm = load_model("tiny-mars", device="cpu", cpu_layout=False)
    ids = ids_of(lm, "What is 17 + 25?")
    out = mars_generate(lm.model, ids, tau=0.95, block_size=4, mask_token_id=lm.mask_id, max_new_tokens=48,
                        return_dict_in_generate=True)    # eos from the checkpoint's generation_config
    ref = generate(lm, [ids[0].tolist()], DecodeConfig(tau=0.95, block_size=4, max_new_tokens=48))[0]
    assert out.sequences[0, ids.shape[1]:].tolist() == ref.token_ids
    assert max(out.accepted_counts[0]) > 1 and len(out.accepted_counts[0]) < len(ref.token_ids)
    plain = lm.model.generate(ids, do_sample=False, max_new_tokens=48)
    assert torch.equal(mars_generate(lm.model, ids, tau=1.0, max_new_tokens=48), plain)
    lossless = mars_generate(lm.model, ids, mode="verify", tau=0.95, mask_token_id=lm.mask_id, max_new_tokens=48,
                             return_dict_in_generate=True)
    assert torch.equal(lossless.sequences, plain) and max(lossless.accepted_counts[0]) > 1


def left_padded(lm, prompts, pad_id):
    rows = [lm.encode(p) for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    assert mask.min() == 0   # the batch really is padded
    return rows, ids, mask


def test_left_padded_batch_of_two(tiny_lm):
    pad = tiny_lm.tokenizer.pad_token_id
    rows, ids, mask = left_padded(tiny_lm, PROMPTS, pad)
    plain = tiny_lm.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=pad,
                                   eos_token_id=tiny_lm.eos_ids)
    one = mars_generate(tiny_lm.model, ids, attention_mask=mask, tau=1.0, max_new_tokens=20, pad_token_id=pad,
                        eos_token_id=tiny_lm.eos_ids)
    assert torch.equal(plain, one)
    out = mars_generate(tiny_lm.model, ids, attention_mask=mask, tau=0.9, mask_token_id=tiny_lm.mask_id,
                        max_new_tokens=20, pad_token_id=pad, eos_token_id=tiny_lm.eos_ids, return_dict_in_generate=True)
    width = ids.shape[1]
    for r, row in enumerate(rows):   # each row gets exactly the tokens it gets alone, pads after them
        alone = generate(tiny_lm, [row], DecodeConfig(tau=0.9, block_size=4, max_new_tokens=20))[0]
        got = out.sequences[r, width:].tolist()
        assert got[: len(alone.token_ids)] == alone.token_ids
        assert set(got[len(alone.token_ids):]) <= {pad}
        assert out.step_tokens[r] == alone.steps


def test_a_right_padded_batch_is_refused_with_the_fix(tiny_lm):
    ids = torch.tensor([[10, 11, 12], [10, 11, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        mars_generate(tiny_lm.model, ids, attention_mask=mask, tau=0.9, mask_token_id=tiny_lm.mask_id)


class Recorder:
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


def test_streamer_gets_the_prompt_then_each_forwards_tokens(tiny_lm, capsys):
    ids = ids_of(tiny_lm, PROMPTS[0])
    rec = Recorder()
    out = mars_generate(tiny_lm.model, ids, streamer=rec, tau=0.5, mask_token_id=tiny_lm.mask_id, max_new_tokens=20,
                        eos_token_id=tiny_lm.eos_ids, return_dict_in_generate=True)
    assert rec.puts[0] == ids.tolist() and rec.ended == 1
    assert rec.puts[1:] == out.step_tokens[0]
    assert any(len(p) > 1 for p in rec.puts[1:])          # several tokens in one put: a MARS step
    # transformers' own TextStreamer takes these puts and prints the same text as decoding the result
    mars_generate(tiny_lm.model, ids, streamer=TextStreamer(tiny_lm.tokenizer, skip_prompt=True), tau=0.5,
                  mask_token_id=tiny_lm.mask_id, max_new_tokens=20, eos_token_id=tiny_lm.eos_ids)
    printed = capsys.readouterr().out
    assert printed.strip() == tiny_lm.tokenizer.decode(out.sequences[0, ids.shape[1]:]).strip()


def test_mask_id_from_the_config_and_errors_that_name_the_fix(tiny_lm):
    ids = ids_of(tiny_lm, PROMPTS[0])
    model = tiny_lm.model
    with pytest.raises(ValueError, match="pass mask_token_id="):
        mars_generate(model, ids, tau=0.9, max_new_tokens=4)
    with pytest.raises(ValueError, match="mask_token_id=99999 is not a token id"):
        mars_generate(model, ids, tau=0.9, mask_token_id=99999, max_new_tokens=4)
    with pytest.raises(ValueError, match="num_beams=2 is not supported.*num_beams=1"):
        mars_generate(model, ids, tau=0.9, mask_token_id=tiny_lm.mask_id, num_beams=2)
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['tua'\]"):
        mars_generate(model, ids, tua=0.9, mask_token_id=tiny_lm.mask_id)
    with pytest.raises(ValueError, match="tau=-1"):
        mars_generate(model, ids, tau=-1, mask_token_id=tiny_lm.mask_id)
    ref = mars_generate(model, ids, tau=0.9, mask_token_id=tiny_lm.mask_id, max_new_tokens=12,
                        eos_token_id=tiny_lm.eos_ids)
    model.config.mask_token_id = tiny_lm.mask_id          # what `python -m mars_core export` writes
    try:
        assert torch.equal(mars_generate(model, ids, tau=0.9, max_new_tokens=12, eos_token_id=tiny_lm.eos_ids), ref)
    finally:
        del model.config.mask_token_id


def test_mars_step_is_what_the_vendor_script_writes_from_the_decoder_now():
    from mars_core.tools import vendor_custom_generate

    committed = (REPO / "custom_generate" / "mars_step.py").read_text()
    assert committed == vendor_custom_generate.render(), \
        "custom_generate/mars_step.py is stale: run python -m mars_core.tools.vendor_custom_generate"
    assert vendor_custom_generate.main(["--check"]) == 0
    # the copy is the decoder itself: its entry points, not a stand-in
    assert "def generate_stream(" in committed and "class DecodeConfig:" in committed and "mars_core" not in "".join(
        line for line in committed.splitlines() if line.startswith(("import ", "from ")))


def test_the_folder_imports_only_torch_transformers_and_its_own_files():
    from transformers.dynamic_module_utils import get_imports, get_relative_import_files

    folder = REPO / "custom_generate"
    files = get_relative_import_files(str(folder / "generate.py"))   # what transformers copies (or downloads)
    assert sorted(Path(f).name for f in files) == ["mars_step.py"]
    third_party = {m for f in (folder / "generate.py", *files) for m in get_imports(f)} - set(sys.stdlib_module_names)
    required = [line.split(">")[0].split("=")[0].strip()
                for line in (folder / "requirements.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert third_party == set(required) == {"torch", "transformers"}


# Run in a fresh interpreter: a copy of the folder alone (as on the Hub), mars_core made unimportable first.
WITHOUT_MARS_CORE = """
import json, sys

class NoMarsCore:
    def find_spec(self, name, path=None, target=None):
        if name == "mars_core" or name.startswith("mars_core."):
            raise ImportError(f"{name} is blocked by the test")

sys.meta_path.insert(0, NoMarsCore())
try:
    import mars_core
    sys.exit("mars_core is importable: the test would prove nothing")
except ImportError:
    pass
import torch
from transformers import AutoModelForCausalLM

folder, checkpoint, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
out = [model.generate(torch.tensor([c["ids"]]), custom_generate=folder, trust_remote_code=True, tau=c["tau"],
                      block_size=4, mask_token_id=c["mask"], eos_token_id=c["eos"], max_new_tokens=c["new"],
                      return_dict_in_generate=True) for c in cases]
print(json.dumps({"tokens": [o.sequences[0, len(c["ids"]):].tolist() for o, c in zip(out, cases)],
                  "steps": [o.step_tokens[0] for o in out],
                  "mars_core_loaded": any(m.split(".")[0] == "mars_core" for m in sys.modules)}))
"""


def test_a_copy_of_the_folder_alone_runs_without_mars_core_and_equals_its_decoder(tmp_path):
    import json
    import shutil

    lm = load_model("tiny-mars", device="cpu", dtype="float32", cpu_layout=False)
    copy = tmp_path / "hub-copy" / "custom_generate"
    copy.mkdir(parents=True)
    for name in ("generate.py", "mars_step.py", "requirements.txt", "README.md"):
        shutil.copy(REPO / "custom_generate" / name, copy / name)
    prompts, taus, new = ["What is 17 + 25?", "Sort: c a b", "Name three colours."], [0.95, 0.6, 1.0], 32
    cases = [dict(ids=lm.encode(p), tau=t, mask=lm.mask_id, eos=lm.eos_ids, new=new) for p in prompts for t in taus]
    env = {**os.environ, "PYTHONPATH": "", "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", WITHOUT_MARS_CORE, str(copy.parent), str(Path(lm.path)),
                           json.dumps(cases)], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["mars_core_loaded"] is False
    for case, tokens, steps in zip(cases, got["tokens"], got["steps"]):
        ref = generate(lm, [case["ids"]], DecodeConfig(tau=case["tau"], block_size=4, max_new_tokens=new))[0]
        assert tokens == ref.token_ids and steps == ref.steps, case
        if case["tau"] >= 1.0:   # one-token mode: plain greedy generate, token for token
            plain = lm.model.generate(torch.tensor([case["ids"]]), do_sample=False, max_new_tokens=new,
                                      eos_token_id=lm.eos_ids)
            assert tokens == plain[0, len(case["ids"]):].tolist()
    assert any(len(s) > 1 for s in got["steps"][0])   # tiny-mars at τ = 0.95 does accept several tokens per pass


def test_the_checkout_is_the_folder_to_pass():
    from mars_core import custom_generate_path
    assert custom_generate_path() == str(REPO)


def test_our_own_code_never_sets_trust_remote_code():
    files = [REPO / "app.py", *(p for d in ("mars_core", "finetune", "app", "custom_generate")
                                for p in (REPO / d).rglob("*.py"))]
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
                if not (isinstance(node.value, ast.Constant) and node.value.value is False):
                    offenders.append(f"{path.relative_to(REPO)}:{node.value.lineno}")
    assert len(files) > 20 and offenders == []
