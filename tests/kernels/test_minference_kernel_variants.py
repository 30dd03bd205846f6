"""The MInference kernel's variants (kernel.Launch: flat, wide) against a float64 dense-masked
reference built from the same plan (plan.group_mask, the torch path's visibility), and the FLOPs each
variant multiplies (every tl.dot counted in the interpreter) against `plan.kernel_cost`.

TRITON_INTERPRET=1, float32 / float16 (bfloat16 is not faithful in the interpreter), small shapes;
block sizes 16 / 32 put many row blocks and diagonal runs into short sequences. num_warps /
num_stages do not exist in the interpreter: the sm_90 compile test (slow) builds the real kernels.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
pytest.importorskip("triton.runtime.interpreter")

from starshard.kernels import minference as mi  # noqa: E402
from starshard.kernels.minference import kernel as mk  # noqa: E402
from starshard.kernels.minference.plan import HeadGroup  # noqa: E402
from tests.helpers.sm90_compile import assert_compiles_for_sm90  # noqa: E402
from tests.helpers.sparse_reference import assert_matches, masked_reference  # noqa: E402

VARIANTS = ["default", "wide", "flat"]
# VS with columns and diagonals, diagonals only (vertical 0), columns only (slash 0), then the
# other kinds in the same call
HEADS = (mi.VerticalSlash(6, 12), mi.AShape(3, 20), mi.VerticalSlash(0, 30), mi.BlockSparse(2),
         mi.VerticalSlash(9, 0), mi.Dense())


def _qkv(B, hq, hkv, lq, lk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, hq, lq, d, generator=g) * 1.5).to(dtype)
    k = torch.randn(B, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(B, hkv, lk, d, generator=g).to(dtype)
    return q, k, v


def _reference(q, k, v, groups, *, off, bm):
    B, hq, lq = q.shape[:3]
    lk = k.shape[2]
    vis = torch.zeros(B, hq, lq, lk, dtype=torch.bool)
    blocks = torch.arange(mi._cdiv(lq, bm))
    for grp in groups:
        vis[:, grp.heads] = mi.group_mask(grp, B=B, Lq=lq, Lk=lk, offset=off, block_size=bm, blocks=blocks)[:, :, :lq]
    return masked_reference(q, k, v, vis)


def _check_variants(q, k, v, groups, *, off, bm, dtype, variants=VARIANTS):
    ref, ref_lse = _reference(q, k, v, groups, off=off, bm=bm)
    for spec in variants:
        out, lse = mk.attention_triton(q, k, v, groups, offset=off, scale=q.shape[-1] ** -0.5, block_size=bm,
                                       launch=spec)
        try:
            assert_matches(out, lse, ref, ref_lse, dtype)
        except AssertionError as e:
            raise AssertionError(f"variant {spec}: {e}") from None


# name: B, Hq, Hkv, Lq, Lk, D, block_size; offset = Lk - Lq (the queries are the last Lq keys)
CASES = {
    "odd_gqa_d64": (1, 6, 2, 141, 141, 64, 32),  # 5 row blocks
    "offset_d48": (1, 6, 3, 77, 150, 48, 16),  # head dim padded to 64, queries after 73 keys
}


@pytest.mark.parametrize("case,dtype", [("odd_gqa_d64", torch.float32), ("offset_d48", torch.float32),
                                        ("offset_d48", torch.float16)], ids=["odd_gqa_d64-fp32", "offset_d48-fp32",
                                                                            "offset_d48-fp16"])
def test_variants_match_masked_reference(case, dtype):
    B, hq, hkv, lq, lk, d, bm = CASES[case]
    q, k, v = _qkv(B, hq, hkv, lq, lk, d, dtype, seed=lq)
    off = lk - lq
    pattern = mi.SparsePattern(HEADS, block_size=bm, last_q=16, force_sink=2, force_local=5)
    groups = mi.build_plan(q, k, pattern, offset=off)
    assert {g.kind for g in groups} == {"vertical_slash", "a_shape", "block_sparse"}
    vs = next(g for g in groups if g.kind == "vertical_slash").index
    assert (vs.col_count.sum((0, 2)) == 0).any() and (vs.seg_count == 0).any()  # heads without columns / runs
    _check_variants(q, k, v, groups, off=off, bm=bm, dtype=dtype)


def test_variants_queries_past_the_keys():
    """off > Lk - Lq: the query block sits after its keys (ranges clipped at Lk)."""
    q, k, v = _qkv(2, 2, 1, 40, 50, 32, torch.float32, seed=3)
    pattern = mi.SparsePattern((mi.VerticalSlash(5, 30), mi.AShape(4, 9)), block_size=16, last_q=16)
    groups = mi.build_plan(q, k, pattern, offset=60)
    _check_variants(q, k, v, groups, off=60, bm=16, dtype=torch.float32)


def _random_vs(B, nH, lq, lk, off, bm, rng, heads, kv=10, ks=40):
    """A Vertical-Slash group from hand-picked diagonals: clusters of several widths (runs up to a few
    blocks wide, single diagonals, runs near diagonal 0 and near the last one) and random columns."""
    ndiag = lq + off
    v_idx = torch.full((B, nH, kv), lk, dtype=torch.long)
    s_idx = torch.full((B, nH, ks), ndiag, dtype=torch.long)
    for b in range(B):
        for h in range(nH):
            cols = sorted(rng.sample(range(lk), min(rng.randint(0, kv), lk)))
            ds = set()
            for _ in range(rng.randint(0, 6)):
                c, w = rng.randrange(ndiag), rng.choice([0, 0, 1, bm // 2, bm, 3 * bm])
                ds.update(x for x in range(c, min(ndiag, c + w + 1)) if rng.random() < 0.7)
            ds = sorted(ds | {0, ndiag - 1} if rng.random() < 0.5 else ds)[:ks]
            v_idx[b, h, : len(cols)] = torch.tensor(cols, dtype=torch.long)
            s_idx[b, h, : len(ds)] = torch.tensor(ds, dtype=torch.long)
    ix = mi.vs_index(v_idx, s_idx, Lq=lq, Lk=lk, offset=off, block_size=bm, heads=heads, use_triton=False)
    return HeadGroup("vertical_slash", list(heads), index=ix)


@pytest.mark.parametrize("seed", range(4))
def test_variants_on_random_diagonal_runs(seed):
    rng = random.Random(seed)
    bm = (16, 32)[seed % 2]
    lq = rng.randint(3 * bm, 5 * bm)
    off = (0, rng.randint(1, 70))[seed // 2]
    lk = lq + off
    q, k, v = _qkv(1, 3, 1, lq, lk, 16, torch.float32, seed=seed)
    groups = [_random_vs(1, 2, lq, lk, off, bm, rng, [2, 0]),
              HeadGroup("a_shape", [1], sink=[rng.randint(0, 40)], local=[rng.randint(1, 3 * bm)])]
    _check_variants(q, k, v, groups, off=off, bm=bm, dtype=torch.float32)


@pytest.mark.parametrize("lq,lk", [(150, 150), (90, 170)])
def test_kernel_cost_is_the_kernels_flops(dot_flops, lq, lk):
    """Every variant computes plan.kernel_cost's entries."""
    rng = random.Random(lq)
    q, k, v = _qkv(1, 3, 1, lq, lk, 16, torch.float32, seed=lk)
    d, off, bm = 16, lk - lq, 16
    groups = [_random_vs(1, 1, lq, lk, off, bm, rng, [0]), HeadGroup("a_shape", [1], sink=[5], local=[37]),
              HeadGroup("block_sparse", [2], index=mi.bs_select(q, k, offset=off, topk=3, block_size=bm, heads=[2]))]
    for grp in groups:
        cost = int(mi.kernel_cost(grp, B=1, Lq=lq, Lk=lk, offset=off, block_size=bm).sum())
        for spec in VARIANTS:
            dot_flops.clear()
            mk.attention_triton(q, k, v, [grp], offset=off, scale=d**-0.5, block_size=bm, launch=spec)
            assert sum(dot_flops) == cost * 4 * d, (grp.kind, spec)


