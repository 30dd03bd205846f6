"""Disk writes off the step loop (issue 37): a shard's file is written on its rank's writer thread while
steps go on, listed only once every rank finished it, given up everywhere (no file left) when one rank's
write fails; a hit on an entry being written is served from the host tier without waiting; the host
budget holds after every step; a graceful shutdown writes the entries down and a restart reuses them."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from starshard import LLM
from starshard.config import ParallelConfig
from starshard.runtime.prompt import Prompt
from starshard.serving.disk_tier import DiskTier
from starshard.serving.disk_writer import DiskWriter
from starshard.serving.host_tier import to_host
from starshard.serving.scheduler import Scheduler
from starshard.serving.tiers import TierConfig
from starshard.server.metrics import ServerMetrics
from tests.helpers.kv_shards import assert_kv_equal, key_for, make_kv
from tests.helpers.mp_harness import run_ranks
from tests.helpers.service import settle_writes, submit

STEPS = 4


def _docs(seed):
    rng = np.random.default_rng(seed)
    docs = [[int(x) for x in rng.integers(1, 500, 83)] for _ in range(3)]
    q1, q2 = ([int(x) for x in rng.integers(1, 500, 6)] for _ in range(2))
    q2[0] = q1[0] + 1
    return docs, q1, q2


def _ask(svc, ids, context_len, timeout=60):
    events, done = submit(svc, Prompt(ids, context_len), STEPS)
    assert done.wait(timeout), "the request was blocked"
    assert events[-1].finish_reason == "length", events[-1]
    return [e.token_id for e in events if e.token_id is not None], events[-1].cached_tokens


def _budget(llm, length):
    """A device budget that holds one document's entry (and its request), never two; that entry's bytes."""
    probe = Scheduler(llm, cache_bytes=1 << 30)
    need = probe.holdings(Prompt(list(range(1, length + 1)), length - 6), STEPS)
    return int(1.5 * max(need)), max(probe.executor.entry_rank_bytes(length, length - 6))


def _service(llm, tiers, budget):
    svc = Scheduler(llm, cache_bytes=budget, max_batch=4, tiers=tiers)
    host = svc.tiers.host
    if host is not None:  # the host budget holds after every step, on every rank's count
        over, run = [], svc.executor.run

        def checked(ops):
            out = run(ops)
            over.extend(r for r in range(host.ranks) if host.used(r) > host.budget)
            return out
        svc.executor.run, svc.over = checked, over
    svc.start()
    return svc


@pytest.fixture(scope="module")
def tiny():
    return LLM(random_weights="tiny", progress=False)


def test_background_write_then_reload_is_exact(tmp_path):
    """The writer thread's file, committed and read back, is the shard bit for bit (bf16 and FP8)."""
    key = key_for()
    for fp8 in (False, True):
        with DiskTier(tmp_path / str(fp8), 1 << 30, key, 0) as disk:
            writer, gate = DiskWriter(disk), threading.Event()
            writer.before_write = lambda job: gate.wait(10)
            kv = make_kv(length=13, seed=3, fp8=fp8)
            ids = np.arange(100, 113)
            job = writer.submit(7, ids, to_host(kv), staged=True)
            assert not job.pending.done and disk.entry_for(ids) is None  # in flight: not listed
            assert disk.stats.writes_in_flight == 1 and disk.used >= job.pending.need  # its room is reserved
            gate.set()
            for _ in range(1000):
                if job.pending.done:
                    break
                threading.Event().wait(0.01)
            assert job.state == 1 and disk.entry_for(ids) is None  # written, not listed before commit
            disk.commit(writer.pop(7).pending)
            assert_kv_equal(kv, disk.load(disk.entry_for(ids), "cpu"))
            st = disk.stats.as_dict()
            assert st["writes_in_flight"] == 0 and st["write_bytes"] == disk.used and st["write_seconds_sum"] > 0
            assert oct(disk.entry_for(ids).path.stat().st_mode & 0o777) == "0o600"
            writer.close()


