"""The disk side of `bench serve --tiers`: a cache entry's files on every rank, dropping them from the
page cache (a cold read without root: posix_fadvise DONTNEED on files already written back, as the disk
tier's fsynced writes are), the disk's read rate over those files (the best of 1, 4 and 8 parallel
sequential readers per file), where they live, and pacing the disk tier's reads to a fraction of that
rate (--disk-read-throttle, benchmark-only)."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from starshard.serving.disk_read import read_file
from starshard.serving.disk_tier import file_name

READER_COUNTS = (1, 4, 8)  # disk_bound: the best of these many parallel sequential readers per file


def entry_files(tier, ids, world: int, timeout: float = 600.0) -> list[Path]:
    """The files of the disk entry sharing the longest prefix with `ids` (a document's own tokens find its
    entry): rank 0's, and every other rank's of this one node in the same directory (waited for: the other
    ranks may still be writing theirs; a file appears only complete, by rename). Ranks of another node are
    skipped after `timeout`."""
    e, _ = tier.peek(ids, whole=True)
    if e is None:
        raise ValueError("the disk tier holds no file of this document")
    paths = [tier.path / file_name(tier.key, e.ids, r) for r in range(world)]
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in paths if p.exists()]


def drop_cached(paths) -> None:
    """Drop the files' pages from the page cache (clean pages only: the disk tier fsyncs its files)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(paths, readers: int = 1) -> tuple[int, float]:
    """(bytes, seconds) of reading every file through once, all files at once (as the ranks' promotions read
    them), each by `readers` parallel sequential readers (serving/disk_read.py, as the disk tier reads)."""
    sizes = [0] * len(paths)
    errors = []

    def read(i, p):
        try:
            for done in read_file(p, 0, p.stat().st_size, None, readers):  # into scratch buffers: a rate only
                sizes[i] = done
        except (OSError, EOFError) as e:  # a file removed or cut meanwhile: its bytes read so far count
            errors.append(e)

    threads = [threading.Thread(target=read, args=(i, p)) for i, p in enumerate(paths)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"reading the entry's files failed: {errors[0]}")
    return sum(sizes), seconds


def read_rate(paths, reader_counts=READER_COUNTS) -> dict:
    """The disk's sequential read rate over `paths`: the best of 1, 4 and 8 parallel sequential readers per
    file, each cold (dropped from the page cache first; every count's rate in `readers_gbps`), and the page
    cache's (read again, warm, with the best count) beside it: a cold rate close to the warm one means the
    drop did not take (tmpfs, or a filesystem that ignores fadvise). The files are dropped again afterwards."""
    rates, n = {}, 0
    for count in reader_counts:
        drop_cached(paths)
        n, cold = read_all(paths, count)
        rates[count] = (n / cold / 1e9, cold)
    best = max(rates, key=lambda c: rates[c][0])
    _, warm = read_all(paths, best)
    drop_cached(paths)
    gbps, cold = rates[best]
    return {"files": [str(p) for p in paths], "file_bytes": [p.stat().st_size for p in paths], "bytes": n,
            "readers_gbps": {str(c): r for c, (r, _) in rates.items()}, "best_readers": best,
            "cold_read_s": cold, "disk_read_gbps": gbps, "page_cache_read_gbps": n / warm / 1e9,
            "drop_took": cold > 1.5 * warm, "where": mount_of(paths[0].parent)}


def throttle(tier, disk: dict, factor: float) -> dict:
    """Pace `tier`'s reads (this rank's) so that the entry's files read at `factor` x the measured rate `disk`
    (read_rate): this rank's file gets its share of factor x rate, so it takes as long as all the files at that
    rate would. Benchmark-only (a slower disk, or a faster one up to the rate measured). Other ranks' tiers
    are not paced: with factor <= 1 they finish first, and a promotion waits for every rank."""
    share = disk["file_bytes"][0] / disk["bytes"]
    tier.read_limit = factor * disk["disk_read_gbps"] * 1e9 * share
    return {"disk_read_throttle": factor, "disk_read_limit_gbps": tier.read_limit / 1e9,
            "disk_bound_throttled_s": disk["bytes"] / (factor * disk["disk_read_gbps"] * 1e9)}


def mount_of(path) -> dict:
    """The mount holding `path` (from /proc/self/mountinfo): mount point, filesystem type, source device."""
    real = os.path.realpath(path)
    best = {"dir": real, "mount_point": None, "fstype": None, "source": None}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        left, _, right = line.partition(" - ")
        f, g = left.split(), right.split()
        point = f[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(g) >= 2 and (best["mount_point"] is None or len(point) >= len(best["mount_point"])):
            best.update(mount_point=point, fstype=g[0], source=g[1], dev=f[2])
    return best
