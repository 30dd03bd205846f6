"""Attention kernels against an independent float64 reference (explicit K/V repeat + masked softmax).

The Triton kernels run on CPU through TRITON_INTERPRET=1 (set before flash.py/decode.py are
imported), at small sizes and float32/float16 only: bfloat16 is not faithful in the interpreter.
Small block configs make the short test sequences span several query and key blocks.
"""
import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

attn_mod = importlib.import_module("starshard.kernels.attention")  # the package re-exports the function
ref_mod = importlib.import_module("starshard.kernels.reference")  # attention_math and its score budget
from starshard.kernels.attention import DECODE_MAX_ROWS, attention, attention_math, cuda_backend, mask_mode  # noqa: E402
from starshard.kernels import decode as dk  # noqa: E402
from starshard.kernels.decode import decode_attention  # noqa: E402
from starshard.kernels.flash import block_ranges, flash_attention  # noqa: E402
from starshard.kernels.merge import merge_into, merge_many, merge_stacked  # noqa: E402
from starshard.kernels.merge import merge_partials as merge_two  # noqa: E402
from tests.helpers.sm90_compile import assert_compiles_for_sm90  # noqa: E402

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2), torch.float64: (1e-12, 1e-6)}  # lse is float32 by contract


def reference(q, k, v, q_pos, k_pos, causal=True, scale=None):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        qp = q_pos if q_pos.dim() == 2 else q_pos[None]
        kp = k_pos if k_pos.dim() == 2 else k_pos[None]
        s = s.masked_fill((kp[:, None, :] > qp[:, :, None])[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # empty rows: exp(-inf - -inf) = NaN -> 0
    return p @ vv, lse


def assert_close(out, lse, q, k, v, q_pos, k_pos, causal=True, expect_empty=None, scale=None):
    ref, ref_lse = reference(q, k, v, q_pos, k_pos, causal, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    tol_out, tol_lse = TOL[q.dtype]
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < tol_out, f"relative error {err:.3e}"
    fin = torch.isfinite(ref_lse)
    assert torch.isfinite(out).all()
    assert (lse[fin].double() - ref_lse[fin]).abs().max().item() < tol_lse
    empty = ~fin
    if expect_empty is not None:
        assert int(empty.sum()) == expect_empty  # the case really has (or lacks) rows with no key
    assert torch.isneginf(lse[empty]).all()
    assert (out[empty] == 0).all()


def rand(B, H, L, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, L, D, generator=g).to(dtype)


def qkv(B, hq, hkv, lq, lk, d, dtype, seed=0):
    return rand(B, hq, lq, d, dtype, seed), rand(B, hkv, lk, d, dtype, seed + 1), rand(B, hkv, lk, d, dtype, seed + 2)


ZIG = torch.cat([torch.arange(0, 24), torch.arange(72, 96)])  # a ring shard: chunks 0 and 3 of 4

# name, B, Hq, Hkv, Lq, Lk, D, q_pos, k_pos, causal, config (BLOCK_M, BLOCK_N, warps, stages),
# rows without a visible key per head (over the batch; None: not counted)
FLASH_CASES = [
    ("odd-lengths-gqa3-query-in-middle", 1, 6, 2, 37, 101, 64, torch.arange(37) + 30, torch.arange(101), True, (16, 32, 4, 1), 0),
    ("gqa3x3-rows-before-all-keys", 1, 9, 3, 37, 101, 32, torch.arange(37) - 10, torch.arange(101), True, (16, 16, 4, 1), 10),
    ("zigzag-shard", 1, 4, 2, 48, 48, 64, ZIG, ZIG, True, (16, 16, 4, 1), 0),
    ("query-in-gap-of-zigzag-keys", 1, 4, 2, 20, 48, 64, torch.arange(30, 50), ZIG, True, (16, 16, 4, 1), 0),
    ("noncausal-d48", 1, 4, 2, 50, 77, 48, torch.arange(50), torch.arange(77), False, (16, 16, 4, 1), 0),
    ("per-batch-positions", 2, 4, 4, 40, 70, 16, torch.stack([torch.arange(40), torch.arange(40) - 5]),
     torch.stack([torch.arange(70), torch.arange(70) + 3]), True, (16, 16, 4, 1), 8),
    ("unsorted-positions", 1, 4, 2, 40, 70, 32, torch.randperm(40, generator=torch.Generator().manual_seed(1)) + 10,
     torch.randperm(70, generator=torch.Generator().manual_seed(2)), True, (16, 16, 4, 1), None),
    ("default-config-d128", 1, 2, 1, 130, 200, 128, torch.arange(130) + 70, torch.arange(200), True, None, 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", FLASH_CASES, ids=[c[0] for c in FLASH_CASES])
def test_flash_matches_reference(case, dtype):
    _, B, hq, hkv, lq, lk, d, qp, kp, causal, cfg, empty_per_head = case
    q, k, v = qkv(B, hq, hkv, lq, lk, d, dtype)
    out, lse = flash_attention(q, k, v, q_pos=qp, k_pos=kp, causal=causal, config=cfg)
    expect = None if empty_per_head is None else empty_per_head * hq
    assert_close(out, lse, q, k, v, qp, kp, causal, expect_empty=expect)


def test_flash_tensor_descriptor_path_and_scale():
    # The TMA path (K/V through tensor descriptors; zero fill past Lk) with a custom scale.
    q, k, v = qkv(1, 6, 2, 37, 101, 64, torch.float32, seed=3)
    qp, kp = torch.arange(37) + 30, torch.arange(101)
    out, lse = flash_attention(q, k, v, q_pos=qp, k_pos=kp, config=(16, 32, 4, 1), tma=True, scale=0.3)
    assert_close(out, lse, q, k, v, qp, kp, scale=0.3, expect_empty=0)


def test_flash_strided_inputs_and_empty_key_set():
    q, k, v = qkv(1, 4, 2, 33, 45, 32, torch.float32, seed=4)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, L, H, D] memory, as projections give
    qp, kp = torch.arange(33) + 12, torch.arange(45)
    out, lse = flash_attention(qt, k, v, q_pos=qp, k_pos=kp, config=(16, 16, 4, 1))
    assert_close(out, lse, q, k, v, qp, kp, expect_empty=0)
    out, lse = flash_attention(q, k[:, :, :0], v[:, :, :0], q_pos=qp, k_pos=kp[:0])
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_flash_partials_merge_to_full():
    # The contract: results over disjoint key sets combine exactly by lse.
    q, k, v = qkv(1, 6, 2, 37, 101, 32, torch.float32, seed=5)
    qp, kp = torch.arange(37) + 60, torch.arange(101)
    cfg = (16, 32, 4, 1)
    o1, l1 = flash_attention(q, k[:, :, :50], v[:, :, :50], q_pos=qp, k_pos=kp[:50], config=cfg)
    o2, l2 = flash_attention(q, k[:, :, 50:], v[:, :, 50:], q_pos=qp, k_pos=kp[50:], config=cfg)
    out, lse = merge_many(torch.stack([o1, o2], -2), torch.stack([l1, l2], -1))
    assert_close(out, lse, q, k, v, qp, kp, expect_empty=0)


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("parts,d", [(1, 64), (3, 24), (4, 64), (5, 32)])
def test_merge_stacked_matches_reference(parts, d, dtype, use_triton):
    """The CP group's decode merge: partials over disjoint key sets, packed [S, B, H, L, D + 1], against
    float64 attention over every key; rows empty in some partials and in all of them."""
    B, hq, hkv, lq = 2, 4, 2, 3
    lk = 7 * parts
    q, k, v = qkv(B, hq, hkv, lq, lk, d, dtype, seed=parts)
    qp = torch.tensor([-1, 5, 1000])  # row 0 sees no key at all; row 1 only the first partial's
    kp = torch.arange(lk)
    owner = torch.randperm(lk, generator=torch.Generator().manual_seed(d)) % parts  # scattered key sets
    owner[:6] = 0
    packed = []
    for r in range(parts):
        sel = (owner == r).nonzero().flatten()
        o, l = attention(q, k[:, :, sel], v[:, :, sel], q_pos=qp, k_pos=kp[sel], causal=True)
        packed.append(torch.cat([o.float(), l.unsqueeze(-1)], -1))
    out, lse = merge_stacked(torch.stack(packed), dtype, use_triton=use_triton)
    assert_close(out, lse, q, k, v, qp, kp, expect_empty=B * hq)
    with pytest.raises(ValueError, match="float32"):
        merge_stacked(torch.stack(packed).half(), dtype)


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [64, 24])
def test_merge_into_matches_reference(d, dtype, use_triton):
    """The ring's in-place accumulate: a slice of a float32 accumulator merged with a partial in the
    model's strided layout, against float64 attention over both key sets; rows empty in the
    accumulator, in the partial, and in both."""
    B, hq, hkv, lq = 2, 4, 2, 40
    q, k, v = qkv(B, hq, hkv, lq, 60, d, dtype, seed=d)
    qp = torch.arange(lq) - 5  # rows 0..4 see no key at all; the first partial holds keys 0..19
    kp = torch.arange(60)
    o1, l1 = attention(q, k[:, :, :20], v[:, :, :20], q_pos=qp, k_pos=kp[:20], causal=True)
    o2, l2 = attention(q, k[:, :, 20:], v[:, :, 20:], q_pos=qp, k_pos=kp[20:], causal=True)
    acc_out = torch.full((B, hq, lq + 7, d), 7.0)  # the accumulator is wider: only the slice may change
    acc_lse = torch.full((B, hq, lq + 7), 7.0)
    acc_out[:, :, 3 : 3 + lq], acc_lse[:, :, 3 : 3 + lq] = o1.float(), l1
    o2s = o2.transpose(1, 2).contiguous().transpose(1, 2)  # [B, L, H, D] storage, as attention returns it
    merge_into(acc_out[:, :, 3 : 3 + lq], acc_lse[:, :, 3 : 3 + lq], o2s, l2, use_triton=use_triton)
    out, lse = acc_out[:, :, 3 : 3 + lq].to(dtype), acc_lse[:, :, 3 : 3 + lq]
    assert_close(out, lse, q, k, v, qp, kp, expect_empty=B * hq * 5)
    assert (acc_out[:, :, :3] == 7).all() and (acc_out[:, :, 3 + lq :] == 7).all() and (acc_lse[:, :, :3] == 7).all()
    with pytest.raises(ValueError, match="float32"):
        merge_into(acc_out[:, :, :lq].half(), acc_lse[:, :, :lq], o2, l2)
    with pytest.raises(ValueError, match="shapes"):
        merge_into(acc_out[:, :, :lq - 1], acc_lse[:, :, :lq - 1], o2, l2)


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_partials_matches_reference(dtype, use_triton):
    """Two partials (one in the model's strided layout) merged into a new result in the first's dtype,
    against float64 attention over both key sets; rows empty in one partial and in both."""
    B, hq, hkv, lq, d = 2, 4, 2, 33, 40
    q, k, v = qkv(B, hq, hkv, lq, 50, d, dtype, seed=3)
    qp = torch.arange(lq) - 3  # rows 0..2 see nothing; rows 3..12 only the first partial's keys
    kp = torch.arange(50)
    o1, l1 = attention(q, k[:, :, :10], v[:, :, :10], q_pos=qp, k_pos=kp[:10], causal=True)
    o2, l2 = attention(q, k[:, :, 10:], v[:, :, 10:], q_pos=qp, k_pos=kp[10:], causal=True)
    o2s = o2.transpose(1, 2).contiguous().transpose(1, 2)
    out, lse = merge_two(o1, l1, o2s, l2, use_triton=use_triton)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, lse, q, k, v, qp, kp, expect_empty=B * hq * 3)


_MERGE_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from starshard.kernels import merge
fn = merge._merge_stacked_kernel
sig = {"P": "*fp32", "O": "*bf16", "LSE": "*fp32", "rows": "i32", "n_parts": "i32",
       "HEAD_DIM": "constexpr", "BLOCK_D": "constexpr", "BLOCK_S": "constexpr"}
for d, s in ((128, 2), (64, 8)):
    consts = dict(HEAD_DIM=d, BLOCK_D=d, BLOCK_S=s)
    triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
fn = merge._merge_two_kernel
for a, o in (("fp32", "fp32"), ("bf16", "bf16")):  # merge_into's accumulator; merge_partials on bf16
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(A="*" + a, LA="*fp32", P="*bf16", LP="*fp32", O="*" + o, LO="*fp32", HEAD_DIM="constexpr",
               BLOCK_D="constexpr", BLOCK_R="constexpr")
    triton.compile(ASTSource(fn, sig, constexprs=dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_R=32)),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print("compiled")
"""


def test_merge_kernels_compile_for_sm90(tmp_path):
    """The interpreter skips Triton's compiler: build the merge kernels for sm_90a (no GPU needed)."""
    assert_compiles_for_sm90(_MERGE_COMPILE, tmp_path)


# name, B, Hq, Hkv, Lq, Lk, D, q_pos, k_pos, causal, num_splits, rows without a visible key per batch
DECODE_CASES = [
    ("one-row-gqa3-splits-uneven", 1, 6, 2, 1, 1000, 64, torch.tensor([999]), torch.arange(1000), True, 3, 0),
    ("five-rows-gqa3x3", 1, 9, 3, 5, 301, 32, torch.arange(296, 301), torch.arange(301), True, 4, 0),
    ("sixteen-rows-some-empty", 1, 4, 2, 16, 100, 64, torch.arange(16) - 8, torch.arange(100), True, 3, 8 * 4),
    ("two-row-blocks-gqa8", 2, 8, 1, 16, 200, 32, torch.arange(184, 200), torch.arange(200), True, 2, 0),
    ("noncausal-d48", 1, 4, 2, 3, 77, 48, torch.zeros(3, dtype=torch.long), torch.zeros(77, dtype=torch.long), False, 2, 0),
    ("query-between-zigzag-keys", 1, 4, 2, 2, 48, 64, torch.tensor([30, 80]), ZIG, True, 2, 0),
]


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_matches_reference(case, dtype, use_triton):
    _, B, hq, hkv, lq, lk, d, qp, kp, causal, splits, empty = case
    q, k, v = qkv(B, hq, hkv, lq, lk, d, dtype, seed=7)
    out, lse = decode_attention(q, k, v, q_pos=qp, k_pos=kp, causal=causal, num_splits=splits, use_triton=use_triton)
    assert_close(out, lse, q, k, v, qp, kp, causal, expect_empty=empty * B)


def test_decode_default_splits_and_config():
    q, k, v = qkv(1, 8, 2, 2, 1500, 64, torch.float32, seed=8)
    qp, kp = torch.tensor([700, 1499]), torch.arange(1500)
    out, lse = decode_attention(q, k, v, q_pos=qp, k_pos=kp, use_triton=True)
    assert_close(out, lse, q, k, v, qp, kp, expect_empty=0)
    out, lse = decode_attention(q, k, v, q_pos=qp, k_pos=kp, use_triton=True, num_splits=5, config=(32, 4, 1))
    assert_close(out, lse, q, k, v, qp, kp, expect_empty=0)


def test_decode_split_count_fills_one_round(monkeypatch):
    """The built-in split count: as many programs as fit one round (one per multiprocessor for 16-bit caches,
    two for e4m3), never a partial second round, no split under _MIN_CHUNK keys."""
    monkeypatch.setattr(dk, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    for fp8, per_sm in ((False, 1), (True, 2)):
        for programs_per_split in (1, 3, 4, 8, 17, 132, 300):
            for Lk in (1, 100, 4096, 131072):
                n = dk._num_splits(cuda, programs_per_split, Lk, fp8)
                assert n >= 1 and (n == 1 or n * programs_per_split <= per_sm * 132), (fp8, programs_per_split, Lk, n)
                assert n == 1 or -(-Lk // n) >= dk._MIN_CHUNK
                if Lk == 131072 and programs_per_split <= per_sm * 132:
                    assert (n + 1) * programs_per_split > per_sm * 132  # the round is filled
    assert dk._num_splits(cuda, 8, 131072) == 16 and dk._num_splits(cuda, 8, 131072, fp8=True) == 33


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_decode_length_on_device_ignores_the_rest(use_triton):
    """length= (CUDA-graph decode): keys past the valid count are ignored, even when they hold
    garbage and their splits are empty; the result equals attention over the valid prefix."""
    q, k, v = qkv(1, 6, 2, 1, 700, 64, torch.float32, seed=11)
    kp = torch.arange(700)
    for n in (1, 63, 300, 700):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, n:], v2[:, :, n:] = 1e4, float("nan")  # must never be read into the result
        length = torch.tensor([n], dtype=torch.int32)
        out, lse = decode_attention(q, k2, v2, q_pos=torch.tensor([n - 1]), k_pos=kp, causal=False, num_splits=4,
                                    use_triton=use_triton, length=length)
        assert_close(out, lse, q, k[:, :, :n], v[:, :, :n], torch.tensor([n - 1]), kp[:n], causal=False, expect_empty=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_through_a_table_reads_whichever_cache_it_names(dtype):
    """table= (the service's decode graphs): k, v, k_pos are one-row anchors of the token-major layout; the
    kernel reads the cache whose offsets and length the table holds. Two caches of other lengths, named in
    turn through the same anchors and q, equal attention over each (GQA, rows at different positions)."""
    hq, hkv, d, lq = 8, 2, 64, 3
    gen = torch.Generator().manual_seed(21)

    def token_major(n):  # [1, n, Hkv, D] memory handed out as [1, Hkv, n, D] (engine/kv_cache.py)
        return torch.randn(1, n, hkv, d, generator=gen).to(dtype).permute(0, 2, 1, 3)

    anchors = (token_major(1), token_major(1), torch.zeros(1, dtype=torch.long))
    q = torch.randn(1, hq, lq, d, generator=gen).to(dtype)
    for n, length, qp in ((300, 300, torch.tensor([299, 150, 7])), (777, 701, torch.tensor([700, 700, 3]))):
        k, v, kp = token_major(n), token_major(n), torch.arange(n) * 2 // 2
        table = torch.tensor(dk.table_row(k, v, kp, length, anchors))
        out, lse = decode_attention(q, *anchors[:2], q_pos=qp, k_pos=anchors[2], use_triton=True, num_splits=5,
                                    config=(32, 4, 1), table=table)
        assert_close(out, lse, q, k[:, :, :length], v[:, :, :length], qp, kp[:length], expect_empty=0)
    with pytest.raises(ValueError, match="strides"):  # a head-major cache: the kernel would misread it
        dk.table_row(torch.zeros(1, hkv, 9, d, dtype=dtype), torch.zeros(1, hkv, 9, d, dtype=dtype),
                     torch.arange(9), 9, anchors)
    with pytest.raises(ValueError, match="no window"):
        decode_attention(q, *anchors[:2], q_pos=qp, k_pos=anchors[2], use_triton=True, table=table, window=4)
    # a cache 8 elements past an aligned start: the kernel's vectorized loads assume TABLE_ALIGN-element offsets
    flat = torch.zeros(8 + 9 * hkv * d, dtype=dtype)[8:]
    shifted = flat.view(1, 9, hkv, d).permute(0, 2, 1, 3)
    with pytest.raises(ValueError, match="multiple of 16"):
        dk.table_row(shifted, token_major(9), torch.arange(9), 9, anchors)


_TABLE_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from starshard.kernels import decode
fn = decode._decode_split_kernel
# specialized as a launch on the service's cache specializes it (Llama-3.1-8B: 8 KV heads x 128, token-major):
# 16-byte aligned pointers and multiple-of-16 ints get divisibility 16, unit strides become constants
# The per-batch graphs' launch (TABLE=False: the length an int32 tensor) beside each, for its registers.
base = dict(Q="*bf16", K="*bf16", V="*bf16", OP="*fp32", LP="*fp32", QPOS="*i64", KPOS="*i64", KS="*fp32",
            VS="*fp32", qk_scale="fp32")
ints = dict(s_qb=4096, s_qh=128, s_qm=128, s_qd=1, s_kb=1024, s_kh=128, s_kn=1024, s_kd=1, s_vb=1024, s_vh=128,
            s_vn=1024, s_vd=1, s_sb=0, s_sh=0, Hkv=8, G=4)
free = {"Lq", "Lk", "chunk", "n_splits", "s_qpb", "s_kpb"}  # do_not_specialize
for block_m, table in ((16, True), (16, False), (64, True), (64, False)):  # 1 / 16 questions at GQA 4
    types = dict(base, LK_PTR="*i64", KVT="*i64") if table else dict(base, LK_PTR="*i32")
    consts = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_M=block_m, BLOCK_N=64, CAUSAL=True, IEEE=False, HAS_LK=True,
                  FP8=False, USE_PDL=True, WINDOW=False, SOFTCAP=False, TABLE=table, KRANGE=None, window=0,
                  cap_in=1.0, cap_out=1.0, s_krb=0, **({} if table else {"KVT": None}))
    print(f"variant table={table} block_m={block_m}", flush=True)
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in consts:
            sig[n] = "constexpr"
        elif n in types:
            sig[n] = types[n]
            if types[n][0] == "*":
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif n not in free and ints[n] == 1:
            sig[n], consts[n] = "constexpr", 1
        else:
            sig[n] = "i32"
            if n not in free and ints[n] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "num_stages": 3})
print("compiled")
"""


def test_decode_table_kernel_compiles_for_sm90_without_spills(tmp_path):
    """The table variant (the service's decode graphs) builds for sm_90a, specialized as the service launches it,
    and ptxas keeps it in registers: with the table's offsets of unknown alignment it loaded the cache element by
    element (255 registers, spills), while the service's steps through it took 4-5x those of the per-batch
    graphs on an H100. Nor more registers than the per-batch graphs' launch of the same tile: a length read as
    int64 (the table's) made every key mask 64-bit (Triton 3.6: 189 / 254 registers against 148 / 238; the
    16-question kernel 1.14x the per-batch one on an H100). ptxas's report: TRITON_DUMP_PTXAS_LOG."""
    import triton
    out = assert_compiles_for_sm90(_TABLE_COMPILE, tmp_path, env={"TRITON_DUMP_PTXAS_LOG": "1"})
    if not hasattr(triton.knobs.nvidia, "dump_ptxas_log"):
        pytest.skip(f"triton {triton.__version__} prints no ptxas report: the build alone is checked")
    spills = [line.strip() for line in out.splitlines() if "spill stores" in line]
    assert len(spills) == 4 and all(line.startswith("0 bytes stack frame, 0 bytes spill stores") for line in spills), \
        spills
    regs, variant = {}, None
    for line in out.splitlines():
        if line.startswith("variant "):
            variant = line.split(" ", 1)[1]
        elif "registers" in line and variant is not None:
            regs[variant] = int(line.split("Used")[1].split("registers")[0])
    for block_m in (16, 64):
        assert regs[f"table=True block_m={block_m}"] <= regs[f"table=False block_m={block_m}"], regs


def test_block_ranges_against_brute_force():
    gen = torch.Generator().manual_seed(9)
    bm, bn = 8, 4
    for sort in (True, False):
        qp = torch.randint(0, 60, (2, 29), generator=gen)
        kp = torch.randint(0, 60, (2, 37), generator=gen)
        if sort:
            qp, kp = qp.sort(-1).values, kp.sort(-1).values
        ranges = block_ranges(qp, kp, bm, bn)
        for p in range(2):
            for i in range(ranges.shape[1]):
                qb = qp[p, i * bm:(i + 1) * bm]
                n_full, n_blocks = ranges[p, i].tolist()
                for j in range(-(-37 // bn)):
                    kb = kp[p, j * bn:(j + 1) * bn]
                    vis = kb[None, :] <= qb[:, None]
                    if j < n_full:
                        assert len(kb) == bn and vis.all()  # unmasked blocks: full and all visible
                    if j >= n_blocks:
                        assert not vis.any()  # skipped blocks: nothing visible
                if sort and n_blocks > n_full:  # sorted positions: the masked range is tight
                    assert not (kp[p, n_full * bn:(n_full + 1) * bn][None, :] <= qb[:, None]).all() or (n_full + 1) * bn > 37
                    assert (kp[p, (n_blocks - 1) * bn:n_blocks * bn][None, :] <= qb[:, None]).any()


def test_mask_mode():
    a = torch.arange(100)
    assert mask_mode(a, a, True) == "causal"
    assert mask_mode(a, a.clone(), False) == "full"
    assert mask_mode(torch.arange(100, 110), a, True) == "full"  # query after every key
    assert mask_mode(torch.arange(90, 100), a, True) == "masked"  # query tail: bottom-right, not index-causal
    assert mask_mode(a + 5, a + 5, True) == "causal"
    assert mask_mode(a, a + 1, True) == "masked"
    # Strictly increasing with gaps (a zigzag shard, Star's [anchor; block]): index-causal is position-causal.
    assert mask_mode(ZIG, ZIG, True) == "causal"
    star = torch.cat([torch.arange(8), torch.arange(40, 60)])
    assert mask_mode(star, star.clone(), True) == "causal"
    assert mask_mode(star, star[:-1], True) == "masked"  # not square
    dup = torch.cat([torch.arange(10), torch.arange(9, 20)])  # a repeated position sees its twin both ways
    assert mask_mode(dup, dup, True) == "masked"
    assert mask_mode(star.flip(0), star.flip(0), True) == "masked"


@pytest.mark.parametrize("pos", [ZIG, torch.cat([torch.arange(8), torch.arange(40, 60)])], ids=["zigzag", "star"])
def test_gapped_increasing_positions_are_index_causal(pos):
    """What mask_mode's "causal" for gapped positions relies on (the fused kernels' is_causal is
    index-causal): attention by those positions equals attention by indices 0 .. L-1."""
    g = torch.Generator().manual_seed(len(pos))
    L = len(pos)
    q, k, v = torch.randn(1, 4, L, 16, generator=g), torch.randn(1, 2, L, 16, generator=g), torch.randn(1, 2, L, 16, generator=g)
    by_pos = attention_math(q, k, v, q_pos=pos, k_pos=pos, causal=True)
    by_index = attention_math(q, k, v, q_pos=torch.arange(L), k_pos=torch.arange(L), causal=True)
    assert torch.equal(by_pos[0], by_index[0]) and torch.equal(by_pos[1], by_index[1])


@pytest.mark.parametrize("shape,dtype,Lk,mode,want", [
    ((1, 32, 1, 128), torch.bfloat16, 10**6, None, "decode"),
    ((1, 32, 8192, 128), torch.bfloat16, 8192, "causal", "cudnn"),
    ((1, 32, 100, 128), torch.bfloat16, 4096, "full", "flash-sdpa"),  # short block: no cuDNN plan per shape
    ((1, 32, 8192, 128), torch.float32, 8192, "causal", "triton"),  # fused kernels are half precision only
    ((1, 32, 8192, 256), torch.bfloat16, 8192, "causal", "triton"),
    ((1, 32, 4096, 128), torch.bfloat16, 4096, "masked", "triton"),
    ((1, 32, 64, 128), torch.bfloat16, 32768, "masked", "decode"),  # 32 programs for 132 SMs: split keys
    ((8, 32, 64, 128), torch.bfloat16, 32768, "masked", "triton"),
])
def test_cuda_backend_choice(shape, dtype, Lk, mode, want):
    assert cuda_backend(torch.empty(shape, dtype=dtype, device="meta"), Lk, mode, sms=132) == want


DISPATCH_CASES = [
    ("square-causal", 1, 6, 2, 40, 40, torch.arange(40), torch.arange(40), True),
    ("query-in-middle", 1, 6, 2, 37, 101, torch.arange(37) + 30, torch.arange(101), True),
    ("rows-without-keys", 1, 9, 3, 37, 101, torch.arange(37) - 10, torch.arange(101), True),
    ("zigzag", 1, 4, 2, 48, 48, ZIG, ZIG, True),
    ("noncausal", 1, 4, 2, 50, 77, torch.arange(50), torch.arange(77), False),
    ("decode-rows", 1, 9, 3, 3, 101, torch.tensor([-1, 50, 100]), torch.arange(101), True),
    ("per-batch-positions", 2, 4, 2, 20, 30, torch.stack([torch.arange(20), torch.arange(20) + 9]), torch.arange(30)[None], True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("case", DISPATCH_CASES, ids=[c[0] for c in DISPATCH_CASES])
def test_attention_dispatch_cpu(case, dtype):
    _, B, hq, hkv, lq, lk, qp, kp, causal = case
    q, k, v = qkv(B, hq, hkv, lq, lk, 32, dtype, seed=11)
    out, lse = attention(q, k, v, q_pos=qp, k_pos=kp, causal=causal)
    assert_close(out, lse, q, k, v, qp, kp, causal)


def test_attention_math_chunked(monkeypatch):
    # A small score budget forces several row chunks; float64 in, float64 exactness out.
    monkeypatch.setattr(ref_mod, "_MATH_SCORE_BUDGET", 6 * 101 * 5)
    q, k, v = qkv(1, 6, 2, 37, 101, 16, torch.float64, seed=12)
    qp, kp = torch.arange(37) - 5, torch.arange(101)
    out, lse = attention_math(q, k, v, q_pos=qp, k_pos=kp)
    assert_close(out, lse, q, k, v, qp, kp, expect_empty=5 * 6)


def test_dispatch_routes_short_queries_to_math_on_cpu(monkeypatch):
    calls = []
    real = attn_mod.attention_math
    monkeypatch.setattr(attn_mod, "attention_math", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = qkv(1, 4, 2, DECODE_MAX_ROWS, 64, 16, torch.float32)
    attention(q, k, v, q_pos=torch.arange(48, 64), k_pos=torch.arange(64))
    assert calls == [1]
    q, k, v = qkv(1, 4, 2, DECODE_MAX_ROWS + 1, 64, 16, torch.float32)
    attention(q, k, v, q_pos=torch.arange(47, 64), k_pos=torch.arange(64))
    assert calls == [1]  # the fused CPU kernel took the longer block


@pytest.mark.parametrize("fn", [attention, flash_attention, decode_attention])
def test_bad_inputs_raise(fn):
    q, k, v = qkv(1, 4, 2, 8, 16, 16, torch.float32)
    pos_q, pos_k = torch.arange(8), torch.arange(16)
    with pytest.raises(ValueError, match="4-D"):
        fn(q[0], k, v, q_pos=pos_q, k_pos=pos_k)
    with pytest.raises(ValueError, match="k and v shapes differ"):
        fn(q, k, v[:, :, :8], q_pos=pos_q, k_pos=pos_k)
    k3 = torch.randn(1, 3, 16, 16)
    with pytest.raises(ValueError, match="GQA"):
        fn(q, k3, k3, q_pos=pos_q, k_pos=pos_k)
    with pytest.raises(ValueError, match="head_dim"):
        fn(q, k[..., :8], v[..., :8], q_pos=pos_q, k_pos=pos_k)
    if fn is not attention:  # the kernels also check positions and dtypes
        kw = {"use_triton": True} if fn is decode_attention else {}
        with pytest.raises(ValueError, match="q_pos"):
            fn(q, k, v, q_pos=torch.arange(7), k_pos=pos_k, **kw)
        with pytest.raises(ValueError, match="dtypes differ"):
            fn(q, k.half(), v.half(), q_pos=pos_q, k_pos=pos_k, **kw)
