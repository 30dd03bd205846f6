"""pinned_arena: the host tier's budget carved into aligned ranges (first fit, coalescing frees), a range
back on the free list only once its HostKV is gone and its copies are done, a pageable fallback when no
range fits; shards stay bit-exact through arena buffers (device(cpu) -> host -> disk -> host -> device).
cudaHostRegister itself needs CUDA: here the arena is a plain tensor (pin=False)."""
import numpy as np
import pytest
import torch

from starshard.serving.disk_tier import DiskTier
from starshard.serving.host_tier import HostTier, own, to_device, to_host
from starshard.serving.kv_file import read_kv_host, write_kv_file
from starshard.serving.pinned_arena import PinnedArena
from starshard.serving.tiers import Tiers, TierConfig
from tests.helpers.kv_shards import assert_kv_equal, key_for, make_kv

PAGE = 4096


def offset(arena, view):
    return view.data_ptr() - arena._buf.data_ptr()


def test_alloc_aligns_fits_first_and_coalesces():
    arena = PinnedArena(8 * PAGE, pin=False)
    a, b, c = arena.alloc(100), arena.alloc(PAGE + 1), arena.alloc(1)
    assert (a.numel(), b.numel(), c.numel()) == (100, PAGE + 1, 1) and a.dtype == torch.uint8
    assert [offset(arena, v) for v in (a, b, c)] == [0, PAGE, 3 * PAGE]  # b takes two pages
    assert arena.free_bytes() == 4 * PAGE and arena.largest_free() == 4 * PAGE
    arena.free(b)
    d = arena.alloc(10)
    assert offset(arena, d) == PAGE  # first fit: the hole b left, not the tail
    assert arena.alloc(5 * PAGE) is None  # 5 pages free in all (1 + 4), but no 5 in a row
    arena.free(a)
    arena.free(c)
    assert arena._free == [(0, PAGE), (2 * PAGE, 6 * PAGE)]  # c merged with both its free neighbours
    arena.free(d)
    assert arena._free == [(0, 8 * PAGE)] and arena.free_bytes() == 8 * PAGE
    with pytest.raises(ValueError, match="freed twice"):
        arena.free(d)
    assert arena.alloc(8 * PAGE).numel() == 8 * PAGE and arena.alloc(1) is None


def test_a_free_while_the_lock_is_held_is_merged_later():
    """A HostKV's finalizer may run inside alloc (a garbage collection on this thread): free never waits."""
    arena = PinnedArena(2 * PAGE, pin=False)
    a, b = arena.alloc(PAGE), arena.alloc(PAGE)
    with arena._lock:
        arena.free(a)  # would deadlock if it waited for the lock
        with pytest.raises(ValueError, match="freed twice"):
            arena.free(a)
    assert offset(arena, arena.alloc(PAGE)) == 0 and arena.alloc(1) is None  # merged back by the next call
    arena.free(b)
    assert arena.free_bytes() == PAGE


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="--host-cache-gib"):
        PinnedArena(0, pin=False)
    with pytest.raises(ValueError, match="power of two"):
        PinnedArena(PAGE, align=3000, pin=False)
    with pytest.raises(ValueError, match="budget"):
        HostTier(2 * PAGE, arena=PinnedArena(PAGE, pin=False))


