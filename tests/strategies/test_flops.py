"""FLOP models of a prefill per CP rank (dense, ring, Star, APB) against counts worked out by hand on a
tiny shape, plus invariants: exact strategies cover the causal triangle once, APB's front rows match
the strategy's own segment layout, APB without compression or anchor does exactly the dense work."""
import pytest

from starshard.config import ModelConfig
from starshard.parallel.context.apb import APBAttention
from starshard.strategies.apb import apb_flops
from starshard.strategies.dense import dense_flops
from starshard.strategies.flops import causal_pairs, predicted_seconds, tp_flops
from starshard.strategies.ring import ring_flops
from starshard.strategies.star import star_flops

# hidden 4, 2 q heads / 1 kv head of dim 2, MLP 8, one layer, vocab 10:
# per token linear = 2 * (4*(4+2*2) + 4*4 + 3*4*8) = 288; per pair attention = 4*2*2 = 16; logits row = 2*4*10 = 80.
CFG = ModelConfig(arch="llama", vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=2)
TOK, PAIR, LOGITS = 288, 16, 80


def test_dense_by_hand():
    (f,) = dense_flops(CFG, 5, query_len=1)
    assert f.linear == 6 * TOK + LOGITS and f.attention == 21 * PAIR and f.total == 6 * TOK + LOGITS + 21 * PAIR


def test_ring_by_hand():
    # 8 tokens, cp 2 -> chunks of 2: rank 0 holds 0,1,6,7 (1+2+7+8 pairs), rank 1 holds 2..5 (3+4+5+6).
    r0, r1 = ring_flops(CFG, 7, 2, query_len=1)
    assert (r0.pairs, r1.pairs) == (18, 18) and (r0.tokens, r1.tokens) == (4, 4)
    assert r0.linear == 4 * TOK + LOGITS and r1.linear == 4 * TOK  # rank 0 holds the last token
    assert r0.comm_bytes == 1 * 2 * 4 * 1 * 2 * 2  # one step: k and v of its 4 rows, 1 kv head, dim 2, 2 bytes


def test_star_by_hand():
    # context 10, cp 2, block 3, anchor 2: rank 0 runs [0,3), then [3,6) against the anchor's stored keys [0,2);
    # rank 1 [0,2)+[6,9) and [0,2)+[9,10).
    r0, r1 = star_flops(CFG, 10, 2, block=3, anchor=2, query_len=1)
    assert (r0.tokens, r1.tokens) == (3 + 3, 5 + 3)
    assert r0.pairs == 6 + (3 * 2 + 6) + 1 * 6  # blocks, then the query row against 6 cached tokens
    assert r1.pairs == 15 + 6 + 1 * 4 + 1  # the query rank also sees the query itself
    assert r0.linear == (6 + 1) * TOK + LOGITS and r0.attention == r0.pairs * PAIR
    # rank 0 recomputing the anchor (--sparse, --fp8 attention): [0,2)+[3,6) causally
    r0, r1b = star_flops(CFG, 10, 2, block=3, anchor=2, query_len=1, anchor_stored=False)
    assert (r0.tokens, r0.pairs) == (3 + 5, 6 + 15 + 1 * 6) and r1b == r1


def test_apb_by_hand():
    # context 10, cp 2, anchor 3, passing 2, query 2: blocks [0,5) and [5,10).
    r0, r1 = apb_flops(CFG, 10, 2, anchor=3, passing=2, query_len=2)
    # rank 0: 2 score-only query rows (causal: 3 pairs) + block causal 15; query phase 2 rows x 5 keys.
    assert r0.detail["front"] == 2 and r0.pairs == 3 + 15 + 10
    assert r0.linear == (7 + 2) * TOK + LOGITS and r0.attention == 28 * PAIR
    assert r0.compressor == 2 * 2 * 2 * 2 * 5  # 2 query rows x 5 keys, QK^T over 2 heads of dim 2
    # rank 1: front = query 2 + anchor min(3, 5 - 2) = 5 rows; block rows see front 5 + passing 2 in full.
    assert (r1.detail["front"], r1.detail["block"], r1.detail["passing_in"]) == (5, 5, 2)
    assert r1.pairs == 15 + 15 + 5 * 7 + (2 * 5 + 3) and r1.compressor == 0
    assert r1.linear == (10 + 2) * TOK + LOGITS
    # all-gather: 1 kv head x 2 entries x (2*2 + 4 position elements) x 2 bytes, one layer.
    assert r0.comm_bytes == r1.comm_bytes == 1 * 2 * 8 * 2


@pytest.mark.parametrize("L,cp", [(101, 2), (101, 3), (64, 4), (96, 3), (9, 4)])
def test_ring_covers_the_causal_triangle_once(L, cp):
    ranks = ring_flops(CFG, L - 1, cp, query_len=1)
    assert sum(r.pairs for r in ranks) == causal_pairs(L) and sum(r.tokens for r in ranks) == L
    if L % (2 * cp) == 0:  # no padding: zigzag gives every rank the same causal work
        assert len({r.pairs for r in ranks}) == 1


