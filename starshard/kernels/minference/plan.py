"""Plans: a call's heads grouped by pattern kind, each group with its index; the groups' visibility
masks (torch path, tests, recall), the score entries the kernel computes for them (cost), and the
cost model that sends a head to the dense kernel where its sparse kernel would not win
(`KernelRates`, `plan_with_fallback`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from starshard.kernels.common import INT32_MAX, cdiv, for_head_dim, to_device
from starshard.kernels.minference.columns import use_columns_kernel
from starshard.kernels.minference.index import BSIndex, VSIndex, bs_select, vs_index, vs_segments, vs_select
from starshard.kernels.minference.patterns import AShape, Dense
from starshard.kernels.minference.runs import vs_runs_kernel


@dataclass
class HeadGroup:
    kind: str  # "a_shape" (Dense heads too), "vertical_slash", "block_sparse"
    heads: list
    index: object = None  # VSIndex / BSIndex
    sink: list = None  # a_shape
    local: list = None


def _grouped(heads, *, Lq: int, Lk: int, offset: int) -> dict[str, HeadGroup]:
    """The call's heads grouped by kind, without indices (A-shape / Dense heads with their windows)."""
    full = min(INT32_MAX // 4, Lk + Lq + offset + 1)  # a window that covers every key
    groups: dict[str, HeadGroup] = {}
    for h, p in enumerate(heads):
        kind = "a_shape" if isinstance(p, (AShape, Dense)) else p.kind
        grp = groups.setdefault(kind, HeadGroup(kind, []))
        grp.heads.append(h)
        if kind == "a_shape":
            grp.sink = (grp.sink or []) + [0 if isinstance(p, Dense) else min(p.sink, full)]
            grp.local = (grp.local or []) + [full if isinstance(p, Dense) else min(p.local, full)]
    return groups


def _vs_pick(q, k, pattern, heads, grp_heads, *, offset, scale):
    ps = [heads[h] for h in grp_heads]
    return vs_select(q, k, offset=offset, vertical=[p.vertical for p in ps], slash=[p.slash for p in ps],
                     last_q=pattern.last_q, force_sink=pattern.force_sink, force_local=pattern.force_local,
                     scale=scale, heads=grp_heads, vertical_aware=pattern.vertical_aware)


def build_plan(q, k, pattern, *, offset: int, scale=None) -> list[HeadGroup]:
    """Group the call's heads by kind and build each group's index (torch, on q's device).
    `pattern`: a SparsePattern (its head patterns for q's heads and its index parameters)."""
    Hq, Lq, Lk = q.shape[1], q.shape[2], k.shape[2]
    heads = pattern.for_heads(Hq)
    BM = pattern.block_size
    groups = _grouped(heads, Lq=Lq, Lk=Lk, offset=offset)
    if "vertical_slash" in groups:
        grp = groups["vertical_slash"]
        v_idx, s_idx = _vs_pick(q, k, pattern, heads, grp.heads, offset=offset, scale=scale)
        grp.index = vs_index(v_idx, s_idx, Lq=Lq, Lk=Lk, offset=offset, block_size=BM, heads=grp.heads)
    if "block_sparse" in groups:
        grp = groups["block_sparse"]
        grp.index = bs_select(q, k, offset=offset, topk=[heads[h].topk for h in grp.heads], block_size=BM,
                              scale=scale, heads=grp.heads)
    return list(groups.values())


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
        nN = cdiv(Lk, BM)
        bm = torch.zeros(B, nH, nb, nN + 1, dtype=torch.bool, device=dev)
        bm.scatter_(-1, torch.where(bvalid, bl, nN), True)
        blk = bm[..., :nN].repeat_interleave(BM, -1)[..., :Lk]
    return blk.repeat_interleave(BM, 2) & causal


def kernel_cost(grp: HeadGroup, *, B: int, Lq: int, Lk: int, offset: int, block_size: int) -> torch.Tensor:
    """Score entries the Triton kernel computes (masked ones included), per head: [B, nH] int64.
    The unit of the search's equal-cost comparison and the bench's density."""
    BM = BN = block_size
    nM = cdiv(Lq, BM)
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
        return slash_cost(idx.seg, idx.seg_count, Lq=Lq, Lk=Lk, offset=offset, block_size=BM) + column_cost(
            idx.col_count, block_size=BM)
    return grp.index.count.long().sum(-1) * BM * BN


def dense_cost(*, Lq: int, Lk: int, offset: int, block_size: int) -> int:
    """Score entries a causal flash kernel with block_size x block_size tiles computes."""
    g = HeadGroup("a_shape", [0], sink=[0], local=[INT32_MAX // 4])
    return int(kernel_cost(g, B=1, Lq=Lq, Lk=Lk, offset=offset, block_size=block_size)[0, 0])


def _ramp_sum(x0: torch.Tensor, x1: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """sum of clamp(t, 0, cap) over the integers t = x0 .. x1 (0 where x1 < x0), elementwise, int64."""

    def upto(x):  # sum over t = 0 .. x (0 for x < 0)
        x = x.clamp(min=-1)
        low = torch.minimum(x, cap).clamp(min=0)
        return torch.where(x < 0, 0, low * (low + 1) // 2 + (x - low).clamp(min=0) * cap)

    return torch.where(x1 < x0, 0, upto(x1) - upto(x0 - 1))


def slash_cost(seg: torch.Tensor, seg_count: torch.Tensor, *, Lq: int, Lk: int, offset: int, block_size: int) -> torch.Tensor:
    """Score entries the kernel computes for a Vertical-Slash index's diagonal runs, per head: [B, nH]
    int64, in closed form (O(runs), no [row blocks x runs] temporaries). Row block m (first key index
    b = m*B + off) streams run (d_first, d_last) as [max(0, b - d_last), min(Lk, b + B - d_first)) in
    B-wide chunks: max(0, m + ceil((off + B - d_first) / B)) chunks, capped at 1 + ceil((d_last -
    d_first) / B), while b + B - d_first <= Lk; after that min(ceil(Lk / B), max(0, ceil((Lk + d_last -
    off) / B) - m)). Both are clamped ramps in m, summed exactly."""
    BM = block_size
    nM = cdiv(Lq, BM)
    a, b = seg[..., 0].long(), seg[..., 1].long()  # [B, nH, KS]
    used = torch.arange(seg.shape[2], device=seg.device) < seg_count[..., None].long()
    cap = 1 + torch.div(b - a + BM - 1, BM, rounding_mode="floor")
    c0 = -torch.div(a - offset - BM, BM, rounding_mode="floor")  # ceil((off + BM - a) / BM)
    m_c = (torch.div(Lk - offset - BM + a, BM, rounding_mode="floor") + 1).clamp(0, nM)  # first block hi clamps
    k1 = -torch.div(offset - Lk - b, BM, rounding_mode="floor")  # ceil((Lk + b - off) / BM)
    cl = torch.full_like(a, cdiv(Lk, BM))
    head = _ramp_sum(c0, c0 + m_c - 1, cap)
    tail = _ramp_sum(k1 - nM + 1, k1 - m_c, cl)
    return torch.where(used, head + tail, 0).sum(-1) * BM * BM


def vs_runs(s_idx: torch.Tensor, *, Lq: int, Lk: int, offset: int, block_size: int, use_triton: bool | None = None):
    """(seg, seg_count, cost [B, nH] int64): `vs_segments` of sorted diagonals and their `slash_cost`,
    from runs.py's one launch with use_triton (None: where the column lists' kernel runs, on CUDA),
    else from the torch ops."""
    if use_columns_kernel(s_idx) if use_triton is None else use_triton:
        return vs_runs_kernel(s_idx, ndiag=Lq + offset, Lq=Lq, Lk=Lk, offset=offset, block_size=block_size)
    seg, seg_count = vs_segments(s_idx, Lq + offset, block_size)
    return seg, seg_count, slash_cost(seg, seg_count, Lq=Lq, Lk=Lk, offset=offset, block_size=block_size)


def column_cost(col_count: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """Score entries of a Vertical-Slash index's gathered columns (B at a time per row block): [B, nH]."""
    BM = block_size
    return torch.div(col_count.long() + BM - 1, BM, rounding_mode="floor").sum(-1) * BM * BM


def block_sparse_cost(topk, *, Lq: int, Lk: int, offset: int, block_size: int) -> torch.Tensor:
    """Score entries of Block-Sparse heads before their index exists (host, [nH] int64): row block m
    takes min(topk, the key blocks its last row sees) blocks, whatever the scores (`bs_select`)."""
    BM = block_size
    m = torch.arange(cdiv(Lq, BM))
    last = torch.clamp(m * BM + BM, max=Lq) - 1 + offset
    visible = torch.clamp(torch.div(last, BM, rounding_mode="floor") + 1, 0, cdiv(Lk, BM))
    topk = torch.tensor([int(t) for t in topk])[:, None]
    return torch.minimum(topk, visible[None]).sum(-1) * BM * BM


# --------------------------------------------------------------------------------------------------
# Cost model: sparse only where it beats the dense kernel
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelRates:
    """Measured speeds for the dense-or-sparse choice. `dense`: score entries per second of the dense
    kernel (cuDNN SDPA, causal; entries counted as `dense_cost` counts them); `a_shape`,
    `vertical_slash`, `block_sparse`: each sparse kernel's speed per entry it computes (`kernel_cost`)
    as a fraction of `dense`; `bs_index`: seconds per (head x key) of the index work still ahead when
    the choice is made (Block-Sparse: its pooled selection, all of it, since its cost is known without
    scores; a Vertical-Slash index is built whole before its choice, so nothing of it is ahead).

    A head runs sparse iff kernel entries / (fraction * dense) + index seconds < dense entries / dense,
    i.e. (index aside) iff its density (kernel entries / dense entries) is below the fraction."""

    dense: float
    a_shape: float
    vertical_slash: float
    block_sparse: float
    bs_index: float = 0.0

    def fraction(self, kind: str) -> float:
        return {"a_shape": self.a_shape, "vertical_slash": self.vertical_slash, "block_sparse": self.block_sparse}[kind]

    def sparse_wins(self, kind: str, entries: float, dense_entries: float, index_s: float = 0.0) -> bool:
        if dense_entries <= 0:
            return False
        return entries / (self.fraction(kind) * self.dense) + index_s < dense_entries / self.dense


# Measured per head dim (the kernels' launch depends on it): one H100 (sm_90, the same kernels as an
# H200), bf16, 64-row blocks, structured inputs, the default launches of 2026-11-26 (`launch/bench.py
# sparse`; docs/results.md, Sparse prefill). Each fraction is density *
# dense_cudnn_ms / kernel_ms at 32K and 128K, the smaller taken (a head goes sparse only where it wins
# at both): head dim 128 (32 / 8 heads): Vertical-Slash (1000, 6096) 0.566 / 0.656, A-shape (1024,
# 4096) 0.768 / 0.756, Block-Sparse (100) 0.690 / 0.733; head dim 64 (9 / 3 heads): 0.620 / 0.630,
# 0.803 / 0.884, 0.833 / 0.859. dense: dense_cost(L, L) * heads / dense_cudnn_ms at 32K. bs_index:
# index_ms / (heads * L), the larger of the two lengths (d128 1.47e-9 / 1.78e-9, d64 3.7e-9 / 2.0e-9).
MEASURED_RATES = {
    64: KernelRates(dense=1.80e12, a_shape=0.803, vertical_slash=0.620, block_sparse=0.833, bs_index=3.7e-9),
    128: KernelRates(dense=1.23e12, a_shape=0.756, vertical_slash=0.566, block_sparse=0.690, bs_index=1.78e-9),
}
# Head dims above 128 (8 warps, 1 stage: not measured): the slowest rates ever measured, the 8-warp
# head-dim-128 kernel's on one H200 (docs/results.md, Sparse prefill), so such heads go
# sparse only where they surely win.
WIDE_HEAD_RATES = KernelRates(dense=1.24e12, a_shape=0.312, vertical_slash=0.275, block_sparse=0.459,
                              bs_index=1.74e-9)


def measured_rates(head_dim: int) -> KernelRates:
    """The cost model's rates for heads of `head_dim` (padded to the kernel's tile as it is launched)."""
    return for_head_dim(MEASURED_RATES, head_dim, WIDE_HEAD_RATES)


def _take(index, pos: list[int], heads: list[int]):
    """An index restricted to the heads at positions `pos` of its head dimension."""
    p = to_device(pos, (index.seg if isinstance(index, VSIndex) else index.blocks).device)
    if isinstance(index, VSIndex):
        return VSIndex(heads, *(t.index_select(1, p) for t in (index.vertical, index.slash, index.seg, index.seg_count,
                                                                  index.col, index.col_count, index.col_full)))
    return BSIndex(heads, *(t.index_select(1, p) for t in (index.blocks, index.count, index.full)))


@dataclass
class FallbackPlan:
    """`plan_with_fallback`'s answer: `groups` hold the heads that run the sparse kernel (indices
    restricted to them), `dense` the heads the dense kernel runs, `density` per head of the call its
    kernel entries / a dense causal kernel's (floats; exact for every kind)."""

    groups: list
    dense: list
    density: list = field(default_factory=list)


def plan_with_fallback(q, k, pattern, *, offset: int, scale=None, rates: KernelRates | None = None) -> FallbackPlan:
    """`build_plan` with the cost model: each head's kernel cost from its pattern (A-shape, Dense and
    Block-Sparse heads before any score is read; Vertical-Slash heads from their whole index: diagonal
    runs and column lists), and the heads whose sparse kernel would not beat the dense kernel (`rates`)
    moved to `dense`. rates=None keeps every head sparse (the densities are still counted). One host
    read. `start_plan` + `PendingPlan.finish` in one go; the sparse call runs the early groups between
    the two (`attend.py`)."""
    return start_plan(q, k, pattern, offset=offset, scale=scale, rates=rates).finish()


def start_plan(q, k, pattern, *, offset: int, scale=None, rates: KernelRates | None = None) -> "PendingPlan":
    """The first half of `plan_with_fallback`: the Vertical-Slash estimate, its whole index and the
    index's exact kernel cost queued first (the cost copied to the host without a wait), then the heads
    decided without scores (A-shape, Dense, Block-Sparse: `PendingPlan.early`, indices built). Launch
    the early groups' kernels, then `finish()`: it waits for the cost alone (the one host read), so
    after it nothing is left to build: the host decides and launches while the GPU runs what was
    queued. Heads that then go dense had their column lists built for nothing (on random weights
    every head: ~1.5 ms per Llama-8B-shaped layer at 128K against ~350 ms of dense attention)."""
    B, Hq, Lq = q.shape[0], q.shape[1], q.shape[2]
    Lk = k.shape[2]
    heads = pattern.for_heads(Hq)
    BM = pattern.block_size
    groups = _grouped(heads, Lq=Lq, Lk=Lk, offset=offset)
    pend = PendingPlan(heads=heads, B=B, Lq=Lq, Lk=Lk, offset=offset, BM=BM, rates=rates,
                       dense_e=float(B * dense_cost(Lq=Lq, Lk=Lk, offset=offset, block_size=BM)), density=[1.0] * Hq)
    if "vertical_slash" in groups:
        grp = groups["vertical_slash"]
        v_idx, s_idx = _vs_pick(q, k, pattern, heads, grp.heads, offset=offset, scale=scale)
        seg, seg_count, runs = vs_runs(s_idx, Lq=Lq, Lk=Lk, offset=offset, block_size=BM)
        grp.index = vs_index(v_idx, s_idx, Lq=Lq, Lk=Lk, offset=offset, block_size=BM, heads=grp.heads,
                             segments=(seg, seg_count))
        cost = (runs + column_cost(grp.index.col_count, block_size=BM)).sum(0)  # [nH], exact
        host, event = cost, None
        if cost.is_cuda:  # pinned, so the copy is asynchronous; the event marks it done
            host = torch.empty(cost.shape, dtype=cost.dtype, pin_memory=True)
            host.copy_(cost, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        pend.vs = (grp, host, event)
    if "a_shape" in groups:
        grp = groups["a_shape"]
        keep = pend.split(grp, (kernel_cost(grp, B=1, Lq=Lq, Lk=Lk, offset=offset, block_size=BM)[0] * B).tolist())
        if keep:
            pend.early.append(HeadGroup("a_shape", [grp.heads[j] for j in keep], sink=[grp.sink[j] for j in keep],
                                        local=[grp.local[j] for j in keep]))
    if "block_sparse" in groups:
        grp = groups["block_sparse"]
        topk = [heads[h].topk for h in grp.heads]
        cost = (block_sparse_cost(topk, Lq=Lq, Lk=Lk, offset=offset, block_size=BM) * B).tolist()
        keep = pend.split(grp, cost, 0.0 if rates is None else rates.bs_index * B * Lk)
        if keep:
            hs = [grp.heads[j] for j in keep]
            pend.early.append(HeadGroup("block_sparse", hs, index=bs_select(q, k, offset=offset, topk=[topk[j] for j in keep],
                                                                          block_size=BM, scale=scale, heads=hs)))
    return pend


@dataclass
class PendingPlan:
    """A plan between `start_plan` and `finish`: `early` (the groups decided without scores, ready to
    run) and the queued Vertical-Slash heads (`vs`: their group with its index, the index's kernel cost
    per head on its way to the host, and the copy's event)."""

    heads: list
    B: int
    Lq: int
    Lk: int
    offset: int
    BM: int
    rates: KernelRates | None
    dense_e: float
    density: list
    early: list = field(default_factory=list)
    dense: list = field(default_factory=list)
    vs: tuple | None = None

    def wins(self, kind, entries, index_s=0.0) -> bool:
        return self.rates is None or self.rates.sparse_wins(kind, entries, self.dense_e, index_s)

    def split(self, grp, entries, index_s=0.0) -> list[int]:
        """Positions in grp.heads that stay sparse; the others go to `dense`. Records densities."""
        keep = []
        for j, h in enumerate(grp.heads):
            self.density[h] = entries[j] / self.dense_e if self.dense_e else 1.0
            if self.wins(grp.kind, entries[j], index_s):
                keep.append(j)
            else:
                self.dense.append(h)
        return keep

    def finish(self) -> FallbackPlan:
        """Wait for the Vertical-Slash index's cost alone, decide those heads and return the whole
        FallbackPlan."""
        out = list(self.early)
        if self.vs is not None:
            out += self._finish_vertical_slash(*self.vs)
        return FallbackPlan(out, sorted(set(self.dense)), self.density)

    def _finish_vertical_slash(self, grp, host, event) -> list:
        if event is not None:
            event.synchronize()
        keep = self.split(grp, host.tolist())  # the read
        if not keep:
            return []
        if len(keep) == len(grp.heads):
            return [grp]
        hs = [grp.heads[j] for j in keep]
        return [HeadGroup("vertical_slash", hs, index=_take(grp.index, keep, hs))]
