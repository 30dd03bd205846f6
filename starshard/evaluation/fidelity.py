"""Attention-level fidelity: per layer, how far each approximate attention is from dense attention.

Teacher-forced: the dense model runs once over the input; at every attention layer its post-RoPE
q, k, v are handed to each approximation, and the layer's output goes on as the dense one. Every
approximation is thus judged per layer on the same inputs, and errors do not compound.

Per approximation and layer (float64 by default, float32 on request; in row chunks so an 8K x 8K x
heads score matrix is never materialised at once):
    rel_err_all    ||o_approx - o_dense||_F / ||o_dense||_F over all rows (every row an
                   approximation computes once: Star/APB context rows as block rows, plus the query)
    rel_err_query  the same over the query rows (positions >= context_len; the last row if there is
                   no query), which decide the answer
    recall_mean    per (head, row): the share of the dense softmax mass on the (row, key) pairs the
                   approximation keeps, averaged over rows and heads (AnchorAttention / MInference)
    recall_min_head   the lowest per-head mean recall
    recall_query   recall_mean over the query rows
    density        kept (row, key) pairs / causal pairs
    kernel_rel_err_*  for approximations with their own kernel (MInference): its output, not the
                   masked float64 one, against dense

o_approx of a mask-defined approximation is masked dense attention in float64 (softmax over the kept
keys only; a key a method sees twice counts twice: APB passes no key its receiver's anchor holds, so
none does today, but the model keeps the count). What is modelled is what each method *drops*; keys a method adds that dense attention does not
have (APB's embedded query in the anchor) are not. At layer 0, whose inputs do not depend on attention,
the outputs equal the real strategies' (tests/evaluation/test_fidelity.py checks Star and APB).

Teacher forcing judges each layer on dense inputs: Star and APB compute the query rows densely, so
their query-row error is 0 here; what they lose shows in the context rows (whose KV the query reads).

Approximations implement `Approximation`: `begin_layer` (per-layer state from the layer's inputs),
`keep_mask` (kept pairs for a chunk of rows, causality is applied by the caller) and optionally
`key_counts` (keys seen more than once) and `output` (an output of their own). Implemented: Star,
APB (its own layout and compressor code), MInference (its own index builders and kernel) and
`MaskApproximation` (any kept set given as a mask or as per row-block key index lists, e.g.
AnchorAttention's).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from starshard.engine.model import dense_attend
from starshard.kernels.minference import (
    MIN_SPARSE_ROWS,
    Dense,
    MInferenceConfig,
    build_plan,
    group_mask,
    minference_attention,
)
from starshard.partition import star_blocks
from starshard.parallel.context.apb import APBAttention, _rotate
from starshard.parallel.context.star import StarAttention
from starshard.strategies import APB, STAR

# float64 elements per [heads, rows, keys] score tile (several such tiles live at once): bounds memory.
DEFAULT_TILE_ELEMENTS = 1 << 23
_ROW_ALIGN = 64  # chunks start on multiples of this (MInference's row blocks)


# ----------------------------------------------------------------------------------------------
# Inputs and the interface
# ----------------------------------------------------------------------------------------------


@dataclass
class LayerInputs:
    """One attention layer's teacher-forced inputs (batch 1, squeezed).

    q: [Hq, L, D] after RoPE; k, v: [Hkv, L, D] (k after RoPE); positions are 0 .. L-1 (row i is token i);
    context_len: tokens before the query part (Star/APB encode them, the rest is the query)."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    context_len: int

    @property
    def length(self) -> int:
        return self.q.shape[1]

    @property
    def pos(self) -> torch.Tensor:
        return torch.arange(self.length, device=self.q.device)


