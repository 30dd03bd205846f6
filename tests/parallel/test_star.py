"""Star Attention against dense (block covers the context) and against an independent masked-dense
reference of the same approximation."""
import functools

import pytest
import torch

from tests.helpers.hf_models import make_hf_model
from tests.helpers.masked_reference import run_masked, star_unrolled
from starshard.checkpoints.load import load_model
from starshard.runtime.context_parallel import ContextParallelRunner
from starshard.partition import star_blocks
from starshard.parallel.context.star import StarAttention


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _, path = make_hf_model("llama", tmp_path_factory.mktemp("star"))
    return load_model(path)


def star_logits(model, ids, context_len, kv_fp8=False, **kw):
    runner = ContextParallelRunner(model, StarAttention(**kw), kv_fp8=kv_fp8)
    cache = runner.new_cache(len(ids) + 4)
    with torch.no_grad():
        logits, _ = runner.prefill_logits(ids, context_len, cache)
    return logits[0, -1], cache


def test_blocks_cover_context_once():
    for C, b, cp in [(100, 30, 2), (7, 3, 4), (64, 8, 3), (5, 10, 2)]:
        got = [blk for rank in star_blocks(C, b, cp) for blk in rank]
        assert got == [(s, min(C, s + b)) for s in range(0, C, b)]


@pytest.mark.parametrize("block", [None, 61, 1000])
def test_block_covering_context_equals_dense(model, block):
    ids = torch.randint(0, 211, (61 + 7,), generator=torch.Generator().manual_seed(0))
    got, _ = star_logits(model, ids, 61, block_size=block)
    with torch.no_grad():
        ref = model(ids[None])[0, -1]
    assert ((got - ref).norm() / ref.norm()).item() <= 1e-5


@pytest.mark.parametrize("block,anchor", [(16, 16), (13, 5), (20, 40), (9, 1)])
def test_equals_masked_reference(model, block, anchor):
    L, C = 83, 71  # odd lengths, last block partial
    ids = torch.randint(0, 211, (L,), generator=torch.Generator().manual_seed(1))
    got, cache = star_logits(model, ids, C, block_size=block, anchor_size=anchor)
    index, pos, visible = star_unrolled(L, C, block, anchor)
    ref = run_masked(model, ids[index], pos, visible)[-1]
    assert ((got - ref).norm() / ref.norm()).item() <= 1e-5
    # The cache holds each context token once (anchors discarded) plus the query.
    assert sorted(cache.layer(0).view()[2].tolist()) == list(range(L))


def test_star_differs_from_dense_when_blocks_are_small(model):
    """Guards the reference itself: with small blocks Star is an approximation, not dense."""
    ids = torch.randint(0, 211, (80,), generator=torch.Generator().manual_seed(2))
    got, _ = star_logits(model, ids, 70, block_size=10, anchor_size=2)
    with torch.no_grad():
        ref = model(ids[None])[0, -1]
    assert ((got - ref).norm() / ref.norm()).item() > 1e-3


def test_bad_sizes_refused():
    with pytest.raises(ValueError, match="--block-size must be >= 1"):
        StarAttention(block_size=0)
    with pytest.raises(ValueError, match="--block-size or --num-blocks, not both"):
        StarAttention(block_size=8, num_blocks=2)


