"""APB (approximate): each host runs its context block behind an anchor that embeds the query, and
hands compressed passing blocks of its KV to the later hosts.

FLOP model (apb_flops), per rank h (block n_h = context * (h+1) // cp - context * h // cp, block start s_h):
    front rows  F_h = Lq + min(anchor, s_h - Lq) (embedded query + anchor context), rank 0: Lq
                score-only query rows when its block is compressed with the query, else 0;
    linear      (F_h + n_h) tokens;
    attention   F_h(F_h+1)/2 (front, causal) + n_h(n_h+1)/2 (block, causal)
                + n_h * (F_h + sum_{j<h} min(passing, n_j)) (anchor and passing blocks, full);
    all-gather  per layer every rank sends Hkv x max_j min(passing, n_j) x (2D + 8/bytes) elements.
The block term is quadratic in context/cp; anchor and passing add only linear terms.
"""
from __future__ import annotations

from starshard.config import ModelConfig
from starshard.partition import apb_bounds, apb_default_sizes
from starshard.strategies.flops import PrefillFlops, add_query_phase, causal_pairs, check_sizes, rank_flops
from starshard.strategies.spec import ANCHOR_SIZE, NUM_BLOCKS, Option, StrategySpec, at_least, query_context, query_rank

COMPRESSORS = ("query", "retaining-heads", "random")
PASSING_SIZE = Option("passing_size", "--passing-size",
                      "apb: KV entries per KV head each host passes on per layer, picked by --compressor (default: the "
                      "paper's table, context/hosts/8 capped at 8192, at least 32; 0 = no passing, the ablation)",
                      metavar="N", exclusive=True)
COMPRESSOR = Option("compressor", "--compressor",
                    "apb: how each host scores its block for the passing entries: query = attention of the embedded "
                    "query's rows (training-free, default); retaining-heads = trained per-layer MLPs over [q, k, v] "
                    "read from --compressor-path; random = uniform (ablation)",
                    type=None, choices=COMPRESSORS, exclusive=True)
COMPRESSOR_PATH = Option("compressor_path", "--compressor-path",
                         "apb: retaining-heads weights, safetensors or torch file with layers.<i>.fc1.weight "
                         "[I, (Hq+2Hkv)*D] and layers.<i>.fc2.weight [Hkv, I] (biases optional); full format in "
                         "starshard/parallel/context/apb.py, RetainingHeads",
                         type=None, metavar="FILE", exclusive=True)
EMBED_QUERY = Option("embed_query", "--no-embed-query",
                     "apb: do not embed the query in the anchors (ablation); the query compressor then scores each "
                     "block with its own last rows",
                     const=False, exclusive=True)
PREFIX_LEN = Option("prefix_len", "--prefix-len",
                    "apb: context tokens that stay before the embedded query in each anchor (default: the chat "
                    "template's head when the template is applied, else 0)",
                    metavar="N", exclusive=True)
APB_HOSTS = Option("apb_hosts", "--apb-hosts",
                   "apb with --cp 1: split the context into N blocks run one after another on this device, each "
                   "handing its passing KV to the later ones; reproduces --cp N exactly (study mode). Without it, APB "
                   "on one rank has nothing to pass and is exact causal attention",
                   metavar="N", exclusive=True)


def apb_flops(cfg: ModelConfig, context: int, cp: int, anchor: int, passing: int, query_len: int = 1,
              embed_query: bool = True, query_compressor: bool = True, kv_bytes: int = 2) -> list[PrefillFlops]:
    """APB (see the module docstring): anchor / passing as given (0 = ablated); query_compressor:
    the training-free scorer (its QK^T counted, rank 0 runs the score-only query rows)."""
    check_sizes(context, cp, query_len)
    if anchor < 0 or passing < 0:
        raise ValueError(f"anchor and passing must be >= 0, got {anchor}, {passing}")
    b = apb_bounds(context, cp)
    n = [b[r + 1] - b[r] for r in range(cp)]
    q_e = query_len if embed_query and cp > 1 else 0
    # A host passes nothing the next host's anchor holds (context [0, anchor end)); prefix ignored.
    a_next = [max(0, min(anchor, b[r + 1] - q_e)) if r + 1 < cp else 0 for r in range(cp)]
    m = [min(passing, b[r + 1] - min(max(b[r], a_next[r]), b[r + 1])) for r in range(cp)] if cp > 1 else [0] * cp
    w = 8 // kv_bytes
    sent = cfg.num_kv_heads * max(m) * (2 * cfg.head_dim + w) * kv_bytes * cfg.num_layers if passing and cp > 1 else 0
    out = []
    for r in range(cp):
        if r == 0:
            front = q_e if query_compressor and 0 < passing < n[0] else 0
            extra = 0  # the score-only rows are seen by no block row
        else:
            front = q_e + max(0, min(anchor, b[r] - q_e))
            extra = front + sum(m[:r])
        pairs = causal_pairs(front) + causal_pairs(n[r]) + n[r] * extra
        f = rank_flops(cfg, front + n[r], pairs, 0, comm_bytes=float(sent),
                  detail={"front": front, "block": n[r], "passing_in": sum(m[:r])})
        if query_compressor and q_e and r < cp - 1 and 0 < m[r] < n[r]:
            f.compressor = 2.0 * cfg.num_heads * cfg.head_dim * q_e * n[r] * cfg.num_layers
        add_query_phase(cfg, f, query_len, n[r], r == cp - 1)
        out.append(f)
    return out


