"""Never slower than dense (issue 18, item 1): the cost model that sends a head whose sparse kernel
would not win to the dense kernel (MInference: minference.plan_with_fallback with KernelRates;
AnchorAttention: AnchorRates after identification), the minimum length below which nothing is
estimated (SparseConfig.min_length, kernels/sparse.py), and the report of what ran.

Dense-like patterns (random q/k, budgets that keep every block, a Dense head, stripes that keep every
key) must run the dense kernel, with (out, lse) equal to the dense dispatcher's for those heads and
to the float64 reference; sparse-like ones (the structured inputs of `launch/bench.py sparse`) keep
their pattern and match the float64 masked reference of it. The Triton kernels run under
TRITON_INTERPRET=1 (float32 / float16 only).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from starshard.benchmarks.sparse import make_inputs  # noqa: E402
from starshard.kernels import anchor as an  # noqa: E402
from starshard.kernels import minference as mi  # noqa: E402
from starshard.kernels.attention import attention, causal_attention, causal_attention_at, head_subset  # noqa: E402
from starshard.kernels.sparse import (  # noqa: E402
    MIN_LENGTH, FallbackSparse, SparseConfig, SparseReport, install_sparse, load_sparse_method, pattern_for,
    sparse_report,
)
from starshard.llm import LLM  # noqa: E402
from tests.helpers.sparse_reference import assert_matches, masked_reference  # noqa: E402

BM = 16
L = 512
# The rates measured for these tests' head dim (32: the head-dim-64 kernels) without the index terms:
# at these test sizes the per-key index cost alone outweighs a dense call (which is right on a GPU, and
# why min_length exists); the kernel-side rule is what most tests below exercise.
RATES = mi.measured_rates(32)
KERNEL_ONLY = dataclasses.replace(RATES, bs_index=0.0)
ANCHOR_RATES = an.measured_anchor_rates(32)


def inputs(kind, dtype=torch.float32, *, H=4, Hkv=2, D=32, seed=0, n=L):
    q, k, v = make_inputs(kind, L=n, H=H, Hkv=Hkv, D=D, dtype=dtype, device="cpu", seed=seed)
    pos = torch.arange(n) + 3
    return q, k, v, pos


def mixed_inputs(dtype=torch.float32):
    """KV head 0 (query heads 0, 1) structured, KV head 1 (query heads 2, 3) random."""
    qs, ks, vs, pos = inputs("structured", dtype)
    qr, kr, vr, _ = inputs("random", dtype, seed=1)
    q = torch.cat([qs[:, :2], qr[:, 2:]], 1)
    k = torch.cat([ks[:, :1], kr[:, 1:]], 1)
    v = torch.cat([vs[:, :1], vr[:, 1:]], 1)
    return q, k, v, pos


def pattern(*heads):
    return mi.SparsePattern(heads, block_size=BM, last_q=16, force_sink=2, force_local=4)


def causal(q, k):
    lq, lk = q.shape[2], k.shape[2]
    vis = torch.arange(lk)[None, :] <= (torch.arange(lq) + lk - lq)[:, None]
    return vis.expand(q.shape[0], q.shape[1], -1, -1)


def plan_vis(groups, B, Hq, Lq, Lk, offset):
    """[B, Hq, Lq, Lk] visibility of the plan's sparse heads (the kernel's own masks, which
    test_minference checks against plain loops); other heads see nothing."""
    vis = torch.zeros(B, Hq, Lq, Lk, dtype=torch.bool)
    blocks = torch.arange(-(-Lq // BM))
    for grp in groups:
        vis[:, grp.heads] = mi.group_mask(grp, B=B, Lq=Lq, Lk=Lk, offset=offset, block_size=BM, blocks=blocks)[:, :, :Lq]
    return vis


def check_split(out, lse, q, k, v, pos, dense_heads, sparse_vis, dtype):
    """Dense heads: exactly the dispatcher's (out, lse) for them, and the float64 causal reference;
    the rest: the float64 reference of their masks."""
    Hq = q.shape[1]
    ref, ref_lse = masked_reference(q, k, v, causal(q, k))
    if dense_heads:
        want = attention(*head_subset(q, k, v, dense_heads), q_pos=pos, k_pos=pos)
        assert torch.equal(out[:, dense_heads], want[0]) and torch.equal(lse[:, dense_heads], want[1])
        assert_matches(out[:, dense_heads], lse[:, dense_heads], ref[:, dense_heads], ref_lse[:, dense_heads], dtype)
    sparse_heads = [h for h in range(Hq) if h not in dense_heads]
    if sparse_heads:
        sref, sref_lse = masked_reference(q, k, v, sparse_vis)
        assert_matches(out[:, sparse_heads], lse[:, sparse_heads], sref[:, sparse_heads], sref_lse[:, sparse_heads], dtype)
        # really sparse: those heads differ from dense attention
        assert (out[:, sparse_heads].double() - ref[:, sparse_heads]).abs().max() > 1e-3


# ---- cost counting -------------------------------------------------------------------------------


def random_diagonals(rng, ndiag: int, ks: int) -> torch.Tensor:
    """[2, 3, ks] sorted diagonal ids, each (batch, head) row a random number of them, padded with ndiag."""
    s_idx = torch.full((2, 3, ks), ndiag, dtype=torch.long)
    for b in range(2):
        for h in range(3):
            d = sorted(rng.sample(range(ndiag), rng.randint(0, ks)))
            s_idx[b, h, : len(d)] = torch.tensor(d, dtype=torch.long)
    return s_idx


def test_slash_cost_closed_form_matches_chunk_loops():
    """The closed form (used by kernel_cost and the fallback) against the kernel's chunk loop, over
    random runs, offsets, keys shorter or longer than the rows, partial last blocks."""
    rng = random.Random(0)
    for _ in range(150):
        bm = rng.choice([16, 32, 64])
        lq, off = rng.randint(1, 300), rng.randint(0, 200)
        lk = rng.choice([lq + off, rng.randint(1, lq + off + 100)])
        ndiag = lq + off
        ks = rng.randint(0, min(ndiag, 30))
        s_idx = random_diagonals(rng, ndiag, ks)
        seg, cnt = mi.vs_segments(s_idx, ndiag, bm)
        got = mi.slash_cost(seg, cnt, Lq=lq, Lk=lk, offset=off, block_size=bm)
        for b in range(2):
            for h in range(3):
                chunks = 0
                for s in range(int(cnt[b, h])):
                    f, last = seg[b, h, s].tolist()
                    for m in range(-(-lq // bm)):
                        base = m * bm + off
                        chunks += -(-max(0, min(lk, base + bm - f) - max(0, base - last)) // bm)
                assert int(got[b, h]) == chunks * bm * bm


@pytest.mark.parametrize("chunk", [16, 1024])
def test_runs_kernel_equals_torch_ops(monkeypatch, chunk):
    """runs.py's launch (interpreted) writes `vs_segments`' runs and counts `slash_cost`'s entries:
    random sorted diagonals with padding, runs across chunk boundaries (chunk 16), queries after a
    gap, keys shorter or longer than the rows, no diagonals at all."""
    from starshard.kernels.minference import runs

    monkeypatch.setattr(runs, "BLOCK_S", chunk)
    rng = random.Random(1)
    for trial in range(25):
        bm = rng.choice([16, 32, 64])
        lq, off = rng.randint(1, 400), rng.randint(0, 300)
        lk = rng.choice([lq + off, rng.randint(1, lq + off + 100)])
        ndiag = lq + off
        ks = 0 if trial == 0 else rng.randint(1, min(ndiag, 120))
        s_idx = random_diagonals(rng, ndiag, ks)
        seg, cnt = mi.vs_segments(s_idx, ndiag, bm)
        cost = mi.slash_cost(seg, cnt, Lq=lq, Lk=lk, offset=off, block_size=bm)
        seg_k, cnt_k, cost_k = runs.vs_runs_kernel(s_idx, ndiag=ndiag, Lq=lq, Lk=lk, offset=off, block_size=bm)
        assert torch.equal(seg_k, seg) and torch.equal(cnt_k, cnt) and torch.equal(cost_k, cost), trial
        assert mi.vs_runs(s_idx, Lq=lq, Lk=lk, offset=off, block_size=bm, use_triton=False)[2].equal(cost)


def test_block_sparse_cost_is_known_before_the_index():
    for lq, lk, off in ((100, 100, 0), (40, 100, 60), (37, 50, 80)):
        q = torch.randn(1, 3, lq, 16)
        k = torch.randn(1, 3, lk, 16)
        topk = [1, 3, 50]
        idx = mi.bs_select(q, k, offset=off, topk=topk, block_size=BM)
        grp = mi.HeadGroup("block_sparse", [0, 1, 2], index=idx)
        want = mi.kernel_cost(grp, B=1, Lq=lq, Lk=lk, offset=off, block_size=BM)[0]
        assert torch.equal(mi.block_sparse_cost(topk, Lq=lq, Lk=lk, offset=off, block_size=BM), want)


def test_head_density_is_the_per_head_density():
    q, k, v, pos = inputs("structured")
    cfg = an.AnchorConfig(theta=2.0, block_q=16, block_k=16, init_tokens=4, step=2)
    idx = an.build_index(q[:, :, 40:], k, cfg, offset=40, backend="torch")
    per_head = an.head_density(idx, cfg, Lq=L - 40, Lk=L, offset=40)
    assert per_head.shape == (1, 4)
    assert abs(per_head.mean().item() - an.density(idx, cfg, Lq=L - 40, Lk=L, offset=40)) < 1e-12


# ---- MInference ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dense_like_pattern_runs_the_dense_kernel(backend):
    """Random q / k: Vertical-Slash picks scattered diagonals whose runs cover about every block, a
    Dense head is dense, and budgets that keep everything are dense: every head goes to the dense
    kernel, and the call returns exactly the dense dispatcher's (out, lse)."""
    q, k, v, pos = inputs("random")
    pat = pattern(mi.VerticalSlash(16, 64), mi.Dense(), mi.VerticalSlash(10**6, 10**6), mi.AShape(0, 10**6))
    plan = mi.plan_with_fallback(q, k, pat, offset=0, rates=RATES)
    assert plan.dense == [0, 1, 2, 3] and plan.groups == []
    assert min(plan.density) > 0.9  # the pattern keeps about every block
    rep = SparseReport()
    out, lse = mi.minference_attention(q, k, v, q_pos=pos, k_pos=pos, pattern=pat, rates=RATES, report=rep,
                                       backend=backend)
    want = attention(q, k, v, q_pos=pos, k_pos=pos)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    check_split(out, lse, q, k, v, pos, [0, 1, 2, 3], None, torch.float32)
    assert rep.as_dict() == {"calls": 1, "heads_sparse": 0, "heads_dense": 4, "heads_skipped": 0, "mean_density": None,
                             "calls_fallen_back": 0, "fallen_back_by_layer": {}}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sparse_like_pattern_keeps_its_kernel(backend):
    """Structured inputs (local bands, planted columns, sinks): small Vertical-Slash budgets and an
    A-shape keep well under the kernels' break-even density and run sparse, matching the float64
    reference of their masks; without rates the same call gives the same result."""
    q, k, v, pos = inputs("structured")
    pat = pattern(mi.VerticalSlash(8, 16), mi.AShape(4, 32), mi.VerticalSlash(8, 16), mi.AShape(2, 24))
    plan = mi.plan_with_fallback(q, k, pat, offset=0, rates=KERNEL_ONLY)
    assert plan.dense == [] and max(plan.density) < RATES.vertical_slash
    rep = SparseReport()
    out, lse = mi.minference_attention(q, k, v, q_pos=pos, k_pos=pos, pattern=pat, rates=KERNEL_ONLY, report=rep,
                                       backend=backend)
    check_split(out, lse, q, k, v, pos, [], plan_vis(plan.groups, 1, 4, L, L, 0), torch.float32)
    if backend == "torch":  # (the interpreter is slow)
        plain = mi.minference_attention(q, k, v, q_pos=pos, k_pos=pos, pattern=pat, backend=backend)
        torch.testing.assert_close(out, plain[0], rtol=0, atol=0)
    d = rep.as_dict()
    assert (d["heads_sparse"], d["heads_dense"]) == (4, 0)
    assert d["mean_density"] == pytest.approx(sum(plan.density) / 4)
    # A Vertical-Slash index is built whole before its choice, so no index term weighs on it; a
    # Block-Sparse index is not: at 512 keys its pooled selection costs more than the dense call.
    assert mi.plan_with_fallback(q, k, pat, offset=0, rates=RATES).dense == []
    bs = pattern(mi.VerticalSlash(8, 16), mi.BlockSparse(2), mi.VerticalSlash(8, 16), mi.BlockSparse(2))
    assert mi.plan_with_fallback(q, k, bs, offset=0, rates=KERNEL_ONLY).dense == []
    assert mi.plan_with_fallback(q, k, bs, offset=0, rates=RATES).dense == [1, 3]


