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

`--max-mb` gives every matrix its own rank instead: the components (singular directions) of all matrices are
taken greedily, most energy per byte first, until adapter.safetensors would pass that size. `--allocate absolute`
ranks a component by its squared singular value (the largest share of the whole change's squared norm kept),
`relative` by its share of its own matrix (no matrix left far behind). The config then records "ranks".

`--calibration FILE` (chat JSONL) measures each matrix's inputs on the fine-tune (C = E[x xᵀ]) and keeps the
directions along which the change moves the outputs most: the SVD of D·L with C = L Lᵀ ranks them by E‖D x‖², and
the energy figures are output energy.

The report gives the share of the change's energy (squared Frobenius norm) the adapter keeps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from mars_core.models.adapter import AdapterSpec


def linear_weights_modules(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """{module path: module} of the decoder's nn.Linear layers (the LM head, tied to the embedding, left out)."""
    head = model.get_output_embeddings()
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}


def linear_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{module path: weight} of the decoder's nn.Linear layers (the LM head, tied to the embedding, left out)."""
    return {name: m.weight for name, m in linear_weights_modules(model).items()}


def norm_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{module path: weight} of the 1-D-weighted modules (RMSNorm / LayerNorm)."""
    return {name: m.weight for name, m in model.named_modules()
            if getattr(m, "weight", None) is not None and isinstance(m.weight, torch.Tensor) and m.weight.ndim == 1}


@torch.no_grad()
def low_rank(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A [r, in], B [out, r], kept energy share) with B @ A the best rank-r approximation of `delta`."""
    return _factors(torch.linalg.svd(delta.float(), full_matrices=False), rank, pad=True)


@torch.no_grad()
def changes(tuned: torch.nn.Module, base: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{module path: W_tuned − W_base} (fp32) of every decoder nn.Linear that changed."""
    lin_t, lin_b = linear_weights(tuned), linear_weights(base)
    if set(lin_t) != set(lin_b):
        raise ValueError("the fine-tune and --base have different layers: pass the base it was trained from")
    out = {}
    for name, w in lin_t.items():
        delta = w.float() - lin_b[name].float()
        if torch.any(delta):
            out[name] = delta
    return out


ALLOCATIONS = ("absolute", "relative")


def component_bytes(shape: tuple[int, int], dtype: str) -> int:
    """Bytes one rank component of an [out, in] matrix costs in the file: a row of A and a column of B (int8: one
    byte each plus their two float32 scales)."""
    out_features, in_features = shape
    if dtype == "int8":
        return out_features + in_features + 8
    return (out_features + in_features) * {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


def allocate_ranks(spectra: dict[str, torch.Tensor], costs: dict[str, int], budget: int,
                   allocate: str = "absolute") -> dict[str, int]:
    """{matrix: rank} spending at most `budget` bytes: components taken greedily by value per byte, the value of
    singular value s of matrix m being s² ("absolute") or s² / ‖D_m‖² ("relative"). Within a matrix the values fall,
    so the taken components of each matrix are its leading ones. A matrix that gets none is left out."""
    if allocate not in ALLOCATIONS:
        raise ValueError(f"allocate={allocate!r}: use one of {', '.join(ALLOCATIONS)}")
    scored = []
    for name, s in spectra.items():
        energy = (s.double() ** 2)
        total = float(energy.sum())
        if total <= 0:
            continue
        value = energy / (total if allocate == "relative" else 1.0) / costs[name]
        scored += [(float(v), name, i) for i, v in enumerate(value) if v > 0]
    scored.sort(key=lambda item: (-item[0], item[1], item[2]))
    ranks: dict[str, int] = {}
    spent = 0
    for _, name, i in scored:
        if spent + costs[name] > budget:
            break   # stop at the first that does not fit: a cheaper later one would take a lower-valued direction
        spent += costs[name]
        ranks[name] = ranks.get(name, 0) + 1
    return ranks


def _factors(svd: tuple, rank: int, pad: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A, B, kept share) at `rank` from a matrix's SVD (u, s, vh); `pad`: zero components up to `rank`."""
    u, s, vh = svd
    r = min(rank, s.numel())
    root = s[:r].sqrt()
    total = float((s ** 2).sum())
    kept = float((s[:r] ** 2).sum()) / total if total > 0 else 1.0
    a, b = root[:, None] * vh[:r], u[:, :r] * root[None, :]
    if pad and r < rank:   # a matrix smaller than the rank: pad with zeros so every module has the config's r
        a = torch.cat([a, a.new_zeros(rank - r, a.shape[1])])
        b = torch.cat([b, b.new_zeros(b.shape[0], rank - r)], dim=1)
    return a, b, kept


@torch.no_grad()
def input_moments(model: torch.nn.Module, tokenizer, chats: list[list[dict]], max_length: int = 256
                  ) -> dict[str, torch.Tensor]:
    """{module path: E[x xᵀ]} (float64) of each decoder nn.Linear's inputs over every token of `chats`."""
    sums: dict[str, torch.Tensor] = {}
    count = 0
    hooks = []
    # one forward's xᵀx per input tensor: q/k/v (and gate/up) share theirs. The tensor is held with it, so its id
    # cannot pass to a later temporary of the same forward.
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    for name, module in linear_weights_modules(model).items():
        def hook(_m, args, name=name):
            x = args[0]
            if id(x) not in seen:
                flat = x.reshape(-1, x.shape[-1]).double()
                seen[id(x)] = (x, flat.T @ flat)
            sums[name] = sums.get(name, 0) + seen[id(x)][1]
        hooks.append(module.register_forward_pre_hook(hook))
    try:
        for messages in chats:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_length]
            model(torch.tensor([ids]))
            seen.clear()   # the next forward's tensors may reuse these ids
            count += len(ids)
    finally:
        for h in hooks:
            h.remove()
    if not count:
        raise ValueError("--calibration holds no conversations: pass a chat JSONL file ({'messages': [...]} rows)")
    return {name: total / count for name, total in sums.items()}


def whitener(moment: torch.Tensor) -> torch.Tensor:
    """L (lower triangular, float64) with L Lᵀ = C + a small ridge (1e-6 of C's mean diagonal): ‖D L‖ is the root
    mean square of D x over the calibration inputs."""
    ridge = 1e-6 * float(moment.diagonal().mean()) or 1e-12
    return torch.linalg.cholesky(moment + ridge * torch.eye(moment.shape[0], dtype=moment.dtype))


def _svd(delta: torch.Tensor, low: torch.Tensor | None) -> tuple:
    """(u, s, vh) of `delta`, or with a whitener `low` (L of its inputs): of D·L, vh carried back to input space
    (vh L⁻¹), so that B @ A at rank r is D's best rank-r approximation in output error over those inputs."""
    if low is None:
        return torch.linalg.svd(delta, full_matrices=False)
    u, s, vh = torch.linalg.svd(delta.double() @ low, full_matrices=False)
    back = torch.linalg.solve_triangular(low, vh, upper=False, left=False)   # vh L⁻¹
    return u.float(), s.float(), back.float()


@torch.no_grad()
def extract(tuned: torch.nn.Module, base: torch.nn.Module, mask_id: int, rank: int | dict[str, int],
            lows: dict[str, torch.Tensor] | None = None) -> dict:
    """The adapter's tensors and a report: {"modules": {path: (A, B)}, "mask_row", "norms", "kept": {path: share}}.

    `rank` is one rank for every matrix, or {path: rank} (a matrix not in it is left out: kept share 0). With
    `lows` ({path: whitener(its input moment)}) each matrix is cut in output space, its kept share of output energy."""
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
    modules, kept = {}, {}
    for name, delta in changes(tuned, base).items():
        if isinstance(rank, dict) and not rank.get(name):
            kept[name] = 0.0
            continue
        svd = _svd(delta, None if lows is None else lows[name])
        a, b, share = _factors(svd, rank[name] if isinstance(rank, dict) else rank, pad=not isinstance(rank, dict))
        modules[name], kept[name] = (a, b), share
    norms = {name: w.detach().float().clone() for name, w in norm_weights(tuned).items()
             if not torch.equal(w.float(), norm_weights(base)[name].float())}
    return {"modules": modules, "mask_row": emb_t[mask_id].detach().float().clone(), "norms": norms, "kept": kept}


@torch.no_grad()
def fit_ranks(tuned: torch.nn.Module, base: torch.nn.Module, max_bytes: int, dtype: str,
              allocate: str = "absolute", lows: dict[str, torch.Tensor] | None = None) -> dict[str, int]:
    """{matrix: rank} whose adapter.safetensors (factors, mask row, changed norms, header) fits `max_bytes`."""
    deltas = changes(tuned, base)
    norms = [n for n, w in norm_weights(tuned).items() if not torch.equal(w.float(), norm_weights(base)[n].float())]
    hidden = tuned.get_input_embeddings().weight.shape[1]
    # Everything but the factors, the header bounded from above (≤ 100 bytes of JSON per tensor besides its name).
    tensor_names = [f"{n}.{part}" for n in deltas for part in ("lora_A", "lora_B", "lora_A_scale", "lora_B_scale")]
    tensor_names += [f"{n}.norm_weight" for n in norms] + ["mask_row"]
    fixed = 4 * hidden * (1 + len(norms)) + sum(len(n) + 100 for n in tensor_names) + 256
    if max_bytes <= fixed:
        raise ValueError(f"--max-mb {max_bytes / 1e6:g}: the mask row, norms and header alone take "
                         f"{fixed / 1e6:.3f} MB; give more")
    spectra = {n: torch.linalg.svdvals(d if lows is None else d.double() @ lows[n])
               for n, d in deltas.items()}
    costs = {n: component_bytes(tuple(d.shape), dtype) for n, d in deltas.items()}
    return allocate_ranks(spectra, costs, max_bytes - fixed, allocate)


def save(out: Path, parts: dict, spec: AdapterSpec) -> None:
    """Write the folder beside `out` and swap it in (mars_core.models.storage.replace_folder): never half a folder.

    `spec.r` is the rank (the config's alpha is `spec.alpha`; `r` gives scale 1), `spec.dtype` a DTYPES name or
    "int8" (factors int8 with a float32 scale per rank component: mars_core.models.adapter.quantize_factors).
    """
    from safetensors.torch import save_file

    from mars_core.models.adapter import (CONFIG_FILE, DTYPES, FORMAT, INT8, MASK_ROW_KEY, NORM_SUFFIX, RANKS_KEY,
                                          WEIGHTS_FILE, quantize_factors)
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
    ranks = parts.get("ranks")
    if ranks:   # read_adapter checks every module's factors against it
        config[RANKS_KEY] = dict(sorted(ranks.items()))
    tmp = out.with_name(out.name + ".new")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    replace_folder(tmp, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m finetune.recipes.export_delta", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a finetune.train checkpoint folder (a full fine-tune)")
    ap.add_argument("--base", default="smollm2", help="the model the adapter goes on (default: smollm2)")
    ap.add_argument("--rank", type=int, default=64, help="one rank for every matrix (default: 64)")
    ap.add_argument("--max-mb", type=float, default=None,
                    help="instead of --rank: a rank per matrix, as much of the change as fits a weights file of this "
                         "many MB (10^6 bytes)")
    ap.add_argument("--allocate", default="absolute", choices=ALLOCATIONS,
                    help="with --max-mb, which components first: the most squared singular value per byte "
                         "(absolute) or the most share of its own matrix per byte (relative)")
    ap.add_argument("--out", required=True, help="the adapter folder to write (replaced by rename if it exists)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "int8"],
                    help="how the factors are stored (int8: half of bfloat16's bytes, a float32 scale per component)")
    ap.add_argument("--calibration", default="",
                    help="a chat JSONL file: cut each change where it moves the outputs least on these inputs")
    ap.add_argument("--n-calibration", type=int, default=256, help="how many of its conversations (default: 256)")
    args = ap.parse_args(argv)
    if args.calibration and not Path(args.calibration).is_file():
        raise ValueError(f"--calibration {args.calibration!r} is not a file: pass a chat JSONL file such as a "
                         "distillation's data.jsonl")
    if args.n_calibration < 1:
        raise ValueError(f"--n-calibration {args.n_calibration}: use 1 or more")
    if args.rank < 1:
        raise ValueError(f"--rank {args.rank}: use 1 or more (64 ships SmolLM2's change in ~40 MB)")
    if args.max_mb is not None and not args.max_mb > 0:
        raise ValueError(f"--max-mb {args.max_mb}: use a positive size in MB (29.5 keeps SmolLM2's under 30 MB)")
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
    base_model = base.model.float()
    lows = None
    if args.calibration:
        from finetune.data import read_chat_jsonl

        chats = read_chat_jsonl(args.calibration)[:args.n_calibration]
        lows = {n: whitener(c) for n, c in input_moments(tuned, base.tokenizer, chats).items()}
    rank: int | dict[str, int] = args.rank
    if args.max_mb is not None:
        rank = fit_ranks(tuned, base_model, int(args.max_mb * 1e6), args.dtype, args.allocate, lows)
    parts = extract(tuned, base_model, base.mask_id, rank, lows)
    r = max(rank.values()) if isinstance(rank, dict) else args.rank
    if isinstance(rank, dict):
        parts["ranks"] = rank
    mask_token = base.tokenizer.convert_ids_to_tokens(base.mask_id)
    kept = parts["kept"]
    extra = {"source": "full fine-tune, SVD per matrix", "checkpoint": ckpt.name,
             "energy_kept_min": round(min(kept.values()), 4) if kept else 1.0,
             "energy_kept_mean": round(sum(kept.values()) / len(kept), 4) if kept else 1.0}
    if isinstance(rank, dict):
        extra["allocate"] = args.allocate
    if lows is not None:
        extra["calibration"] = f"{Path(args.calibration).name}, first {len(chats)} conversations (output energy)"
    save(Path(args.out), parts, AdapterSpec(r=r, alpha=r, base=args.base, mask_id=base.mask_id,
                                            mask_token=mask_token, block_size=int(train_cfg.get("block_size", 4)),
                                            dtype=args.dtype, extra=extra))
    size = sum(p.stat().st_size for p in Path(args.out).iterdir())
    ranks = sorted(rank.values()) if isinstance(rank, dict) else [args.rank]
    print(f"[finetune.recipes.export_delta] {len(parts['modules'])} matrices at rank "
          f"{args.rank if not isinstance(rank, dict) else f'{ranks[0]}..{ranks[-1]} (median {ranks[len(ranks) // 2]})'}"
          f" (energy kept: mean {extra['energy_kept_mean']:.3f}, min {extra['energy_kept_min']:.3f}), "
          f"{len(parts['norms'])} norm weights, the mask row: {size / 1e6:.1f} MB in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from finetune.config import run_main

    run_main(main)
