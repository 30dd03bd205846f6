"""Sliding window, soft-capping and sinks in the compiled Triton kernels (flash prefill, split-KV
decode) and through the CUDA dispatcher, against the float64 reference of the CPU tests
(tests/kernels/test_attention_window.py), at sizes where the kernels take their real tiles."""
import pytest
import torch

from starshard.kernels.attention import attention
from starshard.kernels.decode import decode_attention
from starshard.kernels.flash import flash_attention
from tests.kernels.test_attention_window import dense

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="compiled kernels need CUDA: run `python -m pytest tests/gpu` on a GPU machine")

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}  # relative error of out against float64


def inputs(hq, hkv, lq, lk, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g, device="cuda") * 1.5).to(dtype)  # noqa: E731
    return r(1, hq, lq, d), r(1, hkv, lk, d), r(1, hkv, lk, d)


def check(out, lse, q, k, v, qp, kp, **kw):
    ref, ref_lse = dense(q, k, v, qp, kp, **kw)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[q.dtype], f"relative error {err:.3e}"
    fin = torch.isfinite(ref_lse)
    assert (lse[fin].double() - ref_lse[fin]).abs().max().item() < 2e-2


FEATURES = [dict(), dict(softcap=30.0), dict(sinks=True), dict(softcap=30.0, sinks=True)]


def features(f, hq):
    g = torch.Generator(device="cuda").manual_seed(7)
    return {k: (torch.randn(hq, generator=g, device="cuda") * 2 if k == "sinks" else x) for k, x in f.items()}


@pytest.mark.parametrize("feat", FEATURES, ids=lambda f: "+".join(f) or "window")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window", [1, 97, 512, 5000])
def test_flash_prefill(window, d, dtype, feat):
    lq = lk = 1537  # odd: partial tiles at both ends
    q, k, v = inputs(8, 2, lq, lk, d, dtype, seed=d + window)
    qp = kp = torch.arange(lk, device="cuda")
    kw = dict(window=window, **features(feat, 8))
    check(*flash_attention(q, k, v, q_pos=qp, k_pos=kp, **kw), q, k, v, qp, kp, **kw)
    check(*attention(q, k, v, q_pos=qp, k_pos=kp, **kw), q, k, v, qp, kp, **kw)  # the dispatcher's route


@pytest.mark.parametrize("feat", FEATURES, ids=lambda f: "+".join(f) or "window")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window", [1, 300, 4096, 20000])
def test_decode(window, d, feat):
    lk = 9001
    q, k, v = inputs(8, 2, 1, lk, d, torch.bfloat16, seed=d + window)
    qp, kp = torch.tensor([lk - 1], device="cuda"), torch.arange(lk, device="cuda")
    kw = dict(window=window, **features(feat, 8))
    check(*decode_attention(q, k, v, q_pos=qp, k_pos=kp, **kw), q, k, v, qp, kp, **kw)
    check(*attention(q, k, v, q_pos=qp, k_pos=kp, **kw), q, k, v, qp, kp, **kw)


def test_prefill_after_a_cached_prefix():
    """A 700-row block after 3000 cached keys (a chunk or a follow-up), window 1024."""
    q, k, v = inputs(8, 2, 700, 3700, 128, torch.bfloat16, seed=1)
    qp, kp = torch.arange(3000, 3700, device="cuda"), torch.arange(3700, device="cuda")
    check(*attention(q, k, v, q_pos=qp, k_pos=kp, window=1024), q, k, v, qp, kp, window=1024)
