"""Which weight format and backend a model decodes in: `pick_dtype`, `pick_backend`, and `dtype="auto"`'s choice
on a CPU (the fastest exact format: w8a8 or w8a16 for models cleared for them, float32 otherwise;
mars_core/engine/dtype_probe.py times the candidates). `mars_core.models.loading.load_model` calls these before
and after it loads the weights."""
from __future__ import annotations

import torch

# dtype="auto" on a CPU may serve w8a8 only for these models: their quality in w8a8 was measured on the report
# seed against its bf16 numbers and kept (docs/experiments/cpu-formats.md, "w8a8 quality"). Others decode in
# float32.
W8A8_KEEPS_QUALITY: tuple[str, ...] = ("smollm2-mars",)
# ... and in w8a16 (mars_core/engine/avx2.cpp, MARS_WIDE), measured the same way
# (docs/experiments/cpu-speed-issue-27.md, "w8a16"); the probe then times it beside w8a8
W8A16_KEEPS_QUALITY: tuple[str, ...] = ("smollm2-mars",)
# The CPU formats with int8 weights and per-row quantized activations (mars_core.engine.w8a8): w8a16 is w8a8's layer
# stack with int16 activation levels in one pass, on our AVX2 kernel only.
ACT_QUANTIZED = ("w8a8", "w8a16")


def pick_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of activations (and of weights, except for "int8", whose weights are int8)."""
    if dtype == "auto":   # on a CPU, load_model then serves the fastest exact format (auto_cpu_format)
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype in ("int8",) + ACT_QUANTIZED:
        if device.type != "cpu":
            raise ValueError(f"dtype={dtype!r} is a CPU weight format, not one for device {device.type!r}: "
                             "use bfloat16 there, or --device cpu")
        if dtype == "w8a8":
            from mars_core.engine.w8a8 import check_w8a8

            check_w8a8()
            return torch.float32
        if dtype == "w8a16":
            from mars_core.engine.w8a8 import check_w8a16

            check_w8a16()
            return torch.float32
        from mars_core.engine.dtype_probe import cpu_has_native_bf16

        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype={dtype} is not a floating-point type: use torch.float32, bfloat16 or float16")
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype={dtype!r} is unknown: use auto, float32, bfloat16, float16, int8, w8a8 or w8a16 (CPU)")
    return table[dtype]


BACKENDS = ("auto", "hf", "lean")


def pick_backend(backend: str, model, device: torch.device) -> str:
    """"lean" or "hf". auto: the lean forward on a CPU wherever it supports the architecture."""
    from mars_core.engine.lean import unsupported

    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown: use auto, hf or lean")
    reason = unsupported(model)
    if backend == "lean" and reason is not None:
        raise ValueError(f"backend='lean' cannot run this model: {reason}; use backend='hf' (or auto)")
    if backend == "auto":
        return "lean" if device.type == "cpu" and reason is None else "hf"
    return backend


def auto_cpu_format(model, tokenizer, name: str, where: str, lean: bool):
    """("float32", "w8a8" or "w8a16", its lean forward if the probe built one, else None): w8a8 and w8a16 only
    where this model keeps its quality in them (W8A8_KEEPS_QUALITY, W8A16_KEEPS_QUALITY) and the format decodes
    faster here (dtype_probe); all three are exact formats."""
    from mars_core.engine.dtype_probe import choose_cpu_format
    from mars_core.engine.w8a8 import w8a8_supported

    if not lean:
        return "float32", None
    from mars_core.engine import avx2
    from mars_core.engine.lean import LeanLM

    builders = {"float32": lambda: LeanLM(model, "float", torch.float32)}
    if name in W8A8_KEEPS_QUALITY and w8a8_supported():
        builders["w8a8"] = lambda: lean_net(model, "w8a8", torch.float32, tokenizer)
    if name in W8A16_KEEPS_QUALITY and avx2.WIDE.load():
        builders["w8a16"] = lambda: lean_net(model, "w8a16", torch.float32, tokenizer)
    return choose_cpu_format(builders, where, sum(p.numel() for p in model.parameters()))   # before quantizing


def lean_net(model, dtype: str, torch_dtype: torch.dtype, tokenizer=None):
    """The lean forward in this format; w8a8 is smoothed with activation ranges measured through `tokenizer` (w8a16,
    whose activations keep ~15 bits, is not: smoothing moves outliers into the int8 weights, which only costs it)."""
    from mars_core.engine.lean import LeanLM
    from mars_core.engine.w8a8 import WIDE

    # w8a8's stack on the int16-level kernel, not smoothed (docs/experiments/cpu-speed-issue-27.md, "w8a16")
    if dtype == "w8a16":
        return LeanLM(model, "w8a8", torch_dtype, kernel=WIDE)
    ranges = None
    if dtype == "w8a8" and tokenizer is not None:
        ranges = calibration_ranges(model, tokenizer)
    return LeanLM(model, dtype if dtype in ("int8", "w8a8") else "float", torch_dtype, ranges=ranges)


def calibration_ranges(model, tokenizer) -> dict:
    """activation_ranges over CALIBRATION_PROMPTS, each through the tokenizer's chat template."""
    from mars_core.engine.w8a8 import CALIBRATION_PROMPTS, activation_ranges
    from mars_core.models.tokens import encode_chat

    ids = [encode_chat(tokenizer, [{"role": "user", "content": p}], add_generation_prompt=True)
           for p in CALIBRATION_PROMPTS]
    return activation_ranges(model, ids)
