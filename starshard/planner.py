"""Per-rank memory plan of one layout, from the model config alone (nothing is loaded).

    plan = plan_memory(cfg, Layout(tp=8, cp=4, strategy="ring"), Workload(prompt_tokens=131072, max_new_tokens=64))
    print(plan.table()); plan.fits(limit_bytes)
    smallest_layout(cfg, workload, "ring", limit_bytes)   # the fewest ranks that fit
    max_prompt_tokens(cfg, Layout(), workload, limit_bytes)  # the longest prompt that fits

Counted per rank (the worst pipeline stage and the worst CP rank):
  weights      this (tp, pp) rank's slices: heads, KV heads (replicated when tp > KV heads), MLP
               columns; MoE layers: the router and every expert (1/tp of each one's width); the
               vocabulary padded to a multiple of tp, the embedding on the first stage, the
               final norm + LM head on the last (a tied head shares the embedding when both are here).
               What a decode step reads (active experts only) is `decode_read_elements`. FP8: --fp8
               linear's projections and --fp8 experts' experts at one byte plus a float32 scale per
               output row.
  kv_cache     K and V of the rank's layers for the tokens it keeps, plus one int64 position per token
               and layer (the cache stores positions). dense: prompt + decode budget (Workload.trim_local:
               a local layer window - 1 plus one forward's rows, engine/kv_cache.py); ring / usp
               (zigzag shards) and ulysses: the rank's sequence shard; star / apb: the rank's context
               blocks. The query rank also keeps the query and every generated token.
  activations  the peak of one layer's forward (engine/model.py) for the rows run at once (a prefill
               chunk, a CP shard, or star's anchor + block), counting the tensors alive together:
               attention part: the layer input, normed input, qkv, rotated q and k, attention output,
               its [rows, heads*d] copy and the o-proj output, plus the residual (4h + (hq+2hkv)d +
               (3hq+hkv)d per row); MLP part: input, residual, normed, gate/up, silu(gate)*up and either
               silu(gate) or the down-proj output (max(3h + 4f, 4h + 3f) per row); MoE: k expert rows
               per token (gathered input, gate/up, silu(gate)*up, output, unsorted copy, the float32
               weighted sum: 4h + k(3h + 3f) + 2kh per row); the larger of the parts. Plus the strategy's in-flight KV (ring send/recv blocks, ulysses all-to-all, apb
               passing blocks) and the last token's logits in float32 on the last stage. Attention
               itself is assumed fused (flash): no [rows x keys] score matrix.
               KV transients: a bf16 cache is attended in place (views). A dense prefill chunk after
               held FP8 entries attends them and its own keys in two calls merged by lse
               (engine/model.py dense_attend): its attention part adds the second partial output and
               the merge's two float32 buffers (hq d (b + 8) bytes per row), and the held keys are
               dequantized FP8_PREFILL_KEY_BLOCK at a time (k and v of one block and the float32
               temporary of the second: hkv d (2b + 4) bytes per key), never the whole prefix; decode
               reads e4m3 in the kernel. --fp8 experts: one layer's experts dequantized, counted at 4 + b
               bytes per element whatever the rows (the reference path's compute-dtype copy and float32
               temporary, where no FP8 grouped GEMM runs: an upper bound on the GPU). (A sparse prefill
               method, and Star / APB query phases, are not counted for this block.)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from starshard.config import FP8_PREFILL_KEY_BLOCK, ModelConfig, ParallelConfig
from starshard.partition import check_tp, partition_layers, prefill_steps, valid_tp_sizes
from starshard.strategies import SINGLE_RANK, check, get_spec

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
POS_BYTES = 8  # int64 position stored next to each cached token, per layer
LOGIT_BYTES = 4  # the last token's logits are sampled in float32


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    strategy: str = SINGLE_RANK  # a name in starshard.strategies.STRATEGIES
    pp_layers: tuple[int, ...] | None = None  # layers per stage; None = even split, earlier stages the remainder
    block_size: int | None = None  # star: context tokens per block (default ceil(context / cp))
    anchor_size: int | None = None  # star / apb: anchor tokens (star default: the block; apb: paper defaults)
    query_rank: int | None = None  # CP rank that keeps the query and generated tokens (default: the last)
    num_blocks: int | None = None  # star: blocks when no block_size (default cp); cp=1 studies N hosts (star, apb)
    apb_hosts: int | None = None  # apb with cp=1: the virtual hosts run in turn (the same as num_blocks for apb)

    @classmethod
    def of(cls, p: ParallelConfig) -> Layout:
        """The layout a ParallelConfig runs (e.g. an LLM's `parallel`)."""
        return cls(p.tp, p.pp, p.cp, p.cp_strategy, tuple(p.pp_layers) if p.pp_layers else None, p.block_size,
                   p.anchor_size, p.query_rank, p.num_blocks, p.apb_hosts)

    def __post_init__(self):
        for name in ("tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check(self.strategy, self.cp, {})  # a known name; a one-rank strategy on one rank

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp

    def describe(self) -> str:
        s = f"tp={self.tp} pp={self.pp} cp={self.cp}"
        return s + (f" ({self.strategy})" if self.cp > 1 else "")


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int
    context_tokens: int | None = None  # the context part of the prompt; None = all but the last token
    max_new_tokens: int = 0  # decode budget: KV for these is preallocated
    prefill_chunk: int | None = None  # rows per prefill forward (None: the whole prompt; pp > 1 picks chunks)
    dtype_bytes: int = 2
    batch: int = 1
    fp8_kv: bool = False  # --fp8 kv: e4m3 k / v plus a float32 scale per (KV head, token)
    fp8_linear: bool = False  # --fp8 linear: e4m3 projection weights plus a float32 scale per output channel
    fp8_experts: bool = False  # --fp8 experts: e4m3 expert weights plus a float32 scale per expert row
    prefill_knee: int | None = None  # the chunks' taper (partition.prefill_steps; None: uniform chunks)
    # --sparse / --fp8 attention: a Star block then runs [anchor; block] square on every rank (StarAttention.anchor_stored)
    sparse: bool = False
    fp8_attention: bool = False
    # local layers keep only their window (LLM.generate / infer without pp or cp: engine/kv_cache.py, trimmed)
    trim_local: bool = False

    def __post_init__(self):
        if self.prompt_tokens < 1:
            raise ValueError(f"the prompt must have >= 1 token, got {self.prompt_tokens}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")

    @property
    def context(self) -> int:
        """Context length as the approximate strategies see it: at least one query token follows it."""
        c = self.prompt_tokens if self.context_tokens is None else self.context_tokens
        return max(0, min(c, self.prompt_tokens - 1))


@dataclass(frozen=True)
class StageMemory:
    """Bytes on the worst rank of one pipeline stage."""

    pp_rank: int
    layers: int
    weights: int
    kv_cache: int
    activations: int
    kv_tokens: int  # tokens whose KV the worst CP rank keeps
    rows: int  # rows in that rank's largest prefill forward

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations


@dataclass
class MemoryPlan:
    layout: Layout
    workload: Workload
    stages: list[StageMemory] = field(default_factory=list)

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def peak_bytes(self) -> int:
        return self.worst.total

    def fits(self, limit_bytes: int | None) -> bool:
        return limit_bytes is None or self.peak_bytes <= limit_bytes

    def table(self, limit_bytes: int | None = None) -> str:
        w = self.workload
        lines = [f"memory plan: {self.layout.describe()}, {self.layout.world} ranks; prompt {w.prompt_tokens} tokens "
                 f"+ {w.max_new_tokens} new, {w.dtype_bytes}-byte weights/KV{_fp8_note(w)}, batch {w.batch}",
                 f"{'stage':>5} {'layers':>6} {'weights':>10} {'kv cache':>10} {'activations':>11} {'total':>10}"
                 f" {'kv tokens':>10} {'rows':>7}"]
        for s in self.stages:
            lines.append(f"{s.pp_rank:>5} {s.layers:>6} {gib(s.weights):>10} {gib(s.kv_cache):>10} "
                         f"{gib(s.activations):>11} {gib(s.total):>10} {s.kv_tokens:>10} {s.rows:>7}")
        tail = f"peak per rank: {gib(self.peak_bytes)} (stage {self.worst.pp_rank})"
        if limit_bytes is not None:
            tail += f"; limit {gib(limit_bytes)}: " + ("fits" if self.fits(limit_bytes) else "DOES NOT FIT")
        lines.append(tail)
        return "\n".join(lines)


def _fp8_note(w: Workload) -> str:
    parts = [x for x, on in (("linear", w.fp8_linear), ("kv", w.fp8_kv), ("experts", w.fp8_experts)) if on]
    return f" (fp8: {','.join(parts)})" if parts else ""


def gib(n: int) -> str:
    return f"{n / GiB:.3f} GiB"


# ---------------------------------------------------------------------------- pieces
def _heads(cfg: ModelConfig, tp: int) -> tuple[int, int, int, int]:
    """(query heads, KV heads, MLP columns, vocab rows) on one tensor-parallel rank."""
    return cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp), cfg.intermediate_size // tp, -(-cfg.vocab_size // tp)


def active_experts(cfg: ModelConfig, tokens: int) -> float:
    """Experts of one MoE layer that `tokens` tokens touch, expected under uniform routing (each token
    picks k of E): E (1 - (1 - k/E)^tokens); k for one token, all E for long prefills."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    if tokens <= 1:
        return float(k)
    return E * (1.0 - (1.0 - k / E) ** tokens)


def layer_elements(cfg: ModelConfig, tp: int, layer: int, experts: float | None = None) -> float:
    """Weight elements of one layer on one TP rank. An MoE layer counts its router (whole on every rank)
    and `experts` experts (default all; a decode step reads `active_experts`), each 1/tp of its width."""
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv, ffn, _ = _heads(cfg, tp)
    qkv = (hq + 2 * hkv) * d
    n = 2 * h + qkv * h + (qkv if cfg.qkv_bias else 0) + h * hq * d
    n += 2 * d if cfg.qk_norm else 0  # Qwen3's q / k norms, whole on every TP rank
    n += 2 * h if cfg.sandwich_norms else 0  # Gemma's norms after attention and after the MLP
    if cfg.is_moe_layer(layer):
        fe = cfg.moe_intermediate_size // tp
        return n + cfg.num_experts * h + (cfg.num_experts if experts is None else experts) * 3 * fe * h
    return n + 3 * ffn * h


def weight_elements(cfg: ModelConfig, tp: int, layers: int, first: bool, last: bool,
                    layer_ids: list[int] | None = None) -> int:
    """Weight elements one (tp rank, stage) holds; `layer_ids`: the stage's global layers (default
    0..layers-1; they matter only where dense and MoE layers mix)."""
    h = cfg.hidden_size
    vrows = _heads(cfg, tp)[3]
    ids = range(layers) if layer_ids is None else layer_ids
    n = sum(int(layer_elements(cfg, tp, i)) for i in ids)
    if first:
        n += vrows * h
    if last:
        n += h + (0 if cfg.tie_word_embeddings and first else vrows * h)
    return n


def decode_read_elements(cfg: ModelConfig, tp: int, layers: int, first: bool, last: bool, tokens: int = 1,
                         layer_ids: list[int] | None = None) -> float:
    """Weight elements one decode step of `tokens` tokens (the batch) reads on one rank: attention and
    norms, each MoE layer's router and its active experts only (`active_experts`), dense MLPs, the
    tokens' embedding rows, the final norm and the LM head. The KV cache read comes on top."""
    h = cfg.hidden_size
    ids = range(layers) if layer_ids is None else layer_ids
    active = active_experts(cfg, tokens) if cfg.num_experts else None
    n = sum(layer_elements(cfg, tp, i, active) for i in ids)
    if first:
        n += tokens * h
    if last:
        n += h + _heads(cfg, tp)[3] * h
    return n


