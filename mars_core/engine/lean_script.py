"""The layer stack of `mars_core.engine.lean.LeanLM`: one loop per weight format, three compiled by TorchScript, and the
one call into our own kernels' native layer stack.

On one CPU thread a SmolLM2 forward is ~1,300 small ops besides its 121 matrix products, and Python's share of
each op is what an eager loop pays most for (docs/experiments/cpu-formats.md, "The lean forward and w8a8"). TorchScript
runs the same ops in the same order from its C++ interpreter, so the logits are bitwise the eager loop's
(tests/test_lean.py checks it) at about two thirds of the time. The w8a8 and fp32 loops are scripted; bf16 and int8 run
`layers`, the same arithmetic through the modules' own forward. `torch.jit.script` is deprecated in favour of
torch.compile, which compiled this forward for minutes and did not run it faster; if a torch release drops it,
`scripted()` returns None and LeanLM runs the plain Python functions below, which give the same numbers.

Our w8a8 kernels (mars_core/engine/vnni.cpp, avx2.cpp) go further: their `layers` op runs every layer in one C++ call
(mars_core/engine/w8a8_layers.h), the small ops as plain loops. Its logits are close to, not bitwise, the eager loop's,
and each position's are independent of the others in the call (tests/test_lean.py checks both).
"""
from __future__ import annotations

import warnings
from typing import List, Optional

import torch

from mars_core.engine.w8a8 import _INVERSE, _STEP, onednn_w8a8

