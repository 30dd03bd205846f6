"""MInference sparse prefill kernels against independent float64 references built from the same
indices; index builders against plain-torch loops; configs (ours and MInference's published format);
the offline search and the benchmark script on CPU.

The Triton kernel runs on CPU through TRITON_INTERPRET=1 (set before minference.py is imported), at
small sizes and float32/float16 only (bfloat16 is not faithful in the interpreter). block_size 16
makes the short test sequences span several row blocks.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from starshard.kernels import minference as mi  # noqa: E402
from starshard.kernels.attention import attention  # noqa: E402
from tests.helpers.sm90_compile import assert_compiles_for_sm90  # noqa: E402
from tests.helpers.sparse_reference import assert_matches, masked_reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = Path(__file__).resolve().parents[1] / "helpers" / "data" / "minference_published_sample.json"
BM = 16

# name: B, Hq, Hkv, Lq, Lk, D, offset (q_pos[0] - k_pos[0]); keys start at global position 7
LAYOUTS = {
    "square": (1, 4, 2, 100, 100, 32, 0),
    "tail": (1, 4, 4, 40, 100, 32, 60),  # the query block is the last 40 of 100 keys
    "batch_gqa_d24": (2, 4, 1, 72, 72, 24, 0),
    "gqa_d96": (1, 4, 2, 100, 100, 96, 0),  # padded to 128: the default launch streams runs flat
}


def make(layout, dtype, seed=0):
    B, hq, hkv, lq, lk, d, off = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, hq, lq, d, generator=g) * 1.5).to(dtype)  # peakier than unit scores
    k = torch.randn(B, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(B, hkv, lk, d, generator=g).to(dtype)
    k_pos = torch.arange(lk) + 7
    q_pos = torch.arange(lq) + 7 + off
    return q, k, v, q_pos, k_pos, off


# ---- independent references ----------------------------------------------------------------------


def causal_vis(lq, lk, off):
    return torch.arange(lk)[None, :] <= (torch.arange(lq) + off)[:, None]


def ashape_vis(sink, local, lq, lk, off):
    i = torch.arange(lq)[:, None] + off
    j = torch.arange(lk)[None, :]
    return (j <= i) & ((j < sink) | (i - j < local))


def vs_vis(cols, diags, lq, lk, off, bm):
    """Row i of row block m (first key index b = m*bm + off) sees key j <= i+off if j is a chosen
    column or b - d <= j < b - d + bm for a chosen diagonal d. Plain loops over rows and diagonals."""
    cols = [c for c in cols.tolist() if c < lk]
    diags = [d for d in diags.tolist() if d < lq + off]
    vis = torch.zeros(lq, lk, dtype=torch.bool)
    for i in range(lq):
        b = (i // bm) * bm + off
        row = torch.zeros(lk, dtype=torch.bool)
        row[cols] = True
        for d in diags:
            lo, hi = max(0, b - d), min(lk, b - d + bm)
            if lo < hi:
                row[lo:hi] = True
        vis[i] = row & (torch.arange(lk) <= i + off)
    return vis


def bs_vis(blocks, count, lq, lk, off, bm):
    vis = torch.zeros(lq, lk, dtype=torch.bool)
    for i in range(lq):
        for kb in blocks[i // bm, : count[i // bm]].tolist():
            vis[i, kb * bm : (kb + 1) * bm] = True
    return vis & causal_vis(lq, lk, off)


def reference_vis(pattern, groups, B, hq, lq, lk, off, bm):
    """[B, Hq, Lq, Lk] visibility from the head patterns and the raw selections in the plan's groups
    (chosen columns / diagonals / blocks, not the merged index)."""
    vis = torch.zeros(B, hq, lq, lk, dtype=torch.bool)
    heads = pattern.for_heads(hq)
    for grp in groups:
        for j, h in enumerate(grp.heads):
            for b in range(B):
                p = heads[h]
                if isinstance(p, mi.Dense):
                    vis[b, h] = causal_vis(lq, lk, off)
                elif isinstance(p, mi.AShape):
                    vis[b, h] = ashape_vis(p.sink, p.local, lq, lk, off)
                elif isinstance(p, mi.VerticalSlash):
                    vis[b, h] = vs_vis(grp.index.vertical[b, j], grp.index.slash[b, j], lq, lk, off, bm)
                else:
                    vis[b, h] = bs_vis(grp.index.blocks[b, j], grp.index.count[b, j], lq, lk, off, bm)
    return vis


SPARSE_HEADS = (mi.AShape(sink=3, local=20), mi.VerticalSlash(6, 10), mi.BlockSparse(2), mi.VerticalSlash(3, 40))


def sparse_pattern(**kw):
    return mi.SparsePattern(SPARSE_HEADS, block_size=BM, last_q=16, force_sink=2, force_local=5, **kw)


# ---- kernels -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kernel_matches_masked_reference(layout, dtype):
    q, k, v, q_pos, k_pos, off = make(layout, dtype)
    B, hq, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    pattern = sparse_pattern()
    groups = mi.build_plan(q, k, pattern, offset=off)
    vis = reference_vis(pattern, groups, B, hq, lq, lk, off, BM)
    assert (vis.sum(-1) < causal_vis(lq, lk, off).sum(-1)).any()  # really sparse
    ref, ref_lse = masked_reference(q, k, v, vis)
    out, lse = mi.minference_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, pattern=pattern, backend="triton")
    assert_matches(out, lse, ref, ref_lse, dtype)
    out_t, lse_t = mi.minference_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, pattern=pattern, backend="torch")
    assert_matches(out_t, lse_t, ref, ref_lse, dtype)


@pytest.mark.parametrize("case", ["square-fp32", "tail-fp32", "batch_gqa_d24-fp32", "tail-fp16"])
def test_full_budgets_equal_dense(case):
    layout, dt = case.split("-")
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[dt]
    q, k, v, q_pos, k_pos, off = make(layout, dtype, seed=1)
    big = 10**6
    pattern = mi.SparsePattern((mi.AShape(0, big), mi.VerticalSlash(big, big), mi.BlockSparse(big), mi.Dense()),
                               block_size=BM, last_q=16)
    ref, ref_lse = masked_reference(q, k, v, causal_vis(q.shape[2], k.shape[2], off).expand(q.shape[0], q.shape[1], -1, -1))
    for backend in ("triton", "torch"):
        out, lse = mi.minference_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, pattern=pattern, backend=backend)
        assert_matches(out, lse, ref, ref_lse, dtype)


def test_queries_past_the_keys_and_faithful_estimate():
    """Query block entirely after its keys (off > Lk - Lq), MInference's raw slash estimate."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 2, 40, 32, generator=g), torch.randn(1, 2, 50, 32, generator=g), torch.randn(1, 2, 50, 32, generator=g)
    k_pos, q_pos = torch.arange(50), torch.arange(60, 100)
    pattern = mi.SparsePattern((mi.VerticalSlash(5, 30), mi.BlockSparse(2)), block_size=BM, last_q=16, vertical_aware=False)
    groups = mi.build_plan(q, k, pattern, offset=60)
    ref, ref_lse = masked_reference(q, k, v, reference_vis(pattern, groups, 1, 2, 40, 50, 60, BM))
    out, lse = mi.minference_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, pattern=pattern, backend="triton")
    assert_matches(out, lse, ref, ref_lse, torch.float32)