def projection_sizes(cfg: ModelConfig, tp: int, layers: int, layer_ids: list[int] | None = None) -> tuple[int, int]:
    """(weight elements, output channels) of the decoder projections (wqkv, wo, and a dense layer's w13, w2;
    an MoE layer's experts stay in the compute dtype) on one TP rank: what --fp8 linear stores in e4m3,
    with one float32 scale per output channel. `layer_ids`: the stage's global layers (default 0..layers-1)."""
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv, ffn, _ = _heads(cfg, tp)
    qkv = (hq + 2 * hkv) * d
    ids = range(layers) if layer_ids is None else layer_ids
    dense = sum(not cfg.is_moe_layer(i) for i in ids)
    return (layers * (qkv * h + h * hq * d) + dense * 3 * ffn * h,
            layers * (qkv + h) + dense * (2 * ffn + h))


def kv_bytes_per_token(cfg: ModelConfig, tp: int, w: Workload) -> int:
    """KV bytes of one token in one layer on one TP rank (k, v and the position)."""
    hkv, d = _heads(cfg, tp)[1], cfg.head_dim
    per_head = d + 4 if w.fp8_kv else d * w.dtype_bytes  # e4m3 bytes + float32 scale (engine/kv_cache.py)
    return w.batch * 2 * hkv * per_head + POS_BYTES


