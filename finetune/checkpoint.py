"""Checkpoints of a finetune.train run: writing them, finding them, and resuming from the newest intact one.

``checkpoint-<step>/`` is a plain transformers directory (LoRA already merged, the trained mask row written
into the embedding) with the tokenizer, train_config.json, the metrics.jsonl lines up to <step>, and
``trainer_state.pt``: what resuming needs and the weights cannot hold (see ``trainer_state``).
"""

from __future__ import annotations

import copy
import errno
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from finetune.config import TrainConfig
from finetune.status import METRICS_FILE, read_metrics_rows, write_json
from mars_core.models.storage import replace_folder, storage_error

if TYPE_CHECKING:
    from finetune.train_model import Run, TrainModule

CHECKPOINT_PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "train_config.json"
WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json")   # one file, or a sharded set's index
# What trainer_state.pt must hold for a resume (``trainer_state``); "lora" too for a --lora run
STATE_KEYS = ("step", "optimizer", "rng")

# Settings that define the model, the objective or the data draw: a resume that changes one would silently mix
# two trainings in one checkpoint. --max-steps, --lr and the like may change (to extend a run).
RESUME_KEYS = ("base_model", "stage", "lora", "gated_lora", "lora_r", "lora_alpha", "lora_dropout", "lora_layers",
               "train_mask_row", "freeze_embeddings", "block_size",
               "ar_weight", "mask_label_smoothing", "soft_target_weight", "soft_target_top_k", "random_block_offset",
               "ar_anchor", "ar_anchor_weight",
               "data", "builtin_weights", "seed", "init_adapter", "skip_seen",
               "batch_size", "grad_accum", "max_length", "overlong", "group_by_length",
               # sharded and unsharded checkpoints hold the optimizer state differently (finetune.sharding)
               "sharding")


def checkpoint_step(path: Path) -> int | None:
    name = path.name
    if not name.startswith(CHECKPOINT_PREFIX) or not name[len(CHECKPOINT_PREFIX) :].isdigit():
        return None
    return int(name[len(CHECKPOINT_PREFIX) :])


def all_checkpoints(out: Path) -> list[Path]:
    """Every checkpoint-<step> folder, complete or not, oldest first: any of them means the run has a history."""
    if not out.is_dir():
        return []
    return sorted((p for p in out.iterdir() if checkpoint_step(p) is not None and p.is_dir()), key=checkpoint_step)


def missing_files(ckpt: Path) -> list[str]:
    """What a resume needs that ``ckpt`` lacks: the trainer state (optimizer, step, RNG), the model config, the
    weights. trainer_state.pt is the first file a user deletes to free disk (it is twice the model)."""
    missing = [name for name in (STATE_FILE, "config.json") if not (ckpt / name).is_file()]
    if not any((ckpt / name).is_file() for name in WEIGHTS_FILES):
        missing.append(WEIGHTS_FILES[0])
    return missing


