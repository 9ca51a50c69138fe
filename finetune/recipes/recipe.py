"""The embedded models, end to end: `python -m finetune.recipes.recipe --out assets`.

1. tokenizer  byte-level BPE trained on the suite's train split (finetune.tokenizer)
2. base       a randomly initialised small LlamaForCausalLM + that tokenizer
3. ar-sft     stage 1: plain AR-SFT from scratch on the built-in suite, then a
   ar-sft-2   second cosine cycle on fresh data (see AR_SFT_2)                 -> WORK/tiny-ar-sft-2/final
4. stage 2, runs from the stage-1 model on the same data, steps and schedule; only the loss differs:
   ar-sft-3   the AR loss alone: the matched AR-SFT baseline                   -> OUT/tiny-ar-sft
   mars       the MARS loss (B = 4, ar_weight as in MARS)                      -> OUT/tiny-mars
   ablation   the MARS loss with ar_weight = 0 (the paper's "no SFT loss")     -> runs/tiny-mars-arw0 (not committed)
5. eval       finetune.evals.evaluate sweep on the held-out suite; model cards (README.md, finetune.recipes.model_cards)

The default stages leave the ablation out: the rest fits the hour on 2 cores, and `--stages ablation,eval`
afterwards trains the ablation from the same stage-1 checkpoint (cores to itself) and re-makes the cards, which
time it apart from the recipe. `--stages ...,ablation,eval` in one invocation trains it side by side with the
other two stage-2 runs instead. `--stage2-steps N` sets the stage-2 runs' length (default 3,000, one fresh
example per row of every step).

Training always goes through `python -m finetune.train` (one subprocess per stage), so
the recipe is also a worked example of that CLI. A lone stage runs with --cores torch
threads; the three stage-2 runs go side by side with one thread each and train with
--compile when a C++ compiler is on PATH (--compile auto). The wall time of every
stage is recorded in WORK/recipe_info.json and printed in the model cards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# The stage settings (their own module, which finetune.recipes.model_cards quotes) keep their names here:
# recipe.MARS etc.
from finetune.recipes.recipe_settings import (
    ABLATION, AR_SFT, AR_SFT_2, AR_SFT_3, MARS, MODEL, STAGE1_ROWS, STAGE2, TIMING_PROMPTS, VOCAB_SIZE,
)
from finetune.status import RunStatus, read_status
from mars_core.models.storage import replace_folder

STAGES = ("tokenizer", "base", "ar-sft", "ar-sft-2", "ar-sft-3", "mars", "ablation", "eval")
DEFAULT_STAGES = tuple(s for s in STAGES if s != "ablation")   # the ablation trains on its own: --stages ablation,eval

# torch.compile (finetune.train --compile) needs a C++ compiler for inductor, hence --compile auto. Only the bf16
# stage 2 compiles: a compiled stage 1 once came out with sorting unlearnt, and stage 1 keeps the eager numerics
# that learnt it ("Recipe time").
CXX = ("g++", "c++", "clang++")

KEEP_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "special_tokens_map.json", "train_config.json", "metrics.jsonl")


def log(msg: str) -> None:
    print(f"[recipe {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_base(base_dir: Path, seed: int) -> int:
    """Tokenizer + random LlamaForCausalLM saved as a transformers dir; returns the parameter count."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from finetune.tokenizer import build_tokenizer

    tok = build_tokenizer(VOCAB_SIZE, n_examples=20_000, seed=seed)
    base_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(base_dir)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=True, bos_token_id=None,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **MODEL)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               do_sample=False, max_new_tokens=128)
    model.save_pretrained(base_dir)
    return sum(p.numel() for p in model.parameters())


def train_cmd(base: str, out_dir: Path, settings: dict, seed: int, threads: int) -> list[str]:
    """The `python -m finetune.train` command line of one stage."""
    cmd = [sys.executable, "-m", "finetune.train", "--base-model", base, "--data", "builtin",
           "--output-dir", str(out_dir), "--seed", str(seed), "--threads", str(threads),
           "--max-length", "256", "--log-every", "10", "--save-every", "250", "--keep-checkpoints", "1"]
    for key, value in settings.items():
        if key == "seed_offset":   # a different data draw for a continued stage
            cmd += ["--seed", str(seed + value)]
        else:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


