"""Fixed-budget A/B of MARS training options: ``python -m finetune.recipes.ab --data DATA.jsonl --steps 150``.

Every arm is one ``finetune.train`` run of the same N steps on the same examples in the same order with the same
seed (today's smollm2 recipe, ``finetune.recipes.recipe_smollm2.TRAIN``, with the arm's settings on top), trained from
the base model, then scored on development data only:

- held-out examples: the first ``--dev-examples`` rows of --data, never trained on: mask CE (as training logs
  it), AR CE, and the per-slot agreement of the mask top-1 with AR's top-1 (finetune.recipes.ab_score.mask_metrics);
- development prompts: ``natural_prompts("heldout", --prompts, seed=--prompt-seed)`` (seed 77 by default; the
  report seed 1 is refused): tokens/forward of lossless MARS at τ 0.3 and lossy MARS at τ 0.95.

Warm-start arms (``--init-adapter DIR``, e.g. assets/smollm2-mars): ``shipped`` scores that adapter as it is
(as mars_core serves it: merged, or a gated one applied at the masks; not trained), ``warm`` and ``warm-soft``
train the recipe (and soft targets) for the N steps starting from it (finetune.train --init-adapter), and
``warm-gated`` the gated recipe from a gated adapter (mars-gated-lora-v1). Give them data the adapter never saw.

One command, one markdown table (printed and written to WORK/table.md; every arm's numbers in
WORK/<arm>/score.json). Resumable: a finished arm is not trained again (an interrupted one resumes from its last
checkpoint), and a scored arm is not scored again unless the scoring settings changed.

    nohup nice -n 19 python -m finetune.recipes.ab --data runs/ab29/data.jsonl --work runs/ab29 --steps 150 \\
        --arms baseline,soft,gated --threads 1 > runs/ab29/ab.log 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

# The options compared; each is finetune.train's settings on top of the recipe's. WARM stands for --init-adapter.
WARM = "<--init-adapter>"
ARMS = {
    "baseline": {},                                                   # today's recipe
    "soft": {"soft_target_weight": 0.5},                              # half hard CE, half KL to the clean stream
    "soft-kl": {"soft_target_weight": 1.0},                           # KL to the clean stream alone
    "soft-top32": {"soft_target_weight": 0.5, "soft_target_top_k": 32},
    "gated": {"gated_lora": True, "train_mask_row": False},          # delta at masks only: clean = base exactly
    "gated-row": {"gated_lora": True},                                # the same with the mask row trained
    "top10": {"lora_layers": 10, "train_mask_row": False},            # LoRA in the top 10 layers: backward stops there
    "shipped": {"init_adapter": WARM},                                # --init-adapter as it is: scored, not trained
    "warm": {"init_adapter": WARM},                                   # the recipe, from --init-adapter
    "warm-soft": {"init_adapter": WARM, "soft_target_weight": 0.5},   # soft targets, from --init-adapter
    "warm-gated": {"init_adapter": WARM, "gated_lora": True},         # gated, from a gated --init-adapter
}
UNTRAINED = ("shipped",)
REPORT_SEED = 1   # the seed of the published tables (finetune.recipes.recipe_smollm2.EVAL_SEED): never tuned on


def log(msg: str) -> None:
    print(f"[finetune.recipes.ab {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m finetune.recipes.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True,
                    help="chat JSONL (finetune.recipes.distill's output); its first rows are dev")
    ap.add_argument("--work", default="runs/ab", help="run folder: the split, one folder per arm, table.md")
    ap.add_argument("--base", default="smollm2", help="the model every arm starts from")
    ap.add_argument("--arms", default="baseline,soft", help=f"comma-separated, from {','.join(ARMS)}")
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps of every arm (the fixed budget)")
    ap.add_argument("--dev-examples", type=int, default=48, help="rows of --data held out for the mask metrics")
    ap.add_argument("--prompts", type=int, default=32, help="development prompts to decode")
    ap.add_argument("--prompt-seed", type=int, default=77, help=f"their seed (not {REPORT_SEED}, the report seed)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="decoding cap per prompt")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training and scoring")
    ap.add_argument("--init-adapter", default="",
                    help="the adapter the shipped and warm* arms start from (e.g. assets/smollm2-mars)")
    args = ap.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown or not args.arms:
        raise ValueError(f"--arms {','.join(args.arms)!r} names unknown arms {unknown}: use some of {','.join(ARMS)}")
    if args.prompt_seed == REPORT_SEED:
        raise ValueError(f"--prompt-seed {REPORT_SEED} is the report seed, kept for the final table: use another "
                         "(default 77)")
    for flag in ("steps", "dev_examples", "prompts", "max_new_tokens", "threads"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: use 1 or more")
    if not Path(args.data).is_file():
        raise ValueError(f"--data {args.data!r} is not a file: pass finetune.recipes.distill's chat JSONL")
    warm = [a for a in args.arms if ARMS[a].get("init_adapter") == WARM]
    if warm and not args.init_adapter:
        raise ValueError(f"arms {','.join(warm)} start from an adapter: pass --init-adapter (e.g. assets/smollm2-mars)")
    if args.init_adapter:
        from mars_core.models.adapter import read_adapter_config

        read_adapter_config(args.init_adapter)   # a missing or foreign folder fails here, not after an hour


# ----------------------------------------------------------------------------- data split


def split_data(data: Path, work: Path, n_dev: int) -> tuple[Path, Path]:
    """WORK/train.jsonl and WORK/dev.jsonl: the first ``n_dev`` rows are dev. Made once; a later call with other
    data or another ``n_dev`` is refused, since the arms already trained would not be comparable."""
    rows = [line for line in data.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(rows) <= n_dev:
        raise ValueError(f"--data {str(data)!r} has {len(rows)} rows, not more than --dev-examples {n_dev}: "
                         "lower --dev-examples or distil more")
    train, dev, record = work / "train.jsonl", work / "dev.jsonl", work / "split.json"
    meta = {"data": str(data.resolve()), "rows": len(rows), "dev": n_dev}
    if record.is_file():
        before = json.loads(record.read_text())
        if before != meta:
            raise ValueError(f"{work} was split from {before}, this call gives {meta}: use a new --work")
        return train, dev
    from mars_core.models.storage import atomic_write_text

    atomic_write_text(dev, "".join(r + "\n" for r in rows[:n_dev]))
    atomic_write_text(train, "".join(r + "\n" for r in rows[n_dev:]))
    atomic_write_text(record, json.dumps(meta, indent=1))
    return train, dev


# ----------------------------------------------------------------------------- training


def arm_options(arm: str, init_adapter: str = "") -> dict:
    """The arm's options, --init-adapter filled in."""
    return {k: (init_adapter if v == WARM else v) for k, v in ARMS[arm].items()}


