"""One rank's cache entry shard as a file, and back.

    prelude  MAGIC (8 bytes) | format version (u32 LE) | header length (u32 LE) | blake2b-128 of the header
    header   JSON: the cache key's fields and digest, rank, entry id, token count, the compute dtype, fp8,
             length, each layer's rows (`lengths`, in layer order), the window-trimmed layers' windows
             (`windows`, [layer, window] pairs) and the entry's `serves_from` (format version 2), next
             position, the token section, the writer's `layout` (format version 3: its tp and cp rank, the
             KV heads [start, stop) of the model's `kv_heads` it holds, the key digest it shares with other
             exact layouts, and the positions of a layer keeping every key, in stored order, as [start,
             stop) runs), `block_tokens`, and every payload section (layer, part, dtype, shape, offset,
             bytes, and one blake2b-128 per block of `block_tokens` rows: `blocks`)
    tokens   the token ids, int64, at a 4096-byte boundary
    payload  host_tier.HostKV's buffer as is (each layer's filled rows of pos, k, v and, for FP8, the e4m3
             bytes and their float32 scales), at a 4096-byte boundary: one large sequential read

A block is rows [j * block_tokens, (j + 1) * block_tokens) of a section: one byte range per (batch, KV
head) of k / v / scales (they are head-major: `block_ranges`), one range of pos. Its digest covers those
ranges in order, so a reader may fetch and check any block alone (`read_block`: the tail of an entry read
backward while its head is computed) and a whole-section read checks every block once its bytes are in.

Why blake2b per block: the standard library's fastest hash with a digest wide enough (128 bits) that
no damaged file passes by chance (crc32's 32 bits would, among millions of blocks); the reader hashes
blocks on a thread pool (hashlib releases the GIL) while the next ones are still being read, so
verifying costs little beyond the read itself.

Files of format version 2 and older are refused as "version" (the disk tier logs why and leaves them;
`starshard cache purge` removes them).

Writes are atomic: a temporary name in the same directory, written, flushed and fsynced, renamed over
the final name, then the directory fsynced; a crash leaves the old file or none, never half of one.
Files are created 0600 (they hold users' documents in another form). Every failure to read is a
KVFileError with a `reason`; the caller skips the file, it never crashes.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from starshard.engine.kv_cache import KVCache
from starshard.serving.cache_key import FORMAT_VERSION, CacheKey
from starshard.serving.disk_read import DEFAULT_READERS, ShortRead, read_file
from starshard.serving.host_tier import (
    PARTS,
    STORE_DTYPES,
    DeviceLoader,
    HostKV,
    Section,
    host_buffer,
    layout,
    own,
    to_device,
    to_host,
)
from starshard.serving.kv_layout import from_runs, head_range, runs
from starshard.serving.pinned_arena import PinnedArena

MAGIC = b"SSKVSHRD"
PRELUDE = struct.Struct("<8sII16s")  # magic, version, header length, header digest
PAGE = 4096
READ_CHUNK = 64 << 20  # bytes per read call: large and sequential
MAX_HEADER = 64 << 20  # a header past this is damage, not a model (a few hundred bytes per layer)
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
BLOCK_TOKENS = 4096  # rows per digest: a 128K-token entry's header holds 32 per section
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")


class KVFileError(Exception):
    """A file that cannot be used. reason: truncated | magic | version | header | checksum | key | rank | io |
    layout (another layout's files from which this rank's shard cannot be rebuilt)."""

    def __init__(self, path, reason: str, detail: str):
        self.path, self.reason, self.detail = Path(path), reason, detail
        super().__init__(f"{path}: {reason}: {detail}")


def _hash(view) -> str:
    return hashlib.blake2b(view, digest_size=16).hexdigest()


def _page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def _offsets(header_len: int, n_tokens: int) -> tuple[int, int]:
    """Where the token ids and the payload start, from the header's length and the token count."""
    tokens = _page(PRELUDE.size + header_len)
    return tokens, _page(tokens + 8 * n_tokens)


