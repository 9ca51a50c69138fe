"""Fine-tune a causal LM with AR-SFT (stage 1) or MARS (stage 2): ``python -m finetune.train``.

    python -m finetune.train --base-model tiny-ar-sft --data builtin --stage mars \\
        --block-size 4 --lr 5e-6 --epochs 5 --output-dir runs/mars

The same command under ``accelerate launch --multi_gpu --num_processes N --num_machines 1`` runs
data-parallel: each process takes its own slice of every global batch.

Run directory (``--output-dir``; the app reads it while training runs):
- ``train_config.json``: the resolved TrainConfig
- ``status.json``: state (running | finished | stopped | failed), step, max_steps, pid, pid_started,
  started_at, updated_at, eta_s, last_checkpoint, error (``finetune.status.RunStatus``). "finished" means
  step == max_steps; read it with ``read_status``, which reports a "running" whose process is gone
  (SIGKILL) as "interrupted"
- ``metrics.jsonl``: one line per logged step: step, loss (the optimised total), loss_mask
  (noisy-stream CE; null for AR-SFT), loss_ar (clean-stream CE; reported even when
  ar_weight = 0), lr, tokens_per_s (real example tokens, all processes, per second since the
  previous line), elapsed (training seconds, resumed sessions included)
- ``checkpoint-<step>/``: a plain transformers directory (LoRA already merged) with the
  tokenizer, train_config.json, metrics.jsonl and trainer_state.pt (optimizer state,
  schedule position, step, RNG, LoRA adapter weights when --lora)

Re-running with the same ``--output-dir`` resumes from its newest complete
checkpoint: step count, optimizer state, data position and RNG continue.
SIGINT/SIGTERM: the current optimizer step finishes, a checkpoint is saved,
status becomes "stopped" and the process exits with code 0.

Shape follows nanoGPT/litgpt: ``main`` (flags, signal handlers) -> ``train``
(status bookkeeping around) ``setup`` (model, data, optimizer, resume) and
``fit`` (the loop), with small helpers.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from finetune.config import TrainConfig, config_from_args, refuse_file_above
from finetune.data import Example, build_examples, collate, epoch_batches, load_conversations, pad_id_of
from finetune.losses import ar_loss, mars_loss
from finetune.status import (
    METRICS_FILE, RunStatus, StatusWriter, failed_status, read_metrics_rows, read_status, write_json, write_status,
)

CHECKPOINT_PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.pt"


# ----------------------------------------------------------------------------- model loading


@dataclass
class Base:
    """The starting model and what the loss needs to know about its tokenizer."""

    model: nn.Module
    tokenizer: object
    mask_id: int
    eos_ids: list[int]
    path: str


def load_base(name: str) -> Base:
    """Load ``name`` through mars_core (names, dirs, GGUF; mask id per docs/algorithm.md) in fp32 on CPU."""
    from mars_core import load_model

    lm = load_model(name, device="cpu", dtype="float32", cpu_layout=False)   # stock modules: trained and saved
    return Base(lm.model, lm.tokenizer, lm.mask_id, list(lm.eos_ids), lm.path)


def load_weights(path: str | Path) -> nn.Module:
    """A checkpoint's weights (the tokenizer and mask id always come from the base model)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def add_lora(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules="all-linear",  # every projection in attention and MLP; not the LM head
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


