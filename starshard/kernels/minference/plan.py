"""Plans: a call's heads grouped by pattern kind, each group with its index; the groups' visibility
masks (torch path, tests, recall) and the score entries the kernel computes for them (cost)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from starshard.kernels.common import INT32_MAX, cdiv
from starshard.kernels.minference.index import BSIndex, VSIndex, bs_select, vs_index, vs_select
from starshard.kernels.minference.patterns import AShape, Dense


@dataclass
class HeadGroup:
    kind: str  # "a_shape" (Dense heads too), "vertical_slash", "block_sparse"
    heads: list
    index: object = None  # VSIndex / BSIndex
    sink: list = None  # a_shape
    local: list = None


def build_plan(q, k, pattern, *, offset: int, scale=None) -> list[HeadGroup]:
    """Group the call's heads by kind and build each group's index (torch, on q's device).
    `pattern`: a SparsePattern (its head patterns for q's heads and its index parameters)."""
    Hq, Lq, Lk = q.shape[1], q.shape[2], k.shape[2]
    heads = pattern.for_heads(Hq)
    BM = pattern.block_size
    full = min(INT32_MAX // 4, Lk + Lq + offset + 1)  # a window that covers every key
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
    g = HeadGroup("a_shape", [0], sink=[0], local=[INT32_MAX // 4])
    return int(kernel_cost(g, B=1, Lq=Lq, Lk=Lk, offset=offset, block_size=block_size)[0, 0])
