"""Window-trimmed cache entries through the host and disk tiers (issue 38): a trimmed KV shard (local layers
keep only their window, KVCache.compact_local) goes to host memory and to a file and back with each layer's
rows, positions, windows and bytes (FP8 too, CP-like shuffled positions, a layer holding no row, a ring that
wrapped); the file carries the entry's serves_from (format version 2; a version-1 file is refused with a
reason, another version's key is left alone). The service (a tiny random Gemma 3, window 16) trims with the
tiers on: an entry demoted to host / disk and promoted back answers follow-ups as generate does (as an
untrimmed service does), its host and disk bytes are the trimmed shard's, and after a restart on the same
directory it still serves only prompts sharing all of its document (a shorter share is prefilled)."""
from __future__ import annotations

import json
import logging
import struct

import numpy as np
import pytest
import torch
import transformers

from starshard import LLM
from starshard.engine.kv_cache import KVCache
from starshard.runtime.prompt import Prompt
from starshard.serving import kv_file
from starshard.serving.cache_key import FORMAT_VERSION, CacheKey, token_digest
from starshard.serving.context_cache import kv_bytes
from starshard.serving.disk_tier import DiskTier, file_name
from starshard.serving.host_tier import HostTier, layout, to_device, to_host
from starshard.serving.kv_file import KVFileError, read_header, read_kv_file, write_kv_file
from starshard.serving.scheduler import Scheduler
from starshard.serving.tiers import TierConfig
from tests.engine.test_gemma import FAMILIES as GEMMA
from tests.helpers.hf_models import make_hf_model
from tests.helpers.kv_shards import bits, key_for
from tests.helpers.mp_harness import run_ranks
from tests.helpers.service import settle_writes, submit

transformers.logging.set_verbosity_error()

PARTS = ("k", "v", "pos", "k_scale", "v_scale")