def trimmed_step(blocks: list[tuple[int, int]]) -> int:
    """The most rows one forward stores in a trimmed local layer (engine/kv_cache.py) after the window - 1 it
    keeps, for a prefill of `blocks` ([start, end) each, in order) then one token a step: a later block's
    rows; the first block attends its own keys as given and keeps only their tail."""
    return max([1] + [e - s for s, e in blocks[1:]])


def layer_kv_tokens(cfg: ModelConfig, lay: Layout, w: Workload, layer: int, kv_tok: int) -> int:
    """KV tokens layer `layer` allocates: `kv_tok`, or for a local layer whose cache is trimmed (w.trim_local
    without pp or cp, where the runners trim: LocalRunner.trims_local) window - 1 plus one forward's rows, as
    KVCache allocates them."""
    window = cfg.layer_window(layer)
    if window is None or not w.trim_local or (lay.pp, lay.cp) != (1, 1) or not get_spec(lay.strategy).single_rank:
        return kv_tok
    return min(kv_tok, window - 1 + trimmed_step(prefill_steps(w.prompt_tokens, w.prefill_chunk, w.prefill_knee)))


def kv_tokens_and_rows(cfg: ModelConfig, lay: Layout, w: Workload) -> tuple[int, int, int]:
    """(KV tokens kept, rows of the largest prefill forward, transient KV tokens in flight) on the worst CP rank."""
    return get_spec(lay.strategy).kv_rows(lay, w)