def arm_settings(arm: str, steps: int, init_adapter: str = "") -> dict:
    """The recipe's finetune.train settings for this CPU, N steps, the arm's options on top."""
    from finetune.config import native_bf16_cpu
    from finetune.recipes.recipe_smollm2 import train_settings

    settings = train_settings(False, native_bf16_cpu(), steps, 1.0)
    settings.update(arm_options(arm, init_adapter), keep_checkpoints=1)
    return settings


def train_arm(args, arm: str, train_data: Path) -> dict:
    """Train (or resume) the arm; returns its status and wall time. A finished run is left alone."""
    from finetune.recipes.recipe_smollm2 import flags
    from finetune.status import read_status

    if arm in UNTRAINED:
        return {}
    out = Path(args.work) / arm / "train"
    st = read_status(out)
    if st and st.state == "finished" and st.step == args.steps:
        log(f"{arm}: trained before ({args.steps} steps), skipped")
        return {"trained_before": True}
    cmd = [sys.executable, "-m", "finetune.train", "--base-model", args.base, "--data", str(train_data),
           "--output-dir", str(out), *flags(arm_settings(arm, args.steps, args.init_adapter)),
           "--threads", str(args.threads)]
    log(f"{arm}: $ {shlex.join(cmd)}")
    t0 = time.perf_counter()
    with (Path(args.work) / arm / "train.log").open("a") as fh:
        code = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"{arm}: finetune.train failed (exit {code}): see {Path(args.work) / arm / 'train.log'}")
    return {"train_s": round(time.perf_counter() - t0, 1)}


