"""disk_read: parallel sequential readers fill a buffer byte for byte as one reader does, on ranges of odd
sizes; the filled prefix grows in file order (a layer is handed on only once its bytes are in); a file
that ends early or is damaged is reported as before; pacing holds a read to its rate."""
import time

import numpy as np
import pytest

from starshard.serving import disk_read
from starshard.serving.disk_read import ShortRead, read_file
from starshard.serving.disk_staging import StagingArea, read_kv_staged, windows
from starshard.serving.disk_tier import DiskTier
from starshard.serving.kv_file import KVFileError, read_header, read_kv_host, write_kv_file
from tests.helpers.kv_shards import assert_kv_equal, key_for, make_kv


def random_file(path, n, seed=0):
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("size", [1, 4095, 4097, 5 * 4096 * 7 + 123])
def test_parallel_readers_fill_the_same_bytes_as_one(tmp_path, size):
    data = random_file(tmp_path / "f", size + 777, seed=size)
    want = data[777:]
    for readers in (1, 2, 3, 8):
        for chunk in (None, 4096, 5000, 3 * 4096):  # chunks neither the block nor a divisor of the size
            for direct in (False, True):  # O_DIRECT where the filesystem takes it, aligned chunks only
                buf = bytearray(size)
                seen = list(read_file(tmp_path / "f", 777, size, memoryview(buf), readers, chunk, direct=direct))
                assert bytes(buf) == want, (readers, chunk, direct)
                assert seen == sorted(seen) and seen[-1] == size and 0 < seen[0]


def late_chunk(monkeypatch, offset):
    """The read at `offset` takes 0.2 s longer: the readers after it finish first."""
    preadv = disk_read.os.preadv

    def slow(fd, buffers, off):
        if off == offset:
            time.sleep(0.2)
        return preadv(fd, buffers, off)
    monkeypatch.setattr(disk_read.os, "preadv", slow)


def test_the_filled_prefix_is_really_filled(tmp_path, monkeypatch):
    size = 64 * 4096 + 11
    data = random_file(tmp_path / "f", size)
    late_chunk(monkeypatch, 5 * 4096)
    buf = bytearray(size)
    for done in read_file(tmp_path / "f", 0, size, memoryview(buf), readers=4, chunk=4096):
        assert buf[:done] == data[:done]  # every byte below the yielded prefix is in, whatever the other readers do


def test_a_file_that_ends_early_is_a_short_read(tmp_path):
    random_file(tmp_path / "f", 10 * 4096 + 5)
    for readers in (1, 4):
        with pytest.raises(ShortRead) as e:
            list(read_file(tmp_path / "f", 100, 20 * 4096, memoryview(bytearray(20 * 4096)), readers, 4096))
        assert e.value.done == 10 * 4096 + 5 - 100


def test_readers_are_checked():
    for bad in (0, -1, disk_read.MAX_READERS + 1, 2.5):
        with pytest.raises(ValueError, match="--disk-readers"):
            disk_read.check_readers(bad)


def test_pacing_holds_a_read_to_its_rate(tmp_path):
    size = 150_000
    random_file(tmp_path / "f", size)
    for readers in (1, 4):
        t0 = time.monotonic()
        assert list(read_file(tmp_path / "f", 0, size, None, readers, 4096, rate=1e6))[-1] == size
        took = time.monotonic() - t0
        assert 0.9 * size / 1e6 <= took < 10  # at least bytes / rate (0.15 s), however many readers share it


def test_shards_read_in_parallel_are_bit_exact_and_handed_on_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_read, "CHUNK", 4096)  # many chunks per layer and layers per chunk: readers interleave
    kv, key = make_kv(length=301, layers=tuple(range(6)), heads=2, dim=8, fp8=True), key_for(fp8=True)
    path = tmp_path / "a.kv"
    write_kv_file(path, kv, np.arange(301), key, 0)
    one, _, h = read_kv_host(path, key, 0, readers=1)
    late_chunk(monkeypatch, h.payload_offset + 4096)  # layer 0's second chunk comes last
    payload = path.read_bytes()[h.payload_offset:]
    for readers in (2, 4, 8):
        order = []

        def on_layer(host, i):  # a layer is handed on once all of its bytes are in, in file order
            for s in (s for s in host.sections if s.layer == i):
                assert bytes(host.buffer[s.offset:s.offset + s.nbytes].numpy()) == payload[s.offset:s.offset + s.nbytes]
            order.append(i)
        host, tokens, _ = read_kv_host(path, key, 0, readers=readers, on_layer=on_layer)
        assert order == list(range(6)) and np.array_equal(tokens, np.arange(301))
        assert bytes(host.buffer.numpy()) == bytes(one.buffer.numpy())


