"""AnchorAttention's per-call floor (issue 38, the sparse speed floor): after identification a call
whose heads keep on average at least `AnchorRates.call_density` of the causal pairs runs the dense
kernel whole (exactly dense attention's (out, lse)) and is counted per layer; below it the call runs
as before. `sampled_density` checks the floor on the last groups of query blocks before the full
identification, counting the stripes only (`count_stripes`: the stripe kernels' count-only form split
over key chunks). --sparse-no-fallback still forces the sparse path. Torch backend and interpreted
Triton (TRITON_INTERPRET=1 set before anchor.py is imported, float32/float16), tiny inputs.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from starshard.benchmarks.sparse import make_inputs  # noqa: E402
from starshard.cli import add_sparse_arguments, layout_error, sparse_config  # noqa: E402
from starshard.kernels import anchor as an  # noqa: E402
from starshard.kernels.attention import attention, causal_attention_at  # noqa: E402
from starshard.kernels.sparse import SparseConfig, SparseReport, load_sparse_method, sparse_report  # noqa: E402
from starshard.llm import LLM  # noqa: E402

needs_triton = pytest.mark.skipif(not an.triton_available(torch.zeros(1)), reason="needs Triton (interpreted on CPU)")

CFG = an.AnchorConfig(theta=2.0, block_q=16, block_k=16, init_tokens=4, step=2)
L = 384


def inputs(kind="structured", n=L, off=0):
    q, k, v = make_inputs(kind, L=n + off, H=4, Hkv=2, D=32, dtype=torch.float32, device="cpu", seed=0)
    pos = torch.arange(n + off)
    return q[:, :, off:], k, v, pos[off:], pos


def call_density(q, k, off=0):
    idx = an.build_index(q, k, CFG, offset=off, backend="torch")
    return float(an.head_density(idx, CFG, Lq=q.shape[2], Lk=k.shape[2], offset=off).mean())


@pytest.mark.parametrize("off", [0, 37])
def test_floor_triggers_above_the_threshold_and_not_below(off):
    """Structured inputs (every head sparse-like); the per-head rule keeps every head sparse (kernel
    rate 1.0), so only the call floor decides: just below the call's density it falls back (dense,
    exact, counted), just above it the call is the plain sparse call, bit for bit. The dense kernel is
    the per-head fallback's (`causal_attention_at`: at an offset, the prefix and the rows' own keys
    merged by lse), which is the dispatcher's result at offset 0 and matches it to rounding after."""
    q, k, v, q_pos, k_pos = inputs(off=off)
    d = call_density(q, k, off)
    assert 0.02 < d < 0.5
    plain = an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=CFG, backend="torch")
    dense = causal_attention_at(q, k, v, q_pos=q_pos, k_pos=k_pos, offset=off)
    ref = attention(q.double(), k.double(), v.double(), q_pos=q_pos, k_pos=k_pos)
    torch.testing.assert_close(dense[0].double(), ref[0], rtol=0, atol=1e-5)
    if off == 0:
        want = attention(q, k, v, q_pos=q_pos, k_pos=k_pos)
        assert torch.equal(dense[0], want[0]) and torch.equal(dense[1], want[1])
    assert (plain[0] - dense[0]).abs().max() > 1e-3  # sparse really differs from dense here

    rep = SparseReport()
    out, lse = an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=CFG, backend="torch",
                                   rates=an.AnchorRates(kernel=1.0, call_density=d * 0.999), report=rep)
    assert torch.equal(out, dense[0]) and torch.equal(lse, dense[1])
    assert (rep.calls, rep.calls_fallen_back, rep.heads_dense, rep.heads_sparse) == (1, 1, 4, 0)

    rep = SparseReport()
    out, lse = an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=CFG, backend="torch",
                                   rates=an.AnchorRates(kernel=1.0, call_density=d * 1.001), report=rep)
    assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1])
    assert (rep.calls, rep.calls_fallen_back, rep.heads_dense, rep.heads_sparse) == (1, 0, 0, 4)
    # the default floor is the break-even density, the kernel rate
    assert an.AnchorRates(kernel=d * 0.999).call_falls_back(d) and not an.AnchorRates(kernel=d * 1.001).call_falls_back(d)


