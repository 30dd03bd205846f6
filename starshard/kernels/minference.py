"""MInference sparse prefill attention: A-shape, Vertical-Slash and Block-Sparse heads, with lse.

    pattern = MInferenceConfig.load("cfg.json").pattern(layer, num_heads=Hq)   # one layer, this rank's heads
    out, lse = attention(q, k, v, q_pos=..., k_pos=..., sparse=pattern)       # dispatcher hook
    out, lse = minference_attention(q, k, v, q_pos=..., k_pos=..., pattern=pattern)  # same thing, direct

Same contract as `attention` (DESIGN.md): q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (GQA), causal by
global position, out in q.dtype, lse float32 (natural log), rows with no visible key get out = 0 and
lse = -inf, so results merge with other partial results by lse.

Positions (shared by the batch): q_pos and k_pos runs of consecutive positions with q_pos[0] >=
k_pos[0] (q_pos = k_pos = arange(L); a query block at the end of its keys; a block after them), or
q_pos equal to the last entries of strictly increasing k_pos (gaps allowed, e.g. Star's [anchor;
block]). Everything below works in "key index" space: query row i sits at key index i + off (off =
q_pos[0] - k_pos[0], or Lk - Lq in the second case), key j is visible to row i iff j <= i + off, and
sinks, windows and diagonals are counted in key indices. Other layouts raise ValueError.

Per-head patterns (B = `block_size`, 64 by default, the row block of the index and of the kernel):
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

Index format of a Vertical-Slash head, built once per call with torch ops (no host sync):
- slash segments, shared by all row blocks: the sorted selected diagonals merged into runs whose
  gaps are <= B, as (d_first, d_last) pairs; row block m reads them as the key range
  [max(0, b - d_last), min(Lk, b + B - d_first)).
- per row block, the selected columns not inside any of its ranges (and not past its last row),
  sorted, with a count. The kernel streams each range in contiguous B-wide chunks, then gathers the
  columns B at a time (the PIT part). Work is linear in ranges + columns.

Backends: the Triton kernel (one program per (query block, batch x head), heaviest blocks first) on
CUDA or under TRITON_INTERPRET=1; otherwise a torch path that builds the very same visibility mask
from the same indices (torch's fused CPU flash kernel with an additive bias for float32/bfloat16 on
CPU, float32 math otherwise, float64 for float64 inputs). Index building is shared torch code.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import torch

from starshard.kernels.attention import DECODE_MAX_ROWS, check_shapes

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux CPU installs: torch path only
    triton = None

_LOG2E = 1.4426950408889634
_INT32_MAX = 2**31 - 1
# Elements of a float32 score tile on the torch path / of index temporaries: bounds memory per step.
_SCORE_BUDGET = 1 << 25
_INDEX_BUDGET = 1 << 26
# Query blocks this short (decode steps) run dense: no sparse estimate is meaningful.
MIN_SPARSE_ROWS = DECODE_MAX_ROWS + 1


# --------------------------------------------------------------------------------------------------
# Per-head patterns and configs
# --------------------------------------------------------------------------------------------------


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
_PUBLISHED_NAMES = {"a_shape": "stream_llm", "vertical_slash": "vertical_and_slash", "block_sparse": "block_sparse"}


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


@dataclass(frozen=True)
class SparsePattern:
    """The `sparse=` spec of one attention call: one pattern per query head of this call (a single
    pattern is broadcast to every head), plus the index parameters shared by all heads."""

    heads: tuple
    block_size: int = 64
    last_q: int = 64
    force_sink: int = 30
    force_local: int = 100
    vertical_aware: bool = True  # slash estimates leave out the chosen columns (False: MInference's)

    def __post_init__(self):
        heads = self.heads
        if isinstance(heads, (AShape, VerticalSlash, BlockSparse, Dense, dict)):
            heads = (heads,)
        object.__setattr__(self, "heads", tuple(head_pattern(h) for h in heads))
        if not self.heads:
            raise ValueError("SparsePattern needs at least one head pattern")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")
        if self.last_q < 1:
            raise ValueError(f"last_q must be >= 1, got {self.last_q}")

    def for_heads(self, num_heads: int) -> tuple:
        if len(self.heads) == 1:
            return self.heads * num_heads
        if len(self.heads) != num_heads:
            raise ValueError(f"sparse pattern has {len(self.heads)} head patterns but the call has {num_heads} query heads")
        return self.heads

    def attention(self, q, k, v, *, q_pos, k_pos, causal=True, scale=None):
        """The hook `attention(..., sparse=pattern)` calls."""
        return minference_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, pattern=self, scale=scale, causal=causal)


@dataclass
class MInferenceConfig:
    """Per-layer, per-head patterns of a model (found by `minference_search`, or a published
    MInference config). `pattern(layer, num_heads, head_offset)` gives one call's SparsePattern;
    heads and layers the file does not name use `default`."""

    layers: list = field(default_factory=list)  # list[dict[int, HeadPattern]]
    default: HeadPattern = field(default_factory=VerticalSlash)
    block_size: int = 64
    last_q: int = 64
    force_sink: int = 30
    force_local: int = 100
    vertical_aware: bool = True
    meta: dict = field(default_factory=dict)

    FORMAT = "starshard.minference/1"

    def __post_init__(self):
        self.layers = [{int(h): head_pattern(p) for h, p in layer.items()} for layer in self.layers]
        self.default = head_pattern(self.default)

    def head(self, layer: int, head: int) -> HeadPattern:
        if 0 <= layer < len(self.layers):
            return self.layers[layer].get(head, self.default)
        return self.default

    def pattern(self, layer: int, num_heads: int, head_offset: int = 0) -> SparsePattern:
        """SparsePattern of `layer` for the query heads head_offset .. head_offset + num_heads - 1
        (a tensor- or Ulysses-parallel rank holds a slice of the heads)."""
        heads = tuple(self.head(layer, head_offset + h) for h in range(num_heads))
        return SparsePattern(heads, self.block_size, self.last_q, self.force_sink, self.force_local, self.vertical_aware)

    def attention(self, *args, **kwargs):
        raise TypeError("an MInferenceConfig covers a whole model: pass `config.pattern(layer, num_heads)` as sparse=")

    # ---- JSON ----
    def to_dict(self) -> dict:
        def entry(p):
            d = p.to_dict()
            if p.score is not None:
                d["score"] = p.score
            return d

        return {
            "format": self.FORMAT,
            "block_size": self.block_size,
            "last_q": self.last_q,
            "force_sink": self.force_sink,
            "force_local": self.force_local,
            "vertical_aware": self.vertical_aware,
            "default": entry(self.default),
            "meta": self.meta,
            "layers": [{str(h): entry(p) for h, p in sorted(layer.items())} for layer in self.layers],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def to_published(self) -> list:
        """MInference's own format: per layer {head: [name, vertical, slash, score]}. Dense heads have
        no published name and are written as vertical_and_slash with budgets that cover everything."""
        out = []
        for layer in self.layers:
            row = {}
            for h, p in sorted(layer.items()):
                s = p.score if p.score is not None else 0.0
                if isinstance(p, AShape):
                    row[str(h)] = ["stream_llm", p.sink, p.local, s]
                elif isinstance(p, VerticalSlash):
                    row[str(h)] = ["vertical_and_slash", p.vertical, p.slash, s]
                elif isinstance(p, BlockSparse):
                    row[str(h)] = ["block_sparse", p.topk, 0, s]
                else:
                    row[str(h)] = ["vertical_and_slash", _INT32_MAX, _INT32_MAX, s]
            out.append(row)
        return out

    @classmethod
    def from_dict(cls, obj) -> "MInferenceConfig":
        if isinstance(obj, list):  # MInference's published format
            return cls.from_published(obj)
        if not isinstance(obj, dict) or obj.get("format") != cls.FORMAT:
            raise ValueError(f"not a MInference config: expected a published list of layers or a dict with format {cls.FORMAT!r}")
        return cls(
            layers=obj.get("layers", []),
            default=obj.get("default", {"pattern": "vertical_slash", "vertical": 1000, "slash": 6096}),
            block_size=int(obj.get("block_size", 64)),
            last_q=int(obj.get("last_q", 64)),
            force_sink=int(obj.get("force_sink", 30)),
            force_local=int(obj.get("force_local", 100)),
            vertical_aware=bool(obj.get("vertical_aware", True)),
            meta=obj.get("meta", {}),
        )

    @classmethod
    def from_published(cls, layers: list, **kwargs) -> "MInferenceConfig":
        """A published MInference config: a list (one per layer) of {head: [pattern, v, s, score]}.
        Semantics follow MInference's runtime: stream_llm = A-shape (sink v, local s),
        vertical_and_slash (v columns, s diagonals, 64-row blocks, last 64 queries, first 30
        columns and nearest 100 diagonals forced), block_sparse = top-100 64x64 blocks; heads the
        file misses use vertical_and_slash (1000, 6096)."""
        if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
            raise ValueError("a published MInference config is a JSON list of {head: [pattern, vertical, slash, score]} per layer")
        parsed = [{int(h): head_pattern(list(p)) for h, p in layer.items()} for layer in layers]
        return cls(layers=parsed, **kwargs)

    @classmethod
    def load(cls, path: str | Path) -> "MInferenceConfig":
        """Our JSON format or a published MInference file (told apart by shape)."""
        with open(path) as f:
            obj = json.load(f)
        cfg = cls.from_dict(obj)
        cfg.meta = {**cfg.meta, "source": str(path)}
        return cfg


def _is_triton_interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


# --------------------------------------------------------------------------------------------------
# Positions
# --------------------------------------------------------------------------------------------------


def query_offset(q_pos: torch.Tensor, k_pos: torch.Tensor, Lq: int, Lk: int) -> int:
    """Query block offset in key-index space (one device-to-host sync): row i sits at key index
    i + off. Accepted layouts, positions shared by the batch:
    - q_pos and k_pos runs of consecutive positions, q_pos[0] >= k_pos[0]: off = q_pos[0] - k_pos[0];
    - k_pos strictly increasing and q_pos equal to its last Lq entries (a query block that is the
      tail of its keys, gaps allowed: Star's [anchor; block], a zigzag shard's own block): off = Lk - Lq.
    Key j is visible to row i iff j <= i + off, which is causality by position in both cases.
    ValueError for anything else."""

    def flat(p, L, name):
        if p.dtype.is_floating_point or p.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {p.dtype}")
        if p.dim() == 2:
            if p.shape[1] != L:
                raise ValueError(f"{name} must have {L} positions per row, got {tuple(p.shape)}")
            return p[0], (p != p[:1]).any()
        if p.dim() != 1 or p.shape[0] != L:
            raise ValueError(f"{name} must have shape [{L}] or [B, {L}], got {tuple(p.shape)}")
        return p, torch.zeros((), dtype=torch.bool, device=p.device)

    qp, q_rows_differ = flat(q_pos, Lq, "q_pos")
    kp, k_rows_differ = flat(k_pos, Lk, "k_pos")
    qp, kp = qp.long(), kp.long().to(qp.device)
    zero = qp.new_zeros(())
    tail = (qp != kp[Lk - Lq :]).any().long() if Lq <= Lk else qp.new_ones(())
    stats = torch.stack([
        qp[0], kp[0],
        (qp.diff() != 1).any().long() if Lq > 1 else zero,
        (kp.diff() != 1).any().long() if Lk > 1 else zero,
        (kp.diff() <= 0).any().long() if Lk > 1 else zero,
        tail,
        q_rows_differ.long().to(qp.device), k_rows_differ.long().to(qp.device),
    ]).tolist()
    q0, k0, q_gap, k_gap, k_unsorted, not_tail, q_diff, k_diff = stats
    if q_diff or k_diff:
        raise ValueError("sparse (MInference) attention needs the same positions for every batch row; use dense attention")
    if not q_gap and not k_gap:
        if q0 < k0:
            raise ValueError(f"sparse (MInference) attention needs the query block to start at or after the first key "
                             f"(q_pos[0]={q0} < k_pos[0]={k0}); use dense attention for this layout")
        return int(q0 - k0)
    if not k_unsorted and not not_tail:
        return Lk - Lq
    raise ValueError("sparse (MInference) attention needs q_pos and k_pos to be runs of consecutive positions "
                     "(a contiguous causal block, or a query block at or after the start of its keys), or q_pos "
                     "to be the last entries of strictly increasing k_pos; use dense attention for other layouts")


# --------------------------------------------------------------------------------------------------
# Index builders (torch; shared by the Triton and the torch paths)
# --------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _per_head(x, n: int) -> list[int]:
    if isinstance(x, int):
        return [x] * n
    x = [int(v) for v in x]
    if len(x) != n:
        raise ValueError(f"expected {n} per-head values, got {len(x)}")
    return x


@dataclass
class VSIndex:
    """Vertical-Slash index of `heads` (query head ids). vertical/slash: selected column and diagonal
    ids, sorted, padded with Lk / ndiag; seg: [B, nH, KS, 2] int32 (d_first, d_last) runs, seg_count
    [B, nH]; col: [B, nH, nM, KV] int32 columns per row block (outside its ranges), col_count [B, nH, nM],
    col_full [B, nH, nM]: how many leading columns every row of the block sees (no mask needed)."""

    heads: list
    vertical: torch.Tensor
    slash: torch.Tensor
    seg: torch.Tensor
    seg_count: torch.Tensor
    col: torch.Tensor
    col_count: torch.Tensor
    col_full: torch.Tensor


@dataclass
class BSIndex:
    """Block-Sparse index: blocks [B, nH, nM, K] int32 sorted key-block ids (padded with a large
    id), count [B, nH, nM] int32, full [B, nH, nM]: how many leading blocks every row sees in full."""

    heads: list
    blocks: torch.Tensor
    count: torch.Tensor
    full: torch.Tensor


def vs_estimate(q, k, *, offset: int, vertical=None, slash=None, last_q: int = 64, force_sink: int = 30,
                force_local: int = 100, scale=None, heads=None):
    """One pass over the last `last_q` query rows (causal softmax, float32) of each listed head.

    Returns (v_idx, vertical, slash): vertical [B, nH, Lk] is the summed attention per key column,
    slash [B, nH, Lq + offset] per diagonal d = row key index - key index. With `vertical` budgets
    (one int or one per head), v_idx [B, nH, KV] holds each head's top columns (the first
    `force_sink` first, sorted, padded with Lk). With `slash` budgets too, the slash sums leave out
    the mass on chosen columns that lie outside the estimate rows' near-diagonal band (the run of
    diagonals 0, 1, ... that the raw slash estimate would select): a heavy column would otherwise
    echo as a run of `last_q` single-entry diagonals and spend slash budget (a B x B tile per row
    block each) on them. Otherwise the slash sums are MInference's raw ones (v_idx None without
    `vertical`).

    Heads are processed in chunks of whole KV groups (q rows of a group against its K, no K copies);
    on CUDA the q.k products run in the input dtype (as MInference), the softmax in float32."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    heads = list(range(Hq)) if heads is None else list(heads)
    scale = D**-0.5 if scale is None else scale
    R = min(last_q, Lq)
    ndiag = Lq + offset
    qidx_last = Lq - 1 + offset
    dev = q.device
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    mm = q.dtype if q.is_cuda else acc
    vscore = torch.zeros(B, Hq, Lk, dtype=torch.float32, device=dev)
    sscore = torch.zeros(B, Hq, ndiag, dtype=torch.float32, device=dev)
    budget = torch.zeros(Hq, dtype=torch.long)
    s_budget = torch.zeros(Hq, dtype=torch.long)
    if vertical is not None:
        budget[torch.tensor(heads, dtype=torch.long)] = torch.tensor(_per_head(vertical, len(heads)))
    if slash is not None:
        s_budget[torch.tensor(heads, dtype=torch.long)] = torch.tensor(_per_head(slash, len(heads)))
    echo_free = vertical is not None and slash is not None
    qidx_first = Lq - R + offset
    kv_max = min(int(budget.max()), Lk)
    v_all = torch.full((B, Hq, kv_max), Lk, dtype=torch.long, device=dev)
    rows_qidx = torch.arange(Lq - R, Lq, device=dev) + offset
    invisible = torch.arange(Lk, device=dev)[None, :] > rows_qidx[:, None]  # [R, Lk]
    # Row r of the scores sits at z[r, R-1 : R-1+Lk]; one more zero column at the end takes
    # scattered padding ids.
    W = Lk + 2 * (R - 1) + 1
    # Diagonal d sits at column c = qidx_last - d of the row-shifted scores.
    d_all = torch.arange(ndiag, device=dev)
    c_of_d = qidx_last - d_all
    c_ok = (c_of_d >= 0) & (c_of_d < Lk + R - 1)
    d_ok, c_sel = d_all[c_ok], c_of_d[c_ok]
    needed = torch.zeros(Hkv, dtype=torch.bool)
    needed[torch.tensor(heads, dtype=torch.long) // g] = True
    step = max(1, _INDEX_BUDGET // max(1, B * g * R * W))
    qg = q.view(B, Hkv, g, Lq, D)
    fs = min(force_sink, Lk)
    for c0 in range(0, Hkv, step):
        c1 = min(Hkv, c0 + step)
        if not needed[c0:c1].any():
            continue
        h0, h1 = c0 * g, c1 * g
        n = h1 - h0
        qs = qg[:, c0:c1, :, Lq - R :].to(mm)  # [B, nk, g, R, D]
        kt = k[:, c0:c1, None].to(mm).transpose(-1, -2)  # [B, nk, 1, D, Lk]
        z = torch.zeros(B, n, R, W, dtype=acc, device=dev)
        logits = z[..., R - 1 : R - 1 + Lk]
        logits.copy_((qs @ kt).view(B, n, R, Lk))
        logits.mul_(scale).masked_fill_(invisible, float("-inf"))
        logits.copy_(torch.softmax(logits, dim=-1))
        vscore[:, h0:h1] = logits.sum(-2)
        # Row r shifted right by R-1-r: diagonals line up in columns (strided view, no copy).
        shifted = z.as_strided((B, n, R, Lk + R - 1), (n * R * W, R * W, W + 1, 1))
        sscore[:, h0:h1, d_ok] = shifted.sum(-2)[..., c_sel].float()
        if kv_max > 0 and bool(budget[h0:h1].any()):
            ranked = vscore[:, h0:h1].clone()
            if fs > 0:  # forced columns outrank every estimate (each is <= R), first ones first
                ranked[..., :fs] = 2.0 * R + torch.arange(fs, 0, -1, device=dev, dtype=ranked.dtype)
            v_idx = _topk_per_head(ranked, budget[h0:h1].tolist(), Lk)  # [B, n, KV]
            v_all[:, h0:h1, : v_idx.shape[-1]] = v_idx
            if echo_free and bool(s_budget[h0:h1].any()):
                raw = pick_slash(sscore[:, h0:h1], s_budget[h0:h1].tolist(), R, force_local, n)  # sorted
                pos = torch.arange(raw.shape[-1], device=dev)
                band = (raw == pos).long().cumprod(-1).sum(-1)  # diagonals 0 .. band-1 all chosen
                echo = (v_idx < Lk) & (qidx_first - v_idx > band[..., None])
                zcol = torch.where(echo, v_idx + (R - 1), W - 1)
                z.scatter_(-1, zcol[:, :, None, :].expand(B, n, R, zcol.shape[-1]), 0.0)
                sscore[:, h0:h1, d_ok] = shifted.sum(-2)[..., c_sel].float()
        del z, logits
    if heads != list(range(Hq)):
        sel = torch.tensor(heads, device=dev)
        vscore, sscore, v_all = vscore[:, sel], sscore[:, sel], v_all[:, sel]
    return (v_all if vertical is not None else None), vscore, sscore


def vs_scores(q, k, *, offset: int, last_q: int = 64, scale=None, heads=None):
    """MInference's raw estimates: (vertical [B, nH, Lk], slash [B, nH, Lq + offset]), float32."""
    _, vscore, sscore = vs_estimate(q, k, offset=offset, last_q=last_q, scale=scale, heads=heads)
    return vscore, sscore


def _topk_per_head(scores: torch.Tensor, budgets: list[int], sentinel: int) -> torch.Tensor:
    """Ids of each head's top budget[h] scores, ascending, padded with `sentinel`: [B, nH, max]."""
    n = scores.shape[-1]
    kmax = min(max(budgets), n)
    if kmax <= 0:
        return torch.full((*scores.shape[:-1], 0), sentinel, dtype=torch.long, device=scores.device)
    idx = torch.topk(scores, kmax, dim=-1, sorted=True).indices
    keep = torch.arange(kmax, device=scores.device)[None, :] < torch.tensor(budgets, device=scores.device)[:, None]
    idx = torch.where(keep, idx, sentinel)
    return idx.sort(-1).values


def vs_pick(vscore: torch.Tensor, sscore: torch.Tensor, *, vertical, slash, rows: int, force_sink: int = 30,
            force_local: int = 100):
    """Top columns / diagonals from raw `vs_scores` (budgets: one int or one per head): ids sorted,
    padded with Lk and ndiag. The first `force_sink` columns and `force_local` diagonals rank first,
    nearest first (every estimate is <= `rows`, the number of estimate rows)."""
    nH = vscore.shape[1]
    return pick_vertical(vscore, vertical, rows, force_sink), pick_slash(sscore, slash, rows, force_local, nH)


def pick_vertical(vscore, vertical, rows, force_sink):
    """Top `vertical` columns per head (forced first ones outrank), sorted, padded with Lk."""
    Lk, nH = vscore.shape[-1], vscore.shape[1]
    vs = vscore.clone()
    fs = min(force_sink, Lk)
    if fs > 0:
        vs[..., :fs] = 2.0 * rows + torch.arange(fs, 0, -1, device=vs.device, dtype=vs.dtype)
    return _topk_per_head(vs, _per_head(vertical, nH), Lk)


def pick_slash(sscore, slash, rows, force_local, nH):
    """Top `slash` diagonals per head (forced nearest ones outrank), sorted, padded with ndiag."""
    ndiag = sscore.shape[-1]
    ss = sscore.clone()
    fl = min(force_local, ndiag)
    if fl > 0:
        ss[..., :fl] = 2.0 * rows + torch.arange(fl, 0, -1, device=ss.device, dtype=ss.dtype)
    return _topk_per_head(ss, _per_head(slash, nH), ndiag)


def vs_select(q, k, *, offset: int, vertical, slash, last_q: int = 64, force_sink: int = 30,
              force_local: int = 100, scale=None, heads=None, vertical_aware: bool = True):
    """Selected columns [B, nH, KV] and diagonals [B, nH, KS] (sorted, padded with Lk and Lq+offset).
    `vertical`/`slash`: budgets, one int or one per listed head. vertical_aware: slash estimates
    leave out the chosen columns' mass (see `vs_estimate`); False is MInference's estimate."""
    heads = list(range(q.shape[1])) if heads is None else list(heads)
    rows = min(last_q, q.shape[2])
    if vertical_aware:
        v_idx, _, ss = vs_estimate(q, k, offset=offset, vertical=vertical, slash=slash, last_q=last_q,
                                   force_sink=force_sink, force_local=force_local, scale=scale, heads=heads)
    else:
        vs, ss = vs_scores(q, k, offset=offset, last_q=last_q, scale=scale, heads=heads)
        v_idx = pick_vertical(vs, vertical, rows, force_sink)
    return v_idx, pick_slash(ss, slash, rows, force_local, len(heads))


def vs_segments(s_idx: torch.Tensor, ndiag: int, block_size: int):
    """Sorted diagonals -> runs with gaps <= block_size: seg [B, nH, KS, 2] int32 (first, last), count."""
    B, nH, KS = s_idx.shape
    dev = s_idx.device
    valid = s_idx < ndiag
    if KS == 0:
        return torch.zeros(B, nH, 0, 2, dtype=torch.int32, device=dev), torch.zeros(B, nH, dtype=torch.int32, device=dev)
    prev = torch.cat([torch.full_like(s_idx[..., :1], -(2 * block_size + 2)), s_idx[..., :-1]], -1)
    start = valid & (s_idx - prev > block_size)
    sid = torch.cumsum(start.long(), -1) - 1
    sid = torch.where(valid, sid, KS)  # invalid entries to a spill slot
    big = torch.iinfo(torch.long).max
    first = torch.full((B, nH, KS + 1), big, dtype=torch.long, device=dev)
    last = torch.full((B, nH, KS + 1), -1, dtype=torch.long, device=dev)
    first.scatter_reduce_(-1, sid, s_idx, "amin")
    last.scatter_reduce_(-1, sid, s_idx, "amax")
    count = start.sum(-1).to(torch.int32)
    seg = torch.stack([first[..., :KS], last[..., :KS]], -1)
    used = torch.arange(KS, device=dev) < count[..., None]
    seg = torch.where(used[..., None], seg, 0).to(torch.int32)
    return seg.contiguous(), count.contiguous()


def vs_index(v_idx: torch.Tensor, s_idx: torch.Tensor, *, Lq: int, Lk: int, offset: int, block_size: int,
             heads=None) -> VSIndex:
    """Merge selected columns and diagonal ranges per row block (see the module docstring)."""
    B, nH, KV = v_idx.shape
    dev = v_idx.device
    BM = block_size
    ndiag = Lq + offset
    nM = _cdiv(Lq, BM)
    seg, seg_count = vs_segments(s_idx, ndiag, BM)
    KS = seg.shape[2]
    col = torch.zeros(B, nH, nM, KV, dtype=torch.int32, device=dev)
    col_count = torch.zeros(B, nH, nM, dtype=torch.int32, device=dev)
    col_full = torch.zeros(B, nH, nM, dtype=torch.int32, device=dev)
    if KV > 0:
        # A column j is inside a run's range at row block with first key index b iff
        # b - j in [first - BM + 1, last]: half-open bounds per run, disjoint and increasing.
        used = torch.arange(KS, device=dev) < seg_count[..., None]
        big = torch.iinfo(torch.long).max // 4
        lo_b = torch.where(used, seg[..., 0].long() - BM + 1, big)
        hi_b = torch.where(used, seg[..., 1].long() + 1, big)
        bounds = torch.stack([lo_b, hi_b], -1).reshape(B, nH, 2 * KS).contiguous()
        base = torch.arange(nM, device=dev) * BM + offset  # [nM]
        v = v_idx.long()
        step = max(1, _INDEX_BUDGET // max(1, B * nH * KV))
        for m0 in range(0, nM, step):
            m1 = min(nM, m0 + step)
            bm = base[m0:m1]
            t = (bm[None, None, :, None] - v[:, :, None, :])  # [B, nH, mb, KV]
            if KS > 0:
                pos = torch.searchsorted(bounds, t.reshape(B, nH, -1).contiguous(), right=True).reshape(t.shape)
                covered = (pos % 2) == 1
            else:
                covered = torch.zeros_like(t, dtype=torch.bool)
            keep = (v[:, :, None, :] < Lk) & (v[:, :, None, :] < bm[None, None, :, None] + BM) & ~covered
            slot = torch.cumsum(keep, -1, dtype=torch.int32) - 1
            slot = torch.where(keep, slot.long(), KV)
            out = torch.zeros(B, nH, m1 - m0, KV + 1, dtype=torch.int32, device=dev)
            out.scatter_(-1, slot, v[:, :, None, :].expand_as(slot).to(torch.int32))
            col[:, :, m0:m1] = out[..., :KV]
            col_count[:, :, m0:m1] = keep.sum(-1, dtype=torch.int32)
            col_full[:, :, m0:m1] = (keep & (v[:, :, None, :] <= bm[None, None, :, None])).sum(-1, dtype=torch.int32)
    heads = list(range(nH)) if heads is None else list(heads)
    return VSIndex(heads, v_idx, s_idx, seg, seg_count, col.contiguous(), col_count.contiguous(), col_full.contiguous())


def bs_select(q, k, *, offset: int, topk, block_size: int = 64, scale=None, heads=None) -> BSIndex:
    """Block-Sparse index from mean-pooled q and k (blocks of block_size rows / keys)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    heads = list(range(Hq)) if heads is None else list(heads)
    nH = len(heads)
    BM = block_size
    nM, nN = _cdiv(Lq, BM), _cdiv(Lk, BM)
    dev = q.device
    scale = D**-0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    heads_t = torch.tensor(heads, device=dev)

    def pool(x, L, n):  # block means, accumulated in float32 (float64) without copying x
        whole = L // BM
        sums = [x[:, :, : whole * BM].unflatten(2, (whole, BM)).sum(-2, dtype=acc)]
        if L % BM:
            sums.append(x[:, :, whole * BM :].sum(-2, keepdim=True, dtype=acc))
        cnt = (torch.arange(n, device=dev) * BM).neg().add(L).clamp(max=BM).to(acc)
        return torch.cat(sums, 2) / cnt[:, None]

    qp = pool(q, Lq, nM)[:, heads_t]  # [B, nH, nM, D]
    kp = pool(k, Lk, nN)[:, heads_t // g]  # [B, nH, nN, D]
    s = (qp @ kp.transpose(-1, -2)).float() * scale  # [B, nH, nM, nN]
    m = torch.arange(nM, device=dev)
    first = m * BM + offset
    last = torch.clamp(m * BM + BM, max=Lq) - 1 + offset
    kb = torch.arange(nN, device=dev) * BM
    visible = kb[None, :] <= last[:, None]
    forced = visible & (kb[None, :] + BM - 1 >= first[:, None])
    s = torch.where(forced, float("inf"), torch.where(visible, s, float("-inf")))
    budgets = _per_head(topk, nH)
    K = min(max(budgets), nN)
    top = torch.topk(s, K, dim=-1, sorted=True)
    rank_ok = torch.arange(K, device=dev)[None, :] < torch.tensor(budgets, device=dev)[:, None]  # [nH, K]
    ok = (top.values > float("-inf")) & rank_ok[None, :, None, :]
    sentinel = _INT32_MAX
    blocks = torch.where(ok, top.indices, sentinel).sort(-1).values
    count = ok.sum(-1, dtype=torch.int32)
    whole = (blocks * BM + BM <= torch.clamp(first + 1, max=Lk)[:, None]) & (torch.arange(K, device=dev) < count[..., None])
    return BSIndex(heads, blocks.to(torch.int32).contiguous(), count.contiguous(), whole.sum(-1, dtype=torch.int32).contiguous())


# --------------------------------------------------------------------------------------------------
# Plans: heads grouped by pattern kind, with their indices
# --------------------------------------------------------------------------------------------------


@dataclass
class HeadGroup:
    kind: str  # "a_shape" (Dense heads too), "vertical_slash", "block_sparse"
    heads: list
    index: object = None  # VSIndex / BSIndex
    sink: list = None  # a_shape
    local: list = None


def build_plan(q, k, pattern: SparsePattern, *, offset: int, scale=None) -> list[HeadGroup]:
    """Group the call's heads by kind and build each group's index (torch, on q's device)."""
    Hq, Lq, Lk = q.shape[1], q.shape[2], k.shape[2]
    heads = pattern.for_heads(Hq)
    BM = pattern.block_size
    full = min(_INT32_MAX // 4, Lk + Lq + offset + 1)  # a window that covers every key
    groups: dict[str, HeadGroup] = {}
    for h, p in enumerate(heads):
        kind = "a_shape" if isinstance(p, (AShape, Dense)) else p.kind
        grp = groups.setdefault(kind, HeadGroup(kind, []))
        grp.heads.append(h)
        if kind == "a_shape":
            grp.sink = (grp.sink or []) + [0 if isinstance(p, Dense) else min(p.sink, full)]
            grp.local = (grp.local or []) + [full if isinstance(p, Dense) else min(p.local, full)]
    if "vertical_slash" in groups:
        grp = groups["vertical_slash"]
        ps = [heads[h] for h in grp.heads]
        v_idx, s_idx = vs_select(q, k, offset=offset, vertical=[p.vertical for p in ps], slash=[p.slash for p in ps],
                                 last_q=pattern.last_q, force_sink=pattern.force_sink,
                                 force_local=pattern.force_local, scale=scale, heads=grp.heads,
                                 vertical_aware=pattern.vertical_aware)
        grp.index = vs_index(v_idx, s_idx, Lq=Lq, Lk=Lk, offset=offset, block_size=BM, heads=grp.heads)
    if "block_sparse" in groups:
        grp = groups["block_sparse"]
        grp.index = bs_select(q, k, offset=offset, topk=[heads[h].topk for h in grp.heads], block_size=BM,
                              scale=scale, heads=grp.heads)
    return list(groups.values())


# --------------------------------------------------------------------------------------------------
# Visibility masks (torch path, tests, recall) and kernel cost
# --------------------------------------------------------------------------------------------------


def group_mask(grp: HeadGroup, *, B: int, Lq: int, Lk: int, offset: int, block_size: int, blocks) -> torch.Tensor:
    """Visibility [B, nH, len(blocks) * block_size, Lk] (bool) of a group's heads for the given query
    row blocks (rows past Lq are included; callers trim). Causal included."""
    BM = block_size
    dev = grp.index.blocks.device if isinstance(grp.index, BSIndex) else (
        grp.index.seg.device if isinstance(grp.index, VSIndex) else blocks.device)
    blocks = blocks.to(dev)
    nH, nb = len(grp.heads), blocks.numel()
    rows = (blocks[:, None] * BM + torch.arange(BM, device=dev)).flatten()  # [nb*BM]
    qidx = rows + offset
    cols = torch.arange(Lk, device=dev)
    causal = cols[None, :] <= qidx[:, None]  # [rows, Lk]
    if grp.kind == "a_shape":
        sink = torch.tensor(grp.sink, device=dev)[:, None, None]
        local = torch.tensor(grp.local, device=dev)[:, None, None]
        vis = causal & ((cols[None, None, :] < sink) | (qidx[None, :, None] - cols[None, None, :] < local))
        return vis[None].expand(B, nH, -1, -1)
    base = blocks * BM + offset  # [nb]
    if grp.kind == "vertical_slash":
        idx = grp.index
        KS = idx.seg.shape[2]
        used = torch.arange(KS, device=dev) < idx.seg_count[..., None].long()  # [B, nH, KS]
        lo = (base[None, None, :, None] - idx.seg[:, :, None, :, 1].long()).clamp(min=0)
        hi = (base[None, None, :, None] + BM - idx.seg[:, :, None, :, 0].long()).clamp(max=Lk)
        ok = used[:, :, None, :] & (hi > lo)
        lo, hi = torch.where(ok, lo, 0), torch.where(ok, hi, 0)
        marks = torch.zeros(B, nH, nb, Lk + 1, dtype=torch.int32, device=dev)
        marks.scatter_add_(-1, lo, torch.ones_like(lo, dtype=torch.int32))
        marks.scatter_add_(-1, hi, torch.full_like(hi, -1, dtype=torch.int32))
        blk = marks.cumsum(-1)[..., :Lk] > 0
        cc = idx.col[:, :, blocks.long()].long()  # [B, nH, nb, KV]
        cvalid = torch.arange(cc.shape[-1], device=dev) < idx.col_count[:, :, blocks.long(), None]
        colmask = torch.zeros(B, nH, nb, Lk + 1, dtype=torch.bool, device=dev)
        colmask.scatter_(-1, torch.where(cvalid, cc, Lk), True)
        blk = blk | colmask[..., :Lk]
    else:  # block_sparse
        idx = grp.index
        bl = idx.blocks[:, :, blocks.long()].long()
        bvalid = torch.arange(bl.shape[-1], device=dev) < idx.count[:, :, blocks.long(), None]
        nN = _cdiv(Lk, BM)
        bm = torch.zeros(B, nH, nb, nN + 1, dtype=torch.bool, device=dev)
        bm.scatter_(-1, torch.where(bvalid, bl, nN), True)
        blk = bm[..., :nN].repeat_interleave(BM, -1)[..., :Lk]
    return blk.repeat_interleave(BM, 2) & causal


def kernel_cost(grp: HeadGroup, *, B: int, Lq: int, Lk: int, offset: int, block_size: int) -> torch.Tensor:
    """Score entries the Triton kernel computes (masked ones included), per head: [B, nH] int64.
    The unit of the search's equal-cost comparison and the bench's density."""
    BM = BN = block_size
    nM = _cdiv(Lq, BM)
    dev = grp.index.seg.device if isinstance(grp.index, VSIndex) else (
        grp.index.blocks.device if isinstance(grp.index, BSIndex) else torch.device("cpu"))
    m = torch.arange(nM, device=dev)
    base = m * BM + offset
    last = torch.clamp(m * BM + BM, max=Lq) - 1 + offset

    def chunks(lo, hi):
        return torch.div((hi - lo).clamp(min=0) + BN - 1, BN, rounding_mode="floor")

    if grp.kind == "a_shape":
        sink = torch.tensor(grp.sink, device=dev)[:, None]
        local = torch.tensor(grp.local, device=dev)[:, None]
        win_lo = base[None] - local + 1
        hi = torch.clamp(last[None] + 1, max=Lk)
        sep = win_lo > sink
        n = chunks(0, torch.where(sep, torch.clamp(sink, max=Lk), 0)) + chunks(torch.where(sep, win_lo, 0), hi)
        per_head = n.sum(-1) * BM * BN
        return per_head[None].expand(B, -1).clone()
    if grp.kind == "vertical_slash":
        idx = grp.index
        KS = idx.seg.shape[2]
        used = torch.arange(KS, device=dev) < idx.seg_count[..., None].long()
        lo = (base[None, None, :, None] - idx.seg[:, :, None, :, 1].long()).clamp(min=0)
        hi = (base[None, None, :, None] + BM - idx.seg[:, :, None, :, 0].long()).clamp(max=Lk)
        n = torch.where(used[:, :, None, :], chunks(lo, hi), 0).sum((-1, -2))
        n = n + torch.div(idx.col_count.long() + BN - 1, BN, rounding_mode="floor").sum(-1)
        return n * BM * BN
    return grp.index.count.long().sum(-1) * BM * BN


def dense_cost(*, Lq: int, Lk: int, offset: int, block_size: int) -> int:
    """Score entries a causal flash kernel with block_size x block_size tiles computes."""
    g = HeadGroup("a_shape", [0], sink=[0], local=[_INT32_MAX // 4])
    return int(kernel_cost(g, B=1, Lq=Lq, Lk=Lk, offset=offset, block_size=block_size)[0, 0])


# --------------------------------------------------------------------------------------------------
# Torch path
# --------------------------------------------------------------------------------------------------


def _attention_torch(q, k, v, groups, *, offset, scale, block_size):
    """The same visibility as the kernel, as a dense mask per chunk of row blocks: torch's fused CPU
    flash kernel with an additive bias for float32/bfloat16 on CPU, else float32 (float64) math."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    BM = block_size
    nM = _cdiv(Lq, BM)
    fused = q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if fused:
        kf = k.repeat_interleave(g, 1) if g > 1 else k
        vf = v.repeat_interleave(g, 1) if g > 1 else v
        out = torch.empty_like(q)
    else:
        kf, vf = k.to(acc), v.to(acc)
        out = torch.zeros(B, Hq, Lq, D, dtype=acc, device=q.device)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    step = max(1, _SCORE_BUDGET // max(1, B * Hq * BM * Lk))
    for m0 in range(0, nM, step):
        blocks = torch.arange(m0, min(nM, m0 + step), device=q.device)
        r0, r1 = m0 * BM, min(Lq, (m0 + blocks.numel()) * BM)
        vis = torch.zeros(B, Hq, blocks.numel() * BM, Lk, dtype=torch.bool, device=q.device)
        for grp in groups:
            vis[:, grp.heads] = group_mask(grp, B=B, Lq=Lq, Lk=Lk, offset=offset, block_size=BM, blocks=blocks)
        vis = vis[:, :, : r1 - r0]
        empty = ~vis.any(-1)  # [B, Hq, rows]
        if fused:
            bias = torch.zeros(vis.shape, dtype=q.dtype, device=q.device).masked_fill_(~vis, float("-inf"))
            o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, r0:r1], kf, vf, 0.0, False, attn_mask=bias, scale=scale)
            m = m.float()
        else:
            qc = q[:, :, r0:r1].to(acc).view(B, Hkv, g, r1 - r0, D)
            sc = torch.einsum("bhgqd,bhkd->bhgqk", qc, kf).reshape(B, Hq, r1 - r0, Lk) * scale
            sc = sc.masked_fill(~vis, float("-inf"))
            m = torch.logsumexp(sc, -1)
            p = torch.exp(sc - m.nan_to_num(neginf=0.0)[..., None])
            o = torch.einsum("bhgqk,bhkd->bhgqd", p.view(B, Hkv, g, r1 - r0, Lk), vf).reshape(B, Hq, r1 - r0, D)
        if bool(empty.any()):  # rows that see no key: out 0, lse -inf (the fused kernel gives NaN)
            o = o.masked_fill(empty[..., None], 0.0)
            m = m.masked_fill(empty, float("-inf"))
        out[:, :, r0:r1] = o
        lse[:, :, r0:r1] = m.float()
    return out.to(q.dtype), lse


# --------------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _chunk(q, m_i, l_i, acc, kt_base, v_base, cols, col_ok, s_kn, s_vn, d_ok, q_idx, sink, window, qk_scale,
               MASKED: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr):
        """One chunk of keys (`cols`, any order or gaps) folded into the streaming softmax (log2 units)."""
        if MASKED:
            kt = tl.load(kt_base + cols[None, :] * s_kn, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_base + cols[:, None] * s_vn, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            kt = tl.load(kt_base + cols[None, :] * s_kn)
            v = tl.load(v_base + cols[:, None] * s_vn)
        else:
            kt = tl.load(kt_base + cols[None, :] * s_kn, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_base + cols[:, None] * s_vn, mask=d_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, kt) * qk_scale
        if MASKED:
            vis = col_ok[None, :] & (cols[None, :] <= q_idx[:, None])
            if WINDOW:
                vis = vis & ((cols[None, :] < sink) | (cols[None, :] > q_idx[:, None] - window))
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet: exp2(-inf) = 0
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if IEEE:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        return m_new, l_i, acc

    @triton.jit
    def _span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx, lo, hi, unm_lo, unm_hi,
              sink, window, qk_scale,
              BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr):
        """Keys lo..hi-1 in BLOCK_N chunks; chunks inside [unm_lo, unm_hi) skip all mask arithmetic."""
        n_chunks = (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N
        n_head = tl.minimum((tl.maximum(unm_lo - lo, 0) + BLOCK_N - 1) // BLOCK_N, n_chunks)
        n_fit = tl.maximum(tl.minimum(tl.maximum(unm_hi - lo, 0) // BLOCK_N, n_chunks), n_head)
        for c in range(n_head, n_fit):
            cols = lo + c * BLOCK_N + offs_n
            m_i, l_i, acc = _chunk(q, m_i, l_i, acc, kt_base, v_base, cols, cols < hi, s_kn, s_vn, d_ok, q_idx,
                                   sink, window, qk_scale, False, WINDOW, EVEN_D, IEEE)
        # Masked chunks, before n_head and from n_fit on, in one loop (one copy of the code).
        for i in range(0, n_head + n_chunks - n_fit):
            c = tl.where(i < n_head, i, i - n_head + n_fit)
            cols = lo + c * BLOCK_N + offs_n
            m_i, l_i, acc = _chunk(q, m_i, l_i, acc, kt_base, v_base, cols, cols < hi, s_kn, s_vn, d_ok, q_idx,
                                   sink, window, qk_scale, True, WINDOW, EVEN_D, IEEE)
        return m_i, l_i, acc

    @triton.jit
    def _minference_fwd(
        Q, K, V, O, LSE, HEADS, P0, P1, SEG, SEGN, IDX, CNT, CFULL,
        qk_scale,
        s_qb, s_qh, s_qm, s_qd,
        s_kb, s_kh, s_kn, s_kd,
        s_vb, s_vh, s_vn, s_vd,
        s_ob, s_oh, s_om, s_od,
        n_heads, Hq, G, Lq, Lk, off, n_qblocks, KS, KI,
        MODE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    ):
        # MODE 0: A-shape / dense (P0 sink, P1 local per head); 1: Vertical-Slash (SEG/SEGN runs,
        # IDX/CNT columns per row block); 2: Block-Sparse (IDX/CNT key blocks per row block).
        pid_m = n_qblocks - 1 - tl.program_id(0)  # heaviest query blocks first
        pid = tl.program_id(1)
        b = pid // n_heads
        j = pid % n_heads
        h = tl.load(HEADS + j)
        kvh = h // G
        EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < Lq
        d_ok = offs_d < HEAD_DIM
        q_idx = offs_m + off
        base = pid_m * BLOCK_M + off  # key index of the block's first row
        last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, Lq) - 1 + off

        q_ptrs = Q + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        kt_base = K + b.to(tl.int64) * s_kb + kvh.to(tl.int64) * s_kh + offs_d[:, None] * s_kd
        v_base = V + b.to(tl.int64) * s_vb + kvh.to(tl.int64) * s_vh + offs_d[None, :] * s_vd

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        row_id = (b * n_heads + j).to(tl.int64)

        if MODE == 0:
            sink = tl.load(P0 + j)
            local = tl.load(P1 + j)
            win_lo = base - local + 1  # first key of any row's window
            hi = tl.minimum(last + 1, Lk)
            sep = win_lo > sink  # sink and windows apart: the sink is a plain prefix every row sees
            zero = base - base
            s_hi = tl.where(sep, tl.minimum(sink, Lk), zero)
            m_i, l_i, acc = _span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx,
                                  zero, s_hi, zero, s_hi, zero, local, qk_scale, BLOCK_N, False, EVEN_D, IEEE)
            w_lo = tl.where(sep, win_lo, zero)
            w_sink = tl.where(sep, zero, sink)
            unm_lo = tl.maximum(w_lo, last - local + 1)
            unm_hi = tl.minimum(hi, base + 1)
            m_i, l_i, acc = _span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx,
                                  w_lo, hi, unm_lo, unm_hi, w_sink, local, qk_scale, BLOCK_N, True, EVEN_D, IEEE)
        elif MODE == 1:
            n_seg = tl.load(SEGN + row_id)
            seg_ptr = SEG + row_id * KS * 2
            for s in range(0, n_seg):
                d_first = tl.load(seg_ptr + 2 * s)
                d_last = tl.load(seg_ptr + 2 * s + 1)
                lo = tl.maximum(base - d_last, 0)
                hi = tl.minimum(base + BLOCK_M - d_first, Lk)
                m_i, l_i, acc = _span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx,
                                      lo, hi, lo, tl.minimum(hi, base + 1), 0, 0, qk_scale, BLOCK_N, False, EVEN_D, IEEE)
            blk_id = row_id * n_qblocks + pid_m
            n_col = tl.load(CNT + blk_id)
            n_full = (tl.load(CFULL + blk_id) // BLOCK_N) * BLOCK_N  # sorted: a prefix every row sees
            idx_ptr = IDX + blk_id * KI
            for c in range(0, n_full, BLOCK_N):
                cols = tl.load(idx_ptr + c + offs_n)
                m_i, l_i, acc = _chunk(q, m_i, l_i, acc, kt_base, v_base, cols, cols >= 0, s_kn, s_vn, d_ok, q_idx,
                                       0, 0, qk_scale, False, False, EVEN_D, IEEE)
            for c in range(n_full, n_col, BLOCK_N):
                ok = (c + offs_n) < n_col
                cols = tl.load(idx_ptr + c + offs_n, mask=ok, other=0)
                m_i, l_i, acc = _chunk(q, m_i, l_i, acc, kt_base, v_base, cols, ok, s_kn, s_vn, d_ok, q_idx,
                                       0, 0, qk_scale, True, False, EVEN_D, IEEE)
        else:
            blk_id = row_id * n_qblocks + pid_m
            n_blk = tl.load(CNT + blk_id)
            n_full = tl.load(CFULL + blk_id)  # sorted: leading blocks every row sees in full
            idx_ptr = IDX + blk_id * KI
            for t in range(0, n_full):
                cols = tl.load(idx_ptr + t) * BLOCK_N + offs_n
                m_i, l_i, acc = _chunk(q, m_i, l_i, acc, kt_base, v_base, cols, cols >= 0, s_kn, s_vn, d_ok, q_idx,
                                       0, 0, qk_scale, False, False, EVEN_D, IEEE)
            for t in range(n_full, n_blk):
                cols = tl.load(idx_ptr + t) * BLOCK_N + offs_n
                m_i, l_i, acc = _chunk(q, m_i, l_i, acc, kt_base, v_base, cols, cols < Lk, s_kn, s_vn, d_ok, q_idx,
                                       0, 0, qk_scale, True, False, EVEN_D, IEEE)

        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        o_ptrs = O + b.to(tl.int64) * s_ob + h.to(tl.int64) * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + (b * Hq + h).to(tl.int64) * Lq + offs_m, lse, mask=row_ok)


def triton_available(q: torch.Tensor) -> bool:
    """The Triton kernel runs on CUDA tensors, or on CPU tensors when Triton is interpreted."""
    if triton is None or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if q.is_cuda:
        return True
    return q.device.type == "cpu" and _is_triton_interpreted(_minference_fwd)


def default_launch(head_dim: int) -> tuple[int, int]:
    """(num_warps, num_stages) for a 64-row block. Chosen so that ptxas (sm_90a) reports no register
    spills; not yet timed on a GPU (launch/bench_sparse.py --launch W,S compares)."""
    if head_dim <= 64:
        return 4, 2
    return (8, 2) if head_dim <= 128 else (8, 1)


def _attention_triton(q, k, v, groups, *, offset, scale, block_size, launch=None):
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(D))
    BM = block_size
    n_qblocks = _cdiv(Lq, BM)
    warps, stages = launch or default_launch(block_d)
    dev = q.device
    for grp in groups:
        nH = len(grp.heads)
        heads_t = torch.tensor(grp.heads, dtype=torch.int32, device=dev)
        dummy = heads_t
        p0 = p1 = seg = segn = idx = cnt = cfull = dummy
        ks = ki = 0
        if grp.kind == "a_shape":
            mode = 0
            p0 = torch.tensor(grp.sink, dtype=torch.int32, device=dev)
            p1 = torch.tensor(grp.local, dtype=torch.int32, device=dev)
        elif grp.kind == "vertical_slash":
            mode = 1
            ix = grp.index
            seg, segn, idx, cnt, cfull = ix.seg, ix.seg_count, ix.col, ix.col_count, ix.col_full
            ks, ki = seg.shape[2], idx.shape[3]
            if ks == 0:
                seg = dummy
        else:
            mode = 2
            ix = grp.index
            idx, cnt, cfull = ix.blocks, ix.count, ix.full
            ki = idx.shape[3]
        if mode == 1 and ki == 0:
            idx = dummy
        grid = (n_qblocks, B * nH)
        _minference_fwd[grid](
            q, k, v, out, lse, heads_t, p0, p1, seg, segn, idx, cnt, cfull,
            scale * _LOG2E,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            nH, Hq, Hq // Hkv, Lq, Lk, offset, n_qblocks, ks, ki,
            MODE=mode, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=BM, BLOCK_N=BM,
            IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages,
        )
    return out, lse


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def minference_attention(q, k, v, *, q_pos, k_pos, pattern, scale=None, causal=True, backend=None, launch=None):
    """Sparse prefill attention with lse. `pattern`: a SparsePattern (or anything `SparsePattern(...)`
    accepts: one HeadPattern, a sequence of them). backend: None (Triton on CUDA, else torch),
    "triton" or "torch". Non-causal calls and query blocks of fewer than MIN_SPARSE_ROWS rows run
    exact dense attention."""
    from starshard.kernels.attention import attention

    if isinstance(pattern, MInferenceConfig):
        raise TypeError("pass config.pattern(layer, num_heads) (one layer's SparsePattern), not the whole MInferenceConfig")
    if not isinstance(pattern, SparsePattern):
        pattern = SparsePattern(pattern if isinstance(pattern, (list, tuple)) else (pattern,))
    check_shapes(q, k, v)
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    heads = pattern.for_heads(Hq)
    if not causal or Lq < MIN_SPARSE_ROWS or all(isinstance(p, Dense) for p in heads):
        return attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale)
    if Lk == 0:
        return torch.zeros_like(q), torch.full((B, Hq, Lq), float("-inf"), device=q.device)
    offset = query_offset(q_pos, k_pos, Lq, Lk)
    scale = D**-0.5 if scale is None else scale
    groups = build_plan(q, k, pattern, offset=offset, scale=scale)
    return attention_from_plan(q, k, v, groups, offset=offset, scale=scale, block_size=pattern.block_size,
                               backend=backend, launch=launch)


def attention_from_plan(q, k, v, groups, *, offset: int, scale=None, block_size: int = 64, backend=None, launch=None):
    """The attention step alone, from `build_plan`'s groups (benchmarks time the two apart; tests feed
    hand-made indices). backend / launch as in `minference_attention`."""
    check_shapes(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # Default: Triton on CUDA; on CPU the torch path (the interpreter is for tests, which ask for it).
    use_triton = q.is_cuda and triton_available(q) if backend is None else backend == "triton"
    if use_triton:
        if not triton_available(q):
            raise RuntimeError("the Triton MInference kernel needs CUDA tensors (or TRITON_INTERPRET=1 on CPU) and float16/bfloat16/float32")
        return _attention_triton(q, k, v, groups, offset=offset, scale=scale, block_size=block_size, launch=launch)
    return _attention_torch(q, k, v, groups, offset=offset, scale=scale, block_size=block_size)


__all__ = [
    "AShape", "VerticalSlash", "BlockSparse", "Dense", "HeadPattern", "SparsePattern", "MInferenceConfig",
    "minference_attention", "head_pattern", "query_offset", "vs_estimate", "vs_scores", "vs_pick", "pick_vertical", "pick_slash", "vs_select", "vs_segments", "vs_index",
    "bs_select", "build_plan", "attention_from_plan", "group_mask", "kernel_cost", "dense_cost", "VSIndex", "BSIndex", "HeadGroup", "MIN_SPARSE_ROWS",
]