def test_damage_is_still_reported_with_parallel_readers(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_read, "CHUNK", 4096)
    key, ids = key_for(), np.arange(300)
    with DiskTier(tmp_path, 1 << 30, key, 0, readers=4) as t:
        e = t.put(0, ids, make_kv(length=300, layers=tuple(range(4))))
        assert_kv_equal(make_kv(length=300, layers=tuple(range(4))), t.load(e, "cpu"))
        h = read_header(e.path)
        raw = bytearray(e.path.read_bytes())
        s = h.sections[-3]  # a middle chunk's bytes, read by another reader than the first
        raw[h.payload_offset + s.offset + s.nbytes // 2] ^= 4
        e.path.write_bytes(bytes(raw))
        with pytest.raises(KVFileError) as err:
            t.load(t.get(np.arange(301))[0], "cpu")
        assert err.value.reason == "checksum" and not e.path.exists() and t.get(np.arange(301)) == (None, 0)
    path = tmp_path / "b.kv"
    write_kv_file(path, make_kv(length=300), ids, key, 0)
    h = read_header(path, key, 0)
    with open(path, "r+b") as f:  # cut short after its header was read: the payload ends early
        f.truncate(h.payload_offset + h.payload_bytes // 2 + 3)
    with pytest.raises(KVFileError) as err:
        read_kv_host(path, key, 0, header=h, readers=4)
    assert err.value.reason == "truncated" and f"after {h.payload_bytes // 2 + 3} of" in str(err.value)


def test_a_paced_disk_tier_reloads_no_faster_than_its_limit(tmp_path):
    with DiskTier(tmp_path, 1 << 30, key_for(), 0, readers=4) as t:
        kv = make_kv(length=400, layers=tuple(range(4)))
        e = t.put(0, np.arange(400), kv)
        payload = read_header(e.path).payload_bytes
        t.read_limit = payload / 0.3  # bytes/s: the payload takes 0.3 s
        t0 = time.monotonic()
        assert_kv_equal(kv, t.load(e, "cpu"))
        assert time.monotonic() - t0 >= 0.27


# ---------------------------------------------------------------------------- the pinned staging slots
@pytest.mark.parametrize("fp8", [False, True])
def test_a_staged_reload_reuses_small_slots_bit_exact(tmp_path, monkeypatch, fp8):
    monkeypatch.setattr(disk_read, "CHUNK", 4096)
    kv, key = make_kv(length=301, layers=tuple(range(7)), fp8=fp8), key_for(fp8=fp8)
    path = tmp_path / "a.kv"
    write_kv_file(path, kv, np.arange(301), key, 0)
    h = read_header(path)
    layer = h.payload_bytes // 7
    staging = StagingArea(2 * (2 * layer + 4096), pin=False)  # CPU: plain memory; two layers a slot, 4 windows
    plan = windows(h, staging.slot_bytes)
    assert len(plan) >= 4 and [i for *_, ls in plan for i in ls] == list(range(7))
    assert plan[0][0] == 0 and plan[-1][1] == h.payload_bytes and all(a[1] == b[0] for a, b in zip(plan, plan[1:]))
    for readers in (1, 4):
        back, tokens = read_kv_staged(path, "cpu", staging, key, 0, extra_capacity=3, readers=readers)
        assert_kv_equal(kv, back) and np.array_equal(tokens, np.arange(301))
        assert all(layer.capacity == 301 + 3 for layer in back.layers.values())
    assert read_kv_staged(path, "cpu", StagingArea(layer, pin=False), key, 0) is None  # a layer > a slot: not staged


def test_a_staged_reload_reports_damage(tmp_path):
    kv, key = make_kv(length=200, layers=tuple(range(5))), key_for()
    path = tmp_path / "a.kv"
    write_kv_file(path, kv, np.arange(200), key, 0)
    h = read_header(path)
    staging = StagingArea(2 * (h.payload_bytes // 5 + 4096), pin=False)  # one layer a slot
    raw = bytearray(path.read_bytes())
    s = h.sections[-2]  # the last layer's k: its window reuses a slot of an earlier one
    raw[h.payload_offset + s.offset + 5] ^= 8
    path.write_bytes(bytes(raw))
    read_kv_staged(path, "cpu", staging, key, 0, verify=False)
    with pytest.raises(KVFileError) as err:
        read_kv_staged(path, "cpu", staging, key, 0)
    assert err.value.reason == "checksum" and "layer 4 k" in str(err.value)
    with open(path, "r+b") as f:
        f.truncate(h.payload_offset + h.payload_bytes - 100)
    with pytest.raises(KVFileError) as err:
        read_kv_staged(path, "cpu", staging, key, 0)
    assert err.value.reason == "truncated"
