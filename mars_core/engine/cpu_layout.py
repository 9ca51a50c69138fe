"""The CPU weight layout for decoding: linear layers stored transposed, parameters 64-byte aligned.

`load_model` applies it to every model it loads on a CPU (unless `cpu_layout=False`); it is for inference
only, and the outputs equal the stock modules' to float rounding.
"""
from __future__ import annotations

import torch


class RowMajorLinear(torch.nn.Module):
    """Inference-only stand-in for `nn.Linear` that stores W^T, shape (in, out), contiguous.

    A decoding step multiplies 1 row (AR) or 4-7 rows (MARS, B = 4) by each weight. On a CPU, MKL's
    GEMM for so few rows is cheaper with the weight in this layout than with `nn.Linear`'s (out, in):
    benchmarks/notes in `cpu_decoding_layout`. Same arithmetic, so the outputs agree to float rounding.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = torch.nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(),
                                                                        requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:   # (out, in) view, for code that inspects weight.shape or .dtype
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def cpu_decoding_layout(model: torch.nn.Module) -> None:
    """Prepare a CPU model for decoding, in place.

    1. Every `nn.Linear` whose weight is not the input embedding's (a tied LM head keeps that layout)
       becomes a `RowMajorLinear`: on one thread `x @ W^T` from a row-major W^T costs less than `F.linear`
       for a few rows, and grows less with them (timed with an ad-hoc script on tiny-mars-shaped weights:
       docs/experiments/tiny-models.md, "Wall clock: `mars_core bench`").
    2. Parameters that safetensors left off a 64-byte boundary (tiny-mars's sat at offset 16) are copied
       to aligned memory, which made a 1-row forward cheaper in the same kind of ad-hoc timing (same section).
    `python -m mars_core bench --stock-layout` times decoding without this. Only for inference: the
    converted model is not meant to be trained or saved.
    """
    embedding = model.get_input_embeddings()
    tied = embedding.weight if embedding is not None else None
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and child.weight is not tied:
                setattr(module, name, RowMajorLinear(child))
    with torch.no_grad():
        for p in model.parameters():
            if p.data_ptr() % 64:
                p.data = p.data.clone()
