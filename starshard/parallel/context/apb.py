"""APB (Huang et al., 2025): sequence-parallel prefill with small anchors and compressed context
blocks passed between ranks, then Star Attention's distributed-softmax query phase.

Phase 1, one forward per rank. The context is split evenly over the CP group (rank r holds
[C*r//cp, C*(r+1)//cp)). Every rank but the first runs its block behind an anchor; per layer each rank
scores its block's KV with a compressor, keeps the `passing_size` best entries per KV head (in
position order), and ONE all-gather on the CP group shares them (k, v and positions packed in one
tensor). Rank h then attends

    anchor rows: the anchor, causally
    block rows:  [anchor (full), passing blocks of ranks < h (full), own block (causal)]

The passing KV is dropped after the layer: it never enters the FFN or the cache. Only the block's
KV is cached. A local (sliding-window) layer runs exactly instead: its block rows attend their own
block and the previous block's window edge (edges.py, as Star), no anchor, no passing entries. Phase 2 (the query tokens, then decode) is ContextStrategy.decode_attend, as in Star.
With an FP8 KV cache the passing entries travel as e4m3 plus per-(head, token) scales (wire.py, about
half the bytes) and are attended dequantized, as the sender's FP8 cache holds them.

Row layout and positions (the RoPE positions the model runs with):

    rank h >= 1:  [head | query | anchor context] [block]
                   0 .. p-1 | p .. p+Lq-1 | p+Lq .. a+Lq-1     s_h .. e_h-1
    rank 0:       [query, score-only] [block]                   (only when the compressor reads the query)
                   p .. p+Lq-1                                   0 .. e_0-1

`head` = the first `prefix_len` context tokens (the chat template's system/user header; by default the
prompt's own, Prompt.head_len, which the runner hands over via `use_prompt_head`; 0 for raw prompts),
`query` = the prompt's query tokens, `anchor context` = the rest of the first `a` context tokens. The
anchor takes the *starting* positions 0, 1, ... consecutively, in row order, so the embedded query sits
right after the head (as the paper and its code do) and the anchor context behind it is shifted by
Lq. `a` is capped so that a + Lq <= s_h: every anchor position precedes every block position, and no
anchor token duplicates a block token. (If the query alone is longer than everything before the block,
its positions overlap the block's; visibility is unaffected, see below.) Visibility never relies on
positions across the pieces: each piece is its own attention call (anchor causal, [anchor; passing]
full, block causal) merged by lse, so colliding positions cannot leak keys.

Study mode (one device, `num_blocks` = N virtual hosts, cp = 1): the context is split into N blocks
exactly as over N ranks and the hosts run one after another, each through all layers, as separate
segments. Each host's per-layer passing entries are kept (small) and handed to later hosts at the same
layer in place of the all-gather. This reproduces cp = N exactly: host h's computation depends only on
hosts < h. The blocks land in one cache in position order; the query phase attends all of it, which is
the lse merge over N ranks done in one call.

On rank 0 (no anchor) the compressor still needs the embedded query: its query rows are computed
exactly as on the other ranks (they see the head and themselves, causally) but no other row sees them
and their KV is never cached. The last rank's passing block is never used by anyone: it sends zeros
and skips scoring. With cp = 1 there is nothing to pass: APB is dense attention over the context.

Compressors (one small interface, `Compressor.score(ScoreInput) -> [B, Hkv, n]`, higher = keep):
    query            training-free (default): attention probabilities of the embedded query's rows to
                     the block's keys (softmax over the block), averaged over query rows and the GQA
                     group, max-pooled over neighbouring positions. With the model bound (`bind`), the
                     query's q vectors are rotated to the query's true positions first, so the score is
                     the attention the query would pay from where it really stands. Without an embedded
                     query it falls back to the block's last `window` rows (SnapKV-style).
    retaining-heads  Locret / APB per-layer MLPs scoring [q, k, v] (file format: RetainingHeads).
    random           uniform random scores (ablation).

Defaults follow the paper's Table 5 (per-rank block b = context / cp: anchor b/4 and passing b/8, both
capped at 8K: 32K over 8 ranks -> 1K / 0.5K, 512K -> 8K / 8K), with floors of min(b, 64) and
min(b, 32) so short contexts keep a usable anchor and passing block.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from starshard.kernels.attention import attention
from starshard.kernels.common import mark_arange
from starshard.kernels.rope import apply_rope
from starshard.kernels.sparse import pattern_for
from starshard.partition import apb_bounds, apb_default_sizes
from starshard.parallel.context.base import ContextStrategy, Segment, cache_append
from starshard.parallel.context.edges import cached_edge, post_edges
from starshard.parallel.context.collectives import all_gather_into
from starshard.parallel.context.merge import merge_partials
from starshard.parallel.context.wire import SCALE_BYTES, fp8_wire, nbytes, pack_fp8, unpack_fp8
from starshard.strategies.apb import APB, COMPRESSORS

# ----------------------------------------------------------------------------------------------
# Compressors
# ----------------------------------------------------------------------------------------------


@dataclass
class ScoreInput:
    """What a compressor sees for one layer on one rank.

    q: [B, Hq, n, D] the block's queries (after RoPE); k, v: [B, Hkv, n, D] its keys (after RoPE) and values;
    pos: [n] their global positions; query: [B, Hq, Lq, D] the embedded query's queries (rotated to the
    query's true positions when the RoPE is bound), None when the query is not embedded.
    inv_freq: the model's RoPE inverse frequencies when bound (see `rotate`). kv_head_offset: global
    index of the first KV head here (tensor parallelism hands each rank a contiguous slice of heads).
    """

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    query: torch.Tensor | None
    rank: int
    inv_freq: torch.Tensor | None = None
    kv_head_offset: int = 0

    def rotate(self, x: torch.Tensor, delta) -> torch.Tensor:
        """x [B, H, R, D] rotated by RoPE over `delta` positions (int or [R]); float32."""
        if self.inv_freq is None:
            raise ValueError("this compressor needs the model's RoPE: call strategy.bind(model) first")
        return _rotate(x, delta, self.inv_freq)


def _rotate(x: torch.Tensor, delta, inv_freq: torch.Tensor) -> torch.Tensor:
    inv = inv_freq.to(x.device, torch.float32)
    if isinstance(delta, torch.Tensor):
        freqs = delta.to(x.device, torch.float32).reshape(-1, 1) * inv  # [R, D/2]
    else:  # a host number scales on the device: as a device tensor it would be a blocking copy
        freqs = (inv * float(delta)).reshape(1, -1)  # [1, D/2]
    return apply_rope(x.float(), freqs.cos(), freqs.sin())


def _smooth(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max-pool [B, H, n] over neighbouring positions (odd kernel, same length)."""
    if kernel <= 1 or scores.shape[-1] < 2:
        return scores
    B, H, n = scores.shape
    return F.max_pool1d(scores.reshape(B * H, 1, n), kernel, stride=1, padding=kernel // 2).reshape(B, H, n)


# Float32 scores `pooled_attention` holds at once: as many KV heads a call as fit. Per head at a time (the bound
# it had) a Llama-8B layer made 8 rounds of small launches per host, which left the GPU idle in APB's study mode.
POOLED_SCORE_BYTES = 256 * 2**20


def pooled_attention(qr: torch.Tensor, k: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
    """Mean attention probability each key gets from the rows qr, over rows and the GQA group.

    qr: [B, Hq, R, D]; k: [B, Hkv, n, D]; visible: optional bool [R, n] -> [B, Hkv, n] float32.
    KV heads go together, as many as keep the score buffer [B, heads, g*R, n] within POOLED_SCORE_BYTES
    (at least one).
    """
    B, Hq, R, D = qr.shape
    Hkv, n = k.shape[1], k.shape[2]
    g = Hq // Hkv
    step = max(1, min(Hkv, POOLED_SCORE_BYTES // max(1, 4 * B * g * R * n)))
    hidden = None if visible is None else ~visible.repeat(g, 1)  # [g*R, n], rows as qh's
    out = []
    for h in range(0, Hkv, step):
        e = min(h + step, Hkv)
        qh = qr[:, h * g : e * g].float().reshape(B, e - h, g * R, D)
        s = (qh @ k[:, h:e].float().transpose(-1, -2)) * D**-0.5  # [B, heads, g*R, n]
        if hidden is not None:
            s = s.masked_fill(hidden, float("-inf"))
        out.append(torch.softmax(s, dim=-1).nan_to_num(0.0).mean(dim=2))
    return torch.cat(out, dim=1)


def sparse_after(q, k, v, pos, extra_k: list, extra_v: list, pattern, scale=None, softcap=None):
    """(out, lse) of a block's rows through a sparse method over [extra keys; the block's own keys]:
    the block's rows see every extra key (anchor, passing entries) and their own keys causally. As
    key indices that is index-causal attention with the rows at offset E = len(extras), the layout the
    sparse methods take (`query_offset`); RoPE has been applied with the true positions already, so
    index positions (marked on the host: no device read) only place the mask. No extras: `pos`.
    scale, softcap: the layer's (the patterns refuse a soft-cap, naming it)."""
    if not extra_k:
        return attention(q, k, v, q_pos=pos, k_pos=pos, causal=True, sparse=pattern, scale=scale, softcap=softcap)
    ek, ev = torch.cat(extra_k + [k], dim=2), torch.cat(extra_v + [v], dim=2)
    E, n = ek.shape[2] - k.shape[2], ek.shape[2]
    k_idx = mark_arange(torch.arange(n, device=q.device), 0)
    q_idx = mark_arange(torch.arange(E, n, device=q.device), E)
    return attention(q, ek, ev, q_pos=q_idx, k_pos=k_idx, causal=True, sparse=pattern, scale=scale, softcap=softcap)


class Compressor:
    """Scores a block's KV entries per KV head; the strategy keeps the top `passing_size`."""

    name = "base"
    uses_query = False  # True: rank 0 runs the embedded query's rows for this compressor

    def score(self, inp: ScoreInput) -> torch.Tensor:  # [B, Hkv, n], higher = keep
        raise NotImplementedError


class QueryCompressor(Compressor):
    """Training-free: attention of the embedded query to the block's keys (see the module docstring)."""

    name = "query"
    uses_query = True

    def __init__(self, pool: int = 5, window: int = 32):
        self.pool, self.window = pool, window

    def score(self, inp: ScoreInput) -> torch.Tensor:
        if inp.query is not None:
            probs = pooled_attention(inp.query, inp.k)
        else:  # no embedded query: the block's own last rows observe it (causally)
            w = min(self.window, inp.q.shape[2])
            visible = inp.pos[None, :] <= inp.pos[-w:, None]
            probs = pooled_attention(inp.q[:, :, -w:], inp.k, visible)
        return _smooth(probs, self.pool)


class RandomCompressor(Compressor):
    """Uniform random scores, reproducible per (seed, layer, host, global KV head): the ablation
    baseline; the same selection whatever the tensor-parallel split."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def score(self, inp: ScoreInput) -> torch.Tensor:
        B, Hkv, n, _ = inp.k.shape
        gen = torch.Generator(device=inp.k.device)
        out = []
        for h in range(inp.kv_head_offset, inp.kv_head_offset + Hkv):
            gen.manual_seed((self.seed * 1_000_003 + inp.layer * 7919 + inp.rank * 104_729 + h) % (2**63))
            out.append(torch.rand(B, n, generator=gen, device=inp.k.device))
        return torch.stack(out, dim=1)


class RetainingHeads(Compressor):
    """Locret / APB retaining heads: per layer, scores = fc2(act(fc1([q, k, v]))) per token, one score
    per KV head, then max-pooled over neighbouring positions.

    File format (safetensors, or a torch file holding a dict of tensors), per global layer i:
        layers.{i}.fc1.weight  [I, (Hq + 2*Hkv) * D]   input: one token's q, k, v projections concatenated
                                                       (all q heads, then k heads, then v heads, model order)
        layers.{i}.fc2.weight  [Hkv, I]
        layers.{i}.fc1.bias [I], layers.{i}.fc2.bias [Hkv]   optional
    Any key prefix is accepted, so the retaining heads inside an APB/Locret checkpoint
    (`model.layers.{i}.self_attn.fc1.weight`) load as they are. Optional safetensors metadata (or a
    "__config__" dict entry in a torch file): act = "silu" (default) | "gelu" | "relu";
    pool = 5 (max-pool kernel); rope = "pre" (default: q and k before RoPE, as APB/Locret train them; the
    strategy must be bound to the model to undo the rotation) | "post".
    Layers without weights are an error. Under tensor parallelism pass `tp_group`: each rank holds a
    contiguous slice of heads, fc1's partial products are summed over the TP group and each rank keeps
    its own KV heads' scores.
    """

    name = "retaining-heads"

    def __init__(self, layers: dict[int, dict[str, torch.Tensor]], *, act: str = "silu", pool: int = 5,
                 rope: str = "pre", tp_group=None):
        if rope not in ("pre", "post"):
            raise ValueError(f"retaining heads: rope must be 'pre' or 'post', got {rope!r}")
        acts = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}
        if act not in acts:
            raise ValueError(f"retaining heads: act must be one of {', '.join(acts)}, got {act!r}")
        for i, w in layers.items():
            if "fc1.weight" not in w or "fc2.weight" not in w:
                raise ValueError(f"retaining heads: layer {i} needs fc1.weight and fc2.weight")
        self.layers, self.act, self.pool, self.rope, self.tp_group = layers, acts[act], pool, rope, tp_group
        self._cache: dict = {}

    @classmethod
    def load(cls, path, tp_group=None) -> "RetainingHeads":
        import re

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"retaining heads file {path} not found")
        meta: dict = {}
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            from safetensors.torch import load_file

            tensors = load_file(str(path))
            with safe_open(str(path), "pt") as f:
                meta = dict(f.metadata() or {})
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
            meta = dict(tensors.pop("__config__", {}) or {})
        pat = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?(fc[12]\.(?:weight|bias))$")
        layers: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            m = pat.search(key)
            if m:
                layers.setdefault(int(m.group(1)), {})[m.group(2)] = t
        if not layers:
            raise ValueError(f"{path}: no retaining-head weights (keys like layers.<i>.fc1.weight) found")
        return cls(layers, act=str(meta.get("act", "silu")), pool=int(meta.get("pool", 5)),
                   rope=str(meta.get("rope", "pre")), tp_group=tp_group)

    def _weights(self, layer: int, Hq: int, Hkv: int, D: int, device, dtype):
        key = (layer, Hq, Hkv, D, device, dtype)
        if key in self._cache:
            return self._cache[key]
        if layer not in self.layers:
            raise KeyError(f"retaining heads have no weights for layer {layer}")
        w = self.layers[layer]
        w1, w2 = w["fc1.weight"], w["fc2.weight"]
        b1, b2 = w.get("fc1.bias"), w.get("fc2.bias")
        hkv_full = w2.shape[0]
        hq_full = w1.shape[1] // D - 2 * hkv_full
        if w1.shape[1] != (hq_full + 2 * hkv_full) * D or hq_full < 1:
            raise ValueError(f"retaining heads layer {layer}: fc1 input {w1.shape[1]} does not fit head_dim {D}")
        tp = hkv_full // Hkv if Hkv and hkv_full % Hkv == 0 else 0
        if tp < 1 or hq_full != Hq * tp:
            raise ValueError(f"retaining heads layer {layer}: trained for {hq_full} q / {hkv_full} kv heads, "
                             f"this rank runs {Hq} / {Hkv}")
        if tp > 1:
            if self.tp_group is None or dist.get_world_size(self.tp_group) != tp:
                raise ValueError(f"retaining heads: this rank holds 1/{tp} of the heads; pass the TP group")
            r = dist.get_rank(self.tp_group)
            cols = torch.cat([torch.arange(r * Hq * D, (r + 1) * Hq * D),
                              hq_full * D + torch.arange(r * Hkv * D, (r + 1) * Hkv * D),
                              (hq_full + hkv_full) * D + torch.arange(r * Hkv * D, (r + 1) * Hkv * D)])
            w1 = w1[:, cols]
            w2 = w2[r * Hkv : (r + 1) * Hkv]
            b2 = None if b2 is None else b2[r * Hkv : (r + 1) * Hkv]
        out = tuple(None if t is None else t.to(device, dtype) for t in (w1, b1, w2, b2)) + (tp,)
        self._cache[key] = out
        return out

    def score(self, inp: ScoreInput) -> torch.Tensor:
        q, k, v = inp.q, inp.k, inp.v
        B, Hq, n, D = q.shape
        Hkv = k.shape[1]
        if self.rope == "pre":
            q, k = inp.rotate(q, -inp.pos), inp.rotate(k, -inp.pos)
        w1, b1, w2, b2, tp = self._weights(inp.layer, Hq, Hkv, D, q.device, torch.float32)
        x = torch.cat([t.float().transpose(1, 2).reshape(B, n, -1) for t in (q, k, v)], dim=-1)
        h = x @ w1.T
        if tp > 1:
            dist.all_reduce(h, group=self.tp_group)
        if b1 is not None:
            h = h + b1
        s = self.act(h) @ w2.T
        if b2 is not None:
            s = s + b2
        return _smooth(s.transpose(1, 2).contiguous(), self.pool)  # [B, Hkv, n]


def make_compressor(spec, *, path=None, seed: int = 0, tp_group=None) -> Compressor:
    if isinstance(spec, Compressor):
        return spec
    if spec == "query":
        return QueryCompressor()
    if spec == "random":
        return RandomCompressor(seed)
    if spec == "retaining-heads":
        if path is None:
            raise ValueError("--compressor retaining-heads needs a trained weights file (--compressor-path)")
        return RetainingHeads.load(path, tp_group=tp_group)
    raise ValueError(f"unknown APB compressor {spec!r}; choose one of {', '.join(COMPRESSORS)}")


# ----------------------------------------------------------------------------------------------
# The strategy
# ----------------------------------------------------------------------------------------------


@dataclass
class APBSegment(Segment):
    """Segment = [front rows; block rows]. Front rows are the anchor (ranks > 0) or the embedded
    query's score-only rows (rank 0); `query_rows` locates the embedded query among them."""

    n_front: int = 0
    query_rows: tuple[int, int] | None = None
    query_shift: int = 0  # true position - embedded position of the query rows
    score_only: bool = False  # rank 0: the front rows are the query, seen by no other row
    head_len: int = 0  # score-only rows also see the block's first head_len rows (the template head)
    host: int = 0  # which block (CP rank, or virtual host in study mode) this segment runs

    def to(self, device) -> "APBSegment":
        base = super().to(device)
        return dataclasses.replace(self, index=base.index, positions=base.positions, cache_rows=base.cache_rows)


class APBAttention(ContextStrategy):
    """APB over a CP group. anchor_size / passing_size None = paper defaults for the block size;
    0 = ablate (no anchor / no passing). embed_query=False ablates the embedded query. compressor:
    "query" | "retaining-heads" (needs compressor_path) | "random" | a Compressor. prefix_len: the
    chat template's head at the context's front (the embedded query goes right after it); None = the
    prompt's own (`use_prompt_head`, set by the runner from Prompt.head_len), else 0. num_blocks: with
    cp = 1, simulate that many hosts one after another (study mode, exact copy of cp = num_blocks)."""

    name = "apb"
    query_phase = True

    def __init__(self, group=None, *, anchor_size: int | None = None, passing_size: int | None = None,
                 compressor="query", embed_query: bool = True, query_rank: int | None = None,
                 prefix_len: int | None = None, compressor_path=None, seed: int = 0, tp_group=None,
                 num_blocks: int | None = None):
        super().__init__(group, query_rank)
        # (the compressor's own checks are make_compressor's)
        APB.validate(self.cp, dict(anchor_size=anchor_size, passing_size=passing_size, prefix_len=prefix_len,
                                   apb_hosts=num_blocks))
        self.num_blocks = num_blocks
        self.anchor_size, self.passing_size, self.prefix_len = anchor_size, passing_size, prefix_len
        self._prompt_head = 0
        self.embed_query = embed_query
        self.compressor = make_compressor(compressor, path=compressor_path, seed=seed, tp_group=tp_group)
        self.tp_group = tp_group
        self.inv_freq: torch.Tensor | None = None
        self.layer_ids: list[int] | None = None
        self.trace: list | None = None  # set to [] to record what each layer selected and sent
        self._bounds: list[int] | None = None  # set by segments(): block boundaries of this prompt
        self._sizes: tuple[int, int] | None = None  # (anchor, passing) resolved for this prompt
        self._stash: dict[int, dict[int, tuple]] = {}  # study mode: layer -> host -> passing (k, v, pos)

    @classmethod
    def from_options(cls, group, options, *, cp_groups=None, tp_group=None):
        """--num-blocks means the same as --apb-hosts for APB (the registry refuses the two disagreeing)."""
        return cls(group, anchor_size=options.get("anchor_size"), passing_size=options.get("passing_size"),
                   compressor=options.get("compressor", "query"), embed_query=options.get("embed_query", True),
                   query_rank=options.get("query_rank"), prefix_len=options.get("prefix_len"),
                   compressor_path=options.get("compressor_path"), tp_group=tp_group,
                   num_blocks=options.get("apb_hosts", options.get("num_blocks")))

    def bind(self, model) -> "APBAttention":
        """Learn the model's RoPE (query re-rotation, retaining heads' pre-RoPE inputs) and the global
        index of each held layer (pipeline stages, per-layer retaining heads)."""
        self.inv_freq = getattr(model, "inv_freq", None)
        self.layer_ids = list(getattr(model, "layer_ids", [])) or None
        self._config = getattr(model, "config", None)
        return self

    @property
    def hosts(self) -> int:
        """Blocks the context is split into: the CP ranks, or (cp = 1) virtual hosts run in turn."""
        return self.cp if self.cp > 1 else (self.num_blocks or 1)

    def use_prompt_head(self, head_len: int) -> None:
        """The prompt's chat-template head length: the default prefix_len (the runner sets it per prompt)."""
        self._prompt_head = int(head_len)

    @property
    def effective_prefix_len(self) -> int:
        return self._prompt_head if self.prefix_len is None else self.prefix_len

    def resolved_sizes(self, context_len: int) -> tuple[int, int]:
        """(anchor, passing) for this context (defaults from the per-host block size)."""
        anchor, passing = apb_default_sizes(max(1, math.ceil(context_len / self.hosts)))
        return (anchor if self.anchor_size is None else self.anchor_size,
                passing if self.passing_size is None else self.passing_size)

    def anchor_context_end(self, host: int, prompt_len: int, context_len: int) -> int:
        """Host `host`'s anchor holds context positions [0, this) (0 for host 0)."""
        if host == 0:
            return 0
        s = self._bounds[host]
        anchor, _ = self._sizes
        p = min(self.effective_prefix_len, s)
        embed = self.embed_query and prompt_len > context_len and self.hosts > 1
        return max(p, min(anchor, s - (prompt_len - context_len))) if embed else min(anchor, s)

    def _candidates(self, host: int) -> tuple[int, int]:
        """Positions [lo, hi) host `host` may pass on: its block minus what the next host's anchor
        already holds (anchors only grow with the host index), so no later host sees a key twice."""
        lo, hi = self._bounds[host], self._bounds[host + 1]
        nxt = self._anchor_ends[host + 1] if host + 1 < self.hosts else 0
        return min(max(lo, nxt), hi), hi

    def _passing_counts(self) -> list[int]:
        _, passing = self._sizes
        return [min(passing, hi - lo) for lo, hi in map(self._candidates, range(self.hosts))]

    def segments(self, prompt_len: int, context_len: int) -> list[Segment]:
        C = context_len
        if C < self.hosts:
            what = "CP rank" if self.cp > 1 else "host (--apb-hosts)"
            raise ValueError(f"APB needs at least one context token per {what}: {C} context tokens, "
                             f"{self.hosts} hosts; lower the host count or lengthen the context")
        self._bounds = apb_bounds(C, self.hosts)
        self._sizes = self.resolved_sizes(C)
        self._anchor_ends = [self.anchor_context_end(h, prompt_len, C) for h in range(self.hosts)]
        self._stash = {}
        self._check_windows()
        hosts = [self.rank] if self.cp > 1 else range(self.hosts)
        return [self._host_segment(h, prompt_len, C) for h in hosts]

    def _window(self) -> int | None:
        """The bound model's largest sliding window (config: the same on every pipeline stage)."""
        cfg = getattr(self, "_config", None)
        ws = [w for w in (cfg.layer_window(i) for i in range(cfg.num_layers)) if w] if cfg is not None else []
        return max(ws) if ws else None

    def edge_len(self, host: int, window: int) -> int:
        """Keys before host `host`'s block that its local layers see: the previous window - 1 positions."""
        return min(window - 1, self._bounds[host]) if 0 < host < self.hosts else 0

    def _check_windows(self) -> None:
        """Refuse (ValueError, the same on every rank, before any transfer) a block shorter than a local
        layer's edge over CP ranks (the edge would span several ranks)."""
        window = self._window()
        if window is None or self.cp == 1:
            return
        short = [h for h in range(1, self.hosts) if self.edge_len(h, window) > self._bounds[h] - self._bounds[h - 1]]
        if short:
            raise ValueError(f"--cp-strategy apb: a block of {self._bounds[short[0]] - self._bounds[short[0] - 1]} "
                             f"context tokens is shorter than a local layer's window edge (sliding_window={window}); "
                             f"use fewer CP ranks or a longer context")

    def _local(self, seg: "APBSegment", q, k, v, runs, cache, window: int, extras: dict):
        """A local layer, exactly: the block rows attend their own block and the previous block's edge
        (edges.py) under the window; no anchor, no passing entries (every key they may see is there).
        The front rows (anchor, or rank 0's score-only query) attend themselves under the window. runs: the
        host-marked positions (block, front rows, the front rows' keys)."""
        F_, h = seg.n_front, seg.host
        qL, kL, vL, pL = q[:, :, F_:], k[:, :, F_:], v[:, :, F_:], runs[0]
        e_in, e_out = self.edge_len(h, window), self.edge_len(h + 1, window)
        if e_in and self.cp == 1:  # virtual hosts: the previous host's block ends the cache
            edge = cached_edge(cache, e_in)
            pending = lambda: edge  # noqa: E731
        else:
            pending = post_edges(kL, vL, cache, self.group, send_to=h + 1 if e_out and self.cp > 1 else None,
                                 send_rows=e_out, recv_from=h - 1 if e_in else None, recv_rows=e_in,
                                 start=self._bounds[h], stats=self.wire)
        out, lse = attention(qL, kL, vL, q_pos=pL, k_pos=pL, causal=True, window=window, **extras)
        edge = pending()
        if edge is not None:
            ke, ve, kp, ks, vs = edge
            o2, l2 = attention(qL, ke, ve, q_pos=pL, k_pos=kp, causal=True, window=window, k_scale=ks, v_scale=vs,
                               **extras)
            out, _ = merge_partials(out, lse, o2, l2)
        if F_:
            qF, kF, vF = q[:, :, :F_], k[:, :, :F_], v[:, :, :F_]
            _, pF, kp = runs
            if seg.score_only:  # the query rows see the template head and themselves
                kF, vF = torch.cat([kL[:, :, : seg.head_len], kF], dim=2), torch.cat([vL[:, :, : seg.head_len], vF], dim=2)
            front, _ = attention(qF, kF, vF, q_pos=pF, k_pos=kp, causal=True, window=window, **extras)
            out = torch.cat([front, out], dim=2)
        cache_append(cache, kL, vL, pL, None)
        return out

    def _host_segment(self, host: int, prompt_len: int, C: int) -> "APBSegment":
        Lq = prompt_len - C
        anchor, passing = self._sizes
        b = self._bounds
        s, e = b[host], b[host + 1]
        block = torch.arange(s, e)
        query = torch.arange(C, prompt_len)
        embed = self.embed_query and Lq > 0 and self.hosts > 1
        prefix = self.effective_prefix_len
        if host == 0:
            # Score-only query rows when host 0's block is actually compressed with the query.
            needs = (embed and self.compressor.uses_query and 0 < passing < e - s)
            if not needs:
                return APBSegment(block, block.clone(), None, host=host)
            p = min(prefix, e - s)
            index = torch.cat([query, block])
            positions = torch.cat([torch.arange(p, p + Lq), block])
            return APBSegment(index, positions, torch.arange(Lq, Lq + e - s), n_front=Lq, query_rows=(0, Lq),
                              query_shift=C - p, score_only=True, head_len=p, host=host)
        p = min(prefix, s)
        q_len = Lq if embed else 0
        a = max(p, min(anchor, s - q_len)) if embed else min(anchor, s)
        index = torch.cat([torch.arange(p), query if embed else query[:0], torch.arange(p, a)])
        n_front = len(index)
        positions = torch.cat([torch.arange(n_front), block])
        index = torch.cat([index, block])
        return APBSegment(index, positions, torch.arange(n_front, n_front + e - s), n_front=n_front,
                          query_rows=(p, p + q_len) if embed else None, query_shift=C - p, host=host)

    # -- per-layer pieces ---------------------------------------------------------------------

    def _select(self, layer: int, seg: APBSegment, q, k, v, pos):
        """This rank's passing entries (k, v [B, Hkv, m, D], positions [B, Hkv, m]), in position order."""
        F_ = seg.n_front
        kL, vL, pL = k[:, :, F_:], v[:, :, F_:], pos[F_:]
        B, Hkv, n, D = kL.shape
        m = self._passing_counts()[seg.host]
        lo, hi = self._candidates(seg.host)
        first = lo - self._bounds[seg.host]  # block rows before `first` sit in the next host's anchor
        if m == hi - lo:  # the budget covers every candidate: pass them whole
            return kL[:, :, first:], vL[:, :, first:], pL[first:].expand(B, Hkv, m)
        query = None
        if seg.query_rows is not None and self.compressor.uses_query:
            r0, r1 = seg.query_rows
            query = q[:, :, r0:r1]
            if self.inv_freq is not None and seg.query_shift:
                query = _rotate(query, seg.query_shift, self.inv_freq)
        offset = 0 if self.tp_group is None else dist.get_rank(self.tp_group) * Hkv  # this rank's first KV head
        scores = self.compressor.score(ScoreInput(layer, q[:, :, F_:], kL, vL, pL, query, seg.host, self.inv_freq,
                                                  offset))
        idx = scores[..., first:].topk(m, dim=-1).indices.sort(dim=-1).values + first  # [B, Hkv, m]
        gather = idx[..., None].expand(B, Hkv, m, D)
        return kL.gather(2, gather), vL.gather(2, gather), pL[idx]

    def _exchange_virtual(self, layer: int, host: int, sel, like: torch.Tensor, fp8: bool = False):
        """Study mode: keep this host's passing entries for later hosts, return those of earlier ones
        (same result and order as `_exchange` over `hosts` ranks, no collective; fp8: rounded through
        e4m3 as they would travel)."""
        B, Hkv, _, D = like.shape
        store = self._stash.setdefault(layer, {})
        if sel is not None:
            if fp8:
                sel = (unpack_fp8(pack_fp8(sel[0]), like.dtype), unpack_fp8(pack_fp8(sel[1]), like.dtype), sel[2])
            store[host] = sel
        row, w = (D + SCALE_BYTES, 8) if fp8 else (D, 8 // like.element_size())
        shape = (B, Hkv, max(self._passing_counts()), 2 * row + w)
        if host == 0:
            return None, shape
        if any(j not in store for j in range(host)):
            raise RuntimeError(f"APB study mode: host {host} ran before an earlier host at layer {layer}")
        got = [store[j] for j in range(host)]
        return tuple(torch.cat([g[i] for g in got], dim=2) for i in range(3)), shape

    def _exchange(self, sel, like: torch.Tensor, fp8: bool = False):
        """One all-gather of every rank's passing entries (k, v and positions packed into one tensor of
        the KV dtype, padded to the largest count), started asynchronously -> a function that waits
        for it and returns ((k, v, positions) of ranks < this one, or None; the shape this rank sent).
        The caller computes the block's own causal attention in between, which hides the gather.
        fp8: the tensor holds bytes, k and v as wire.pack_fp8 rows (e4m3 + scale), dequantized on arrival."""
        B, Hkv, _, D = like.shape
        counts = self._passing_counts()
        M = max(counts)
        if fp8:
            dt, row, w = torch.uint8, D + SCALE_BYTES, 8
        else:  # an int64 position, bit-cast to w elements of the KV dtype
            dt, row, w = like.dtype, D, 8 // like.element_size()
        buf = torch.zeros(B, Hkv, M, 2 * row + w, dtype=dt, device=like.device)
        if sel is not None:
            ks, vs, ps = sel
            m = ks.shape[2]
            buf[:, :, :m, :row] = pack_fp8(ks) if fp8 else ks
            buf[:, :, :m, row : 2 * row] = pack_fp8(vs) if fp8 else vs
            buf[:, :, :m, 2 * row :] = ps.to(torch.int64).contiguous()[..., None].view(dt)
        out = torch.empty(self.cp * B, Hkv, M, 2 * row + w, dtype=dt, device=like.device)
        work = all_gather_into(out, buf, self.group, async_op=True)
        self.wire.add(nbytes(buf) * (self.cp - 1))  # positions ride along: 8 bytes of 2*row + w per entry

        def finish():
            work.wait()
            if self.rank == 0:
                return None, tuple(buf.shape)
            got = out.view(self.cp, B, Hkv, M, 2 * row + w)
            got = torch.cat([got[j, :, :, : counts[j]] for j in range(self.rank)], dim=2)
            pos = got[..., 2 * row :].contiguous().view(torch.int64)[..., 0]
            k, v = got[..., :row], got[..., row : 2 * row]
            if fp8:
                k, v = unpack_fp8(k, like.dtype), unpack_fp8(v, like.dtype)
            return (k, v, pos), tuple(buf.shape)

        return finish

    def prefill_attend(self, segment: Segment):
        if self._sizes is None:
            raise RuntimeError("APB: call segments(prompt_len, context_len) before prefill_attend")
        seg = segment if isinstance(segment, APBSegment) else APBSegment(segment.index, segment.positions, segment.cache_rows)
        _, passing = self._sizes
        exchange = self.hosts > 1 and passing > 0
        last = seg.host == self.hosts - 1
        calls = [0]
        # The block's positions are the run bounds[host] .., the front rows' the anchor's 0 .. n_front - 1 (keys
        # the same), or host 0's score-only query rows head_len .. head_len + n_front - 1 (keys: the template head
        # before them, 0 .. head_len + n_front - 1, the block starting at 0): made once per segment and marked on
        # the host, so that no layer's attention call reads them back from the device (`common.mark_arange`).
        start, n_block = self._bounds[seg.host], seg.positions.shape[0] - seg.n_front
        runs: dict = {}

        def marked(device):
            if device not in runs:
                F_, h = seg.n_front, seg.head_len if seg.score_only else 0
                block = mark_arange(torch.arange(start, start + n_block, device=device), start)
                front = mark_arange(torch.arange(h, h + F_, device=device), h)
                keys = mark_arange(torch.arange(h + F_, device=device), 0) if seg.score_only else front
                runs[device] = (block, front, keys)
            return runs[device]

        def attend(q, k, v, pos, cache, sparse=None, window=None, softcap=None, scale=None):
            extras = dict(softcap=softcap, scale=scale)  # the layer's (engine/model.py AttendFn)
            i = calls[0]
            calls[0] += 1
            layer = self.layer_ids[i] if self.layer_ids is not None and i < len(self.layer_ids) else i
            F_ = seg.n_front
            seg_runs = marked(q.device)
            if window is not None:  # a local layer: exact, dense (sparse methods run global layers only)
                return self._local(seg, q, k, v, seg_runs, cache, window, extras)
            block_pos, front_pos, front_keys = seg_runs
            qL, kL, vL, pL = q[:, :, F_:], k[:, :, F_:], v[:, :, F_:], block_pos
            extra_k, extra_v = [], []
            if F_ and not seg.score_only:  # the anchor, seen in full by every block row
                extra_k.append(k[:, :, :F_])
                extra_v.append(v[:, :, :F_])
            if exchange:
                sel = None if last else self._select(layer, seg, q, k, v, pos)
                if self.cp > 1:
                    pending = self._exchange(sel, kL, fp8_wire(cache))
                else:
                    done = self._exchange_virtual(layer, seg.host, sel, kL, fp8_wire(cache))
                    pending = lambda: done  # noqa: E731
            # Dense: the block's own causal part runs while the passing blocks are gathered, the anchor
            # and passing keys after, merged by lse. Sparse (--sparse): one call over all of them, so the
            # method also thins the anchor and passing keys (the quadratic part is block x all keys).
            pattern = pattern_for(sparse, qL)
            together = pattern is not None and (bool(extra_k) or exchange)
            if not together:
                out, lse = attention(qL, kL, vL, q_pos=pL, k_pos=pL, causal=True, sparse=pattern, **extras)
            if exchange:
                got, sent = pending()
                if got is not None:
                    extra_k.append(got[0])
                    extra_v.append(got[1])
                if self.trace is not None:
                    self.trace.append({"layer": layer, "host": seg.host, "sent": sent,
                                       "selected": None if sel is None else sel[2].cpu(),
                                       "received": None if got is None else got[2].cpu()})
            if together:
                out, lse = sparse_after(qL, kL, vL, pL, extra_k, extra_v, pattern, **extras)
            elif extra_k:
                ek, ev = torch.cat(extra_k, dim=2), torch.cat(extra_v, dim=2)
                o2, l2 = attention(qL, ek, ev, q_pos=pL, k_pos=pL.new_zeros(ek.shape[2]), causal=False, **extras)
                out, lse = merge_partials(out, lse, o2, l2)
            if F_:
                qF, kF, vF = q[:, :, :F_], k[:, :, :F_], v[:, :, :F_]
                if seg.score_only:  # the query rows see the template head and themselves
                    h = seg.head_len
                    kF, vF = torch.cat([kL[:, :, :h], kF], dim=2), torch.cat([vL[:, :, :h], vF], dim=2)
                front, _ = attention(qF, kF, vF, q_pos=front_pos, k_pos=front_keys, causal=True, **extras)
                out = torch.cat([front, out], dim=2)
            cache_append(cache, kL, vL, pL, None)
            return out

        return attend
