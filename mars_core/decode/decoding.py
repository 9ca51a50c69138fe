"""MARS and AR decoding: one generator yields one event per forward pass (docs/algorithm.md, "Decoding").

Pieces, each a pure function of tensors:
  propose(logits)          -> candidates, confidences      (fp32 softmax on the B rows used)
  accept_counts(...)       -> how many candidates each row keeps
  _Batch.chunk(...)        -> the step's input: [holes | uncached tokens | leaves | mask groups], right-aligned
                              (verify mode's draft layouts: mars_core/decode/drafts.py)
  step_attention(...)      -> the 4D mask that hides holes
`generate_stream` strings them together around one KV cache; `generate` collects its events. What a decode is
asked for is mars_core.decode.config's (`DecodeConfig`, `TauControl`), what it yields mars_core.decode.events' (`StepEvent`,
`RowStep`, `SequenceResult`), the rows and their cache mars_core.decode.batch's (`_Batch`, `step_attention`).
`reference_generate` is the plain uncached sampler (one full forward per step, one row at a time)
that the tests hold the cached decoder against.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from transformers import DynamicCache

from mars_core.decode.batch import _Batch, _Row
from mars_core.decode.config import CRITERIA, DecodeConfig, TauControl, _is_int
from mars_core.decode.drafts import (DraftPlanner, choose_leaves, clip_commit, confirm, groups_behind, keep_drafts,
                              lookup_drafts, lookup_wins)
from mars_core.decode.events import RowStep, SequenceResult, StepEvent


# ----------------------------------------------------------------------------- pure pieces

def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)`: the first index of the largest value along the last dimension. On a CPU in fp32 it goes
    through numpy, whose argmax of a 49k-token vocabulary row ran ~15x faster than torch's on one thread (a
    lossless step takes two such argmaxes over 4-7 rows); the rule and the result are the same."""
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


# ----------------------------------------------------------------------------- the decoder

def _check_has_text(lm, ids: list[int]) -> None:
    """A prompt of mask and special ids only gives the model nothing to answer (and masks in a prompt read as
    holes to fill): refuse it by name."""
    special = set(getattr(lm.tokenizer, "all_special_ids", None) or []) | {lm.mask_id}
    if all(t in special for t in ids):
        raise ValueError(f"the prompt {ids[:8]!r}{'...' if len(ids) > 8 else ''} holds only mask-token "
                         f"(id {lm.mask_id}) or special ids, no text: pass a prompt with text")


def _prompt_ids(lm, prompts) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts={prompts!r} must be a non-empty list of strings or of token-id lists")
    vocab = _vocab_size(lm)
    out = []
    for p in prompts:
        if isinstance(p, str):
            ids = lm.encode(p)
        elif isinstance(p, Sequence) and not isinstance(p, (bytes, bytearray)):
            ids = list(p)
            bad = [t for t in ids if not _is_int(t) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token id {bad[0]!r} is not an integer in [0, {vocab}): pass token ids from this "
                                 "model's tokenizer, or the prompt as a string")
            ids = [int(t) for t in ids]
        else:
            raise ValueError(f"prompt {p!r} must be a string or a list of token ids (decode bytes to str first)")
        if not ids:
            raise ValueError("a prompt has no tokens: pass a non-empty prompt")
        _check_has_text(lm, ids)
        if len(ids) + 2 > lm.context_length:
            raise ValueError(f"a prompt of {len(ids)} tokens does not fit the context of {lm.context_length}: shorten it")
        out.append(ids)
    return out


def net(lm):
    """What the decoder runs: `lm.net` (a LoadedModel's backend: the lean forward or the transformers model), or
    `lm.model` for a model view that has no backend of its own."""
    return getattr(lm, "net", None) or lm.model


def draft_tail(lm, cfg, n: int) -> dict:
    """The forward's `draft_tail` argument for a lossless step whose last `n` positions are masks: their outputs
    only propose drafts that the next step checks, so a backend may compute them more cheaply (LeanLM.forward);
    {} for backends without it and for the other modes, where mask outputs are committed."""
    return {"draft_tail": n} if cfg.mode == "verify" and n and getattr(net(lm), "takes_draft_tail", False) else {}


