"""disk_tier: a rank's directory of shard files: permissions, the lock, LRU, reuse after a restart,
damaged and foreign files."""
import logging
import os
import stat
import threading

import numpy as np
import pytest
import torch

from starshard.serving import disk_tier
from starshard.serving.disk_tier import DiskTier, DiskTierLocked, file_name, lock_path
from starshard.serving.kv_file import KVFileError, read_header
from tests.helpers.kv_shards import assert_kv_equal, key_for, make_kv

DOC = np.arange(1000, 1013)  # a 13-token "document"


def flip_payload(path):
    """Flip one bit of the last layer's v (padding between sections is no data: flipping it would change nothing)."""
    h = read_header(path)
    s = h.sections[-1]
    raw = bytearray(path.read_bytes())
    raw[h.payload_offset + s.offset + s.nbytes - 1] ^= 1
    path.write_bytes(bytes(raw))


def tier(path, budget=1 << 30, key=None, rank=0, **kw):
    return DiskTier(path, budget, key or key_for(), rank, **kw)


def test_put_get_load_and_permissions(tmp_path):
    d = tmp_path / "cache"
    kv = make_kv(length=13, fp8=True)
    with tier(d, key=key_for(fp8=True)) as t:
        e = t.put(3, DOC, kv)
        assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE(e.path.stat().st_mode) == 0o600
        assert e.name == file_name(key_for(fp8=True), DOC, 0) and e.name.endswith("-r0.kv")
        found, n = t.get(np.r_[DOC, 5, 6])
        assert found.name == e.name and n == 13
        assert_kv_equal(kv, t.load(found, "cpu", extra_capacity=4))
        s = t.stats
        assert (s.entries, s.demotions, s.promotions, s.hits, s.bytes) == (1, 1, 1, 1, e.nbytes)
        assert t.put(3, DOC, kv) is e  # already there: nothing written again
        assert t.stats.demotions == 1


def test_a_second_server_on_the_same_dir_and_rank_is_refused(tmp_path):
    first = tier(tmp_path)
    with pytest.raises(DiskTierLocked) as e:
        tier(tmp_path)
    assert str(lock_path(tmp_path, 0)) in str(e.value) and "--disk-cache-dir" in str(e.value)
    assert f"pid {os.getpid()}" in str(e.value)
    tier(tmp_path, rank=1).close()  # another rank of the same server has its own lock
    first.close()
    tier(tmp_path).close()  # released


def test_a_restart_finds_a_shared_prefix(tmp_path):
    kv = make_kv(length=13, dtype=torch.float32)
    with tier(tmp_path) as t:
        t.put(1, DOC, kv)
        t.put(2, np.arange(5), make_kv(length=5, seed=3))
    with tier(tmp_path) as t:  # a new server on the same directory
        assert len(t.list()) == 2
        e, n = t.get(np.r_[DOC[:9], 77, 78])  # a new prompt sharing the document's first 9 tokens
        assert n == 9 and np.array_equal(e.ids, DOC)
        assert t.get(DOC)[1] == 12  # the whole document: one token is left to run
        assert_kv_equal(kv, t.load(e, "cpu"))
        assert t.get(np.r_[55, DOC]) == (None, 0)
        assert t.entry_for(DOC).name == e.name and t.entry_for(DOC[:5]) is None  # by exact tokens (other ranks)


def test_lru_eviction_within_the_budget_survives_a_restart(tmp_path):
    with tier(tmp_path) as t:
        size = t.put(0, [0], make_kv(length=13)).nbytes
    (tmp_path / file_name(key_for(), [0], 0)).unlink()
    budget = 2 * size + 1000
    docs = {name: np.arange(13) + 100 * i for i, name in enumerate("abcd")}
    with tier(tmp_path, budget=budget) as t:
        t.put(1, docs["a"], make_kv(length=13, seed=1))
        t.put(2, docs["b"], make_kv(length=13, seed=2))
        assert t.get(docs["a"])[0] is not None  # a is used again: b is now the oldest
        t.put(3, docs["c"], make_kv(length=13, seed=3))
        assert sorted(map(len, t.list())) == [13, 13] and t.stats.evictions == 1
        assert t.get(docs["b"]) == (None, 0)
        assert t.used <= budget
    with tier(tmp_path, budget=budget) as t:  # the order is the files' mtime: kept across the restart
        assert [int(e.ids[0]) for e in t.list()] == [0, 200]
        t.put(4, docs["d"], make_kv(length=13, seed=4))
        assert [int(e.ids[0]) for e in t.list()] == [200, 300]
        assert t.put(5, np.arange(300), make_kv(length=300, heads=4)) is None  # larger than the budget: not kept
        assert len(t.list()) == 2


