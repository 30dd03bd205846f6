"""Positions the host already knows (common.mark_arange): the model marks the runs it makes with
torch.arange, and the layout questions asked per attention call (query_offset, mask_mode) are answered
from the mark instead of a device read (a host sync per call on a GPU). The answers must equal the
read ones on every layout; a marked tensor on the meta device (nothing to read) proves no read."""
import pytest
import torch

from starshard.kernels.attention import mask_mode
from starshard.kernels.common import arange_start, mark_arange, query_offset

CASES = [  # (q start, Lq, k start, Lk)
    (0, 40, 0, 40),     # square prefill
    (25, 15, 0, 40),    # tail block after its keys
    (40, 8, 0, 40),     # every key before every query
    (3, 10, 7, 30),     # query block starting before the first key
    (5, 20, 5, 20),
    (0, 20, 3, 20),
]


def marked(start, n):
    return mark_arange(torch.arange(start, start + n), start)


@pytest.mark.parametrize("case", CASES)
def test_marked_runs_answer_as_read(case):
    qs, lq, ks, lk = case
    qm, km = marked(qs, lq), marked(ks, lk)
    qr, kr = torch.arange(qs, qs + lq), torch.arange(ks, ks + lk)  # unmarked: read
    assert arange_start(qm) == qs and arange_start(qr) is None
    for causal in (True, False):
        assert mask_mode(qm, km, causal) == mask_mode(qr, kr, causal)
    try:
        want = query_offset(qr, kr, lq, lk)
    except ValueError as e:
        with pytest.raises(ValueError, match="start at or after the first key"):
            query_offset(qm, km, lq, lk)
        assert "start at or after the first key" in str(e)
    else:
        assert query_offset(qm, km, lq, lk) == want
    # one side marked: read as before
    assert mask_mode(qm, kr, True) == mask_mode(qr, kr, True)


def test_marked_answers_without_reading():
    q = mark_arange(torch.empty(16, dtype=torch.long, device="meta"), 100)
    k = mark_arange(torch.empty(116, dtype=torch.long, device="meta"), 0)
    assert query_offset(q, k, 16, 116) == 100
    assert mask_mode(q, k, True) == "masked" and mask_mode(k, k, True) == "causal"


def test_mark_goes_with_the_tensor():
    t = marked(7, 5)
    key = id(t)
    del t
    u = torch.arange(5)
    assert arange_start(u) is None or id(u) != key
    with pytest.raises(ValueError, match="1-D"):
        mark_arange(torch.arange(6).view(2, 3), 0)


def test_marked_increasing_answers_as_read():
    """Star's [anchor; block] (gaps, strictly increasing), given as both q_pos and k_pos: index-causal at
    offset 0, from the mark as from the read; a meta tensor (nothing to read) proves no read; only the
    marked tensor itself counts (an equal copy, or another k_pos, is read as before)."""
    from starshard.kernels.common import mark_increasing, square_increasing

    pos = torch.cat([torch.arange(8), torch.arange(40, 60)])
    read = (mask_mode(pos, pos, True), query_offset(pos, pos, 28, 28))
    m = mark_increasing(pos.clone())
    assert square_increasing(m, m) and not square_increasing(m, m.clone()) and not square_increasing(pos, pos)
    assert (mask_mode(m, m, True), query_offset(m, m, 28, 28)) == read == ("causal", 0)
    meta = mark_increasing(torch.empty(28, dtype=torch.long, device="meta"))
    assert mask_mode(meta, meta, True) == "causal" and query_offset(meta, meta, 28, 28) == 0
    assert mask_mode(meta, meta, False) == "full"
    with pytest.raises(ValueError, match="1-D"):
        mark_increasing(torch.arange(6).view(2, 3))


def test_star_marks_its_block_positions(tmp_path, monkeypatch):
    """Star's block calls get positions the host knows are increasing (checked once per segment): block 0's
    [anchor-free] call, and the later blocks' own keys beside the stored anchor (`attention_after_held`)."""
    import starshard.parallel.context.star as star_mod
    from tests.helpers.hf_models import make_hf_model
    from starshard.checkpoints.load import load_model
    from starshard.kernels.common import square_increasing
    from starshard.parallel.context.star import StarAttention
    from starshard.runtime.context_parallel import ContextParallelRunner

    _, path = make_hf_model("llama", tmp_path)
    model = load_model(path)
    seen = []
    real = star_mod.attention

    def spy(q, k, v, *, q_pos, k_pos, **kw):
        seen.append(square_increasing(q_pos, k_pos))
        return real(q, k, v, q_pos=q_pos, k_pos=k_pos, **kw)

    real_after = star_mod.attention_after_held
    after = []

    def spy_after(q, k, v, pos, held_k, held_v, held_pos, **kw):
        after.append(square_increasing(pos, pos))
        return real_after(q, k, v, pos, held_k, held_v, held_pos, **kw)

    monkeypatch.setattr(star_mod, "attention", spy)
    monkeypatch.setattr(star_mod, "attention_after_held", spy_after)
    runner = ContextParallelRunner(model, StarAttention(num_blocks=3, anchor_size=8))
    ids = torch.randint(0, 211, (70,), generator=torch.Generator().manual_seed(3))
    cache = runner.new_cache(71)
    with torch.no_grad():
        runner.prefill_logits(ids, 60, cache)
    n = model.config.num_layers
    assert len(seen) == n and len(after) == 2 * n and all(seen) and all(after)


