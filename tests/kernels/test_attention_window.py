"""Sliding window, logit soft-capping and attention sinks (the attention.py contract) on every path,
against an independent float64 dense reference written as transformers writes them (Mistral / Gemma
sliding_window mask kv > q - window, Gemma 2 softcap, GPT-OSS sinks as an extra softmax column).

The Triton kernels run on CPU through TRITON_INTERPRET=1 (tests/conftest.py), at small sizes; on a CUDA
machine tests/gpu/test_window_kernels.py runs the compiled kernels against the same reference.
"""
import importlib

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted kernels on CPU tensors; on a GPU "
                                "machine tests/gpu/test_window_kernels.py runs the compiled ones")

from starshard.kernels.attention import attention, cuda_backend  # noqa: E402
from starshard.kernels.cpu import attention_cpu  # noqa: E402
from starshard.kernels.decode import decode_attention, window_key_range  # noqa: E402
from starshard.kernels.flash import block_ranges, flash_attention  # noqa: E402
from starshard.kernels.merge import apply_sink, merge_partials  # noqa: E402
from starshard.kernels.reference import attention_math  # noqa: E402

ref_mod = importlib.import_module("starshard.kernels.reference")

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 2e-3)}  # relative error of out, max error of lse


def dense(q, k, v, q_pos, k_pos, window=None, softcap=None, sinks=None, scale=None):
    """float64: scores, softcap, causal + window mask, a sink column in the softmax (dropped after)."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    qp = (q_pos if q_pos.dim() == 2 else q_pos[None])[:, :, None]
    kp = (k_pos if k_pos.dim() == 2 else k_pos[None])[:, None, :]
    visible = kp <= qp
    if window is not None:
        visible = visible & (kp > qp - window)
    s = s.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)  # without the sink, by the contract
    if sinks is not None:
        col = sinks.double()[None, :, None, None].expand(*s.shape[:-1], 1)
        s = torch.cat([s, col], -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)[..., : kk.shape[2]]
    return p @ vv, lse


def check(out, lse, q, k, v, q_pos, k_pos, **kw):
    ref, ref_lse = dense(q, k, v, q_pos, k_pos, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    tol_out, tol_lse = TOL[q.dtype]
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < tol_out, f"relative error {err:.3e}"
    fin = torch.isfinite(ref_lse)
    assert torch.isfinite(out).all()
    assert (lse[fin].double() - ref_lse[fin]).abs().max().item() < tol_lse
    assert torch.isneginf(lse[~fin]).all() and (out[~fin] == 0).all()


def qkv(B, hq, hkv, lq, lk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 1.5).to(dtype)  # noqa: E731  (wide scores: softcap bites)
    return r(B, hq, lq, d), r(B, hkv, lk, d), r(B, hkv, lk, d)


def sink_logits(hq, seed=1):
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2


# name, B, Hq, Hkv, Lq, Lk, D, q_pos, k_pos, window
PREFILL = [
    ("square-window-smaller", 1, 4, 2, 45, 45, 64, torch.arange(45), torch.arange(45), 9),
    ("square-window-larger", 1, 4, 2, 37, 37, 64, torch.arange(37), torch.arange(37), 100),
    ("cache-prefix-gqa3", 1, 6, 2, 21, 77, 128, torch.arange(56, 77), torch.arange(77), 17),
    ("d256-odd", 1, 2, 1, 19, 41, 256, torch.arange(22, 41), torch.arange(41), 12),
    ("per-batch-positions", 2, 4, 4, 23, 50, 32, torch.stack([torch.arange(27, 50), torch.arange(23) + 3]),
     torch.arange(50), 6),
    ("zigzag-shard", 1, 4, 2, 24, 24, 64, torch.cat([torch.arange(0, 12), torch.arange(36, 48)]),
     torch.cat([torch.arange(0, 12), torch.arange(36, 48)]), 10),
    ("rows-before-every-key", 1, 2, 1, 20, 30, 64, torch.arange(20) - 5, torch.arange(30), 4),
]
FEATURES = [dict(), dict(softcap=8.0), dict(sinks=True), dict(softcap=8.0, sinks=True)]


def _features(f, hq):
    return {k: (sink_logits(hq) if k == "sinks" else x) for k, x in f.items()}


@pytest.mark.parametrize("feat", FEATURES, ids=lambda f: "+".join(f) or "window")
@pytest.mark.parametrize("case", PREFILL, ids=lambda c: c[0])
def test_flash_kernel(case, feat):
    name, B, hq, hkv, lq, lk, d, qp, kp, window = case
    q, k, v = qkv(B, hq, hkv, lq, lk, d)
    kw = dict(window=window, **_features(feat, hq))
    out, lse = flash_attention(q, k, v, q_pos=qp, k_pos=kp, config=(16, 16, 4, 1), **kw)
    check(out, lse, q, k, v, qp, kp, **kw)


@pytest.mark.parametrize("feat", FEATURES, ids=lambda f: "+".join(f) or "window")
@pytest.mark.parametrize("case", PREFILL, ids=lambda c: c[0])
def test_math_and_dispatch(case, feat):
    """attention_math directly, and the CPU dispatcher (torch's fused kernel with a window bias where
    it applies, the math path for softcap / sinks)."""
    name, B, hq, hkv, lq, lk, d, qp, kp, window = case
    q, k, v = qkv(B, hq, hkv, lq, lk, d, seed=3)
    kw = dict(window=window, **_features(feat, hq))
    check(*attention_math(q, k, v, q_pos=qp, k_pos=kp, **kw), q, k, v, qp, kp, **kw)
    check(*attention(q, k, v, q_pos=qp, k_pos=kp, **kw), q, k, v, qp, kp, **kw)
    if not feat and qp.dim() == 1:
        check(*attention_cpu(q, k, v, q_pos=qp, k_pos=kp, window=window), q, k, v, qp, kp, window=window)


def test_math_chunked_rows(monkeypatch):
    monkeypatch.setattr(ref_mod, "_MATH_SCORE_BUDGET", 4 * 30 * 3)  # three rows per chunk
    q, k, v = qkv(1, 4, 2, 10, 30, 32)
    qp, kp = torch.arange(20, 30), torch.arange(30)
    kw = dict(window=5, softcap=3.0, sinks=sink_logits(4))
    check(*attention_math(q, k, v, q_pos=qp, k_pos=kp, **kw), q, k, v, qp, kp, **kw)


# name, B, Hq, Hkv, Lq, Lk, D, q_pos, k_pos, window, num_splits
DECODE = [
    ("one-row-window-in-middle", 1, 6, 2, 1, 300, 64, torch.tensor([299]), torch.arange(300), 37, 3),
    ("one-row-window-larger", 1, 4, 1, 1, 90, 128, torch.tensor([89]), torch.arange(90), 500, 4),
    ("d256-gqa2", 1, 4, 2, 1, 120, 256, torch.tensor([119]), torch.arange(120), 50, 2),
    ("rows-of-a-chunk", 1, 4, 2, 5, 200, 32, torch.arange(150, 155), torch.arange(200), 20, 4),
    ("per-batch-lengths", 2, 4, 2, 1, 160, 64, torch.tensor([[159], [70]]), torch.arange(160), 33, 3),
]


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("feat", FEATURES, ids=lambda f: "+".join(f) or "window")
@pytest.mark.parametrize("case", DECODE, ids=lambda c: c[0])
def test_decode(case, feat, use_triton):
    name, B, hq, hkv, lq, lk, d, qp, kp, window, splits = case
    q, k, v = qkv(B, hq, hkv, lq, lk, d, seed=5)
    kw = dict(window=window, **_features(feat, hq))
    out, lse = decode_attention(q, k, v, q_pos=qp, k_pos=kp, num_splits=splits, use_triton=use_triton, **kw)
    check(out, lse, q, k, v, qp, kp, **kw)


@pytest.mark.parametrize("kernel", ["flash", "decode"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_head_dims_float16_no_window(kernel, d):
    """Each head dim with softcap and sinks only (no window), float16."""
    lq = 1 if kernel == "decode" else 24
    q, k, v = qkv(1, 4, 2, lq, 40, d, torch.float16, seed=d)
    qp, kp = torch.arange(40 - lq, 40), torch.arange(40)
    kw = dict(softcap=6.0, sinks=sink_logits(4))
    if kernel == "flash":
        out, lse = flash_attention(q, k, v, q_pos=qp, k_pos=kp, config=(16, 16, 4, 1), **kw)
    else:
        out, lse = decode_attention(q, k, v, q_pos=qp, k_pos=kp, num_splits=3, use_triton=True, **kw)
    check(out, lse, q, k, v, qp, kp, **kw)


def test_decode_fp8_cache_with_window_softcap_sinks():
    """An e4m3 cache takes the general split kernel (not the unmasked "even" one) with every argument."""
    from starshard.kernels.fp8 import dequantize, quantize_rows

    q, k, v = qkv(1, 4, 2, 1, 130, 64, torch.float16, seed=9)
    k8, ks = quantize_rows(k)
    v8, vs = quantize_rows(v)
    qp, kp = torch.tensor([129]), torch.arange(130)
    kw = dict(window=40, softcap=5.0, sinks=sink_logits(4))
    out, lse = decode_attention(q, k8, v8, q_pos=qp, k_pos=kp, num_splits=3, use_triton=True, k_scale=ks, v_scale=vs,
                                **kw)
    check(out, lse, q, dequantize(k8, ks, torch.float16), dequantize(v8, vs, torch.float16), qp, kp, **kw)


def test_window_skips_key_blocks(dot_flops):
    """Key blocks wholly outside every row's window are never computed (not merely masked): the
    interpreted kernels' tl.dot count is that of the window's blocks, not of all keys."""
    lq, lk, d, bm, bn = 16, 256, 32, 16, 16
    q, k, v = qkv(1, 1, 1, lq, lk, d)
    qp, kp = torch.arange(lk - lq, lk), torch.arange(lk)
    flash_attention(q, k, v, q_pos=qp, k_pos=kp, config=(bm, bn, 4, 1), window=20)
    blocks = len(dot_flops) // 2  # q.k and p.v per key block
    # rows 240..255 with window 20 see keys 221..255: key blocks 13, 14, 15
    assert blocks == 3, blocks
    dot_flops.clear()
    decode_attention(q[:, :, -1:], k, v, q_pos=qp[-1:], k_pos=kp, num_splits=4, use_triton=True, config=(16, 4, 1),
                     window=20)
    # keys 236..255 shared by 4 splits, 16 keys each: 2 blocks (split 0: 236..251, split 1: 252..255)
    assert len(dot_flops) // 2 == 2, len(dot_flops)


def test_block_ranges_window_against_brute_force():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        lq, lk = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 60, (1,), generator=g))
        sorted_keys = trial % 2 == 0
        kp = torch.arange(lk) if sorted_keys else torch.randint(0, 60, (lk,), generator=g)
        qp = torch.randint(0, 70, (lq,), generator=g).sort().values
        window = int(torch.randint(1, 30, (1,), generator=g))
        bm, bn = 8, 8
        r = block_ranges(qp[None], kp[None], bm, bn, window)[0]
        for i in range(r.shape[0]):
            n_skip, full_lo, n_full, n_blocks = r[i].tolist()
            assert 0 <= n_skip <= full_lo <= n_full <= n_blocks
            qb = qp[i * bm : (i + 1) * bm]
            vis = (kp[None] <= qb[:, None]) & (kp[None] > qb[:, None] - window)
            for j in range(-(-lk // bn)):
                blk = vis[:, j * bn : (j + 1) * bn]
                if j < n_skip or j >= n_blocks:
                    assert not blk.any(), (trial, i, j)
                if full_lo <= j < n_full:
                    assert blk.all(), (trial, i, j)
        lo, hi = window_key_range(qp[None], kp[None], window)[0].tolist()
        vis = (kp[None] <= qp[:, None]) & (kp[None] > qp[:, None] - window)
        assert not vis[:, :lo].any() and not vis[:, hi:].any()


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_merge_of_key_halves_with_sink_once(use_triton):
    """Two halves of the keys, computed without sinks, merged by lse, then apply_sink once: equals the
    whole call with sinks (out) and its lse (which excludes the sink)."""
    q, k, v = qkv(1, 4, 2, 9, 70, 64, seed=11)
    qp, kp = torch.arange(61, 70), torch.arange(70)
    sinks = sink_logits(4)
    kw = dict(window=25, softcap=7.0)
    halves = [flash_attention(q, k[:, :, s], v[:, :, s], q_pos=qp, k_pos=kp[s], config=(16, 16, 4, 1), **kw)
              for s in (slice(0, 40), slice(40, 70))]
    out, lse = apply_sink(*merge_partials(*halves[0], *halves[1], use_triton=use_triton), sinks)
    whole, whole_lse = flash_attention(q, k, v, q_pos=qp, k_pos=kp, config=(16, 16, 4, 1), sinks=sinks, **kw)
    assert (out - whole).abs().max() < 1e-5 and (lse - whole_lse).abs().max() < 1e-5
    check(out, lse, q, k, v, qp, kp, sinks=sinks, **kw)
    # a sink in each half would count it twice
    each = [flash_attention(q, k[:, :, s], v[:, :, s], q_pos=qp, k_pos=kp[s], config=(16, 16, 4, 1), sinks=sinks, **kw)
            for s in (slice(0, 40), slice(40, 70))]
    assert (merge_partials(*each[0], *each[1])[0] - whole).abs().max() > 1e-3


def test_rows_that_see_no_key_with_sinks():
    q, k, v = qkv(1, 2, 1, 4, 10, 32)
    qp, kp = torch.tensor([-3, -1, 30, 31]), torch.arange(10)  # before every key; past every window
    kw = dict(window=5, sinks=sink_logits(2))
    for out, lse in (flash_attention(q, k, v, q_pos=qp, k_pos=kp, config=(16, 16, 4, 1), **kw),
                     decode_attention(q, k, v, q_pos=qp, k_pos=kp, num_splits=2, use_triton=True, **kw),
                     attention_math(q, k, v, q_pos=qp, k_pos=kp, **kw)):
        assert (out == 0).all() and torch.isneginf(lse).all()


def test_no_window_is_unchanged():
    """window=None / softcap=None / sinks=None is the call without them, bit for bit."""
    q, k, v = qkv(1, 4, 2, 20, 33, 64)
    qp, kp = torch.arange(13, 33), torch.arange(33)
    for fn, kw in ((flash_attention, dict(config=(16, 16, 4, 1))), (decode_attention, dict(use_triton=True)),
                   (attention, {}), (attention_math, {})):
        a = fn(q, k, v, q_pos=qp, k_pos=kp, **kw)
        b = fn(q, k, v, q_pos=qp, k_pos=kp, window=None, softcap=None, sinks=None, **kw)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_cuda_backend_keeps_features_off_fused_kernels():
    q = torch.empty(1, 32, 4096, 128, dtype=torch.bfloat16, device="meta")
    assert cuda_backend(q, 4096, "causal", 132) == "cudnn"
    assert cuda_backend(q, 4096, "causal", 132, fused=False) == "triton"
    assert cuda_backend(q[:, :, :100], 300, "full", 132, fused=False) == "triton"
    assert cuda_backend(q[:, :1, :100], 40960, "masked", 132, fused=False) == "decode"


@pytest.mark.parametrize("kw, match", [
    (dict(window=0), "window"), (dict(window=2.5), "window"), (dict(window=True), "window"),
    (dict(window=4, causal=False), "window"), (dict(softcap=0.0), "softcap"), (dict(softcap=-1.0), "softcap"),
    (dict(sinks=torch.zeros(3)), "sinks"), (dict(sinks=torch.zeros(4, dtype=torch.long)), "sinks"),
])
@pytest.mark.parametrize("fn", ["attention", "attention_math", "flash", "decode"])
def test_bad_arguments_raise(fn, kw, match):
    q, k, v = qkv(1, 4, 2, 3, 8, 16)
    qp, kp = torch.arange(5, 8), torch.arange(8)
    f = {"attention": attention, "attention_math": attention_math, "flash": flash_attention,
         "decode": lambda *a, **x: decode_attention(*a, use_triton=True, **x)}[fn]
    with pytest.raises(ValueError, match=match):
        f(q, k, v, q_pos=qp, k_pos=kp, **kw)


@pytest.mark.parametrize("name", ["window", "softcap", "sinks"])
def test_sparse_patterns_refuse(name):
    q, k, v = qkv(1, 4, 2, 20, 20, 16)
    pos = torch.arange(20)
    value = {"window": 4, "softcap": 5.0, "sinks": torch.zeros(4)}[name]

    class Pattern:  # never reached: the dispatcher refuses first
        def attention(self, *a, **kw):
            raise AssertionError("sparse pattern ran")

    with pytest.raises(ValueError, match=name):
        attention(q, k, v, q_pos=pos, k_pos=pos, sparse=Pattern(), **{name: value})
