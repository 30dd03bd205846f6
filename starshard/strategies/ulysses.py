"""Ulysses (exact): contiguous sequence shards, all-to-alls to head shards of the whole sequence."""
from __future__ import annotations

import math

from starshard.partition import contiguous_rows
from starshard.strategies.ring import ring_flops
from starshard.strategies.spec import StrategySpec


def valid_cp_sizes(num_heads: int, limit: int | None = None) -> list[int]:
    return [c for c in range(1, (limit or num_heads) + 1) if num_heads % c == 0]


def check_ulysses_heads(hq: int, hkv: int, cp: int) -> None:
    if hq % cp:
        raise ValueError(
            f"Ulysses needs the query heads (per tensor-parallel rank), {hq}, divisible by cp={cp}; "
            f"valid cp sizes: {valid_cp_sizes(hq)} (or use ring attention)"
        )
    if hkv < 1 or hq % hkv:
        raise ValueError(f"GQA needs query heads divisible by KV heads, got Hq={hq} Hkv={hkv}")


class UlyssesSpec(StrategySpec):
    name = "ulysses"
    fp8_attention = "in Ulysses"
    chunked_prefill = True
    windows = True

    def check_heads(self, heads, kv_heads, cp, options):
        if cp > 1:
            check_ulysses_heads(heads, kv_heads, cp)

    def kv_rows(self, lay, w):
        chunked = self.chunked_kv_rows(lay, w)  # --prefill-chunk: one chunk's shard per forward
        if chunked is not None:
            return chunked
        rows = math.ceil(w.prompt_tokens / lay.cp)
        return rows + w.max_new_tokens, rows, 0  # the all-to-all buffers: activation_elements

    def whole_rows(self, cp, prompt_len, context_len, options):
        return [contiguous_rows(prompt_len, cp, r) for r in range(cp)]

    def activation_elements(self, rows, heads, kv_heads, head_dim):
        return rows * ((heads + 2 * kv_heads) * head_dim + heads * head_dim)  # full-sequence q, k, v, out for heads / cp

    def prefill_flops(self, cfg, prompt_len, context_len, strategy):
        return ring_flops(cfg, prompt_len, strategy.cp)  # exact strategies split the same work evenly


ULYSSES = UlyssesSpec()
