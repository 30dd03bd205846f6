"""8-bit causal prefill attention (kernels/flash_fp8.py, `--fp8 attention`, issue 19 item 4).

The kernels run on CPU under TRITON_INTERPRET=1 (conftest sets it without CUDA) with float32 / float16
inputs (bfloat16 is not faithful in the interpreter); the interpreter multiplies int8 operands
exactly, so the kernel is checked against `flash_fp8_reference` (the same blockwise algorithm in
float64 torch) tightly, and against plain float64 attention with a bound (8-bit scores are a few
percent off, never exact). On a CUDA machine (no interpreter) the compiled kernels are checked the
same way in bfloat16; the CPU-only kernel tests skip there.
"""
import importlib

import pytest
import torch

pytest.importorskip("triton")

from tests.helpers.sm90_compile import assert_compiles_for_sm90  # noqa: E402

from starshard.kernels import flash_fp8 as ff  # noqa: E402
from starshard.kernels.common import triton_interpreted  # noqa: E402

INTERP = triton_interpreted(ff._flash_fp8_fwd_kernel)
needs_interp = pytest.mark.skipif(not INTERP, reason="kernels on CPU tensors need TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(INTERP or not torch.cuda.is_available(), reason="needs CUDA and compiled kernels")


def exact(q, k, v, scale=None):
    """float64 causal attention, explicit GQA repeat: (out, lse natural log)."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    L = q.shape[2]
    s = (q.double() @ kk.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ vv, lse


def inputs(B, hq, hkv, L, D, dtype, seed=0, q_scale=1.5, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, hq, L, D, generator=g) * q_scale
    k, v = torch.randn(B, hkv, L, D, generator=g), torch.randn(B, hkv, L, D, generator=g)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def lse_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@needs_interp
def test_quantize_keys_kernel_matches_torch():
    g = torch.Generator().manual_seed(4)
    # strided: [B, L, H, D] memory as the projections give; L = 200 is one full and one partial block
    k = torch.randn(2, 200, 2, 64, generator=g).transpose(1, 2)
    got = ff.quantize_keys(k)
    want = ff.quantize_keys(k, use_triton=False)
    assert got.k8.shape == (2, 2, 256, 64) and got.k_scale.shape == (2, 2, 2)
    assert torch.equal(got.k8.view(torch.uint8), want.k8.view(torch.uint8))
    assert torch.equal(got.k_scale, want.k_scale)
    assert (got.k8[:, :, 200:].float() == 0).all()
    kd = (got.k8.float().view(2, 2, 2, 128, 64) * got.k_scale[..., None, None]).view(2, 2, 256, 64)[:, :, :200]
    # int8 of K minus its mean: 8 bits, a finer grid than e4m3's
    assert got.k8.dtype == torch.int8 and got.k8.abs().max() == 127
    assert torch.allclose(got.k_mean, k.mean(2), atol=1e-6)
    assert 1e-4 < rel(kd + got.k_mean[:, :, None], k) < 0.01


# name, B, Hq, Hkv, L, D, config (BLOCK_M, BLOCK_N, warps, stages)
CASES = [
    ("odd-gqa4-batch2", 2, 8, 2, 77, 64, (32, 32, 4, 1)),
    ("block-n-over-block-m", 1, 4, 1, 150, 32, (16, 64, 4, 1)),
    ("block-m-over-block-n-batch2", 2, 2, 2, 130, 64, (64, 32, 4, 1)),
]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_blockwise_reference(case, dtype):
    _, B, hq, hkv, L, D, cfg = case
    q, k, v = inputs(B, hq, hkv, L, D, dtype)
    out, lse = ff.flash_fp8_attention(q, k, v, config=cfg)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (B, hq, L) and lse.dtype == torch.float32
    ref, ref_lse = ff.flash_fp8_reference(q, k, v, block_m=cfg[0], block_n=cfg[1])
    assert rel(out, ref) < TOL[dtype], rel(out, ref)
    assert lse_err(lse, ref_lse) < 1e-4
    # against exact attention: bounded, and really not exact (the scores went through int8)
    full, full_lse = exact(q, k, v)
    err, lerr = rel(out, full), lse_err(lse, full_lse)
    assert 1e-3 < err < 0.02, err
    assert 1e-4 < lerr < 0.25, lerr


def test_reference_s_is_smoothed_int8_then_attend():
    # The kernel's algorithm = plain softmax attention on int8 q (per block of 32 rows) and int8 (K - mean K) (per
    # KV_BLOCK keys), with q . mean(K) added back to the lse: the softmax never sees it.
    q, k, v = inputs(2, 4, 2, 150, 32, torch.float32, seed=8)
    k = k + torch.linspace(-4, 6, 32)  # a common key offset, as real models' keys carry
    out, lse = ff.flash_fp8_reference(q, k, v, block_m=32, block_n=32, p_dtype=torch.float64)
    qb = torch.nn.functional.pad(q, (0, 0, 0, 10)).view(2, 4, 5, 32, 32)
    qs = qb.abs().amax((-1, -2)) / 127
    qd = (torch.round(qb / qs[..., None, None]).double() * qs[..., None, None].double()).view(2, 4, 160, 32)[:, :, :150]
    km = k.double().mean(2, keepdim=True)
    kb = torch.nn.functional.pad(k.double() - km, (0, 0, 0, 106)).view(2, 2, 2, 128, 32)
    ks = kb.abs().amax((-1, -2)) / 127
    kd = (torch.round(kb / ks[..., None, None]) * ks[..., None, None]).view(2, 2, 256, 32)[:, :, :150]
    want, want_lse = exact(qd, kd, v.double())
    want_lse = want_lse + (q.double() @ km.repeat_interleave(2, 1).transpose(-1, -2))[..., 0] * 32**-0.5
    assert rel(out, want) < 1e-6 and lse_err(lse, want_lse) < 1e-5
    full, full_lse = exact(q, k, v)
    assert 1e-4 < rel(out, full) < 0.02 and 1e-4 < lse_err(lse, full_lse) < 0.1


@needs_interp
def test_smoothing_makes_a_common_key_offset_free():
    # Adding one vector to every key changes no softmax weight: the scores see K - mean(K),
    # identical with or without the offset, and the lse moves by exactly q . offset * scale.
    q, k, v = inputs(1, 4, 2, 96, 64, torch.float32, seed=9)
    offset = torch.randn(64, generator=torch.Generator().manual_seed(10)) * 8
    cfg = (32, 32, 4, 1)
    out, lse = ff.flash_fp8_attention(q, k, v, config=cfg)
    out2, lse2 = ff.flash_fp8_attention(q, k + offset, v, config=cfg)
    assert rel(out2, out) < 1e-5
    assert lse_err(lse2 - (q @ offset) * 64**-0.5, lse) < 1e-4


@needs_interp
def test_tensor_descriptor_path_and_scale():
    q, k, v = inputs(1, 4, 2, 100, 64, torch.float32, seed=5)
    cfg = (32, 64, 4, 1)
    out, lse = ff.flash_fp8_attention(q, k, v, config=cfg, tma=True, scale=0.2)
    ref, ref_lse = ff.flash_fp8_reference(q, k, v, block_m=32, block_n=64, scale=0.2)
    assert rel(out, ref) < 1e-5 and lse_err(lse, ref_lse) < 1e-4
    plain, plain_lse = ff.flash_fp8_attention(q, k, v, config=cfg, scale=0.2)
    assert torch.allclose(out, plain, atol=1e-6) and torch.allclose(lse, plain_lse, atol=1e-6)


@needs_interp
def test_precomputed_keys_and_strided_q():
    q, k, v = inputs(1, 4, 2, 70, 32, torch.float32, seed=6)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    keys = ff.quantize_keys(k)
    out, lse = ff.flash_fp8_attention(qt, k, v, keys=keys, config=(32, 32, 4, 1))
    ref, ref_lse = ff.flash_fp8_reference(q, k, v, block_m=32, block_n=32)
    assert rel(out, ref) < 1e-5 and lse_err(lse, ref_lse) < 1e-4


def test_rejects_what_it_does_not_do():
    q, k, v = inputs(1, 4, 2, 40, 32, torch.float32)
    with pytest.raises(ValueError, match="square causal"):
        ff.flash_fp8_attention(q[:, :, :20], k, v)
    with pytest.raises(ValueError, match="head_dim"):
        ff.flash_fp8_attention(q[..., :24], k[..., :24], v[..., :24])
    with pytest.raises(ValueError, match="one dtype"):
        ff.flash_fp8_reference(q.double(), k.double(), v.double())
    if INTERP:
        with pytest.raises(ValueError, match="must divide KV_BLOCK"):
            ff.flash_fp8_attention(q, k, v, config=(32, 48, 4, 1))


_COMPILE = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from starshard.kernels import flash_fp8 as ff
fn = ff._flash_fp8_fwd_kernel
sig = {n: "i32" for n in fn.arg_names}
sig.update(Q="*bf16", K8="*i8", KS="*fp32", V="*bf16", KM="*fp32", O="*bf16", LSE="*fp32", k_desc="*i8",
           v_desc="*bf16", qk_scale="fp32")
consts = dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, KV_BLOCK=128, USE_TMA=False)
sig.update({n: "constexpr" for n in consts})
k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=8, num_stages=3))
mmas = set(re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.m64n\\d+k\\d+\\.[fs]32\\.(\\w+)\\.(\\w+)", k.asm["ptx"]))
# scores on int8 tensor cores; P @ V in bf16
assert mmas == {("s8", "s8"), ("bf16", "bf16")}, mmas
print("compiled")
"""


@pytest.mark.slow  # a real sm_90a build
def test_kernel_compiles_to_int8_wgmma(tmp_path):
    assert_compiles_for_sm90(_COMPILE, tmp_path)


@needs_cuda
@pytest.mark.parametrize("config", [None, (64, 64, 4, 3)])
def test_cuda_kernel_matches_reference(config):
    q, k, v = inputs(2, 8, 2, 1000, 128, torch.bfloat16, seed=7, device="cuda")
    out, lse = ff.flash_fp8_attention(q, k, v, config=config)
    bm, bn = (config or ff.default_config(128))[:2]
    ref, ref_lse = ff.flash_fp8_reference(q, k, v, block_m=bm, block_n=bn)
    # bf16 output, float32 exp2 / division against float64
    assert rel(out, ref) < 1e-2 and lse_err(lse, ref_lse) < 2e-2
    full, full_lse = exact(q, k, v)
    assert 3e-3 < rel(out, full) < 0.07 and lse_err(lse, full_lse) < 0.3


def test_int8_scores_dispatch_on_cpu():
    # causal_attention_int8_scores (`--fp8 attention`): on the CPU, the kernel's quantization through the
    # exact path = the blockwise reference with P unrounded; anything the kernel does not
    # take (a decode-sized call, a head dim without tiles, a position mask) is plain `attention`.
    from starshard.kernels.attention import attention, causal_attention_int8_scores

    q, k, v = inputs(1, 6, 2, 300, 32, torch.float32, seed=11)
    k = k + 3.0  # a common key offset: smoothing takes it out of the scores
    pos = torch.arange(300)
    out, lse = causal_attention_int8_scores(q, k, v, q_pos=pos, k_pos=pos)
    ref, ref_lse = ff.flash_fp8_reference(q, k, v, block_m=128, block_n=128, p_dtype=torch.float64)
    assert rel(out, ref) < 1e-5 and lse_err(lse, ref_lse) < 1e-4
    full, full_lse = exact(q, k, v)
    assert 1e-4 < rel(out, full) < 0.02
    for args in ((q[:, :, :16], k[:, :, :16], v[:, :, :16], pos[:16], pos[:16]),  # decode-sized
                 (q[..., :24], k[..., :24], v[..., :24], pos, pos),  # head dim 24
                 (q, k, v, pos, pos * 2 - 50)):  # not index-causal
        got, got_lse = causal_attention_int8_scores(*args[:3], q_pos=args[3], k_pos=args[4])
        want, want_lse = attention(*args[:3], q_pos=args[3], k_pos=args[4], causal=True)
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


def test_int8_scores_decision(monkeypatch):
    # uses_int8_scores, the one place `--fp8 attention` is decided: a sparse pattern declines (and
    # causal_attention_int8_scores then runs `attention` with it), and on CUDA so does a call shorter than
    # INT8_SCORES_MIN_LENGTH keys (measured slower than cuDNN there), while the CPU reference takes any length.
    att = importlib.import_module("starshard.kernels.attention")  # the module (the package exports the function)

    q, k, v = inputs(1, 6, 2, 300, 32, torch.float32, seed=12)
    pos = torch.arange(300)
    assert att.uses_int8_scores(q, k, pos, pos)
    assert not att.uses_int8_scores(q, k, pos, pos, sparse=object())
    assert not att.uses_int8_scores(q, k, pos, pos, device_type="cuda")  # 300 < 96K keys
    monkeypatch.setattr(att, "INT8_SCORES_MIN_LENGTH", 300)
    assert att.uses_int8_scores(q, k, pos, pos, device_type="cuda")
    assert not att.uses_int8_scores(q[:, :, :299], k[:, :, :299], pos[:299], pos[:299], device_type="cuda")
    calls = []
    monkeypatch.setattr(att, "attention", lambda *a, **kw: calls.append(kw["sparse"]) or ("out", "lse"))
    assert att.causal_attention_int8_scores(q, k, v, q_pos=pos, k_pos=pos, sparse="pattern") == ("out", "lse")
    assert calls == ["pattern"]
