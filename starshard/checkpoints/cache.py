"""Checkpoints converted once into the cache dir ($STARSHARD_CACHE, default ~/.cache/starshard).

    ckpt = gguf_checkpoint(Path("model.gguf"))   # converts on the first load, seconds on every later one

A user's GGUF is keyed by its size, mtime and the sha256 of its first HEADER_BYTES (the metadata and
the tensor table, never the whole file): a file that is touched or rewritten converts again.

An entry is built in a `.partial` dir and renamed into place. It is loaded without hashing its tensors
again only while its files keep the sizes and mtimes recorded in its STAMP when it was last verified
(its build hashed every tensor as it wrote it): a 6 GB float32 model then loads in seconds. An entry
whose files changed, or that has no stamp, has every tensor checked against its manifest's sha256
first; one that fails, or is incomplete (an interrupted build, a missing or truncated shard, a broken
manifest), is rebuilt, never loaded."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path

from starshard.checkpoints.convert import MANIFEST, convert, gguf_array_items
from starshard.checkpoints.load import CheckpointError, load_shard

log = logging.getLogger(__name__)

HEADER_BYTES = 4 << 20  # what the key hashes: the GGUF header of any model we run fits in it
STAMP = "stamp.json"  # {file: [size, mtime_ns]} of a verified entry
# The first load's estimate: transformers' reader parses the metadata arrays one element at a time, twice
# (config, weights; ~15 us an element each), then dequantizing and writing float32 shards follows the
# file's size. Fitted to first loads in a new process on 2 CPU cores (2026-12-07): SmolLM2-135M Q4_1
# (98 MB, 147K array elements) 19.6 s, Qwen2.5-Coder-1.5B Q4_K_M (1.1 GB, 455K) 48.5 s; it gives 42 s for
# Gemma 3 270M Q4_K_M (253 MB, a 262K vocabulary), measured ~38 s before.
CONVERT_S_FIXED = 13.0
CONVERT_S_PER_MB = 0.02
CONVERT_S_PER_ITEM = 3e-5


def cache_dir() -> Path:
    return Path(os.environ.get("STARSHARD_CACHE", Path.home() / ".cache" / "starshard"))


def convert_seconds(nbytes: int, items: int) -> int:
    """Rough seconds a first load takes to convert a GGUF of `nbytes` whose metadata arrays hold `items`
    elements (gguf_array_items; the log line's estimate)."""
    return int(round(CONVERT_S_FIXED + CONVERT_S_PER_MB * nbytes / 1e6 + CONVERT_S_PER_ITEM * items, -1))


def gguf_key(gguf: Path) -> str:
    """The cache key of a GGUF file: its size, mtime and the sha256 of its first HEADER_BYTES."""
    st = gguf.stat()
    with open(gguf, "rb") as f:
        head = hashlib.sha256(f.read(HEADER_BYTES)).hexdigest()
    return hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:{head}".encode()).hexdigest()[:16]


def gguf_checkpoint(gguf: str | Path, *, progress: bool = True) -> Path:
    """The float32, tp=1 checkpoint of a GGUF file, converted once into the cache dir."""
    gguf = Path(gguf).resolve()
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", gguf.stem)[:64]
    out = cache_dir() / "gguf" / f"{stem}-{gguf_key(gguf)}"

    def build(tmp: Path) -> None:
        eta = convert_seconds(gguf.stat().st_size, gguf_array_items(gguf))
        say(f"converting {gguf} once (~{eta} s) into {out}", progress)
        prune(out.parent, gguf)
        with quiet_transformers(not progress):
            convert(out=tmp, gguf=gguf, dtype="float32", progress=progress)

    return converted_once(out, build)


def prune(root: Path, gguf: Path) -> None:
    """Remove the entries no load can hit again: those of `gguf` before it changed, and those whose file
    is gone (a recreated file has another mtime, so another key). An entry another process holds
    (building it) is left."""
    for manifest in root.glob(f"*/{MANIFEST}"):
        entry = manifest.parent
        try:
            source = Path(json.loads(manifest.read_text())["source"]["path"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if source != gguf and source.exists():
            continue
        with open(root / (entry.name + ".lock"), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(entry, ignore_errors=True)
        (root / (entry.name + ".lock")).unlink(missing_ok=True)


def converted_once(out: Path, build: Callable[[Path], None]) -> Path:
    """`out` if it holds a sound checkpoint (module doc), else `build(tmp)` then `tmp` renamed to `out`,
    under a file lock (several ranks or processes may start at once: one builds, the others wait)."""
    if is_stamped(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / (out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_stamped(out) or (is_complete(out) and verify(out)):
            return out
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)  # what an interrupted build left
        try:
            build(tmp)
        except BaseException:  # a refused model, an interrupt: nothing half-built stays
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if not is_complete(tmp):
            raise RuntimeError(f"converting into {tmp} left an incomplete checkpoint")
        stamp(tmp)  # the build hashed every tensor it wrote
        shutil.rmtree(out, ignore_errors=True)  # a damaged entry
        tmp.rename(out)  # keeps the files' mtimes: the stamp holds
    return out


def _files(ckpt: Path) -> list[str]:
    manifest = json.loads((ckpt / MANIFEST).read_text())
    return [MANIFEST, *(entry["file"] for entry in manifest["shards"].values())]


def _stats(ckpt: Path) -> dict[str, list[int]]:
    return {f: [(ckpt / f).stat().st_size, (ckpt / f).stat().st_mtime_ns] for f in _files(ckpt)}


def stamp(ckpt: Path) -> None:
    (ckpt / STAMP).write_text(json.dumps(_stats(ckpt)))


def is_stamped(ckpt: Path) -> bool:
    """Whether `ckpt` was verified and its files have not changed since (sizes and mtimes)."""
    try:
        return json.loads((ckpt / STAMP).read_text()) == _stats(ckpt)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def verify(ckpt: Path) -> bool:
    """Every tensor against the manifest's sha256; stamps the entry where all match."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    try:
        for key in manifest["shards"]:
            t, p = (int(x) for x in key.removeprefix("tp").split("-pp"))
            load_shard(ckpt, manifest, t, p)
    except CheckpointError as e:
        log.warning("%s; converting again", e)
        return False
    stamp(ckpt)
    return True


def is_complete(ckpt: Path) -> bool:
    """Whether `ckpt` holds a whole checkpoint: a readable manifest and every shard it lists at the
    length its own header gives (cheap: no tensor is read)."""
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
        return manifest.get("format") == "starshard" and all(
            _shard_whole(ckpt / entry["file"]) for entry in manifest["shards"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _shard_whole(path: Path) -> bool:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            return False
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    return path.stat().st_size == 8 + n + end


def say(message: str, progress: bool) -> None:
    """A one-off notice: on stderr where progress is shown, else through logging (a --json run's
    stdout carries only its JSON)."""
    if progress:
        print(f"[starshard] {message}", file=sys.stderr, flush=True)
    else:
        log.info("%s", message)


@contextlib.contextmanager
def quiet_transformers(quiet: bool):
    """transformers' progress bars off while `quiet`: its own (loading weights) and the GGUF reader's
    de-quantizing bar, a plain tqdm its logging settings do not reach."""
    if not quiet:
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.utils import logging as hf_logging

    was, bar = hf_logging.is_progress_bar_enabled(), getattr(reader, "tqdm", None)
    hf_logging.disable_progress_bar()
    if bar is not None:
        reader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
        if bar is not None:
            reader.tqdm = bar
