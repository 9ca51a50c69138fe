"""A full fine-tune shipped small: its change per weight matrix, cut to rank r by SVD, as a mars-lora-v1 adapter.

    python -m finetune.recipes.export_delta --checkpoint runs/v3/lr1e-4/checkpoint-1000 --base smollm2 --rank 64 \\
        --out runs/v3/delta-r64

For every nn.Linear of the decoder, D = W_fine-tuned − W_base is factored as D ≈ B @ A with B = U_r √S_r and
A = √S_r V_rᵀ (the best rank-r approximation, Eckart–Young), written as the adapter's lora_B / lora_A with
alpha = r (scale 1), so today's adapter path (mars_core.models.adapter.merge_adapter, merged once and cached)
loads it. The mask token's embedding row is stored as it is, and so are normalisation weights that changed
(1-D: no rank to cut).
A fine-tune that also changed other embedding rows (trained without --freeze-embeddings) is refused: a
49,152 × 576 change does not ship small.

The report gives, per rank, the share of the change's energy (squared Frobenius norm) the adapter keeps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from mars_core.models.adapter import AdapterSpec


def linear_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{module path: weight} of the decoder's nn.Linear layers (the LM head, tied to the embedding, left out)."""
    head = model.get_output_embeddings()
    return {name: m.weight for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head}


def norm_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{module path: weight} of the 1-D-weighted modules (RMSNorm / LayerNorm)."""
    return {name: m.weight for name, m in model.named_modules()
            if getattr(m, "weight", None) is not None and isinstance(m.weight, torch.Tensor) and m.weight.ndim == 1}


@torch.no_grad()
def low_rank(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A [r, in], B [out, r], kept energy share) with B @ A the best rank-r approximation of `delta`."""
    u, s, vh = torch.linalg.svd(delta.float(), full_matrices=False)
    r = min(rank, s.numel())
    root = s[:r].sqrt()
    total = float((s ** 2).sum())
    kept = float((s[:r] ** 2).sum()) / total if total > 0 else 1.0
    a, b = root[:, None] * vh[:r], u[:, :r] * root[None, :]
    if r < rank:   # a matrix smaller than the rank: pad with zeros so every module has the config's r
        a = torch.cat([a, a.new_zeros(rank - r, a.shape[1])])
        b = torch.cat([b, b.new_zeros(b.shape[0], rank - r)], dim=1)
    return a, b, kept


@torch.no_grad()
def extract(tuned: torch.nn.Module, base: torch.nn.Module, mask_id: int, rank: int) -> dict:
    """The adapter's tensors and a report: {"modules": {path: (A, B)}, "mask_row", "norms", "kept": {path: share}}."""
    emb_t, emb_b = tuned.get_input_embeddings().weight, base.get_input_embeddings().weight
    if emb_t.shape != emb_b.shape:
        raise ValueError(f"the fine-tune's embedding is {tuple(emb_t.shape)} but the base's {tuple(emb_b.shape)}: "
                         "pass the --base it was trained from")
    others = torch.ones(emb_t.shape[0], dtype=torch.bool)
    others[mask_id] = False
    moved = int((emb_t[others] != emb_b[others]).any(dim=1).sum())
    if moved:
        raise ValueError(f"{moved} embedding rows besides the mask token's changed: the run trained the whole "
                         "embedding, which does not ship as a small delta; train with --freeze-embeddings")
    lin_t, lin_b = linear_weights(tuned), linear_weights(base)
    if set(lin_t) != set(lin_b):
        raise ValueError("the fine-tune and --base have different layers: pass the base it was trained from")
    modules, kept = {}, {}
    for name, w in lin_t.items():
        delta = w.float() - lin_b[name].float()
        if not torch.any(delta):
            continue
        a, b, share = low_rank(delta, rank)
        modules[name], kept[name] = (a, b), share
    norms = {name: w.detach().float().clone() for name, w in norm_weights(tuned).items()
             if not torch.equal(w.float(), norm_weights(base)[name].float())}
    return {"modules": modules, "mask_row": emb_t[mask_id].detach().float().clone(), "norms": norms, "kept": kept}


