"""Ring attention (exact), with the zigzag load-balanced strategy built on it.

Each rank holds a shard of the queries and of the keys/values, with their global positions. The K/V
blocks travel the ring (batch_isend_irecv, double-buffered: the next block is in flight while the
current one is computed) and the partial results merge by log-sum-exp in float32.

Positions do not travel: a `RingPlan`, built once (one tiny all-gather, or no communication at all
when the layout is known, as for zigzag) and reusable by every layer, says for each step which
(query rows, key rows) pairs to compute and whether they need a mask. Shards are cut into runs of
consecutive positions; a run pair is skipped when no key is visible, computed without a mask when
every key is visible, and as plain causal attention when both runs hold the same positions. With
the zigzag layout (rank r holds chunks r and 2cp-1-r) this gives every rank the same work, one
unmasked call per remote block and three mask-free calls for the local one, and the hot loop needs
no host synchronisation.

Local (sliding-window) layers: every call takes the layer's window (and soft-cap, scale), so masks by
position stay exact. Positions are known per block, so a rank skips the steps whose keys lie wholly
before every one of its queries' windows (`plan_steps(window=)`). Over self-attention shards (zigzag,
USP) a local layer does better: it leaves the ring and each rank receives from each peer only the
keys some query of its own can see, the window's edge (`EdgePlan`; zigzag: the last W - 1 keys of the
chunk before each of its chunks), when no rank then receives more than one block; blocks beyond the
window never travel. (One round of transfers, overlapped with the rank's own block; a window longer
than the blocks takes the ring with skipped steps, where every block still travels.)

With an FP8 KV cache the blocks travel as e4m3 plus per-(head, token) scales (wire.py, about half
the bytes): a received block is dequantized on arrival, so it is attended exactly as the sender's
FP8 cache holds it; the rank's own block is attended as computed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from starshard.kernels.attention import attention
from starshard.kernels.common import upload
from starshard.kernels.sparse import refuse_sparse
from starshard.parallel.context.base import ContextStrategy, Segment, cache_append, group_size
from starshard.parallel.context.collectives import all_gather_1d
from starshard.parallel.context.merge import merge_into, merge_partials
from starshard.parallel.context.sharding import zigzag_chunks, zigzag_positions, zigzag_shard
from starshard.parallel.context.wire import SCALE_BYTES, WireStats, fp8_wire, nbytes, pack_fp8, unpack_fp8

__all__ = ["RingPlan", "EdgePlan", "ring_attention", "gather_ring_plan", "build_ring_plan", "zigzag_ring_plan",
           "plan_steps", "RingAttention", "zigzag_chunks", "zigzag_positions"]

_MAX_RUNS = 4  # more runs than this: the shard is treated as one (masked) run
_MAX_CALLS = 4  # more run pairs than this in one block: one masked call instead

_SKIP, _FULL, _DIAG, _PARTIAL = range(4)


@dataclass(frozen=True)
class Run:
    """Rows [start, stop) of a shard holding positions lo..hi (consecutive, in order, if `contiguous`)."""

    start: int
    stop: int
    lo: int
    hi: int
    contiguous: bool


@dataclass(frozen=True)
class Call:
    """One attention call of a ring step: query rows q, key rows k of the block, mask or not."""

    q: tuple[int, int]
    k: tuple[int, int]
    causal: bool  # False: every key is visible to every query row of the call
    runs: tuple[int, ...]  # query runs the call covers
    diagonal: bool = False  # query and key rows hold the same consecutive positions


def _runs(pos: torch.Tensor) -> list[Run]:
    """Split host positions [n] into runs of consecutive positions."""
    n = pos.numel()
    if n == 0:
        return []
    cuts = [0, *((pos[1:] - pos[:-1] != 1).nonzero().squeeze(1) + 1).tolist(), n]
    if len(cuts) - 1 > _MAX_RUNS:
        return [Run(0, n, int(pos.min()), int(pos.max()), False)]
    return [Run(a, b, int(pos[a]), int(pos[b - 1]), True) for a, b in zip(cuts, cuts[1:])]


def _status(q: Run, k: Run, window: int | None = None) -> int:
    # A local layer (window W: a query at p sees keys in (p - W, p]) skips a key run wholly before every
    # query's window and takes one wholly inside every query's window without a mask.
    if k.lo > q.hi or (window is not None and k.hi <= q.lo - window):
        return _SKIP
    if k.hi <= q.lo and (window is None or k.lo > q.hi - window):
        return _FULL
    if q.contiguous and k.contiguous and q.lo == k.lo and q.hi == k.hi:
        return _DIAG  # same consecutive positions: index-causal, the kernels' mask-free path
    return _PARTIAL


def _is_range(idx: list[int]) -> bool:
    return idx == list(range(idx[0], idx[-1] + 1))


def _plan_block(qr: list[Run], kr: list[Run], window: int | None = None) -> tuple[Call, ...]:
    st = [[_status(a, b, window) for b in kr] for a in qr]
    rows = [i for i in range(len(qr)) if any(s != _SKIP for s in st[i])]
    if not rows:
        return ()  # the whole block is invisible to this shard
    cols = [j for j in range(len(kr)) if any(st[i][j] != _SKIP for i in rows)]
    q_span = (qr[rows[0]].start, qr[rows[-1]].stop)
    k_span = (kr[cols[0]].start, kr[cols[-1]].stop)
    if _is_range(rows) and _is_range(cols) and all(st[i][j] == _FULL for i in rows for j in cols):
        return (Call(q_span, k_span, False, tuple(rows)),)
    pairs = [(i, j) for i in rows for j in cols if st[i][j] != _SKIP]
    if len(pairs) > _MAX_CALLS:
        return (Call(q_span, k_span, True, tuple(range(rows[0], rows[-1] + 1))),)
    return tuple(Call((qr[i].start, qr[i].stop), (kr[j].start, kr[j].stop), st[i][j] != _FULL, (i,), st[i][j] == _DIAG)
                 for i, j in pairs)


def plan_steps(q_pos: torch.Tensor, k_pos_per_rank: Sequence[torch.Tensor], rank: int,
               window: int | None = None) -> tuple[tuple[Call, ...], ...]:
    """Calls per ring step (pure, host tensors): step s computes the K/V block of rank (rank - s) % cp.
    window: a local layer's; a step whose keys all lie before every query's window has no call."""
    cp = len(k_pos_per_rank)
    qr = _runs(q_pos.cpu())
    return tuple(_plan_block(qr, _runs(k_pos_per_rank[(rank - s) % cp].cpu()), window) for s in range(cp))


@dataclass(frozen=True)
class EdgePlan:
    """A local layer's exchange (window W) over self-attention shards: each rank sends each peer only
    the key rows some query of that peer can see (positions within W before one of its queries, e.g. a
    zigzag chunk's last W - 1 keys to the rank holding the next chunk), one round of point-to-point
    transfers, and attends its own block plus what arrived. Blocks beyond the window never travel."""

    send: tuple[tuple[int, torch.Tensor], ...]  # (global peer rank, rows of this rank's block it needs)
    recv: tuple[tuple[int, int], ...]  # (global peer rank, rows it sends here)
    k_pos: torch.Tensor  # positions of the received rows, in recv order

    @property
    def recv_rows(self) -> int:
        return sum(n for _, n in self.recv)


@dataclass(frozen=True)
class RingPlan:
    """What one rank computes at each ring step, and with whom it exchanges blocks."""

    rank: int  # in the group
    cp: int
    send_to: int  # global ranks
    recv_from: int
    q_len: int
    k_len: int
    q_runs: int  # runs of consecutive positions in the query shard
    k_pos: torch.Tensor  # [cp, k_len] every rank's key positions (the travelling blocks' masks)
    steps: tuple[tuple[Call, ...], ...]
    # Every rank's key positions on the host, this rank's query positions, the group's global ranks; and
    # whether every rank's queries are its own keys (zigzag, USP), which lets a local layer exchange edges.
    host_pos: tuple[torch.Tensor, ...] = ()
    q_host: torch.Tensor | None = None
    peers: tuple[int, ...] = ()
    self_attention: bool = False
    windowed_plans: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_calls(self) -> int:
        return sum(len(s) for s in self.steps)

    def windowed(self, window: int) -> "RingPlan | EdgePlan":
        """The plan of a local layer (built once per window, the same choice on every rank)."""
        if window not in self.windowed_plans:
            self.windowed_plans[window] = _window_plan(self, window)
        return self.windowed_plans[window]


def _visible_rows(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Rows of k_pos (host) that some query at q_pos sees through a window (query runs' bounds: a
    superset at worst, which the mask then trims)."""
    seen = torch.zeros(k_pos.numel(), dtype=torch.bool)
    for r in _runs(q_pos):
        seen |= (k_pos > r.lo - window) & (k_pos <= r.hi)
    return seen.nonzero().squeeze(1)


def _window_plan(plan: RingPlan, window: int) -> "RingPlan | EdgePlan":
    """A local layer: the edge exchange when every rank receives at most one block's rows (no more memory
    than the ring's spare buffer), else the ring with the steps outside every query's window skipped."""
    pos, cp, me = plan.host_pos, plan.cp, plan.rank
    if plan.self_attention:
        need = [[_visible_rows(pos[d], pos[s], window) for s in range(cp)] for d in range(cp)]  # need[dst][src]
        if max(sum(len(need[d][s]) for s in range(cp) if s != d) for d in range(cp)) <= plan.k_len:
            dev = plan.k_pos.device
            send = tuple((plan.peers[d], upload(need[d][me], dev)) for d in range(cp) if d != me and len(need[d][me]))
            srcs = [s for s in range(cp) if s != me and len(need[me][s])]
            k_pos = torch.cat([pos[s][need[me][s]] for s in srcs]) if srcs else pos[me][:0]
            return EdgePlan(send, tuple((plan.peers[s], len(need[me][s])) for s in srcs), upload(k_pos, dev))
    return replace(plan, steps=plan_steps(plan.q_host, pos, me, window), windowed_plans={})


def _check_pos(name: str, pos: torch.Tensor, n: int) -> None:
    if pos.dim() != 1 or pos.numel() != n:
        raise ValueError(f"{name} must be 1-D with one position per row ({n}), got shape {tuple(pos.shape)}")


def build_ring_plan(q_pos: torch.Tensor, k_pos_per_rank: Sequence[torch.Tensor], group,
                    device: torch.device | str | None = None, self_attention: bool = False) -> RingPlan:
    """A plan from key positions already known for every rank (no communication). self_attention: every
    rank's query positions are its key positions (the same on every rank: local layers may then exchange
    only their window's edges)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(k_pos_per_rank) != cp:
        raise ValueError(f"need the key positions of all {cp} ranks, got {len(k_pos_per_rank)}")
    k_len = k_pos_per_rank[0].numel()
    if any(p.dim() != 1 or p.numel() != k_len for p in k_pos_per_rank):
        raise ValueError("ring attention needs equal 1-D key shards on every rank (pad with sharding.py helpers)")
    _check_pos("q_pos", q_pos, q_pos.numel())
    host = tuple(p.cpu() for p in k_pos_per_rank)
    k_pos = upload(torch.stack(host), device or q_pos.device)  # one copy, no wait
    peers = tuple(dist.get_global_rank(group, r) for r in range(cp))
    q_host = q_pos.cpu()
    return RingPlan(rank, cp, peers[(rank + 1) % cp], peers[(rank - 1) % cp], q_pos.numel(), k_len,
                    len(_runs(q_host)), k_pos, plan_steps(q_host, host, rank), host, q_host, peers,
                    self_attention)


def gather_ring_plan(q_pos: torch.Tensor, k_pos: torch.Tensor, group) -> RingPlan:
    """A plan for arbitrary shards: all-gathers the key positions (two tiny collectives, one host sync)."""
    _check_pos("q_pos", q_pos, q_pos.numel())
    _check_pos("k_pos", k_pos, k_pos.numel())
    lens = all_gather_1d(torch.tensor([k_pos.numel()], device=k_pos.device), group).flatten().tolist()
    if len(set(lens)) != 1:  # every rank sees the same lengths, so every rank raises
        raise ValueError(f"ring attention needs equal key shard lengths on every rank, got {lens} "
                         "(pad with the sharding.py helpers)")
    gathered = all_gather_1d(k_pos, group)  # [cp, k_len]
    plan = build_ring_plan(q_pos.cpu(), list(gathered.cpu()), group)
    return replace(plan, k_pos=gathered)  # keep the device copy: no re-upload


def zigzag_ring_plan(seq_len: int, group, device: torch.device | str | None = None) -> RingPlan:
    """The plan for self-attention over the zigzag shards of a `seq_len` sequence (no communication)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    pos = [zigzag_positions(seq_len, cp, r) for r in range(cp)]
    return build_ring_plan(pos[rank], pos, group, device, self_attention=True)


class _Partial:
    """Running float32 (out, lse) of this rank's query rows; a run's first partial is stored as is."""

    def __init__(self, q: torch.Tensor, num_runs: int):
        B, H, L, D = q.shape
        self.out = torch.zeros(B, H, L, D, dtype=torch.float32, device=q.device)
        self.lse = torch.full((B, H, L), float("-inf"), dtype=torch.float32, device=q.device)
        self.written = [False] * num_runs

    def add(self, call: Call, o: torch.Tensor, l: torch.Tensor) -> None:
        a, b = call.q
        if any(self.written[i] for i in call.runs):
            merge_into(self.out[:, :, a:b], self.lse[:, :, a:b], o, l)  # in place
        else:
            self.out[:, :, a:b] = o
            self.lse[:, :, a:b] = l
        for i in call.runs:
            self.written[i] = True


def _compute_block(q, k, v, q_pos, k_pos, calls: tuple[Call, ...], acc: _Partial, scale, window=None,
                   softcap=None) -> None:
    for c in calls:
        qp = q_pos[c.q[0] : c.q[1]]
        kp = qp if c.diagonal else k_pos[c.k[0] : c.k[1]]  # one tensor: kernels see plain causal cheaply
        # A mask-free call lies wholly inside every row's window (the plan says so): no window to apply.
        o, l = attention(q[:, :, c.q[0] : c.q[1]], k[:, :, c.k[0] : c.k[1]], v[:, :, c.k[0] : c.k[1]],
                         q_pos=qp, k_pos=kp, causal=c.causal, scale=scale, window=window if c.causal else None,
                         softcap=softcap)
        acc.add(c, o, l)


def _edge_attention(q, k, v, q_pos, k_pos, edges: EdgePlan, group, *, window: int, softcap, scale, fp8: bool,
                    packed, stats: WireStats | None):
    """A local layer over an EdgePlan: post the edges' transfers, attend this rank's own block meanwhile,
    then the rows that arrived (dequantized when they travel as e4m3), merged by lse."""
    ops = []
    for dst, rows in edges.send:
        if fp8:
            ks, vs = ((packed[0].index_select(2, rows), packed[1].index_select(2, rows)) if packed is not None
                      else (pack_fp8(k.index_select(2, rows)), pack_fp8(v.index_select(2, rows))))
        else:
            ks, vs = k.index_select(2, rows), v.index_select(2, rows)
        ops += [dist.P2POp(dist.isend, ks, dst, group), dist.P2POp(dist.isend, vs, dst, group)]
        if stats is not None:
            stats.add(nbytes(ks, vs), local=True)
    B, H, _, D = k.shape
    width, dtype = (D + SCALE_BYTES, torch.uint8) if fp8 else (D, k.dtype)
    got = []
    for src, n in edges.recv:
        kb, vb = (torch.empty(B, H, n, width, dtype=dtype, device=k.device) for _ in range(2))
        ops += [dist.P2POp(dist.irecv, kb, src, group), dist.P2POp(dist.irecv, vb, src, group)]
        got.append((kb, vb))
    reqs = dist.batch_isend_irecv(ops) if ops else []
    out, lse = attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=True, scale=scale, window=window, softcap=softcap)
    for req in reqs:
        req.wait()
    if got:
        ke, ve = torch.cat([g[0] for g in got], dim=2), torch.cat([g[1] for g in got], dim=2)
        if fp8:
            ke, ve = unpack_fp8(ke, k.dtype), unpack_fp8(ve, v.dtype)
        o2, l2 = attention(q, ke, ve, q_pos=q_pos, k_pos=edges.k_pos.to(q_pos.device), causal=True, scale=scale,
                           window=window, softcap=softcap)
        out, lse = merge_partials(out, lse, o2, l2)
    return out, lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                   group, *, scale: float | None = None, plan: RingPlan | None = None, fp8: bool = False,
                   packed: tuple[torch.Tensor, torch.Tensor] | None = None,
                   stats: WireStats | None = None, window: int | None = None,
                   softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this rank's queries over the keys of every rank in `group`.

    q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] and positions q_pos [Lq], k_pos [Lk] are this rank's shard;
    Lk (and B, Hkv, D) must be equal on every rank. Returns (out [B, Hq, Lq, D] in q.dtype,
    lse [B, Hq, Lq] float32) for this rank's rows, as dense attention over the whole sequence would.
    `plan` (from gather_ring_plan / zigzag_ring_plan for the same positions) skips re-planning when
    every layer has the same shards. group=None means a single rank.
    fp8: the blocks travel as wire.pack_fp8 bytes (e4m3 + scales) and are dequantized on arrival; this
    rank's own k, v are attended as given. `packed`: (k, v) already packed, sent instead of packing k, v
    (USP hands on the bytes its all-to-all delivered). `stats`: counts the K/V bytes sent.
    window, softcap, scale: the layer's (kernels/attention.py), in every call: masks by position stay
    exact. A local layer (window) skips the ring steps whose keys lie wholly before every one of its
    queries' windows (positions are known per block: `plan_steps`); over self-attention shards (a plan
    from zigzag_ring_plan / usp_ring_plan) it sends only the window's edges instead (`EdgePlan`) when no
    rank then receives more than one block's rows.
    """
    _check_pos("q_pos", q_pos, q.shape[2])
    _check_pos("k_pos", k_pos, k.shape[2])
    if group_size(group) == 1:
        return attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=True, scale=scale, window=window, softcap=softcap)
    plan = plan if plan is not None else gather_ring_plan(q_pos, k_pos, group)
    if (plan.q_len, plan.k_len) != (q.shape[2], k.shape[2]):
        raise ValueError(f"ring plan is for {plan.q_len} query / {plan.k_len} key rows, got {q.shape[2]} / {k.shape[2]}")
    if window is not None:
        plan = plan.windowed(window)
        if isinstance(plan, EdgePlan):
            out, lse = _edge_attention(q, k, v, q_pos, k_pos, plan, group, window=window, softcap=softcap, scale=scale,
                                       fp8=fp8, packed=packed, stats=stats)
            return out.to(q.dtype), lse
    all_k_pos = plan.k_pos.to(k_pos.device)
    acc = _Partial(q, plan.q_runs)
    block = (k.contiguous(), v.contiguous())  # the block computed at this step
    cur = block  # what travels: the block itself, or (fp8) its packed bytes
    if fp8:
        cur = packed if packed is not None else (pack_fp8(block[0]), pack_fp8(block[1]))
    spare: tuple[torch.Tensor, torch.Tensor] | None = None
    for step, calls in enumerate(plan.steps):
        reqs = []
        if step < plan.cp - 1:  # pass the current block on, receive the previous rank's
            if spare is None:
                spare = (torch.empty_like(cur[0]), torch.empty_like(cur[1]))
            reqs = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, cur[0], plan.send_to, group),
                dist.P2POp(dist.isend, cur[1], plan.send_to, group),
                dist.P2POp(dist.irecv, spare[0], plan.recv_from, group),
                dist.P2POp(dist.irecv, spare[1], plan.recv_from, group),
            ])
            if stats is not None:
                stats.add(nbytes(*cur), local=window is not None)
        src = (plan.rank - step) % plan.cp
        _compute_block(q, block[0], block[1], q_pos, all_k_pos[src], calls, acc, scale, window, softcap)
        for req in reqs:
            req.wait()
        if reqs:
            # the received block becomes current; the sent one is free again (never the caller's k/v)
            cur, spare = spare, (None if step == 0 else cur)
            block = (unpack_fp8(cur[0], k.dtype), unpack_fp8(cur[1], k.dtype)) if fp8 else cur
    return acc.out.to(q.dtype), acc.lse


class RingAttention(ContextStrategy):
    """Zigzag ring strategy for the model: prefill self-attention over zigzag shards."""

    name = "ring"

    @classmethod
    def shard_positions(cls, prompt_len: int, cp: int, rank: int, options: dict) -> torch.Tensor:
        return zigzag_positions(prompt_len, cp, rank)

    def segments(self, prompt_len: int, context_len: int) -> list[Segment]:
        shard = zigzag_shard(prompt_len, self.cp, self.rank)
        last = prompt_len - 1
        hit = (shard.positions == last).nonzero()
        self._prompt_len = prompt_len  # prefill_attend's plan follows from it on every rank
        return [Segment(shard.token_index, shard.positions, shard.rows, int(hit[0]) if len(hit) else -1)]

    def last_token_rank(self, prompt_len: int, context_len: int) -> int:
        c, _ = zigzag_chunks(prompt_len, self.cp)
        chunk = (prompt_len - 1) // c
        return chunk if chunk < self.cp else 2 * self.cp - 1 - chunk

    def prefill_attend(self, segment: Segment):
        rows = segment.cache_rows
        plan = zigzag_ring_plan(self._prompt_len, self.group, segment.positions.device) if self.cp > 1 else None

        def attend(q, k, v, pos, cache, sparse=None, window=None, softcap=None, scale=None):
            refuse_sparse(sparse, "ring")
            cache_append(cache, k, v, pos, rows)
            return ring_attention(q, k, v, pos, pos, self.group if self.cp > 1 else None, plan=plan,
                                  fp8=fp8_wire(cache), stats=self.wire, window=window, softcap=softcap, scale=scale)[0]

        return attend