def test_sample_is_the_full_identification_of_its_groups():
    """The sampled groups select exactly the stripes the full identification gives them (offset rows,
    a partial last group), so the estimate is their true density."""
    q, k, v, q_pos, k_pos = inputs(n=L - 5, off=21)
    full = an.build_index(q, k, CFG, offset=21, backend="torch")
    G = full.count.shape[2]
    for groups in (1, 3):
        start = (G - groups) * CFG.block_q * CFG.step
        sub = an.build_index(q[:, :, start:], k, CFG, offset=21 + start, backend="torch")
        assert torch.equal(sub.count, full.count[:, :, G - groups:])
        for b, h, g in ((0, hh, gg) for hh in range(4) for gg in range(groups)):
            n = int(sub.count[b, h, g])
            assert torch.equal(sub.idx[b, h, g, :n], full.idx[b, h, G - groups + g, :n])
        want = an.head_density(sub, CFG, Lq=q.shape[2] - start, Lk=k.shape[2], offset=21 + start).mean().item()
        assert an.sampled_density(q, k, CFG, groups, offset=21, backend="torch") == pytest.approx(want, abs=1e-12)
    assert an.sampled_density(q, k, CFG, G, offset=21, backend="torch") is None  # the sample would be everything


def test_sampled_floor_skips_the_full_identification(monkeypatch):
    q, k, v, q_pos, k_pos = inputs()
    est = an.sampled_density(q, k, CFG, 2, offset=0, backend="torch")
    seen = []

    def spy(name, orig):
        def f(q, *a, **kw):
            seen.append((name, q.shape[2]))
            return orig(q, *a, **kw)
        return f

    monkeypatch.setattr(an, "build_index", spy("build", an.build_index))
    monkeypatch.setattr(an, "count_stripes", spy("count", an.count_stripes))
    rep = SparseReport()
    out, lse = an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=CFG, backend="torch",
                                   rates=an.AnchorRates(kernel=1.0, call_density=est * 0.999, sample_groups=2),
                                   report=rep)
    dense = attention(q, k, v, q_pos=q_pos, k_pos=k_pos)
    assert torch.equal(out, dense[0]) and torch.equal(lse, dense[1])
    assert seen == [("count", 2 * CFG.block_q * CFG.step)] and rep.calls_fallen_back == 1  # only the sample, counted
    seen.clear()
    plain = an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=CFG, backend="torch")
    out, _ = an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=CFG, backend="torch",
                                 rates=an.AnchorRates(kernel=1.0, call_density=0.99, sample_groups=2))
    assert seen == [("build", L), ("count", 64), ("build", L)] and torch.equal(out, plain[0])  # under the floor


# name: B, Hq, Hkv, Lq, D, offset (Lk = offset + Lq: the query block is the tail of its keys), dtype
COUNT_LAYOUTS = {
    "gqa_d64_fp32": (1, 4, 2, 107, 64, 0, torch.float32),
    "gqa_d128_fp16_prefix": (1, 4, 2, 75, 128, 37, torch.float16),
    "mha_d64_long_prefix": (1, 2, 2, 70, 64, 150, torch.float32),
    "batch_mqa_fp16": (2, 3, 1, 70, 32, 13, torch.float16),
}
COUNT_CFG = an.AnchorConfig(theta=2.0, block_q=16, block_k=16, init_tokens=5, local_window=7, step=2)


def count_inputs(layout, seed):
    B, hq, hkv, lq, d, off, dtype = COUNT_LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, hq, lq, d, generator=g) * 1.5).to(dtype)
    k = torch.randn(B, hkv, off + lq, d, generator=g).to(dtype)
    return q, k, off


