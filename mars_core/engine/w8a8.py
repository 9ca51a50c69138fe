"""int8 weights x int8 activations on a CPU (`dtype="w8a8"`), with every output row independent of the others.

A decoding step multiplies 1 (AR) to 7 (MARS, B = 4) activation rows by every weight matrix, so its cost is
reading the weights. fbgemm's dynamic-quantized linear (`torch.ops.quantized.linear_dynamic`) reads int8 weights
and multiplies them by int8 activations (with exact int32 sums on an AVX512-VNNI CPU); it is the fastest few-row
product torch has there (docs/experiments/cpu-formats.md, "The lean forward and w8a8").

It quantizes its input with one scale and zero point for the whole tensor, taken from the tensor's min and max, so
a row's result would depend on the other rows in the call: a 7-position verify forward would round differently
from the one-position AR forward, and lossless decoding would drift from AR. We pin the range instead. Each row is
divided by its own largest magnitude, and two "rail" columns holding +1 and -1 are appended, with zero weights
behind them. Every input then has min -1 and max +1, so fbgemm picks the same quantization for any set of rows;
the int32 sums are exact, so a row's output is bitwise the same alone or in any batch. Multiplying the output by
the row's magnitude undoes the division. That is per-row symmetric activation quantization, whose error is about
half that of the per-tensor one.

Weights are rounded once, per output channel (symmetric, 1/127 of the row's largest magnitude), from fp32.

Four kernels compute these integer sums (KERNELS): fbgemm's, exact on an AVX512-VNNI CPU but not on an AVX2 one,
where its int16 pair sums saturate; our own AVX512-VNNI kernel (mars_core/engine/vnni.py), which reproduces fbgemm's
results bit for bit, reads the weights once for many rows and is used wherever it builds; our own AVX2 kernel
(mars_core/engine/avx2.py), exact, with the VNNI kernel's results bit for bit, used where that one cannot run; and
oneDNN's quantized linear (`torch.ops.onednn.qlinear_pointwise`), which takes int8 activations we round ourselves
onto the same grid, so it needs no rails. The VNNI kernel is the default where it builds, else the AVX2 kernel,
else fbgemm; MARS_W8A8_KERNEL names one (onednn for CPUs with AMX, where its cost grows less with the rows;
measured in docs/experiments/amx-and-kernels.md, "oneDNN's kernels"). All quantize alike and keep every row independent
of the others; oneDNN's sums and rescaling round differently from the other two in the last bits, so its answers may
differ.
"""
from __future__ import annotations

import warnings

import torch

RAILS = 2   # the +1 / -1 columns
KERNELS = ("fbgemm", "onednn", "vnni", "avx2")
# our own kernels (mars_core/engine/vnni.cpp, mars_core/engine/avx2.cpp): exact sums, one call per product
OWN = ("vnni", "avx2")
# dtype="w8a16": the AVX2 kernel built with int16 activation levels and one pass (mars_core/engine/avx2.cpp,
# MARS_WIDE). Its own format, not a w8a8 kernel: pick_kernel never chooses it and its answers differ from w8a8's.
WIDE = "avx2w"
NATIVE = OWN + (WIDE,)   # the kernels with a native layer stack (mars_core/engine/w8a8_layers.h)


def own_kernel(kernel: str):
    """The module of one of our own kernels (its load(), why_not(), cpu_supported())."""
    from mars_core.engine import avx2, vnni

    return {"vnni": vnni, "avx2": avx2, WIDE: avx2.WIDE}[kernel]


class OwnWeights:
    """One product's int8 weight in an own kernel's layout, and its rescale: `scale` = fp32(2/255 * w_scale) per
    channel, the product fbgemm multiplies its int32 sums by; for WIDE (w8a16) fp32(w_scale / levels), levels
    being the kernel's largest activation level for this weight's width."""

    def __init__(self, kernel: str, q: torch.Tensor, w_scale: torch.Tensor):
        self.op = getattr(torch.ops, f"mars_{kernel}")
        self.packed = self.op.pack(q.contiguous())
        if kernel == WIDE:
            self.scale = (w_scale.float() / float(self.op.levels(self.packed.shape[1]))).contiguous()
        else:
            self.scale = (_STEP * w_scale.float()).contiguous()


def w8a8_supported() -> bool:
    """Whether this torch build has one of the w8a8 kernels (fbgemm's or oneDNN's; mars_core/engine/vnni.cpp's, which
    needs neither, is only ever an alternative to fbgemm's)."""
    return fbgemm_supported() or onednn_supported()