def list_checkpoints(out: Path) -> list[Path]:
    """Checkpoints with trainer_state.pt, oldest first: the ones to name as the last good one, or to prune. What a
    resume reads is ``all_checkpoints``: one without that file is damaged, not absent."""
    return [p for p in all_checkpoints(out) if (p / STATE_FILE).is_file()]


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
    tmp = run.out / f".{final.name}.tmp"  # renamed into place once complete: a kill leaves no half checkpoint
    export = None
    if run.cfg.sharding != "no":   # every process writes its shard into tmp, and the main one gathers the model
        from finetune.sharding import gather_full_state, save_sharded, unsharded_copy

        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        save_sharded(run.module, run.optimizer, tmp)
        full_state = gather_full_state(run.module)
        export = unsharded_copy(run.module, full_state, run.cfg) if acc.is_main_process else None
    elif acc.num_processes > 1:
        check_replicas_agree(run)
    if acc.is_main_process:
        if export is None:
            shutil.rmtree(tmp, ignore_errors=True)
        try:
            write_checkpoint(run, tmp, step, elapsed, export)
            replace_folder(tmp, final)   # a damaged checkpoint-<step> of an earlier session goes only once this is in
        except BaseException as exc:   # no half checkpoint left behind (a full disk would stay full)
            fault = write_fault(exc, run.out)
            shutil.rmtree(tmp, ignore_errors=True)
            if fault is None:
                raise
            raise ValueError(checkpoint_not_written(run.out, final, fault)) from None
        kept = list_checkpoints(run.out)[-run.cfg.keep_checkpoints:]
        for old in all_checkpoints(run.out):   # incomplete ones older than those kept go too
            if checkpoint_step(old) < checkpoint_step(kept[0]):
                shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def write_fault(exc: BaseException, out: Path) -> OSError | None:
    """The OSError behind a failed checkpoint write, or None when ``exc`` is no write fault (a bug, a signal).
    The writers report a full disk in their own words: safetensors as a SafetensorError ("I/O error: No space
    left on device (os error 28)"), torch.save as a RuntimeError of its zip writer ("unexpected pos ...",
    "PytorchStreamWriter failed writing file") that keeps no errno; a device with no space left then is full."""
    if isinstance(exc, OSError):
        return exc
    text = str(exc)
    code = re.search(r"os error (\d+)|Os \{ code: (\d+)", text)
    if code:
        number = int(code.group(1) or code.group(2))
        return OSError(number, os.strerror(number))
    torch_writer = isinstance(exc, RuntimeError) and any(w in text for w in ("PytorchStreamWriter", "inline_container",
                                                                          "file write failed"))
    if not (torch_writer or type(exc).__name__ == "SafetensorError"):
        return None
    try:
        full = shutil.disk_usage(out).free < 1 << 16   # before the partial checkpoint is removed
    except OSError:
        full = False
    first_line = text.strip().splitlines()[0][:160] if text.strip() else type(exc).__name__
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if full else OSError(errno.EIO, first_line)


def checkpoint_not_written(out: Path, final: Path, fault: OSError) -> str:
    """One line: why ``final`` was not written, the fix, and which checkpoint a rerun resumes from."""
    kept = [c for c in list_checkpoints(out) if c != final]
    previous = (f"the previous checkpoint {kept[-1]} is kept as it was: rerun the same command to resume from it"
                if kept else "no earlier checkpoint of this run exists: rerun the same command to start again")
    return f"{storage_error(fault, out, final.name)}; {previous}"


def check_replicas_agree(run: Run) -> None:
    """Data-parallel replicas must hold identical weights; a difference means gradients were not synced."""
    acc = run.accelerator
    checksum = torch.stack([p.detach().double().sum() for p in run.module.parameters()]).sum().reshape(1)
    sums = acc.gather(checksum.to(acc.device))
    assert torch.allclose(sums, sums[0]), f"replicas diverged: {sums.tolist()}"


def write_checkpoint(run: Run, directory: Path, step: int, elapsed: float,
                     train_module: TrainModule | None = None) -> None:
    """The checkpoint's files; ``train_module`` is a sharded run's gathered, unsharded copy."""
    train_module = train_module or run.accelerator.unwrap_model(run.module)
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
    """What a resume reads back. No schedule state: the learning rate is a function of the step
    (``finetune.schedule.get_lr``)."""
    mask_row = train_module.mask_row
    return {
        "step": step,
        "optimizer": sharded_optimizer() if run.cfg.sharding != "no" else run.optimizer.state_dict(),
        "rng": rng_state(),
        "elapsed": elapsed,
        "lora": lora_weights(train_module.model) if run.cfg.lora else None,  # the base model + these = the model
        "mask_row": None if mask_row is None else mask_row.row.detach().cpu().clone(),
        "num_processes": run.accelerator.num_processes,
        "config": run.cfg.to_dict(),   # the settings record that survives a deleted train_config.json
    }


def sharded_optimizer() -> dict:
    from finetune.sharding import SHARDED_OPTIMIZER

    return dict(SHARDED_OPTIMIZER)


def lora_weights(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(peft_model).items()}


# ----------------------------------------------------------------------------- resuming


RESTART_FIX = "pass --restart to move this run aside and start over, or use a new --output-dir"


def check_resumable(out: Path, cfg: TrainConfig, checkpoints: list[Path] | None = None) -> bool:
    """Refuse to resume a run whose model-, objective- or data-defining settings (``RESUME_KEYS``) changed, by
    every record that survives: the run's train_config.json and each checkpoint's copy (one of them may have been
    deleted or replaced by hand). Returns whether any was found; with none, ``load_resume`` checks the settings
    saved in the trainer state."""
    checkpoints = all_checkpoints(out) if checkpoints is None else checkpoints
    records = [path for path in (out / CONFIG_FILE, *(c / CONFIG_FILE for c in checkpoints)) if path.is_file()]
    for path in records:
        try:
            saved = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is unreadable ({exc}): restore it, or use a new --output-dir") from None
        check_same_settings(out, saved, cfg, path)
    return bool(records)


