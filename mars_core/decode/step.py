"""One decode step after its forward: the candidates (`propose`), how many are accepted (`accept_lists`), and what
each row does with them (`settle_mars`, `settle_verify`), laid out by the step's `StepPlan`.

Lossless mode's bookkeeping (which drafts hold, which leaf, what is committed, where new drafts come from) is
written once, as functions of one row's host lists (`check_drafts`, `drafting_group`, `draft_room`,
`next_drafts`): the cached decoder and the uncached reference (mars_core.decode.decoding) both call them, while
their forwards stay separate so that the reference keeps checking the fast path.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from mars_core.decode.config import CRITERIA
from mars_core.decode.drafts import choose_leaves, clip_commit, confirm, keep_drafts, lookup_drafts, lookup_wins


# ----------------------------------------------------------------------------- pure pieces

def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)`: the first index of the largest value along the last dimension. On a CPU in fp32 it goes
    through numpy, whose argmax of a vocabulary-sized row is much faster than torch's on one thread (a lossless
    step takes two such argmaxes over 4-7 rows; docs/experiments/amx-and-kernels.md, "The decoder's own time");
    the rule and the result are the same."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad:
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def propose(logits: torch.Tensor, criterion: str = "prob", temperature: float = 0.0, top_p: float = 1.0,
            generator: torch.Generator | None = None, top: torch.Tensor | None = None,
            conf: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates and confidences from logits [b, k, V] -> ([b, k] ids, [b, k] fp32 in [0, 1]). `top`: the
    logits' argmax when the caller has it already (greedy only); `conf`: with it, the softmax probability of
    each (the backend's: LeanOutput.conf), taken as the confidence where that is what is asked for."""
    if conf is not None and top is not None and temperature == 0 and criterion == "prob":
        return top, conf
    logits = logits.float()  # fp32 softmax even for a bf16 model
    if temperature > 0:
        probs = torch.softmax(logits / temperature, dim=-1)
        tokens = _sample(probs, top_p, generator)
    else:
        probs = torch.softmax(logits, dim=-1)
        tokens = argmax(logits) if top is None else top  # argmax of the raw logits, exactly as greedy generate()
    if criterion == "prob":
        conf = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    elif criterion == "entropy":
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
        conf = torch.exp(-entropy)  # 1 for a certain prediction, falls as the distribution spreads
    elif criterion == "margin":
        top2 = probs.topk(2, dim=-1).values
        conf = top2[..., 0] - top2[..., 1]
    else:
        raise ValueError(f"criterion={criterion!r} is unknown: use one of {', '.join(CRITERIA)}")
    return tokens, conf


def _sample(probs: torch.Tensor, top_p: float, generator) -> torch.Tensor:
    b, k, vocab = probs.shape
    flat = probs.reshape(b * k, vocab)
    if top_p < 1.0:
        sorted_p, order = flat.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the top token
        sorted_p = sorted_p * keep
        choice = torch.multinomial(sorted_p, 1, generator=generator)
        tokens = order.gather(-1, choice)
    else:
        tokens = torch.multinomial(flat, 1, generator=generator)
    return tokens.reshape(b, k)


def masks_this_step(tau: float, n_masks: int, room: int) -> int:
    """Masks to append this step: none at τ >= 1, so one-token mode runs exactly AR's computation (in any
    dtype, at AR's cost); otherwise B - 1, or fewer when the context has no room for them."""
    return 0 if tau >= 1.0 else max(0, min(n_masks, room))


def never_propose_mask(logits: torch.Tensor, mask_id: int, first: int = 1) -> torch.Tensor:
    """Logits [b, k, V] with the mask id ruled out at the mask rows, columns `first`.. (changed in place).

    A mask position predicts a future token, never another mask; a reused special token (SmolLM2's
    <repo_name>) may still carry probability there. q_0 is the plain AR prediction and stays untouched, so
    one-token mode remains exactly greedy AR.
    """
    if logits.shape[1] > first:
        logits[:, first:, mask_id] = float("-inf")   # in place: the step's own fresh logits, no [b, k, V] copy
    return logits


def accept_counts(tokens: torch.Tensor, conf: torch.Tensor, tau: float, limit: torch.Tensor,
                  eos_ids: torch.Tensor) -> torch.Tensor:
    """How many leading candidates each row accepts: [b, k] -> [b] (accept_lists on tensors)."""
    n = accept_lists(tokens.tolist(), conf.tolist(), tau, limit.tolist(), set(eos_ids.tolist()), conf.dtype)
    return torch.tensor(n, dtype=torch.long, device=tokens.device)


@functools.lru_cache(maxsize=64)
def _rounded(tau: float, dtype: torch.dtype) -> float:
    """τ as a value of `dtype` (a tensor comparison with τ rounds it so); cached, since it runs every step."""
    return torch.tensor(tau, dtype=dtype).item()