def stage_memory(cfg: ModelConfig, lay: Layout, w: Workload, pp_rank: int, layers: int,
                 layer_ids: list[int] | None = None) -> StageMemory:
    first, last = pp_rank == 0, pp_rank == lay.pp - 1
    b, B = w.dtype_bytes, w.batch
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv, ffn, vrows = _heads(cfg, lay.tp)
    ids = list(range(layers)) if layer_ids is None else layer_ids
    weights = weight_elements(cfg, lay.tp, layers, first, last, ids) * b
    if w.fp8_linear:  # steady state (quantizing at load time holds the compute-dtype weights first; an FP8 checkpoint never does)
        elems, channels = projection_sizes(cfg, lay.tp, layers, ids)
        weights += elems * (1 - b) + channels * 4
    moe_layers, fe = sum(cfg.is_moe_layer(i) for i in ids), cfg.moe_intermediate_size // lay.tp
    if w.fp8_experts and moe_layers:  # e4m3 experts + a float32 scale per expert row (w13's 2F, w2's h)
        weights += moe_layers * cfg.num_experts * (3 * fe * h * (1 - b) + (2 * fe + h) * 4)
    kv_tok, rows, flight = kv_tokens_and_rows(cfg, lay, w)
    kv = sum(layer_kv_tokens(cfg, lay, w, i, kv_tok) for i in ids) * kv_bytes_per_token(cfg, lay.tp, w)
    attn_bytes = b * (4 * h + (hq + 2 * hkv) * d + (3 * hq + hkv) * d)
    spec = get_spec(lay.strategy)
    cp_chunked = spec.chunked_kv_rows(lay, w) is not None  # a context strategy's later chunks (chunked.py)
    # chunks after held FP8 entries
    held_fp8 = w.fp8_kv and (cp_chunked or spec.single_rank and spec.chunked_prefill and rows < w.prompt_tokens)
    if held_fp8:
        attn_bytes += hq * d * (b + 8)  # the own-keys partial and two float32 merge buffers
    mlp_part = max(3 * h + 4 * ffn, 4 * h + 3 * ffn)
    if moe_layers:  # engine/moe.py: k gathered rows per token, in expert order
        k = cfg.num_experts_per_tok
        mlp_part = max(mlp_part, 4 * h + k * (3 * h + 3 * fe) + 2 * k * h)  # + the float32 weighted sum
    act = B * rows * max(attn_bytes, b * mlp_part)
    if held_fp8:  # the held keys dequantized a block at a time (kernels/attention.py): k and v of one block
        act += B * hkv * d * (2 * b + 4) * min(kv_tok, FP8_PREFILL_KEY_BLOCK)  # + v's float32 temporary
    if w.fp8_linear:  # the e4m3 copy of a GEMM's input rows
        act += B * rows * max(h, ffn)
    if w.fp8_experts and moe_layers:  # one layer's experts dequantized (module doc: an upper bound)
        act += cfg.num_experts * 3 * fe * h * (4 + b)
    act += B * b * spec.activation_elements(rows, hq, hkv, d)  # ulysses: the whole sequence's q, k, v, out for heads / cp
    act += B * flight * 2 * hkv * d * b
    if cp_chunked:  # a later chunk's queries gathered over the CP group, their partials packed, sent and received
        act += B * lay.cp * rows * hq * (d * b + 2 * (d + 1) * 4)
    if last:
        act += B * vrows * LOGIT_BYTES
    return StageMemory(pp_rank, layers, weights, kv, act, kv_tok, rows)