def check_same_settings(out: Path, saved, cfg: TrainConfig, record: Path) -> None:
    if not isinstance(saved, dict):
        raise ValueError(f"{record} holds no settings (not a JSON object): restore it, or use a new --output-dir")
    keys = list(RESUME_KEYS)
    if cfg.data == "builtin":  # the number of generated examples is the data; it means nothing for a file
        keys.append("builtin_examples")
    for key in keys:
        if key in saved and saved[key] != getattr(cfg, key):
            raise ValueError(
                f"{out} holds a run with {key}={saved[key]!r} but this run has {key}={getattr(cfg, key)!r} (per "
                f"{record}): use the same settings to resume, or {RESTART_FIX}"
            )


def refuse_starting_over(out: Path) -> None:
    """A run folder with logged steps but no checkpoint at all (stopped or killed before its first save): starting
    at step 1 would overwrite that history, so only --restart may."""
    rows = read_metrics_rows(out / METRICS_FILE)
    if rows:
        raise ValueError(f"{out} holds {METRICS_FILE} with {len(rows)} logged step(s) but no checkpoint to resume "
                         f"from: {RESTART_FIX}")


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
    """(trainer state, full fine-tuning weights) of one checkpoint; raises on any damage or missing part."""
    missing = missing_files(ckpt)
    if cfg.sharding != "no":
        from finetune.sharding import missing_sharded

        missing += missing_sharded(ckpt)
    if missing:
        raise ValueError(f"it has no {', '.join(missing)}")
    state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{STATE_FILE} holds no step")
    lacking = [key for key in (*STATE_KEYS, *(("lora",) if cfg.lora else ())) if state.get(key) is None]
    if lacking:
        raise ValueError(f"{STATE_FILE} has no {', '.join(map(repr, lacking))} entry")
    for weights_file in sorted(ckpt.glob("*.safetensors")):
        safetensors_readable(weights_file)
    # LoRA: the base model + the state's adapter; sharded: the base model + sharded/ (loaded once sharded)
    return state, None if cfg.lora or cfg.sharding != "no" else load_weights(ckpt)


def load_resume(out: Path, checkpoints: list[Path], cfg: TrainConfig,
                settings_checked: bool = True) -> tuple[Path, dict, nn.Module | None]:
    """(checkpoint, trainer state, full fine-tuning weights) of the newest intact checkpoint.

    A damaged or incomplete checkpoint (no trainer_state.pt, one without its optimizer, a truncated
    model.safetensors) is skipped with a warning and the one before it is used; when none is intact the run
    refuses, by name, rather than start over. The settings saved in its trainer state are checked too; with
    ``settings_checked`` False (no train_config.json survives) they are the only record, and without them the
    run is refused: a resume never writes into a folder whose history it could not verify."""
    skipped = []
    for ckpt in reversed(checkpoints):
        try:
            state, weights = read_checkpoint(ckpt, cfg)
        except Exception as exc:  # any damage: this checkpoint cannot be resumed from
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            warn(f"{ckpt} is damaged ({reason}); skipping it")
            skipped.append(ckpt.name)
            continue
        if isinstance(state.get("config"), dict):   # checkpoints written before it was saved there have none
            check_same_settings(out, state["config"], cfg, ckpt / STATE_FILE)
        elif not settings_checked:
            raise ValueError(f"{out} has checkpoints but no record of the settings they were trained with "
                             f"({CONFIG_FILE} is gone from the run and every checkpoint): restore it, or {RESTART_FIX}")
        if skipped:
            warn(f"resuming from the older intact {ckpt.name} instead of {', '.join(skipped)}")
        return ckpt, state, weights
    raise ValueError(f"every checkpoint in {out} is damaged or incomplete ({', '.join(skipped)}, named above): "
                     f"restore the missing files, or {RESTART_FIX}")


def warn(message: str) -> None:
    """A warning on stderr, once per run (from the first process only)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[finetune.train] warning: {message}", file=sys.stderr)