def fbgemm_supported() -> bool:
    """Whether this torch build has fbgemm's dynamic int8 linear and its prepacking."""
    ops = getattr(torch.ops, "quantized", None)
    try:
        engines = torch.backends.quantized.supported_engines
        return (ops is not None and hasattr(ops, "linear_dynamic") and hasattr(ops, "linear_prepack")
                and any(e in engines for e in ("fbgemm", "x86")))
    except (AttributeError, RuntimeError):
        return False


def onednn_supported() -> bool:
    """Whether this torch build has oneDNN's quantized linear and its prepacking."""
    ops = getattr(torch.ops, "onednn", None)
    try:
        return (torch.backends.mkldnn.is_available() and ops is not None and hasattr(ops, "qlinear_pointwise")
                and hasattr(ops, "qlinear_prepack"))
    except (AttributeError, RuntimeError):
        return False


def check_w8a8() -> None:
    if not w8a8_supported():
        raise ValueError(f"dtype='w8a8' needs fbgemm's dynamic int8 linear (torch.ops.quantized.linear_dynamic) or "
                         f"oneDNN's (torch.ops.onednn.qlinear_pointwise), which torch {torch.__version__} on this "
                         "machine lacks: use dtype='int8' or 'float32'")


class W8A8Linear(torch.nn.Module):
    """Inference-only stand-in for `nn.Linear` on fp32 activations: int8 weight, per-row int8 activations (with
    kernel WIDE: per-row int16 activation levels, one pass; dtype="w8a16")."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, passes: int = 1,
                 kernel: str = "fbgemm"):
        super().__init__()
        if kernel not in KERNELS and kernel != WIDE:
            raise ValueError(f"kernel={kernel!r} is unknown: use one of {', '.join(KERNELS + (WIDE,))}")
        self.passes = passes   # 2: the input's rounding error goes through a second product (see on_grid)
        self.kernel = kernel
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        self.register_buffer("rails", torch.tensor([[1.0, -1.0]]), persistent=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        if kernel == "onednn":
            check_onednn()
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            # contiguous: the prepack reads rows as laid out, and a weight may arrive as a transposed view
            q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            self._packed = torch.ops.onednn.qlinear_prepack(q, [1, self.in_features])
            self.register_buffer("w_scale", scale, persistent=False)
            self.register_buffer("w_zero", torch.zeros(self.out_features, dtype=torch.long), persistent=False)
            return
        if kernel in NATIVE:
            own = own_kernel(kernel)
            if not own.load():
                raise ValueError(f"the w8a8 kernel {kernel!r} is not available here ({own.why_not()}): use "
                                 "MARS_W8A8_KERNEL=fbgemm")
        elif not fbgemm_supported():
            raise ValueError(f"the w8a8 kernel 'fbgemm' needs torch.ops.quantized.linear_dynamic, which torch "
                             f"{torch.__version__} on this machine lacks: use MARS_W8A8_KERNEL=onednn")
        padded = torch.cat([w, w.new_zeros(self.out_features, RAILS)], dim=1)
        scale = padded.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        with warnings.catch_warnings():   # quantized tensors are deprecated as a user API; the op itself is not
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(padded, scale.double(), torch.zeros(self.out_features, dtype=torch.long),
                                           0, torch.qint8)
            if kernel in NATIVE:   # the very int8 weights and scales fbgemm would get, in the kernel's layout
                self._own = OwnWeights(kernel, q.int_repr()[:, : self.in_features], scale)
                return
            self._packed = torch.ops.quantized.linear_prepack(q, None)

    @property
    def gives_top(self) -> bool:
        """Whether `with_top` is served (our own kernels) rather than refused."""
        return self.kernel in NATIVE

    @property
    def gives_sums(self) -> bool:
        """Whether `with_top` also gathers the softmax sums (the VNNI kernel; the AVX2 one leaves NaN)."""
        return self.kernel == "vnni"

    def with_top(self, x: torch.Tensor, exclude: int = -1, period: int = 1, first: int = 0,
                 conf_from: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(forward(x), each row's largest output, its column, sums), [rows, out] and [rows] for x [rows, in]:
        the argmax gathered while the outputs are written (an LM head's: see mars_core/engine/w8a8_kernel.h, Top), equal
        to `y.argmax(-1)` (the first column of a tie) with column `exclude` left out at rows whose place in their
        group of `period` rows is `first` or later. A NaN makes its row's value NaN. Rows whose place is
        `conf_from` or later (none for -1) get the sum over those columns of exp(y - largest), so that 1 / sum is
        the softmax probability of the top column, where `gives_sums` (NaN elsewhere). Our own kernels only."""
        if not self.gives_top:
            raise ValueError(f"with_top needs one of our own w8a8 kernels ({', '.join(NATIVE)}), not {self.kernel!r}")
        v = self._own
        return v.op.linear_top(x.float(), v.packed, v.scale, self.bias, self.passes == 2, _INVERSE, float(_STEP),
                               1, 0, exclude, period, first, conf_from)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1]).float()
        if self.kernel == "onednn":
            y = onednn_w8a8(x, self._packed, self.w_scale, self.w_zero, self.bias, self.passes == 2)
            return y.reshape(*shape[:-1], self.out_features)
        if self.kernel in NATIVE:
            v = self._own
            y = v.op.linear(x, v.packed, v.scale, self.bias, self.passes == 2, _INVERSE, float(_STEP))
            return y.reshape(*shape[:-1], self.out_features)
        magnitude = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
        u = x / magnitude
        y = torch.ops.quantized.linear_dynamic(torch.cat([u, self.rails.expand(x.shape[0], RAILS)], dim=1),
                                               self._packed)
        if self.passes == 2:
            r = u - on_grid(u)
            r_magnitude = r.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
            railed = torch.cat([r / r_magnitude, self.rails.expand(x.shape[0], RAILS)], dim=1)
            y = y + torch.ops.quantized.linear_dynamic(railed, self._packed) * r_magnitude
        y = y * magnitude
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


