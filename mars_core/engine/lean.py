"""A lean decoding forward for the Llama family (Llama, Qwen2, SmolLM2): what the decoder runs on a CPU.

A transformers decoder layer is ~40 small ops plus cache bookkeeping and mask building, which on one CPU thread
cost more than the matrix products of a 135M model (docs/experiments/cpu-formats.md, "The lean forward and
w8a8"). `LeanLM` does the same
arithmetic with fewer ops, in the manner of gpt-fast's `model.py`:

  * q, k, v are one product, gate and up another (the weights concatenated once at load);
  * RoPE is one complex multiply by a precomputed table: the q and k weight rows of every head are permuted once
    from transformers' half-split layout to an interleaved one, which leaves q . k unchanged;
  * the KV cache is two preallocated tensors and a length (`LeanCache`), with exactly what the decoder asks of a
    cache: append a chunk, crop, keep some batch rows; holes are columns the caller's mask hides;
  * attention takes the decoder's own 4D mask, and the LM head runs only on the kept positions;
  * with our w8a8 kernels every layer is one C++ call (mars_core/engine/w8a8_layers.h), the small ops as plain loops.

It takes its weights from a loaded transformers model (which stays usable beside it) and is a backend as the
decoder defines it (mars_core.decode.backend), with all three capabilities. The weight formats are
`mars_core.engine.int8` (int8 weights, bf16 activations), `mars_core.engine.w8a8` (int8 weights and activations)
and plain float. Inference only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mars_core.engine.gated import GatedLinear, gate_of
from mars_core.engine.lean_cache import LeanCache
from mars_core.engine.lean_script import _rms, layers
from mars_core.engine.w8a8 import NATIVE   # our kernels, which skip the second pass on a lossless step's masks

ARCHITECTURES = ("llama", "qwen2")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")   # tables that do not change with the sequence length
FORMATS = ("float", "int8", "w8a8")
PRODUCTS = ("qkv", "o", "gate_up", "down")   # a layer's products, in the layer loops' order


def unsupported(model) -> str | None:
    """Why the lean forward cannot run this model, or None if it can."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"its architecture {kind!r} is not one of {', '.join(ARCHITECTURES)}"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"its RoPE type {rope!r} changes with the sequence length"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"its activation {cfg.hidden_act!r} is not silu"
    if getattr(cfg, "use_sliding_window", False):
        return "it uses sliding-window attention"
    if not all(isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.is_floating_point()
               for m in _linears(model)):
        return "its linear layers are already quantized (build the lean forward before quantizing)"
    return None


def _linears(model):
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        yield from (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)