def compile_works(env: dict | None = None) -> bool:
    """A toy torch.compile in a fresh process (~5-15 s): can this machine build inductor's CPU kernels?"""
    probe = "import torch; f = torch.compile(lambda x: (x * 2).sin()); f(torch.ones(3))"
    try:
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=600).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def compile_wanted(mode: str, which=shutil.which, works=compile_works) -> bool:
    """--compile on / off, or auto: on when a C++ compiler is on PATH and a toy compile succeeds (so a broken
    toolchain is found before stage 1, not when stage 2 starts half an hour later)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--compile {mode!r}: use auto, on or off")
    if mode != "auto":
        return mode == "on"
    return any(which(c) for c in CXX) and works()


def stage_settings(settings: dict, scale: float = 1.0, compile_: bool = False, steps: int | None = None) -> dict:
    """One stage's finetune.train settings: `steps` (with one fresh example per batch row of every step) if given,
    then steps and data times `scale`; without `compile_`, no --compile."""
    s = dict(settings)
    if not compile_:
        s.pop("compile", None)
    if steps is not None:
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"--stage2-steps {steps!r}: give a whole number of steps >= 1 "
                             f"(the recipe's is {STAGE2['max_steps']})")
        s["max_steps"], s["builtin_examples"] = steps, steps * s["batch_size"]
    s["max_steps"] = max(2, round(s["max_steps"] * scale))
    s["builtin_examples"] = max(s["batch_size"] * 2, round(s["builtin_examples"] * scale))
    s["warmup_steps"] = min(s["warmup_steps"], s["max_steps"] // 2)
    return s


def run_parallel(cmds: list[list[str]]) -> list[float]:
    """Run training commands side by side (one thread each); returns each one's wall time in seconds."""
    t0 = time.time()
    procs = []
    for cmd in cmds:
        log(" ".join(cmd[1:]))
        procs.append(subprocess.Popen(cmd))
    walls = [0.0] * len(procs)
    while any(w == 0.0 for w in walls):
        for i, p in enumerate(procs):
            if walls[i] == 0.0 and p.poll() is not None:
                walls[i] = time.time() - t0
                if p.returncode != 0:
                    for q in procs:
                        q.poll() is None and q.terminate()
                    raise RuntimeError(f"training failed (exit {p.returncode}): {' '.join(cmds[i][1:])}")
        time.sleep(2)
    return walls


def final_checkpoint(run_dir: Path) -> Path:
    """The checkpoint a finished training run ended on, from its status.json."""
    st = read_status(run_dir) or RunStatus()   # no readable status.json: the run never started
    if st.state != "finished" or not st.last_checkpoint:
        raise RuntimeError(f"{run_dir}: training did not finish ({st.state}, {st.error})")
    return Path(st.last_checkpoint)