def train_summary(out: Path, last: int = 25) -> dict:
    """Mean mask / AR CE of the last ``last`` logged steps and the run's training seconds."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tail = rows[-last:]

    def mean(key: str) -> float:
        return sum(r[key] for r in tail) / len(tail)

    return {"train_mask_ce": mean("loss_mask"), "train_ar_ce": mean("loss_ar"), "train_elapsed_s": rows[-1]["elapsed"],
            "steps": rows[-1]["step"]}


# ----------------------------------------------------------------------------- scoring


def score_key(args, checkpoint: Path) -> dict:
    """What a score depends on: a saved score with another key is redone."""
    return {"checkpoint": str(checkpoint), "dev_examples": args.dev_examples, "prompts": args.prompts,
            "prompt_seed": args.prompt_seed, "max_new_tokens": args.max_new_tokens}


def score_arm(args, arm: str, dev_data: Path) -> dict:
    """The arm's score.json, computed unless a saved one has the same key."""
    import torch

    from finetune.recipes.ab_score import decode_metrics, mask_metrics, trained_model
    from finetune.checkpoint import list_checkpoints
    from finetune.config import native_bf16_cpu
    from finetune.data import build_examples, load_conversations, pad_id_of
    from finetune.evals.natural import natural_prompts
    from finetune.train_model import load_base
    from mars_core.models.loading import wrap_model
    from mars_core.models.storage import atomic_write_text

    folder = Path(args.work) / arm
    checkpoint = Path(args.init_adapter) if arm in UNTRAINED else list_checkpoints(folder / "train")[-1]
    key = score_key(args, checkpoint)
    path = folder / "score.json"
    if path.is_file() and json.loads(path.read_text()).get("key") == key:
        log(f"{arm}: scored before, skipped")
        return json.loads(path.read_text())
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    base = load_base(args.base)
    if arm in UNTRAINED:   # the adapter as mars_core serves it: merged into the base, or a gated one attached
        from mars_core.models.adapter import is_gated, merge_adapter, read_adapter_config
        from mars_core.models.adapter import attach_gated

        model = base.model.eval()
        (attach_gated if is_gated(read_adapter_config(checkpoint)) else merge_adapter)(model, checkpoint)
    else:
        model = trained_model(checkpoint, base)
    settings = arm_settings(arm, args.steps, args.init_adapter)
    dev = build_examples(load_conversations(str(dev_data)), base.tokenizer, max_length=settings["max_length"],
                         block_size=settings["block_size"], eos_ids=base.eos_ids, overlong="drop")
    masks = mask_metrics(model, dev, base.mask_id, pad_id_of(base.tokenizer, base.eos_ids), settings["block_size"])
    log(f"{arm}: held-out mask CE {masks['mask_ce']:.3f}, agreement {masks['agreement']}")
    dtype = torch.bfloat16 if native_bf16_cpu() else torch.float32   # as the recipe decodes on this CPU
    lm = wrap_model(model.to(dtype), base.tokenizer, name=arm,
                    mask_token=base.tokenizer.convert_ids_to_tokens(base.mask_id))
    assert lm.mask_id == base.mask_id, "the scored model resolved another mask token than training used"
    prompts = natural_prompts("heldout", args.prompts, seed=args.prompt_seed)
    decoded = decode_metrics(lm, prompts, block_size=settings["block_size"], max_new_tokens=args.max_new_tokens)
    trained = {"steps": 0} if arm in UNTRAINED else train_summary(folder / "train")
    result = {"key": key, "arm": arm, "settings": arm_options(arm, args.init_adapter),
              "dtype": str(dtype).replace("torch.", ""), **trained, **masks, **decoded,
              "score_s": round(time.perf_counter() - t0, 1)}
    atomic_write_text(path, json.dumps(result, indent=1))
    log(f"{arm}: lossless {decoded['lossless_tpf']:.3f}, lossy {decoded['lossy_tpf']:.3f} tokens/forward")
    return result