class Approximation:
    """An approximate attention, judged by the pairs it keeps (and optionally its own output)."""

    name = "base"

    def bind(self, model) -> None:
        """Learn what the model offers (RoPE, layer ids); called once before the run."""

    def begin_layer(self, x: LayerInputs) -> None:
        """Per-layer state from the layer's inputs (selections, indices); called before keep_mask."""

    def keep_mask(self, x: LayerInputs, r0: int, r1: int) -> torch.Tensor:
        """Kept pairs of rows r0 .. r1-1 against keys 0 .. r1-1: bool [1 | Hkv | Hq, r1-r0, r1].
        Pairs past the causal diagonal may be anything (the caller applies causality)."""
        raise NotImplementedError

    def key_counts(self, x: LayerInputs, r0: int, r1: int) -> torch.Tensor | None:
        """How many times each kept key enters the row's softmax, shaped like keep_mask, or None (once).
        A key in a receiver's anchor and in an earlier rank's passing block would count twice (APB's
        selection leaves those out)."""
        return None

    def output(self, x: LayerInputs) -> torch.Tensor | None:
        """The approximation's own output [Hq, L, D] (e.g. a kernel's), or None."""
        return None

    def config(self) -> dict:
        return {}


def _expand_heads(mask: torch.Tensor, Hq: int, Hkv: int) -> torch.Tensor:
    """[1 | Hkv | Hq, R, K] -> [Hq, R, K] (a KV head's mask is shared by its GQA group)."""
    h = mask.shape[0]
    if h == Hq:
        return mask
    if h == 1:
        return mask.expand(Hq, -1, -1)
    if h == Hkv:
        return mask.repeat_interleave(Hq // Hkv, 0)
    raise ValueError(f"keep_mask gave {h} heads; expected 1, {Hkv} (KV heads) or {Hq} (query heads)")


# ----------------------------------------------------------------------------------------------
# Star Attention
# ----------------------------------------------------------------------------------------------


class StarApproximation(Approximation):
    """Star Attention's pairs: a context row in the block starting at s sees the anchor (positions
    < min(anchor, s)) and its own block causally; query rows see everything. Block defaults to
    ceil(context / cp), anchor to the block (StarAttention.resolved_sizes)."""

    def __init__(self, block_size: int | None = None, anchor_size: int | None = None, cp: int = 4):
        if block_size is None and cp < 1:
            raise ValueError(f"star: cp must be >= 1, got {cp}")
        for flag, v in (("block", block_size), ("anchor", anchor_size)):
            if v is not None and v < 1:
                raise ValueError(f"star: {flag} must be >= 1, got {v}")
        self.block_size, self.anchor_size, self.cp = block_size, anchor_size, cp
        parts = [f"b={block_size}" if block_size else f"cp={cp}"] + ([f"a={anchor_size}"] if anchor_size else [])
        self.name = f"{STAR.name}({','.join(parts)})"

    def config(self) -> dict:
        return {"kind": STAR.name, "block_size": self.block_size, "anchor_size": self.anchor_size, "cp": self.cp,
                "resolved": getattr(self, "_resolved", None)}

    def begin_layer(self, x: LayerInputs) -> None:

        C = x.context_len
        strat = StarAttention(None, block_size=self.block_size or max(1, math.ceil(C / self.cp)),
                              anchor_size=self.anchor_size)
        block, anchor = strat.resolved_sizes(C)
        self._resolved = {"block": block, "anchor": anchor}
        L = x.length
        start = torch.full((L,), 0, dtype=torch.long)  # query rows: everything from 0
        lo = torch.zeros(L, dtype=torch.long)
        for s, e in star_blocks(C, block, 1)[0]:
            start[s:e] = s
            lo[s:e] = min(anchor, s)
        self._start, self._anchor_end = start.to(x.q.device), lo.to(x.q.device)

    def keep_mask(self, x, r0, r1):
        j = torch.arange(r1, device=x.q.device)
        keep = (j[None, :] < self._anchor_end[r0:r1, None]) | (j[None, :] >= self._start[r0:r1, None])
        return keep[None]


# ----------------------------------------------------------------------------------------------
# APB
# ----------------------------------------------------------------------------------------------


class APBApproximation(Approximation):
    """APB's pairs over a virtual CP group of `cp` ranks: a context row of rank h >= 1 sees the anchor's
    context tokens, the passing entries every earlier rank selected (per KV head) and its own block
    causally; rank 0's rows and the query rows are dense. Layout and selection are APB's own code
    (APBAttention.segments / _select with its compressor) run on the teacher-forced q, k, v: the
    embedded query's q is the dense query's q rotated back to where APB embeds it."""

    def __init__(self, cp: int = 4, *, anchor_size: int | None = None, passing_size: int | None = None,
                 compressor="query", embed_query: bool = True, prefix_len: int = 0, compressor_path=None,
                 seed: int = 0):
        if cp < 1:
            raise ValueError(f"apb: cp must be >= 1, got {cp}")
        self.cp = cp
        self.strategy = APBAttention(None, anchor_size=anchor_size, passing_size=passing_size, compressor=compressor,
                                     embed_query=embed_query, prefix_len=prefix_len,
                                     compressor_path=compressor_path, seed=seed)
        # A stand-in for a CP group of `cp` ranks: only the layout arithmetic and the compressor run.
        self.strategy.cp = cp
        self._cfg = {"kind": APB.name, "cp": cp, "anchor_size": anchor_size, "passing_size": passing_size,
                     "compressor": getattr(self.strategy.compressor, "name", str(compressor)),
                     "embed_query": embed_query, "prefix_len": prefix_len}
        parts = [f"cp={cp}"] + [f"{k[0]}={v}" for k, v in (("anchor", anchor_size), ("passing", passing_size))
                                if v is not None]
        if self._cfg["compressor"] != "query":
            parts.append(self._cfg["compressor"])
        if not embed_query:
            parts.append("no-query")
        self.name = f"{APB.name}({','.join(parts)})"
        self.selected: dict[int, list] = {}  # layer -> per rank: positions [Hkv, m] (tests, inspection)

    def bind(self, model) -> None:
        self.strategy.bind(model)

    def config(self) -> dict:
        return {**self._cfg, "resolved": getattr(self, "_resolved", None)}

    def begin_layer(self, x: LayerInputs) -> None:
        st, cp, C, L = self.strategy, self.cp, x.context_len, x.length
        Hkv, dev = x.k.shape[0], x.q.device
        q, k, v = x.q[None], x.k[None], x.v[None]
        # keys[:, r]: [Hkv, L] how often rank r's block rows see each key (causality applied later); row
        # r = cp: the query. A key is seen twice when it is in the anchor and in an earlier rank's passing block.
        keys = torch.zeros(Hkv, cp + 1, L, dtype=torch.int32, device=dev)
        keys[:, 0] = 1
        keys[:, cp] = 1
        heads = torch.arange(Hkv, device=dev)[:, None]
        selected = []
        for r in range(cp):
            st.rank = r
            seg = st.segments(L, C)[0]
            s, e = st._bounds[r], st._bounds[r + 1]
            if r > 0:
                front = seg.index[: seg.n_front]
                keys[:, r, front[front < C].to(dev)] += 1  # the anchor's context tokens
                keys[:, r, s:e] += 1
                for sel in selected[:r]:  # positions are distinct within one rank's selection
                    keys[heads, r, sel] += 1
            if r == cp - 1 or cp == 1 or st._sizes[1] == 0:
                selected.append(torch.zeros(Hkv, 0, dtype=torch.long, device=dev))
                continue
            idx = seg.index.to(dev)
            qs, ks, vs = q[:, :, idx], k[:, :, idx], v[:, :, idx]
            if seg.query_rows is not None and seg.query_shift and st.inv_freq is not None:
                # APB computes the query's q at its embedded positions and rotates it forward by
                # query_shift; teacher-forced, the dense q sits at the true positions: rotate it back.
                a, b = seg.query_rows
                qs = qs.clone()
                qs[:, :, a:b] = _rotate(qs[:, :, a:b], -seg.query_shift, st.inv_freq).to(qs.dtype)
            _, _, pos = st._select(x.layer, seg, qs, ks, vs, seg.positions.to(dev))
            selected.append(pos[0].long())
        self._keys, self._twice = keys, bool((keys > 1).any())
        self._row_rank = torch.full((L,), cp, dtype=torch.long, device=dev)
        for r in range(cp):
            self._row_rank[st._bounds[r] : st._bounds[r + 1]] = r
        self.selected[x.layer] = [p.cpu() for p in selected]
        self._resolved = {"anchor": st._sizes[0], "passing": st._sizes[1], "bounds": list(st._bounds)}

    def keep_mask(self, x, r0, r1):
        return self._keys[:, self._row_rank[r0:r1], :r1] > 0

    def key_counts(self, x, r0, r1):
        return self._keys[:, self._row_rank[r0:r1], :r1] if self._twice else None


# ----------------------------------------------------------------------------------------------
# MInference
# ----------------------------------------------------------------------------------------------


class MInferenceApproximation(Approximation):
    """MInference over the whole prompt (one prefill call, q_pos = k_pos = 0 .. L-1): the kept pairs
    from its own index builders (`build_plan`, `group_mask`), the output also from its kernel
    (`minference_attention`; Triton where it runs, else its torch path)."""

    def __init__(self, config, name: str | None = None, backend: str | None = None, kernel_output: bool = True):
        if not isinstance(config, MInferenceConfig):
            raise TypeError("MInferenceApproximation needs a MInferenceConfig")
        self.mcfg, self.backend, self.kernel_output = config, backend, kernel_output
        self.name = name or "minference"

    def config(self) -> dict:
        return {"kind": "minference", "config": self.mcfg.to_dict()}

    def begin_layer(self, x: LayerInputs) -> None:
        Hq, L, D = x.q.shape
        self._pattern = self.mcfg.pattern(x.layer, Hq)
        self._groups = None
        if L >= MIN_SPARSE_ROWS and not all(isinstance(p, Dense) for p in self._pattern.for_heads(Hq)):
            self._groups = build_plan(x.q[None], x.k[None], self._pattern, offset=0, scale=D**-0.5)

    def keep_mask(self, x, r0, r1):
        if self._groups is None:  # too short to sparsify, or all heads dense: MInference runs dense
            return torch.ones(1, r1 - r0, r1, dtype=torch.bool, device=x.q.device)
        Hq, L = x.q.shape[:2]
        BM = self._pattern.block_size
        b0, b1 = r0 // BM, -(-r1 // BM)
        blocks = torch.arange(b0, b1, device=x.q.device)
        vis = torch.zeros(Hq, (b1 - b0) * BM, L, dtype=torch.bool, device=x.q.device)
        for grp in self._groups:
            vis[grp.heads] = group_mask(grp, B=1, Lq=L, Lk=L, offset=0, block_size=BM, blocks=blocks)[0]
        return vis[:, r0 - b0 * BM : r1 - b0 * BM, :r1]

    def output(self, x):
        if not self.kernel_output:
            return None
        pos = x.pos
        out, _ = minference_attention(x.q[None], x.k[None], x.v[None], q_pos=pos, k_pos=pos, pattern=self._pattern,
                                      backend=self.backend)
        return out[0]


# ----------------------------------------------------------------------------------------------
# Any kept set (AnchorAttention and others)
# ----------------------------------------------------------------------------------------------


@dataclass
class BlockKeys:
    """Kept keys as index lists: for query rows [m * block_rows, (m+1) * block_rows), head h keeps the keys
    keys[h, m, :] (-1 = padding). heads: 1, Hkv or Hq. block_rows = 1 gives per-row lists. With
    key_block > 1 the entries are key-block indices: entry b keeps keys [b * key_block, (b+1) * key_block)."""

    block_rows: int
    keys: torch.Tensor  # long [heads, n_row_blocks, K]
    key_block: int = 1


class MaskApproximation(Approximation):
    """A kept set from a function of the layer's inputs: `select(x: LayerInputs)` returns a bool mask
    [1 | Hkv | Hq, L, L] or `BlockKeys` index lists (the scalable form: the mask of a chunk of rows is
    built when it is needed). Output: masked dense attention (float64)."""

    def __init__(self, name: str, select: Callable[[LayerInputs], "torch.Tensor | BlockKeys"]):
        self.name, self.select = name, select

    def config(self) -> dict:
        return {"kind": "mask", "select": getattr(self.select, "__qualname__", repr(self.select))}

    def begin_layer(self, x: LayerInputs) -> None:
        kept = self.select(x)
        L = x.length
        if isinstance(kept, BlockKeys):
            if kept.block_rows < 1 or kept.key_block < 1 or kept.keys.dim() != 3:
                raise ValueError("BlockKeys needs block_rows >= 1, key_block >= 1 and keys [heads, row blocks, K]")
            need = -(-L // kept.block_rows)
            if kept.keys.shape[1] < need:
                raise ValueError(f"BlockKeys covers {kept.keys.shape[1]} row blocks of {kept.block_rows}; "
                                 f"{L} rows need {need}")
            keys = kept.keys.long().to(x.q.device)
            n_keys = -(-L // kept.key_block)
            if bool((keys >= n_keys).any() | (keys < -1).any()):
                unit = "key indices" if kept.key_block == 1 else f"key-block indices (blocks of {kept.key_block})"
                raise ValueError(f"BlockKeys {unit} must lie in [0, {n_keys}) (or -1 for padding)")
            self._keys, self._kept, self._mask = keys, kept, None
        else:
            if kept.dtype != torch.bool or kept.dim() != 3 or tuple(kept.shape[1:]) != (L, L):
                raise ValueError(f"select must return BlockKeys or a bool mask [heads, {L}, {L}], got "
                                 f"{kept.dtype} {tuple(kept.shape)}")
            self._mask, self._keys = kept.to(x.q.device), None

    def keep_mask(self, x, r0, r1):
        if self._mask is not None:
            return self._mask[:, r0:r1, :r1]
        br, kb = self._kept.block_rows, self._kept.key_block
        b0, b1 = r0 // br, (r1 - 1) // br + 1
        keys = self._keys[:, b0:b1]  # [h, nb, K] of the row blocks this chunk touches
        nk = -(-r1 // kb)  # key blocks that reach keys < r1
        table = torch.zeros(keys.shape[0], b1 - b0, nk + 1, dtype=torch.bool, device=keys.device)
        table.scatter_(-1, torch.where((keys < 0) | (keys >= nk), nk, keys), True)
        table = table[..., :nk]
        if kb > 1:
            table = table.repeat_interleave(kb, -1)
        rows = torch.arange(r0, r1, device=keys.device) // br - b0
        return table[:, rows, :r1]


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------


@dataclass
class LayerFidelity:
    layer: int
    rel_err_all: float
    rel_err_query: float
    recall_mean: float
    recall_min_head: float
    recall_query: float
    density: float
    recall_heads: list = field(default_factory=list)  # per query head: mean recall over rows
    kernel_rel_err_all: float | None = None
    kernel_rel_err_query: float | None = None


class _Acc:
    """Running sums for one (approximation, layer)."""

    def __init__(self, Hq: int, dev):
        z = lambda: torch.zeros((), dtype=torch.float64, device=dev)  # noqa: E731
        self.err_all, self.err_q = z(), z()
        self.recall_head = torch.zeros(Hq, dtype=torch.float64, device=dev)
        self.recall_q = z()
        self.kept = z()


def query_rows(L: int, context_len: int) -> slice:
    """Rows that decide the answer: the query part, or the last row when there is none."""
    return slice(context_len, L) if context_len < L else slice(L - 1, L)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref||_F / ||ref||_F in float64."""
    a, ref = a.double(), ref.double()
    den = ref.norm()
    return float((a - ref).norm() / den) if den > 0 else float((a - ref).norm())


def _masked_softmax(s: torch.Tensor, keep: torch.Tensor, counts: torch.Tensor | None, Hq: int, Hkv: int):
    """Softmax over the kept keys, a key counted `counts` times (exp(s + log n)); rows that keep no key
    give 0, as the kernels do."""
    if counts is not None:  # log on the KV-head tensor, before it is expanded to the query heads
        s = s + _expand_heads(counts.to(s.device, s.dtype).log(), Hq, Hkv)
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
    return p if bool(keep.any(-1).all()) else p.nan_to_num(0.0)


def _chunk_rows(Hq: int, L: int, tile_elements: int) -> int:
    """Rows per chunk so that [Hq, rows, keys <= L] tiles stay within the budget; aligned starts."""
    return max(_ROW_ALIGN, tile_elements // max(1, Hq * L) // _ROW_ALIGN * _ROW_ALIGN)


def masked_output(x: LayerInputs, approximation: Approximation, *, dtype: torch.dtype = torch.float64,
                  tile_elements: int = DEFAULT_TILE_ELEMENTS, begin: bool = True) -> torch.Tensor:
    """The approximation's masked dense attention output [Hq, L, D] (softmax over its kept, causal keys;
    rows that keep nothing give 0). What layer_fidelity compares with dense; for tests and inspection."""
    Hq, L, D = x.q.shape
    Hkv = x.k.shape[0]
    if begin:
        approximation.begin_layer(x)
    k = x.k.to(dtype).repeat_interleave(Hq // Hkv, 0)
    v = x.v.to(dtype).repeat_interleave(Hq // Hkv, 0)
    out = torch.empty(Hq, L, D, dtype=dtype, device=x.q.device)
    j = torch.arange(L, device=x.q.device)
    rows = _chunk_rows(Hq, L, tile_elements)
    for r0 in range(0, L, rows):
        r1 = min(L, r0 + rows)
        m = _expand_heads(approximation.keep_mask(x, r0, r1).to(x.q.device), Hq, Hkv) & (j[None, :r1] <= j[r0:r1, None])
        s = torch.einsum("hrd,hkd->hrk", x.q[:, r0:r1].to(dtype), k[:, :r1]) * D**-0.5
        out[:, r0:r1] = _masked_softmax(s, m, approximation.key_counts(x, r0, r1), Hq, Hkv) @ v[:, :r1]
    return out


def layer_fidelity(x: LayerInputs, approximations: list[Approximation],
                   tile_elements: int = DEFAULT_TILE_ELEMENTS,
                   dtype: torch.dtype = torch.float64) -> list[LayerFidelity]:
    """Every approximation's metrics on one layer, in chunks of rows. dtype: of the score / output math
    (float64 by default; float32 halves memory and time on a GPU); sums are always float64."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"fidelity math runs in float32 or float64, got {dtype}")
    Hq, L, D = x.q.shape
    Hkv = x.k.shape[0]
    g = Hq // Hkv
    dev = x.q.device
    qd = x.q.to(dtype)
    kd = x.k.to(dtype).repeat_interleave(g, 0)
    vd = x.v.to(dtype).repeat_interleave(g, 0)
    scale = D**-0.5
    qr = query_rows(L, x.context_len)
    for a in approximations:
        a.begin_layer(x)
    accs = [_Acc(Hq, dev) for _ in approximations]
    ref_all = torch.zeros((), dtype=torch.float64, device=dev)
    ref_q = torch.zeros((), dtype=torch.float64, device=dev)
    o_dense = torch.empty(Hq, L, D, dtype=dtype, device=dev)
    rows = _chunk_rows(Hq, L, tile_elements)
    j = torch.arange(L, device=dev)
    for r0 in range(0, L, rows):
        r1 = min(L, r0 + rows)
        causal = j[None, :r1] <= j[r0:r1, None]  # [R, K]
        s = torch.einsum("hrd,hkd->hrk", qd[:, r0:r1], kd[:, :r1]) * scale
        s = s.masked_fill(~causal, float("-inf"))
        p = torch.softmax(s, -1)
        od = p @ vd[:, :r1]
        o_dense[:, r0:r1] = od
        in_q = (j[r0:r1] >= qr.start) & (j[r0:r1] < qr.stop)  # [R]
        sq = od.double().pow(2).sum(-1)  # [Hq, R]
        ref_all += sq.sum()
        ref_q += sq[:, in_q].sum()
        for a, acc in zip(approximations, accs):
            m = _expand_heads(a.keep_mask(x, r0, r1).to(dev), Hq, Hkv)
            if tuple(m.shape[1:]) != (r1 - r0, r1):
                raise ValueError(f"{a.name}: keep_mask gave {tuple(m.shape)} for rows {r0}..{r1 - 1}; "
                                 f"expected [heads, {r1 - r0}, {r1}]")
            m = m & causal
            rec = (p * m).sum(-1, dtype=torch.float64)  # [Hq, R]
            acc.recall_head += rec.sum(-1)
            acc.recall_q += rec[:, in_q].sum()
            acc.kept += m.sum()
            counts = a.key_counts(x, r0, r1)
            if counts is None and bool((m | ~causal).all()):
                continue  # every causal pair kept once: the output is the dense one (rows of a dense rank)
            pa = _masked_softmax(s, m, counts, Hq, Hkv)
            diff = (pa @ vd[:, :r1] - od).double().pow(2).sum(-1)
            acc.err_all += diff.sum()
            acc.err_q += diff[:, in_q].sum()
            del m, pa
        del s, p
    n_q = qr.stop - qr.start
    pairs = Hq * L * (L + 1) / 2
    out = []
    for a, acc in zip(approximations, accs):
        head_mean = acc.recall_head / L
        f = LayerFidelity(
            layer=x.layer,
            rel_err_all=float((acc.err_all / ref_all).sqrt()),
            rel_err_query=float((acc.err_q / ref_q).sqrt()),
            recall_mean=float(head_mean.mean()),
            recall_min_head=float(head_mean.min()),
            recall_query=float(acc.recall_q / (Hq * n_q)),
            density=float(acc.kept / pairs),
            recall_heads=head_mean.tolist(),
        )
        own = a.output(x)
        if own is not None:
            f.kernel_rel_err_all = rel_err(own, o_dense)
            f.kernel_rel_err_query = rel_err(own[:, qr], o_dense[:, qr])
        out.append(f)
    return out


# ----------------------------------------------------------------------------------------------
# The teacher-forced run and its report
# ----------------------------------------------------------------------------------------------


@dataclass
class FidelityReport:
    meta: dict
    configs: dict = field(default_factory=dict)  # name -> approximation config
    layers: dict = field(default_factory=dict)  # name -> [LayerFidelity]

    def summary(self) -> dict:
        """Per approximation: the mean of each metric over layers, the worst layer's recall and error, and
        the worst (layer, head) recall."""
        out = {}
        for name, rows in self.layers.items():
            keys = [k for k, v in asdict(rows[0]).items() if k != "layer" and isinstance(v, float)]
            s = {f"mean_{k}": sum(getattr(r, k) for r in rows) / len(rows) for k in keys}
            s["min_layer_recall_mean"] = min(r.recall_mean for r in rows)
            s["min_head_recall"] = min(r.recall_min_head for r in rows)  # the worst (layer, head)
            s["max_layer_rel_err_query"] = max(r.rel_err_query for r in rows)
            out[name] = s
        return out

    def to_dict(self) -> dict:
        return {"meta": self.meta, "summary": self.summary(), "configs": self.configs,
                "layers": {n: [asdict(r) for r in rows] for n, rows in self.layers.items()}}

    def markdown(self) -> str:
        lines = ["| approximation | recall (mean) | recall (min head) | recall (query rows) | rel. error (all rows) "
                 "| rel. error (query rows) | kernel rel. error (query rows) | density |",
                 "|---|---|---|---|---|---|---|---|"]
        for name, s in self.summary().items():
            kq = s.get("mean_kernel_rel_err_query")
            lines.append(f"| {name} | {s['mean_recall_mean']:.4f} | {s['mean_recall_min_head']:.4f} | "
                         f"{s['mean_recall_query']:.4f} | {s['mean_rel_err_all']:.2e} | "
                         f"{s['mean_rel_err_query']:.2e} | "
                         f"{'-' if kq is None else f'{kq:.2e}'} | {s['mean_density']:.3f} |")
        m = self.meta
        lines.append("")
        lines.append(f"Means over {m.get('num_layers')} layers; {m.get('length')} tokens "
                     f"({m.get('context_len')} context + {m.get('length', 0) - m.get('context_len', 0)} query); "
                     f"input: {m.get('input')}; model: {m.get('model')}.")
        return "\n".join(lines)

    def write(self, out: Path) -> list[Path]:
        """fidelity.json, fidelity.md and (with matplotlib) fidelity.png under `out`."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fidelity.json").write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        (out / "fidelity.md").write_text(self.markdown() + "\n")
        written = [out / "fidelity.json", out / "fidelity.md"]
        if self.plot(out / "fidelity.png"):
            written.append(out / "fidelity.png")
        return written

    def plot(self, path: Path) -> bool:
        """Per-layer recall and relative error per approximation; False without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            from matplotlib.ticker import MaxNLocator
        except ImportError:
            return False
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
        nan = float("nan")
        for name, rows in self.layers.items():
            ls = [r.layer for r in rows]
            line = ax1.plot(ls, [r.recall_mean for r in rows], marker="o", ms=3, label=name)[0]
            ax1.plot(ls, [r.recall_min_head for r in rows], ls=":", color=line.get_color())
            # A log axis cannot show 0 (Star / APB query rows are exact here): those points are left out.
            ax2.plot(ls, [r.rel_err_all if r.rel_err_all > 0 else nan for r in rows], marker="o", ms=3,
                     color=line.get_color())
            ax2.plot(ls, [r.rel_err_query if r.rel_err_query > 0 else nan for r in rows], ls="--",
                     color=line.get_color())
        ax1.set(xlabel="layer", ylabel="attention recall", title="recall: mean (solid), lowest head (dotted)")
        ax2.set(xlabel="layer", ylabel="relative output error", yscale="log",
                title="error vs dense: all rows (solid), query rows (dashed; 0 not drawn)")
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=min(4, len(self.layers)), fontsize=7)
        fig.suptitle(f"attention fidelity vs dense (teacher-forced), {self.meta.get('length')} tokens: "
                     f"{self.meta.get('input')}", fontsize=9)
        fig.tight_layout(rect=(0, 0.04 + 0.035 * ((len(self.layers) - 1) // 4), 1, 1))
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return True


def capture_attention(model, ids: torch.Tensor,
                      on_layer: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]):
    """Run the model densely over ids [L] (positions 0 .. L-1) calling on_layer(layer, q, k, v) with each
    layer's post-RoPE q [1, Hq, L, D], k, v [1, Hkv, L, D]; returns the logits. The model's hooks are
    restored afterwards."""

    def hook(layer_id):
        def attend(q, k, v, pos, cache, sparse=None, **extras):  # extras: the layer's window, softcap, scale
            on_layer(layer_id, q, k, v)
            return dense_attend(q, k, v, pos, cache, sparse=sparse, **extras)

        return attend

    with model.attention_hooks([hook(lid) for lid in model.layer_ids]), torch.no_grad():
        # Only the last row's logits: an 8K x vocab float32 logits tensor would be ~1.6 GB.
        return model(ids[None].to(next(model.parameters()).device), last_only=True)


def measure(model, ids, context_len: int, approximations: list[Approximation], *, layers=None,
            tile_elements: int = DEFAULT_TILE_ELEMENTS, compute_device=None, dtype: torch.dtype = torch.float64,
            meta: dict | None = None, progress: Callable[[int], None] | None = None) -> FidelityReport:
    """Teacher-forced fidelity of each approximation on one input.

    ids: token ids [L] (list or tensor); context_len: tokens before the query part (1 <= .. <= L). As
    in the engine's runner, a prompt with no query part lends its last token as the query
    (context_len = L becomes L - 1). layers: global layer ids to measure (default all).
    compute_device: where the metrics run (default: the model's device); dtype: their precision."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    L = ids.numel()
    if L < 2:
        raise ValueError(f"the input has {L} token(s); fidelity needs at least 2")
    if not 1 <= context_len <= L:
        raise ValueError(f"context_len {context_len} must lie in [1, {L}] (the tokens before the query)")
    context_len = min(context_len, L - 1)  # Star / APB need >= 1 query token (ContextParallelRunner.prefill)
    names = [a.name for a in approximations]
    if not approximations or len(set(names)) != len(names):
        raise ValueError(f"give at least one approximation, each with its own name; got {names}")
    wanted = set(model.layer_ids if layers is None else layers)
    missing = wanted - set(model.layer_ids)
    if missing:
        raise ValueError(f"layers {sorted(missing)} are not in this model (layers 0 .. {max(model.layer_ids)})")
    for a in approximations:
        a.bind(model)
    report = FidelityReport(meta={"length": L, "context_len": context_len, "num_layers": len(wanted),
                                  "dtype": str(dtype).replace("torch.", ""),
                                  **(meta or {})},
                            configs={}, layers={n: [] for n in names})

    def on_layer(lid, q, k, v):
        if lid not in wanted:
            return
        dev = compute_device or q.device
        x = LayerInputs(lid, q[0].to(dev), k[0].to(dev), v[0].to(dev), context_len)
        for a, f in zip(approximations, layer_fidelity(x, approximations, tile_elements, dtype)):
            report.layers[a.name].append(f)
        if progress is not None:
            progress(lid)

    capture_attention(model, ids, on_layer)
    report.configs = {a.name: a.config() for a in approximations}
    return report
