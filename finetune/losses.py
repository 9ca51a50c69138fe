"""MARS and AR-SFT losses as pure functions (docs/algorithm.md, "Training").

One training example is a prompt followed by a response, length ``n``, with
labels ``-100`` on the prompt. MARS trains on the concatenation
``[noisy | clean]`` (length ``2n``): ``clean`` is the example itself, ``noisy``
is the same sequence with every response token replaced by ``mask_id``. Both
halves use position ids ``0..n-1``. Blocks are absolute, ``block(i) = i // B``.

Attention (True = may attend; q and k are positions inside their own half):
- clean -> clean: ``k <= q`` (plain causal)
- noisy -> noisy: ``block(k) == block(q) and k <= q``
- noisy -> clean: ``block(k) < block(q)``
- clean -> noisy: never

``block_offset = r`` (not in the paper; 0 = the paper's grid; docs/algorithm.md) shifts the
grid to ``block(i) = (i + r) // B``. On the fixed grid every run of masks in
the noisy half starts at a multiple of B, while the decoder appends its masks
after whatever it accepted last, at any position; a small model learns the
grid's phase and its mask predictions get worse off it. Training with r drawn
afresh every step (``finetune.train --random-block-offset``) removes that
mismatch (docs/experiments.md, "Block phase").

Loss: ``CE(noisy) + ar_weight * CE(clean)``, each the mean over labelled
tokens, with the usual causal shift inside each half. With ``soft_weight = w`` (not in the paper; 0 = off) the
mask term becomes ``(1 - w) * CE(noisy) + w * KL(teacher || noisy)``: the teacher is the clean stream's detached
next-token distribution at the same target (computed in the same forward, so it costs one LM-head pass that the
AR loss already makes), over the whole vocabulary or its top-k renormalised. With an anchor (``--ar-anchor``, not
in the paper; issue 52) the clean term becomes ``(1 - a) * CE(clean) + a * KL(anchor || clean)``, the anchor a frozen
model (the base) run causally on the example: a hard CE on greedy answers pulls only the argmax, the KL the whole
distribution, so AR's answers on prompts outside the data drift less. Logits are computed only
for the rows that carry a label: the hidden states of those rows are gathered
first and only then multiplied by the LM head (with SmolLM2's 49k-token
vocabulary that matmul would otherwise be the largest single cost).

The noisy copies of blocks that hold only prompt tokens predict no label and
are attended by no other row, so ``mars_loss`` leaves them out of the forward
(``skip_prompt_blocks``; exact, checked against the full ``[2n]`` forward).

The model is any stock transformers causal LM with ``.model`` (the decoder,
returning ``last_hidden_state``) and ``.lm_head`` - Llama, Qwen2, SmolLM2. A
4D boolean ``attention_mask`` with explicit ``position_ids`` goes through SDPA
unchanged, so no custom model class is needed. The eager kernel adds its mask
to the scores, so it gets the same mask as 0 / -inf-like floats
(``model_attention_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


class LossOutput(NamedTuple):
    """What the loss functions return; ``loss`` is the one to backpropagate."""

    loss: torch.Tensor  # scalar, differentiable
    loss_mask: torch.Tensor | None  # noisy-stream CE (detached), None for AR-SFT
    loss_ar: torch.Tensor  # clean-stream CE (detached)
    n_labels: int  # labelled tokens in this batch


def check_block_offset(block_offset: int, block_size: int) -> None:
    if not isinstance(block_offset, int) or not 0 <= block_offset < block_size:
        raise ValueError(f"block_offset={block_offset!r} must be an integer in [0, block_size={block_size})")


def is_block_start(i: int, block_size: int, block_offset: int = 0) -> bool:
    """Whether position ``i`` starts a block when ``block(i) = (i + block_offset) // block_size``."""
    return i == 0 or (i + block_offset) % block_size == 0