def test_launch_specs():
    L = mk.Launch
    assert mk.as_launch(None) == L(flat=None) and mk.as_launch((8, 3)) == L(8, 3)
    assert mk.as_launch("wide+flat:8,2") == L(8, 2, flat=True, wide=True)
    assert mk.as_launch("wide") == L(wide=True) and mk.as_launch("4,2") == L(4, 2)
    assert L.parse("wide+flat").name() == "flat+wide" and L(4, 3).name() == "default:4,3"
    assert L().settings(64) == {"num_warps": 4, "num_stages": 2}
    # head dim 128: 4 warps (2x faster than 8 on an H100), 3 stages except Vertical-Slash, flat by default
    assert L().settings(128) == {"num_warps": 4, "num_stages": 2}
    three = {"num_warps": 4, "num_stages": 3}
    assert L().settings(128, "a_shape") == L().settings(128, "block_sparse") == three
    assert mk.as_launch(None).flat_for(128) and not mk.as_launch(None).flat_for(64)
    assert not L().flat_for(128) and L(flat=True).flat_for(64)  # an explicit launch is taken as given
    assert mk.default_settings(128) == {"a_shape": [4, 3], "vertical_slash": [4, 2], "block_sparse": [4, 3],
                                        "vertical_slash_flat": True}
    with pytest.raises(ValueError, match="unknown"):
        L.parse("pairs")
    with pytest.raises(ValueError, match="num_warps"):
        L.parse("flat:8")
    # a launch travels through minference_attention's launch= unchanged
    q, k, v = _qkv(1, 2, 1, 48, 48, 16, torch.float32, seed=9)
    pos = torch.arange(48)
    pattern = mi.SparsePattern((mi.VerticalSlash(4, 8),), block_size=16, last_q=16)
    ref = mi.minference_attention(q, k, v, q_pos=pos, k_pos=pos, pattern=pattern, backend="triton")
    out = mi.minference_attention(q, k, v, q_pos=pos, k_pos=pos, pattern=pattern, backend="triton",
                                  launch=L(flat=True, wide=True))
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5)


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from starshard.kernels.minference import kernel as mk
ints = {"HEADS", "P0", "P1", "SEG", "SEGN", "IDX", "CNT", "CFULL"}
for fn, consts in ((mk._minference_fwd, dict(MODE=1, BLOCK_M=64, BLOCK_N=64, FLAT=True, WIDE=False)),
                   (mk._minference_fwd, dict(MODE=0, BLOCK_M=128, BLOCK_N=64, FLAT=False, WIDE=True))):
    sig = {n: "*i32" if n in ints else ("fp32" if n == "qk_scale" else "i32") for n in fn.arg_names}
    sig.update({n: "*bf16" for n in ("Q", "K", "V", "O")}, LSE="*fp32")
    consts.update(HEAD_DIM=64, BLOCK_D=64, IEEE=False)
    sig.update({n: "constexpr" for n in consts})
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(zip(("num_warps", "num_stages"), mk.default_launch(64))))
    assert "wgmma" in k.asm["ptx"], consts
print("compiled")
"""


@pytest.mark.slow  # ~20 s on 2 cores: two real sm_90a builds
def test_variants_compile_for_sm90(tmp_path):
    assert_compiles_for_sm90(_COMPILE, tmp_path, timeout=900)
