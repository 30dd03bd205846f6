"""CPU attention through torch's fused flash kernel (returns logsumexp), position masks as an
additive bias. About 20x faster than the math path at 4K tokens; exact to float32 rounding."""
from __future__ import annotations

import torch

_MASK_BUDGET = 1 << 24  # elements of the additive mask per chunk of query rows (64 MiB float32)


def attention_cpu(q, k, v, *, q_pos, k_pos, causal=True, scale=None, window=None):
    """`window` as in the attention.py contract (part of the mask); softcap and sinks are not
    expressible in the fused kernel: the dispatcher sends them to the math path."""
    if window is not None and not causal:
        raise ValueError("attention_cpu: window needs causal=True (a query sees keys at positions in (p - window, p])")
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if Hq != Hkv:  # the fused CPU kernel wants equal head counts
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if not causal:
        out, lse = flash(q, k, v, 0.0, False, scale=scale)
        return out, lse.float()
    if q_pos.dim() != 1 or k_pos.dim() != 1:
        raise ValueError("the CPU path takes 1-D positions shared across the batch")
    if window is None and Lq == Lk and torch.equal(q_pos, k_pos) and bool((q_pos.diff() == 1).all()):
        out, lse = flash(q, k, v, 0.0, True, scale=scale)  # plain causal: no mask tensor
        return out, lse.float()
    outs, lses = [], []
    rows = max(1, _MASK_BUDGET // max(1, Lk))
    for s in range(0, Lq, rows):
        visible = k_pos[None, :] <= q_pos[s : s + rows, None]
        if window is not None:
            visible &= k_pos[None, :] > q_pos[s : s + rows, None] - window
        bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
        o, l = flash(q[:, :, s : s + rows], k, v, 0.0, False, attn_mask=bias, scale=scale)
        empty = ~visible.any(-1)  # rows that see no key: out 0, lse -inf (the kernel gives NaN)
        if bool(empty.any()):
            o = o.masked_fill(empty[None, None, :, None], 0.0)
            l = l.masked_fill(empty[None, None, :], float("-inf"))
        outs.append(o)
        lses.append(l.float())
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)
