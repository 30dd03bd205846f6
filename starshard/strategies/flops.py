"""FLOP models of one prefill per CP rank, for dense, ring, Star and APB, so benchmarks can report
measured time against what the arithmetic predicts.

Counting (2 FLOPs per multiply-add):
    linear     per token and layer 2 * (h*(Hq + 2*Hkv)*D + Hq*D*h + 3*h*I)  (QKV, O, gated MLP),
               plus 2*h*V for every logits row the rank computes;
    attention  per visible (query row, key) pair and layer 4 * Hq * D  (QK^T and PV);
    compressor APB's query scorer: the embedded query's rows against the block's keys, 2 * Hq * D per
               pair and layer (QK^T only).
Only visible pairs count (a causal block of n rows is n(n+1)/2 pairs): the model is the useful work,
which a kernel that skips masked tiles approaches.

Each model returns one `PrefillFlops` per rank (phase 1 and, for Star / APB, the query phase, whose
`query_len` tokens run on every rank against its own KV); the slowest rank sets the time. The prompt
is `context + query_len` tokens; exact strategies count the query as ordinary prompt tokens.

APB per rank h (block n_h = context * (h+1) // cp - context * h // cp, block start s_h):
    front rows  F_h = Lq + min(anchor, s_h - Lq) (embedded query + anchor context), rank 0: Lq
                score-only query rows when its block is compressed with the query, else 0;
    linear      (F_h + n_h) tokens;
    attention   F_h(F_h+1)/2 (front, causal) + n_h(n_h+1)/2 (block, causal)
                + n_h * (F_h + sum_{j<h} min(passing, n_j)) (anchor and passing blocks, full);
    all-gather  per layer every rank sends Hkv x max_j min(passing, n_j) x (2D + 8/bytes) elements.
The block term is quadratic in context/cp; anchor and passing add only linear terms.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from starshard.config import ModelConfig
from starshard.layout import apb_bounds, star_blocks


@dataclass
class PrefillFlops:
    """One rank's prefill work. comm_bytes: what this rank sends over the CP group (all layers)."""

    linear: float = 0.0
    attention: float = 0.0
    compressor: float = 0.0
    comm_bytes: float = 0.0
    tokens: int = 0  # rows run through the layers in phase 1 (anchor + block, or the shard)
    pairs: int = 0  # visible attention pairs per layer and head, phase 1 and query phase
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.compressor

    def seconds(self, matmul_flops_per_s: float, attention_flops_per_s: float | None = None) -> float:
        """Predicted compute time at the given throughputs (attention defaults to the matmul rate)."""
        attn = attention_flops_per_s or matmul_flops_per_s
        return (self.linear + self.compressor) / matmul_flops_per_s + self.attention / attn


def predicted_seconds(ranks: list[PrefillFlops], matmul_flops_per_s: float,
                      attention_flops_per_s: float | None = None, serial: bool = False) -> float:
    """The slowest rank's predicted time (collectives assumed hidden); serial: the ranks run one after
    another on one device (Star --num-blocks / APB --apb-hosts study mode), so their times add up.
    (In study mode every host runs the query phase once in a single call; the sum counts it per host,
    a small overestimate for short queries.)"""
    times = [r.seconds(matmul_flops_per_s, attention_flops_per_s) for r in ranks]
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


def causal_pairs(n: int) -> int:
    return n * (n + 1) // 2


def _check(context: int, cp: int, query_len: int) -> None:
    if cp < 1 or context < cp:
        raise ValueError(f"need cp >= 1 and at least one context token per rank, got context {context}, cp {cp}")
    if query_len < 0:
        raise ValueError(f"query_len must be >= 0, got {query_len}")


def _rank(cfg: ModelConfig, tokens: int, pairs: int, logits_rows: int, **kw) -> PrefillFlops:
    lin = tokens * linear_flops_per_token(cfg) + logits_rows * 2.0 * cfg.hidden_size * cfg.vocab_size
    return PrefillFlops(linear=lin, attention=pairs * attention_flops_per_pair(cfg), tokens=tokens, pairs=pairs, **kw)


def _query_phase(cfg: ModelConfig, r: PrefillFlops, query_len: int, local_kv: int, is_query_rank: bool) -> None:
    """Star / APB phase 2 on one rank: the query's rows against its local KV (+ themselves causally on
    the query rank), logits of the last row on every rank (the lse merge needs no more)."""
    if query_len == 0:
        return
    pairs = query_len * local_kv + (causal_pairs(query_len) if is_query_rank else 0)
    q = _rank(cfg, query_len, pairs, 1)
    r.linear += q.linear
    r.attention += q.attention
    r.pairs += pairs
    r.detail["query_phase_pairs"] = pairs