def head_top(lm, cfg, first: int, conf_from: int) -> dict:
    """The forward's `head_top` argument where the backend takes it (LeanLM.takes_head_top): each kept position's
    argmax, the mask id left out from position `first` on (as never_propose_mask does), gathered by the LM head
    as it writes the logits, and from position `conf_from` on the argmax's softmax probability, where that is the
    step's confidence (greedy, criterion "prob"); {} elsewhere."""
    if not getattr(net(lm), "takes_head_top", False):
        return {}
    greedy_prob = cfg.temperature == 0 and cfg.criterion == "prob"
    return {"head_top": (lm.mask_id, first, conf_from if greedy_prob else -1)}


def new_cache(lm):
    """An empty KV cache for what the decoder runs: the lean forward's own, else transformers' DynamicCache."""
    make = getattr(net(lm), "new_cache", None)
    return make() if make is not None else DynamicCache(config=lm.model.config)


def _vocab_size(lm) -> int:
    return lm.model.get_input_embeddings().weight.shape[0]


@dataclass
class _Settled:
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


def _check_finite(logits: torch.Tensor, lm, step: int, found=None) -> torch.Tensor:
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


def _settle_mars(logits, top, rows, cfg, tau, n_masks, eos: set[int], generator, found_conf=None) -> list[_Settled]:
    """Lossy MARS (and AR): accept the leading candidates q_0.. whose confidence stays >= τ."""
    tokens, conf = propose(logits, cfg.criterion, cfg.temperature, cfg.top_p, generator, top, found_conf)
    tokens_h, conf_h = tokens.tolist(), conf.tolist()   # the step's one host sync
    cap = min(cfg.max_accept or cfg.candidates, n_masks + 1)
    n_h = accept_lists(tokens_h, conf_h, tau, [min(r.left, cap) for r in rows], eos, conf.dtype)
    return [_Settled(tokens_h[i][: n_h[i]], tokens_h[i], conf_h[i]) for i in range(len(rows))]


def _settle_verify(logits, top, rows, cfg, tau, n_masks, n_verify, n_leaves, behind, width, eos: set[int],
                   planner=None, found_conf=None) -> list[_Settled]:
    """Lossless MARS: the outputs at the last committed token and at each draft are AR's greedy tokens;
    drafts are kept while equal to them, the first one that differs is replaced by AR's token, unless a leaf
    of the tree layout at that depth holds AR's token: then the leaf is confirmed and AR's token after it is
    committed too. New drafts come from the mask group behind the last confirmed draft, if the layout put one
    there (the linear layout has only the group after the last draft: after a rejection its masks saw a wrong
    token), or from prompt lookup when that offers more."""
    n_out = n_verify + 1 + n_leaves
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
        drafts, want = r.pending[len(r.pending) - m:], ar[i][n_verify - m: n_verify + 1]
        ok = confirm(drafts, want)
        leaf = next((j for j, (depth, t) in enumerate(r.leaves) if depth == ok + 1 and t == want[ok]), None)
        extra = [ar[i][n_verify + 1 + leaf]] if leaf is not None else []
        commit = clip_commit(want[: ok + 1] + extra, r.left, eos)
        leaf = leaf if len(commit) == ok + 2 else None    # clipped: the row ends on the leaf's token anyway
        kept = list(range(width - len(r.pending), width - m + ok)) + ([width + leaf] if leaf is not None else [])
        # the group behind the last confirmed draft or leaf, if the layout put one there
        g = (behind.index(m - ok) if m - ok in behind else -1) if leaf is None else len(behind) + leaf
        cut = slice(max(g, 0) * n_masks, (max(g, 0) + 1) * n_masks)
        cands, confs = props[i][cut], conf[i][cut]
        new, source, leaves = [], None, []
        if commit[-1] not in eos and len(commit) == ok + 1 + (leaf is not None):
            cap = min(n_masks, r.left - len(commit) - 1, (cfg.max_accept or cfg.candidates) - 1)
            if g >= 0:
                new = keep_drafts(cands, confs, tau, cap, eos)
                source = "masks" if new else None
                if probs:
                    group = torch.softmax(logits[i, n_out + cut.start: n_out + cut.stop].float(), dim=-1)
                    leaves = choose_leaves(group, new, cfg.tree_width, cap)
                    if planner is not None:
                        leaves = planner.keep_leaves(group, new, leaves, n_masks)
            if cfg.prompt_lookup:
                looked = lookup_drafts(r.prompt + r.generated + commit, cfg.prompt_lookup, cap, eos)
                if lookup_wins(looked, new):
                    new, source, leaves = looked, "prompt", []
        settled.append(_Settled(commit, cands, confs, new, min(ok + (leaf is not None), len(commit)),
                                drafts[ok] if ok < m else None, kept, source, leaves, leaf is not None))
    return settled