def trimmed_kv(fp8: bool, start: int = 9, windows=None, dtype=torch.bfloat16, seed=0) -> KVCache:
    """A CP-like shard (12 shuffled positions) of 4 layers compacted at `start`: layer 0 (window 4) keeps the
    rows at positions >= start - 3, layer 1 (window 2, start past them all) none, layer 3 (window 40)
    every row (its window covers everything: not trimmed), layer 2 is global."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(12, generator=g)
    kv = KVCache([0, 1, 2, 3], 1, 2, 8, 12, dtype, "cpu", fp8=fp8)
    for i in kv.layers:
        kv.layer(i).append((torch.randn(1, 2, 12, 8, generator=g) * (i + 1)).to(dtype),
                           torch.randn(1, 2, 12, 8, generator=g).to(dtype), perm)
    kv.advance(perm)
    kv.compact_local({0: 4, 3: 40}, start)
    kv.compact_local({1: 2}, 14)
    return kv


def assert_same_layers(a: KVCache, b: KVCache, by_position: bool = False) -> None:
    """Same layers, rows, windows, trimmed state and the bytes of every held row (by_position: rows compared
    in position order, for a ring that wrapped)."""
    assert list(a.layers) == list(b.layers) and a.next_position == b.next_position and a.trimmed == b.trimmed
    for i in a.layers:
        x, y = a.layers[i], b.layers[i]
        assert (x.length, x.window, x.trimmed, x.fp8, x.k.dtype) == (y.length, y.window, y.trimmed, y.fp8, y.k.dtype), i
        sx, sy = x.stored(), y.stored()
        ox, oy = (torch.argsort(sx.pos), torch.argsort(sy.pos)) if by_position else (None, None)
        for p in PARTS:
            tx, ty = getattr(sx, p), getattr(sy, p)
            assert (tx is None) == (ty is None), p
            if tx is None:
                continue
            if by_position:
                dim = 0 if p == "pos" else 2
                tx, ty = tx.index_select(dim, ox), ty.index_select(dim, oy)
            assert tx.shape == ty.shape and torch.equal(bits(tx), bits(ty)), (i, p)


@pytest.mark.parametrize("fp8", [False, True])
def test_trimmed_shard_round_trips_through_host_and_file(tmp_path, fp8):
    kv = trimmed_kv(fp8)
    rows = {i: kv.layer(i).length for i in kv.layers}
    assert kv.trimmed and rows[0] == 6 and rows[1] == 0 and rows[2] == rows[3] == 12
    assert [kv.layer(i).window for i in kv.layers] == [4, 2, None, None]
    host = to_host(kv, serves_from=9)
    assert host.windows == {0: 4, 1: 2} and host.serves_from == 9 and host.length == 12
    assert [host.rows(i) for i in kv.layers] == [6, 0, 12, 12]
    sections, nbytes = layout([0, 1, 2, 3], 1, 2, 8, rows, torch.bfloat16, fp8)
    assert host.sections == sections and host.nbytes == nbytes
    assert sum(s.nbytes for s in sections) == kv_bytes(kv)  # exactly the trimmed shard's rows (compacted: no spare)
    back = to_device(host, "cpu").kv
    assert_same_layers(kv, back)
    assert kv_bytes(back) == kv_bytes(kv)
    # the file: each layer's rows, the windows and serves_from in the header; the same shard back
    key, ids = key_for(fp8=fp8), np.arange(50, 70)
    write_kv_file(tmp_path / "t.kv", host, ids, key, rank=0)
    h = read_header(tmp_path / "t.kv", key, 0)
    assert (h.lengths, h.windows, h.serves_from, h.length) == ((6, 0, 12, 12), ((0, 4), (1, 2)), 9, 12)
    loaded, tokens = read_kv_file(tmp_path / "t.kv", "cpu", key, 0)
    assert_same_layers(kv, loaded) and np.array_equal(tokens, ids)
    # the disk tier lists it with serves_from and its device bytes (as the service counted them)
    with DiskTier(tmp_path / "d", 1 << 30, key, 0) as tier:
        e = tier.put(3, ids, to_host(kv, serves_from=9))
        one_row = kv_bytes(KVCache([0], 1, 2, 8, 1, torch.bfloat16, "cpu", fp8))  # one layer's KV of one token
        assert e.serves_from == 9 and e.device_bytes(4 * one_row) == kv_bytes(kv)
        assert tier.peek(ids[:9]) == (None, 0) and tier.peek(ids[:12])[1] == 11  # served_prefix: >= 9 shared
        assert_same_layers(kv, tier.load(e, "cpu"))
    with DiskTier(tmp_path / "d", 1 << 30, key, 0) as tier:  # a restart indexes the same
        (e,) = tier.list()
        assert e.serves_from == 9 and e.layer_rows == ((6, True), (0, True), (12, False), (12, False))


def test_a_wrapped_ring_comes_back_in_write_order():
    """A trimmed layer whose single-token writes went round its ring: the host copy holds its rows from the
    oldest, the rebuilt layer the same rows, and the next token replaces the same (oldest) key in both."""
    torch.manual_seed(0)
    kv = KVCache([0, 1], 1, 2, 8, 20, torch.float32, "cpu", windows={0: 4})
    kv.layer(0).append(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), torch.arange(6))
    kv.layer(1).append(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), torch.arange(6))
    for p in (6, 7):
        for i in kv.layers:
            kv.layer(i).store(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.tensor([p]))
    kv.advance(torch.arange(8))
    ring = kv.layer(0)
    assert ring.ring_full() and ring.head == 1
    host = to_host(kv, serves_from=6)
    assert host.layer(0).pos.tolist() == [4, 5, 6, 7]
    back = to_device(host, "cpu").kv
    assert_same_layers(kv, back, by_position=True)
    k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    for c in (kv, back):
        c.layer(0).store(k, v, torch.tensor([8]))
    assert_same_layers(kv, back, by_position=True)
    assert sorted(back.layer(0).pos.tolist()) == [5, 6, 7, 8]


def test_host_tier_counts_and_serves_a_trimmed_entry():
    kv = trimmed_kv(False)
    tier = HostTier(1 << 20)
    tier.put(1, np.arange(20), to_host(kv, serves_from=9), rank_bytes=[kv_bytes(kv)])
    assert tier.used(0) == kv_bytes(kv) and tier.entries[1].serves_from == 9
    assert tier.peek(np.r_[np.arange(8), 99, 98]) == (None, 0)  # shares 8 < 9 tokens: not served
    assert tier.peek(np.r_[np.arange(10), 99])[1] == 10


def _version_1(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[8:12] = struct.pack("<I", 1)
    path.write_bytes(bytes(raw))


def test_old_format_files_are_skipped_with_a_reason(tmp_path, caplog):
    """A version-1 file under this key's name is refused at start (reason "version", removed); one under a
    version-1 key's name belongs to another key: left in place, never read."""
    assert FORMAT_VERSION == 4
    key, ids = key_for(), np.arange(30)
    old_key = CacheKey.from_fields({**key.fields(), "format_version": 1})
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    write_kv_file(d / file_name(key, ids, 0), trimmed_kv(False), ids, key, 0)
    write_kv_file(d / file_name(old_key, ids, 0), trimmed_kv(False), ids, old_key, 0)
    _version_1(d / file_name(key, ids, 0))
    with pytest.raises(KVFileError) as e:
        read_header(d / file_name(key, ids, 0), key, 0)
    assert e.value.reason == "version" and "format version 1" in str(e.value)
    with caplog.at_level(logging.INFO, logger="starshard.serving.disk_tier"):
        with DiskTier(d, 1 << 30, key, 0) as tier:
            assert tier.entries == {} and tier.stats.rejected == 1
    assert not (d / file_name(key, ids, 0)).exists() and (d / file_name(old_key, ids, 0)).exists()
    assert "version" in caplog.text and "belong to another model or layout" in caplog.text