def test_a_held_buffer_is_never_handed_out_again():
    kvs = [make_kv(length=40, seed=s) for s in range(3)]
    size = to_host(kvs[0]).nbytes
    arena = PinnedArena(2 * -(-size // PAGE) * PAGE, pin=False)  # room for exactly two shards
    tier = HostTier(arena.nbytes, arena=arena)
    tier.put(1, np.arange(40), to_host(kvs[0], arena=arena))
    tier.put(2, np.arange(40) + 100, to_host(kvs[1], arena=arena))
    b = tier.entries[2].kv
    b_bytes = b.buffer.clone()
    assert all(arena.owns(e.kv.buffer) for e in tier.entries.values()) and arena.largest_free() == 0
    taken = tier.take(1)  # moving on (e.g. to disk): its buffer stays its own while it is held
    third = to_host(kvs[2], arena=arena)
    assert not arena.owns(third.buffer) and arena.fallbacks == 1  # no room: pageable, counted
    a_ptr = taken.kv.buffer.data_ptr()
    del taken
    c = to_host(kvs[2], arena=arena)
    assert c.buffer.data_ptr() == a_ptr  # the range came back once its HostKV was gone
    assert torch.equal(b.buffer, b_bytes)  # the other entry's bytes are untouched
    assert_kv_equal(kvs[1], to_device(b, "cpu").kv)
    assert_kv_equal(kvs[2], to_device(c, "cpu").kv)
    assert tier.stats.unpinned_fallbacks == 1 and tier.stats.as_dict()["unpinned_fallbacks"] == 1
    del c
    stale = tier.entries[2]  # as a scheduler's cached lookup keeps one
    tier.evict([2])  # released at once, not when the last reference goes
    assert arena.free_bytes() == arena.largest_free() == arena.nbytes
    assert stale.kv.nbytes == size and stale.kv.buffer.is_meta
    with pytest.raises((NotImplementedError, RuntimeError)):  # never another shard's bytes
        stale.kv.layer(0).k.tolist()


def test_a_shard_leaving_the_host_gives_its_range_back():
    arena = PinnedArena(8 * PAGE, pin=False)
    tier = HostTier(arena.nbytes, arena=arena)
    kv = make_kv(length=9, fp8=True)
    tier.put(1, np.arange(9), to_host(kv, arena=arena))
    tier.put(2, np.arange(9) + 50, to_host(kv, arena=arena))
    held = arena.free_bytes()
    stale = tier.entries[1]
    assert_kv_equal(kv, tier.load(1, "cpu", keep=False).kv)  # promoted: released once copied
    freed = arena.free_bytes()
    assert freed > held and stale.kv.buffer.is_meta
    assert_kv_equal(kv, tier.load(2, "cpu").kv)  # keep=True: the host copy stays, readable
    assert arena.free_bytes() == freed and not tier.entries[2].kv.buffer.is_meta


def test_a_range_waits_for_its_copies_before_it_is_free():
    """CUDA copies run after to_host / to_device return: the range is freed only after their events."""
    arena = PinnedArena(4 * PAGE, pin=False)
    host = to_host(make_kv(length=5), arena=arena)
    seen = []

    class Copy:  # stands for a torch.cuda.Event of a copy still using the buffer
        def synchronize(self):
            seen.append(arena.free_bytes())

    host._copies.append(Copy())
    del host
    assert seen == [3 * PAGE] and arena.free_bytes() == 4 * PAGE  # waited while the range was still held


@pytest.mark.parametrize("fp8", [False, True])
def test_device_host_disk_host_device_is_bit_exact_through_the_arena(tmp_path, fp8):
    kv = make_kv(length=21, heads=2, batch=2, dtype=torch.bfloat16, fp8=fp8)
    key, ids = key_for(fp8=fp8), np.arange(7, 28)
    arena = PinnedArena(16 * PAGE, pin=False)
    host = to_host(kv, arena=arena)
    assert arena.owns(host.buffer)
    write_kv_file(tmp_path / "a.kv", host, ids, key, rank=0)
    del host
    assert arena.free_bytes() == arena.nbytes
    back, tokens, _ = read_kv_host(tmp_path / "a.kv", key, 0, arena=arena)
    assert arena.owns(back.buffer) and np.array_equal(tokens, ids)
    assert_kv_equal(kv, to_device(back, "cpu", extra_capacity=2).kv)
    del back
    with DiskTier(tmp_path / "d", 1 << 20, key, 0) as disk:  # straight to the device, layer by layer
        disk.put(1, ids, kv)
        assert_kv_equal(kv, disk.load(disk.entry_for(ids), "cpu", arena=arena))
        assert_kv_equal(kv, to_device(disk.load_host(disk.entry_for(ids), arena=arena), "cpu").kv)
    assert arena.free_bytes() == arena.nbytes and arena.fallbacks == 0  # every read's range came back
    small = PinnedArena(PAGE, pin=False)  # too small: the read falls back to pageable memory, still exact
    back, _, _ = read_kv_host(tmp_path / "a.kv", key, 0, arena=small)
    assert not small.owns(back.buffer) and small.fallbacks == 1
    assert_kv_equal(kv, to_device(back, "cpu").kv)


def test_own_ignores_buffers_of_other_memory():
    arena = PinnedArena(PAGE, pin=False)
    host = to_host(make_kv(length=3))  # no arena: pageable
    assert own(host, arena) is host and not arena.owns(host.buffer) and arena.free_bytes() == PAGE


def test_tiers_build_the_arena_of_the_host_budget():
    tiers = Tiers(TierConfig(host_bytes=8 * PAGE), ranks=1, cp_rank=0, token_bytes=16, key=None)
    try:
        assert tiers.arena is tiers.host.arena and tiers.arena.nbytes == tiers.host.budget == 8 * PAGE
        assert tiers.arena.pinned == torch.cuda.is_available()
    finally:
        tiers.close()
    assert Tiers(TierConfig(), ranks=1, cp_rank=0, token_bytes=16, key=None).arena is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cudaHostRegister needs CUDA (not run on CPU-only hosts)")
def test_the_arena_is_page_locked_and_cuda_copies_through_it_are_exact():
    kv = make_kv(length=33, fp8=True)
    arena = PinnedArena(64 * PAGE)
    assert arena.pinned
    on_gpu = to_device(to_host(kv), "cuda")
    on_gpu.synchronize()
    host = to_host(on_gpu.kv, arena=arena)  # asynchronous into the arena
    assert arena.owns(host.buffer) and host.buffer.is_pinned()
    load = to_device(host, "cuda")
    load.synchronize()
    assert_kv_equal(kv, to_device(to_host(load.kv), "cpu").kv)  # cpu -> gpu -> arena -> gpu -> cpu
    del host, load
    assert arena.free_bytes() == arena.nbytes  # the range came back once its copies were done
    arena.close()
