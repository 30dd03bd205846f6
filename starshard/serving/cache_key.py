"""What binds a stored KV shard to its producer: the model, the dtype and FP8 parts, the layout and the
file format. The key's digest names the files; a server indexes its own key's files as its own.

An exact layout's files are also found by another exact layout (`CacheKey.share_digest`: the key without
tp, cp, the strategy and the prefill steps): one process, tp, and cp with ring, Ulysses or USP all hold
the same keys and values, split by KV heads (tp) and by positions (cp), and every file states which heads
and positions it holds (kv_file.py), so a reader rebuilds its own shard from the files present
(serving/kv_layout.py). Star's entries differ from dense attention's (its anchors), so they share with no
other layout; APB's are never cached. pp > 1 shares with nothing (a stage's files hold its layers only).

The model's fingerprint is cheap at start (never a full read of the weights): the config as JSON plus
each weight file's name, size and a few sampled blocks (the safetensors header and spread data bytes),
or, for random weights, the preset and seed. It is a fingerprint, not a proof: two checkpoints that
differ only in bytes no sample touches collide, so replacing weights in place at the same path with
the same sizes calls for `starshard cache purge`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from starshard.config import Fp8Config, ModelConfig
from starshard.strategies import SPECS

# The on-disk layout of kv_file.py; part of every key, so files of another version are another key's.
# 2: each layer's rows, the window-trimmed layers' windows and the entry's serves_from in the header.
# 3: the writer's layout (tp / cp rank, the KV heads and positions it holds) and one digest per block of
#    tokens of each section instead of one per section (a tail read backward is checked block by block).
# 4: with --fp8 kv, keys are stored minus their constant part (engine/model.py key_offset): a version-3 file's
#    e4m3 keys of a model with a k bias would be read as shifted ones.
FORMAT_VERSION = 4
LAYOUT_FIELDS = ("tp", "cp", "strategy", "options", "prefill_chunk", "prefill_knee")  # what share_digest leaves out

SAMPLE_BYTES = 4096  # bytes read per sample of a weight file
SAMPLES_PER_FILE = 16  # evenly spread over the file besides its head: catches a fine-tune with the same shapes
HEAD_BYTES = 1 << 20  # a safetensors / GGUF header (dtypes, shapes, offsets) fits in this for the models we run


def canonical_json(obj: Any) -> str:
    """One spelling per value (sorted keys, no spaces): the digest of equal keys is equal."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def digest(data: bytes | str, size: int = 32) -> str:
    return hashlib.blake2b(data.encode() if isinstance(data, str) else data, digest_size=size).hexdigest()