def test_hit_during_a_write_is_served_from_host(tiny, tmp_path):
    (d1, d2, d3), q1, q2 = _docs(11)
    budget, entry = _budget(tiny, len(d1) + len(q1))
    want = [tiny.generate(d + q2, max_new_tokens=STEPS).token_ids for d in (d1, d2, d3)]
    svc = _service(tiny, TierConfig(host_bytes=int(1.5 * entry), disk_dir=tmp_path, disk_bytes=1 << 30), budget)
    gate = threading.Event()
    svc.tiers.writer.before_write = lambda job: gate.wait(30)  # the writer stalls until the test lets it go
    try:
        _ask(svc, d1 + q1, len(d1))
        _ask(svc, d2 + q1, len(d2))  # d1 -> host
        moved = []
        mover = threading.Thread(target=lambda: moved.append(svc.demote(d1 + q1, "disk")))
        mover.start()  # returns once d1's file is committed
        while not svc.executor.writes:
            threading.Event().wait(0.01)
        tokens, cached = _ask(svc, d1 + q2, len(d1))  # while its write hangs: a copy comes up from host; d2 has
        # no room in host (d1 stays there until written): it goes straight to disk, its write queued behind d1's
        assert tokens == want[0] and cached == len(d1)
        assert mover.is_alive() and svc.executor.writes and not svc.tiers.disk.entries
        (he,) = [e for e in svc.tiers.host.entries.values() if list(e.ids) == d1 + q1]
        assert he.writing and not he.written  # neither evicted nor moved while written
        _ask(svc, d3 + q1, len(d3))  # room for d3: d1's copy goes to disk too (its tokens' write is in flight)
        assert svc.stats()["tiers"]["disk"]["writes_in_flight"] == 2
        gate.set()
        mover.join(30)
        assert moved and not mover.is_alive()
        settle_writes(svc)
        assert he.written and not he.writing and svc.tiers.disk.entry_for(d1 + q1) is not None
        assert sorted(list(e.ids) for e in svc.tiers.disk.entries.values()) == sorted([d1 + q1, d2 + q1])
        disk = svc.stats()["tiers"]["disk"]
        assert disk["writes_in_flight"] == 0 and disk["write_bytes"] == disk["bytes"] and disk["write_seconds_sum"] > 0
        text = ServerMetrics(svc.stats).render()[0].decode()
        assert 'starshard_context_cache_tier_writes_in_flight{tier="disk"} 0.0' in text
        assert f'starshard_context_cache_tier_write_bytes_total{{tier="disk"}} {float(disk["bytes"])}' in text
        tokens, cached = _ask(svc, d2 + q2, len(d2))  # from disk
        assert tokens == want[1] and cached == len(d2) and svc.stats()["tiers"]["disk"]["promotions"] == 1
        assert not svc.over and svc.health() is None
    finally:
        gate.set()
        svc.shutdown()


def test_shutdown_writes_down_and_a_restart_reuses(tiny, tmp_path, caplog):
    (d1, d2, _), q1, q2 = _docs(12)
    budget, entry = _budget(tiny, len(d1) + len(q1))
    want = [tiny.generate(d + q2, max_new_tokens=STEPS).token_ids for d in (d1, d2)]
    tiers = TierConfig(host_bytes=int(1.5 * entry), disk_dir=tmp_path, disk_bytes=1 << 30)
    svc = _service(tiny, tiers, budget)
    try:
        _ask(svc, d1 + q1, len(d1))
        _ask(svc, d2 + q1, len(d2))  # d1 in host, d2 on the device: nothing on disk yet
        assert not svc.tiers.disk.entries and not svc.executor.writes
    finally:
        with caplog.at_level(logging.INFO, logger="starshard.serve"):
            svc.shutdown()
    assert any("writing 2 cache entries" in r.getMessage() for r in caplog.records)
    assert len(list(Path(tmp_path).glob("*.kv"))) == 2 and not list(Path(tmp_path).glob(".*.tmp"))
    # "always": the restart starts from the rates the first server saved, and on a CPU this tiny model's prefill
    # may beat a reload (the policy's choice is tested in test_tiered_service / test_reload_policy)
    svc = _service(tiny, TierConfig(disk_dir=tmp_path, disk_bytes=1 << 30, shutdown_write_s=0, disk_reload="always"),
                   budget)
    try:
        for d, w in zip((d2, d1), want[::-1]):
            tokens, cached = _ask(svc, d + q2, len(d))
            assert tokens == w and cached >= len(d)
        assert svc.counters["prefill_chunks_total"] == 0
    finally:
        svc.shutdown()


