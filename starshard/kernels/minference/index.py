"""Index building for Vertical-Slash and Block-Sparse heads (torch, on q's device, no host sync;
shared by the Triton and the torch attention paths). The Vertical-Slash estimate's softmax rows and
the per-row-block column lists can also run as Triton launches (estimate.py, columns.py).

Index format of a Vertical-Slash head (B = block_size; row block m's first row sits at key index
b = m*B + off):
- slash segments, shared by all row blocks: the sorted selected diagonals merged into runs whose
  gaps are <= B, as (d_first, d_last) pairs; row block m reads them as the key range
  [max(0, b - d_last), min(Lk, b + B - d_first)).
- per row block, the selected columns not inside any of its ranges (and not past its last row),
  sorted, with a count. The kernel streams each range in contiguous B-wide chunks, then gathers the
  columns B at a time (the PIT part). Work is linear in ranges + columns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from starshard.kernels.common import INT32_MAX, cdiv, to_device
from starshard.kernels.minference.columns import use_columns_kernel, vs_columns
from starshard.kernels.minference.estimate import estimate_probs, use_estimate_kernel
from starshard.kernels.minference.runs import vs_runs_kernel

_INDEX_BUDGET = 1 << 26  # elements of index temporaries: bounds memory per step
# Elements of the estimate's float32 score rows per step (vs_estimate; 1 GiB, about 2.5 GiB of
# temporaries with the product and the softmax). Whole KV groups go through together: at 128K keys
# and 64 rows, 7 of the 8B shape's 8 KV groups in the first step (1 at 1 << 26), so its ~30 kernels
# and 2 top-k selections per step run twice per layer instead of 8 times.
_ESTIMATE_BUDGET = 1 << 28


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
                force_local: int = 100, scale=None, heads=None, use_triton: bool | None = None):
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

    Heads are processed in chunks of whole KV groups (q rows of a group against its K, no K copies).
    With use_triton (None: estimate.py's `use_estimate_kernel`: CUDA in 16-bit floats), the
    softmax rows come from estimate.py's two Triton launches (q . k accumulated in float32, z written
    once); otherwise from torch ops (on CUDA the q.k products in the input dtype, as MInference, the
    softmax in float32)."""
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
    kernel = (use_estimate_kernel(q) if use_triton is None else use_triton) and acc == torch.float32
    if kernel:  # the kernels read rows with unit stride along D
        qc = q if q.stride(3) == 1 else q.contiguous()
        kc = k if k.stride(3) == 1 else k.contiguous()
    else:
        rows_qidx = torch.arange(Lq - R, Lq, device=dev) + offset
        invisible = torch.arange(Lk, device=dev)[None, :] > rows_qidx[:, None]  # [R, Lk]
    # Row r of the scores sits at z[r, R-1 : R-1+Lk]; one more zero column at the end takes
    # scattered padding ids.
    W = Lk + 2 * (R - 1) + 1
    # Diagonal d sits at column c = qidx_last - d of the row-shifted scores (Lk + R - 1 columns):
    # diagonals d_lo .. ndiag-1 are columns c_top .. 0, a reversed slice (no mask, no host sync).
    d_lo = max(0, qidx_last - (Lk + R - 2))
    c_top = qidx_last - d_lo
    needed = torch.zeros(Hkv, dtype=torch.bool)
    needed[torch.tensor(heads, dtype=torch.long) // g] = True
    step = max(1, _ESTIMATE_BUDGET // max(1, B * g * R * W))
    qg = q.view(B, Hkv, g, Lq, D)
    fs = min(force_sink, Lk)
    for c0 in range(0, Hkv, step):
        c1 = min(Hkv, c0 + step)
        if not needed[c0:c1].any():
            continue
        h0, h1 = c0 * g, c1 * g
        n = h1 - h0
        if kernel:  # the softmax rows written once, their column sums with them
            z = torch.empty(B, n, R, W, dtype=acc, device=dev)
            z[..., : R - 1].zero_()
            z[..., R - 1 + Lk :].zero_()
            estimate_probs(qc, kc, z, vscore, h0=h0, h1=h1, rows=R, offset=offset, scale=scale)
        else:
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
        sscore[:, h0:h1, d_lo:] = shifted[..., : c_top + 1].sum(-2).flip(-1).float()
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
                sscore[:, h0:h1, d_lo:] = shifted[..., : c_top + 1].sum(-2).flip(-1).float()
        del z
    if heads != list(range(Hq)):
        sel = to_device(heads, dev)
        vscore, sscore, v_all = vscore[:, sel], sscore[:, sel], v_all[:, sel]
    return (v_all if vertical is not None else None), vscore, sscore


def vs_scores(q, k, *, offset: int, last_q: int = 64, scale=None, heads=None, use_triton: bool | None = None):
    """MInference's raw estimates: (vertical [B, nH, Lk], slash [B, nH, Lq + offset]), float32."""
    _, vscore, sscore = vs_estimate(q, k, offset=offset, last_q=last_q, scale=scale, heads=heads,
                                    use_triton=use_triton)
    return vscore, sscore


def _topk_per_head(scores: torch.Tensor, budgets: list[int], sentinel: int) -> torch.Tensor:
    """Ids of each head's top budget[h] scores, ascending, padded with `sentinel`: [B, nH, max]."""
    n = scores.shape[-1]
    kmax = min(max(budgets), n)
    if kmax <= 0:
        return torch.full((*scores.shape[:-1], 0), sentinel, dtype=torch.long, device=scores.device)
    ranks = min(budgets) < kmax  # heads with smaller budgets: their extra ranks become padding
    idx = torch.topk(scores, kmax, dim=-1, sorted=ranks).indices  # the ids get sorted below anyway
    if ranks:
        keep = torch.arange(kmax, device=scores.device)[None, :] < to_device(budgets, scores.device)[:, None]
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
              force_local: int = 100, scale=None, heads=None, vertical_aware: bool = True,
              use_triton: bool | None = None):
    """Selected columns [B, nH, KV] and diagonals [B, nH, KS] (sorted, padded with Lk and Lq+offset).
    `vertical`/`slash`: budgets, one int or one per listed head. vertical_aware: slash estimates
    leave out the chosen columns' mass (see `vs_estimate`); False is MInference's estimate.
    use_triton: as `vs_estimate`."""
    heads = list(range(q.shape[1])) if heads is None else list(heads)
    rows = min(last_q, q.shape[2])
    if vertical_aware:
        v_idx, _, ss = vs_estimate(q, k, offset=offset, vertical=vertical, slash=slash, last_q=last_q,
                                   force_sink=force_sink, force_local=force_local, scale=scale, heads=heads,
                                   use_triton=use_triton)
    else:
        vs, ss = vs_scores(q, k, offset=offset, last_q=last_q, scale=scale, heads=heads, use_triton=use_triton)
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
    # s_idx is sorted, so a run starts where `start` is set and ends just before the next start (or
    # the last valid entry): one plain scatter each, every run's slot written once (padding and
    # inner entries go to a spill slot). A scatter_reduce over all entries cost ~90 us each at
    # 6096 diagonals x 9 heads (one H200).
    end = valid & torch.cat([start[..., 1:] | ~valid[..., 1:], torch.ones_like(valid[..., :1])], -1)
    sid = torch.cumsum(start, -1) - 1
    first = torch.zeros(B, nH, KS + 1, dtype=torch.long, device=dev)
    last = torch.zeros(B, nH, KS + 1, dtype=torch.long, device=dev)
    first.scatter_(-1, torch.where(start, sid, KS), s_idx)
    last.scatter_(-1, torch.where(end, sid, KS), s_idx)
    count = start.sum(-1).to(torch.int32)
    seg = torch.stack([first[..., :KS], last[..., :KS]], -1)
    used = torch.arange(KS, device=dev) < count[..., None]
    seg = torch.where(used[..., None], seg, 0).to(torch.int32)
    return seg.contiguous(), count.contiguous()


def vs_index(v_idx: torch.Tensor, s_idx: torch.Tensor, *, Lq: int, Lk: int, offset: int, block_size: int,
             heads=None, use_triton: bool | None = None, segments=None) -> VSIndex:
    """Merge selected columns and diagonal ranges per row block (see the module docstring). The column
    lists: columns.py's Triton launch with use_triton (None: `use_columns_kernel`), else torch ops.
    segments: `vs_segments(s_idx, ...)`'s answer when the caller already has it."""
    B, nH, KV = v_idx.shape
    dev = v_idx.device
    BM = block_size
    ndiag = Lq + offset
    nM = cdiv(Lq, BM)
    kernel = use_columns_kernel(v_idx) if use_triton is None else use_triton
    if segments is None:  # runs.py's launch with the column lists' kernel, else the torch ops
        segments = (vs_runs_kernel(s_idx, ndiag=ndiag, Lq=Lq, Lk=Lk, offset=offset, block_size=BM)[:2] if kernel
                    else vs_segments(s_idx, ndiag, BM))
    seg, seg_count = segments
    KS = seg.shape[2]
    col = torch.zeros(B, nH, nM, KV, dtype=torch.int32, device=dev)
    col_count = torch.zeros(B, nH, nM, dtype=torch.int32, device=dev)
    col_full = torch.zeros(B, nH, nM, dtype=torch.int32, device=dev)
    if KV > 0:
        v = v_idx.long()
        if kernel:
            vs_columns(v, seg, seg_count, col, col_count, col_full, Lk=Lk, offset=offset, block_size=BM)
        else:
            # A column j is inside a run's range at row block with first key index b iff
            # b - j in [first - BM + 1, last]: half-open bounds per run, disjoint and increasing.
            used = torch.arange(KS, device=dev) < seg_count[..., None]
            big = torch.iinfo(torch.long).max // 4
            lo_b = torch.where(used, seg[..., 0].long() - BM + 1, big)
            hi_b = torch.where(used, seg[..., 1].long() + 1, big)
            bounds = torch.stack([lo_b, hi_b], -1).reshape(B, nH, 2 * KS).contiguous()
            base = torch.arange(nM, device=dev) * BM + offset  # [nM]
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
    nM, nN = cdiv(Lq, BM), cdiv(Lk, BM)
    dev = q.device
    scale = D**-0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    heads_t = to_device(heads, dev)

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
    rank_ok = torch.arange(K, device=dev)[None, :] < to_device(budgets, dev)[:, None]  # [nH, K]
    ok = (top.values > float("-inf")) & rank_ok[None, :, None, :]
    sentinel = INT32_MAX
    blocks = torch.where(ok, top.indices, sentinel).sort(-1).values
    count = ok.sum(-1, dtype=torch.int32)
    whole = (blocks * BM + BM <= torch.clamp(first + 1, max=Lk)[:, None]) & (torch.arange(K, device=dev) < count[..., None])
    return BSIndex(heads, blocks.to(torch.int32).contiguous(), count.contiguous(), whole.sum(-1, dtype=torch.int32).contiguous())