def save(out: Path, parts: dict, spec: AdapterSpec) -> None:
    """Write the folder beside `out` and swap it in (mars_core.models.storage.replace_folder): never half a folder.

    `spec.r` is the rank (the config's alpha is `spec.alpha`; `r` gives scale 1), `spec.dtype` a DTYPES name or
    "int8" (factors int8 with a float32 scale per rank component: mars_core.models.adapter.quantize_factors).
    """
    from safetensors.torch import save_file

    from mars_core.models.adapter import (CONFIG_FILE, DTYPES, FORMAT, INT8, MASK_ROW_KEY, NORM_SUFFIX, WEIGHTS_FILE,
                                          quantize_factors)
    from mars_core.models.storage import replace_folder

    tensors = {}
    for name, (a, b) in sorted(parts["modules"].items()):
        if spec.dtype == INT8:
            tensors.update({f"{name}.{key}": t for key, t in quantize_factors(a, b).items()})
        else:
            tensors[f"{name}.lora_A"] = a.to(DTYPES[spec.dtype]).contiguous()
            tensors[f"{name}.lora_B"] = b.to(DTYPES[spec.dtype]).contiguous()
    tensors[MASK_ROW_KEY] = parts["mask_row"].contiguous()
    for name, w in sorted(parts["norms"].items()):
        tensors[f"{name}.{NORM_SUFFIX}"] = w.contiguous()
    config = {"format": FORMAT, "base": spec.base, "r": spec.r, "alpha": spec.alpha, "mask_id": spec.mask_id,
              "mask_token": spec.mask_token, "block_size": spec.block_size, "dtype": spec.dtype, **(spec.extra or {})}
    tmp = out.with_name(out.name + ".new")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    replace_folder(tmp, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m finetune.recipes.export_delta", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a finetune.train checkpoint folder (a full fine-tune)")
    ap.add_argument("--base", default="smollm2", help="the model the adapter goes on (default: smollm2)")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--out", required=True, help="the adapter folder to write (replaced by rename if it exists)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "int8"],
                    help="how the factors are stored (int8: half of bfloat16's bytes, a float32 scale per component)")
    args = ap.parse_args(argv)
    if args.rank < 1:
        raise ValueError(f"--rank {args.rank}: use 1 or more (64 ships SmolLM2's change in ~40 MB)")
    ckpt = Path(args.checkpoint)
    cfg_path = ckpt / "train_config.json"
    if not cfg_path.is_file():
        raise ValueError(f"--checkpoint {args.checkpoint!r} has no train_config.json: pass a finetune.train "
                         "checkpoint folder (checkpoint-<step>)")
    train_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    if train_cfg.get("lora"):
        raise ValueError(f"--checkpoint {args.checkpoint!r} is a LoRA run: "
                         "export it with finetune.recipes.export_adapter")
    from finetune.checkpoint import load_weights
    from finetune.train_model import load_base

    base = load_base(args.base)
    tuned = load_weights(ckpt).float().eval()
    parts = extract(tuned, base.model.float(), base.mask_id, args.rank)
    mask_token = base.tokenizer.convert_ids_to_tokens(base.mask_id)
    kept = parts["kept"]
    extra = {"source": "full fine-tune, SVD per matrix", "checkpoint": ckpt.name,
             "energy_kept_min": round(min(kept.values()), 4) if kept else 1.0,
             "energy_kept_mean": round(sum(kept.values()) / len(kept), 4) if kept else 1.0}
    save(Path(args.out), parts, AdapterSpec(r=args.rank, alpha=args.rank, base=args.base, mask_id=base.mask_id,
                                            mask_token=mask_token, block_size=int(train_cfg.get("block_size", 4)),
                                            dtype=args.dtype, extra=extra))
    size = sum(p.stat().st_size for p in Path(args.out).iterdir())
    print(f"[finetune.recipes.export_delta] {len(parts['modules'])} matrices at rank {args.rank} (energy kept: mean "
          f"{extra['energy_kept_mean']:.3f}, min {extra['energy_kept_min']:.3f}), {len(parts['norms'])} norm "
          f"weights, the mask row: {size / 1e6:.1f} MB in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from finetune.config import run_main

    run_main(main)