# ----------------------------------------------------------------------------- the table


def paired(r: dict, ref: dict, key: str = "lossless_tpf_each") -> str:
    """Arm ``r`` against the first arm prompt by prompt: the mean difference of tokens/forward and on how many
    prompts it is higher / lower (a mean over 24 prompts hides which way most of them went)."""
    a, b = r.get(key), ref.get(key)
    if r is ref or not a or not b or len(a) != len(b):
        return "–"
    diffs = [x - y for x, y in zip(a, b)]
    higher, lower = sum(d > 1e-9 for d in diffs), sum(d < -1e-9 for d in diffs)
    return f"{sum(diffs) / len(diffs):+.3f} ({higher} / {lower})"


def format_table(results: list[dict], block_size: int = 4) -> str:
    slots = " / ".join(str(j) for j in range(1, block_size))
    first = results[0]["arm"] if results else ""
    head = (f"| arm | settings | steps | train min | train mask CE (last 25) | held-out mask CE | held-out AR CE | "
            f"agreement slot {slots} | lossless τ 0.3 tok/fwd | lossless vs {first}, paired (mean, prompts higher / "
            "lower) | lossy τ 0.95 tok/fwd | lossy = lossless (answers / prefix) |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]

    def num(value, fmt: str) -> str:   # an untrained arm has no training numbers
        return "–" if value is None else format(value, fmt)

    for r in results:
        agree = " / ".join(f"{100 * r['agreement'].get(f'slot{j}', float('nan')):.1f}%" for j in range(1, block_size))
        settings = ", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "recipe"
        if r["arm"] in UNTRAINED:
            settings += " (as it is)"
        minutes = None if r.get("train_elapsed_s") is None else r["train_elapsed_s"] / 60
        lines.append(f"| {r['arm']} | {settings} | {r['steps']} | {num(minutes, '.1f')} | "
                     f"{num(r.get('train_mask_ce'), '.3f')} | {r['mask_ce']:.3f} | {r['ar_ce']:.3f} | {agree} | "
                     f"{r['lossless_tpf']:.3f} | {paired(r, results[0])} | {r['lossy_tpf']:.3f} | "
                     f"{100 * r['lossy_same_answer']:.0f}% / {100 * r['lossy_prefix_share']:.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from finetune.config import check_output_file

    args = parse_args(argv)
    work = Path(args.work)
    check_output_file("--work", work / "table.md")
    train_data, dev_data = split_data(Path(args.data), work, args.dev_examples)
    results = []
    for arm in args.arms:
        (work / arm).mkdir(parents=True, exist_ok=True)
        train_arm(args, arm, train_data)
        results.append(score_arm(args, arm, dev_data))
        table = format_table(results)
        start = f"{args.base}" + (f" (warm* arms: from {args.init_adapter})" if args.init_adapter else "")
        header = (f"Development A/B, {args.steps} steps per arm from {start}; held-out: {args.dev_examples} "
                  f"examples of --data; prompts: natural_prompts('heldout', {args.prompts}, seed={args.prompt_seed}),"
                  f" {args.max_new_tokens} new tokens, {results[0]['dtype']}.\n\n")
        from mars_core.models.storage import atomic_write_text

        atomic_write_text(work / "table.md", header + table + "\n")
    print(header + table)
    return 0


if __name__ == "__main__":
    from finetune.config import run_main

    run_main(main)