class APBSpec(StrategySpec):
    name = "apb"
    options = (ANCHOR_SIZE, NUM_BLOCKS, PASSING_SIZE, COMPRESSOR, COMPRESSOR_PATH, EMBED_QUERY, PREFIX_LEN, APB_HOSTS)
    flag_group = ("APB (--cp-strategy apb: anchors with the embedded query, compressed passing blocks; paper "
                  "ablations: --anchor-size 0, --passing-size 0, --compressor random, --no-embed-query)")
    exact = False
    context_cache = False  # the anchors embed the question: a cached context's KV serves only that question
    windows = True  # local layers exact (the previous block's edge); anchors and passing blocks serve global layers

    def validate(self, cp, options):
        at_least(options, 0, ANCHOR_SIZE, PASSING_SIZE, PREFIX_LEN)
        at_least(options, 1, APB_HOSTS)
        if options.get("block_size") is not None:
            raise ValueError("--block-size is Star's; APB splits the context evenly over the hosts (--cp, or "
                             "--apb-hosts with --cp 1): drop --block-size")
        hosts, blocks = options.get("apb_hosts"), options.get("num_blocks")
        if hosts is not None and cp > 1 and hosts != cp:
            raise ValueError(f"--apb-hosts {hosts} simulates hosts on one device; with --cp {cp} the CP ranks are the "
                             "hosts: drop --apb-hosts or run --cp 1")
        if blocks is not None and hosts is not None and blocks != hosts:
            raise ValueError(f"--num-blocks {blocks} and --apb-hosts {hosts} disagree; for APB they are the "
                             "same setting: give one")
        if (options.get("compressor") == "retaining-heads") != (options.get("compressor_path") is not None):
            raise ValueError("--compressor retaining-heads and --compressor-path FILE go together")

    def kv_rows(self, lay, w):
        # even split over the hosts (the CP ranks, or with cp = 1 the virtual hosts run in turn on the one
        # device, which keeps every block); block rows behind an anchor (+ the embedded query); passing
        # blocks gathered per layer
        cp, C, Q, N = lay.cp, w.context, w.prompt_tokens - w.context, w.max_new_tokens
        hosts = cp if cp > 1 else (lay.apb_hosts or lay.num_blocks or 1)
        q_rank = cp - 1 if lay.query_rank is None else lay.query_rank
        bounds = apb_bounds(C, hosts)
        per = [bounds[r + 1] - bounds[r] for r in range(hosts)]
        block = max(per)
        anchor, passing = apb_default_sizes(block)
        if lay.anchor_size is not None:
            anchor = lay.anchor_size
        kept = [per[r] + (Q + N if r == q_rank else 0) for r in range(cp)] if cp > 1 else [C + Q + N]
        return max(kept), block + anchor + Q, hosts * min(passing, block)

    def chunk_error(self):
        return ("--cp-strategy apb prefills the whole prompt in one step: each host's passing blocks are chosen per "
                "layer from its whole block (scored against the embedded question), and its KV depends on the "
                "question; drop --prefill-chunk (or use --cp-strategy star, ring, ulysses or usp, which chunk)")

    def whole_rows(self, cp, prompt_len, context_len, options):
        # Each rank keeps its block (cp = 1: every virtual host's, i.e. the whole context); the anchor and
        # the embedded query are run, not kept; the query phase stores the question on the query rank.
        C = query_context(prompt_len, context_len)
        bounds = apb_bounds(C, cp)
        rows = [bounds[r + 1] - bounds[r] for r in range(cp)]
        rows[query_rank(cp, options)] += prompt_len - C
        return rows

    def prefill_flops(self, cfg, prompt_len, context_len, strategy):
        anchor, passing = strategy.resolved_sizes(context_len)
        return apb_flops(cfg, context_len, strategy.hosts, anchor, passing, query_len=prompt_len - context_len,
                         embed_query=strategy.embed_query)


APB = APBSpec()
