"""Where lossless MARS's drafts come from and how a step lays them out (docs/algorithm.md, "Draft layouts").

Three layouts of one verify step, fed as [holes | uncached tokens, drafts last | leaves | mask groups]:
  linear     one group of B-1 masks after the last draft. When a draft is rejected those masks saw a wrong
             token, so the next step has no mask drafts.
  quadratic  one group after the last committed token and after every draft; group j sees the prefix up to
             draft j and its own masks only. Whichever prefix of the drafts is confirmed, the group behind it
             has already proposed the next drafts, so no step waits for drafts. It costs (drafts + 1) x (B-1)
             mask positions instead of B-1.
  tree       the quadratic layout plus leaves: at each draft's depth (and the one after the last draft) the
             next likeliest tokens of that mask, each seeing only the drafts before its depth. When a draft is
             rejected and a leaf at its depth holds AR's token, the leaf is confirmed and AR's token after it is
             committed too (one token more), and the mask group behind that leaf drafts the next step. Costs
             one position per leaf and a group of B-1 masks behind each. A rejected draft or leaf before a kept
             column stays in the cache as a hole (hidden, never seen again).
The masks always come after every real token, so the cache keeps only real tokens and drops the masks by
cropping its last columns, as in the linear layout.

Prompt lookup (`prompt_lookup=n`): when the last n..1 tokens of prompt + output occurred before, the tokens
that followed their latest occurrence are offered as drafts; the step keeps whichever of the mask drafts and
the looked-up drafts is longer. Drafts only change how many tokens a forward confirms, never which tokens.
"""
from __future__ import annotations

import torch

LAYOUTS = ("linear", "quadratic", "tree")
SOURCES = ("masks", "prompt")
LEAF_MIN_PROB = 0.1   # tree layout: an alternative below this probability is not worth its position


def block_attention(base: torch.Tensor, width: int, follows: torch.Tensor, starts: torch.Tensor,
                    sees: torch.Tensor) -> torch.Tensor:
    """The step's 4D mask with blocks after the uncached tokens: `base` is the causal mask over [cache | chunk]
    (step_attention); trailing column t of row b sees the chunk up to column follows[b, t] (the prefix of what
    it extends: with drafts last, exactly its ancestors), the leaf column sees[b, t] if >= 0 (a group behind a
    leaf), and the columns of its own block from starts[b, t] up to itself. Every query still sees itself."""
    length = base.shape[2]
    past = base.shape[3] - length
    k = torch.arange(length, device=base.device)[None, None, :]
    q = torch.arange(width, length, device=base.device)[None, :, None]
    rows = (k <= follows[:, :, None]) | ((k >= starts[:, :, None]) & (k <= q)) | (k == sees[:, :, None])
    mask = base.clone()
    mask[:, 0, width:, past:] &= rows
    return mask


def choose_leaves(probs: torch.Tensor, drafts: list[int], tree_width: int, cap: int,
                  min_prob: float = LEAF_MIN_PROB) -> list[tuple[int, int]]:
    """Tree layout: (depth, token) alternatives to the drafts from the masks' distributions `probs` [n_masks, V]
    (mask j predicts depth j + 1): at every draft's depth and the one after the last draft, up to
    tree_width - 1 of the likeliest other tokens whose probability reaches `min_prob`, at depths <= cap."""
    leaves = []
    if tree_width < 2:
        return leaves
    for depth in range(1, min(len(drafts) + 1, cap, probs.shape[0]) + 1):
        top = probs[depth - 1].topk(tree_width)
        chosen = [t for p, t in zip(top.values.tolist(), top.indices.tolist())
                  if p >= min_prob and (depth > len(drafts) or t != drafts[depth - 1])]
        leaves += [(depth, t) for t in chosen[: tree_width - 1]]
    return leaves


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
