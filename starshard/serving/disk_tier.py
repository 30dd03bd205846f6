"""The disk tier: one rank's cache entry shards as files in a directory (`--disk-cache-dir`), within a
byte budget, found again by prefix after a restart.

Files are named `<key16>-<tokens16>-r<rank>.kv` (hashes of the cache key and of the token ids: never
request text) and each rank writes and indexes only its own, so a directory per node and one shared
filesystem both work. An exclusive lock per rank (`rank<r>.lock`, fcntl.flock) keeps a second server
off the same directory and rank. LRU order is the files' modification time (touched on each use), so
it survives a restart too.

Another exact layout's files (cache_key.CacheKey.share_digest: one process, tp, cp with ring / Ulysses /
USP) are found too: at start each rank reads the headers of the other keys' files, and an entry whose
every rank's file is present and together holds the KV heads and positions this rank needs is listed as
`shared`. Loading one reads those files and rebuilds exactly the shard this rank's own prefill of the entry
would have kept (serving/kv_layout.py). Shared files are another layout's: never counted in this budget,
evicted, touched or removed here (a damaged one is only dropped from the index). Files of another format
version are skipped with the reason logged, and left for `starshard cache purge`.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from starshard.engine.kv_cache import KVCache
from starshard.serving.cache_key import CacheKey, token_digest
from starshard.serving.context_cache import longest_prefix
from starshard.serving.disk_read import DEFAULT_READERS, check_readers
from starshard.serving.disk_staging import StagingArea, read_kv_staged
from starshard.serving.host_tier import DeviceLoader, HostKV, to_device, to_host
from starshard.serving.kv_layout import head_range, prefill_positions, reassemble
from starshard.serving.kv_file import (
    KVFileError,
    KVFileHeader,
    file_bytes,
    fsync_dir,
    read_header,
    read_kv_host,
    read_tokens,
    write_kv_file,
)
from starshard.serving.pinned_arena import PinnedArena
from starshard.serving.tier_stats import TierStats

log = logging.getLogger("starshard.serving.disk_tier")

FILE_RE = re.compile(r"^(?P<key>[0-9a-f]{16})-(?P<tokens>[0-9a-f]{16})-r(?P<rank>\d+)\.kv$")
TMP_RE = re.compile(r"^\.(?P<name>.+\.kv)\.\d+\.tmp$")  # kv_file.write_kv_file's temporary names


class DiskTierLocked(RuntimeError):
    """Another process holds this directory and rank."""


def file_name(key: CacheKey, token_ids, rank: int) -> str:
    return f"{key.short}-{token_digest(token_ids)}-r{rank}.kv"


def lock_path(directory, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.lock"


def take_lock(directory, rank: int) -> int:
    """An exclusive, non-blocking flock on the rank's lock file (its fd); DiskTierLocked naming the file,
    the holder and the fix when another process has it. Released when the fd is closed (or the process ends)."""
    path = lock_path(directory, rank)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DiskTierLocked(
            f"the disk cache lock {path} is held by another process ({holder}): two servers cannot share one "
            f"--disk-cache-dir for rank {rank}; give this server its own --disk-cache-dir, or stop the other "
            f"server (the lock is released when it exits)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def make_private_dir(path) -> Path:
    """The directory, created 0700 if missing; an existing one readable by others is named in a warning
    (it is the operator's directory: its mode is not changed behind their back)."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("disk cache directory %s has mode %o: other users can read the cached documents; "
                    "chmod 700 it", path, mode)
    return path


