"""`python -m mars_core export --model M --out DIR`: any model mars_core loads, as a plain transformers checkpoint.

What comes out is what `AutoModelForCausalLM.from_pretrained(DIR)` loads without remote code, and what other
tools that read transformers folders take (vLLM, llama.cpp's convert_hf_to_gguf.py):
- config.json of the stock architecture (a released `a2d-qwen2` MARS checkpoint becomes `qwen2`; `auto_map`
  dropped) with `mask_token_id` (the id our decoder uses; also as `pard_token`, the name vLLM's parallel
  drafting reads, docs/serving.md) and `mars_block_size` when the source records one;
- model.safetensors (an adapter such as smollm2-mars merged into its base, a GGUF dequantised);
- the tokenizer, its mask token declared (`tokenizer.mask_token`), so `load_model(DIR)` finds the same id;
- generation_config.json whose eos_token_id lists every end-of-turn id the decoder stops at;
- mars_export.json (where it came from) and a short README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from mars_core.models import loading, sources
from mars_core.models.formats import pick_dtype
from mars_core.models.storage import check_free_space, replace_folder, storage_error

EXPORT_INFO = "mars_export.json"


def check_out(out: str | os.PathLike, force: bool = False) -> Path:
    """The --out folder, refused before anything is loaded: a file, or a non-empty folder without --force."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out} is a file: name a new folder for the checkpoint")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise ValueError(f"--out {out} exists and is not empty: name a new folder, or pass --force to replace it")
    parent = path.resolve().parent
    if parent.exists() and not os.access(parent, os.W_OK):
        raise ValueError(f"--out {out}: its parent folder {parent} is not writable: pick a folder you can write to")
    return path


def _refuse_overwriting_the_source(out: Path, where: str, model: str) -> None:
    src, dst = Path(where).resolve(), out.resolve()
    if dst == src or dst in src.parents:
        raise ValueError(f"--out {out} would replace the model it exports ({model!r} lives at {src}): "
                         "name another folder")


def _block_size(folder: str, source: tuple[str, str]) -> int | None:
    """The MARS block size the source was trained with, when it records one (train_config.json / adapter config)."""
    candidates = [Path(folder) / "train_config.json"]
    if source[0] == "adapter":
        candidates.insert(0, Path(source[1]) / "adapter_config.json")
    for path in candidates:
        try:
            value = json.loads(path.read_text()).get("block_size")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int) and value >= 1:
            return value
    return None