_STEP = torch.tensor(2 / 255, dtype=torch.float32)   # fbgemm's scale for the range [-1, 1], in fp32
_INVERSE = float(1 / _STEP)                            # 127.49999..., so +-1 round to +-127, not 128


def check_onednn() -> None:
    if not onednn_supported():
        raise ValueError(f"the w8a8 kernel 'onednn' needs torch.ops.onednn.qlinear_pointwise, which torch "
                         f"{torch.__version__} on this machine lacks: use MARS_W8A8_KERNEL=fbgemm")


def onednn_w8a8(x: torch.Tensor, packed: torch.Tensor, w_scale: torch.Tensor, w_zero: torch.Tensor,
                bias: torch.Tensor | None, two: bool, inverse: float = _INVERSE, step: float = float(_STEP)):
    """W8A8Linear's product through oneDNN on a 2D fp32 input: each row scaled to [-1, 1] and rounded onto
    fbgemm's grid (on_grid) as int8; with `two`, the rounding's remainder, scaled and rounded the same way, goes
    through the same call as extra rows (rows cost little there), and its result is added back.

    oneDNN is asked for the bare int32 sums (unit scales; an integer converts to fp32 the same way whatever the
    call), and the scales are applied here: its own rescaling took a different path for one row than for several
    on small shapes, which broke row independence in the last bit."""
    magnitude = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    u = x / magnitude
    q = torch.round(u * inverse).clamp(-128.0, 127.0)
    rows = x.shape[0]
    r_magnitude = magnitude   # set below when `two`
    if two:
        r = u - q * step
        r_magnitude = r.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
        q = torch.cat([q, torch.round(r / r_magnitude * inverse).clamp(-128.0, 127.0)])
    units = torch.ones_like(w_scale)
    y = torch.ops.onednn.qlinear_pointwise(q.to(torch.int8), 1.0, 0, packed, units, w_zero, None, 1.0, 0,
                                           torch.float32, "none", [], "") * (w_scale * step)
    if two:
        y = y[:rows] + y[rows:] * r_magnitude
    y = y * magnitude
    if bias is not None:
        y = y + bias
    return y


def pick_kernel() -> str:
    """The w8a8 kernel this process uses: MARS_W8A8_KERNEL if set, else the VNNI kernel where it builds, else the
    AVX2 kernel where it builds, else fbgemm (oneDNN where fbgemm is missing). Not chosen by timing between fbgemm
    and oneDNN: they round the rescale differently in the last bit, and a choice that followed a noisy clock could
    change a model's answers from one run to the next (docs/experiments/amx-and-kernels.md, "oneDNN's kernels").
    Our two kernels give the same bits as each other, and fbgemm's on an AVX512-VNNI CPU (where its sums are exact)."""
    import os

    named = os.environ.get("MARS_W8A8_KERNEL")
    if named:
        if named not in KERNELS:
            raise ValueError(f"MARS_W8A8_KERNEL={named!r} is unknown: use one of {', '.join(KERNELS)}")
        return named
    for kernel in OWN:   # exact sums, bitwise each other's results
        if own_kernel(kernel).load():
            return kernel
    return "fbgemm" if fbgemm_supported() or not onednn_supported() else "onednn"


