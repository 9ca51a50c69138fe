"""The w8a8 layer stack of `mars_core.lean.LeanLM` as one TorchScript function.

On one CPU thread a SmolLM2 forward is ~1,300 small ops besides its 121 matrix products, and Python's share of
each op is what the eager loop pays most for (docs/experiments.md, "lean forward"). TorchScript runs the same ops
in the same order from its C++ interpreter, so the logits are bitwise the eager loop's (tests/test_lean.py
checks it) at about two thirds of the time. `torch.jit.script` is deprecated in favour of torch.compile, which
compiled this forward for minutes and did not run it faster; if a torch release drops it, `scripted_layers()`
returns None and LeanLM runs its eager loop.
"""
from __future__ import annotations

import warnings
from typing import List, Optional

import torch

from mars_core.w8a8 import _INVERSE, _STEP

_SCRIPTED = []   # [function or None], built once per process
_STEP_F = float(_STEP)


def _railed(x: torch.Tensor, packed: torch.classes.quantized.LinearPackedParamsBase, rails: torch.Tensor,
            bias: Optional[torch.Tensor], two: bool, inverse: float = _INVERSE, step: float = _STEP_F) -> torch.Tensor:
    """mars_core.w8a8.W8A8Linear.forward on a 2D fp32 input, op for op (`two`: its passes == 2)."""
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


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _layers(x: torch.Tensor, packs: List[torch.classes.quantized.LinearPackedParamsBase],
            biases: List[Optional[torch.Tensor]], two: List[bool], norms: List[torch.Tensor], k_cache: torch.Tensor,
            v_cache: torch.Tensor, past: int, b: int, length: int, heads: int, kv: int, d: int, rope: torch.Tensor,
            hidden: Optional[torch.Tensor], eps: float, rails: torch.Tensor) -> torch.Tensor:
    """LeanLM._block for every layer (weights in order qkv, o, gate_up, down per layer; norms in, post)."""
    end = past + length
    group = heads // kv
    for i in range(len(norms) // 2):
        h = _rms(x, norms[2 * i], eps)
        qkv = _railed(h, packs[4 * i], rails, biases[4 * i], two[4 * i])
        qk = qkv[:, : (heads + kv) * d]
        qk = torch.view_as_real(torch.view_as_complex(qk.reshape(b * length, heads + kv, d // 2, 2)) * rope)
        qk = qk.reshape(b, length, heads + kv, d)
        k_cache[i, :, :, past:end] = qk[:, :, heads:].transpose(1, 2)
        v_cache[i, :, :, past:end] = qkv[:, (heads + kv) * d:].reshape(b, length, kv, d).transpose(1, 2)
        k = k_cache[i, :, :, :end]
        v = v_cache[i, :, :, :end]
        q = qk[:, :, :heads].to(k.dtype).reshape(b, length, kv, group, d).transpose(1, 2).reshape(b, kv, -1, d)
        scores = q @ k.transpose(-1, -2)
        if hidden is not None:
            scores = scores.masked_fill(hidden, float("-inf"))
        att = (torch.softmax(scores, dim=-1) @ v).view(b, kv, length, group, d).transpose(1, 2)
        att = att.reshape(b * length, heads * d)
        x = x + _railed(att.to(x.dtype), packs[4 * i + 1], rails, biases[4 * i + 1], two[4 * i + 1])
        h = _rms(x, norms[2 * i + 1], eps)
        gate, up = _railed(h, packs[4 * i + 2], rails, biases[4 * i + 2], two[4 * i + 2]).chunk(2, dim=-1)
        x = x + _railed(torch.nn.functional.silu(gate) * up, packs[4 * i + 3], rails, biases[4 * i + 3], two[4 * i + 3])
    return x


def scripted_layers():
    """The TorchScript-compiled `_layers`, or None where torch cannot script it (then LeanLM stays eager)."""
    if not _SCRIPTED:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # the deprecation notice; the function is what it was
                _SCRIPTED.append(torch.jit.script(_layers))
        except Exception:   # any failure to compile means "run eagerly", never a wrong result
            _SCRIPTED.append(None)
    return _SCRIPTED[0]
