"""The decoder, written once for one device: Llama / Mistral / Qwen2 / Qwen3 / Phi-3, Gemma 2 / Gemma 3
(text), and the mixture-of-experts Qwen3-MoE / Mixtral (engine/moe.py: the same attention, expert MLPs).

Attention kinds per layer (config.py ModelConfig.layer_window): a local layer attends a sliding window of
keys (positions (p - window, p]), a global one every earlier key; Gemma 3's local layers rotate with a RoPE
base of their own. A layer's window, logit soft-cap and scale (Gemma's query_pre_attn_scalar) reach its
AttendFn as keywords, passed only when the model has them, so hooks written for plain attention keep
working for plain models; the runtime refuses hooks that cannot take them (llm.py check_attention_kinds).

Parallelism is applied to this model from outside (runtime/build.py and the runners, using
parallel/: tensor-parallel linears swapped in, layers split into pipeline stages, a context
strategy's hook handed to each attention layer); nothing here knows about process groups. Layout kept Megatron-friendly: fused QKV (`wqkv`: q heads, then k
heads, then v heads) and fused gate/up (`w13`: gate rows, then up rows) so that a column-parallel
split of each is one contiguous slice per part.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from starshard.config import ModelConfig
from starshard.engine.kv_cache import KVCache, LayerKV
from starshard.engine.linear import Linear, project_add, project_heads
from starshard.engine.moe import MoEFeedForward
from starshard.kernels.activation import gelu_tanh_mul, silu_mul
from starshard.kernels.attention import (DECODE_MAX_ROWS, attention, attention_after_held,
                                         causal_attention_int8_scores)
from starshard.kernels.common import known_end, mark_arange
from starshard.kernels.norm import rms_norm, use_norm_kernel
from starshard.kernels.rope import apply_rope, rope_qk, use_rope_kernel
from starshard.kernels.sparse import pattern_for


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    @classmethod
    def of(cls, cfg: ModelConfig, dim: int) -> "RMSNorm":
        """The model's RMSNorm: Gemma's (1 + weight) form where the config says so."""
        return (OffsetRMSNorm if cfg.norm_unit_offset else cls)(dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_norm_kernel(x):  # decode: one short Triton launch (kernels/norm.py)
            return rms_norm(x, self.weight, self.eps)
        if x.is_cuda:  # fused kernel (float32 accumulation) instead of five elementwise passes
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the normalized row times (1 + weight), in float32, rounded once to the input's
    dtype (transformers' Gemma norms). The weight is kept as checkpoints store it (zero = identity), so
    every source (HF, GGUF through transformers, converted shards) loads it unchanged. A class of its
    own: code that fuses RMSNorm (parallel/fp8.py fuse_inputs, the RoPE kernel's q/k norm) checks the
    exact type and leaves this one alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping); x unchanged when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


def rope_inv_freq(cfg: ModelConfig, length: int | None = None) -> torch.Tensor:
    """Inverse frequencies [rope_dim / 2] of the model's RoPE scaling (transformers' formulas).

    `length` matters only for the length-dependent types (dynamic, longrope): it is the run's RoPE
    length (see `Transformer.set_rope_length`); None means the model's window
    (cfg.max_position_embeddings). Every other type ignores it.
    """
    d = cfg.rope_dim
    exps = torch.arange(0, d, 2, dtype=torch.float64) / d
    inv = 1.0 / (cfg.rope_theta ** exps)
    rs = cfg.rope_scaling
    n = cfg.max_position_embeddings if length is None else int(length)
    if rs.type == "linear":
        inv = inv / rs.factor
    elif rs.type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    elif rs.type == "yarn":
        # Dimensions that turn more than beta_fast times over the original window keep their
        # frequency (extrapolate), those under beta_slow turns are divided by `factor`
        # (interpolate), a linear ramp between. The attention factor scales cos / sin (Transformer.rope).
        def correction_dim(rotations: float) -> float:
            return d * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(cfg.rope_theta))

        low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
        if rs.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # as transformers: no zero-width ramp
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp
        inv = (inv / rs.factor) * (1 - extrapolate) + inv * extrapolate
    elif rs.type == "dynamic":
        # NTK-aware: the base grows so that `n` positions span what the original window did.
        m = rs.original_max_position_embeddings
        n = max(n, m)
        base = cfg.rope_theta * ((rs.factor * n / m) - (rs.factor - 1)) ** (d / (d - 2))
        inv = 1.0 / (base ** exps)
    elif rs.type == "longrope":
        ext = rs.long_factor if n > rs.original_max_position_embeddings else rs.short_factor
        inv = inv / torch.tensor(ext, dtype=torch.float64)
    return inv.float()


def local_rope_inv_freq(cfg: ModelConfig) -> torch.Tensor | None:
    """Inverse frequencies of the local layers' own RoPE (Gemma 3: plain, base cfg.local_rope_theta), or
    None where every layer rotates with `rope_inv_freq`."""
    if cfg.local_rope_theta is None:
        return None
    d = cfg.rope_dim
    return (1.0 / (cfg.local_rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))).float()


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by (yarn, longrope; 1 otherwise): it scales
    q and k, so attention logits by its square."""
    return float(cfg.rope_scaling.attention_factor)


