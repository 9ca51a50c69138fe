"""Where lossless MARS's drafts come from and how a step lays them out (docs/algorithm.md, "Draft layouts").

Two layouts of one verify step, both fed as [holes | uncached tokens, drafts last | mask groups]:
  linear     one group of B-1 masks after the last draft. When a draft is rejected those masks saw a wrong
             token, so the next step has no mask drafts.
  quadratic  one group after the last committed token and after every draft; group j sees the prefix up to
             draft j and its own masks only. Whichever prefix of the drafts is confirmed, the group behind it
             has already proposed the next drafts, so no step waits for drafts. It costs (drafts + 1) x (B-1)
             mask positions instead of B-1.
The masks always come after every real token, so the cache keeps only real tokens and drops the masks by
cropping its last columns, as in the linear layout.

Prompt lookup (`prompt_lookup=n`): when the last n..1 tokens of prompt + output occurred before, the tokens
that followed their latest occurrence are offered as drafts; the step keeps whichever of the mask drafts and
the looked-up drafts is longer. Drafts only change how many tokens a forward confirms, never which tokens.
"""
from __future__ import annotations

import torch

LAYOUTS = ("linear", "quadratic")
SOURCES = ("masks", "prompt")


def group_attention(base: torch.Tensor, width: int, groups: int, n_masks: int) -> torch.Tensor:
    """The step's 4D mask with mask groups: `base` is the causal mask over [cache | chunk] (step_attention);
    group g belongs to chunk column width - groups + g and may see the chunk only up to that column, then the
    masks of its own group before it. Every query still sees itself."""
    length = width + groups * n_masks
    allowed = torch.ones(length, length, dtype=torch.bool, device=base.device).tril()
    for g in range(groups):
        first = width + g * n_masks
        allowed[first: first + n_masks, width - groups + g + 1: first] = False   # later tokens, earlier groups
    past = base.shape[-1] - length
    keys = torch.cat([torch.ones(length, past, dtype=torch.bool, device=base.device), allowed], dim=1)
    return base & keys


def lookup_drafts(tokens: list[int], max_n: int, cap: int, eos_ids) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the last n tokens (n = max_n .. 1, longest
    match first), at most `cap`, ending at an eos. Empty when nothing matches."""
    if cap < 1 or max_n < 1:
        return []
    end = len(tokens)
    for n in range(min(max_n, end - 1), 0, -1):
        tail, last = tokens[end - n:], tokens[-1]
        for start in range(end - n - 1, -1, -1):   # latest first: the nearest context is the likeliest copy
            if tokens[start + n - 1] == last and tokens[start: start + n] == tail:
                out = tokens[start + n: start + n + cap]
                for i, t in enumerate(out):
                    if t in eos_ids:
                        return out[: i + 1]
                return out
    return []
