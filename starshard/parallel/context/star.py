"""Star Attention (Acharya et al., 2024): anchor-block context encoding, then a distributed-softmax
query phase.

Phase 1 (no communication): the context is cut into blocks; each block but the first runs behind the
anchor (the first `anchor_size` context tokens, original positions) with plain causal attention over
[anchor; block], and only the block's KV is kept. Phase 2: the query tokens, then every generated
token, attend each rank's local KV; partials merge by lse over the CP group (ContextStrategy.decode_attend).
"""
from __future__ import annotations

import torch

from starshard.kernels.attention import attention, causal_attention_int8_scores
from starshard.kernels.common import mark_increasing
from starshard.kernels.sparse import pattern_for
from starshard.partition import star_blocks, star_sizes
from starshard.parallel.context.base import ContextStrategy, Segment, cache_append, refuse_extras
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
        # (unchunked, every rank r >= 1 recomputes it for each of its blocks).
        block, anchor = self.resolved_sizes(context_len)
        bs = start // block * block
        if end > bs + block:
            raise ValueError(f"a Star prefill step must lie in one block of {block} tokens, got context [{start}, "
                             f"{end}) (use the runner's prefill_bounds, which cut at block ends)")
        return (min(anchor, bs), bs)

    def segments(self, prompt_len: int, context_len: int) -> list[Segment]:
        if context_len < 1:
            raise ValueError("Star Attention needs a non-empty context before the query")
        block, anchor = self.resolved_sizes(context_len)
        segs = []
        for start, end in star_blocks(context_len, block, self.cp)[self.rank]:
            a = min(anchor, start)  # the first block needs no anchor; never duplicate block tokens
            index = torch.cat([torch.arange(a), torch.arange(start, end)])
            segs.append(Segment(index, index.clone(), torch.arange(a, a + end - start)))
        return segs

    def prefill_attend(self, segment: Segment):
        rows = segment.cache_rows
        # [anchor; block] positions increase (segments() builds them so; checked once per segment): the
        # model passes this tensor to every layer, whose attention then knows the call is index-causal
        # without a device read per layer.
        pos = segment.positions
        if pos.dim() == 1 and bool((pos.diff() > 0).all()):
            mark_increasing(pos)

        def attend(q, k, v, pos, cache, sparse=None, **extras):
            refuse_extras(self.name, extras)  # a block's local layers would need the previous block's edge
            # Local causal attention over [anchor; block]: anchor rows see only the anchor, block
            # rows see the anchor in full and their block causally. Earlier blocks held by this
            # rank stay invisible (each block is encoded independently). A square index-causal call:
            # --fp8 attention takes it with 8-bit scores.
            pattern = pattern_for(sparse, q)
            if self.int8_scores:
                out, _ = causal_attention_int8_scores(q, k, v, q_pos=pos, k_pos=pos, sparse=pattern)
            else:
                out, _ = attention(q, k, v, q_pos=pos, k_pos=pos, causal=True, sparse=pattern)
            cache_append(cache, k, v, pos, rows)
            return out

        return attend
