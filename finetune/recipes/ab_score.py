"""How finetune.recipes.ab scores one trained arm: the mask stream on held-out examples, and decoding on development
prompts.

- ``mask_metrics``: teacher-forced, one [noisy | clean] forward per batch and block grid offset (every offset
  r in [0, B), so every position is seen in every slot): the hard mask CE as training logs it (``loss_mask``), the
  clean stream's CE, and the per-slot agreement of the mask top-1 with AR's top-1 — the clean stream's argmax at
  the same target, i.e. the token this model's own one-token decoding would write after the same prefix. Slot j
  is the j-th mask after the last real token (q_j of docs/algorithm.md, "Inference"); slot B, the last mask's
  output, is never used by the decoder and is left out of the agreement.
- ``decode_metrics``: tokens/forward of lossless MARS (verify) and lossy MARS on development prompts, and how
  much of each lossy answer matches the lossless one (which is AR's answer, up to bf16 rounding).
- ``trained_model``: an arm's final weights as a module to score: the merged checkpoint, or for a gated adapter
  the base model with the adapter and its position gate (a merged checkpoint would apply the delta everywhere).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from finetune.data import Example, collate
from finetune.losses import (
    IGNORE_INDEX,
    first_noisy_block_start,
    mars_inputs,
    model_attention_mask,
    shift_labels,
)


def mask_slots(labels: torch.Tensor, block_size: int, block_offset: int) -> torch.Tensor:
    """``[b, n]`` slot of each noisy position: how many masks, this one included, follow the last real token in
    its block (0 where the noisy input is a real token). The output there predicts the token ``slot`` places
    after the one AR predicts next."""
    is_mask = labels != IGNORE_INDEX  # the noisy stream masks exactly the labelled tokens
    slots = torch.zeros_like(labels)
    run = torch.zeros(labels.shape[0], dtype=labels.dtype)
    for i in range(labels.shape[1]):
        if (i + block_offset) % block_size == 0:
            run = torch.zeros_like(run)  # a new block: nothing of it is committed yet
        run = torch.where(is_mask[:, i], run + 1, torch.zeros_like(run))
        slots[:, i] = run
    return slots


class MaskTally:
    """Sums over batches and offsets: CE numerators, label count, per-slot agreements."""

    def __init__(self, block_size: int):
        self.ce_mask = self.ce_ar = 0.0
        self.labels = 0
        self.agree = [0] * block_size  # index j: slot j (0 unused)
        self.seen = [0] * block_size

    def result(self) -> dict:
        n = max(self.labels, 1)
        agree = {f"slot{j}": self.agree[j] / self.seen[j] for j in range(1, len(self.seen)) if self.seen[j]}
        return {"mask_ce": self.ce_mask / n, "ar_ce": self.ce_ar / n, "agreement": agree, "labels": self.labels}


@torch.no_grad()
def tally_batch(model, batch: dict, mask_id: int, block_size: int, offset: int, tally: MaskTally) -> None:
    """One [noisy | clean] forward (as finetune.losses.mars_loss builds it) added to ``tally``."""
    input_ids, labels, valid = batch["input_ids"], batch["labels"], batch["valid"]
    n = input_ids.shape[1]
    start = first_noisy_block_start(labels, block_size, offset)
    ids, positions, attn = mars_inputs(input_ids, labels, valid, mask_id, block_size, start, offset)
    hidden = model.model(input_ids=ids, attention_mask=model_attention_mask(model, attn), position_ids=positions,
                         use_cache=False).last_hidden_state  # [b, m + n, d]
    m = n - start
    targets = shift_labels(labels)  # [b, n]
    rows = targets[:, start:] != IGNORE_INDEX  # [b, m]; the same (row, position) pairs as the clean rows
    student = model.lm_head(hidden[:, :m][rows]).float()  # [L, vocab]
    teacher = model.lm_head(hidden[:, m:][targets != IGNORE_INDEX]).float()  # [L, vocab]
    gold = targets[:, start:][rows]
    tally.ce_mask += float(F.cross_entropy(student, gold, reduction="sum"))
    tally.ce_ar += float(F.cross_entropy(teacher, gold, reduction="sum"))
    tally.labels += int(gold.numel())
    slots = mask_slots(labels, block_size, offset)[:, start:][rows]  # [L]
    same = student.argmax(-1) == teacher.argmax(-1)
    for j in range(1, block_size):
        hit = slots == j
        tally.agree[j] += int((same & hit).sum())
        tally.seen[j] += int(hit.sum())


def mask_metrics(model, examples: list[Example], mask_id: int, pad_id: int, block_size: int = 4,
                 batch_size: int = 8) -> dict:
    """Held-out mask CE, AR CE (nats per label) and per-slot agreement, over every block grid offset."""
    if not examples:
        raise ValueError("no held-out examples to score: raise --dev-examples")
    was_training = model.training
    model.eval()
    tally = MaskTally(block_size)
    for offset in range(block_size):
        for i in range(0, len(examples), batch_size):
            tally_batch(model, collate(examples[i: i + batch_size], pad_id), mask_id, block_size, offset, tally)
    model.train(was_training)
    return tally.result()


def decode_metrics(lm, prompts: list[str], *, lossless_tau: float = 0.3, lossy_tau: float = 0.95,
                   block_size: int = 4, max_new_tokens: int = 128, batch_size: int = 16) -> dict:
    """Tokens/forward (mean over sequences) of lossless and lossy MARS, and the lossy answers' agreement with the
    lossless ones (share identical, mean share of tokens before the first difference)."""
    from finetune.evals.evaluate_common import decode_batches
    from finetune.evals.evaluate_natural import agreement, mean_tokens_per_forward
    from mars_core import DecodeConfig

    ids = [lm.encode(p) for p in prompts]
    out = {}
    for name, mode, tau in (("lossless", "verify", lossless_tau), ("lossy", "mars", lossy_tau)):
        cfg = DecodeConfig(mode=mode, tau=tau, block_size=block_size, max_new_tokens=max_new_tokens)
        out[name] = decode_batches(lm, ids, cfg, batch_size)
    same, prefix = agreement([r.token_ids for r in out["lossy"]], [r.token_ids for r in out["lossless"]])
    return {"lossless_tpf": mean_tokens_per_forward(out["lossless"]),
            "lossy_tpf": mean_tokens_per_forward(out["lossy"]),
            "lossy_same_answer": same, "lossy_prefix_share": prefix,
            # per prompt, so two arms can be compared prompt by prompt (paired), not only by their means
            "lossless_tpf_each": [r.tokens_per_forward for r in out["lossless"]],
            "lossy_tpf_each": [r.tokens_per_forward for r in out["lossy"]],
            "lossless_answers": [r.text for r in out["lossless"]]}


def trained_model(checkpoint: Path, base) -> torch.nn.Module:
    """The fp32 model ``checkpoint`` (a finetune.train checkpoint dir) holds, on ``base`` (train_model.Base). A
    gated run's adapter is applied as mars_core serves it (mars_core.engine.gated: the deltas at mask positions, the
    mask row in the input embedding only)."""
    from finetune.checkpoint import STATE_FILE, load_weights
    from finetune.config import TrainConfig
    from mars_core.models.adapter import peft_modules
    from mars_core.engine.gated import apply_gated

    cfg = TrainConfig.from_dict(__import__("json").loads((checkpoint / "train_config.json").read_text()))
    if not cfg.gated_lora:
        return load_weights(checkpoint).eval()
    state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=False)
    model = base.model.float().eval()
    model.set_attn_implementation("sdpa")
    apply_gated(model, {"mask_id": base.mask_id, "r": cfg.lora_r, "alpha": cfg.lora_alpha, "base": cfg.base_model},
                peft_modules(state["lora"], cfg.lora_r), state.get("mask_row"), str(checkpoint / STATE_FILE))
    return model
