"""lm-eval (EleutherAI's lm-evaluation-harness) with our decoder: the model class `mars`.

    pip install '.[eval]'                                       # lm-eval, pinned in requirements-dev.txt
    python -m finetune.evals.lm_eval_mars --model mars --model_args model=tiny-mars,tau=0.95,block_size=4,mode=mars \\
        --tasks gsm8k --apply_chat_template                     # or `mars-lm-eval ...` once installed

Every lm-eval flag works: this command is lm-eval's own CLI with the class registered first. lm-eval (0.4.13)
finds model classes only in its own registry, filled by `@register_model` when the defining module is imported,
and neither `--include_path` (tasks only) nor an entry point loads an outside module, so the bare `lm_eval`
command cannot see `mars`. In Python: `import finetune.evals.lm_eval_mars`, then `simple_evaluate(model="mars", ...)`.

- `generate_until` runs mars_core's decoder in the mode asked for: `mars` (τ, B), `verify` (lossless MARS,
  alias `lossless`) or `ar`; the task's `until` strings stop the decoder and cut the text, as lm-eval expects.
- `loglikelihood` and `loglikelihood_rolling` score with the model's AR forward (one forward per batch of
  requests, no masks): multiple-choice scores never depend on mode or τ.
- Tokens per forward (new tokens ÷ forwards, mean over a task's sequences, docs/algorithm.md) is logged when a
  task's generations finish, stored in the results JSON under config["tokens_per_forward"], and printed as a
  table under lm-eval's when this command runs.

model_args: model (a name `load_model` knows or a folder; default tiny-mars), mode, tau, block_size, criterion,
draft_layout, max_gen_toks (default 256, when a task gives none), device (auto), dtype (auto), backend (auto),
mask_token, seed (sampling tasks only). Nothing here reaches the network: `load_model` reads local folders
(a hub id is downloaded only when named), and the tasks are the user's.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass, fields
from typing import Any

if importlib.util.find_spec("lm_eval") is None:   # the optional extra is missing: say how to get it, no traceback
    _MISSING = "lm-eval is not installed: pip install '.[eval]' (or pip install -r requirements-dev.txt)"
    if __name__ == "__main__":
        print(f"error: {_MISSING}", file=sys.stderr)
        sys.exit(2)
    raise ImportError(_MISSING)

import lm_eval.models  # noqa: F401  lm-eval's registry loads its own names (hf, vllm, ...) only while it is empty:
import torch           # load them before "mars" goes in, or `--model hf` would be gone from this process
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from mars_core import DecodeConfig, generate, load_model
from mars_core.models.formats import BACKENDS, pick_dtype
from mars_core.models.loading import pick_device
from mars_core.models.sources import resolve_source

log = logging.getLogger("lm_eval.mars")
MODE_ALIASES = {"lossless": "verify"}
GEN_KWARGS = ("until", "max_gen_toks", "max_new_tokens", "do_sample", "temperature", "top_p")


INSTANCES: list = []   # every MarsLM this process built, so that the command can print their tallies


class BadModelArgs(ValueError):
    """A model_args value this class refuses; the command prints it as one line and exits 2."""


def _batch_size(value) -> int:
    text = str(value)
    if not text.isdigit() or int(text) < 1:
        raise BadModelArgs(f"batch_size={value!r}: pass a whole number >= 1 (automatic batch sizes are not "
                           "supported: a batch decodes each row exactly as alone, so pick the size that fits)")
    return int(text)


MODEL_ARGS = ("model", "mode", "tau", "block_size", "criterion", "draft_layout", "max_gen_toks", "device", "dtype",
              "backend", "mask_token", "seed")


@dataclass(frozen=True)
class MarsModelArgs:
    """`--model_args` of `--model mars` (lm-eval passes them as keyword arguments), with their defaults; lm-eval's
    own batch_size and max_batch_size arrive here too."""

    model: str | None = None
    mode: str = "mars"
    tau: float = 0.95
    block_size: int = 4
    criterion: str = "prob"
    draft_layout: str = "linear"
    max_gen_toks: int = 256
    device: str | None = "auto"
    seed: int = 0
    batch_size: Any = 1
    max_batch_size: Any = None
    dtype: str = "auto"
    backend: str = "auto"
    mask_token: str | None = None

    @classmethod
    def of(cls, values: dict) -> MarsModelArgs:
        """The settings in `values`, or BadModelArgs naming the keys this class does not know."""
        known = {f.name for f in fields(cls)}
        unknown = {k: v for k, v in values.items() if k not in known}
        if unknown:
            raise BadModelArgs(f"model_args {', '.join(f'{k}={v!r}' for k, v in unknown.items())} unknown to "
                               f"--model mars: use {', '.join(MODEL_ARGS)}")
        return cls(**values)


def check_model_args(**model_args) -> tuple[DecodeConfig, int]:
    """Every model_args value (MarsModelArgs' keys) checked without loading anything (the command runs this before
    lm-eval reads its task index): the decoding config and the batch size, or BadModelArgs naming the value and the
    fix."""
    a = MarsModelArgs.of(model_args)
    try:
        decode = DecodeConfig(mode=MODE_ALIASES.get(str(a.mode), str(a.mode)), tau=a.tau, block_size=a.block_size,
                              criterion=a.criterion, draft_layout=a.draft_layout, max_new_tokens=a.max_gen_toks,
                              seed=a.seed)
        batch = _batch_size(a.batch_size)
        resolve_source(None if a.model is None else str(a.model))   # a name or folder that does not exist
        pick_dtype(str(a.dtype), pick_device(a.device or "auto"))     # cuda on a machine without one, an unknown dtype
        if a.backend not in BACKENDS:
            raise ValueError(f"backend={a.backend!r} is unknown: use auto, hf or lean")
    except BadModelArgs:
        raise
    except ValueError as exc:
        raise BadModelArgs(str(exc)) from None
    return decode, batch


@register_model("mars")
class MarsLM(TemplateLM):
    """lm-eval's view of a mars_core model: generation through `mars_core.generate`, scores through the AR forward."""

    def __init__(self, **model_args):
        """`model_args`: MarsModelArgs' keys, as lm-eval passes `--model_args` (checked by check_model_args)."""
        super().__init__()
        self.decode, self._batch = check_model_args(**model_args)
        a = MarsModelArgs.of(model_args)
        try:
            self.lm = load_model(None if a.model is None else str(a.model), device=a.device or "auto",
                                 dtype=str(a.dtype), mask_token=a.mask_token, backend=str(a.backend))
        except ValueError as exc:
            raise BadModelArgs(str(exc)) from None
        self.tokenizer = self.lm.tokenizer
        self._device = self.lm.device
        self.decode_stats: dict[str, dict] = {}   # task -> tokens per forward and what it is made of
        INSTANCES.append(self)

    # ------------------------------------------------------------------------- lm-eval's construction

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        # lm-eval's CLI always passes device (default "cuda:0") and batch_size; a value in model_args wins, so
        # `device=cpu` there is not a duplicate argument.
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    # ------------------------------------------------------------------------- tokens

    @property
    def eot_token_id(self) -> int:
        return self.lm.eos_ids[0] if self.tokenizer.eos_token_id is None else self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self.lm.context_length

    @property
    def batch_size(self) -> int:
        return self._batch

    @property
    def tokenizer_name(self) -> str:
        return (self.lm.path or self.lm.name).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # Special-token text is parsed as the token: a prompt from --apply_chat_template holds the template's own.
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"]

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def get_model_info(self) -> dict:
        """Merged by lm-eval into results["config"] (so into the results JSON) after every task has run."""
        cfg = self.decode
        return {"mars": {"model": self.lm.name, "path": self.lm.path, "mode": cfg.mode, "tau": cfg.tau,
                         "block_size": cfg.block_size, "criterion": cfg.criterion, "device": str(self.lm.device),
                         "weight_format": self.lm.weight_format, "backend": self.lm.backend},
                "tokens_per_forward": {task: dict(s) for task, s in self.decode_stats.items()}}

    # ------------------------------------------------------------------------- scores: the AR forward

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """(logprob, is_greedy) of each continuation after its context: one AR forward per batch, right-padded
        (padding after the last real token changes nothing before it under causal attention)."""
        size = override_bs or self._batch
        out = []
        for start in range(0, len(requests), size):
            chunk = requests[start:start + size]
            seqs, conts = [], []
            for key, context, continuation in chunk:
                if not continuation:
                    raise ValueError(f"the continuation of {key!r} has no tokens: a score needs at least one")
                whole = (context + continuation)[-(self.max_length + 1):]   # keep the end, as lm-eval's HF model does
                seqs.append(whole[:-1])
                conts.append(continuation[-len(whole) + 1:] if len(continuation) >= len(whole) else continuation)
            width = max(map(len, seqs))
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, :len(s)] = torch.tensor(s)
                mask[i, :len(s)] = 1
            with torch.inference_mode():
                logits = self.lm.model(input_ids=ids.to(self._device), attention_mask=mask.to(self._device)).logits
            logprobs = F.log_softmax(logits.float(), dim=-1)        # [b, width, vocab], fp32 for any model dtype
            for i, ((key, _, _), s, cont) in enumerate(zip(chunk, seqs, conts)):
                rows = logprobs[i, len(s) - len(cont): len(s)]       # [len(cont), vocab]: the outputs before each
                target = torch.tensor(cont, device=rows.device)
                score = float(rows.gather(-1, target[:, None]).sum())
                greedy = bool((rows.argmax(-1) == target).all())
                out.append((score, greedy))
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, (score, greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood, in windows of the context length, each token scored once."""
        scores = []
        for (text,) in (r.args for r in requests):
            windows = [(None,) + lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            score = sum(s for s, _ in self._loglikelihood_tokens(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), score)
            scores.append(score)
        return scores

    # ------------------------------------------------------------------------- generation: our decoder

    def _config(self, gen_kwargs: dict) -> tuple[DecodeConfig, list[str]]:
        """The task's generation kwargs as a DecodeConfig (this model's mode, τ and B) and its stop strings."""
        unknown = sorted(set(gen_kwargs) - set(GEN_KWARGS))
        if unknown:
            raise ValueError(f"generation kwargs {unknown} are not supported by --model mars: it takes "
                             f"{', '.join(GEN_KWARGS)}; drop them from the task's generation_kwargs / --gen_kwargs")
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = gen_kwargs.get("max_gen_toks", gen_kwargs.get("max_new_tokens", self.decode.max_new_tokens))
        sample = bool(gen_kwargs.get("do_sample", False)) and float(gen_kwargs.get("temperature", 1.0)) > 0
        cfg = DecodeConfig(mode=self.decode.mode, tau=self.decode.tau, block_size=self.decode.block_size,
                           criterion=self.decode.criterion, draft_layout=self.decode.draft_layout,
                           max_new_tokens=int(max_new), stop_strings=tuple(until), seed=self.decode.seed,
                           temperature=float(gen_kwargs.get("temperature", 1.0)) if sample else 0.0,
                           top_p=float(gen_kwargs.get("top_p", 1.0)) if sample else 1.0)
        return cfg, until

    def _prompt(self, context: str, max_new: int) -> list[int]:
        ids = self.tok_encode(context)
        room = self.max_length - max_new - 1
        if len(ids) > room:   # keep the end of a long context, as lm-eval's HF model does
            log.warning("a context of %d tokens is cut to its last %d to leave room for %d new tokens",
                        len(ids), room, max_new)
            ids = ids[-room:]
        return ids

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context decoded by mars_core in this model's mode; requests that share generation kwargs share
        batches (a batched row gets exactly its tokens alone)."""
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(repr(sorted(r.args[1].items())), []).append(i)
        texts: list[str | None] = [None] * len(requests)
        per_task: dict[str, list] = {}
        for members in groups.values():
            cfg, until = self._config(dict(requests[members[0]].args[1]))
            for start in range(0, len(members), self._batch):
                batch = members[start:start + self._batch]
                prompts = [self._prompt(requests[i].args[0], cfg.max_new_tokens) for i in batch]
                for i, result in zip(batch, generate(self.lm, prompts, cfg)):
                    text = result.text
                    for stop in until:   # lm-eval's contract: the text before the first stop string
                        text = text.split(stop)[0]
                    texts[i] = text
                    per_task.setdefault(requests[i].task_name or "?", []).append(result)
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        for task, results in per_task.items():
            self._record(task, results)
        return texts

    def _record(self, task: str, results) -> None:
        """Tokens per forward of a task's sequences: the mean over sequences (docs/algorithm.md), and the sums."""
        old = self.decode_stats.get(task, {"sequences": 0, "tokens": 0, "forwards": 0, "sum_per_sequence": 0.0})
        s = {"sequences": old["sequences"] + len(results),
             "tokens": old["tokens"] + sum(len(r.token_ids) for r in results),
             "forwards": old["forwards"] + sum(r.forwards for r in results),
             "sum_per_sequence": old["sum_per_sequence"] + sum(r.tokens_per_forward for r in results)}
        s["tokens_per_forward"] = s["sum_per_sequence"] / s["sequences"]
        self.decode_stats[task] = s
        cfg = self.decode
        how = "mode ar" if cfg.mode == "ar" else f"mode {cfg.mode}, tau {cfg.tau:g}, B {cfg.block_size}"
        log.info("%s: %.3f tokens per forward (mean over %d sequences; %d tokens in %d forwards), %s", task,
                 s["tokens_per_forward"], s["sequences"], s["tokens"], s["forwards"], how)