def test_gapped_positions_query_is_tail_of_keys():
    """Star's [anchor; block] layout: positions with a gap, q_pos == k_pos (index-space causal)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, 2, 60, 32, generator=g), torch.randn(1, 2, 60, 32, generator=g), torch.randn(1, 2, 60, 32, generator=g)
    pos = torch.cat([torch.arange(12), torch.arange(500, 548)])
    pattern = mi.SparsePattern((mi.VerticalSlash(4, 12), mi.AShape(4, 9)), block_size=BM, last_q=16, force_sink=2, force_local=3)
    assert mi.query_offset(pos, pos, 60, 60) == 0 and mi.query_offset(pos[20:], pos, 40, 60) == 20
    groups = mi.build_plan(q, k, pattern, offset=0)
    ref, ref_lse = masked_reference(q, k, v, reference_vis(pattern, groups, 1, 2, 60, 60, 0, BM))
    out, lse = mi.minference_attention(q, k, v, q_pos=pos, k_pos=pos, pattern=pattern, backend="triton")
    assert_matches(out, lse, ref, ref_lse, torch.float32)
    with pytest.raises(ValueError, match="last entries"):
        mi.query_offset(pos[:30], pos, 30, 60)


_COMPILE = """
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from starshard.kernels.minference import kernel as mk

def build(dt, mode):
    fn = mk._minference_fwd
    ints = {"HEADS", "P0", "P1", "SEG", "SEGN", "IDX", "CNT", "CFULL"}
    sig = {n: "*i32" if n in ints else ("fp32" if n == "qk_scale" else "i32") for n in fn.arg_names}
    sig.update({n: "*" + dt for n in ("Q", "K", "V", "O")}, LSE="*fp32")
    sig.update({n: "constexpr" for n in ("MODE", "HEAD_DIM", "BLOCK_D", "BLOCK_M", "BLOCK_N", "IEEE", "FLAT")})
    warps, stages = mk.default_launch(128, kind=("a_shape", "vertical_slash", "block_sparse")[mode])
    consts = dict(MODE=mode, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, IEEE=dt == "fp32",
                  FLAT=mode == 1 and mk.default_flat(128))
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    return "wgmma" in k.asm["ptx"] or dt == "fp32"

# the variants build apart (ptxas and Triton's passes are CPU-bound): one process per core
jobs = [("bf16", 0), ("bf16", 1), ("bf16", 2), ("fp32", 1)]
with ProcessPoolExecutor(min(len(jobs), os.cpu_count() or 1), mp_context=mp.get_context("fork")) as pool:
    ok = list(pool.map(build, *zip(*jobs)))
assert all(ok), [j for j, o in zip(jobs, ok) if not o]
print("compiled")
"""


def test_kernel_compiles_for_sm90(tmp_path):
    """The interpreter skips Triton's compiler: build the real kernel (sm_90a cubin, no GPU needed)."""
    assert_compiles_for_sm90(_COMPILE, tmp_path)


# ---- index builders ------------------------------------------------------------------------------


