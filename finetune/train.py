"""Fine-tune a causal LM with AR-SFT (stage 1) or MARS (stage 2): ``python -m finetune.train``.

    python -m finetune.train --base-model tiny-ar-sft --data builtin --stage mars \\
        --block-size 4 --lr 5e-6 --epochs 5 --output-dir runs/mars

The same command under ``accelerate launch --multi_gpu --num_processes N --num_machines 1`` runs
data-parallel: each process takes its own slice of every global batch. Under ``torchrun --nproc_per_node N``
with ``--sharding full`` the model, gradients and Adam state are sharded over the processes (FSDP2,
``finetune.sharding``; docs/scaling.md). ``--dry-run`` prints the plan and trains nothing (``finetune.plan``).

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
- ``data_manifest.json``: which prompts this run's data came from (hashed; finetune.data's manifest), with
  those of the ``--skip-seen`` manifest it continued: a later round passes it to ``--skip-seen``
- ``checkpoint-<step>/``: a plain transformers directory (LoRA already merged) with the
  tokenizer, train_config.json, metrics.jsonl and trainer_state.pt (optimizer state, step, RNG,
  LoRA adapter weights when --lora, the mask row when --train-mask-row); see ``finetune.checkpoint``

- ``train.lock``: held (flock, with the trainer's pid) while a trainer runs here: a second one is refused

Re-running with the same ``--output-dir`` resumes from its newest complete
checkpoint: step count, optimizer state, data position and RNG continue. A checkpoint missing a file the resume
needs is skipped by name for an older one; a folder with checkpoints or logged steps is never started over, and
its settings are checked against every record that survives (train_config.json, each checkpoint's copy, the
trainer state's). ``--restart`` moves such a run aside (``<dir>.old-<time>``) and starts afresh.
A new run can instead warm-start from an exported adapter (``--init-adapter assets/smollm2-mars``: its LoRA
weights and mask row, with a fresh optimizer and schedule) and train only on examples that adapter's data
manifest does not list (``--skip-seen``); see docs/smollm2-mars.md, "Continuing the shipped adapter".
SIGINT/SIGTERM: the current optimizer step finishes, a checkpoint is saved, status becomes "stopped" and the
process exits with 130/143, or 0 when the app's Stop asked for it (``stop-requested``); before step 1 there is
nothing to save, and the run ends "stopped" at once.

Shape follows nanoGPT/litgpt: ``main`` (flags, signal handlers) -> ``train``
(status bookkeeping around) ``setup`` (model, data, optimizer, resume) and
``fit`` (the loop), with small helpers. The model, its loss wrapper and the ``Run`` live in
``finetune.train_model``, checkpoints in ``finetune.checkpoint``, status.json and metrics.jsonl in
``finetune.status``, the step count and learning rate in ``finetune.schedule``, and claiming, starting and
closing the run folder in ``finetune.run_dir``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

STARTED_AT = time.time()
EARLY_SIGNALS: list[int] = []
if __name__ == "__main__":
    # The app's Stop may come during the seconds of `import torch` below: remember it for main's StopFlag instead
    # of dying of it, which accelerate's launcher would report as a failed run with a traceback.
    for _sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(_sig) is not signal.SIG_IGN:
            signal.signal(_sig, lambda signum, frame: EARLY_SIGNALS.append(signum))

import torch
from torch import nn

from finetune.checkpoint import (
    RESTART_FIX, all_checkpoints, check_resumable, list_checkpoints, load_resume, refuse_starting_over,
    save_checkpoint, set_rng_state, warn,
)
from finetune import sharding
from finetune.config import TrainConfig, native_bf16_cpu, parse_train_command
from finetune.data import (
    IGNORE_INDEX, build_examples, collate, epoch_batches, leave_out_seen, load_conversations, manifest_path,
    pad_id_of, prompt_key, read_manifest,
)
from finetune.host_memory import keep_freed_memory
from finetune.run_dir import (
    check_output_dir, claim_run_dir, drop_stale_stop_request, start_run_dir, stop_exit, stopped_before_start,
    write_failed_status,
)
from finetune.schedule import block_offset_at, get_lr, schedule
from finetune.status import METRICS_FILE, RunStatus, StatusWriter, read_status
from finetune.train_model import Run, StopFlag, WarmStart, load_base, make_optimizer, prepare_model, wrap_model
from mars_core.engine.threads import check_thread_count

# ----------------------------------------------------------------------------- setup


# TrainConfig's own defaults of the settings only the MARS loss reads
MARS_ONLY_DEFAULTS = {k: v for k, v in vars(TrainConfig()).items()
                      if k in ("block_size", "ar_weight", "mask_label_smoothing", "random_block_offset",
                                "soft_target_weight", "soft_target_top_k", "gated_lora")}


def ignored_settings(cfg: TrainConfig) -> list[str]:
    """MARS-only settings changed from their defaults in an AR-SFT run, where they do nothing."""
    if cfg.stage == "mars":
        return []
    return [f"{k}={getattr(cfg, k)!r}" for k, default in MARS_ONLY_DEFAULTS.items() if getattr(cfg, k) != default]


def emulated_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True on an x86 CPU that lists its flags and has no bf16 instructions (where a bf16 step is slow)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False   # no flags to read (not Linux): say nothing
    return "avx2" in text.split() and not native_bf16_cpu(cpuinfo)


def preflight(cfg: TrainConfig, use_cpu: bool) -> Path:
    """Checks that need no model or data: run before anything slow, so a bad flag fails in a second."""
    if cfg.mixed_precision == "fp16" and use_cpu:
        raise ValueError("--mixed-precision fp16 needs a CUDA GPU and this run trains on the CPU: "
                         "use --mixed-precision bf16 or --mixed-precision no")
    if cfg.mixed_precision == "bf16" and use_cpu and emulated_bf16():
        warn("--mixed-precision bf16 on a CPU without bf16 instructions (no avx512_bf16 or amx_bf16 in "
             "/proc/cpuinfo): torch emulates it and a step runs several times slower than in fp32; "
             "use --mixed-precision no")
    sharding.check_world(cfg)
    if cfg.threads:
        check_thread_count(cfg.threads)
    ignored = ignored_settings(cfg)
    if ignored:
        warn(f"--stage ar-sft ignores the MARS-only setting(s) {', '.join(ignored)}: drop them, or use --stage mars")
    out = check_output_dir(cfg.output_dir)
    st = read_status(out)
    if st and st.held_by_another_process():
        raise ValueError(f"--output-dir {cfg.output_dir!r} is in use by a training process that is still running "
                         f"(pid {st.pid}, step {st.step}): stop it first (SIGTERM saves a checkpoint), "
                         "or use another --output-dir")
    return out


def uses_cpu() -> bool:
    # cpu=True is what turns a torchrun-style launch without GPUs into gloo data parallelism
    # (accelerate's MULTI_CPU); `accelerate launch --cpu` alone starts a single process.
    return not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")


def setup(cfg: TrainConfig, out: Path, use_cpu: bool, fresh: bool = False) -> Run:
    """Model, data, optimizer and resume state; nothing is written to ``out`` here (``start_run_dir`` does).
    ``fresh`` (--restart): the main process has moved the earlier run aside; the others must not read it either."""
    # complete or not: a checkpoint folder without trainer_state.pt is damaged, not absent
    checkpoints = [] if fresh else all_checkpoints(out)
    settings_checked = check_resumable(out, cfg, checkpoints) if checkpoints else True
    if not checkpoints and not fresh:
        refuse_starting_over(out)
    accelerator = start_accelerator(cfg, use_cpu)

    # The data is read and validated before any model is loaded: a bad row fails in a second, naming its line.
    conversations = load_conversations(cfg.data, cfg.builtin_examples, cfg.seed, cfg.builtin_weights,
                                       cfg.max_row_bytes)
    conversations, manifest = select_data(cfg, conversations)
    # The adapter's settings are checked before the slow load; its shapes when it is copied in, before step 1.
    init = WarmStart.read(cfg) if cfg.init_adapter else None
    resume, state, trained = load_resume(out, checkpoints, cfg, settings_checked) if checkpoints else (None, None, None)
    base = load_base(cfg.base_model)
    model = prepare_model(trained if trained is not None else base.model, cfg, state, init)
    examples = build_examples(
        conversations,
        base.tokenizer,
        max_length=cfg.max_length,
        block_size=cfg.block_size if cfg.stage == "mars" else None,
        eos_ids=base.eos_ids,
        overlong=cfg.overlong,
    )
    micro_per_epoch, total_steps = schedule(cfg, len(examples), accelerator.num_processes)
    if state is not None and state["step"] > total_steps:
        raise ValueError(f"{resume} is at step {state['step']}, past this run's {total_steps} steps: raise "
                         f"--max-steps (or --epochs) to continue it, or {RESTART_FIX}")
    pad_id = pad_id_of(base.tokenizer, base.eos_ids)

    module = wrap_model(model, cfg, base.mask_id, state, init)
    module, optimizer = sharding.prepare(accelerator, module, cfg, make_optimizer)
    run = Run(cfg, accelerator, module, optimizer, base.tokenizer, examples, pad_id, out, total_steps, micro_per_epoch,
              manifest=manifest)
    if state is not None:
        resume_from(run, state, resume)
    return run


def select_data(cfg: TrainConfig, conversations: list) -> tuple[list, tuple[list[str], list]]:
    """With --skip-seen, the conversations its manifest does not list; and this run's manifest: the skipped one's
    prompts plus this run's, so the next round can skip everything trained on so far."""
    keys = [prompt_key(c) for c in conversations]
    source = {"data": cfg.data, "examples": len(conversations)}
    if not cfg.skip_seen:
        return conversations, (keys, [source])
    before = read_manifest(cfg.skip_seen)
    new, n_seen = leave_out_seen(conversations, set(before["prompts"]))
    if not new:
        raise ValueError(f"every one of the {len(conversations)} conversations of --data {cfg.data!r} is in the "
                         f"--skip-seen manifest {cfg.skip_seen!r}: add new data (e.g. distil prompts not used yet)")
    print(f"[finetune.train] --skip-seen: left out {n_seen} of {len(conversations)} conversations already in "
          f"{str(manifest_path(cfg.skip_seen))!r}; {len(new)} new", file=sys.stderr)
    source["examples"], source["left_out_as_seen"] = len(new), n_seen
    return new, (list(before["prompts"]) + [prompt_key(c) for c in new], list(before.get("sources", [])) + [source])


