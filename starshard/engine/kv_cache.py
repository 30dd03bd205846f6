"""This rank's KV shard: per layer k/v plus the global positions it holds.

Under context parallelism a rank holds only part of the sequence, so positions are stored next to
the keys rather than implied by the index; attention masks by position. `fp8=True` stores e4m3 keys
and values with per-(KV head, token) scales (LayerKV says why).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from starshard.kernels.fp8 import FP8_DTYPE, dequantize, quantize_rows
from starshard.kernels.kv_write import use_kv_write_kernel, write_kv_block, write_kv_slot, write_kv_slot_reference


@dataclass
class StoredKV:
    """What a LayerKV holds, as stored: k, v [B, Hkv, n, D] (e4m3 for an FP8 cache) with positions [n];
    k_scale, v_scale [B, Hkv, n] float32 for FP8 (None otherwise). `attention(q, s.k, s.v, ...,
    k_scale=s.k_scale, v_scale=s.v_scale)` reads it either way."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class LayerKV:
    """Preallocated k/v/positions for one layer; grows by doubling if a run outlasts its capacity.

    fp8: keys and values are stored in e4m3 (1 byte) with one float32 scale per (KV head, token):
    scale = amax of that head's D values / 448 (kernels/fp8.py quantize_rows). Why per token rather
    than one scale per head fixed at the first write: an entry's bytes then depend on that key
    alone, so every strategy and rank stores the same bytes for the same key whatever order or shard
    it is written in (ring, Ulysses, Star, APB and dense agree), nothing ever clips when a later token
    is larger than the first ones, and no stored entry is rescaled for the rest of the run. The scale
    costs 4 bytes per 128 stored (about 3 %).
    Reads: `stored()` hands the e4m3 bytes and scales to attention (the Triton kernels dequantize in
    registers); `append_stored()` stores a prefill block and hands back the entries held before it
    as stored, the block attending its own keys as given (kernels/attention.py attention_after_held):
    a chunked prefill never holds a compute-dtype copy of the prefix. `append()` / `view()` hand back
    the compute dtype (held entries dequantized: a transient copy of the prefix; the entries just
    appended as given). Either way a prefill attends its own keys exactly, as every context
    strategy's prefill does with the keys it computes or receives.
    """

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, capacity: int, dtype, device, fp8: bool = False):
        self.dtype = dtype  # what attention computes in
        self.fp8 = fp8
        store = FP8_DTYPE if fp8 else dtype
        self.k = torch.empty(batch, n_kv_heads, capacity, head_dim, dtype=store, device=device)
        self.v = torch.empty_like(self.k)
        self.k_scale = torch.empty(batch, n_kv_heads, capacity, dtype=torch.float32, device=device) if fp8 else None
        self.v_scale = torch.empty_like(self.k_scale) if fp8 else None
        self.pos = torch.empty(capacity, dtype=torch.long, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        """Bytes allocated (capacity, not length)."""
        ts = [self.k, self.v, self.pos] + ([self.k_scale, self.v_scale] if self.fp8 else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def _grow(self, needed: int) -> None:
        cap = max(needed, 2 * self.capacity)
        n = self.length

        def grown(t, dim):
            new = t.new_empty(*t.shape[:dim], cap, *t.shape[dim + 1 :])
            new.narrow(dim, 0, n).copy_(t.narrow(dim, 0, n))
            return new

        self.k, self.v, self.pos = grown(self.k, 2), grown(self.v, 2), grown(self.pos, 0)
        if self.fp8:
            self.k_scale, self.v_scale = grown(self.k_scale, 2), grown(self.v_scale, 2)

    def _put(self, k, v, start: int, end: int) -> None:
        if self.fp8 and use_kv_write_kernel(self.k):  # one launch, no copies of k / v first
            write_kv_block(k, v, start, self.k, self.v, self.k_scale, self.v_scale)
        elif self.fp8:
            k8, ks = quantize_rows(k)
            v8, vs = quantize_rows(v)
            self.k[:, :, start:end], self.k_scale[:, :, start:end] = k8, ks
            self.v[:, :, start:end], self.v_scale[:, :, start:end] = v8, vs
        else:
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v

    def store(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Store new entries (k, v [B, Hkv, n, D] in the compute dtype, pos [n])."""
        n = k.shape[2]
        end = self.length + n
        if end > self.capacity:
            self._grow(end)
        if n == 1 and pos.device == self.pos.device and use_kv_write_kernel(self.k):  # eager decode: one launch
            write_kv_slot(k, v, pos, self.length, self.k, self.v, self.pos, self.k_scale, self.v_scale)
        else:
            self._put(k, v, self.length, end)
            self.pos[self.length : end] = pos
        self.length = end

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        """Store new entries; return everything held for attention: (k, v, positions) in the compute
        dtype (FP8: the held entries dequantized, the new ones as given)."""
        held = self.length
        self.store(k, v, pos)
        if not self.fp8:
            return self.view()
        if held == 0:
            return k, v, self.pos[: self.length]
        old_k, old_v, _ = self._dequantized(held)
        return torch.cat([old_k, k], 2), torch.cat([old_v, v], 2), self.pos[: self.length]

    def append_stored(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> StoredKV:
        """Store new entries; return the entries held before them, as stored (no copy). The caller
        attends these plus its own k, v as given."""
        held = self.length
        self.store(k, v, pos)
        return self.stored(held)

    def write_slot(self, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Write one token's entry at the device index `slot` [1] (a captured CUDA-graph step: nothing
        read on the host, `length` is the caller's to advance). CUDA: one Triton launch (kernels/kv_write.py)."""
        write = write_kv_slot if use_kv_write_kernel(self.k) else write_kv_slot_reference
        write(k, v, pos, slot, self.k, self.v, self.pos, self.k_scale, self.v_scale)

    def _dequantized(self, n: int):
        return (dequantize(self.k[:, :, :n], self.k_scale[:, :, :n], self.dtype),
                dequantize(self.v[:, :, :n], self.v_scale[:, :, :n], self.dtype), self.pos[:n])

    def view(self):
        """Everything held as (k, v, positions) in the compute dtype (an FP8 cache: dequantized copies)."""
        n = self.length
        if self.fp8:
            return self._dequantized(n)
        return self.k[:, :, :n], self.v[:, :, :n], self.pos[:n]

    def stored(self, n: int | None = None) -> StoredKV:
        """The first n entries (default: all held) as stored, no copy: what attention reads directly."""
        n = self.length if n is None else n
        if not self.fp8:
            return StoredKV(self.k[:, :, :n], self.v[:, :, :n], self.pos[:n])
        return StoredKV(self.k[:, :, :n], self.v[:, :, :n], self.pos[:n], self.k_scale[:, :, :n], self.v_scale[:, :, :n])


class KVCache:
    """KV for the layers this rank holds (a pipeline stage holds a slice, keyed by global index)."""

    def __init__(self, layer_ids, batch, n_kv_heads, head_dim, capacity, dtype, device, fp8: bool = False):
        self.layers = {i: LayerKV(batch, n_kv_heads, head_dim, capacity, dtype, device, fp8) for i in layer_ids}
        self.device = torch.device(device)
        self.next_position = 0  # position the next token of the sequence takes

    def layer(self, i: int) -> LayerKV:
        return self.layers[i]

    def advance(self, positions: torch.Tensor, end: int | None = None) -> None:
        """Record that `positions` were processed; `end` (max + 1), when known, avoids a device sync."""
        if end is None and positions.numel():
            end = int(positions.max()) + 1
        if end is not None:
            self.next_position = max(self.next_position, end)

    @property
    def length(self) -> int:
        return next(iter(self.layers.values())).length if self.layers else 0