@pytest.mark.parametrize("case", ["torch-fp32-groups", "triton-fp32-groups", "triton-fp16-split", "torch-fp32-split"])
def test_mixed_heads_split_between_kernels(case):
    """Some heads sparse, some dense in one call: the dense ones are exactly the dense dispatcher's,
    the sparse ones their masks' reference. 'groups': the dense heads are whole KV groups (GQA kept);
    'split': they are not (each gets its own KV head)."""
    backend, dt, layout = case.split("-")
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[dt]
    q, k, v, pos = mixed_inputs(dtype)  # KV head 0 structured, KV head 1 random
    if layout == "groups":
        heads, dense = (mi.VerticalSlash(8, 16), mi.AShape(4, 32), mi.VerticalSlash(16, 64), mi.Dense()), [2, 3]
    else:
        heads, dense = (mi.Dense(), mi.VerticalSlash(8, 16), mi.AShape(4, 32), mi.VerticalSlash(16, 64)), [0, 3]
    pat = pattern(*heads)
    plan = mi.plan_with_fallback(q, k, pat, offset=0, rates=KERNEL_ONLY)
    assert plan.dense == dense
    rep = SparseReport()
    out, lse = mi.minference_attention(q, k, v, q_pos=pos, k_pos=pos, pattern=pat, rates=KERNEL_ONLY, report=rep,
                                       backend=backend)
    check_split(out, lse, q, k, v, pos, dense, plan_vis(plan.groups, 1, 4, L, L, 0), dtype)
    assert (rep.heads_sparse, rep.heads_dense) == (2, 2)