class MaskRow(nn.Module):
    """The mask token's embedding as one trainable vector (``--train-mask-row``).

    Forward hooks put it in place of the embedding's row wherever the input holds ``mask_id`` and, when the
    LM head is tied to the embedding, in place of the head's logit column for ``mask_id``, so training sees
    exactly the model that ``write_into`` produces at save time.
    """

    def __init__(self, lm: nn.Module, mask_id: int):
        super().__init__()
        embedding = lm.get_input_embeddings()
        self.mask_id = mask_id
        self.row = nn.Parameter(embedding.weight[mask_id].detach().float().clone())
        embedding.register_forward_hook(self._embed)
        head = lm.get_output_embeddings()
        self.tied = head is not None and head.weight is embedding.weight
        if self.tied:
            head.register_forward_hook(self._head)

    def _embed(self, module, args, output):
        hit = (args[0] == self.mask_id).unsqueeze(-1)
        return torch.where(hit, self.row.to(output.dtype), output)

    def _head(self, module, args, output):
        column = args[0] @ self.row.to(args[0].dtype)
        output = output.clone()
        output[..., self.mask_id] = column.to(output.dtype)
        return output

    @torch.no_grad()
    def write_into(self, lm: nn.Module) -> None:
        """Store the row in ``lm``'s embedding matrix (and so in a tied LM head): a plain checkpoint."""
        lm.get_input_embeddings().weight[self.mask_id] = self.row.to(lm.get_input_embeddings().weight.dtype)


