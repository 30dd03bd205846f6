"""The serving load benchmark's workload and metrics, in the conventions of vLLM's serving benchmark
(`vllm bench serve`): the same load flags and result keys where vLLM has one. Pure Python (no torch,
no model): the two backends that send the requests are benchmarks/serve_client.py (HTTP) and the
in-process scheduler in benchmarks/serve.py; both fill one RequestRecord per request.

Definitions (vLLM's), over completed requests, in milliseconds:
    TTFT   the request's send -> its first token
    TPOT   (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token
    ITL    the gaps between a request's token events
    E2EL   the request's send -> its last event
A request's send is when it leaves the client: after its arrival time and after a --max-concurrency
slot is free (vLLM's convention: queueing in the client is not the server's latency).

Outcomes: completed (finish reason stop / length), cancelled (the client cancelled it after
--cancel-after tokens, on purpose), failed (an HTTP error, or an error event in the stream), lost (no
terminal event and no HTTP error: a dropped stream or a --request-timeout; must be 0).
"""
from __future__ import annotations

import asyncio
import math
import re
import sys
import time
from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
KINDS = ("new_doc", "follow_up")


# ---------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class LenDist:
    """Document lengths in tokens: fixed:N, uniform:LO:HI (inclusive), lognormal:MEDIAN:SIGMA, or
    list:N1,N2,.. (the i-th new document gets N_(i mod count): e.g. short documents with one long one)."""

    kind: str
    a: float = 0.0
    b: float = 0.0
    values: tuple[int, ...] = ()

    def sample(self, rng: np.random.Generator, index: int = 0) -> int:
        """The length of the index-th new document."""
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "list":
            return self.values[index % len(self.values)]
        if self.kind == "uniform":
            return int(rng.integers(int(self.a), int(self.b) + 1))
        return max(1, int(round(rng.lognormal(math.log(self.a), self.b))))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        if self.kind == "list":
            return "list:" + ",".join(map(str, self.values))
        return f"lognormal:{int(self.a)}:{self.b:g}"


def parse_len_dist(spec: str) -> LenDist:
    """--doc-len-dist: fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA | list:N1,N2,.. (ValueError says
    which form)."""
    forms = "fixed:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA or list:N1,N2,.."
    kind, _, rest = spec.partition(":")
    if kind == "list":
        try:
            values = tuple(int(x) for x in rest.split(","))
        except ValueError:
            values = ()
        if not values or min(values) < 1:
            raise ValueError(f"--doc-len-dist {spec!r}: list needs whole token counts >= 1 ({forms})")
        return LenDist("list", values=values)
    parts = rest.split(":") if rest else []
    try:
        nums = [float(x) for x in parts]
    except ValueError:
        raise ValueError(f"--doc-len-dist {spec!r}: the numbers must be numbers ({forms})") from None
    if kind == "fixed" and len(nums) == 1 and nums[0] >= 1 and nums[0] == int(nums[0]):
        return LenDist("fixed", nums[0])
    if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1] and all(x == int(x) for x in nums):
        return LenDist("uniform", nums[0], nums[1])
    if kind == "lognormal" and len(nums) == 2 and nums[0] >= 1 and nums[1] >= 0:
        return LenDist("lognormal", nums[0], nums[1])
    raise ValueError(f"--doc-len-dist {spec!r} is not one of {forms} (whole token counts >= 1, LO <= HI, SIGMA >= 0)")


def parse_token_range(spec: str) -> tuple[int, int]:
    """--token-range LO:HI -> (LO, HI): prompt token ids are drawn from [LO, HI)."""
    try:
        lo, hi = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--token-range {spec!r} is not LO:HI (two integers)") from None
    if not 0 <= lo < hi:
        raise ValueError(f"--token-range {spec!r}: need 0 <= LO < HI")
    return lo, hi


@dataclass(frozen=True)
class RequestSpec:
    index: int
    kind: str  # "new_doc": the first question on its document; "follow_up": another one on a document sent before
    doc: int
    prompt: list[int]  # the document's tokens, then the question's
    max_tokens: int
    cancel_after: int | None  # the client cancels the request after this many tokens


