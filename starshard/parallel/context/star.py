"""Star Attention (Acharya et al., 2024): anchor-block context encoding, then a distributed-softmax
query phase.

Phase 1 (no communication): the context is cut into blocks; each block but the first runs behind the
anchor (the first `anchor_size` context tokens, original positions) with plain causal attention over
[anchor; block], and only the block's KV is kept. Phase 2: the query tokens, then every generated
token, attend each rank's local KV; partials merge by lse over the CP group (ContextStrategy.decode_attend).

Local (sliding-window) layers run exactly: a block's query at p needs only the keys in (p - W, p], so
its first W - 1 queries need the previous block's last keys (the edge) beyond what the anchor holds.
Each rank sends its block's edge to the rank holding the next block (one block per CP rank; on one
device, --num-blocks, the edge is the previous block's rows in the cache) and attends
[anchor; edge; block] masked by window; the anchor/block approximation applies to global layers only.
With every layer local, Star is dense attention. Soft-caps and scales reach every call.

The anchor's K/V at every layer are those of block 0's first rows (the same tokens and positions, causal). So rank
0, which holds block 0 (every block on one device, --num-blocks), runs its later blocks without the anchor rows:
each layer attends the anchor's stored K/V (a local layer: the stored keys in its window) and the block's own,
merged by lse. The same math at ~half the tokens for those blocks; the other ranks recompute the anchor as the
paper does (they never see block 0). Not with --sparse or --fp8 attention, whose calls take the square [anchor;
block]; with --fp8 kv the anchor is read as stored (e4m3), as decode reads it.
"""
from __future__ import annotations

import torch

from starshard.kernels.attention import attention, attention_after_held, causal_attention_int8_scores
from starshard.kernels.sparse import pattern_for
from starshard.partition import star_blocks, star_sizes
from starshard.parallel.context.base import ContextStrategy, Segment, cache_append
from starshard.parallel.context.edges import cached_edge, post_edges
from starshard.parallel.context.merge import merge_partials
from starshard.strategies.star import STAR


