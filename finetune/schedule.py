"""A training run's schedule: how many steps, the learning rate at each, and the block grid's offset per micro-batch.

Pure functions of the TrainConfig (and the data and process counts): the loop (finetune.train) and the dry-run plan
(finetune.plan) compute the same numbers from here.
"""

from __future__ import annotations

import math
import random

from finetune.config import TrainConfig


def block_offset_at(cfg: TrainConfig, index: int) -> int:
    """The block grid's offset for micro-batch `index`: 0 (the paper's grid), or with --random-block-offset a draw in
    [0, B) that depends only on the seed and the index, so a resumed run and every process agree on it."""
    if not (cfg.random_block_offset and cfg.stage == "mars"):
        return 0
    return random.Random(cfg.seed * 1_000_003 + index).randrange(cfg.block_size)


def get_lr(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine/linear/constant decay."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if cfg.decay == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    min_lr = cfg.lr * cfg.min_lr_ratio
    if cfg.decay == "cosine":
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)
    return cfg.lr - progress * (cfg.lr - min_lr)


def schedule(cfg: TrainConfig, n_examples: int, num_processes: int) -> tuple[int, int]:
    """(micro-batches per epoch, optimizer steps in the run)."""
    global_batch = cfg.batch_size * num_processes
    micro_per_epoch = n_examples // global_batch
    if micro_per_epoch < 1:
        raise ValueError(
            f"{n_examples} examples are fewer than one global batch of {global_batch} "
            f"(--batch-size {cfg.batch_size} x {num_processes} processes): lower --batch-size or add data"
        )
    return micro_per_epoch, cfg.max_steps or max(1, math.ceil(cfg.epochs * micro_per_epoch / cfg.grad_accum))
