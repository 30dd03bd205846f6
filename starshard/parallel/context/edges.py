"""Window edges between the context blocks of Star and APB: what makes their local layers exact.

A local layer's query at position p sees only keys in (p - W, p]. A context block starting at s
therefore needs, beyond its own keys, the last keys before s (the edge) and nothing older. The rank
holding the previous block sends them; on one device (virtual hosts run in turn) they are the last
rows of the cache. One round of point-to-point transfers per local layer, posted before the block's
own attention and awaited after it; with an FP8 KV cache the edge travels as e4m3 + scales (wire.py)
and is attended as the sender's cache holds it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from starshard.engine.kv_cache import LayerKV
from starshard.parallel.context.wire import SCALE_BYTES, WireStats, fp8_wire, nbytes, pack_fp8, unpack_fp8

# (k, v, positions, k_scale, v_scale) of an edge; the scales only for e4m3 keys read from a cache
Edge = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def cached_edge(cache: LayerKV, rows: int) -> Edge:
    """The last `rows` keys of this rank's cache (the previous block, stored just before this one)."""
    s = cache.stored()
    n = s.pos.numel()
    if rows > n:
        raise ValueError(f"a window edge of {rows} keys needs them in the cache, which holds {n}")
    e = s.rows(n - rows)
    return (e.k, e.v, e.pos, e.k_scale, e.v_scale)


def post_edges(k: torch.Tensor, v: torch.Tensor, cache: LayerKV | None, group, *, send_to: int | None,
               send_rows: int, recv_from: int | None, recv_rows: int, start: int, stats: WireStats):
    """Send this block's last `send_rows` keys (k, v [B, H, n, D], the block's rows) to group rank
    `send_to`, receive `recv_rows` keys at positions [start - recv_rows, start) from `recv_from` (None:
    no transfer that way). Returns a function that waits and gives the received Edge, or None."""
    fp8 = fp8_wire(cache)
    ops, recv = [], None
    if send_to is not None and send_rows:
        ks, vs = k[:, :, -send_rows:], v[:, :, -send_rows:]
        ks, vs = (pack_fp8(ks), pack_fp8(vs)) if fp8 else (ks.contiguous(), vs.contiguous())
        peer = dist.get_global_rank(group, send_to)
        ops += [dist.P2POp(dist.isend, ks, peer, group), dist.P2POp(dist.isend, vs, peer, group)]
        stats.add(nbytes(ks, vs))
    if recv_from is not None and recv_rows:
        B, H, _, D = k.shape
        shape, dtype = (B, H, recv_rows, D + SCALE_BYTES if fp8 else D), torch.uint8 if fp8 else k.dtype
        recv = (torch.empty(shape, dtype=dtype, device=k.device), torch.empty(shape, dtype=dtype, device=k.device))
        peer = dist.get_global_rank(group, recv_from)
        ops += [dist.P2POp(dist.irecv, recv[0], peer, group), dist.P2POp(dist.irecv, recv[1], peer, group)]
    reqs = dist.batch_isend_irecv(ops) if ops else []

    def finish() -> Edge | None:
        for req in reqs:
            req.wait()
        if recv is None:
            return None
        ke, ve = (unpack_fp8(recv[0], k.dtype), unpack_fp8(recv[1], v.dtype)) if fp8 else recv
        return ke, ve, torch.arange(start - recv_rows, start, device=k.device), None, None

    return finish
