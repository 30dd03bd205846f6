"""Independent masked-dense references for approximate strategies: the model runs once over an
"unrolled" sequence with an explicit visibility matrix (float64 softmax), no strategy code involved."""
from __future__ import annotations

import torch


def masked_attend(visible: torch.Tensor):
    """AttendFn for a full sequence with a boolean [L, L] visibility matrix (row = query)."""

    def attend(q, k, v, pos, cache, sparse=None):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
        s = (q.double() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        s = s.masked_fill(~visible, float("-inf"))
        return (torch.softmax(s, -1) @ v).to(q.dtype)

    return attend


def run_masked(model, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Logits [L, V] of the model over ids with the given positions and visibility."""
    with model.attention_hooks(masked_attend(visible)), torch.no_grad():
        return model(ids[None], positions=positions)[0]


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


def masked_attend_layers(visibles):
    """AttendFn whose i-th call (the i-th layer) uses visibles[i]: bool [L, L], or [Hkv, L, L] when the
    visibility differs per KV head (shared by the head's GQA group)."""
    calls = [0]

    def attend(q, k, v, pos, cache, sparse=None):
        vis = visibles[calls[0]]
        calls[0] += 1
        g = q.shape[1] // k.shape[1]
        if vis.dim() == 3:
            vis = vis.repeat_interleave(g, 0)
        k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
        s = (q.double() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        s = s.masked_fill(~vis, float("-inf"))
        return (torch.softmax(s, -1) @ v).to(q.dtype)

    return attend


def run_masked_layers(model, ids: torch.Tensor, positions: torch.Tensor, visibles) -> torch.Tensor:
    """Logits [L, V] of the model with a per-layer (optionally per-KV-head) visibility."""
    with model.attention_hooks(masked_attend_layers(visibles)), torch.no_grad():
        return model(ids[None], positions=positions)[0]


def apb_unrolled(prompt_len: int, context_len: int, cp: int, *, anchor: int, selected, n_layers: int,
                 n_kv_heads: int, prefix_len: int = 0, embed_query: bool = True, score_rows: bool = False):
    """APB written out as one masked sequence: token index, RoPE positions and per-layer, per-KV-head
    visibility [n_layers][Hkv, N, N].

    Layout (rank r holds context [C*r//cp, C*(r+1)//cp)): rank 0 = optional score-only copy of the query
    (positions p0.., sees the block's first p0 tokens and itself) + its block; rank h >= 1 = anchor
    [first p tokens; query (if embedded); context tokens p..a-1] at positions 0, 1, ... (a = max(p,
    min(anchor, s - Lq)) with the query, min(anchor, s) without) + its block at its own positions;
    then the query at its true positions. Anchor rows see their anchor causally; block rows see their
    anchor, the entries `selected(layer, head, rank j, block positions)` of every earlier rank's block
    and their own block causally; query rows see every block (no anchors, no copies) and themselves.
    """
    C, Lq = context_len, prompt_len - context_len
    bounds = [C * r // cp for r in range(cp + 1)]
    index, pos, kind, rank_of = [], [], [], []

    def add(ids, positions, k, r):
        index.extend(ids)
        pos.extend(positions)
        kind.extend([k] * len(ids))
        rank_of.extend([r] * len(ids))

    query = list(range(C, prompt_len))
    head0 = 0
    for r in range(cp):
        s, e = bounds[r], bounds[r + 1]
        if r == 0:
            if score_rows:
                head0 = min(prefix_len, e)
                add(query, range(head0, head0 + Lq), "score", 0)
        else:
            p = min(prefix_len, s)
            emb = embed_query and cp > 1 and Lq > 0
            a = max(p, min(anchor, s - Lq)) if emb else min(anchor, s)
            front = list(range(p)) + (query if emb else []) + list(range(p, a))
            add(front, range(len(front)), "anchor", r)
        add(range(s, e), range(s, e), "block", r)
    add(query, query, "query", -1)
    index, pos, rank_of = torch.tensor(index), torch.tensor(pos), torch.tensor(rank_of)
    N = len(index)
    rows = torch.arange(N)
    is_ = {k: torch.tensor([x == k for x in kind]) for k in ("score", "anchor", "block", "query")}
    same_rank = rank_of[:, None] == rank_of[None, :]
    earlier_row = rows[None, :] <= rows[:, None]
    base = torch.zeros(N, N, dtype=torch.bool)
    base |= is_["anchor"][:, None] & is_["anchor"][None, :] & same_rank & earlier_row
    base |= is_["score"][:, None] & is_["score"][None, :] & earlier_row
    base |= is_["score"][:, None] & is_["block"][None, :] & (rank_of == 0)[None, :] & (index < head0)[None, :]
    base |= is_["block"][:, None] & is_["anchor"][None, :] & same_rank
    base |= is_["block"][:, None] & is_["block"][None, :] & same_rank & (pos[None, :] <= pos[:, None])
    base |= is_["query"][:, None] & is_["block"][None, :]
    base |= is_["query"][:, None] & is_["query"][None, :] & earlier_row
    visibles = []
    for layer in range(n_layers):
        vis = base.repeat(n_kv_heads, 1, 1)
        for hd in range(n_kv_heads):
            for j in range(cp - 1):
                block = list(range(bounds[j], bounds[j + 1]))
                keep = torch.zeros(N, dtype=torch.bool)
                for t in selected(layer, hd, j, block):
                    keep |= is_["block"] & (index == t)
                vis[hd] |= (is_["block"] & (rank_of > j))[:, None] & keep[None, :]
        visibles.append(vis)
    return index, pos, visibles
