"""MARS and AR decoding: one generator yields one event per forward pass (docs/algorithm.md, "Decoding").

One step of `generate_stream`, in three files:
  here                     plan the step (StepPlan: masks, drafts to check, leaves, mask groups) and run the forward
                           through the backend (mars_core.decode.backend: what the decoder needs of a model)
  batch.py                 _Batch.chunk lays out the input [holes | uncached tokens | leaves | mask groups],
                           right-aligned; _Batch.attention its mask; after the forward _Batch.rollback crops the cache
  step.py                  propose → accept (settle_mars), or lossless's check and new drafts (settle_verify)
then `_advance` applies the settlement to each row and yields a StepEvent. Lossless mode's draft layouts (quadratic,
tree, auto, prompt lookup) are mars_core.decode.drafts. What a decode is asked for is mars_core.decode.config's
(`DecodeConfig`, `TauControl`), what it yields mars_core.decode.events' (`StepEvent`, `RowStep`, `SequenceResult`).
`reference_generate` is the plain uncached sampler (one full forward per step, one row at a time) that the tests
hold the cached decoder against; it shares step.py's bookkeeping, not the forward.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator, Sequence

import torch

from mars_core.decode.backend import backend
from mars_core.decode.batch import _Batch, _Row
from mars_core.decode.config import DecodeConfig, TauControl, _is_int
from mars_core.decode.drafts import DraftPlanner, choose_leaves, groups_behind
from mars_core.decode.events import RowStep, SequenceResult, StepEvent
from mars_core.decode.step import (StepPlan, accept_counts, argmax, check_drafts, check_finite, draft_room,
                                   drafting_group, masks_this_step, never_propose_mask, next_drafts, propose,
                                   settle_mars, settle_verify)


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
            raise ValueError(f"a prompt of {len(ids)} tokens does not fit the context of {lm.context_length}: "
                             "shorten it")
        out.append(ids)
    return out


def _vocab_size(lm) -> int:
    return lm.model.get_input_embeddings().weight.shape[0]


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
    device, n_masks_max, eos_set, model = lm.device, cfg.candidates - 1, set(lm.eos_ids), backend(lm)
    generator = None
    if cfg.temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(cfg.seed if cfg.seed is not None else torch.seed())
    # Positions must stay inside the context: a row stops ("length") at its last position, as AR does.
    budget = [min(cfg.max_new_tokens, lm.context_length - len(p) - 1) for p in prompt_ids]
    if min(budget) < 1:
        raise ValueError(f"a prompt leaves no room in the context of {lm.context_length} tokens: shorten it")
    batch = _Batch([_Row(i, budget[i], list(p), list(p)) for i, p in enumerate(prompt_ids)], model.new_cache(), device)
    planner = None
    if cfg.mode == "verify" and cfg.draft_layout == "auto":
        planner = DraftPlanner(cfg.row_costs or getattr(lm, "row_costs", None), cfg.block_size - 1)
    start, step = time.perf_counter(), 0
    while batch.rows:
        t0 = time.perf_counter()
        tau = 1.0 if cfg.mode == "ar" else (tau_control.value if tau_control is not None else cfg.tau)
        plan = _plan(lm, cfg, batch.rows, tau, n_masks_max, planner)
        ids, pos, valid, width, blocks = batch.chunk(plan.n_masks, lm.mask_id, plan.behind, plan.n_leaves,
                                                     bool(plan.n_masks))
        plan = replace(plan, width=width)
        out = model(input_ids=ids, attention_mask=batch.attention(valid, width, blocks, model.builds_causal_mask),
                    position_ids=pos, cache=batch.cache, use_cache=True, logits_to_keep=plan.keep(ids.shape[1], device),
                    **_options(model, lm, cfg, plan))
        logits = never_propose_mask(out.logits, lm.mask_id, first=plan.n_out)
        top = check_finite(logits, lm, step, getattr(out, "top", None))
        conf = getattr(out, "conf", None)   # the head's confidences where it gathered them (head_top)
        if cfg.mode == "verify":
            settled = settle_verify(logits, top, batch.rows, cfg, plan, eos_set, planner, conf)
        else:
            settled = settle_mars(logits, top, batch.rows, cfg, plan, eos_set, generator, conf)
        kept = [range(width - len(r.pending), width) if st.kept is None else st.kept
                for r, st in zip(batch.rows, settled)]
        batch.rollback(plan.n_mask_cols, kept, width + plan.n_leaves)
        if planner is not None:
            planner.observe(batch.rows, settled, ids.shape[1],
                            drafting=bool(plan.n_masks or plan.n_verify or plan.n_leaves))
        step_time = time.perf_counter() - t0

        events, still = _advance(lm, cfg, batch.rows, settled, len(prompt_ids))
        yield StepEvent(step, tau, step_time, time.perf_counter() - start, events, ids.shape[1])
        step += 1
        batch.select(still)


def _plan(lm, cfg, rows, tau: float, n_masks_max: int, planner) -> StepPlan:
    """This step's layout: the drafts to check, the masks that fit (as deep as drafting pays on this machine
    under draft_layout="auto"; none during its pause), the leaves, and which pending columns get a mask group."""
    n_verify = max(r.n_drafts for r in rows)
    n_masks = masks_this_step(tau, n_masks_max, lm.context_length - max(r.cached + len(r.pending) for r in rows))
    if planner is not None and n_masks:
        n_masks = planner.masks(rows, n_masks) if planner.drafting() else 0
    behind = tuple(groups_behind(cfg, n_verify, n_masks, planner, rows))
    return StepPlan(tau, n_masks, n_verify, max(len(r.leaves) for r in rows), behind)


def _options(model, lm, cfg, plan: StepPlan) -> dict:
    """The forward's optional arguments the backend takes (mars_core.decode.backend). `draft_tail`: in lossless
    mode the last mask columns only propose drafts that the next step checks, so they may be computed more cheaply
    (in the other modes mask outputs are committed). `head_top`: the head gathers each kept row's argmax, the mask
    id left out from the masks on (as never_propose_mask does), and where the step's confidence is the argmax's
    softmax probability (greedy, criterion "prob") that too, from the first row settle reads it at."""
    options = {}
    if model.takes_draft_tail and cfg.mode == "verify" and plan.n_mask_cols:
        options["draft_tail"] = plan.n_mask_cols
    if model.takes_head_top:
        greedy_prob = cfg.temperature == 0 and cfg.criterion == "prob"
        conf_from = plan.n_out if cfg.mode == "verify" else 0
        options["head_top"] = (lm.mask_id, plan.n_out, conf_from if greedy_prob else -1)
    return options


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


def generate(lm, prompts, cfg: DecodeConfig | None = None,
             tau_control: TauControl | None = None) -> list[SequenceResult]:
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
    logits = backend(lm)(input_ids=torch.tensor([seq + masks], device=lm.device)).logits   # [1, T, V]
    rows = never_propose_mask(logits[:, len(seq) - 1: len(seq) - 1 + used], lm.mask_id)
    tokens, conf = propose(rows, cfg.criterion, cfg.temperature, cfg.top_p, generator)
    limit = torch.tensor([min(left, cfg.max_accept or k, used)], device=lm.device)
    n = int(accept_counts(tokens, conf, tau, limit, torch.tensor(lm.eos_ids, device=lm.device))[0])
    return tokens[0, :n].tolist(), []


def _reference_verify_step(lm, cfg, seq, state, left, generator):
    """Feed [committed | drafts | leaves | masks] with no cache; AR's greedy tokens check the drafts, and the
    masks behind the last confirmed token (or prompt lookup) draft anew, through the cached decoder's own
    bookkeeping (mars_core.decode.step). `state` is (drafts, leaves) from the previous step ([] at the first).
    The quadratic and tree layouts' input comes from the same chunk builder as the cached decoder's."""
    drafts, leaves = state if state else ([], [])
    n_masks = masks_this_step(cfg.tau, cfg.block_size - 1, lm.context_length - len(seq) - len(drafts))
    m, model = len(drafts), backend(lm)
    behind = groups_behind(cfg, m, n_masks)
    n_mask_cols = (len(behind) + len(leaves)) * n_masks
    tail = {"draft_tail": n_mask_cols} if model.takes_draft_tail and n_mask_cols else {}
    if len(behind) > 1 or leaves:
        batch = _Batch([_Row(0, left, seq + drafts, n_drafts=m, leaves=leaves)], None, lm.device)
        ids, pos, valid, width, blocks = batch.chunk(n_masks, lm.mask_id, behind, len(leaves), bool(n_masks))
        logits = model(input_ids=ids, attention_mask=batch.attention(valid, width, blocks), position_ids=pos,
                       **tail).logits[0]
    else:
        logits = model(input_ids=torch.tensor([seq + drafts + [lm.mask_id] * n_masks], device=lm.device),
                       **tail).logits[0]
    ar = argmax(logits[len(seq) - 1: len(seq) + m + len(leaves)]).tolist()   # at the last token, drafts, leaves
    ok, leaf, commit = check_drafts(drafts, ar[: m + 1], leaves, ar[m + 1:], left, lm.eos_ids)
    cap = draft_room(commit, ok, leaf, lm.eos_ids, n_masks, left, cfg.max_accept or cfg.block_size)
    g = drafting_group(behind, m, ok, leaf) if n_masks else -1
    cands, confs, leaf_group = [], [], None
    if g >= 0 and cap > 0:
        first = len(seq) + m + len(leaves) + g * n_masks
        rows = never_propose_mask(logits[None, first: first + n_masks], lm.mask_id, first=0)
        tokens, conf = propose(rows, cfg.criterion)
        cands, confs = tokens[0].tolist(), conf[0].tolist()
        if cfg.draft_layout == "tree":
            leaf_group = lambda new: choose_leaves(torch.softmax(rows[0].float(), dim=-1), new, cfg.tree_width, cap)
    new, _, new_leaves = next_drafts(cands, confs, cfg.tau, cap, lm.eos_ids, seq + commit, cfg.prompt_lookup,
                                     leaf_group)
    return commit, (new, new_leaves)
