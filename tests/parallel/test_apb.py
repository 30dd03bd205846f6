"""APB: exact when nothing is compressed or anchored, equal to an independent masked-dense reference
of the same selection otherwise, cp in {2, 3, 4} and odd lengths; the per-layer AllGather moves only
passing-size x KV-heads x (2 head-dim + a position) per rank; compressors and layouts unit-tested.

All multi-rank cases run in ONE spawn of 4 gloo ranks (sub-groups of 2 and 3 ranks for cp = 2, 3):
starting processes dominates the run time on 2 cores."""
import pytest
import torch

from tests.helpers.hf_models import make_hf_model
from tests.helpers.masked_reference import apb_unrolled, run_masked_layers
from starshard.checkpoints.load import load_model
from starshard.partition import apb_bounds, apb_default_sizes
from starshard.parallel.context.apb import (
    APBAttention,
    Compressor,
    QueryCompressor,
    RandomCompressor,
    RetainingHeads,
    ScoreInput,
    _rotate,
)
from starshard.runtime.context_parallel import ContextParallelRunner

STEPS = 4


class FixedScores(Compressor):
    """Scores from (layer, KV head, position) only: the selection is known without running the model.
    Declares uses_query so rank 0 runs the embedded query's score-only rows (their isolation is tested)."""

    name = "fixed"
    uses_query = True

    def score(self, inp):
        B, Hkv = inp.k.shape[:2]
        return fixed_scores(inp.layer, Hkv, inp.pos)[None].expand(B, -1, -1)


def fixed_scores(layer, n_heads, pos):
    h = torch.arange(n_heads)[:, None]
    return ((pos.cpu()[None, :] * 7919 + h * 104729 + layer * 1299709) % 1000003).float().to(pos.device)


def fixed_selection(passing, skip_below=lambda rank: 0):
    """The fixed compressor's picks; `skip_below(rank)`: the next rank's anchor ends there, so those
    positions are never passed (no key is seen twice)."""
    def selected(layer, head, rank, block):
        pos = torch.tensor([t for t in block if t >= skip_below(rank)], dtype=torch.long)
        m = min(passing, len(block))
        keep = fixed_scores(layer, head + 1, pos)[head].topk(m).indices
        return pos[keep].tolist()

    return selected


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    _, path = make_hf_model("llama", tmp_path_factory.mktemp("apb"))
    return path


@pytest.fixture(scope="module")
def model(model_path):
    return load_model(model_path)


def apb_run(model, ids, context_len, steps=0, **kw):
    """Single process (cp = 1): query-phase logits of the last token, greedy tokens, the cache."""
    runner = ContextParallelRunner(model, APBAttention(**kw).bind(model))
    cache = runner.new_cache(len(ids) + steps + 1)
    with torch.no_grad():
        logits, _ = runner.prefill_logits(ids, context_len, cache)
    return logits[0, -1], cache


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------------------------------------
# Single process
# ---------------------------------------------------------------------------------------------


def test_default_sizes_follow_paper_table():
    # Table 5 (8 hosts): 32K -> block 4K, anchor 1K, passing 0.5K; 128K -> 4K / 2K; 512K -> 8K / 8K.
    assert apb_default_sizes(4096) == (1024, 512)
    assert apb_default_sizes(16384) == (4096, 2048)
    assert apb_default_sizes(65536) == (8192, 8192)
    assert apb_default_sizes(20) == (20, 20)  # short blocks: floors keep a usable anchor / passing
    assert apb_default_sizes(400) == (100, 50)


def test_bounds_split_evenly():
    for C, cp in [(67, 2), (67, 3), (10, 4), (4, 4)]:
        b = apb_bounds(C, cp)
        sizes = [b[r + 1] - b[r] for r in range(cp)]
        assert b[0] == 0 and b[-1] == C and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def layout(cp, rank, L, C, **kw):
    s = APBAttention(**kw)
    s.cp, s.rank = cp, rank  # segments() is pure bookkeeping: no collective runs
    (seg,) = s.segments(L, C)
    return seg


def test_segment_layout_positions_and_cache_rows():
    L, C, cp = 83, 71, 3
    b = apb_bounds(C, cp)
    for r in range(cp):
        seg = layout(cp, r, L, C, anchor_size=6, passing_size=5, prefix_len=3)
        s, e = b[r], b[r + 1]
        cached = seg.index[seg.cache_rows]
        assert cached.tolist() == list(range(s, e))  # the block only: no anchor, no embedded query
        assert seg.positions[seg.cache_rows].tolist() == list(range(s, e))
        assert seg.positions[seg.n_front :].tolist() == list(range(s, e))  # attend marks this run on the host
        front, fpos = seg.index[: seg.n_front], seg.positions[: seg.n_front]
        if r == 0:  # score-only query rows, positions right after the template head
            assert seg.score_only and front.tolist() == list(range(C, L))
            assert fpos.tolist() == list(range(3, 3 + L - C))
        else:  # [head; query; anchor context] at the starting positions, before the block
            assert front.tolist() == [0, 1, 2] + list(range(C, L)) + [3, 4, 5]
            assert fpos.tolist() == list(range(len(front))) and int(fpos.max()) < s
            r0, r1 = seg.query_rows
            assert front[r0:r1].tolist() == list(range(C, L)) and seg.query_shift == C - 3
    # The anchor shrinks rather than reach the block's positions (query 12 tokens, block start 17).
    seg = layout(4, 1, 79, 67, anchor_size=10, passing_size=5)
    assert seg.n_front == 16 and int(seg.positions[: seg.n_front].max()) < 16
    # Ablations: no anchor and no query -> the block alone; no passing -> no score-only rows.
    seg = layout(3, 2, L, C, anchor_size=0, embed_query=False)
    assert seg.n_front == 0 and seg.index.tolist() == list(range(b[2], b[3]))
    assert layout(3, 0, L, C, anchor_size=6, passing_size=0).n_front == 0
    assert layout(3, 0, L, C, anchor_size=6, passing_size=100).n_front == 0  # nothing compressed on rank 0


