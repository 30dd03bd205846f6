"""AnchorAttention sparse prefill: anchor scores, difference-aware stripe selection, sparse flash by index.

    cfg = AnchorConfig(theta=12.0)
    out, lse = anchor_attention(q, k, v, q_pos=..., k_pos=..., config=cfg)   # entry point
    out, lse = cfg.attention(q, k, v, q_pos=..., k_pos=...)                   # the `sparse=` hook form

Same contract as `attention` (docs/design.md): q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (GQA, K/V never
repeated), causal by global position, out in q.dtype, lse float32 (natural log), rows that see no key
get out = 0 and lse = -inf. Position layouts as MInference (`common.query_offset`): query row i
sits at key index i + off and sees key j iff j <= i + off.

The method (AnchorAttention paper, Algorithms 1-3), in key-index space. Query rows are cut into
blocks of `block_q` rows (block m starts at key index b_m = m * block_q + off); `step` consecutive
blocks form a group g, whose first row sits at key index gb_g. For group g:
- window start ws_g = max(0, gb_g - local_window). The *anchor region* of row i is the keys
  j <= i + off with j < init_tokens (initial tokens) or j >= ws_g (local window, up to the diagonal).
- stage 1, anchor: x_a[i] = max over the anchor region of q_i . k_j * scale (no score matrix kept).
- stage 2, stripe identification: the block means qbar_m (of q rows) and xbar_m (of x_a) of every block
  m in g; candidates are the keys init_tokens <= j < ws_g (each visible to every row of the group);
  key j is selected iff xbar_m - qbar_m . k_j * scale <= theta_h for some block m of the group (the
  paper's `step` union). By linearity xbar_m - qbar_m . k_j * scale is the block's mean of
  x_a[i] - s_ij: how far, in natural-log units of the softmax weight, key j's score stays below the
  row's anchor on average. theta is one number for every head, or one per head (`AnchorConfig.theta`
  a tuple; per-head thresholds calibrated offline by `starshard.tools.anchor_calibrate` and kept per
  layer in an `AnchorModelConfig` file). No sorting: selected keys are written, ascending, into a compact per-group
  list (idx [B, Hq, G, KI] int32, count [B, Hq, G]).
- stage 3, sparse compute: per query block, a flash loop over its anchor region (contiguous spans)
  and then over the group's selected keys, loaded by index `block_k` at a time (stripes: one key
  row at a time in the key dimension, any gaps).
theta = +inf keeps every candidate, i.e. exact causal attention.

Backends: Triton kernels (anchor max, identification with in-kernel compaction or, for the per-call
floor's sample, counts only, sparse flash) on CUDA or under TRITON_INTERPRET=1; otherwise torch code
computing the very same quantities (float32 math, float64 for float64 inputs). Non-causal calls and
query blocks of fewer than MIN_SPARSE_ROWS rows run exact dense attention.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch

from starshard.kernels.attention import attention, causal_attention_at, head_subset
from starshard.kernels.common import (MIN_SPARSE_ROWS, cdiv, check_shapes, for_head_dim, query_offset, to_device,
                                      triton_interpreted)
from starshard.kernels.online_softmax import LOG2E, key_chunk, key_span, softmax_finish, softmax_init

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux CPU installs: torch path only
    triton = None

_SCORE_BUDGET = 1 << 24  # elements of a float32 score tile on the torch paths


def _pow2(x: int) -> bool:
    return x >= 16 and not x & (x - 1)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


@dataclass(frozen=True)
class AnchorConfig:
    """AnchorAttention parameters. theta: score-difference threshold (natural-log units of the scaled
    score; the paper uses 12), one float for every head or a tuple with one per query head of the call
    (what `AnchorModelConfig.pattern` builds from a calibrated file); block_q: query rows per pooled block and per kernel program; block_k:
    keys per load in the kernels; init_tokens: initial keys always attended (and part of the anchor);
    local_window: keys before a group's first row that belong to its window (besides the group itself);
    step: query blocks sharing one stripe selection (the paper's `step`). Defaults are the paper's
    (theta 12, 128-row blocks, step 16, for 8B models at 32K-128K); a small model at a few thousand
    tokens needs finer pooling (SmolLM2-135M passkey at 2K: found with block_q=16, step=1, lost with
    block_q=64, step=4 at the same theta)."""

    theta: float = 12.0
    block_q: int = 128
    block_k: int = 64
    init_tokens: int = 128
    local_window: int = 0
    step: int = 16

    def __post_init__(self):
        if isinstance(self.theta, (list, tuple)):
            if not self.theta or not all(_number(t) for t in self.theta):
                raise ValueError(f"AnchorConfig.theta per head must be a non-empty list of numbers (inf: that head "
                                 f"keeps every key), got {self.theta!r}")
            object.__setattr__(self, "theta", tuple(float(t) for t in self.theta))
        elif not _number(self.theta):
            raise ValueError(f"AnchorConfig.theta must be a number (or inf for dense), got {self.theta!r}")
        if not _pow2(self.block_q) or not _pow2(self.block_k):
            raise ValueError(f"AnchorConfig block_q and block_k must be powers of two >= 16, got {self.block_q}, {self.block_k}")
        if self.init_tokens < 0 or self.local_window < 0:
            raise ValueError(f"AnchorConfig init_tokens and local_window must be >= 0, got {self.init_tokens}, {self.local_window}")
        if self.step < 1:
            raise ValueError(f"AnchorConfig.step must be >= 1, got {self.step}")

    def head_thetas(self, num_heads: int, device=None) -> torch.Tensor:
        """theta per query head of a call over `num_heads` heads: [num_heads] float32."""
        if isinstance(self.theta, tuple):
            if len(self.theta) != num_heads:
                raise ValueError(f"AnchorConfig has {len(self.theta)} per-head thetas but the call has {num_heads} "
                                 "query heads; build the config with AnchorModelConfig.pattern(layer, num_heads, offset)")
            # from the host without waiting: torch.tensor(..., device=cuda) is a blocking copy, a GPU drain a layer
            return to_device(list(self.theta), device or "cpu", torch.float32)
        return torch.full((num_heads,), float(self.theta), dtype=torch.float32, device=device)

    def to_dict(self) -> dict:
        d = asdict(self)
        if isinstance(self.theta, tuple):
            d["theta"] = list(self.theta)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "AnchorConfig":
        known = {f.name for f in fields(cls)}
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown AnchorConfig keys {sorted(extra)}; known: {sorted(known)}")
        def value(k, v):
            if k != "theta":
                return int(v)
            return tuple(float(t) for t in v) if isinstance(v, (list, tuple)) else float(v)

        return cls(**{k: value(k, v) for k, v in d.items()})

    def attention(self, q, k, v, *, q_pos, k_pos, causal=True, scale=None, rates=None, report=None):
        """The hook `attention(..., sparse=config)` calls (rates / report: see `anchor_attention`)."""
        return anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=self, scale=scale, causal=causal,
                                rates=rates, report=report)


@dataclass(frozen=True)
class AnchorRates:
    """The dense-or-sparse choice after identification: the stripe kernel's speed per (row, key) pair it
    computes, as a fraction of the dense kernel's (cuDNN SDPA) per causal pair. A head runs sparse iff
    its density (`head_density`) is below it; identification is spent by then.

    call_density: the per-call floor. When the call's selected key fraction (its heads' mean density)
    reaches it, the whole call runs the dense kernel (exact) and is counted as fallen back; None: the
    break-even density `kernel` itself (a call at it costs the stripe kernel as much as dense costs).
    sample_groups: > 0 first counts the stripes of only the call's last `sample_groups` groups of query
    blocks (their rows see the most keys; `sampled_density`) and, when their mean density reaches the
    floor, runs dense without the full identification (its cost is what a fallen-back call otherwise
    pays on top of dense); 0: the floor is checked on the full identification only."""

    kernel: float
    call_density: float | None = None
    sample_groups: int = 0

    def sparse_wins(self, density: float) -> bool:
        return density < self.kernel

    def call_falls_back(self, mean_density: float) -> bool:
        return mean_density >= (self.kernel if self.call_density is None else self.call_density)


# Measured per head dim (the launch depends on it): one H100 (the H200's sm_90 kernels), bf16, the
# paper's pooling (128-row blocks, step 16), structured inputs, the default launches of 2026-11-26
# (`launch/bench.py anchor`; docs/results.md, Sparse prefill). density *
# dense_cudnn_ms / kernel_ms over theta 4 / 8 / 12 at 32K and 128K: head dim 128 (32 / 8 heads)
# 0.411-0.632, head dim 64 (9 / 3) 0.399-0.560, lowest at theta 4 and 32K; the smallest is taken, so a
# head goes sparse only where it wins at every measured point.
# The same numbers are the per-call break-even density (`AnchorRates.call_density` None): a call
# keeping that share of the causal pairs costs the stripe kernel what the dense kernel costs.
# The floor is checked on FLOOR_SAMPLE_GROUPS groups first because identification alone is what a
# fallen-back call costs on top of dense: SmolLM2 (9 / 3 x d64) at 128K keys 3.80 ms per layer on one
# H100 (docs/results.md at 2f17e11, run 2026-11-26-gpu-anchor-grouped), x 30 layers = 0.11 s on dense's 1.41 s:
# the 1.51 s (0.92x) measured with every head sent dense. 4 of the 64 groups at 128K (the longest:
# their rows see the most keys) are 1/16 of the identification's work, 1/8 at the 64K+ minimum length.
# The sample is counted, not listed (`count_stripes`): identified with the stripe kernel's one program
# per (group, head), each scanning its group's keys serially, 1-4 groups were a few dozen programs on
# 132 SMs, latency-bound, their cost not shrinking with fewer groups (SmolLM2 at 128K on one H200,
# 2026-11-28: the stripe kernel 82 ms over the 30 calls; 1.443 / 1.444 / 1.447 s with 1 / 2 / 4 groups
# against dense's 1.361 s, 0.94x). Split over key chunks (~1000 programs), without the list's
# compaction and stores, it costs in proportion to its work: the anchors of its rows plus 1/16 (1/8)
# of the stripe scores. Measured the same way: 1.415 s against dense's 1.385 / 1.390 s (0.98x).
FLOOR_SAMPLE_GROUPS = 4
MEASURED_ANCHOR_RATES = {64: AnchorRates(kernel=0.399, sample_groups=FLOOR_SAMPLE_GROUPS),
                         128: AnchorRates(kernel=0.411, sample_groups=FLOOR_SAMPLE_GROUPS)}
# Head dims above 128 (unmeasured launch): the 8-warp head-dim-128 kernel's rate on one H200
# (docs/results.md, Sparse prefill), the slowest measured.
WIDE_HEAD_ANCHOR_RATES = AnchorRates(kernel=0.319, sample_groups=FLOOR_SAMPLE_GROUPS)


def measured_anchor_rates(head_dim: int) -> AnchorRates:
    return for_head_dim(MEASURED_ANCHOR_RATES, head_dim, WIDE_HEAD_ANCHOR_RATES)


@dataclass
class StripeIndex:
    """Selected keys per group of `step` query blocks: idx [B, Hq, G, KI] int32, ascending in the first
    count[b, h, g] entries (the rest is unspecified); count [B, Hq, G] int32."""

    idx: torch.Tensor
    count: torch.Tensor


# --------------------------------------------------------------------------------------------------
# Geometry shared by every path
# --------------------------------------------------------------------------------------------------


def window_starts(cfg: AnchorConfig, *, Lq: int, offset: int, device=None) -> torch.Tensor:
    """ws_g per group g: [G] int64."""
    G = cdiv(cdiv(Lq, cfg.block_q), cfg.step)
    gb = torch.arange(G, device=device) * (cfg.step * cfg.block_q) + offset
    return (gb - cfg.local_window).clamp(min=0)


def index_capacity(cfg: AnchorConfig, *, Lq: int, Lk: int, offset: int) -> int:
    """Most candidates any group has (host arithmetic, no sync): the last group's."""
    G = cdiv(cdiv(Lq, cfg.block_q), cfg.step)
    ws = max(0, (G - 1) * cfg.step * cfg.block_q + offset - cfg.local_window)
    return max(0, min(ws, Lk) - cfg.init_tokens)