@pytest.mark.parametrize("vertical", [8, 40, 100, 300])
def test_vertical_slash_choice_and_density_match_the_exact_count(vertical):
    """The plan reads each Vertical-Slash head's whole index cost in its one host read: the heads it
    sends dense and the densities it reports are the exact count's (kernel_cost of the whole index),
    small and large column budgets alike."""
    q, k, v, pos = inputs("structured")
    pat = pattern(mi.VerticalSlash(vertical, 16), mi.VerticalSlash(vertical, 48), mi.VerticalSlash(8, 16),
                  mi.VerticalSlash(vertical, 4))
    plan = mi.plan_with_fallback(q, k, pat, offset=0, rates=KERNEL_ONLY)
    (grp,) = mi.build_plan(q, k, pat, offset=0)
    exact = mi.plan.kernel_cost(grp, B=1, Lq=L, Lk=L, offset=0, block_size=BM)[0].tolist()
    dense_e = mi.plan.dense_cost(Lq=L, Lk=L, offset=0, block_size=BM)
    frac = KERNEL_ONLY.vertical_slash
    assert plan.dense == [h for h in range(4) if exact[h] / dense_e >= frac]
    for h in range(4):
        if h not in plan.dense:
            assert float(plan.density[h]) == pytest.approx(exact[h] / dense_e, rel=1e-12)


