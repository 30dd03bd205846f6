"""The serving load benchmark (benchmarks/serve_load.py, serve_client.py, serve.py --scenario load):
vLLM's metric definitions on synthetic timestamps, the arrival process and the workload, then whole
runs: over HTTP against a real server (a tiny random model behind the real scheduler and app), and
in process."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from starshard.benchmarks.serve_load import (RequestRecord, arrival_offsets, calculate_metrics, crosscheck_http,
                                             make_workload, parse_len_dist, parse_prometheus, tier_deltas)
from starshard.commands.bench import main
from starshard.config import ParallelConfig
from starshard.llm import LLM
from starshard.server import ServerSettings, create_app, make_server
from starshard.serving.scheduler import Scheduler


def record(index, kind, start, times, end, *, finish="length", cached=0, prompt_len=10, **kw):
    r = RequestRecord(index, kind, prompt_len, start=start, token_times=list(times), output_tokens=len(times),
                      end=end, finish_reason=finish, completion_tokens=len(times), cached_tokens=cached,
                      prompt_tokens=prompt_len, http_status=200)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_metrics_follow_vllm_definitions_and_names():
    recs = [record(0, "new_doc", 0.0, [1.0, 1.5, 2.5], 2.5, prompt_len=100),
            record(1, "follow_up", 1.0, [1.2, 1.4], 1.4, cached=90, prompt_len=110),
            record(2, "follow_up", 2.0, [2.1], 2.1, cached=0),  # one token: no TPOT
            record(3, "follow_up", 2.0, [2.3, 2.4], 2.4, client_cancelled=True, finish=None),
            record(4, "new_doc", 2.0, [], 2.0, finish=None, failure="503", error="out of memory", http_status=503),
            record(5, "new_doc", 2.0, [2.2], None, finish=None, error="timeout")]
    m = calculate_metrics(recs, duration=4.0, percentiles=[50, 90, 99.5])
    assert (m["completed"], m["failed"], m["cancelled"], m["lost"]) == (3, 1, 1, 1)
    assert m["total_input_tokens"] == 100 + 110 + 10 and m["total_output_tokens"] == 3 + 2 + 1
    assert m["cached_input_tokens"] == 90
    assert m["request_throughput"] == pytest.approx(3 / 4) and m["output_throughput"] == pytest.approx(6 / 4)
    assert m["total_token_throughput"] == pytest.approx((220 + 6) / 4)
    ttft = np.array([1.0, 0.2, 0.1]) * 1000
    tpot = np.array([(2.5 - 1.0) / 2, (0.4 - 0.2) / 1]) * 1000
    itl = np.array([0.5, 1.0, 0.2]) * 1000
    e2el = np.array([2.5, 0.4, 0.1]) * 1000
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        assert m[f"mean_{name}_ms"] == pytest.approx(xs.mean())
        assert m[f"median_{name}_ms"] == pytest.approx(np.median(xs))
        assert m[f"std_{name}_ms"] == pytest.approx(xs.std())
        assert m[f"p50_{name}_ms"] == pytest.approx(np.percentile(xs, 50))
        assert m[f"p90_{name}_ms"] == pytest.approx(np.percentile(xs, 90))
        assert m[f"p99.5_{name}_ms"] == pytest.approx(np.percentile(xs, 99.5))
    assert m["by_kind"]["new_doc"]["count"] == 3 and m["by_kind"]["new_doc"]["completed"] == 1
    assert m["by_kind"]["follow_up"]["p50_ttft_ms"] == pytest.approx(150.0)
    assert m["by_kind"]["new_doc"]["p50_itl_ms"] == pytest.approx(750.0)
    assert m["max_itl_ms"] == pytest.approx(1000.0)
    # request 0's gap 1.5 -> 2.5 s spans request 5's prefill (sent 2.0, first token 2.2); no other gap
    # meets another new document's prefill
    stall = m["itl_during_new_doc_prefill"]
    assert stall["count"] == 1
    assert stall["max_itl_ms"] == stall["p50_itl_ms"] == pytest.approx(1000.0)
    assert m["cache_hit_rate"] == pytest.approx(1 / 3)  # follow-ups 1 (hit), 2 (miss), 3 (cancelled, miss)
    assert m["errors"] == {"503": 1} and m["error_examples"] == ["503: out of memory"]
    assert "timeout" in m["lost_examples"][0]
    with pytest.raises(ValueError, match="--percentile-metrics"):
        calculate_metrics(recs, 1.0, metrics=["ttft", "latency"])
    empty = calculate_metrics([], 1.0)
    assert empty["completed"] == 0 and empty["p99_itl_ms"] is None


def test_poisson_gaps_have_mean_one_over_rate():
    n, rate = 20000, 4.0
    for burstiness in (1.0, 0.5):
        off = np.array(arrival_offsets(n, rate, burstiness, seed=3))
        gaps = np.diff(off)
        assert off[0] == 0 and (gaps >= 0).all()
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
        # gamma(shape k): the coefficient of variation is 1/sqrt(k); burstier below 1
        assert gaps.std() / gaps.mean() == pytest.approx(burstiness ** -0.5, rel=0.05)
    assert arrival_offsets(5, float("inf")) == [0.0] * 5
    with pytest.raises(ValueError, match="--request-rate"):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError, match="--burstiness"):
        arrival_offsets(3, 1.0, 0.0)


def test_workload_is_reproducible_and_mixes_documents():
    kw = dict(num_prompts=200, num_docs=5, doc_len=parse_len_dist("uniform:50:80"), follow_up_ratio=0.6,
              question_len=7, output_len=9, cancel_ratio=0.25, cancel_after=3, token_range=(10, 60), window=100)
    a, b, c = make_workload(**kw, seed=1), make_workload(**kw, seed=1), make_workload(**kw, seed=2)
    assert a == b and a != c
    assert [s.kind for s in a].count("new_doc") == 5 and a[0].kind == "new_doc"
    docs = {}
    for s in a:
        assert all(10 <= t < 60 for t in s.prompt) and s.max_tokens == 9
        if s.kind == "new_doc":
            assert s.doc not in docs
            docs[s.doc] = s.prompt[:-7]
            assert 50 <= len(docs[s.doc]) <= 100 - 7 - 9  # clipped to the window
        else:
            assert s.prompt[:-7] == docs[s.doc]  # a follow-up repeats its document's tokens
    assert 0.1 < sum(s.cancel_after == 3 for s in a) / 200 < 0.4
    assert all(s.cancel_after is None for s in a if s.cancel_after != 3)
    assert str(parse_len_dist("lognormal:1000:0.5")) == "lognormal:1000:0.5"
    assert parse_len_dist("fixed:7").sample(np.random.default_rng(0)) == 7
    assert str(parse_len_dist("list:30,90")) == "list:30,90"
    listed = make_workload(**{**kw, "doc_len": parse_len_dist("list:30,90,40"), "window": 1000}, seed=1)
    assert [len(s.prompt) - 7 for s in listed if s.kind == "new_doc"] == [30, 90, 40, 30, 90]
    for bad in ("fixed", "uniform:9:3", "normal:4:1", "fixed:x", "list:", "list:3,0"):
        with pytest.raises(ValueError, match="--doc-len-dist"):
            parse_len_dist(bad)
    with pytest.raises(ValueError, match="window"):
        make_workload(**{**kw, "window": 16})


def test_prometheus_parse_and_crosscheck_catches_a_mismatch():
    text = ('# HELP x\nstarshard_requests_total{endpoint="/v1/completions",status="200"} 2.0\n'
            'starshard_prefill_tokens_total 30.0\nstarshard_running_requests 0.0\n')
    parsed = parse_prometheus(text)
    assert parsed['starshard_requests_total{endpoint="/v1/completions",status="200"}'] == 2.0
    recs = [record(0, "new_doc", 0.0, [1.0, 2.0], 2.0, prompt_len=20), record(1, "new_doc", 0.0, [1.0], 1.0)]
    after = {**parsed, "starshard_cached_prompt_tokens_total": 0.0, "starshard_decode_tokens_total": 1.0,
             "starshard_time_to_first_token_seconds_count": 2.0, "starshard_queue_depth": 0.0}
    cc = crosscheck_http(recs, {}, after)
    assert cc["ok"], cc
    cc = crosscheck_http(recs, {}, {**after, "starshard_prefill_tokens_total": 29.0})
    assert not cc["ok"] and [c["name"] for c in cc["checks"] if not c["ok"]] == ["prefill_tokens"]


# ---- whole runs on a tiny random model ----

LOAD = ["--scenario", "load", "--num-prompts", "20", "--num-docs", "2", "--doc-len-dist", "uniform:40:70",
        "--follow-up-ratio", "0.7", "--question-len", "6", "--output-len", "6", "--cancel-ratio", "0.1",
        "--cancel-after", "2", "--max-concurrency", "4", "--request-rate", "inf", "--seed", "0",
        "--num-warmups", "0", "--request-timeout", "60"]


@pytest.fixture(scope="module")
def tiny_server():
    torch.manual_seed(0)
    llm = LLM(random_weights="tiny", dtype=torch.float32, device="cpu", progress=False, parallel=ParallelConfig())
    svc = Scheduler(llm, cache_bytes=2**24, max_batch=4, max_queue=64, max_extend=64, model_name="tiny",
                    cuda_graphs=False)
    svc.start()
    settings = ServerSettings(port=0, api_key="k", log_level="warning")
    server = make_server(create_app(svc, settings), settings)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.bound_port}", svc
    server.should_exit = True
    thread.join(5)
    svc.shutdown()


def run_bench(argv, tmp_path, capsys):
    out = tmp_path / "r.json"
    main(["serve", *argv, "--out", str(out), "--save-detailed"])
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "P99 ITL (ms)" in printed
    return json.loads(out.read_text())


def test_http_load_loses_nothing_and_agrees_with_metrics(tiny_server, tmp_path, capsys):
    base, _ = tiny_server
    r = run_bench([*LOAD, "--url", base, "--api-key", "k", "--token-range", "10:500"], tmp_path, capsys)
    assert r["mode"] == "http" and r["scenario"] == "load"
    assert r["lost"] == 0 and r["failed"] == 0, r["lost_examples"]
    assert r["completed"] + r["cancelled"] == 20 and r["cancelled"] >= 1
    assert r["crosscheck"]["ok"], r["crosscheck"]
    assert r["by_kind"]["new_doc"]["count"] == 2 and r["by_kind"]["follow_up"]["count"] == 18
    assert r["cache_hit_rate"] > 0.5 and r["cached_input_tokens"] > 0
    assert r["p99_itl_ms"] is not None and r["mean_tpot_ms"] > 0  # token events stream one by one
    assert len(r["detailed"]["itls"]) == 20
    assert r["server_metrics"]["after"]["starshard_running_requests"] == 0


def test_in_process_load_on_one_cpu_process(tmp_path, capsys):
    r = run_bench([*LOAD, "--random-weights", "tiny", "--device", "cpu", "--cache-gib", "0.02",
                   "--no-cuda-graphs", "--warmup", "--warmup-tokens", "256"], tmp_path, capsys)
    assert r["mode"] == "in-process" and r["layout"] == {"tp": 1, "cp": 1, "strategy": "dense"}
    assert r["warmup_s"] > 0  # serve's start-up warm-up, forced on on CPU: its whole-prompt prefill and batch sizes
    assert sum(r["warmup_phases_s"].values()) == pytest.approx(r["warmup_s"])
    assert r["lost"] == 0 and r["failed"] == 0 and r["completed"] + r["cancelled"] == 20 and r["cancelled"] >= 1
    assert r["crosscheck"]["ok"], r["crosscheck"]
    assert r["cache_budget_bytes"] == int(0.02 * 2**30)
    assert r["total_output_tokens"] == 6 * r["completed"]  # tiny has no EOS: every answer runs to --output-len


def test_hits_by_tier_from_metrics_or_stats():
    before = parse_prometheus('starshard_context_cache_tier_hits_total{tier="host"} 2.0\n'
                              'starshard_context_cache_tier_promotions_total{tier="disk"} 1.0\n')
    after = parse_prometheus('starshard_context_cache_tier_hits_total{tier="host"} 5.0\n'
                             'starshard_context_cache_tier_promotions_total{tier="disk"} 4.0\n'
                             'starshard_context_cache_tier_bytes{tier="host"} 9.0\n')
    assert tier_deltas(before, after) == {"host": {"hits": 3.0}, "disk": {"promotions": 3.0}}
    st0 = {"tiers": {"device": {"hits": 1, "promotions": 0, "demotions": 0}}}
    st1 = {"tiers": {"device": {"hits": 4, "promotions": 0, "demotions": 2}}}
    assert tier_deltas(st0, st1) == {"device": {"hits": 3.0, "promotions": 0.0, "demotions": 2.0}}
    assert tier_deltas({}, {}) == {}
