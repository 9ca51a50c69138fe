"""Export a finetune.train LoRA checkpoint as a MARS adapter folder that mars_core.load_model, the app and
--init-adapter read: mars-lora-v1 (merged into the base when loaded), or mars-gated-lora-v1 for a --gated-lora
run (applied at mask positions only, so real tokens stay the base model's: mars_core.engine.gated).

    python -m finetune.recipes.export_adapter runs/ab-gated/gated/train/checkpoint-285 --out runs/gated-adapter

The checkpoint's own train_config.json says which base, rank, alpha, block size and gate it was trained with;
its data manifest, if it has one, travels with the adapter (so a later --skip-seen round can read it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

STORE_DTYPES = ("bfloat16", "float32", "int8")   # int8: int8 factors, a float32 scale per rank component


def export_adapter(checkpoint, out, dtype: str = "bfloat16", base: str | None = None) -> dict:
    """Write the adapter of `checkpoint` to `out`; returns {"format", "step", "bytes"}. `base`: the name the
    adapter records for its base (default: the run's --base-model)."""
    import torch

    from finetune.checkpoint import CONFIG_FILE, STATE_FILE
    from finetune.config import TrainConfig
    from finetune.data import MANIFEST_FILE
    from mars_core import load_model
    from mars_core.models.adapter import AdapterSpec, adapter_files_size, read_adapter_config, save_adapter
    from mars_core.models.storage import replace_folder

    checkpoint, out = Path(checkpoint), Path(out)
    for name in (CONFIG_FILE, STATE_FILE):
        if not (checkpoint / name).is_file():
            raise ValueError(f"{checkpoint} has no {name}: pass a checkpoint folder of a finetune.train run "
                             "(e.g. runs/x/train/checkpoint-200)")
    if dtype not in STORE_DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {', '.join(STORE_DTYPES)}")
    cfg = TrainConfig.from_dict(json.loads((checkpoint / CONFIG_FILE).read_text()), str(checkpoint / CONFIG_FILE))
    if not cfg.lora or cfg.stage != "mars":
        raise ValueError(f"{checkpoint} is a {'LoRA' if cfg.lora else 'full'} {cfg.stage} run: only a MARS LoRA run "
                         "(--stage mars --lora) exports as an adapter; "
                         "a full fine-tune is its checkpoint folder itself")
    state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=False)
    lm = load_model(cfg.base_model, device="cpu", dtype="float32", cpu_layout=False)   # the mask token it trained with
    # Written beside `out` and swapped in whole: replacing an adapter file by file could leave new weights under an
    # old config (another rank) if stopped halfway, and the old adapter goes only once the new one is complete.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        spec = AdapterSpec(r=cfg.lora_r, alpha=cfg.lora_alpha, base=base or cfg.base_model, mask_id=lm.mask_id,
                           mask_token=lm.tokenizer.convert_ids_to_tokens(lm.mask_id), block_size=cfg.block_size,
                           dtype=dtype, gated=cfg.gated_lora,
                           extra={"steps": state["step"], "checkpoint": checkpoint.name})
        save_adapter(tmp, state["lora"], state.get("mask_row"), spec)
        if (checkpoint / MANIFEST_FILE).is_file():
            shutil.copy2(checkpoint / MANIFEST_FILE, tmp / MANIFEST_FILE)
        keep_other_files(out, tmp)
        replace_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"format": read_adapter_config(out)["format"], "step": state["step"], "bytes": adapter_files_size(out)}


def keep_other_files(old: Path, new: Path) -> None:
    """Copy what ``old`` holds besides the adapter (a README, a model card) into ``new``: an export replaced the
    adapter's files in place before, and a user's own files there must not go with the old adapter."""
    if not old.is_dir():
        return
    for entry in old.iterdir():
        if (new / entry.name).exists() or entry.name.startswith("."):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, new / entry.name, follow_symlinks=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m finetune.recipes.export_adapter", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoint folder of a finetune.train MARS LoRA run")
    ap.add_argument("--out", required=True, help="the adapter folder to write")
    ap.add_argument("--dtype", default="bfloat16", choices=STORE_DTYPES, help="how A and B are stored")
    ap.add_argument("--base", default=None, help="the base name the adapter records (default: the run's)")
    args = ap.parse_args(argv)
    done = export_adapter(args.checkpoint, args.out, args.dtype, args.base)
    print(f"[finetune.recipes.export_adapter] {done['format']} at step {done['step']}, "
          f"{done['bytes']} bytes: {args.out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    from finetune.config import run_main

    run_main(main)
