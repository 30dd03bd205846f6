"""The disk side of `bench serve --tiers`: a cache entry's files on every rank, dropping them from the
page cache (a cold read without root: posix_fadvise DONTNEED on files already written back, as the disk
tier's fsynced writes are), the disk's sequential read rate over those files, and where they live."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from starshard.serving.disk_tier import file_name

READ_BLOCK = 64 << 20  # plain large sequential reads


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


def read_all(paths) -> tuple[int, float]:
    """(bytes, seconds) of reading every file through once, one thread per file, all at once (as the
    ranks' promotions read them)."""
    sizes = [0] * len(paths)

    def read(i, p):
        buf = bytearray(max(1, min(READ_BLOCK, p.stat().st_size)))
        view = memoryview(buf)
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                sizes[i] += n

    threads = [threading.Thread(target=read, args=(i, p)) for i, p in enumerate(paths)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(sizes), time.perf_counter() - t0


def read_rate(paths) -> dict:
    """The disk's sequential read rate over `paths`, cold (dropped from the page cache first), and the
    page cache's (read again, warm) beside it: a cold rate close to the warm one means the drop did not
    take (tmpfs, or a filesystem that ignores fadvise). The files are dropped again afterwards."""
    drop_cached(paths)
    n, cold = read_all(paths)
    _, warm = read_all(paths)
    drop_cached(paths)
    return {"files": [str(p) for p in paths], "file_bytes": [p.stat().st_size for p in paths], "bytes": n,
            "cold_read_s": cold, "disk_read_gbps": n / cold / 1e9, "page_cache_read_gbps": n / warm / 1e9,
            "drop_took": cold > 1.5 * warm, "where": mount_of(paths[0].parent)}


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