@dataclass
class DiskEntry:
    name: str
    path: Path
    ids: np.ndarray  # the token ids whose KV the file holds
    nbytes: int  # the file's size
    rank: int
    entry_id: int | None  # the context cache's id when it was written (informational: ids restart with the server)
    created: float
    last_used: float  # the file's mtime: LRU order, kept across restarts
    rows: int = 0  # KV rows of a layer that keeps every key
    layer_rows: tuple[tuple[int, bool], ...] = ()  # (rows, window-trimmed) of each layer
    serves_from: int = 0  # the fewest shared tokens it serves (a window-trimmed entry's document: served_prefix)
    sources: tuple = ()  # shared: ((path, header), ...) of another layout's files this rank's shard is rebuilt from
    positions: np.ndarray | None = None  # shared: the positions this rank's shard holds, in order
    heads: tuple[int, int] | None = None  # shared: the KV heads [start, stop) it holds
    layout: str = ""  # shared: the writer's layout (CacheKey.layout)
    context_len: int | None = None  # the entry's document part (its file's header; None: not recorded)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def shared(self) -> bool:
        """Rebuilt from another exact layout's files."""
        return bool(self.sources)

    def device_bytes(self, token_bytes: int) -> int:
        """Its shard's bytes once loaded on the device, as the service counted them before it went down:
        `token_bytes` (every layer's KV of one token) per row of a layer keeping every key (at least one,
        as Executor.entry_rank_bytes), a layer's share of it per row a trimmed layer holds (exactly its rows,
        as after KVCache.compact_local)."""
        if not self.layer_rows:
            return max(1, self.rows) * token_bytes
        per_layer = token_bytes // len(self.layer_rows)
        return per_layer * sum(n if trimmed else max(1, n) for n, trimmed in self.layer_rows)


@dataclass
class PendingWrite:
    """A shard file being written (DiskTier.reserve -> write -> commit or abandon): reserved in the budget,
    not listed (never promoted) before commit."""

    name: str
    path: Path
    ids: np.ndarray
    entry_id: int | None
    host: HostKV | None  # None: the caller found these tokens' file listed (DiskTier.holds) and copied nothing
    need: int = 0  # the bytes reserved
    reserved: bool = False
    done: bool = False  # write() returned (or nothing to write)
    wrote: bool = False  # this job's file is complete under its final name
    error: str | None = None
    size: int = 0
    seconds: float = 0.0