@torch.inference_mode()
def generate_stream(lm, prompts, cfg: DecodeConfig | None = None,
                    tau_control: TauControl | None = None) -> Iterator[StepEvent]:
    """Decode a batch; yield one StepEvent per forward pass.

    Every step feeds [holes | uncached tokens | B-1 masks] per row and runs the LM head on the last
    columns only. The spec appends B masks; the output at the last one is never used and, under causal
    attention, nothing before it depends on it, so we append B-1: identical candidates, one position less.
    A step at τ >= 1 appends none, so one-token mode is AR's own computation; near the context's end a step
    appends only the masks that fit. In verify mode the uncached tokens end with the drafts to check.
    """
    cfg = cfg or DecodeConfig()
    cfg.validate()
    if cfg.block_size >= lm.context_length:   # refused as the CLI refuses --block-size: never capped in silence
        raise ValueError(f"block_size={cfg.block_size} does not fit {getattr(lm, 'name', 'the model')}'s context of "
                         f"{lm.context_length} tokens: use a small block size such as 4")
    prompt_ids = _prompt_ids(lm, prompts)
    device, n_masks_max = lm.device, cfg.candidates - 1
    eos_set = set(lm.eos_ids)
    own_causal = getattr(net(lm), "builds_causal_mask", False)
    generator = None
    if cfg.temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(cfg.seed if cfg.seed is not None else torch.seed())
    # Positions must stay inside the context: a row stops ("length") at its last position, as AR does.
    budget = [min(cfg.max_new_tokens, lm.context_length - len(p) - 1) for p in prompt_ids]
    if min(budget) < 1:
        raise ValueError(f"a prompt leaves no room in the context of {lm.context_length} tokens: shorten it")
    batch = _Batch([_Row(i, budget[i], list(p), list(p)) for i, p in enumerate(prompt_ids)], new_cache(lm), device)
    planner = None
    if cfg.mode == "verify" and cfg.draft_layout == "auto":
        planner = DraftPlanner(cfg.row_costs or getattr(lm, "row_costs", None), cfg.block_size - 1)
    start, step = time.perf_counter(), 0
    while batch.rows:
        t0 = time.perf_counter()
        tau = 1.0 if cfg.mode == "ar" else (tau_control.value if tau_control is not None else cfg.tau)
        n_verify = max(r.n_drafts for r in batch.rows)
        n_masks = masks_this_step(tau, n_masks_max, lm.context_length - max(r.cached + len(r.pending) for r in batch.rows))
        n_leaves = max(len(r.leaves) for r in batch.rows)
        if planner is not None and n_masks:
            # as deep as drafting pays on this machine; none during a pause (check what is drafted, draft no more)
            n_masks = planner.masks(batch.rows, n_masks) if planner.drafting() else 0
        behind = groups_behind(cfg, n_verify, n_masks, planner, batch.rows)
        ids, pos, valid, width, blocks = batch.chunk(n_masks, lm.mask_id, behind, n_leaves, bool(n_masks))
        keep = torch.arange(width - 1 - n_verify, ids.shape[1], device=device)   # q_0 (and drafts, leaves), masks
        n_mask_cols = (len(behind) + n_leaves) * n_masks                          # the chunk's last columns
        n_out = n_verify + 1 + n_leaves                                           # kept rows before the masks
        mask = batch.attention(valid, width, blocks, own_causal)
        out = net(lm)(input_ids=ids, attention_mask=mask, position_ids=pos, cache=batch.cache, use_cache=True,
                      logits_to_keep=keep, **draft_tail(lm, cfg, n_mask_cols),
                      **head_top(lm, cfg, n_out, n_out if cfg.mode == "verify" else 0))
        logits = never_propose_mask(out.logits, lm.mask_id, first=n_out)
        top = _check_finite(logits, lm, step, getattr(out, "top", None))
        conf = getattr(out, "conf", None)   # the head's confidences where it gathered them (head_top)
        if cfg.mode == "verify":
            settled = _settle_verify(logits, top, batch.rows, cfg, tau, n_masks, n_verify, n_leaves, behind, width,
                                     eos_set, planner, conf)
        else:
            settled = _settle_mars(logits, top, batch.rows, cfg, tau, n_masks, eos_set, generator, conf)
        kept = [range(width - len(r.pending), width) if st.kept is None else st.kept
                for r, st in zip(batch.rows, settled)]
        batch.rollback(n_mask_cols, kept, width + n_leaves)
        if planner is not None:
            planner.observe(batch.rows, settled, ids.shape[1], drafting=bool(n_masks or n_verify or n_leaves))
        step_time = time.perf_counter() - t0

        events, still = _advance(lm, cfg, batch.rows, settled, len(prompt_ids))
        yield StepEvent(step, tau, step_time, time.perf_counter() - start, events, ids.shape[1])
        step += 1
        batch.select(still)