class TrainModule(nn.Module):
    """Wraps the LM so that the loss runs inside ``forward``.

    Data-parallel gradient sync hooks in at the wrapper's forward; the losses call
    ``model.model`` and ``model.lm_head`` directly (logits on labelled rows only),
    so they must run inside the module that accelerate wraps.
    """

    def __init__(self, model: nn.Module, cfg: TrainConfig, mask_id: int):
        super().__init__()
        self.model = model
        self.stage, self.block_size, self.ar_weight, self.mask_id = cfg.stage, cfg.block_size, cfg.ar_weight, mask_id
        self.mask_label_smoothing = cfg.mask_label_smoothing
        self.mask_row = MaskRow(self.causal_lm(), mask_id) if cfg.train_mask_row else None

    def causal_lm(self) -> nn.Module:
        """The transformers model (with LoRA layers injected in place when training LoRA)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def forward(self, input_ids, labels, valid, block_offset: int = 0):
        lm = self.causal_lm()
        if self.stage == "mars":
            return mars_loss(
                lm, input_ids, labels, valid, block_size=self.block_size, mask_id=self.mask_id, ar_weight=self.ar_weight,
                mask_label_smoothing=self.mask_label_smoothing, block_offset=block_offset,
            )
        return ar_loss(lm, input_ids, labels, valid)


# ----------------------------------------------------------------------------- helpers


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


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on 1-D parameters (norms, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.adam_beta2), foreach=True)


def checkpoint_step(path: Path) -> int | None:
    name = path.name
    if not name.startswith(CHECKPOINT_PREFIX) or not name[len(CHECKPOINT_PREFIX) :].isdigit():
        return None
    return int(name[len(CHECKPOINT_PREFIX) :])


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints (those with trainer_state.pt), oldest first."""
    if not out.is_dir():
        return []
    found = [p for p in out.iterdir() if checkpoint_step(p) is not None and (p / STATE_FILE).is_file()]
    return sorted(found, key=checkpoint_step)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class StopFlag:
    """Set by SIGINT/SIGTERM; the loop checks it after each optimizer step. A second signal aborts at once."""

    def __init__(self):
        self.requested = False
        self.signal_name = ""

    def install(self):
        self.previous = {sig: signal.signal(sig, self.handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def uninstall(self):
        for sig, handler in getattr(self, "previous", {}).items():
            signal.signal(sig, handler)

    def handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name


# ----------------------------------------------------------------------------- setup


@dataclass
class Run:
    """Everything ``fit`` needs; built by ``setup``."""

    cfg: TrainConfig
    accelerator: object
    module: nn.Module  # prepared TrainModule (DDP-wrapped when data-parallel)
    optimizer: torch.optim.Optimizer
    tokenizer: object
    examples: list[Example]
    pad_id: int
    out: Path
    total_steps: int
    micro_per_epoch: int
    start_step: int = 0
    elapsed_before: float = 0.0  # training seconds spent in earlier (resumed) sessions
    resumed_from: str | None = None
    stop: StopFlag = field(default_factory=StopFlag)


def check_resumable(out: Path, cfg: TrainConfig) -> None:
    """Refuse to resume a run whose model- or objective-defining settings changed.

    --max-steps, --lr and the like may change (to extend a run); the base model and its adapter (lora, lora_r,
    lora_alpha, lora_dropout), the loss (stage, B, ar_weight, mask_label_smoothing, random_block_offset), the
    data and its draw (data, builtin_examples, builtin_weights, seed, max_length, overlong) and the batch may
    not: resuming a run with those changed would silently mix two trainings in one checkpoint.
    """
    saved_path = out / "train_config.json"
    if not saved_path.is_file():   # removed by hand: every checkpoint carries its own copy
        copies = [c / "train_config.json" for c in list_checkpoints(out) if (c / "train_config.json").is_file()]
        if not copies:
            return
        saved_path = copies[-1]
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{saved_path} is unreadable ({exc}): restore it, or use a new --output-dir") from None
    keys = ["base_model", "stage", "lora", "lora_r", "lora_alpha", "lora_dropout", "train_mask_row", "block_size",
            "ar_weight", "mask_label_smoothing", "random_block_offset", "data", "builtin_weights", "seed", "batch_size",
            "grad_accum", "max_length", "overlong"]
    if cfg.data == "builtin":  # the number of generated examples is the data; it means nothing for a file
        keys.append("builtin_examples")
    for key in keys:
        if key in saved and saved[key] != getattr(cfg, key):
            raise ValueError(
                f"{out} holds a run with {key}={saved[key]!r} but this run has {key}={getattr(cfg, key)!r}: "
                "use a new --output-dir, or the same settings to resume"
            )


def check_output_dir(output_dir: str) -> Path:
    """--output-dir is (or can become) a directory this process can write to; checked before any loading."""
    out = Path(output_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output-dir {output_dir!r} is a file, not a directory: pass a new or existing directory")
    refuse_file_above(out, f"--output-dir {output_dir!r}", "pass a directory path")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--output-dir {output_dir!r} cannot be written ({exc.strerror or exc}): "
                         "pass a directory you can write to") from None
    return out


MARS_ONLY_DEFAULTS = {"block_size": 4, "ar_weight": 1.0, "mask_label_smoothing": 0.0, "random_block_offset": False}


def ignored_settings(cfg: TrainConfig) -> list[str]:
    """MARS-only settings changed from their defaults in an AR-SFT run, where they do nothing."""
    if cfg.stage == "mars":
        return []
    return [f"{k}={getattr(cfg, k)!r}" for k, default in MARS_ONLY_DEFAULTS.items() if getattr(cfg, k) != default]


def preflight(cfg: TrainConfig, use_cpu: bool) -> Path:
    """Checks that need no model or data: run before anything slow, so a bad flag fails in a second."""
    if cfg.mixed_precision == "fp16" and use_cpu:
        raise ValueError("--mixed-precision fp16 needs a CUDA GPU and this run trains on the CPU: "
                         "use --mixed-precision bf16 or --mixed-precision no")
    ignored = ignored_settings(cfg)
    if ignored and int(os.environ.get("RANK", "0")) == 0:
        print(f"[finetune.train] warning: --stage ar-sft ignores the MARS-only setting(s) {', '.join(ignored)}: "
              "drop them, or use --stage mars", file=sys.stderr)
    out = check_output_dir(cfg.output_dir)
    st = read_status(out)
    if st and st.held_by_another_process():
        raise ValueError(f"--output-dir {cfg.output_dir!r} is in use by a training process that is still running "
                         f"(pid {st.pid}, step {st.step}): stop it first (SIGTERM saves a checkpoint), "
                         "or use another --output-dir")
    return out


def safetensors_readable(path: Path) -> None:
    """Raise if a .safetensors file is truncated or its header is damaged (reads every tensor: a cut-off
    file fails here, not halfway through training)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            f.get_tensor(key)


def load_resume(out: Path, checkpoints: list[Path], cfg: TrainConfig) -> tuple[Path | None, dict | None, nn.Module | None]:
    """(checkpoint, trainer state, full fine-tuning weights) of the newest intact checkpoint.

    A damaged checkpoint (unreadable trainer_state.pt, truncated model.safetensors) is skipped with a warning
    and the one before it is used; when every checkpoint is damaged the run refuses to start over silently.
    """
    skipped = []
    for ckpt in reversed(checkpoints):
        try:
            state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
            if not isinstance(state, dict) or not isinstance(state.get("step"), int):
                raise ValueError(f"{STATE_FILE} holds no step")
            for weights_file in sorted(ckpt.glob("*.safetensors")):
                safetensors_readable(weights_file)
            weights = None if cfg.lora else load_weights(ckpt)  # full fine-tuning: the checkpoint holds them
        except Exception as exc:  # any damage: this checkpoint cannot be resumed from
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"[finetune.train] warning: {ckpt} is damaged ({reason}); skipping it", file=sys.stderr)
            skipped.append(ckpt.name)
            continue
        if skipped and int(os.environ.get("RANK", "0")) == 0:
            print(f"[finetune.train] warning: resuming from the older intact {ckpt.name} instead of "
                  f"{', '.join(skipped)}", file=sys.stderr)
        return ckpt, state, weights
    raise ValueError(f"every checkpoint in {out} is damaged ({', '.join(skipped)}): delete them to start over, "
                     "or use a new --output-dir")


def setup(cfg: TrainConfig) -> Run:
    # cpu=True is what turns a torchrun-style launch without GPUs into gloo data parallelism
    # (accelerate's MULTI_CPU); `accelerate launch --cpu` alone starts a single process.
    use_cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    out = preflight(cfg, use_cpu)
    checkpoints = list_checkpoints(out)
    if checkpoints:
        check_resumable(out, cfg)

    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, cpu=use_cpu)
    set_seed(cfg.seed)

    # The data is read and validated before any model is loaded: a bad row fails in a second, naming its line.
    conversations = load_conversations(cfg.data, cfg.builtin_examples, cfg.seed, cfg.builtin_weights)
    resume, state, trained = load_resume(out, checkpoints, cfg) if checkpoints else (None, None, None)
    base = load_base(cfg.base_model)
    model = trained if trained is not None else base.model
    model.float().train()
    model.set_attn_implementation(cfg.attention)   # the losses pass eager an additive mask (finetune.losses)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    if cfg.lora:
        model = add_lora(model, cfg)
        if state is not None:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model, state["lora"])

    examples = build_examples(
        conversations,
        base.tokenizer,
        max_length=cfg.max_length,
        block_size=cfg.block_size if cfg.stage == "mars" else None,
        eos_ids=base.eos_ids,
        overlong=cfg.overlong,
    )
    global_batch = cfg.batch_size * accelerator.num_processes
    micro_per_epoch = len(examples) // global_batch
    if micro_per_epoch < 1:
        raise ValueError(
            f"{len(examples)} examples are fewer than one global batch of {global_batch} "
            f"(--batch-size {cfg.batch_size} x {accelerator.num_processes} processes): lower --batch-size or add data"
        )
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * micro_per_epoch / cfg.grad_accum))
    if state is not None and state["step"] > total_steps:
        raise ValueError(f"{resume} is at step {state['step']}, past this run's {total_steps} steps: raise "
                         "--max-steps (or --epochs) to continue it, or use a new --output-dir")
    pad_id = pad_id_of(base.tokenizer, base.eos_ids)

    module = TrainModule(model, cfg, base.mask_id)
    if state is not None and module.mask_row is not None:
        with torch.no_grad():
            module.mask_row.row.copy_(state["mask_row"])
    if cfg.compile:
        # Only the decoder's forward: the loss's row gathering has data-dependent shapes.
        decoder = module.causal_lm().model
        decoder.forward = torch.compile(decoder.forward, dynamic=True)
    optimizer = make_optimizer(module, cfg)
    module, optimizer = accelerator.prepare(module, optimizer)

    run = Run(cfg, accelerator, module, optimizer, base.tokenizer, examples, pad_id, out, total_steps, micro_per_epoch)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        run.start_step = state["step"]
        run.elapsed_before = state.get("elapsed", 0.0)
        run.resumed_from = str(resume)
    return run


# ----------------------------------------------------------------------------- batches, logging, saving


def get_batch(run: Run, micro_index: int, cache: dict) -> tuple[dict[str, torch.Tensor], int]:
    """This process's slice of global micro-batch ``micro_index`` and its real-token count.

    The slice is a pure function of (seed, micro_index), which is what makes resuming exact.
    """
    cfg, acc = run.cfg, run.accelerator
    epoch, k = divmod(micro_index, run.micro_per_epoch)
    if cache.get("epoch") != epoch:
        lengths = [len(e.input_ids) for e in run.examples]
        cache["epoch"] = epoch
        cache["batches"] = epoch_batches(len(run.examples), cfg.batch_size * acc.num_processes, epoch, cfg.seed, lengths)
    global_batch = cache["batches"][k]
    mine = global_batch[acc.process_index * cfg.batch_size : (acc.process_index + 1) * cfg.batch_size]
    batch = collate([run.examples[i] for i in mine], run.pad_id)
    n_tokens = sum(len(run.examples[i].input_ids) for i in mine)
    return {name: t.to(acc.device, non_blocking=True) for name, t in batch.items()}, n_tokens


def read_metrics(path: Path, up_to_step: int | None = None) -> list[str]:
    """metrics.jsonl's lines as written, up to ``up_to_step``: what a checkpoint keeps and a resume restarts from."""
    return [line for line, _ in read_metrics_rows(path, up_to_step)]


def save_checkpoint(run: Run, step: int, elapsed: float) -> Path:
    """Write checkpoint-<step>/ atomically (main process only) and prune old ones."""
    acc = run.accelerator
    final = run.out / f"{CHECKPOINT_PREFIX}{step}"
    acc.wait_for_everyone()
    if acc.num_processes > 1:  # invariant: data-parallel replicas hold identical weights
        checksum = torch.stack([p.detach().double().sum() for p in run.module.parameters()]).sum().reshape(1)
        sums = acc.gather(checksum.to(acc.device))
        assert torch.allclose(sums, sums[0]), f"replicas diverged: {sums.tolist()}"
    if acc.is_main_process:
        train_module = acc.unwrap_model(run.module)
        model = train_module.model
        lora_state = None
        if run.cfg.lora:
            from peft import get_peft_model_state_dict

            lora_state = {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(model).items()}
            # Merge into a copy so training continues on the unmerged adapter; the copy must not
            # carry a --compile wrapper (it is bound to the original module).
            decoder = train_module.causal_lm().model
            compiled = decoder.__dict__.pop("forward", None)
            try:
                model = copy.deepcopy(model).merge_and_unload()
            finally:
                if compiled is not None:
                    decoder.forward = compiled
        tmp = run.out / f".{final.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        if train_module.mask_row is not None:
            train_module.mask_row.write_into(model.get_base_model() if hasattr(model, "get_base_model") else model)
        model.save_pretrained(tmp, safe_serialization=True)
        run.tokenizer.save_pretrained(tmp)
        write_json(tmp / "train_config.json", run.cfg.to_dict())
        (tmp / METRICS_FILE).write_text("".join(ln + "\n" for ln in read_metrics(run.out / METRICS_FILE, step)))
        state = {
            "step": step,
            "optimizer": run.optimizer.state_dict(),
            "scheduler": {"decay": run.cfg.decay, "step": step, "total_steps": run.total_steps,
                          "lr": get_lr(max(step - 1, 0), run.cfg, run.total_steps)},
            "rng": rng_state(),
            "elapsed": elapsed,
            "lora": lora_state,
            "mask_row": None if train_module.mask_row is None else train_module.mask_row.row.detach().cpu().clone(),
            "num_processes": acc.num_processes,
        }
        torch.save(state, tmp / STATE_FILE)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(run.out)[: -run.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


# ----------------------------------------------------------------------------- the loop


class NonFiniteLoss(ValueError):
    """The loss or the gradients stopped being finite numbers: the run stops before the update lands."""


def check_finite(run: Run, step: int, loss: torch.Tensor, grad_norm) -> None:
    """Refuse an update from a non-finite loss or gradient norm; nothing of it reaches the weights or a checkpoint.

    Under --mixed-precision fp16 an infinite gradient is the loss scaler's business (it skips that step and
    lowers the scale), so there only the loss is checked. Every process sees the same all-reduced gradients,
    so they all stop at the same step."""
    norm = torch.as_tensor(grad_norm, dtype=torch.float32).reshape(())
    check_grads = run.cfg.mixed_precision != "fp16"
    ok = torch.isfinite(loss.float()) & (torch.isfinite(norm.to(loss.device)) if check_grads else True)
    if bool(ok):
        return
    saved = list_checkpoints(run.out)
    raise NonFiniteLoss(
        f"step {step}: the loss is {float(loss):g} and the gradient norm {float(norm):g} (not finite): training "
        f"stopped before this update, so no checkpoint holds it; last good checkpoint: "
        f"{saved[-1] if saved else 'none yet'}. Lower --lr (now {run.cfg.lr:g})"
        + (f" or --ar-weight (now {run.cfg.ar_weight:g})" if run.cfg.stage == "mars" else "")
        + ", or check the data"
    )


def fit(run: Run, status: StatusWriter) -> str:
    """Train from run.start_step to run.total_steps; returns the final state (finished | stopped)."""
    cfg, acc, module, optimizer = run.cfg, run.accelerator, run.module, run.optimizer
    from tqdm.auto import tqdm

    metrics_path = run.out / METRICS_FILE
    bar = tqdm(total=run.total_steps, initial=run.start_step, disable=not acc.is_local_main_process,
               desc=f"{cfg.stage}", unit="step", dynamic_ncols=True)  # fmt: skip
    batch_cache: dict = {}
    session_start = time.perf_counter()
    log_t, log_tokens = session_start, 0
    step = run.start_step
    state = "finished"
    params = [p for p in module.parameters() if p.requires_grad]
    while step < run.total_steps:
        if run.stop.requested and acc.num_processes == 1:
            # Signalled during setup. (Several processes first agree through the per-step reduce.)
            state = "stopped"
            break
        lr = get_lr(step, cfg, run.total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        sums = torch.zeros(3, device=acc.device)  # loss, loss_mask, loss_ar summed over micro-batches
        tokens = 0
        for micro in range(cfg.grad_accum):
            index = step * cfg.grad_accum + micro
            batch, n_tokens = get_batch(run, index, batch_cache)
            tokens += n_tokens
            sync = micro == cfg.grad_accum - 1
            with contextlib.nullcontext() if sync else acc.no_sync(module):
                out = module(**batch, block_offset=block_offset_at(cfg, index))
                acc.backward(out.loss / cfg.grad_accum)
            mask_part = out.loss_mask if out.loss_mask is not None else torch.zeros((), device=acc.device)
            sums += torch.stack([out.loss.detach(), mask_part, out.loss_ar]).float()
        # With --grad-clip 0 the norm is still measured (a max of inf scales the gradients by exactly 1).
        grad_norm = acc.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        check_finite(run, step + 1, sums[0] / cfg.grad_accum, grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        # One host sync per step: mean losses, real tokens and the stop flag, summed over processes
        # (every process must agree to stop at the same step).
        flag = 1.0 if run.stop.requested else 0.0
        local = torch.cat([sums / cfg.grad_accum, torch.tensor([float(tokens), flag], device=acc.device)])
        totals = (acc.reduce(local, "sum") if acc.num_processes > 1 else local).cpu()
        means = totals[:3] / acc.num_processes
        log_tokens += int(totals[3])
        stop_now = bool(totals[4] > 0)
        elapsed = run.elapsed_before + time.perf_counter() - session_start
        bar.update(1)
        bar.set_postfix(loss=f"{means[0]:.4f}", lr=f"{lr:.2e}")
        if step % cfg.log_every == 0 or step == run.total_steps:
            now = time.perf_counter()
            row = {
                "step": step,
                "loss": round(float(means[0]), 6),
                "loss_mask": round(float(means[1]), 6) if cfg.stage == "mars" else None,
                "loss_ar": round(float(means[2]), 6),
                "lr": lr,
                "tokens_per_s": round(log_tokens / max(now - log_t, 1e-9), 1),
                "elapsed": round(elapsed, 3),
            }
            log_t, log_tokens = now, 0
            if acc.is_main_process:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            done_here = step - run.start_step
            eta = (time.perf_counter() - session_start) / done_here * (run.total_steps - step)
            status.update(step=step, eta_s=round(eta, 1))
        if stop_now:
            state = "stopped"
            break
        if cfg.save_every and step % cfg.save_every == 0 and step < run.total_steps:
            status.update(last_checkpoint=str(save_checkpoint(run, step, elapsed)))
    bar.close()
    elapsed = run.elapsed_before + time.perf_counter() - session_start
    if step > run.start_step:
        save_checkpoint(run, step, elapsed)
    if state == "finished" and step != run.total_steps:  # "finished" means max_steps was reached, nothing else
        state = "stopped"
    checkpoints = list_checkpoints(run.out)  # none only if stopped before the first step of a fresh run
    status.update(step=step, eta_s=0.0 if state == "finished" else None,
                  last_checkpoint=str(checkpoints[-1]) if checkpoints else None)  # fmt: skip
    return state


def write_failed_status(cfg: TrainConfig, exc: BaseException) -> None:
    """Setup failed before a Run existed: still tell the app why (main process only)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    out = Path(cfg.output_dir).resolve()
    try:
        if not out.is_dir():  # never create a directory for a run that could not start
            return
        before = read_status(out)   # a refused resume keeps the run's real step and checkpoint
        if before and before.held_by_another_process():
            return   # refusing to join another live trainer's run must not overwrite its status.json
        checkpoints = list_checkpoints(out)
        last = str(checkpoints[-1]) if checkpoints else None
        write_status(out, failed_status(before, cfg.max_steps, last, f"{type(exc).__name__}: {exc}"))
    except OSError:  # an unwritable --output-dir is what failed: the error message says so
        pass


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(argv)
    stop = StopFlag()
    stop.install()  # before setup: a stop during a slow model load is honoured once it finishes
    try:
        return train(cfg, stop)
    finally:
        stop.uninstall()


def train(cfg: TrainConfig, stop: StopFlag) -> int:
    try:
        run = setup(cfg)
    except Exception as exc:
        write_failed_status(cfg, exc)
        raise
    run.stop = stop
    acc = run.accelerator
    record = RunStatus.of_this_process("running", run.start_step, run.total_steps, run.resumed_from)
    status = StatusWriter(run.out, record, write=acc.is_main_process)
    if acc.is_main_process:
        run.out.mkdir(parents=True, exist_ok=True)
        write_json(run.out / "train_config.json", cfg.to_dict())
        # A resumed run drops metrics logged after its checkpoint (they are about to be redone).
        kept = read_metrics(run.out / METRICS_FILE, run.start_step)
        (run.out / METRICS_FILE).write_text("".join(ln + "\n" for ln in kept))
        where = f"resuming from {run.resumed_from} at step {run.start_step}" if run.resumed_from else "starting"
        n_params = sum(p.numel() for p in run.module.parameters())
        n_train = sum(p.numel() for p in run.module.parameters() if p.requires_grad)
        print(
            f"[finetune.train] {where}; {len(run.examples)} examples, {run.total_steps} steps, "
            f"{acc.num_processes} process(es), {n_train:,}/{n_params:,} trainable parameters",
            file=sys.stderr,
        )
    status.update()
    try:
        state = fit(run, status)
    except BaseException as exc:  # record why the run died, then let it propagate
        status.update(state="failed", error=f"{type(exc).__name__}: {exc}")
        raise
    status.update(state=state)
    if run.stop.requested and acc.is_main_process:
        print(f"[finetune.train] {run.stop.signal_name}: stopped at step {status.record.step}; "
              f"last checkpoint: {status.record.last_checkpoint}", file=sys.stderr)  # fmt: skip
    acc.end_training()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as exc:  # boundary errors: one clear line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
