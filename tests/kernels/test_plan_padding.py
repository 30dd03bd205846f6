"""cuDNN plans per padded length (kernels/attention.py `plan_padded`): a call's query rows padded up to a multiple
of PLAN_ROWS (and a square causal call's keys alike), then cut back, give the unpadded call's out and lse exactly.
The CUDA path that uses it runs in launch/gpu_check.py (tests/gpu); here the padding runs around the float64
reference, which shows what the kernel is asked and that nothing of the pad reaches a real row."""
import importlib

import pytest
import torch

from starshard.kernels.reference import attention_math

attn = importlib.import_module("starshard.kernels.attention")  # the package's `attention` is the function


def _qkv(hq, hkv, lq, lk, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, 64, dtype=torch.float64, generator=g) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))


def _reference(causal, seen):
    def run(q, k, v):
        seen.append((q.shape[2], k.shape[2]))
        return attention_math(q, k, v, q_pos=torch.arange(q.shape[2]), k_pos=torch.arange(k.shape[2]), causal=causal)
    return run


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("lq,lk,causal,seed", [(300, 300, True, 1), (257, 257, True, 2), (1000, 1000, True, 3),
                                               (300, 517, False, 4), (511, 90, False, 5)])
def test_padded_call_equals_the_unpadded_one(hq, hkv, lq, lk, causal, seed):
    q, k, v = _qkv(hq, hkv, lq, lk, seed)
    seen = []
    out, lse = attn.plan_padded(q, k, v, causal=causal, run=_reference(causal, seen))
    ref, ref_lse = attention_math(q, k, v, q_pos=torch.arange(lq), k_pos=torch.arange(lk), causal=causal)
    rows = -(-lq // attn.PLAN_ROWS) * attn.PLAN_ROWS
    assert seen == [(rows, rows if causal else lk)]  # the kernel saw whole multiples: one plan per multiple
    assert out.shape == q.shape and lse.shape == q.shape[:3] and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)


def test_a_multiple_and_a_long_call_run_as_they_are(monkeypatch):
    for lq in (attn.PLAN_ROWS, 2 * attn.PLAN_ROWS):
        q, k, v = _qkv(2, 2, lq, lq, lq)
        seen = []
        attn.plan_padded(q, k, v, causal=True, run=_reference(True, seen))
        assert seen == [(lq, lq)]
    monkeypatch.setattr(attn, "PLAN_PAD_MAX", 300)  # past it: no padded copies at the memory peak
    q, k, v = _qkv(2, 2, 301, 301, 7)
    seen = []
    attn.plan_padded(q, k, v, causal=True, run=_reference(True, seen))
    assert seen == [(301, 301)]


def test_a_causal_call_that_is_not_square_runs_as_it_is():
    q, k, v = _qkv(2, 2, 300, 400, 8)
    seen = []
    attn.plan_padded(q, k, v, causal=True, run=_reference(True, seen))
    assert seen == [(300, 400)]


def test_the_cudnn_path_pads_a_query_heads_rows_and_the_flash_path_does_not(monkeypatch):
    """_fused's wiring, the kernel faked: cuDNN calls reach the kernel on padded rows (a query head's, before GQA
    folds g heads into rows: lengths within one multiple of PLAN_ROWS share a plan whatever g), flash calls as
    they are."""
    seen = []

    def fake_sdpa(q, k, v, *, causal, scale, op):
        seen.append((op, q.shape[1], q.shape[2], k.shape[2]))
        return attention_math(q, k, v, q_pos=torch.arange(q.shape[2]), k_pos=torch.arange(k.shape[2]), causal=causal)

    monkeypatch.setattr(attn, "_sdpa", fake_sdpa)
    q, k, v = _qkv(6, 2, 300, 517, 9)
    out, _ = attn._fused(q, k, v, causal=False, scale=None, op="cudnn")
    attn._fused(q, k, v, causal=False, scale=None, op="flash")
    assert seen == [("cudnn", 6, 512, 517), ("flash", 6, 300, 517)]
    ref, _ = attention_math(q, k, v, q_pos=torch.arange(300), k_pos=torch.arange(517), causal=False)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