@pytest.mark.parametrize("kw", [dict(), dict(anchor_size=5, passing_size=2, prefix_len=3),
                                dict(compressor="random", embed_query=False)])
def test_single_rank_is_dense(model, kw):
    """cp = 1: nothing to pass, no anchor: APB is exact causal attention over the context."""
    ids = torch.randint(0, 211, (69,), generator=torch.Generator().manual_seed(3))
    got, cache = apb_run(model, ids, 61, **kw)
    with torch.no_grad():
        ref = model(ids[None])[0, -1]
    assert rel(got, ref) <= 1e-5
    assert cache.layer(0).view()[2].tolist() == list(range(69))


def test_rotation_composes():
    """Re-rotating an embedded query by (true - embedded) positions = RoPE at the true positions."""
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8)).float()
    x = torch.randn(1, 2, 5, 8)
    at_p = _rotate(x, torch.arange(3, 8), inv)
    moved = _rotate(at_p, 40, inv)
    assert torch.allclose(moved, _rotate(x, torch.arange(43, 48), inv), atol=1e-5)
    assert torch.allclose(_rotate(at_p, -torch.arange(3, 8), inv), x, atol=1e-5)


def score_input(q, k, query=None, layer=0):
    n = k.shape[2]
    return ScoreInput(layer, q, k, torch.randn_like(k), torch.arange(100, 100 + n), query, rank=1)


def test_query_compressor_prefers_attended_keys():
    torch.manual_seed(0)
    B, Hq, Hkv, n, D = 1, 4, 2, 40, 16
    k = torch.randn(B, Hkv, n, D) * 0.1
    query = torch.randn(B, Hq, 3, D)
    hot = {0: [5, 30], 1: [17]}
    for h, idx in hot.items():  # keys aligned with the head's (group-mean) query direction
        direction = query[:, 2 * h : 2 * h + 2].mean(dim=(1, 2))
        for j in idx:
            k[:, h, j] = 4 * direction / direction.norm() * D**0.5
    scores = QueryCompressor(pool=1).score(score_input(torch.randn(B, Hq, n, D), k, query))
    assert scores.shape == (B, Hkv, n)
    for h, idx in hot.items():
        assert set(scores[0, h].topk(len(idx)).indices.tolist()) == set(idx)
    smooth = QueryCompressor(pool=5).score(score_input(torch.randn(B, Hq, n, D), k, query))
    assert torch.equal(smooth[0, 1, 15:20], smooth[0, 1, 17].expand(5))  # neighbours kept with the peak
    # Without an embedded query the block's last rows score it (causally): still a valid score.
    window = QueryCompressor().score(score_input(torch.randn(B, Hq, n, D), k))
    assert window.shape == (B, Hkv, n) and torch.isfinite(window).all()


def test_random_compressor_is_reproducible():
    k = torch.randn(1, 2, 30, 8)
    a = RandomCompressor(seed=1).score(score_input(k.repeat(1, 2, 1, 1), k, layer=2))
    b = RandomCompressor(seed=1).score(score_input(k.repeat(1, 2, 1, 1), k, layer=2))
    c = RandomCompressor(seed=1).score(score_input(k.repeat(1, 2, 1, 1), k, layer=3))
    assert torch.equal(a, b) and not torch.equal(a, c)


