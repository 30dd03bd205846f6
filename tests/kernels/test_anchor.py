"""AnchorAttention: anchors and stripe identification against a plain-torch reading of the paper's
formulas (float64 loops), the sparse kernel against a masked dense float64 reference built from the
same selection, theta = +inf against dense attention, and the sm90 build of the Triton kernels.

The Triton kernels run on CPU through TRITON_INTERPRET=1 (set before anchor.py is imported), at small
sizes and float32/float16 only (bfloat16 is not faithful in the interpreter).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from starshard.kernels import anchor as an  # noqa: E402
from starshard.kernels.attention import attention  # noqa: E402
from tests.helpers.sm90_compile import assert_compiles_for_sm90  # noqa: E402
from tests.helpers.sparse_reference import assert_matches, masked_reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# name: B, Hq, Hkv, Lq, Lk, D, offset (q_pos[0] - k_pos[0]); keys start at global position 5
LAYOUTS = {
    "square_odd": (1, 4, 2, 101, 101, 32, 0),
    "tail": (1, 2, 2, 45, 117, 32, 72),  # the query block is the last 45 of 117 keys
    "batch_gqa_d24": (2, 6, 2, 67, 67, 24, 0),
    "past_keys": (1, 2, 1, 40, 70, 16, 50),  # query rows start after key 50 of 70: some see all keys
}
CONFIGS = {
    "q16k16": an.AnchorConfig(theta=2.0, block_q=16, block_k=16, init_tokens=5, local_window=7, step=1),
    "q32k16_step2": an.AnchorConfig(theta=2.5, block_q=32, block_k=16, init_tokens=16, local_window=0, step=2),
    "q16k32_step3": an.AnchorConfig(theta=1.5, block_q=16, block_k=32, init_tokens=0, local_window=20, step=3),
}


def make(layout, dtype, seed=0):
    B, hq, hkv, lq, lk, d, off = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, hq, lq, d, generator=g) * 1.5).to(dtype)
    k = torch.randn(B, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(B, hkv, lk, d, generator=g).to(dtype)
    k_pos = torch.arange(lk) + 5
    q_pos = torch.arange(lq) + 5 + off
    return q, k, v, q_pos, k_pos, off


# ---- plain references (loops over the paper's definitions) ---------------------------------------


def plain_geometry(cfg, lq, off):
    """Per row: (group, window start), plain Python."""
    out = []
    for i in range(lq):
        grp = (i // cfg.block_q) // cfg.step
        out.append((grp, max(0, grp * cfg.step * cfg.block_q + off - cfg.local_window)))
    return out


def plain_region(cfg, lq, lk, off):
    """[Lq, Lk] anchor region: initial tokens or window start .. diagonal, causal."""
    reg = torch.zeros(lq, lk, dtype=torch.bool)
    for i, (_, ws) in enumerate(plain_geometry(cfg, lq, off)):
        for j in range(min(lk, i + off + 1)):
            reg[i, j] = j < cfg.init_tokens or j >= ws
    return reg


def plain_selection(q, k, cfg, off, scale=None):
    """Eq. (1) and (2) of the paper in float64 loops: anchors x_a, block means, and per group the
    candidate keys j with avgpool(x_a) - avgpool(Q) k_j / sqrt(d) <= theta for some block.
    Returns (x_a [B, Hq, Lq], {(b, h, g): sorted keys}, {(b, h, g): {key: min margin}})."""
    B, hq, lq, d = q.shape
    lk = k.shape[2]
    grp_size = hq // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    reg = plain_region(cfg, lq, lk, off)
    geo = plain_geometry(cfg, lq, off)
    xa = torch.full((B, hq, lq), float("-inf"), dtype=torch.float64)
    sel, margin = {}, {}
    n_blocks = -(-lq // cfg.block_q)
    for b in range(B):
        for h in range(hq):
            kk = k[b, h // grp_size].double()
            s = (q[b, h].double() @ kk.T) * scale
            for i in range(lq):
                if reg[i].any():
                    xa[b, h, i] = s[i][reg[i]].max()
            for gi in range(-(-n_blocks // cfg.step)):
                blocks = range(gi * cfg.step, min(n_blocks, (gi + 1) * cfg.step))
                ws = geo[blocks[0] * cfg.block_q][1]
                keys, marg = [], {}
                for j in range(cfg.init_tokens, min(ws, lk)):
                    best = float("inf")
                    for m in blocks:
                        r0, r1 = m * cfg.block_q, min(lq, (m + 1) * cfg.block_q)
                        qbar = q[b, h, r0:r1].double().mean(0)
                        xbar = xa[b, h, r0:r1].mean()
                        best = min(best, float(xbar - (qbar @ kk[j]) * scale - cfg.theta))
                    if best <= 0:
                        keys.append(j)
                    marg[j] = abs(best)
                sel[b, h, gi], margin[b, h, gi] = keys, marg
    return xa, sel, margin


def reference_vis(cfg, index, B, hq, lq, lk, off):
    """[B, Hq, Lq, Lk]: anchor region of the row plus the keys listed for its group."""
    reg = plain_region(cfg, lq, lk, off)
    geo = plain_geometry(cfg, lq, off)
    vis = reg.expand(B, hq, lq, lk).clone()
    for b in range(B):
        for h in range(hq):
            for i, (gi, _) in enumerate(geo):
                keys = index.idx[b, h, gi, : int(index.count[b, h, gi])].long()
                vis[b, h, i, keys[keys <= i + off]] = True
    return vis


def assert_selection_matches(index, sel, margin, tol):
    """Lists equal to the plain selection, except keys within `tol` of the threshold (rounding)."""
    for (b, h, gi), keys in sel.items():
        got = index.idx[b, h, gi, : int(index.count[b, h, gi])].tolist()
        assert got == sorted(got), "lists must be ascending"
        assert len(set(got)) == len(got)
        diff = set(got) ^ set(keys)
        assert all(margin[b, h, gi][j] < tol for j in diff), (b, h, gi, sorted(diff))


# ---- stage 1 and 2 -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("layout", ["square_odd", "tail", "batch_gqa_d24", "past_keys"])
def test_identification_matches_paper_formula(layout, cfg_name, backend):
    cfg = CONFIGS[cfg_name]
    q, k, v, q_pos, k_pos, off = make(layout, torch.float32, seed=2)
    xa_ref, sel, margin = plain_selection(q, k, cfg, off)
    xa = an.anchor_scores(q, k, cfg, offset=off, backend=backend)
    fin = torch.isfinite(xa_ref)
    assert torch.equal(torch.isfinite(xa), fin)
    torch.testing.assert_close(xa[fin].double(), xa_ref[fin], rtol=1e-5, atol=1e-5)
    index = an.identify_stripes(q, k, xa, cfg, offset=off, backend=backend)
    assert index.idx.dtype == index.count.dtype == torch.int32
    assert_selection_matches(index, sel, margin, 1e-4)
    if backend == "triton":  # the KV-grouped kernel: the same lists, also with a theta per head
        grouped = an.identify_stripes(q, k, xa, cfg, offset=off, backend=backend, group_heads=True)
        assert torch.equal(grouped.count, index.count)
        assert_selection_matches(grouped, sel, margin, 1e-4)
        per_head = dataclasses.replace(cfg, theta=tuple(cfg.theta + 0.5 * h for h in range(q.shape[1])))
        want = an.identify_stripes(q, k, xa, per_head, offset=off, backend="torch")
        got = an.identify_stripes(q, k, xa, per_head, offset=off, backend=backend, group_heads=True)
        assert torch.equal(got.count, want.count)
        for b, h, gi in zip(*[t.tolist() for t in torch.nonzero(want.count >= 0, as_tuple=True)]):
            n = int(want.count[b, h, gi])
            assert torch.equal(got.idx[b, h, gi, :n], want.idx[b, h, gi, :n])
    counts = [len(x) for x in sel.values()]
    cands = sum(len(m) for m in margin.values())
    if layout != "past_keys":  # the test is only meaningful if theta keeps some candidates, not all
        assert 0 < sum(counts) < cands


@pytest.mark.parametrize("head_dim,keys,group,want", [(128, 1 << 17, 4, True), (128, 1 << 20, 8, True),
                                                       (128, 1 << 15, 4, False), (64, 1 << 17, 3, False),
                                                       (128, 1 << 17, 1, False)])
def test_default_stripe_kernel_follows_the_measurements(head_dim, keys, group, want):
    """The KV-grouped stripe kernel by default only where it was timed faster: head dim 128 from 128K
    keys with GQA (MHA has nothing to group)."""
    assert an.grouped_identify(head_dim, keys, group) is want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("L", [64, 71, 9])
def test_pool_blocks_are_block_means(L, dtype):
    """Block means of q (strided, as the model passes it) and of the anchors, the last block over its
    real rows only; a -inf anchor makes its block's mean -inf."""
    g = torch.Generator().manual_seed(L)
    q = torch.randn(2, L, 3, 24, generator=g).to(dtype).transpose(1, 2)  # [B, Hq, L, D], not contiguous
    xa = torch.randn(2, 3, L, generator=g)
    xa[1, 2, L - 1] = -math.inf
    qbar, xbar = an.pool_blocks(q, xa, 16)
    want_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert qbar.dtype == xbar.dtype == want_dtype and qbar.shape == (2, 3, -(-L // 16), 24)
    for m in range(qbar.shape[2]):
        rows = slice(16 * m, min(16 * m + 16, L))
        torch.testing.assert_close(qbar[:, :, m].double(), q[:, :, rows].double().mean(2), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(xbar[:, :, m].double(), xa[:, :, rows].double().mean(2), rtol=1e-6, atol=1e-6)
    assert xbar[1, 2, -1] == -math.inf


def test_identification_theta_extremes():
    q, k, v, q_pos, k_pos, off = make("square_odd", torch.float32)
    for theta, want_all in ((math.inf, True), (-math.inf, False)):
        cfg = an.AnchorConfig(theta=theta, block_q=16, block_k=16, init_tokens=3, local_window=4, step=1)
        for backend in ("torch", "triton"):
            index = an.build_index(q, k, cfg, offset=off, backend=backend)
            ws = an.window_starts(cfg, Lq=q.shape[2], offset=off)
            want = (ws.clamp(max=k.shape[2]) - 3).clamp(min=0) if want_all else torch.zeros_like(ws)
            assert torch.equal(index.count[0, 0].long(), want)


# ---- stage 3 and the whole call ------------------------------------------------------------------


# every layout and every config at least once in each dtype, kept short for the interpreter
KERNEL_CASES = [
    "square_odd-q16k16-fp32", "square_odd-q32k16_step2-fp16", "tail-q32k16_step2-fp32", "tail-q16k32_step3-fp16",
    "batch_gqa_d24-q16k32_step3-fp32", "batch_gqa_d24-q16k16-fp16", "past_keys-q16k16-fp32",
    "past_keys-q32k16_step2-fp16",
]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_matches_masked_reference(case):
    layout, cfg_name, dt = case.split("-")
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[dt]
    cfg = CONFIGS[cfg_name]
    q, k, v, q_pos, k_pos, off = make(layout, dtype)
    B, hq, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    index = an.build_index(q, k, cfg, offset=off, backend="triton")
    vis = reference_vis(cfg, index, B, hq, lq, lk, off)
    if layout != "past_keys":
        causal = torch.arange(lk)[None, :] <= (torch.arange(lq) + off)[:, None]
        assert (vis.sum(-1) < causal.sum(-1)).any()  # really sparse
    ref, ref_lse = masked_reference(q, k, v, vis)
    out, lse = an.sparse_attention(q, k, v, index, cfg, offset=off, backend="triton")
    assert_matches(out, lse, ref, ref_lse, dtype)
    out_t, lse_t = an.sparse_attention(q, k, v, index, cfg, offset=off, backend="torch")
    assert_matches(out_t, lse_t, ref, ref_lse, dtype)
    # the entry point chains the same stages
    out_e, lse_e = an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=cfg, backend="triton")
    assert torch.equal(out_e, out) and torch.equal(lse_e, lse)


def test_hand_made_index_by_row():
    """Stage 3 alone on a hand-written list with gaps, duplicates of nothing, a partial last chunk."""
    q, k, v, q_pos, k_pos, off = make("square_odd", torch.float32, seed=5)
    cfg = an.AnchorConfig(theta=0.0, block_q=32, block_k=16, init_tokens=2, local_window=3, step=1)
    G = 4
    lists = [[], [], [2, 3, 9, 10, 11, 30], list(range(2, 61, 3))]  # ws_g = 0, 29, 61, 93
    idx = torch.zeros(1, 4, G, 40, dtype=torch.int32)
    count = torch.zeros(1, 4, G, dtype=torch.int32)
    for gi, keys in enumerate(lists):
        idx[0, :, gi, : len(keys)] = torch.tensor(keys, dtype=torch.int32)
        count[0, :, gi] = len(keys)
    index = an.StripeIndex(idx, count)
    ref, ref_lse = masked_reference(q, k, v, reference_vis(cfg, index, 1, 4, 101, 101, 0))
    for backend in ("triton", "torch"):
        out, lse = an.sparse_attention(q, k, v, index, cfg, offset=0, backend=backend)
        assert_matches(out, lse, ref, ref_lse, torch.float32)


@pytest.mark.parametrize("case", ["square_odd-q16k16-fp32", "tail-q32k16_step2-fp32", "batch_gqa_d24-q16k32_step3-fp16",
                                  "past_keys-q16k32_step3-fp32"])
def test_theta_inf_equals_dense(case):
    layout, cfg_name, dt = case.split("-")
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[dt]
    q, k, v, q_pos, k_pos, off = make(layout, dtype, seed=1)
    lq, lk = q.shape[2], k.shape[2]
    causal = torch.arange(lk)[None, :] <= (torch.arange(lq) + off)[:, None]
    ref, ref_lse = masked_reference(q, k, v, causal.expand(q.shape[0], q.shape[1], -1, -1))
    cfg = an.AnchorConfig(**{**CONFIGS[cfg_name].to_dict(), "theta": math.inf})
    for backend in ("triton", "torch"):
        out, lse = an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=cfg, backend=backend)
        assert_matches(out, lse, ref, ref_lse, dtype)


def test_entry_points_and_errors():
    q, k, v, q_pos, k_pos, off = make("square_odd", torch.float32)
    cfg = CONFIGS["q16k16"]
    a = cfg.attention(q, k, v, q_pos=q_pos, k_pos=k_pos)
    b = an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=cfg.to_dict(), backend="torch")
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    assert an.AnchorConfig.from_dict(cfg.to_dict()) == cfg
    # decode-sized and non-causal calls are exact dense
    short = an.anchor_attention(q[:, :, -8:], k, v, q_pos=q_pos[-8:], k_pos=k_pos, config=cfg)
    torch.testing.assert_close(short[0], attention(q[:, :, -8:], k, v, q_pos=q_pos[-8:], k_pos=k_pos)[0])
    full = an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=cfg, causal=False)
    torch.testing.assert_close(full[0], attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=False)[0])
    with pytest.raises(ValueError, match="powers of two"):
        an.AnchorConfig(block_q=24)
    with pytest.raises(ValueError, match="theta"):
        an.AnchorConfig(theta=float("nan"))
    with pytest.raises(ValueError, match="unknown AnchorConfig keys"):
        an.AnchorConfig.from_dict({"theta": 1.0, "tehta": 2})
    with pytest.raises(ValueError, match="start at or after"):
        an.anchor_attention(q, k, v, q_pos=q_pos - 3, k_pos=k_pos, config=cfg)
    with pytest.raises(TypeError, match="AnchorConfig"):
        an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=12.0)
    with pytest.raises(ValueError, match="backend"):
        an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=cfg, backend="cuda")


