"""The long-document service under load, in two scenarios.

--scenario document (default): the scheduler in this process (no HTTP): time to first token for a
question on a new document (prefill) and on a cached one (a follow-up), then aggregate decode tokens/s
with N concurrent questions on one cached document.

    python launch/bench.py serve --random-weights llama-3.1-8b --lengths 32768,131072 --concurrency 1,4,16

With --tiers host,disk (and serve's --host-cache-gib / --disk-cache-dir / --disk-cache-gib) it then
pushes each document's cache entry down to each tier (Scheduler.demote, the move an eviction makes)
and times a new question on it (issue 37): demote_<tier>_s (a disk move: until its files are committed on
every rank) with demote_<tier>_longest_step_s (the longest step meanwhile: a write runs off the step
loop, so only the device -> host copy stalls the streams) and demote_<tier>_blocked_steps (that step took
>= 1 s, scheduler.SLOW_STEP_S), ttft_host_s, and ttft_disk_cold_s with the entry's files
dropped from the page cache (posix_fadvise DONTNEED; rank 0 drops every rank's files of the node),
beside the disk's read rate over those same files (the best of 1, 4 and 8 parallel sequential readers
per file; each count's rate in disk.readers_gbps) and disk_bound_s = their bytes / that rate.
--disk-read-throttle F (benchmark-only) then paces the disk tier's reads to F x that rate, a slower disk's
stand-in (disk_bound_throttled_s). --reuse-only, a later run on the same --disk-cache-dir and --seed, asks only questions on the
documents the earlier run left there (the restart check: cached_tokens >= the document's tokens).
Graceful shutdown writes the entries not on disk yet down to it (--shutdown-write-s; 0: only entries
already on disk outlive a run).

    python launch/bench.py serve --random-weights llama-3.1-8b --lengths 131072 --concurrency 1 \
        --cache-gib 24 --host-cache-gib 20 --disk-cache-dir /tmp/kv --disk-cache-gib 20 --tiers host,disk
    python launch/bench.py serve --random-weights llama-3.1-8b --lengths 131072 --concurrency 1 \
        --cache-gib 24 --disk-cache-dir /tmp/kv --disk-cache-gib 20 --reuse-only

--scenario load: a serving load in the conventions of vLLM's serving benchmark (its flag and result
names where it has one): --num-prompts requests arriving at --request-rate (Poisson, gamma gaps with
--burstiness) or all at once, at most --max-concurrency in flight, mixing new documents (--num-docs,
lengths from --doc-len-dist) with follow-up questions on documents already sent; some cancelled
mid-stream. Reports TTFT / TPOT / ITL / E2EL (mean, median, std, percentiles), throughputs, cache hits,
errors and a cross-check of the client's counts against the server's. Two modes:

    # in process, any tp x cp layout (rank 0 runs the scheduler and the load, the other ranks its steps)
    torchrun --nproc-per-node 4 launch/bench.py serve --scenario load --cp 4 --cp-strategy star \
        --random-weights llama-3.1-8b --cache-gib 40 --num-prompts 300 --max-concurrency 8 --num-docs 4 \
        --doc-len-dist fixed:131072 --out load.json
    # client of a running server (no model here): its /v1/completions and /metrics
    python launch/bench.py serve --scenario load --url http://127.0.0.1:8000 --num-prompts 300 ...

Prompts are random token ids from --token-range (random weights have no tokenizer).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from starshard.benchmarks import serve_client, serve_tiers
from starshard.benchmarks.common import commit, device_name, ints, save_json, today, write
from starshard.benchmarks.serve_load import (METRICS, RequestRecord, RequestSpec, arrival_offsets, calculate_metrics,
                                             crosscheck_http, crosscheck_stats, detailed, make_workload,
                                             parse_len_dist, parse_token_range, print_summary, run_load,
                                             tier_deltas)
from starshard.cli import add_fp8_arguments, add_layout_arguments, fp8_config, layout_error, parallel_config
from starshard.config import SamplingConfig
from starshard.llm import LLM
from starshard.parallel.topology import read_launch_env
from starshard.runtime.prompt import Prompt
from starshard.serving.cache_key import token_digest
from starshard.serving.disk_read import DEFAULT_READERS
from starshard.serving.reload_policy import POLICIES
from starshard.serving.scheduler import SLOW_STEP_S, QueueFull, Scheduler, ServiceUnavailable, default_prefill_chunk
from starshard.serving.step_clock import StepClock, idle_summary, idle_while, step_timeline
from starshard.serving.tiers import SHUTDOWN_WRITE_S, TierConfig

HELP = "the service: cached vs uncached time to first token (document), or a vLLM-style serving load (load)"


def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",")]


def add_arguments(p) -> None:
    p.add_argument("--scenario", choices=["document", "load"], default="document",
                   help="document: prefill vs cached time to first token and concurrent decode on one document; "
                   "load: a serving load with vLLM's metrics (see the load flags)")
    p.add_argument("--random-weights", default=None, help="preset name (llama-3.1-8b, tiny); default: --model")
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2 when no --random-weights)")
    p.add_argument("--lengths", type=ints, default=[32768, 131072], help="document + question lengths in tokens")
    p.add_argument("--question-tokens", type=int, default=64,
                   help="tokens of each question after the document (document scenario: the prompt's query part, "
                   "as the chat API splits a document and its question)")
    p.add_argument("--concurrency", type=ints, default=[1, 4, 16], help="concurrent questions on one document")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens each concurrent question generates")
    p.add_argument("--cache-gib", type=float, default=40.0, help="context cache budget")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds any one request may take")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run the batched decode steps eagerly")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="compute dtype on CUDA (CPU runs float32)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--out", default=None, help="write the JSON here (also printed)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="prompt tokens one prefill step processes, over the whole prompt (0 = whole; default: serve's, "
                   "4096 x cp on CUDA, the whole prompt on CPU)")
    p.add_argument("--prefill-taper", action=argparse.BooleanOptionalAction, default=True,
                   help="later chunks shrink as the prefix before them grows (serve's --prefill-taper; default: on)")
    p.add_argument("--prefill-knee", type=int, default=None, metavar="TOKENS",
                   help="the taper's knee in held tokens: full chunks up to it, then chunk x 2 knee / (knee + prefix) "
                   "(default: the model's FLOP knee x cp, as serve)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="serve's start-up warm-up (serving/warmup.py: every prefill step shape of the longest admitted "
                   "document and decode batch sizes 1..max batch, on one layer of each kind) before the first request; "
                   "its seconds go into the JSON (warmup_s; by phase in warmup_phases_s: prefill, batches, "
                   "decode_graphs). Default: on with CUDA, off on CPU")
    p.add_argument("--warmup-tokens", type=int, default=None, metavar="TOKENS",
                   help="the longest document the warm-up prefills (default: the longest the window and --cache-gib "
                   "admit; a lower value leaves longer documents' later steps cold)")
    tiers = p.add_argument_group("context cache tiers (serve's flags, per rank; document scenario: --tiers, "
                                 "--reuse-only)")
    tiers.add_argument("--host-cache-gib", type=float, default=0.0, metavar="GiB",
                       help="pinned host memory for entries the device budget evicts (serve's flag); 0: off")
    tiers.add_argument("--disk-cache-dir", default=None, metavar="DIR",
                       help="the disk tier's directory (serve's flag; needs --disk-cache-gib); its files outlive the "
                       "run, so a later --reuse-only run on it finds the documents")
    tiers.add_argument("--shutdown-write-s", type=float, default=SHUTDOWN_WRITE_S, metavar="SECONDS",
                       help="at the end of the run, seconds to write the entries not on disk yet down to it (serve's "
                       "flag: its graceful shutdown's write-down); 0: none (default: %(default)g)")
    tiers.add_argument("--disk-cache-gib", type=float, default=None, metavar="GiB",
                       help="the disk tier's budget per rank (serve's flag)")
    tiers.add_argument("--tiers", type=tier_list, default=[], metavar="host,disk",
                       help="document scenario: after each length's uncached / cached / concurrent measurements, push "
                       "the document's cache entry down to each of these tiers in turn (Scheduler.demote, as an "
                       "eviction would) and time a new question on it: ttft_host_s (promoted from pinned host "
                       "memory) and ttft_disk_cold_s (its files dropped from the page cache first, with the disk's "
                       "read rate over the same files (the best of 1, 4 and 8 parallel sequential readers) and disk_bound_s = their bytes / that rate), each "
                       "over ttft_uncached_s; the tiers' budgets must hold the longest document's shard")
    tiers.add_argument("--disk-readers", type=int, default=DEFAULT_READERS, metavar="N",
                       help="threads reading one disk cache file in parallel (serve's flag; 1: one sequential reader; "
                       "default: %(default)s). disk_bound_s is the best of 1, 4 and 8 readers whatever this is")
    tiers.add_argument("--disk-read-throttle", type=float, default=None, metavar="F",
                       help="BENCHMARK-ONLY (serve has no such flag): after measuring the disk's read rate over a "
                       "document's files, pace the disk tier's reads (sleeps) to F x that rate before its question "
                       "(--tiers disk, or --reuse-only: measured first there too), e.g. 0.25 for a disk 4x slower "
                       "than this one; reports disk_read_limit_gbps and disk_bound_throttled_s. Over several ranks "
                       "only rank 0's reads are paced, to its share of F x the rate (a promotion waits for every "
                       "rank). Default: unpaced")
    tiers.add_argument("--disk-reload-policy", choices=POLICIES, default="always",
                       help="serve's flag: always (this benchmark's default: each tier's reload is measured, slower "
                       "than a prefill or not), auto (reload where expected faster than a prefill) or split (a disk "
                       "hit's head prefilled while its tail is read; serving/reload_policy.py). The rates a run "
                       "measures stay in --disk-cache-dir for the next (a --reuse-only run starts planned)")
    tiers.add_argument("--page-cache", choices=("cold", "warm"), default="cold",
                       help="--reuse-only: the documents' files dropped from the page cache before the question "
                       "(cold, default: as after a reboot) or read through once first (warm: as right after the "
                       "server that wrote them, a fast disk's stand-in); reports page_cache and the warm read rate")
    tiers.add_argument("--reuse-only", action="store_true",
                       help="document scenario, the restart check: only ask one new question on each --lengths "
                       "document that an earlier run with the same --seed made on this --disk-cache-dir (its files "
                       "read cold); reports cached_tokens per length (>= the document's tokens: reused)")
    add_layout_arguments(p)
    add_fp8_arguments(p)
    load = p.add_argument_group("load scenario (names as vLLM's serving benchmark where it has one)")
    load.add_argument("--url", default=None,
                      help="client mode: the base URL of a running server (http://HOST:PORT); no model is loaded here")
    load.add_argument("--api-key", default=None, help="client mode: sent as 'Authorization: Bearer KEY'")
    load.add_argument("--num-prompts", type=int, default=300, help="requests to send")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests per second (arrivals with gamma-distributed gaps of mean 1/rate); inf sends all "
                      "at once, so that --max-concurrency alone sets the load")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="shape of the gamma gaps: 1 is a Poisson process, below 1 burstier, above 1 steadier")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="most requests in flight at once (default: no limit)")
    load.add_argument("--seed", type=int, default=0,
                      help="seed of the documents, questions, kinds and arrivals (document scenario too: each "
                      "length's document is drawn from (seed, length) alone, so --reuse-only finds it again)")
    load.add_argument("--num-docs", type=int, default=4,
                      help="distinct documents; a request opens a new one with probability 1 - --follow-up-ratio "
                      "until this many are open")
    load.add_argument("--doc-len-dist", default="fixed:4096",
                      help="document lengths in tokens: fixed:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA, or list:N1,N2,.. "
                      "(the i-th new document gets N_(i mod count)); clipped so that document + question + output fit "
                      "the model window")
    load.add_argument("--follow-up-ratio", type=float, default=0.75,
                      help="share of requests that ask about a document already sent (the server's cache can serve "
                      "its tokens); the rest open new documents")
    load.add_argument("--question-len", type=int, default=64, help="tokens of each question after its document")
    load.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    load.add_argument("--ignore-eos", action="store_true",
                      help="run every answer to --output-len past end-of-sequence tokens (vLLM's ignore_eos: client "
                      "mode sends it in the body; answers that still stop early are counted in early_stops)")
    load.add_argument("--cancel-ratio", type=float, default=0.0, help="share of requests the client cancels mid-stream")
    load.add_argument("--cancel-after", type=int, default=8, help="tokens a cancelled request receives first")
    load.add_argument("--request-timeout", type=float, default=600.0,
                      help="seconds a request may take; one without its end by then counts as lost")
    load.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                      help="metrics reported with percentiles: ttft, tpot, itl, e2el")
    load.add_argument("--metric-percentiles", type=floats, default=[50.0, 90.0, 99.0],
                      help="percentiles of those metrics, comma separated")
    load.add_argument("--save-detailed", action="store_true",
                      help="also keep the per-request lists (input / output lengths, TTFTs, ITLs, errors) in the JSON")
    load.add_argument("--num-warmups", type=int, default=1,
                      help="short requests sent (one at a time) before the load, so compilation stays out of it")
    load.add_argument("--token-range", default="100:500", metavar="LO:HI",
                      help="prompt token ids are drawn from [LO, HI) (below any model's vocabulary size)")
    load.add_argument("--max-batch", type=int, default=16, help="in process: requests decoding together")
    load.add_argument("--max-queue", type=int, default=64,
                      help="in process: requests waiting beyond the batch (more are refused, as 429)")
    load.add_argument("--max-extend", type=int, default=4096,
                      help="in process: a prompt that shares a cached prefix runs only the rest when the rest is at "
                      "most this many tokens (serve's flag)")


def tier_list(s: str) -> list[str]:
    """--tiers: a comma-separated subset of host,disk (argparse type)."""
    out = [t for t in s.split(",") if t]
    bad = [t for t in out if t not in ("host", "disk")]
    if bad or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"--tiers takes host and/or disk once each (e.g. host,disk), got {s!r}")
    return out


def tier_error(args) -> str | None:
    """What is wrong with the tier flags (None: nothing)."""
    try:
        TierConfig.from_gib(args.host_cache_gib, args.disk_cache_dir, args.disk_cache_gib,
                            shutdown_write_s=args.shutdown_write_s, disk_readers=args.disk_readers)
    except ValueError as e:
        return str(e)
    if (args.tiers or args.reuse_only) and args.scenario != "document":
        return "--tiers and --reuse-only belong to --scenario document"
    if "host" in args.tiers and not args.host_cache_gib:
        return "--tiers host needs --host-cache-gib > 0 (the host tier's budget per rank)"
    if ("disk" in args.tiers or args.reuse_only) and args.disk_cache_dir is None:
        return f"{'--reuse-only' if args.reuse_only else '--tiers disk'} needs --disk-cache-dir and --disk-cache-gib"
    if args.reuse_only and args.tiers:
        return "--reuse-only only asks questions on documents already on disk: drop --tiers"
    if args.page_cache == "warm" and not args.reuse_only:
        return "--page-cache warm belongs to --reuse-only (--tiers disk always reads cold)"
    if args.page_cache == "warm" and args.disk_read_throttle is not None:
        return "--page-cache warm and --disk-read-throttle: pick one (a throttle paces a cold read)"
    if args.disk_read_throttle is not None:
        if not args.disk_read_throttle > 0:
            return f"--disk-read-throttle must be > 0 (a fraction of the measured read rate), got {args.disk_read_throttle}"
        if "disk" not in args.tiers and not args.reuse_only:
            return "--disk-read-throttle paces disk reloads: it needs --tiers disk or --reuse-only"
    return None


def check(args) -> str | None:
    """What is wrong with the flags (None: nothing), before any model loads."""
    if args.warmup_tokens is not None and args.warmup_tokens < 2:
        return f"--warmup-tokens must be >= 2 tokens, got {args.warmup_tokens}"
    if args.scenario == "document":
        return "--url needs --scenario load" if args.url else tier_error(args) or layout_error(args)
    if args.url and (args.model or args.random_weights):
        return "--url benchmarks a running server: drop --model / --random-weights"
    if args.url and read_launch_env().world_size > 1:
        return "--url is a client of a running server: run it as one process, not under torchrun"
    try:
        parse_len_dist(args.doc_len_dist)
        parse_token_range(args.token_range)
        arrival_offsets(1, args.request_rate, args.burstiness)
    except ValueError as e:
        return str(e)
    unknown = set(args.percentile_metrics.split(",")) - set(METRICS)
    if unknown:
        return f"--percentile-metrics: unknown {sorted(unknown)}; choose from {','.join(METRICS)}"
    if args.max_concurrency is not None and args.max_concurrency < 1:
        return f"--max-concurrency must be >= 1, got {args.max_concurrency}"
    if args.request_timeout <= 0 or args.num_warmups < 0:
        return "--request-timeout must be > 0 and --num-warmups >= 0"
    return tier_error(args) or (None if args.url else layout_error(args))


def run(args) -> None:
    if args.scenario == "load":
        return run_load_scenario(args)
    llm, svc, device = start_scheduler(args, max_batch=max(args.concurrency), max_queue=4 * max(args.concurrency),
                                       max_extend=args.question_tokens + 8)
    if svc is None:
        return
    vocab = llm.config.vocab_size
    # The warm-up's and the questions' tokens; a --reuse-only run asks other questions than the run it reuses.
    rng = np.random.default_rng([args.seed, int(args.reuse_only)])

    def tokens(n, gen=rng):  # random ids (random weights have no tokenizer; real weights: still a valid prompt)
        return [int(x) for x in gen.integers(100, vocab - 100, n)]

    def document(L):  # its own stream: the same tokens for the same --seed, whatever ran before (--reuse-only)
        return tokens(L - args.question_tokens, np.random.default_rng([args.seed, L]))

    def ask(doc, max_tokens):
        """Submit a new question on `doc`, split into context and query as the chat API splits a document
        and its question (Star / APB run the question as their query; a window-trimmed entry serves the
        prompts that share its whole context); -> (done event, record with arrival, first-token and
        per-token times)."""
        ids = doc + tokens(args.question_tokens)
        rec = {"t0": time.perf_counter(), "times": [], "ids": [], "finish": None, "cached": 0}
        done = threading.Event()

        def on_event(ev):
            if ev.token_id is not None:
                rec["times"].append(time.perf_counter())
                rec["ids"].append(ev.token_id)
            if ev.finish_reason is not None:
                rec["finish"], rec["cached"] = ev.finish_reason, ev.cached_tokens
                done.set()

        svc.submit(Prompt(ids, len(doc)), max_tokens=max_tokens, sampling=SamplingConfig(), on_event=on_event)
        return done, rec

    def wait(done):
        if not done.wait(args.timeout):
            raise SystemExit(f"error: a request did not finish within --timeout {args.timeout} s")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def question(doc):  # -> (time to first token, cached tokens) of a new question on `doc`
        done, rec = ask(doc, 2)
        wait(done)
        return rec["times"][0] - rec["t0"], rec["cached"]

    try:
        check_tier_room(args, svc)
        if not args.reuse_only:
            check_uncached(svc, {L: document(L) for L in args.lengths})
    except ValueError as e:
        svc.shutdown()
        raise SystemExit(f"error: {e}") from None

    clock = svc.executor.clock = StepClock(device)  # each step's device time and the idle time between steps

    def measure(L) -> dict:
        """Prefill vs cached first token, concurrent decode, then each of --tiers."""
        doc = document(L)
        clock.drain()
        first = ask(doc, 2)  # a new document: prefill
        wait(first[0])
        prefill_steps = idle_summary(clock.drain(), "P")
        follow = ask(doc, 2)  # another question on it: cached
        wait(follow[0])
        ttft = lambda r: r["times"][0] - r["t0"]  # noqa: E731
        row = {"length": L, "document_tokens": len(doc), "document_digest": token_digest(doc),
               "ttft_uncached_s": ttft(first[1]), "ttft_cached_s": ttft(follow[1]),
               "cached_tokens": follow[1]["cached"], "prefill_steps": prefill_steps, "concurrency": []}
        row["cached_over_uncached"] = row["ttft_cached_s"] / row["ttft_uncached_s"]
        for n in args.concurrency:
            sync()
            clock.drain()
            reqs = [ask(doc, args.decode_tokens) for _ in range(n)]
            for d, _ in reqs:
                wait(d)
            marked = clock.drain()
            decode_steps = idle_summary([st for st in marked if st.kind == "D"], "D")  # the batch of all n
            recs = [r for _, r in reqs]
            # Steady state: from the moment every request has its first token to the last token.
            start = max(r["times"][0] for r in recs)
            end = max(r["times"][-1] for r in recs)
            decoded = sum(sum(1 for t in r["times"] if t > start) for r in recs)
            steps = [b - a for r in recs for a, b in zip(r["times"], r["times"][1:]) if a >= start]
            busy = decode_steps["busy_s_median"]
            row["concurrency"].append({"questions": n, "decode_tokens_per_second": decoded / (end - start),
                                       "step_seconds_median": statistics.median(steps) if steps else None,
                                       # the device's time per decode step: tokens/s over n / that is the host's share
                                       "decode_steps": decode_steps,
                                       "tokens_per_second_over_device_bound": (decoded / (end - start)) / (n / busy)
                                       if busy else None,
                                       "all_cached": all(r["cached"] > 0 for r in recs),
                                       "steady_s": end - start,
                                       # every step of the run in order: where time outside the batched step goes
                                       "timeline": step_timeline(marked),
                                       # the device idle from the first decode step to the last, also around the
                                       # joins and leaves between them (decode_steps counts decode after decode)
                                       "idle_while_decoding_s": idle_while(marked, "D"),
                                       "tokens": [r["ids"] for r in recs]})
        one = row["concurrency"][0]["decode_tokens_per_second"]
        for c in row["concurrency"]:
            c["speedup_vs_first"] = c["decode_tokens_per_second"] / one
        for tier in args.tiers:
            row.update(tier_follow_up(svc, tier, doc, question, row["ttft_uncached_s"], args.disk_read_throttle))
        if args.tiers:
            row["targets"] = tier_targets(row)
            row["tier_stats"] = svc.stats()["tiers"]
        print(json.dumps(row), file=sys.stderr, flush=True)
        return row

    # Warm-up on a short document: kernel compilation (Triton JIT, cuBLAS heuristics) stays out of
    # the timed first-token latencies.
    warm = tokens(1024)
    for n in [1, 1] + [max(args.concurrency)]:
        for d, _ in [ask(warm, 2) for _ in range(n)]:
            wait(d)
    measure_one = (lambda L: reuse_row(svc, L, document(L), question, args.disk_read_throttle,
                                       args.page_cache == "warm")) if args.reuse_only \
        else measure
    try:
        rows = [measure_one(L) for L in args.lengths]
        stats = svc.stats()
    except ValueError as e:  # a demotion refused
        raise SystemExit(f"error: {e}") from None
    finally:
        svc.shutdown()  # the other ranks leave their step loop, also on an error
    result = {"kind": "serve", "device": device_name(device), "gpus": world(), "date": today(),
              "commit": commit(), "args": json_args(args), "inputs": "random token ids" + (
                  f", random weights {args.random_weights}" if args.random_weights else f", weights {args.model or 'SmolLM2'}"),
              "fp8": llm.fp8.describe(), "prefill_chunk": svc.prefill_chunk, "prefill_knee": svc.prefill_knee,
              "warmup_s": svc.warmup_s, "warmup_phases_s": svc.warmup_phases_s,
              "results": rows,
              "engine_stats": stats}
    write(args.out, result)


# ---------------------------------------------------------------------------- document scenario: the tiers
TIER_TARGETS = {"host": 0.10, "disk_cold": 0.35, "disk_cold_over_bound": 1.3}  # issue 37


def check_tier_room(args, svc) -> None:
    """Refuse (ValueError, before the first prefill) a --tiers run whose longest document's shard does not
    fit a tier it is pushed to; log the budgets and the shard."""
    if not args.tiers:
        return
    L = max(args.lengths)
    shard = max(svc.entry_rank_bytes(L, L))
    gib = 2**30
    for tier in args.tiers:
        budget = svc.tiers.host.budget if tier == "host" else svc.tiers.disk.budget
        if shard > budget:
            flag = "--host-cache-gib" if tier == "host" else "--disk-cache-gib"
            raise ValueError(f"--tiers {tier}: the {L}-token document's shard is {shard / gib:.2f} GiB per rank, more "
                             f"than the {tier} tier's {budget / gib:.2f} GiB: raise {flag}")
    print(f"tiers: the {L}-token document's shard {shard / gib:.2f} GiB per rank; device budget "
          f"{svc.cache.budget / gib:.2f} GiB, host {args.host_cache_gib:g} GiB, disk {args.disk_cache_gib or 0:g} GiB "
          f"per rank; each document is pushed to {', '.join(args.tiers)} by Scheduler.demote", file=sys.stderr)


UNCACHED_SHARED_TOKENS = 256  # a prefix this long (or half the document) is an earlier run's, never chance


def check_uncached(svc, docs: dict[int, list[int]]) -> None:
    """Refuse (ValueError, before the first prefill) documents the disk tier already holds (an earlier run's
    files with the same --seed): their first question would reuse them, and ttft_uncached_s time no prefill."""
    disk = svc.tiers.disk if svc.tiers is not None else None
    if disk is None:
        return
    held = {L: disk.peek(doc, min_tokens=min(UNCACHED_SHARED_TOKENS, len(doc) // 2))[1] for L, doc in docs.items()}
    held = {L: n for L, n in held.items() if n}
    if held:
        what = ", ".join(f"{n} tokens of the {L}-token document" for L, n in held.items())
        raise ValueError(f"--disk-cache-dir {disk.path} already holds {what} (an earlier run with this --seed): the "
                         "first question would reuse them, not prefill; use an empty directory or another --seed, or "
                         "--reuse-only to time the reuse")


def tier_follow_up(svc, tier: str, doc: list[int], question, uncached: float, throttle: float | None = None) -> dict:
    """Push `doc`'s entry down to `tier` (Scheduler.demote), then time a new question on it: promoted
    back from the host tier, or read cold from the disk tier (its files dropped from the page cache,
    after the disk's read rate was measured on them; `throttle`: its reads paced to that fraction of it)."""
    svc.longest_step_s = 0.0
    t0 = time.perf_counter()
    shard = svc.demote(doc, tier)  # returns once the move is complete (a disk write: committed on every rank)
    name = "host" if tier == "host" else "disk_cold"
    # The move's step stalls every stream for the device -> host copy; a disk write runs on each rank's writer
    # thread meanwhile, steps going on: the longest step during the move says whether the loop was blocked.
    out = {"shard_bytes_per_rank": shard, f"demote_{tier}_s": time.perf_counter() - t0,
           f"demote_{tier}_longest_step_s": svc.longest_step_s,
           f"demote_{tier}_blocked_steps": svc.longest_step_s >= SLOW_STEP_S}
    if tier == "disk":
        disk = serve_tiers.read_rate(serve_tiers.entry_files(svc.tiers.disk, doc, world()))
        out["disk"] = disk
        out["disk_bound_s"] = disk["bytes"] / (disk["disk_read_gbps"] * 1e9)
        if not disk["drop_took"]:
            print(f"warning: reading {disk['where']['dir']} cold was not slower than from the page cache "
                  f"({disk['disk_read_gbps']:.2f} vs {disk['page_cache_read_gbps']:.2f} GB/s): the drop may not have "
                  "taken, or the files are on tmpfs", file=sys.stderr)
        if throttle is not None:
            out |= serve_tiers.throttle(svc.tiers.disk, disk, throttle)
    try:
        ttft, cached = question(doc)
    finally:
        if svc.tiers.disk is not None:
            svc.tiers.disk.read_limit = None
    out |= {f"ttft_{name}_s": ttft, f"{name}_over_uncached": ttft / uncached, f"{name}_cached_tokens": cached}
    if tier == "disk":
        out["disk_cold_over_bound"] = ttft / out["disk_bound_s"]
    if cached < len(doc):
        print(f"warning: the follow-up on the {tier} tier reused {cached} of the document's {len(doc)} tokens",
              file=sys.stderr)
    return out


def tier_targets(row: dict) -> dict:
    """Issue 37's targets, each True / False for the tiers measured."""
    out = {}
    if "ttft_host_s" in row:
        out["host_within_10pct_of_prefill"] = (row["host_over_uncached"] <= TIER_TARGETS["host"]
                                               and row["host_cached_tokens"] >= row["document_tokens"])
    if "ttft_disk_cold_s" in row:
        out["disk_within_35pct_of_prefill_or_1.3x_read"] = (
            (row["disk_cold_over_uncached"] <= TIER_TARGETS["disk_cold"]
             or row["disk_cold_over_bound"] <= TIER_TARGETS["disk_cold_over_bound"])
            and row["disk_cold_cached_tokens"] >= row["document_tokens"])
    return out


def reuse_row(svc, L: int, doc: list[int], question, throttle: float | None = None, warm: bool = False) -> dict:
    """--reuse-only: a question on a document an earlier run on this --disk-cache-dir (same --seed) made,
    its files dropped from the page cache first (a cold read, as after a reboot), or read through once first
    (`warm`); `throttle`: the disk's read rate measured on them first, the reads paced to that fraction of it."""
    row = {"length": L, "document_tokens": len(doc), "document_digest": token_digest(doc),
           "page_cache": "warm" if warm else "cold"}
    files = []
    try:
        files = serve_tiers.entry_files(svc.tiers.disk, doc, world(), timeout=0)
        serve_tiers.drop_cached(files)
        if warm and files:
            serve_tiers.read_all(files)  # into the page cache
            nbytes, seconds = serve_tiers.read_all(files, DEFAULT_READERS)
            row["page_cache_read_gbps"] = nbytes / seconds / 1e9 if seconds > 0 else None
    except ValueError:
        pass
    row["files"] = [str(p) for p in files]
    if throttle is not None and files:
        row["disk"] = serve_tiers.read_rate(files)  # leaves them dropped
        row |= serve_tiers.throttle(svc.tiers.disk, row["disk"], throttle)
    splits = svc.counters["split_reloads_total"]
    try:
        ttft, cached = question(doc)
    finally:
        svc.tiers.disk.read_limit = None
    # --disk-reload-policy split: the head was computed, cached_tokens counts the tokens read from the file
    split = svc.counters["split_reloads_total"] > splits
    row |= {"ttft_reuse_s": ttft, "cached_tokens": cached, "split": split,
            "reused": cached >= len(doc) or (split and cached > 0)}
    if not row["reused"]:
        print(f"warning: --reuse-only: the {L}-token document reused {cached} of its {len(doc)} tokens (no file of "
              "it in --disk-cache-dir from a run with this --seed and --lengths?)", file=sys.stderr)
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


# ---------------------------------------------------------------------------- both scenarios
def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def json_args(args) -> dict:
    """vars(args) with inf as the string "inf" (JSON has no infinity)."""
    return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()}


