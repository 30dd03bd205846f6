"""decode_attention over an e4m3 cache with 16-bit queries under the Triton interpreter, against
float64 attention over the dequantized cache: the general kernel, and the unmasked-block kernel
(`_decode_split_fp8_kernel`, options "even", plain loads and tensor descriptors) where the call has
no causal mask (causal calls with "even" take the general kernel);
GQA groups, several query rows and row blocks, a device-side key count with garbage past it, uneven
splits, and the one-pass merge with more splits than one merge block."""
import pytest
import torch

pytest.importorskip("triton")

from starshard.kernels.attention import attention  # noqa: E402
from starshard.kernels.decode import decode_attention  # noqa: E402
from starshard.kernels.fp8 import dequantize, quantize_rows  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def cache(B, Hkv, Lk, D, seed, v_mag=1.0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, Lk, D, generator=g)
    v = torch.randn(B, Hkv, Lk, D, generator=g) * v_mag
    k8, ks = quantize_rows(k)
    v8, vs = quantize_rows(v)
    return k8, ks, v8, vs


# name, B, Hq, Hkv, Lq, Lk, D, q_pos, causal, num_splits, options
EVEN, TMA, GENERAL = {"even": True}, {"even": True, "tma": True}, {"even": False}
CASES = [
    ("one-row-gqa4", 1, 8, 2, 1, 300, 64, torch.tensor([299]), False, 3, EVEN),
    ("one-row-gqa4-tma", 1, 8, 2, 1, 300, 64, torch.tensor([299]), False, 3, TMA),
    ("one-row-gqa4-general", 1, 8, 2, 1, 300, 64, torch.tensor([299]), False, 3, GENERAL),
    ("one-row-gqa4-causal-uneven", 1, 8, 2, 1, 301, 32, torch.tensor([200]), True, 4, EVEN),
    ("three-rows-gqa3", 2, 6, 2, 3, 150, 64, torch.tensor([60, 100, 149]), True, 2, EVEN),
    ("three-rows-gqa3-full", 2, 6, 2, 3, 152, 64, torch.tensor([151, 151, 151]), False, 2, TMA),
    ("two-row-blocks-gqa8", 1, 8, 1, 4, 100, 32, torch.arange(96, 100), False, 2, EVEN),
    ("d48-padded", 1, 4, 2, 2, 92, 48, torch.tensor([91, 91]), False, 2, TMA),
    ("many-splits-merge", 1, 4, 1, 1, 2200, 32, torch.tensor([2199]), False, 70, {"even": True, "config": (32, 4, 1)})]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp8_decode_kernel_matches_float64(case, dtype):
    if dtype == torch.bfloat16 and case[0] != "one-row-gqa4":
        pytest.skip("bfloat16 once: the interpreter's bfloat16 is slow")
    _, B, Hq, Hkv, Lq, Lk, D, qp, causal, splits, opts = case
    g = torch.Generator().manual_seed(5)
    k8, ks, v8, vs = cache(B, Hkv, Lk, D, seed=6)
    kd, vd = dequantize(k8, ks, torch.float64), dequantize(v8, vs, torch.float64)
    # a peaked softmax, as real heads have: each query along one key
    q = torch.randn(B, Hq, Lq, D, generator=g, dtype=torch.float64)
    q = q + 2.0 * kd[:, :, 7:8].repeat_interleave(Hq // Hkv, 1)
    q = q.to(dtype)
    kp = torch.arange(Lk)
    ref, ref_lse = attention(q.double(), kd, vd, q_pos=qp, k_pos=kp, causal=causal)
    out, lse = decode_attention(q, k8, v8, q_pos=qp, k_pos=kp, causal=causal, num_splits=splits, use_triton=True,
                                k_scale=ks, v_scale=vs, options=opts)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel(out, ref) < 4e-3
    assert (lse.double() - ref_lse).abs().max() < 1e-2


@pytest.mark.parametrize("opts", [GENERAL, EVEN, TMA], ids=["general", "even", "tma"])
def test_fp8_decode_kernel_length_ignores_the_rest(opts):
    """length= (CUDA-graph decode): e4m3 keys / values past the count hold garbage (NaN in V, huge scales)
    and are never read into the result, including in splits that are wholly past it."""
    B, Hq, Hkv, Lk, D = 1, 8, 2, 400, 32
    g = torch.Generator().manual_seed(8)
    k8, ks, v8, vs = cache(B, Hkv, Lk, D, seed=9)
    q = torch.randn(B, Hq, 1, D, generator=g).half()
    kp = torch.arange(Lk)
    for n in (1, 63, 129, 400):
        k2, v2, ks2, vs2 = k8.clone(), v8.clone(), ks.clone(), vs.clone()
        v2[:, :, n:] = float("nan")
        ks2[:, :, n:], vs2[:, :, n:] = 1e30, float("nan")
        length = torch.tensor([n], dtype=torch.int32)
        out, lse = decode_attention(q, k2, v2, q_pos=torch.tensor([n - 1]), k_pos=kp, causal=False, num_splits=4,
                                    use_triton=True, length=length, k_scale=ks2, v_scale=vs2,
                                    options=opts)
        kd = dequantize(k8[:, :, :n], ks[:, :, :n], torch.float64)
        vd = dequantize(v8[:, :, :n], vs[:, :, :n], torch.float64)
        ref, ref_lse = attention(q.double(), kd, vd, q_pos=torch.tensor([n - 1]), k_pos=kp[:n], causal=False)
        assert torch.isfinite(out).all() and rel(out, ref) < 4e-3, n
        assert (lse.double() - ref_lse).abs().max() < 1e-2


def test_fp8_decode_small_values_keep_precision():
    """Values of 1e-3 give per-key scales whose products with the probabilities would fall below fp16's
    normal range; the kernel factors each block's largest scale out first."""
    B, Hq, Hkv, Lk, D = 1, 4, 1, 200, 32
    k8, ks, v8, vs = cache(B, Hkv, Lk, D, seed=10, v_mag=1e-3)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(11)).half()
    kd, vd = dequantize(k8, ks, torch.float64), dequantize(v8, vs, torch.float64)
    ref, _ = attention(q.double(), kd, vd, q_pos=torch.tensor([Lk]), k_pos=torch.arange(Lk), causal=True)
    for causal, opts in ((True, {}), (False, GENERAL), (False, EVEN)):
        out, _ = decode_attention(q, k8, v8, q_pos=torch.tensor([Lk]), k_pos=torch.arange(Lk), causal=causal,
                                  use_triton=True, k_scale=ks, v_scale=vs, options=opts)
        assert rel(out, ref) < 4e-3
