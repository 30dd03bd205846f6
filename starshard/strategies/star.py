"""Star Attention (approximate): each rank runs its context blocks behind an anchor (the context's
first tokens), then the query attends every rank's blocks, merged by lse."""
from __future__ import annotations

from starshard.config import ModelConfig
from starshard.partition import prefill_steps, star_blocks, star_sizes, zigzag_rows
from starshard.strategies.flops import PrefillFlops, add_query_phase, causal_pairs, check_sizes, rank_flops
from starshard.strategies.spec import ANCHOR_SIZE, NUM_BLOCKS, Option, StrategySpec, at_least, query_context, query_rank

BLOCK_SIZE = Option("block_size", "--block-size", "star: context tokens per block (default: context / cp)")


def star_flops(cfg: ModelConfig, context: int, cp: int, block: int | None = None, anchor: int | None = None,
               query_len: int = 1, anchor_stored: bool = True) -> list[PrefillFlops]:
    """Star Attention: each block runs [anchor; block] causally (the first block has no anchor), then
    the query phase. Defaults as StarAttention: block = ceil(context / cp), anchor = block. anchor_stored:
    rank 0's later blocks run only their own rows against the anchor's stored keys (StarAttention.anchor_stored)."""
    check_sizes(context, cp, query_len)
    block = block or -(-context // cp)
    anchor = block if anchor is None else anchor
    out = []
    for r, blocks in enumerate(star_blocks(context, block, cp)):
        tokens = pairs = held = 0
        for s, e in blocks:
            a = min(anchor, s)
            if r == 0 and anchor_stored:
                tokens, pairs = tokens + e - s, pairs + (e - s) * a + causal_pairs(e - s)
            else:
                tokens, pairs = tokens + a + e - s, pairs + causal_pairs(a + e - s)
            held += e - s
        f = rank_flops(cfg, tokens, pairs, 0, detail={"blocks": blocks})
        add_query_phase(cfg, f, query_len, held, r == cp - 1)
        out.append(f)
    return out


class StarSpec(StrategySpec):
    name = "star"
    options = (BLOCK_SIZE, NUM_BLOCKS, ANCHOR_SIZE)
    exact = False
    fp8_attention = "in Star's context blocks"
    chunked_prefill = True  # context chunks cut at block ends; the anchor is the document's first chunks, run once
    chunk_plan = "ring"  # a chunk's in-chunk part runs ring's zigzag path (parallel/context/chunked.py)
    windows = True  # local layers exact (the previous block's edge); the anchor approximates global layers only

    def validate(self, cp, options):
        at_least(options, 1, BLOCK_SIZE, ANCHOR_SIZE, NUM_BLOCKS)
        if options.get("block_size") is not None and options.get("num_blocks") is not None:
            raise ValueError("give --block-size or --num-blocks, not both")

    def kv_rows(self, lay, w):
        chunked = self.chunked_kv_rows(lay, w)  # --prefill-chunk: one chunk's shard per forward
        if chunked is not None:
            return chunked
        cp, C, Q, N = lay.cp, w.context, w.prompt_tokens - w.context, w.max_new_tokens
        q_rank = cp - 1 if lay.query_rank is None else lay.query_rank
        block, anchor = star_sizes(C, cp, lay.block_size, lay.anchor_size, lay.num_blocks)
        blocks = star_blocks(max(C, 1), block, cp)
        kept = [sum(e - s for s, e in blocks[r]) + (Q + N if r == q_rank else 0) for r in range(cp)]
        # one forward per block, behind the anchor (the first block has none; rank 0's later blocks read it from
        # the cache unless --sparse or --fp8 attention needs the square call: StarAttention.anchor_stored); then
        # the query phase
        stored = not (w.sparse or w.fp8_attention)
        rows = max([e - s + (0 if r == 0 and stored else min(anchor, s)) for r, bl in enumerate(blocks) for s, e in bl]
                   + [Q])
        return max(kept), rows, 0

    def whole_rows(self, cp, prompt_len, context_len, options):
        C = query_context(prompt_len, context_len)
        block, _ = star_sizes(C, cp, options.get("block_size"), options.get("anchor_size"), options.get("num_blocks"))
        rows = [sum(e - s for s, e in blocks) for blocks in star_blocks(C, block, cp)]  # the anchor is not kept
        rows[query_rank(cp, options)] += prompt_len - C  # the query phase stores the question there
        return rows

    def prefill_bounds(self, cp, prompt_len, context_len, options, chunk, knee=None):
        """Context steps of `chunk` tokens, also cut at block ends (a step never spans two blocks); the
        last one runs the question (the query phase) too. With `knee` each block's steps taper by what
        a step sees: the anchor and its block's earlier steps (the keys between are hidden)."""
        whole = super().prefill_bounds(cp, prompt_len, context_len, options, chunk)
        C = query_context(prompt_len, context_len)
        if not chunk or C < 1:
            return whole
        block, anchor = star_sizes(C, cp, options.get("block_size"), options.get("anchor_size"),
                                   options.get("num_blocks"))
        if knee is None:
            cuts = sorted({*range(chunk, C, chunk), *range(block, C, block)})
        else:
            cuts = [e for b in range(0, C, block)
                    for _, e in prefill_steps(min(b + block, C), chunk, knee, cp, start=b, held=min(anchor, b))][:-1]
        return list(zip([0, *cuts], [*cuts, prompt_len]))

    def first_step_rows(self, lay, w, end):
        # Every context step runs the generic zigzag path; the last one also runs the question.
        return max(2 * -(-end // (2 * lay.cp)), w.prompt_tokens - w.context), 0

    def chunked_rows(self, cp, prompt_len, context_len, options, bounds):
        # Every context step keeps its zigzag shard's real rows (the anchor is block 0's, kept once);
        # the query phase stores the question on the query rank.
        C = query_context(prompt_len, context_len)
        rows = [0] * cp
        for s, e in bounds:
            rows = [n + zigzag_rows(min(e, C) - s, cp, r) for r, n in enumerate(rows)]
        rows[query_rank(cp, options)] += prompt_len - C
        return rows

    def prefill_flops(self, cfg, prompt_len, context_len, strategy):
        block, anchor = strategy.resolved_sizes(context_len)
        return star_flops(cfg, context_len, strategy.cp, block, anchor, query_len=prompt_len - context_len,
                          anchor_stored=strategy.anchor_stored())


STAR = StarSpec()
