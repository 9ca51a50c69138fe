"""The shipped MARS adapter formats: LoRA deltas + one mask-embedding row over a base model.

"mars-lora-v1" is merged into the base: the delta acts at every position. "mars-gated-lora-v1" holds the same
files, but its delta acts only where the input token is the mask (a --gated-lora run, Samragh et al., arXiv
2507.11851): it cannot be merged, so real tokens run the base model exactly (mars_core.engine.gated applies it while
decoding). Each format has its own string so that a loader which knows only the first refuses the second rather
than merging it.

A folder holds
  adapter.safetensors   "<module>.lora_A" [r, in] and "<module>.lora_B" [out, r] for each adapted nn.Linear
                        (module paths inside the CausalLM, e.g. "model.layers.0.self_attn.q_proj"), in the
                        config's dtype; with dtype "int8", int8 factors and float32 "<module>.lora_A_scale" [r]
                        (one per row of A) and "<module>.lora_B_scale" [r] (one per column of B): half the bytes
                        of bfloat16, so twice the rank in the same folder; optionally "mask_row" [hidden] in
                        float32, the trained embedding row of the mask token, and "<module>.norm_weight" [hidden]
                        in float32: the new weight of a normalisation layer (a full fine-tune changes those 1-D
                        weights, which no low-rank delta can hold; finetune.recipes.export_delta writes them)
  adapter_config.json   {"format": "mars-lora-v1" or "mars-gated-lora-v1", "base", "r", "alpha", "mask_id",
                         "mask_token", "block_size", "dtype", ...extra}; optionally "ranks": {module path: rank},
                         one entry per adapted module, each 1..r: a rank per matrix (export_delta --max-mb spends
                         a file size where the change has its energy); without it every module has rank r
  README.md             (optional) how it was made

Merging (mars-lora-v1 only) is W += (alpha / r) * B @ A for each module (the config's r, also with "ranks"),
then embedding row mask_id := mask_row. With tied embeddings that also sets the LM head's row, which is intended.
Nothing here needs peft: peft is only used to train (`save_adapter` takes its `get_peft_model_state_dict`).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mars_core.models.storage import atomic_path, atomic_write_text

FORMAT = "mars-lora-v1"
GATED_FORMAT = "mars-gated-lora-v1"
FORMATS = (FORMAT, GATED_FORMAT)
WEIGHTS_FILE = "adapter.safetensors"
CONFIG_FILE = "adapter_config.json"
MASK_ROW_KEY = "mask_row"
NORM_SUFFIX = "norm_weight"   # "<module>.norm_weight": a normalisation layer's new weight, replacing the base's
REQUIRED_KEYS = ("format", "base", "r", "alpha", "mask_id", "mask_token", "block_size", "dtype")
RANKS_KEY = "ranks"   # optional {module path: rank}: a rank per matrix; the scale stays alpha / r for every module
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INT8 = "int8"   # a stored dtype only (read_adapter dequantizes): factors int8, one float32 scale per rank component
SCALE_SUFFIX = "_scale"
PEFT_PREFIX = "base_model.model."
RECIPE_HINT = "rebuild it with its recipe (`python -m finetune.recipes.recipe_smollm2` for smollm2-mars)"

_MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")
_PEFT_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<part>[AB])\.weight")


REPO_ROOT = Path(__file__).resolve().parents[2]   # the checkout (mars_core/models/ is two below)


def _restore_hint(path: Path) -> str:
    """How to get a good copy back: git for the shipped assets, a reinstall elsewhere; or rebuild it."""
    try:
        restore = f"`git checkout {path.resolve().relative_to(REPO_ROOT)}`"
    except ValueError:   # not inside this repo
        restore = "reinstall or copy it again"
    return f"restore it ({restore}) or {RECIPE_HINT}"


def _dtype_name(dtype) -> str:
    if dtype == INT8:
        return INT8
    for name, value in DTYPES.items():
        if dtype == value or dtype == name:
            return name
    raise ValueError(f"dtype={dtype!r} is not supported for adapter weights: use torch.bfloat16, float16, float32 "
                     f"or {INT8!r}")


# ----------------------------------------------------------------------------- saving

def _modules_from_peft(lora_state: dict, r: int) -> dict[str, dict[str, torch.Tensor]]:
    """{module path: {"A": [r, in], "B": [out, r]}} from peft's state dict, refusing anything else."""
    if not isinstance(lora_state, dict) or not lora_state:
        raise ValueError("lora_state is empty: pass peft's get_peft_model_state_dict(model) of a LoRA model")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in lora_state.items():
        match = _PEFT_KEY.fullmatch(key) if isinstance(key, str) else None
        module = match["module"] if match else ""
        if module.startswith(PEFT_PREFIX):
            module = module[len(PEFT_PREFIX):]
        if not match or not _MODULE_PATH.fullmatch(module) or ".lora_" in module:
            raise ValueError(
                f"lora_state key {key!r} is not a plain LoRA weight ('<module>.lora_A.weight' / '.lora_B.weight'): "
                "pass get_peft_model_state_dict(model) of a LoRA model without DoRA, biases, embedding targets "
                "or modules_to_save"
            )
        if not isinstance(tensor, torch.Tensor) or tensor.ndim != 2 or not tensor.is_floating_point():
            raise ValueError(f"lora_state[{key!r}] must be a 2-D float tensor, got "
                             f"{getattr(tensor, 'shape', type(tensor).__name__)}")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"lora_state[{key!r}] holds NaN or inf: the training diverged; save a good checkpoint")
        modules.setdefault(module, {})[match["part"]] = tensor
    for module, parts in modules.items():
        if set(parts) != {"A", "B"}:
            missing = "lora_B" if "A" in parts else "lora_A"
            raise ValueError(f"lora_state has no {missing} for {module!r}: pass the complete state dict")
        a, b = parts["A"], parts["B"]
        if a.shape[0] != r or b.shape[1] != r:
            raise ValueError(f"{module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not have rank r={r}: "
                             "pass the r the LoRA config was made with")
    return modules