def _advance(lm, cfg, rows, settled, n_prompts: int) -> tuple[list[RowStep], list[int]]:
    """Apply one step's settlement to each row: (a RowStep per prompt, the batch indices of rows still going)."""
    events = [RowStep([], [], [], 0, True, False, lm.tokenizer) for _ in range(n_prompts)]
    still = []
    for i, (r, s) in enumerate(zip(rows, settled)):
        r.cached += len(r.pending) if s.kept is None else len(s.kept)
        r.generated.extend(s.commit)
        reason = "eos" if s.commit[-1] in lm.eos_ids else "length" if r.left <= 0 else None
        if cfg.stop_strings and reason is None and _trim_at_stop(lm, r.generated, s.commit, cfg.stop_strings):
            reason = "stop"
        # Next input: what is not cached yet. Verify mode caches confirmed drafts; AR's token comes next.
        r.pending = (s.commit[-1:] if cfg.mode == "verify" else s.commit) + s.drafts
        r.n_drafts, r.leaves = len(s.drafts), s.leaves
        events[r.index] = RowStep(s.commit, s.candidates, s.confidences, len(s.commit), reason is not None, True,
                                  lm.tokenizer, reason, s.drafts, s.confirmed, s.rejected, s.source,
                                  [t for _, t in s.leaves], s.leaf_confirmed)
        if reason is None:
            still.append(i)
    return events, still


def _trim_at_stop(lm, generated: list[int], accepted: list[int], stops: tuple[str, ...]) -> bool:
    """If the text now contains a stop string, drop accepted tokens after the one completing it."""
    if not any(s in lm.decode(generated) for s in stops):
        return False
    base = len(generated) - len(accepted)
    for cut in range(1, len(accepted) + 1):
        if any(s in lm.decode(generated[: base + cut]) for s in stops):
            del generated[base + cut:]
            del accepted[cut:]
            break
    return True


def generate(lm, prompts, cfg: DecodeConfig | None = None, tau_control: TauControl | None = None) -> list[SequenceResult]:
    """Run `generate_stream` to the end and collect one SequenceResult per prompt."""
    prompt_ids = _prompt_ids(lm, prompts)
    results = collect(lm, prompt_ids, generate_stream(lm, prompt_ids, cfg, tau_control))
    return results


