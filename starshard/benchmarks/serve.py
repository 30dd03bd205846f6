"""The long-document service's scheduler in this process (no HTTP): time to first token for a question on
a new document (prefill) and on a cached one (a follow-up), then aggregate decode tokens/s with N
concurrent questions on one cached document.

    python launch/bench.py serve --random-weights llama-3.1-8b --lengths 32768,131072 --concurrency 1,4,16
"""
from __future__ import annotations

import json
import statistics
import sys
import threading
import time

import numpy as np
import torch

from starshard.benchmarks.common import commit, device_name, ints, today, write
from starshard.config import ParallelConfig, SamplingConfig
from starshard.llm import LLM
from starshard.serving.scheduler import Scheduler

HELP = "the service's scheduler: cached vs uncached time to first token, concurrent decode"


def add_arguments(p) -> None:
    p.add_argument("--random-weights", default=None, help="preset name (llama-3.1-8b, tiny); default: --model")
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2 when no --random-weights)")
    p.add_argument("--lengths", type=ints, default=[32768, 131072], help="document + question lengths in tokens")
    p.add_argument("--question-tokens", type=int, default=64, help="tokens of each question after the document")
    p.add_argument("--concurrency", type=ints, default=[1, 4, 16], help="concurrent questions on one document")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens each concurrent question generates")
    p.add_argument("--cache-gib", type=float, default=40.0, help="context cache budget")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds any one request may take")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run the batched decode steps eagerly")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="compute dtype on CUDA (CPU runs float32)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--out", default=None, help="write the JSON here (also printed)")


def run(args) -> None:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype if device.type == "cuda" else "float32")
    llm = LLM(args.model, dtype=dtype, device=str(device), random_weights=args.random_weights, progress=False,
              parallel=ParallelConfig())
    budget = int(args.cache_gib * 2**30)
    svc = Scheduler(llm, cache_bytes=budget, max_batch=max(args.concurrency), max_queue=4 * max(args.concurrency),
                    max_extend=args.question_tokens + 8, cuda_graphs=not args.no_cuda_graphs)
    svc.start()
    vocab = llm.config.vocab_size
    rng = np.random.default_rng(0)

    def tokens(n):  # random ids (random weights have no tokenizer; real weights: still a valid prompt)
        return [int(x) for x in rng.integers(100, vocab - 100, n)]

    def ask(ids, max_tokens):
        """Submit; -> (done event, record with arrival, first-token and per-token times)."""
        rec = {"t0": time.perf_counter(), "times": [], "ids": [], "finish": None, "cached": 0}
        done = threading.Event()

        def on_event(ev):
            if ev.token_id is not None:
                rec["times"].append(time.perf_counter())
                rec["ids"].append(ev.token_id)
            if ev.finish_reason is not None:
                rec["finish"], rec["cached"] = ev.finish_reason, ev.cached_tokens
                done.set()

        svc.submit(svc.text_prompt(ids), max_tokens=max_tokens, sampling=SamplingConfig(), on_event=on_event)
        return done, rec

    def wait(done):
        if not done.wait(args.timeout):
            raise SystemExit(f"error: a request did not finish within --timeout {args.timeout} s")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # Warm-up on a short document: kernel compilation (Triton JIT, cuBLAS heuristics) stays out of
    # the timed first-token latencies.
    warm = tokens(1024)
    for n in [1, 1] + [max(args.concurrency)]:
        for d, _ in [ask(warm + tokens(args.question_tokens), 2) for _ in range(n)]:
            wait(d)
    rows = []
    for L in args.lengths:
        doc = tokens(L - args.question_tokens)
        first = ask(doc + tokens(args.question_tokens), 2)  # a new document: prefill
        wait(first[0])
        follow = ask(doc + tokens(args.question_tokens), 2)  # another question on it: cached
        wait(follow[0])
        ttft = lambda r: r["times"][0] - r["t0"]  # noqa: E731
        row = {"length": L, "ttft_uncached_s": ttft(first[1]), "ttft_cached_s": ttft(follow[1]),
               "cached_tokens": follow[1]["cached"], "concurrency": []}
        row["cached_over_uncached"] = row["ttft_cached_s"] / row["ttft_uncached_s"]
        for n in args.concurrency:
            sync()
            reqs = [ask(doc + tokens(args.question_tokens), args.decode_tokens) for _ in range(n)]
            for d, _ in reqs:
                wait(d)
            recs = [r for _, r in reqs]
            # Steady state: from the moment every request has its first token to the last token.
            start = max(r["times"][0] for r in recs)
            end = max(r["times"][-1] for r in recs)
            decoded = sum(sum(1 for t in r["times"] if t > start) for r in recs)
            steps = [b - a for r in recs for a, b in zip(r["times"], r["times"][1:]) if a >= start]
            row["concurrency"].append({"questions": n, "decode_tokens_per_second": decoded / (end - start),
                                       "step_seconds_median": statistics.median(steps) if steps else None,
                                       "all_cached": all(r["cached"] > 0 for r in recs),
                                       "tokens": [r["ids"] for r in recs]})
        one = row["concurrency"][0]["decode_tokens_per_second"]
        for c in row["concurrency"]:
            c["speedup_vs_first"] = c["decode_tokens_per_second"] / one
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    stats = svc.stats()
    svc.shutdown()
    result = {"kind": "serve", "device": device_name(device), "gpus": 1, "date": today(),
              "commit": commit(), "args": vars(args), "inputs": "random token ids" + (
                  f", random weights {args.random_weights}" if args.random_weights else f", weights {args.model or 'SmolLM2'}"),
              "results": rows, "engine_stats": stats}
    write(args.out, result)
