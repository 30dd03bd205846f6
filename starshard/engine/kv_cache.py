"""This rank's KV shard: per layer k/v plus the global positions it holds.

Under context parallelism a rank holds only part of the sequence, so positions are stored next to
the keys rather than implied by the index; attention masks by position.
"""
from __future__ import annotations

import torch


class LayerKV:
    """Preallocated k/v/positions for one layer; grows by doubling if a run outlasts its capacity."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, capacity: int, dtype, device):
        self.k = torch.empty(batch, n_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.pos = torch.empty(capacity, dtype=torch.long, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def _grow(self, needed: int) -> None:
        cap = max(needed, 2 * self.capacity)
        k = self.k.new_empty(*self.k.shape[:2], cap, self.k.shape[3])
        v = torch.empty_like(k)
        pos = self.pos.new_empty(cap)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        pos[: self.length] = self.pos[: self.length]
        self.k, self.v, self.pos = k, v, pos

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        """Store new entries; return views of everything held: (k, v, positions)."""
        n = k.shape[2]
        end = self.length + n
        if end > self.capacity:
            self._grow(end)
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.pos[self.length : end] = pos
        self.length = end
        return self.view()

    def view(self):
        n = self.length
        return self.k[:, :, :n], self.v[:, :, :n], self.pos[:n]


class KVCache:
    """KV for the layers this rank holds (a pipeline stage holds a slice, keyed by global index)."""

    def __init__(self, layer_ids, batch, n_kv_heads, head_dim, capacity, dtype, device):
        self.layers = {i: LayerKV(batch, n_kv_heads, head_dim, capacity, dtype, device) for i in layer_ids}
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