def peft_modules(lora_state: dict, r: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module path: (A [r, in], B [out, r])} from peft's state dict, as read_adapter returns a folder's."""
    return {module: (parts["A"], parts["B"]) for module, parts in _modules_from_peft(lora_state, r).items()}


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter folder's config records (``save_adapter`` checks it).

    `r`/`alpha` the LoRA rank and scale numerator, `base` the model it goes on, `mask_id`/`mask_token` the mask
    token, `block_size` the MARS block it was trained with. LoRA tensors are stored in `dtype` (a torch dtype or its
    name, or "int8": int8 factors with a float32 scale per rank component, `quantize_factors`), the mask row in fp32
    (one row: precision is free there). `extra`: more config keys (never one of REQUIRED_KEYS). `gated`: the delta
    was trained to act at mask positions only (--gated-lora), so the folder is written as mars-gated-lora-v1.
    """

    r: int
    alpha: float
    base: str
    mask_id: int
    mask_token: str
    block_size: int
    dtype: Any = torch.bfloat16
    extra: dict | None = None
    gated: bool = False


def save_adapter(out_dir, lora_state: dict, mask_row: torch.Tensor | None, spec: AdapterSpec) -> list[Path]:
    """Write adapter.safetensors + adapter_config.json to `out_dir`; returns both paths.

    `lora_state` is peft's `get_peft_model_state_dict(model)`; `mask_row` the mask token's trained
    embedding row (None: keep the base's row); `spec` what the config records and how the tensors are stored.
    """
    r, extra = spec.r, spec.extra
    config = {"format": GATED_FORMAT if spec.gated else FORMAT, "base": spec.base, "r": r, "alpha": spec.alpha,
              "mask_id": spec.mask_id, "mask_token": spec.mask_token, "block_size": spec.block_size,
              "dtype": _dtype_name(spec.dtype)}
    extra = dict(extra or {})
    clash = sorted(set(extra) & set(REQUIRED_KEYS))
    if clash:
        raise ValueError(f"extra={clash} would overwrite the adapter's own config keys: rename them")
    config.update(extra)
    _check_config(config, Path(out_dir) / CONFIG_FILE, fix="pass a valid value to save_adapter")
    try:
        json.dumps(config)
    except TypeError as exc:
        raise ValueError(f"extra={extra!r} is not JSON-serialisable ({exc}): "
                         "pass plain numbers, strings, lists") from exc
    modules = _modules_from_peft(lora_state, r)
    tensors: dict[str, torch.Tensor] = {}
    for module, parts in sorted(modules.items()):
        a, b = parts["A"].detach().to("cpu"), parts["B"].detach().to("cpu")
        if config["dtype"] == INT8:   # half bf16's bytes; read_adapter dequantizes
            tensors.update({f"{module}.{key}": t for key, t in quantize_factors(a, b).items()})
        else:
            tensors[f"{module}.lora_A"] = a.to(DTYPES[config["dtype"]]).contiguous()
            tensors[f"{module}.lora_B"] = b.to(DTYPES[config["dtype"]]).contiguous()
    if mask_row is not None:
        if not isinstance(mask_row, torch.Tensor) or mask_row.ndim != 1 or not mask_row.is_floating_point():
            raise ValueError(f"mask_row must be a 1-D float tensor [hidden], got "
                             f"{getattr(mask_row, 'shape', type(mask_row).__name__)}: pass embedding.weight[mask_id]")
        if not torch.isfinite(mask_row).all():
            raise ValueError("mask_row holds NaN or inf: the training diverged; save a good checkpoint")
        tensors[MASK_ROW_KEY] = mask_row.detach().to("cpu", torch.float32).contiguous()

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights, cfg_path = out / WEIGHTS_FILE, out / CONFIG_FILE
    with atomic_path(weights, "the adapter's weights") as tmp:   # a full disk: one line, no half-written file
        save_file(tensors, str(tmp), metadata={"format": config["format"]})
    atomic_write_text(cfg_path, json.dumps(config, indent=2, sort_keys=True) + "\n", "the adapter's config")
    return [weights, cfg_path]


