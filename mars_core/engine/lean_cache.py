"""The lean forward's KV cache: two preallocated tensors and a length, with exactly what the decoder asks of a
cache (mars_core.decode.backend.KVCache): the forward appends a chunk, the decoder crops and keeps batch rows;
holes are columns the decoder's mask hides."""
from __future__ import annotations

import torch

GROW = 256   # cache columns added at a time


class LeanCache:
    """Keys and values of every layer, [layers, batch, kv_heads, capacity, head_dim], and how many columns are
    filled. Columns are appended in place and dropped by moving `length`; the tensors grow by GROW columns."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, limit: int,
                 key_tiles: bool = False):
        self.shape, self.dtype, self.device, self.limit = (layers, kv_heads, head_dim), dtype, device, limit
        # keys as [layers, batch, kv_heads, capacity / 16, head_dim, 16]: tiles of 16 columns stored by dimension,
        # which the native stack reads in order (mars_core/engine/w8a8_layers.h, `scores`)
        self.key_tiles = key_tiles
        self.k = self.v = None
        self.length = 0

    def reserve(self, batch: int, columns: int) -> None:
        """Room for `columns` more columns at this batch size."""
        need = self.length + columns
        if self.v is not None and self.v.shape[3] >= need:
            return
        layers, heads, dim = self.shape
        cap = max(need, min(self.limit, need + GROW))   # GROW spare columns, never past the context
        if self.key_tiles:
            cap = -(-cap // 16) * 16
        v = torch.empty(layers, batch, heads, cap, dim, dtype=self.dtype, device=self.device)
        # zeros: the native stack also scores the last tile's columns past the filled ones (and discards them)
        k = torch.zeros(layers, batch, heads, cap // 16, dim, 16, dtype=self.dtype, device=self.device) \
            if self.key_tiles else torch.empty_like(v)
        if self.k is not None:
            if self.key_tiles:
                tiles = -(-self.length // 16)
                k[:, :, :, :tiles] = self.k[:, :, :, :tiles]
            else:
                k[:, :, :, : self.length] = self.k[:, :, :, : self.length]
            v[:, :, :, : self.length] = self.v[:, :, :, : self.length]
        self.k, self.v = k, v

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, n: int) -> None:
        """As transformers' Cache.crop: n < 0 drops the last -n columns, n >= 0 keeps the first n."""
        self.length = max(0, self.length + n if n < 0 else min(n, self.length))

    def batch_select_indices(self, index: torch.Tensor) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, index], self.v[:, index]