class DiskTier:
    """One rank's files of one cache key in `path`, LRU within `budget_bytes`.

    verify_on_start: also check every payload's digests while indexing (a full read of the directory);
    off, start reads headers and token ids only (seconds for terabytes) and a damaged payload is caught
    when it is loaded: `load` then removes the file and raises KVFileError, and the caller re-prefills.
    readers: parallel sequential readers per file (disk_read.py; --disk-readers; 1: one in order).
    staging_bytes: a pinned staging area for reloads to a CUDA device without a host arena range (0: none).
    """

    def __init__(self, path, budget_bytes: int, key: CacheKey, rank: int, verify_on_start: bool = False,
                 readers: int = DEFAULT_READERS, staging_bytes: int = 0):
        self.readers = check_readers(readers)  # parallel sequential readers per file read (disk_read.py)
        self.read_limit: float | None = None  # bytes/s: bench serve --disk-read-throttle's pacing, never serve's
        # pinned slots that reloads to a CUDA device stream through when no host arena range takes the file
        # (disk_staging.py); page-locked here, once, not on the first reload after a restart
        self.staging = StagingArea(staging_bytes) if staging_bytes else None
        if budget_bytes <= 0:
            raise ValueError(f"the disk cache budget must be > 0 bytes (--disk-cache-gib), got {budget_bytes}")
        self.path = make_private_dir(path)
        self.budget = budget_bytes
        self.key = key
        self.rank = rank
        self.entries: dict[str, DiskEntry] = {}
        self.shared: dict[str, DiskEntry] = {}  # token digest -> an entry rebuilt from another layout's files
        self._writing: dict[str, int] = {}  # names being written -> the bytes reserved for them
        self._stats = TierStats()
        self._mutex = threading.RLock()  # a writer thread may demote while the scheduler looks up
        self._lock_fd = take_lock(self.path, rank)
        try:
            self._index(verify_on_start)
            self._fit(0)
        except BaseException:
            self.close()
            raise

    # -- start
    def _reject(self, path: Path, err: KVFileError) -> None:
        log.warning("disk cache: removed %s (%s: %s)", path.name, err.reason, err.detail)
        self._stats.rejected += 1
        try:
            path.unlink(missing_ok=True)
        except OSError as e:  # a directory or an unwritable file by that name: skipped all the same
            log.warning("disk cache: could not remove %s (%s)", path.name, e)

    def _index(self, verify: bool) -> None:
        foreign, old, mine = 0, 0, f"-r{self.rank}.kv"
        others: dict[tuple[str, str], dict[int, tuple[Path, KVFileHeader]]] = {}  # another key's files
        for p in sorted(self.path.iterdir()):
            tmp = TMP_RE.match(p.name)
            if tmp and tmp["name"].endswith(mine):
                p.unlink(missing_ok=True)  # a crashed write of this rank's (we hold its lock: no writer is live)
                continue
            m = FILE_RE.match(p.name)
            if m is None:
                continue  # not a shard file
            if m["key"] != self.key.short:
                # Another model's, layout's or format's files may share the directory (a server restarted with
                # other weights or --cp, or another deployment); never read as ours, left for that key and for
                # `starshard cache purge`. Another exact layout's may be rebuilt from (_share).
                try:
                    h = read_header(p)
                except KVFileError as e:
                    if e.reason == "version" and int(m["rank"]) == self.rank:
                        old += 1
                        log.info("disk cache: skipped %s (%s: %s)", p.name, e.reason, e.detail)
                    elif int(m["rank"]) == self.rank:
                        foreign += 1
                    continue
                if h.share is not None and h.share == self.key.share_digest:
                    others.setdefault((m["key"], m["tokens"]), {})[h.rank] = (p, h)
                elif int(m["rank"]) == self.rank:
                    foreign += 1
                continue
            if int(m["rank"]) != self.rank:
                continue  # another rank's: that rank indexes it
            if p.is_symlink() or not p.is_file():
                log.warning("disk cache: skipped %s (not a regular file)", p.name)
                continue
            try:
                h = read_header(p, self.key, self.rank)
                ids = read_tokens(p, h)
                if token_digest(ids) != m["tokens"]:
                    raise KVFileError(p, "header", "the token ids do not match the file's name")
                if verify:
                    read_kv_host(p, self.key, self.rank, verify=True, header=h, readers=self.readers)
            except KVFileError as e:
                self._reject(p, e)
                continue
            try:
                st = p.stat()
            except OSError:
                continue  # removed meanwhile
            windows = dict(h.windows)
            self.entries[p.name] = DiskEntry(p.name, p, ids, st.st_size, self.rank, h.entry_id, h.created, st.st_mtime,
                                             h.length, tuple((n, i in windows) for i, n in zip(h.layer_ids, h.lengths)),
                                             h.serves_from, context_len=h.context_len)
        if old:
            log.info("disk cache %s: %d file(s) of rank %d were written in another format version (this starshard "
                     "reads version %d): skipped, left in place (`starshard cache purge --disk-cache-dir %s --all` "
                     "removes them)", self.path, old, self.rank, self.key.format_version, self.path)
        for (key16, tokens16), files in others.items():
            reason = self._share(key16, tokens16, files)
            if reason is not None and files:
                foreign += sum(1 for r in files if r == self.rank)
                log.info("disk cache: the %s entry %s of another layout is not reused on rank %d: %s",
                         next(iter(files.values()))[1].cache_key().layout(), tokens16, self.rank, reason)
        if foreign:
            log.info("disk cache %s: %d file(s) of rank %d belong to another model or layout (key differs from %s): "
                     "not reused, left in place (`starshard cache list --disk-cache-dir %s` shows them)",
                     self.path, foreign, self.rank, self.key.short, self.path)
        log.info("disk cache %s rank %d: %d entries, %.2f GiB of %.2f GiB%s", self.path, self.rank, len(self.entries),
                 self.used / 2**30, self.budget / 2**30,
                 f"; {len(self.shared)} more rebuilt from another layout's files" if self.shared else "")

    def _share(self, key16: str, tokens16: str, files: dict[int, tuple[Path, KVFileHeader]]) -> str | None:
        """List another exact layout's entry (every rank's file, by rank) as this rank's `shared` entry when the
        files hold what this rank needs; else why not."""
        first = next(iter(files.values()))[1]
        writer = first.cache_key()
        if sorted(files) != list(range(writer.tp * writer.cp)):
            return f"rank files {sorted(files)} of {writer.tp * writer.cp} (a write in progress, or lost)"
        heads = [h for _, h in files.values()]
        same = ("n_tokens", "tokens_digest", "dtype", "fp8", "windows", "serves_from", "layer_ids")
        if any(getattr(h, f) != getattr(first, f) for h in heads for f in same) or \
                len({(h.layout or {}).get("kv_heads") for h in heads}) != 1:
            return "its rank files disagree (tokens, dtype, layers or heads)"
        total, n = first.layout["kv_heads"], first.n_tokens
        if self.key.kv_heads is not None and self.key.kv_heads != total:
            return f"it holds {total} KV heads, this model {self.key.kv_heads}"
        if first.windows and (self.key.cp > 1 or writer.cp > 1):
            return "it is window-trimmed (its local layers keep only their window), and a CP layout keeps every key"
        tp_rank, cp_rank = self.rank % self.key.tp, self.rank // self.key.tp % self.key.cp
        try:
            want = prefill_positions(self.key, cp_rank, n)
            need = head_range(total, self.key.tp, tp_rank)
        except ValueError as e:
            return str(e)
        chosen, covered = [], np.zeros((need[1] - need[0], n), dtype=bool)
        for r in sorted(files):
            p, h = files[r]
            lo, hi = max(need[0], h.heads[0]), min(need[1], h.heads[1])
            pos = h.positions()
            if lo >= hi or pos.size == 0 or pos.max() >= n or not np.isin(pos, want).any():
                continue
            if not covered[lo - need[0]:hi - need[0]][:, pos].all():
                chosen.append((p, h))
                covered[lo - need[0]:hi - need[0], pos] = True
        if not covered[:, want].all():
            return "its files do not hold every KV head and position this rank needs"
        if not chosen:
            return "this rank's own prefill of it would keep no rows"
        try:
            ids = read_tokens(*chosen[0])
        except KVFileError as e:
            return f"{e.reason}: {e.detail}"
        if token_digest(ids) != tokens16:
            return "the token ids do not match the file names"
        rows = len(want)
        layer_rows = tuple((n_rows if i in dict(first.windows) else rows, i in dict(first.windows))
                           for i, n_rows in zip(first.layer_ids, first.lengths))
        e = DiskEntry(f"{key16}-{tokens16}-as-r{self.rank}", chosen[0][0], ids,
                      sum(h.file_bytes for _, h in chosen), self.rank, first.entry_id, first.created,
                      max(h.created for _, h in chosen), rows, layer_rows, first.serves_from, tuple(chosen),
                      want, need, writer.layout(), context_len=first.context_len)
        old = self.shared.get(tokens16)
        if old is None or e.nbytes < old.nbytes:  # of several layouts' copies, the one with the fewest bytes to read
            self.shared[tokens16] = e
        return None

    # -- accounting
    @property
    def used(self) -> int:
        return sum(e.nbytes for e in self.entries.values()) + sum(self._writing.values())

    @property
    def stats(self) -> TierStats:
        with self._mutex:
            self._stats.entries = len(self.entries)
            self._stats.bytes = self.used
        return self._stats

    def list(self) -> list[DiskEntry]:
        """This key's entries on this rank, least recently used first, then those rebuilt from another layout's
        files whose tokens no own file holds."""
        with self._mutex:
            own = sorted(self.entries.values(), key=lambda e: e.last_used)
            held = {e.name.split("-")[1] for e in own}
            return own + [e for d, e in self.shared.items() if d not in held]

    def _remove(self, name: str) -> None:
        shared = next((d for d, e in self.shared.items() if e.name == name), None)
        if shared is not None:
            del self.shared[shared]  # another layout's files: only forgotten here
            return
        e = self.entries.pop(name, None)
        if e is not None:
            e.path.unlink(missing_ok=True)  # a load reading it keeps its open file: POSIX frees it after

    def remove(self, name: str) -> None:
        with self._mutex:
            self._remove(name)
            fsync_dir(self.path)

    def _fit(self, need: int, keep: str | None = None) -> bool:
        """Evict LRU files until `need` more bytes fit; False (nothing evicted) if they never can."""
        if need > self.budget:
            return False
        victims, used = [], self.used
        for e in sorted(self.entries.values(), key=lambda e: e.last_used):
            if used + need <= self.budget:
                break
            if e.name != keep:
                victims.append(e.name)
                used -= e.nbytes
        if used + need > self.budget:
            return False
        for name in victims:
            self._remove(name)
        self._stats.evictions += len(victims)
        if victims:
            fsync_dir(self.path)
        return True

    def purge(self) -> int:
        """Remove every file of this key and rank; the number removed."""
        with self._mutex:
            n = len(self.entries)
            for name in list(self.entries):
                self._remove(name)
            fsync_dir(self.path)
            return n

    def _touch(self, e: DiskEntry) -> None:
        if e.shared:
            return  # another layout's files keep their own LRU order
        now = time.time()
        e.last_used = max(now, e.last_used + 1e-6)
        try:
            os.utime(e.path, (e.last_used, e.last_used))
        except OSError:
            pass  # removed meanwhile: the next load reports it

    # -- moves
    def put(self, entry_id: int | None, token_ids, kv: KVCache | HostKV) -> DiskEntry | None:
        """Demote a shard to disk: written atomically under its hashed name, LRU files evicted to stay in the
        budget. None (logged) when it cannot be kept: larger than the budget, or the write failed (disk
        full, I/O error); the cache is best effort and the caller's entry stays valid where it was.
        The service writes in the background instead (reserve / write / commit; serving/disk_writer.py)."""
        job = self.reserve(entry_id, token_ids, kv if isinstance(kv, HostKV) else to_host(kv))
        if job.error is None and not job.done:
            self.write(job)
        if job.error is not None:
            self.abandon(job)
            return None
        return self.commit(job)

    def reserve(self, entry_id: int | None, token_ids, host: HostKV | None) -> "PendingWrite":
        """Make room for a shard's file (LRU files evicted, its bytes counted in `used` from now) without
        writing it; `write` (any thread) writes it, then `commit` lists it or `abandon` removes it. A job
        whose tokens are already on disk is done at once (commit touches that file); one that cannot be
        kept (larger than the budget, or these tokens being written already, or no `host` copy to write a
        file gone meanwhile from) carries its `error`."""
        ids = np.asarray(token_ids, dtype=np.int64)
        name = file_name(self.key, ids, self.rank)
        job = PendingWrite(name, self.path / name, ids, entry_id, host)
        with self._mutex:
            old = self.entries.get(name)
            if old is not None and np.array_equal(old.ids, ids):
                job.done, job.size = True, old.nbytes  # the same key and tokens: the same bytes are already here
                return job
            if name in self._writing:  # another job writes these very bytes: this one has nothing to do
                job.done = True
                return job
            if host is None:  # listed when the caller looked (holds), gone since: nothing to write it from
                job.error = "its file left the disk tier meanwhile, and the shard was not copied to write it again"
                return job
            job.need = file_bytes(host, len(ids), self.key, self.rank, entry_id)
            if not self._fit(job.need, keep=name):
                job.error = (f"a {job.need / 2**30:.2f} GiB shard does not fit the {self.budget / 2**30:.2f} GiB "
                             f"budget (raise --disk-cache-gib)")
                return job
            self._writing[name] = job.need  # counted in `used` while written, invisible to get() until committed
            job.reserved = True
            self._stats.writes_in_flight += 1
        return job

    def write(self, job: "PendingWrite") -> None:
        """Write a reserved job's file (atomically: a temporary name renamed when complete, 0600). Plain file
        I/O outside the mutex, so it may run on a writer thread while lookups and loads go on. A failure is
        kept in job.error (no partial file is left); the job stays reserved until commit or abandon."""
        t0 = time.perf_counter()
        try:
            job.size = write_kv_file(job.path, job.host, job.ids, self.key, self.rank, job.entry_id)
            job.wrote = True
        except Exception as err:  # noqa: BLE001 (disk full, I/O error: the entry stays where it was)
            job.error = f"{type(err).__name__}: {err}"
        job.seconds = time.perf_counter() - t0
        job.done = True

    def commit(self, job: "PendingWrite") -> DiskEntry | None:
        """List a written job's file (every rank wrote its own: it may be promoted from now on)."""
        with self._mutex:
            self._release(job)
            old = self.entries.get(job.name)
            if old is not None and np.array_equal(old.ids, job.ids):
                self._touch(old)
                return old
            if not job.wrote:
                return None
            try:
                mtime = job.path.stat().st_mtime
            except OSError:  # removed behind our back: nothing to list
                return None
            host = job.host
            e = DiskEntry(job.name, job.path, job.ids, job.size, self.rank, job.entry_id, time.time(), mtime,
                          host.length, tuple((host.rows(i), i in host.windows) for i in host.layer_ids),
                          host.serves_from, context_len=host.context_len)
            self.entries[job.name] = e
            self._stats.demotions += 1
            self._stats.write_bytes += job.size
            self._stats.write_seconds_sum += job.seconds
            return e

    def abandon(self, job: "PendingWrite") -> None:
        """Give a job up (its write failed here or on another rank): its file, if this rank wrote one, is removed."""
        with self._mutex:
            self._release(job)
            if job.wrote and job.name not in self.entries:
                job.path.unlink(missing_ok=True)
                fsync_dir(self.path)
            if job.error is not None:
                self._stats.write_failures += 1
                log.warning("disk cache: writing %s failed on rank %d (%s); not kept on disk", job.name, self.rank,
                            job.error)

    def _release(self, job: "PendingWrite") -> None:
        if job.reserved:
            self._writing.pop(job.name, None)
            self._stats.writes_in_flight -= 1
            job.reserved = False

    def get(self, token_ids, min_tokens: int = 1, only=None) -> tuple[DiskEntry | None, int]:
        """The file sharing the longest prefix with `token_ids` and that length, capped at len - 1 (as
        ContextCache.lookup: one prompt token always runs); (None, 0) below `min_tokens`."""
        with self._mutex:
            self._stats.lookups += 1
            best, best_n = self.peek(token_ids, min_tokens, only)
            if best is None:
                return None, 0
            self._stats.hits += 1
            self._touch(best)
            return best, best_n

    def peek(self, token_ids, min_tokens: int = 1, only=None, whole: bool = False) -> tuple[DiskEntry | None, int]:
        """get without counting or touching (a scheduler scans its queue with it); `only`: the token
        digests (file names' middle part) to consider, e.g. those every rank holds; whole: see longest_prefix."""
        ids = np.asarray(token_ids, dtype=np.int64)
        with self._mutex:
            kept = [e for e in self.list() if only is None or e.name.split("-")[1] in only]  # own first: they win a tie
            return longest_prefix(kept, ids, min_tokens, whole)

    def holds(self, token_ids) -> bool:
        """Whether this rank's own file of exactly these tokens is listed: a demotion then writes nothing."""
        ids = np.asarray(token_ids, dtype=np.int64)
        with self._mutex:
            e = self.entries.get(file_name(self.key, ids, self.rank))
            return e is not None and np.array_equal(e.ids, ids)

    def entry_for(self, token_ids) -> DiskEntry | None:
        """This rank's file of exactly these tokens (what rank 0 found by prefix with `get`, sent to every rank
        as its token ids: each rank's own file has its own name), or None when this rank has none."""
        ids = np.asarray(token_ids, dtype=np.int64)
        with self._mutex:
            e = self.entries.get(file_name(self.key, ids, self.rank))
            if e is None:
                e = self.shared.get(token_digest(ids))
            return e if e is not None and np.array_equal(e.ids, ids) else None

    def load_host(self, entry: DiskEntry | str, verify: bool = True, arena: PinnedArena | None = None) -> HostKV:
        """Promote a file into a host buffer (a range of the host tier's pinned `arena` when it has room), digests
        checked (e.g. into the host tier). A damaged or vanished file is removed from the index (and the disk),
        logged, and raised as KVFileError: the caller re-prefills."""
        t0 = time.perf_counter()
        host = self._read(entry, verify, None, arena)
        self._stats.observe_reload(time.perf_counter() - t0)
        return host

    def _read(self, entry: DiskEntry | str, verify: bool, on_layer, arena: PinnedArena | None = None, read=None):
        """read_kv_host's HostKV of the entry's file (or read(path) -> (result, token ids)); errors: see load_host."""
        with self._mutex:
            name = entry if isinstance(entry, str) else entry.name
            e = self.entries.get(name) or next((s for s in self.shared.values() if s.name == name), None)
            if e is not None and e.shared:
                return self._rebuild(e, verify, arena)
            if e is None:
                raise KVFileError(self.path / str(entry if isinstance(entry, str) else entry.name), "io",
                                  "not in this disk tier (evicted or never written)")
            self._touch(e)
        try:
            if read is not None:
                host, ids = read(e.path)
                if host is None:
                    return None  # not read that way (e.g. a layer larger than a staging slot): the caller reads it
            else:
                host, ids, _ = read_kv_host(e.path, self.key, self.rank, verify, on_layer=on_layer, arena=arena,
                                            readers=self.readers, rate=self.read_limit)
            if not np.array_equal(ids, e.ids):
                raise KVFileError(e.path, "header", "the token ids changed since the file was indexed")
        except KVFileError as err:
            with self._mutex:
                self.entries.pop(e.name, None)
                if err.reason == "io" and not e.path.exists():
                    log.warning("disk cache: %s vanished (%s)", e.name, err.detail)
                else:
                    self._reject(e.path, err)
            raise
        return host

    def _rebuild(self, e: DiskEntry, verify: bool, arena: PinnedArena | None) -> HostKV:
        """A shared entry: its files read (digests checked) and this rank's shard rebuilt from them. A file that
        fails drops the entry from the index (the file is another layout's: left) and raises KVFileError."""
        parts, path = [], e.path
        try:
            for path, h in e.sources:
                host, ids, _ = read_kv_host(path, verify=verify, header=h)
                if not np.array_equal(ids, e.ids):
                    raise KVFileError(path, "header", "the token ids changed since the file was indexed")
                parts.append((host, h.heads))
            try:
                return reassemble(parts, e.positions, e.heads, arena)
            except ValueError as err:
                raise KVFileError(path, "layout", str(err)) from None
        except KVFileError as err:
            with self._mutex:
                self.shared.pop(e.name.split("-")[1], None)
            log.warning("disk cache: the %s entry %s cannot be rebuilt on rank %d (%s: %s); not reused", e.layout,
                        e.name.split("-")[1], self.rank, err.reason, err.detail)
            raise
        finally:
            for host, _ in parts:
                host.release()

    def load(self, entry: DiskEntry | str, device, extra_capacity: int = 0, verify: bool = True,
             arena: PinnedArena | None = None) -> KVCache:
        """Promote a file straight to `device`: a KVCache of exactly its rows plus `extra_capacity`, copies
        done; each layer's host -> device copy starts as soon as its bytes are read. The bytes pass through a
        range of the host tier's pinned `arena` when it has room (freed once the copies are done), else a
        pageable buffer, or, to a CUDA device, this tier's pinned staging slots. Raises KVFileError as load_host."""
        t0, loader = time.perf_counter(), []
        if self._staged(entry, device, arena):
            def staged(path):
                return read_kv_staged(path, device, self.staging, self.key, self.rank, extra_capacity, verify,
                                      self.readers, self.read_limit) or (None, None)
            kv = self._read(entry, verify, None, read=staged)
            if kv is not None:
                self._stats.observe_reload(time.perf_counter() - t0)
                return kv

        def start(host, i):
            if not loader:
                loader.append(DeviceLoader(host, device, extra_capacity))
            loader[0].copy_layer(i)
        host = self._read(entry, verify, start, arena)
        load = loader[0].finish() if loader else to_device(host, device, extra_capacity)
        load.synchronize()
        host.release()  # copies done: the arena range is free for the next move
        self._stats.observe_reload(time.perf_counter() - t0)
        return load.kv

    def _staged(self, entry: DiskEntry | str, device, arena: PinnedArena | None) -> bool:
        """Whether a load to `device` streams through the staging slots: a CUDA device, and no host arena
        range for the whole file (none, or too full)."""
        if self.staging is None or torch.device(device).type != "cuda":
            return False
        e = self.entries.get(entry if isinstance(entry, str) else entry.name)
        return arena is None or e is None or arena.largest_free() < e.nbytes

    def close(self) -> None:
        """Release the rank's lock (also released when the process exits)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self.staging is not None:
            self.staging.close()
            self.staging = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def load_everywhere(tier: DiskTier, token_ids, device, group=None, extra_capacity: int = 0) -> KVCache | None:
    """Every rank of `group` loads its own shard of the entry of exactly `token_ids` (what rank 0 found
    with `get`, sent to every rank), and they agree: each rank's KVCache when every rank loaded its own,
    None on every rank when any one could not (its file missing, damaged or evicted): then the caller
    re-prefills. One all-reduce (MIN) over `group`, a CPU (gloo) group such as the service's control
    group; every rank reaches it whatever happened locally, so a missing file never hangs the group."""
    kv = None
    e = tier.entry_for(token_ids)
    if e is not None:
        try:
            kv = tier.load(e, device, extra_capacity)
        except KVFileError:
            kv = None  # logged and removed by load; the others learn it below
    ok = torch.tensor([int(kv is not None)], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return kv if int(ok.item()) else None


# ---------------------------------------------------------------------------- offline: `starshard cache`
@dataclass
class FileInfo:
    """One shard file as `starshard cache list` shows it (header None: unreadable, `error` says why)."""

    path: Path
    key16: str
    rank: int
    nbytes: int
    mtime: float
    header: KVFileHeader | None
    error: str | None = None


def scan_dir(directory) -> list[FileInfo]:
    """Every shard file in a directory, any key or rank, headers checked (payloads not read)."""
    out = []
    for p in sorted(Path(directory).iterdir()):
        m = FILE_RE.match(p.name)
        if m is None:
            continue
        try:
            st = p.stat()
        except OSError:
            continue  # removed meanwhile
        try:
            h, err = read_header(p), None
        except KVFileError as e:
            h, err = None, f"{e.reason}: {e.detail}"
        out.append(FileInfo(p, m["key"], int(m["rank"]), st.st_size, st.st_mtime, h, err))
    return out


def _rank_of(name: str) -> int | None:
    """The rank of a shard file or of its temporary file; None for anything else."""
    tmp = TMP_RE.match(name)
    m = FILE_RE.match(tmp["name"] if tmp else name)
    return int(m["rank"]) if m else None


def purge_dir(directory, key_prefix: str | None = None) -> list[Path]:
    """Remove the shard files (all, or those whose key digest starts with `key_prefix`) and stale temporary
    files; refuses (DiskTierLocked) while a server holds a rank whose files would go. The paths removed."""
    directory = Path(directory)
    files = [p for p in sorted(directory.iterdir()) if _rank_of(p.name) is not None]
    if key_prefix is not None:
        files = [p for p in files if FILE_RE.match(p.name) and p.name.startswith(key_prefix)]
    ranks = sorted({_rank_of(p.name) for p in files})
    fds = []
    try:
        for r in ranks:
            fds.append(take_lock(directory, r))
        for p in files:
            p.unlink(missing_ok=True)
        fsync_dir(directory)
    finally:
        for fd in fds:
            os.close(fd)
    return files