def packed_bf16_supported() -> bool:
    """Whether bf16 products can use oneDNN's prepacked weights on this CPU (AMX): one weight read per call
    whatever the rows, and each row's result independent of the others (tests/test_lean.py checks it here)."""
    try:
        return (torch.backends.mkldnn.is_available() and torch.cpu._is_amx_tile_supported()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


class FloatLinear(torch.nn.Module):
    """x @ W^T in the weights' float dtype. fp32 runs our own kernel where it builds (mars_core.engine.fp32: each weight
    read once for up to three rows, each row's sums in a fixed order whatever the other rows), else keeps W^T
    row-major, which MKL multiplies faster for few rows; bf16 keeps W as it is (F.linear), which measured faster there
    (mars_core.engine.cpu_layout explains the layout), or, on a CPU with AMX, packed once for oneDNN (its cost barely
    grows with the rows: docs/experiments/amx-and-kernels.md, "The CPU path on an Intel Xeon with AMX").
    `own=False` keeps MKL for fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, own: bool = True):
        super().__init__()
        self.transposed = dtype == torch.float32
        w = weight.detach().to(dtype)
        self.packed, self.out_features = None, w.shape[0]
        if dtype == torch.bfloat16 and w.device.type == "cpu" and packed_bf16_supported():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
            w = None
        own32 = None
        if own and self.transposed and w.device.type == "cpu":
            from mars_core.engine import fp32

            if fp32.load():
                own32, w = torch.ops.mars_fp32.pack(w.t().contiguous()), None
        self.register_buffer("own32", own32)
        self.register_buffer("w", None if w is None else (w.t() if self.transposed else w).contiguous())
        self.register_buffer("b", None if bias is None else bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.own32 is not None:
            y = torch.ops.mars_fp32.linear(x.reshape(-1, x.shape[-1]), self.own32, self.b, self.out_features)
            return y.view(*x.shape[:-1], self.out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.b, "none", [], "")
        if self.transposed:
            return x @ self.w if self.b is None else torch.addmm(self.b, x, self.w)
        return F.linear(x, self.w, self.b)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, dtype: torch.dtype,
                role: str = "head", kernel: str | None = None) -> torch.nn.Module:
    """One weight matrix (out, in) in the chosen format; `dtype` is the activations' dtype, `role` which product
    of a layer it is (qkv, o, gate_up, down) or "head"; `kernel` w8a8's (default: mars_core.engine.w8a8.pick_kernel)."""
    if fmt == "float":
        return FloatLinear(weight, bias, dtype)
    if fmt == "int8":
        from mars_core.engine.int8 import Int8Linear

        return Int8Linear(weight, bias, dtype)
    if fmt == "w8a8":
        from mars_core.engine.w8a8 import TWO_PASS, W8A8Linear, pick_kernel

        return W8A8Linear(weight, bias, passes=2 if role in TWO_PASS else 1, kernel=kernel or pick_kernel())
    raise ValueError(f"weight format {fmt!r} is unknown: use one of {', '.join(FORMATS)}")


def _interleave_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head reordered from (x_0..x_{d/2-1}, y_0..y_{d/2-1}) to (x_0, y_0, x_1, y_1, ...)."""
    half = head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
    heads = w.reshape(-1, head_dim, *w.shape[1:])
    return heads[:, order].reshape(w.shape)


@dataclass
class LeanOutput:
    logits: torch.Tensor
    top: tuple[torch.Tensor, torch.Tensor] | None = None   # (largest logit, its column) [b, k], when asked for
    conf: torch.Tensor | None = None   # [b, k] softmax probability of that column, where asked for and gathered


class LeanLM(torch.nn.Module):
    """The decoding forward of a Llama-family causal LM in one weight format (see the module docstring); a
    mars_core.decode.backend.Backend with all three capabilities."""

    takes_draft_tail = True   # forward() accepts draft_tail (mars_core.decode.backend: a capability)
    builds_causal_mask = True  # attention_mask=None is the causal mask, built in a few ops (_mask_fill)

    @property
    def takes_head_top(self) -> bool:
        """Whether forward(head_top=...) gathers the top in the head (a w8a8 head on our own kernels): a decoding
        step then reads its logits once less (mars_core.decode.decoding._options)."""
        return getattr(self.head, "gives_top", False)

    def __init__(self, model, fmt: str = "float", dtype: torch.dtype = torch.float32, script: bool = True,
                 ranges: list[dict] | None = None, kernel: str | None = None):
        """`ranges` (w8a8 only): mars_core.engine.w8a8.activation_ranges of `model`, to smooth the products with;
        `kernel` (w8a8 only): one of mars_core.engine.w8a8.KERNELS, by default pick_kernel()'s, or WIDE (w8a16)."""
        super().__init__()
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the lean forward cannot run {type(model).__name__}: {reason}; use backend='hf'")
        cfg = model.config
        self.config, self.format, self.dtype = cfg, fmt, torch.float32 if fmt == "w8a8" else dtype
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps, self.context = cfg.rms_norm_eps, cfg.max_position_embeddings
        self.scale = self.head_dim ** -0.5
        self.gate = gate_of(model)   # a gated adapter (mars_core.engine.gated): its deltas ride on the fused products
        if fmt == "w8a8":
            from mars_core.engine.w8a8 import pick_kernel

            kernel = kernel or pick_kernel()
        self.kernel = kernel if fmt == "w8a8" else None
        if self.gate is not None and fmt == "w8a8" and (kernel not in NATIVE or not script):
            how = f"the {kernel!r} kernel" if kernel not in NATIVE else "script=False (the module loop)"
            raise ValueError(f"the lean w8a8 forward applies a gated adapter only in our kernels' native layer "
                             f"stack ({', '.join(NATIVE)}), not with {how}: use dtype float32, bfloat16 or int8, or "
                             f"backend='hf'")
        self.embed = model.model.embed_tokens.weight.detach().to(self.dtype)
        mask_row = getattr(model, "_mars_gated_mask_row", None)
        if mask_row is not None:   # the mask token's input row only; a tied head keeps the base's
            self.embed = self.embed.clone()
            self.embed[self.gate.mask_id] = mask_row.to(self.embed.device, self.dtype)
        self.layers = torch.nn.ModuleList(
            self._layer(layer, fmt, dtype, None if ranges is None else ranges["layers"][i])
            for i, layer in enumerate(model.model.layers))
        norm, head = model.model.norm.weight.detach().float(), model.lm_head.weight.detach().float()
        if ranges is not None:   # the head's input is the final norm's output: fold 1/s into that norm
            from mars_core.engine.w8a8 import smoothing

            s = smoothing(ranges["head"], head.abs().amax(dim=0))
            norm, head = norm / s, head * s
        self.norm = norm.to(self.dtype)
        self.head = make_linear(head, getattr(model.lm_head, "bias", None), fmt, dtype, kernel=self.kernel)
        self._rope_tables(model.model.rotary_emb)
        self.scripted, self._script_weights = None, ()   # w8a8 and fp32: the layer loop compiled by TorchScript
        self.huge_pages = False   # whether the packed weights asked for 2 MB pages (and the OS took the advice)
        if self.kernel in NATIVE:
            self._onto_huge_pages()
        if script and (fmt == "w8a8" or (fmt == "float" and self.dtype == torch.float32)):
            self._script()
        # w8a8's products are exact per row, so attention is what could make a row depend on its batch or on the
        # number of positions fed. Our native stack (mars_core/engine/w8a8_layers.h) computes each query in a fixed
        # order whatever shares its call, so float32 is exact there (and it reads keys in tiles: LeanCache); in torch,
        # float64 scores and sums make those last-bit differences vanish in fp32 (the same holds for bf16's packed
        # products on an AMX CPU)
        self.native = self.scripted is not None and self.kernel in NATIVE
        exact_rows = fmt == "w8a8" or (fmt == "float" and self.dtype == torch.bfloat16 and packed_bf16_supported())
        self.attention_dtype = torch.float64 if exact_rows and not self.native else torch.float32

    def _rope_tables(self, rotary) -> None:
        """RoPE as one complex multiply: the rotation of every position, and per head row the attention scale that
        q's rows also carry (1/sqrt(d)), so the scores need no extra multiply."""
        angles = torch.outer(torch.arange(self.context, dtype=torch.float32), rotary.inv_freq.float().cpu())
        table = torch.polar(torch.full_like(angles, float(rotary.attention_scaling)), angles)
        self.register_buffer("rope", table.to(self.embed.device), persistent=False)
        scale = torch.tensor([self.scale] * self.heads + [1.0] * self.kv_heads, device=self.embed.device)
        self.register_buffer("rope_scale", scale[:, None], persistent=False)

    def _onto_huge_pages(self) -> None:
        """Our w8a8 kernels' packed weights, moved into one buffer on 2 MB pages where the OS grants them: a
        one-position forward streams them all (mars_core.engine.hugepages)."""
        from mars_core.engine.hugepages import gather

        owns = [m._own for m in self._products()] + [self.head._own]
        packed, self.huge_pages = gather([o.packed for o in owns])
        for o, p in zip(owns, packed):
            o.packed = p

    def _products(self) -> list:
        """Every layer's products in the layer loops' order, a GatedLinear as its base product."""
        return [getattr(getattr(layer, n), "inner", getattr(layer, n)) for layer in self.layers for n in PRODUCTS]

    def _script(self) -> None:
        """The layer loop for this format and kernel, compiled by TorchScript, and the weight lists it takes."""
        from mars_core.engine.lean_script import scripted

        lins = self._products()
        own32 = self.kernel is None and lins[0].own32 is not None   # fp32 on our kernel (mars_core.engine.fp32)
        loop = {"fbgemm": "w8a8", "onednn": "w8a8-onednn", "vnni": "w8a8-vnni", "avx2": "w8a8-avx2",
                "avx2w": "w8a8-avx2w", None: "fp32-own" if own32 else "fp32"}[self.kernel]
        self.scripted = scripted(loop)
        norms = [w for layer in self.layers for w in (layer.norm_in, layer.norm_post)]
        two = [m.passes == 2 for m in lins] if self.format == "w8a8" else []
        own = lambda: ([m._own.packed for m in lins], [m._own.scale for m in lins], [m.bias for m in lins], two, norms)
        self._script_weights = {
            "w8a8": lambda: ([m._packed for m in lins], [m.bias for m in lins], two, self.layers[0].qkv.rails, norms),
            "w8a8-onednn": lambda: ([m._packed for m in lins], [m.w_scale for m in lins], [m.w_zero for m in lins],
                                    [m.bias for m in lins], two, norms),
            "w8a8-vnni": own, "w8a8-avx2": own, "w8a8-avx2w": own,
            "fp32": lambda: ([m.w for m in lins], [m.b for m in lins], [m.out_features for m in lins], norms),
            "fp32-own": lambda: ([m.own32 for m in lins], [m.b for m in lins], [m.out_features for m in lins],
                                 norms)}[loop]()
        if self.gate is not None and self.format == "w8a8":   # the native stack's int8 deltas (_native_lora)
            self._lora = self._native_lora()
        elif self.gate is not None:   # the fp32 loop's deltas
            gated = [getattr(layer, n) for layer in self.layers for n in PRODUCTS]
            self._lora = ([getattr(m, "a_t", None) for m in gated], [getattr(m, "b_t", None) for m in gated])

    def _native_lora(self) -> tuple:
        """The native layer stack's gated deltas (mars_core/engine/w8a8_layers.h, `Lora`): A products (one per adapted
        product), B products (one per part) and the index [parts, 5] of (product, A entry, r offset, r width,
        output offset), from each layer's `lora` (_layer)."""
        a, a_scale, b, b_scale, index = [], [], [], [], []
        for i, layer in enumerate(self.layers):
            for j, name in enumerate(PRODUCTS):
                lora = layer.lora.get(name)
                if lora is None:
                    continue
                a_lin, parts = lora
                for b_lin, r_off, out_off in parts:
                    index.append([4 * i + j, len(a), r_off, b_lin.in_features, out_off])
                    b.append(b_lin._own.packed)
                    b_scale.append(b_lin._own.scale)
                a.append(a_lin._own.packed)
                a_scale.append(a_lin._own.scale)
        return a, a_scale, b, b_scale, torch.tensor(index, dtype=torch.long).reshape(-1, 5)

    def _layer(self, layer, fmt, dtype, ranges: dict | None = None) -> torch.nn.Module:
        w = self._float_weights(layer)
        scales = self._smooth(w, ranges) if ranges is not None else {}
        out = torch.nn.Module()
        out.lora = {}   # w8a8: the gated deltas the native stack applies (_native_lora)
        for name in PRODUCTS:
            linear = make_linear(w[name], w.get(name + "_b"), fmt, dtype, name, self.kernel)
            if self.gate is not None and fmt == "w8a8":
                out.lora[name] = self._w8a8_delta(layer, name, *scales.get(name, (None, None)))
            elif self.gate is not None and (delta := self._gated_delta(layer, name)) is not None:
                # in the activations' dtype, as the products take them
                linear = GatedLinear(linear, *(t.to(self.dtype) for t in delta), self.gate)
            setattr(out, name, linear)
        out.register_buffer("norm_in", w["norm_in"].to(self.dtype))
        out.register_buffer("norm_post", w["norm_post"].to(self.dtype))
        return out

    def _float_weights(self, layer) -> dict:
        """One layer's fused fp32 weights (q and k rows interleaved for the complex RoPE), biases, norm weights."""
        a, m, d = layer.self_attn, layer.mlp, self.head_dim
        f = lambda t: None if t is None else t.detach().float()
        w = {"qkv": torch.cat([_interleave_rows(f(a.q_proj.weight), d), _interleave_rows(f(a.k_proj.weight), d),
                               f(a.v_proj.weight)]),
             "o": f(a.o_proj.weight), "gate_up": torch.cat([f(m.gate_proj.weight), f(m.up_proj.weight)]),
             "down": f(m.down_proj.weight), "o_b": f(getattr(a.o_proj, "bias", None)),
             "down_b": f(getattr(m.down_proj, "bias", None)),
             "norm_in": f(layer.input_layernorm.weight), "norm_post": f(layer.post_attention_layernorm.weight)}
        if getattr(a.q_proj, "bias", None) is not None:
            w["qkv_b"] = torch.cat([_interleave_rows(f(a.q_proj.bias), d), _interleave_rows(f(a.k_proj.bias), d),
                                    f(a.v_proj.bias)])
        if getattr(m.gate_proj, "bias", None) is not None:
            w["gate_up_b"] = torch.cat([f(m.gate_proj.bias), f(m.up_proj.bias)])
        return w

    def _gated_parts(self, layer, role: str) -> tuple[torch.Tensor, list, int] | None:
        """A fused product's gated deltas (mars_core.engine.gated): (the parts' A stacked [R, in], [(B [out_part, r],
        r offset, output offset)] with q's and k's rows interleaved as the fused weight's are, the product's
        outputs), or None if no part has one."""
        a, m = layer.self_attn, layer.mlp
        parts = {"qkv": [(a.q_proj, True), (a.k_proj, True), (a.v_proj, False)], "o": [(a.o_proj, False)],
                 "gate_up": [(m.gate_proj, False), (m.up_proj, False)], "down": [(m.down_proj, False)]}[role]
        if not any(isinstance(p, GatedLinear) for p, _ in parts):
            return None
        big_a, bs, row, col = [], [], 0, 0
        for p, inter in parts:
            if isinstance(p, GatedLinear):
                b = p.b_t.t()
                big_a.append(p.a_t.t())
                bs.append((_interleave_rows(b, self.head_dim) if inter else b, col, row))
                col += b.shape[1]
            row += p.weight.shape[0]
        return torch.cat(big_a), bs, row

    def _gated_delta(self, layer, role: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A [R, in], B [out, R]) of a fused product's gated deltas: the parts' B on the block diagonal, zero rows
        for a part without one (the fp32 loop's form). None if no part has one."""
        found = self._gated_parts(layer, role)
        if found is None:
            return None
        big_a, bs, rows = found
        big_b = torch.zeros(rows, big_a.shape[0])
        for b, col, row in bs:
            big_b[row: row + b.shape[0], col: col + b.shape[1]] = b
        return big_a, big_b

    def _w8a8_delta(self, layer, role: str, s_in: torch.Tensor | None, out_scale: torch.Tensor | None):
        """A fused product's gated deltas as the native stack's int8 products, (A, [(B, r offset, output
        offset)]), or None. Smoothing divided the product's input by `s_in` (so A's columns are multiplied by it)
        and multiplied some outputs by `out_scale` (v's rows of qkv and up's of gate_up: B's rows follow)."""
        from mars_core.engine.w8a8 import W8A8Linear

        found = self._gated_parts(layer, role)
        if found is None:
            return None
        big_a, bs, _ = found
        big_a = big_a.float() * (s_in[None, :] if s_in is not None else 1.0)
        parts = []
        for b, col, row in bs:
            b = b.float() * (out_scale[row: row + b.shape[0], None] if out_scale is not None else 1.0)
            parts.append((W8A8Linear(b, None, passes=2, kernel=self.kernel), col, row))
        return W8A8Linear(big_a, None, passes=2, kernel=self.kernel), parts

    def _smooth(self, w: dict, ranges: dict) -> dict:
        """SmoothQuant's migration (mars_core.engine.w8a8.smoothing), folded into the weights that feed each product.
        Returns, per product, (what its input was divided by [in], what its outputs were multiplied by [out] or
        None): what a gated delta on that product must follow (_w8a8_delta)."""
        from mars_core.engine.w8a8 import smoothing

        col = lambda weight: weight.abs().amax(dim=0)
        scales = {}
        for norm, name in (("norm_in", "qkv"), ("norm_post", "gate_up")):
            s = smoothing(ranges[name], col(w[name]))
            w[name], w[norm] = w[name] * s, w[norm] / s
            scales[name] = [s, None]
        # o's input is attention's output, linear in v: one scale per v channel, shared by the heads that read it
        group, d = self.heads // self.kv_heads, self.head_dim
        x_range = ranges["o"].view(self.kv_heads, group, d).amax(dim=1)
        w_range = col(w["o"]).view(self.kv_heads, group, d).amax(dim=1)
        s = smoothing(x_range.reshape(-1), w_range.reshape(-1)).view(self.kv_heads, 1, d)
        w["o"] = w["o"] * s.expand(self.kv_heads, group, d).reshape(-1)
        v = slice((self.heads + self.kv_heads) * d, None)
        w["qkv"][v] = w["qkv"][v] / s.reshape(-1, 1)
        if "qkv_b" in w:
            w["qkv_b"][v] = w["qkv_b"][v] / s.reshape(-1)
        scales["o"] = [s.expand(self.kv_heads, group, d).reshape(-1), None]
        scales["qkv"][1] = torch.ones(w["qkv"].shape[0])
        scales["qkv"][1][v] = 1 / s.reshape(-1)
        # down's input is silu(gate) * up, linear in up
        s = smoothing(ranges["down"], col(w["down"]))
        half = w["gate_up"].shape[0] // 2
        w["down"], w["gate_up"][half:] = w["down"] * s, w["gate_up"][half:] / s[:, None]
        if "gate_up_b" in w:
            w["gate_up_b"][half:] = w["gate_up_b"][half:] / s
        scales["down"] = [s, None]
        scales["gate_up"][1] = torch.cat([torch.ones(half), 1 / s])
        return scales

    def new_cache(self) -> LeanCache:
        return LeanCache(len(self.layers), self.kv_heads, self.head_dim, self.attention_dtype, self.embed.device,
                         self.context, key_tiles=self.native)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: LeanCache | None = None, use_cache: bool = True,
                logits_to_keep: int | torch.Tensor = 0, draft_tail: int = 0,
                head_top: tuple[int, int, int] | None = None, **unused) -> LeanOutput:
        """`attention_mask`: None (causal) or a boolean [b, 1, L, past + L] mask, True where a query may look.
        `draft_tail`: how many of each row's last positions only propose drafts that a later forward checks (a
        lossless step's masks: no other position attends to them and their cache entries are dropped). w8a8's
        VNNI and AVX2 loops spend their second pass on them not at all; the other loops ignore it. Other
        positions' outputs never change with it.
        `head_top`: (column, first, conf_from) asks for each kept position's largest logit and its column,
        gathered by the head as it writes them, with `column` left out from the `first`-th kept position of a row
        on, and from the `conf_from`-th on (none for -1) the softmax probability of that column where the head
        gathers sums (see `takes_head_top`; the logits are the same either way)."""
        b, length = input_ids.shape
        cache = cache if cache is not None else self.new_cache()
        past = cache.length
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=input_ids.device).expand(b, length)
        hidden = self._mask_fill(attention_mask, b, length, past, input_ids.device)
        rope = self.rope[position_ids.reshape(-1)][:, None] * self.rope_scale        # [b*L, heads + kv, d/2]
        cache.reserve(b, length)
        x = self.embed[input_ids.reshape(-1)]                                       # [b*L, hidden]
        shape = (cache.k, cache.v, past, b, length, self.heads, self.kv_heads, self.head_dim, rope, hidden, self.eps)
        # a gated adapter's deltas act at mask positions (the fp32 loop takes them; the modules apply their own)
        gated = self.gate is not None and self.gate.read(input_ids)
        if self.scripted is not None:
            tail = {"tail": min(draft_tail, length)} if self.kernel in NATIVE and draft_tail else {}
            if gated and self.kernel in NATIVE:   # the native stack: the mask rows' int8 deltas
                tail.update(rows=self.gate.column[:, 0].nonzero()[:, 0], lora=self._lora)
            elif gated:
                tail = {"column": self.gate.column, "lora_a": self._lora[0], "lora_b": self._lora[1]}
            x = self.scripted(x, *self._script_weights, *shape, **tail)
        else:   # the same arithmetic through the modules (bf16, int8, or a torch that cannot script)
            x = layers(x, self.layers, *shape)
        if gated:
            self.gate.clear()
        cache.length = past + length
        x = x.view(b, length, -1)
        if isinstance(logits_to_keep, torch.Tensor):
            x = x[:, logits_to_keep]
        elif logits_to_keep:
            x = x[:, -logits_to_keep:]
        h = _rms(x, self.norm, self.eps)
        kept = h.shape[1]
        h = h.reshape(-1, h.shape[-1])
        if head_top is not None and self.takes_head_top:
            column, first, conf_from = head_top
            sums = self.head.gives_sums and conf_from >= 0
            y, value, index, total = self.head.with_top(h, column, kept, first, conf_from if sums else -1)
            return LeanOutput(y.view(b, kept, -1), (value.view(b, kept), index.view(b, kept)),
                              total.reciprocal().view(b, kept) if sums else None)
        return LeanOutput(self.head(h).view(b, kept, -1))

    def _mask_fill(self, mask, b, length, past, device):
        """Where the scores must be -inf, [b, 1, L * group, past + L] (rows in the grouped-query order), or None
        when every query may see every key (one position after a cache without holes)."""
        if mask is None:
            if length == 1:
                return None
            mask = torch.ones(length, past + length, dtype=torch.bool, device=device).tril(past)[None, None]
        group = self.heads // self.kv_heads
        return (~mask).expand(b, 1, length, past + length).repeat_interleave(group, dim=2)
