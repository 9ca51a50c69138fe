"""Checkpoints of a finetune.train run: writing them, finding them, and resuming from the newest intact one.

``checkpoint-<step>/`` is a plain transformers directory (LoRA already merged, the trained mask row written
into the embedding) with the tokenizer, train_config.json, the metrics.jsonl lines up to <step>, and
``trainer_state.pt``: what resuming needs and the weights cannot hold (see ``trainer_state``).
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from finetune.config import TrainConfig
from finetune.status import METRICS_FILE, read_metrics_rows, write_json
from mars_core.storage import storage_error

if TYPE_CHECKING:
    from finetune.train_model import Run, TrainModule

CHECKPOINT_PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "train_config.json"

# Settings that define the model, the objective or the data draw: a resume that changes one would silently mix
# two trainings in one checkpoint. --max-steps, --lr and the like may change (to extend a run).
RESUME_KEYS = ("base_model", "stage", "lora", "gated_lora", "lora_r", "lora_alpha", "lora_dropout", "lora_layers", "train_mask_row", "freeze_embeddings", "block_size",
               "ar_weight", "mask_label_smoothing", "soft_target_weight", "soft_target_top_k", "random_block_offset", "data", "builtin_weights", "seed", "init_adapter", "skip_seen",
               "batch_size", "grad_accum", "max_length", "overlong")


def checkpoint_step(path: Path) -> int | None:
    name = path.name
    if not name.startswith(CHECKPOINT_PREFIX) or not name[len(CHECKPOINT_PREFIX) :].isdigit():
        return None
    return int(name[len(CHECKPOINT_PREFIX) :])


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints (those with trainer_state.pt), oldest first."""
    if not out.is_dir():
        return []
    found = [p for p in out.iterdir() if checkpoint_step(p) is not None and (p / STATE_FILE).is_file()]
    return sorted(found, key=checkpoint_step)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def read_metrics(path: Path, up_to_step: int | None = None) -> list[str]:
    """metrics.jsonl's lines as written, up to ``up_to_step``: what a checkpoint keeps and a resume restarts from."""
    return [line for line, _ in read_metrics_rows(path, up_to_step)]


def keep_metrics(src: Path, dst: Path, up_to_step: int) -> None:
    """Write ``src``'s metrics up to ``up_to_step`` to ``dst``; later lines are about to be redone (or never were)."""
    dst.write_text("".join(line + "\n" for line in read_metrics(src, up_to_step)))


# ----------------------------------------------------------------------------- saving