def dense_flops(cfg: ModelConfig, context: int, query_len: int = 1) -> list[PrefillFlops]:
    """One device, causal over the whole prompt."""
    L = context + query_len
    return [_rank(cfg, L, causal_pairs(L), 1)]


def ring_flops(cfg: ModelConfig, context: int, cp: int, query_len: int = 1, kv_bytes: int = 2) -> list[PrefillFlops]:
    """Ring attention over the zigzag split (2cp chunks, rank r holds chunks r and 2cp-1-r, the end
    padded): exact causal work, balanced; each layer passes its KV shard cp-1 times."""
    _check(context, cp, query_len)
    L = context + query_len
    chunk = -(-L // (2 * cp))
    out = []
    for r in range(cp):
        rows = [p for c in (r, 2 * cp - 1 - r) for p in range(c * chunk, (c + 1) * chunk) if p < L]
        pairs = sum(p + 1 for p in rows)  # a row at position p sees positions 0..p
        comm = (cp - 1) * 2 * cfg.num_kv_heads * cfg.head_dim * chunk * 2 * kv_bytes * cfg.num_layers
        out.append(_rank(cfg, len(rows), pairs, 1 if (L - 1) in rows else 0, comm_bytes=float(comm)))
    return out


def star_flops(cfg: ModelConfig, context: int, cp: int, block: int | None = None, anchor: int | None = None,
               query_len: int = 1) -> list[PrefillFlops]:
    """Star Attention: each block runs [anchor; block] causally (the first block has no anchor), then
    the query phase. Defaults as StarAttention: block = ceil(context / cp), anchor = block."""
    _check(context, cp, query_len)
    block = block or -(-context // cp)
    anchor = block if anchor is None else anchor
    out = []
    for r, blocks in enumerate(star_blocks(context, block, cp)):
        tokens = pairs = held = 0
        for s, e in blocks:
            n = min(anchor, s) + e - s
            tokens, pairs, held = tokens + n, pairs + causal_pairs(n), held + e - s
        f = _rank(cfg, tokens, pairs, 0, detail={"blocks": blocks})
        _query_phase(cfg, f, query_len, held, r == cp - 1)
        out.append(f)
    return out


def apb_flops(cfg: ModelConfig, context: int, cp: int, anchor: int, passing: int, query_len: int = 1,
              embed_query: bool = True, query_compressor: bool = True, kv_bytes: int = 2) -> list[PrefillFlops]:
    """APB (see the module docstring): anchor / passing as given (0 = ablated); query_compressor:
    the training-free scorer (its QK^T counted, rank 0 runs the score-only query rows)."""
    _check(context, cp, query_len)
    if anchor < 0 or passing < 0:
        raise ValueError(f"anchor and passing must be >= 0, got {anchor}, {passing}")
    b = apb_bounds(context, cp)
    n = [b[r + 1] - b[r] for r in range(cp)]
    q_e = query_len if embed_query and cp > 1 else 0
    # A host passes nothing the next host's anchor holds (context [0, anchor end)); prefix ignored.
    a_next = [max(0, min(anchor, b[r + 1] - q_e)) if r + 1 < cp else 0 for r in range(cp)]
    m = [min(passing, b[r + 1] - min(max(b[r], a_next[r]), b[r + 1])) for r in range(cp)] if cp > 1 else [0] * cp
    w = 8 // kv_bytes
    sent = cfg.num_kv_heads * max(m) * (2 * cfg.head_dim + w) * kv_bytes * cfg.num_layers if passing and cp > 1 else 0
    out = []
    for r in range(cp):
        if r == 0:
            front = q_e if query_compressor and 0 < passing < n[0] else 0
            extra = 0  # the score-only rows are seen by no block row
        else:
            front = q_e + max(0, min(anchor, b[r] - q_e))
            extra = front + sum(m[:r])
        pairs = causal_pairs(front) + causal_pairs(n[r]) + n[r] * extra
        f = _rank(cfg, front + n[r], pairs, 0, comm_bytes=float(sent),
                  detail={"front": front, "block": n[r], "passing_in": sum(m[:r])})
        if query_compressor and q_e and r < cp - 1 and 0 < m[r] < n[r]:
            f.compressor = 2.0 * cfg.num_heads * cfg.head_dim * q_e * n[r] * cfg.num_layers
        _query_phase(cfg, f, query_len, n[r], r == cp - 1)
        out.append(f)
    return out
