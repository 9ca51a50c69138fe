"""Continuable runs on a tiny model: finetune.train --init-adapter (warm start from a saved mars-lora-v1 adapter)
and --skip-seen (a data manifest, so a later round trains on new examples only)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.train import main
from tests.tiny_fixtures import train_flags, train_metrics

REPO = Path(__file__).resolve().parent.parent
LORA = ["--stage", "mars", "--lora", "--lora-r", "4", "--lora-alpha", "8", "--train-mask-row"]


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory):
    """A 3-step LoRA run exported as a mars-lora-v1 adapter in fp32 (exact), as the recipe's export stage does."""
    from mars_core import load_model
    from mars_core.models.adapter import AdapterSpec, save_adapter

    model_dir, _ = tiny
    root = tmp_path_factory.mktemp("adapter")
    main(train_flags(tiny, root / "run", *LORA, "--lr", "3e-2", "--decay", "constant", "--max-steps", "3"))
    state = torch.load(root / "run" / "checkpoint-3" / "trainer_state.pt", weights_only=False)
    lm = load_model(str(model_dir), device="cpu", cpu_layout=False)
    save_adapter(root / "adapter", state["lora"], state["mask_row"],
                 AdapterSpec(r=4, alpha=8, base=str(model_dir), mask_id=lm.mask_id,
                             mask_token=lm.tokenizer.convert_ids_to_tokens(lm.mask_id), block_size=4,
                             dtype=torch.float32))
    return root / "adapter", state, lm.mask_id


def merged_model(model_dir, adapter_dir):
    """The adapter as mars_core serves it: merged into the base weights."""
    from finetune.train_model import load_base
    from mars_core.models.adapter import merge_adapter

    model = load_base(str(model_dir)).model.eval()
    merge_adapter(model, adapter_dir)
    return model


def test_warm_start_begins_from_exactly_the_saved_adapter(tiny, adapter):
    from finetune.config import TrainConfig
    from finetune.train_model import WarmStart, load_base, prepare_model, wrap_model

    model_dir, _ = tiny
    adapter_dir, _, mask_id = adapter
    cfg = TrainConfig(base_model=str(model_dir), stage="mars", lora=True, lora_r=4, lora_alpha=8, train_mask_row=True,
                      init_adapter=str(adapter_dir))
    init = WarmStart.read(cfg)
    base = load_base(str(model_dir))
    plain = load_base(str(model_dir)).model.eval()
    module = wrap_model(prepare_model(base.model, cfg, None, init), cfg, base.mask_id, None, init).eval()
    ids = torch.tensor([[5, 9, 14, 22, mask_id, mask_id, mask_id]])
    with torch.no_grad():
        warm = module.causal_lm()(input_ids=ids).logits
        want = merged_model(model_dir, adapter_dir)(input_ids=ids).logits
        before = plain(input_ids=ids).logits
    torch.testing.assert_close(warm, want, atol=1e-5, rtol=1e-5)       # real tokens and masks alike
    assert (warm - before).abs().max() > 1e-3                           # and the adapter is not a no-op


def test_a_warm_started_run_logs_the_saved_adapters_loss_at_step_1(tiny, adapter, tmp_path):
    """The loop itself starts from the adapter: step 1's loss (before its update) is the merged adapter's loss on
    that batch, not a fresh adapter's."""
    from finetune.data import build_examples, collate, epoch_batches, load_conversations
    from finetune.losses import MarsLossSettings, mars_loss
    from finetune.train_model import load_base

    model_dir, data = tiny
    adapter_dir, _, mask_id = adapter
    main(train_flags(tiny, tmp_path / "warm", *LORA, "--init-adapter", str(adapter_dir), "--max-steps", "1"))
    main(train_flags(tiny, tmp_path / "fresh", *LORA, "--max-steps", "1"))
    warm, fresh = train_metrics(tmp_path / "warm")[0], train_metrics(tmp_path / "fresh")[0]

    base = load_base(str(model_dir))
    examples = build_examples(load_conversations(str(data)), base.tokenizer, max_length=64, block_size=4,
                              eos_ids=base.eos_ids)
    first = epoch_batches(len(examples), 4, 0, 0, [len(e.input_ids) for e in examples])[0]   # seed 0, epoch 0
    batch = collate([examples[i] for i in first], base.tokenizer.pad_token_id)
    with torch.no_grad():
        want = mars_loss(merged_model(model_dir, adapter_dir), **batch,
                         settings=MarsLossSettings(block_size=4, mask_id=mask_id))
    assert warm["loss_mask"] == pytest.approx(float(want.loss_mask), abs=1e-4)
    assert warm["loss_ar"] == pytest.approx(float(want.loss_ar), abs=1e-4)
    assert abs(fresh["loss_mask"] - warm["loss_mask"]) > 1e-2


