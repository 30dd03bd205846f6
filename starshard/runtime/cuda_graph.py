"""Decode steps replayed from a CUDA graph.

A decode step of a small or mid-sized model is bound by the host: ~20 kernel launches per layer,
each 10-30 us of Python and dispatcher time, against a few microseconds of GPU work (measured on
SmolLM2-135M at 8K on one H200: 25 ms a step, 1.7 ms of it on the GPU). Capturing the whole
forward pass of one token once and replaying it removes that overhead.

What a replay must not bake in is handled on the device: the token, its position, the cache slot
it writes (index_copy_ at a device index) and the number of valid keys (read by the split-KV
kernel, decode.py `length=`). The cache's tensors must therefore not move: one graph serves one
KVCache whose capacity covers the whole generation (runtime/generate.py sizes it so). Sampling stays
outside the graph. A trimmed local layer (engine/kv_cache.py) is a fixed-capacity ring: its slot is the
oldest row once full and its valid length stays the capacity, so it never grows; layers that share a
(capacity, window) share one slot and one length tensor, filled on the host before each replay.

Sharded-KV decode (a CP group): every rank replays its own graph of the same step; each attends its
shard and the partials merge by lse over the group inside the graph (NCCL collectives are captured
like kernels), and only the query rank writes the new token's KV. Every rank of the group must
capture at the same step and replay the same number of times (ContextParallelRunner sees to it).
"""
from __future__ import annotations

import functools

import torch

from starshard.engine.kv_cache import KVCache, LayerKV
from starshard.kernels.decode import decode_attention
from starshard.parallel.context.group_merge import merge_over_group


class GraphDecoder:
    """One-token decode steps of `model` over `cache` (batch 1), captured on the first step.

    `capture=False` runs the same device-indexed step eagerly (what the graph records; the CPU
    tests check it against plain decode). `group`: the CP group whose ranks hold the other KV shards
    (partials merged by lse over it); `appends`: this rank stores the new token's KV (the query rank;
    always, without a group)."""

    def __init__(self, model, cache: KVCache, capture: bool = True, group=None, appends: bool = True):
        self.model, self.cache, self.capture = model, cache, capture
        self.group, self.appends = group, appends
        dev = cache.device
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        # Per group of layers whose rows move alike (same capacity and window): the cache row this step
        # writes and the valid keys after the write.
        self.groups: dict[tuple, tuple[torch.Tensor, torch.Tensor, LayerKV]] = {}
        self.group_of: dict[int, tuple] = {}
        for i, kv in cache.layers.items():
            key = (kv.capacity, kv.window)
            if key not in self.groups:
                self.groups[key] = (torch.zeros(1, dtype=torch.long, device=dev),
                                    torch.zeros(1, dtype=torch.int32, device=dev), kv)
            self.group_of[i] = key
        self.graph = None
        self.logits = None

    def fits(self) -> bool:
        """Another step fits without the cache growing (growth would move its tensors)."""
        # A trimmed layer's ring never grows; its capacity (hence the graph's shapes) is fixed.
        return not self.appends or all(kv.length < kv.capacity or kv.ring_full() for kv in self.cache.layers.values())

    def _attend(self, i: int, q, k, v, pos, cache=None, sparse=None, *, window=None, softcap=None,
                scale=None):  # decode is dense: sparse unused
        kv = self.cache.layer(i)
        slot, length, _ = self.groups[self.group_of[i]]
        if self.appends:
            kv.write_slot(slot, k, v, pos)
        # The whole preallocated cache (FP8: e4m3 with its scales); `length` says how much is valid. A
        # local layer's window masks the oldest keys by position (causal: the window needs it).
        out, lse = decode_attention(q, kv.k, kv.v, q_pos=pos, k_pos=kv.pos, causal=window is not None,
                                    length=length, k_scale=kv.k_scale, v_scale=kv.v_scale, window=window,
                                    softcap=softcap, scale=scale)
        if self.group is not None:
            out, _ = merge_over_group(out, lse, self.group)
        return out

    def _forward(self):
        m = self.model
        # cache=None: the hooks hold their layer's cache; nothing reads positions on the host.
        with m.attention_hooks([functools.partial(self._attend, i) for i in m.layer_ids]):
            return m(self.tok, positions=self.pos, cache=None, last_only=True)

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        """Run token [1, 1] at the cache's next position -> logits [1, 1, V] (valid until the next step)."""
        self.tok.copy_(tok.view(1, 1))
        self.pos.fill_(self.cache.next_position)
        for slot, length, kv in self.groups.values():
            slot.fill_(kv.next_row())
            length.fill_(kv.length + (self.appends and not kv.ring_full()))
        if not self.capture:
            self.logits = self._forward()
        elif self.graph is None:
            # Warm-up off the capture stream (Triton compiles, cuBLAS picks kernels): it runs this
            # step for real; the capture records it without running; the replay runs it again,
            # writing the same slot with the same values.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._forward()
            self.graph.replay()
        else:
            self.graph.replay()
        if self.appends:
            for kv in self.cache.layers.values():
                kv.wrote_one()
        self.cache.next_position += 1
        return self.logits