def start_accelerator(cfg: TrainConfig, use_cpu: bool):
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, cpu=use_cpu)
    set_seed(cfg.seed)
    return accelerator


def resume_from(run: Run, state: dict, checkpoint: Path) -> None:
    """Continue where ``checkpoint`` stopped: optimizer moments, RNG, step count and training time.

    The weights were restored while the model was built; the learning rate follows from the step. The process
    count must match: it multiplies the global batch, so another count would change the data order and the
    schedule behind the checkpoint's back."""
    saved = state.get("num_processes", 1)
    if saved != run.accelerator.num_processes:
        raise ValueError(f"{checkpoint} was written by {saved} training process(es), this run has "
                         f"{run.accelerator.num_processes}: resume with --num_processes {saved} "
                         "(accelerate launch), or use a new --output-dir")
    if sharding.is_sharded(run.cfg):
        sharding.load_sharded(run.module, run.optimizer, checkpoint)
    else:
        run.optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    run.start_step = state["step"]
    run.elapsed_before = state.get("elapsed", 0.0)
    run.resumed_from = str(checkpoint)


# ----------------------------------------------------------------------------- batches


def get_batch(run: Run, micro_index: int, cache: dict) -> tuple[dict[str, torch.Tensor], int]:
    """This process's slice of global micro-batch ``micro_index`` and its real-token count.

    The slice is a pure function of (seed, micro_index), which is what makes resuming exact.
    """
    cfg, acc = run.cfg, run.accelerator
    epoch, k = divmod(micro_index, run.micro_per_epoch)
    if cache.get("epoch") != epoch:
        lengths = [len(e.input_ids) for e in run.examples] if cfg.group_by_length else None
        cache["epoch"] = epoch
        cache["batches"] = epoch_batches(len(run.examples), cfg.batch_size * acc.num_processes, epoch, cfg.seed,
                                         lengths)
    global_batch = cache["batches"][k]
    mine = global_batch[acc.process_index * cfg.batch_size : (acc.process_index + 1) * cfg.batch_size]
    batch = collate([run.examples[i] for i in mine], run.pad_id)
    n_tokens = sum(len(run.examples[i].input_ids) for i in mine)
    return {name: t.to(acc.device, non_blocking=True) for name, t in batch.items()}, n_tokens