def random_heads(layers, Hq, Hkv, D, inter=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {i: {"fc1.weight": torch.randn(inter, (Hq + 2 * Hkv) * D, generator=g) * 0.1,
                "fc2.weight": torch.randn(Hkv, inter, generator=g),
                "fc2.bias": torch.randn(Hkv, generator=g)} for i in layers}


def test_retaining_heads_file_and_scores(tmp_path):
    from safetensors.torch import save_file

    Hq, Hkv, D, n = 6, 2, 8, 25
    w = random_heads([0, 1], Hq, Hkv, D)
    # APB/Locret checkpoints keep them inside the model: any prefix before layers.<i>. is accepted.
    flat = {f"model.layers.{i}.self_attn.{k}": t for i, d in w.items() for k, t in d.items()}
    flat["model.embed_tokens.weight"] = torch.zeros(3, 3)
    save_file(flat, tmp_path / "heads.safetensors", metadata={"rope": "post", "pool": "1"})
    heads = RetainingHeads.load(tmp_path / "heads.safetensors")
    assert sorted(heads.layers) == [0, 1] and heads.pool == 1
    q, k, v = torch.randn(1, Hq, n, D), torch.randn(1, Hkv, n, D), torch.randn(1, Hkv, n, D)
    got = heads.score(ScoreInput(1, q, k, v, torch.arange(n), None, 0))
    x = torch.cat([t.transpose(1, 2).reshape(1, n, -1) for t in (q, k, v)], -1)
    ref = torch.nn.functional.silu(x @ w[1]["fc1.weight"].T) @ w[1]["fc2.weight"].T + w[1]["fc2.bias"]
    assert torch.allclose(got, ref.transpose(1, 2), atol=1e-5)
    # Default rope = "pre": q and k are un-rotated first, which needs the model's RoPE (bind).
    torch.save({**flat, "__config__": {"pool": 1}}, tmp_path / "heads.pt")
    pre = RetainingHeads.load(tmp_path / "heads.pt")
    with pytest.raises(ValueError, match="bind"):
        pre.score(ScoreInput(1, q, k, v, torch.arange(n), None, 0))
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).double() / D)).float()
    pos = torch.arange(7, 7 + n)
    rq, rk = _rotate(q, pos, inv), _rotate(k, pos, inv)
    got = pre.score(ScoreInput(1, rq, rk, v, pos, None, 0, inv))
    assert torch.allclose(got, ref.transpose(1, 2), atol=1e-4)
    with pytest.raises(ValueError, match="trained for"):
        heads.score(ScoreInput(1, q[:, :3], k, v, torch.arange(n), None, 0))


def test_bad_arguments():
    with pytest.raises(ValueError, match="--passing-size must be >= 0"):
        APBAttention(passing_size=-1)
    with pytest.raises(ValueError, match="unknown APB compressor"):
        APBAttention(compressor="snapkv")
    with pytest.raises(ValueError, match="needs a trained weights file"):
        APBAttention(compressor="retaining-heads")
    with pytest.raises(ValueError, match="one context token per CP rank"):
        layout(4, 0, 8, 3)


# ---------------------------------------------------------------------------------------------
# Multi-rank: one spawn of 4 ranks runs every case
# ---------------------------------------------------------------------------------------------

L_FIX, C_FIX = 83, 71
CASES = [
    # name, cp, L, C, kwargs
    *[(f"exact{cp}", cp, 77, 67, dict(anchor_size=0, passing_size=1000, embed_query=False)) for cp in (2, 3, 4)],
    *[(f"fixed{cp}", cp, L_FIX, C_FIX, dict(anchor_size=6, passing_size=5, prefix_len=3, compressor=FixedScores()))
      for cp in (2, 3, 4)],
    ("query3", 3, 81, 70, dict(anchor_size=5, passing_size=4, prefix_len=2)),
    ("random2", 2, 61, 52, dict(anchor_size=4, passing_size=6, compressor="random", seed=3)),
    ("window3", 3, 81, 70, dict(anchor_size=5, passing_size=4, embed_query=False)),
    ("nopass3", 3, 81, 70, dict(anchor_size=5, passing_size=0)),
    ("noanchor4", 4, 90, 79, dict(anchor_size=0, passing_size=3, embed_query=False)),
    ("longquery4", 4, 25, 13, dict(anchor_size=4, passing_size=2)),  # query longer than early blocks
    # a sparse method inside each block (`sparse_method`): the call over [anchor; passing; block]
    ("sparse3", 3, 83, 72, dict(anchor_size=6, passing_size=5, embed_query=False, sparse=("vs", 3, 5))),
]


def sparse_method(spec):
    """("vs", vertical, slash): a Vertical-Slash pattern on every head, small enough to drop keys."""
    from starshard.kernels.minference import MInferenceConfig, VerticalSlash

    _, vertical, slash = spec
    return MInferenceConfig(default=VerticalSlash(vertical, slash), block_size=16, last_q=16)


