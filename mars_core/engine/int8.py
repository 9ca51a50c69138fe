"""Weight-only int8 for CPU decoding: `load_model(..., dtype="int8")`.

A decoding step on a CPU mostly streams weights from memory. Storing each linear weight as int8 with one
bf16 scale per output row halves the bytes bf16 reads; activations, the KV cache, norms and the softmax stay
in bf16 (or fp32 on CPUs without native bf16). torch's `_weight_int8pack_mm` multiplies bf16 rows by the
int8 weight and applies the scales. The tied LM head gets its own int8 copy, the embedding table stays as it
was (a lookup reads one row, not the table).

This is lossy: outputs differ from the bf16 model by the rounding of each weight to 1/127 of its row's
largest magnitude. Decoding with it keeps the decoder's own guarantees (one-token mode equals AR; docs/
algorithm.md says which hold in which dtype), but against the int8 model, not the original.
"""
from __future__ import annotations

import torch


def int8_supported() -> bool:
    """Whether this torch has the CPU int8-weight matmul."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8Linear(torch.nn.Module):
    """Inference-only stand-in for `nn.Linear`: weight int8 (out, in), per-row scale, optional bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.to(dtype))
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(self.scale.dtype), self.qweight, self.scale)
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize_int8(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Replace every linear layer (the tied LM head included) by an `Int8Linear`, in place.

    `dtype` is the activation dtype; the rest of the model should be cast to it afterwards. Quantizing from
    fp32 weights avoids rounding twice. Only for inference, on a CPU.
    """
    if not int8_supported():
        raise ValueError(f"dtype='int8' needs torch's CPU int8 matmul, which torch {torch.__version__} lacks: "
                         "use float32 or bfloat16")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, Int8Linear(child.weight, child.bias, dtype))
