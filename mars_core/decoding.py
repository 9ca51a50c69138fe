"""MARS and AR decoding: one generator yields one event per forward pass (docs/algorithm.md, "Decoding").

Pieces, each a pure function of tensors:
  propose(logits)          -> candidates, confidences      (fp32 softmax on the B rows used)
  accept_counts(...)       -> how many candidates each row keeps
  build_chunk(...)         -> the step's input: [holes | uncached committed tokens | masks]
  step_attention(...)      -> the 4D mask that hides holes
`generate_stream` strings them together around one KV cache; `generate` collects its events.
`reference_generate` is the plain uncached sampler (one full forward per step, one row at a time)
that the tests hold the cached decoder against.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from transformers import DynamicCache

MODES = ("mars", "ar")
CRITERIA = ("prob", "entropy", "margin")


def check_tau(tau) -> float:
    """τ must be a positive finite number; τ >= 1 is one-token mode."""
    try:
        value = float(tau)
    except (TypeError, ValueError):
        raise ValueError(f"tau={tau!r} is not a number: use a value in (0, 1), or 1.0 for one-token (AR) mode") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"tau={tau!r} is out of range: use a value in (0, 1), or 1.0 for one-token (AR) mode")
    return value


@dataclass
class DecodeConfig:
    """How to decode. Validated on creation; every error names the value and the fix."""
    mode: str = "mars"            # "mars": B candidates per forward; "ar": plain one-token decoding
    tau: float = 0.95             # acceptance threshold; >= 1.0 accepts exactly one token per step
    block_size: int = 4           # B: candidates per forward pass (q_0 .. q_{B-1})
    max_new_tokens: int = 128     # hard cap on new tokens per sequence (eos included)
    temperature: float = 0.0      # 0 = greedy; > 0 samples every candidate at this temperature
    top_p: float = 1.0            # nucleus sampling mass, with temperature > 0
    seed: int | None = None       # seed for sampling
    criterion: str = "prob"       # confidence: prob = p(t); entropy = exp(-H(q)); margin = p1 - p2
    max_accept: int | None = None  # optional cap on tokens accepted per forward
    stop_strings: tuple[str, ...] = ()  # stop once the decoded text contains one of these

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is unknown: use 'mars' or 'ar'")
        self.tau = check_tau(self.tau)
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size={self.block_size!r} must be an integer >= 1 (the paper uses 4)")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.criterion not in CRITERIA:
            raise ValueError(f"criterion={self.criterion!r} is unknown: use one of {', '.join(CRITERIA)}")
        if self.max_accept is not None and (not isinstance(self.max_accept, int) or self.max_accept < 1):
            raise ValueError(f"max_accept={self.max_accept!r} must be None or an integer >= 1")
        if isinstance(self.stop_strings, str):
            self.stop_strings = (self.stop_strings,)
        self.stop_strings = tuple(s for s in self.stop_strings if s)

    @property
    def candidates(self) -> int:
        """Rows of logits each forward uses: B in MARS mode, 1 in AR mode."""
        return self.block_size if self.mode == "mars" else 1


class TauControl:
    """A τ the caller may change while a generation runs; the decoder reads it at every step."""

    def __init__(self, value: float):
        self.value = value

    @property
    def value(self) -> float:
        return self._value

    @value.setter
    def value(self, tau) -> None:
        self._value = check_tau(tau)


@dataclass
class RowStep:
    """What one sequence did in one forward pass."""
    accepted_ids: list[int]
    candidates: list[int]
    confidences: list[float]
    n_accepted: int
    done: bool
    active: bool
    tokenizer: object = field(default=None, repr=False)
    finish_reason: str | None = None   # eos | length | stop, on the step that finished the row

    @property
    def text(self) -> str:
        if not self.accepted_ids or self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.accepted_ids, skip_special_tokens=True)


@dataclass
class StepEvent:
    step: int            # 0-based forward index; step 0 also encodes the prompt
    tau: float           # τ used at this step (1.0 in AR mode)
    step_time: float     # seconds of this forward + acceptance
    elapsed: float       # seconds since generation started
    rows: list[RowStep]


@dataclass
class SequenceResult:
    prompt_ids: list[int]
    token_ids: list[int]          # new tokens, eos counted once
    text: str
    steps: list[list[int]]        # accepted ids per forward
    step_times: list[float]
    wall_time: float              # seconds until this sequence finished
    finish_reason: str            # eos | length | stop

    @property
    def forwards(self) -> int:
        return len(self.steps)

    @property
    def tokens_per_forward(self) -> float:
        return len(self.token_ids) / max(1, self.forwards)

    def to_dict(self) -> dict:
        return {
            "prompt_ids": self.prompt_ids, "token_ids": self.token_ids, "text": self.text,
            "forwards": self.forwards, "tokens_per_forward": self.tokens_per_forward,
            "steps": self.steps, "step_times": self.step_times, "wall_time": self.wall_time,
            "finish_reason": self.finish_reason,
        }


# ----------------------------------------------------------------------------- pure pieces

def propose(logits: torch.Tensor, criterion: str = "prob", temperature: float = 0.0, top_p: float = 1.0,
            generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates and confidences from logits [b, k, V] -> ([b, k] ids, [b, k] fp32 in [0, 1])."""
    logits = logits.float()  # fp32 softmax even for a bf16 model
    if temperature > 0:
        probs = torch.softmax(logits / temperature, dim=-1)
        tokens = _sample(probs, top_p, generator)
    else:
        probs = torch.softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)  # argmax of the raw logits, exactly as greedy generate()
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