def n_targets(example) -> int:
    """An example's labelled targets as the losses count them (labels shifted by one)."""
    return sum(1 for t in example.labels[1:] if t != IGNORE_INDEX)


def process_weight(run: Run, micro_index: int, cache: dict) -> float:
    """This process's loss weight for global micro-batch ``micro_index`` (after ``get_batch`` drew it): the process
    count times its share of the micro-batch's labelled targets.

    Each process's loss is a mean over its own targets and the processes' gradients are then averaged; weighted so,
    that average is the mean over every target of the global micro-batch, which is what one process computes for
    the same batch. Unweighted, a process with fewer targets would count as much as one with more. Every process
    computes it from the global batch's indices: no communication."""
    acc, b = run.accelerator, run.cfg.batch_size
    if acc.num_processes == 1:
        return 1.0
    global_batch = cache["batches"][micro_index % run.micro_per_epoch]
    counts = [n_targets(run.examples[i]) for i in global_batch]
    mine = sum(counts[acc.process_index * b : (acc.process_index + 1) * b])
    return acc.num_processes * mine / sum(counts)


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


def accumulate(run: Run, step: int, cache: dict) -> tuple[torch.Tensor, int]:
    """Forward and backward over optimizer step ``step``'s grad_accum micro-batches.

    Returns (loss, loss_mask, loss_ar) summed over the micro-batches (each weighted by ``process_weight``, so
    their mean over processes is the global micro-batch's) and this process's real tokens."""
    cfg, acc, module = run.cfg, run.accelerator, run.module
    sums = torch.zeros(3, device=acc.device)
    tokens = 0
    for micro in range(cfg.grad_accum):
        index = step * cfg.grad_accum + micro
        batch, n_tokens = get_batch(run, index, cache)
        weight = process_weight(run, index, cache)
        tokens += n_tokens
        sync = micro == cfg.grad_accum - 1  # gradients are all-reduced once, on the last micro-batch
        with sharding.no_sync(acc, module, sync):
            out = module(**batch, block_offset=block_offset_at(cfg, index))
            acc.backward(out.loss * weight / cfg.grad_accum)   # (x 1.0 in one process: the same numbers)
        mask_part = out.loss_mask if out.loss_mask is not None else torch.zeros((), device=acc.device)
        sums += torch.stack([out.loss.detach(), mask_part, out.loss_ar]).float() * weight
    return sums, tokens


