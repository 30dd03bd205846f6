"""The context cache's lower tiers on one rank, as the service uses them: pinned host memory
(--host-cache-gib) and a directory (--disk-cache-dir, --disk-cache-gib), each within its budget per rank.

The scheduler on rank 0 decides every move (serving/ops.py: Demote down a tier when the device budget
evicts an entry, Promote back up when a new prompt's prefix matches a lower tier's entry) and every
rank's executor applies it to its own shard, so all ranks agree on what lives where. The disk tier's
files are bound to this server by `server_key` (model fingerprint, dtype, FP8 parts, layout): another
model or layout on the same directory reuses nothing.

APB entries are never tiered: their KV depends on the question, so they are never reused at all
(the service refuses the tier flags under APB).
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from starshard.serving.cache_key import CacheKey, cache_key, model_fingerprint
from starshard.serving.disk_read import DEFAULT_READERS, check_readers
from starshard.serving.disk_staging import DISK_STAGING_BYTES
from starshard.serving.disk_tier import DiskEntry, DiskTier, DiskTierLocked
from starshard.serving.disk_writer import DiskWriter
from starshard.serving.host_tier import HostTier
from starshard.serving.pinned_arena import PinnedArena
from starshard.serving.reload_policy import POLICIES

log = logging.getLogger("starshard.serve")

GiB = 2**30
SHUTDOWN_WRITE_S = 120.0  # --shutdown-write-s's default
# --disk-cache-dir without --disk-cache-gib: this share of its filesystem's free space, split over the ranks that
# may write there, at most DISK_DEFAULT_CAP per rank (a 128K-token Llama-3.1-8B entry takes 17 GB at cp=1)
DISK_FREE_SHARE = 0.5
DISK_DEFAULT_CAP = 100 * GiB
# A host tier serve sizes itself (a disk tier on a GPU, no --host-cache-gib) takes at most this share of the
# node's available memory, split over its ranks.
HOST_DEFAULT_RAM_SHARE = 0.5


@dataclass(frozen=True)
class TierConfig:
    """The lower tiers' budgets per rank; 0 / None: that tier is off."""

    host_bytes: int = 0
    disk_dir: str | Path | None = None
    disk_bytes: int = 0
    disk_reload: str = "auto"  # when a disk hit is promoted (serving/reload_policy.py): "auto" or "always"
    shutdown_write_s: float = SHUTDOWN_WRITE_S  # graceful shutdown: seconds to write entries down to disk (0: skip)
    disk_readers: int = DEFAULT_READERS  # parallel sequential readers per file read (serving/disk_read.py)

    @classmethod
    def from_gib(cls, host_gib: float = 0.0, disk_dir=None, disk_gib: float | None = None,
                 disk_reload: str = "auto", shutdown_write_s: float = None,
                 disk_readers: int = DEFAULT_READERS) -> "TierConfig":
        check_readers(disk_readers)
        shutdown_write_s = SHUTDOWN_WRITE_S if shutdown_write_s is None else shutdown_write_s
        if shutdown_write_s < 0:
            raise ValueError(f"--shutdown-write-s must be >= 0 seconds (0: write nothing down), got {shutdown_write_s}")
        if disk_reload not in POLICIES:
            raise ValueError(f"--disk-reload-policy must be one of {', '.join(POLICIES)}, got {disk_reload!r}")
        if host_gib < 0:
            raise ValueError(f"--host-cache-gib must be >= 0 (0: no host tier), got {host_gib}")
        if disk_dir is None and disk_gib is not None:
            raise ValueError("--disk-cache-gib needs --disk-cache-dir (the directory the disk tier keeps its files in)")
        if disk_dir is not None and (disk_gib is None or disk_gib <= 0):
            raise ValueError(f"--disk-cache-dir needs --disk-cache-gib > 0 (the disk tier's budget per rank), "
                             f"got {disk_gib}")
        return cls(int(host_gib * GiB), disk_dir, int((disk_gib or 0) * GiB), disk_reload, shutdown_write_s,
                   disk_readers)

    @property
    def any(self) -> bool:
        return bool(self.host_bytes) or self.disk_dir is not None