def apb_worker(rank, world, path, cases, steps):
    import torch.distributed as dist

    from starshard.config import SamplingConfig

    groups = {world: dist.group.WORLD}
    for n in sorted({c[1] for c in cases}):
        if n not in groups:
            groups[n] = dist.new_group(list(range(n)))  # every rank creates every group, in order
    model = load_model(path)
    log: list = []
    wrapped = {}
    for name in ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast",
                 "all_to_all_single", "send", "recv", "isend", "irecv"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrap(*a, _fn=fn, _name=name, **kw):
            sent = a[1] if _name.startswith("all_gather") and len(a) > 1 else a[0]
            log.append((_name, tuple(sent.shape) if torch.is_tensor(sent) else None,
                        sent.dtype if torch.is_tensor(sent) else None))
            return _fn(*a, **kw)

        wrapped[name] = wrap
    out = {}
    from starshard.kernels.sparse import install_sparse

    for name, cp, L, C, kw in cases:
        if rank >= cp:
            continue
        kw = dict(kw)
        sparse = kw.pop("sparse", None)
        install_sparse(model, None if sparse is None else sparse_method(sparse))
        ids = torch.randint(0, 211, (L,), generator=torch.Generator().manual_seed(L + cp))
        strategy = APBAttention(groups[cp], **kw).bind(model)
        strategy.trace = []
        runner = ContextParallelRunner(model, strategy)
        cache = runner.new_cache(L + steps)
        with torch.no_grad():
            log.clear()
            originals = {n: getattr(dist, n) for n in wrapped}
            for n, f in wrapped.items():
                setattr(dist, n, f)
            try:
                segs = strategy.segments(L, C)
                with runner._strategy_attention(strategy.prefill_attend(segs[0].to(ids.device))):
                    model(ids[segs[0].index][None], positions=segs[0].positions, cache=cache,
                          output_row=segs[0].last_row)
                prefill_log = list(log)
            finally:
                for n, f in originals.items():
                    setattr(dist, n, f)
            cache = runner.new_cache(L + steps)  # again through the public entry point
            strategy.trace = []
            logits, owner = runner.prefill_logits(ids, C, cache)
            after = cache.length
            tok = runner._broadcast_token(logits[:, -1].argmax(-1), owner)
            toks = [int(tok)]
            for _ in range(steps - 1):
                tok = runner.next_token(tok.view(1, 1), cache, SamplingConfig(), None)
                toks.append(int(tok))
        kv = {i: tuple(t.clone() for t in cache.layer(i).view()) for i in cache.layers}
        out[name] = {"logits": logits[0, -1], "owner": owner, "tokens": toks, "after_prefill": after,
                     "final": cache.length, "positions": cache.layer(0).view()[2].clone(), "kv": kv,
                     "trace": strategy.trace, "prefill_log": prefill_log, "ids": ids}
    # Retaining heads under tensor parallelism: ranks 0 and 1 each hold half the heads.
    if rank < 2:
        torch.manual_seed(5)
        Hq, Hkv, D, n = 4, 2, 8, 19
        q, k, v = torch.randn(1, Hq, n, D), torch.randn(1, Hkv, n, D), torch.randn(1, Hkv, n, D)
        w = random_heads([0], Hq, Hkv, D)
        full = RetainingHeads(w, rope="post").score(ScoreInput(0, q, k, v, torch.arange(n), None, 0))
        part = RetainingHeads(w, rope="post", tp_group=groups[2]).score(ScoreInput(
            0, q[:, 2 * rank : 2 * rank + 2], k[:, rank : rank + 1], v[:, rank : rank + 1], torch.arange(n), None, 0))
        out["tp"] = (full[:, rank : rank + 1] - part).abs().max().item()
    return out


@pytest.fixture(scope="module")
def ranks(model_path):
    from tests.helpers.mp_harness import run_ranks

    return run_ranks(apb_worker, 4, model_path, CASES, STEPS)


def case(name):
    return next(c for c in CASES if c[0] == name)


def masked_tokens(model, index, ids, pos, visibles, steps):
    """Greedy decode on the unrolled reference: each new token sees what the last query row saw + itself."""
    seq_ids, seq_pos, vis = ids[index], pos, visibles
    first, toks = None, []
    for step in range(steps):
        logits = run_masked_layers(model, seq_ids, seq_pos, vis)[-1]
        first = logits if first is None else first
        tok = int(logits.argmax())
        toks.append(tok)
        n = vis[0].shape[-1]
        grown = []
        for v in vis:
            g = torch.zeros(v.shape[0], n + 1, n + 1, dtype=torch.bool)
            g[:, :n, :n] = v
            g[:, n, :n] = v[:, n - 1]
            g[:, n, n] = True
            grown.append(g)
        seq_ids = torch.cat([seq_ids, torch.tensor([tok])])
        seq_pos = torch.cat([seq_pos, seq_pos[-1:] + 1])
        vis = grown
    return first, toks


def recorded_selection(results, name):
    """selected(layer, head, rank, block) from what each rank recorded it sent."""
    def selected(layer, head, rank, block):
        return results[rank][name]["trace"][layer]["selected"][0, head].tolist()

    return selected


