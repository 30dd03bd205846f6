"""MInference's per-head sparse patterns, in key-index space (query row i sits at key index i + off and
sees key j iff j <= i + off; `starshard.kernels.common.query_offset`). B = the pattern's `block_size`
(64 by default), the row block of the index and of the kernel.

- AShape(sink, local): row i sees key j iff j <= i+off and (j < sink or i+off - j < local).
- VerticalSlash(vertical, slash): estimated from the last `last_q` query rows (softmax over their
  causal keys): the `vertical` key columns and the `slash` diagonals (d = i+off - j) with the largest
  summed attention; the first `force_sink` columns and the `force_local` nearest diagonals rank first
  (inside the budget, as in MInference). With `vertical_aware` (default) the slash sums leave out the
  chosen columns that lie outside the estimate rows' near-diagonal band: in MInference's estimate a
  heavy column also shows up as `last_q` single-entry diagonals, each of which then costs a B x B
  tile per row block; vertical_aware=False is MInference's estimate exactly. Row i in row block m
  (first row at key index b = m*B + off) sees key j iff j <= i+off and (j is a selected column, or
  some selected diagonal d has b - d <= j < b - d + B): a slash line is widened to a B x B block per
  row block, vertical lines are loaded column by column.
- BlockSparse(topk): B x B mean-pooled q.k scores; per row block the `topk` key blocks (of B keys)
  with the largest score among the causally visible ones, the block(s) on the diagonal always first.
- Dense(): plain causal attention.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class AShape:
    """Attention sink (first `sink` keys) + local window (`local` nearest keys, self included)."""

    sink: int = 1024
    local: int = 4096
    score: float | None = field(default=None, compare=False)
    kind = "a_shape"

    def __post_init__(self):
        if self.sink < 0 or self.local < 1:
            raise ValueError(f"AShape needs sink >= 0 and local >= 1, got {self.sink}, {self.local}")

    def to_dict(self) -> dict:
        return {"pattern": self.kind, "sink": self.sink, "local": self.local}


@dataclass(frozen=True)
class VerticalSlash:
    """Top `vertical` key columns and top `slash` diagonals, estimated from the last query rows."""

    vertical: int = 1000
    slash: int = 6096
    score: float | None = field(default=None, compare=False)
    kind = "vertical_slash"

    def __post_init__(self):
        if self.vertical < 0 or self.slash < 0:
            raise ValueError(f"VerticalSlash budgets must be >= 0, got {self.vertical}, {self.slash}")

    def to_dict(self) -> dict:
        return {"pattern": self.kind, "vertical": self.vertical, "slash": self.slash}


@dataclass(frozen=True)
class BlockSparse:
    """Top `topk` key blocks per query row block by mean-pooled scores."""

    topk: int = 100
    score: float | None = field(default=None, compare=False)
    kind = "block_sparse"

    def __post_init__(self):
        if self.topk < 1:
            raise ValueError(f"BlockSparse needs topk >= 1, got {self.topk}")

    def to_dict(self) -> dict:
        return {"pattern": self.kind, "topk": self.topk}


@dataclass(frozen=True)
class Dense:
    """Exact causal attention for this head."""

    score: float | None = field(default=None, compare=False)
    kind = "dense"

    def to_dict(self) -> dict:
        return {"pattern": self.kind}


HeadPattern = Union[AShape, VerticalSlash, BlockSparse, Dense]
_ALIASES = {
    "a_shape": "a_shape", "ashape": "a_shape", "stream_llm": "a_shape", "streaming": "a_shape",
    "vertical_slash": "vertical_slash", "vertical_and_slash": "vertical_slash", "vs": "vertical_slash",
    "block_sparse": "block_sparse", "bs": "block_sparse", "dense": "dense",
}
# MInference's runtime runs every "block_sparse" head of a published config with 100 blocks of 64,
# whatever numbers the file holds; loading a published file does the same.
PUBLISHED_BLOCK_TOPK = 100


def head_pattern(spec) -> HeadPattern:
    """A HeadPattern from a HeadPattern, our dict form, or a published [name, v, s, score] list."""
    if isinstance(spec, (AShape, VerticalSlash, BlockSparse, Dense)):
        return spec
    if isinstance(spec, dict):
        d = dict(spec)
        name = _ALIASES.get(str(d.pop("pattern", "")).lower())
        score = d.pop("score", None)
        score = None if score is None else float(score)
        try:
            if name == "a_shape":
                return AShape(int(d.pop("sink")), int(d.pop("local")), score)
            if name == "vertical_slash":
                return VerticalSlash(int(d.pop("vertical")), int(d.pop("slash")), score)
            if name == "block_sparse":
                return BlockSparse(int(d.pop("topk")), score)
            if name == "dense":
                return Dense(score)
        except KeyError as e:
            raise ValueError(f"head pattern {spec!r} lacks {e.args[0]!r}") from None
        raise ValueError(f"unknown head pattern {spec!r}; patterns: a_shape, vertical_slash, block_sparse, dense")
    if isinstance(spec, (list, tuple)) and len(spec) >= 3 and isinstance(spec[0], str):
        name = _ALIASES.get(spec[0].lower())
        score = float(spec[3]) if len(spec) > 3 and spec[3] is not None else None
        if name == "a_shape":
            return AShape(int(spec[1]), int(spec[2]), score)
        if name == "vertical_slash":
            return VerticalSlash(int(spec[1]), int(spec[2]), score)
        if name == "block_sparse":
            return BlockSparse(PUBLISHED_BLOCK_TOPK, score)
        if name == "dense":
            return Dense(score)
    raise ValueError(f"cannot read a head pattern from {spec!r}")
