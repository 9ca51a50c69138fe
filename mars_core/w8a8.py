"""int8 weights x int8 activations on a CPU (`dtype="w8a8"`), with every output row independent of the others.

A decoding step multiplies 1 (AR) to 7 (MARS, B = 4) activation rows by every weight matrix, so its cost is
reading the weights. fbgemm's dynamic-quantized linear (`torch.ops.quantized.linear_dynamic`) reads int8 weights
and multiplies them by int8 activations with exact int32 sums; it is the fastest few-row product torch has on an
AVX512-VNNI CPU (docs/experiments.md, "w8a8").

It quantizes its input with one scale and zero point for the whole tensor, taken from the tensor's min and max, so
a row's result would depend on the other rows in the call: a 7-position verify forward would round differently
from the one-position AR forward, and lossless decoding would drift from AR. We pin the range instead. Each row is
divided by its own largest magnitude, and two "rail" columns holding +1 and -1 are appended, with zero weights
behind them. Every input then has min -1 and max +1, so fbgemm picks the same quantization for any set of rows;
the int32 sums are exact, so a row's output is bitwise the same alone or in any batch. Multiplying the output by
the row's magnitude undoes the division. That is per-row symmetric activation quantization, whose error is about
half that of the per-tensor one.

Weights are rounded once, per output channel (symmetric, 1/127 of the row's largest magnitude), from fp32.
"""
from __future__ import annotations

import warnings

import torch

RAILS = 2   # the +1 / -1 columns


def w8a8_supported() -> bool:
    """Whether this torch build has fbgemm's dynamic int8 linear and its prepacking."""
    ops = getattr(torch.ops, "quantized", None)
    try:
        engines = torch.backends.quantized.supported_engines
        return (ops is not None and hasattr(ops, "linear_dynamic") and hasattr(ops, "linear_prepack")
                and any(e in engines for e in ("fbgemm", "x86")))
    except (AttributeError, RuntimeError):
        return False


def check_w8a8() -> None:
    if not w8a8_supported():
        raise ValueError(f"dtype='w8a8' needs fbgemm's dynamic int8 linear (torch.ops.quantized.linear_dynamic), "
                         f"which torch {torch.__version__} on this machine lacks: use dtype='int8' or 'float32'")


class W8A8Linear(torch.nn.Module):
    """Inference-only stand-in for `nn.Linear` on fp32 activations: int8 weight, per-row int8 activations."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        check_w8a8()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        padded = torch.cat([w, w.new_zeros(self.out_features, RAILS)], dim=1)
        scale = padded.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        with warnings.catch_warnings():   # quantized tensors are deprecated as a user API; the op itself is not
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(padded, scale.double(), torch.zeros(self.out_features, dtype=torch.long),
                                           0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(q, None)
        self.register_buffer("rails", torch.tensor([[1.0, -1.0]]), persistent=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1]).float()
        magnitude = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
        railed = torch.cat([x / magnitude, self.rails.expand(x.shape[0], RAILS)], dim=1)
        y = torch.ops.quantized.linear_dynamic(railed, self._packed) * magnitude
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def quantize_w8a8(model: torch.nn.Module) -> None:
    """Replace every `nn.Linear` (a tied LM head included) by a `W8A8Linear`, in place; fp32 model, CPU only."""
    check_w8a8()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, W8A8Linear(child.weight, child.bias))