def _saved_dtype(config) -> torch.dtype:
    value = getattr(config, "dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else torch.float32


def export(model: str | None, out: str | os.PathLike, *, force: bool = False, dtype: str = "auto",
           mask_token: str | None = None) -> dict:
    """Write `model` to `out` as a plain checkpoint; returns what was written (the CLI prints it)."""
    out = check_out(out, force)
    if dtype != "auto":
        torch_dtype = pick_dtype(dtype, torch.device("cpu"))
    source = sources.resolve_source(model)
    if source[0] == "adapter":
        from mars_core.models.adapter import is_gated, read_adapter_config

        if is_gated(read_adapter_config(source[1])):   # a plain checkpoint would lose the gate
            raise ValueError(f"{model!r} is a gated adapter (its delta acts at mask positions only), which no plain "
                             "transformers checkpoint can hold: share the adapter folder itself, or export its base")
    _refuse_overwriting_the_source(out, source[1], model or sources.DEFAULT_MODEL)
    folder = sources.prepare(model)                      # converts a GGUF / merges an adapter once (cached)
    _refuse_overwriting_the_source(out, folder, model or sources.DEFAULT_MODEL)
    if dtype == "auto":
        torch_dtype = _saved_dtype(sources._stock_config(folder))
    lm = loading.load_model(model, device="cpu", dtype=torch_dtype, mask_token=mask_token, cpu_layout=False)
    net, tok = lm.model, lm.tokenizer
    config, mask_text, block = _declare_mask(lm, model, folder, source)
    info = {"source": model or sources.DEFAULT_MODEL, "source_dir": lm.path, "architecture": type(net).__name__,
            "model_type": config.model_type, "mask_token_id": lm.mask_id, "mask_token": mask_text,
            "mask_source": lm.mask_source, "mars_block_size": block, "eos_token_ids": list(lm.eos_ids),
            "dtype": str(torch_dtype).replace("torch.", ""), "exported_by": "python -m mars_core export"}
    what = f"the export to --out {out}"
    tmp = _temp_folder(out, net, what)
    try:
        net.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
        (tmp / "README.md").write_text(_card(info))
        saved = json.loads((tmp / "config.json").read_text())
        if saved.get("mask_token_id") != lm.mask_id or saved.get("pard_token") != lm.mask_id or "auto_map" in saved:
            raise ValueError(f"the saved config.json of {model!r} lost mask_token_id or kept auto_map: report this")
        # --force (check_out refused a non-empty one without it): the old export leaves only once this one is in
        replace_folder(tmp, out)
    except OSError as exc:   # a full or read-only disk: one line; the temp folder goes in finally
        raise ValueError(storage_error(exc, exc.filename or out, what)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**info, "out": str(out.resolve())}



def _declare_mask(lm, model: str | None, folder, source) -> tuple:
    """Write the mask id (and B, where the source knows it) into the model's config and tokenizer, and the end of
    turn into its generation config, in place; -> (config, the mask token's text, B or None)."""
    net, tok = lm.model, lm.tokenizer
    config = net.config
    if hasattr(config, "auto_map"):
        del config.auto_map                              # nothing in the export needs remote code
    config.mask_token_id = lm.mask_id
    config.pard_token = lm.mask_id     # the key vLLM's parallel drafting reads a draft model's mask id from
    block = _block_size(folder, source)
    if block is not None:
        config.mars_block_size = block
    mask_text = tok.convert_ids_to_tokens(lm.mask_id)
    if tok.mask_token != mask_text:
        tok.mask_token = mask_text                       # an existing token: declared, not added
    if tok.mask_token_id != lm.mask_id:
        raise ValueError(f"the tokenizer of {model!r} maps {mask_text!r} to {tok.mask_token_id}, not the mask id "
                         f"{lm.mask_id}: pass --mask-token with the token the model was trained with")
    gen = net.generation_config
    gen.eos_token_id = lm.eos_ids[0] if len(lm.eos_ids) == 1 else list(lm.eos_ids)
    if gen.pad_token_id is None and tok.pad_token_id is not None:
        gen.pad_token_id = tok.pad_token_id
    return config, mask_text, block


def _temp_folder(out: Path, net, what: str) -> Path:
    """A temp folder beside ``out``, after checking the disk has room for the weights in the dtype saved
    (+ tokenizer): a full disk is refused before a byte is written."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        need = sum(p.numel() * p.element_size() for p in net.parameters()) + 50_000_000
        check_free_space(out.resolve().parent, need, what)
        return Path(tempfile.mkdtemp(dir=out.resolve().parent, prefix=f".{out.name}.export-"))
    except OSError as exc:
        raise ValueError(storage_error(exc, out, what)) from None


def _card(info: dict) -> str:
    block = info["mars_block_size"] or "the block size it was trained with"
    return f"""# {Path(info['source']).name}, exported for MARS decoding

A plain transformers checkpoint (`{info['architecture']}`, `model_type: {info['model_type']}`, {info['dtype']}),
written by `python -m mars_core export --model {info['source']}`. No remote code.

- mask token: `{info['mask_token']}`, id {info['mask_token_id']} (`mask_token_id` in config.json; how MARS
  Playground found it: {info['mask_source']})
- MARS block size: {block}
- end-of-turn ids (generation_config.json): {info['eos_token_ids']}

MARS decoding: `python -m mars_core generate --model THIS_FOLDER --prompt ...`, or in transformers
`model.generate(ids, custom_generate=<MARS Playground's folder>, trust_remote_code=True, tau=0.95)`
(see its custom_generate/README.md). Plain `generate` is ordinary AR decoding of the same weights.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=sources.DEFAULT_MODEL,
                   help="embedded name, local checkpoint or adapter folder (e.g. a finetune run's checkpoint), "
                        f".gguf or hub id (default {sources.DEFAULT_MODEL})")
    p.add_argument("--out", required=True, help="new folder for the checkpoint")
    p.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's own), float32, bfloat16, float16")
    p.add_argument("--mask-token", default=None, help="the mask token, when the tokenizer does not declare one")
    p.add_argument("--json", action="store_true", help="print JSON only")


def cmd_export(args) -> int:
    info = export(args.model, args.out, force=args.force, dtype=args.dtype, mask_token=args.mask_token)
    if args.json:
        print(json.dumps(info))
    else:
        print(f"exported {info['source']} -> {info['out']} ({info['architecture']}, mask_token_id "
              f"{info['mask_token_id']} = {info['mask_token']!r}, {info['dtype']})")
    return 0
