"""--sharding full (FSDP2, finetune.sharding) on two CPU processes over gloo, against the one-process run.

The model is a random Qwen2 of Qwen2.5's shape family (tied embeddings, grouped KV heads, q/k/v biases), 3 layers,
built here. The examples differ in length, so the two processes' slices of a batch hold different numbers of
labelled tokens: finetune.train.process_weight makes their average the one-process mean all the same.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from finetune.checkpoint import check_resumable
from finetune.config import TrainConfig
from finetune.data import Example, epoch_batches
from finetune.train import get_batch, main
from tests.tiny_fixtures import make_tokenizer, save_model_dir, tiny_causal_lm

REPO = Path(__file__).resolve().parent.parent
STEPS = 20


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """(model folder, chat JSONL): a 3-layer random Qwen2 with the character tokenizer; 48 chats of 8 lengths."""
    root = tmp_path_factory.mktemp("qwen2")
    tok = make_tokenizer()
    model = tiny_causal_lm(len(tok), "qwen2", layers=3, context=128, tie=True, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, bos_token_id=None)
    model_dir = save_model_dir(root / "model", tok, model)
    data = root / "data.jsonl"
    with data.open("w") as f:
        for a in range(48):   # one character a token: prompts of 2 lengths, answers of 4
            b = (a * 7) % 10 * (1 + a % 4) ** 2
            chat = [{"role": "user", "content": f"What is {a}+{b}?"},
                    {"role": "assistant", "content": f"{a}+{b}={a + b}"}]
            f.write(json.dumps({"messages": chat}) + "\n")
    return model_dir, data


def flags(qwen2, out, *extra) -> list[str]:
    model_dir, data = qwen2
    return ["--base-model", str(model_dir), "--data", str(data), "--output-dir", str(out), "--max-length", "64",
            "--threads", "1", "--lr", "3e-3", "--max-steps", str(STEPS), "--save-every", "10",
            "--keep-checkpoints", "3", *extra]


def torchrun(args: list[str]) -> str:
    """finetune.train under `torchrun --standalone --nproc_per_node 2` on CPU processes (gloo); returns the log."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "finetune.train", *args]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stderr


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def assert_same_curve(one: list[float], two: list[float]) -> None:
    assert len(one) == len(two) == STEPS
    worst = max(abs(a - b) / abs(a) for a, b in zip(one, two))
    assert worst <= 1e-4, (worst, one, two)


def weights(checkpoint) -> dict:
    return load_file(str(Path(checkpoint) / "model.safetensors"))


@pytest.mark.slow
def test_two_sharded_processes_follow_one_process_resume_exactly_and_export_a_plain_model(qwen2, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    main(flags(qwen2, one, "--batch-size", "4"))
    log = torchrun(flags(qwen2, two, "--batch-size", "2", "--sharding", "full"))   # the same global batch of 4
    assert "2 process(es)" in log
    assert_same_curve(losses(one), losses(two))

    ckpt = two / f"checkpoint-{STEPS}"
    assert (ckpt / "sharded" / ".metadata").is_file() and len(list((ckpt / "sharded").glob("*.distcp"))) == 2
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert state["num_processes"] == 2 and state["optimizer"] == {"torch.distributed.checkpoint": "sharded"}
    a, b = weights(one / f"checkpoint-{STEPS}"), weights(ckpt)   # one consolidated file, the usual keys
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-4, rtol=0)

    # A run killed after its step-10 checkpoint, resumed: the same steps and weights as the uninterrupted one.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(two / "checkpoint-10", resumed / "checkpoint-10")
    shutil.copy(two / "train_config.json", resumed / "train_config.json")
    shutil.copy(two / "checkpoint-10" / "metrics.jsonl", resumed / "metrics.jsonl")
    log = torchrun(flags(qwen2, resumed, "--batch-size", "2", "--sharding", "full"))
    assert "resuming from" in log and "at step 10" in log
    assert losses(resumed) == losses(two)
    c = weights(resumed / f"checkpoint-{STEPS}")
    assert all(torch.equal(b[name], c[name]) for name in b)

    # The export is an ordinary checkpoint: our decoder loads it, and one token a forward is greedy AR.
    from mars_core import DecodeConfig, generate, load_model

    lm = load_model(str(ckpt), device="cpu", dtype="float32")
    prompts = [lm.encode("What is 07+9?"), lm.encode("What is 31+7?")]
    ar = generate(lm, prompts, DecodeConfig(mode="ar", max_new_tokens=12))
    mars = generate(lm, prompts, DecodeConfig(mode="mars", tau=1.0, block_size=4, max_new_tokens=12))
    assert [r.token_ids for r in mars] == [r.token_ids for r in ar]
    assert all(len(r.token_ids) > 0 for r in ar)