def collect(lm, prompt_ids: list[list[int]], events) -> list[SequenceResult]:
    """Fold a stream of StepEvents into per-sequence results (metrics as docs/algorithm.md defines them)."""
    rows = [dict(steps=[], times=[], wall=0.0, reason="length", drafted=[], confirmed=[], positions=[], sources=[])
            for _ in prompt_ids]
    for event in events:
        for r, row in enumerate(event.rows):
            if row.active:
                acc = rows[r]
                acc["steps"].append(row.accepted_ids)
                acc["times"].append(event.step_time)
                acc["drafted"].append(len(row.drafts))
                acc["confirmed"].append(row.confirmed)
                acc["positions"].append(event.positions)
                acc["sources"].append(row.draft_source)
                acc["wall"] = event.elapsed
                acc["reason"] = row.finish_reason or acc["reason"]
    results = []
    for p, acc in zip(prompt_ids, rows):
        ids = [t for s in acc["steps"] for t in s]
        results.append(SequenceResult(p, ids, lm.decode(ids), acc["steps"], acc["times"], acc["wall"], acc["reason"],
                                      acc["drafted"], acc["confirmed"], acc["positions"], acc["sources"]))
    return results


def draft_acceptance(results: list[SequenceResult], block_size: int) -> list[float | None]:
    """Verify mode: per mask slot j = 1 .. B-1, the share of drafts in slot j that the next forward confirmed
    (None where no draft was ever checked there). Drafts left when a sequence ends were never checked."""
    drafted, kept = [0] * (block_size - 1), [0] * (block_size - 1)
    for r in results:
        for d, c in zip(r.drafted[:-1], r.confirmed[1:]):
            for j in range(d):
                drafted[j] += 1
                kept[j] += j < c
    return [k / d if d else None for k, d in zip(kept, drafted)]


# ----------------------------------------------------------------------------- uncached reference

@torch.inference_mode()
def reference_generate(lm, prompts, cfg: DecodeConfig | None = None) -> list[SequenceResult]:
    """The plain sampler: every step is one full forward of [all committed tokens | B masks], no cache,
    one row at a time, the LM head on every position. Slow on purpose; the tests' yardstick. Not for
    draft_layout="auto", whose choices follow the cached run's own statistics."""
    cfg = cfg or DecodeConfig()
    cfg.validate()
    if cfg.mode == "verify" and cfg.draft_layout == "auto":
        raise ValueError("draft_layout='auto' adapts to the decoding run's own statistics, which the uncached "
                         "reference does not keep: compare it with 'tree' or 'quadratic'")
    results = []
    for prompt in _prompt_ids(lm, prompts):
        budget = min(cfg.max_new_tokens, lm.context_length - len(prompt) - 1)
        generator = None
        if cfg.temperature > 0:
            generator = torch.Generator(device=lm.device)
            generator.manual_seed(cfg.seed if cfg.seed is not None else 0)
        step = _reference_verify_step if cfg.mode == "verify" else _reference_mars_step
        seq, new, steps, times, drafts = list(prompt), [], [], [], []
        start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            accepted, drafts = step(lm, cfg, seq, drafts, budget - len(new), generator)
            seq += accepted
            new += accepted
            steps.append(accepted)
            times.append(time.perf_counter() - t0)
            if accepted[-1] in lm.eos_ids or len(new) >= budget:
                break
        reason = "eos" if new[-1] in lm.eos_ids else "length"
        results.append(SequenceResult(list(prompt), new, lm.decode(new), steps, times,
                                      time.perf_counter() - start, reason))
    return results


