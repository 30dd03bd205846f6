"""The service's context cache tiers (issue 37): with a device budget of one document, a second document
demotes the first (device -> host, or -> disk); a follow-up on the first is promoted back, reports its
cached tokens, runs no prefill and answers as the document never left; the disk tier serves it after a
restart; a damaged file falls back to a prefill; a disk entry whose reload is expected slower than its
prefill is passed over; FP8 KV stays e4m3 through the tiers; cp=2 ring moves both ranks' shards."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

import starshard.serving.executor as executor_module
from starshard import LLM
from starshard.commands.serve import parse_args
from starshard.config import ParallelConfig
from starshard.parallel.topology import ranks_per_node
from starshard.runtime.prompt import Prompt
from starshard.serving.disk_tier import DiskTierLocked, file_name
from starshard.serving.kv_file import read_header
from starshard.serving.reload_policy import Rate
from starshard.serving.scheduler import Scheduler
from starshard.serving.tiers import TierConfig, default_host_bytes, memory_available
from starshard.server.metrics import ServerMetrics
from tests.helpers.mp_harness import run_ranks
from tests.helpers.service import settle_writes, submit

STEPS = 4


def _docs(n_docs=2, seed=5):
    rng = np.random.default_rng(seed)
    docs = [[int(x) for x in rng.integers(1, 500, 83)] for _ in range(n_docs)]
    questions = [[int(x) for x in rng.integers(1, 500, 6)] for _ in range(3)]
    questions[1][0] = questions[0][0] + 1  # the follow-ups differ from the first question at its first token
    questions[2][0] = questions[0][0] + 2
    return docs, questions


def _submit(svc, ids, context_len):
    return submit(svc, Prompt(ids, context_len), STEPS)


def _result(events, done):
    assert done.wait(120)
    assert events[-1].finish_reason == "length", events[-1]
    return [e.token_id for e in events if e.token_id is not None], events[-1].cached_tokens


def _ask(svc, ids, context_len):
    return _result(*_submit(svc, ids, context_len))


def _budget(llm, length):
    """A device budget that holds one document's entry (and its request), never two."""
    probe = Scheduler(llm, cache_bytes=1 << 30)
    need = probe.holdings(Prompt(list(range(1, length + 1)), length - 6), STEPS)
    entry = max(probe.executor.entry_rank_bytes(length, length - 6))
    return int(1.5 * max(need)), entry


def _service(llm, tiers, budget, **kw):
    svc = Scheduler(llm, cache_bytes=budget, max_batch=4, tiers=tiers, **kw)
    svc.start()
    return svc


def _solo(llm, ids):
    return llm.generate(ids, max_new_tokens=STEPS).token_ids


@pytest.fixture(scope="module")
def tiny():
    return LLM(random_weights="tiny", progress=False)


