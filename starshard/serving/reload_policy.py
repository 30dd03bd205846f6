"""Whether a prompt's prefix found in the disk tier is worth reloading (issue 37, --disk-reload-policy).

A cold read of a long document's shards can take longer than prefilling it again: 4 x H200, Llama-3.1-8B
shape, cp=4 Star at 512K prefills in 14.3 s, but the four ranks' reloads share one disk at 1.6 GB/s
aggregate and take 44.2 s. With "auto" rank 0's scheduler promotes from disk only when the reload it
expects takes no longer than `margin` x the prefill it expects, both from what this server measured:

    reload   seconds per byte of its promotions from disk (every rank's shard bytes; the Promote step's
             time on rank 0, which the vote after loading makes the slowest rank's)
    prefill  seconds per FLOP of its document prefills (a whole prefill, or the sum of its chunks; the
             strategy's FLOP model, strategies/flops.py: the slowest rank's FLOPs)

each an exponential moving average. Before a kind is measured the reload is tried (optimistic): the first
reload measures the disk. A skipped entry's file stays: a longer prompt on it, or a faster disk after a
restart, may still use it. The host tier is not asked (its reloads are ~30x faster than a prefill).

"split" (issue 49, Cake-style load and compute at once) serves a disk hit of P tokens from both ends: the
head [0, cut) is prefilled chunk by chunk (the service's prefill_bounds of the entry) while the tail's rows
[cut, P) are read from the file backward (serving/tail_read.py); `plan_cut` picks the chunk bound where
both are expected to finish together, from the same two rates, and the scheduler re-plans after every head
chunk, with the read's own rate once it has read a block (a warm page cache reads ~10x the disk's rate).
Before both rates are measured it decides as "auto" (cut 0: a whole reload; cut P: a prefill). Without
chunks (--prefill-chunk 0) the only bounds are 0 and P: it is "auto".

The two rates outlive the server: rank 0 keeps them in the disk directory (RATES_FILE, one record per
(cache key, device)) after each reload and at shutdown, and a server started on that directory begins with
them, so the first disk hit after a restart is planned, not guessed. A "split" server that finds none probes
at start instead (`probe_read`: a cold read of up to PROBE_BYTES of the largest file; `probe_prefill`: a
GEMM's rate on the device, over PREFILL_OF_GEMM), each then averaged with the real measurements (EMA).
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from starshard.serving.disk_read import read_file

log = logging.getLogger("starshard.serve")
RATES_FILE = "reload-rates.json"

POLICIES = ("auto", "always", "split")
EMA_WEIGHT = 0.5  # the newest measurement's weight: a disk's rate drifts (page cache, other readers)
PROBE_BYTES = 256 << 20  # the start-up read probe: past a disk's caches, a fraction of a second
# A long prefill's FLOPs run at about this share of the GEMM rate (attention is slower: Llama-3.1-8B at 134,827
# tokens on an H100, 0.72); a prior until the first prefill is measured.
PREFILL_OF_GEMM = 0.7


@dataclass
class Rate:
    """Seconds per unit (byte, FLOP), an exponential moving average; None before any measurement."""

    per_unit: float | None = None

    def observe(self, seconds: float, units: float) -> None:
        if units <= 0 or not seconds >= 0:  # nothing moved or computed, or a bad clock: no information
            return
        rate = seconds / units
        self.per_unit = rate if self.per_unit is None else EMA_WEIGHT * rate + (1 - EMA_WEIGHT) * self.per_unit

    def estimate(self, units: float | None) -> float | None:
        return None if self.per_unit is None or units is None else self.per_unit * units


def reload_pays(reload_s: float | None, prefill_s: float | None, margin: float = 1.0) -> bool:
    """Reload unless it is expected to take longer than `margin` x the prefill (either unknown: reload)."""
    return reload_s is None or prefill_s is None or reload_s <= margin * prefill_s


def plan_cut(cuts: list[int], compute_s: list[float], read_s: list[float]) -> int:
    """The cut among `cuts` (ascending chunk bounds: the head computed so far first, P last) that minimizes
    max(compute_s[k], read_s[k]): seconds to compute the head up to cuts[k] and to read the tail from
    cuts[k] on, both from now. Ties: the less total work, then the earlier cut (less compute)."""
    if not cuts or not len(cuts) == len(compute_s) == len(read_s):
        raise ValueError(f"plan_cut needs one compute and one read estimate per cut, got {len(cuts)} cuts, "
                         f"{len(compute_s)} and {len(read_s)} estimates")
    best = min(range(len(cuts)), key=lambda k: (max(compute_s[k], read_s[k]), compute_s[k] + read_s[k], cuts[k]))
    return cuts[best]


@dataclass(frozen=True)
class Verdict:
    promote: bool
    reload_s: float | None  # the estimates it compared (None: not measured yet)
    prefill_s: float | None


class DiskReloadPolicy:
    """Rank 0's estimates and decisions. mode "always": every disk hit is promoted (the measurements are
    still kept); "split": a hit is split between a computed head and a read tail (split); margin: reload
    while the expected reload <= margin x the expected prefill."""

    def __init__(self, mode: str = "auto", margin: float = 1.0):
        if mode not in POLICIES:
            raise ValueError(f"--disk-reload-policy must be one of {', '.join(POLICIES)}, got {mode!r}")
        if not margin > 0:
            raise ValueError(f"the disk reload margin must be > 0, got {margin}")
        self.mode, self.margin = mode, margin
        self.reload = Rate()  # seconds per byte over every rank's shards
        self.prefill = Rate()  # seconds per FLOP of the slowest rank
        self.skipped = 0  # requests prefilled although the disk tier held their prefix

    def observe_reload(self, seconds: float, nbytes: int) -> None:
        self.reload.observe(seconds, nbytes)

    def observe_prefill(self, seconds: float, flops: float) -> None:
        self.prefill.observe(seconds, flops)

    def decide(self, nbytes: int, flops: float | None) -> Verdict:
        """Promote a disk entry of `nbytes` (every rank's shards) whose prefix's prefill costs `flops`?"""
        reload_s, prefill_s = self.reload.estimate(nbytes), self.prefill.estimate(flops)
        promote = self.mode == "always" or reload_pays(reload_s, prefill_s, self.margin)
        return Verdict(promote, reload_s, prefill_s)

    def split(self, cuts: list[int], head_flops: list[float | None], tail_bytes: list[float],
              read_s: float = 0.0, live: tuple[float, float] | None = None) -> int | None:
        """Mode "split": the cut (plan_cut) of an entry whose head is computed up to cuts[0] and whose tail is
        read from the end: head_flops[k] the FLOPs of computing [cuts[0], cuts[k]), tail_bytes[k] the bytes
        (every rank's shards) of rows [cuts[k], P); `read_s` seconds the read has run already. `live`: the
        read's own (seconds per byte, bytes read) so far, which replace the saved rate and the elapsed time
        (this read may come from a warm page cache, or a disk slower today). None: another mode, a rate not
        measured yet or a FLOP model that does not apply (the caller decides as "auto")."""
        if self.mode != "split" or self.prefill.per_unit is None or (self.reload.per_unit is None and live is None):
            return None
        if any(f is None for f in head_flops):
            return None
        compute = [self.prefill.per_unit * f for f in head_flops]
        if live is not None:
            per_byte, done = live
            read = [per_byte * max(0.0, b - done) for b in tail_bytes]
        else:
            read = [max(0.0, self.reload.per_unit * b - read_s) for b in tail_bytes]
        return plan_cut(cuts, compute, read)

    # -- the rates across restarts (the disk directory's RATES_FILE)
    def load(self, directory, where: str) -> bool:
        """Start from the rates a server of this cache key on this device (`where`) saved in `directory`
        -> whether there were any. A damaged file is ignored, with a warning."""
        path = Path(directory) / RATES_FILE
        try:
            saved = json.loads(path.read_text()).get(where)
        except FileNotFoundError:
            return False
        except (OSError, ValueError, AttributeError) as e:
            log.warning("disk cache: ignoring %s (%s: %s); the reload rates are measured again", path,
                        type(e).__name__, e)
            return False
        if not isinstance(saved, dict):
            return False
        for rate, name in ((self.reload, "reload_s_per_byte"), (self.prefill, "prefill_s_per_flop")):
            value = saved.get(name)
            if isinstance(value, (int, float)) and value > 0:
                rate.per_unit = float(value)
        return self.reload.per_unit is not None or self.prefill.per_unit is not None

    def save(self, directory, where: str) -> None:
        """Keep the measured rates in `directory` under `where` (beside other keys' and devices'), replacing
        the file atomically; nothing measured: nothing written."""
        if self.reload.per_unit is None and self.prefill.per_unit is None:
            return
        path = Path(directory) / RATES_FILE
        try:
            records = json.loads(path.read_text())
            records = records if isinstance(records, dict) else {}
        except (OSError, ValueError):
            records = {}
        records[where] = {"reload_s_per_byte": self.reload.per_unit, "prefill_s_per_flop": self.prefill.per_unit}
        tmp = path.with_name(f".{RATES_FILE}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(records, indent=1) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            log.warning("disk cache: could not save the reload rates to %s: %s", path, e)


def probe_read(files, readers: int) -> float | None:
    """Seconds per byte of a cold read (its pages dropped from the page cache first) of up to PROBE_BYTES from the
    start of the largest of `files`, by `readers` parallel readers; None without a readable file."""
    sizes = []
    for f in files:
        try:
            sizes.append((Path(f).stat().st_size, Path(f)))
        except OSError:
            continue
    if not sizes:
        return None
    size, path = max(sizes)
    n = min(size, PROBE_BYTES)
    if n <= 0:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, n, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        t0 = time.perf_counter()
        for _ in read_file(path, 0, n, None, readers):
            pass
        return (time.perf_counter() - t0) / n
    except (OSError, EOFError) as e:
        log.warning("disk cache: the start-up read probe of %s failed (%s); the first disk hit decides as auto",
                    path, e)
        return None


def probe_prefill(device, dtype) -> float:
    """Seconds per FLOP a prefill is expected to take before one ran on this server: a square GEMM's rate in
    `dtype` on `device` (CUDA events), over PREFILL_OF_GEMM."""
    n = 4096 if device.type == "cuda" else 512
    dtype = dtype if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # lazy initialisations
    reps = 8
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            a @ b
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        seconds = time.perf_counter() - t0
    return seconds / (reps * 2 * n**3) / PREFILL_OF_GEMM