class AttendFn(Protocol):
    """The attention a layer runs: dense_attend by default, a caller's hook inside
    Transformer.attention_hooks (a context strategy, a CUDA graph's decode step, a probe).

    q: [B, Hq, L, D] after RoPE; k, v: this step's new keys / values [B, Hkv, L, D]; pos: their global
    positions; cache: the layer's KV (None when the hook holds its own); sparse: the layer's
    LayerSparse (kernels/sparse.py) or None. The hook decides which keys each query sees and what
    enters the cache; it returns out [B, Hq, L, D].
    Keywords given only when the layer has them (kernels/attention.py's meaning): window (a local
    layer's sliding window), softcap (Gemma 2's attention logit cap), scale (softmax scale other than
    head_dim ** -0.5). A hook that cannot honour one must not be installed for such a model.
    """

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                 cache: LayerKV | None, sparse=None, **extras) -> torch.Tensor: ...


def dense_attend(q, k, v, pos, cache: LayerKV | None, sparse=None, *, window=None, softcap=None, scale=None):
    """Single-device causal attention over the cache (if any) plus this step's keys; `sparse`: the
    layer's LayerSparse (kernels/sparse.py), used for prefill-sized blocks; window / softcap / scale:
    the layer's (AttendFn). The window masks by position, so a local layer's cache may keep every key or
    only the last ones (a trimmed LayerKV, engine/kv_cache.py: rows in any order)."""
    extras = dict(window=window, softcap=softcap, scale=scale)
    scales = {}
    pattern = pattern_for(sparse, q)
    # A trimmed local layer's first block (engine/kv_cache.py) attends its keys as given below and keeps only
    # their tail, whatever its size: it never needs more rows than the window.
    first_trimmed = cache is not None and cache.trimmed and cache.length == 0
    # decode: attend the cache as stored (FP8 too)
    if cache is not None and q.shape[2] <= DECODE_MAX_ROWS and not first_trimmed:
        cache.store(k, v, pos)
        s = cache.stored()
        k, v, k_pos, scales = s.k, s.v, s.pos, dict(k_scale=s.k_scale, v_scale=s.v_scale)
    elif cache is not None and cache.length and pattern is None:
        # A prefill block after held entries (a chunked prefill): the prefix as stored (FP8: no whole-prefix
        # copy) in one call without a mask, since it all precedes the block, and the block's own keys as
        # given, causally; two fused kernels merged by lse. One position-masked kernel over every key was
        # 1.2x slower at a 128K prefix on an H100 (docs/results.md, Service).
        held = cache.append_stored(k, v, pos)
        out, _ = attention_after_held(q, k, v, pos, held.k, held.v, held.pos, k_scale=held.k_scale,
                                      v_scale=held.v_scale, **extras)
        return out
    elif cache is not None:
        held = cache.length
        k, v, k_pos = cache.append(k, v, pos)
        if held == 0:  # the cache holds just this block: its positions are pos (layout maybe known on the host)
            k_pos = pos
    else:
        k_pos = pos
    # One new token follows everything cached: no mask (saves the mask check in every decode step), unless
    # a window hides the oldest keys.
    causal = q.shape[2] > 1 or window is not None
    out, _ = attention(q, k, v, q_pos=pos, k_pos=k_pos, causal=causal, sparse=pattern, **scales, **extras)
    return out