def _reference_mars_step(lm, cfg, seq, drafts, left, generator):
    k, tau = cfg.candidates, (cfg.tau if cfg.mode == "mars" else 1.0)
    used = masks_this_step(tau, k - 1, lm.context_length - len(seq)) + 1     # candidates q_0 .. q_{used-1}
    # the spec's B masks when they fit (the last one's output is never read), else as many as fit
    masks = [lm.mask_id] * (min(used, lm.context_length - len(seq)) if used > 1 else 0)
    logits = net(lm)(input_ids=torch.tensor([seq + masks], device=lm.device)).logits   # [1, T, V]
    rows = never_propose_mask(logits[:, len(seq) - 1: len(seq) - 1 + used], lm.mask_id)
    tokens, conf = propose(rows, cfg.criterion, cfg.temperature, cfg.top_p, generator)
    limit = torch.tensor([min(left, cfg.max_accept or k, used)], device=lm.device)
    n = int(accept_counts(tokens, conf, tau, limit, torch.tensor(lm.eos_ids, device=lm.device))[0])
    return tokens[0, :n].tolist(), []


def _reference_verify_step(lm, cfg, seq, state, left, generator):
    """Feed [committed | drafts | masks]; AR's greedy tokens check the drafts; new drafts from the masks behind
    the last confirmed token (linear: only after a full match), or from prompt lookup when that offers more.
    `state` is (drafts, leaves) from the previous step ([] at the first). The quadratic and tree layouts' input
    comes from the same chunk builder as the cached decoder's, with no cache."""
    drafts, leaves = state if state else ([], [])
    n_masks = masks_this_step(cfg.tau, cfg.block_size - 1, lm.context_length - len(seq) - len(drafts))
    m = len(drafts)
    behind = groups_behind(cfg, m, n_masks)
    if len(behind) > 1 or leaves:
        batch = _Batch([_Row(0, left, seq + drafts, n_drafts=m, leaves=leaves)], None, lm.device)
        ids, pos, valid, width, blocks = batch.chunk(n_masks, lm.mask_id, behind, len(leaves), bool(n_masks))
        mask = batch.attention(valid, width, blocks)
        logits = net(lm)(input_ids=ids, attention_mask=mask, position_ids=pos,
                         **draft_tail(lm, cfg, (len(behind) + len(leaves)) * n_masks)).logits[0]
    else:
        logits = net(lm)(input_ids=torch.tensor([seq + drafts + [lm.mask_id] * n_masks], device=lm.device),
                         **draft_tail(lm, cfg, n_masks)).logits[0]
    ar = argmax(logits[len(seq) - 1: len(seq) + m]).tolist()
    ok = confirm(drafts, ar)
    leaf = next((j for j, (depth, t) in enumerate(leaves) if depth == ok + 1 and t == ar[ok]), None)
    extra = [int(logits[len(seq) + m + leaf].argmax())] if leaf is not None else []
    commit = clip_commit(ar[: ok + 1] + extra, left, lm.eos_ids)
    leaf = leaf if len(commit) == ok + 2 else None
    new, new_leaves = [], []
    if commit[-1] not in lm.eos_ids and len(commit) == ok + 1 + (leaf is not None) and n_masks:
        cap = min(n_masks, left - len(commit) - 1, (cfg.max_accept or cfg.block_size) - 1)
        g = (behind.index(m - ok) if m - ok in behind else -1) if leaf is None else len(behind) + leaf
        if g >= 0:
            first = len(seq) + m + len(leaves) + g * n_masks
            rows = never_propose_mask(logits[None, first: first + n_masks], lm.mask_id, first=0)
            tokens, conf = propose(rows, cfg.criterion)
            new = keep_drafts(tokens[0].tolist(), conf[0].tolist(), cfg.tau, cap, lm.eos_ids)
            if cfg.draft_layout == "tree":
                new_leaves = choose_leaves(torch.softmax(rows[0].float(), dim=-1), new, cfg.tree_width, cap)
        if cfg.prompt_lookup:
            looked = lookup_drafts(seq + commit, cfg.prompt_lookup, cap, lm.eos_ids)
            if lookup_wins(looked, new):
                new, new_leaves = looked, []
    return commit, (new, new_leaves)
