"""--disk-reload-policy split (issue 49, load and compute at once): a disk hit's head is prefilled in chunk
steps while its tail is read from the file backward, block by block. The planner's cut; the entry it builds is
bit-identical to a pure reload of the file (whose rows a chunked prefill with the same bounds wrote), the
answer the same; a damaged tail block falls back to computing the rest, with the same answer."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from starshard import LLM
from starshard.config import SamplingConfig
from starshard.runtime.prompt import Prompt
from starshard.serving import kv_file
from starshard.serving.kv_file import read_header
from starshard.serving.ops import JoinTail, PrefillChunk, ReadTail
from starshard.serving.reload_policy import DiskReloadPolicy, plan_cut
from starshard.serving.scheduler import Scheduler
from starshard.serving.tiers import TierConfig
from tests.helpers.kv_shards import assert_kv_equal
from tests.helpers.service import settle_writes, submit

STEPS = 4
CHUNK = 32


# -- the planner
def test_plan_cut_meets_where_both_finish():
    cuts = [0, 32, 64, 96, 128]
    linear = [c / 128 for c in cuts]  # seconds to compute [0, c) at one unit per whole prefill
    tail = [(128 - c) / 128 for c in cuts]  # seconds to read [c, 128)
    assert plan_cut(cuts, linear, tail) == 64  # equal rates: the middle
    assert plan_cut(cuts, [x / 10 for x in linear], tail) == 128  # compute 10x faster: all computed
    assert plan_cut(cuts, linear, [x / 10 for x in tail]) == 0  # read 10x faster: all read
    assert plan_cut(cuts, [3 * x for x in linear], tail) == 32  # compute 3x slower: a short head
    assert plan_cut([64, 96, 128], [0.0, 0.25, 0.5], [0.5, 0.25, 0.0]) == 96  # a re-plan from 64 on
    with pytest.raises(ValueError, match="one compute and one read estimate per cut"):
        plan_cut(cuts, linear, tail[:-1])


@pytest.mark.parametrize("cuts", [(40, 35), (40, 70, 9), (100, 0)])
def test_a_tail_read_covers_every_row_above_the_cut_wherever_it_moves(cuts, tmp_path, monkeypatch):
    """Blocks of 16 rows: a cut moved earlier inside a block already read (40 -> 35: block 2 again), later
    (40 -> 70: rows left to the head) and back, and to the start: the rows above the last cut equal the
    file's; the head's rows (below it) are left alone."""
    from starshard.serving.cache_key import cache_key
    from starshard.serving.host_tier import HostKV, layout
    from starshard.serving.tail_read import TailRead

    monkeypatch.setattr(kv_file, "BLOCK_TOKENS", 16)
    n, key = 100, cache_key("tail-probe", dtype=torch.float32)
    sections, nbytes = layout(range(3), 1, 2, 8, n, torch.float32, False)
    host = HostKV(torch.randint(0, 255, (nbytes,), dtype=torch.uint8), sections, torch.float32, False, n, n)
    for sec in sections:
        if sec.part == "pos":
            host.buffer[sec.offset:sec.offset + sec.nbytes].view(torch.int64).copy_(torch.arange(n))
        else:  # finite floats
            host.buffer[sec.offset:sec.offset + sec.nbytes].view(torch.float32).copy_(torch.randn(sec.nbytes // 4))
    path = tmp_path / "x.kv"
    kv_file.write_kv_file(path, host, list(range(n)), key, 0)
    want, _ = kv_file.read_kv_file(path, "cpu", key, 0)
    got, _ = kv_file.read_kv_file(path, "cpu", key, 0)
    last = cuts[-1]
    for layer in got.layers.values():  # the head [0, last) as computed; nothing above it yet
        layer.k[:, :, last:].zero_()
        layer.v[:, :, last:].zero_()
        layer.length = last
    rate = 4 * nbytes  # paced (a benchmark's slower disk): the whole file would take 0.25 s
    tail = TailRead(path, read_header(path, key, 0), cuts[0], rate=rate)
    tail.attach(got)
    for cut in cuts:
        first = tail.join(cut)
    assert first == last and tail.error is None
    assert tail.seconds >= 0.9 * tail.nbytes / rate
    tail.complete(got, first)
    assert_kv_equal(got, want)


def test_policy_split_uses_the_rates_and_replans_as_they_drift():
    policy = DiskReloadPolicy("split")
    cuts, flops, nbytes = [0, 32, 64, 96, 128], [0, 1e9, 2e9, 3e9, 4e9], [4e6, 3e6, 2e6, 1e6, 0]
    assert policy.split(cuts, flops, nbytes) is None  # nothing measured: decided as "auto"
    policy.observe_prefill(1.0, 4e9)  # a whole prefill: 1 s
    assert policy.split(cuts, flops, nbytes) is None
    policy.observe_reload(1.0, 4e6)  # a whole reload: 1 s
    assert policy.split(cuts, flops, nbytes) == 64
    policy.observe_prefill(3.0, 4e9)  # the prefills slow down (average 2 s): the head shrinks
    assert policy.split(cuts, flops, nbytes) == 32
    # a re-plan with the head at 32: from there on the head costs 0.5 s a chunk, the tail 0.25 s a chunk's rows
    head, tail = [0, 1e9, 2e9, 3e9], [3e6, 2e6, 1e6, 0]
    assert policy.split(cuts[1:], head, tail) == 64
    assert policy.split(cuts[1:], head, tail, read_s=0.5) == 32  # the read ran 0.5 s already: join now
    # the read's own rate replaces the saved one: a warm page cache (40x) reads it all; a slow disk (4x) computes more
    assert policy.split(cuts[1:], head, tail, live=(2.5e-8, 0.0)) == 32
    assert policy.split(cuts[1:], head, tail, read_s=9.0, live=(1e-6, 1e6)) == 96
    fresh = DiskReloadPolicy("split")
    fresh.observe_prefill(2.0, 4e9)
    assert fresh.split(cuts[1:], head, tail) is None and fresh.split(cuts[1:], head, tail, live=(2.5e-8, 0.0)) == 32
    assert DiskReloadPolicy("auto").split(cuts, flops, nbytes) is None
    with pytest.raises(ValueError, match="auto, always, split"):
        DiskReloadPolicy("sometimes")


# -- one process
def _docs(seed):
    rng = np.random.default_rng(seed)
    docs = [[int(x) for x in rng.integers(1, 500, 83)] for _ in range(2)]
    q1, q2 = ([int(x) for x in rng.integers(1, 500, 6)] for _ in range(2))
    return docs, q1, q2


def _ask(svc, ids, context_len):
    events, done = submit(svc, Prompt(ids, context_len), STEPS)
    assert done.wait(120)
    assert events[-1].finish_reason == "length", events[-1]
    return [e.token_id for e in events if e.token_id is not None], events[-1].cached_tokens


def _recording(svc) -> list:
    """Every op the executor runs, in order."""
    seen, run = [], svc.executor.run

    def recorded(ops):
        seen.extend(ops)
        return run(ops)
    svc.executor.run = recorded
    return seen


def _service(llm, tmp_path, cut):
    """A device budget of one document, a disk tier in split mode, the planner pinned to `cut` (once the
    head reaches it, the next re-plan joins)."""
    probe = Scheduler(llm, cache_bytes=1 << 30)
    budget = int(1.5 * max(probe.holdings(Prompt(list(range(1, 90)), 83), STEPS)))
    svc = Scheduler(llm, cache_bytes=budget, max_batch=4, prefill_chunk=CHUNK,
                    tiers=TierConfig(disk_dir=tmp_path, disk_bytes=1 << 30, disk_reload="split"))
    svc.reload_policy.split = lambda cuts, *a, **k: max(c for c in cuts if c <= cut) if cuts[0] <= cut else cuts[0]
    svc.start()
    return svc


def test_a_split_server_without_saved_rates_probes_them_at_start(tmp_path, caplog):
    """No reload-rates.json (a copied directory, a first start): a split server probes both rates at start (a
    cold read of the largest file, a GEMM) instead of reloading its first disk hit whole."""
    from starshard.serving.reload_policy import RATES_FILE, probe_prefill, probe_read

    tiny = LLM(random_weights="tiny", progress=False)
    (d1, d2), q1, q2 = _docs(14)
    svc = _service(tiny, tmp_path, cut=32)
    try:
        assert svc.reload_policy.reload.per_unit is None  # nothing on disk to probe yet
        _ask(svc, d1 + q1, len(d1))
        _ask(svc, d2 + q1, len(d2))  # d1 -> disk
        settle_writes(svc)
    finally:
        svc.shutdown()
    (tmp_path / RATES_FILE).unlink()
    files = sorted(tmp_path.glob("*.kv"))
    assert files and probe_read(files, 2) > 0 and probe_read([tmp_path / "none.kv"], 2) is None
    assert probe_prefill(tiny.device, torch.float32) > 0
    with caplog.at_level("INFO", logger="starshard.serve"):
        again = Scheduler(tiny, cache_bytes=1 << 26, max_batch=4, prefill_chunk=CHUNK,
                          tiers=TierConfig(disk_dir=tmp_path, disk_bytes=1 << 30, disk_reload="split"))
    try:
        policy = again.reload_policy
        assert policy.reload.per_unit > 0 and policy.prefill.per_unit > 0
        assert "no saved reload rates" in caplog.text and "probed reload" in caplog.text
        cuts, flops, nbytes = [0, 32, 64], [0.0, 1e6, 2e6], [2e6, 1e6, 0.0]
        assert policy.split(cuts, flops, nbytes) in cuts  # planned, not decided as "auto"
    finally:
        again.shutdown()


@pytest.mark.parametrize("fp8", [None, "kv"])  # FP8: e4m3 rows and scales grafted as stored
def test_split_reload_is_a_pure_reload_and_a_damaged_tail_is_computed(fp8, tmp_path, monkeypatch):
    monkeypatch.setattr(kv_file, "BLOCK_TOKENS", 16)  # several blocks per file: the tail is read block by block
    tiny = LLM(random_weights="tiny", progress=False, fp8=fp8)
    (d1, d2), q1, q2 = _docs(11)
    want = tiny.generate(d1 + q2, max_new_tokens=STEPS).token_ids
    svc = _service(tiny, tmp_path, cut=32)
    try:
        _ask(svc, d1 + q1, len(d1))
        _ask(svc, d2 + q1, len(d2))  # d1 -> disk
        settle_writes(svc)
        disk = svc.tiers.disk
        found = disk.entry_for(d1 + q1)
        reload = disk.load(found, "cpu")  # what a pure reload gives
        assert read_header(found.path).block_tokens == 16
        ops = _recording(svc)
        tokens, cached = _ask(svc, d1 + q2, len(d1))
        m = int(np.flatnonzero(np.array(d1 + q1) != np.array(d1 + q2))[0])  # the tokens shared with the entry
        assert tokens == want and cached == m - 32
        fills = [(op.start, op.end) for op in ops if isinstance(op, PrefillChunk)]
        assert fills == [(0, 32)] and all(op.fill for op in ops if isinstance(op, PrefillChunk))
        assert [op.cut for op in ops if isinstance(op, (ReadTail, JoinTail))] == [32, 32]
        entry = next(e for e in svc.cache.entries.values() if list(e.ids) == d1 + q1)
        assert_kv_equal(entry.kv, reload)  # rows [0, 32) computed, [32, 89) read: as the file holds them
        assert svc.counters["split_reloads_total"] == 1 and svc.counters["tail_failures_total"] == 0
        assert svc.reload_policy.reload.per_unit is not None  # the tail's read measured the disk

        _ask(svc, d2 + q2, len(d2))  # d1's new entry -> disk again (its file is there already)
        settle_writes(svc)
        path = disk.entry_for(d1 + q1).path
        h = read_header(path)
        raw = bytearray(path.read_bytes())
        k = next(i for i, s in enumerate(h.sections) if s.part == "k")
        off, _ = kv_file.block_ranges(h.sections[k], 5, 16)[0]  # rows [80, 89): in the tail
        raw[h.payload_offset + off] ^= 4
        path.write_bytes(bytes(raw))
        ops.clear()
        tokens, cached = _ask(svc, d1 + q2, len(d1))
        assert tokens == want and cached == 0
        assert [(op.start, op.end) for op in ops if isinstance(op, PrefillChunk)] == [(0, 32), (32, 64), (64, 89)]
        entry = next(e for e in svc.cache.entries.values() if list(e.ids) == d1 + q1)
        assert_kv_equal(entry.kv, reload)  # the rest computed: the same rows the file held
        assert svc.counters["tail_failures_total"] == 1 and disk.entry_for(d1 + q1) is None  # the file dropped
        assert svc.health() is None
    finally:
        svc.shutdown()


def test_a_split_reload_cancelled_mid_head_frees_everything_and_keeps_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_file, "BLOCK_TOKENS", 16)
    tiny = LLM(random_weights="tiny", progress=False)
    (d1, d2), q1, q2 = _docs(14)
    want = tiny.generate(d1 + q2, max_new_tokens=STEPS).token_ids
    svc = _service(tiny, tmp_path, cut=64)  # two head chunks
    ex = svc.executor
    try:
        _ask(svc, d1 + q1, len(d1))
        _ask(svc, d2 + q1, len(d2))  # d1 -> disk
        settle_writes(svc)
        before = svc.cache.used(0)
        run, box = ex.run, {}

        def cancel_after_the_first_fill(ops):
            out = run(ops)
            if any(isinstance(op, PrefillChunk) and op.fill and op.start == 0 for op in ops):
                box["filling"] = dict(ex.filling), dict(ex.tails)
                box["ticket"].cancel()
            return out
        ex.run = cancel_after_the_first_fill
        events, done = [], threading.Event()
        box["ticket"] = svc.submit(Prompt(d1 + q2, len(d1)), max_tokens=STEPS, sampling=SamplingConfig(),
                                   on_event=lambda ev: (events.append(ev), ev.finish_reason and done.set()))
        assert done.wait(60) and events[-1].finish_reason == "cancelled"
        ex.run = run
        filling, tails = box["filling"]
        assert list(filling) and list(tails)  # it was cancelled while the head computed and the tail was read
        for _ in range(500):  # the cancel is answered first, its Abort runs in that step
            if not ex.filling:
                break
            time.sleep(0.01)
        # everything it held is freed (the room it made stays made: d2 went to disk)
        held = sum(e.bytes_on(0) for e in svc.cache.entries.values())
        assert not ex.filling and not ex.tails and svc.cache.used(0) == held <= before
        assert all(list(e.ids) != d1 + q1 for e in svc.cache.entries.values())
        assert svc.tiers.disk.entry_for(d1 + q1) is not None and svc.health() is None  # the file stays
        tokens, cached = _ask(svc, d1 + q2, len(d1))  # split again, to the end
        assert tokens == want and cached > 0 and svc.counters["split_reloads_total"] == 2
    finally:
        svc.shutdown()


# -- cp=2 (gloo): ring, Ulysses, USP and Star, each rank grafting its own file's tail
def _same(a, b) -> bool:
    try:
        assert_kv_equal(a, b)
        return True
    except AssertionError:
        return False


def _checked(svc) -> list:
    """On every rank: once a split entry is complete, whether it equals a pure reload of the file (read then;
    kept as the reference for an entry completed by computing the rest, its file dropped)."""
    checks, refs, run = [], {}, svc.executor.run

    def recorded(ops):
        out = run(ops)
        for op in ops:
            done = isinstance(op, JoinTail) or isinstance(op, PrefillChunk) and op.fill and op.last
            e = svc.cache.entries.get(op.entry) if done else None
            if e is None or e.filling:
                continue
            key = tuple(e.ids)
            found = svc.tiers.disk.entry_for(e.ids)
            if key not in refs and found is not None:
                refs[key] = svc.tiers.disk.load(found, "cpu")
            checks.append((type(op).__name__, _same(e.kv, refs[key])))
        return out
    svc.executor.run = recorded
    return checks


def _cp2_rank(rank, world, directory, strategy):
    from starshard.config import ParallelConfig
    from starshard.serving.disk_tier import file_name

    kv_file.BLOCK_TOKENS = 16  # several blocks per file
    llm = LLM(random_weights="tiny", progress=False, parallel=ParallelConfig(cp=world, cp_strategy=strategy))
    (d1, d2), q1, q2 = _docs(12)
    probe = Scheduler(llm, cache_bytes=1 << 30)
    budget = int(1.5 * max(probe.holdings(Prompt(list(range(1, 90)), 83), STEPS)))
    svc = Scheduler(llm, cache_bytes=budget, max_batch=4, prefill_chunk=CHUNK,
                    tiers=TierConfig(disk_dir=directory, disk_bytes=1 << 30, disk_reload="always", shutdown_write_s=0))
    checks = _checked(svc)
    if rank != 0:
        svc.serve_forever()
        return dict(checks=checks)
    policy = svc.reload_policy
    policy.split = lambda cuts, *a, **k: max(c for c in cuts if c <= 32) if cuts[0] <= 32 else cuts[0]
    out = {}
    svc.start()
    try:
        _ask(svc, d1 + q1, len(d1))
        _ask(svc, d2 + q1, len(d2))  # d1 -> disk, each rank its shard
        settle_writes(svc)
        out["reload"] = _ask(svc, d1 + q2, len(d1))  # "always": a pure reload
        _ask(svc, d2 + q2, len(d2))  # d1 -> disk again
        settle_writes(svc)
        policy.mode = "split"
        ops = _recording(svc)
        out["split"] = _ask(svc, d1 + q2, len(d1))
        out["cuts"] = [(type(op).__name__, op.cut) for op in ops if isinstance(op, (ReadTail, JoinTail))]
        policy.mode = "always"
        _ask(svc, d2 + q2, len(d2))  # d1 -> disk again
        settle_writes(svc)
        path = svc.tiers.disk.path / file_name(svc.tiers.disk.key, d1 + q1, 1)  # rank 1's file: a tail block
        h = read_header(path)
        raw = bytearray(path.read_bytes())
        k = next(i for i, s in enumerate(h.sections) if s.part == "v")
        off, _ = kv_file.block_ranges(h.sections[k], kv_file.n_blocks(h.sections[k], 16) - 1, 16)[0]
        raw[h.payload_offset + off] ^= 4
        path.write_bytes(bytes(raw))
        policy.mode = "split"
        out["damaged"] = _ask(svc, d1 + q2, len(d1))
        out["counters"] = svc.counters["split_reloads_total"], svc.counters["tail_failures_total"]
        out["files"] = sorted(p.name.split("-r")[1] for p in svc.tiers.disk.path.glob("*.kv")
                              if file_name(svc.tiers.disk.key, d1 + q1, 0).split("-r")[0] in p.name)
        out["health"] = svc.health()
    finally:
        svc.shutdown()
    return dict(out, checks=checks)


CP2_STRATEGIES = ("ring", "ulysses", "usp", "star")


def _cp2_both(rank, world, directory):
    from pathlib import Path
    return {s: _cp2_rank(rank, world, str(Path(directory) / s), s) for s in CP2_STRATEGIES}


def test_cp2_split_reloads_equal_pure_reloads_for_each_exact_strategy_and_star(tmp_path):
    from tests.helpers.mp_harness import run_ranks

    r0, r1 = run_ranks(_cp2_both, 2, str(tmp_path))
    for strategy in CP2_STRATEGIES:
        lead = r0[strategy]
        tokens, m = lead["reload"]
        assert lead["split"] == (tokens, m - 32) and lead["damaged"] == (tokens, 0), strategy
        assert lead["cuts"] == [("ReadTail", 32), ("JoinTail", 32)], strategy
        assert lead["counters"] == (2, 1) and lead["health"] is None, strategy
        assert lead["files"] == [], strategy  # the damaged tail's file dropped on both ranks
        for r in (r0, r1):  # each rank: the grafted entry, then the one completed by computing, equal the reload
            assert r[strategy]["checks"] == [("JoinTail", True), ("PrefillChunk", True)], (strategy, r[strategy])