def test_host_tier_demotes_and_promotes(tiny):
    (d1, d2), (q1, q2, q3) = _docs()
    budget, entry = _budget(tiny, len(d1) + len(q1))
    want = _solo(tiny, d1 + q2), _solo(tiny, d2 + q3)  # before the service runs: the model is then its thread's
    svc = _service(tiny, TierConfig(host_bytes=int(1.5 * entry)), budget)
    try:
        _ask(svc, d1 + q1, len(d1))
        _ask(svc, d2 + q1, len(d1))  # evicts d1 from the device: it moves to the host tier
        host = svc.tiers.host
        assert len(svc.cache.entries) == 1 and len(host.entries) == 1
        assert list(next(iter(host.entries.values())).ids) == d1 + q1
        chunks = svc.counters["prefill_chunks_total"]
        tokens, cached = _ask(svc, d1 + q2, len(d1))  # promoted back; d2 swaps into the host tier
        assert tokens == want[0]
        assert cached == len(d1) and svc.counters["prefill_chunks_total"] == chunks
        assert [list(e.ids) for e in host.entries.values()] == [d2 + q1]
        stats = svc.stats()["tiers"]
        assert stats["host"]["demotions"] == 2 and stats["host"]["promotions"] == 1 and stats["host"]["hits"] == 1
        assert stats["host"]["reload_seconds_count"] == 1 and stats["device"]["entries"] == 1
        tokens, cached = _ask(svc, d2 + q3, len(d2))  # and back again
        assert tokens == want[1] and cached == len(d2)
        arena = svc.tiers.arena  # the budget, carved into shard buffers: every shard that left gave its range back
        held = [-(-e.kv.nbytes // arena.align) * arena.align for e in host.entries.values()]
        assert arena.nbytes == host.budget and arena.free_bytes() == arena.nbytes - sum(held)
        text = ServerMetrics(svc.stats).render()[0].decode()
        for line in ['starshard_context_cache_tier_entries{tier="host"} 1.0',
                     'starshard_context_cache_tier_entries{tier="device"} 1.0',
                     'starshard_context_cache_tier_demotions_total{tier="host"} 3.0',
                     'starshard_context_cache_tier_promotions_total{tier="host"} 2.0',
                     'starshard_context_cache_tier_hits_total{tier="host"} 2.0',
                     'starshard_context_cache_reload_seconds_count{tier="host"} 2.0',
                     'starshard_context_cache_reload_seconds_bucket{le="+Inf",tier="host"} 2.0',
                     'starshard_context_cache_tier_bytes{tier="host"}',
                     # the first swap: d2 moves down before d1's promotion frees its range (room for one)
                     'starshard_context_cache_tier_unpinned_fallbacks_total{tier="host"} 1.0',
                     "starshard_context_cache_reload_failures_total 0.0"]:
            assert line in text, line
    finally:
        svc.shutdown()


def test_serve_flags(tmp_path):
    args = parse_args(["--random-weights", "tiny", "--host-cache-gib", "0.5", "--disk-cache-dir", str(tmp_path),
                       "--disk-cache-gib", "2"])
    assert args.tiers == TierConfig(2**29, str(tmp_path), 2 * 2**30, "auto")
    assert parse_args(["--random-weights", "tiny"]).tiers == TierConfig()
    args = parse_args(["--random-weights", "tiny", "--disk-cache-dir", str(tmp_path), "--disk-cache-gib", "2",
                       "--disk-reload-policy", "always"])
    assert args.tiers.disk_reload == "always" and args.tiers.disk_readers == 4
    assert parse_args(["--random-weights", "tiny", "--disk-readers", "8"]).tiers.disk_readers == 8
    for bad in (["--disk-cache-gib", "1"], ["--disk-cache-dir", str(tmp_path), "--disk-cache-gib", "0"],
                ["--host-cache-gib", "-1"], ["--disk-reload-policy", "never"], ["--disk-readers", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--random-weights", "tiny", *bad])


def test_host_tier_default_for_a_disk_tier_on_a_gpu(monkeypatch):
    """No --host-cache-gib: serve sizes a host tier for a disk tier on a GPU (commands/serve.py main) to one device
    budget, within half the node's available memory over its ranks, so shards reach disk through pinned memory."""
    assert parse_args(["--random-weights", "tiny"]).host_cache_gib is None  # "size it", unlike an explicit 0
    assert parse_args(["--random-weights", "tiny", "--host-cache-gib", "0"]).host_cache_gib == 0
    gib = 2**30
    assert default_host_bytes(24 * gib, 128 * gib, 1) == 24 * gib  # one device budget
    assert default_host_bytes(24 * gib, 40 * gib, 1) == 20 * gib  # half of what is available
    assert default_host_bytes(70 * gib, 560 * gib, 8) == 35 * gib  # split over the node's 8 ranks
    assert default_host_bytes(24 * gib, 5 * 2**20 + 1, 2) == 2**20  # whole MiB (1.25 MiB)
    assert default_host_bytes(24 * gib, 2**20, 4) == 0  # too little to keep a tier
    assert memory_available() > 0
    for env, want in (({}, 1), ({"LOCAL_WORLD_SIZE": "4"}, 4), ({"SLURM_NTASKS_PER_NODE": "8(x4)"}, 8)):
        for k in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert ranks_per_node(1) == want


def _damage(directory, svc_key, ids, rank=0):
    p = directory / file_name(svc_key, ids, rank)
    h = read_header(p)
    raw = bytearray(p.read_bytes())
    raw[h.payload_offset + h.sections[1].offset] ^= 4
    p.write_bytes(bytes(raw))


def test_disk_tier_survives_a_restart_and_a_damaged_file(tiny, tmp_path):
    (d1, d2), (q1, q2, q3) = _docs(seed=6)
    budget, _ = _budget(tiny, len(d1) + len(q1))
    want = {name: _solo(tiny, ids) for name, ids in (("d1q2", d1 + q2), ("d1q3", d1 + q3), ("d2q2", d2 + q2))}
    # "always": after the restart the policy starts from the saved rates, and on a CPU this tiny model's prefill
    # beats the reload (test_disk_reload_slower_than_prefill_is_skipped covers that choice)
    tiers = TierConfig(disk_dir=tmp_path / "kv", disk_bytes=1 << 30, disk_reload="always")
    svc = _service(tiny, tiers, budget)
    try:
        _ask(svc, d1 + q1, len(d1))
        _ask(svc, d2 + q1, len(d2))  # d1 -> disk (no host tier)
        settle_writes(svc)
        with pytest.raises(DiskTierLocked, match="rank0.lock"):  # a second server on the directory
            Scheduler(tiny, cache_bytes=budget, tiers=tiers)
        tokens, cached = _ask(svc, d1 + q2, len(d1))
        assert tokens == want["d1q2"] and cached == len(d1)
        assert svc.counters["prefill_chunks_total"] == 2
        key = svc.tiers.disk.key
        rates = svc.reload_policy.reload.per_unit, svc.reload_policy.prefill.per_unit
        assert None not in rates  # a promotion and the prefills measured
    finally:
        svc.shutdown()
    assert oct((tmp_path / "kv").stat().st_mode & 0o777) == "0o700"
    svc = _service(tiny, tiers, budget)  # the restart: the directory is indexed, both documents found
    try:
        assert len(svc.tiers.disk.entries) == 2 and not svc.cache.entries
        # it starts from the rates the last server measured here (its first disk hit is planned, not guessed)
        assert (svc.reload_policy.reload.per_unit, svc.reload_policy.prefill.per_unit) == rates
        assert {e.context_len for e in svc.tiers.disk.entries.values()} == {len(d1)}  # the files recorded it
        with svc._lock:  # two follow-ups arrive together: one promotion, then both extend the entry
            runs = [_submit(svc, d1 + q, len(d1)) for q in (q3, q2)]
        results = [_result(*run) for run in runs]
        assert results == [(want["d1q3"], len(d1)), (want["d1q2"], len(d1))]
        assert svc.counters["prefill_chunks_total"] == 0 and svc.counters["prefill_tokens_total"] == len(q3) + len(q2)
        assert svc.stats()["tiers"]["disk"]["promotions"] == 1
    finally:
        svc.shutdown()
    _damage(tmp_path / "kv", key, d2 + q1)
    svc = _service(tiny, tiers, budget)  # the damaged file is found at load: a prefill instead, no error
    try:
        tokens, cached = _ask(svc, d2 + q2, len(d2))
        assert tokens == want["d2q2"] and cached == 0
        assert svc.counters["reload_failures_total"] == 1 and svc.counters["prefill_chunks_total"] == 1
        assert svc.health() is None and svc.stats()["tiers"]["disk"]["rejected"] == 1
    finally:
        svc.shutdown()


def test_an_entry_promoted_from_disk_goes_back_without_a_copy(tiny, tmp_path, monkeypatch):
    """Demoting to disk an entry whose file is still there writes nothing and copies nothing to the host (without
    a host tier that copy is pageable: ~10 s in the step loop for a 128K shard); the file keeps serving."""
    (d1, d2), (q1, q2, q3) = _docs(seed=11)
    budget, _ = _budget(tiny, len(d1) + len(q1))
    want = _solo(tiny, d1 + q3)
    tiers = TierConfig(disk_dir=tmp_path / "kv", disk_bytes=1 << 30, disk_reload="always")
    svc = _service(tiny, tiers, budget)
    try:
        _ask(svc, d1 + q1, len(d1))
        _ask(svc, d2 + q1, len(d2))  # d1 -> disk
        settle_writes(svc)
        assert _ask(svc, d1 + q2, len(d1))[1] == len(d1)  # promoted from its file (d2 -> disk)
        settle_writes(svc)
        written = svc.stats()["tiers"]["disk"]["write_bytes"]
        copies = []
        real = executor_module.to_host
        monkeypatch.setattr(executor_module, "to_host", lambda *a, **k: copies.append(1) or real(*a, **k))
        svc.demote(d1 + q2, "disk")
        settle_writes(svc)
        assert copies == [] and not svc.cache.entries
        stats = svc.stats()["tiers"]["disk"]
        assert stats["write_bytes"] == written and stats["write_failures"] == 0 and len(svc.tiers.disk.entries) == 2
        assert _ask(svc, d1 + q3, len(d1)) == (want, len(d1))  # the file serves it again
    finally:
        svc.shutdown()


def test_disk_reload_slower_than_prefill_is_skipped(tiny, tmp_path, caplog):
    (d1, d2), (q1, q2, _) = _docs(seed=9)
    budget, _ = _budget(tiny, len(d1) + len(q1))
    want = _solo(tiny, d1 + q2), _solo(tiny, d2 + q2)
    svc = _service(tiny, TierConfig(disk_dir=tmp_path, disk_bytes=1 << 30), budget, prefill_chunk=32)
    policy = svc.reload_policy
    try:
        _ask(svc, d1 + q1, len(d1))
        assert policy.prefill.per_unit > 0 and policy.reload.per_unit is None  # a prefill's chunks measured
        _ask(svc, d2 + q1, len(d2))  # d1 -> disk
        settle_writes(svc)
        policy.observe_reload(1.0, 1)  # a disk of one byte a second: slower than any prefill
        chunks = svc.counters["prefill_chunks_total"]
        with caplog.at_level(logging.INFO, logger="starshard.serve"):
            tokens, cached = _ask(svc, d1 + q2, len(d1))  # prefilled, as if nothing were cached; d2 -> disk
        settle_writes(svc)
        assert tokens == want[0] and cached == 0 and svc.counters["prefill_chunks_total"] == chunks + 3
        assert len([r for r in caplog.records if "prefilled instead" in r.getMessage()]) == 1
        stats = svc.stats()["tiers"]["disk"]
        assert stats["skipped_slower_than_prefill"] == 1 and stats["promotions"] == 0
        assert sorted(list(e.ids) for e in svc.tiers.disk.entries.values()) == sorted([d1 + q1, d2 + q1])  # kept
        text = ServerMetrics(svc.stats).render()[0].decode()
        assert 'starshard_context_cache_tier_skipped_slower_than_prefill_total{tier="disk"} 1.0' in text
        policy.reload = Rate()
        policy.observe_reload(1e-6, 10**9)  # a fast disk: promoted
        tokens, cached = _ask(svc, d2 + q2, len(d2))
        assert tokens == want[1] and cached == len(d2) and svc.counters["prefill_chunks_total"] == chunks + 3
        stats = svc.stats()["tiers"]["disk"]
        assert stats["promotions"] == 1 and stats["skipped_slower_than_prefill"] == 1
        assert policy.reload.per_unit > 0.5e-15  # the promotion's own time, averaged in
    finally:
        svc.shutdown()


def test_fp8_kv_stays_e4m3_through_host_and_disk(tmp_path):
    llm = LLM(random_weights="tiny", progress=False, fp8="kv")
    (d1, d2), (q1, q2, _) = _docs(seed=7)
    budget, entry = _budget(llm, len(d1) + len(q1))
    never = Scheduler(llm, cache_bytes=1 << 30)  # the same requests, nothing ever evicted
    never.start()
    try:
        for ids in (d1 + q1, d2 + q1):
            _ask(never, ids, len(d1))
        want = _ask(never, d1 + q2, len(d1))[0]
        want2 = _ask(never, d2 + q2, len(d2))[0]
    finally:
        never.shutdown()
    # the host tier holds one document: the third one's demotion starts writing the host's (d2) to disk, which
    # stays in host until written, and sends the device's (d1) straight to disk
    svc = _service(llm, TierConfig(host_bytes=int(1.5 * entry), disk_dir=tmp_path, disk_bytes=1 << 30,
                                   disk_reload="always"), budget)
    try:
        _ask(svc, d1 + q1, len(d1))
        _ask(svc, d2 + q1, len(d2))
        host = next(iter(svc.tiers.host.entries.values())).kv
        assert host.fp8 and any(s.dtype == "float8_e4m3fn" for s in host.sections)
        tokens, cached = _ask(svc, d1 + q2, len(d1))  # from host
        assert tokens == want and cached == len(d1)
        entry_kv = next(e for e in svc.cache.entries.values() if list(e.ids) == d1 + q1).kv
        assert all(layer.k.dtype == torch.float8_e4m3fn for layer in entry_kv.layers.values())
        _ask(svc, [9] * 90, 80)  # a third document: d1 device -> disk, d2 host -> disk (kept in host)
        settle_writes(svc)
        assert sorted(list(e.ids) for e in svc.tiers.disk.entries.values()) == sorted([d1 + q1, d2 + q1])
        assert all(read_header(e.path).fp8 for e in svc.tiers.disk.entries.values())
        assert [list(e.ids) for e in svc.tiers.host.entries.values()] == [d2 + q1]
        tokens, cached = _ask(svc, d1 + q2, len(d1))  # from disk
        assert tokens == want and cached == len(d1) and svc.stats()["tiers"]["disk"]["promotions"] == 1
        # the third document's entry took the host's room: d2 (on disk by now) was dropped from host
        assert [list(e.ids) for e in svc.tiers.host.entries.values()] == [[9] * 90]
        tokens, cached = _ask(svc, d2 + q2, len(d2))  # from disk
        assert tokens == want2 and cached == len(d2) and svc.stats()["tiers"]["disk"]["promotions"] == 2
    finally:
        svc.shutdown()


def _cp2(rank, world, directory):
    llm = LLM(random_weights="tiny", progress=False, parallel=ParallelConfig(cp=world, cp_strategy="ring"))
    (d1, d2), (q1, q2, q3) = _docs(seed=8)
    solo = [llm.generate(d + q, max_new_tokens=STEPS).token_ids for d, q in ((d1, q2), (d1, q3), (d2, q2))]
    budget, _ = _budget(llm, len(d1) + len(q1))
    # only what evictions wrote; "always": under a loaded CPU "auto"'s measured rates may rightly pick a prefill
    tiers = TierConfig(disk_dir=directory, disk_bytes=1 << 30, disk_reload="always", shutdown_write_s=0)
    out = dict(solo=solo)
    for run in range(2):  # the second is a restart on the same directory
        if run == 1 and rank == 1:  # rank 1's copy of d2 damaged in its payload: found only when loaded
            _damage(Path(directory), key, d2 + q1, rank)
        svc = Scheduler(llm, cache_bytes=budget, max_batch=4, tiers=tiers)
        key = svc.tiers.disk.key
        if rank != 0:
            svc.serve_forever()
            continue
        svc.start()
        try:
            if run == 0:
                _ask(svc, d1 + q1, len(d1))
                _ask(svc, d2 + q1, len(d2))  # d1's shards -> disk, each rank its own
                settle_writes(svc)
                out["first"] = _ask(svc, d1 + q2, len(d1))
            else:
                out["restart"] = _ask(svc, d1 + q3, len(d1))
                out["prefills"] = svc.counters["prefill_chunks_total"]
                out["damaged"] = _ask(svc, d2 + q2, len(d2))  # rank 1 cannot load it: every rank prefills
                out["failures"] = svc.counters["reload_failures_total"], svc.counters["prefill_chunks_total"]
        finally:
            svc.shutdown()
    return out


def test_cp2_ring_demotes_and_promotes_both_shards(tmp_path):
    lead = run_ranks(_cp2, 2, str(tmp_path))[0]
    docs, _ = _docs(seed=8)
    assert lead["first"] == (lead["solo"][0], len(docs[0]))
    assert lead["restart"] == (lead["solo"][1], len(docs[0])) and lead["prefills"] == 0
    assert lead["damaged"] == (lead["solo"][2], 0) and lead["failures"] == (1, 1)
    # d1's shard file on each rank; d2's were removed on both ranks when rank 1's failed to load
    assert sorted(p.name.split("-r")[1] for p in tmp_path.glob("*.kv")) == ["0.kv", "1.kv"]