def dense_attend_int8_scores(q, k, v, pos, cache: LayerKV | None, sparse=None, **extras):
    """dense_attend, except that a prefill block starting an empty cache (the whole prompt unless
    prefill is chunked) attends itself with 8-bit scores (`--fp8 attention`,
    kernels/attention.py causal_attention_int8_scores, which keeps 16-bit scores where the layer's sparse
    pattern applies); decode steps and later chunks are dense_attend's. The 8-bit kernel takes no window,
    soft-cap or scale: a layer with one is refused."""
    if extras:
        raise ValueError(f"--fp8 attention (8-bit prefill scores) does not run {', '.join(sorted(extras))}; "
                         "drop `attention` from --fp8 for this model")
    if q.shape[2] > DECODE_MAX_ROWS and (cache is None or cache.length == 0):
        if cache is not None:
            cache.store(k, v, pos)
        out, _ = causal_attention_int8_scores(q, k, v, q_pos=pos, k_pos=pos, sparse=pattern_for(sparse, q))
        return out
    return dense_attend(q, k, v, pos, cache, sparse)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.head_dim = cfg.head_dim
        # Local head counts: tensor parallelism divides them (parallel/tensor.py).
        self.n_heads = cfg.num_heads
        self.n_kv_heads = cfg.num_kv_heads
        self.wqkv = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.wo = Linear(cfg.q_size, cfg.hidden_size, bias=False)
        # Qwen3, Gemma 3: RMSNorm over each head's q and k (weights of head_dim, the same on every TP rank).
        self.q_norm = RMSNorm.of(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = RMSNorm.of(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.sparse = None  # LayerSparse when a sparse prefill method is on (kernels/sparse.py)
        self.window = cfg.layer_window(layer_id)  # None: a global layer
        # Gemma 3: a local layer takes the local RoPE (Transformer.forward hands it the local cos / sin).
        self.local_rope = self.window is not None and cfg.local_rope_theta is not None
        scale = None
        if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != cfg.head_dim:
            scale = cfg.query_pre_attn_scalar ** -0.5
        # What the AttendFn gets beyond plain attention (only those set: plain models call hooks as before).
        extras = dict(window=self.window, softcap=cfg.attn_logit_softcapping, scale=scale)
        self.extras = {k: v for k, v in extras.items() if v is not None}
        # [Hkv, 1, D] subtracted from every key after RoPE (None: nothing), --fp8 kv only (key_offset says why)
        self.k_offset: torch.Tensor | None = None

    def forward(self, x, cos, sin, pos, cache: LayerKV | None, attend: AttendFn = dense_attend,
                residual: torch.Tensor | None = None):
        """The attention output, computed by `attend`, projected by wo (+ residual, the block's input, when given)."""
        B, L, _ = x.shape
        d = self.head_dim
        qkv = self.wqkv(x)
        q, k, v = qkv.split([self.n_heads * d, self.n_kv_heads * d, self.n_kv_heads * d], dim=-1)
        q = q.view(B, L, self.n_heads, d)
        k = k.view(B, L, self.n_kv_heads, d)
        v = v.view(B, L, self.n_kv_heads, d).transpose(1, 2)
        plain_norm = self.q_norm is None or type(self.q_norm) is RMSNorm
        if use_rope_kernel(q) and plain_norm:  # GPU: (q / k norm +) RoPE on both in one Triton launch (kernels/rope.py)
            qn, kn = self.q_norm, self.k_norm  # Qwen3's norms share cfg.rms_norm_eps
            q, k = rope_qk(q.transpose(1, 2), k.transpose(1, 2), cos, sin,
                           None if qn is None else qn.weight, None if kn is None else kn.weight,
                           eps=0.0 if qn is None else qn.eps)
        else:
            if self.q_norm is not None:  # before RoPE, per head
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.k_offset is not None:
            k = k - self.k_offset
        out = attend(q, k, v, pos, cache, sparse=self.sparse, **self.extras)
        return project_heads(self.wo, out, residual)


def key_offset(attn: Attention, inv_freq: torch.Tensor, rope_scale: float, positions: int) -> torch.Tensor | None:
    """The part of a layer's keys that is the same for every token, [Hkv, 1, D] (None: no such part known).

    Why (--fp8 kv): a k bias (Qwen2 / 2.5) gives some channels of every key one large value, 354 in
    Qwen2.5-Coder-1.5B's layer 0 where the rest of the key is within 8. One e4m3 scale per (head, token)
    rounds such values by up to 6 %, which moves every score by more than its spread: paired on bf16,
    `--fp8 linear,kv` kept 48 % of the right answers at 16K-30K (`linear` alone 100 %). Keys stored minus this
    offset lose only the rest's rounding. Exact: every key of a layer and head loses the same vector m, so
    each query's scores all move by q . m and the softmax is unchanged (flash_fp8's smoothed K, SageAttention);
    the lse of every partial result a strategy merges moves by the same q . m, so the merges agree too.
    What is constant: the bias on channels that RoPE leaves unrotated or turns by less than pi / 3 over the
    model's window (there |R(p) b - b| <= |b|, so the offset never widens a channel's range), times the
    scaling's attention factor as cos / sin carry it. A function of the weights and config alone, so a
    key's stored bytes still depend on that key only, on every rank and layout. None where scores are not
    shift-invariant (a soft cap) or a k norm follows the bias."""
    bias = getattr(attn.wqkv, "bias", None)
    if bias is None or attn.k_norm is not None or "softcap" in attn.extras:
        return None
    d, hq, hk = attn.head_dim, attn.n_heads, attn.n_kv_heads
    b = bias.detach()[hq * d:(hq + hk) * d].view(hk, d).float()
    r = inv_freq.numel()  # rotated pairs (i, i + r); channels from 2r on pass unrotated
    still = (inv_freq.float().to(b.device) * positions < math.pi / 3).repeat(2)
    m = b.clone()
    m[:, :2 * r] = torch.where(still, b[:, :2 * r] * rope_scale, torch.zeros_like(b[:, :2 * r]))
    return m.to(bias.dtype)[:, None, :] if m.any() else None


class SiluMul(nn.Module):
    """SwiGLU's activation, silu(gate) * up, of w13's output [.., 2F] (gate columns first)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)


class GeluTanhMul(nn.Module):
    """GeGLU's activation (Gemma), gelu_tanh(gate) * up, of w13's output [.., 2F] (gate columns first)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_mul(gate_up)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        # a module of its own so that an FP8 w2 can take it over (parallel/fp8.py sets it to identity)
        self.act = GeluTanhMul() if cfg.hidden_act == "gelu_pytorch_tanh" else SiluMul()
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, residual: torch.Tensor | None = None):
        return project_add(self.w2, self.act(self.w13(x)), residual)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm.of(cfg, cfg.hidden_size)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm.of(cfg, cfg.hidden_size)
        # Qwen3-MoE / Mixtral: the expert MLP on the config's sparse layers (global index), dense elsewhere.
        self.feed_forward = MoEFeedForward(cfg) if cfg.is_moe_layer(layer_id) else FeedForward(cfg)
        # Gemma 2 / 3: the attention's and the MLP's outputs are normalized before they join the residual.
        self.post_attention_norm = RMSNorm.of(cfg, cfg.hidden_size) if cfg.sandwich_norms else None
        self.post_ffn_norm = RMSNorm.of(cfg, cfg.hidden_size) if cfg.sandwich_norms else None

    def forward(self, x, cos, sin, pos, cache: LayerKV | None, attend: AttendFn = dense_attend):
        if self.post_attention_norm is not None:
            h = x + self.post_attention_norm(self.attention(self.attention_norm(x), cos, sin, pos, cache, attend))
            return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))
        # h = x + attention(...), out = h + feed_forward(...): the sums are passed in, so a projection
        # that can adds them in its own kernel (project_add)
        h = self.attention(self.attention_norm(x), cos, sin, pos, cache, attend, residual=x)
        return self.feed_forward(self.ffn_norm(h), residual=h)