def test_known_end_without_reading():
    """The positions' end (max + 1) where the host knows it: a marked run, an increasing tensor marked with its
    end, any tensor noted with one (mark_end); a meta tensor (nothing to read) proves no read; unmarked or marked
    without an end: None (read)."""
    from starshard.kernels.common import known_end, mark_end, mark_increasing, square_increasing

    assert known_end(mark_arange(torch.empty(16, dtype=torch.long, device="meta"), 100)) == 116
    assert known_end(mark_increasing(torch.empty(28, dtype=torch.long, device="meta"), 60)) == 60
    assert known_end(mark_increasing(torch.cat([torch.arange(8), torch.arange(40, 60)]))) is None
    assert known_end(torch.arange(5)) is None
    # notes add up: an end noted on an increasing tensor keeps it increasing; a run stays a run
    both = mark_end(mark_increasing(torch.empty(28, dtype=torch.long, device="meta")), 60)
    assert square_increasing(both, both) and known_end(both) == 60
    run = mark_increasing(mark_arange(torch.empty(16, dtype=torch.long, device="meta"), 100))
    assert arange_start(run) == 100 and known_end(run) == 116
    loose = mark_end(torch.empty(3, dtype=torch.long, device="meta"), 9)
    assert known_end(loose) == 9 and not square_increasing(loose, loose) and arange_start(loose) is None


def test_segment_to_notes_what_the_host_read():
    """Segment.to: the copy holds the same rows, and its positions are noted with their end (so the model's cache
    needs no device read) and, where they strictly increase, as increasing (so each attention call needs none)."""
    from starshard.kernels.common import known_end, square_increasing
    from starshard.parallel.context.base import Segment

    pos = torch.cat([torch.arange(8), torch.arange(40, 60)])
    seg = Segment(pos.clone(), pos, torch.arange(8, 28)).to("cpu")
    assert torch.equal(seg.positions, pos) and torch.equal(seg.cache_rows, torch.arange(8, 28))
    assert square_increasing(seg.positions, seg.positions) and known_end(seg.positions) == 60
    back = torch.tensor([3, 1, 2])
    other = Segment(back.clone(), back).to("cpu")
    assert not square_increasing(other.positions, other.positions) and known_end(other.positions) == 4


@pytest.mark.parametrize("strategy", ["star", "apb"])
def test_context_prefill_tells_the_cache_its_end(tmp_path, monkeypatch, strategy):
    """Every forward of a Star or APB prefill on one device (its blocks, then the query phase) gives the cache its
    end from the host (KVCache.advance's `end`), where it read max(positions) from the device after each forward
    (a sync per block). (An APB block whose embedded query follows a chat template's head has positions that do
    not increase: that one still reads its end.)"""
    from tests.helpers.hf_models import make_hf_model
    from starshard.checkpoints.load import load_model
    from starshard.engine.kv_cache import KVCache
    from starshard.parallel.context.apb import APBAttention
    from starshard.parallel.context.star import StarAttention
    from starshard.runtime.context_parallel import ContextParallelRunner

    _, path = make_hf_model("llama", tmp_path)
    model = load_model(path)
    ends = []
    real = KVCache.advance

    def spy(self, positions, end=None):
        ends.append((end, int(positions.max()) + 1))
        return real(self, positions, end)

    monkeypatch.setattr(KVCache, "advance", spy)
    s = StarAttention(num_blocks=3, anchor_size=8) if strategy == "star" else APBAttention(num_blocks=3)
    runner = ContextParallelRunner(model, s)
    ids = torch.randint(0, 211, (70,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        runner.prefill_logits(ids, 60, runner.new_cache(71))
    assert len(ends) == 4 and all(e is None or e == want for e, want in ends), ends  # 3 blocks, the query phase
    assert all(e is not None for e, _ in ends), ends