def train_step(run: Run, step: int, params: list[nn.Parameter], cache: dict) -> tuple[float, torch.Tensor, int]:
    """Optimizer step ``step`` (0-based): (its lr, this process's mean losses, this process's real tokens)."""
    cfg, optimizer = run.cfg, run.optimizer
    lr = get_lr(step, cfg, run.total_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    sums, tokens = accumulate(run, step, cache)
    # With --grad-clip 0 the norm is still measured (a max of inf scales the gradients by exactly 1).
    grad_norm = run.accelerator.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    grad_norm = sharding.full_value(grad_norm)   # sharded gradients give a DTensor norm
    check_finite(run, step + 1, sums[0] / cfg.grad_accum, grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lr, sums / cfg.grad_accum, tokens


def sync_step(run: Run, means: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int, bool]:
    """One host sync per step: (mean losses over processes, real tokens of all processes, whether to stop).

    Every process must agree to stop at the same step, so the stop flag travels with the losses."""
    acc = run.accelerator
    flag = 1.0 if run.stop.requested else 0.0
    local = torch.cat([means, torch.tensor([float(tokens), flag], device=acc.device)])
    totals = (acc.reduce(local, "sum") if acc.num_processes > 1 else local).cpu()
    return totals[:3] / acc.num_processes, int(totals[3]), bool(totals[4] > 0)


class MetricsLog:
    """Appends metrics.jsonl rows (main process only); tokens/s counts the tokens since the previous row."""

    def __init__(self, run: Run, start: float):
        self.path, self.stage, self.write = run.out / METRICS_FILE, run.cfg.stage, run.accelerator.is_main_process
        self.since, self.tokens = start, 0

    def log(self, step: int, means: torch.Tensor, lr: float, elapsed: float) -> None:
        now = time.perf_counter()
        row = {
            "step": step,
            "loss": round(float(means[0]), 6),
            "loss_mask": round(float(means[1]), 6) if self.stage == "mars" else None,
            "loss_ar": round(float(means[2]), 6),
            "lr": lr,
            "tokens_per_s": round(self.tokens / max(now - self.since, 1e-9), 1),
            "elapsed": round(elapsed, 3),
        }
        self.since, self.tokens = now, 0
        if self.write:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")


def fit(run: Run, status: StatusWriter) -> str:
    """Train from run.start_step to run.total_steps; returns the final state (finished | stopped)."""
    from tqdm.auto import tqdm

    cfg, acc = run.cfg, run.accelerator
    bar = tqdm(total=run.total_steps, initial=run.start_step, disable=not acc.is_local_main_process,
               desc=f"{cfg.stage}", unit="step", dynamic_ncols=True)  # fmt: skip
    params = [p for p in run.module.parameters() if p.requires_grad]
    batch_cache: dict = {}
    session_start = time.perf_counter()
    metrics = MetricsLog(run, session_start)
    step, state = run.start_step, "finished"
    while step < run.total_steps:
        if run.stop.requested and acc.num_processes == 1:
            # Signalled during setup. (Several processes first agree through the per-step reduce.)
            state = "stopped"
            break
        lr, means, tokens = train_step(run, step, params, batch_cache)
        step += 1
        means, tokens, stop_now = sync_step(run, means, tokens)
        metrics.tokens += tokens
        elapsed = run.elapsed_before + time.perf_counter() - session_start
        bar.update(1)
        bar.set_postfix(loss=f"{means[0]:.4f}", lr=f"{lr:.2e}")
        if step % cfg.log_every == 0 or step == run.total_steps:
            metrics.log(step, means, lr, elapsed)
            eta = (time.perf_counter() - session_start) / (step - run.start_step) * (run.total_steps - step)
            status.update(step=step, eta_s=round(eta, 1))
        if stop_now:
            state = "stopped"
            break
        if cfg.save_every and step % cfg.save_every == 0 and step < run.total_steps:
            status.update(last_checkpoint=str(save_checkpoint(run, step, elapsed)))
    bar.close()
    return end_fit(run, status, step, state, run.elapsed_before + time.perf_counter() - session_start)


def end_fit(run: Run, status: StatusWriter, step: int, state: str, elapsed: float) -> str:
    """Save the last step's checkpoint and record where the run ended; returns the final state."""
    if step > run.start_step:
        save_checkpoint(run, step, elapsed)
    if state == "finished" and step != run.total_steps:  # "finished" means max_steps was reached, nothing else
        state = "stopped"
    checkpoints = list_checkpoints(run.out)  # none only if stopped before the first step of a fresh run
    status.update(step=step, eta_s=0.0 if state == "finished" else None,
                  last_checkpoint=str(checkpoints[-1]) if checkpoints else None)  # fmt: skip
    return state


# ----------------------------------------------------------------------------- entry points


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    cfg, flags = parse_train_command(argv)
    if own_process and cfg.keep_freed_memory and uses_cpu():  # process-wide: only the trainer's own process
        keep_freed_memory()
    if flags.dry_run:
        from finetune.plan import print_plan

        return print_plan(cfg, flags.plan_examples, flags.plan_processes)
    restart = flags.restart
    stop = StopFlag()
    stop.install()  # before setup: a stop during a slow model load is honoured once it finishes
    if EARLY_SIGNALS:   # a stop that came while this module was still importing
        stop.handle(EARLY_SIGNALS[0], None)
        EARLY_SIGNALS.clear()
    try:
        return train(cfg, stop, restart)
    finally:
        stop.uninstall()


def train(cfg: TrainConfig, stop: StopFlag, restart: bool = False) -> int:
    use_cpu = uses_cpu()
    out = preflight(cfg, use_cpu)
    claim = claim_run_dir(out, restart)
    try:
        drop_stale_stop_request(out, STARTED_AT)
        # Stopped while starting: no model is loaded for nothing. (Several processes first agree, in fit.)
        if stop.requested and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return stopped_before_start(cfg, out, stop)
        try:
            run = setup(cfg, out, use_cpu, fresh=restart)
        except Exception as exc:
            write_failed_status(cfg, out, exc)
            raise
        run.stop = stop
        return train_run(run)
    finally:
        if claim is not None:
            claim.release()


def train_run(run: Run) -> int:
    acc = run.accelerator
    record = RunStatus.of_this_process("running", run.start_step, run.total_steps, run.resumed_from)
    status = StatusWriter(run.out, record, write=acc.is_main_process)
    if acc.is_main_process:
        start_run_dir(run)
    status.update()
    try:
        state = fit(run, status)
    except BaseException as exc:  # record why the run died, then let it propagate
        status.update(state="failed", error=f"{type(exc).__name__}: {exc}")
        raise
    status.update(state=state)
    acc.end_training()
    if run.stop.requested:
        return stop_exit(run.out, run.stop, status.record.step, run.start_step, run.total_steps,
                         status.record.last_checkpoint, acc.is_main_process)
    return 0


if __name__ == "__main__":
    from finetune.config import run_main

    run_main(lambda: main(own_process=True))