def accept_lists(tokens: list[list[int]], conf: list[list[float]], tau: float, limits: list[int],
                 eos: set[int], conf_dtype: torch.dtype = torch.float32) -> list[int]:
    """How many leading candidates each row accepts, on the host lists of a step's one device sync.

    t_0 always; t_j while every earlier one was accepted and c_j >= τ; never more than the row's limit
    (B, max_accept, tokens left); nothing after an eos. τ >= 1 accepts exactly t_0 — even when a
    probability rounds to 1.0, which the official sampler would accept. `conf` holds values of `conf_dtype`,
    compared with τ rounded to that dtype, as a tensor comparison `conf >= tau` rounds it (0.95 is no fp32
    number). A few list steps per row cost less on a CPU than a dozen small tensor ops.
    """
    if tau >= 1.0:   # AR's step: t_0 alone, which every row has room for (a row with no room has ended)
        return [1] * len(tokens)
    tau_c = _rounded(tau, conf_dtype)
    counts = []
    for row, c, limit in zip(tokens, conf, limits):
        n = 1
        while n < len(row) and c[n] >= tau_c:
            n += 1
        n = min(n, limit)
        counts.append(next((j + 1 for j, t in enumerate(row[:n]) if t in eos), n))   # up to and with an eos
    return counts


def check_finite(logits: torch.Tensor, lm, step: int, found=None) -> torch.Tensor:
    """The logits' argmax [b, k], after checking that every row's largest logit is finite (argmax picks a NaN or
    +inf if there is one, and a row of -inf has no finite largest value). `found`: (largest values, argmax) the
    backend gathered already (head_top), the same numbers without reading the logits again."""
    if found is None:
        top = argmax(logits)
        best = logits.gather(-1, top[..., None])
    else:
        best, top = found
    if not torch.isfinite(best).all():
        raise FloatingPointError(
            f"{getattr(lm, 'name', 'the model')} produced NaN/inf logits at step {step}: its weights are damaged "
            "or the dtype overflows; reload the checkpoint, or decode in float32")
    return top


# ----------------------------------------------------------------------------- the step's plan

@dataclass(frozen=True)
class StepPlan:
    """How one step's chunk is laid out, per row right-aligned (mars_core.decode.batch._Batch.chunk):
    [holes | pending: committed tokens, then `n_verify` drafts | `n_leaves` leaf slots | groups of `n_masks`
    masks behind the pending columns `behind` (and behind each leaf)]. `width` is the pending part's width."""
    tau: float
    n_masks: int            # masks per group (0: an AR step)
    n_verify: int           # drafts to check (the most any row has)
    n_leaves: int           # tree layout: leaf slots
    behind: tuple[int, ...]  # the mask groups' offsets back from the last pending column
    width: int = 0          # pending columns, holes included (known once the chunk is built)

    @property
    def n_out(self) -> int:
        """Kept output rows before the masks: the last committed token, the drafts, the leaves."""
        return self.n_verify + 1 + self.n_leaves

    @property
    def n_mask_cols(self) -> int:
        """The chunk's trailing mask columns (groups behind pending columns and behind leaves)."""
        return (len(self.behind) + self.n_leaves) * self.n_masks

    def keep(self, columns: int, device) -> torch.Tensor:
        """The columns whose logits the step reads: q_0 (with the drafts and leaves), then every mask."""
        return torch.arange(self.width - 1 - self.n_verify, columns, device=device)


@dataclass
class Settled:
    """What a row does with one forward's outputs."""
    commit: list[int]                          # tokens final from this step on
    candidates: list[int]
    confidences: list[float]
    drafts: list[int] = field(default_factory=list)   # verify: fed next step, unverified
    confirmed: int = 0                         # verify: previous drafts equal to AR's token
    rejected: int | None = None                # verify: the first previous draft that was not
    kept: list[int] | None = None              # verify: chunk columns of this row to keep cached (None: all pending)
    source: str | None = None                  # verify: where the drafts came from
    leaves: list = field(default_factory=list)   # tree layout: (depth, token) alternatives fed next step
    leaf_confirmed: bool = False


def settle_mars(logits, top, rows, cfg, plan: StepPlan, eos: set[int], generator, found_conf=None) -> list[Settled]:
    """Lossy MARS (and AR): accept the leading candidates q_0.. whose confidence stays >= τ."""
    tokens, conf = propose(logits, cfg.criterion, cfg.temperature, cfg.top_p, generator, top, found_conf)
    tokens_h, conf_h = tokens.tolist(), conf.tolist()   # the step's one host sync
    cap = min(cfg.max_accept or cfg.candidates, plan.n_masks + 1)
    n_h = accept_lists(tokens_h, conf_h, plan.tau, [min(r.left, cap) for r in rows], eos, conf.dtype)
    return [Settled(tokens_h[i][: n_h[i]], tokens_h[i], conf_h[i]) for i in range(len(rows))]


# ----------------------------------------------------------------------------- lossless bookkeeping, one row