@needs_triton
@pytest.mark.parametrize("layout", list(COUNT_LAYOUTS))
def test_count_stripes_equals_the_identification_counts(layout):
    """The count-only stripe kernels (per head and KV-grouped, split over key chunks of several sizes,
    chunks starting off the block grid: init_tokens 5) count exactly the hits of the full kernels on
    the floor's samples (last 1 and 3 groups of query blocks, odd lengths, offsets); the torch path
    equals the torch identification; per-head thetas in one layout."""
    q, k, off = count_inputs(layout, seed=len(layout))
    cfg = COUNT_CFG
    if layout == "batch_mqa_fp16":
        cfg = dataclasses.replace(cfg, theta=tuple(1.0 + 0.75 * h for h in range(q.shape[1])))
    rpg = cfg.block_q * cfg.step
    G = -(-q.shape[2] // rpg)
    hits = cands = 0
    for groups in (1, 3):
        start = (G - groups) * rpg
        qs, o = q[:, :, start:], off + start
        for backend in ("triton", "torch"):
            xa = an.anchor_scores(qs, k, cfg, offset=o, backend=backend)
            for group_heads in ((False, True) if backend == "triton" else (None,)):
                want = an.identify_stripes(qs, k, xa, cfg, offset=o, backend=backend, group_heads=group_heads).count
                for chunk_keys in ((cfg.block_k, 3 * cfg.block_k) if backend == "triton" else (None,)):
                    got = an.count_stripes(qs, k, xa, cfg, offset=o, backend=backend, group_heads=group_heads,
                                           chunk_keys=chunk_keys)
                    assert got.dtype == torch.int32 and torch.equal(got, want), (groups, backend, group_heads, chunk_keys)
            if backend == "triton":  # the defaults: the identification's kernel choice, one chunk at this size
                assert torch.equal(an.count_stripes(qs, k, xa, cfg, offset=o, backend=backend), want)
        hits += int(want.sum())
        ws = an.window_starts(cfg, Lq=qs.shape[2], offset=o).clamp(max=k.shape[2])
        cands += int((ws - cfg.init_tokens).clamp(min=0).sum()) * q.shape[0] * q.shape[1]
    assert 0 < hits < cands  # theta keeps some candidates, not all: the counts test the hit test


@needs_triton
def test_count_stripes_edges():
    """No candidates (the first group at offset 0): zeros without a launch; chunk_keys refused unless
    a positive multiple of block_k."""
    q, k, off = count_inputs("gqa_d64_fp32", seed=1)
    qs = q[:, :, :20]
    xa = an.anchor_scores(qs, k[:, :, :20], COUNT_CFG, offset=0, backend="triton")
    got = an.count_stripes(qs, k[:, :, :20], xa, COUNT_CFG, offset=0, backend="triton")
    assert torch.equal(got, an.identify_stripes(qs, k[:, :, :20], xa, COUNT_CFG, offset=0, backend="triton").count)
    assert got.shape == (1, q.shape[1], 1) and not got.any()
    for bad in (0, 24, -16):
        with pytest.raises(ValueError, match="chunk_keys"):
            an.count_stripes(q, k, an.anchor_scores(q, k, COUNT_CFG, offset=0, backend="torch"), COUNT_CFG,
                             offset=0, backend="torch", chunk_keys=bad)


@pytest.mark.parametrize("keys,heads,groups", [(1 << 17, 9, 1), (1 << 17, 9, 4), (1 << 17, 3, 1), (1 << 15, 32, 4),
                                               (3000, 9, 2), (200, 9, 1)])
def test_count_chunks_fill_the_gpu(keys, heads, groups):
    """Chunks are whole key tiles covering the candidates; about _COUNT_PROGRAMS programs in all (a
    128K-key call of 1-4 groups fills an H100 / H200's 132 SMs several times over), none scanning
    fewer than _COUNT_MIN_KEYS keys unless the group has fewer."""
    block_k = 64
    programs = heads * groups
    chunk = an.count_chunk_keys(keys, programs, block_k)
    chunks = -(-keys // chunk)
    assert chunk % block_k == 0 and chunks * chunk >= keys
    assert chunk >= min(an._COUNT_MIN_KEYS, -(-keys // block_k) * block_k)
    assert programs * chunks <= max(an._COUNT_PROGRAMS + programs, programs)
    if keys >= 1 << 17 and heads >= 9:
        assert programs * chunks >= an._COUNT_PROGRAMS - programs


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sampled_density_is_the_sampled_identification(backend):
    """sampled_density (anchors + counts of the sample) equals head_density of the sample's full
    build_index, exactly (the same counts, the same closed form)."""
    q, k, off = count_inputs("gqa_d128_fp16_prefix", seed=3)
    if backend == "torch":
        q, k = q.float(), k.float()
    rpg = COUNT_CFG.block_q * COUNT_CFG.step
    G = -(-q.shape[2] // rpg)
    assert G == 3
    for groups in (1, 2):
        start = (G - groups) * rpg
        sub = an.build_index(q[:, :, start:], k, COUNT_CFG, offset=off + start, backend=backend)
        want = float(an.head_density(sub, COUNT_CFG, Lq=q.shape[2] - start, Lk=k.shape[2], offset=off + start).mean())
        assert an.sampled_density(q, k, COUNT_CFG, groups, offset=off, backend=backend) == want
        assert torch.equal(an.count_density(sub.count, COUNT_CFG, Lq=q.shape[2] - start, Lk=k.shape[2],
                                            offset=off + start),
                           an.head_density(sub, COUNT_CFG, Lq=q.shape[2] - start, Lk=k.shape[2], offset=off + start))


def run_tiny(cfg):
    ids = torch.randint(0, 512, (1, 160), generator=torch.Generator().manual_seed(0))
    llm = LLM(random_weights="tiny", progress=False, device="cpu", dtype=torch.float32, sparse=cfg)
    with torch.inference_mode():
        logits = llm.model(ids, cache=llm.runner.new_cache(200), last_only=True)
    return logits, sparse_report(llm.model)


def test_installed_floor_counts_by_layer_and_no_fallback_forces_sparse():
    """Random weights (dense-like heads): the default floor sends each layer's call dense whole,
    counted under its layer, logits equal to dense; a floor above 1 leaves the per-head rule alone;
    --sparse-no-fallback runs every head sparse."""
    base = dict(anchor_block_q=16, anchor_step=1, anchor_theta=2.0, min_length=0)
    dense, _ = run_tiny(None)
    logits, rep = run_tiny(SparseConfig("anchor", fallback=True, **base))
    layers, heads = 2, 4  # the tiny preset
    assert rep["calls_fallen_back"] == layers and rep["fallen_back_by_layer"] == {"0": 1, "1": 1}
    assert rep["heads_dense"] == layers * heads and rep["heads_sparse"] == 0
    torch.testing.assert_close(logits, dense, rtol=0, atol=0)
    logits, rep = run_tiny(SparseConfig("anchor", fallback=True, fallback_density=1.5, **base))
    assert rep["calls_fallen_back"] == 0 and rep["heads_dense"] + rep["heads_sparse"] == layers * heads
    logits, rep = run_tiny(SparseConfig("anchor", fallback=False, **base))  # the config that fell back above
    assert rep["heads_sparse"] == layers * heads and rep["calls_fallen_back"] == 0
    logits, rep = run_tiny(SparseConfig("anchor", fallback=False, **dict(base, anchor_theta=0.05)))
    assert rep["heads_sparse"] == layers * heads and rep["calls_fallen_back"] == 0
    assert (logits - dense).abs().max() > 1e-4  # the sparse kernel really ran


def test_a_forced_call_reports_its_heads_densities_unread():
    """rates=None (every head sparse, --sparse-no-fallback) hands the report the heads' densities as a
    device tensor (no host read per call): the report's mean is identification's, an odd length's last
    partial query block included."""
    q, k, v, qp, kp = inputs(n=L - 7)
    rep = SparseReport()
    an.anchor_attention(q, k, v, q_pos=qp, k_pos=kp, config=CFG, backend="torch", rates=None, report=rep)
    assert isinstance(rep.kept, torch.Tensor)
    got = rep.as_dict()
    assert (got["calls"], got["heads_sparse"], got["heads_dense"]) == (1, 4, 0)
    assert got["mean_density"] == pytest.approx(call_density(q, k), rel=1e-9)


def test_flags_and_validation():
    ap = argparse.ArgumentParser()
    add_sparse_arguments(ap)
    a = ap.parse_args(["--sparse", "anchor", "--sparse-fallback-density", "0.3", "--sparse-fallback-sample", "3"])
    cfg = sparse_config(a)
    assert (cfg.fallback_density, cfg.fallback_sample, cfg.fallback) == (0.3, 3, None)
    rates = load_sparse_method(cfg).rates(torch.device("cuda"), 64)
    assert (rates.kernel, rates.call_density, rates.sample_groups) == (an.MEASURED_ANCHOR_RATES[64].kernel, 0.3, 3)
    plain = sparse_config(ap.parse_args(["--sparse", "anchor"]))
    assert (plain.fallback_density, plain.fallback_sample) == (None, None)
    default = load_sparse_method(plain).rates(torch.device("cuda"), 64)
    assert (default.call_density, default.sample_groups) == (None, an.FLOOR_SAMPLE_GROUPS)
    assert load_sparse_method(plain).rates(torch.device("cpu"), 64) is None  # CPU default: patterns as asked
    no_sample = sparse_config(ap.parse_args(["--sparse", "anchor", "--sparse-fallback-sample", "0"]))
    assert load_sparse_method(no_sample).rates(torch.device("cuda"), 128).sample_groups == 0
    assert load_sparse_method(cfg).rates(torch.device("cpu"), 64) == rates  # asked for: on off CUDA too
    assert load_sparse_method(SparseConfig("anchor")).rates(torch.device("cuda"), 64).call_density is None
    forced = sparse_config(ap.parse_args(["--sparse", "anchor", "--sparse-no-fallback"]))
    assert load_sparse_method(forced).rates(torch.device("cuda"), 64) is None  # the sparse path, forced
    with pytest.raises(ValueError, match="sparse-no-fallback"):
        sparse_config(ap.parse_args(["--sparse", "anchor", "--sparse-no-fallback", "--sparse-fallback-density", "0.3"]))
    with pytest.raises(ValueError, match="--sparse anchor"):
        SparseConfig("minference", fallback_density=0.3)
    for bad in (dict(fallback_density=0.0), dict(fallback_density=-1), dict(fallback_sample=-1),
                dict(fallback_sample=1.5)):
        with pytest.raises(ValueError, match="fallback_"):
            SparseConfig("anchor", **bad)
    assert "need --sparse anchor" in layout_error(ap.parse_args(["--sparse", "minference",
                                                                 "--sparse-fallback-sample", "2"]))
    rep = SparseReport()
    rep.fall_back(4, 3)
    rep.reset()
    assert rep.as_dict()["fallen_back_by_layer"] == {} and rep.calls_fallen_back == 0
