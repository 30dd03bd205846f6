"""The KV cache's layout: views of its first n rows have strides set by (heads, head_dim) alone, whatever the
cache's capacity (the prompt's length), so torch's cuDNN plans, keyed by strides, are shared by every
document (issue 47); growing and trimming keep that layout."""
from __future__ import annotations

import torch

from starshard.engine.kv_cache import LayerKV
from starshard.kernels.attention import _plan_strides


def _filled(capacity, n, fp8=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = LayerKV(1, 3, 16, capacity, torch.float32, "cpu", fp8=fp8)
    k, v = (torch.randn(1, 3, n, 16, generator=g) for _ in range(2))
    kv.store(k, v, torch.arange(n))
    return kv, k, v


def test_views_do_not_depend_on_capacity():
    a, k, v = _filled(1000, 37)
    b, _, _ = _filled(4099, 37)
    for x, y in ((a.stored().k, b.stored().k), (a.stored().v, b.stored().v)):
        assert x.stride()[1:] == y.stride()[1:]
        assert _plan_strides(x).stride() == _plan_strides(y).stride()
    assert torch.equal(a.stored().k, k) and torch.equal(_plan_strides(a.stored().v), v)


def test_fp8_cache_stays_head_major():
    # its prefill attends dequantized copies (their own strides); its decode kernel reads contiguous rows
    kv, _, _ = _filled(64, 10, fp8=True)
    assert kv.k.is_contiguous() and kv.v.is_contiguous()
    kv.store(*(torch.randn(1, 3, 60, 16) for _ in range(2)), torch.arange(10, 70))  # grows
    assert kv.k.is_contiguous() and kv.length == 70


def test_plan_strides_is_the_same_tensor():
    kv, k, _ = _filled(513, 100)
    view = kv.stored(60).k
    same = _plan_strides(view)
    assert same.data_ptr() == view.data_ptr() and torch.equal(same, k[:, :, :60])
    batch2 = torch.randn(2, 3, 5, 16)
    assert _plan_strides(batch2) is batch2  # a real batch's stride addresses rows: left alone


def test_grow_and_trim_keep_the_layout_and_the_rows():
    kv, k, v = _filled(8, 8)
    more = torch.randn(1, 3, 5, 16)
    kv.store(more, more, torch.arange(8, 13))  # grows past its capacity
    assert kv.capacity >= 13 and kv.k.stride(2) == 3 * 16 and kv.k.stride(1) == 16
    assert torch.equal(kv.stored().k, torch.cat([k, more], 2))
    kv.keep_from(6, window=4)  # a finished entry's local layer keeps positions >= 6
    assert kv.length == 7 and kv.k.stride(2) == 3 * 16
    assert torch.equal(kv.stored().k, torch.cat([k, more], 2)[:, :, 6:])
    assert torch.equal(kv.stored().pos, torch.arange(6, 13))