def make_workload(*, num_prompts: int, num_docs: int, doc_len: LenDist, follow_up_ratio: float, question_len: int,
                  output_len: int, cancel_ratio: float = 0.0, cancel_after: int = 8,
                  token_range: tuple[int, int] = (100, 500), window: int | None = None,
                  seed: int = 0) -> list[RequestSpec]:
    """The requests in send order, reproducible by seed. Each asks a fresh question after a document.
    A request opens a new document with probability 1 - follow_up_ratio while fewer than num_docs have
    been opened (the first always does); otherwise it is a follow-up on a document opened before, chosen
    uniformly, so its prompt begins with that document's tokens (the server's context cache can serve
    them). Documents are clipped so that document + question + output_len fits the window."""
    if num_prompts < 1 or num_docs < 1:
        raise ValueError(f"--num-prompts and --num-docs must be >= 1, got {num_prompts} / {num_docs}")
    if not 0 <= follow_up_ratio <= 1 or not 0 <= cancel_ratio <= 1:
        raise ValueError(f"--follow-up-ratio and --cancel-ratio must be in [0, 1], got {follow_up_ratio} / "
                         f"{cancel_ratio}")
    if question_len < 1 or output_len < 1 or cancel_after < 1:
        raise ValueError(f"--question-len, --output-len and --cancel-after must be >= 1, got {question_len} / "
                         f"{output_len} / {cancel_after}")
    longest = None if window is None else window - question_len - output_len
    if longest is not None and longest < 1:
        raise ValueError(f"--question-len {question_len} + --output-len {output_len} leave no room for a document in "
                         f"the model window of {window} tokens: lower them")
    rng = np.random.default_rng(seed)
    lo, hi = token_range

    def ids(n: int) -> list[int]:
        return rng.integers(lo, hi, n).tolist()

    docs: list[list[int]] = []
    out = []
    for i in range(num_prompts):
        new = not docs or (len(docs) < num_docs and rng.random() >= follow_up_ratio)
        if new:
            n = doc_len.sample(rng, len(docs))
            docs.append(ids(n if longest is None else min(n, longest)))
            d = len(docs) - 1
        else:
            d = int(rng.integers(len(docs)))
        cancel = cancel_after if rng.random() < cancel_ratio else None
        out.append(RequestSpec(i, "new_doc" if new else "follow_up", d, docs[d] + ids(question_len), output_len, cancel))
    return out


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of n requests arrives: all at once for rate inf, else
    gamma-distributed gaps of mean 1/rate (shape = burstiness; 1 is a Poisson process, lower is
    burstier), as vLLM's benchmark draws them. The first request arrives at 0."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    gaps = np.random.default_rng(seed + 1).gamma(burstiness, 1.0 / (rate * burstiness), max(n - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist()


