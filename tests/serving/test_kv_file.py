"""kv_file: one rank's shard to a file and back, bit-exact; every kind of damage a typed error."""
import os
import stat
import struct

import numpy as np
import pytest
import torch

from starshard.serving import kv_file
from starshard.serving.cache_key import FORMAT_VERSION
from starshard.serving.host_tier import to_host
from starshard.serving.kv_file import KVFileError, read_header, read_kv_file, write_kv_file
from tests.helpers.kv_shards import assert_kv_equal, key_for, make_kv

CASES = [(torch.float32, False, 1), (torch.bfloat16, False, 2), (torch.bfloat16, True, 1), (torch.float16, True, 2)]


@pytest.mark.parametrize("dtype,fp8,batch", CASES)
def test_round_trip_is_bit_exact(tmp_path, dtype, fp8, batch):
    kv = make_kv(length=13, heads=2, dim=8, batch=batch, dtype=dtype, fp8=fp8)  # GQA-sized: 2 KV heads
    key, ids = key_for(dtype, fp8), np.arange(100, 117)
    path = tmp_path / "a.kv"
    size = write_kv_file(path, kv, ids, key, rank=1, entry_id=7)
    assert path.stat().st_size == size and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["a.kv"]  # no temporary left
    back, tokens = read_kv_file(path, "cpu", key, rank=1, extra_capacity=5)
    assert_kv_equal(kv, back)
    assert np.array_equal(tokens, ids) and tokens.dtype == np.int64
    assert all(layer.capacity == 13 + 5 for layer in back.layers.values())
    if fp8:
        assert back.layers[0].k.dtype == torch.float8_e4m3fn  # stays e4m3 on disk and back
    h = read_header(path, key, rank=1)
    assert (h.rank, h.entry_id, h.length, h.fp8, h.n_tokens) == (1, 7, 13, fp8, 17)
    assert h.cache_key() == key
    # the payload holds the filled rows only: 13 rows, not the capacity of 20
    row = 2 * batch * 2 * 8 * (1 if fp8 else dtype.itemsize) + (2 * batch * 2 * 4 if fp8 else 0) + 8
    assert h.payload_bytes < 3 * (13 * row + 5 * 64)
    # the rebuilt cache keeps working: one more token appends after the reloaded rows
    back.layers[0].store(torch.zeros(batch, 2, 1, 8, dtype=dtype), torch.zeros(batch, 2, 1, 8, dtype=dtype),
                         torch.tensor([99]))
    assert back.layers[0].length == 14 and back.layers[0].pos[13] == 99


def test_host_copy_writes_the_same_bytes(tmp_path):
    kv, key = make_kv(fp8=True), key_for(fp8=True)
    write_kv_file(tmp_path / "a.kv", kv, [1, 2, 3], key, 0)
    write_kv_file(tmp_path / "b.kv", to_host(kv), [1, 2, 3], key, 0)
    a, b = (tmp_path / "a.kv").read_bytes(), (tmp_path / "b.kv").read_bytes()
    ha, hb = read_header(tmp_path / "a.kv"), read_header(tmp_path / "b.kv")
    assert a[ha.tokens_offset:] == b[hb.tokens_offset:]


def test_the_document_length_travels_to_the_file_and_back(tmp_path):
    """A split reload lays a Star file's head out by its document's length: the header keeps it (and reads
    None from a file that does not record it); a value outside the file's tokens is refused on reading."""
    kv, key = make_kv(length=11), key_for()
    write_kv_file(tmp_path / "a.kv", to_host(kv, context_len=9), np.arange(11), key, 0)
    write_kv_file(tmp_path / "b.kv", kv, np.arange(11), key, 0)
    assert read_header(tmp_path / "a.kv").context_len == 9 and read_header(tmp_path / "b.kv").context_len is None
    assert kv_file.read_kv_host(tmp_path / "a.kv")[0].context_len == 9
    write_kv_file(tmp_path / "c.kv", to_host(kv, context_len=12), np.arange(11), key, 0)
    with pytest.raises(KVFileError, match="context_len 12 is not within"):
        read_header(tmp_path / "c.kv")


def damaged(tmp_path, how):
    kv, key = make_kv(length=11), key_for()
    path = tmp_path / "x.kv"
    write_kv_file(path, kv, np.arange(11), key, 0)
    raw = bytearray(path.read_bytes())
    h = read_header(path)
    if how == "truncated-payload":
        raw = raw[:-5]
    elif how == "truncated-prelude":
        raw = raw[:10]
    elif how == "truncated-header":
        raw = raw[:kv_file.PRELUDE.size + 20]
    elif how == "flip-payload":
        k = h.sections[1]  # layer 0's keys (padding between sections is no data)
        raw[h.payload_offset + k.offset + k.nbytes // 2] ^= 0x10
    elif how == "flip-header":
        raw[kv_file.PRELUDE.size + 30] ^= 0x01
    elif how == "flip-tokens":
        raw[h.tokens_offset + 3] ^= 0x01
    elif how == "magic":
        raw[:4] = b"GGUF"
    elif how == "version":
        raw[8:12] = struct.pack("<I", FORMAT_VERSION + 1)
    path.write_bytes(bytes(raw))
    return path, key


@pytest.mark.parametrize("how,reason", [("truncated-payload", "truncated"), ("truncated-prelude", "truncated"),
                                        ("truncated-header", "truncated"), ("flip-payload", "checksum"),
                                        ("flip-header", "checksum"), ("flip-tokens", "checksum"),
                                        ("magic", "magic"), ("version", "version")])
def test_damage_is_a_typed_error(tmp_path, how, reason):
    path, key = damaged(tmp_path, how)
    with pytest.raises(KVFileError) as e:
        read_kv_file(path, "cpu", key, 0)
    assert e.value.reason == reason and str(path) in str(e.value)


def test_payload_digests_can_be_skipped_but_are_checked_by_default(tmp_path):
    path, key = damaged(tmp_path, "flip-payload")
    read_kv_file(path, "cpu", key, 0, verify=False)  # the header still checks out
    with pytest.raises(KVFileError, match="digest"):
        read_kv_file(path, "cpu", key, 0)


def test_another_key_or_rank_is_refused(tmp_path):
    path = tmp_path / "x.kv"
    write_kv_file(path, make_kv(), [5, 6], key_for(), rank=0)
    for other in (key_for(seed=1), key_for(cp=2, strategy="ring"), key_for(torch.float16), key_for(fp8=True)):
        with pytest.raises(KVFileError) as e:
            read_kv_file(path, "cpu", other, 0)
        assert e.value.reason == "key" and "another model or layout" in str(e.value)
    with pytest.raises(KVFileError) as e:
        read_kv_file(path, "cpu", key_for(), 1)
    assert e.value.reason == "rank"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path, key = tmp_path / "x.kv", key_for()
    write_kv_file(path, make_kv(seed=1), [1], key, 0)
    before = path.read_bytes()

    def boom(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        write_kv_file(path, make_kv(seed=2), [1], key, 0)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["x.kv"]
