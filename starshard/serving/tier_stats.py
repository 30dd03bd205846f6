"""Counters of one context cache tier (host memory, disk), ready for Prometheus: the scheduler's
stats() reads `TierStats.as_dict()` and server/metrics.py turns it into gauges, counters and a histogram."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# A reload moves one shard up a tier: from milliseconds (a small document from host memory) to tens of
# seconds (a 1M-token shard read cold from disk).
RELOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class TierStats:
    bytes: int = 0  # held now
    entries: int = 0  # held now
    lookups: int = 0
    hits: int = 0  # lookups that found a prefix
    demotions: int = 0  # entries put into this tier (from the tier above)
    promotions: int = 0  # entries loaded back up from this tier
    evictions: int = 0  # entries dropped to stay within the budget
    rejected: int = 0  # files skipped as damaged or unreadable (disk)
    unpinned_fallbacks: int = 0  # shard buffers the host arena had no room for: pageable instead (host)
    reload_seconds_sum: float = 0.0
    writes_in_flight: int = 0  # files reserved and being written (or queued), not yet listed (disk)
    write_bytes: int = 0  # bytes of files written and listed (disk)
    write_seconds_sum: float = 0.0  # seconds those writes took on their writer thread (disk)
    write_failures: int = 0  # writes given up (an I/O error on this rank; disk)
    # cumulative counts per RELOAD_BUCKETS bound (Prometheus' histogram), the last one +Inf
    reload_buckets: list[int] = field(default_factory=lambda: [0] * (len(RELOAD_BUCKETS) + 1))

    def observe_reload(self, seconds: float) -> None:
        self.promotions += 1
        self.reload_seconds_sum += seconds
        for i in range(bisect.bisect_left(RELOAD_BUCKETS, seconds), len(self.reload_buckets)):
            self.reload_buckets[i] += 1

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("bytes", "entries", "lookups", "hits", "demotions", "promotions",
                                           "evictions", "rejected", "unpinned_fallbacks", "reload_seconds_sum",
                                           "writes_in_flight", "write_bytes", "write_seconds_sum", "write_failures")}
        d["reload_seconds_count"] = self.reload_buckets[-1]
        d["reload_seconds_buckets"] = dict(zip([*map(str, RELOAD_BUCKETS), "+Inf"], self.reload_buckets))
        return d
