"""mars_core: MARS multi-token decoding and the AR baseline for ordinary causal LMs (arXiv 2604.07023).

The names below load on first use (PEP 562), so `import mars_core.catalogue` or `mars_core.textfile` does not
import torch: `python -m finetune.evaluate --help` and the app's startup stay quick."""
import importlib

_HOMES = {
    "DecodeConfig": "config", "TauControl": "config",
    "accept_counts": "decoding", "draft_acceptance": "decoding", "generate": "decoding",
    "generate_stream": "decoding", "propose": "decoding", "reference_generate": "decoding",
    "RowStep": "events", "SequenceResult": "events", "StepEvent": "events",
    "LoadedModel": "loading", "load_model": "loading", "wrap_model": "loading",
    "DEFAULT_MODEL": "sources", "KNOWN_MODELS": "sources",
    "resolve_mask_id": "tokens",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'mars_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mars_core.{_HOMES[name]}"), name)
    globals()[name] = value   # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