# ----------------------------------------------------------------------------- reading

def _check_config(cfg, path: Path, fix: str = RECIPE_HINT) -> None:
    def bad(key, want):
        raise ValueError(f"{path}: {key}={cfg.get(key)!r} {want}; {fix}")

    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a JSON object: {_restore_hint(path)}")
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"{path} lacks {missing}: it is not a {FORMAT} adapter config; {_restore_hint(path)}")
    if cfg["format"] not in FORMATS:
        bad("format", f"is not one of {', '.join(map(repr, FORMATS))} (a peft adapter folder? convert it with "
                      "mars_core.models.adapter.save_adapter)")
    if not isinstance(cfg["base"], str) or not cfg["base"].strip():
        bad("base", "must name the base model (a known name like 'smollm2' or a checkpoint folder)")
    if not isinstance(cfg["r"], int) or isinstance(cfg["r"], bool) or cfg["r"] < 1:
        bad("r", "must be a positive integer (the LoRA rank)")
    alpha = cfg["alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        bad("alpha", "must be a positive number (LoRA alpha; the scale is alpha / r)")
    if not isinstance(cfg["mask_id"], int) or isinstance(cfg["mask_id"], bool) or cfg["mask_id"] < 0:
        bad("mask_id", "must be a non-negative token id")
    if not isinstance(cfg["mask_token"], str) or not cfg["mask_token"]:
        bad("mask_token", "must be the mask token's text (e.g. '<repo_name>')")
    if not isinstance(cfg["block_size"], int) or isinstance(cfg["block_size"], bool) or cfg["block_size"] < 1:
        bad("block_size", "must be a positive integer (B, the block size it was trained with)")
    if cfg["dtype"] not in (*DTYPES, INT8):
        bad("dtype", f"must be one of {sorted(DTYPES) + [INT8]}")
    ranks = cfg.get(RANKS_KEY)
    if ranks is not None and (not isinstance(ranks, dict) or not ranks or not all(
            isinstance(m, str) and _MODULE_PATH.fullmatch(m) and isinstance(k, int) and not isinstance(k, bool)
            and 1 <= k <= cfg["r"] for m, k in ranks.items())):
        bad(RANKS_KEY, f"must map each adapted module path to its rank, 1 to r={cfg['r']}")


def read_adapter_config(adapter_dir) -> dict:
    """The validated adapter_config.json of an adapter folder."""
    path = Path(adapter_dir) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing: {_restore_hint(path)}")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is damaged ({exc}): {_restore_hint(path)}") from exc
    _check_config(cfg, path)
    return cfg


def is_gated(cfg: dict) -> bool:
    """Whether an adapter config (read_adapter_config's) is a gated one: applied at mask positions, never merged."""
    return cfg["format"] == GATED_FORMAT


def read_norms(adapter_dir) -> dict[str, torch.Tensor]:
    """{module path: new weight} of the normalisation layers an adapter replaces ({} for a plain LoRA adapter)."""
    from safetensors import safe_open

    path = Path(adapter_dir) / WEIGHTS_FILE
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            module, _, part = key.rpartition(".")
            if part == NORM_SUFFIX:
                t = f.get_tensor(key)
                if t.ndim != 1 or t.dtype != torch.float32 or not torch.isfinite(t).all():
                    raise ValueError(f"{path}: {key} is {t.dtype} {tuple(t.shape)} or not finite, not a float32 "
                                     f"row: {_restore_hint(path)}")
                out[module] = t
    return out


