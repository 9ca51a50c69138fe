"""``python -m finetune.train ... --dry-run``: what a run would do and need, printed before anything is trained.

The plan: optimizer steps, tokens, the estimated memory of one process for the chosen ``--sharding`` (parameters,
gradients, Adam states, what FSDP gathers, activations with and without ``--gradient-checkpointing``, the LM head's
logits), and the size of one checkpoint. No weights are loaded: the model is built on PyTorch's meta device from
its config.json (a local folder, the Hugging Face cache, or the shapes below), so counting the parameters of
Qwen2.5-7B takes a second on a laptop. Each formula is printed beside its number.

The activation formula counts, per token and decoder layer, the values autograd keeps for a Llama/Qwen2 layer's
backward pass with SDPA (no attention matrix), as tests/test_dry_run.py measures them on a tiny Qwen2: the two RMS
norms' inputs and scaled outputs and the projections' input (5h), five tensors as wide as q (q = heads x head_dim;
among them k and v, which reach SDPA repeated to every head, and the attention output), and the MLP's gate, up,
act(gate) and product (4I), each in the compute dtype; and the attention mask as SDPA keeps it, one [seq x seq]
matrix a sequence (seq = 2n for MARS's [noisy | clean], n for AR-SFT). With gradient
checkpointing a layer keeps only its input (h) and one layer is recomputed at a time. MARS trains on
[noisy | clean], up to twice the example's tokens; the noisy copies of prompt-only blocks are left out, so the
count is an upper bound. These are estimates: allocator fragmentation and the CUDA context (~1 GB) come on top.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from finetune.config import TrainConfig

GB = 1e9
# Architectures of the paper's models (their config.json on the Hugging Face Hub), for a plan on a machine that has
# not downloaded them; a local folder or the Hugging Face cache is read first.
QWEN25_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=32768)
QWEN25_7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                 max_position_embeddings=32768)
KNOWN_SHAPES = {"Qwen/Qwen2.5-0.5B": QWEN25_05B, "Qwen/Qwen2.5-0.5B-Instruct": QWEN25_05B,
                "Qwen/Qwen2.5-7B": QWEN25_7B, "Qwen/Qwen2.5-7B-Instruct": QWEN25_7B}


def model_config(base_model: str):
    """(transformers config, where it came from) of --base-model, without its weights."""
    from transformers import AutoConfig

    from mars_core.models.sources import resolve_source

    kind, where = resolve_source(base_model)
    if kind == "dir":
        return AutoConfig.from_pretrained(where), f"{where}/config.json"
    if kind == "hub":
        try:
            return AutoConfig.from_pretrained(where, local_files_only=True), f"{where} (Hugging Face cache)"
        except OSError:
            if where in KNOWN_SHAPES:
                shape = dict(KNOWN_SHAPES[where])
                return AutoConfig.for_model(shape.pop("model_type"), **shape), f"{where} (finetune.plan.KNOWN_SHAPES)"
    raise ValueError(f"--dry-run reads the model's config.json, and {base_model!r} ({kind}) has none on this machine: "
                     f"pass a checkpoint folder or one of {', '.join(KNOWN_SHAPES)}")


def meta_module(cfg: TrainConfig, config) -> nn.Module:
    """The model as finetune.train would train it (LoRA, frozen parts), on the meta device: shapes only."""
    from transformers import AutoModelForCausalLM

    from finetune.train_model import prepare_model

    with torch.device("meta"):
        return prepare_model(AutoModelForCausalLM.from_config(config), cfg, None)


@dataclass
class Counts:
    total: int       # parameters of the model (LoRA's included)
    trainable: int   # what AdamW updates (+ the mask row)
    layer: int       # the largest decoder layer: what FSDP gathers at a time
    root: int        # what is not in a decoder layer (embeddings, LM head, final norm): the root FSDP unit
    adapter: int     # LoRA's parameters (0 without --lora): not in the merged model.safetensors


def count(model: nn.Module, cfg: TrainConfig) -> Counts:
    from finetune.sharding import decoder_layers

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = {id(p): p for p in model.parameters()}   # a tied head counts once
    total = sum(p.numel() for p in params.values())
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    if cfg.train_mask_row:
        trainable += lm.config.hidden_size
    layers = decoder_layers(lm)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    layer = max(sum(p.numel() for p in m.parameters()) for m in layers)
    root = sum(p.numel() for i, p in params.items() if i not in in_layers)
    adapter = sum(p.numel() for p in params.values() if p.requires_grad) if cfg.lora else 0
    return Counts(total, trainable, layer, root, adapter)


def example_stats(cfg: TrainConfig, plan_examples: int | None) -> tuple[int, float, str]:
    """(examples, mean tokens an example, where those came from)."""
    if plan_examples is not None:
        return plan_examples, float(cfg.max_length), f"--plan-examples {plan_examples}, each at --max-length"
    if cfg.data != "builtin" and not Path(cfg.data).expanduser().is_file():
        raise ValueError(f"--data {cfg.data!r} is not on this machine: pass --plan-examples N (the number of "
                         "examples it holds) to plan without it")
    from finetune.data import build_examples, load_conversations

    tokenizer, eos_ids = tokenizer_and_eos(cfg.base_model)
    conversations = load_conversations(cfg.data, cfg.builtin_examples, cfg.seed, cfg.builtin_weights)
    examples = build_examples(conversations, tokenizer, max_length=cfg.max_length, eos_ids=eos_ids,
                              block_size=cfg.block_size if cfg.stage == "mars" else None, overlong=cfg.overlong)
    return len(examples), sum(len(e.input_ids) for e in examples) / len(examples), f"--data {cfg.data} tokenised"


def tokenizer_and_eos(base_model: str):
    """(tokenizer, end-of-turn ids) of --base-model as the run will have them (mars_core.load_model's), without
    loading its weights."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer, GenerationConfig

    from mars_core.models.sources import resolve_source
    from mars_core.models.tokens import end_of_turn_ids

    _, where = resolve_source(base_model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True)
    except Exception:
        raise ValueError(f"--dry-run tokenises --data with {base_model!r}'s tokenizer, which is not on this machine: "
                         "pass --plan-examples N to plan without it") from None
    try:
        generation = GenerationConfig.from_pretrained(where, local_files_only=True)
    except OSError:   # no generation_config.json: the tokenizer's eos alone, as for the loaded model
        generation = None
    return tokenizer, end_of_turn_ids(tokenizer, SimpleNamespace(generation_config=generation))


def query_width(config) -> int:
    """q's width: heads x head_dim (the hidden size for Llama and Qwen2)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim


def layer_values_per_token(config) -> int:
    """Values a decoder layer keeps for its backward pass, per token: 5h + 5q + 4I (see the module docstring)."""
    return 5 * config.hidden_size + 5 * query_width(config) + 4 * config.intermediate_size


def layer_bytes(config, batch: int, seq: int, value_bytes: int) -> int:
    """What one decoder layer keeps for its backward pass over ``batch`` sequences of ``seq`` positions."""
    return value_bytes * (batch * seq * layer_values_per_token(config) + batch * seq * seq)


def gb(n: float) -> str:
    return f"{n / GB:,.2f} GB"


def plan_lines(cfg: TrainConfig, processes: int, plan_examples: int | None) -> list[str]:
    config, source = model_config(cfg.base_model)
    c = count(meta_module(cfg, config), cfg)
    sharded = cfg.sharding != "no"
    cb = 2 if cfg.mixed_precision in ("bf16", "fp16") else 4          # compute dtype's bytes
    streams = 2 if cfg.stage == "mars" else 1
    mem = _fixed_memory(c, processes, sharded, cb)
    lines = _run_lines(cfg, config, c, source, processes, plan_examples, streams)
    lines.append(f"memory per process, --sharding {cfg.sharding}, --mixed-precision {cfg.mixed_precision} "
                 f"({cb} B a compute value):")
    lines += [f"  {name:<26} {gb(value):>12}   {formula}" for name, (value, formula) in mem.items()]
    lines += _activation_lines(cfg, config, cb, streams, sum(v for v, _ in mem.values()))
    lines += _checkpoint_lines(cfg, c, processes, sharded)
    return lines


def _run_lines(cfg: TrainConfig, config, c, source: str, processes: int, plan_examples: int | None,
               streams: int) -> list[str]:
    """The plan's head: the model, the data, the batches and the steps the run will make."""
    n_examples, mean_len, data_source = example_stats(cfg, plan_examples)
    from finetune.schedule import schedule

    P, b = processes, cfg.batch_size
    global_batch = b * P * cfg.grad_accum
    micro_per_epoch, steps = schedule(cfg, n_examples, P)   # what the run itself will compute
    tokens = steps * global_batch * mean_len
    return [
        f"plan for {cfg.stage} on {cfg.base_model} (architecture from {source})",
        f"  parameters {c.total:,}, trainable {c.trainable:,}; decoder layers {config.num_hidden_layers}, "
        f"largest {c.layer:,}; outside the layers {c.root:,}",
        f"  data: {n_examples:,} examples, {mean_len:,.1f} tokens each on average ({data_source})",
        f"  processes {P}, --batch-size {b} x --grad-accum {cfg.grad_accum} x {P} = global batch {global_batch}; "
        f"{micro_per_epoch:,} micro-batches an epoch",
        f"  optimizer steps {steps:,} ({'--max-steps' if cfg.max_steps else f'--epochs {cfg.epochs:g}'}); "
        f"tokens {tokens:,.0f} (steps x global batch x mean tokens)"
        + (f", {streams * tokens:,.0f} positions through the model ([noisy | clean])" if streams == 2 else ""),
    ]


def _fixed_memory(c, processes: int, sharded: bool, cb: int) -> dict[str, tuple[float, str]]:
    """{what: (bytes per process, formula)} of the memory that does not grow with the batch."""
    P = processes
    share = P if sharded else 1
    mem = {
        "parameters (fp32)": (4 * c.total / share, f"4 B x {c.total:,}" + (f" / {P}" if sharded else "")),
        "gradients (fp32)": (4 * c.trainable / share,
                             f"4 B x {c.trainable:,} trainable" + (f" / {P}" if sharded else "")),
        "Adam moments (fp32)": (8 * c.trainable / share, f"8 B x {c.trainable:,}" + (f" / {P}" if sharded else "")),
    }
    if sharded:
        mem["gathered by FSDP"] = (cb * (2 * c.layer + c.root) + 4 * c.layer,
                                   f"{cb} B x (2 x {c.layer:,} layer, prefetched + {c.root:,} root) + 4 B x "
                                   f"{c.layer:,} unsharded gradient")
    elif cb == 2:
        mem["autocast weight copies"] = (2 * c.total, f"2 B x {c.total:,}")
    return mem


def _activation_lines(cfg: TrainConfig, config, cb: int, streams: int, fixed: float) -> list[str]:
    """Activations and logits per micro-batch, and the totals with and without gradient checkpointing."""
    b, n = cfg.batch_size, cfg.max_length
    h, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    q, inter = query_width(config), config.intermediate_size
    rows = streams * b * n                                            # positions in one micro-batch, at most
    seq = streams * n
    act_layer = layer_bytes(config, b, seq, cb)
    act_full = L * act_layer
    act_ckpt = rows * L * cb * h + act_layer
    logits = rows * V * (cb + 4 + 4)
    return [
        f"  {'activations':<26} {gb(act_full):>12}   layers x {cb} B x (rows x (5h + 5q + 4I) + batch x seq^2) = {L} x "
        f"{cb} x ({rows:,} x (5 x {h} + 5 x {q} + 4 x {inter}) + {b} x {seq:,}^2); rows = batch x seq = {b} x "
        f"{streams} streams x {n}",
        f"  {'  with checkpointing':<26} {gb(act_ckpt):>12}   rows x layers x {cb} B x h + one layer recomputed",
        f"  {'logits (labelled rows)':<26} {gb(logits):>12}   rows x vocab x ({cb} + 4 + 4) B = {rows:,} x {V:,} x "
        f"{cb + 8} (the head's output, fp32 copy, its gradient); at most",
        f"  {'total':<26} {gb(fixed + act_full + logits):>12}   without --gradient-checkpointing"
        + ("  <- this run" if not cfg.gradient_checkpointing else ""),
        f"  {'total':<26} {gb(fixed + act_ckpt + logits):>12}   with --gradient-checkpointing"
        + ("  <- this run" if cfg.gradient_checkpointing else ""),
    ]


def _checkpoint_lines(cfg: TrainConfig, c, processes: int, sharded: bool) -> list[str]:
    """What each checkpoint weighs on disk."""
    model_file = 4 * (c.total - c.adapter)   # LoRA merged: the base's size
    state = (12 if sharded or cfg.lora else 8) * c.trainable
    return [
        f"checkpoint: {gb(model_file + state)} each (--keep-checkpoints {cfg.keep_checkpoints}): model.safetensors "
        f"{gb(model_file)} (fp32, consolidated{', LoRA merged' if cfg.lora else ''}) + "
        + (f"sharded/ {gb(state)} (torch.distributed.checkpoint: trainable parameters 4 B + Adam 8 B, {processes} "
           "files)"
           if sharded else f"trainer_state.pt {gb(state)} (Adam 8 B a trainable parameter"
                           + (", the adapter and mask row 4 B)" if cfg.lora else ")")),
    ]


def print_plan(cfg: TrainConfig, plan_examples: int | None = None, processes: int | None = None) -> int:
    """Print the plan (the main process only, under a launcher); returns 0."""
    processes = processes or int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.sharding != "no" and processes < 2:
        raise ValueError(f"--sharding {cfg.sharding} plans for 2 or more processes but this has {processes}: pass "
                         "--plan-processes N (or run the dry run under the launcher)")
    lines = plan_lines(cfg, processes, plan_examples)
    if int(os.environ.get("RANK", "0")) == 0:
        print("\n".join(lines), file=sys.stdout, flush=True)
    return 0