@pytest.mark.parametrize("num_blocks,anchor", [(3, None), (4, 5)])
def test_num_blocks_is_block_size_from_the_context(model, num_blocks, anchor):
    """--num-blocks N on one rank = the block size N hosts get (ceil(context / N)); not dense."""
    L, C = 77, 66
    ids = torch.randint(0, 211, (L,), generator=torch.Generator().manual_seed(num_blocks))
    got, _ = star_logits(model, ids, C, num_blocks=num_blocks, anchor_size=anchor)
    want, _ = star_logits(model, ids, C, block_size=-(-C // num_blocks), anchor_size=anchor)
    dense, _ = star_logits(model, ids, C, block_size=C)
    assert torch.equal(got, want)
    assert ((got - dense).norm() / dense.norm()).item() > 1e-4


@pytest.mark.parametrize("cp,block,anchor", [(2, 16, 16), (3, 11, 7), (4, 9, 9), (2, 7, 3)])
def test_multi_rank_equals_single_rank(tmp_path, cp, block, anchor):
    """Star over cp ranks (several blocks per rank) = Star on one rank with the same blocks: same
    last-token logits and greedy tokens; the union of caches holds every token once; only the
    query rank's cache grows in decode."""
    from tests.helpers.cp_ranks import strategy_rank
    from tests.helpers.mp_harness import run_ranks

    _, path = make_hf_model("llama", tmp_path)
    model = load_model(path)
    L, C, steps = 77, 66, 6
    ids = torch.randint(0, 211, (L,), generator=torch.Generator().manual_seed(cp))
    ref_logits, _ = star_logits(model, ids, C, block_size=block, anchor_size=anchor)
    index, pos, visible = star_unrolled(L, C, block, anchor)
    ref_tokens = []  # greedy decode on the unrolled masked reference
    seq_ids, seq_pos, vis = ids[index], pos, visible
    for step in range(steps):
        tok = int(run_masked(model, seq_ids, seq_pos, vis)[-1].argmax())
        ref_tokens.append(tok)
        n = vis.shape[0]
        grown = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        grown[:n, :n] = vis
        grown[n] = torch.cat([vis[-1], torch.tensor([True])])  # new token sees what the last query row saw + itself
        seq_ids, seq_pos, vis = torch.cat([seq_ids, torch.tensor([tok])]), torch.cat([seq_pos, torch.tensor([L + step])]), grown
    make = functools.partial(StarAttention, block_size=block, anchor_size=anchor)
    results = run_ranks(strategy_rank, cp, path, ids, C, make, steps)
    for r in results:
        assert ((r["logits"] - ref_logits).norm() / ref_logits.norm()).item() <= 1e-5
        assert r["tokens"] == ref_tokens
    assert sum(r["after_prefill"] for r in results) == L  # context once (anchors dropped) + query on one rank
    growth = [r["final"] - r["after_prefill"] for r in results]
    assert growth == [0] * (cp - 1) + [steps - 1]


def _tokens_run(model, **kw):
    """Prompt tokens rank 0 of one device runs through the model in Star's prefill of context 66 of 77."""
    strategy = ContextParallelRunner(model, StarAttention(**kw)).strategy
    return sum(len(seg.index) for seg in strategy.segments(77, 66))


def test_rank_zero_runs_its_later_blocks_without_the_anchor(model, monkeypatch):
    """The anchor's K/V are block 0's first rows: rank 0 reads them stored instead of recomputing them, unless a
    call needs the square [anchor; block] (a sparse method, 8-bit scores)."""
    assert _tokens_run(model, block_size=16, anchor_size=16) == 66
    recomputed = 66 + 16 * 4  # blocks at 16, 32, 48, 64 each behind the 16-token anchor
    monkeypatch.setattr(StarAttention, "int8_scores", True)
    assert _tokens_run(model, block_size=16, anchor_size=16) == recomputed
    monkeypatch.setattr(StarAttention, "int8_scores", False)
    monkeypatch.setattr(model.layers[1].attention, "sparse", object(), raising=False)
    assert _tokens_run(model, block_size=16, anchor_size=16) == recomputed


@pytest.mark.parametrize("arch,overrides,block,anchor", [
    ("llama", {}, 16, 16), ("llama", {}, 13, 5), ("llama", {}, 20, 40),
    ("qwen2", {}, 9, 9),  # q / k / v biases: the keys stored minus their offset, as computed
    ("gemma2", dict(sliding_window=12, query_pre_attn_scalar=10, attn_logit_softcapping=2.0,
                    final_logit_softcapping=3.0), 20, 4),  # local layers: the stored keys in the window
])
def test_the_stored_anchor_gives_the_recomputed_anchors_logits(tmp_path, monkeypatch, arch, overrides, block, anchor):
    _, path = make_hf_model(arch, tmp_path, **overrides)
    model = load_model(path)
    ids = torch.randint(0, 211, (83,), generator=torch.Generator().manual_seed(3))
    got, cache = star_logits(model, ids, 71, block_size=block, anchor_size=anchor)
    monkeypatch.setattr(StarAttention, "anchor_stored", lambda self: False)
    want, want_cache = star_logits(model, ids, 71, block_size=block, anchor_size=anchor)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5
    k, v, pos = cache.layer(0).view()
    wk, wv, wpos = want_cache.layer(0).view()
    assert torch.equal(pos, wpos) and torch.allclose(k, wk, atol=1e-5) and torch.allclose(v, wv, atol=1e-5)


def test_the_stored_anchor_under_fp8_kv_is_read_as_stored(model, monkeypatch):
    """--fp8 kv: the later blocks read the anchor in e4m3 (with its scales), as decode reads every key; the
    recomputed anchor is attended as computed. They differ by e4m3's rounding, as FP8 KV differs from bf16."""
    ids = torch.randint(0, 211, (83,), generator=torch.Generator().manual_seed(4))
    got, _ = star_logits(model, ids, 71, kv_fp8=True, block_size=16, anchor_size=16)
    unquantized, _ = star_logits(model, ids, 71, block_size=16, anchor_size=16)
    monkeypatch.setattr(StarAttention, "anchor_stored", lambda self: False)
    want, _ = star_logits(model, ids, 71, kv_fp8=True, block_size=16, anchor_size=16)
    fp8_error = ((want - unquantized).norm() / unquantized.norm()).item()
    assert 0 < ((got - want).norm() / want.norm()).item() <= max(2 * fp8_error, 1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused CUDA kernels need a GPU")
def test_the_stored_anchor_on_cuda_in_bf16(tmp_path, monkeypatch):
    """The GPU path (fused kernels, the anchor's held part unmasked, the block square causal): bf16 against the
    recomputed anchor, within bf16's rounding."""
    _, path = make_hf_model("llama", tmp_path)
    model = load_model(path, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 211, (300,), generator=torch.Generator().manual_seed(6)).cuda()
    got, _ = star_logits(model, ids, 290, num_blocks=4)
    monkeypatch.setattr(StarAttention, "anchor_stored", lambda self: False)
    want, _ = star_logits(model, ids, 290, num_blocks=4)
    assert torch.isfinite(got).all() and ((got.float() - want.float()).norm() / want.float().norm()).item() <= 2e-2