def export(checkpoint: Path, dest: Path) -> None:
    """Copy the files an embedded model needs (no optimizer state) from a checkpoint to `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name in KEEP_FILES:
            if (checkpoint / name).is_file():
                shutil.copy2(checkpoint / name, tmp / name)
        replace_folder(tmp, dest)   # the committed model leaves only once its successor is complete
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets", help="where tiny-ar-sft/ and tiny-mars/ go")
    ap.add_argument("--work", default="runs/recipe", help="scratch dir for the base model and training runs")
    ap.add_argument("--ablation-dir", default="runs/tiny-mars-arw0", help="the ar_weight=0 model (not committed)")
    ap.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                    help=f"comma list from {','.join(STAGES)} (default: all but ablation)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cores", type=int, default=2, help="CPU cores to use: a lone stage trains with this many "
                    "torch threads, side-by-side stages split them")
    ap.add_argument("--eval-n", type=int, default=400, help="held-out examples for the model cards")
    ap.add_argument("--eval-reuse", default="", help="comma list of model names whose rows are read from an "
                    "earlier eval-<dir>.json in --work instead of being measured again")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="stage 2 with torch.compile (finetune.train --compile); auto = when a C++ compiler is on PATH "
                    "and a toy torch.compile works")
    ap.add_argument("--stage2-steps", type=int, default=STAGE2["max_steps"],
                    help="steps of each stage-2 run (AR baseline, MARS, ablation); their data grows to match")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps (e.g. 0.01 for a smoke run)")
    return ap.parse_args(argv)


def train_stages(args: argparse.Namespace, stages: list[str], info: dict, info_path: Path, invocation: str,
                 compile_: bool) -> None:
    """The training stages asked for, each exported to where the next stage (or the app) reads it."""
    out, work = Path(args.out), Path(args.work)

    def scaled(settings: dict, steps: int | None = None) -> dict:
        return stage_settings(settings, args.scale, compile_, steps)

    base_dir = work / "base"
    stage1 = str(work / "tiny-ar-sft-2" / "final")
    jobs = [("ar-sft", "tiny-ar-sft-1", str(base_dir), scaled(AR_SFT), work / "tiny-ar-sft-1" / "final"),
            ("ar-sft-2", "tiny-ar-sft-2", str(work / "tiny-ar-sft-1" / "final"), scaled(AR_SFT_2), Path(stage1)),
            ("ar-sft-3", "tiny-ar-sft", stage1, scaled(AR_SFT_3, args.stage2_steps), out / "tiny-ar-sft"),
            ("mars", "tiny-mars", stage1, scaled(MARS, args.stage2_steps), out / "tiny-mars"),
            ("ablation", "tiny-mars-arw0", stage1, scaled(ABLATION, args.stage2_steps), Path(args.ablation_dir))]
    # Stage 1 gets all cores; the three stage-2 runs go side by side, one thread each (single-threaded runs use a
    # core better than two-threaded ones, and the short AR run's core passes to the MARS runs when it ends).
    for group in (["ar-sft"], ["ar-sft-2"], ["ar-sft-3", "mars", "ablation"]):
        todo = [j for j in jobs if j[0] in group and j[0] in stages]
        if not todo:
            continue
        threads = max(1, args.cores // len(todo))
        walls = run_parallel([train_cmd(base, work / name, settings, args.seed, threads)
                              for _, name, base, settings, _ in todo])
        for (stage, name, base, settings, dest), wall in zip(todo, walls):
            export(final_checkpoint(work / name), dest)
            info["stages"][name] = {"settings": settings, "steps": settings["max_steps"], "wall_s": wall,
                                    "threads": threads, "parallel_with": [j[1] for j in todo if j[1] != name],
                                    "invocation": invocation}
            info_path.write_text(json.dumps(info, indent=1))
            log(f"{name}: {settings['max_steps']} steps in {wall / 60:.1f} min -> {dest}")


def evaluate_stage(args: argparse.Namespace, info: dict, invocation: str, command: str) -> None:
    """Evaluate the exported models (accuracy, then speed), write eval.json, the Pareto plot and the model cards."""
    from finetune.evals.evaluate import pareto_figure
    from finetune.recipes.model_cards import write_cards

    out, work = Path(args.out), Path(args.work)
    # Accuracy: one evaluation process per model, side by side, one thread each (see finetune.evals.evaluate).
    # Speed: then one model at a time on the otherwise idle CPU, one thread, TIMING_PROMPTS prompts: timed side by
    # side, the processes slow each other unevenly ("Recipe time" in docs/experiments.md).
    t0 = time.time()
    targets = [(name, path) for name, path in [("tiny-ar-sft", out / "tiny-ar-sft"), ("tiny-mars", out / "tiny-mars"),
                                               ("tiny-mars ar_weight=0", Path(args.ablation_dir))]
               if (path / "model.safetensors").is_file()]
    files = [work / f"eval-{path.name}.json" for _, path in targets]
    reuse = {n.strip() for n in args.eval_reuse.split(",") if n.strip()}
    todo = [(name, path, f) for (name, path), f in zip(targets, files) if name not in reuse or not f.is_file()]

    def evaluate_cmd(name: str, path: Path, n: int, timing: int, json_file: Path) -> list[str]:
        return [sys.executable, "-m", "finetune.evals.evaluate", "--models", str(path), "--names", name, "--n", str(n),
                "--seed", str(args.seed), "--threads", "1", "--timing-prompts", str(timing), "--json", str(json_file)]

    run_parallel([evaluate_cmd(name, path, args.eval_n, 0, f) for name, path, f in todo])
    for name, path, f in todo:
        timed = f.with_name(f.stem + "-timing.json")
        run_parallel([evaluate_cmd(name, path, TIMING_PROMPTS, TIMING_PROMPTS, timed)])
        speed = {r["tau"]: r for r in json.loads(timed.read_text())}
        rows_f = json.loads(f.read_text())
        for r in rows_f:
            r.update({k: speed[r["tau"]][k] for k in ("speedup", "ar_time_s", "mars_time_s", "timing_prompts")})
        f.write_text(json.dumps(rows_f, indent=1))
    rows = {name: json.loads(f.read_text()) for (name, _), f in zip(targets, files)}
    extra = work / "eval-extra.json"   # rows of development runs, shown in the tiny-mars card when present
    if extra.is_file():
        rows["extra"] = json.loads(extra.read_text())
    if (work / STAGE1_ROWS).is_file():   # quoted in the AR card, not tabled
        rows["stage-1"] = json.loads((work / STAGE1_ROWS).read_text())
    if todo:   # the ablation evaluated on its own is timed apart from the recipe's evaluation
        key = "eval" if {n for n, _, _ in todo} - {"tiny-mars ar_weight=0"} else "eval-ablation"
        info["stages"][key] = {"wall_s": time.time() - t0, "invocation": invocation}
    all_rows = [r for k, v in rows.items() if k not in ("extra", "stage-1") for r in v]
    (work / "eval.json").write_text(json.dumps(all_rows, indent=1))
    pareto_figure(all_rows).write_html(work / "pareto.html", include_plotlyjs=True)
    write_cards(out, info, rows, command, TIMING_PROMPTS)   # the count this run timed with
    (out / "eval.json").write_text(json.dumps(all_rows, indent=1))
    log(f"eval: {time.time() - t0:.0f}s; table in {out}/*/README.md, plot in {work / 'pareto.html'}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise ValueError(f"--stages {bad}: choose from {','.join(STAGES)}")

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    info_path = work / "recipe_info.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {"stages": {}}
    command = "python -m finetune.recipes.recipe --out " + str(args.out) + (
        "" if args.scale == 1 else f" --scale {args.scale}") + (
        "" if args.stage2_steps == STAGE2["max_steps"] else f" --stage2-steps {args.stage2_steps}")
    t_all = time.time()
    invocation = time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(t_all))   # names this run in the cards' timing

    compile_ = compile_wanted(args.compile)
    if args.compile == "auto":
        log("--compile auto: " + ("stage 2 trains with torch.compile" if compile_
                                  else "no C++ compiler on PATH or a toy torch.compile failed: training eagerly"))

    if "tokenizer" in stages or "base" in stages:
        t0 = time.time()
        base_dir = work / "base"
        info["parameters"] = build_base(base_dir, args.seed)
        info["vocab_size"] = VOCAB_SIZE
        info["stages"]["base"] = {"wall_s": time.time() - t0, "invocation": invocation}
        log(f"base model: {info['parameters']:,} parameters in {base_dir}")
    train_stages(args, stages, info, info_path, invocation, compile_)
    if "eval" in stages:
        evaluate_stage(args, info, invocation, command)
    info["total_wall_s_last_invocation"] = time.time() - t_all
    info_path.write_text(json.dumps(info, indent=1))
    log(f"done in {(time.time() - t_all) / 60:.1f} min")


if __name__ == "__main__":
    main()