def test_density_counts_pairs():
    q, k, v, q_pos, k_pos, off = make("tail", torch.float32)
    cfg = CONFIGS["q32k16_step2"]
    index = an.build_index(q, k, cfg, offset=off, backend="torch")
    vis = reference_vis(cfg, index, 1, 2, 45, 117, off)
    causal = torch.arange(117)[None, :] <= (torch.arange(45) + off)[:, None]
    want = (vis.sum((-1, -2)).double() / causal.sum()).mean().item()
    assert abs(an.density(index, cfg, Lq=45, Lk=117, offset=off) - want) < 1e-12


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from starshard.kernels import anchor as an
ptrs = {"_anchor_max_fwd": {"Q": "q", "K": "q", "XA": "fp32"},
        "_identify_fwd": {"QP": "fp32", "XP": "fp32", "K": "q", "IDX": "i32", "CNT": "i32", "TH": "fp32"},
        "_identify_gqa_fwd": {"QP": "fp32", "XP": "fp32", "K": "q", "IDX": "i32", "CNT": "i32", "TH": "fp32"},
        "_anchor_sparse_fwd": {"Q": "q", "K": "q", "V": "q", "O": "q", "LSE": "fp32", "IDX": "i32", "CNT": "i32"}}
floats = {"qk_scale", "theta"}
consts = {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 128, "BLOCK_N": 64, "STEP_P": 16, "G_P": 4, "IEEE": False,
          "COUNT_ONLY": False}
