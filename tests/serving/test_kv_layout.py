"""Files another exact layout can read (issue 49): an entry's shards written by one layout (one process, tp=2,
cp=2 ring / Ulysses / USP) are found by another on the same directory and rebuilt bit for bit into exactly
the shard that layout's own prefill keeps; Star's, incomplete, window-trimmed (into CP) and old-format files
are not, each with its reason logged; a block of a section is read and checked alone."""
import logging

import numpy as np
import pytest
import torch

from starshard.engine.kv_cache import KVCache
from starshard.serving.cache_key import cache_key, model_fingerprint
from starshard.serving.disk_tier import DiskTier
from starshard.serving.kv_file import KVFileError, PRELUDE, read_block, read_header
from starshard.serving.kv_layout import head_range, prefill_positions
from starshard.strategies import get_spec
from tests.helpers.kv_shards import assert_kv_equal

N, HEADS, LAYERS = 37, 2, (0, 1)
DOC = np.arange(2000, 2000 + N)
MODEL = model_fingerprint({"arch": "llama"}, random_preset="tiny", seed=0)


def key(tp=1, cp=1, strategy="dense", fp8=False, chunk=None, **options):
    return cache_key(MODEL, dtype=torch.float32, fp8="kv" if fp8 else None, tp=tp, cp=cp, strategy=strategy,
                     options=options, prefill_chunk=chunk, kv_heads=HEADS)


def whole(fp8=False, windows=None, seed=0) -> KVCache:
    """One process's shard of the document: every KV head, positions 0..N-1 in order."""
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(list(LAYERS), 1, HEADS, 8, N, torch.float32, "cpu", fp8)
    for i in LAYERS:
        kv.layers[i].store(torch.randn(1, HEADS, N, 8, generator=g), torch.randn(1, HEADS, N, 8, generator=g),
                           torch.arange(N))
    kv.advance(torch.arange(N))
    if windows:
        kv.compact_local(windows, N)
    return kv


def shard(kv: KVCache, positions, heads) -> KVCache:
    """The rows at `positions` (in that order) and KV heads [heads) of a whole shard, as that rank stores them."""
    h0, h1 = heads
    out = KVCache(list(kv.layers), 1, h1 - h0, 8, max(1, len(positions)), torch.float32, "cpu", kv.layers[0].fp8)
    idx = torch.as_tensor(np.asarray(positions), dtype=torch.long)
    for i, layer in kv.layers.items():
        dst, src = out.layers[i], layer.stored()
        n = len(idx)

        def take(t):
            raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            return raw[:, h0:h1].index_select(2, idx).view(t.dtype)
        dst.k[:, :, :n], dst.v[:, :, :n], dst.pos[:n] = take(src.k), take(src.v), src.pos[idx]
        if dst.fp8:
            dst.k_scale[:, :, :n], dst.v_scale[:, :, :n] = take(src.k_scale), take(src.v_scale)
        dst.length = n
    out.next_position = kv.next_position
    return out