def test_shutdown_finishes_an_eviction_write_in_flight(tiny, tmp_path, caplog):
    """An entry evicted to disk just before shutdown (its write still queued) is on the device and in no tier,
    so the write-down has nothing left to write of its own: it still waits for that write (within
    --shutdown-write-s) instead of dropping it at close, and the restart finds both documents."""
    (d1, d2, _), q1, q2 = _docs(14)
    budget, _ = _budget(tiny, len(d1) + len(q1))
    tiers = TierConfig(disk_dir=tmp_path, disk_bytes=1 << 30, disk_reload="always")
    svc = _service(tiny, tiers, budget)
    try:
        _ask(svc, d1 + q1, len(d1))
        _ask(svc, d2 + q1, len(d2))  # d1 -> disk (no host tier)
        settle_writes(svc)
        svc.tiers.writer.before_write = lambda job: threading.Event().wait(0.5)  # a slow disk from here on
        _ask(svc, d1 + q2, len(d1))  # d1 comes up from disk; d2 goes down, its write queued behind the stall
        assert svc.executor.writes and svc.tiers.disk.entry_for(d2 + q1) is None
    finally:
        with caplog.at_level(logging.INFO, logger="starshard.serve"):
            svc.shutdown()
    assert any("1 writes in flight first" in r.getMessage() for r in caplog.records)
    assert len(list(Path(tmp_path).glob("*.kv"))) == 2 and not list(Path(tmp_path).glob(".*.tmp"))
    svc = _service(tiny, TierConfig(disk_dir=tmp_path, disk_bytes=1 << 30, shutdown_write_s=0), budget)
    try:
        assert sorted(list(e.ids) for e in svc.tiers.disk.entries.values()) == sorted([d1 + q1, d2 + q1])
    finally:
        svc.shutdown()


def _cp2(rank, world, directory):
    llm = LLM(random_weights="tiny", progress=False, parallel=ParallelConfig(cp=world, cp_strategy="ring"))
    (d1, d2, _), q1, _ = _docs(13)
    budget, entry = _budget(llm, len(d1) + len(q1))
    svc = Scheduler(llm, cache_bytes=budget, max_batch=4,
                    tiers=TierConfig(host_bytes=int(1.5 * entry), disk_dir=directory, disk_bytes=1 << 30,
                                     shutdown_write_s=0))
    fails, seen = [OSError("no space left on device (test)")] if rank == 1 else [], []

    def hook(job):  # every rank: what each write finds; rank 1's first write fails
        seen.append((job.entry in svc.tiers.host.entries, job.pending.host.buffer.clone()))
        if fails:
            raise fails.pop()
    svc.tiers.writer.before_write = hook
    out = {}
    if rank == 0:
        svc.start()
        try:
            _ask(svc, d1 + q1, len(d1))
            _ask(svc, d2 + q1, len(d2))  # d1 -> host on both ranks
            with pytest.raises(ValueError, match="disk write failed"):
                svc.demote(d1 + q1, "disk")  # rank 1's write fails: given up on both
            out["files_after_failure"] = sorted(p.name for p in Path(directory).iterdir() if "kv" in p.name)
            he = next(e for e in svc.tiers.host.entries.values() if list(e.ids) == d1 + q1)
            out["host_after_failure"] = (he.writing, he.written)
            svc.demote(d1 + q1, "disk")  # again: written on both, committed, the host copy dropped
        finally:
            svc.shutdown()
    else:
        svc.serve_forever()
    out["in_host_at_each_write"] = [h for h, _ in seen]  # the second write found it still there: it stayed
    out["host_after"] = [list(e.ids) for e in svc.tiers.host.entries.values()]
    with DiskTier(directory, 1 << 30, svc.tiers.disk.key, rank) as disk:  # reopened: the file as a restart sees it
        back = disk.load_host(disk.entry_for(d1 + q1))
        out["exact"] = torch.equal(back.buffer, seen[-1][1])
    return out


def test_cp2_write_fails_on_one_rank_then_succeeds(tmp_path):
    r0, r1 = run_ranks(_cp2, 2, str(tmp_path))
    assert r0["files_after_failure"] == []  # neither rank's file (nor a temporary one) is left
    assert r0["host_after_failure"] == (False, False)  # stayed in host, not written
    for r in (r0, r1):
        assert r["in_host_at_each_write"] == [True, True] and r["exact"]  # then written bit for bit
        assert r["host_after"] == []  # demote() to disk ends with the host copy dropped