def read_adapter(adapter_dir) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """(config, {module: (A, B)}, mask_row or None), every tensor checked against the config; normalisation
    weights (read_norms) are checked there and skipped here."""
    cfg = read_adapter_config(adapter_dir)
    path = Path(adapter_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing: {_restore_hint(path)}")
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error type for truncated or garbled files
        raise ValueError(f"{path} is damaged or truncated ({exc}): {_restore_hint(path)}") from exc
    r, int8 = cfg["r"], cfg["dtype"] == INT8
    store = torch.int8 if int8 else DTYPES[cfg["dtype"]]
    mask_row = tensors.pop(MASK_ROW_KEY, None)
    if mask_row is not None and (mask_row.ndim != 1 or mask_row.dtype != torch.float32):
        raise ValueError(f"{path}: mask_row is {mask_row.dtype} {tuple(mask_row.shape)}, not a float32 row: "
                         f"{_restore_hint(path)}")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, part = key.rpartition(".")
        if part == NORM_SUFFIX and _MODULE_PATH.fullmatch(module):
            continue
        if int8 and part in ("lora_A" + SCALE_SUFFIX, "lora_B" + SCALE_SUFFIX) and _MODULE_PATH.fullmatch(module):
            parts.setdefault(module, {})[part] = tensor   # its shape is checked below, against the module's rank
            continue
        if part not in ("lora_A", "lora_B") or not _MODULE_PATH.fullmatch(module):
            raise ValueError(f"{path}: unknown tensor {key!r} (want '<module>.lora_A', '<module>.lora_B' or "
                             f"'mask_row'): {_restore_hint(path)}")
        if tensor.ndim != 2 or tensor.dtype != store:
            raise ValueError(f"{path}: {key} is {tensor.dtype} {tuple(tensor.shape)}, the config says 2-D "
                             f"{cfg['dtype']}: {_restore_hint(path)}")
        parts.setdefault(module, {})[part] = tensor
    ranks = cfg.get(RANKS_KEY)
    if ranks is not None and set(ranks) != set(parts):   # a rank per matrix names every matrix the file holds
        only_cfg, only_file = sorted(set(ranks) - set(parts)), sorted(set(parts) - set(ranks))
        raise ValueError(f"{path}: the config's ranks and the file's modules differ (only in the config: "
                         f"{only_cfg[:2]}, only in the file: {only_file[:2]}): {_restore_hint(path)}")
    modules = {}
    want = {"lora_A", "lora_B"} | ({"lora_A" + SCALE_SUFFIX, "lora_B" + SCALE_SUFFIX} if int8 else set())
    for module, p in sorted(parts.items()):
        if set(p) != want:
            raise ValueError(f"{path}: {module} has only {sorted(p)}, not {sorted(want)}: {_restore_hint(path)}")
        a, b = p["lora_A"], p["lora_B"]
        rank = r if ranks is None else ranks[module]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{path}: {module} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not have "
                             f"the config's rank {'r' if ranks is None else 'ranks[...]'}={rank}: "
                             f"{_restore_hint(path)}")
        for part in ("lora_A" + SCALE_SUFFIX, "lora_B" + SCALE_SUFFIX) if int8 else ():
            t = p[part]
            if t.ndim != 1 or t.dtype != torch.float32 or t.shape[0] != rank:
                raise ValueError(f"{path}: {module}.{part} is {t.dtype} {tuple(t.shape)}, not float32 [{rank}] (one "
                                 f"scale per rank component): {_restore_hint(path)}")
        if int8:
            a = a.float() * p["lora_A" + SCALE_SUFFIX][:, None]
            b = b.float() * p["lora_B" + SCALE_SUFFIX][None, :]
        modules[module] = (a, b)
    if not modules and mask_row is None:
        raise ValueError(f"{path} holds no LoRA weights and no mask_row: {_restore_hint(path)}")
    for name, t in [("mask_row", mask_row)] + [(m, t) for m, ab in modules.items() for t in ab]:
        if t is not None and not torch.isfinite(t.float()).all():
            raise ValueError(f"{path}: {name} holds NaN or inf: {_restore_hint(path)}")
    return cfg, modules, mask_row


