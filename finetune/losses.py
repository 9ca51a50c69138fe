"""MARS and AR-SFT losses as pure functions (MARS_SPEC.md, "Training").

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

Loss: ``CE(noisy) + ar_weight * CE(clean)``, each the mean over labelled
tokens, with the usual causal shift inside each half. Logits are computed only
for the rows that carry a label: the hidden states of those rows are gathered
first and only then multiplied by the LM head (a vocab-sized matmul per
position is most of the cost of a small model's forward).

The model is any stock transformers causal LM with ``.model`` (the decoder,
returning ``last_hidden_state``) and ``.lm_head`` - Llama, Qwen2, SmolLM2. A
4D boolean ``attention_mask`` with explicit ``position_ids`` goes through SDPA
unchanged, so no custom model class is needed.
"""

from __future__ import annotations

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


def mars_attention_mask(n: int, block_size: int) -> torch.Tensor:
    """Boolean ``[2n, 2n]`` mask over ``[noisy | clean]``; rows are queries."""
    if n < 1 or block_size < 1:
        raise ValueError(f"need n >= 1 and block_size >= 1, got n={n}, block_size={block_size}")
    q = torch.arange(n).unsqueeze(1)  # [n, 1]
    k = torch.arange(n).unsqueeze(0)  # [1, n]
    causal = k <= q  # [n, n]
    same_block = (q // block_size) == (k // block_size)
    earlier_block = (k // block_size) < (q // block_size)
    noisy_rows = torch.cat([same_block & causal, earlier_block], dim=1)  # [n, 2n]
    clean_rows = torch.cat([torch.zeros(n, n, dtype=torch.bool), causal], dim=1)  # [n, 2n]
    return torch.cat([noisy_rows, clean_rows], dim=0)  # [2n, 2n]


def batched_mars_attention_mask(valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[b, 1, 2n, 2n]`` MARS mask that also hides padded keys.

    ``valid`` is ``[b, n]`` bool (True = real token). Padding is found from this
    mask only, never from token ids (pad may equal eos). Every query may attend
    to itself so a padded row is never fully masked (an all-False row makes
    SDPA return NaN); real rows already attend to themselves, so they are
    unchanged.
    """
    b, n = valid.shape
    base = mars_attention_mask(n, block_size).to(valid.device)  # [2n, 2n]
    keys = torch.cat([valid, valid], dim=1)  # [b, 2n]
    mask = base.unsqueeze(0) & keys.unsqueeze(1)  # [b, 2n, 2n]
    mask |= torch.eye(2 * n, dtype=torch.bool, device=valid.device).unsqueeze(0)
    return mask.unsqueeze(1)  # [b, 1, 2n, 2n]


def noisy_input_ids(input_ids: torch.Tensor, labels: torch.Tensor, mask_id: int) -> torch.Tensor:
    """The noisy stream: every response (labelled) token replaced by ``mask_id``."""
    return torch.where(labels != IGNORE_INDEX, torch.full_like(input_ids, mask_id), input_ids)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``targets[:, i] = labels[:, i + 1]``: the output at i predicts token i+1."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


def labelled_cross_entropy(hidden: torch.Tensor, targets: torch.Tensor, lm_head) -> torch.Tensor:
    """Mean CE over rows whose target is not -100, running the LM head on those rows only.

    ``hidden`` is ``[b, n, d]``, ``targets`` ``[b, n]`` (already shifted).
    """
    rows = targets != IGNORE_INDEX  # [b, n]
    h = hidden[rows]  # [m, d]
    logits = lm_head(h).float()  # [m, vocab]
    return F.cross_entropy(logits, targets[rows])


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
    input_ids: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, mask_id: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Model inputs for the dual stream: ids ``[b, 2n]``, positions ``[b, 2n]``, mask ``[b, 1, 2n, 2n]``."""
    b, n = input_ids.shape
    ids = torch.cat([noisy_input_ids(input_ids, labels, mask_id), input_ids], dim=1)  # [b, 2n]
    half = torch.arange(n, device=input_ids.device)
    positions = torch.cat([half, half]).expand(b, 2 * n)  # [b, 2n]
    return ids, positions, batched_mars_attention_mask(valid, block_size)


def mars_loss(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    *,
    block_size: int,
    mask_id: int,
    ar_weight: float = 1.0,
) -> LossOutput:
    """``L = CE(noisy, labels) + ar_weight * CE(clean, labels)`` in one forward of length 2n."""
    n = input_ids.shape[1]
    targets = shift_labels(labels)
    n_labels = int((targets != IGNORE_INDEX).sum())
    assert n_labels > 0, "batch has no labelled tokens"
    ids, positions, attn = mars_inputs(input_ids, labels, valid, mask_id, block_size)
    hidden = model.model(
        input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=False
    ).last_hidden_state  # [b, 2n, d]
    loss_mask = labelled_cross_entropy(hidden[:, :n], targets, model.lm_head)
    if ar_weight == 0.0:
        # The ablation (paper Table 2): no gradient from the clean stream; its CE
        # is still reported so the run's metrics stay comparable.
        with torch.no_grad():
            loss_ar = labelled_cross_entropy(hidden[:, n:].detach(), targets, model.lm_head)
        return LossOutput(loss_mask, loss_mask.detach(), loss_ar, n_labels)
    loss_ar = labelled_cross_entropy(hidden[:, n:], targets, model.lm_head)
    loss = loss_mask + ar_weight * loss_ar
    return LossOutput(loss, loss_mask.detach(), loss_ar.detach(), n_labels)
