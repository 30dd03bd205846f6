"""cache_key: what binds a shard to its producer; cheap to compute, changed by anything the bytes depend on."""
import pytest
import torch

from starshard.presets import preset_config
from starshard.serving import cache_key as ck
from starshard.serving.cache_key import CacheKey, cache_key, model_fingerprint, weight_files

CFG = preset_config("tiny")


def checkpoint(d, data=b"\1" * 300_000):
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text('{"a": 1}')
    (d / "model.safetensors").write_bytes(data)
    (d / ".cache").mkdir(exist_ok=True)
    (d / ".cache" / "junk").write_text("ignored")
    return d


def test_the_fingerprint_follows_the_weights_cheaply(tmp_path, monkeypatch):
    base = model_fingerprint(CFG, weights_path=checkpoint(tmp_path / "a"))
    assert base == model_fingerprint(CFG, weights_path=checkpoint(tmp_path / "b"))  # same files, another path
    assert [f["name"] for f in weight_files(tmp_path / "a")] == ["config.json", "model.safetensors"]
    tuned = bytearray(b"\1" * 300_000)
    tuned[150_000] = 2  # a fine-tune of the same shapes: header and size unchanged, data bytes differ
    assert model_fingerprint(CFG, weights_path=checkpoint(tmp_path / "c", bytes(tuned))) != base
    assert model_fingerprint(CFG, weights_path=checkpoint(tmp_path / "d", b"\1" * 300_001)) != base
    other = preset_config("tiny")
    other.rope_theta += 1
    assert model_fingerprint(other, weights_path=tmp_path / "a") != base
    # never a full read: a file of any size costs the head and the samples
    reads = []
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *e):
            self.f.close()

        def seek(self, n):
            self.f.seek(n)

        def read(self, n):
            data = self.f.read(n)
            reads.append(len(data))
            return data
    monkeypatch.setattr(ck, "open", lambda p, m: Counting(real_open(p, m)), raising=False)
    (tmp_path / "big").mkdir()
    with real_open(tmp_path / "big" / "w.bin", "wb") as f:
        f.truncate(64 << 20)
    model_fingerprint(CFG, weights_path=tmp_path / "big")
    assert sum(reads) <= ck.HEAD_BYTES + ck.SAMPLES_PER_FILE * ck.SAMPLE_BYTES


def test_random_weights_are_their_preset_and_seed():
    a = model_fingerprint(CFG, random_preset="tiny", seed=0)
    assert a == model_fingerprint(CFG.to_dict(), random_preset="tiny", seed=0)
    assert a != model_fingerprint(CFG, random_preset="tiny", seed=1)
    with pytest.raises(ValueError, match="either weights_path"):
        model_fingerprint(CFG)


def test_the_key_binds_dtype_fp8_layout_and_version():
    m = model_fingerprint(CFG, random_preset="tiny", seed=0)
    star = dict(block_size=64, anchor_size=64, query_rank=1)
    base = cache_key(m, dtype=torch.bfloat16, cp=2, strategy="star", options=dict(star, unset=None))
    again = cache_key(m, dtype="bfloat16", cp=2, strategy="star", options=dict(reversed(star.items())))
    assert base == again and base.digest == again.digest and len(base.short) == 16
    assert CacheKey.from_fields(base.fields()) == base  # the header's JSON round trip
    others = [cache_key(m, dtype=torch.float16, cp=2, strategy="star", options=star),
              cache_key(m, dtype=torch.bfloat16, fp8="kv", cp=2, strategy="star", options=star),
              cache_key(m, dtype=torch.bfloat16, cp=2, strategy="star", options=dict(star, block_size=32)),
              cache_key(m, dtype=torch.bfloat16, cp=2, strategy="ring", options=dict(query_rank=1)),
              cache_key(m, dtype=torch.bfloat16, tp=2, cp=2, strategy="star", options=star),
              cache_key(m, dtype=torch.bfloat16, cp=2, strategy="star", options=star, prefill_chunk=4096),
              cache_key(m, dtype=torch.bfloat16, cp=2, strategy="star", options=star, prefill_chunk=4096,
                        prefill_knee=26624),
              CacheKey(**{**base.__dict__, "format_version": ck.FORMAT_VERSION + 1})]
    assert len({k.digest for k in others} | {base.digest}) == len(others) + 1
    assert "prefill_knee" not in base.fields()  # uniform steps: the key files written before the taper carry
    assert CacheKey.from_fields(others[6].fields()) == others[6] and others[6].prefill_knee == 26624
    with pytest.raises(ValueError, match="not a plain value"):
        cache_key(m, dtype=torch.bfloat16, options=dict(weights=[1, 2]))
    with pytest.raises(ValueError, match="--fp8"):
        cache_key(m, dtype=torch.bfloat16, fp8="kvv")
