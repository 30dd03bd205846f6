"""The counting every strategy's FLOP model of one prefill per CP rank shares (each model sits in its
strategy's module: dense_flops, ring_flops, star_flops, apb_flops), so benchmarks can report measured
time against what the arithmetic predicts.

Counting (2 FLOPs per multiply-add):
    linear     per token and layer 2 * (h*(Hq + 2*Hkv)*D + Hq*D*h + 3*h*I)  (QKV, O, gated MLP),
               plus 2*h*V for every logits row the rank computes;
    attention  per visible (query row, key) pair and layer 4 * Hq * D  (QK^T and PV);
    compressor APB's query scorer: the embedded query's rows against the block's keys, 2 * Hq * D per
               pair and layer (QK^T only);
    tp         a tensor-parallel group splits a CP rank's linear and attention FLOPs evenly (heads, MLP
               columns, the vocab) and all-reduces 2 * layers * rows * hidden elements (after the O and
               down projections), which sit on the critical path (tp_flops).
Only visible pairs count (a causal block of n rows is n(n+1)/2 pairs): the model is the useful work,
which a kernel that skips masked tiles approaches. A local layer (window W) sees min(p + 1, W) keys
from position p: `window_pairs`; `attention_flops` sums the layers (the strategies' models below still
count every layer global, except dense).

Each model returns one `PrefillFlops` per rank (phase 1 and, for Star / APB, the query phase, whose
`query_len` tokens run on every rank against its own KV); the slowest rank sets the time. The prompt
is `context + query_len` tokens; exact strategies count the query as ordinary prompt tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from starshard.config import ModelConfig


@dataclass
class PrefillFlops:
    """One rank's prefill work. comm_bytes: what this rank sends over the CP group (all layers), assumed
    hidden; tp_bytes: what its tp group all-reduces (all layers; the tensor's bytes), not hidden."""

    linear: float = 0.0
    attention: float = 0.0
    compressor: float = 0.0
    comm_bytes: float = 0.0
    tp_bytes: float = 0.0
    tokens: int = 0  # rows run through the layers in phase 1 (anchor + block, or the shard)
    pairs: int = 0  # visible attention pairs per layer and head, phase 1 and query phase
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.compressor

    def seconds(self, matmul_flops_per_s: float, attention_flops_per_s: float | None = None,
                allreduce_bytes_per_s: float | None = None) -> float:
        """Predicted time at the given throughputs (attention defaults to the matmul rate); the tp
        all-reduces at `allreduce_bytes_per_s` (a tensor's bytes over its all-reduce's seconds), not
        counted without it."""
        attn = attention_flops_per_s or matmul_flops_per_s
        t = (self.linear + self.compressor) / matmul_flops_per_s + self.attention / attn
        return t + (self.tp_bytes / allreduce_bytes_per_s if allreduce_bytes_per_s and self.tp_bytes else 0.0)


def predicted_seconds(ranks: list[PrefillFlops], matmul_flops_per_s: float,
                      attention_flops_per_s: float | None = None, serial: bool = False,
                      allreduce_bytes_per_s: float | None = None) -> float:
    """The slowest rank's predicted time (CP collectives assumed hidden); serial: the ranks run one after
    another on one device (Star --num-blocks / APB --apb-hosts study mode), so their times add up.
    (In study mode every host runs the query phase once in a single call; the sum counts it per host,
    a small overestimate for short queries.)"""
    times = [r.seconds(matmul_flops_per_s, attention_flops_per_s, allreduce_bytes_per_s) for r in ranks]
    return sum(times) if serial else max(times)


def linear_flops_per_token(cfg: ModelConfig) -> float:
    """All layers' linear FLOPs for one token (no logits)."""
    h = cfg.hidden_size
    attn = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    # MoE layers: the router and the token's k experts; dense layers: the MLP
    moe = h * cfg.num_experts + 3 * h * cfg.num_experts_per_tok * cfg.moe_intermediate_size
    mlp = sum(moe if cfg.is_moe_layer(i) else 3 * h * cfg.intermediate_size for i in range(cfg.num_layers))
    return 2.0 * (attn * cfg.num_layers + mlp)


def attention_flops_per_pair(cfg: ModelConfig) -> float:
    """All layers' attention FLOPs for one visible (query row, key) pair over all query heads."""
    return 4.0 * cfg.num_heads * cfg.head_dim * cfg.num_layers


def prefill_knee(cfg: ModelConfig) -> int | None:
    """Held tokens at which a prompt token's attention FLOPs (over the global-attention layers: a local
    layer's window does not grow with the prefix) equal its linear FLOPs: the knee of the tapered prefill
    schedule (partition.prefill_steps). None for a model without a global layer (no step grows)."""
    glob = sum(cfg.layer_window(i) is None for i in range(cfg.num_layers))
    if glob == 0:
        return None
    return round(linear_flops_per_token(cfg) / (attention_flops_per_pair(cfg) * glob / cfg.num_layers))


def tp_flops(cfg: ModelConfig, ranks: list[PrefillFlops], tp: int, dtype_bytes: int = 2) -> list[PrefillFlops]:
    """One tp rank of each CP rank's work (the Megatron split): linear, attention and compressor FLOPs
    over tp, plus the two all-reduces per layer of the rows it runs (`tokens`: phase 1 and the query
    phase) x hidden in the compute dtype (--fp8 linear's GEMMs still return it). tp=1: `ranks` as given."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if tp == 1:
        return ranks
    out = []
    for r in ranks:
        rows = r.tokens + r.detail.get("query_rows", 0)
        out.append(PrefillFlops(linear=r.linear / tp, attention=r.attention / tp, compressor=r.compressor / tp,
                                comm_bytes=r.comm_bytes / tp,  # each tp rank sends its heads' K/V
                                tp_bytes=2.0 * cfg.num_layers * rows * cfg.hidden_size * dtype_bytes,
                                tokens=r.tokens, pairs=r.pairs, detail={**r.detail, "tp": tp}))
    return out


def causal_pairs(n: int) -> int:
    return n * (n + 1) // 2


def window_pairs(n: int, window: int | None) -> int:
    """Visible (query, key) pairs of a causal prefill of n rows from position 0 through a window of W keys
    (a query at p sees (p - W, p]): sum over p of min(p + 1, W). None: every earlier key (causal_pairs)."""
    if window is None or n <= window:
        return causal_pairs(n)
    return causal_pairs(window) + (n - window) * window


def attention_flops(cfg: ModelConfig, n: int, windows: bool = True) -> float:
    """All layers' attention FLOPs of a causal prefill of n rows from position 0: each layer's visible
    pairs (its window's, when `windows`; else every layer global) at 4 * Hq * D per pair."""
    per_pair = 4.0 * cfg.num_heads * cfg.head_dim
    return per_pair * sum(window_pairs(n, cfg.layer_window(i) if windows else None) for i in range(cfg.num_layers))


def prefill_flops(cfg: ModelConfig, n: int, windows: bool = True, logits_rows: int = 1) -> dict[str, float]:
    """Model FLOPs of a causal prefill of n tokens on one device (logits for `logits_rows` rows): linear,
    attention (windowed, or every layer global with windows=False) and their total."""
    linear = n * linear_flops_per_token(cfg) + logits_rows * 2.0 * cfg.hidden_size * cfg.vocab_size
    attn = attention_flops(cfg, n, windows)
    return {"linear": float(linear), "attention": float(attn), "total": float(linear + attn)}


def check_sizes(context: int, cp: int, query_len: int) -> None:
    if cp < 1 or context < cp:
        raise ValueError(f"need cp >= 1 and at least one context token per rank, got context {context}, cp {cp}")
    if query_len < 0:
        raise ValueError(f"query_len must be >= 0, got {query_len}")


def rank_flops(cfg: ModelConfig, tokens: int, pairs: int, logits_rows: int, **kw) -> PrefillFlops:
    lin = tokens * linear_flops_per_token(cfg) + logits_rows * 2.0 * cfg.hidden_size * cfg.vocab_size
    return PrefillFlops(linear=lin, attention=pairs * attention_flops_per_pair(cfg), tokens=tokens, pairs=pairs, **kw)


def add_query_phase(cfg: ModelConfig, r: PrefillFlops, query_len: int, local_kv: int, is_query_rank: bool) -> None:
    """Star / APB phase 2 on one rank: the query's rows against its local KV (+ themselves causally on
    the query rank), logits of the last row on every rank (the lse merge needs no more)."""
    if query_len == 0:
        return
    pairs = query_len * local_kv + (causal_pairs(query_len) if is_query_rank else 0)
    q = rank_flops(cfg, query_len, pairs, 1)
    r.detail["query_rows"] = query_len  # run through the layers on top of `tokens`
    r.linear += q.linear
    r.attention += q.attention
    r.pairs += pairs
    r.detail["query_phase_pairs"] = pairs