_STEP_F = float(_STEP)
_COMPILED: dict = {}   # loop name -> compiled function (or None), built once per process


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (statistics in fp32), spelled out: torch's F.rms_norm measured slower on few rows."""
    if x.dtype != torch.float32:
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _attention(i: int, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, past: int, b: int,
               length: int, heads: int, kv: int, d: int, rope: torch.Tensor, hidden: Optional[torch.Tensor]):
    """Layer i's attention from its fused q/k/v rows [b*L, (heads + 2 kv) d]: RoPE as one complex multiply (q rows
    also carry 1/sqrt(d)), the chunk's k and v written into the cache, and grouped-query attention over the cache
    in its dtype (float64 for w8a8), the query rows of one KV head batched as L * group rows of one product."""
    end = past + length
    group = heads // kv
    qk = qkv[:, : (heads + kv) * d]
    if qk.dtype != torch.float32:   # complex RoPE needs fp32; bf16 formats round back below
        qk = qk.float()
    qk = torch.view_as_real(torch.view_as_complex(qk.reshape(b * length, heads + kv, d // 2, 2)) * rope)
    qk = qk.reshape(b, length, heads + kv, d)
    k_cache[i, :, :, past:end] = qk[:, :, heads:].transpose(1, 2)
    v_cache[i, :, :, past:end] = qkv[:, (heads + kv) * d:].reshape(b, length, kv, d).transpose(1, 2)
    k = k_cache[i, :, :, :end]
    v = v_cache[i, :, :, :end]
    q = qk[:, :, :heads].to(k.dtype).reshape(b, length, kv, group, d).transpose(1, 2).reshape(b, kv, -1, d)
    scores = q @ k.transpose(-1, -2)                                               # [b, kv, L*group, T]
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    att = (torch.softmax(scores, dim=-1) @ v).view(b, kv, length, group, d).transpose(1, 2)
    return att.reshape(b * length, heads * d).to(qkv.dtype)


def _w8a8(x: torch.Tensor, packed: torch.classes.quantized.LinearPackedParamsBase, rails: torch.Tensor,
          bias: Optional[torch.Tensor], two: bool, inverse: float = _INVERSE, step: float = _STEP_F) -> torch.Tensor:
    """mars_core.engine.w8a8.W8A8Linear.forward on a 2D fp32 input, op for op (`two`: its passes == 2)."""
    magnitude = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    u = x / magnitude
    y = torch.ops.quantized.linear_dynamic(torch.cat([u, rails.expand(x.shape[0], 2)], dim=1), packed)
    if two:
        r = u - torch.round(u * inverse).clamp(-128.0, 127.0) * step
        r_magnitude = r.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
        railed = torch.cat([r / r_magnitude, rails.expand(x.shape[0], 2)], dim=1)
        y = y + torch.ops.quantized.linear_dynamic(railed, packed) * r_magnitude
    y = y * magnitude
    if bias is not None:
        y = y + bias
    return y


def layers_w8a8(x: torch.Tensor, packs: List[torch.classes.quantized.LinearPackedParamsBase],
                biases: List[Optional[torch.Tensor]], two: List[bool], rails: torch.Tensor, norms: List[torch.Tensor],
                k_cache: torch.Tensor, v_cache: torch.Tensor, past: int, b: int, length: int, heads: int, kv: int,
                d: int, rope: torch.Tensor, hidden: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Every layer in w8a8 (products in order qkv, o, gate_up, down per layer; norms in, post)."""
    for i in range(len(norms) // 2):
        j = 4 * i
        qkv = _w8a8(_rms(x, norms[2 * i], eps), packs[j], rails, biases[j], two[j])
        att = _attention(i, qkv, k_cache, v_cache, past, b, length, heads, kv, d, rope, hidden)
        x = x + _w8a8(att, packs[j + 1], rails, biases[j + 1], two[j + 1])
        gate, up = _w8a8(_rms(x, norms[2 * i + 1], eps), packs[j + 2], rails, biases[j + 2], two[j + 2]).chunk(2, -1)
        x = x + _w8a8(torch.nn.functional.silu(gate) * up, packs[j + 3], rails, biases[j + 3], two[j + 3])
    return x


def layers_w8a8_onednn(x: torch.Tensor, packs: List[torch.Tensor], w_scales: List[torch.Tensor],
                       w_zeros: List[torch.Tensor], biases: List[Optional[torch.Tensor]], two: List[bool],
                       norms: List[torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor, past: int, b: int,
                       length: int, heads: int, kv: int, d: int, rope: torch.Tensor, hidden: Optional[torch.Tensor],
                       eps: float) -> torch.Tensor:
    """Every layer in w8a8 through oneDNN's kernel (mars_core.engine.w8a8.onednn_w8a8), as layers_w8a8."""
    for i in range(len(norms) // 2):
        j = 4 * i
        qkv = onednn_w8a8(_rms(x, norms[2 * i], eps), packs[j], w_scales[j], w_zeros[j], biases[j], two[j])
        att = _attention(i, qkv, k_cache, v_cache, past, b, length, heads, kv, d, rope, hidden)
        x = x + onednn_w8a8(att, packs[j + 1], w_scales[j + 1], w_zeros[j + 1], biases[j + 1], two[j + 1])
        h = _rms(x, norms[2 * i + 1], eps)
        gate, up = onednn_w8a8(h, packs[j + 2], w_scales[j + 2], w_zeros[j + 2], biases[j + 2], two[j + 2]).chunk(2, -1)
        x = x + onednn_w8a8(torch.nn.functional.silu(gate) * up, packs[j + 3], w_scales[j + 3], w_zeros[j + 3],
                            biases[j + 3], two[j + 3])
    return x


def native_loop(kernel: str):
    """Every layer in w8a8 through one call of our kernel's `layers` op (mars_core/engine/w8a8_layers.h, built into
    mars_core/engine/vnni.cpp and avx2.cpp). It takes the kernel's weight lists (LeanLM._script: packed weights, scales,
    biases, second-pass flags, norms), the loops' shape arguments and `tail`: the last `tail` positions of each row
    skip the second pass (LeanLM.forward's `draft_tail`). A gated adapter adds `rows` (the mask positions) and
    `lora`: LeanLM._native_lora's packed A and B products and their index."""
    op = getattr(torch.ops, f"mars_{kernel}").layers

    def loop(x: torch.Tensor, packs: List[torch.Tensor], scales: List[torch.Tensor],
             biases: List[Optional[torch.Tensor]], two: List[bool], norms: List[torch.Tensor], k_cache: torch.Tensor,
             v_cache: torch.Tensor, past: int, b: int, length: int, heads: int, kv: int, d: int, rope: torch.Tensor,
             hidden: Optional[torch.Tensor], eps: float, tail: int = 0, rows: Optional[torch.Tensor] = None,
             lora: tuple = ([], [], [], [], None)) -> torch.Tensor:
        return op(x, packs, scales, biases, two, norms, k_cache, v_cache, past, b, length, heads, kv, d,
                  torch.view_as_real(rope), hidden, eps, _INVERSE, _STEP_F, tail, rows, *lora)

    return loop


def _fp32(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """mars_core.engine.lean.FloatLinear.forward in fp32 on MKL (W^T row-major), op for op; `n` is implied by `w`."""
    return x @ w if bias is None else torch.addmm(bias, x, w)


def _own32(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """FloatLinear.forward on our kernel (mars_core.engine.fp32): `packed` by mars_fp32.pack, `n` output columns."""
    return torch.ops.mars_fp32.linear(x, packed, bias, n)


def _gated(y: torch.Tensor, x: torch.Tensor, column: Optional[torch.Tensor], a: Optional[torch.Tensor],
           b: Optional[torch.Tensor]) -> torch.Tensor:
    """A product's output `y` plus, where `column` (1 at mask positions, else 0) is given, a gated adapter's delta
    (mars_core.engine.gated.GatedLinear.forward, op for op)."""
    if column is None or a is None or b is None:
        return y
    return torch.addmm(y, (x @ a) * column, b)


def _fp32_loop(product):
    """The fp32 layer loop with `product` (_fp32 or _own32) for its matrix products. TorchScript resolves the
    product when it compiles each loop, so the kernel's loop is built only where its op exists."""

    def layers_fp32(x: torch.Tensor, weights: List[torch.Tensor], biases: List[Optional[torch.Tensor]], ns: List[int],
                    norms: List[torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor, past: int, b: int,
                    length: int, heads: int, kv: int, d: int, rope: torch.Tensor, hidden: Optional[torch.Tensor],
                    eps: float, column: Optional[torch.Tensor] = None,
                    lora_a: Optional[List[Optional[torch.Tensor]]] = None,
                    lora_b: Optional[List[Optional[torch.Tensor]]] = None) -> torch.Tensor:
        """Every layer in fp32, as layers_w8a8 with plain products (`ns`: their output widths); with `column`, a
        gated adapter's deltas (`lora_a`/`lora_b`: [in, R] and [R, out] per product, None where a product has
        none) at the mask positions."""
        for i in range(len(norms) // 2):
            j = 4 * i
            a: List[Optional[torch.Tensor]] = [None, None, None, None]
            bb: List[Optional[torch.Tensor]] = [None, None, None, None]
            if column is not None and lora_a is not None and lora_b is not None:
                a = lora_a[j: j + 4]
                bb = lora_b[j: j + 4]
            h = _rms(x, norms[2 * i], eps)
            qkv = _gated(product(h, weights[j], biases[j], ns[j]), h, column, a[0], bb[0])
            att = _attention(i, qkv, k_cache, v_cache, past, b, length, heads, kv, d, rope, hidden)
            x = x + _gated(product(att, weights[j + 1], biases[j + 1], ns[j + 1]), att, column, a[1], bb[1])
            h = _rms(x, norms[2 * i + 1], eps)
            gate, up = _gated(product(h, weights[j + 2], biases[j + 2], ns[j + 2]), h, column, a[2], bb[2]).chunk(2, -1)
            h = torch.nn.functional.silu(gate) * up
            x = x + _gated(product(h, weights[j + 3], biases[j + 3], ns[j + 3]), h, column, a[3], bb[3])
        return x

    return layers_fp32


layers_fp32 = _fp32_loop(_fp32)


def layers(x, modules, k_cache, v_cache, past, b, length, heads, kv, d, rope, hidden, eps):
    """Every layer through its modules' own products (any format; what bf16 and int8 run)."""
    for i, layer in enumerate(modules):
        qkv = layer.qkv(_rms(x, layer.norm_in, eps))
        att = _attention(i, qkv, k_cache, v_cache, past, b, length, heads, kv, d, rope, hidden)
        x = x + layer.o(att)
        gate, up = layer.gate_up(_rms(x, layer.norm_post, eps)).chunk(2, -1)
        x = x + layer.down(torch.nn.functional.silu(gate) * up)
    return x


def scripted(name: str):
    """The TorchScript-compiled "w8a8", "w8a8-onednn", "fp32" or "fp32-own" loop (the last only once our fp32 op is
    registered), or None where torch cannot script it; for "w8a8-vnni", "w8a8-avx2" and "w8a8-avx2w" (w8a16), that
    kernel's native layer stack (only once its op is registered, mars_core.engine.native)."""
    if name in ("w8a8-vnni", "w8a8-avx2", "w8a8-avx2w"):   # already one C++ call: nothing to compile
        return native_loop(name.split("-")[1])
    if name not in _COMPILED:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # the deprecation notice; the function is what it was
                loops = {"w8a8": layers_w8a8, "w8a8-onednn": layers_w8a8_onednn, "fp32": layers_fp32,
                         "fp32-own": _fp32_loop(_own32)}
                _COMPILED[name] = torch.jit.script(loops[name])
        except Exception:   # any failure to compile means "run the Python function", never a wrong result
            _COMPILED[name] = None
    return _COMPILED[name]