def plan_memory(cfg: ModelConfig, layout: Layout, workload: Workload) -> MemoryPlan:
    check_tp(cfg, layout.tp)
    stages = partition_layers(cfg.num_layers, layout.pp, layout.pp_layers)
    plan = MemoryPlan(layout, workload)
    plan.stages = [stage_memory(cfg, layout, workload, i, len(s), s) for i, s in enumerate(stages)]
    return plan


def smallest_layout(cfg: ModelConfig, workload: Workload, strategy: str, limit_bytes: int, *,
                    max_world: int = 1024, max_tp: int = 64,
                    allow: Callable[[int, int, int], bool] = lambda tp, pp, cp: True) -> MemoryPlan | None:
    """The fitting layout with the fewest ranks (ties: the lowest peak), keeping `strategy` (dense searches
    tp x pp only; a CP strategy also cp); `allow(tp, pp, cp)` filters out layouts the runtime refuses."""
    tps = valid_tp_sizes(cfg, max_tp)
    for world in range(1, max_world + 1):
        best = None
        for tp in (t for t in tps if world % t == 0):
            for pp in range(1, min(cfg.num_layers, world // tp) + 1):
                if (world // tp) % pp:
                    continue
                cp = world // (tp * pp)
                if (cp > 1 and get_spec(strategy).single_rank) or not allow(tp, pp, cp):
                    continue
                lay = Layout(tp, pp, cp, strategy if cp > 1 else SINGLE_RANK)
                plan = plan_memory(cfg, lay, workload)
                if plan.fits(limit_bytes) and (best is None or plan.peak_bytes < best.peak_bytes):
                    best = plan
        if best is not None:
            return best
    return None


def max_prompt_tokens(cfg: ModelConfig, layout: Layout, workload: Workload, limit_bytes: int,
                      most: int = 1 << 32) -> int:
    """The longest prompt (tokens, at most `most`) whose plan fits `limit_bytes`, everything else as in
    `workload` (decode budget, prefill chunk, dtype, FP8; the context part: all but the last token);
    0 when not even one token fits. Bisection: the peak grows with the prompt (KV kept, rows run)."""

    def fits(n: int) -> bool:
        w = dataclasses.replace(workload, prompt_tokens=n, context_tokens=None)
        return plan_memory(cfg, layout, w).fits(limit_bytes)

    if not fits(1):
        return 0
    lo, hi = 1, 2  # fits(lo), and hi is the first power of two that does not
    while hi <= most and fits(hi):
        lo, hi = hi, 2 * hi
    if hi > most:
        return most if fits(most) else _last_fit(fits, lo, most)
    return _last_fit(fits, lo, hi)


def _last_fit(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest n in [lo, hi) with fits(n), given fits(lo) and not fits(hi) (hi may be untested)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ---------------------------------------------------------------------------- the usable share of a GPU
USABLE_GPU_FRACTION = 0.9  # 10% stays free for the CUDA context, NCCL buffers and allocator fragmentation


def usable_bytes(total_bytes: int) -> int:
    """What a plan may use of a GPU of `total_bytes`: --memory-limit-gb's default, the server's cache budget."""
    return int(total_bytes * USABLE_GPU_FRACTION)


# ---------------------------------------------------------------------------- a server's context cache budget
GRAPH_POOL_BYTES = GiB // 2  # the decode CUDA graph's private memory pool, kept out of the cache


@dataclass(frozen=True)
class CacheBudget:
    """One rank's context cache budget and what it is left from (bytes): 90% of the device, less what is
    allocated before the cache (the weights), the working set of the largest step the server runs and
    the decode CUDA graphs' pool."""

    total: int
    weights: int
    steps: tuple[tuple[str, int], ...]  # (what, working set) of each kind of step: prefill, extend, decode
    graphs: int

    @property
    def usable(self) -> int:
        return usable_bytes(self.total)

    @property
    def step(self) -> tuple[str, int]:
        """(what, bytes) of the largest step."""
        return max(self.steps, key=lambda s: s[1])

    @property
    def bytes(self) -> int:
        return self.usable - self.weights - self.step[1] - self.graphs

    def describe(self) -> str:
        what, step = self.step
        return (f"{self.bytes / GiB:.2f} GiB per rank = {USABLE_GPU_FRACTION} x total {self.total / GiB:.2f} GiB - "
                f"weights {self.weights / GiB:.2f} GiB - step {step / GiB:.2f} GiB ({what}) - graphs "
                f"{self.graphs / GiB:.2f} GiB")


def cache_budget(cfg: ModelConfig, layout: Layout, workload: Workload, *, total_bytes: int, weights_bytes: int,
                 max_batch: int, max_extend: int = 0, graphs_bytes: int = GRAPH_POOL_BYTES) -> CacheBudget:
    """A server rank's context cache budget: usable_bytes(total) - weights - the largest step's working
    set - graphs. `workload`: prompt_tokens = the longest prompt served (the model's window), prefill_chunk =
    the prompt tokens one prefill step processes (None: the whole prompt), dtype and FP8 as served.
    The steps: one prefill chunk (`prefill_step_bytes`), an extend of max_extend rows, a decode step of
    max_batch rows. Their KV is left out: entries and the own-KV pool (its rebuild included) are
    what the budget holds (the scheduler admits by them). ValueError when nothing is left."""
    prefill = prefill_step_bytes(cfg, layout, workload)
    steps = {prefill: ("lower --prefill-chunk" if prefill[0].startswith("one ") else
                       "prefill in chunks (--prefill-chunk TOKENS)")}
    if max_extend > 0:
        steps[(f"an extend of {max_extend} tokens", cascade_step_bytes(cfg, layout, workload, max_extend, 1))] = \
            "lower --max-extend"
    steps[(f"a decode step of {max_batch} rows", cascade_step_bytes(cfg, layout, workload, 1, max_batch))] = \
        "lower --max-batch"
    b = CacheBudget(total_bytes, weights_bytes, tuple(steps), graphs_bytes)
    if b.bytes <= 0:
        raise ValueError(f"no memory is left for the context cache (--cache-gib): {b.describe()}. To fit, "
                         f"{steps[b.step]}, spread the weights over more ranks (--tp, --pp), or give --cache-gib "
                         "explicitly")
    return b


def prefill_step_bytes(cfg: ModelConfig, layout: Layout, w: Workload) -> tuple[str, int]:
    """(what, bytes) of the largest prefill step on the worst rank, beside the KV it keeps. Whole
    (no chunk, or APB, whose passing blocks need each host's whole block): the plan of a window-long
    prefill. A chunk on one rank: the planner's chunk after a held prefix. A chunk over cp ranks: the
    strategy's plan of a chunk-long prompt (each chunk is laid out as such a prompt; Star's in-chunk
    part runs ring's zigzag path), plus the prefix partial: the chunk's queries gathered from every
    rank, their (out, lse) partials sent and received, and held e4m3 keys read as a dense chunk reads them."""
    window, chunk, cp = w.prompt_tokens, w.prefill_chunk, layout.cp
    over = f" over cp={cp}" if cp > 1 else ""
    spec = get_spec(layout.strategy)
    if not chunk or chunk >= window or not spec.chunked_prefill:
        whole = dataclasses.replace(w, prefill_chunk=None)
        return f"a whole {window}-token prompt{over}", _activations(cfg, layout, whole)
    if cp == 1:
        return f"one {chunk}-token chunk", _activations(cfg, dataclasses.replace(layout, strategy=SINGLE_RANK), w)
    rows = -(-chunk // cp)
    in_chunk = Layout(layout.tp, layout.pp, cp, spec.chunk_plan or layout.strategy, layout.pp_layers)
    acts = _activations(cfg, in_chunk, dataclasses.replace(w, prompt_tokens=chunk, context_tokens=None,
                                                           max_new_tokens=0, prefill_chunk=None, fp8_kv=False))
    hq, d = _heads(cfg, layout.tp)[0], cfg.head_dim
    prefix = chunk * hq * d * w.dtype_bytes + 2 * chunk * hq * (d + 1) * 4
    return f"one {chunk}-token chunk{over}", acts + prefix + _held_fp8_bytes(cfg, layout, w, rows, -(-window // cp))


def cascade_step_bytes(cfg: ModelConfig, layout: Layout, w: Workload, rows: int, batch: int) -> int:
    """Bytes of one cascade forward (an extend of `rows` tokens, or a decode step of `batch` rows of one
    token) on a rank: every CP rank runs all the rows (the planner's layer model, last-row logits per
    row), attends its shard; the partials in float32 (shared and own, merged), gathered over the CP group.
    An extend reads a held FP8 entry a key block at a time; a decode step reads e4m3 in the kernel."""
    dense = Layout(layout.tp, layout.pp, 1, SINGLE_RANK, layout.pp_layers)
    acts = _activations(cfg, dense, Workload(rows, None, 0, rows, w.dtype_bytes, batch, fp8_linear=w.fp8_linear,
                                             fp8_experts=w.fp8_experts))
    hq, d = _heads(cfg, layout.tp)[0], cfg.head_dim
    partials = batch * rows * hq * (d + 1) * 4 * (2 + (layout.cp + 1 if layout.cp > 1 else 0))
    held = _held_fp8_bytes(cfg, layout, w, rows, -(-w.prompt_tokens // layout.cp)) if rows > 1 else 0
    return acts + partials + held


def _activations(cfg: ModelConfig, layout: Layout, w: Workload) -> int:
    """Activations of `w` under `layout` on the pipeline stage that needs the most."""
    return max(s.activations for s in plan_memory(cfg, layout, w).stages)


def _held_fp8_bytes(cfg: ModelConfig, layout: Layout, w: Workload, rows: int, held: int) -> int:
    """What `rows` rows attending `held` e4m3 keys add to their forward (0 without --fp8 kv): the dense
    planner's chunk after held FP8 entries less the same rows alone."""
    if not w.fp8_kv:
        return 0
    dense = Layout(layout.tp, layout.pp, 1, SINGLE_RANK, layout.pp_layers)
    one = dataclasses.replace(w, prompt_tokens=held + rows, context_tokens=None, max_new_tokens=0, prefill_chunk=rows,
                              batch=1)
    return (_activations(cfg, dense, one)
            - _activations(cfg, dense, dataclasses.replace(one, prompt_tokens=rows, prefill_chunk=rows)))


# ---------------------------------------------------------------------------- how a plan is shown
def _fp8_items(w: Workload) -> list[str]:
    return [x for x, on in (("linear", w.fp8_linear), ("kv", w.fp8_kv)) if on]


def plan_json(plan: MemoryPlan, limit: int | None, best: MemoryPlan | None) -> dict:
    """The plan as `--plan-only --json` prints it; `best` is the smallest layout that fits, if this one does not."""
    lay, w = plan.layout, plan.workload
    return {"layout": {"tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "strategy": lay.strategy},
            "fp8": _fp8_items(w),
            "world_size": lay.world, "peak_bytes": plan.peak_bytes, "limit_bytes": limit, "fits": plan.fits(limit),
            "stages": [{"pp_rank": s.pp_rank, "layers": s.layers, "weights": s.weights, "kv_cache": s.kv_cache,
                        "activations": s.activations, "kv_tokens": s.kv_tokens, "rows": s.rows} for s in plan.stages],
            "smallest_fitting": None if best is None else {
                "tp": best.layout.tp, "pp": best.layout.pp, "cp": best.layout.cp, "peak_bytes": best.peak_bytes}}


def refusal(plan: MemoryPlan, limit: int, best: MemoryPlan | None) -> str:
    """Why a layout that does not fit is refused, and the flags of the smallest one that fits."""
    s = plan.worst
    msg = (f"layout {plan.layout.describe()} needs {gib(plan.peak_bytes)} per rank (stage {s.pp_rank}: weights "
           f"{gib(s.weights)}, KV cache {gib(s.kv_cache)}, activations {gib(s.activations)}) but {gib(limit)} is "
           "usable per rank (--memory-limit-gb, or 90% of the GPU): it does not fit. ")
    if best is None:
        return msg + ("No layout of up to 1024 ranks fits: shorten the prompt, lower --max-new-tokens or set "
                      "--prefill-chunk")
    b = best.layout
    return (msg + f"The smallest layout that fits: {b.describe()} ({b.world} ranks, {gib(best.peak_bytes)} per rank): "
            f"run with --tp {b.tp} --pp {b.pp} --cp {b.cp}" + (f" --cp-strategy {b.strategy}" if b.cp > 1 else "")
            + f" on {b.world} processes")


def max_prompt_json(cfg: ModelConfig, layout: Layout, workload: Workload, tokens: int, peak: int | None,
                    limit: int) -> dict:
    """`--max-prompt --json`: the longest prompt that fits `limit` (max_prompt_tokens) and its plan's peak."""
    return {"max_prompt_tokens": tokens, "peak_bytes": peak, "limit_bytes": limit,
            "max_new_tokens": workload.max_new_tokens, "prefill_chunk": workload.prefill_chunk,
            "layout": {"tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "strategy": layout.strategy},
            "fp8": _fp8_items(workload), "model_window": cfg.max_position_embeddings}


def max_prompt_line(r: dict) -> str:
    """`--max-prompt` without --json: max_prompt_json's result in one line."""
    return (f"longest prompt that fits {gib(r['limit_bytes'])} per rank: {r['max_prompt_tokens']} tokens "
            f"(+ {r['max_new_tokens']} new; model window {r['model_window']})")
