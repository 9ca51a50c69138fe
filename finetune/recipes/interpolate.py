"""A point between two full fine-tunes of one model: every weight at θ_a + α (θ_b − θ_a), as a checkpoint folder.

    python -m finetune.recipes.interpolate --a runs/s8/anch/checkpoint-400 --b runs/s9/own5/run/checkpoint-400 \\
        --alpha 0.5 --out runs/s12/mid50

Why: a second round of training (b, started from a) moves the masks and, a little, AR's answers with them. Weight
interpolation between a model and its fine-tune (WiSE-FT, Wortsman et al. 2022) often keeps much of the fine-tune's
gain while staying nearer the start, so a point between the two rounds may keep more of a's answers than b does.
α = 0 is a, α = 1 is b; α outside [0, 1] extrapolates and is refused (nothing here measures it).

The folder is a finetune.train checkpoint without a trainer state (it cannot be resumed): b's config, tokenizer and
train_config.json (with an "interpolated" entry naming a, b and α), so finetune.recipes.export_delta and
mars_core.load_model read it like b. It is written beside --out and renamed into place: never half a folder.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch

WEIGHTS = "model.safetensors"
TRAIN_CONFIG = "train_config.json"
# b's files that describe the model (copied); the trainer state, metrics and data manifest belong to b's run only
CARRIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja", TRAIN_CONFIG)


def _checkpoint(path: str, flag: str) -> Path:
    folder = Path(path)
    if not (folder / WEIGHTS).is_file() or not (folder / TRAIN_CONFIG).is_file():
        raise ValueError(f"{flag} {path!r} has no {WEIGHTS} and {TRAIN_CONFIG}: pass a full fine-tune's "
                         "finetune.train checkpoint folder (checkpoint-<step>)")
    if json.loads((folder / TRAIN_CONFIG).read_text(encoding="utf-8")).get("lora"):
        raise ValueError(f"{flag} {path!r} is a LoRA run: interpolate full fine-tunes only (its adapter lives in "
                         "the trainer state)")
    return folder


def interpolate(a: dict, b: dict, alpha: float) -> dict:
    """{name: a + α (b − a)} computed in float32 and stored in b's dtype; both must hold the same tensors."""
    if a.keys() != b.keys():
        only = sorted(a.keys() ^ b.keys())
        raise ValueError(f"the checkpoints hold different tensors ({', '.join(only[:3])}"
                         f"{', …' if len(only) > 3 else ''}): interpolate two fine-tunes of one model")
    out = {}
    for name in sorted(a):
        ta, tb = a[name], b[name]
        if ta.shape != tb.shape:
            raise ValueError(f"tensor {name!r} is {tuple(ta.shape)} in --a and {tuple(tb.shape)} in --b: "
                             "interpolate two fine-tunes of one model")
        if not tb.is_floating_point():
            if not bool((ta == tb).all()):
                raise ValueError(f"tensor {name!r} is not floating point and differs between the checkpoints")
            out[name] = tb.clone()
            continue
        # torch.lerp computes from the nearer end, so α = 0 and α = 1 give a and b bit for bit
        out[name] = torch.lerp(ta.float(), tb.float(), alpha).to(tb.dtype).contiguous()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m finetune.recipes.interpolate", description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="the starting checkpoint (α = 0)")
    ap.add_argument("--b", required=True, help="the later checkpoint (α = 1)")
    ap.add_argument("--alpha", type=float, required=True, help="where between them, in [0, 1]")
    ap.add_argument("--out", required=True, help="the new checkpoint folder (an existing one is replaced)")
    args = ap.parse_args(argv)
    if not (math.isfinite(args.alpha) and 0.0 <= args.alpha <= 1.0):
        raise ValueError(f"--alpha {args.alpha}: use a number from 0 (the --a checkpoint) to 1 (the --b one)")
    a, b = _checkpoint(args.a, "--a"), _checkpoint(args.b, "--b")
    from safetensors.torch import load_file, save_file

    from mars_core.models.storage import replace_folder

    mixed = interpolate(load_file(str(a / WEIGHTS)), load_file(str(b / WEIGHTS)), args.alpha)
    out = Path(args.out)
    tmp = out.with_name(out.name + ".new")
    if tmp.exists():
        shutil.rmtree(tmp)   # a leftover of an interrupted run, never the finished folder
    tmp.mkdir(parents=True)
    for name in CARRIED:
        if (b / name).is_file() and name != TRAIN_CONFIG:
            shutil.copy2(b / name, tmp / name)
    train_cfg = json.loads((b / TRAIN_CONFIG).read_text(encoding="utf-8"))
    train_cfg["interpolated"] = {"a": str(a), "b": str(b), "alpha": args.alpha}
    (tmp / TRAIN_CONFIG).write_text(json.dumps(train_cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_file(mixed, str(tmp / WEIGHTS), metadata={"format": "pt"})
    replace_folder(tmp, out)
    print(f"[finetune.recipes.interpolate] {len(mixed)} tensors at α {args.alpha} between {a} and {b}: {out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    from finetune.config import run_main

    run_main(main)