def _file_sample(path: Path) -> str:
    """A digest of the file's head and SAMPLES_PER_FILE blocks spread over the rest (about 1 MiB read,
    whatever the file's size)."""
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(min(size, HEAD_BYTES)))
        for i in range(1, SAMPLES_PER_FILE + 1):
            f.seek(max(0, size * i // (SAMPLES_PER_FILE + 1) - SAMPLE_BYTES))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def weight_files(path: str | Path) -> list[dict]:
    """[{name, size, sample}] of a checkpoint: a file (.gguf) or every regular file under a directory
    (hidden ones skipped: editors' and tools' droppings are not weights)."""
    path = Path(path)
    if path.is_file():
        return [dict(name=path.name, size=path.stat().st_size, sample=_file_sample(path))]
    if not path.is_dir():
        raise FileNotFoundError(f"model path does not exist: {path}")
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            p = Path(root) / name
            out.append(dict(name=p.relative_to(path).as_posix(), size=p.stat().st_size, sample=_file_sample(p)))
    return out


def model_fingerprint(config: ModelConfig | dict, *, weights_path: str | Path | None = None,
                      random_preset: str | None = None, seed: int | None = None) -> str:
    """Hex digest of the model: its config plus the weight files (weights_path), or the random weights'
    preset name and seed. Exactly one of weights_path / random_preset."""
    if (weights_path is None) == (random_preset is None):
        raise ValueError("model_fingerprint: give either weights_path (a checkpoint) or random_preset (random "
                         "weights, with their seed)")
    cfg = config.to_dict() if isinstance(config, ModelConfig) else dict(config)
    if random_preset is not None:
        weights = dict(random=str(random_preset), seed=int(seed or 0))
    else:
        weights = dict(files=weight_files(weights_path))
    return digest(canonical_json(dict(config=cfg, weights=weights)))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CacheKey:
    """Everything a KV shard's bytes depend on besides the tokens and the rank. `options`: the context
    strategy's options as its StrategySpec reads them (`strategy.spec_options()`), sorted pairs.
    `prefill_chunk`, `prefill_knee` (its taper): set only where they change the shard's layout (a CP rank's
    rows depend on the steps)."""

    model: str
    dtype: str
    fp8: tuple[str, ...] = ()
    tp: int = 1
    cp: int = 1
    pp: int = 1
    strategy: str = "dense"
    options: tuple[tuple[str, Any], ...] = ()
    prefill_chunk: int | None = None
    prefill_knee: int | None = None
    format_version: int = FORMAT_VERSION
    kv_heads: int | None = None  # the model's KV heads (a tp rank's file names which of them it holds)

    def fields(self) -> dict:
        """The key as JSON-ready fields (what a file's header stores)."""
        d = dataclasses.asdict(self)
        for k in ("prefill_knee", "kv_heads"):
            if d[k] is None:
                del d[k]  # unset: the key (and digest) of files written before the field existed
        d["fp8"] = list(self.fp8)
        d["options"] = [list(kv) for kv in self.options]
        return d

    @classmethod
    def from_fields(cls, d: dict) -> "CacheKey":
        d = dict(d)
        d["fp8"] = tuple(d.get("fp8") or ())
        d["options"] = tuple((str(k), v) for k, v in d.get("options") or ())
        names = {f.name for f in dataclasses.fields(cls)}
        extra = set(d) - names
        if extra:
            raise ValueError(f"unknown cache key field(s) {sorted(extra)}")
        return cls(**d)

    @property
    def digest(self) -> str:
        """64 hex digits; the first 16 (`short`) lead every file name of this key."""
        return digest(canonical_json(self.fields()))

    @property
    def short(self) -> str:
        return self.digest[:16]

    @property
    def exact(self) -> bool:
        """Its KV is dense attention's, split by heads and positions (dense, ring, Ulysses, USP)."""
        spec = SPECS.get(self.strategy)
        return spec is not None and spec.exact and spec.context_cache

    @property
    def share_digest(self) -> str | None:
        """The digest every exact layout of this model, dtype and FP8 parts has in common (None: its files
        serve this layout only: Star, APB, or pp > 1)."""
        if not self.exact or self.pp != 1:
            return None
        return digest(canonical_json({k: v for k, v in self.fields().items() if k not in LAYOUT_FIELDS}))

    def layout(self) -> str:
        """The layout in words, e.g. "tp=2 cp=1 dense" or "tp=1 cp=2 ring(query_rank=1) chunk=256"."""
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        steps = f" chunk={self.prefill_chunk}" if self.prefill_chunk else ""
        steps += f" knee={self.prefill_knee}" if self.prefill_knee else ""
        pp = f" pp={self.pp}" if self.pp != 1 else ""
        return f"tp={self.tp} cp={self.cp}{pp} {self.strategy}{f'({opts})' if opts else ''}{steps}"

    def readers(self) -> str:
        """Which layouts can read its files, in words (`starshard cache list`)."""
        if self.share_digest is not None:
            return "any exact layout (one process, any tp, cp with ring / ulysses / usp)"
        if self.pp != 1:
            return "this layout only (a pipeline stage's file holds its layers only)"
        return f"this layout only ({self.strategy}'s KV is not dense attention's)"

    def describe(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return (f"model {self.model[:12]} {self.dtype} fp8={','.join(self.fp8) or 'none'} tp={self.tp} cp={self.cp} "
                f"pp={self.pp} {self.strategy}({opts}) chunk={self.prefill_chunk} knee={self.prefill_knee} "
                f"v{self.format_version}")


def cache_key(model: str, *, dtype: torch.dtype | str, fp8: Fp8Config | str | None = None, tp: int = 1,
              cp: int = 1, pp: int = 1, strategy: str = "dense", options: dict | None = None,
              prefill_chunk: int | None = None, prefill_knee: int | None = None,
              kv_heads: int | None = None) -> CacheKey:
    """The key of a server: `model` from model_fingerprint, `options` from `strategy.spec_options()`
    (None values dropped: unset is the strategy's default, resolved into the values it reports)."""
    opts = tuple(sorted((str(k), v) for k, v in (options or {}).items() if v is not None))
    for k, v in opts:
        if not isinstance(v, (int, float, str, bool)):
            raise ValueError(f"cache key: strategy option {k}={v!r} is not a plain value (int, float, str, bool)")
    return CacheKey(model=model, dtype=dtype if isinstance(dtype, str) else dtype_name(dtype),
                    fp8=tuple(Fp8Config.parse(fp8).items()), tp=tp, cp=cp, pp=pp, strategy=strategy,
                    options=opts, prefill_chunk=prefill_chunk, prefill_knee=prefill_knee, kv_heads=kv_heads)


def token_digest(token_ids) -> str:
    """16 hex digits of the token ids (int64): a file's name, never the request's text."""
    return digest(np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64)).tobytes(), size=8)