def check_common(results, name, model):
    _, cp, L, C, kw = case(name)
    for r in range(cp):
        assert results[r][name]["owner"] == cp - 1
    held = torch.cat([results[r][name]["positions"] for r in range(cp)]).sort().values
    assert held.tolist() == list(range(L + STEPS - 1))  # each context token once, query + decode on one rank
    growth = [results[r][name]["final"] - results[r][name]["after_prefill"] for r in range(cp)]
    assert growth == [0] * (cp - 1) + [STEPS - 1]
    for r in range(1, cp):  # what rank r received = what ranks < r sent, in rank order
        for t in results[r][name]["trace"]:
            if t["received"] is None:
                continue
            sent = [results[j][name]["trace"][t["layer"]]["selected"] for j in range(r)]
            assert torch.equal(t["received"], torch.cat(sent, dim=2))


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_no_compression_no_anchor_is_exact(ranks, model_path, cp):
    """passing >= block, no anchor, no embedded query: every rank sees all earlier blocks in full, so
    every layer is exact causal attention; query-phase logits and greedy tokens equal dense."""
    model = load_model(model_path)
    name = f"exact{cp}"
    ids = ranks[0][name]["ids"]
    with torch.no_grad():
        ref = model(ids[None])[0, -1]
        seq, toks = ids[None], []
        for _ in range(STEPS):
            t = int(model(seq)[0, -1].argmax())
            toks.append(t)
            seq = torch.cat([seq, torch.tensor([[t]])], dim=1)
    for r in range(cp):
        assert rel(ranks[r][name]["logits"], ref) <= 1e-5
        assert ranks[r][name]["tokens"] == toks
    check_common(ranks, name, model)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_fixed_selection_equals_masked_reference(ranks, model_path, cp):
    model = load_model(model_path)
    name = f"fixed{cp}"
    _, _, L, C, kw = case(name)
    cfg = model.config
    b = apb_bounds(C, cp)

    def next_anchor_end(r):  # rank r+1's anchor: the prefix, the embedded query, then context up to here
        s = b[r + 1]
        return max(min(kw["prefix_len"], s), min(kw["anchor_size"], s - (L - C)))

    selected = fixed_selection(kw["passing_size"], next_anchor_end)
    index, pos, vis = apb_unrolled(L, C, cp, anchor=kw["anchor_size"], selected=selected, n_layers=cfg.num_layers,
                                   n_kv_heads=cfg.num_kv_heads, prefix_len=kw["prefix_len"], score_rows=True)
    ref, toks = masked_tokens(model, index, ranks[0][name]["ids"], pos, vis, STEPS)
    for r in range(cp):
        assert rel(ranks[r][name]["logits"], ref) <= 1e-5
        assert ranks[r][name]["tokens"] == toks
    with torch.no_grad():  # guards the reference itself: compressed APB is an approximation, not dense
        dense = model(ranks[0][name]["ids"][None])[0, -1]
    assert rel(ranks[0][name]["logits"], dense) > 1e-3
    # Each rank but the last sent exactly the fixed selection, in position order.
    for r in range(cp - 1):
        for layer, t in enumerate(ranks[r][name]["trace"]):
            for h in range(cfg.num_kv_heads):
                want = sorted(selected(layer, h, r, list(range(b[r], b[r + 1]))))
                assert t["selected"][0, h].tolist() == want
    check_common(ranks, name, model)


@pytest.mark.parametrize("name", ["query3", "random2", "window3", "nopass3", "noanchor4", "longquery4"])
def test_compressors_and_ablations_equal_masked_reference(ranks, model_path, name):
    """Whatever a compressor picked (as recorded), the result is APB's masks on exactly that selection."""
    model = load_model(model_path)
    _, cp, L, C, kw = case(name)
    cfg = model.config
    anchor = kw["anchor_size"]
    embed = kw.get("embed_query", True)
    passing = kw["passing_size"]
    n0 = apb_bounds(C, cp)[1]
    score_rows = embed and kw.get("compressor", "query") == "query" and 0 < passing < n0
    selected = recorded_selection(ranks, name) if passing else (lambda *a: [])
    index, pos, vis = apb_unrolled(L, C, cp, anchor=anchor, selected=selected, n_layers=cfg.num_layers,
                                   n_kv_heads=cfg.num_kv_heads, prefix_len=kw.get("prefix_len", 0),
                                   embed_query=embed, score_rows=score_rows)
    ref = run_masked_layers(model, ranks[0][name]["ids"][index], pos, vis)[-1]
    for r in range(cp):
        assert rel(ranks[r][name]["logits"], ref) <= 1e-5
    check_common(ranks, name, model)
    if passing:
        for r in range(cp - 1):
            for t in ranks[r][name]["trace"]:
                sel = t["selected"]
                assert sel.shape[2] == min(passing, apb_bounds(C, cp)[r + 1] - apb_bounds(C, cp)[r])
                assert torch.equal(sel, sel.sort(dim=-1).values)  # position order


@pytest.mark.parametrize("name", ["fixed2", "fixed3", "fixed4", "query3", "exact3", "nopass3"])
def test_allgather_moves_only_the_passing_blocks(ranks, model_path, name):
    """Prefill runs exactly one collective per layer: an all-gather of [B, Hkv, passing, 2*D + w]
    (k, v and the int64 position bit-cast into w elements of the KV dtype) -- nothing else."""
    cfg = load_model(model_path).config
    _, cp, L, C, kw = case(name)
    b = apb_bounds(C, cp)
    M = min(kw["passing_size"], max(b[r + 1] - b[r] for r in range(cp)))
    for r in range(cp):
        log = ranks[r][name]["prefill_log"]
        if kw["passing_size"] == 0:
            assert log == []
            continue
        assert len(log) == cfg.num_layers
        for op, shape, dtype in log:
            assert op in ("all_gather_single", "all_gather_into_tensor")
            w = 8 // dtype.itemsize
            assert shape == (1, cfg.num_kv_heads, M, 2 * cfg.head_dim + w)
            assert M <= kw["passing_size"]