stores = {}
for name, p in ptrs.items():
    fn = getattr(an, name)
    # the stripe kernels also in their count-only form (the floor's sample, count_stripes)
    for count_only in ((False, True) if "COUNT_ONLY" in fn.arg_names else (False,)):
        dt = "bf16"  # the GPU dtype; an fp32 build of the 128-row sparse kernel takes minutes
        sig = {}
        for n in fn.arg_names:
            if n in p:
                sig[n] = "*" + (dt if p[n] == "q" else p[n])
            elif n in consts:
                sig[n] = "constexpr"
            else:
                sig[n] = "fp32" if n in floats else "i32"
        c = {n: (dt == "fp32" if n == "IEEE" else v) for n, v in consts.items() if n in fn.arg_names}
        if count_only:
            c["COUNT_ONLY"] = True
        warps, stages = an.default_launch(128, 128)
        k = triton.compile(ASTSource(fn, sig, constexprs=c), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": stages})
        assert name.startswith("_identify") or "wgmma" in k.asm["ptx"], name
        stores[name, count_only] = k.asm["ptx"].count("st.global")
for name in ("_identify_fwd", "_identify_gqa_fwd"):  # count-only: no list written, its one store is the count
    assert stores[name, True] == 1 < stores[name, False], stores
print("compiled")
"""


def test_kernel_compiles_for_sm90(tmp_path):
    """The interpreter skips Triton's compiler: build the real kernels (sm_90a cubin, no GPU needed)."""
    assert_compiles_for_sm90(_COMPILE, tmp_path)


def test_bench_script_runs_on_cpu(tmp_path):
    """launch/bench.py anchor end to end at a tiny size (interpreted Triton)."""
    out = tmp_path / "anchor.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "launch" / "bench.py"), "anchor", "--device", "cpu", "--quick",
           "--lengths", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--dtype", "float32",
           "--block-q", "16", "--block-k", "16", "--init-tokens", "16", "--step", "2", "--thetas", "3", "--vs", "8,32",
           "--vs-block-size", "16", "--repeats", "1", "--warmup", "0", "--recall-blocks", "2", "--group-heads",
           "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    row = json.loads(out.read_text())["results"][0]
    a, vs = row["anchor"][0], row["vertical_slash"][0]
    assert 0 < a["density"] < 1 and 0 < a["recall"] <= 1 + 1e-6 and a["rel_err"] < 1e-4
    assert 0 < vs["recall"] <= 1 + 1e-6 and vs["rel_err"] < 1e-4
    for key in ("dense_sdpa_cpu_ms",):
        assert row[key] > 0
    assert a["identify_ms"] > 0 and a["kernel_ms"] > 0 and a["total_ms"] > 0
    assert a["identify_grouped_ms"] > 0 and a["grouped_same_lists"] is True


def test_gapped_positions_query_is_tail_of_keys():
    """Star's [anchor; block] layout: positions with a gap, the query block is the tail of its keys."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) * 2), torch.randn(1, 1, 70, 16, generator=g), torch.randn(1, 1, 70, 16, generator=g)
    k_pos = torch.cat([torch.arange(10), torch.arange(300, 360)])
    cfg = an.AnchorConfig(theta=2.0, block_q=16, block_k=16, init_tokens=4, local_window=5, step=1)
    index = an.build_index(q, k, cfg, offset=30, backend="torch")
    ref, ref_lse = masked_reference(q, k, v, reference_vis(cfg, index, 1, 2, 40, 70, 30))
    for backend in ("triton", "torch"):
        out, lse = an.anchor_attention(q, k, v, q_pos=k_pos[30:], k_pos=k_pos, config=cfg, backend=backend)
        assert_matches(out, lse, ref, ref_lse, torch.float32)