@pytest.mark.slow
def test_sharded_lora_with_gradient_checkpointing_and_the_mask_row_follows_one_process(qwen2, tmp_path):
    extra = ["--lora", "--lora-r", "4", "--train-mask-row", "--group-by-length", "false"]
    one, two = tmp_path / "one", tmp_path / "two"
    main(flags(qwen2, one, "--batch-size", "4", *extra))
    torchrun(flags(qwen2, two, "--batch-size", "2", "--sharding", "full", "--gradient-checkpointing", *extra))
    assert_same_curve(losses(one), losses(two))
    a, b = weights(one / f"checkpoint-{STEPS}"), weights(two / f"checkpoint-{STEPS}")
    assert sorted(a) == sorted(b) and not any("lora" in name for name in b)   # merged, as every LoRA checkpoint
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-4, rtol=0)
    state = torch.load(two / f"checkpoint-{STEPS}" / "trainer_state.pt", weights_only=False)
    assert state["lora"] and state["mask_row"] is not None


def test_sharding_in_one_process_is_refused_naming_torchrun(qwen2, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"--sharding full .* this run has 1: launch it with `torchrun"):
        main(flags(qwen2, tmp_path / "run", "--sharding", "full"))
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def test_resuming_with_another_sharding_is_refused_by_name(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "train_config.json").write_text(json.dumps(TrainConfig(sharding="no").to_dict()))
    with pytest.raises(ValueError, match=r"sharding='no' but this run has sharding='full'.*--restart"):
        check_resumable(out, TrainConfig(sharding="full"))


@pytest.mark.parametrize("bad, match", [({"sharding": "zero3"}, "sharding='zero3'; use one of no, full"),
                                        ({"sharding": "full", "mixed_precision": "fp16"}, "use --mixed-precision bf16"),
                                        ({"sharding": "full", "compile": True}, "drop --compile")])
def test_bad_sharding_settings_name_the_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**bad)


def test_group_by_length_false_draws_the_plain_shuffle_and_true_pads_less():
    lengths = [3 + (i * 37) % 40 for i in range(200)]
    examples = [Example(input_ids=[1] * n, labels=[1] * n) for n in lengths]

    def batches(group: bool) -> list[list[int]]:
        cfg = TrainConfig(batch_size=4, group_by_length=group)
        run = SimpleNamespace(cfg=cfg, examples=examples, pad_id=0, micro_per_epoch=50,
                              accelerator=SimpleNamespace(num_processes=1, process_index=0, device="cpu"))
        cache: dict = {}
        drawn = [get_batch(run, k, cache)[0] for k in range(50)]
        return drawn, cache["batches"]

    plain, plain_order = batches(False)
    grouped, _ = batches(True)
    assert plain_order == epoch_batches(200, 4, 0, 0)   # no lengths: the shuffle alone
    padding = lambda drawn: sum(int((~b["valid"]).sum()) for b in drawn)  # noqa: E731
    assert padding(grouped) < padding(plain) / 4


def test_gradient_checkpointing_is_switched_on_and_changes_no_number(qwen2, tmp_path):
    from transformers import AutoModelForCausalLM

    from finetune.train_model import prepare_model

    model = prepare_model(AutoModelForCausalLM.from_pretrained(qwen2[0]), TrainConfig(gradient_checkpointing=True),
                          None)
    assert model.is_gradient_checkpointing and model.training
    plain, ckpt = tmp_path / "plain", tmp_path / "ckpt"
    short = ["--batch-size", "4", "--max-steps", "3", "--save-every", "0"]
    main(flags(qwen2, plain, *short[:2]) + short[2:])
    main(flags(qwen2, ckpt, *short[:2], "--gradient-checkpointing") + short[2:])
    assert losses(ckpt) == losses(plain)
    a, b = weights(plain / "checkpoint-3"), weights(ckpt / "checkpoint-3")
    assert all(torch.equal(a[name], b[name]) for name in a)
