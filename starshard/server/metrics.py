"""Prometheus metrics of one app.

Each app gets its own CollectorRegistry (not the process-global one), so several apps (tests, or
two models in one process) do not collide. The backend's numbers are read from backend.stats() at
scrape time; the server's own (requests, TTFT) are counted as requests pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

log = logging.getLogger("starshard.server")

# Prefill of a long document can take minutes, so the buckets reach far.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320, 640)

# stats() key -> (metric name, help, kind)
_ENGINE_METRICS = {
    "queue_depth": ("starshard_queue_depth", "Requests waiting in the scheduler queue", "gauge"),
    "running": ("starshard_running_requests", "Requests in the running batch", "gauge"),
    "cache_bytes": ("starshard_context_cache_bytes", "Bytes held by the context cache", "gauge"),
    "cache_budget_bytes": ("starshard_context_cache_budget_bytes", "Byte budget of the context cache", "gauge"),
    "cache_hits": ("starshard_context_cache_hits", "Context cache lookups that hit", "counter"),
    "cache_lookups": ("starshard_context_cache_lookups", "Context cache lookups", "counter"),
    "prefill_tokens_total": ("starshard_prefill_tokens", "Prompt tokens prefilled", "counter"),
    "decode_tokens_total": ("starshard_decode_tokens", "Tokens decoded", "counter"),
    "cached_tokens_total": ("starshard_cached_prompt_tokens", "Prompt tokens served from the context cache", "counter"),
    "prefill_chunks_total": ("starshard_prefill_chunks", "Prefill steps run (a document's chunks, a whole prompt's one)",
                             "counter"),
    "prefilling_tokens_left": ("starshard_prefilling_tokens_left",
                               "Prompt tokens of the document being prefilled that are still to run", "gauge"),
    "cancelled_total": ("starshard_cancelled_requests", "Requests cancelled (client gone or stop string)", "counter"),
    "timeouts_total": ("starshard_request_timeouts", "Requests ended by --request-timeout", "counter"),
    "reload_failures_total": ("starshard_context_cache_reload_failures",
                              "Promotions that failed on some rank (a missing or damaged file): prefilled instead",
                              "counter"),
    "split_reloads_total": ("starshard_context_cache_split_reloads",
                            "Disk hits served from both ends: the head prefilled while the tail was read "
                            "(--disk-reload-policy split)", "counter"),
    "decode_graphs_kept": ("starshard_decode_graphs_kept",
                           "Decode CUDA graphs kept across batches on one document (0: off, e.g. turned off by the "
                           "warm-up's check)", "gauge"),
    "tail_failures_total": ("starshard_context_cache_tail_failures",
                            "Split reloads whose tail could not be read on some rank: the rest was computed",
                            "counter"),
}

# stats()["tiers"][tier] key -> (metric name, help, kind), labelled by tier (device, host, disk)
_TIER_METRICS = {
    "bytes": ("starshard_context_cache_tier_bytes", "Bytes the tier holds (rank 0's shards)", "gauge"),
    "entries": ("starshard_context_cache_tier_entries", "Entries the tier holds", "gauge"),
    "lookups": ("starshard_context_cache_tier_lookups", "Lookups the tier answered", "counter"),
    "hits": ("starshard_context_cache_tier_hits", "Lookups that found a prefix in the tier", "counter"),
    "demotions": ("starshard_context_cache_tier_demotions", "Entries moved into the tier from the tier above",
                  "counter"),
    "promotions": ("starshard_context_cache_tier_promotions", "Entries reloaded from the tier to the device",
                   "counter"),
    "evictions": ("starshard_context_cache_tier_evictions", "Entries dropped by the tier to stay within its budget",
                  "counter"),
    "rejected": ("starshard_context_cache_tier_rejected", "Files skipped as damaged, foreign or unreadable", "counter"),
    "unpinned_fallbacks": ("starshard_context_cache_tier_unpinned_fallbacks",
                           "Shard buffers the pinned host arena had no room for (fragmentation): pageable, "
                           "copied synchronously", "counter"),
    "writes_in_flight": ("starshard_context_cache_tier_writes_in_flight",
                         "Files being written (or queued) on rank 0's writer thread, not yet committed", "gauge"),
    "write_bytes": ("starshard_context_cache_tier_write_bytes", "Bytes of files written and committed (rank 0)",
                    "counter"),
    "write_seconds_sum": ("starshard_context_cache_tier_write_seconds",
                          "Seconds rank 0's writer thread spent writing committed files (off the step loop)",
                          "counter"),
    "write_failures": ("starshard_context_cache_tier_write_failures",
                       "Writes given up: an I/O error on rank 0 (the entry stayed where it was)", "counter"),
    "skipped_slower_than_prefill": ("starshard_context_cache_tier_skipped_slower_than_prefill",
                                    "Prompts prefilled although the tier held their prefix: its reload was "
                                    "expected to take longer than the prefill (--disk-reload-policy auto)", "counter"),
}


class _BackendCollector:
    """Turns one backend.stats() snapshot into metrics at each scrape."""

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def collect(self):
        try:
            stats = self._stats()
            up = 1
        except Exception as e:  # noqa: BLE001 (a scrape must not fail because the backend is down)
            log.warning("backend.stats() failed: %s", e)
            stats, up = {}, 0
        up_metric = GaugeMetricFamily("starshard_engine_up", "1 when engine.stats() answered")
        up_metric.add_metric([], up)
        yield up_metric
        for key, (name, doc, kind) in _ENGINE_METRICS.items():
            if key in stats:
                family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                yield family(name, doc, value=float(stats[key]))
        yield from _tier_metrics(stats.get("tiers") or {})
        errors = stats.get("errors_by_code")
        if errors is not None:  # requests the engine ended with an error (each failed alone)
            family = CounterMetricFamily("starshard_request_errors", "Requests that failed, by error code", labels=["code"])
            for code, n in sorted(errors.items()):
                family.add_metric([code], float(n))
            yield family
        # The ratio since start; for a windowed rate use rate(hits) / rate(lookups).
        hits, lookups = stats.get("cache_hits"), stats.get("cache_lookups")
        if hits is not None and lookups is not None:
            yield GaugeMetricFamily(
                "starshard_context_cache_hit_rate",
                "Context cache hits / lookups since start (0 before any lookup)",
                value=float(hits) / lookups if lookups else 0.0,
            )

    def describe(self):
        return []  # unknown until the first scrape; keeps registration from calling stats()


def _tier_metrics(tiers: dict):
    """One family per tier statistic, labelled by tier, and the reload seconds as a histogram."""
    for key, (name, doc, kind) in _TIER_METRICS.items():
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["tier"])
        found = False
        for tier, st in tiers.items():
            if key in st:
                family.add_metric([tier], float(st[key]))
                found = True
        if found:
            yield family
    reloads = HistogramMetricFamily("starshard_context_cache_reload_seconds",
                                    "Seconds to bring an entry back to the device from a lower tier", labels=["tier"])
    found = False
    for tier, st in tiers.items():
        if "reload_seconds_buckets" in st:
            reloads.add_metric([tier], [(b, float(n)) for b, n in st["reload_seconds_buckets"].items()],
                               float(st["reload_seconds_sum"]))
            found = True
    if found:
        yield reloads


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "starshard_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "starshard_time_to_first_token_seconds",
            "From the request's arrival to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_BackendCollector(stats))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