def mars_attention_mask(n: int, block_size: int, noisy_start: int = 0, block_offset: int = 0) -> torch.Tensor:
    """Boolean ``[2n, 2n]`` mask over ``[noisy | clean]``; rows are queries.

    With ``noisy_start = s`` (a block start) the noisy half holds only
    positions ``s..n-1`` and the mask is ``[(n-s) + n, (n-s) + n]``: the
    noisy rows of earlier blocks are attended by nobody (noisy queries see
    noisy keys of their own block only, clean queries never see noisy keys),
    so dropping them changes no kept output.

    ``block_offset = r`` shifts the block grid: ``block(i) = (i + r) // B``, so the
    first block is ``B - r`` positions long (``r = 0``: the paper's absolute blocks, docs/algorithm.md).
    """
    if n < 1 or block_size < 1:
        raise ValueError(f"need n >= 1 and block_size >= 1, got n={n}, block_size={block_size}")
    check_block_offset(block_offset, block_size)
    assert 0 <= noisy_start < n and is_block_start(noisy_start, block_size, block_offset), \
        "noisy_start must be a block start inside n"
    qn = torch.arange(noisy_start, n).unsqueeze(1) + block_offset  # [m, 1] noisy query positions (+ r)
    kn = torch.arange(noisy_start, n).unsqueeze(0) + block_offset  # [1, m] noisy key positions (+ r)
    q = torch.arange(n).unsqueeze(1)  # [n, 1]
    k = torch.arange(n).unsqueeze(0)  # [1, n]
    noisy_noisy = ((qn // block_size) == (kn // block_size)) & (kn <= qn)  # [m, m]
    noisy_clean = ((k + block_offset) // block_size) < (qn // block_size)  # [m, n]
    clean_noisy = torch.zeros(n, n - noisy_start, dtype=torch.bool)  # [n, m]
    clean_clean = k <= q  # [n, n]
    noisy_rows = torch.cat([noisy_noisy, noisy_clean], dim=1)  # [m, m + n]
    clean_rows = torch.cat([clean_noisy, clean_clean], dim=1)  # [n, m + n]
    return torch.cat([noisy_rows, clean_rows], dim=0)  # [m + n, m + n]


def batched_mars_attention_mask(valid: torch.Tensor, block_size: int, noisy_start: int = 0,
                                block_offset: int = 0) -> torch.Tensor:
    """``[b, 1, m + n, m + n]`` MARS mask (``m = n - noisy_start``) that also hides padded keys.

    ``valid`` is ``[b, n]`` bool (True = real token). Padding is found from this
    mask only, never from token ids (pad may equal eos). Every query may attend
    to itself so a padded row is never fully masked (an all-False row makes
    SDPA return NaN); real rows already attend to themselves, so they are
    unchanged.
    """
    b, n = valid.shape
    base = mars_attention_mask(n, block_size, noisy_start, block_offset).to(valid.device)  # [m + n, m + n]
    keys = torch.cat([valid[:, noisy_start:], valid], dim=1)  # [b, m + n]
    mask = base.unsqueeze(0) & keys.unsqueeze(1)  # [b, m + n, m + n]
    mask |= torch.eye(base.shape[0], dtype=torch.bool, device=valid.device).unsqueeze(0)
    return mask.unsqueeze(1)  # [b, 1, m + n, m + n]


def model_attention_mask(model, mask: torch.Tensor) -> torch.Tensor:
    """A boolean 4D mask in the form ``model``'s attention kernel takes it.

    SDPA (and flex/flash wrappers) take booleans; transformers' eager kernel adds
    the mask to the scores, so it gets 0 where attending and the fp32 minimum
    where not (a boolean would be added as 0/1 and hide nothing).
    """
    if getattr(model.config, "_attn_implementation", None) != "eager":
        return mask
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return bias.masked_fill_(~mask, torch.finfo(torch.float32).min)


def first_noisy_block_start(labels: torch.Tensor, block_size: int, block_offset: int = 0) -> int:
    """Start of the first block holding a noisy query with a label (the output at i-1 predicts label i)."""
    has_label = (labels != IGNORE_INDEX).any(dim=0)  # [n]
    first_label = int(has_label.float().argmax())  # one host sync per batch
    query = max(first_label - 1, 0)
    return max((query + block_offset) // block_size * block_size - block_offset, 0)


def noisy_input_ids(input_ids: torch.Tensor, labels: torch.Tensor, mask_id: int) -> torch.Tensor:
    """The noisy stream: every response (labelled) token replaced by ``mask_id``."""
    return torch.where(labels != IGNORE_INDEX, torch.full_like(input_ids, mask_id), input_ids)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``targets[:, i] = labels[:, i + 1]``: the output at i predicts token i+1."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


HEAD_ROW_MULTIPLE = 64


def head_logits(lm_head, h: torch.Tensor) -> torch.Tensor:
    """``lm_head(h)`` as fp32 ``[L, vocab]`` for gathered rows ``h`` ``[L, d]``, run on ``L`` rounded up to a
    multiple of ``HEAD_ROW_MULTIPLE`` (zero rows, sliced off again: no value or gradient changes). Why: ``L`` is the
    batch's labelled-token count, new nearly every step, and a CPU's bf16 matmul library builds and caches a kernel
    per shape; a few dozen shapes instead of one per step."""
    pad = -h.shape[0] % HEAD_ROW_MULTIPLE
    if pad == 0:
        return lm_head(h).float()
    return lm_head(F.pad(h, (0, 0, 0, pad)))[: h.shape[0]].float()


def labelled_cross_entropy(hidden: torch.Tensor, targets: torch.Tensor, lm_head,
                           label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean CE over rows whose target is not -100, running the LM head on those rows only.

    ``hidden`` is ``[b, n, d]``, ``targets`` ``[b, n]`` (already shifted).
    """
    rows = targets != IGNORE_INDEX  # [b, n]
    h = hidden[rows]  # [m, d]
    logits = head_logits(lm_head, h)  # [m, vocab]
    return F.cross_entropy(logits, targets[rows], label_smoothing=label_smoothing)


def soft_target_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, top_k: int = 0) -> torch.Tensor:
    """Mean over rows of ``KL(p || q)``: ``p`` the teacher's distribution (detached here, so no gradient ever
    reaches the teacher's stream through this term), ``q`` the student's. Both are ``[m, vocab]``.

    ``top_k > 0`` keeps the teacher's k most likely tokens, renormalised, so the student is pulled toward the
    teacher's plausible continuations only; 0 uses the whole vocabulary. A one-hot teacher gives exactly the hard
    CE of its token (KL(onehot || q) = -log q(token)).
    """
    log_q = F.log_softmax(student_logits.float(), dim=-1)  # [m, vocab]
    teacher = teacher_logits.detach().float()
    if top_k > 0:
        top, idx = teacher.topk(min(top_k, teacher.shape[-1]), dim=-1)  # [m, k]
        log_p = F.log_softmax(top, dim=-1)
        log_q = log_q.gather(-1, idx)
    else:
        log_p = F.log_softmax(teacher, dim=-1)
    p = log_p.exp()
    # 0 * log 0 is 0: a teacher probability that underflows contributes nothing.
    kl = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)  # [m]
    return kl.mean()


def mask_stream_loss(hidden_noisy: torch.Tensor, hidden_clean: torch.Tensor, targets_noisy: torch.Tensor,
                     targets_clean: torch.Tensor, lm_head, soft_weight: float, top_k: int,
                     label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask term to optimise, hard mask CE, clean-stream CE), each over the labelled rows.

    The noisy rows (``[b, m]``, from ``start``) and the clean rows (``[b, n]``) carry the same labelled
    (row, position) pairs in the same row-major order, because no label lies before ``start``; so the gathered
    rows line up one to one and the clean logits serve both as the AR loss and as the teacher.
    """
    rows_noisy, rows_clean = targets_noisy != IGNORE_INDEX, targets_clean != IGNORE_INDEX
    assert int(rows_noisy.sum()) == int(rows_clean.sum()), "a label lies before the noisy half's start"
    student = head_logits(lm_head, hidden_noisy[rows_noisy])  # [L, vocab]
    teacher = head_logits(lm_head, hidden_clean[rows_clean])  # [L, vocab]
    labels = targets_clean[rows_clean]
    hard = F.cross_entropy(student, labels, label_smoothing=label_smoothing)
    loss_ar = F.cross_entropy(teacher, labels)
    mask_term = (1 - soft_weight) * hard + soft_weight * soft_target_loss(student, teacher, top_k)
    return mask_term, hard, loss_ar


def ar_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> LossOutput:
    """Plain AR-SFT loss: causal forward, CE on the labelled rows only.

    ``input_ids``/``labels``/``valid`` are ``[b, n]``; padded positions must
    have label -100 and ``valid`` False.
    """
    targets = shift_labels(labels)
    n_labels = int((targets != IGNORE_INDEX).sum())
    assert n_labels > 0, "batch has no labelled tokens"
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    hidden = model.model(
        input_ids=input_ids, attention_mask=valid.long(), position_ids=positions, use_cache=False
    ).last_hidden_state  # [b, n, d]
    loss = labelled_cross_entropy(hidden, targets, model.lm_head)
    return LossOutput(loss, None, loss.detach(), n_labels)


def mars_inputs(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    mask_id: int,
    block_size: int,
    noisy_start: int = 0,
    block_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dual-stream inputs: ids ``[b, m + n]``, positions ``[b, m + n]``, mask ``[b, 1, m + n, m + n]``.

    The noisy half covers positions ``noisy_start..n-1`` (``m`` of them); both
    halves keep their absolute position ids.
    """
    b, n = input_ids.shape
    noisy = noisy_input_ids(input_ids, labels, mask_id)[:, noisy_start:]  # [b, m]
    ids = torch.cat([noisy, input_ids], dim=1)  # [b, m + n]
    half = torch.arange(n, device=input_ids.device)
    positions = torch.cat([half[noisy_start:], half]).expand(b, -1)  # [b, m + n]
    return ids, positions, batched_mars_attention_mask(valid, block_size, noisy_start, block_offset)


@dataclass(frozen=True)
class MarsLossSettings:
    """How ``mars_loss`` builds and weighs its two streams: ``L = CE(noisy, labels) + ar_weight * CE(clean, labels)``.

    With ``skip_prompt_blocks`` the noisy half starts at the first block that
    predicts a label: the noisy copies of earlier (prompt-only) blocks carry no
    loss and no later row attends to them, so they are pure waste (about a
    quarter of the compute for prompts as long as their answers). The result is
    the same as the full ``[2n]`` forward (a test checks it).

    ``mask_label_smoothing`` (not in the paper; 0 = off) smooths the noisy-stream targets only, which caps
    the mask predictions' confidence below 1 (the clean stream, the one-token path, is untouched);
    ``loss_mask`` then reports the smoothed CE.

    ``soft_weight`` > 0 mixes in the clean stream's detached distribution as a soft target for the masks
    (``soft_target_loss``; ``soft_top_k`` its vocabulary); ``loss_mask`` still reports the hard mask CE, so runs
    with and without it compare on one number.

    ``frozen_clean`` says that no trained parameter acts on the clean stream (gated LoRA: every delta is gated to
    the mask positions, and the clean stream holds no mask token), so that stream is the base model. It then runs
    first without a graph and the noisy rows attend to its keys and values through a KV cache: the backward pass
    covers the noisy rows only (a batch whose text holds the mask token itself takes the joint forward). The clean
    CE still reaches a trained mask row through a tied head's mask-id logit, as in the joint forward. Same losses
    and gradients as the joint forward up to fp32 rounding (a test checks it).
    """

    block_size: int
    mask_id: int
    ar_weight: float = 1.0
    skip_prompt_blocks: bool = True
    mask_label_smoothing: float = 0.0
    block_offset: int = 0
    soft_weight: float = 0.0
    soft_top_k: int = 0
    frozen_clean: bool = False
    anchor_weight: float = 0.0


def mars_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
              settings: MarsLossSettings, anchor=None) -> LossOutput:
    """``L = CE(noisy, labels) + ar_weight * CE(clean, labels)`` in one forward (``MarsLossSettings`` says how).

    With ``anchor`` (a frozen causal LM with the same vocabulary) and ``anchor_weight = w`` the clean term is
    ``(1 - w) * CE(clean) + w * KL(anchor || clean)`` over the same labelled rows; the anchor runs the plain causal
    forward of the example without a graph. ``loss_ar`` still reports the clean CE."""
    s = settings
    assert (anchor is not None) == (s.anchor_weight > 0), "an anchor model goes with anchor_weight > 0"
    n = input_ids.shape[1]
    targets = shift_labels(labels)
    n_labels = int((targets != IGNORE_INDEX).sum())
    assert n_labels > 0, "batch has no labelled tokens"
    start = first_noisy_block_start(labels, s.block_size, s.block_offset) if s.skip_prompt_blocks else 0
    ids, positions, attn = mars_inputs(input_ids, labels, valid, s.mask_id, s.block_size, start, s.block_offset)
    m = n - start
    # A real token equal to the mask id would switch the gate on inside the clean stream: then the joint forward.
    if s.frozen_clean and not bool((input_ids[valid] == s.mask_id).any()):
        hidden = _frozen_clean_forward(model, ids, positions, attn, m)
    else:
        hidden = model.model(
            input_ids=ids, attention_mask=model_attention_mask(model, attn), position_ids=positions, use_cache=False
        ).last_hidden_state  # [b, m + n, d]
    if s.soft_weight > 0:
        return _soft_mars_loss(hidden, m, targets[:, start:], targets, model.lm_head, s, n_labels)
    if anchor is not None:
        return _anchored_mars_loss(hidden, m, targets[:, start:], targets, model.lm_head, s, n_labels,
                                   anchor_logits(anchor, input_ids, valid, targets))
    return _hard_mars_loss(hidden, m, targets[:, start:], targets, model.lm_head, s, n_labels)


def anchor_logits(anchor, input_ids: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[L, vocab]`` logits of the frozen ``anchor`` at the labelled rows of ``targets`` (row-major, the order
    ``labelled_cross_entropy`` gathers them in), from its plain causal forward with positions ``0..n-1``."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    with torch.no_grad():
        hidden = anchor.model(input_ids=input_ids, attention_mask=valid.long(), position_ids=positions,
                              use_cache=False).last_hidden_state  # [b, n, d]
        return head_logits(anchor.lm_head, hidden[targets != IGNORE_INDEX])


def _anchored_mars_loss(hidden, m, targets_noisy, targets, lm_head, s: MarsLossSettings, n_labels,
                        anchor: torch.Tensor) -> LossOutput:
    """``mars_loss``'s terms with the clean stream pulled toward the anchor's distribution ``anchor`` ``[L, vocab]``."""
    loss_mask = labelled_cross_entropy(hidden[:, :m], targets_noisy, lm_head, s.mask_label_smoothing)
    rows = targets != IGNORE_INDEX
    clean = head_logits(lm_head, hidden[:, m:][rows])  # [L, vocab]
    loss_ar = F.cross_entropy(clean, targets[rows])
    w = s.anchor_weight
    loss = loss_mask + s.ar_weight * ((1 - w) * loss_ar + w * soft_target_loss(clean, anchor))
    return LossOutput(loss, loss_mask.detach(), loss_ar.detach(), n_labels)


def _hard_mars_loss(hidden, m, targets_noisy, targets, lm_head, s: MarsLossSettings, n_labels) -> LossOutput:
    """``mars_loss``'s hard-target terms from the ``[b, m + n, d]`` hidden states of ``[noisy | clean]``."""
    loss_mask = labelled_cross_entropy(hidden[:, :m], targets_noisy, lm_head, s.mask_label_smoothing)
    if s.ar_weight == 0.0:
        # The ablation (paper Table 2): no gradient from the clean stream; its CE
        # is still reported so the run's metrics stay comparable.
        with torch.no_grad():
            loss_ar = labelled_cross_entropy(hidden[:, m:].detach(), targets, lm_head)
        return LossOutput(loss_mask, loss_mask.detach(), loss_ar, n_labels)
    loss_ar = labelled_cross_entropy(hidden[:, m:], targets, lm_head)
    loss = loss_mask + s.ar_weight * loss_ar
    return LossOutput(loss, loss_mask.detach(), loss_ar.detach(), n_labels)


def _frozen_clean_forward(model, ids: torch.Tensor, positions: torch.Tensor, attn: torch.Tensor,
                          m: int) -> torch.Tensor:
    """``[b, m + n, d]`` hidden states of ``[noisy | clean]`` in two forwards: the clean half without a graph (its
    keys and values kept in a cache), then the noisy half reading that cache. The noisy rows' mask is the joint
    mask's with its key columns reordered to the cache's [clean | noisy]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        clean = model.model(input_ids=ids[:, m:], attention_mask=model_attention_mask(model, attn[:, :, m:, m:]),
                            position_ids=positions[:, m:], cache=cache, use_cache=True).last_hidden_state
    noisy_attn = torch.cat([attn[:, :, :m, m:], attn[:, :, :m, :m]], dim=-1)  # [b, 1, m, n + m]
    noisy = model.model(input_ids=ids[:, :m], attention_mask=model_attention_mask(model, noisy_attn),
                        position_ids=positions[:, :m], cache=cache, use_cache=True).last_hidden_state
    return torch.cat([noisy, clean], dim=1)


def _soft_mars_loss(hidden, m, targets_noisy, targets, lm_head, s: MarsLossSettings, n_labels) -> LossOutput:
    """``mars_loss`` with a soft mask target: the clean logits are the teacher whatever ``ar_weight`` is."""
    mask_term, hard, loss_ar = mask_stream_loss(hidden[:, :m], hidden[:, m:], targets_noisy, targets, lm_head,
                                                s.soft_weight, s.soft_top_k, s.mask_label_smoothing)
    loss = mask_term + s.ar_weight * loss_ar if s.ar_weight else mask_term
    return LossOutput(loss, hard.detach(), loss_ar.detach(), n_labels)
