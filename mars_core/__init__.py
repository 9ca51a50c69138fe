"""mars_core: MARS multi-token decoding and the AR baseline for ordinary causal LMs (arXiv 2604.07023)."""
from mars_core.config import DecodeConfig, TauControl
from mars_core.decoding import accept_counts, draft_acceptance, generate, generate_stream, propose, reference_generate
from mars_core.events import RowStep, SequenceResult, StepEvent
from mars_core.loading import LoadedModel, load_model, wrap_model
from mars_core.sources import DEFAULT_MODEL, KNOWN_MODELS
from mars_core.tokens import resolve_mask_id

__all__ = [
    "DEFAULT_MODEL", "KNOWN_MODELS", "DecodeConfig", "LoadedModel", "RowStep", "SequenceResult", "StepEvent",
    "TauControl", "accept_counts", "draft_acceptance", "generate", "generate_stream", "load_model", "propose", "reference_generate",
    "resolve_mask_id", "wrap_model",
]