@pytest.mark.parametrize("extra,message", [
    (["--lora-r", "8"], "has r=4 but this run has --lora-r 8: pass --lora-r 4"),
    (["--lora-alpha", "16"], "has alpha=8 but this run has --lora-alpha 16"),
    (["--train-mask-row", "false"], "holds a trained mask row: pass --train-mask-row"),
])
def test_warm_start_refuses_settings_that_do_not_match_the_adapter(tiny, adapter, tmp_path, extra, message):
    adapter_dir, _, _ = adapter
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        main(train_flags(tiny, tmp_path / "run", *LORA, "--init-adapter", str(adapter_dir), "--max-steps", "1", *extra))
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def copy_adapter(adapter_dir, dst, **changes):
    """The adapter with some of its config's keys changed, or with ``lora`` tensors replaced."""
    import shutil

    shutil.copytree(adapter_dir, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def run_cli(*args):
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    return subprocess.run([sys.executable, "-m", "finetune.train", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


def test_an_adapter_of_another_base_is_one_line_and_exit_2(tiny, adapter, tmp_path):
    adapter_dir, _, _ = adapter
    other = copy_adapter(adapter_dir, tmp_path / "other", base="smollm2")
    done = run_cli(*train_flags(tiny, tmp_path / "run", *LORA, "--init-adapter", str(other), "--max-steps", "1"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"error: --init-adapter {str(other)!r} has base='smollm2' but this run has --base-model "
        f"{str(tiny[0])!r}: pass --base-model smollm2, or start without --init-adapter"]


def test_an_adapter_whose_shapes_do_not_fit_the_model_is_refused_before_training(tiny, adapter, tmp_path):
    """Same base name, other shapes (as a wider base with the same module names would have)."""
    from mars_core import load_model
    from mars_core.models.adapter import AdapterSpec, save_adapter

    model_dir, _ = tiny
    _, state, mask_id = adapter
    narrow = {k: (v[:, :32] if ".lora_A." in k else v) for k, v in state["lora"].items()}   # inputs 32 wide, not 64
    lm = load_model(str(model_dir), device="cpu", cpu_layout=False)
    save_adapter(tmp_path / "narrow", narrow, state["mask_row"],
                 AdapterSpec(r=4, alpha=8, base=str(model_dir), mask_id=mask_id,
                             mask_token=lm.tokenizer.convert_ids_to_tokens(mask_id), block_size=4, dtype=torch.float32))
    done = run_cli(*train_flags(tiny, tmp_path / "run", *LORA, "--init-adapter", str(tmp_path / "narrow"),
                                "--max-steps", "1"))
    assert done.returncode == 2, done.stderr[-2000:]
    # transformers' loading bar may come first; the refusal is the last line and the only error, no traceback
    lines = done.stderr.strip().splitlines()
    assert [line for line in lines if "error" in line.lower()] == lines[-1:] and "Traceback" not in done.stderr
    assert "lora_A [4, 32]" in lines[-1] and "but this model's are [4, " in lines[-1], lines[-1]
    assert lines[-1].endswith("the adapter was made for another base")
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_init_adapter_needs_lora_and_mars():
    from finetune.config import TrainConfig

    with pytest.raises(ValueError, match="init_adapter .*--lora and --stage mars"):
        TrainConfig(init_adapter="x")


def test_a_plain_adapter_does_not_warm_start_a_gated_run(tiny, adapter, tmp_path):
    adapter_dir, _, _ = adapter
    with pytest.raises(ValueError, match="is a plain \\(merged\\) adapter but this run is gated: drop --gated-lora"):
        main(train_flags(tiny, tmp_path / "run", *LORA, "--gated-lora", "--init-adapter", str(adapter_dir),
                         "--max-steps", "1"))
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_skip_seen_trains_on_new_examples_only_and_the_run_manifest_lists_both(tiny, tmp_path):
    from finetune.config import TrainConfig
    from finetune.data import load_conversations, prompt_key, read_manifest, write_manifest
    from finetune.train import select_data

    model_dir, data = tiny
    rows = load_conversations(str(data))
    seen = [prompt_key(c) for c in rows[:12]]
    write_manifest(tmp_path / "seen.json", seen, [{"data": "round 1"}])

    cfg = TrainConfig(base_model=str(model_dir), data=str(data), skip_seen=str(tmp_path / "seen.json"))
    kept, (keys, sources) = select_data(cfg, rows)
    assert kept == rows[12:]                                      # in order, the seen ones out
    assert not {prompt_key(c) for c in kept} & set(seen)
    assert sorted(set(keys)) == sorted(prompt_key(c) for c in rows)
    assert sources[0] == {"data": "round 1"} and sources[1]["left_out_as_seen"] == 12

    out = tmp_path / "run"
    main(train_flags(tiny, out, "--stage", "mars", "--skip-seen", str(tmp_path / "seen.json"), "--max-steps", "1"))
    for where in (out, out / "checkpoint-1"):     # the run and its checkpoint carry the union
        assert set(read_manifest(where)["prompts"]) == {prompt_key(c) for c in rows}
    # A next round that skips this run's manifest has nothing new left in the same data: refused, one line.
    with pytest.raises(ValueError, match="every one of the 40 conversations .* is in the --skip-seen manifest"):
        main(train_flags(tiny, tmp_path / "next", "--stage", "mars", "--skip-seen", str(out), "--max-steps", "1"))


def test_skip_seen_refuses_a_missing_or_foreign_manifest(tiny, tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"prompts": ["abc"]}))
    with pytest.raises(ValueError, match="no data_manifest.json there"):
        main(train_flags(tiny, tmp_path / "a", "--skip-seen", str(tmp_path), "--max-steps", "1"))
    with pytest.raises(ValueError, match="is not a mars-data-manifest-v1 manifest"):
        main(train_flags(tiny, tmp_path / "b", "--skip-seen", str(tmp_path / "bad.json"), "--max-steps", "1"))


def test_the_recipes_manifest_stage_lists_every_distilled_prompt(tmp_path):
    """A prompts file's manifest leaves out exactly the conversations finetune.recipes.distill makes from those
    prompts."""
    from finetune.data import leave_out_seen, read_manifest
    from finetune.recipes.recipe_smollm2 import stage_manifest

    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "prompts.txt").write_text("Explain rain.\nWrite a haiku about tea.\n")
    stage_manifest(work, out)
    seen = set(read_manifest(out)["prompts"])
    distilled = [[{"role": "user", "content": p}, {"role": "assistant", "content": "An answer."}]
                 for p in ("Explain rain.", "Write a haiku about tea.", "Explain snow.")]
    new, n_seen = leave_out_seen(distilled, seen)
    assert n_seen == 2 and new == distilled[2:]


def test_an_adapter_with_a_rank_per_matrix_does_not_warm_start_a_lora_run_but_a_full_fine_tune(tiny, adapter,
                                                                                               tmp_path):
    """A full fine-tune's export (export_delta --max-mb) has a rank per matrix, which peft's one --lora-r cannot hold:
    refused before training, naming the way that works; that way (the folder as --base-model) trains."""
    from mars_core.models.adapter import read_adapter

    adapter_dir, _, _ = adapter
    modules = read_adapter(adapter_dir)[1]
    ranked = copy_adapter(adapter_dir, tmp_path / "ranked", ranks={m: 4 for m in modules})
    assert read_adapter(ranked)[0]["ranks"]   # a valid folder: every matrix at rank 4
    with pytest.raises(ValueError, match=f"has a rank per matrix .*--base-model {ranked}, without --lora"):
        main(train_flags(tiny, tmp_path / "run", *LORA, "--init-adapter", str(ranked), "--max-steps", "1"))
    assert not list((tmp_path / "run").glob("checkpoint-*"))
    flags = train_flags(tiny, tmp_path / "full", "--stage", "mars", "--train-mask-row", "--freeze-embeddings",
                        "--max-steps", "1")
    flags[flags.index("--base-model") + 1] = str(ranked)
    main(flags)
    assert (tmp_path / "full" / "checkpoint-1").is_dir()