def test_causal_attention_is_the_square_dispatcher_call():
    """The sparse methods' dense heads skip the position read when the layout is square index-causal:
    same (out, lse) as the dispatcher given positions; other shapes refused."""
    q, k, v, pos = inputs("random")
    out, lse = causal_attention(q, k, v)
    want = attention(q, k, v, q_pos=pos, k_pos=pos)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    with pytest.raises(ValueError, match="as many keys as query rows"):
        causal_attention(q[:, :, :100], k, v)


@pytest.mark.parametrize("Lq,Lk,off", [(97, 97, 0), (83, 200, 117), (40, 131, 91), (30, 120, 100)])
def test_causal_attention_at_offset(Lq, Lk, off):
    """The dense heads of an offset call: a tail block (Lk = off + Lq) as a full part and a square
    causal part merged by lse; a block whose keys end past it (the last case: keys 0..119, rows at
    100..129) through the position mask. Against float64, GQA 6 / 2, odd lengths, two batch rows."""
    g = torch.Generator().manual_seed(Lq)
    q = torch.randn(2, 6, Lq, 24, generator=g)
    k, v = torch.randn(2, 2, Lk, 24, generator=g), torch.randn(2, 2, Lk, 24, generator=g)
    q_pos, k_pos = torch.arange(off, off + Lq), torch.arange(Lk)
    vis = (k_pos[None, :] <= q_pos[:, None]).expand(2, 6, -1, -1)
    ref, ref_lse = masked_reference(q, k, v, vis)
    out, lse = causal_attention_at(q, k, v, q_pos=q_pos, k_pos=k_pos, offset=off)
    assert_matches(out, lse, ref, ref_lse, torch.float32)