def test_retaining_heads_under_tensor_parallelism(ranks):
    assert ranks[0]["tp"] <= 1e-5 and ranks[1]["tp"] <= 1e-5


# ---------------------------------------------------------------------------------------------
# Study mode: cp = 1 with N virtual hosts reproduces cp = N
# ---------------------------------------------------------------------------------------------


def study_run(model, ids, context_len, hosts, steps, **kw):
    """cp = 1, `hosts` virtual hosts run in turn: logits, greedy tokens, the cache, the trace."""
    from starshard.config import SamplingConfig
    from starshard.kernels.sparse import install_sparse

    kw = dict(kw)
    sparse = kw.pop("sparse", None)
    install_sparse(model, None if sparse is None else sparse_method(sparse))
    strategy = APBAttention(num_blocks=hosts, **kw)
    strategy.trace = []
    runner = ContextParallelRunner(model, strategy)  # binds the model
    cache = runner.new_cache(len(ids) + steps)
    with torch.no_grad():
        logits, owner = runner.prefill_logits(ids, context_len, cache)
        tok = logits[:, -1].argmax(-1)
        toks = [int(tok)]
        for _ in range(steps - 1):
            tok = runner.next_token(tok.view(1, 1), cache, SamplingConfig(), None)
            toks.append(int(tok))
    kv = {i: cache.layer(i).view() for i in cache.layers}
    return logits[0, -1], owner, toks, kv, strategy.trace


@pytest.mark.parametrize("name", ["fixed2", "fixed3", "fixed4", "query3", "random2", "window3", "nopass3",
                                  "noanchor4", "longquery4", "exact3", "sparse3"])
def test_study_mode_reproduces_cp(ranks, model_path, name):
    """One process, N virtual hosts one after another == N gloo ranks: the query-phase logits, the
    greedy tokens, every layer's KV cache (rows, values and positions, blocks in host order) and
    what each host selected and received at every layer."""
    model = load_model(model_path)
    _, cp, L, C, kw = case(name)
    logits, owner, toks, kv, trace = study_run(model, ranks[0][name]["ids"], C, cp, STEPS, **kw)
    assert owner == 0
    if "sparse" in kw:  # the pattern really drops keys (else sparse and dense would agree trivially)
        dense = study_run(model, ranks[0][name]["ids"], C, cp, STEPS, **{**kw, "sparse": None})[0]
        assert rel(logits, dense) > 1e-3
    assert rel(logits, ranks[cp - 1][name]["logits"]) <= 1e-6
    assert toks == ranks[cp - 1][name]["tokens"]
    for i, (k, v, pos) in kv.items():  # ranks' caches laid end to end, in rank order
        want = [torch.cat([ranks[r][name]["kv"][i][j] for r in range(cp)], dim=2 if j < 2 else 0) for j in range(3)]
        assert pos.tolist() == want[2].tolist()
        assert rel(k, want[0]) <= 1e-6 and rel(v, want[1]) <= 1e-6
    if kw["passing_size"] == 0:
        assert trace == []
        return
    n_layers = model.config.num_layers
    assert [t["host"] for t in trace] == [h for h in range(cp) for _ in range(n_layers)]
    for h in range(cp):
        for t, want in zip(trace[h * n_layers : (h + 1) * n_layers], ranks[h][name]["trace"]):
            assert t["layer"] == want["layer"] and t["sent"] == want["sent"]
            for key in ("selected", "received"):
                assert (t[key] is None) == (want[key] is None)
                if t[key] is not None:
                    assert torch.equal(t[key], want[key])


def test_study_mode_with_one_host_is_dense(model):
    ids = torch.randint(0, 211, (40,), generator=torch.Generator().manual_seed(9))
    got, _ = apb_run(model, ids, 33, num_blocks=1, anchor_size=4, passing_size=2)
    with torch.no_grad():
        ref = model(ids[None])[0, -1]
    assert rel(got, ref) <= 1e-5


def test_compressors_score_a_head_slice_as_the_full_model_does():
    """Under tensor parallelism a rank scores only its KV heads (and their GQA groups): the query and
    random compressors give that slice exactly the full model's scores, so the selection does not
    depend on the tp split."""
    torch.manual_seed(1)
    B, Hq, Hkv, n, D = 1, 6, 3, 23, 8
    q, k, v, query = torch.randn(B, Hq, n, D), torch.randn(B, Hkv, n, D), torch.randn(B, Hkv, n, D), torch.randn(B, Hq, 4, D)
    pos = torch.arange(30, 30 + n)
    for comp in (QueryCompressor(), RandomCompressor(seed=2)):
        for with_query in (query, None):
            full = comp.score(ScoreInput(1, q, k, v, pos, with_query, 2))
            for h in range(Hkv):  # tp = 3: one KV head and its group of 2 q heads per rank
                part = comp.score(ScoreInput(1, q[:, 2 * h : 2 * h + 2], k[:, h : h + 1], v[:, h : h + 1], pos,
                                             None if with_query is None else with_query[:, 2 * h : 2 * h + 2], 2,
                                             kv_head_offset=h))
                assert torch.allclose(part, full[:, h : h + 1], atol=1e-6)