# ---------------------------------------------------------------------------- one request's record
@dataclass
class RequestRecord:
    """What the client saw of one request (times from time.perf_counter)."""

    index: int
    kind: str
    prompt_len: int
    start: float = 0.0  # sent
    token_times: list[float] = field(default_factory=list)  # one per token event (a chunk may carry several)
    output_tokens: int = 0  # tokens counted from the events
    end: float | None = None  # the last event (terminal chunk, or the client's cancel)
    finish_reason: str | None = None
    client_cancelled: bool = False
    failure: str | None = None  # failed: the HTTP status ("429", "503", ...) or "stream" (an error event after 200)
    error: str | None = None  # the message of a failure, or why the request is lost
    http_status: int | None = None
    completion_tokens: int | None = None  # the server's usage, as last reported
    cached_tokens: int | None = None
    prompt_tokens: int | None = None

    @property
    def outcome(self) -> str:
        if self.client_cancelled:
            return "cancelled"
        if self.failure is not None:
            return "failed"
        if self.finish_reason in ("stop", "length"):
            return "completed"
        return "lost"

    @property
    def output_len(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.output_tokens

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def e2el(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


async def run_load(specs: list[RequestSpec], send, *, offsets: list[float], max_concurrency: int | None = None,
                   progress: bool = True) -> tuple[list[RequestRecord], float]:
    """Sends every request at its arrival offset (at most max_concurrency in flight) through
    `await send(spec, record)`, which sets record.start and fills the record. -> (records, seconds from
    the first arrival to the last request's end)."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [RequestRecord(s.index, s.kind, len(s.prompt)) for s in specs]
    done = 0
    t0 = time.perf_counter()
    next_report = [t0 + 10.0]
    step = max(1, len(specs) // 10)

    async def one(spec: RequestSpec, rec: RequestRecord, at: float):
        nonlocal done
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        if sem is None:
            await send(spec, rec)
        else:
            async with sem:
                await send(spec, rec)
        done += 1
        now = time.perf_counter()
        if progress and (done % step == 0 or now >= next_report[0] or done == len(specs)):
            next_report[0] = now + 10.0
            print(f"[bench] {done}/{len(specs)} requests done, {now - t0:.1f} s", file=sys.stderr, flush=True)

    await asyncio.gather(*(one(s, r, at) for s, r, at in zip(specs, records, offsets)))
    return records, time.perf_counter() - t0


# ---------------------------------------------------------------------------- metrics
def pkey(p: float) -> str:
    """vLLM's percentile key word: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def _stats(name: str, xs_s: list[float], percentiles: list[float]) -> dict:
    """mean / median / std / pN of one metric, in ms (None without samples)."""
    xs = np.asarray(xs_s, dtype=np.float64) * 1000.0
    have = xs.size > 0
    out = {f"mean_{name}_ms": float(xs.mean()) if have else None,
           f"median_{name}_ms": float(np.median(xs)) if have else None,
           f"std_{name}_ms": float(xs.std()) if have else None}
    for p in percentiles:
        out[f"p{pkey(p)}_{name}_ms"] = float(np.percentile(xs, p)) if have else None
    return out


def samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """The seconds behind each metric, over completed requests."""
    done = [r for r in records if r.outcome == "completed"]
    return {"ttft": [r.ttft for r in done if r.ttft is not None],
            "tpot": [(r.e2el - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1 and r.ttft is not None],
            "itl": [x for r in done for x in r.itls],
            "e2el": [r.e2el for r in done if r.e2el is not None]}


def calculate_metrics(records: list[RequestRecord], duration: float, *, metrics=METRICS,
                      percentiles=(50.0, 90.0, 99.0)) -> dict:
    """vLLM's result keys (completed, totals, throughputs, mean/median/std/pN of each metric in ms)
    plus ours: failed / cancelled / lost, cached_input_tokens, by_kind, cache_hit_rate, errors."""
    unknown = set(metrics) - set(METRICS)
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}; choose from {','.join(METRICS)}")
    done = [r for r in records if r.outcome == "completed"]
    counts = {k: sum(r.outcome == k for r in records) for k in ("completed", "failed", "cancelled", "lost")}
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_len for r in done)
    out = {"duration": duration, **counts,
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "cached_input_tokens": sum(r.cached_tokens or 0 for r in done),
           "request_throughput": len(done) / duration if duration > 0 else None,
           "output_throughput": total_out / duration if duration > 0 else None,
           "total_token_throughput": (total_in + total_out) / duration if duration > 0 else None}
    s = samples(records)
    for m in metrics:
        out.update(_stats(m, s[m], percentiles))
    out["by_kind"] = {}
    for kind in KINDS:
        mine = [r for r in records if r.kind == kind]
        ks = samples(mine)
        row = {"count": len(mine), **{k: sum(r.outcome == k for r in mine) for k in ("completed", "failed", "cancelled", "lost")}}
        for m in ("ttft", "itl", "e2el"):
            st = _stats(m, ks[m], percentiles)
            row.update({k: v for k, v in st.items() if k.startswith("p")})
        out["by_kind"][kind] = row
    out["max_itl_ms"] = 1000.0 * max(s["itl"]) if s["itl"] else None
    out["itl_during_new_doc_prefill"] = stall_stats(records, percentiles)
    # Follow-ups the server answered from its cache, among those whose usage came back.
    follow = [r for r in records if r.kind == "follow_up" and r.cached_tokens is not None]
    out["cache_hit_rate"] = sum(r.cached_tokens > 0 for r in follow) / len(follow) if follow else None
    errors: dict[str, int] = {}
    for r in records:
        if r.failure is not None:
            errors[r.failure] = errors.get(r.failure, 0) + 1
    out["errors"] = errors
    out["error_examples"] = [f"{r.failure}: {r.error}" for r in records if r.failure is not None][:5]
    out["lost_examples"] = [f"request {r.index}: {r.error or 'the stream ended without a finish reason'}"
                            for r in records if r.outcome == "lost"][:5]
    return out


def stall_stats(records: list[RequestRecord], percentiles=(50.0, 90.0, 99.0)) -> dict:
    """The other streams' inter-token gaps while a new document prefills (from its send to its first
    token): what a prefill costs everyone else, which the all-gaps ITL percentiles dilute (a stall of a
    few streams is a small share of all gaps). `count`: such gaps; percentiles and max in ms."""
    windows = [(r.index, r.start, r.token_times[0]) for r in records if r.kind == "new_doc" and r.token_times]
    gaps = [b - a for r in records for a, b in zip(r.token_times, r.token_times[1:])
            if any(i != r.index and a < end and b > start for i, start, end in windows)]
    st = {k: v for k, v in _stats("itl", gaps, percentiles).items() if k.startswith("p")}
    return {"count": len(gaps), **st, "max_itl_ms": 1000.0 * max(gaps) if gaps else None}


def detailed(records: list[RequestRecord]) -> dict:
    """--save-detailed: per-request lists, in request order (vLLM's names)."""
    return {"input_lens": [r.prompt_len for r in records], "output_lens": [r.output_len for r in records],
            "ttfts": [r.ttft for r in records], "itls": [r.itls for r in records],
            "e2els": [r.e2el for r in records], "kinds": [r.kind for r in records],
            "outcomes": [r.outcome for r in records], "cached_tokens": [r.cached_tokens for r in records],
            "errors": [r.error or "" for r in records]}


# ---------------------------------------------------------------------------- the server's side
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """A Prometheus text exposition -> {'name{labels}': value} (labels as the server wrote them)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


_TIER_SAMPLE = re.compile(r'^starshard_context_cache_tier_(hits|promotions|demotions)_total\{tier="(\w+)"\}$')


def tier_deltas(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """{tier: {hits, promotions, demotions}} over the run, from the server's tier counters: a /metrics
    scrape (parse_prometheus) or Scheduler.stats() (its "tiers"). Empty when the server has no tiers."""
    def counts(snapshot: dict) -> dict[tuple[str, str], float]:
        if "tiers" in snapshot:  # stats()
            return {(t, k): float(st.get(k, 0)) for t, st in (snapshot["tiers"] or {}).items()
                    for k in ("hits", "promotions", "demotions")}
        out = {}
        for name, value in snapshot.items():
            m = _TIER_SAMPLE.match(name)
            if m:
                out[(m.group(2), m.group(1))] = value
        return out
    b, a = counts(before), counts(after)
    deltas: dict[str, dict[str, float]] = {}
    for (tier, key), value in a.items():
        deltas.setdefault(tier, {})[key] = value - b.get((tier, key), 0.0)
    return deltas


def _check(name: str, client, server, ok: bool) -> dict:
    return {"name": name, "client": client, "server": server, "ok": bool(ok)}


def crosscheck_http(records: list[RequestRecord], before: dict, after: dict,
                    endpoint: str = "/v1/completions") -> dict:
    """The client's counts against the /metrics deltas (parse_prometheus snapshots before and after):
    cached and prefilled prompt tokens, decoded tokens, requests by status, TTFT observations, and
    the running / queue gauges back at 0."""
    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    started = [r for r in records if r.token_times]  # a first token reached the client
    checks = []
    if all(r.cached_tokens is not None for r in started):  # usage known for every started request
        cached = sum(r.cached_tokens for r in started)
        checks.append(_check("cached_prompt_tokens", cached, delta("starshard_cached_prompt_tokens_total"),
                             cached == delta("starshard_cached_prompt_tokens_total")))
        prefill = sum(r.prompt_len - r.cached_tokens for r in started)
        checks.append(_check("prefill_tokens", prefill, delta("starshard_prefill_tokens_total"),
                             prefill == delta("starshard_prefill_tokens_total")))
    generated = sum(r.output_len for r in started)
    server = delta("starshard_decode_tokens_total") + len(started)
    # A cancelled stream may decode a few tokens more on the server before the cancel lands.
    exact = all(r.outcome == "completed" for r in started)
    checks.append(_check("generated_tokens (decode + first)", generated, server,
                         server == generated if exact else server >= generated))
    statuses = {}
    for r in records:
        if r.http_status is not None:
            statuses[str(r.http_status)] = statuses.get(str(r.http_status), 0) + 1
    pattern = re.compile(r'^starshard_requests_total\{.*endpoint="' + re.escape(endpoint) + r'".*status="(\d+)"')
    server_status = {}
    for key in set(before) | set(after):
        m = pattern.match(key)
        if m and delta(key):
            server_status[m.group(1)] = int(delta(key))
    checks.append(_check(f"requests by status ({endpoint})", statuses, server_status, statuses == server_status))
    ttft_count = delta("starshard_time_to_first_token_seconds_count")
    checks.append(_check("ttft observations", len(started), ttft_count, len(started) == ttft_count))
    for gauge in ("starshard_running_requests", "starshard_queue_depth"):
        checks.append(_check(f"{gauge} at the end", 0, after.get(gauge), after.get(gauge) == 0))
    return {"ok": all(c["ok"] for c in checks), "checks": checks}


def crosscheck_stats(records: list[RequestRecord], before: dict, after: dict) -> dict:
    """The same cross-check against the in-process scheduler's stats() before and after."""
    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    started = [r for r in records if r.token_times]
    accepted = [r for r in records if r.failure is None or r.failure == "stream"]
    cached = sum(r.cached_tokens or 0 for r in started)
    prefill = sum(r.prompt_len - (r.cached_tokens or 0) for r in started)
    generated = sum(r.output_len for r in started)
    checks = [_check("cached_prompt_tokens", cached, delta("cached_tokens_total"), cached == delta("cached_tokens_total")),
              _check("prefill_tokens", prefill, delta("prefill_tokens_total"), prefill == delta("prefill_tokens_total")),
              _check("generated_tokens (decode + first)", generated, delta("decode_tokens_total") + len(started),
                     generated == delta("decode_tokens_total") + len(started)),
              _check("requests accepted", len(accepted), delta("requests_total"), len(accepted) == delta("requests_total"))]
    for gauge in ("running", "queue_depth"):
        checks.append(_check(f"{gauge} at the end", 0, after.get(gauge), after.get(gauge) == 0))
    return {"ok": all(c["ok"] for c in checks), "checks": checks}


# ---------------------------------------------------------------------------- the summary table
def print_summary(result: dict, metrics=METRICS, percentiles=(50.0, 90.0, 99.0), file=None) -> None:
    """vLLM's summary table, plus our outcome, cache and cross-check lines (to stdout by default)."""
    file = file or sys.stdout
    def line(label, value, fmt="{:<10.2f}"):
        shown = "-" if value is None else (fmt.format(value) if isinstance(value, float) else str(value))
        print(f"{label:<40} {shown}", file=file)

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="), file=file)
    line("Successful requests:", result["completed"])
    line("Failed / cancelled / lost requests:", f"{result['failed']} / {result['cancelled']} / {result['lost']}")
    line("Benchmark duration (s):", result["duration"])
    line("Total input tokens:", result["total_input_tokens"])
    line("Cached input tokens:", result["cached_input_tokens"])
    line("Total generated tokens:", result["total_output_tokens"])
    line("Request throughput (req/s):", result["request_throughput"])
    line("Output token throughput (tok/s):", result["output_throughput"])
    line("Total Token throughput (tok/s):", result["total_token_throughput"])
    line("Follow-up cache hit rate:", result.get("cache_hit_rate"))
    for m in metrics:
        short, header = METRIC_NAMES[m]
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"), file=file)
        line(f"Mean {short} (ms):", result[f"mean_{m}_ms"])
        line(f"Median {short} (ms):", result[f"median_{m}_ms"])
        for p in percentiles:
            line(f"P{pkey(p)} {short} (ms):", result[f"p{pkey(p)}_{m}_ms"])
    for tier, d in (result.get("hits_by_tier") or {}).items():
        line(f"Context cache {tier} hits / promotions:", f"{d.get('hits', 0):g} / {d.get('promotions', 0):g}")
    stall = result.get("itl_during_new_doc_prefill")
    if stall is not None:
        print("{s:{c}^{n}}".format(s="ITL while a new document prefills", n=50, c="-"), file=file)
        line("Gaps:", stall["count"])
        for p in percentiles:
            line(f"P{pkey(p)} ITL (ms):", stall.get(f"p{pkey(p)}_itl_ms"))
        line("Max ITL (ms):", stall["max_itl_ms"])
    if result.get("errors"):
        print("{s:{c}^{n}}".format(s="Errors", n=50, c="-"), file=file)
        for k, n in result["errors"].items():
            line(f"{k}:", n)
    cc = result.get("crosscheck")
    if cc is not None:
        print("{s:{c}^{n}}".format(s="Cross-check with the server", n=50, c="-"), file=file)
        for c in cc["checks"]:
            line(f"{c['name']}:", f"{'ok' if c['ok'] else 'MISMATCH'} (client {c['client']}, server {c['server']})")
    print("=" * 50, file=file, flush=True)
