"""mars_core: MARS multi-token decoding and the AR baseline for ordinary causal LMs (arXiv 2604.07023).

Four parts: decode/ (the MARS algorithm, what custom_generate vendors), engine/ (the CPU forward: lean, w8a8,
native kernels), models/ (loading, sources, tokens, adapters, export) and tools/ (CLI, bench, other runtimes,
timing). Each part imports only the parts listed before it.

The names below load on first use (PEP 562), so `import mars_core.models.catalogue` or `mars_core.models.textfile`
does not import torch: `python -m finetune.evals.evaluate --help` and the app's startup stay quick."""
import importlib

_HOMES = {
    "DecodeConfig": "decode.config", "TauControl": "decode.config",
    "accept_counts": "decode.step", "draft_acceptance": "decode.decoding", "generate": "decode.decoding",
    "generate_stream": "decode.decoding", "propose": "decode.step", "reference_generate": "decode.decoding",
    "RowStep": "decode.events", "SequenceResult": "decode.events", "StepEvent": "decode.events",
    "LoadedModel": "models.loading", "load_model": "models.loading", "wrap_model": "models.loading",
    "DEFAULT_MODEL": "models.sources", "KNOWN_MODELS": "models.sources",
    "resolve_mask_id": "models.tokens", "custom_generate_path": "models.hf",
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