def _u8(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _row_axis(s: Section) -> int:
    return 0 if s.part == "pos" else 2  # pos [n]; k, v [B, H, n, D]; scales [B, H, n]


def n_blocks(s: Section, block_tokens: int) -> int:
    return max(1, -(-s.shape[_row_axis(s)] // block_tokens))


def block_ranges(s: Section, j: int, block_tokens: int) -> list[tuple[int, int]]:
    """(offset from the payload's start, bytes) of the ranges holding rows [j * block_tokens, (j + 1) *
    block_tokens) of section `s`, in the order its digest covers them (one per leading index)."""
    axis = _row_axis(s)
    n = s.shape[axis]
    lead, tail = math.prod(s.shape[:axis]), math.prod(s.shape[axis + 1:])
    row = tail * STORE_DTYPES[s.dtype].itemsize
    a, b = j * block_tokens, min(n, (j + 1) * block_tokens)
    return [(s.offset + i * n * row + a * row, (b - a) * row) for i in range(lead)]


def _hash_ranges(buf, ranges, base: int = 0) -> str:
    h = hashlib.blake2b(digest_size=16)
    for off, n in ranges:
        h.update(buf[off - base:off - base + n])
    return h.hexdigest()


def _section_blocks(buf, s: Section, block_tokens: int) -> list[str]:
    """Every block digest of a section whose bytes are in `buf` (the payload)."""
    return [_hash_ranges(buf, block_ranges(s, j, block_tokens)) for j in range(n_blocks(s, block_tokens))]


def submit_digests(pool, buf, s: Section, block_tokens: int) -> list:
    """One hashing task per block of section `s` (its bytes in `buf`): a section is a layer's whole k or v, so
    a pool given sections alone hashes as few of them at once as a window holds (two per layer), slower
    than the disk reads."""
    return [pool.submit(_hash_ranges, buf, block_ranges(s, j, block_tokens)) for j in range(n_blocks(s, block_tokens))]


def check_digests(path, s: Section, want, futures) -> None:
    """Raise KVFileError(checksum) naming the first block of `s` whose digest (a submit_digests task) differs."""
    for j, (fut, w) in enumerate(zip(futures, want, strict=True)):
        if fut.result() != w:
            raise KVFileError(path, "checksum",
                              f"layer {s.layer} {s.part} block {j}: the payload's digest does not match")


@dataclass(frozen=True)
class KVFileHeader:
    key: dict  # CacheKey.fields()
    key_digest: str
    rank: int
    entry_id: int | None
    n_tokens: int
    tokens_offset: int
    tokens_digest: str
    dtype: str  # compute dtype
    fp8: bool
    length: int
    next_position: int
    payload_offset: int
    payload_bytes: int
    sections: tuple[Section, ...]
    block_digests: tuple[tuple[str, ...], ...]  # per section, one per block of block_tokens rows
    created: float
    lengths: tuple[int, ...] = ()  # each layer's rows, in the sections' layer order
    windows: tuple[tuple[int, int], ...] = ()  # (layer, window) of the window-trimmed layers
    serves_from: int = 0  # the cache entry's: a trimmed entry serves only prompts sharing that many tokens
    block_tokens: int = BLOCK_TOKENS
    layout: dict | None = None  # tp_rank, cp_rank, heads [start, stop), kv_heads, share, positions (runs)
    context_len: int | None = None  # the entry's document part (a split reload of a Star file lays its head out by it)

    @property
    def heads(self) -> tuple[int, int] | None:
        """The KV heads [start, stop) of the model's this file holds (None: unknown, shared with no other layout)."""
        h = (self.layout or {}).get("heads")
        return None if h is None else (int(h[0]), int(h[1]))

    @property
    def share(self) -> str | None:
        return (self.layout or {}).get("share")

    def positions(self) -> np.ndarray:
        """The positions a layer keeping every key holds, in stored order."""
        return from_runs((self.layout or {}).get("positions") or [])

    @property
    def layer_ids(self) -> list[int]:
        return list(dict.fromkeys(s.layer for s in self.sections))

    @property
    def file_bytes(self) -> int:
        return self.payload_offset + self.payload_bytes

    def cache_key(self) -> CacheKey:
        return CacheKey.from_fields(self.key)

    def to_json(self) -> dict:
        skip = ("sections", "block_digests", "tokens_offset", "payload_offset")  # offsets: derived (_offsets)
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in skip}
        d["sections"] = [dict(layer=s.layer, part=s.part, dtype=s.dtype, shape=list(s.shape), offset=s.offset,
                              nbytes=s.nbytes, blocks=list(h)) for s, h in zip(self.sections, self.block_digests)]
        d["lengths"], d["windows"] = list(self.lengths), [list(w) for w in self.windows]
        return d


def _parse_layout(raw: dict) -> dict:
    heads = raw["heads"]
    return dict(tp_rank=int(raw["tp_rank"]), cp_rank=int(raw["cp_rank"]),
                heads=None if heads is None else [int(heads[0]), int(heads[1])],
                kv_heads=None if raw["kv_heads"] is None else int(raw["kv_heads"]),
                share=None if raw["share"] is None else str(raw["share"]),
                positions=[[int(a), int(b)] for a, b in raw["positions"]])


def _parse_header(path, raw: dict, file_size: int, header_len: int) -> KVFileHeader:
    """A header from its JSON, every field checked against the others and the file's size."""
    def bad(detail):
        return KVFileError(path, "header", detail)
    try:
        sections = tuple(Section(int(s["layer"]), str(s["part"]), str(s["dtype"]), tuple(int(x) for x in s["shape"]),
                                 int(s["offset"]), int(s["nbytes"])) for s in raw["sections"])
        digests = tuple(tuple(str(x) for x in s["blocks"]) for s in raw["sections"])
        tokens_offset, payload_offset = _offsets(header_len, int(raw["n_tokens"]))
        h = KVFileHeader(key=dict(raw["key"]), key_digest=str(raw["key_digest"]), rank=int(raw["rank"]),
                         entry_id=None if raw.get("entry_id") is None else int(raw["entry_id"]),
                         n_tokens=int(raw["n_tokens"]), tokens_offset=tokens_offset,
                         tokens_digest=str(raw["tokens_digest"]), dtype=str(raw["dtype"]), fp8=bool(raw["fp8"]),
                         length=int(raw["length"]), next_position=int(raw["next_position"]),
                         payload_offset=payload_offset, payload_bytes=int(raw["payload_bytes"]),
                         sections=sections, block_digests=digests, created=float(raw["created"]),
                         lengths=tuple(int(n) for n in raw["lengths"]),
                         windows=tuple((int(i), int(w)) for i, w in raw["windows"]),
                         serves_from=int(raw["serves_from"]), block_tokens=int(raw["block_tokens"]),
                         layout=_parse_layout(raw["layout"]),
                         context_len=None if raw.get("context_len") is None else int(raw["context_len"]))
    except (KeyError, TypeError, ValueError) as e:
        raise bad(f"missing or malformed field ({type(e).__name__}: {e})") from None
    if h.block_tokens < 1:
        raise bad(f"block_tokens {h.block_tokens} < 1")
    if any(len(d) != n_blocks(s, h.block_tokens) for s, d in zip(sections, digests)):
        raise bad("a section's block digests disagree with its rows")
    if h.dtype not in COMPUTE_DTYPES:
        raise bad(f"compute dtype {h.dtype!r} is not one of {COMPUTE_DTYPES}")
    if not sections:
        raise bad("no sections")
    if h.n_tokens < 0 or h.length < 0 or any(n < 0 for n in h.lengths):
        raise bad("negative token count or length")
    layer_ids = h.layer_ids
    if len(h.lengths) != len(layer_ids):
        raise bad(f"{len(h.lengths)} layer lengths for {len(layer_ids)} layers")
    windows = dict(h.windows)
    if len(windows) != len(h.windows) or not set(windows) <= set(layer_ids) or any(w < 1 for w in windows.values()):
        raise bad(f"windows {list(h.windows)}: not one window >= 1 per trimmed layer of {layer_ids}")
    if any(n != h.length for i, n in zip(layer_ids, h.lengths) if i not in windows):
        raise bad(f"a layer keeping every key holds other than {h.length} rows")
    if len(h.positions()) != h.length:
        raise bad(f"the layout's positions name {len(h.positions())} rows, the layers keeping every key hold {h.length}")
    if not 0 <= h.serves_from <= h.n_tokens:
        raise bad(f"serves_from {h.serves_from} is not within the file's {h.n_tokens} tokens")
    if h.context_len is not None and not 1 <= h.context_len <= h.n_tokens:
        raise bad(f"context_len {h.context_len} is not within the file's {h.n_tokens} tokens")
    first_k = next((s for s in sections if s.part == "k"), None)
    if first_k is None or len(first_k.shape) != 4:
        raise bad("no 4-d k section")
    b, heads, _, d = first_k.shape
    expect, size = layout(layer_ids, b, heads, d, dict(zip(layer_ids, h.lengths)), getattr(torch, h.dtype), h.fp8)
    if expect != sections or size != h.payload_bytes:  # shapes, dtypes, offsets, sizes all as the layout says
        raise bad("sections disagree with the layout of their shapes (damaged header)")
    if any(s.dtype not in STORE_DTYPES or s.part not in PARTS for s in sections):
        raise bad("unknown section dtype or part")
    if file_size < h.file_bytes:
        raise KVFileError(path, "truncated", f"{file_size} bytes, the header promises {h.file_bytes}")
    if file_size > h.file_bytes:
        raise bad(f"{file_size} bytes, the header promises {h.file_bytes} (trailing bytes)")
    return h


def read_header(path, key: CacheKey | None = None, rank: int | None = None) -> KVFileHeader:
    """The checked header of a file (magic, version, header digest, layout, size; the key and rank when
    given). Reads a few KiB."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            pre = f.read(PRELUDE.size)
            if len(pre) < PRELUDE.size:
                raise KVFileError(path, "truncated", f"{len(pre)} bytes, shorter than the {PRELUDE.size}-byte prelude")
            magic, version, hlen, hdigest = PRELUDE.unpack(pre)
            if magic != MAGIC:
                raise KVFileError(path, "magic", f"starts with {magic!r}, not {MAGIC!r}: not a starshard KV file")
            if version != FORMAT_VERSION:
                raise KVFileError(path, "version", f"format version {version}, this starshard reads {FORMAT_VERSION}")
            if hlen > MAX_HEADER:
                raise KVFileError(path, "header", f"header length {hlen} is implausible")
            raw = f.read(hlen)
    except OSError as e:
        raise KVFileError(path, "io", str(e)) from None
    if len(raw) < hlen:
        raise KVFileError(path, "truncated", "the header is cut short")
    if hashlib.blake2b(raw, digest_size=16).digest() != hdigest:
        raise KVFileError(path, "checksum", "the header's digest does not match")
    try:
        parsed = json.loads(raw)
    except ValueError as e:
        raise KVFileError(path, "header", f"not JSON ({e})") from None
    h = _parse_header(path, parsed, size, hlen)
    if key is not None and h.key != key.fields():
        diff = sorted(k for k in set(h.key) | set(key.fields()) if h.key.get(k) != key.fields().get(k))
        raise KVFileError(path, "key", f"written for another model or layout (differs in {', '.join(diff)})")
    if key is not None and h.key_digest != key.digest:
        raise KVFileError(path, "key", "the key digest does not match its fields")
    if rank is not None and h.rank != rank:
        raise KVFileError(path, "rank", f"rank {h.rank}'s shard, not rank {rank}'s")
    return h


def read_tokens(path, header: KVFileHeader) -> np.ndarray:
    """The token ids (int64), checked against their digest."""
    try:
        with open(path, "rb") as f:
            f.seek(header.tokens_offset)
            raw = f.read(8 * header.n_tokens)
    except OSError as e:
        raise KVFileError(path, "io", str(e)) from None
    if len(raw) < 8 * header.n_tokens:
        raise KVFileError(path, "truncated", "the token section is cut short")
    if _hash(raw) != header.tokens_digest:
        raise KVFileError(path, "checksum", "the token ids' digest does not match")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64)


def shard_layout(host: HostKV, key: CacheKey, rank: int) -> dict:
    """The header's `layout` of `rank`'s shard under `key`: its tp / cp rank, the KV heads it holds (unknown
    when the key names no KV head count and tp > 1 with one head a rank: split or replicated, it cannot
    tell; such a file is shared with no other layout), the share digest and its positions."""
    tp_rank, cp_rank = rank % key.tp, rank // key.tp % key.cp
    local = host.shape()[1]
    total = key.kv_heads or (local * key.tp if key.tp == 1 or local > 1 else None)
    heads = None if total is None else list(head_range(total, key.tp, tp_rank))
    if heads is not None and heads[1] - heads[0] != local:
        raise ValueError(f"write_kv_file: the shard holds {local} KV heads, tp rank {tp_rank} of {total} holds "
                         f"{heads[1] - heads[0]}")
    full = [i for i in host.layer_ids if i not in host.windows] or host.layer_ids
    return dict(tp_rank=tp_rank, cp_rank=cp_rank, heads=heads, kv_heads=total,
                share=key.share_digest if heads is not None else None, positions=runs(host.layer(full[0]).pos.numpy()))


def _header_bytes(host: HostKV, n_tokens: int, tokens_digest: str, digests, key: CacheKey, rank: int,
                  entry_id: int | None) -> bytes:
    # The offsets follow from the header's length (the reader derives them the same way: _offsets).
    h = KVFileHeader(key=key.fields(), key_digest=key.digest, rank=int(rank), entry_id=entry_id, n_tokens=n_tokens,
                     tokens_offset=0, tokens_digest=tokens_digest, dtype=str(host.dtype).removeprefix("torch."),
                     fp8=host.fp8, length=host.length, next_position=host.next_position, payload_offset=0,
                     payload_bytes=host.nbytes, sections=host.sections, block_digests=tuple(map(tuple, digests)),
                     created=int(time.time()),  # whole seconds: a fixed width, so file_bytes is exact
                     lengths=tuple(host.rows(i) for i in host.layer_ids), windows=tuple(sorted(host.windows.items())),
                     serves_from=host.serves_from, block_tokens=BLOCK_TOKENS, layout=shard_layout(host, key, rank),
                     context_len=host.context_len)
    return json.dumps(h.to_json()).encode()


def file_bytes(host: HostKV, n_tokens: int, key: CacheKey, rank: int, entry_id: int | None = None) -> int:
    """The size write_kv_file gives this shard (what a budget must make room for before writing)."""
    blanks = [["0" * 32] * n_blocks(s, BLOCK_TOKENS) for s in host.sections]
    hdr = _header_bytes(host, n_tokens, "0" * 32, blanks, key, rank, entry_id)
    return _offsets(len(hdr), n_tokens)[1] + host.nbytes


def write_kv_file(path, kv: KVCache | HostKV, token_ids, key: CacheKey, rank: int, entry_id: int | None = None) -> int:
    """Write one rank's shard atomically (0600); returns the file's size. A KVCache is copied to host first."""
    path = Path(path)
    host = kv if isinstance(kv, HostKV) else to_host(kv)
    host.synchronize()
    tokens = np.ascontiguousarray(np.asarray(token_ids, dtype="<i8"))
    buf = _u8(host.buffer)
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        digests = list(pool.map(lambda s: _section_blocks(buf, s, BLOCK_TOKENS), host.sections))
    tokens_bytes = tokens.tobytes()
    hdr = _header_bytes(host, len(tokens), _hash(tokens_bytes), digests, key, rank, entry_id)
    tokens_offset, payload_offset = _offsets(len(hdr), len(tokens))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(PRELUDE.pack(MAGIC, FORMAT_VERSION, len(hdr), hashlib.blake2b(hdr, digest_size=16).digest()))
            f.write(hdr)
            f.write(b"\0" * (tokens_offset - f.tell()))
            f.write(tokens_bytes)
            f.write(b"\0" * (payload_offset - f.tell()))
            for start in range(0, len(buf), READ_CHUNK):
                f.write(buf[start:start + READ_CHUNK])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return payload_offset + host.nbytes


def block_bytes(s: Section, j: int, block_tokens: int) -> int:
    """The bytes of block j of section `s` (what read_block reads)."""
    return sum(n for _, n in block_ranges(s, j, block_tokens))


def read_block(path, header: KVFileHeader, section: int, j: int, into: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [j * block_tokens, ...) of section `section` (an index into header.sections) alone, checked
    against that block's digest: [B, H, rows, D] of k / v, [B, H, rows] of a scale, [rows] of pos, in the
    section's store dtype. A few ranges read (one per batch row and KV head), never the whole section.
    `into`: a uint8 CPU tensor of at least block_bytes (pinned memory, say) the block is read into and
    returned as a view of; default: new pageable memory."""
    s = header.sections[section]
    if not 0 <= j < n_blocks(s, header.block_tokens):
        raise IndexError(f"block {j} of a {n_blocks(s, header.block_tokens)}-block section")
    ranges = block_ranges(s, j, header.block_tokens)
    size = sum(n for _, n in ranges)
    if into is not None and (into.dtype != torch.uint8 or into.device.type != "cpu" or into.numel() < size
                             or not into.is_contiguous()):
        raise ValueError(f"read_block: `into` must be a contiguous uint8 CPU tensor of >= {size} bytes")
    out = bytearray(size) if into is None else into[:size].numpy()
    view, at = memoryview(out).cast("B"), 0
    try:
        with open(path, "rb", buffering=0) as f:
            for off, n in ranges:
                got = os.preadv(f.fileno(), [view[at:at + n]], header.payload_offset + off) if n else 0
                if got < n:
                    raise KVFileError(path, "truncated", f"layer {s.layer} {s.part} block {j} is cut short")
                at += n
    except OSError as e:
        raise KVFileError(path, "io", str(e)) from None
    if hashlib.blake2b(out, digest_size=16).hexdigest() != header.block_digests[section][j]:
        raise KVFileError(path, "checksum", f"layer {s.layer} {s.part} block {j}: the digest does not match")
    axis = _row_axis(s)
    rows = min(s.shape[axis], (j + 1) * header.block_tokens) - j * header.block_tokens
    shape = s.shape[:axis] + (rows,) + s.shape[axis + 1:]
    if not size:
        return torch.empty(shape, dtype=STORE_DTYPES[s.dtype])
    raw = torch.frombuffer(out, dtype=torch.uint8) if into is None else into[:size]
    return raw.view(STORE_DTYPES[s.dtype]).view(shape)


def fsync_dir(path) -> None:
    """Make a rename or unlink in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_kv_host(path, key: CacheKey | None = None, rank: int | None = None, verify: bool = True,
                 header: KVFileHeader | None = None,
                 on_layer: Callable[[HostKV, int], None] | None = None,
                 arena: PinnedArena | None = None, readers: int = DEFAULT_READERS,
                 rate: float | None = None) -> tuple[HostKV, np.ndarray, KVFileHeader]:
    """Read a shard into a host buffer (a range of the host tier's pinned `arena` when it has room, else
    pageable: host_tier.host_buffer) by `readers` parallel sequential readers (disk_read.py; `rate`: paced to
    at most that many bytes/s, a benchmark's slow disk), each section's digest checked
    on a thread pool as soon as its bytes are in (verify=False skips them). (HostKV, token ids, header).
    on_layer(host, i) is called as soon as layer i's bytes are in, before the digests are known (to start
    its copy to the device: host_tier.DeviceLoader); a digest that fails raises after it, and the caller
    drops what it copied."""
    path = Path(path)
    h = header or read_header(path, key, rank)
    tokens = read_tokens(path, h)
    host = own(HostKV(host_buffer(h.payload_bytes, arena), h.sections, getattr(torch, h.dtype), h.fp8, h.length,
                      h.next_position, dict(h.windows), h.serves_from, context_len=h.context_len), arena)
    buf = _u8(host.buffer)
    pending, futures = list(zip(h.sections, h.block_digests)), []
    layer_end = {}
    for s in h.sections:
        layer_end[s.layer] = max(layer_end.get(s.layer, 0), s.offset + s.nbytes)
    layers = list(layer_end.items())
    try:
        with ThreadPoolExecutor(HASH_THREADS) as pool:
            for done in read_file(path, h.payload_offset, h.payload_bytes, buf, readers, rate=rate):
                while verify and pending and pending[0][0].offset + pending[0][0].nbytes <= done:
                    s, want = pending.pop(0)
                    futures.append((s, want, submit_digests(pool, buf, s, h.block_tokens)))
                while on_layer is not None and layers and layers[0][1] <= done:
                    on_layer(host, layers.pop(0)[0])
            for s, want, futs in futures:
                check_digests(path, s, want, futs)
    except ShortRead as e:
        raise KVFileError(path, "truncated", f"the payload ends after {e.done} of {h.payload_bytes} bytes") from None
    except OSError as e:
        raise KVFileError(path, "io", str(e)) from None
    return host, tokens, h


def read_kv_file(path, device, key: CacheKey | None = None, rank: int | None = None, extra_capacity: int = 0,
                 verify: bool = True) -> tuple[KVCache, np.ndarray]:
    """A file's shard as a KVCache of exactly its rows (plus `extra_capacity`) on `device`, copies done,
    and its token ids."""
    loader = []

    def start(host, i):  # each layer's copy to the device overlaps the rest of the read
        if not loader:
            loader.append(DeviceLoader(host, device, extra_capacity))
        loader[0].copy_layer(i)
    host, tokens, _ = read_kv_host(path, key, rank, verify, on_layer=start)
    load = loader[0].finish() if loader else to_device(host, device, extra_capacity)
    load.synchronize()
    return load.kv, tokens