def default_disk_budget(path, ranks: int) -> tuple[int, int]:
    """(budget per rank, free bytes) for a disk tier in `path` given no --disk-cache-gib: DISK_FREE_SHARE of the
    free space of the filesystem that holds it (or will: the nearest existing parent), split over `ranks` (the
    launch's ranks, which may all write there), at most DISK_DEFAULT_CAP, in whole MiB."""
    where = Path(path).expanduser().absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    budget = min(int(free * DISK_FREE_SHARE) // max(ranks, 1), DISK_DEFAULT_CAP) // 2**20 * 2**20
    if budget <= 0:
        raise ValueError(f"--disk-cache-dir {path}: its filesystem has {free / 2**20:.0f} MiB free, too little for a "
                         "disk tier; free some space, or give --disk-cache-gib")
    return budget, free


def default_host_bytes(cache_bytes: int, available: int, node_ranks: int) -> int:
    """The host tier per rank for a disk tier on a GPU given no --host-cache-gib: one device budget, so that a shard
    leaving the device for disk is staged in page-locked memory (0.33 s for a 17 GB shard on an H100 host) instead
    of copied inside a step through ordinary memory (~10 s, every stream waiting); at most HOST_DEFAULT_RAM_SHARE
    of the node's `available` memory over its `node_ranks`. Whole MiB; 0 when that leaves less than one."""
    share = int(available * HOST_DEFAULT_RAM_SHARE) // max(node_ranks, 1)
    return max(0, min(cache_bytes, share)) // 2**20 * 2**20


def memory_available() -> int:
    """The node's available memory: Linux's MemAvailable (what can be had without swapping), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def server_key(llm, dtype, chunk: int, knee: int | None = None) -> CacheKey:
    """What this server's shards depend on: the model (its weight files sampled, or the random weights'
    preset and seed), the compute dtype and FP8 parts, tp / cp / the strategy and its options, and the
    prefill chunk and its taper's knee where they lay a CP rank's shard out."""
    if llm.path is not None:
        model = model_fingerprint(llm.config, weights_path=llm.path)
    else:
        model = model_fingerprint(llm.config, random_preset=llm.random_weights, seed=llm.weights_seed)
    strategy = getattr(llm.runner, "strategy", None)
    cp = 1 if strategy is None else strategy.cp
    return cache_key(model, dtype=dtype, fp8=llm.fp8, tp=llm.parallel.tp, cp=cp, pp=llm.parallel.pp,
                     strategy="dense" if strategy is None else strategy.name,
                     options={} if strategy is None else strategy.spec_options(),
                     prefill_chunk=(chunk or None) if cp > 1 else None,
                     prefill_knee=knee if cp > 1 and chunk else None, kv_heads=llm.config.num_kv_heads)


class Tiers:
    """One rank's host and disk tiers. `disk_bytes` (what rank 0 plans with): each disk entry's bytes on
    every CP rank once loaded to the device, by token digest; only entries every rank holds a file of
    are listed after a start, so rank 0 promotes only what every rank can load."""

    def __init__(self, config: TierConfig, *, ranks: int, cp_rank: int, token_bytes: int, key: CacheKey | None,
                 control=None):
        # the host budget is page-locked here, once (seconds for many GiB), not per demoted shard
        self.host = HostTier(config.host_bytes, ranks, PinnedArena(config.host_bytes)) if config.host_bytes else None
        self.disk = None
        self.writer: DiskWriter | None = None  # the disk tier's writer thread (background writes)
        self.token_bytes = token_bytes
        self.disk_bytes: dict[str, list[int]] = {}
        if config.disk_dir is not None:
            self._open_disk(config, ranks, cp_rank, key, control)
            self.writer = DiskWriter(self.disk)

    def _open_disk(self, config: TierConfig, ranks: int, cp_rank: int, key: CacheKey, control) -> None:
        """Every rank opens (locks, indexes) its files, then one all-gather: rank 0 learns each entry's shard
        bytes on every CP rank, and a rank that could not open the directory stops every rank (no hang)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        mine, err = {}, None
        try:
            self.disk = DiskTier(config.disk_dir, config.disk_bytes, key, rank, readers=config.disk_readers,
                                 staging_bytes=DISK_STAGING_BYTES if torch.cuda.is_available() else 0)
            mine = {digest_of(e): e.device_bytes(self.token_bytes) for e in self.disk.list()}
        except (DiskTierLocked, OSError) as e:
            err = e
        own = (cp_rank, mine, None if err is None else f"{type(err).__name__}: {err}")
        every = [own]
        if control is not None:
            every = [None] * dist.get_world_size(control)
            dist.all_gather_object(every, own, group=control)
        failed = [(r, msg) for r, (_, _, msg) in enumerate(every) if msg]
        if failed:
            self.close()
            if isinstance(err, DiskTierLocked):
                raise err
            r, msg = failed[0]
            raise ValueError(f"--disk-cache-dir {config.disk_dir}: rank {r} could not open it ({msg})")
        for digest in mine:
            nbytes = [None] * ranks
            if all(digest in files for _, files, _ in every):
                for r, files, _ in every:
                    nbytes[r] = files[digest]
            if None not in nbytes:
                self.disk_bytes[digest] = nbytes
        if self.disk.entries:
            log.info("disk cache: %d of this rank's %d entries are held by every rank (reusable)",
                     len(self.disk_bytes), len(self.disk.entries))

    @property
    def arena(self) -> PinnedArena | None:
        """The host tier's pinned memory, which disk reloads also pass through when it has room."""
        return self.host.arena if self.host is not None else None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.disk is not None:
            self.disk.close()
        if self.host is not None and self.host.arena is not None:
            self.host.arena.close()

    # -- rank 0: lookups (not counted: the scheduler scans its queue with them)
    def peek(self, ids: np.ndarray, disk: bool = True) -> tuple[str | None, object, int]:
        """(tier, entry, shared tokens) of the lower tier entry sharing the longest prefix with `ids`, the
        host tier's on a tie (the faster reload); (None, None, 0) when none. disk=False: the host tier's only."""
        best = (None, None, 0)
        if self.host is not None:
            e, m = self.host.peek(ids)
            if e is not None:
                best = ("host", e, m)
        if self.disk is not None and disk:
            e, m = self.disk.peek(ids, only=self.disk_bytes)
            if e is not None and m > best[2]:
                best = ("disk", e, m)
        return best

    def stats(self) -> dict:
        out = {}
        if self.host is not None:
            out["host"] = self.host.stats.as_dict()
        if self.disk is not None:
            out["disk"] = self.disk.stats.as_dict()
        return out


def digest_of(entry: DiskEntry) -> str:
    """The token digest a disk entry's file name carries (the same on every rank)."""
    return entry.name.split("-")[1]
