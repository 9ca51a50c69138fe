"""TrainConfig: every knob of ``python -m finetune.train``, validated in one place.

Values come from (lowest to highest priority) the defaults below, a JSON file
(``--config FILE.json``, same keys; dashes or underscores), and CLI flags. The
resolved config is written to ``train_config.json`` in the run directory and in
every checkpoint.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from mars_core.models.storage import check_writable, storage_error   # standard library only: no torch
from mars_core.models.textfile import not_a_file   # standard library only too

STAGES = ("ar-sft", "mars")
DECAYS = ("cosine", "linear", "constant")
OVERLONG = ("drop", "truncate")
MIXED_PRECISION = ("no", "bf16", "fp16")
ATTENTION = ("sdpa", "eager")
SHARDING = ("no", "full")


@dataclass
class TrainConfig:
    base_model: str = "tiny-ar-sft"
    """Model to start from: a mars_core name (tiny-ar-sft, tiny-mars, smollm2), a local transformers dir or a .gguf."""
    output_dir: str = "runs/finetune"
    """Run directory: train_config.json, status.json, metrics.jsonl, checkpoint-<step>/; resumed if it has
    checkpoints."""
    data: str = "builtin"
    """Training data: 'builtin' (finetune.tasks train split) or a chat JSONL path."""
    builtin_examples: int = 2000
    """Number of built-in task examples to generate when --data builtin."""
    builtin_weights: str = ""
    """Built-in data only: 'sorting=3,multiplication=2' draws those families 3x and 2x as often as the others."""
    stage: str = "mars"
    """'ar-sft' (plain causal SFT, stage 1) or 'mars' (dual-stream MARS loss, stage 2)."""
    block_size: int = 4
    """MARS block size B (tokens predicted per forward at most)."""
    ar_weight: float = 1.0
    """Weight of the clean-stream (AR) loss in MARS: 1.0 is MARS, 0.0 the no-SFT-loss ablation."""
    mask_label_smoothing: float = 0.0
    """Label smoothing on the noisy-stream (mask) loss only; 0 = off, the paper. Not in the paper: an experiment
    in calibrating the mask predictions' confidence (see docs/experiments.md, "Confidence criteria")."""
    soft_target_weight: float = 0.0
    """MARS: weight w of a soft target for the mask stream, mask term = (1 - w) * CE + w * KL(clean || mask), the
    teacher being the clean stream's detached next-token distribution at the same target; 0 = off (the paper),
    1 = KL alone. Not in the paper (issue 29)."""
    soft_target_top_k: int = 0
    """With --soft-target-weight: keep the teacher's top k tokens (renormalised); 0 = the whole vocabulary."""
    ar_anchor: str = ""
    """MARS: a model (name or folder, same tokenizer) whose next-token distribution the clean stream is pulled
    toward: the AR term becomes (1 - w) * CE + w * KL(anchor || clean), w = --ar-anchor-weight. Every step of
    MARS training also moves the one-token path; anchoring it to the base model's full distribution (not only its
    greedy token) holds AR's answers near the base's. Empty: off (the paper). Not in the paper (issue 52)."""
    ar_anchor_weight: float = 1.0
    """With --ar-anchor: the KL share w of the clean-stream term (1 = KL alone)."""
    random_block_offset: bool = False
    """MARS: shift the block grid by a random r in [0, B) at every step (block(i) = (i + r) // B) instead of
    the fixed grid (docs/algorithm.md), so the mask runs the decoder appends at any position are in the training
    distribution (docs/experiments.md, "Block phase")."""
    lr: float = 1e-5
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 0
    """Linear warmup from 0 to --lr over this many optimizer steps."""
    decay: str = "cosine"
    """Learning-rate decay after warmup: cosine, linear or constant."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of --lr (cosine and linear decay)."""
    max_steps: int | None = None
    """Optimizer steps to train; if unset, --epochs decides."""
    epochs: float = 1.0
    """Passes over the data when --max-steps is unset (fractions allowed)."""
    batch_size: int = 8
    """Examples per process per micro-batch."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    max_length: int = 512
    """Longest example in tokens (after block padding); see --overlong."""
    overlong: str = "drop"
    """Examples longer than --max-length: 'drop' them (counted warning) or 'truncate' the prompt from the left."""
    max_row_bytes: int = 1_000_000
    """Longest --data JSONL row in bytes; a longer one is refused by its line number before tokenizing."""
    seed: int = 0
    """Seed for data order, initialisation of LoRA weights and dropout."""
    weight_decay: float = 0.0
    """AdamW weight decay (not applied to biases and norm weights)."""
    adam_beta2: float = 0.95
    """AdamW beta2 (beta1 is 0.9)."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this value; 0 disables clipping."""
    lora: bool = False
    """Train LoRA adapters (peft) instead of all weights; merged into the weights at every save."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: int = 16
    """LoRA alpha (scale = alpha / r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    lora_layers: int = 0
    """With --lora: adapt only the top N decoder layers (0 = every layer). Without --train-mask-row nothing below
    them needs a gradient, so the backward pass stops at the lowest adapted layer: cheaper steps, less capacity."""
    gated_lora: bool = False
    """MARS with --lora: apply the LoRA delta only where the input token is the mask (Samragh et al., arXiv
    2507.11851), so every real token, hence the one-token path, is the base model exactly. Checkpoints then hold
    the base weights plus the adapter in trainer_state.pt (a merged model would apply the delta everywhere).
    Since the clean stream is then the base model, it runs without a graph and only the masks are backpropagated
    (finetune.losses, frozen_clean): a step costs ~0.7 of an ungated one on SmolLM2."""
    init_adapter: str = ""
    """Warm start (MARS with --lora): an adapter folder, e.g. assets/smollm2-mars, whose LoRA weights and mask row
    this run starts from instead of a fresh adapter; --base-model, --lora-r, --lora-alpha, --block-size and
    --train-mask-row must match it, and --gated-lora must be set exactly when it is a gated one
    (mars-gated-lora-v1, written by finetune.recipes.export_adapter from a --gated-lora run). Optimizer and schedule
    start afresh. Empty: a fresh adapter."""
    skip_seen: str = ""
    """A data manifest (data_manifest.json, or a folder holding one: a run, a checkpoint, an exported adapter):
    conversations whose prompt it lists are left out, so a continued run adds only new examples. Every run writes
    its own manifest (the skipped one plus this run's data) to --output-dir and each checkpoint."""
    train_mask_row: bool = False
    """MARS: also train the mask token's embedding row (one vector of hidden-size numbers). For a reused special
    token (SmolLM2's <repo_name>) that row was never trained for anything; with tied embeddings the LM head's
    row of the mask id is the same vector, and the decoder never proposes the mask id at a mask position."""
    freeze_embeddings: bool = False
    """Full fine-tuning: keep the token embedding matrix (and so a tied LM head) as it is; with --train-mask-row the
    mask token's row still trains. The change then lies in the decoder layers only, which an SVD delta can ship
    compactly (finetune.recipes.export_delta); a changed 49,152 x 576 embedding would not."""
    save_every: int = 0
    """Save a checkpoint every N optimizer steps (0: only at the end, on SIGINT/SIGTERM)."""
    keep_checkpoints: int = 2
    """Keep only the newest N checkpoints in --output-dir."""
    log_every: int = 1
    """Append a metrics.jsonl line every N optimizer steps."""
    threads: int | None = None
    """torch CPU threads per process (default: torch's own choice)."""
    mixed_precision: str = "no"
    """accelerate mixed precision: no, bf16 or fp16 (fp16 needs a GPU)."""
    attention: str = "sdpa"
    """Attention kernel while training: sdpa, or eager (matmul + softmax). On a CPU with --mixed-precision bf16,
    eager steps are ~1.7x faster than fp32 sdpa (sdpa's bf16 CPU backward is slow). Not saved with the model."""
    compile: bool = False
    """torch.compile the decoder (dynamic shapes): ~1.5x faster steps on CPU after 1-2 min of compiling."""
    sharding: str = "no"
    """'no': every process holds the whole model, its gradients and Adam state (data parallel through accelerate);
    'full': PyTorch FSDP2 shards them over the processes (one unit per decoder layer, then the rest), launched by
    torchrun or accelerate launch with 2 or more processes; see docs/scaling.md and finetune.sharding."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them: less memory, about
    a third more compute per step. The same numbers either way."""
    group_by_length: bool = True
    """Batch examples of similar length together (sorted inside windows of 50 global batches, the batches then
    shuffled) so less compute goes to padding; false: a plain shuffle."""
    keep_freed_memory: bool = True
    """On a CPU, keep freed host memory in the process (glibc's malloc: no block of its own mapping, no trimming),
    so a step does not page-fault its activations in afresh: SmolLM2 steps 1.13x (with --compile) to 1.3x faster,
    peak memory up to an eighth higher (finetune.host_memory). Changes no number a step computes; false: glibc's
    defaults."""

    def __post_init__(self):
        check_types(self)
        self._check_choices_and_paths()
        self._check_training_numbers()
        self._check_lora_and_run()

    def _check_choices_and_paths(self):
        """The enumerated settings are known values; model, output and data are named."""
        _need(self.stage in STAGES, f"stage={self.stage!r}; use one of {', '.join(STAGES)}")
        _need(self.decay in DECAYS, f"decay={self.decay!r}; use one of {', '.join(DECAYS)}")
        _need(self.overlong in OVERLONG, f"overlong={self.overlong!r}; use one of {', '.join(OVERLONG)}")
        _need(
            self.mixed_precision in MIXED_PRECISION,
            f"mixed_precision={self.mixed_precision!r}; use one of {', '.join(MIXED_PRECISION)}",
        )
        _need(self.attention in ATTENTION, f"attention={self.attention!r}; use one of {', '.join(ATTENTION)}")
        _need(bool(self.base_model), "base_model is empty; pass --base-model NAME_OR_DIR")
        _need(bool(self.output_dir), "output_dir is empty; pass --output-dir DIR")
        _need(bool(self.data), "data is empty; pass --data builtin or --data FILE.jsonl")

    def _check_training_numbers(self):
        """The loss, schedule, batch and optimiser numbers are in range."""
        _need(self.block_size >= 1, f"block_size={self.block_size}; use an integer >= 1 (the paper uses 4)")
        _need(self.ar_weight >= 0, f"ar_weight={self.ar_weight}; use a value >= 0 (1.0 is MARS, 0.0 the ablation)")
        _need(0 <= self.mask_label_smoothing < 1,
             f"mask_label_smoothing={self.mask_label_smoothing}; use a value in [0, 1) (0 = off)")
        _need(0 <= self.soft_target_weight <= 1,
             f"soft_target_weight={self.soft_target_weight}; use a value in [0, 1] (0 = off, 1 = KL alone)")
        _need(self.soft_target_top_k >= 0, f"soft_target_top_k={self.soft_target_top_k}; use 0 (all) or more")
        _need(0 < self.ar_anchor_weight <= 1,
             f"ar_anchor_weight={self.ar_anchor_weight}; use a value in (0, 1] (1 = KL to the anchor alone)")
        _need(not self.ar_anchor or (self.stage == "mars" and self.ar_weight > 0 and not self.gated_lora
                                     and self.soft_target_weight == 0),
             f"ar_anchor={self.ar_anchor!r} anchors the clean-stream term of --stage mars with ar_weight > 0; it "
             "does not combine with --gated-lora (its clean stream is the base already) or --soft-target-weight: "
             "drop one of them")
        _need(self.lr > 0, f"lr={self.lr}; use a positive learning rate such as 1e-5")
        _need(self.warmup_steps >= 0, f"warmup_steps={self.warmup_steps}; use 0 or more")
        _need(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio={self.min_lr_ratio}; use a value in [0, 1]")
        _need(self.max_steps is None or self.max_steps >= 1, f"max_steps={self.max_steps}; use 1 or more (or unset)")
        _need(self.epochs > 0, f"epochs={self.epochs}; use a positive number")
        _need(self.batch_size >= 1, f"batch_size={self.batch_size}; use 1 or more")
        _need(self.grad_accum >= 1, f"grad_accum={self.grad_accum}; use 1 or more")
        _need(self.max_row_bytes >= 1, f"max_row_bytes={self.max_row_bytes}; use at least 1 (the default is 1000000)")
        _need(self.max_length >= 2, f"max_length={self.max_length}; use at least 2 tokens")
        _need(self.stage != "mars" or self.block_size <= self.max_length,
             f"block_size={self.block_size} is larger than max_length={self.max_length}: MARS pads every example to a "
             "multiple of the block size, so none would fit; use a block size such as 4 or raise --max-length")
        _need(self.builtin_examples >= 1, f"builtin_examples={self.builtin_examples}; use 1 or more")
        _need(self.weight_decay >= 0, f"weight_decay={self.weight_decay}; use 0 or more")
        _need(0 <= self.adam_beta2 < 1, f"adam_beta2={self.adam_beta2}; use a value in [0, 1)")
        _need(self.grad_clip >= 0, f"grad_clip={self.grad_clip}; use 0 (off) or a positive norm")

    def _check_lora_and_run(self):
        """LoRA and its options fit together; checkpointing, logging and sharding settings are usable."""
        _need(self.lora_r >= 1, f"lora_r={self.lora_r}; use 1 or more")
        _need(self.lora_alpha >= 1, f"lora_alpha={self.lora_alpha}; use 1 or more")
        _need(not (self.freeze_embeddings and self.lora),
             "freeze_embeddings applies to full fine-tuning (LoRA never trains the embeddings): drop it or --lora")
        _need(not self.train_mask_row or self.stage == "mars",
             "train_mask_row applies to --stage mars only (AR-SFT never feeds the mask token): drop it")
        _need(not self.gated_lora or (self.lora and self.stage == "mars"),
             "gated_lora gates a LoRA delta by the mask token: use it with --lora and --stage mars")
        _need(not self.init_adapter or (self.lora and self.stage == "mars"),
             "init_adapter warm-starts a MARS LoRA adapter: use it with --lora and --stage mars")
        _need(self.lora_layers >= 0, f"lora_layers={self.lora_layers}; use 0 (every layer) or a layer count")
        _need(not self.lora_layers or self.lora, "lora_layers chooses which layers LoRA adapts: use it with --lora")
        _need(0 <= self.lora_dropout < 1, f"lora_dropout={self.lora_dropout}; use a value in [0, 1)")
        _need(self.save_every >= 0, f"save_every={self.save_every}; use 0 (end only) or a step interval")
        _need(self.keep_checkpoints >= 1, f"keep_checkpoints={self.keep_checkpoints}; keep at least 1")
        _need(self.log_every >= 1, f"log_every={self.log_every}; use 1 or more")
        _need(self.threads is None or self.threads >= 1, f"threads={self.threads}; use 1 or more (or unset)")
        _need(self.sharding in SHARDING, f"sharding={self.sharding!r}; use one of {', '.join(SHARDING)}")
        _need(self.sharding == "no" or self.mixed_precision != "fp16",
             "sharding='full' with mixed_precision='fp16' is not supported (FSDP2 here casts to bf16, no loss scaler): "
             "use --mixed-precision bf16")
        _need(self.sharding == "no" or not self.compile,
             "sharding='full' with compile=true was never tested here: drop --compile")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict, where: str = "config") -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        values = {k.replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known keys: {', '.join(sorted(known))}")
        return cls(**values)


def _need(ok: bool, message: str):
    """Raise ``ValueError(message)`` unless ``ok``."""
    if not ok:
        raise ValueError(message)


# How each field's annotation is checked, and the fix the error suggests.
_TYPE_HINTS = {
    "bool": "true or false (a JSON boolean, not a string)",
    "int": "a whole number",
    "int | None": "a whole number (or null)",
    "float": "a finite number",
    "str": "a string",
}


def check_types(cfg: "TrainConfig") -> None:
    """Every field holds its annotated type: booleans only for bool fields ("false" is a string, refused),
    whole numbers for int fields (2.5 and true are refused), finite numbers for float fields (inf and nan
    are refused). A JSON --config reaches TrainConfig unconverted, so this is where its values are checked."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if kind == "bool":
            ok = isinstance(value, bool)
        elif kind in ("int", "int | None"):
            ok = (value is None and kind == "int | None") or (isinstance(value, int) and not isinstance(value, bool))
        elif kind == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        elif kind == "str":
            ok = isinstance(value, str)
        else:  # a new annotation: nothing to check against
            continue
        if not ok:
            raise ValueError(f"{f.name}={value!r} is not valid: use {_TYPE_HINTS[kind]} "
                             f"(--{f.name.replace('_', '-')} on the command line)")


def refuse_file_above(p: Path, label: str, fix: str) -> None:
    """A path whose nearest existing ancestor is a file can never be created: say so, naming both."""
    for folder in p.parents:
        if folder.exists():
            if not folder.is_dir():
                raise ValueError(f"{label} lies under {str(folder)!r}, which is a file: {fix}")
            return


def check_output_file(flag: str, path: str | Path) -> Path:
    """An output file path that can be written: not a directory, not under a file, its folder creatable and
    writable. Checked before any long work, so results are never lost to a bad path at the end. The file itself
    is left as it was (a probe file next to it is created and removed)."""
    p = Path(path).expanduser()
    try:
        is_dir = p.is_dir()
    except OSError:   # e.g. a name too long: check_writable below words it
        is_dir = False
    if is_dir:
        raise ValueError(f"{flag} {str(path)!r} is a directory: pass a file path")
    refuse_file_above(p, f"{flag} {str(path)!r}", "pass a path inside a directory")
    return check_writable(path, flag)


def native_bf16_cpu(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True when the CPU multiplies bf16 natively (x86 avx512_bf16 or AMX): there ``--mixed-precision bf16
    --attention eager`` trains ~1.7x faster than fp32. Elsewhere bf16 is emulated and slower, so False."""
    try:
        flags = set(Path(cpuinfo).read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def field_docs() -> dict[str, str]:
    """The one-line docstring under each TrainConfig field (used as --help text)."""
    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = nxt.value.value
    return docs


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean; use true or false")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m finetune.train",
        description="Fine-tune a causal LM with AR-SFT or MARS (see docs/algorithm.md). "
        "Runs data-parallel unchanged under `accelerate launch`. "
        "Re-running with the same --output-dir resumes from its last checkpoint.",
        epilog="Data: chat JSONL, one {\"messages\": [...]} per line; prompt tokens are not supervised, the last "
        "assistant turn is (up to its end-of-turn token). Over-long examples (longer than --max-length after "
        "MARS block padding): --overlong drop skips them and warns with the count; --overlong truncate cuts "
        "the prompt from the left and keeps the response whole (an example whose response alone is too long is "
        "dropped). Run directory: train_config.json, status.json, metrics.jsonl, checkpoint-<step>/.",
    )
    parser.add_argument("--config", help="JSON file with any of the keys below (CLI flags override it)")
    docs = field_docs()
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        kind = {"bool": parse_bool, "int": int, "int | None": int, "float": float, "str": str}[f.type]
        if f.type == "bool":
            parser.add_argument(flag, nargs="?", const=True, type=parse_bool, default=None, help=docs[f.name])
            continue
        # default=None marks "not given", so a --config file value is not overridden by a default
        shown = "" if default is None else f" (default: {default})"
        choices = {"stage": STAGES, "decay": DECAYS, "overlong": OVERLONG, "mixed_precision": MIXED_PRECISION,
                   "attention": ATTENTION, "sharding": SHARDING}
        parser.add_argument(flag, type=kind, default=None, choices=choices.get(f.name), help=docs[f.name] + shown)
    # Not a TrainConfig field: an act on the folder, not a setting of the run (a --config copied from a run's
    # train_config.json must never restart anything).
    parser.add_argument("--restart", action="store_true",
                        help="--output-dir holds an earlier run (checkpoints or logged steps): move it aside to "
                             "<dir>.old-<time> and start over, instead of resuming it")
    # Not a setting either: print the plan (steps, tokens, memory per process, checkpoint size) and train nothing.
    parser.add_argument("--dry-run", action="store_true",
                        help="print the run's plan (optimizer steps, tokens, estimated memory per process for "
                             "--sharding with and without --gradient-checkpointing, checkpoint size) and exit "
                             "without loading weights or training; see finetune.plan")
    parser.add_argument("--plan-examples", type=int, default=None,
                        help="with --dry-run when --data is not on this machine: plan for this many examples "
                             "(each counted at --max-length tokens)")
    parser.add_argument("--plan-processes", type=int, default=None,
                        help="with --dry-run: plan for this many processes (GPUs) instead of the launcher's "
                             "WORLD_SIZE, e.g. 8 from a machine without GPUs")
    return parser


def config_from_args(argv: list[str] | None = None) -> TrainConfig:
    """Defaults < --config JSON < explicit flags."""
    return parse_train_args(argv)[0]


def parse_train_args(argv: list[str] | None = None) -> tuple[TrainConfig, bool]:
    """(the TrainConfig, whether --restart was given)."""
    cfg, args = parse_train_command(argv)
    return cfg, args.restart


def parse_train_command(argv: list[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    """(the TrainConfig, the parsed flags: --restart, --dry-run and --plan-examples are not settings of the run)."""
    args = build_parser().parse_args(argv)
    values: dict = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():   # a directory, a missing path, a FIFO or a device, named as what it is
            raise ValueError(f"--config {str(path)!r} {not_a_file(path)}; pass a JSON file")
        try:
            values = json.loads(path.read_bytes().decode("utf-8"))
        except OSError as e:
            raise ValueError(f"--config {str(path)!r} cannot be read ({e.strerror or e}): "
                             "check its permissions") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"--config {str(path)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                             f"{e.start}); save it as UTF-8 JSON") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {str(path)!r} is not valid JSON ({e.msg.removesuffix(' at')} "
                             f"at line {e.lineno}, column {e.colno}); fix the file") from None
        if not isinstance(values, dict):
            raise ValueError(f"--config {str(path)!r} must hold a JSON object of TrainConfig keys")
        values = {k.replace("-", "_"): v for k, v in values.items()}
    for f in fields(TrainConfig):
        given = getattr(args, f.name)
        if given is not None:
            values[f.name] = given
    for flag in ("plan_examples", "plan_processes"):
        value = getattr(args, flag)
        if value is not None and (not args.dry_run or value < 1):
            raise ValueError(f"--{flag.replace('_', '-')} {value}: use a count of 1 or more, with --dry-run")
    return TrainConfig.from_dict(values, where=args.config or "config"), args


def run_main(main) -> None:
    """A command's entry point: bad input (a ValueError) prints one line naming the fix and exits with 2,
    without a traceback, as do an OSError (a full or read-only disk), running out of memory, NaN/inf logits and a
    stdout that cannot be written (a closed pipe ends quietly, as a Unix tool does; mars_core.tools.exits);
    SIGINT/SIGTERM print one line (the KeyboardInterrupt's text says how far it got: a command that can save its
    work catches it, saves, and re-raises with that text) and exit 130/143; otherwise exit with main()'s return
    code when it returns one (an int), else 0."""
    from mars_core.decode.config import interrupt_exit, sigterm_as_interrupt   # here: mars_core imports torch
    from mars_core.tools.exits import StdoutFault, guarded_stdout, out_of_memory, stdout_exit

    try:
        with guarded_stdout(), sigterm_as_interrupt():
            code = main()
    except StdoutFault as fault:
        sys.exit(stdout_exit(fault))
    except (ValueError, OSError, MemoryError, RuntimeError) as exc:
        if out_of_memory(exc):   # also a ValueError raised while handling one: not the input's fault
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            print(f"error: out of memory ({first}): use a smaller --batch-size, fewer --threads, or a machine with "
                  "more memory", file=sys.stderr)
            sys.exit(2)
        if isinstance(exc, ValueError):
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
        if isinstance(exc, OSError):   # a full or read-only disk a writer did not word itself: one line
            print(f"error: {storage_error(exc)}", file=sys.stderr)
            sys.exit(2)
        raise
    except FloatingPointError as exc:   # NaN/inf logits: the decoder's message names the model and the fix
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as exc:
        sys.exit(interrupt_exit(exc))
    sys.exit(code if isinstance(code, int) else 0)