@pytest.mark.parametrize("hosts,anchor", [(3, 10), (4, 30)])
def test_full_passing_with_an_anchor_is_exact(model, hosts, anchor):
    """Passing budget over every block and the query not embedded: each block row sees the anchor,
    every earlier block (what its anchor does not hold) and its own block, each key once, so APB
    equals dense attention. A key passed on that the receiver's anchor also holds would count twice
    in its softmax and break this (anchor 30 covers all of rank 0's block and part of rank 1's)."""
    ids = torch.randint(0, 211, (77,), generator=torch.Generator().manual_seed(hosts))
    got, _ = apb_run(model, ids, 67, num_blocks=hosts, anchor_size=anchor, passing_size=1000, embed_query=False)
    with torch.no_grad():
        ref = model(ids[None])[0, -1]
    assert rel(got, ref) <= 1e-5


# ---------------------------------------------------------------------------------------------
# A sparse method inside each block (--sparse with --cp-strategy apb)
# ---------------------------------------------------------------------------------------------


def with_sparse(model, method, fn):
    from starshard.kernels.sparse import install_sparse

    install_sparse(model, method)
    try:
        return fn()
    finally:
        install_sparse(model, None)


def small_mi(*heads):
    from starshard.kernels.minference import MInferenceConfig

    return MInferenceConfig(default=heads[0], block_size=16, last_q=16)


@pytest.mark.parametrize("method", ["minference", "anchor"])
def test_sparse_with_full_budget_is_apb(model, method):
    """A pattern whose budget covers every key (Vertical-Slash budgets over the length; AnchorAttention
    with an infinite threshold): APB with it equals APB without it (compressed, with an anchor, three
    hosts), so the one sparse call over [anchor; passing; block] sees what APB's two dense calls see."""
    from starshard.kernels.minference import VerticalSlash
    from starshard.kernels.sparse import SparseConfig, load_sparse_method

    ids = torch.randint(0, 211, (77,), generator=torch.Generator().manual_seed(21))
    kw = dict(num_blocks=3, anchor_size=10, passing_size=6)
    want, _ = apb_run(model, ids, 67, **kw)
    if method == "minference":
        sparse = small_mi(VerticalSlash(10**6, 10**6))
    else:
        sparse = load_sparse_method(SparseConfig("anchor", anchor_theta=float("inf"), anchor_block_q=16, anchor_step=1,
                                                 min_length=0, fallback=False))
    got, _ = with_sparse(model, sparse, lambda: apb_run(model, ids, 67, **kw))
    assert rel(got, want) <= 1e-5


def test_sparse_thins_anchor_and_passing_keys_in_one_call(model, monkeypatch):
    """With a sparse method each host's block rows go through ONE sparse call over [anchor; passing
    entries of earlier hosts; own block] at key offset E (host-marked index positions: no device read),
    so the method's pattern covers the anchor and passing keys too; without it, the block's causal part
    and the [anchor; passing] part are two dense calls merged by lse (as before)."""
    import starshard.parallel.context.apb as apb_mod
    from starshard.kernels.common import arange_start
    from starshard.kernels.minference import VerticalSlash

    calls = []
    real = apb_mod.attention

    def spy(q, k, v, *, q_pos, k_pos, causal=True, sparse=None, **kw):
        calls.append((q.shape[2], k.shape[2], causal, sparse is not None, arange_start(q_pos), arange_start(k_pos)))
        return real(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, sparse=sparse, **kw)

    monkeypatch.setattr(apb_mod, "attention", spy)
    ids = torch.randint(0, 211, (77,), generator=torch.Generator().manual_seed(22))
    kw = dict(num_blocks=3, anchor_size=10, passing_size=6, embed_query=False)
    n_layers = model.config.num_layers
    dense, _ = apb_run(model, ids, 67, **kw)
    assert sum(1 for c in calls if not c[2]) == 2 * n_layers  # hosts 1, 2: [anchor; passing] apart
    assert not any(c[3] for c in calls)
    b = apb_bounds(67, 3)
    causal = sorted(c[:2] + c[4:] for c in calls if c[2])  # block and anchor calls: positions marked
    want = [(b[h + 1] - b[h],) * 2 + (b[h],) * 2 for h in range(3)] + [(10, 10, 0, 0)] * 2
    assert causal == sorted(w for w in want for _ in range(n_layers))
    calls.clear()
    got, _ = with_sparse(model, small_mi(VerticalSlash(2, 4)), lambda: apb_run(model, ids, 67, **kw))
    sparse = [c for c in calls if c[3]]
    assert not any(not c[2] for c in calls)  # no separate call over the anchor and passing keys
    want = []
    for h in range(3):
        rows, extras = b[h + 1] - b[h], (10 + 6 * h if h else 0)
        want += [(rows, rows + extras, True, True) + ((extras, 0) if h else (b[h], b[h]))] * n_layers
    assert sorted(sparse) == sorted(want)
    assert rel(got, dense) > 1e-3  # the small budget really drops keys


