"""Independent masked-dense references for approximate strategies: the model runs once over an
"unrolled" sequence with an explicit visibility matrix (float64 softmax), no strategy code involved."""
from __future__ import annotations

import torch

from starshard.engine.kv_cache import KVCache


def masked_attend(visible: torch.Tensor):
    """AttendFn for a full sequence with a boolean [L, L] visibility matrix (row = query)."""

    def attend(q, k, v, pos, cache):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
        s = (q.double() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        s = s.masked_fill(~visible, float("-inf"))
        return (torch.softmax(s, -1) @ v).to(q.dtype)

    return attend


def run_masked(model, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Logits [L, V] of the model over ids with the given positions and visibility."""
    saved = [layer.attention.attend for layer in model.layers]
    try:
        for layer in model.layers:
            layer.attention.attend = masked_attend(visible)
        with torch.no_grad():
            return model(ids[None], positions=positions)[0]
    finally:
        for layer, fn in zip(model.layers, saved):
            layer.attention.attend = fn


def star_unrolled(prompt_len: int, context_len: int, block: int, anchor: int):
    """Token index, positions and visibility of Star Attention written out as one masked sequence:
    each block's [anchor; block] causal and isolated; query rows see every block (no anchors) + query."""
    index, seg_id, is_anchor = [], [], []
    for b, start in enumerate(range(0, context_len, block)):
        end = min(context_len, start + block)
        a = min(anchor, start)
        index += list(range(a)) + list(range(start, end))
        seg_id += [b] * (a + end - start)
        is_anchor += [True] * a + [False] * (end - start)
    index += list(range(context_len, prompt_len))
    seg_id += [-1] * (prompt_len - context_len)
    is_anchor += [False] * (prompt_len - context_len)
    index, seg_id, is_anchor = torch.tensor(index), torch.tensor(seg_id), torch.tensor(is_anchor)
    pos = index.clone()
    causal = pos[None, :] <= pos[:, None]
    same_block = seg_id[:, None] == seg_id[None, :]
    query_row = (seg_id == -1)[:, None]
    visible = causal & (same_block | (query_row & ~is_anchor[None, :]))
    return index, pos, visible
