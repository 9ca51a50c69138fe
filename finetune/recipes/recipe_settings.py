"""The recipe's model shape and stage settings (finetune.recipes.recipe), and what its evaluation times.

Apart from finetune.recipes.recipe so that finetune.recipes.model_cards can quote them without importing the recipe,
which writes the cards.
"""

from __future__ import annotations

# The settings below were chosen by measurement on a 2-core CPU; the runs behind each choice, with their
# numbers and commands, are in docs/experiments.md (the section named next to each).

# Model shape: a wider model was slower per step and learnt less per step ("Choosing the recipe's settings").
MODEL = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=6, max_position_embeddings=512, rope_theta=10000.0)
VOCAB_SIZE = 512

# Stage settings (flags of finetune.train). Every example is drawn fresh (one epoch).
# bf16 autocast with eager attention makes steps ~1.7x faster here and learnt stage 2 as well as fp32, so stage 2
# uses it and spends the time on more steps; stage 1 stays fp32, where bf16 learnt sorting worse
# ("Training on a CPU: bf16 and torch.compile").
FAST = dict(mixed_precision="bf16", attention="eager")
AR_SFT = dict(stage="ar-sft", lr=2e-3, warmup_steps=100, max_steps=3500, batch_size=32, builtin_examples=112000,
              weight_decay=0.1, min_lr_ratio=0.05)
# A second, shorter cosine cycle from the first one's weights on fresh data (seed + 1), drawing the families that
# lag at the end of the first cycle more often. It is short so that the recipe fits its hour with stage 2's
# steps ("Recipe time").
AR_SFT_2 = dict(stage="ar-sft", lr=1e-3, warmup_steps=50, max_steps=1000, batch_size=32, builtin_examples=32000,
                weight_decay=0.1, min_lr_ratio=0.05, builtin_weights="sorting=3,multiplication=2,word_problem=2",
                seed_offset=1)
# Stage 2: the families that lean on look-ups in the prompt are drawn more often ("Choosing the recipe's
# settings"). The AR baseline (ar-sft-3) gets the same steps on the same draw: the paper compares MARS with AR-SFT
# on the same data, and these AR steps alone lift the stage-1 model a long way, so comparing MARS with the
# stage-1 model would flatter it ("Measured: the shipped tiny models").
STAGE2 = dict(lr=1e-3, warmup_steps=30, max_steps=3000, batch_size=32, builtin_examples=96000, weight_decay=0.1,
              min_lr_ratio=0.1, builtin_weights="word_problem=3,compare=3,sorting=3,units=2,reverse=2", seed_offset=2,
              compile=True, **FAST)   # compile: unless --compile says otherwise (finetune.recipes.recipe.CXX)
AR_SFT_3 = dict(stage="ar-sft", **STAGE2)
# ar_weight 5, not the paper's 1: at this size the mask loss competes with the one-token path, and weighting the
# AR term up keeps it. The block grid is shifted by a random r in [0, B) at every step (not in the paper): on a
# fixed grid the tiny model learns the grid's phase, while the decoder puts its masks at any phase ("Block phase").
MARS = dict(stage="mars", block_size=4, ar_weight=5.0, random_block_offset=True, **STAGE2)
ABLATION = dict(MARS, ar_weight=0.0)   # the paper's "no SFT loss"

TIMING_PROMPTS = 8   # held-out prompts timed at batch 1 for the model cards' speedup column
# The stage-1 checkpoint's own rows for the AR card. The recipe does not evaluate stage 1 itself (one more
# evaluation in the hour); write them with `python -m finetune.evals.evaluate --models WORK/tiny-ar-sft-2/final
# --n 400 --taus 1.0 --timing-prompts 0 --json WORK/eval-stage1.json`, and the card quotes them.
STAGE1_ROWS = "eval-stage1.json"