@pytest.mark.parametrize("C,cp", [(67, 2), (67, 3), (90, 4)])
def test_apb_without_compression_or_anchor_is_the_dense_work(C, cp):
    ranks = apb_flops(CFG, C, cp, anchor=0, passing=C, query_len=0, embed_query=False)
    assert sum(r.pairs for r in ranks) == causal_pairs(C) and sum(r.tokens for r in ranks) == C
    assert all(r.compressor == 0 for r in ranks)


@pytest.mark.parametrize("C,Lq,cp,anchor,passing,embed", [(71, 12, 3, 6, 5, True), (67, 12, 4, 10, 5, True),
                                                          (13, 12, 4, 4, 2, True), (71, 12, 3, 6, 0, True),
                                                          (71, 12, 3, 6, 5, False), (71, 12, 3, 6, 100, True)])
def test_apb_front_rows_match_the_strategy_layout(C, Lq, cp, anchor, passing, embed):
    ranks = apb_flops(CFG, C, cp, anchor=anchor, passing=passing, query_len=Lq, embed_query=embed)
    for r in range(cp):
        s = APBAttention(anchor_size=anchor, passing_size=passing, embed_query=embed, prefix_len=0)
        s.cp, s.rank = cp, r  # segments() is pure bookkeeping
        (seg,) = s.segments(C + Lq, C)
        assert ranks[r].detail["front"] == seg.n_front
        assert ranks[r].tokens == len(seg.index)


def test_llama_8b_128k_cp4_apb_beats_ring_and_star():
    """The issue's operating point: at 128K, cp 4, anchor 4K, passing 2K the model gives ~1.5x ring."""
    from starshard.presets import preset_config

    cfg = preset_config("llama-3.1-8b")
    L = 128 * 1024
    apb = predicted_seconds(apb_flops(cfg, L, 4, 4096, 2048), 1e15)
    ring = predicted_seconds(ring_flops(cfg, L, 4), 1e15)
    star = predicted_seconds(star_flops(cfg, L, 4), 1e15)
    assert 1.4 < ring / apb < 1.8 and star > ring > apb
    # Attention running at half the matmul rate widens APB's lead (its attention share is smaller).
    assert predicted_seconds(ring_flops(cfg, L, 4), 1e15, 5e14) / predicted_seconds(apb_flops(cfg, L, 4, 4096, 2048),
                                                                                     1e15, 5e14) > ring / apb


def test_bad_arguments():
    with pytest.raises(ValueError, match="one context token per rank"):
        apb_flops(CFG, 3, 4, anchor=1, passing=1)
    with pytest.raises(ValueError, match=">= 0"):
        apb_flops(CFG, 30, 2, anchor=-1, passing=1)


def test_study_mode_time_adds_the_hosts_up():
    ranks = apb_flops(CFG, 10, 2, anchor=3, passing=2, query_len=2)
    one = [r.seconds(1e3) for r in ranks]
    assert predicted_seconds(ranks, 1e3) == max(one) and predicted_seconds(ranks, 1e3, serial=True) == sum(one)
    assert ranks[1].seconds(1e3, 5e2) == (ranks[1].linear + ranks[1].compressor) / 1e3 + ranks[1].attention / 5e2


def test_tp_by_hand():
    # tp=2 over dense's 6 tokens: half the FLOPs, two all-reduces of 6 rows x hidden 4 in 2 bytes on the one layer
    (d,) = dense_flops(CFG, 5, query_len=1)
    (f,) = tp_flops(CFG, [d], 2, dtype_bytes=2)
    assert f.linear == (6 * TOK + LOGITS) / 2 and f.attention == 21 * PAIR / 2 and f.tp_bytes == 2 * 1 * 6 * 4 * 2
    # read at 10 FLOP/s (GEMM), 5 FLOP/s (attention) and 8 bytes/s (all-reduce)
    want = (6 * TOK + LOGITS) / 2 / 10 + 21 * PAIR / 2 / 5 + 96 / 8
    assert f.seconds(10, 5, 8) == pytest.approx(want) == predicted_seconds([f], 10, 5, allreduce_bytes_per_s=8)
    assert f.seconds(10, 5) == pytest.approx(want - 96 / 8)  # no all-reduce rate: compute only
    assert tp_flops(CFG, [d], 1) == [d]
    # each Star rank runs its phase-1 rows (rank 0: 6, the anchor stored; rank 1: 8) and the query row through
    # every layer
    r0, r1 = tp_flops(CFG, star_flops(CFG, 10, 2, block=3, anchor=2, query_len=1), 2, dtype_bytes=4)
    assert (r0.tp_bytes, r1.tp_bytes) == (2 * 7 * 4 * 4, 2 * 9 * 4 * 4)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        tp_flops(CFG, [d], 0)