def test_a_damaged_trimmed_header_is_refused(tmp_path):
    """The header's lengths must agree with the sections, and serves_from lie within the tokens."""
    key, ids = key_for(), np.arange(30)
    host = to_host(trimmed_kv(False), serves_from=9)
    blanks = [["0" * 32] * kv_file.n_blocks(s, kv_file.BLOCK_TOKENS) for s in host.sections]
    raw = kv_file._header_bytes(host, len(ids), "0" * 32, blanks, key, 0, None)
    size = kv_file._offsets(len(raw), len(ids))[1] + host.nbytes
    assert kv_file._parse_header(tmp_path / "x.kv", json.loads(raw), size, len(raw)).serves_from == 9
    for field, bad, why in (("lengths", [6, 1, 12, 12], "disagree with the layout"),
                            ("lengths", [6, 0, 12, 11], "holds other than 12 rows"),
                            ("serves_from", 31, "serves_from 31"), ("windows", [[0, 4], [0, 2]], "windows"),
                            ("windows", [[0, 4], [7, 2]], "windows")):
        h = json.loads(raw)
        h[field] = bad
        with pytest.raises(KVFileError, match=why) as e:
            kv_file._parse_header(tmp_path / "x.kv", h, size, len(raw))
        assert e.value.reason == "header", field


# ---------------------------------------------------------------------------------------------- the service
DOC, PART, NEW = 120, 50, 5  # d shares PART tokens: an entry keeping every key would serve it


def _ids(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 211, n)]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    arch, kw = GEMMA["gemma3"]
    path = make_hf_model(arch, tmp_path_factory.mktemp("trimtiers") / "g3", eos_token_id=None, initializer_range=0.1,
                         **kw)[1]
    llm = LLM(path, progress=False)
    prompts = _prompts()
    refs = {k: llm.generate(p, max_new_tokens=NEW).token_ids for k, p in prompts.items()}
    return llm, prompts, refs


def _ask(svc, prompt):
    events, done = submit(svc, prompt, NEW)
    assert done.wait(120)
    assert events[-1].finish_reason == "length", events[-1]
    return [e.token_id for e in events if e.token_id is not None], events[-1].cached_tokens