# ----------------------------------------------------------------------------- the command

def tokens_per_forward_table(models) -> str:
    """A markdown table (as lm-eval prints its results) of tokens per forward per task and model."""
    lines = ["|model|mode|tau|B|task|tokens/forward|sequences|forwards|", "|---|---|---|---|---|---|---|---|"]
    for m in models:
        for task, s in sorted(m.decode_stats.items()):
            ar = m.decode.mode == "ar"   # one token a forward: τ and B do not apply
            lines.append(f"|{m.lm.name}|{m.decode.mode}|{'-' if ar else f'{m.decode.tau:g}'}|"
                         f"{'-' if ar else m.decode.block_size}|{task}|"
                         f"{s['tokens_per_forward']:.3f}|{s['sequences']}|{s['forwards']}|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """lm-eval's CLI (its parser and its run command) with `mars` registered. For --model mars the model_args are
    checked first, and --device defaults to auto (lm-eval's own default is cuda:0)."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]
    setup_logging()
    cli = HarnessCLI()
    args = cli.parse_args()
    try:
        if getattr(args, "model", None) == "mars":
            args.device = getattr(args, "device", None) or "auto"
            given = dict(getattr(args, "model_args", None) or {})
            check_model_args(**{"device": args.device, "batch_size": getattr(args, "batch_size", 1), **given})
        cli.execute(args)
    except BadModelArgs as exc:
        print(f"error: --model mars: {exc}", file=sys.stderr)
        return 2
    if any(m.decode_stats for m in INSTANCES):
        print("\nTokens per forward (generate_until tasks; scores of loglikelihood tasks use the AR forward):")
        print(tokens_per_forward_table(INSTANCES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