def anchor_region(cfg: AnchorConfig, *, Lq: int, Lk: int, offset: int, rows: torch.Tensor) -> torch.Tensor:
    """[rows, Lk] bool: the anchor region (initial tokens + local window, causal) of query rows `rows`."""
    ws = window_starts(cfg, Lq=Lq, offset=offset, device=rows.device)[rows // (cfg.block_q * cfg.step)]
    j = torch.arange(Lk, device=rows.device)[None, :]
    qi = (rows + offset)[:, None]
    return (j <= qi) & ((j < cfg.init_tokens) | (j >= ws[:, None]))


def selected_mask(index: StripeIndex, Lk: int) -> torch.Tensor:
    """[B, Hq, G, Lk] bool from the compact lists."""
    B, H, G, KI = index.idx.shape
    mask = torch.zeros(B, H, G, Lk + 1, dtype=torch.bool, device=index.idx.device)
    if KI:
        valid = torch.arange(KI, device=index.idx.device) < index.count[..., None]
        cols = torch.where(valid, index.idx.long(), Lk)  # invalid entries land in a spare column
        mask.scatter_(3, cols, True)
    return mask[..., :Lk]


def _accum(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def pool_blocks(q: torch.Tensor, xa: torch.Tensor, block_q: int):
    """Block means of query rows [B, Hq, nM, D] and of anchors [B, Hq, nM] (float32, float64 for float64);
    the last block averages only its real rows."""
    Lq = q.shape[2]
    nM, whole = cdiv(Lq, block_q), Lq // block_q
    acc = _accum(q)

    def block_means(x):  # the reduction accumulates in `acc`: no float32 (or padded) copy of q is made
        means = [x[:, :, : whole * block_q].unflatten(2, (whole, block_q)).sum(3, dtype=acc) / block_q]
        if whole < nM:  # the last, partial block; its count is a host number (a count tensor's write waited)
            means.append(x[:, :, whole * block_q :].sum(2, keepdim=True, dtype=acc) / (Lq - whole * block_q))
        return torch.cat(means, 2) if len(means) > 1 else means[0]

    return block_means(q), block_means(xa)


# --------------------------------------------------------------------------------------------------
# Torch paths (also the CPU fallback)
# --------------------------------------------------------------------------------------------------


def _anchor_max_torch(q, k, cfg, *, offset, scale):
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    acc = _accum(q)
    kf = k.to(acc)
    xa = torch.empty(B, Hq, Lq, dtype=acc, device=q.device)
    rows = max(1, _SCORE_BUDGET // max(1, B * Hq * Lk))
    for r0 in range(0, Lq, rows):
        r1 = min(Lq, r0 + rows)
        reg = anchor_region(cfg, Lq=Lq, Lk=Lk, offset=offset, rows=torch.arange(r0, r1, device=q.device))
        s = torch.einsum("bhgqd,bhkd->bhgqk", q[:, :, r0:r1].to(acc).view(B, Hkv, g, r1 - r0, D), kf)
        s = s.reshape(B, Hq, r1 - r0, Lk) * scale
        xa[:, :, r0:r1] = s.masked_fill(~reg, float("-inf")).amax(-1) if Lk else float("-inf")
    return xa.float() if acc == torch.float32 else xa


def _identify_torch(q, k, xa, cfg, *, offset, scale):
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qbar, xbar = pool_blocks(q, xa, cfg.block_q)  # [B, Hq, nM, D], [B, Hq, nM]
    nM = qbar.shape[2]
    G = cdiv(nM, cfg.step)
    KI = index_capacity(cfg, Lq=Lq, Lk=Lk, offset=offset)
    ws = window_starts(cfg, Lq=Lq, offset=offset).tolist()
    idx = torch.zeros(B, Hq, G, KI, dtype=torch.int32, device=q.device)
    count = torch.zeros(B, Hq, G, dtype=torch.int32, device=q.device)
    kf = k.to(qbar.dtype)
    theta = cfg.head_thetas(Hq, q.device).to(qbar.dtype)[None, :, None, None]
    for gi in range(G):
        lo, hi = cfg.init_tokens, min(ws[gi], Lk)
        if hi <= lo:
            continue
        m0, m1 = gi * cfg.step, min(nM, (gi + 1) * cfg.step)
        qb = qbar[:, :, m0:m1].reshape(B, Hkv, g, m1 - m0, D)
        s = torch.einsum("bhgmd,bhkd->bhgmk", qb, kf[:, :, lo:hi]).reshape(B, Hq, m1 - m0, hi - lo) * scale
        hit = ((xbar[:, :, m0:m1, None] - s) <= theta).any(2)  # [B, Hq, n]
        pos = hit.long().cumsum(-1) - 1  # compaction without sorting
        cols = torch.arange(lo, hi, device=q.device, dtype=torch.int32).expand_as(hit)
        dest = torch.where(hit, pos, KI)  # misses land in a spare slot
        row = torch.zeros(B, Hq, KI + 1, dtype=torch.int32, device=q.device)
        row.scatter_(2, dest, cols)
        idx[:, :, gi] = row[..., :KI]
        count[:, :, gi] = hit.sum(-1).to(torch.int32)
    return StripeIndex(idx, count)


def _sparse_torch(q, k, v, index, cfg, *, offset, scale):
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    acc = _accum(q)
    kf, vf = k.to(acc), v.to(acc)
    sel = selected_mask(index, Lk)  # [B, Hq, G, Lk]
    out = torch.empty(B, Hq, Lq, D, dtype=acc, device=q.device)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    rows = max(1, _SCORE_BUDGET // max(1, B * Hq * Lk))
    for r0 in range(0, Lq, rows):
        r1 = min(Lq, r0 + rows)
        r = torch.arange(r0, r1, device=q.device)
        vis = anchor_region(cfg, Lq=Lq, Lk=Lk, offset=offset, rows=r) | sel[:, :, r // (cfg.block_q * cfg.step)]
        s = torch.einsum("bhgqd,bhkd->bhgqk", q[:, :, r0:r1].to(acc).view(B, Hkv, g, r1 - r0, D), kf)
        s = s.reshape(B, Hq, r1 - r0, Lk).mul(scale).masked_fill(~vis, float("-inf"))
        m = torch.logsumexp(s, -1)
        p = torch.exp(s - m.nan_to_num(neginf=0.0)[..., None])
        o = torch.einsum("bhgqk,bhkd->bhgqd", p.view(B, Hkv, g, r1 - r0, Lk), vf).reshape(B, Hq, r1 - r0, D)
        out[:, :, r0:r1] = o
        lse[:, :, r0:r1] = m.float()
    return out.to(q.dtype), lse


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _max_span(q, x_i, kt_base, s_kn, offs_n, d_ok, q_idx, lo, hi, qk_scale,
                  BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Row max of q . k * qk_scale over keys lo..hi-1 (causal by q_idx), folded into x_i."""
        for start in range(lo, hi, BLOCK_N):
            cols = start + offs_n
            ok = cols < hi
            kt = tl.load(kt_base + cols[None, :] * s_kn, mask=ok[None, :] & d_ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, kt, input_precision="ieee") * qk_scale
            else:
                s = tl.dot(q, kt) * qk_scale
            s = tl.where(ok[None, :] & (cols[None, :] <= q_idx[:, None]), s, float("-inf"))
            x_i = tl.maximum(x_i, tl.max(s, 1))
        return x_i

    @triton.jit
    def _anchor_max_fwd(
        Q, K, XA, qk_scale,
        s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd,
        Hq, G, Lq, Lk, off, init_tokens, local_window, rows_per_group,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid = tl.program_id(1)
        b = pid // Hq
        h = pid % Hq
        kvh = h // G
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < Lq
        d_ok = offs_d < HEAD_DIM
        q_idx = offs_m + off
        last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, Lq) - 1 + off
        ws = tl.maximum((pid_m * BLOCK_M // rows_per_group) * rows_per_group + off - local_window, 0)
        q = tl.load(Q + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        kt_base = K + b.to(tl.int64) * s_kb + kvh.to(tl.int64) * s_kh + offs_d[:, None] * s_kd
        hi = tl.minimum(last + 1, Lk)
        x_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        # initial tokens, then the window; one span when they touch
        sep = ws > init_tokens
        i_hi = tl.where(sep, tl.minimum(init_tokens, hi), 0)
        w_lo = tl.where(sep, ws, 0)
        x_i = _max_span(q, x_i, kt_base, s_kn, offs_n, d_ok, q_idx, 0, i_hi, qk_scale, BLOCK_N, IEEE)
        x_i = _max_span(q, x_i, kt_base, s_kn, offs_n, d_ok, q_idx, w_lo, hi, qk_scale, BLOCK_N, IEEE)
        tl.store(XA + pid.to(tl.int64) * Lq + offs_m, x_i, mask=row_ok)

    @triton.jit
    def _identify_fwd(
        QP, XP, K, IDX, CNT, TH, qk_scale,
        s_kb, s_kh, s_kn, s_kd,
        Hq, G, nM, n_groups, KI, step, init_tokens, Lk, off, local_window, rows_per_group, chunk_keys,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, STEP_P: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr, COUNT_ONLY: tl.constexpr,
    ):
        # One program per (group, batch x head): pooled queries of the group's blocks against every
        # candidate key; a key is kept if any block's pooled anchor minus its score is <= theta.
        # COUNT_ONLY: one program per (group, batch x head, chunk of chunk_keys candidates), which only
        # counts its chunk's hits into CNT [batch x head, group, chunk] (no list). Chunks start at
        # init_tokens + a multiple of BLOCK_N, so every key tile, score and hit is the full kernel's.
        gi = tl.program_id(0)
        pid = tl.program_id(1)
        b = pid // Hq
        h = pid % Hq
        kvh = h // G
        offs_s = gi * step + tl.arange(0, STEP_P)
        s_ok = (tl.arange(0, STEP_P) < step) & (offs_s < nM)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        d_ok = offs_d < HEAD_DIM
        qp = tl.load(QP + (pid.to(tl.int64) * nM + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                     mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        xp = tl.load(XP + pid.to(tl.int64) * nM + offs_s, mask=s_ok, other=0.0)
        theta = tl.load(TH + h)  # this head's threshold
        # score >= xbar - theta  <=>  xbar - score <= theta; padded blocks never hit
        thr = tl.where(s_ok, xp - theta, float("inf"))
        kt_base = K + b.to(tl.int64) * s_kb + kvh.to(tl.int64) * s_kh + offs_d[:, None] * s_kd
        ws = tl.maximum(gi * rows_per_group + off - local_window, 0)
        hi = tl.minimum(ws, Lk)
        lo = init_tokens
        end = hi
        if COUNT_ONLY:  # this program's chunk of the candidates
            lo = init_tokens + tl.program_id(2) * chunk_keys
            end = tl.minimum(hi, lo + chunk_keys)
        out_ptr = IDX + (pid.to(tl.int64) * n_groups + gi) * KI
        cnt = gi - gi  # int32 zero
        for start in range(lo, end, BLOCK_N):
            cols = start + offs_n
            ok = cols < hi
            kt = tl.load(kt_base + cols[None, :] * s_kn, mask=ok[None, :] & d_ok[:, None], other=0.0).to(tl.float32)
            if IEEE:
                s = tl.dot(qp, kt, input_precision="ieee") * qk_scale
            else:
                s = tl.dot(qp, kt) * qk_scale
            hit = (tl.max(s - thr[:, None], 0) >= 0) & ok
            hit_i = hit.to(tl.int32)
            if not COUNT_ONLY:
                pos = cnt + tl.cumsum(hit_i, 0) - 1
                tl.store(out_ptr + pos, cols, mask=hit)
            cnt += tl.sum(hit_i, 0)
        if COUNT_ONLY:
            tl.store(CNT + (pid.to(tl.int64) * n_groups + gi) * tl.num_programs(2) + tl.program_id(2), cnt)
        else:
            tl.store(CNT + pid.to(tl.int64) * n_groups + gi, cnt)

    @triton.jit
    def _identify_gqa_fwd(
        QP, XP, K, IDX, CNT, TH, qk_scale,
        s_kb, s_kh, s_kn, s_kd,
        Hq, Hkv, G, nM, n_groups, KI, step, init_tokens, Lk, off, local_window, rows_per_group, chunk_keys,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, STEP_P: tl.constexpr, G_P: tl.constexpr,
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr, COUNT_ONLY: tl.constexpr,
    ):
        # `_identify_fwd` with one program per (group, batch x KV head): the G query heads of the KV
        # head stacked as G_P x STEP_P pooled rows, so each key tile is loaded once for all of them
        # (and the product has G times the rows); hits and lists stay per head. COUNT_ONLY: as there,
        # per (group, batch x KV head, chunk), each head's count of the chunk into CNT.
        R: tl.constexpr = G_P * STEP_P
        gi = tl.program_id(0)
        pid = tl.program_id(1)
        b = pid // Hkv
        kvh = pid % Hkv
        r = tl.arange(0, R)
        hh = r // STEP_P  # the row's head within the KV group
        offs_s = gi * step + r % STEP_P
        s_ok = (hh < G) & (r % STEP_P < step) & (offs_s < nM)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        d_ok = offs_d < HEAD_DIM
        row_bh = (b * Hq + kvh * G + hh).to(tl.int64)  # the pooled tensors' (batch x head) of each row
        qp = tl.load(QP + (row_bh * nM + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                     mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        xp = tl.load(XP + row_bh * nM + offs_s, mask=s_ok, other=0.0)
        theta = tl.load(TH + kvh * G + hh, mask=hh < G, other=0.0)
        thr = tl.where(s_ok, xp - theta, float("inf"))
        heads = tl.arange(0, G_P)
        h_ok = heads < G
        bh = (b * Hq + kvh * G + heads).to(tl.int64)
        kt_base = K + b.to(tl.int64) * s_kb + kvh.to(tl.int64) * s_kh + offs_d[:, None] * s_kd
        ws = tl.maximum(gi * rows_per_group + off - local_window, 0)
        hi = tl.minimum(ws, Lk)
        lo = init_tokens
        end = hi
        if COUNT_ONLY:
            lo = init_tokens + tl.program_id(2) * chunk_keys
            end = tl.minimum(hi, lo + chunk_keys)
        out_ptr = IDX + (bh * n_groups + gi) * KI  # [G_P]
        cnt = tl.zeros([G_P], dtype=tl.int32)
        for start in range(lo, end, BLOCK_N):
            cols = start + offs_n
            ok = cols < hi
            kt = tl.load(kt_base + cols[None, :] * s_kn, mask=ok[None, :] & d_ok[:, None], other=0.0).to(tl.float32)
            if IEEE:
                sc = tl.dot(qp, kt, input_precision="ieee") * qk_scale
            else:
                sc = tl.dot(qp, kt) * qk_scale
            gap = tl.reshape(sc - thr[:, None], (G_P, STEP_P, BLOCK_N))
            hit = (tl.max(gap, 1) >= 0) & ok[None, :] & h_ok[:, None]  # [G_P, BLOCK_N]
            hit_i = hit.to(tl.int32)
            if not COUNT_ONLY:
                pos = cnt[:, None] + tl.cumsum(hit_i, 1) - 1
                tl.store(out_ptr[:, None] + pos, tl.broadcast_to(cols[None, :], (G_P, BLOCK_N)), mask=hit)
            cnt += tl.sum(hit_i, 1)
        if COUNT_ONLY:
            tl.store(CNT + (bh * n_groups + gi) * tl.num_programs(2) + tl.program_id(2), cnt, mask=h_ok)
        else:
            tl.store(CNT + bh * n_groups + gi, cnt, mask=h_ok)

    @triton.jit
    def _anchor_sparse_fwd(
        Q, K, V, O, LSE, IDX, CNT, qk_scale,
        s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd, s_ob, s_oh, s_om, s_od,
        Hq, G, Lq, Lk, off, n_qblocks, n_groups, KI, init_tokens, local_window, rows_per_group,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        pid_m = n_qblocks - 1 - tl.program_id(0)  # heaviest query blocks first
        pid = tl.program_id(1)
        b = pid // Hq
        h = pid % Hq
        kvh = h // G
        EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < Lq
        d_ok = offs_d < HEAD_DIM
        q_idx = offs_m + off
        base = pid_m * BLOCK_M + off
        last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, Lq) - 1 + off
        gi = pid_m * BLOCK_M // rows_per_group
        ws = tl.maximum(gi * rows_per_group + off - local_window, 0)

        q = tl.load(Q + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        kt_base = K + b.to(tl.int64) * s_kb + kvh.to(tl.int64) * s_kh + offs_d[:, None] * s_kd
        v_base = V + b.to(tl.int64) * s_vb + kvh.to(tl.int64) * s_vh + offs_d[None, :] * s_vd
        m_i, l_i, acc = softmax_init(BLOCK_M, BLOCK_D)

        # anchor region: initial tokens (every row sees them when apart from the window), then the
        # window up to the diagonal; keys <= base need no causal mask
        hi = tl.minimum(last + 1, Lk)
        sep = ws > init_tokens
        zero = base - base
        i_hi = tl.where(sep, tl.minimum(init_tokens, Lk), zero)
        m_i, l_i, acc = key_span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx,
                                 zero, i_hi, zero, i_hi, zero, zero, qk_scale, BLOCK_N, False, EVEN_D, IEEE)
        w_lo = tl.where(sep, ws, zero)
        m_i, l_i, acc = key_span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx,
                                 w_lo, hi, w_lo, tl.minimum(hi, base + 1), zero, zero, qk_scale, BLOCK_N, False,
                                 EVEN_D, IEEE)
        # stripes: the group's selected keys (all before ws, so visible to every row), by index
        grp = pid.to(tl.int64) * n_groups + gi
        n_sel = tl.load(CNT + grp)
        idx_ptr = IDX + grp * KI
        n_full = (n_sel // BLOCK_N) * BLOCK_N
        for c in range(0, n_full, BLOCK_N):
            cols = tl.load(idx_ptr + c + offs_n)
            m_i, l_i, acc = key_chunk(q, m_i, l_i, acc, kt_base, v_base, cols, cols >= 0, s_kn, s_vn, d_ok, q_idx,
                                      0, 0, qk_scale, False, False, EVEN_D, IEEE)
        if n_full < n_sel:
            ok = (n_full + offs_n) < n_sel
            cols = tl.load(idx_ptr + n_full + offs_n, mask=ok, other=0)
            m_i, l_i, acc = key_chunk(q, m_i, l_i, acc, kt_base, v_base, cols, ok, s_kn, s_vn, d_ok, q_idx,
                                      0, 0, qk_scale, True, False, EVEN_D, IEEE)

        out, lse = softmax_finish(m_i, l_i, acc, False)
        o_ptrs = O + b.to(tl.int64) * s_ob + h.to(tl.int64) * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + pid.to(tl.int64) * Lq + offs_m, lse, mask=row_ok)


def triton_available(q: torch.Tensor) -> bool:
    """The Triton kernels run on CUDA tensors, or on CPU tensors when Triton is interpreted."""
    if triton is None or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if q.is_cuda:
        return True
    return q.device.type == "cpu" and triton_interpreted(_anchor_sparse_fwd)


def default_launch(head_dim: int, block_q: int) -> tuple[int, int]:
    """(num_warps, num_stages) of the sparse kernel, by measurement on an H100 at 128K, theta 12
    (docs/results.md, Sparse prefill): head_dim 128 runs 4 warps, 1.8-2.0x faster than
    8 (128-row blocks 4,2: 559 -> 305 ms; 64-row 4,3: 623 -> 315 ms); head_dim 64 keeps 8 warps for
    128-row blocks (4,2 took 80 ms against 66) and 4 for smaller ones; wider heads 8 warps, 1 stage."""
    if head_dim > 128:
        return 8, 1
    if head_dim > 64:
        return (4, 2) if block_q >= 128 else (4, 3)
    return (8, 2) if block_q >= 128 else (4, 2)


def _use_triton(q, backend) -> bool:
    if backend is None:  # Triton on CUDA; on CPU the torch path (the interpreter is for tests, which ask for it)
        return q.is_cuda and triton_available(q)
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    if backend == "triton" and not triton_available(q):
        raise RuntimeError("the Triton AnchorAttention kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU) "
                           "and float16/bfloat16/float32")
    return backend == "triton"


def _block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


# --------------------------------------------------------------------------------------------------
# The three stages and the entry point
# --------------------------------------------------------------------------------------------------


def anchor_scores(q, k, config: AnchorConfig, *, offset: int, scale=None, backend=None, launch=None) -> torch.Tensor:
    """Stage 1: x_a [B, Hq, Lq] float32 (float64 for float64 inputs): per row, the max scaled score over
    its anchor region (-inf if the region is empty). launch: (num_warps, num_stages) of the Triton
    kernel (default: 4 warps for blocks of <= 64 rows, else 8; 2 stages; benchmarks sweep it)."""
    check_shapes(q, k, k)
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    if not _use_triton(q, backend):
        return _anchor_max_torch(q, k, config, offset=offset, scale=scale)
    xa = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    BM = config.block_q
    warps, stages = launch or (4 if BM <= 64 else 8, 2)
    grid = (cdiv(Lq, BM), B * Hq)
    _anchor_max_fwd[grid](
        q, k, xa, float(scale), *q.stride(), *k.stride(),
        Hq, Hq // Hkv, Lq, Lk, offset, config.init_tokens, config.local_window, BM * config.step,
        HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_M=BM, BLOCK_N=config.block_k, IEEE=q.dtype == torch.float32,
        num_warps=warps, num_stages=stages,
    )
    return xa


def grouped_identify(head_dim: int, keys: int, kv_group: int) -> bool:
    """Whether identification takes the KV-grouped stripe kernel by default. Timed against the per-head
    one (docs/results.md, Sparse prefill; GQA 4 / 3, theta 12): faster at head dim 128 with
    128K keys (10.4 vs 12.9 ms on an H100, 10.3 vs 11.2 on an H200), slower at 32K keys (7% at d 128, 11%
    at d 64) and at d 64 with 128K keys (15%; 4% faster at 512K)."""
    return kv_group > 1 and head_dim >= 128 and keys >= 1 << 17


def identify_stripes(q, k, xa, config: AnchorConfig, *, offset: int, scale=None, backend=None,
                     launch=None, group_heads: bool | None = None) -> StripeIndex:
    """Stage 2: per group of `step` query blocks, the candidate keys (init_tokens <= j < ws_g) with
    xbar_m - qbar_m . k_j * scale <= theta for some block m of the group, as compact ascending lists.
    launch: (num_warps, num_stages) of the Triton kernel (default 4, 2). group_heads: the Triton kernel
    takes the query heads of one KV head together (each key tile loaded once for them, G times the rows
    per product; the same selection up to exact ties at theta, whose products round differently);
    None picks by `grouped_identify`."""
    check_shapes(q, k, k)
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    if not _use_triton(q, backend):
        return _identify_torch(q, k, xa, config, offset=offset, scale=scale)
    if group_heads is None:
        group_heads = grouped_identify(D, Lk, Hq // Hkv)
    G = cdiv(cdiv(Lq, config.block_q), config.step)
    KI = index_capacity(config, Lq=Lq, Lk=Lk, offset=offset)
    idx = torch.empty(B, Hq, G, max(KI, 1), dtype=torch.int32, device=q.device)
    count = torch.empty(B, Hq, G, dtype=torch.int32, device=q.device)
    _launch_identify(q, k, xa, config, offset=offset, scale=scale, launch=launch, group_heads=group_heads,
                     idx=idx, count=count)
    return StripeIndex(idx[..., :KI], count)


# The floor's sample is a few groups (1-4), i.e. a few dozen (group, head) programs against 132 SMs:
# count_stripes splits each group's candidate keys into chunks, one program each, aiming at about
# _COUNT_PROGRAMS programs in all (~8 per SM of an H100 / H200: enough resident to keep key loads in
# flight), each scanning at least _COUNT_MIN_KEYS keys (below that its fixed work, the pooled-query
# loads and its store, stops being small next to its scan). 128K keys, 9 heads: ~1.2K keys per
# program for 1 group, ~4.5K for 4.
_COUNT_PROGRAMS = 1024
_COUNT_MIN_KEYS = 1024


def count_chunk_keys(candidates: int, programs: int, block_k: int) -> int:
    """Keys per count-only program (a multiple of block_k) for `candidates` keys per group and
    `programs` (group, head) pairs: see _COUNT_PROGRAMS."""
    chunks = max(1, min(cdiv(candidates, _COUNT_MIN_KEYS), cdiv(_COUNT_PROGRAMS, programs)))
    return max(1, cdiv(cdiv(candidates, chunks), block_k)) * block_k


def count_stripes(q, k, xa, config: AnchorConfig, *, offset: int, scale=None, backend=None, launch=None,
                  group_heads: bool | None = None, chunk_keys: int | None = None) -> torch.Tensor:
    """Stage 2 counted only: `identify_stripes(...).count` ([B, Hq, G] int32), equal to it (the same
    kernel's hit test on the same key tiles, group_heads picked the same way), without writing the
    lists. The Triton kernel splits each group's candidate keys into chunks of `chunk_keys` (a
    multiple of block_k; None: `count_chunk_keys`), one program each, so that a call of a few groups
    (the floor's sample, `sampled_density`) still fills the GPU."""
    check_shapes(q, k, k)
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if chunk_keys is not None and (chunk_keys < 1 or chunk_keys % config.block_k):
        raise ValueError(f"count_stripes chunk_keys must be a positive multiple of block_k ({config.block_k}), "
                         f"got {chunk_keys}")
    scale = D**-0.5 if scale is None else scale
    if not _use_triton(q, backend):
        return _identify_torch(q, k, xa, config, offset=offset, scale=scale).count
    if group_heads is None:
        group_heads = grouped_identify(D, Lk, Hq // Hkv)
    G = cdiv(cdiv(Lq, config.block_q), config.step)
    cands = index_capacity(config, Lq=Lq, Lk=Lk, offset=offset)  # the last group's: the most
    if cands == 0:
        return torch.zeros(B, Hq, G, dtype=torch.int32, device=q.device)
    if chunk_keys is None:
        chunk_keys = count_chunk_keys(cands, G * B * (Hkv if group_heads else Hq), config.block_k)
    part = torch.empty(B, Hq, G, cdiv(cands, chunk_keys), dtype=torch.int32, device=q.device)  # per chunk
    _launch_identify(q, k, xa, config, offset=offset, scale=scale, launch=launch, group_heads=group_heads,
                     idx=part, count=part, chunk_keys=chunk_keys)
    return part.sum(-1, dtype=torch.int32)


def _launch_identify(q, k, xa, config, *, offset, scale, launch, group_heads, idx, count, chunk_keys=0):
    """The stripe kernel (per head, or per KV head with group_heads): lists into idx [B, Hq, G, KI] and
    count [B, Hq, G]; with chunk_keys > 0 count-only, count [B, Hq, G, chunks] per chunk (idx unused)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    qbar, xbar = pool_blocks(q, xa, config.block_q)
    nM = qbar.shape[2]
    G = count.shape[2]
    chunks = count.shape[3] if chunk_keys else 1
    warps, stages = launch or (4, 2)
    common = dict(HEAD_DIM=D, BLOCK_D=_block_d(D), STEP_P=max(16, triton.next_power_of_2(config.step)),
                  BLOCK_N=config.block_k, IEEE=q.dtype == torch.float32, COUNT_ONLY=chunk_keys > 0,
                  num_warps=warps, num_stages=stages)
    thetas = config.head_thetas(Hq, q.device)
    tail = (nM, G, idx.shape[-1], config.step, config.init_tokens, Lk, offset, config.local_window,
            config.block_q * config.step, chunk_keys)
    if group_heads:
        g = Hq // Hkv
        _identify_gqa_fwd[(G, B * Hkv, chunks)](qbar.contiguous(), xbar.contiguous(), k, idx, count, thetas,
                                                float(scale), *k.stride(), Hq, Hkv, g, *tail,
                                                G_P=triton.next_power_of_2(g), **common)
    else:
        _identify_fwd[(G, B * Hq, chunks)](qbar.contiguous(), xbar.contiguous(), k, idx, count, thetas,
                                           float(scale), *k.stride(), Hq, Hq // Hkv, *tail, **common)


def sparse_attention(q, k, v, index: StripeIndex, config: AnchorConfig, *, offset: int, scale=None, backend=None,
                     launch=None):
    """Stage 3: flash attention over each row's anchor region plus its group's selected keys -> (out, lse)."""
    check_shapes(q, k, v)
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    G = cdiv(cdiv(Lq, config.block_q), config.step)
    if index.count.shape != (B, Hq, G):
        raise ValueError(f"stripe index count has shape {tuple(index.count.shape)}, expected {(B, Hq, G)} for this call")
    if not _use_triton(q, backend):
        return _sparse_torch(q, k, v, index, config, offset=offset, scale=scale)
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    idx = index.idx if index.idx.shape[-1] else index.count.unsqueeze(-1)  # never read when empty
    idx = idx if idx.is_contiguous() and idx.stride(2) == idx.shape[3] else idx.contiguous()
    BM = config.block_q
    nM = cdiv(Lq, BM)
    warps, stages = launch or default_launch(_block_d(D), BM)
    _anchor_sparse_fwd[(nM, B * Hq)](
        q, k, v, out, lse, idx, index.count, scale * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        Hq, Hq // Hkv, Lq, Lk, offset, nM, G, idx.shape[-1], config.init_tokens, config.local_window,
        BM * config.step,
        HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_M=BM, BLOCK_N=config.block_k, IEEE=q.dtype == torch.float32,
        num_warps=warps, num_stages=stages,
    )
    return out, lse


def build_index(q, k, config: AnchorConfig, *, offset: int, scale=None, backend=None, anchor_launch=None,
                identify_launch=None, group_heads: bool | None = None) -> StripeIndex:
    """Stages 1 and 2 (what benchmarks time as identification); *_launch: each kernel's (num_warps,
    num_stages), see `anchor_scores` / `identify_stripes` (also for group_heads)."""
    xa = anchor_scores(q, k, config, offset=offset, scale=scale, backend=backend, launch=anchor_launch)
    return identify_stripes(q, k, xa, config, offset=offset, scale=scale, backend=backend, launch=identify_launch,
                            group_heads=group_heads)


def anchor_attention(q, k, v, *, q_pos, k_pos, config: AnchorConfig, scale=None, causal=True, backend=None,
                     launch=None, rates: AnchorRates | None = None, report=None):
    """AnchorAttention sparse prefill with lse. backend: None (Triton where it runs, else torch),
    "triton" or "torch". Non-causal calls and query blocks shorter than MIN_SPARSE_ROWS run dense.

    rates (e.g. measured_anchor_rates(head_dim)): after identification, a call whose heads keep on
    average at least `rates.call_density` of the causal pairs (default: the break-even density, the
    stripe kernel's rate) runs the dense kernel whole, and otherwise heads whose stripes keep so many
    keys that the stripe kernel would not beat the dense kernel run the dense dispatcher instead; either
    way those heads get exactly dense attention's (out, lse). `rates.sample_groups` checks the call
    floor on a sample first (`sampled_density`). report: anything with record(sparse_densities,
    dense_heads), and fall_back(heads) for a call sent dense whole (`SparseReport`)."""
    if isinstance(config, dict):
        config = AnchorConfig.from_dict(config)
    if not isinstance(config, AnchorConfig):
        raise TypeError(f"config must be an AnchorConfig (or its dict form), got {type(config).__name__}")
    check_shapes(q, k, v)
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    if not causal or Lq < MIN_SPARSE_ROWS:
        return attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale)
    if Lk == 0:
        return torch.zeros_like(q), torch.full((B, Hq, Lq), float("-inf"), device=q.device)
    try:
        offset = query_offset(q_pos, k_pos, Lq, Lk)
    except ValueError as e:  # same layouts as MInference; say which method refused
        raise ValueError(f"AnchorAttention: {e}") from None
    def dense_part(q, k, v):
        return causal_attention_at(q, k, v, q_pos=q_pos, k_pos=k_pos, offset=offset, scale=scale)

    if rates is not None and rates.sample_groups > 0:
        est = sampled_density(q, k, config, rates.sample_groups, offset=offset, scale=scale, backend=backend)
        if est is not None and rates.call_falls_back(est):
            return fall_back(report, Hq, dense_part(q, k, v))
    index = build_index(q, k, config, offset=offset, scale=scale, backend=backend)
    if rates is None:  # every head sparse: the report takes the densities on the device (read when it is read)
        if report is not None:
            report.record(head_density(index, config, Lq=Lq, Lk=Lk, offset=offset).mean(0), 0)
        return sparse_attention(q, k, v, index, config, offset=offset, scale=scale, backend=backend, launch=launch)
    dens = head_density(index, config, Lq=Lq, Lk=Lk, offset=offset).mean(0).tolist()  # the cost model's sync
    if rates.call_falls_back(sum(dens) / Hq):
        return fall_back(report, Hq, dense_part(q, k, v))
    sparse = [h for h in range(Hq) if rates.sparse_wins(dens[h])]
    dense = [h for h in range(Hq) if h not in set(sparse)]
    if report is not None:
        report.record([dens[h] for h in sparse], len(dense))

    if not sparse:
        return dense_part(q, k, v)
    if not dense:
        return sparse_attention(q, k, v, index, config, offset=offset, scale=scale, backend=backend, launch=launch)
    sp = to_device(sparse, q.device)
    sub = StripeIndex(index.idx.index_select(1, sp), index.count.index_select(1, sp))
    o_s, l_s = sparse_attention(*head_subset(q, k, v, sparse), sub, config, offset=offset, scale=scale,
                                backend=backend, launch=launch)
    o_d, l_d = dense_part(*head_subset(q, k, v, dense))
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    dn = to_device(dense, q.device)
    out.index_copy_(1, sp, o_s)
    out.index_copy_(1, dn, o_d)
    lse.index_copy_(1, sp, l_s)
    lse.index_copy_(1, dn, l_d)
    return out, lse


def fall_back(report, heads: int, result):
    """A call the floor sent to the dense kernel whole: count it (`SparseReport.fall_back`; a report
    without that counter records its heads as dense) and hand back the dense (out, lse)."""
    if report is not None:
        if hasattr(report, "fall_back"):
            report.fall_back(heads)
        else:
            report.record([], heads)
    return result


def sampled_density(q, k, config: AnchorConfig, groups: int, *, offset: int, scale=None, backend=None) -> float | None:
    """The mean head density of the call's last `groups` groups of query blocks, their stripes counted
    alone (`anchor_scores` of their rows, `count_stripes`, `count_density`): the geometry is by key
    index, so they select exactly the stripes the full identification gives them (their rows see the
    most keys: the bulk of the causal pairs). None when the call has no more groups than that (the
    sample would be the full identification)."""
    Lq, Lk = q.shape[2], k.shape[2]
    rpg = config.block_q * config.step
    G = cdiv(Lq, rpg)
    if G <= groups:
        return None
    start = (G - groups) * rpg
    qs, off = q[:, :, start:], offset + start
    xa = anchor_scores(qs, k, config, offset=off, scale=scale, backend=backend)
    count = count_stripes(qs, k, xa, config, offset=off, scale=scale, backend=backend)
    return float(count_density(count, config, Lq=Lq - start, Lk=Lk, offset=off).mean())  # the sync


def head_density(index: StripeIndex, config: AnchorConfig, *, Lq: int, Lk: int, offset: int) -> torch.Tensor:
    """Per (batch row, head), the share of the causal (row, key) pairs the sparse step computes (anchor
    region + the group's stripes): [B, Hq] float64, counted in closed form per row (no [rows, keys]
    mask). Its mean is `density`. It needs only the counts: `count_density`."""
    return count_density(index.count, config, Lq=Lq, Lk=Lk, offset=offset)


def count_density(count: torch.Tensor, config: AnchorConfig, *, Lq: int, Lk: int, offset: int) -> torch.Tensor:
    """`head_density` from the stripe counts [B, Hq, G] alone (`StripeIndex.count`, `count_stripes`)."""
    dev = count.device
    rows = torch.arange(Lq, device=dev)
    rpg = config.block_q * config.step
    hi = (rows + offset + 1).clamp(max=Lk)  # keys j < hi are causal for the row
    ws = window_starts(config, Lq=Lq, offset=offset, device=dev)[rows // rpg]
    init = config.init_tokens
    region = hi.clamp(max=init) + (hi - ws.clamp(min=init)).clamp(min=0)
    G = count.shape[2]
    per_group = torch.clamp(torch.arange(1, G + 1, device=dev) * rpg, max=Lq) - torch.arange(G, device=dev) * rpg
    stripes = (count.double() * per_group.double()).sum(-1)  # [B, Hq]
    return (region.double().sum() + stripes) / hi.double().sum()


def kernel_cost(index: StripeIndex, config: AnchorConfig, *, Lq: int, Lk: int, offset: int) -> torch.Tensor:
    """Score entries the Triton sparse kernel computes (masked ones included), per (batch row, head):
    [B, Hq] int64. Query block m (block_q rows) streams its initial tokens and its window as two key
    spans in block_k-wide chunks (one span when they touch), then its group's selected keys block_k at
    a time; each chunk is a block_q x block_k tile (times 4 * head_dim FLOPs: q.k and p.v). The
    counterpart of `minference.kernel_cost`, for FLOP rates on the blocks the kernel computes."""
    dev = index.count.device
    BM, BN = config.block_q, config.block_k
    nM = cdiv(Lq, BM)
    m = torch.arange(nM, device=dev)
    rpg = BM * config.step
    last = torch.clamp(m * BM + BM, max=Lq) - 1 + offset
    ws = window_starts(config, Lq=Lq, offset=offset, device=dev)[(m * BM) // rpg]
    hi = torch.clamp(last + 1, max=Lk)
    sep = ws > config.init_tokens
    i_hi = torch.where(sep, min(config.init_tokens, Lk), 0)
    w_lo = torch.where(sep, ws, 0)

    def chunks(n):
        return torch.div(n.clamp(min=0) + BN - 1, BN, rounding_mode="floor")

    region = (chunks(i_hi) + chunks(hi - w_lo)).sum()
    stripes = chunks(index.count.long())  # [B, Hq, G] chunks per query block of the group
    blocks_per_group = torch.clamp(torch.arange(1, stripes.shape[2] + 1, device=dev) * config.step, max=nM) - (
        torch.arange(stripes.shape[2], device=dev) * config.step)
    return (region + (stripes * blocks_per_group).sum(-1)) * BM * BN


def density(index: StripeIndex, config: AnchorConfig, *, Lq: int, Lk: int, offset: int) -> float:
    """Share of the causal (row, key) pairs the sparse step computes (anchor regions + stripes)."""
    rows = torch.arange(Lq, device=index.count.device)
    # The region mask row by row would be Lq x Lk: count it 2048 rows at a time.
    reg = torch.cat([anchor_region(config, Lq=Lq, Lk=Lk, offset=offset, rows=r).sum(-1) for r in rows.split(2048)]).double()
    stripes = index.count.double()[:, :, rows // (config.block_q * config.step)]  # [B, Hq, Lq]
    causal = (rows + offset + 1).clamp(max=Lk).double()
    return float(((reg + stripes).sum(-1) / causal.sum()).mean())


__all__ = [
    "AnchorConfig", "StripeIndex", "anchor_attention", "anchor_scores", "identify_stripes", "sparse_attention",
    "build_index", "anchor_region", "selected_mask", "window_starts", "index_capacity", "pool_blocks", "density",
    "head_density", "sampled_density", "kernel_cost", "AnchorRates", "MEASURED_ANCHOR_RATES", "FLOOR_SAMPLE_GROUPS", "measured_anchor_rates", "triton_available",
    "default_launch", "count_stripes", "count_chunk_keys", "count_density",
]
