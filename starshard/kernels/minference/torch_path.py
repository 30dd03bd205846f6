"""The torch path (CPU, or wherever the Triton kernel does not run): the kernel's visibility as a dense
mask per chunk of row blocks, from the very same indices."""
from __future__ import annotations

import torch

from starshard.kernels.common import cdiv
from starshard.kernels.minference.plan import group_mask

_SCORE_BUDGET = 1 << 25  # elements of a float32 score tile: bounds memory per step


def attention_torch(q, k, v, groups, *, offset, scale, block_size):
    """The same visibility as the kernel, as a dense mask per chunk of row blocks: torch's fused CPU
    flash kernel with an additive bias for float32/bfloat16 on CPU, else float32 (float64) math."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    BM = block_size
    nM = cdiv(Lq, BM)
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