def save_checkpoint(run: Run, step: int, elapsed: float) -> Path:
    """Write checkpoint-<step>/ atomically (main process only) and prune old ones."""
    acc = run.accelerator
    final = run.out / f"{CHECKPOINT_PREFIX}{step}"
    acc.wait_for_everyone()
    if acc.num_processes > 1:
        check_replicas_agree(run)
    if acc.is_main_process:
        tmp = run.out / f".{final.name}.tmp"  # renamed into place once complete: a kill leaves no half checkpoint
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            write_checkpoint(run, tmp, step, elapsed)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except BaseException as exc:   # no half checkpoint left behind (a full disk would stay full)
            shutil.rmtree(tmp, ignore_errors=True)
            if not isinstance(exc, OSError):
                raise
            raise ValueError(storage_error(exc, tmp if exc.filename is None else exc.filename,
                                           f"checkpoint {final.name} of --output-dir {str(run.out)!r}")) from None
        for old in list_checkpoints(run.out)[: -run.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def check_replicas_agree(run: Run) -> None:
    """Data-parallel replicas must hold identical weights; a difference means gradients were not synced."""
    acc = run.accelerator
    checksum = torch.stack([p.detach().double().sum() for p in run.module.parameters()]).sum().reshape(1)
    sums = acc.gather(checksum.to(acc.device))
    assert torch.allclose(sums, sums[0]), f"replicas diverged: {sums.tolist()}"


def write_checkpoint(run: Run, directory: Path, step: int, elapsed: float) -> None:
    train_module = run.accelerator.unwrap_model(run.module)
    plain_model(train_module, run.cfg.lora).save_pretrained(directory, safe_serialization=True)
    run.tokenizer.save_pretrained(directory)
    write_json(directory / CONFIG_FILE, run.cfg.to_dict())
    if run.manifest is not None:   # travels with the weights: an adapter exported from here can carry it
        from finetune.data import MANIFEST_FILE, write_manifest

        write_manifest(directory / MANIFEST_FILE, *run.manifest)
    keep_metrics(run.out / METRICS_FILE, directory / METRICS_FILE, step)
    torch.save(trainer_state(run, train_module, step, elapsed), directory / STATE_FILE)


def plain_model(train_module: TrainModule, lora: bool) -> nn.Module:
    """The model as a stock transformers model: LoRA merged, the trained mask row in the embedding. A gated
    adapter cannot be merged (it acts on mask positions only): its plain model is the base, unchanged."""
    model = train_module.model
    if lora and getattr(train_module, "gate", None) is not None:
        return copy.deepcopy(model).unload()
    if lora:
        # Merge into a copy so training continues on the unmerged adapter; the copy must not
        # carry a --compile wrapper (it is bound to the original module).
        decoder = train_module.causal_lm().model
        compiled = decoder.__dict__.pop("forward", None)
        try:
            model = copy.deepcopy(model).merge_and_unload()
        finally:
            if compiled is not None:
                decoder.forward = compiled
    if train_module.mask_row is not None:
        train_module.mask_row.write_into(model.get_base_model() if hasattr(model, "get_base_model") else model)
    return model


def trainer_state(run: Run, train_module: TrainModule, step: int, elapsed: float) -> dict:
    """What a resume reads back. No schedule state: the learning rate is a function of the step (``get_lr``)."""
    mask_row = train_module.mask_row
    return {
        "step": step,
        "optimizer": run.optimizer.state_dict(),
        "rng": rng_state(),
        "elapsed": elapsed,
        "lora": lora_weights(train_module.model) if run.cfg.lora else None,  # the base model + these = the model
        "mask_row": None if mask_row is None else mask_row.row.detach().cpu().clone(),
        "num_processes": run.accelerator.num_processes,
    }


def lora_weights(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(peft_model).items()}


# ----------------------------------------------------------------------------- resuming


def check_resumable(out: Path, cfg: TrainConfig) -> None:
    """Refuse to resume a run whose model-, objective- or data-defining settings (``RESUME_KEYS``) changed."""
    saved_path = out / CONFIG_FILE
    if not saved_path.is_file():   # removed by hand: every checkpoint carries its own copy
        copies = [c / CONFIG_FILE for c in list_checkpoints(out) if (c / CONFIG_FILE).is_file()]
        if not copies:
            return
        saved_path = copies[-1]
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{saved_path} is unreadable ({exc}): restore it, or use a new --output-dir") from None
    keys = list(RESUME_KEYS)
    if cfg.data == "builtin":  # the number of generated examples is the data; it means nothing for a file
        keys.append("builtin_examples")
    for key in keys:
        if key in saved and saved[key] != getattr(cfg, key):
            raise ValueError(
                f"{out} holds a run with {key}={saved[key]!r} but this run has {key}={getattr(cfg, key)!r}: "
                "use a new --output-dir, or the same settings to resume"
            )


def safetensors_readable(path: Path) -> None:
    """Raise if a .safetensors file is truncated or its header is damaged (reads every tensor: a cut-off
    file fails here, not halfway through training)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            f.get_tensor(key)


def load_weights(path: str | Path) -> nn.Module:
    """A checkpoint's weights (the tokenizer and mask id always come from the base model)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def read_checkpoint(ckpt: Path, cfg: TrainConfig) -> tuple[dict, nn.Module | None]:
    """(trainer state, full fine-tuning weights) of one checkpoint; raises on any damage."""
    state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{STATE_FILE} holds no step")
    for weights_file in sorted(ckpt.glob("*.safetensors")):
        safetensors_readable(weights_file)
    return state, None if cfg.lora else load_weights(ckpt)  # LoRA: the base model + the state's adapter


def load_resume(out: Path, checkpoints: list[Path], cfg: TrainConfig) -> tuple[Path | None, dict | None, nn.Module | None]:
    """(checkpoint, trainer state, full fine-tuning weights) of the newest intact checkpoint.

    A damaged checkpoint (unreadable trainer_state.pt, truncated model.safetensors) is skipped with a warning
    and the one before it is used; when every checkpoint is damaged the run refuses to start over silently.
    """
    skipped = []
    for ckpt in reversed(checkpoints):
        try:
            state, weights = read_checkpoint(ckpt, cfg)
        except Exception as exc:  # any damage: this checkpoint cannot be resumed from
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            warn(f"{ckpt} is damaged ({reason}); skipping it")
            skipped.append(ckpt.name)
            continue
        if skipped:
            warn(f"resuming from the older intact {ckpt.name} instead of {', '.join(skipped)}")
        return ckpt, state, weights
    raise ValueError(f"every checkpoint in {out} is damaged ({', '.join(skipped)}): delete them to start over, "
                     "or use a new --output-dir")


def warn(message: str) -> None:
    """A warning on stderr, once per run (from the first process only)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[finetune.train] warning: {message}", file=sys.stderr)