def test_damaged_and_foreign_files_are_skipped_never_raised(tmp_path, caplog):
    key = key_for()
    with tier(tmp_path, key=key) as t:
        paths = {n: t.put(i, np.arange(7) + 10 * i, make_kv(length=7, seed=i)).path
                 for i, n in enumerate(["good", "truncated", "header", "payload", "renamed"])}
    with tier(tmp_path, key=key, rank=1) as t:
        other_rank = t.put(0, np.arange(7), make_kv(length=7)).path
    with tier(tmp_path, key=key_for(cp=2, strategy="ring")) as t:
        foreign = t.put(0, np.arange(7), make_kv(length=7)).path
    raw = paths["truncated"].read_bytes()
    paths["truncated"].write_bytes(raw[: len(raw) // 2])
    raw = bytearray(paths["header"].read_bytes())
    raw[60] ^= 1
    paths["header"].write_bytes(bytes(raw))
    flip_payload(paths["payload"])
    paths["renamed"].rename(paths["renamed"].with_name(file_name(key, [1, 2, 3], 0)))  # name and tokens disagree
    stale = tmp_path / f".{file_name(key, [9], 0)}.12345.tmp"
    stale.write_bytes(b"half")
    other_stale = tmp_path / f".{file_name(key, [9], 1)}.12345.tmp"
    other_stale.write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("not a cache file")
    caplog.set_level(logging.INFO, logger="starshard.serving.disk_tier")
    with tier(tmp_path, key=key) as t:
        names = {e.path for e in t.list()}
        assert names == {paths["good"], paths["payload"]}  # the payload's damage shows only when it is read
        assert "another model or layout" in caplog.text and "left in place" in caplog.text
        assert "truncated" in caplog.text and "checksum" in caplog.text
        assert t.stats.rejected == 3
        e, n = t.get(np.arange(7) + 30)
        with pytest.raises(KVFileError) as err:
            t.load(e, "cpu")
        assert err.value.reason == "checksum"
        assert not paths["payload"].exists() and t.get(np.arange(7) + 30) == (None, 0)  # removed: re-prefill
        assert t.load(t.get(np.arange(8))[0], "cpu").length == 7  # the good one still loads
    assert not paths["truncated"].exists() and not paths["header"].exists() and not stale.exists()
    assert foreign.exists() and other_rank.exists() and other_stale.exists() and (tmp_path / "notes.txt").exists()
    assert read_header(foreign).key["cp"] == 2


def test_verify_on_start_removes_a_damaged_payload(tmp_path):
    with tier(tmp_path) as t:
        p = t.put(0, np.arange(7), make_kv(length=7)).path
    flip_payload(p)
    with tier(tmp_path, verify_on_start=True) as t:
        assert t.list() == [] and not p.exists()


def test_purge_removes_this_key_and_rank_only(tmp_path):
    with tier(tmp_path, key=key_for(seed=5)) as t:
        kept = t.put(0, [1, 2], make_kv(length=3)).path
    with tier(tmp_path) as t:
        t.put(0, [1, 2], make_kv(length=3))
        t.put(1, [3, 4], make_kv(length=3))
        assert t.purge() == 2 and t.list() == [] and t.used == 0
    assert [p.name for p in tmp_path.glob("*.kv")] == [kept.name]


def test_an_entry_being_written_is_invisible_and_blocks_no_lookup(tmp_path, monkeypatch):
    """A demotion writes outside the tier's mutex: lookups and loads of other entries go on, and the entry
    appears only once its file is complete (never served half-written)."""
    kv = make_kv(length=13)
    with tier(tmp_path) as t:
        t.put(0, np.arange(5), make_kv(length=5))
        started, release, real = threading.Event(), threading.Event(), disk_tier.write_kv_file

        def slow_write(*a, **kw):
            started.set()
            assert release.wait(30)
            return real(*a, **kw)
        monkeypatch.setattr(disk_tier, "write_kv_file", slow_write)
        writer = threading.Thread(target=t.put, args=(1, DOC, kv))
        writer.start()
        assert started.wait(30)
        assert t.get(np.r_[DOC, 1]) == (None, 0)  # not there yet, and the lookup did not wait for the write
        assert t.load(t.get(np.arange(6))[0], "cpu").length == 5
        assert t.put(2, DOC, kv) is None  # the same tokens are being written by the other thread
        assert t.used > sum(e.nbytes for e in t.list())  # the write's bytes are reserved in the budget
        release.set()
        writer.join(30)
        e, n = t.get(np.r_[DOC, 1])
        assert n == 13 and not list(tmp_path.glob(".*.tmp"))
        assert_kv_equal(kv, t.load(e, "cpu"))


def test_odd_directory_entries_never_stop_the_start(tmp_path):
    key = key_for()
    (tmp_path / file_name(key, [1], 0)).mkdir()  # a directory with a shard's name
    (tmp_path / file_name(key, [2], 0)).symlink_to("/etc/hostname")
    (tmp_path / file_name(key, [3], 0)).write_bytes(b"")  # empty
    with tier(tmp_path, key=key) as t:
        assert t.list() == []
    assert (tmp_path / file_name(key, [1], 0)).is_dir() and (tmp_path / file_name(key, [2], 0)).is_symlink()
    assert not (tmp_path / file_name(key, [3], 0)).exists()
