"""`starshard cache list|purge --disk-cache-dir DIR`: what a server's disk tier holds, and removing it.

    starshard cache list --disk-cache-dir /nvme/kv                 # files per cache key: its layout, which
                                                                   # layouts can read it; rank, tokens, bytes, age
    starshard cache purge --disk-cache-dir /nvme/kv --key 3f2a9c   # one model / layout's files
    starshard cache purge --disk-cache-dir /nvme/kv --all          # everything, damaged files included

Listing reads the files' headers only. An exact layout's files (one process, tp, cp with ring / Ulysses / USP)
are read by every exact layout of the same model, dtype and FP8 parts (serving/kv_layout.py); Star's only by
its own layout. Purging takes each affected rank's lock first, so it refuses
(naming the lock) while a server uses the directory.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from starshard.serving.disk_tier import DiskTierLocked, FileInfo, purge_dir, scan_dir

DIR_HELP = ("the directory a server's --disk-cache-dir names (one directory per node, or one on a shared "
            "filesystem: the files of every rank and key in it are shown)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="List or purge the disk tier of the context cache (--disk-cache-dir): "
                                            "one file per cached document, rank and cache key.")
    sub = p.add_subparsers(dest="action", required=True, metavar="{list,purge}")
    ls = sub.add_parser("list", help="the files per cache key: its layout, which layouts can read it; rank, "
                                     "tokens, bytes, age (reads headers only)",
                        description="The files per cache key (model, dtype, FP8 parts, layout, format version) and "
                                    "which layouts can read them; per file its rank, KV heads, tokens, bytes, age; "
                                    "files that fail their header check are listed with the reason (damaged, or "
                                    "another format version).")
    ls.add_argument("--disk-cache-dir", required=True, type=Path, help=DIR_HELP)
    ls.add_argument("--json", action="store_true", help="print one JSON object per file instead of the table")
    pg = sub.add_parser("purge", help="remove files: --all, or one cache key's (--key HEX)",
                        description="Remove disk cache files. Refused while a server holds the lock of a rank "
                                    "whose files would go (stop it first).")
    pg.add_argument("--disk-cache-dir", required=True, type=Path, help=DIR_HELP)
    what = pg.add_mutually_exclusive_group(required=True)
    what.add_argument("--all", action="store_true",
                      help="every shard file of every key and rank, damaged and temporary files included")
    what.add_argument("--key", metavar="HEX",
                      help="only the files whose cache key digest starts with HEX (4 to 16 hex digits: the key "
                           "column of `starshard cache list`)")
    return p


def age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def describe_key(info: FileInfo) -> str:
    if info.header is None:
        return "damaged"
    k = info.header.cache_key()
    return f"model {k.model[:12]} {k.dtype} fp8={','.join(k.fp8) or 'none'} {k.layout()} v{k.format_version}"


def readers(info: FileInfo) -> str | None:
    """Which layouts can read the file's entry (None: unreadable)."""
    if info.header is None:
        return None
    if info.header.share is None and info.header.cache_key().share_digest is not None:
        return "this layout only (its file does not say which KV heads it holds)"
    return info.header.cache_key().readers()


def heads(info: FileInfo) -> str:
    h = info.header.heads if info.header is not None else None
    return "" if h is None else f"heads {h[0]}-{h[1] - 1}"


def list_files(directory: Path, as_json: bool) -> int:
    infos, now = scan_dir(directory), time.time()
    if as_json:
        for i in infos:
            print(json.dumps(dict(file=i.path.name, key=i.key16, rank=i.rank, bytes=i.nbytes, age_s=now - i.mtime,
                                  tokens=None if i.header is None else i.header.n_tokens,
                                  layout=describe_key(i), read_by=readers(i),
                                  heads=None if i.header is None else i.header.heads, error=i.error)))
        return 0
    if not infos:
        print(f"{directory}: no disk cache files")
        return 0
    for key in dict.fromkeys(i.key16 for i in infos):
        group = [i for i in infos if i.key16 == key]
        good = [i for i in group if i.header is not None]
        print(f"key {key}  {describe_key(good[0]) if good else 'damaged'}  "
              f"({len(group)} files, {sum(i.nbytes for i in group) / 2**30:.2f} GiB)")
        if good:
            print(f"  read by {readers(good[0])}")
        for i in group:
            tokens = "damaged" if i.header is None else f"{i.header.n_tokens} tokens"
            line = (f"  rank {i.rank:<3} {heads(i):>10} {tokens:>16} {i.nbytes / 2**20:12.1f} MiB  "
                    f"used {age(now - i.mtime)} ago  {i.path.name}")
            print(line + (f"  ({i.error})" if i.error else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.disk_cache_dir.is_dir():
        print(f"starshard cache: error: --disk-cache-dir {args.disk_cache_dir} is not a directory", file=sys.stderr)
        return 2
    if args.action == "list":
        return list_files(args.disk_cache_dir, args.json)
    if args.key is not None and not re.fullmatch(r"[0-9a-f]{4,16}", args.key):
        print(f"starshard cache: error: --key {args.key!r} must be 4 to 16 lowercase hex digits (the key column of "
              "`starshard cache list`)", file=sys.stderr)
        return 2
    try:
        removed = purge_dir(args.disk_cache_dir, None if args.all else args.key)
    except DiskTierLocked as e:
        print(f"starshard cache: error: {e}", file=sys.stderr)
        return 1
    print(f"removed {len(removed)} file(s) from {args.disk_cache_dir}, "
          f"{'all keys' if args.all else f'key {args.key}'}")
    return 0