def _trimmed_bytes(svc) -> int:
    """A trimmed entry's bytes (one rank): global layers DOC + 6 rows, local ones W - 1 + 6."""
    ex = svc.executor
    windows, layers = ex.local_windows(), ex.model.layer_ids
    rows = sum(windows[i] - 1 + 6 if i in windows else DOC + 6 for i in layers)
    return rows * (ex.token_bytes() // len(layers))


def _budget(llm) -> tuple[int, int]:
    """A device budget holding one document's prefill and its request, never a second trimmed entry beside."""
    probe = Scheduler(llm, cache_bytes=1 << 30)
    need = max(probe.holdings(Prompt(list(range(1, DOC + 7)), DOC), NEW))
    return need + _trimmed_bytes(probe) // 2, _trimmed_bytes(probe)


def test_service_trims_with_the_host_tier(gemma3):
    """a's trimmed entry moves to the host tier (its trimmed bytes, its windows, serves_from) when b arrives;
    d (sharing 50 tokens) is prefilled, not served from it; c and e are promoted / extended from it and answer
    as generate (as an untrimmed service)."""
    llm, p, refs = gemma3
    budget, trimmed = _budget(llm)
    svc = Scheduler(llm, cache_bytes=budget, max_batch=4, tiers=TierConfig(host_bytes=1 << 22))
    svc.start()
    try:
        assert svc.window_trim and svc.executor.window_trim
        assert _ask(svc, p["a"]) == (refs["a"], 0)
        (a,) = svc.cache.entries.values()
        assert a.serves_from == DOC and a.rank_bytes == [trimmed] and kv_bytes(a.kv) == trimmed
        assert _ask(svc, p["b"]) == (refs["b"], 0)  # a -> host
        (he,) = svc.tiers.host.entries.values()
        assert list(he.ids) == p["a"].ids and he.serves_from == DOC and he.bytes_on(0) == trimmed
        assert he.kv.windows == svc.executor.local_windows()
        assert sum(s.nbytes for s in he.kv.sections) == trimmed  # the host copy holds the trimmed rows
        assert _ask(svc, p["d"]) == (refs["d"], 0)  # shares 50 < 120 tokens with a: prefilled
        assert svc.stats()["tiers"]["host"]["promotions"] == 0
        assert _ask(svc, p["c"]) == (refs["c"], DOC)  # promoted back
        assert svc.stats()["tiers"]["host"]["promotions"] == 1
        e = next(e for e in svc.cache.entries.values() if list(e.ids) == p["a"].ids)
        assert e.serves_from == DOC and e.kv.trimmed and kv_bytes(e.kv) == trimmed == e.rank_bytes[0]
        assert _ask(svc, p["e"]) == (refs["e"], DOC)
    finally:
        svc.shutdown()


def test_demote_finds_a_trimmed_entry_by_its_document(gemma3, tmp_path):
    """Scheduler.demote given a document's own tokens (as bench serve --tiers passes them) moves its trimmed
    entry to host, then to disk; the document less its last token shares less than the entry serves: refused."""
    llm, p, refs = gemma3
    tiers = TierConfig(host_bytes=1 << 22, disk_dir=tmp_path, disk_bytes=1 << 22)
    svc = Scheduler(llm, cache_bytes=1 << 24, tiers=tiers)
    svc.start()
    try:
        assert _ask(svc, p["a"]) == (refs["a"], 0)
        doc = p["a"].ids[:DOC]
        with pytest.raises(ValueError, match="no cache entry on the device shares"):
            svc.demote(doc[:-1], "host")
        shard = svc.demote(doc, "host")
        assert shard == [_trimmed_bytes(svc)] and svc.stats()["tiers"]["host"]["entries"] == 1
        assert svc.demote(doc, "disk") == shard and svc.stats()["tiers"]["disk"]["entries"] == 1
        assert _ask(svc, p["c"]) == (refs["c"], DOC)  # read back from disk
    finally:
        svc.shutdown()


def test_service_trims_with_the_disk_tier_and_a_restart(gemma3, tmp_path):
    llm, p, refs = gemma3
    budget, trimmed = _budget(llm)
    tiers = TierConfig(disk_dir=tmp_path / "kv", disk_bytes=1 << 30, disk_reload="always")
    svc = Scheduler(llm, cache_bytes=budget, max_batch=4, tiers=tiers)
    svc.start()
    try:
        assert svc.window_trim
        _ask(svc, p["a"])
        _ask(svc, p["b"])  # a -> disk
        settle_writes(svc)
        key = svc.tiers.disk.key
        h = read_header(tmp_path / "kv" / file_name(key, p["a"].ids, 0), key, 0)
        assert h.serves_from == DOC and dict(h.windows) == svc.executor.local_windows()
        assert svc.tiers.disk_bytes[token_digest(p["a"].ids)] == [trimmed]
        assert _ask(svc, p["c"]) == (refs["c"], DOC)  # promoted from disk
        assert svc.stats()["tiers"]["disk"]["promotions"] == 1
    finally:
        svc.shutdown()  # writes b (and c's entry) down
    svc = Scheduler(llm, cache_bytes=budget, max_batch=4, tiers=tiers)
    svc.start()
    try:
        disk = svc.tiers.disk
        e = disk.entry_for(p["a"].ids)
        assert e is not None and e.serves_from == DOC
        assert svc.tiers.disk_bytes[token_digest(p["a"].ids)] == [trimmed]  # as counted before the restart
        assert _ask(svc, p["d"]) == (refs["d"], 0)  # 50 shared tokens: the reloaded file does not serve them
        assert svc.stats()["tiers"]["disk"]["promotions"] == 0
        assert _ask(svc, p["e"]) == (refs["e"], DOC)
        assert svc.stats()["tiers"]["disk"]["promotions"] == 1
        got = next(x for x in svc.cache.entries.values() if list(x.ids) == p["a"].ids)  # reloaded, trimmed
        assert got.serves_from == DOC and got.kv.trimmed and kv_bytes(got.kv) == trimmed
    finally:
        svc.shutdown()


def _cp2(rank, world, path, directory):
    """cp=2 ring in chunks of 8: a's trimmed shards (a local layer's may be empty on a rank) go to disk on
    each rank, come back for c; after a restart d is prefilled and e promoted. Rank 0: each answer; every
    rank: the reloaded entries' (bytes held, bytes counted for every rank, serves_from)."""
    from starshard.config import ParallelConfig

    llm = LLM(path, progress=False, parallel=ParallelConfig(cp=world, cp_strategy="ring"))
    p = _prompts()
    tiers = TierConfig(disk_dir=directory, disk_bytes=1 << 30, disk_reload="always", shutdown_write_s=0)
    out = {}
    for run in range(2):  # the second is a restart on the same directory
        svc = Scheduler(llm, cache_bytes=_budget(llm)[0], max_batch=4, prefill_chunk=8, tiers=tiers)
        if rank != 0:
            svc.serve_forever()
        else:
            svc.start()
            try:
                for k in ("a", "b", "c") if run == 0 else ("d", "e"):
                    out[k] = _ask(svc, p[k])
                    settle_writes(svc)
                out[f"disk_bytes{run}"] = svc.tiers.disk_bytes[token_digest(p["a"].ids)]
            finally:
                svc.shutdown()
        out[f"held{run}"] = [(kv_bytes(e.kv), e.rank_bytes, e.serves_from, e.kv.trimmed)
                             for e in svc.cache.entries.values() if list(e.ids) == p["a"].ids]
    return out


def _prompts() -> dict[str, Prompt]:
    d1, d2 = _ids(1, DOC), _ids(2, DOC)
    q = [_ids(10 + i, 6) for i in range(5)]
    return dict(a=Prompt(d1 + q[0], DOC), b=Prompt(d2 + q[1], DOC), c=Prompt(d1 + q[2], DOC),
                d=Prompt(d1[:PART] + q[3], PART), e=Prompt(d1 + q[4], DOC))


def test_cp2_ring_trimmed_shards_through_disk_and_a_restart(gemma3, tmp_path):
    llm, _, refs = gemma3
    ranks = run_ranks(_cp2, 2, str(llm.path), str(tmp_path / "kv"))
    lead = ranks[0]
    assert [lead[k] for k in "abcde"] == [(refs["a"], 0), (refs["b"], 0), (refs["c"], DOC), (refs["d"], 0),
                                          (refs["e"], DOC)]
    assert lead["disk_bytes0"] == lead["disk_bytes1"]  # counted after the restart as before it
    for run in (0, 1):
        (mine0, every, serves_from, trimmed), = lead[f"held{run}"]
        (mine1, every1, serves_from1, trimmed1), = ranks[1][f"held{run}"]
        assert every == every1 == lead["disk_bytes0"] == [mine0, mine1], run
        assert serves_from == serves_from1 == DOC and trimmed and trimmed1, run
