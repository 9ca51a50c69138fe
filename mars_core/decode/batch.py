"""The rows a decode still runs and their shared KV cache: each step's input laid out (`_Batch.chunk`), its
attention mask (`step_attention`, and mars_core.decode.drafts.block_attention for the quadratic and tree layouts),
the cache cropped after the forward (`_Batch.rollback`) and finished rows dropped (`_Batch.select`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mars_core.decode.drafts import block_attention


def step_attention(kv_valid: torch.Tensor, chunk_valid: torch.Tensor) -> torch.Tensor:
    """4D boolean mask [b, 1, L, P+L]: causal over [cache | chunk], holes hidden from every query.

    A hole still attends to itself so that no query row is fully masked (which would give NaN
    and poison the cache); nothing real ever attends to a hole.
    """
    past, length = kv_valid.shape[1], chunk_valid.shape[1]
    keys_valid = torch.cat([kv_valid, chunk_valid], dim=1)     # [b, P+L]
    q = torch.arange(length, device=kv_valid.device)[:, None] + past
    k = torch.arange(past + length, device=kv_valid.device)[None, :]
    mask = (k <= q)[None] & keys_valid[:, None, :]              # [b, L, P+L]
    mask = mask | (k == q)[None]
    return mask[:, None]


@dataclass
class _Row:
    """One sequence still decoding."""
    index: int                  # its position in the caller's batch
    budget: int                 # new tokens it may write
    pending: list[int]          # tokens not in the cache yet: committed ones, then `n_drafts` unverified drafts
    prompt: list[int] = field(default_factory=list)
    n_drafts: int = 0
    leaves: list = field(default_factory=list)   # tree layout: (depth, token) alternatives to the drafts
    cached: int = 0             # real tokens in the cache, so also the next free position
    generated: list[int] = field(default_factory=list)

    @property
    def left(self) -> int:
        return self.budget - len(self.generated)


class _Batch:
    """The rows still decoding and their shared KV cache; `kv_valid` marks which cached columns are real."""

    def __init__(self, rows: list[_Row], cache, device):
        self.rows, self.cache, self.device = rows, cache, device
        self.kv_valid = torch.zeros(len(rows), 0, dtype=torch.bool, device=device)
        self.kv_holes = False       # whether any cached column is a hole (then every step needs the 4D mask)

    def attention(self, chunk_valid: torch.Tensor, width: int, blocks=None, own_causal: bool = False):
        """The step's attention mask, or None where it is plain causal (no holes anywhere, the plain layout) and
        the model builds that itself at no more cost: for a one-position step (it sees every cached position,
        so no mask is the same mask, and building none made AR steps at batch 1 measurably faster on tiny-mars:
        docs/experiments/tiny-models.md, "Wall clock: `mars_core bench`"), and for longer chunks
        where `own_causal` says the backend's own causal mask is cheap (the lean forward's; transformers' own
        for a chunk after a cache cost more than building this one). `blocks` (chunk's): the columns after the
        uncached tokens see only their own prefix (mars_core.decode.drafts.block_attention)."""
        plain = blocks is None and not self.kv_holes and all(len(r.pending) == width for r in self.rows)
        if plain and (chunk_valid.shape[1] == 1 or own_causal):
            return None
        mask = step_attention(self.kv_valid, chunk_valid)
        return block_attention(mask, width, *blocks) if blocks is not None else mask

    def chunk(self, n_masks: int, fill: int, behind=(0,), n_leaves: int = 0, leaf_groups: bool = False):
        """The step's input, right-aligned: [holes | pending | leaves | groups x masks] per row -> ids, positions,
        valid, width, blocks. Right alignment puts every row's last pending token and its masks in the same
        columns. Leaf slot j holds the row's j-th (depth, token) alternative, which follows the draft before its
        depth; group g follows pending column width - 1 - behind[g] (behind: offsets from the last pending
        column, descending; (0,) is the plain layout's one group); with `leaf_groups` one more group follows
        each leaf slot. All continue the positions of what they follow; a slot the row does not use, or a group
        behind a token already committed, is a hole. `blocks` is None for the plain layout (one group after the
        last token: the causal mask), else per trailing column the pending column up to which it sees, the
        first column of its block, and the leaf column it also sees (-1: none), [b, trailing] each."""
        width = max(len(r.pending) for r in self.rows)
        ids, pos, valid, follows, starts, sees = [], [], [], [], [], []
        for r in self.rows:
            holes = width - len(r.pending)
            t = [fill] * holes + r.pending
            p = [0] * holes + list(range(r.cached, r.cached + len(r.pending)))   # holes take no position
            v = [False] * holes + [True] * len(r.pending)
            first = width - 1 - r.n_drafts        # the row's last committed token
            f, st = [], []
            for slot in range(n_leaves):
                depth, token = r.leaves[slot] if slot < len(r.leaves) else (0, None)
                parent = first + depth - 1
                live = token is not None
                t.append(token if live else fill)
                p.append(p[parent] + 1 if live else 0)
                v.append(live)
                f.append(parent if live else first)
                st.append(width + slot)
            se = [-1] * len(f)
            # the groups: behind the chosen pending columns, then behind each leaf slot
            after = [(width - 1 - k, -1, width - 1 - k >= first) for k in behind]
            after += [(f[slot], width + slot, v[width + slot]) for slot in range(n_leaves)] if leaf_groups else []
            for c, leaf, live in after:
                start, at = len(t), c if leaf < 0 else leaf
                t += [fill] * n_masks
                p += list(range(p[at] + 1, p[at] + 1 + n_masks)) if live else [0] * n_masks
                v += [live] * n_masks
                f += [c] * n_masks
                st += [start] * n_masks
                se += [leaf] * n_masks
            ids.append(t)
            pos.append(p)
            valid.append(v)
            follows.append(f)
            starts.append(st)
            sees.append(se)
        as_tensor = lambda x, **kw: torch.tensor(x, device=self.device, **kw)
        plain = tuple(behind) == (0,) and not n_leaves
        blocks = None if plain else (as_tensor(follows), as_tensor(starts), as_tensor(sees))
        return as_tensor(ids), as_tensor(pos), as_tensor(valid, dtype=torch.bool), width, blocks

    def rollback(self, n_masks: int, kept: list, columns: int) -> None:
        """The one place the cache shrinks: the masks always leave; so do rejected drafts and leaves (verify
        mode). kept[i] lists the chunk columns (of its first `columns`, the non-mask ones) row i keeps; columns no
        row keeps at the end are cropped with the masks, a row's other dropped columns become holes. Host-side
        lists only: no device sync on the decoding path."""
        last = max((max(k) + 1 for k in kept if k), default=0)
        if n_masks + columns - last:
            self.cache.crop(-(n_masks + columns - last))
        rows = [[False] * last for _ in kept]
        for row, k in zip(rows, kept):
            for c in k:
                row[c] = True
        self.kv_valid = torch.cat([self.kv_valid, torch.tensor(rows, dtype=torch.bool, device=self.device)], dim=1)
        self.kv_holes = self.kv_holes or any(len(k) != last for k in kept)

    def select(self, keep: list[int]) -> None:
        """Keep only these batch rows (finished rows leave the batch and the cache)."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if keep:
            index = torch.tensor(keep, device=self.device)
            self.cache.batch_select_indices(index)
            self.kv_valid = self.kv_valid[index]