class StarAttention(ContextStrategy):
    name = "star"
    query_phase = True

    def __init__(self, group=None, *, block_size: int | None = None, anchor_size: int | None = None, query_rank=None,
                 num_blocks: int | None = None):
        super().__init__(group, query_rank)
        STAR.validate(self.cp, dict(block_size=block_size, anchor_size=anchor_size, num_blocks=num_blocks))
        self.block_size = block_size
        self.anchor_size = anchor_size
        self.num_blocks = num_blocks
        self._model = None  # bound by the runner: its config's windows decide which layouts can exchange edges
        self._context_len = 0
        self._after_anchor: list[int] = []  # starts of this prefill's blocks that attend the stored anchor, in order
        self._blocks: list[tuple[int, int, int]] = []  # (anchor rows, start, end) of the other blocks, in order

    @classmethod
    def from_options(cls, group, options, *, cp_groups=None, tp_group=None):
        return cls(group, block_size=options.get("block_size"), anchor_size=options.get("anchor_size"),
                   query_rank=options.get("query_rank"), num_blocks=options.get("num_blocks"))

    def spec_options(self) -> dict:
        return super().spec_options() | dict(block_size=self.block_size, anchor_size=self.anchor_size,
                                             num_blocks=self.num_blocks)

    def resolved_sizes(self, context_len: int) -> tuple[int, int]:
        """(block, anchor): block defaults to ceil(context / num_blocks), num_blocks to cp (so cp=1
        with num_blocks=N runs exactly what N hosts would, one block after another); anchor
        defaults to the block size."""
        return star_sizes(context_len, self.cp, self.block_size, self.anchor_size, self.num_blocks)

    def chunk_hidden(self, start: int, end: int, context_len: int) -> tuple[int, int] | None:
        # A step in the block starting at bs sees the anchor [0, min(A, bs)) and its block, as
        # segments() encodes each block; the anchor's KV is block 0's, stored once for the document
        # (unchunked, every rank r >= 1 recomputes it for each of its blocks; rank 0 reads it stored).
        block, anchor = self.resolved_sizes(context_len)
        bs = start // block * block
        if end > bs + block:
            raise ValueError(f"a Star prefill step must lie in one block of {block} tokens, got context [{start}, "
                             f"{end}) (use the runner's prefill_bounds, which cut at block ends)")
        return (min(anchor, bs), bs)

    def bind(self, model) -> None:
        self._model = model

    def _window(self) -> int | None:
        """The bound model's largest sliding window over all its layers (config: the same on every pipeline
        stage, so every rank refuses alike; None: no local layer)."""
        cfg = getattr(self._model, "config", None)
        ws = [w for w in (cfg.layer_window(i) for i in range(cfg.num_layers)) if w] if cfg is not None else []
        return max(ws) if ws else None

    def edge_len(self, start: int, window: int) -> int:
        """Keys a local layer of the block starting at `start` needs from before it beyond its anchor:
        positions [max(anchor end, start - window + 1), start)."""
        _, anchor = self.resolved_sizes(self._context_len)
        return max(0, start - max(min(anchor, start), start - window + 1))

    def _owner(self, position: int) -> int:
        """The CP rank holding the block that contains context position `position`."""
        block, _ = self.resolved_sizes(self._context_len)
        return next(r for r, bs in enumerate(star_blocks(self._context_len, block, self.cp))
                    if any(s <= position < e for s, e in bs))

    def _check_windows(self, context_len: int) -> None:
        """Refuse (ValueError, the same on every rank, before any transfer) a layout whose local layers
        cannot get their edge: several blocks on one CP rank (a rank's first block would wait for the
        previous rank's last), or a block shorter than its edge."""
        window = self._window()
        if window is None:
            return
        block, _ = self.resolved_sizes(context_len)
        blocks = star_blocks(context_len, block, self.cp)
        if self.cp > 1 and any(len(b) > 1 for b in blocks):
            raise ValueError(f"--cp-strategy star runs sliding-window layers (sliding_window={window}) with one block "
                             f"per CP rank; --block-size {block} gives {sum(map(len, blocks))} blocks over --cp {self.cp}: "
                             f"drop --block-size / --num-blocks")
        if any(self.edge_len(s, window) > block for bs in blocks for s, _ in bs):
            raise ValueError(f"--cp-strategy star: a block of {block} tokens is shorter than a local layer's window edge "
                             f"(sliding_window={window}); use --block-size >= {window - 1} or fewer blocks")

    def segments(self, prompt_len: int, context_len: int) -> list[Segment]:
        if context_len < 1:
            raise ValueError("Star Attention needs a non-empty context before the query")
        self._context_len = context_len
        self._check_windows(context_len)
        block, anchor = self.resolved_sizes(context_len)
        segs = []
        self._after_anchor, self._blocks = [], []
        stored = self.anchor_stored()
        for start, end in star_blocks(context_len, block, self.cp)[self.rank]:
            if start > 0 and stored:
                # Rank 0 stored blocks [0, start) in order (module doc): the anchor is there, rows = positions.
                self._after_anchor.append(start)
                index = torch.arange(start, end)
                segs.append(Segment(index, index.clone(), None))
                continue
            a = min(anchor, start)  # the first block needs no anchor; never duplicate block tokens
            self._blocks.append((a, start, end))
            index = torch.cat([torch.arange(a), torch.arange(start, end)])
            segs.append(Segment(index, index.clone(), torch.arange(a, a + end - start)))
        return segs

    def anchor_stored(self) -> bool:
        """Whether this rank's later blocks attend the anchor as stored (module doc): rank 0, whose first block is
        block 0, and no call that needs the square [anchor; block] (--sparse, --fp8 attention)."""
        layers = getattr(self._model, "layers", None)
        return (self.rank == 0 and layers is not None and not self.int8_scores
                and all(getattr(layer.attention, "sparse", None) is None for layer in layers))

    def _edge(self, start: int, end: int, k, v, cache, window: int):
        """A local layer's edge exchange for the block [start, end) (edges.py): this block's last keys go to
        the next block's rank, the previous block's come in -> a function that waits and returns the edge."""
        e_in, e_out = self.edge_len(start, window), self.edge_len(end, window) if end < self._context_len else 0
        src = self._owner(start - 1) if e_in else None
        dst = self._owner(end) if e_out else None
        if src == self.rank:  # the previous block ran here before (one device): its rows end the cache
            edge = cached_edge(cache, e_in)
            return lambda: edge
        return post_edges(k, v, cache, self.group, send_to=None if dst == self.rank else dst, send_rows=e_out,
                          recv_from=src, recv_rows=e_in, start=start, stats=self.wire)

    def prefill_attend(self, segment: Segment):
        # [anchor; block] positions increase (segments() builds them so, Segment.to notes it on the copy the model
        # passes to every layer): each attention call knows it is index-causal without a device read.
        rows = segment.cache_rows
        if rows is None:  # a block after the anchor, on the rank that stored it (segments())
            return self._after_anchor_attend(self._after_anchor.pop(0))
        a, start, end = self._blocks.pop(0)  # as segments() built it: nothing read from the device

        def attend(q, k, v, pos, cache, sparse=None, window=None, softcap=None, scale=None):
            extras = dict(softcap=softcap, scale=scale)
            if window is None:
                # Local causal attention over [anchor; block]: anchor rows see only the anchor, block
                # rows see the anchor in full and their block causally. Earlier blocks held by this
                # rank stay invisible (each block is encoded independently). A square index-causal call:
                # --fp8 attention takes it with 8-bit scores.
                pattern = pattern_for(sparse, q)
                if self.int8_scores and softcap is None and scale is None:
                    out, _ = causal_attention_int8_scores(q, k, v, q_pos=pos, k_pos=pos, sparse=pattern)
                else:
                    out, _ = attention(q, k, v, q_pos=pos, k_pos=pos, causal=True, sparse=pattern, **extras)
                cache_append(cache, k, v, pos, rows)
                return out
            # A local layer, exactly (module doc): [anchor; block] under the window (anchor keys past it drop
            # out), then the previous block's edge for the block rows, merged by lse. Dense (sparse methods
            # run global layers only).
            pending = self._edge(start, end, k, v, cache, window)
            out, lse = attention(q, k, v, q_pos=pos, k_pos=pos, causal=True, window=window, **extras)
            edge = pending()
            if edge is not None:
                ke, ve, kp, ks, vs = edge
                o2, l2 = attention(q[:, :, a:], ke, ve, q_pos=pos[a:], k_pos=kp, causal=True, window=window,
                                   k_scale=ks, v_scale=vs, **extras)
                out = torch.cat([out[:, :, :a], merge_partials(out[:, :, a:], lse[:, :, a:], o2, l2)[0]], dim=2)
            cache_append(cache, k, v, pos, rows)
            return out

        return attend

    def _after_anchor_attend(self, start: int):
        """The AttendFn of the block starting at `start` on the rank holding every block before it: each layer
        attends the stored anchor rows [0, min(anchor, start)) (a local layer: the stored rows in its window,
        which are the anchor's and the previous block's edge there) and the block's own keys causally, merged
        by lse, then stores the block."""
        _, anchor = self.resolved_sizes(self._context_len)

        def attend(q, k, v, pos, cache, sparse=None, window=None, softcap=None, scale=None):
            if cache is None or cache.trimmed or cache.length != start:
                raise RuntimeError(f"Star's block at {start} reads the anchor from this rank's cache, which must hold "
                                   f"every earlier position untrimmed (holds {getattr(cache, 'length', None)} rows)")
            lo, hi = (0, min(anchor, start)) if window is None else (max(0, start - window + 1), start)
            held = cache.stored().rows(lo, hi)
            out, _ = attention_after_held(q, k, v, pos, held.k, held.v, held.pos, k_scale=held.k_scale,
                                          v_scale=held.v_scale, window=window, softcap=softcap, scale=scale)
            cache_append(cache, k, v, pos, None)
            return out

        return attend