def on_grid(u: torch.Tensor) -> torch.Tensor:
    """u in [-1, 1] rounded onto fbgemm's grid once the rails fix its range (scale 2/255 in fp32, zero point 128).
    It agrees with fbgemm's own rounding except on exact ties of the product u * 1/scale, which fbgemm rounds after
    one fused multiply-add (mars_core/engine/vnni.cpp does the same); on_grid only defines the second pass's remainder,
    the same way in every kernel, so that difference changes no result.

    Two passes: the products whose inputs lose most to that rounding (TWO_PASS) multiply the weight by the
    rounded input and, in a second call, by what the rounding left out (itself rounded, 255 times finer); the
    input then keeps ~16 bits, and each row stays independent, since both calls are."""
    return torch.round(u * _INVERSE).clamp(-128.0, 127.0) * float(_STEP)


# Which of a layer's products take two passes: the inputs of q/k/v (a norm's output, with outlier channels) and
# of down lost most to one rounding on development prompts (docs/experiments/cpu-formats.md, "w8a8 quality").
TWO_PASS = ("qkv", "down")


def check_w8a16() -> None:
    from mars_core.engine import avx2

    if not avx2.WIDE.load():
        raise ValueError("dtype='w8a16' needs our AVX2 kernel (mars_core/engine/avx2.cpp), "
                         f"which is not available here ({avx2.WIDE.why_not()}): use dtype='w8a8' or 'float32'")


def quantize_w8a8(model: torch.nn.Module, kernel: str | None = None) -> None:
    """Replace every `nn.Linear` (a tied LM head included) by a `W8A8Linear`, in place; fp32 model, CPU only.
    `kernel` WIDE makes it w8a16."""
    if kernel == WIDE:
        check_w8a16()
    else:
        check_w8a8()
    kernel = kernel or pick_kernel()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, W8A8Linear(child.weight, child.bias, kernel=kernel))


# ----------------------------------------------------------------------------- smoothing (SmoothQuant)
# One scale per row leaves the small channels of a row with few levels when a few channels carry outliers. As in
# SmoothQuant (Xiao et al., arXiv 2211.10438), each input channel j of a product is divided by
# s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha) and the weight's column multiplied by it: the product is unchanged,
# the outliers move into the weights. LeanLM folds 1/s into the RMSNorm weight (q/k/v and gate/up inputs), the v
# rows (o's input) and the up rows (down's input), so it costs nothing per step. max|x_j| comes from a prefill of
# these prompts through the float model when the model is loaded.
SMOOTH_ALPHA = 0.5
CALIBRATION_PROMPTS = (
    "Explain how a refrigerator keeps food cold, step by step.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "What is 37 times 43? Show your working.",
    "Summarise the causes of the French Revolution in three sentences.",
    "Translate into German: The train leaves at seven and arrives before noon.",
    "List five words that rhyme with light, then use two of them in a short poem.",
    "A shop sells pens at 3 for 2 euros. How much do 12 pens cost?",
    "Describe the difference between a list and a tuple in Python.",
)


@torch.inference_mode()
def activation_ranges(model, prompt_ids: list[list[int]]) -> dict:
    """max |x| per input channel of every product over the prompts' tokens, from a prefill of each prompt through
    `model` (a float transformers Llama-family model): {"layers": [{qkv, o, gate_up, down}, ...], "head": ...}."""
    ranges = [dict() for _ in model.model.layers] + [dict()]
    hooks = []
    watched = [(i, name, module) for i, layer in enumerate(model.model.layers)
               for name, module in (("qkv", layer.self_attn.q_proj), ("o", layer.self_attn.o_proj),
                                    ("gate_up", layer.mlp.gate_proj), ("down", layer.mlp.down_proj))]
    for i, name, module in watched + [(len(ranges) - 1, "head", model.lm_head)]:
        def keep(_module, args, i=i, name=name):
            seen = args[0].detach().float().abs().reshape(-1, args[0].shape[-1]).amax(dim=0)
            ranges[i][name] = torch.maximum(ranges[i].get(name, seen), seen)
        hooks.append(module.register_forward_pre_hook(keep))
    try:
        for ids in prompt_ids:
            model(input_ids=torch.tensor([ids], device=model.device))
    finally:
        for h in hooks:
            h.remove()
    return {"layers": ranges[:-1], "head": ranges[-1]["head"]}


def smoothing(x_range: torch.Tensor, w_range: torch.Tensor, alpha: float | None = None) -> torch.Tensor:
    """s per input channel, for activations whose channels reach `x_range` and weight columns reaching `w_range`."""
    alpha = SMOOTH_ALPHA if alpha is None else alpha
    s = x_range.clamp(min=1e-5).pow(alpha) / w_range.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)