def quantize_factors(a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """A [r, in] and B [out, r] as int8 with one float32 scale per rank component (A's rows, B's columns),
    symmetric and rounded to nearest: {"lora_A", "lora_A_scale", "lora_B", "lora_B_scale"}. A zero component
    gets scale 1 (its int8 values are 0 either way)."""
    out = {}
    for name, t, dim in (("lora_A", a.float(), 1), ("lora_B", b.float(), 0)):
        scale = t.abs().amax(dim=dim) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        shaped = scale[:, None] if dim == 1 else scale[None, :]
        out[name] = torch.round(t / shaped).clamp(-127, 127).to(torch.int8).contiguous()
        out[name + SCALE_SUFFIX] = scale.contiguous()
    return out


def adapter_files_size(adapter_dir) -> int:
    """Bytes of every file in the adapter folder: what shipping it costs (smollm2-mars's budget: 48 MB)."""
    folder = Path(adapter_dir)
    if not folder.is_dir():
        raise ValueError(f"adapter folder {folder} does not exist: {RECIPE_HINT}")
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- merging

@torch.no_grad()
def merge_adapter(model: torch.nn.Module, adapter_dir) -> None:
    """Fold the adapter into a plain transformers CausalLM, in place.

    Everything is validated before the first weight changes, so a refused adapter leaves the model as it
    was. The sums are done in fp32 (the loader merges into an fp32 model; others are cast back).
    """
    cfg, modules, mask_row = read_adapter(adapter_dir)
    where = Path(adapter_dir) / WEIGHTS_FILE
    if is_gated(cfg):
        raise ValueError(f"{Path(adapter_dir) / CONFIG_FILE} is a {GATED_FORMAT} adapter, which acts at mask "
                         "positions only and cannot be merged: load it with mars_core.load_model(folder), or apply it "
                         "with mars_core.models.adapter.attach_gated")
    named = dict(model.named_modules())
    targets = []
    for module, (a, b) in modules.items():
        layer = named.get(module)
        if layer is None:
            raise ValueError(f"{where} adapts {module!r}, which {type(model).__name__} does not have: the adapter "
                             f"was made for another base (its config says base={cfg['base']!r})")
        if type(layer) is not torch.nn.Linear:
            raise ValueError(f"{module!r} is a {type(layer).__name__}, not an nn.Linear: merge into the stock "
                             "model (load_model(..., cpu_layout=False) or AutoModelForCausalLM.from_pretrained)")
        want = (layer.out_features, layer.in_features)
        if (b.shape[0], a.shape[1]) != want:
            raise ValueError(f"{where}: {module} is [{b.shape[0]}, {a.shape[1]}] but the model's is {list(want)}: "
                             f"the adapter was made for another base (its config says base={cfg['base']!r})")
        targets.append((layer, a, b))
    embedding = model.get_input_embeddings()
    if mask_row is not None:
        rows, hidden = embedding.weight.shape
        if cfg["mask_id"] >= rows:
            raise ValueError(f"{where}: mask_id={cfg['mask_id']} but the embedding has {rows} rows: the adapter was "
                             f"made for another base (its config says base={cfg['base']!r})")
        if mask_row.shape[0] != hidden:
            raise ValueError(f"{where}: mask_row has {mask_row.shape[0]} values but the embedding is {hidden} wide: "
                             f"the adapter was made for another base (its config says base={cfg['base']!r})")
    norms = read_norms(adapter_dir)
    norm_targets = []
    for module, weight in norms.items():
        layer = named.get(module)
        if layer is None or getattr(layer, "weight", None) is None or tuple(layer.weight.shape) != tuple(weight.shape):
            raise ValueError(f"{where} replaces the weight of {module!r}, which {type(model).__name__} does not have "
                             f"in that shape: the adapter was made for another base (its config says "
                             f"base={cfg['base']!r})")
        norm_targets.append((layer, weight))
    scale = cfg["alpha"] / cfg["r"]
    for layer, weight in norm_targets:
        layer.weight.copy_(weight.to(layer.weight.dtype))
    for layer, a, b in targets:
        w = layer.weight
        merged = w.float() + scale * (b.float() @ a.float())
        w.copy_(merged.to(w.dtype))
    if mask_row is not None:
        # Tied embeddings share this tensor with the LM head, so its row mask_id changes too (intended).
        embedding.weight[cfg["mask_id"]] = mask_row.to(embedding.weight.dtype)


def attach_gated(model: torch.nn.Module, adapter_dir) -> "Gate":
    """Apply a mars-gated-lora-v1 adapter folder to a transformers CausalLM, in place; returns its Gate."""
    from mars_core.engine.gated import Gate, apply_gated

    cfg, modules, mask_row = read_adapter(adapter_dir)
    if not is_gated(cfg):
        raise ValueError(f"{Path(adapter_dir) / CONFIG_FILE} is a plain (merged) adapter: load it with "
                         "mars_core.load_model or merge it with mars_core.models.adapter.merge_adapter")
    return apply_gated(model, cfg, modules, mask_row, str(Path(adapter_dir) / WEIGHTS_FILE))