def test_sparse_after_masks_the_extras_like_a_tail_block():
    """`sparse_after` against float64: an A-shape pattern (sink 3, window 9) over two extra key sets
    and the block's own keys, GQA 4 / 2: the rows see the first 3 extra keys, and of the rest only
    those within 9 key indices, the block's first rows thus the last extra keys."""
    from tests.helpers.sparse_reference import assert_matches, masked_reference
    from starshard.kernels import minference as mi
    from starshard.parallel.context.apb import sparse_after

    g = torch.Generator().manual_seed(23)
    q = torch.randn(1, 4, 40, 16, generator=g)
    k, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    ek = [torch.randn(1, 2, n, 16, generator=g) for n in (7, 11)]
    ev = [torch.randn(1, 2, n, 16, generator=g) for n in (7, 11)]
    pattern = mi.SparsePattern((mi.AShape(3, 9),), block_size=16, last_q=16)
    out, lse = sparse_after(q, k, v, torch.arange(500, 540), ek, ev, pattern)
    i, j = torch.arange(40)[:, None] + 18, torch.arange(58)[None, :]
    vis = ((j <= i) & ((j < 3) | (i - j < 9))).expand(1, 4, -1, -1)
    ref, ref_lse = masked_reference(q, torch.cat(ek + [k], 2), torch.cat(ev + [v], 2), vis)
    assert_matches(out, lse, ref, ref_lse, torch.float32)


@pytest.mark.parametrize("shape", [(1, 12, 2, 7, 301, 64), (2, 8, 8, 5, 97, 32), (1, 32, 8, 33, 1025, 128)])
def test_pooled_attention_against_float64(shape, monkeypatch):
    """The query compressor's scores (mean attention probability per key over the rows and the GQA group) equal
    a float64 per-head reference, with or without a visibility mask (the block's own last rows), whether the KV
    heads go one a call (a 1-byte score budget) or all in one (POOLED_SCORE_BYTES)."""
    import starshard.parallel.context.apb as apb_mod

    B, Hq, Hkv, R, n, D = shape
    g = torch.Generator().manual_seed(sum(shape))
    qr = torch.randn(B, Hq, R, D, generator=g).bfloat16()
    k = torch.randn(B, Hkv, n, D, generator=g).bfloat16()
    for visible in (None, torch.rand(R, n, generator=g) > 0.3):
        want = []
        for h in range(Hkv):
            qh = qr[:, h * (Hq // Hkv):(h + 1) * (Hq // Hkv)].double().reshape(B, -1, D)
            s = (qh @ k[:, h].double().transpose(-1, -2)) * D**-0.5
            if visible is not None:
                s = s.masked_fill(~visible.repeat(Hq // Hkv, 1), float("-inf"))
            want.append(torch.softmax(s, -1).nan_to_num(0.0).mean(1))
        want = torch.stack(want, 1)
        for budget in (1, 2**40):
            monkeypatch.setattr(apb_mod, "POOLED_SCORE_BYTES", budget)
            got = apb_mod.pooled_attention(qr, k, visible)
            assert got.shape == (B, Hkv, n) and got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


def test_front_rows_attend_with_their_segments_positions(monkeypatch):
    """The runs prefill_attend marks on the host for the front rows (no device read per layer) are the segment's
    own positions: host 0's score-only query rows at head_len.. with keys [template head; themselves], a later
    host's [head; query; anchor] at 0.. with keys the same."""
    import starshard.parallel.context.apb as apb_mod

    L, C, H, Hkv, D = 83, 71, 4, 2, 16
    s = APBAttention(num_blocks=3, anchor_size=6, passing_size=5, prefix_len=3)
    segs = s.segments(L, C)
    calls = []
    real = apb_mod.attention

    def spy(q, k, v, *, q_pos, k_pos, **kw):
        calls.append((q.shape[2], q_pos.tolist(), k_pos.tolist()))
        return real(q, k, v, q_pos=q_pos, k_pos=k_pos, **kw)

    monkeypatch.setattr(apb_mod, "attention", spy)
    g = torch.Generator().manual_seed(0)
    for seg in segs:
        n, F_ = seg.positions.shape[0], seg.n_front
        calls.clear()
        q, k, v = (torch.randn(1, h, n, D, generator=g) for h in (H, Hkv, Hkv))
        s.prefill_attend(seg)(q, k, v, seg.positions, None)
        front = [(qp, kp) for rows, qp, kp in calls if rows == F_]
        assert len(front) == 1, calls
        fpos = seg.positions[:F_].tolist()
        keys = seg.positions[F_:F_ + seg.head_len].tolist() + fpos if seg.score_only else fpos
        assert front[0] == (fpos, keys), (seg.host, front[0])
    assert segs[0].score_only and segs[0].head_len == 3