class Transformer(nn.Module):
    """Decoder stack. `layers` may hold a contiguous slice of the model (a pipeline stage):
    `tok_embeddings` is None except on the first stage, `norm`/`output` None except on the last.

    RoPE length. For dynamic and longrope scaling the frequencies depend on a sequence length;
    transformers reads it from each forward's positions, which no CP shard can do (a shard sees part
    of the sequence; padding rows carry positions past the prompt). Here it is a setting of the run:
    `set_rope_length(n)` fixes the frequencies for every token of the run, prefill and decode, on
    every rank and stage alike, so cached keys and new tokens always share one rotation and every
    context strategy gives each token what one device gives it. The runtime sets n = prompt tokens +
    max new tokens (the longest sequence the run can reach) before the prefill; unset (None) means
    the model's window (cfg.max_position_embeddings). The other scaling types ignore it.

    Attention. Each layer's attention is an AttendFn passed down the forward: the model's own
    (dense_attend; dense_attend_int8_scores when `int8_scores` is set, `--fp8 attention`), or, inside
    `with model.attention_hooks(fn_or_per_layer_fns):`, a caller's hooks.
    """

    def __init__(self, cfg: ModelConfig, layer_ids: list[int] | None = None):
        super().__init__()
        self.config = cfg
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # global index of each held layer (a pipeline stage holds a slice; MoE layers are picked by it)
        self.layer_ids = list(range(cfg.num_layers)) if layer_ids is None else list(layer_ids)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in self.layer_ids)
        self.norm: nn.Module | None = RMSNorm.of(cfg, cfg.hidden_size)
        self.output: nn.Module | None = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.rope_length: int | None = None
        self.rope_scale = rope_attention_factor(cfg)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # Gemma 3: the local layers' RoPE (None: every layer rotates with inv_freq)
        self.register_buffer("local_inv_freq", local_rope_inv_freq(cfg), persistent=False)
        self.int8_scores = False  # --fp8 attention: the own attention takes 8-bit prefill scores
        self._hooks: list[AttendFn] | None = None  # one per held layer while attention_hooks() is active

    @property
    def hooked(self) -> bool:
        """A caller's hooks, not the model's own attention, run in the layers now."""
        return self._hooks is not None

    def layer_attends(self) -> list[AttendFn]:
        """The attention each held layer runs now: the active hooks, else the model's own."""
        own = dense_attend_int8_scores if self.int8_scores else dense_attend
        return self._hooks or [own] * len(self.layers)

    @contextlib.contextmanager
    def attention_hooks(self, hooks: AttendFn | Sequence[AttendFn]):
        """Inside the block the layers attend through `hooks`: one AttendFn for every layer, or one per
        held layer (in `layers` order). On exit, also on error, the previous hooks (or the model's own
        attention) are back, so blocks nest. A CUDA graph captured inside the block records what the
        hooks ran; its replays need no hooks."""
        fns = list(hooks) if isinstance(hooks, (list, tuple)) else [hooks] * len(self.layers)
        if len(fns) != len(self.layers):
            raise ValueError(f"attention_hooks got {len(fns)} hooks for {len(self.layers)} held layers; "
                             "pass one AttendFn for all layers or exactly one per held layer")
        saved, self._hooks = self._hooks, fns
        try:
            yield
        finally:
            self._hooks = saved

    def drop_windows(self) -> None:
        """Every local layer attends as a global one from now on: for a caller whose attention cannot take a
        window and that keeps every run within the window (where it hides nothing), checking that per
        request (llm.py LLM.run_without_windows)."""
        for layer in self.layers:
            layer.attention.extras.pop("window", None)

    def smooth_keys(self, on: bool = True) -> None:
        """Every layer with a k bias stores and attends its keys minus their constant part (key_offset), for
        e4m3 KV caches (LocalRunner turns it on with --fp8 kv); off: keys as computed. Set from the config's
        own frequencies, not the run's RoPE length, so that it never changes with a run."""
        own = rope_inv_freq(self.config)  # the config's, where inv_freq may hold a run's (set_rope_length)
        for layer in self.layers:
            a = layer.attention
            inv = self.local_inv_freq if a.local_rope else own
            a.k_offset = key_offset(a, inv, self.rope_scale, self.config.max_position_embeddings) if on else None

    def set_rope_length(self, length: int | None) -> None:
        """Fix the RoPE frequencies for a run of up to `length` positions (None: the model's window).
        Only dynamic and longrope scaling depend on it. The buffer is updated in place, so whoever
        holds it (a bound context strategy, a captured CUDA graph) sees the new values."""
        self.rope_length = None if length is None else int(length)
        if not self.config.rope_scaling.length_dependent:
            return
        inv = rope_inv_freq(self.config, self.rope_length)
        if self.inv_freq.is_meta:
            self.inv_freq = inv
        else:
            self.inv_freq.copy_(inv)

    def rope(self, pos: torch.Tensor, inv_freq: torch.Tensor | None = None):
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        freqs = pos.to(inv_freq.device).float()[..., None] * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if self.rope_scale != 1.0:  # yarn / longrope attention factor, applied to cos and sin as transformers does
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        return cos, sin

    def forward(
        self,
        tokens_or_hidden: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
        output_row: int | None = None,
    ) -> torch.Tensor:
        """tokens [B, L] (first stage) or hidden [B, L, H] -> logits [B, L, V] (last stage) or hidden.

        positions: global positions [L] of these tokens; default continues the cache (or 0..L-1).
        last_only: the last stage computes logits for the final token only (prefill needs no more);
        output_row: likewise for this one row (a CP shard whose final token is not its last row).
        """
        x = tokens_or_hidden
        L = x.shape[1]
        if positions is None:
            start = cache.next_position if cache is not None else 0
            positions = mark_arange(torch.arange(start, start + L, device=x.device), start)
        end = known_end(positions)  # None: the cache reads it from the device (a sync)
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
            if self.config.embed_scale != 1.0:  # Gemma: the scale rounded to the compute dtype, as transformers
                x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        cos, sin = self.rope(positions)
        cos, sin = cos.to(x.device, x.dtype), sin.to(x.device, x.dtype)
        local = None
        if self.local_inv_freq is not None:
            local = tuple(t.to(x.device, x.dtype) for t in self.rope(positions, self.local_inv_freq))
        for i, layer, attend in zip(self.layer_ids, self.layers, self.layer_attends()):
            c, s = local if local is not None and layer.attention.local_rope else (cos, sin)
            x = layer(x, c, s, positions, cache.layer(i) if cache is not None else None, attend)
        if cache is not None:
            cache.advance(positions, end)
        if (last_only or output_row is not None) and self.output is not None:
            x = x.narrow(1, (-1 if output_row is None else output_row) % L, 1)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = softcap(self.output(x).float(), self.config.final_logit_softcapping)
        return x