def start_scheduler(args, **limits):
    """The model over the layout flags and its scheduler. -> (llm, scheduler, device) on rank 0, with the
    scheduler's thread started; every other rank executes the broadcast steps until rank 0 shuts the
    scheduler down, then gets (llm, None, device)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype if device.type == "cuda" else "float32")
    try:
        parallel = parallel_config(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    llm = LLM(args.model, dtype=dtype, device=str(device), random_weights=args.random_weights, progress=False,
              parallel=parallel, fp8=fp8_config(args))
    options = dict(cache_bytes=int(args.cache_gib * 2**30), cuda_graphs=not args.no_cuda_graphs,
                   tiers=TierConfig.from_gib(args.host_cache_gib, args.disk_cache_dir, args.disk_cache_gib,
                                             disk_reload=args.disk_reload_policy,
                                             shutdown_write_s=args.shutdown_write_s,
                                             disk_readers=args.disk_readers), **limits)
    chunk = args.prefill_chunk if args.prefill_chunk is not None else default_prefill_chunk(llm.device, parallel.cp)
    options.update(prefill_chunk=chunk, prefill_taper=args.prefill_taper, prefill_knee_tokens=args.prefill_knee,
                   warmup=args.warmup, warmup_tokens=args.warmup_tokens)
    try:
        svc = Scheduler(llm, **options)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if dist.is_initialized() and dist.get_rank() != 0:
        svc.serve_forever()
        return llm, None, llm.device
    svc.start()
    return llm, svc, llm.device


# ---------------------------------------------------------------------------- the load scenario
class InProcessBackend:
    """serve_load.run_load's sender over the scheduler in this process: its token events, stamped in
    the scheduler's thread as they are emitted; a cancel through the ticket; failures as the HTTP
    server would answer them (429 queue full, 503 engine down or an error before the first token, 400
    refused)."""

    def __init__(self, svc: Scheduler, request_timeout: float, ignore_eos: bool = False):
        self.svc, self.timeout, self.ignore_eos = svc, request_timeout, ignore_eos

    async def send(self, spec: RequestSpec, rec: RequestRecord) -> None:
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def on_event(ev):  # the scheduler's thread
            loop.call_soon_threadsafe(events.put_nowait, (time.perf_counter(), ev))

        rec.start = time.perf_counter()
        try:
            ticket = self.svc.submit(self.svc.text_prompt(spec.prompt), max_tokens=spec.max_tokens,
                                     sampling=SamplingConfig(ignore_eos=self.ignore_eos), on_event=on_event)
        except (QueueFull, ServiceUnavailable, ValueError) as e:
            status = 429 if isinstance(e, QueueFull) else 503 if isinstance(e, ServiceUnavailable) else 400
            rec.failure, rec.error, rec.end = str(status), str(e), time.perf_counter()
            return
        deadline = rec.start + self.timeout
        while True:
            try:
                t, ev = await asyncio.wait_for(events.get(), max(deadline - time.perf_counter(), 0.0))
            except asyncio.TimeoutError:
                ticket.cancel()
                rec.error = f"no terminal event within --request-timeout {self.timeout:g} s"
                return
            if ev.token_id is not None:
                rec.token_times.append(t)
                rec.output_tokens += 1
            rec.completion_tokens, rec.cached_tokens, rec.prompt_tokens = (ev.completion_tokens, ev.cached_tokens,
                                                                           ev.prompt_tokens)
            if ev.finish_reason is not None:
                rec.end = t
                if ev.finish_reason in ("stop", "length"):
                    rec.finish_reason = ev.finish_reason
                elif not (ev.finish_reason == "cancelled" and rec.client_cancelled):
                    rec.failure = "stream" if rec.token_times else "503"  # as the HTTP server answers it
                    code = getattr(ev, "error_code", None)
                    rec.error = (f"{code}: " if code else "") + (ev.error or f"the engine ended the request "
                                                                             f"({ev.finish_reason})")
                return
            if spec.cancel_after and rec.output_tokens >= spec.cancel_after and not rec.client_cancelled:
                rec.client_cancelled = True
                ticket.cancel()  # then wait for its "cancelled" event: the counts stay exact


def settled_stats(svc: Scheduler, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = svc.stats()
        if (st["running"] == 0 and st["queue_depth"] == 0) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def workload_of(args, window: int) -> list[RequestSpec]:
    return make_workload(num_prompts=args.num_prompts, num_docs=args.num_docs,
                         doc_len=parse_len_dist(args.doc_len_dist), follow_up_ratio=args.follow_up_ratio,
                         question_len=args.question_len, output_len=args.output_len, cancel_ratio=args.cancel_ratio,
                         cancel_after=args.cancel_after, token_range=parse_token_range(args.token_range),
                         window=window, seed=args.seed)


def warmups(args, window: int) -> list[RequestSpec]:
    """Short requests on a document of their own (1024 tokens, or what the window leaves): kernel
    compilation and autotuning stay out of the timed load."""
    rng = np.random.default_rng(args.seed + 7)
    lo, hi = parse_token_range(args.token_range)
    n = max(1, min(1024, window - args.question_len - 2))
    doc = rng.integers(lo, hi, n).tolist()
    return [RequestSpec(-1, "new_doc", -1, doc + rng.integers(lo, hi, args.question_len).tolist(), 2, None)
            for _ in range(args.num_warmups)]


def run_load_scenario(args) -> None:
    if args.url:
        return run_http(args)
    llm, svc, device = start_scheduler(args, max_batch=args.max_batch, max_queue=args.max_queue,
                                       max_extend=args.max_extend)
    if svc is None:
        return
    try:
        lo, hi = parse_token_range(args.token_range)
        if hi > llm.config.vocab_size:
            raise SystemExit(f"error: --token-range {args.token_range} reaches past the vocabulary "
                             f"({llm.config.vocab_size} tokens): lower HI")
        backend = InProcessBackend(svc, args.request_timeout, args.ignore_eos)

        async def go():
            await drive_warmups_only(args, backend, svc.max_model_len)
            before = svc.stats()
            records, duration, specs = await load_only(args, backend, svc.max_model_len)
            return before, records, duration, specs

        before, records, duration, specs = asyncio.run(go())
        after = settled_stats(svc)
    finally:
        svc.shutdown()
    p = llm.parallel
    result = header(args, "in-process", device_name(device), world())
    result.update(layout={"tp": p.tp, "cp": p.cp, "strategy": p.cp_strategy},
                  prefill_chunk=svc.prefill_chunk, prefill_knee=svc.prefill_knee, warmup_s=svc.warmup_s,
                  warmup_phases_s=svc.warmup_phases_s,
                  cache_budget_bytes=after["cache_budget_bytes"])
    finish(args, result, records, duration, specs, before, after, crosscheck_stats(records, before, after))


async def drive_warmups_only(args, backend, window: int) -> None:
    for spec in warmups(args, window):
        rec = RequestRecord(spec.index, spec.kind, len(spec.prompt))
        await backend.send(spec, rec)
        if rec.outcome != "completed":
            raise SystemExit(f"error: the warm-up request failed: {rec.failure or 'lost'}: {rec.error}")


async def load_only(args, backend, window: int) -> tuple[list[RequestRecord], float, list[RequestSpec]]:
    specs = workload_of(args, window)
    offsets = arrival_offsets(len(specs), args.request_rate, args.burstiness, args.seed)
    records, duration = await run_load(specs, backend.send, offsets=offsets, max_concurrency=args.max_concurrency)
    return records, duration, specs


def run_http(args) -> None:
    try:
        serve_client.require_httpx()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None

    async def go():
        backend = serve_client.HttpBackend(args.url, api_key=args.api_key, request_timeout=args.request_timeout,
                                           max_connections=args.max_concurrency, ignore_eos=args.ignore_eos)
        try:
            _, window = await backend.model_info()
            await drive_warmups_only(args, backend, window)
            before = await backend.settle()
            records, duration, specs = await load_only(args, backend, window)
            after = await backend.settle()
        finally:
            await backend.aclose()
        return before, after, records, duration, specs

    try:
        before, after, records, duration, specs = asyncio.run(go())
    except (ValueError, serve_client.httpx.HTTPError) as e:
        raise SystemExit(f"error: {args.url}: {e}") from None
    result = header(args, "http", None, None)
    result.update(server=args.url, layout=None, prefill_chunk=args.prefill_chunk,
                  cache_budget_bytes=after.get("starshard_context_cache_budget_bytes"))
    finish(args, result, records, duration, specs, before, after, crosscheck_http(records, before, after))


def header(args, mode: str, device, gpus) -> dict:
    return {"kind": "serve", "scenario": "load", "mode": mode, "device": device, "gpus": gpus, "date": today(),
            "commit": commit(), "args": json_args(args)}


def finish(args, result, records, duration, specs, before, after, crosscheck) -> None:
    """The result's load fields, metrics and cross-check; the summary table to stdout, the JSON to --out
    (else to stdout too)."""
    percentiles, metrics = args.metric_percentiles, args.percentile_metrics.split(",")
    result.update(request_rate="inf" if math.isinf(args.request_rate) else args.request_rate,
                  burstiness=args.burstiness, max_concurrency=args.max_concurrency, num_prompts=args.num_prompts,
                  workload={"num_docs": args.num_docs, "doc_len_dist": str(parse_len_dist(args.doc_len_dist)),
                            "follow_up_ratio": args.follow_up_ratio, "question_len": args.question_len,
                            "output_len": args.output_len, "cancel_ratio": args.cancel_ratio,
                            "cancel_after": args.cancel_after,
                            "docs_sent": sum(s.kind == "new_doc" for s in specs)})
    result.update(calculate_metrics(records, duration, metrics=metrics, percentiles=percentiles))
    # Answers that ended at EOS before --output-len (with --ignore-eos the server did not honour it).
    result["early_stops"] = sum(r.outcome == "completed" and r.output_len < s.max_tokens
                                for r, s in zip(records, specs))
    result["server_metrics"] = {"before": before, "after": after}
    result["hits_by_tier"] = tier_deltas(before, after)
    result["crosscheck"] = crosscheck
    if args.save_detailed:
        result["detailed"] = detailed(records)
    print_summary(result, metrics, percentiles)
    if args.ignore_eos and result["early_stops"]:
        print(f"warning: {result['early_stops']} answers stopped at EOS before --output-len although --ignore-eos "
              "was given", file=sys.stderr)
    if args.out:
        save_json(args.out, result)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(json.dumps(result, indent=1))
