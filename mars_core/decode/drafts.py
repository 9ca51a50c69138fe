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
  auto       the tree's groups and leaves, each only where DraftPlanner finds it pays for its positions.
The masks always come after every real token, so the cache keeps only real tokens and drops the masks by
cropping its last columns, as in the linear layout.

Prompt lookup (`prompt_lookup=n`): when the last n..1 tokens of prompt + output occurred before, the tokens
that followed their latest occurrence are offered as drafts; they replace the mask drafts when the masks offer
none, or when they start with the masks' first draft and run longer (lookup_wins). Drafts only change how
many tokens a forward confirms, never which tokens.
"""
from __future__ import annotations

import torch

LAYOUTS = ("linear", "quadratic", "tree", "auto")
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


def lookup_wins(looked: list[int], masks: list[int]) -> bool:
    """Whether the looked-up drafts replace the mask drafts: when the masks offer none, or when the lookup
    starts with the masks' first draft and runs longer (chosen on development prompts over "the longer run":
    docs/experiments/lossless-verify.md, "Prompt lookup's rule")."""
    return len(looked) > len(masks) and (not masks or looked[0] == masks[0])


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


def clip_commit(tokens: list[int], left: int, eos_ids) -> list[int]:
    """Committed tokens end at the budget and right after the first eos."""
    tokens = tokens[:left]
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens


def confirm(drafts: list[int], ar_tokens: list[int]) -> int:
    """How many leading drafts equal AR's own greedy token at their position."""
    n = 0
    while n < len(drafts) and drafts[n] == ar_tokens[n]:
        n += 1
    return n


def keep_drafts(tokens: list[int], conf: list[float], tau: float, cap: int, eos_ids) -> list[int]:
    """Verify mode: the leading mask proposals with confidence >= τ become drafts (none at τ >= 1),
    at most `cap`, none after an eos."""
    drafts = []
    if tau >= 1.0:
        return drafts
    for t, c in zip(tokens[:max(0, cap)], conf):
        if c < tau:
            break
        drafts.append(t)
        if t in eos_ids:
            break
    return drafts


