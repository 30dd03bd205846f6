"""Dense: the whole prompt on one rank, the reference every other strategy is tested against."""
from __future__ import annotations

from starshard.config import ModelConfig
from starshard.strategies.flops import PrefillFlops, attention_flops, causal_pairs, rank_flops
from starshard.strategies.spec import StrategySpec


def dense_flops(cfg: ModelConfig, context: int, query_len: int = 1) -> list[PrefillFlops]:
    """One device, causal over the whole prompt (a local layer through its window)."""
    L = context + query_len
    f = rank_flops(cfg, L, causal_pairs(L), 1)  # pairs: a global layer's
    f.attention = attention_flops(cfg, L)
    return [f]


class DenseSpec(StrategySpec):
    name = "dense"
    single_rank = True
    fp8_attention = "on the dense path"
    chunked_prefill = True
    windows = True

    def kv_rows(self, lay, w):
        L, N = w.prompt_tokens, w.max_new_tokens
        chunk = w.prefill_chunk
        if chunk is None and lay.pp > 1:  # ParallelRunner.default_chunk: ~4 chunks per stage, >= 512 tokens
            chunk = max(512, -(-L // (4 * lay.pp)))
        return L + N, min(L, chunk or L), 0

    def whole_rows(self, cp, prompt_len, context_len, options):
        return [prompt_len]

    def prefill_flops(self, cfg, prompt_len, context_len, strategy):
        return dense_flops(cfg, prompt_len)


DENSE = DenseSpec()
