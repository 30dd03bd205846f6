"""bench serve --tiers host,disk and --reuse-only (issue 37's measurements) end to end on a tiny random
model on CPU: every follow-up on a document pushed to a tier reuses the whole document, the ratios and
the disk's read rate are reported, and a later run on the same --disk-cache-dir and --seed finds the
documents again (another seed finds nothing). Scheduler.demote, which the bench pushes entries with,
moves device -> host -> disk and refuses what it cannot do."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from starshard.commands.bench import main
from starshard.llm import LLM
from starshard.runtime.prompt import Prompt
from starshard.serving.scheduler import Scheduler, ServiceUnavailable
from starshard.serving.tiers import TierConfig
from tests.helpers.mp_harness import run_ranks
from tests.helpers.service import submit

BASE = ["serve", "--random-weights", "tiny", "--device", "cpu", "--no-cuda-graphs", "--lengths", "96,160",
        "--question-tokens", "8", "--concurrency", "1", "--decode-tokens", "3", "--cache-gib", "0.02"]


def bench(tmp_path, name, *argv):
    out = tmp_path / f"{name}.json"
    main([*BASE, *argv, "--out", str(out)])
    return json.loads(out.read_text())


def test_tiers_then_reuse_after_a_restart(tmp_path):
    disk = ["--disk-cache-dir", str(tmp_path / "kv"), "--disk-cache-gib", "0.02"]
    r = bench(tmp_path, "tiers", "--host-cache-gib", "0.01", *disk, "--tiers", "host,disk", "--seed", "3",
              "--disk-readers", "2", "--disk-read-throttle", "0.5")
    assert [row["length"] for row in r["results"]] == [96, 160]
    for i, row in enumerate(r["results"]):
        n = row["document_tokens"]
        assert n == row["length"] - 8
        c = row["concurrency"][0]  # one question of 3 tokens: its extend, then 2 decode steps
        kinds = [k for k, *_ in c["timeline"] if k != "F"]  # the follow-up's finish may land in this run's steps
        assert kinds == ["E", "D"] and c["steady_s"] > 0
        assert sum(k_n[1] for k_n in c["timeline"] if k_n[0] == "D") == c["decode_steps"]["steps"] == 2
        assert c["idle_while_decoding_s"] >= c["decode_steps"]["idle_between_s_sum"] >= 0
        assert row["host_cached_tokens"] >= n and row["disk_cold_cached_tokens"] >= n
        assert row["host_over_uncached"] == pytest.approx(row["ttft_host_s"] / row["ttft_uncached_s"])
        assert row["disk_cold_over_uncached"] == pytest.approx(row["ttft_disk_cold_s"] / row["ttft_uncached_s"])
        d = row["disk"]
        files = [Path(f) for f in d["files"]]
        assert len(files) == 1 and files[0].parent == tmp_path / "kv" and files[0].name.endswith("-r0.kv")
        assert d["file_bytes"] == [files[0].stat().st_size] and d["bytes"] == sum(d["file_bytes"])
        assert d["file_bytes"][0] > row["shard_bytes_per_rank"][0] > 0  # the shard, a header and its token ids
        assert row["disk_bound_s"] == pytest.approx(d["bytes"] / (d["disk_read_gbps"] * 1e9))
        assert set(d["readers_gbps"]) == {"1", "4", "8"}  # the bound: the best of 1, 4 and 8 readers per file
        assert d["disk_read_gbps"] == max(d["readers_gbps"].values()) == d["readers_gbps"][str(d["best_readers"])]
        assert row["disk_read_throttle"] == 0.5  # paced to half the measured rate (one rank: all of it)
        assert row["disk_read_limit_gbps"] == pytest.approx(0.5 * d["disk_read_gbps"])
        assert row["disk_bound_throttled_s"] == pytest.approx(2 * row["disk_bound_s"])
        assert row["disk_cold_over_bound"] == pytest.approx(row["ttft_disk_cold_s"] / row["disk_bound_s"])
        assert d["where"]["mount_point"] is not None and d["where"]["fstype"]
        assert set(row["targets"]) == {"host_within_10pct_of_prefill", "disk_within_35pct_of_prefill_or_1.3x_read"}
        host, on_disk = row["tier_stats"]["host"], row["tier_stats"]["disk"]
        assert host["demotions"] == host["promotions"] == i + 1  # one push and one reload per length
        assert on_disk["demotions"] == on_disk["promotions"] == i + 1
    assert r["engine_stats"]["reload_failures_total"] == 0

    again = bench(tmp_path, "reuse", *disk, "--reuse-only", "--seed", "3", "--disk-read-throttle", "0.25")
    for first, row in zip(r["results"], again["results"]):
        assert row["document_digest"] == first["document_digest"]  # the warm-up's draws do not shift documents
        assert row["reused"] and row["cached_tokens"] >= row["document_tokens"]
        assert row["files"] == first["disk"]["files"] == row["disk"]["files"]  # measured before the paced reload
        assert row["disk_read_limit_gbps"] == pytest.approx(0.25 * row["disk"]["disk_read_gbps"])
    warm = bench(tmp_path, "warm", *disk, "--reuse-only", "--seed", "3", "--page-cache", "warm")
    for row in warm["results"]:  # read through once first: from the page cache
        assert row["reused"] and not row["split"] and row["page_cache"] == "warm" and row["page_cache_read_gbps"] > 0
    other = bench(tmp_path, "other", *disk, "--reuse-only", "--seed", "4")
    assert all(not row["reused"] and row["cached_tokens"] == 0 for row in other["results"])
    with pytest.raises(SystemExit, match="already holds 87 tokens of the 96-token document.*--reuse-only"):
        bench(tmp_path, "again", *disk, "--tiers", "disk", "--seed", "3")  # its first question would be no prefill


@pytest.mark.parametrize("argv, why", [
    (["--tiers", "host"], "--tiers host needs --host-cache-gib"),
    (["--tiers", "disk", "--host-cache-gib", "1"], "--tiers disk needs --disk-cache-dir"),
    (["--reuse-only"], "--reuse-only needs --disk-cache-dir"),
    (["--tiers", "host,tape"], "--tiers takes host and/or disk"),
    (["--disk-read-throttle", "0.5"], "--disk-read-throttle paces disk reloads: it needs --tiers disk"),
    (["--tiers", "disk", "--disk-cache-dir", "kv", "--disk-cache-gib", "1", "--disk-read-throttle", "0"],
     "--disk-read-throttle must be > 0"),
    (["--disk-readers", "0"], "--disk-readers must be an integer from 1"),
    (["--page-cache", "warm"], "--page-cache warm belongs to --reuse-only"),
])
def test_tier_flags_are_checked(argv, why, capsys):
    with pytest.raises(SystemExit):
        main([*BASE, *argv])
    assert why in capsys.readouterr().err


def test_demote_moves_down_and_refuses(tmp_path):
    llm = LLM(random_weights="tiny", progress=False)
    tiers = TierConfig(host_bytes=1 << 22, disk_dir=tmp_path, disk_bytes=1 << 22)
    svc = Scheduler(llm, cache_bytes=1 << 24, tiers=tiers)
    svc.start()
    try:
        ids = [int(x) for x in np.random.default_rng(0).integers(1, 500, 40)]
        events, done = submit(svc, Prompt(ids, len(ids)), 2)
        assert done.wait(60) and events[-1].finish_reason == "length"
        shard = svc.demote(ids, "host")
        tiers = svc.stats()["tiers"]
        assert shard[0] > 0 and tiers["device"]["entries"] == 0 and tiers["host"]["entries"] == 1
        assert svc.demote(ids, "disk") == shard  # from the host tier on
        tiers = svc.stats()["tiers"]
        assert tiers["host"]["entries"] == 0 and tiers["disk"]["entries"] == 1
        with pytest.raises(ValueError, match="no cache entry on the device shares"):
            svc.demote(ids, "host")  # on disk only: never back up by demote
        with pytest.raises(ValueError, match="'host' or 'disk'"):
            svc.demote(ids, "tape")
    finally:
        svc.shutdown()
    with pytest.raises(ServiceUnavailable):
        svc.demote(ids, "disk")
    plain = Scheduler(llm, cache_bytes=1 << 24)
    plain.start()
    try:
        with pytest.raises(ValueError, match="there is no host tier"):
            plain.demote([1, 2, 3], "host")
    finally:
        plain.shutdown()


def _cp2_bench(rank, world, tmp):
    from starshard.commands.bench import SUBCOMMANDS, parse_args  # main() would tear the harness's group down

    disk = ["--disk-cache-dir", f"{tmp}/kv", "--disk-cache-gib", "0.02"]
    layout = ["--cp", str(world), "--cp-strategy", "star", "--lengths", "160"]
    for name, argv in (("tiers", ["--host-cache-gib", "0.01", "--tiers", "host,disk"]), ("reuse", ["--reuse-only"])):
        SUBCOMMANDS["serve"].run(parse_args([*BASE, *layout, *disk, *argv, "--out", f"{tmp}/{name}.json"]))
    return None


def test_cp2_star_each_rank_moves_its_shard(tmp_path):
    run_ranks(_cp2_bench, 2, str(tmp_path))
    r = json.loads((tmp_path / "tiers.json").read_text())
    (row,) = r["results"]
    assert r["gpus"] == 2 and len(row["shard_bytes_per_rank"]) == 2
    assert min(row["host_cached_tokens"], row["disk_cold_cached_tokens"]) >= row["document_tokens"]
    files = [Path(f).name for f in row["disk"]["files"]]
    assert [f[-6:] for f in files] == ["-r0.kv", "-r1.kv"]  # rank 0 reads (and drops) every rank's file
    assert row["disk"]["bytes"] == sum(row["disk"]["file_bytes"])
    (again,) = json.loads((tmp_path / "reuse.json").read_text())["results"]
    assert again["reused"] and again["cached_tokens"] >= again["document_tokens"]