class DraftPlanner:
    """draft_layout="auto": spend positions on mask groups and leaves only where they pay on this machine.

    A group behind an earlier draft, or a leaf (with its group), adds tokens only in some outcomes: the group
    behind the k-th-from-last draft drafts the next step when exactly that draft is the first rejected (gain:
    the tokens a drafted step commits, minus the one a draft-less step commits), a leaf at depth j adds AR's
    next token when the drafts before it are confirmed and it is AR's token (taken as its probability). Both
    come from this generation's own counts: per-slot confirmation rates and the tokens of drafted steps.
    Their cost is what the extra positions add to a forward, from `costs` (the relative forward cost by
    positions fed, as `mars_core.tools.bench.row_costs` measures it; none given: positions are free, as on a GPU at
    batch 1). An addition is made when its tokens per cost beat the tokens per cost the generation reaches so
    far, the only case in which it raises tokens per second.

    The number of masks is chosen the same way (`masks`): the j-th mask is appended when the chance that it drafts
    (its confidence and those before it reach tau: counted per mask, `offer`) and that its draft is then confirmed
    pays for its position now and its draft's position then. With free positions that is every mask; on a CPU
    whose forward grows steeply with its positions it is few or none.

    Drafting itself is weighed too: where the masks' positions cost more than their confirmed drafts bring (a CPU
    on which a forward's cost grows with its positions), the steps that draft write fewer tokens per cost than AR's
    one per one-position forward. After every WINDOW drafting steps the planner compares the two, and when drafting
    lost it appends no masks for a pause (AR's own steps), then tries again; each loss in a row doubles the pause.
    With free positions drafting never loses. Answers stay AR's whatever it picks."""

    WINDOW, PAUSE, LONGEST = 6, 8, 64   # drafting steps per verdict; the first pause and the longest, in steps

    def __init__(self, costs, slots: int):
        # a measured curve dips here and there (noise); a dip must not look like free positions
        self.costs = [max(float(c) for c in costs[: i + 1]) for i in range(len(costs))] if costs else None
        self.drafted = [2.0] * (slots + 2)      # per slot j (1-based): drafts checked, confirmed; prior 1 of 2
        self.confirmed = [1.0] * (slots + 2)
        self.asked = [1.0] * (slots + 2)        # per mask j of a group drafted from: asked, kept as a draft (its
        self.offered = [1.0] * (slots + 2)      # confidence and the j - 1 before it reached tau); prior 1 of 1
        self.drafted_tokens, self.drafted_steps = 2.0, 1.0   # tokens a step with drafts commits; prior 2
        self.tokens, self.spent = 1.0, 1.0                   # per row; prior: AR's one token per AR forward
        self.prefilled = False
        self.window = [0.0, 0.0, 0]     # this verdict's drafting steps: tokens per row, cost, steps
        self.paused, self.pause = 0, self.PAUSE

    def drafting(self) -> bool:
        """Whether a step with nothing to check appends masks (False during a pause, which it counts down)."""
        if self.paused:
            self.paused -= 1
            return False
        return True

    def cost(self, positions: int) -> float:
        """Relative cost of a forward over `positions` (past the measured range: the last measured slope)."""
        if not self.costs:
            return 1.0
        if positions <= len(self.costs):
            return self.costs[max(positions, 1) - 1]
        slope = self.costs[-1] - self.costs[-2] if len(self.costs) > 1 else 0.0
        return self.costs[-1] + max(slope, 0.0) * (positions - len(self.costs))

    def rate(self, slot: int) -> float:
        return self.confirmed[slot] / self.drafted[slot]

    def offer(self, slot: int) -> float:
        """Chance that the group's masks 1..slot all become drafts (a mask below tau ends the drafts)."""
        return self.offered[slot] / self.asked[slot]

    def reach(self, depth: int) -> float:
        """Chance that the drafts before `depth` are all confirmed."""
        p = 1.0
        for j in range(1, depth):
            p *= self.rate(j)
        return p

    def _worth(self, gain: float, positions: int, extra: int) -> bool:
        return self._pays(gain, self.cost(positions + extra) - self.cost(positions))

    def _pays(self, gain: float, added: float) -> bool:
        """Whether `gain` tokens for `added` cost beat the tokens per cost the generation reaches so far."""
        return gain > 0 and (added <= 0 or gain / added >= self.tokens / self.spent)

    def masks(self, rows, most: int) -> int:
        """How many masks (up to `most`) a step appends behind its last pending column. The j-th mask drafts next
        step's j-th token, which adds a token when this step's drafts and the j - 1 before it are all confirmed;
        it costs its position now and its draft's position next step. Masks are added while that pays (with free
        positions: all of them), so on a CPU whose forward grows with its positions a step drafts only as deep as
        its confirmation rates carry."""
        positions = max(len(r.pending) + len(r.leaves) for r in rows)
        # the chance that the group behind the last draft counts
        used = sum(self.reach(r.n_drafts + 1) for r in rows) / len(rows)
        m = 0
        while m < most:
            offer = self.offer(m + 1)   # its draft exists only if its confidence and all before it reach tau
            added = (self.cost(positions + m + 1) - self.cost(positions + m)
                     + offer * (self.cost(m + 2) - self.cost(m + 1)))
            if not self._pays(used * offer * self.reach(m + 2), added):
                break
            m += 1
        return m

    def behind(self, rows, n_masks: int) -> list[int]:
        """The step's group offsets (from the last pending column, descending); offset 0 always."""
        positions = max(len(r.pending) + len(r.leaves) for r in rows) + n_masks
        value = (self.drafted_tokens / self.drafted_steps - 1.0) * self.offer(1)   # if the group drafts at all
        gains = []
        for k in range(1, max(r.n_drafts for r in rows) + 1):
            stop = [self.reach(r.n_drafts - k + 1) * (1 - self.rate(r.n_drafts - k + 1)) if r.n_drafts >= k else 0.0
                    for r in rows]
            gains.append((sum(stop) / len(rows) * value, k))
        chosen = [0]
        for gain, k in sorted(gains, reverse=True):
            if self._worth(gain, positions, n_masks):
                chosen.append(k)
                positions += n_masks
        return sorted(chosen, reverse=True)

    def keep_leaves(self, probs, drafts: list[int], leaves: list, n_masks: int) -> list:
        """The leaves (depth, token) worth their position and group next step, in their order."""
        positions = 1 + len(drafts) + n_masks
        ranked = sorted(((self.reach(d) * float(probs[d - 1, t]), i) for i, (d, t) in enumerate(leaves)), reverse=True)
        kept = []
        for gain, i in ranked:
            if self._worth(gain, positions, 1 + n_masks):
                kept.append(i)
                positions += 1 + n_masks
        return [leaves[i] for i in sorted(kept)]

    def observe(self, rows, settled, positions: int, drafting: bool = True) -> None:
        """Count one step: each row's drafts checked and confirmed, its tokens, and the forward's cost
        (`drafting`: whether it appended masks or checked drafts). The prompt's forward costs the same whatever
        the layout, so it is not counted."""
        if not self.prefilled:
            self.prefilled = True
            return
        for r, s in zip(rows, settled):
            if s.candidates and s.source != "prompt":   # a group was drafted from (lookup: its masks not asked)
                for j in range(1, len(s.candidates) + 1):
                    self.asked[j] += 1
                    self.offered[j] += j <= len(s.drafts)
            if r.n_drafts:
                ok = s.confirmed - s.leaf_confirmed
                for j in range(1, min(r.n_drafts, ok + 1) + 1):    # slot j was checked if every earlier one held
                    self.drafted[j] += 1
                    self.confirmed[j] += j <= ok
                self.drafted_tokens += len(s.commit)
                self.drafted_steps += 1
        tokens = sum(len(s.commit) for s in settled) / len(settled)
        self.tokens += tokens
        self.spent += self.cost(positions)
        if drafting:
            self._verdict(tokens, self.cost(positions))

    def _verdict(self, tokens: float, cost: float) -> None:
        """Count a drafting step; after WINDOW of them, pause drafting if they wrote fewer tokens per cost than AR."""
        w = self.window
        w[0], w[1], w[2] = w[0] + tokens, w[1] + cost, w[2] + 1
        if w[2] < self.WINDOW:
            return
        if w[0] < w[1] * self.cost(1):      # AR: one token per one-position forward
            self.paused, self.pause = self.pause, min(2 * self.pause, self.LONGEST)
        else:
            self.pause = self.PAUSE
        self.window = [0.0, 0.0, 0]


def groups_behind(cfg, n_verify: int, n_masks: int, planner=None, rows=None) -> list[int]:
    """Which pending columns get a mask group this step, as offsets from the last one (descending): the last
    only (linear), every draft's and the committed token's (quadratic, tree), or the planner's choice (auto)."""
    if not n_masks or cfg.draft_layout == "linear" or n_verify == 0:
        return [0]
    if planner is not None:
        return planner.behind(rows, n_masks)
    return list(range(n_verify, -1, -1))