def write(directory, k, kv: KVCache):
    """Every rank's file of `k`'s layout, each its shard of the whole `kv` (Star's: split as ring's)."""
    for rank in range(k.tp * k.cp):
        pos = prefill_positions(k if k.exact else key(tp=k.tp, cp=k.cp, strategy="ring"), rank // k.tp, N)
        with DiskTier(directory, 1 << 30, k, rank) as t:
            t.put(1, DOC, shard(kv, pos, head_range(HEADS, k.tp, rank % k.tp)))


def reload(directory, k, rank=0):
    with DiskTier(directory, 1 << 30, k, rank) as t:
        found, n = t.get(np.r_[DOC, 5])
        if found is None:
            return None
        assert n == N and found.shared and len(t.entries) == 0 and t.used == 0  # another layout's: not our budget
        rows = [n for n, _ in found.layer_rows]  # each layer its rows of 10 bytes on the device
        assert found.device_bytes(20) == 10 * sum(rows) and max(rows) == len(found.positions)
        return t.load(found, "cpu")


LAYOUTS = [key(), key(tp=2), key(cp=2, strategy="ring", query_rank=1), key(cp=2, strategy="ulysses"),
           key(cp=2, strategy="usp", ulysses_degree=2), key(cp=2, strategy="ring", chunk=8),
           key(tp=2, cp=2, strategy="ring")]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("writer,reader", [(0, 2), (2, 0), (0, 1), (1, 0), (3, 5), (6, 0), (1, 4)])
def test_an_exact_layout_rebuilds_its_own_shard_from_anothers_files(tmp_path, writer, reader, fp8):
    w, r = (LAYOUTS[i] if not fp8 else key(**_args(LAYOUTS[i]), fp8=True) for i in (writer, reader))
    kv = whole(fp8)
    write(tmp_path, w, kv)
    for rank in range(r.tp * r.cp):
        want = shard(kv, prefill_positions(r, rank // r.tp, N), head_range(HEADS, r.tp, rank % r.tp))
        assert_kv_equal(want, reload(tmp_path, r, rank))


def _args(k):
    return dict(tp=k.tp, cp=k.cp, strategy=k.strategy, chunk=k.prefill_chunk, **dict(k.options))


@pytest.mark.parametrize("k", LAYOUTS[2:6], ids=lambda k: k.layout())
def test_the_rebuilt_rows_are_what_the_strategy_keeps(k):
    counts = get_spec(k.strategy).rank_rows(k.cp, N, N, dict(k.options), k.prefill_chunk)
    pos = [prefill_positions(k, r, N) for r in range(k.cp)]
    assert [len(p) for p in pos] == counts
    assert sorted(np.concatenate(pos).tolist()) == list(range(N))  # every position on exactly one rank
    assert all((np.diff(p) > 0).all() for p in pos)  # increasing, as a chunked step assumes


def test_what_is_not_shared_says_why(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="starshard.serving.disk_tier")
    kv = whole()
    star = key(cp=2, strategy="star")
    assert star.share_digest is None and key(cp=2, strategy="apb").share_digest is None
    write(tmp_path / "star", star, kv)
    assert reload(tmp_path / "star", key()) is None  # Star's KV is not dense attention's
    assert "another model or layout" in caplog.text
    ring = key(cp=2, strategy="ring")
    with DiskTier(tmp_path / "half", 1 << 30, ring, 0) as t:  # rank 1's file never written
        t.put(1, DOC, shard(kv, prefill_positions(ring, 0, N), (0, HEADS)))
    caplog.clear()
    assert reload(tmp_path / "half", key()) is None and "rank files [0] of 2" in caplog.text
    trimmed = whole(windows={0: 5})
    with DiskTier(tmp_path / "trim", 1 << 30, key(), 0) as t:
        t.put(1, DOC, trimmed)
    caplog.clear()
    assert reload(tmp_path / "trim", ring) is None and "window-trimmed" in caplog.text
    got = reload(tmp_path / "trim", key(tp=2), 1)  # across tp a trimmed entry is rebuilt, its windows kept
    assert got.trimmed and got.layers[0].length == 4 and got.layers[1].length == N


def test_an_old_format_file_is_skipped_with_its_reason(tmp_path, caplog):
    with DiskTier(tmp_path, 1 << 30, key(), 0) as t:
        path = t.put(1, DOC, whole()).path
    raw = bytearray(path.read_bytes())
    magic, version, hlen, digest = PRELUDE.unpack(raw[:PRELUDE.size])
    raw[:PRELUDE.size] = PRELUDE.pack(magic, version - 1, hlen, digest)
    old = path.with_name("0123456789abcdef" + path.name[16:])  # a version-2 key's digest leads its name
    old.write_bytes(bytes(raw))
    path.unlink()
    caplog.set_level(logging.INFO, logger="starshard.serving.disk_tier")
    with DiskTier(tmp_path, 1 << 30, key(), 0) as t:
        assert t.list() == []
    assert f"skipped {old.name} (version: format version {version - 1}, this starshard reads {version})" in caplog.text
    assert "another format version" in caplog.text and old.exists()  # left for `starshard cache purge`


def test_a_block_is_read_and_checked_alone(tmp_path, monkeypatch):
    monkeypatch.setattr("starshard.serving.kv_file.BLOCK_TOKENS", 16)
    kv = whole(fp8=True)
    with DiskTier(tmp_path, 1 << 30, key(fp8=True), 0) as t:
        path = t.put(1, DOC, kv).path
    h = read_header(path)
    assert h.block_tokens == 16 and all(len(d) == 3 for d in h.block_digests)  # 37 rows: 16 + 16 + 5
    assert h.heads == (0, HEADS) and h.positions().tolist() == list(range(N)) and h.share == key(fp8=True).share_digest
    for si, s in enumerate(h.sections):
        whole_section = {"pos": kv.layers[s.layer].pos[:N], "k": kv.layers[s.layer].k[:, :, :N],
                         "k_scale": kv.layers[s.layer].k_scale[:, :, :N], "v": kv.layers[s.layer].v[:, :, :N],
                         "v_scale": kv.layers[s.layer].v_scale[:, :, :N]}[s.part]
        tail = read_block(path, h, si, 2)
        want = whole_section[32:] if s.part == "pos" else whole_section[:, :, 32:]
        assert torch.equal(tail.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    s = h.sections[1]  # layer 0's k: damage one byte of its last block
    raw = bytearray(path.read_bytes())
    raw[h.payload_offset + s.offset + s.nbytes - 1] ^= 1
    path.write_bytes(bytes(raw))
    read_block(path, h, 1, 0)  # another block of the same section is still good
    with pytest.raises(KVFileError, match="block 2") as e:
        read_block(path, h, 1, 2)
    assert e.value.reason == "checksum"
