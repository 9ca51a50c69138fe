"""What the decoder needs of a model: the backend interface, written down once.

A backend runs one forward over a chunk of positions and keeps a KV cache. The decoder asks it for nothing else,
so any model that provides these members decodes: the lean CPU forward (mars_core.engine.lean.LeanLM) declares
them itself, and a transformers CausalLM gets them from `TransformersBackend`, a thin wrapper.

    backend(input_ids=[b, T], attention_mask=[b, 1, T, K] bool or None (None: plain causal), position_ids=[b, T],
            cache=KVCache, use_cache=True, logits_to_keep=[k] column indices,
            draft_tail=n (only if takes_draft_tail), head_top=(mask_id, first, conf_from) (only if takes_head_top))
        -> an output with .logits [b, k, V]; with head_top also .top = (largest logits, argmax) and .conf

The optional parts are what a fast backend can do better than transformers, and each is a capability flag:
`takes_draft_tail` (the last n positions only propose drafts, so they may be computed more cheaply),
`takes_head_top` (the LM head gathers each kept row's argmax, and its probability, while writing the logits),
`builds_causal_mask` (attention_mask=None costs less than the decoder's 4D mask for a chunk after a cache).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from transformers import DynamicCache


class KVCache(Protocol):
    """The cache a forward appends the chunk's keys and values to."""

    def crop(self, n: int) -> None:
        """With n < 0: drop the last -n columns (the masks, rejected drafts and leaves of the step)."""

    def batch_select_indices(self, index: torch.Tensor) -> None:
        """Keep only these batch rows (finished rows leave)."""

    def get_seq_length(self) -> int:
        """Columns cached, holes included."""


@runtime_checkable
class Backend(Protocol):
    """A model as the decoder runs it (see the module docstring for the forward's arguments)."""
    takes_draft_tail: bool
    takes_head_top: bool
    builds_causal_mask: bool

    def new_cache(self) -> KVCache:
        """An empty cache for a new generation."""

    def __call__(self, **forward): ...


class TransformersBackend:
    """A transformers CausalLM as a Backend: none of the optional capabilities, its own DynamicCache."""
    takes_draft_tail = False
    takes_head_top = False
    builds_causal_mask = False   # transformers' own mask for a chunk after a cache costs more than ours

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def __call__(self, **forward):
        return self.model(**forward)


def net(lm):
    """The module that runs the forward: `lm.net` (a LoadedModel's: the lean forward or the transformers model),
    or `lm.model` for a model view that has none. Hooks and timing attach here."""
    return getattr(lm, "net", None) or lm.model


def as_backend(module) -> Backend:
    """`module` itself where it provides the interface (the lean forward), else wrapped as a transformers model."""
    return module if isinstance(module, Backend) else TransformersBackend(module)


def backend(lm) -> Backend:
    """What the decoder runs for a loaded model or model view: `net(lm)` as a Backend."""
    return as_backend(net(lm))