def plain_scores(q, k, off, last_q, heads, drop=None):
    """Vertical / slash sums of softmax rows (float64 loops). drop[h]: columns left out of slash sums."""
    hq, lq, d = q.shape[1:]
    g = hq // k.shape[1]
    lk = k.shape[2]
    R = min(last_q, lq)
    vert = torch.zeros(len(heads), lk, dtype=torch.float64)
    slash = torch.zeros(len(heads), lq + off, dtype=torch.float64)
    for n, h in enumerate(heads):
        for r in range(lq - R, lq):
            s = (k[0, h // g].double() @ q[0, h, r].double()) * d**-0.5
            s[torch.arange(lk) > r + off] = float("-inf")
            p = torch.softmax(s, 0)
            vert[n] += p
            for j in range(min(lk, r + off + 1)):
                if drop is None or j not in drop[n]:
                    slash[n, r + off - j] += p[j]
    return vert, slash


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "kernel"])
def test_vs_scores_and_selection_match_plain_torch(use_triton):
    """The estimate (torch ops, or estimate.py's kernels under the interpreter) against float64 loops."""
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, 48, 16, generator=g) * 2, torch.randn(1, 2, 80, 16, generator=g)
    off, heads = 32, [1, 2]
    vs, ss = mi.vs_scores(q, k, offset=off, last_q=16, heads=heads, use_triton=use_triton)
    pv, ps = plain_scores(q, k, off, 16, heads)
    torch.testing.assert_close(vs[0].double(), pv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ss[0].double(), ps, rtol=1e-5, atol=1e-6)
    # picks: forced first columns / nearest diagonals, then the largest estimates; per-head budgets
    v_idx, s_idx = mi.vs_pick(vs, ss, vertical=[4, 6], slash=[5, 9], rows=16, force_sink=2, force_local=3)
    for n, (kv, ks) in enumerate([(4, 5), (6, 9)]):
        want_v = {0, 1} | set(torch.topk(pv[n, 2:], kv - 2).indices.add(2).tolist())
        want_s = {0, 1, 2} | set(torch.topk(ps[n, 3:], ks - 3).indices.add(3).tolist())
        assert set(v_idx[0, n, :kv].tolist()) == want_v and (v_idx[0, n, kv:] == 80).all()
        assert set(s_idx[0, n, :ks].tolist()) == want_s and (s_idx[0, n, ks:] == 80).all()
        assert (v_idx[0, n].diff() >= 0).all() and (s_idx[0, n].diff() >= 0).all()
    # vertical-aware estimate: chosen columns outside the raw near-diagonal band leave the slash sums
    v2, vs2, ss2 = mi.vs_estimate(q, k, offset=off, vertical=[4, 6], slash=[5, 9], last_q=16, force_sink=2,
                                  force_local=3, heads=heads, use_triton=use_triton)
    assert torch.equal(v2, v_idx)
    drop = []
    for n in range(2):
        band = 0
        while band < s_idx.shape[-1] and s_idx[0, n, band] == band:
            band += 1
        first = 48 - 16 + off
        drop.append({c for c in v_idx[0, n].tolist() if c < 80 and first - c > band})
    assert any(drop)
    _, ps2 = plain_scores(q, k, off, 16, heads, drop)
    torch.testing.assert_close(ss2[0].double(), ps2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(vs2, vs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_estimate_kernels_match_torch_path(dtype):
    """estimate.py's two launches (interpreted) give the torch path's scores and picks: batch 2, GQA,
    head dim 24 (padded tile), keys past several 128-key blocks and chunks, a query block after its
    keys, and more estimate rows than query rows."""
    g = torch.Generator().manual_seed(11)
    for B, hq, hkv, lq, lk, d, last_q in [(2, 4, 2, 40, 301, 24, 16), (1, 3, 1, 20, 150, 16, 64)]:
        off = lk - lq
        q = (torch.randn(B, hq, lq, d, generator=g) * 2).to(dtype)
        k = torch.randn(B, hkv, lk, d, generator=g).to(dtype)
        kw = dict(offset=off, vertical=5, slash=7, last_q=last_q, force_sink=2, force_local=3)
        v_t, vs_t, ss_t = mi.vs_estimate(q, k, use_triton=False, **kw)
        v_k, vs_k, ss_k = mi.vs_estimate(q, k, use_triton=True, **kw)
        tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=1e-4)
        torch.testing.assert_close(vs_k, vs_t, **tol)
        torch.testing.assert_close(ss_k, ss_t, **tol)
        assert torch.equal(v_k, v_t)
        rows = min(last_q, lq)
        torch.testing.assert_close(vs_k.sum(-1), torch.full_like(vs_k.sum(-1), float(rows)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("seed", range(4))
def test_vs_index_matches_plain_merge(seed, use_triton):
    """Column lists (torch ops, or columns.py's kernel under the interpreter) against plain set logic."""
    lq, lk, off = 70, 110, 40
    ndiag = lq + off
    g = torch.Generator().manual_seed(seed)
    cols, diags = [], []
    for _ in range(2):
        c = torch.randperm(lk, generator=g)[: 12].tolist()
        # adversarial diagonals: gaps of exactly BM and BM + 1, the first and last ones, a dense run
        d = {0, 1, 2, 20, 20 + BM, 20 + 2 * BM + 1, ndiag - 1, 70, 71, 72, 73}
        d |= set(torch.randperm(ndiag, generator=g)[:6].tolist())
        cols.append(sorted(c) + [lk] * 3)
        diags.append(sorted(d) + [ndiag] * (20 - len(d)))
    v_idx, s_idx = torch.tensor([cols]), torch.tensor([diags])
    ix = mi.vs_index(v_idx, s_idx, Lq=lq, Lk=lk, offset=off, block_size=BM, use_triton=use_triton)
    for n in range(2):
        dd = [x for x in diags[n] if x < ndiag]
        for m in range(-(-lq // BM)):
            b = m * BM + off
            covered = set()
            for x in dd:
                covered |= set(range(max(0, b - x), min(lk, b - x + BM)))
            # the runs, read as key ranges of this row block, are disjoint and cover exactly that
            ranges = []
            for s in range(int(ix.seg_count[0, n])):
                f, l = ix.seg[0, n, s].tolist()
                lo, hi = max(0, b - l), min(lk, b + BM - f)
                if lo < hi:
                    ranges.append(set(range(lo, hi)))
            assert sum(len(r) for r in ranges) == len(set().union(*ranges)) == len(covered)
            assert set().union(*ranges) == covered
            want = [c for c in cols[n] if c < lk and c < b + BM and c not in covered]
            cnt = int(ix.col_count[0, n, m])
            assert ix.col[0, n, m, :cnt].tolist() == want
            assert int(ix.col_full[0, n, m]) == sum(c <= b for c in want)


@pytest.mark.parametrize("ks", [0, 9])
def test_vs_index_kernel_equals_torch_path(ks):
    """columns.py's kernel writes exactly the torch path's index: more columns than one 512-column tile,
    no slash runs at all, batch 2."""
    g = torch.Generator().manual_seed(3)
    lq, lk, off, bm = 300, 1400, 1100, 32
    ndiag = lq + off
    v = torch.sort(torch.stack([torch.randperm(lk, generator=g)[:700] for _ in range(6)]).view(2, 3, 700), -1).values
    v[..., -20:] = lk  # padding
    if ks:
        s = torch.sort(torch.stack([torch.randperm(ndiag, generator=g)[:ks] for _ in range(6)]).view(2, 3, ks), -1).values
    else:
        s = torch.zeros(2, 3, 0, dtype=torch.long)
    a = mi.vs_index(v, s, Lq=lq, Lk=lk, offset=off, block_size=bm, use_triton=False)
    b = mi.vs_index(v, s, Lq=lq, Lk=lk, offset=off, block_size=bm, use_triton=True)
    for name in ("col", "col_count", "col_full", "seg", "seg_count"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert int(a.col_count.max()) > 512


def test_bs_select_matches_plain():
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, 4, 52, 8, generator=g), torch.randn(1, 2, 90, 8, generator=g)
    off, heads, topk = 38, [0, 3], [3, 5]
    ix = mi.bs_select(q, k, offset=off, topk=topk, block_size=BM, heads=heads)
    nm, nn = -(-52 // BM), -(-90 // BM)
    for n, h in enumerate(heads):
        for m in range(nm):
            rows = q[0, h, m * BM : (m + 1) * BM].double().mean(0)
            first, last = m * BM + off, min(52, (m + 1) * BM) - 1 + off
            cand = {}
            for kb in range(nn):
                if kb * BM > last:
                    continue
                key = k[0, h // 2, kb * BM : (kb + 1) * BM].double().mean(0)
                forced = kb * BM + BM - 1 >= first
                cand[kb] = float("inf") if forced else float(rows @ key) * 8**-0.5
            want = sorted(sorted(cand, key=lambda x: -cand[x])[: topk[n]])
            cnt = int(ix.count[0, n, m])
            assert ix.blocks[0, n, m, :cnt].tolist() == want
            assert int(ix.full[0, n, m]) == sum(kb * BM + BM <= min(first + 1, 90) for kb in want)


def test_kernel_cost_counts_chunks():
    q, k, v, q_pos, k_pos, off = make("tail", torch.float32)
    lq, lk = q.shape[2], k.shape[2]
    groups = mi.build_plan(q, k, sparse_pattern(), offset=off)
    nm = -(-lq // BM)
    for grp in groups:
        cost = mi.kernel_cost(grp, B=1, Lq=lq, Lk=lk, offset=off, block_size=BM)[0]
        for j in range(len(grp.heads)):
            chunks = 0
            for m in range(nm):
                b, last = m * BM + off, min(lq, (m + 1) * BM) - 1 + off
                if grp.kind == "vertical_slash":
                    for s in range(int(grp.index.seg_count[0, j])):
                        f, l = grp.index.seg[0, j, s].tolist()
                        chunks += -(-max(0, min(lk, b + BM - f) - max(0, b - l)) // BM)
                    chunks += -(-int(grp.index.col_count[0, j, m]) // BM)
                elif grp.kind == "block_sparse":
                    chunks += int(grp.index.count[0, j, m])
                else:
                    sink, local = grp.sink[j], grp.local[j]
                    cols = set(range(min(sink, lk))) | set(range(max(0, b - local + 1), min(last + 1, lk)))
                    if b - local + 1 > sink:
                        chunks += -(-min(sink, lk) // BM) + -(-(min(last + 1, lk) - (b - local + 1)) // BM)
                    else:
                        chunks += -(-min(last + 1, lk) // BM)
                    assert cols
            assert int(cost[j]) == chunks * BM * BM
    assert mi.dense_cost(Lq=lq, Lk=lk, offset=off, block_size=BM) == sum(
        -(-min(lk, min(lq, (m + 1) * BM) + off) // BM) * BM * BM for m in range(nm))


# ---- entry points --------------------------------------------------------------------------------


def test_entry_points_and_errors():
    q, k, v, q_pos, k_pos, off = make("square", torch.float32)
    pattern = sparse_pattern()
    a = pattern.attention(q, k, v, q_pos=q_pos, k_pos=k_pos)
    b = mi.minference_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, pattern=pattern, backend="torch")
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    # a single head pattern broadcasts; all-dense, decode-sized and non-causal calls are exact dense
    dense = attention(q, k, v, q_pos=q_pos, k_pos=k_pos)
    out = mi.minference_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, pattern=mi.Dense())
    torch.testing.assert_close(out[0], dense[0])
    short = mi.minference_attention(q[:, :, -8:], k, v, q_pos=q_pos[-8:], k_pos=k_pos, pattern=pattern)
    torch.testing.assert_close(short[0], attention(q[:, :, -8:], k, v, q_pos=q_pos[-8:], k_pos=k_pos)[0])
    full = mi.minference_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, pattern=pattern, causal=False)
    torch.testing.assert_close(full[0], attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=False)[0])
    with pytest.raises(ValueError, match="consecutive"):
        mi.minference_attention(q, k, v, q_pos=q_pos.flip(0), k_pos=k_pos, pattern=pattern)
    with pytest.raises(ValueError, match="start at or after"):
        mi.minference_attention(q, k, v, q_pos=q_pos - 3, k_pos=k_pos, pattern=pattern)
    with pytest.raises(ValueError, match="every batch row"):
        mi.minference_attention(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                                q_pos=torch.stack([q_pos, q_pos + 1]), k_pos=k_pos, pattern=pattern)
    with pytest.raises(ValueError, match="head patterns"):
        mi.minference_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, pattern=mi.SparsePattern(SPARSE_HEADS[:3]))
    with pytest.raises(TypeError, match="pattern\\(layer"):
        mi.minference_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, pattern=mi.MInferenceConfig())
    with pytest.raises(ValueError):
        mi.SparsePattern((mi.Dense(),), block_size=24)


# ---- configs -------------------------------------------------------------------------------------


def test_config_round_trip(tmp_path):
    cfg = mi.MInferenceConfig(
        layers=[{0: mi.AShape(8, 32, score=0.9), 1: mi.VerticalSlash(5, 7, score=0.5)}, {},
                {2: mi.BlockSparse(3), 0: mi.Dense()}],
        default=mi.VerticalSlash(10, 20), block_size=32, last_q=32, force_sink=4, force_local=8,
        vertical_aware=False, meta={"model": "x"})
    path = tmp_path / "cfg.json"
    cfg.save(path)
    back = mi.MInferenceConfig.load(path)
    assert back.to_dict() == {**cfg.to_dict(), "meta": {"model": "x", "source": str(path)}}
    assert back.layers[0][0].score == 0.9 and back.layers[0][1] == mi.VerticalSlash(5, 7)
    p = back.pattern(0, 3)
    assert p.heads == (mi.AShape(8, 32), mi.VerticalSlash(5, 7), mi.VerticalSlash(10, 20))
    assert (p.block_size, p.last_q, p.force_sink, p.force_local, p.vertical_aware) == (32, 32, 4, 8, False)
    assert back.pattern(1, 2).heads == (mi.VerticalSlash(10, 20),) * 2
    assert back.pattern(2, 2, head_offset=1).heads == (mi.VerticalSlash(10, 20), mi.BlockSparse(3))
    assert back.pattern(9, 1).heads == (mi.VerticalSlash(10, 20),)  # layers past the file: default
    # MInference's format both ways (dense heads become all-covering vertical_and_slash)
    pub = mi.MInferenceConfig.from_published(json.loads(json.dumps(cfg.to_published())))
    assert pub.layers[0][0] == mi.AShape(8, 32) and pub.layers[0][0].score == 0.9
    assert pub.layers[2][2] == mi.BlockSparse(mi.PUBLISHED_BLOCK_TOPK)
    assert isinstance(pub.layers[2][0], mi.VerticalSlash) and pub.layers[2][0].vertical >= 2**30
    with pytest.raises(ValueError):
        mi.MInferenceConfig.from_dict({"layers": []})
    with pytest.raises(ValueError, match="unknown head pattern"):
        mi.head_pattern({"pattern": "diagonal"})


def test_load_published_sample():
    cfg = mi.MInferenceConfig.load(PUBLISHED)
    assert len(cfg.layers) == 3
    assert cfg.layers[0][0] == mi.VerticalSlash(1000, 6096) and cfg.layers[0][0].score == 336
    assert cfg.layers[0][2] == mi.AShape(sink=100, local=800)
    assert cfg.layers[0][3] == mi.BlockSparse(100)  # MInference's runtime block budget
    assert cfg.layers[2][0] == mi.AShape(64, 512) and cfg.layers[1][0] == mi.VerticalSlash(3500, 100)
    assert cfg.head(1, 1) == mi.VerticalSlash(1000, 6096)  # missing head: MInference's default
    assert cfg.pattern(7, 4).heads == (mi.VerticalSlash(1000, 6096),) * 4
    p = cfg.pattern(0, 4)
    assert (p.block_size, p.last_q, p.force_sink, p.force_local) == (64, 64, 30, 100)
    # at 80 tokens every published budget covers everything: equals dense
    q, k, v, q_pos, k_pos, off = make("square", torch.float32)
    ref = attention(q[:, :, :80], k[:, :, :80], v[:, :, :80], q_pos=q_pos[:80], k_pos=k_pos[:80])
    out = mi.minference_attention(q[:, :, :80], k[:, :, :80], v[:, :, :80], q_pos=q_pos[:80], k_pos=k_pos[:80],
                                  pattern=p, backend="torch")
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)


# ---- search and bench ----------------------------------------------------------------------------


def test_search_layer_picks_vertical_slash_for_scattered_columns():
    from starshard.tools.minference_search import LayerSearch

    g = torch.Generator().manual_seed(11)
    L, D = 256, 32
    q, k = torch.randn(1, 2, L, D, generator=g) * 0.3, torch.randn(1, 2, L, D, generator=g) * 0.3
    cols = torch.randperm(L, generator=g)[:24]
    k[0, 0, cols, 0] += 12.0  # head 0: scattered heavy columns every query likes
    q[0, 0, :, 0] += 3.0
    pos = torch.arange(L, dtype=torch.float64)  # head 1: a local band (rotary-like phase)
    for f, w in enumerate((0.02, 0.05, 0.1)):
        q[0, 1, :, 2 * f], q[0, 1, :, 2 * f + 1] = 3 * torch.cos(w * pos), 3 * torch.sin(w * pos)
        k[0, 1, :, 2 * f], k[0, 1, :, 2 * f + 1] = 3 * torch.cos(w * pos), 3 * torch.sin(w * pos)
    s = LayerSearch(q, k, block_size=BM, last_q=16, force_sink=2, force_local=4, target=(8, 32))
    best = s.best()
    assert best[0].kind == "vertical_slash"
    assert all(0.0 <= p.score <= 1.0 for p in best)
    for h, p in enumerate(best):  # equal kernel cost: nothing above the target A-shape's
        sp = mi.SparsePattern((p,), block_size=BM, last_q=16, force_sink=2, force_local=4)
        grp = mi.build_plan(q[:, h : h + 1], k[:, h : h + 1], sp, offset=0)[0]
        assert int(mi.kernel_cost(grp, B=1, Lq=L, Lk=L, offset=0, block_size=BM)[0, 0]) <= int(s.target_cost[h])


def _two_heads(L=256, D=32):
    """Head 0: scattered heavy columns every query likes; head 1: a local band (rotary-like phase)."""
    g = torch.Generator().manual_seed(11)
    q, k = torch.randn(1, 2, L, D, generator=g) * 0.3, torch.randn(1, 2, L, D, generator=g) * 0.3
    cols = torch.randperm(L, generator=g)[:24]
    k[0, 0, cols, 0] += 12.0
    q[0, 0, :, 0] += 3.0
    pos = torch.arange(L, dtype=torch.float64)
    for f, w in enumerate((0.02, 0.05, 0.1)):
        q[0, 1, :, 2 * f], q[0, 1, :, 2 * f + 1] = 3 * torch.cos(w * pos), 3 * torch.sin(w * pos)
        k[0, 1, :, 2 * f], k[0, 1, :, 2 * f + 1] = 3 * torch.cos(w * pos), 3 * torch.sin(w * pos)
    return q, k


@pytest.mark.parametrize("vertical,slash", [(6, [40, 9]), (0, [30, 30]), (10, [0, 5])])
def test_search_scores_the_index_the_run_builds(vertical, slash):
    """The search's Vertical-Slash index for given budgets is the one `build_plan` builds at run time
    for those budgets (with the vertical-aware estimate the slash picks depend on the slash budget)."""
    from starshard.tools.minference_search import LayerSearch

    q, k = _two_heads()
    s = LayerSearch(q, k, block_size=BM, last_q=16, force_sink=2, force_local=4, target=(8, 32))
    got = s.vs_group(vertical, slash).index
    sp = mi.SparsePattern(tuple(mi.VerticalSlash(vertical, sl) for sl in slash), block_size=BM, last_q=16,
                          force_sink=2, force_local=4)
    want = mi.build_plan(q, k, sp, offset=0)[0].index
    for name in ("seg", "seg_count", "col", "col_count", "col_full"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("want", [0.9, 0.99])
def test_search_with_target_recall_picks_cheapest_pattern_reaching_it(want):
    """--target-recall: every head's pick reaches the recall, costs no more than any family's smallest
    budget reaching it, and one step less of its own budget falls short (the search's own index
    builders and recall)."""
    from starshard.tools.minference_search import LayerSearch

    q, k = _two_heads()
    s = LayerSearch(q, k, block_size=BM, last_q=16, force_sink=2, force_local=4, target=(8, 32), target_recall=want)
    n = s.Hq

    def group(p):  # the pattern on every head, as the search builds it
        if p.kind == "vertical_slash":
            return s.vs_group(p.vertical, [p.slash] * n)
        if p.kind == "block_sparse":
            return s.bs_group(torch.full((n,), p.topk))
        return mi.HeadGroup("a_shape", s.heads, sink=[p.sink] * n, local=[p.local] * n)

    cands = s.recall_candidates()
    best = s.best()
    assert {p.kind for p in best} - {"dense"}, "some head must reach the recall sparsely"
    for h, p in enumerate(best):
        if p.kind == "dense":
            assert all(float(c[1][h]) < 0 for c in cands) and p.score == 1.0
            continue
        grp = group(p)
        assert float(s._recall(grp)[h]) >= want and p.score >= want
        assert int(s._cost(grp)[h]) == min(int(c[2][h]) for c in cands if float(c[1][h]) >= 0)
        smaller = {"vertical_slash": lambda: mi.VerticalSlash(p.vertical, p.slash - 1) if p.slash > 0 else None,
                   "block_sparse": lambda: mi.BlockSparse(p.topk - 1) if p.topk > 1 else None,
                   "a_shape": lambda: mi.AShape(p.sink, p.local - 1) if p.local > 1 else None}[p.kind]()
        if smaller is not None:
            assert float(s._recall(group(smaller))[h]) < want
    with pytest.raises(ValueError, match="target_recall"):
        LayerSearch(q, k, block_size=BM, last_q=16, target=(8, 32), target_recall=1.5)


@pytest.mark.parametrize("target_recall", [0.95, None])
def test_search_takes_only_the_named_kinds(target_recall):
    """kinds=: every head takes one of the named families or dense, at the recall floor (or, at equal cost,
    the best recall among those families alone); an unknown or empty list is refused, naming the choices."""
    from starshard.tools.minference_search import KINDS, VERTICAL_SHARES, LayerSearch, parse_kinds

    q, k = _two_heads()
    kw = dict(block_size=BM, last_q=16, force_sink=2, force_local=4, target=(8, 32), target_recall=target_recall)
    per_family = {"a_shape": 1, "vertical_slash": len(VERTICAL_SHARES), "block_sparse": 1}  # candidates each
    for only in (("vertical_slash",), ("a_shape", "block_sparse")):
        s = LayerSearch(q, k, kinds=only, **kw)
        got = s.best()
        assert {p.kind for p in got} <= {*only, "dense"} and len(got) == 2
        assert len(s.families()) == len(s.candidates()) == sum(per_family[f] for f in only)
        if target_recall is not None:
            assert all(p.kind == "dense" or p.score >= target_recall for p in got)
        else:  # the best of the named families' candidates, as the whole search picks among all
            rec = torch.stack([c[1] for c in s.candidates()]).amax(0)
            assert [p.score for p in got] == [round(float(r), 6) for r in rec]
    assert parse_kinds(" block_sparse,a_shape ") == ("a_shape", "block_sparse")
    assert parse_kinds(",".join(KINDS)) == KINDS
    for bad in ("", "vertical", "a_shape,slash"):
        with pytest.raises(ValueError, match="give one or more of a_shape, vertical_slash, block_sparse"):
            parse_kinds(bad)


def test_search_by_block_holds_the_floor_on_every_sampled_block():
    """recall_by="block": each pick's every sampled query block (the last, partial one included) keeps the floor's
    share of its rows' attention mass, counted here from the dense softmax apart; never cheaper than the mean's
    pick; an unknown criterion is refused."""
    from starshard.tools.minference_search import LayerSearch

    q, k = _two_heads(L=250)  # the last block partial
    kw = dict(block_size=BM, last_q=16, force_sink=2, force_local=4, target=(8, 32), target_recall=0.95)
    by_mean, by_block = LayerSearch(q, k, **kw), LayerSearch(q, k, recall_by="block", **kw)
    assert int(by_block.blocks[-1]) == (250 - 1) // BM and int(by_block.block_rows[-1]) == 250 % BM
    picks, mean_picks = by_block.best(), by_mean.best()
    assert any(p.kind != "dense" for p in picks)
    scale = q.shape[-1] ** -0.5
    for h, p in enumerate(picks):
        if p.kind == "dense":
            continue
        grp = {"vertical_slash": lambda: by_block.vs_group(p.vertical, [p.slash] * 2),
               "block_sparse": lambda: by_block.bs_group(torch.full((2,), p.topk)),
               "a_shape": lambda: mi.HeadGroup("a_shape", [0, 1], sink=[p.sink] * 2, local=[p.local] * 2)}[p.kind]()
        every = torch.arange(mi._cdiv(250, BM))
        vis = mi.group_mask(grp, B=1, Lq=250, Lk=250, offset=0, block_size=BM, blocks=every)[0, h, :250].double()
        s = (q[0, h].double() @ k[0, h].double().T) * scale
        probs = torch.softmax(s.masked_fill(torch.ones(250, 250, dtype=torch.bool).tril().logical_not(), -torch.inf), -1)
        for b in by_block.blocks.tolist():
            rows = slice(b * BM, min(250, (b + 1) * BM))
            assert float((probs[rows] * vis[rows]).sum(-1).mean()) >= 0.95 - 1e-5, (h, p, b)
        assert float(by_block._cost(grp)[h]) >= min(float(c[2][h]) for c in by_mean.recall_candidates()
                                                   if float(c[1][h]) >= 0)
        assert mean_picks[h].kind == "dense" or p.score <= float(by_mean._recall(grp)[h]) + 1e-6
    with pytest.raises(ValueError, match="recall_by must be one of mean, block"):
        LayerSearch(q, k, recall_by="row", **kw)


def _default_checkpoint():
    try:
        from starshard.checkpoints.default import default_checkpoint

        return default_checkpoint(progress=False)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_search_cli_and_attend_restore(tmp_path):
    import starshard
    from starshard.engine.model import dense_attend
    from starshard.tools import minference_search as ms

    ckpt = _default_checkpoint()
    out, pub = tmp_path / "cfg.json", tmp_path / "published.json"
    summary = ms.main(["--model", str(ckpt), "--out", str(out), "--length", "160", "--layers", "0,3",
                       "--block-size", "16", "--last-q", "16", "--force-sink", "4", "--force-local", "8", "--quiet",
                       "--published", str(pub), "--equal-cost"])
    cfg = mi.MInferenceConfig.load(out)
    assert cfg.meta["target_recall"] is None and "equal kernel cost" in cfg.meta["score"]
    assert len(cfg.layers) == 30 and len(cfg.layers[0]) == 9 and len(cfg.layers[3]) == 9 and not cfg.layers[1]
    assert (cfg.block_size, cfg.last_q, cfg.force_sink, cfg.force_local) == (16, 16, 4, 8)
    assert summary["heads"] == 18 and cfg.meta["searched_layers"] == [0, 3]
    assert all(0.0 <= p.score <= 1.0 for p in cfg.layers[0].values())
    assert len(mi.MInferenceConfig.load(pub).layers[0]) == 9
    model = starshard.load_model(ckpt)
    found = ms.run_search(model, list(range(100, 228)), layers=[1], progress=False, block_size=16, last_q=16)
    assert len(found[1]) == 9 and not found[0]
    assert not model.hooked and all(fn is dense_attend for fn in model.layer_attends())


def test_search_cli_target_recall(tmp_path):
    """--target-recall through the CLI: recorded in the config's meta, every searched head reaching it
    (or dense), and the file runs through the sparse attention path."""
    from starshard.tools import minference_search as ms

    ckpt = _default_checkpoint()
    out = tmp_path / "cfg.json"
    ms.main(["--model", str(ckpt), "--out", str(out), "--length", "160", "--layers", "2", "--block-size", "16",
             "--last-q", "16", "--force-sink", "4", "--force-local", "8", "--target-recall", "0.97", "--quiet"])
    cfg = mi.MInferenceConfig.load(out)
    assert cfg.meta["target_recall"] == 0.97 and "0.97" in cfg.meta["score"]
    # without the flag the recall floor is the measured 0.99
    ms.main(["--model", str(ckpt), "--out", str(out), "--length", "160", "--layers", "2", "--block-size", "16",
             "--last-q", "16", "--force-sink", "4", "--force-local", "8", "--quiet"])
    dflt = mi.MInferenceConfig.load(out)
    assert dflt.meta["target_recall"] == 0.99 and all(p.score >= 0.99 for p in dflt.layers[2].values())
    assert len(cfg.layers[2]) == 9 and all(p.score >= 0.97 for p in cfg.layers[2].values())
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 9, 96, 64, generator=g) for _ in range(3))
    pos = torch.arange(96)
    out_sparse, _ = attention(q, k, v, q_pos=pos, k_pos=pos, sparse=cfg.pattern(2, num_heads=9))
    assert torch.isfinite(out_sparse).all()
    with pytest.raises(SystemExit):
        ms.main(["--out", str(out), "--target-recall", "abc"])


def test_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # torch path: fast on CPU
    subprocess.run([sys.executable, str(ROOT / "launch" / "bench.py"), "sparse", "--device", "cpu", "--lengths", "256",
                    "--heads", "2", "--head-dim", "32", "--dtype", "float32", "--repeats", "1", "--warmup", "0",
                    "--patterns", "vs:30,64;vs_mi:30,64;ashape:16,64;bs:3", "--block-size", "16", "--out", str(out)],
                   check=True, cwd=ROOT, env=env, capture_output=True, timeout=600)
    r = json.loads(out.read_text())
    assert r["config"]["sparse_backend"] == "torch"
    (row,) = r["results"]
    assert row["length"] == 256 and row["dense_sdpa_cpu_ms"] > 0
    assert [p["name"] for p in row["patterns"]] == ["vs_30_64", "vs_mi_30_64", "ashape_16_64", "bs_3"]
    for p in row["patterns"]:
        assert 0 < p["density"] < 1 and 0 < p["recall"] <= 1 and p["rel_err"] < 1e-4
        assert p["index_ms"] >= 0 and p["kernel_ms"] > 0 and p["total_ms"] > 0


def test_models_take_their_shipped_configs(tmp_path, monkeypatch, caplog):
    """--sparse minference on the embedded default model runs the shipped recall-0.99 patterns, --sparse anchor on
    qwen2.5-coder-1.5b-instruct its shipped 128K calibration, found from the checkpoint (the GGUF's sha256 in its
    manifest; for an entry converted before the manifest recorded it, the cache entry it is), however the model
    was given; a given config file, a threshold or pooling given, another method and any other model keep what
    they were given."""
    import starshard
    from starshard.checkpoints import cache
    from starshard.checkpoints.default import DEFAULT_MINFERENCE_CONFIG
    from starshard.checkpoints.named import MODELS, shipped_sparse_configs, with_shipped_config
    from starshard.kernels.anchor_model import AnchorModelConfig
    from starshard.kernels.sparse import SparseConfig, sparse_report

    cfg = mi.MInferenceConfig.load(DEFAULT_MINFERENCE_CONFIG)  # shipped with the package, SmolLM2's shape
    assert len(cfg.layers) == 30 and all(len(layer) == 9 for layer in cfg.layers)
    assert cfg.meta["target_recall"] == 0.99
    ckpt = _default_checkpoint()
    smol = shipped_sparse_configs(ckpt)
    assert smol == {"minference": DEFAULT_MINFERENCE_CONFIG}
    got = with_shipped_config(SparseConfig("minference", min_length=0), smol)
    assert got.config_path == str(DEFAULT_MINFERENCE_CONFIG) and got.min_length == 0
    own = SparseConfig("minference", config_path=str(DEFAULT_MINFERENCE_CONFIG.parent / "__init__.py"))
    assert with_shipped_config(own, smol) is own and with_shipped_config(None, smol) is None
    anchor = SparseConfig("anchor")
    assert with_shipped_config(anchor, smol) is anchor

    def converted(name, source):  # a checkpoint's manifest, as convert writes its source
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({"format": "starshard", "source": source}))
        return tmp_path / name

    model = MODELS["qwen2.5-coder-1.5b-instruct"]
    qwen = shipped_sparse_configs(converted("q", {"kind": "gguf", "path": "/any/name.gguf", "sha256": model.sha256}))
    assert set(qwen) == {"anchor"}
    calibrated = AnchorModelConfig.load(qwen["anchor"])  # shipped with the package, Qwen2.5-1.5B's shape
    assert len(calibrated.layers) == 28 and all(len(layer) == 12 for layer in calibrated.layers)
    assert calibrated.meta["target_recall"] == 0.99 and calibrated.meta["rope_scaling"] == "yarn:4"
    monkeypatch.setenv("STARSHARD_CACHE", str(tmp_path / "cache"))  # an entry converted before the sha256 was kept
    assert shipped_sparse_configs(converted("old", {"kind": "gguf", "path": str(cache.cache_dir() / "models" /
                                                                                  model.gguf)})) == qwen
    got = with_shipped_config(SparseConfig("anchor", fallback=False), qwen)
    assert got.config_path == str(qwen["anchor"]) and got.fallback is False
    for given in (SparseConfig("anchor", anchor_theta=12.0), SparseConfig("anchor", anchor_step=1),
                  SparseConfig("minference")):
        assert with_shipped_config(given, qwen) is given
    for other in (converted("other", {"kind": "gguf", "path": "/x.gguf", "sha256": "0" * 64}),
                  converted("hf", {"kind": "hf", "path": "/some/hf"}), tmp_path, None):
        assert shipped_sparse_configs(other) == {}, other
    monkeypatch.delenv("STARSHARD_CACHE")

    with caplog.at_level("INFO"):
        llm = starshard.LLM(progress=False, sparse=SparseConfig("minference"))
    assert "--sparse minference: the config shipped for this model (smollm2_minference.json)" in caplog.text
    assert llm.sparse.config_path == str(DEFAULT_MINFERENCE_CONFIG)
    assert llm.model.layers[0].attention.sparse.method.method.meta["source"] == str(DEFAULT_MINFERENCE_CONFIG)
    assert sparse_report(llm.model) is not None
    same = starshard.LLM(ckpt, progress=False, sparse=SparseConfig("minference"))  # the default by its path
    assert same.sparse.config_path == str(DEFAULT_MINFERENCE_CONFIG)
    other = starshard.LLM(random_weights="tiny", progress=False, sparse=SparseConfig("minference"))
    assert other.sparse.config_path is None


def test_bench_prefill_on_the_embedded_default(tmp_path):
    """launch/bench.py prefill without --model or --random-weights runs the embedded SmolLM2 (as bench.py serve
    does), and its JSON names the checkpoint and the shipped MInference config that ran."""
    from starshard.checkpoints.default import DEFAULT_MINFERENCE_CONFIG

    _default_checkpoint()
    out = tmp_path / "b.json"
    subprocess.run([sys.executable, str(ROOT / "launch" / "bench.py"), "prefill", "--lengths", "200", "--repeats", "1",
                    "--warmup", "0", "--device", "cpu", "--dtype", "float32", "--cp-strategy", "dense", "--sparse", "minference",
                    "--sparse-min-length", "0", "--decode-steps", "0", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, timeout=600)
    r = json.loads(out.read_text())
    assert r["sparse_config_file"] == str(DEFAULT_MINFERENCE_CONFIG) and r["weights"] == "real"
    assert r["checkpoint"].endswith("smollm2-135m-instruct-q4_1-f32")
    assert r["results"][0]["length"] == 200 and r["results"][0]["sparse_report"]["heads_sparse"] > 0


def test_search_over_samples_reaches_the_floor_on_each():
    """run_search_samples: the same sample twice is the one-sample search; over two samples each head's pattern
    is a family's budget at least each sample's own smallest, and reaches the floor on each sample alone (its
    score the lower recall), or the head runs dense."""
    import starshard
    from starshard.tools import minference_search as ms
    from starshard.tools.layer_probe import probe_layers

    model = starshard.load_model(_default_checkpoint())
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(100, 20000, (160,), generator=g).tolist() for _ in range(2))
    kw = dict(block_size=16, last_q=16, force_sink=4, force_local=8, target_recall=0.97)
    assert ms.run_search_samples(model, [a, a], layers=[2], progress=False, **kw)[2] == \
        ms.run_search(model, a, layers=[2], progress=False, **kw)[2]
    both = ms.run_search_samples(model, [a, b], layers=[2], progress=False, **kw)[2]
    searches = []
    for ids in (a, b):
        seen = {}
        probe_layers(model, ids, lambda i, q, k: seen.setdefault(i, (q, k)), [2])
        searches.append(ms.LayerSearch(*seen[2], **kw))
    own = [s.smallest_budgets() for s in searches]
    combined = [torch.maximum(x[0], y[0]) for x, y in zip(*own)]
    evals = [s.evaluate(combined) for s in searches]
    plain = lambda p: {f: getattr(p, f) for f in p.__dataclass_fields__ if f != "score"}  # noqa: E731
    sparse = 0
    for h, p in both.items():
        if isinstance(p, mi.Dense):
            continue
        sparse += 1
        f = next(f for f in range(len(combined)) if plain(evals[0][f][0][h]) == plain(p))
        recalls = [float(e[f][1][h]) for e in evals]
        assert min(recalls) >= 0.97 - 1e-6 and p.score == round(min(recalls), 6), (h, p, recalls)
        assert all(int(combined[f][h]) >= int(o[f][0][h]) for o in own)
    assert sparse > 0 and len(both) == 9


def test_search_cli_samples(tmp_path, capsys):
    """--samples through the CLI: recorded in the config's meta, every searched head at the floor or dense;
    --equal-cost (one sample's search) refuses it, naming the fix."""
    from starshard.tools import minference_search as ms

    ckpt = _default_checkpoint()
    out = tmp_path / "cfg.json"
    args = ["--model", str(ckpt), "--out", str(out), "--length", "160", "--layers", "2", "--block-size", "16",
            "--last-q", "16", "--force-sink", "4", "--force-local", "8", "--quiet", "--samples", "2"]
    ms.main([*args, "--target-recall", "0.97", "--tasks", "multikey,niah_essay"])
    cfg = mi.MInferenceConfig.load(out)
    assert cfg.meta["sample"]["count"] == 2 and len(cfg.layers[2]) == 9
    assert cfg.meta["sample"]["task"] == "multikey,niah_essay"
    assert all(p.score >= 0.97 for p in cfg.layers[2].values())
    assert cfg.meta["kinds"] == ["a_shape", "vertical_slash", "block_sparse"]
    ms.main([*args, "--target-recall", "0.97", "--kinds", "vertical_slash", "--recall-by", "block"])
    only = mi.MInferenceConfig.load(out)
    assert only.meta["kinds"] == ["vertical_slash"] and only.meta["recall_by"] == "block"
    assert "lowest sampled block" in only.meta["score"] and cfg.meta["recall_by"] == "mean"
    assert {p.kind for p in only.layers[2].values()} <= {"vertical_slash", "dense"}
    for bad, why in ((["--equal-cost"], "drop --samples"), (["--samples", "0"], "at least 1"),
                     (["--kinds", "slash"], "give one or more of a_shape"), (["--recall-by", "row"], "invalid choice"),
                     (["--task", "multikey,nosuch"], "give one or more of")):  # --tasks' earlier spelling
        with pytest.raises(SystemExit):
            ms.main([*args, *bad])
        assert why in capsys.readouterr().err