def never_propose_mask(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Logits [b, k, V] with the mask id ruled out at the mask rows q_1..q_{k-1} (changed in place).

    A mask position predicts a future token, never another mask; a reused special token (SmolLM2's
    <repo_name>) may still carry probability there. q_0 is the plain AR prediction and stays untouched, so
    one-token mode remains exactly greedy AR.
    """
    if logits.shape[1] > 1:
        logits[:, 1:, mask_id] = float("-inf")   # in place: the step's own fresh logits, no [b, k, V] copy
    return logits


def accept_counts(tokens: torch.Tensor, conf: torch.Tensor, tau: float, limit: torch.Tensor,
                  eos_ids: torch.Tensor) -> torch.Tensor:
    """How many leading candidates each row accepts: [b, k] -> [b].

    t_0 always; t_j while every earlier one was accepted and c_j >= τ; never more than `limit`
    (B, max_accept, tokens left); nothing after an eos. τ >= 1 accepts exactly t_0 — even when a
    probability rounds to 1.0, which the official sampler would accept.
    """
    passes = conf >= tau if tau < 1.0 else torch.zeros_like(conf, dtype=torch.bool)
    passes[:, 0] = True
    n = passes.long().cumprod(dim=1).sum(dim=1)                # leading run of passes
    n = torch.minimum(n, limit)
    is_eos = torch.isin(tokens, eos_ids)
    first_eos = torch.where(is_eos.any(dim=1), is_eos.long().argmax(dim=1) + 1, tokens.shape[1])
    return torch.minimum(n, first_eos)


def right_align(tokens: torch.Tensor, counts: torch.Tensor, width: int,
                fill: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Put each row's first `counts[r]` tokens at the right end of a [b, width] block.
    Returns (ids, valid, src), each [b, width]: the left holes hold `fill` and are invalid; `src` is the
    index of each column's token among the row's tokens (negative for holes)."""
    cols = torch.arange(width, device=tokens.device)
    src = cols[None, :] - (width - counts[:, None])            # [b, width] source column, < 0 for holes
    valid = src >= 0
    ids = tokens.gather(1, src.clamp(min=0, max=tokens.shape[1] - 1))
    return torch.where(valid, ids, torch.full_like(ids, fill)), valid, src


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


# ----------------------------------------------------------------------------- the decoder

def _prompt_ids(lm, prompts) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts={prompts!r} must be a non-empty list of strings or of token-id lists")
    out = []
    for p in prompts:
        ids = lm.encode(p) if isinstance(p, str) else [int(t) for t in p]
        if not ids:
            raise ValueError("a prompt has no tokens: pass a non-empty prompt")
        if len(ids) + 2 > lm.context_length:
            raise ValueError(f"a prompt of {len(ids)} tokens does not fit the context of {lm.context_length}: shorten it")
        out.append(ids)
    return out


@torch.inference_mode()
def generate_stream(lm, prompts, cfg: DecodeConfig | None = None,
                    tau_control: TauControl | None = None) -> Iterator[StepEvent]:
    """Decode a batch; yield one StepEvent per forward pass.

    Every step feeds [holes | uncached committed tokens | B-1 masks] per row. Rows are right-aligned,
    so q_0 (the last committed token) and q_1..q_{B-1} (the masks) sit in the same B columns for
    every row and the LM head runs on those B columns only. The spec appends B masks; the output at
    the last one is never used and, under causal attention, nothing before it depends on it, so we
    append B-1: identical candidates, one position less per forward. A step at τ >= 1 appends none, so
    one-token mode is AR's own computation; near the context's end a step appends only the masks that fit.
    """
    cfg = cfg or DecodeConfig()
    model, device = lm.model, lm.device
    prompt_ids = _prompt_ids(lm, prompts)
    b, k = len(prompt_ids), cfg.candidates
    n_masks = k - 1
    eos_ids = torch.tensor(lm.eos_ids, device=device)
    generator = None
    if cfg.temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(cfg.seed if cfg.seed is not None else torch.seed())
    # Positions must stay inside the context: a row stops ("length") at its last position, as AR does;
    # near the end a step appends only the masks that still fit (masks_this_step).
    budget = [min(cfg.max_new_tokens, lm.context_length - len(p) - 1) for p in prompt_ids]
    if min(budget) < 1:
        raise ValueError(f"a prompt leaves no room in the context of {lm.context_length} tokens: shorten it")

    # Per-row host state (one sync per step builds the event anyway).
    generated = [[] for _ in range(b)]
    committed = [len(p) for p in prompt_ids]                   # prompt + accepted tokens, per original row
    alive = list(range(b))                                     # original row index of each batch row
    # Device state for the alive rows.
    lengths = torch.tensor([len(p) for p in prompt_ids], device=device)
    width = int(lengths.max())
    pending = torch.zeros(b, width, dtype=torch.long, device=device)
    for r, p in enumerate(prompt_ids):
        pending[r, : len(p)] = torch.tensor(p, device=device)   # left-aligned, like accepted tokens
    pending_n = lengths.clone()                                 # real tokens in `pending` per row
    cached = torch.zeros(b, dtype=torch.long, device=device)   # real tokens already in the cache
    left = torch.tensor(budget, device=device)                  # tokens each row may still accept
    kv_valid = torch.zeros(b, 0, dtype=torch.bool, device=device)
    cache = DynamicCache(config=model.config)

    start = time.perf_counter()
    step = 0
    while alive:
        t0 = time.perf_counter()
        tau = tau_control.value if tau_control is not None else cfg.tau
        if cfg.mode == "ar":
            tau = 1.0
        width = pending.shape[1]
        masks = masks_this_step(tau, n_masks, lm.context_length - max(committed[r] for r in alive))
        ids, valid, src = right_align(pending, pending_n, width, fill=lm.mask_id)
        pos = torch.where(valid, cached[:, None] + src, torch.zeros_like(src))   # holes take no position
        if masks:
            mask_cols = torch.arange(1, masks + 1, device=device)[None, :]
            ids = torch.cat([ids, torch.full((len(alive), masks), lm.mask_id, device=device)], dim=1)
            pos = torch.cat([pos, cached[:, None] + pending_n[:, None] - 1 + mask_cols], dim=1)
            valid = torch.cat([valid, torch.ones(len(alive), masks, dtype=torch.bool, device=device)], dim=1)
        keep = torch.arange(width - 1, width + masks, device=device)   # q_0 .. q_masks
        out = model(input_ids=ids, attention_mask=step_attention(kv_valid, valid), position_ids=pos,
                    cache=cache, use_cache=True, logits_to_keep=keep)
        logits = never_propose_mask(out.logits, lm.mask_id)     # [b_alive, masks + 1, V]
        # Cache rollback, in this one place: drop the masks; the accepted tokens enter next step.
        if masks:
            cache.crop(-masks)
        kv_valid = torch.cat([kv_valid, valid[:, :width]], dim=1)
        cached = cached + pending_n

        tokens, conf = propose(logits, cfg.criterion, cfg.temperature, cfg.top_p, generator)
        limit = left.clamp(max=min(cfg.max_accept or k, masks + 1))
        n = accept_counts(tokens, conf, tau, limit, eos_ids)
        tokens_h, conf_h, n_h = tokens.tolist(), conf.tolist(), n.tolist()   # the step's one host sync
        step_time = time.perf_counter() - t0

        rows = [RowStep([], [], [], 0, True, False, lm.tokenizer) for _ in range(b)]
        finished = []
        for i, r in enumerate(alive):
            accepted = tokens_h[i][: n_h[i]]
            generated[r].extend(accepted)
            committed[r] += len(accepted)
            reason = "eos" if accepted[-1] in lm.eos_ids else "length" if len(generated[r]) >= budget[r] else None
            if cfg.stop_strings and reason is None and _trim_at_stop(lm, generated[r], accepted, cfg.stop_strings):
                reason = "stop"
            done = reason is not None
            rows[r] = RowStep(accepted, tokens_h[i], conf_h[i], len(accepted), done, True, lm.tokenizer, reason)
            if done:
                finished.append(i)
        yield StepEvent(step, tau, step_time, time.perf_counter() - start, rows)
        step += 1

        # Next input: this step's accepted tokens, right-aligned; finished rows leave the batch.
        pending, pending_n = tokens, n
        left = left - n
        width = max(n_h[i] for i in range(len(alive)) if i not in finished) if len(finished) < len(alive) else 0
        if finished:
            keep_rows = torch.tensor([i for i in range(len(alive)) if i not in finished], device=device)
            alive = [r for i, r in enumerate(alive) if i not in finished]
            if not alive:
                break
            cache.batch_select_indices(keep_rows)
            pending, pending_n = pending[keep_rows], pending_n[keep_rows]
            kv_valid, cached, left = kv_valid[keep_rows], cached[keep_rows], left[keep_rows]
        pending = pending[:, :width]          # width from the host copy: no second sync per step


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
    """Fold a stream of StepEvents into per-sequence results (metrics as docs/algorithm.md, "Metrics", defines them)."""
    steps = [[] for _ in prompt_ids]
    times = [[] for _ in prompt_ids]
    wall = [0.0 for _ in prompt_ids]
    reasons = ["length" for _ in prompt_ids]
    for event in events:
        for r, row in enumerate(event.rows):
            if row.active:
                steps[r].append(row.accepted_ids)
                times[r].append(event.step_time)
                wall[r] = event.elapsed
                reasons[r] = row.finish_reason or reasons[r]
    results = []
    for r, p in enumerate(prompt_ids):
        ids = [t for s in steps[r] for t in s]
        results.append(SequenceResult(p, ids, lm.decode(ids), steps[r], times[r], wall[r], reasons[r]))
    return results


# ----------------------------------------------------------------------------- uncached reference

@torch.inference_mode()
def reference_generate(lm, prompts, cfg: DecodeConfig | None = None) -> list[SequenceResult]:
    """The plain sampler: every step is one full forward of [all committed tokens | B masks], no cache,
    one row at a time, the LM head on every position. Slow on purpose; the tests' yardstick."""
    cfg = cfg or DecodeConfig()
    device = lm.device
    eos_ids = torch.tensor(lm.eos_ids, device=device)
    results = []
    for prompt in _prompt_ids(lm, prompts):
        k = cfg.candidates
        budget = min(cfg.max_new_tokens, lm.context_length - len(prompt) - 1)
        generator = None
        if cfg.temperature > 0:
            generator = torch.Generator(device=device)
            generator.manual_seed(cfg.seed if cfg.seed is not None else 0)
        seq, new, steps, times = list(prompt), [], [], []
        start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            tau = cfg.tau if cfg.mode == "mars" else 1.0
            used = masks_this_step(tau, k - 1, lm.context_length - len(seq)) + 1     # candidates q_0 .. q_{used-1}
            # the spec's B masks when they fit (the last one's output is never read), else as many as fit
            masks = [lm.mask_id] * (min(used, lm.context_length - len(seq)) if used > 1 else 0)
            logits = lm.model(input_ids=torch.tensor([seq + masks], device=device)).logits   # [1, T, V]
            rows = never_propose_mask(logits[:, len(seq) - 1: len(seq) - 1 + used], lm.mask_id)
            tokens, conf = propose(rows, cfg.criterion, cfg.temperature, cfg.top_p, generator)
            limit = torch.tensor([min(budget - len(new), cfg.max_accept or k, used)], device=device)
            n = int(accept_counts(tokens, conf, tau, limit, eos_ids)[0])
            accepted = tokens[0, :n].tolist()
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
