"""Ring attention (exact): zigzag sequence shards, KV blocks passed around the CP group."""
from __future__ import annotations

import math

from starshard.config import ModelConfig
from starshard.partition import zigzag_rows
from starshard.strategies.flops import PrefillFlops, check_sizes, rank_flops
from starshard.strategies.spec import StrategySpec


def ring_flops(cfg: ModelConfig, context: int, cp: int, query_len: int = 1, kv_bytes: int = 2) -> list[PrefillFlops]:
    """Ring attention over the zigzag split (2cp chunks, rank r holds chunks r and 2cp-1-r, the end
    padded): exact causal work, balanced; each layer passes its KV shard cp-1 times."""
    check_sizes(context, cp, query_len)
    L = context + query_len
    chunk = -(-L // (2 * cp))
    out = []
    for r in range(cp):
        rows = [p for c in (r, 2 * cp - 1 - r) for p in range(c * chunk, (c + 1) * chunk) if p < L]
        pairs = sum(p + 1 for p in rows)  # a row at position p sees positions 0..p
        comm = (cp - 1) * 2 * cfg.num_kv_heads * cfg.head_dim * chunk * 2 * kv_bytes * cfg.num_layers
        out.append(rank_flops(cfg, len(rows), pairs, 1 if (L - 1) in rows else 0, comm_bytes=float(comm)))
    return out


class RingSpec(StrategySpec):
    name = "ring"
    sparse = False  # a ring step sees part of a row's keys: no pattern estimate over the whole range
    chunked_prefill = True
    windows = True
    ring_kv = True  # USP inherits it: its ring pass is ring attention's

    def kv_rows(self, lay, w):
        chunked = self.chunked_kv_rows(lay, w)  # --prefill-chunk: one chunk's shard per forward
        if chunked is not None:
            return chunked
        rows = 2 * math.ceil(w.prompt_tokens / (2 * lay.cp))  # zigzag: two chunks of ceil(L / 2cp) per rank
        # a send and a receive KV block of one layer in flight
        return rows + w.max_new_tokens, rows, 2 * rows

    def whole_rows(self, cp, prompt_len, context_len, options):
        return [zigzag_rows(prompt_len, cp, r) for r in range(cp)]

    def prefill_flops(self, cfg, prompt_len, context_len, strategy):
        return ring_flops(cfg, prompt_len, strategy.cp)


RING = RingSpec()