def check_drafts(drafts: list[int], want: list[int], leaves: list, leaf_ar: Sequence[int], left: int,
                 eos) -> tuple[int, int | None, list[int]]:
    """(drafts confirmed, the leaf slot confirmed or None, tokens committed). `want`: AR's greedy tokens at the
    last committed token and at each draft; `leaf_ar`: AR's token after each leaf slot. Drafts hold while equal
    to AR's; the first that differs is replaced by AR's token, unless a leaf at that depth holds AR's token: then
    the leaf is confirmed and AR's token after it is committed too."""
    ok = confirm(drafts, want)
    leaf = next((j for j, (depth, t) in enumerate(leaves) if depth == ok + 1 and t == want[ok]), None)
    commit = clip_commit(want[: ok + 1] + ([leaf_ar[leaf]] if leaf is not None else []), left, eos)
    return ok, (leaf if len(commit) == ok + 2 else None), commit   # clipped: the row ends on the leaf's token


def drafting_group(behind: Sequence[int], m: int, ok: int, leaf: int | None) -> int:
    """The mask group that drafts next: the one behind the last confirmed draft (`m` drafts, `ok` confirmed) or
    behind the confirmed leaf, if the layout put one there; -1 where none did (the linear layout has only the
    group after the last draft: after a rejection its masks saw a wrong token)."""
    if leaf is not None:
        return len(behind) + leaf
    return behind.index(m - ok) if m - ok in behind else -1


def draft_room(commit: list[int], ok: int, leaf: int | None, eos, n_masks: int, left: int, most: int) -> int:
    """How many new drafts the row may take: none after an eos or a clipped commit, else up to the masks of a
    group, the tokens left after the next one, and `most` (max_accept or B) - 1."""
    if not n_masks or commit[-1] in eos or len(commit) != ok + 1 + (leaf is not None):
        return 0
    return min(n_masks, left - len(commit) - 1, most - 1)


def next_drafts(cands: list[int], confs: list[float], tau: float, cap: int, eos, history: list[int],
                lookup: int, leaf_group=None) -> tuple[list[int], str | None, list]:
    """(new drafts, their source, new leaves), at most `cap` drafts: the drafting group's candidates kept while
    confident (`cands` empty where no group drafts), with `leaf_group(drafts)` → the leaves chosen after them
    (tree layouts); or prompt lookup over `history` (`lookup`: its longest match) when that offers more."""
    if cap < 1:
        return [], None, []
    new = keep_drafts(cands, confs, tau, cap, eos)
    leaves = leaf_group(new) if leaf_group is not None else []
    looked = lookup_drafts(history, lookup, cap, eos) if lookup else []
    if lookup_wins(looked, new):
        return looked, "prompt", []
    return new, ("masks" if new else None), leaves


def settle_verify(logits, top, rows, cfg, plan: StepPlan, eos: set[int], planner=None,
                  found_conf=None) -> list[Settled]:
    """Lossless MARS over the batch: AR's greedy tokens at the last committed token, the drafts and the leaves
    check the drafts (check_drafts); the group behind the last confirmed one drafts anew (next_drafts)."""
    n_out, n_masks, most = plan.n_out, plan.n_masks, cfg.max_accept or cfg.candidates
    ar = top[:, :n_out].tolist()
    props, conf, probs = [[]] * len(rows), [[]] * len(rows), False
    if n_masks:
        p, c = propose(logits[:, n_out:], cfg.criterion, top=top[:, n_out:],
                       conf=None if found_conf is None else found_conf[:, n_out:])   # [b, groups x n_masks]
        props, conf = p.tolist(), c.tolist()
        probs = cfg.draft_layout in ("tree", "auto")   # leaves: softmax of the one group a row drafts from
    settled = []
    for i, r in enumerate(rows):
        m = r.n_drafts
        drafts = r.pending[len(r.pending) - m:]
        ok, leaf, commit = check_drafts(drafts, ar[i][plan.n_verify - m: plan.n_verify + 1], r.leaves,
                                        ar[i][plan.n_verify + 1:], r.left, eos)
        kept = list(range(plan.width - len(r.pending), plan.width - m + ok))
        kept += [plan.width + leaf] if leaf is not None else []
        g = drafting_group(plan.behind, m, ok, leaf)
        cut = slice(max(g, 0) * n_masks, (max(g, 0) + 1) * n_masks)
        cands, confs = props[i][cut], conf[i][cut]
        cap = draft_room(commit, ok, leaf, eos, n_masks, r.left, most)
        leaf_group = None
        if probs and g >= 0:
            def leaf_group(new, row=i, cut=cut, cap=cap):
                group = torch.softmax(logits[row, n_out + cut.start: n_out + cut.stop].float(), dim=-1)
                leaves = choose_leaves(group, new, cfg.tree_width, cap)
                return planner.keep_leaves(group, new, leaves, n_masks) if planner is not None else leaves
        history = r.prompt + r.generated + commit if cfg.prompt_lookup else []
        new, source, leaves = next_drafts(cands if g >= 0 else [], confs, plan.tau, cap, eos, history,
                                          cfg.prompt_lookup, leaf_group)
        settled.append(Settled(commit, cands, confs, new, min(ok + (leaf is not None), len(commit)),
                               drafts[ok] if ok < m else None, kept, source, leaves, leaf is not None))
    return settled