def test_query_block_after_its_keys_and_batch():
    """A tail query block (offset > 0), two batch rows, GQA 6 / 2: the head costs add over the batch,
    and the split still returns dense heads exactly as the dense path computes them (the tail layout's
    full + causal split, test_causal_attention_at_offset), and close to float64."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 96, 32, generator=g)
    k, v = torch.randn(2, 2, 400, 32, generator=g), torch.randn(2, 2, 400, 32, generator=g)
    k_pos, q_pos = torch.arange(400), torch.arange(304, 400)
    pat = pattern(mi.AShape(4, 24), mi.VerticalSlash(16, 64), mi.AShape(2, 16), mi.Dense(), mi.BlockSparse(2),
                  mi.AShape(4, 24))
    plan = mi.plan_with_fallback(q, k, pat, offset=304, rates=KERNEL_ONLY)
    assert plan.dense == [1, 3] and sorted(h for grp in plan.groups for h in grp.heads) == [0, 2, 4, 5]
    out, lse = mi.minference_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, pattern=pat, rates=KERNEL_ONLY)
    want = causal_attention_at(*head_subset(q, k, v, [1, 3]), q_pos=q_pos, k_pos=k_pos, offset=304)
    assert torch.equal(out[:, [1, 3]], want[0]) and torch.equal(lse[:, [1, 3]], want[1])
    causal = (k_pos[None, :] <= q_pos[:, None]).expand(2, 2, -1, -1)
    assert_matches(out[:, [1, 3]], lse[:, [1, 3]], *masked_reference(*head_subset(q, k, v, [1, 3]), causal),
                   torch.float32)
    vis = plan_vis(plan.groups, 2, 6, 96, 400, 304)
    ref, ref_lse = masked_reference(q, k, v, vis)
    sp = [0, 2, 4, 5]
    assert_matches(out[:, sp], lse[:, sp], ref[:, sp], ref_lse[:, sp], torch.float32)


def test_kernel_rates_rule():
    r = mi.KernelRates(dense=1e12, a_shape=0.3, vertical_slash=0.5, block_sparse=0.7)
    assert r.sparse_wins("vertical_slash", 0.45, 1.0) and not r.sparse_wins("vertical_slash", 0.55, 1.0)
    assert r.sparse_wins("block_sparse", 0.65, 1.0) and not r.sparse_wins("a_shape", 0.35, 1.0)
    # seconds of index work count against the sparse side
    dense_e = 1e9  # entries: 1 ms dense
    assert r.sparse_wins("vertical_slash", 0.1 * dense_e, dense_e) and not r.sparse_wins(
        "vertical_slash", 0.1 * dense_e, dense_e, index_s=1e-3)


def test_measured_rates_by_head_dim():
    """Each head dim gets the rates measured for its launch; unmeasured wide heads the slowest known."""
    assert mi.measured_rates(32) is mi.measured_rates(64) is mi.MEASURED_RATES[64]
    assert mi.measured_rates(96) is mi.measured_rates(128) is mi.MEASURED_RATES[128]
    wide = mi.measured_rates(256)
    for kind in ("a_shape", "vertical_slash", "block_sparse"):
        assert wide.fraction(kind) < min(r.fraction(kind) for r in mi.MEASURED_RATES.values())
    assert an.measured_anchor_rates(64) is an.MEASURED_ANCHOR_RATES[64]
    assert an.measured_anchor_rates(128) is an.MEASURED_ANCHOR_RATES[128]
    assert an.measured_anchor_rates(256).kernel < min(r.kernel for r in an.MEASURED_ANCHOR_RATES.values())


# ---- AnchorAttention -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_anchor_falls_back_where_stripes_keep_most_keys(backend):
    """KV head 0 structured (stripes keep few keys: sparse), KV head 1 random (flat scores: theta 2
    keeps most candidates: dense), and query head 1 zeroed (every score equal: all kept)."""
    n = 256
    qs, ks, vs, pos = inputs("structured", n=n)
    qr, kr, vr, _ = inputs("random", seed=1, n=n)
    q, k, v = torch.cat([qs[:, :2], qr[:, 2:]], 1), torch.cat([ks[:, :1], kr[:, 1:]], 1), torch.cat([vs[:, :1], vr[:, 1:]], 1)
    q[:, 1] = 0.0
    cfg = an.AnchorConfig(theta=2.0, block_q=16, block_k=16, init_tokens=4, step=1)
    idx = an.build_index(q, k, cfg, offset=0, backend=backend)
    dens = an.head_density(idx, cfg, Lq=n, Lk=n, offset=0)[0].tolist()
    assert dens[0] < 0.2 and min(dens[1:]) > ANCHOR_RATES.kernel
    rep = SparseReport()
    per_head = dataclasses.replace(ANCHOR_RATES, call_density=2.0)  # no per-call floor: heads priced alone
    out, lse = an.anchor_attention(q, k, v, q_pos=pos, k_pos=pos, config=cfg, backend=backend,
                                   rates=per_head, report=rep)
    rows = torch.arange(n)
    vis = an.anchor_region(cfg, Lq=n, Lk=n, offset=0, rows=rows) | an.selected_mask(idx, n)[:, :, rows // 16]
    check_split(out, lse, q, k, v, pos, [1, 2, 3], vis, torch.float32)
    assert rep.as_dict() == {"calls": 1, "heads_sparse": 1, "heads_dense": 3, "heads_skipped": 0,
                             "mean_density": pytest.approx(dens[0]), "calls_fallen_back": 0, "fallen_back_by_layer": {}}
    # the default floor (the break-even density): the heads' mean is past it, so the call runs dense whole
    assert sum(dens) / 4 >= ANCHOR_RATES.kernel
    rep = SparseReport()
    out, lse = an.anchor_attention(q, k, v, q_pos=pos, k_pos=pos, config=cfg, backend=backend,
                                   rates=ANCHOR_RATES, report=rep)
    want = attention(q, k, v, q_pos=pos, k_pos=pos)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert (rep.calls_fallen_back, rep.heads_dense, rep.heads_sparse) == (1, 4, 0)
    if backend == "triton":  # the interpreter is slow; the rest is backend-independent
        return
    # every head dense-like (random inputs): the whole call is the dense dispatcher's
    out, lse = an.anchor_attention(qr, kr, vr, q_pos=pos, k_pos=pos, config=cfg, backend=backend,
                                   rates=ANCHOR_RATES)
    want = attention(qr, kr, vr, q_pos=pos, k_pos=pos)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    # sparse-like everywhere: nothing changes against the plain call
    a = an.anchor_attention(qs, ks, vs, q_pos=pos, k_pos=pos, config=cfg, backend=backend, rates=ANCHOR_RATES)
    b = an.anchor_attention(qs, ks, vs, q_pos=pos, k_pos=pos, config=cfg, backend=backend)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---- the installed method: min_length, defaults, report ------------------------------------------


def test_min_length_skips_estimation():
    q, k, v, pos = inputs("structured")
    cfg = SparseConfig("minference", min_length=L + 1)
    method = load_sparse_method(cfg)
    spec = method.pattern(0, 4)
    calls = []
    orig = mi.attend.start_plan

    def spy(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(mi.attend, "start_plan", spy)
    try:
        out, lse = spec.attention(q, k, v, q_pos=pos, k_pos=pos)
        assert calls == []  # nothing estimated
        want = attention(q, k, v, q_pos=pos, k_pos=pos)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        assert method.report.as_dict() == {"calls": 1, "heads_skipped": 4, "heads_sparse": 0, "heads_dense": 0,
                                           "mean_density": None, "calls_fallen_back": 0, "fallen_back_by_layer": {}}
        # at the length: estimated (CPU default: no cost model, the pattern runs as asked)
        at = load_sparse_method(dataclasses.replace(cfg, min_length=L))
        out2, _ = at.pattern(0, 4).attention(q, k, v, q_pos=pos, k_pos=pos)
        assert calls == [1] and at.report.heads_sparse == 4
        plain = mi.MInferenceConfig().pattern(0, 4).attention(q, k, v, q_pos=pos, k_pos=pos)
        torch.testing.assert_close(out2, plain[0], rtol=0, atol=0)
    finally:
        mp.undo()
    # anchor takes the same guard
    an_method = load_sparse_method(SparseConfig("anchor", min_length=10**6))
    out3, _ = an_method.pattern(0, 4).attention(q, k, v, q_pos=pos, k_pos=pos)
    assert torch.equal(out3, want[0]) and an_method.report.heads_skipped == 4


def test_defaults_per_device_and_validation():
    m = load_sparse_method(SparseConfig("minference"))
    a = load_sparse_method(SparseConfig("anchor"))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert MIN_LENGTH == 65537  # more than 64K keys (measured crossover, kernels/sparse.py)
    assert (m.min_length(cuda), m.min_length(cpu)) == (65537, 0)
    assert (a.min_length(cuda), a.min_length(cpu)) == (65537, 0)
    assert m.rates(cuda, 128) is mi.MEASURED_RATES[128]
    assert a.rates(cuda, 64) is an.MEASURED_ANCHOR_RATES[64]
    assert m.rates(cpu, 64) is None and a.rates(cpu, 64) is None  # nothing measured on CPU: patterns as asked
    forced = load_sparse_method(SparseConfig("minference", min_length=0, fallback=False))
    assert forced.min_length(cuda) == 0 and forced.rates(cuda, 64) is None
    on = load_sparse_method(SparseConfig("minference", fallback=True))
    assert on.rates(cpu, 64) is mi.MEASURED_RATES[64]
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="min_length"):
            SparseConfig("minference", min_length=bad)


def test_report_through_the_model():
    """--sparse on a model: the report counts (call, head) pairs per prefill, decode steps not at all,
    and dense-like random weights send every head to the dense kernel when the cost model is on."""
    ids = torch.randint(0, 512, (1, 160), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, cfg in {"dense": None,
                      "fallback": SparseConfig("minference", min_length=0, fallback=True),
                      "forced": SparseConfig("minference", min_length=0, fallback=False),
                      "skipped": SparseConfig("minference", min_length=161, fallback=True)}.items():
        llm = LLM(random_weights="tiny", progress=False, device="cpu", dtype=torch.float32, sparse=cfg)
        model = llm.model
        with torch.inference_mode():
            cache = llm.runner.new_cache(200)
            logits = model(ids, cache=cache, last_only=True)
            model(ids[:, :1], cache=cache)  # a decode step: not counted
        runs[name] = (logits, sparse_report(model))
    layers, heads = 2, 4  # the tiny preset
    assert runs["dense"][1] is None
    fb = runs["fallback"][1]
    assert fb["calls"] == layers and fb["heads_dense"] == layers * heads and fb["heads_sparse"] == 0
    torch.testing.assert_close(runs["fallback"][0], runs["dense"][0], rtol=0, atol=0)
    forced = runs["forced"][1]
    assert forced["heads_sparse"] == layers * heads and 0 < forced["mean_density"] <= 1.01
    sk = runs["skipped"][1]
    assert sk["heads_skipped"] == layers * heads and sk["heads_sparse"] == sk["heads_dense"] == 0
    torch.testing.assert_close(runs["skipped"][0], runs["dense"][0], rtol=0, atol=0)


def test_pattern_for_and_install_keep_working_with_the_wrapper():
    """install_sparse with a bare method (no wrapper) still works; with the wrapper, pattern_for hands
    out its guarded spec, and a decode-sized call stays dense without touching the report."""
    class Attn:
        sparse = None

    class Block:
        def __init__(self):
            self.attention = Attn()

    class Model:
        layers = [Block(), Block()]

    model = Model()
    method = load_sparse_method(SparseConfig("minference", min_length=0))
    install_sparse(model, method)
    assert isinstance(model.layers[1].attention.sparse.method, FallbackSparse)
    q = torch.zeros(1, 4, 8, 16)
    assert pattern_for(model.layers[0].attention.sparse, q) is None
    spec = pattern_for(model.layers[0].attention.sparse, torch.zeros(1, 4, 32, 16))
    assert spec.owner is method
    assert sparse_report(model) == SparseReport().as_dict()
    install_sparse(model, mi.MInferenceConfig())
    assert sparse_report(model) is None
