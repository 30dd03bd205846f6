"""Random KV shards for the context cache tiers' tests, and a bit-exact comparison."""
from __future__ import annotations

import torch

from starshard.engine.kv_cache import KVCache
from starshard.serving.cache_key import cache_key, model_fingerprint


def make_kv(length=13, layers=(0, 1, 2), batch=1, heads=2, dim=8, dtype=torch.bfloat16, fp8=False, capacity=None,
            seed=0, stride=2) -> KVCache:
    """A shard as a CP rank holds one: `length` rows at global positions 1, 1 + stride, ... (not 0..n-1),
    capacity above the length (only the filled rows may travel)."""
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(list(layers), batch, heads, dim, capacity or length + 7, dtype, "cpu", fp8)
    pos = torch.arange(length) * stride + 1
    for i in layers:
        k = torch.randn(batch, heads, length, dim, generator=g).to(dtype) * (i + 1)
        v = torch.randn(batch, heads, length, dim, generator=g).to(dtype)
        kv.layers[i].store(k, v, pos)
    kv.advance(pos)
    return kv


def bits(t):
    return None if t is None else t.contiguous().view(torch.uint8)


def assert_kv_equal(a: KVCache, b: KVCache) -> None:
    """Same layers, lengths, dtypes and bytes of every filled row (FP8: e4m3 bytes and scales)."""
    assert list(a.layers) == list(b.layers)
    assert a.length == b.length and a.next_position == b.next_position
    for i in a.layers:
        x, y = a.layers[i], b.layers[i]
        assert (x.fp8, x.dtype, x.k.dtype) == (y.fp8, y.dtype, y.k.dtype)
        sx, sy = x.stored(), y.stored()
        for p in ("k", "v", "pos", "k_scale", "v_scale"):
            tx, ty = getattr(sx, p), getattr(sy, p)
            assert (tx is None) == (ty is None), p
            if tx is not None:
                assert tx.shape == ty.shape and torch.equal(bits(tx), bits(ty)), (i, p)


def key_for(dtype=torch.bfloat16, fp8=False, cp=1, strategy="dense", seed=0, **options):
    return cache_key(model_fingerprint({"arch": "llama", "hidden_size": 16}, random_preset="tiny", seed=seed),
                     dtype=dtype, fp8="kv" if fp8 else None, cp=cp, strategy=strategy, options=options)
