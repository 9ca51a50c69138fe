"""Gated MARS adapters while decoding: a LoRA delta that acts only at positions whose input token is the mask.

A --gated-lora run (finetune) trains the delta at mask positions only, so every real token runs the base model.
Decoding keeps that promise by construction: a step's masks are its last positions, attention is causal, and
each `GatedLinear` adds its delta to the mask rows alone, so every real position computes exactly what the base
model computes. Hence τ >= 1 (no masks) is the base model's greedy answer in any format, and lossless decoding is
too wherever the base's own lossless equals its AR (float32, and w8a8 on our own kernels, whose native layer
stack adds the deltas itself: mars_core/engine/w8a8_layers.h); only the drafts and MARS guesses come from the adapter.

`apply_gated` (reached through mars_core.models.adapter.attach_gated for a folder) wraps the adapted `nn.Linear`
modules of a transformers model in place and hooks its input embedding to read which positions are masks.
`mars_core.engine.lean.LeanLM` built from that model finds the wrappers and carries the same deltas into its fused
products. The trained mask row, if any, replaces the mask token's input embedding only: a tied LM head keeps the
base's row, so the logits of real positions stay the base model's.
"""
from __future__ import annotations

from pathlib import Path

import torch


class Gate:
    """Which positions of the current forward are masks, as a column [positions, 1] of 1.0 at masks and 0.0
    elsewhere (None: there are none), shared by every GatedLinear of one model. `read` sets it from the input ids
    at the start of each forward. A dense column rather than indices keeps the delta at three plain ops."""

    def __init__(self, mask_id: int):
        self.mask_id, self.column, self.positions = mask_id, None, 0

    def read(self, input_ids: torch.Tensor) -> bool:
        """Mark the mask positions of `input_ids`; True if there is one."""
        hit = input_ids.reshape(-1, 1) == self.mask_id
        self.column, self.positions = (hit.float() if bool(hit.any()) else None), input_ids.numel()
        return self.column is not None

    def clear(self) -> None:
        self.column, self.positions = None, 0


class GatedLinear(torch.nn.Module):
    """`inner(x)` plus ((x @ A^T) * gate) @ B^T, B carrying the LoRA scale alpha / r. The gate's zero rows make a
    real position's delta exactly zero, so its output is `inner`'s bit for bit.

    `inner` is any linear module (nn.Linear, RowMajorLinear, Int8Linear, W8A8Linear, lean's FloatLinear); the
    quantizers replace an nn.Linear inside the wrapper, so the delta survives a change of weight format."""

    def __init__(self, inner: torch.nn.Module, a: torch.Tensor, b: torch.Tensor, gate: Gate):
        super().__init__()
        self.inner, self.gate = inner, gate
        self.register_buffer("a_t", a.detach().t().contiguous())   # [in, r]
        self.register_buffer("b_t", b.detach().t().contiguous())   # [r, out]

    @property
    def weight(self) -> torch.Tensor:   # what code that reads a linear layer's weight (the lean builder) finds
        return self.inner.weight

    @property
    def bias(self):
        return getattr(self.inner, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        column = self.gate.column
        if column is None:
            return y
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] != self.gate.positions:
            raise RuntimeError(f"a gated adapter saw {flat.shape[0]} positions but its gate was read from "
                               f"{self.gate.positions} input ids: run the model on input_ids, not inputs_embeds")
        dtype = self.a_t.dtype
        z = (flat.to(dtype) @ self.a_t) * column.to(dtype)
        out = torch.addmm(y.reshape(-1, y.shape[-1]).to(dtype), z, self.b_t)
        return out.to(y.dtype).view(y.shape)


def apply_gated(model: torch.nn.Module, cfg: dict, modules: dict, mask_row: torch.Tensor | None,
                where: str = "the adapter") -> Gate:
    """Wrap `model`'s adapted products (`modules`: {module path: (A [r, in], B [out, r])}, scaled by cfg's
    alpha / r) and gate them by cfg's mask_id; `mask_row` replaces the mask token's input embedding.

    Everything is checked before the model changes. The deltas are kept in fp32 (they follow a later .to(dtype)
    of the model, as buffers do)."""
    other = f"the adapter was made for another base (its config says base={cfg['base']!r})"
    named = dict(model.named_modules())
    targets = []
    for module, (a, b) in modules.items():
        layer = named.get(module)
        if layer is None:
            raise ValueError(f"{where} adapts {module!r}, which {type(model).__name__} does not have: {other}")
        if type(layer) is not torch.nn.Linear:
            raise ValueError(f"{module!r} is a {type(layer).__name__}, not an nn.Linear: attach the adapter to the "
                             "stock model, before any change of layout or weight format")
        if (b.shape[0], a.shape[1]) != (layer.out_features, layer.in_features):
            raise ValueError(f"{where}: {module} is [{b.shape[0]}, {a.shape[1]}] but the model's is "
                             f"{[layer.out_features, layer.in_features]}: {other}")
        targets.append((module, layer, a, b))
    embedding = model.get_input_embeddings()
    rows, hidden = embedding.weight.shape
    if cfg["mask_id"] >= rows or (mask_row is not None and mask_row.shape[0] != hidden):
        raise ValueError(f"{where}: mask_id={cfg['mask_id']} and a mask row of "
                         f"{None if mask_row is None else mask_row.shape[0]} values do not fit an embedding of "
                         f"{rows} x {hidden}: {other}")
    gate = Gate(cfg["mask_id"])
    scale = cfg["alpha"] / cfg["r"]
    for module, layer, a, b in targets:
        parent, _, name = module.rpartition(".")
        setattr(model.get_submodule(parent), name, GatedLinear(layer, a.float(), scale * b.float(), gate))

    def read_ids(_module, args):   # returns None: the call's arguments stay as they are
        gate.read(args[0])

    embedding.register_forward_pre_hook(read_ids)
    # cleared after each forward, so a later call that bypasses the embedding (inputs_embeds) meets no stale gate
    model.register_forward_hook(lambda *_: gate.clear())
    if mask_row is not None:
        row = mask_row.float()
        embedding.register_forward_hook(lambda _module, args, out: torch.where(
            (args[0] == gate.mask_id).unsqueeze(-1), row.to(out.device, out.dtype), out))
        model._mars_gated_mask_row = row   # LeanLM copies it into its own embedding table
    model._mars_gate = gate
    return gate


def gate_of(model) -> Gate | None:
    """The Gate apply_gated gave `model`, or None for a model without a gated adapter."""
    return getattr(model, "_mars_gate", None)
