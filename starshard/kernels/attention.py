"""Attention dispatcher. Every entry point returns (out, lse) per the docs/design.md contract.

    out, lse = attention(q, k, v, q_pos=..., k_pos=..., causal=True, scale=None, sparse=None,
                         window=None, softcap=None, sinks=None)
    q: [B, Hq, Lq, D]   k, v: [B, Hkv, Lk, D]   q_pos: [Lq] or [B, Lq]   k_pos: [Lk] or [B, Lk]
    out: [B, Hq, Lq, D] in q.dtype     lse: [B, Hq, Lq] float32

Causality is by global position (key visible iff k_pos <= q_pos), so a query block may sit anywhere
relative to its keys. Rows that see no key get out = 0 and lse = -inf.

Optional, each a compile-time switch of the Triton kernels (off: the kernels as they were):
- window (int >= 1, causal only): sliding-window attention. A query at position p sees the keys at
  positions in (p - window, p]: the last `window` positions, itself included. This is transformers'
  config.sliding_window as Mistral, Gemma 2/3 and GPT-OSS pass it (masking_utils.sliding_window_overlay
  keeps kv_idx > q_idx - sliding_window), in positions, not indices, so CP shards and caches need
  nothing else. Key blocks wholly out of every row's window are skipped.
- softcap (float > 0): logit soft-capping (Gemma 2): scores = softcap * tanh(scale * q.k / softcap),
  before the mask.
- sinks (float tensor [Hq], one logit per query head, unscaled): attention sinks (GPT-OSS): exp(sink)
  joins the softmax denominator only: out = sum_j e^{s_j} v_j / (e^sink + sum_j e^{s_j}). The lse
  EXCLUDES the sink (log sum_j e^{s_j}, as without sinks), so lse-merges stay merges of key sets: a
  caller that merges partials (ring, Star, cascades, split keys) computes them with sinks=None and
  applies `merge.apply_sink(out, lse, sinks)` once to the merged result (out * sigmoid(lse - sink)).
Refused with a ValueError naming the argument where a path cannot run them: any of them with a
`sparse` pattern, and `window` with causal=False. The int8-score (`--fp8 attention`) and flash_fp8
kernels take none of them. On CUDA a call with any of them never takes torch's fused kernels (which
lack them): the Triton flash or split-KV kernel runs it, exactly (an FP8 cache too).

Backends: flash.py (Triton, any position mask), decode.py (split-KV Triton for short query blocks),
torch's fused cuDNN SDPA where the mask is plain, cpu.py and the math reference (reference.py) on CPU,
flash_fp8.py (8-bit scores: `causal_attention_int8_scores`, `--fp8 attention`). The backends import
common.py (checks, positions, sizes), online_softmax.py and fp8.py, never this module.
"""
from __future__ import annotations

import torch

from starshard.config import FP8_PREFILL_KEY_BLOCK
from starshard.kernels.common import (
    DECODE_MAX_ROWS, arange_start, as_positions, check_extras, check_shapes, sm_count, square_increasing, to_device,
)
from starshard.kernels.cpu import attention_cpu
from starshard.kernels.decode import decode_attention
from starshard.kernels.fp8 import dequantize
from starshard.kernels.flash import flash_attention
from starshard.kernels.flash_fp8 import HEAD_DIMS as FP8_HEAD_DIMS  # other head dims run `attention`
from starshard.kernels.flash_fp8 import flash_fp8_attention, int8_scores_operands
from starshard.kernels.merge import apply_sink, merge_partials
from starshard.kernels.reference import attention_math

__all__ = [
    "attention", "attention_after_held", "causal_attention", "causal_attention_int8_scores", "uses_int8_scores",
    "INT8_SCORES_MIN_LENGTH", "attention_math", "check_shapes", "as_positions", "mask_mode", "cuda_backend", "DECODE_MAX_ROWS",
    "SHORT_QUERY_ROWS", "sm_count", "head_subset",
]


def mask_mode(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> str:
    """Which mask the positions make: "full" (every key visible to every query row), "causal"
    (q_pos == k_pos, strictly increasing: key j is visible to row i iff j <= i, plain index-causal,
    which the fused kernels' is_causal expresses whatever their alignment convention; gaps allowed,
    as in Star's [anchor; block] or a zigzag ring shard) or "masked" (anything else).

    Reading positions that live on a GPU costs one device-to-host sync; only prefill-sized calls
    pay it (decode-sized ones go to the split-KV kernel, which needs no classification), and none
    when both are runs marked on the host (`common.mark_arange`: the model's own positions)."""
    if not causal:
        return "full"
    if q_pos.dim() != 1 or k_pos.dim() != 1 or q_pos.numel() == 0 or k_pos.numel() == 0:
        return "masked"
    if square_increasing(q_pos, k_pos):  # known on the host (common.mark_increasing): nothing to read
        return "causal"
    q0, k0 = arange_start(q_pos), arange_start(k_pos)
    if q0 is not None and k0 is not None:  # both runs known on the host: nothing to read
        if k0 + k_pos.numel() - 1 <= q0:
            return "full"
        return "causal" if q_pos.shape == k_pos.shape and q0 == k0 else "masked"
    stats = [k_pos.to(q_pos.device).max(), q_pos.min()]
    square = q_pos.shape == k_pos.shape
    if square:
        stats += [(q_pos != k_pos.to(q_pos.device)).any().long(), (q_pos.diff() <= 0).any().long()]
    vals = torch.stack(stats).tolist()  # the one sync
    if vals[0] <= vals[1]:
        return "full"
    if square and vals[2] == 0 and vals[3] == 0:
        return "causal"
    return "masked"


# Query blocks longer than DECODE_MAX_ROWS (common.py) with a plain mask go to cuDNN; up to this many
# rows to flash SDPA, because cuDNN builds an execution plan per new shape and short blocks (query
# phases) change shape often.
SHORT_QUERY_ROWS = 256
_FLASH_BLOCK_M = 128  # flash.py's query rows per program at head_dim <= 128


def cuda_backend(q: torch.Tensor, Lk: int, mode: str | None, sms: int, fused: bool = True) -> str:
    """The CUDA kernel for a call (a pure function of shapes, so CPU tests cover it):
    "decode" (decode.py, split-KV), "flash-sdpa" / "cudnn" (torch's fused kernels, plain masks) or
    "triton" (flash.py, any position mask). `mode` is `mask_mode`'s answer, None when Lq is at most
    DECODE_MAX_ROWS (not classified); `sms` is the GPU's multiprocessor count; `fused` False keeps
    the call off torch's fused kernels (a window, softcap or sinks, which they lack)."""
    B, Hq, Lq, D = q.shape
    if mode is None:
        return "decode"
    fused_ok = fused and q.dtype in (torch.float16, torch.bfloat16) and D % 8 == 0 and D <= 128
    if mode != "masked" and fused_ok:
        return "flash-sdpa" if Lq <= SHORT_QUERY_ROWS else "cudnn"
    # A short query block over a long cache gives flash.py fewer programs than multiprocessors;
    # the split-KV kernel spreads the keys instead.
    if B * Hq * -(-Lq // _FLASH_BLOCK_M) < sms and Lk >= 4 * Lq:
        return "decode"
    return "triton"


_NATIVE_GQA: dict[tuple, bool] = {}


def _cudnn_native_gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether torch's cuDNN op takes fewer KV heads than query heads and gets them right on this
    device / torch build (newer cuDNN frontends do; older ones raise or mis-broadcast). Checked once
    per (device, dtype) on a small input against the expanded call; saves the K/V copy."""
    key = (q.device, q.dtype)
    if key not in _NATIVE_GQA:
        g = torch.Generator(device=q.device).manual_seed(0)
        qs = torch.randn(1, 4, 192, 64, device=q.device, dtype=q.dtype, generator=g)
        ks, vs = (torch.randn(1, 2, 192, 64, device=q.device, dtype=q.dtype, generator=g) for _ in range(2))
        try:
            op = torch.ops.aten._scaled_dot_product_cudnn_attention
            got = op(qs, ks, vs, None, True, 0.0, True, False)
            want = op(qs, ks.repeat_interleave(2, 1), vs.repeat_interleave(2, 1), None, True, 0.0, True, False)
            ok = got[0].shape == want[0].shape and torch.allclose(got[0].float(), want[0].float(), atol=1e-3, rtol=0)
            ok = ok and torch.allclose(got[1].float().reshape(-1)[: 4 * 192], want[1].float().reshape(-1)[: 4 * 192], atol=1e-3)
        except RuntimeError:
            ok = False
        _NATIVE_GQA[key] = bool(ok)
    return _NATIVE_GQA[key]


def _plan_strides(t: torch.Tensor) -> torch.Tensor:
    """`t` with a size-1 batch's stride set by its other dims. torch keys its cuDNN plans by every stride,
    and a KV cache view's batch stride is the cache's capacity (the prompt's length): a plan per document
    (46-65 ms each on one H200). The stride of a size-1 dim addresses nothing, so any value is the same
    tensor; the token-major cache (engine/kv_cache.py) makes the other strides length-free."""
    if t.shape[0] != 1:
        return t
    stride = max(s * n for s, n in zip(t.stride()[1:], t.shape[1:]))
    return t if t.stride(0) == stride else t.as_strided(t.shape, (stride, *t.stride()[1:]))


# cuDNN builds an execution plan for each new shape (35-68 ms on one H100 / H200, docs/results.md): a prompt of a
# new length pays it in full, and a harness sample or a document's last chunk is nearly always one. Query rows
# padded up to a multiple of PLAN_ROWS let every length within one multiple share a plan. Exact: padded rows are
# dropped, and in a square causal call the padded keys come after every real row's last visible key. Past
# PLAN_PAD_MAX rows a plan costs under ~2 % of the prefill, and the padded copies would add to its peak memory.
PLAN_ROWS = 256
PLAN_PAD_MAX = 65536


def plan_padded(q, k, v, *, causal: bool, run):
    """run(q, k, v) -> (out, lse) on q's rows padded to a multiple of PLAN_ROWS (k, v too when causal), cut back
    to q's rows; as is past PLAN_PAD_MAX rows, on a multiple already, or causal with other than one key per row
    (the dispatcher sends cuDNN square causal calls only: a key pad elsewhere would depend on the alignment)."""
    Lq = q.shape[2]
    pad = -Lq % PLAN_ROWS if Lq <= PLAN_PAD_MAX and (not causal or k.shape[2] == Lq) else 0
    if pad == 0:
        return run(q, k, v)
    grow = lambda t: torch.nn.functional.pad(t, (0, 0, 0, pad))  # noqa: E731
    if causal:
        k, v = grow(k), grow(v)
    out, lse = run(grow(q), k, v)
    return out[:, :, :Lq].contiguous(), lse[:, :, :Lq].contiguous()


def _fused(q, k, v, *, causal: bool, scale, op: str):
    """torch's fused cuDNN or flash SDPA; both return natural-log logsumexp per (head, row). cuDNN's calls on
    rows padded for its plans (`plan_padded`: a query head's rows, before GQA folds heads into rows)."""
    if op == "cudnn":
        return plan_padded(q, k, v, causal=causal, run=lambda q, k, v: _sdpa(q, k, v, causal=causal, scale=scale,
                                                                              op=op))
    return _sdpa(q, k, v, causal=causal, scale=scale, op=op)


def _sdpa(q, k, v, *, causal: bool, scale, op: str):
    B, Hq, Lq, D = q.shape
    g = Hq // k.shape[1]
    if g > 1 and not causal:
        # No mask: a KV head's g query heads are just more rows over the same keys (no K/V copy).
        out, lse = _sdpa(q.reshape(B, k.shape[1], g * Lq, D), k, v, causal=False, scale=scale, op=op)
        return out.reshape(B, Hq, Lq, D), lse.reshape(B, Hq, Lq)
    if g > 1 and not (op == "cudnn" and _cudnn_native_gqa(q, k)):
        # Causal rows of different heads differ: equal head counts (the copy is a few % of the time).
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    if op == "cudnn":
        q, k, v = _plan_strides(q), _plan_strides(k), _plan_strides(v)
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    else:
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1].reshape(B, Hq, -1)[:, :, :Lq].float()  # lse may come padded or as [B, H, L, 1]


def _attention_cuda(q, k, v, q_pos, k_pos, causal, scale, window=None, softcap=None, sinks=None):
    if q.shape[2] <= DECODE_MAX_ROWS:
        mode = None
    else:  # a window is a position mask whatever the layout: no need to classify (a host sync)
        mode = "masked" if window is not None else mask_mode(q_pos, k_pos, causal)
    plain = window is None and softcap is None and sinks is None
    backend = cuda_backend(q, k.shape[2], mode, sm_count(q.device), fused=plain)
    if backend == "decode":
        return decode_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale, window=window,
                                softcap=softcap, sinks=sinks)
    if backend in ("cudnn", "flash-sdpa"):
        return _fused(q, k, v, causal=mode == "causal", scale=scale, op="cudnn" if backend == "cudnn" else "flash")
    return flash_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=mode != "full", scale=scale, window=window,
                           softcap=softcap, sinks=sinks)


def _attention_cuda_fp8(q, k, v, q_pos, k_pos, causal, scale, k_scale, v_scale, window=None, softcap=None, sinks=None):
    """e4m3 k, v with per-(head, key) scales. Decode-sized calls and short blocks over long caches (as
    `cuda_backend` picks): the split-KV kernel reads the e4m3 bytes as stored. Prefill-sized calls: the
    keys FP8_PREFILL_KEY_BLOCK at a time, each block dequantized into a bounded buffer and run through
    the compute-dtype path (cuDNN where the mask allows), partials merged by lse. Why not a Triton flash
    kernel reading the e4m3 bytes in registers (a3bab66 had one): on one H200, a 128K prompt in chunks
    of 8192 took 28.1 s with it against 19.0 s for the bf16 cache through cuDNN and 12.1 s this way
    (docs/results.md, FP8). A window, softcap and sinks go to either kernel; the sink is applied once,
    after the blocks merge."""
    mode = None if q.shape[2] <= DECODE_MAX_ROWS else mask_mode(q_pos, k_pos, causal)
    if cuda_backend(q, k.shape[2], mode and "masked", sm_count(q.device)) == "decode":
        return decode_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale, k_scale=k_scale,
                                v_scale=v_scale, window=window, softcap=softcap, sinks=sinks)
    out = lse = None
    for s in range(0, k.shape[2], FP8_PREFILL_KEY_BLOCK):
        e = min(s + FP8_PREFILL_KEY_BLOCK, k.shape[2])
        kb = dequantize(k[:, :, s:e], k_scale[:, :, s:e], q.dtype)
        vb = dequantize(v[:, :, s:e], v_scale[:, :, s:e], q.dtype)
        o, l = _attention_cuda(q, kb, vb, q_pos, k_pos[..., s:e], causal, scale, window, softcap)
        del kb, vb  # before the next block is dequantized
        out, lse = (o, l) if out is None else merge_partials(out, lse, o, l)
    return apply_sink(out, lse, sinks)


def attention(q, k, v, *, q_pos, k_pos, causal=True, scale=None, sparse=None, k_scale=None, v_scale=None, window=None,
              softcap=None, sinks=None):
    """Exact (or `sparse`-approximate) attention with log-sum-exp. See the module docstring.

    CUDA (see `cuda_backend`): decode-sized calls and short query blocks over long caches ->
    split-KV Triton kernel; plain masks (none, or index-causal) -> cuDNN (flash SDPA for short
    blocks); any other position mask -> Triton flash kernel. CPU: torch's fused flash kernel with a
    position bias (float32/bfloat16, shared 1-D positions, more than DECODE_MAX_ROWS query rows),
    else the float32 math path.

    k_scale, v_scale: k, v are e4m3 (an FP8 KV cache) with float32 scales [B, Hkv, Lk], one per (KV
    head, key). On CUDA (`_attention_cuda_fp8`) decode-sized calls read the e4m3 bytes as stored and
    prefill-sized ones dequantize the keys a bounded block at a time; with `sparse`, and on the CPU, k
    and v are dequantized to q's dtype first and the call runs as above.

    window, softcap, sinks: see the module docstring (all paths but `sparse`, which refuses them)."""
    extras = dict(window=window, softcap=softcap, sinks=sinks)
    check_extras(q, causal, window, softcap, sinks, "attention")
    if sparse is not None and (window is not None or softcap is not None or sinks is not None):
        name = next(n for n, x in extras.items() if x is not None)
        raise ValueError(f"attention: the sparse patterns (kernels/sparse.py) do not take {name}; pass sparse=None "
                         f"for layers with a {name} (dense attention runs it exactly)")
    if k_scale is not None:
        if q.device.type == "cuda" and sparse is None and q.dtype in (torch.float16, torch.bfloat16, torch.float32):
            check_shapes(q, k, v)
            return _attention_cuda_fp8(q, k, v, q_pos, k_pos, causal, scale, k_scale, v_scale, **extras)
        k, v = dequantize(k, k_scale[:, :, : k.shape[2]], q.dtype), dequantize(v, v_scale[:, :, : v.shape[2]], q.dtype)
    if sparse is not None:  # a sparse method's pattern for these heads (kernels/sparse.py)
        return sparse.attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale)
    check_shapes(q, k, v)
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return _attention_cuda(q, k, v, q_pos, k_pos, causal, scale, **extras)
    # On CPU the fused kernel's mask and K/V copies cost more than they save for a few query rows; it
    # has no softcap or sinks (the math path has).
    fused_cpu = q.dtype in (torch.float32, torch.bfloat16) and q_pos.dim() == 1 and k_pos.dim() == 1
    if q.device.type == "cpu" and fused_cpu and q.shape[2] > DECODE_MAX_ROWS and softcap is None and sinks is None:
        return attention_cpu(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale, window=window)
    return attention_math(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale, **extras)


def causal_attention(q, k, v, *, scale=None, window=None, softcap=None, sinks=None):
    """Square index-causal attention (Lq == Lk, row i sees keys 0..i), for callers that already know
    their layout: the sparse methods' dense heads, after `query_offset` read the positions (offset 0
    over as many keys as rows, strictly increasing positions: position-causal is index-causal). Same
    kernels as `attention`, without `mask_mode`'s read of the positions (a host sync per call).
    window, softcap, sinks: as `attention` (rows at indices, so the window counts indices); any of them
    keeps the call off torch's fused kernels."""
    check_shapes(q, k, v)
    B, Hq, L, D = q.shape
    if k.shape[2] != L:
        raise ValueError(f"causal_attention needs as many keys as query rows, got {L} rows and {k.shape[2]} keys")
    plain = window is None and softcap is None and sinks is None
    if (plain and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and L > DECODE_MAX_ROWS):
        backend = cuda_backend(q, L, "causal", sm_count(q.device))
        if backend in ("cudnn", "flash-sdpa"):
            return _fused(q, k, v, causal=True, scale=scale, op="cudnn" if backend == "cudnn" else "flash")
    pos = torch.arange(L, device=q.device)
    return attention(q, k, v, q_pos=pos, k_pos=pos, causal=True, scale=scale, window=window, softcap=softcap,
                     sinks=sinks)


def causal_attention_at(q, k, v, *, q_pos, k_pos, offset: int, scale=None):
    """Index-causal attention for a caller that already knows the query offset (the sparse methods'
    dense heads; row i sees keys 0 .. i + offset): a square prefill at offset 0 takes
    `causal_attention` (no read of the positions); rows that are the tail of their keys (Lk = offset +
    Lq: a chunk after its prefix, an APB block after its anchor and passing keys) take the keys
    before them in full and their own causally, two fused calls merged by lse, instead of one masked
    kernel; anything else `attention` with the positions."""
    Lq, Lk = q.shape[2], k.shape[2]
    if offset == 0 and Lq == Lk:
        return causal_attention(q, k, v, scale=scale)
    if offset > 0 and Lk == offset + Lq and Lq > DECODE_MAX_ROWS:
        o1, l1 = attention(q, k[:, :, :offset], v[:, :, :offset], q_pos=q_pos, k_pos=k_pos[..., :offset], causal=False,
                           scale=scale)
        o2, l2 = causal_attention(q, k[:, :, offset:], v[:, :, offset:], scale=scale)
        return merge_partials(o1, l1, o2, l2)
    return attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=True, scale=scale)


# `--fp8 attention` on CUDA from this many keys: below it the 8-bit kernel (with its pre-pass) measured slower than
# cuDNN's bf16 one (one H100, Llama-8B heads: 0.83x at 16K, 0.91x at 64K, 0.98x at 96K, 1.00x at 128K; end to end
# `linear,kv,attention` vs `linear,kv` 0.96x at 64K, 1.007x at 96K; an H200 1.00x at 32K, 1.04-1.09x at 128K:
# docs/results.md, FP8), so shorter calls keep exact scores at no cost in speed.
INT8_SCORES_MIN_LENGTH = 96 * 1024


def uses_int8_scores(q, k, q_pos, k_pos, sparse=None, device_type: str | None = None) -> bool:
    """Whether causal_attention_int8_scores gives this call 8-bit scores: a square index-causal prefill call
    (more than DECODE_MAX_ROWS rows) of a head dim the kernel has, without a sparse pattern, and on CUDA
    at least INT8_SCORES_MIN_LENGTH keys (the CPU's reference path takes every length: it is there to show
    the kernel's numerics). device_type: q's unless given."""
    L = q.shape[2]
    on_cuda = (device_type or q.device.type) == "cuda"
    return (sparse is None and L > DECODE_MAX_ROWS and k.shape[2] == L and q.shape[-1] in FP8_HEAD_DIMS
            and (not on_cuda or L >= INT8_SCORES_MIN_LENGTH) and mask_mode(q_pos, k_pos, True) == "causal")


def causal_attention_int8_scores(q, k, v, *, q_pos, k_pos, scale=None, sparse=None):
    """Square causal prefill attention with 8-bit scores (`--fp8 attention`): q . k from int8 q (per
    128 rows) and int8 K minus its mean (per 128 keys; the mean shifts every score of a row alike, so
    the softmax never sees it and the lse gets it back), P @ V in q's dtype. CUDA: one Triton kernel
    (kernels/flash_fp8.py) when the positions are plain index-causal; the CPU runs the same
    quantization through the exact path (slow reference). A call `uses_int8_scores` declines (a sparse
    pattern, whose kernels read 16-bit scores; any other mask; a decode-sized call; on CUDA, fewer than
    INT8_SCORES_MIN_LENGTH keys) runs `attention` unchanged: every caller of `--fp8 attention` (the dense
    path, Star's context blocks, Ulysses) decides here."""
    check_shapes(q, k, v)
    if not uses_int8_scores(q, k, q_pos, k_pos, sparse):
        return attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=True, scale=scale, sparse=sparse)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.device.type == "cuda":
        return flash_fp8_attention(q, k, v, scale=scale)
    qd, kd, shift = int8_scores_operands(q, k)
    out, lse = attention(qd, kd, v, q_pos=q_pos, k_pos=k_pos, causal=True, scale=scale)
    return out, lse + shift * scale


def attention_after_held(q, k, v, pos, held_k, held_v, held_pos, *, k_scale=None, v_scale=None, scale=None,
                         window=None, softcap=None, sinks=None):
    """(out, lse) of a query block at positions `pos` over keys held before it (held_k / held_v /
    held_pos as stored: e4m3 with k_scale / v_scale for an FP8 cache) and its own keys k, v at `pos`
    (as given, so the block attends its own keys exactly), causal by position; the two partials
    merge by lse. A chunked prefill over an FP8 cache runs this instead of attending a dequantized
    copy of the whole prefix: on CUDA the held part is read in e4m3 by a Triton kernel and the own
    part takes the fused index-causal path. window, softcap: as `attention`, in both parts (positions
    carry the window); sinks: applied once, to the merged result (the lse excludes them)."""
    extras = dict(scale=scale, window=window, softcap=softcap)
    # Every held key precedes the block: no mask (and no host read of the positions to find that out),
    # unless a window hides the oldest ones.
    o1, l1 = attention(q, held_k, held_v, q_pos=pos, k_pos=held_pos, causal=window is not None, k_scale=k_scale,
                       v_scale=v_scale, **extras)
    o2, l2 = attention(q, k, v, q_pos=pos, k_pos=pos, causal=True, **extras)
    out, lse = merge_partials(o1, l1, o2, l2)
    return (out, lse) if sinks is None else apply_sink(out, lse, sinks)


def head_subset(q, k, v, heads):
    """(q, k, v) of the query heads `heads` (ascending ids) of one call, for running part of a call's
    heads through one kernel (the sparse methods' dense fallback). GQA stays GQA (the KV heads of
    `heads`, a view when they are consecutive) when `heads` are whole KV groups; otherwise each query
    head gets its own copy of its KV head."""
    Hq, Hkv = q.shape[1], k.shape[1]
    g = Hq // Hkv
    heads = [int(h) for h in heads]

    def take(x, ids):
        if ids == list(range(ids[0], ids[0] + len(ids))):
            return x[:, ids[0] : ids[0] + len(ids)]
        return x.index_select(1, to_device(ids, x.device))

    kvs = sorted({h // g for h in heads})
    if heads == [kv * g + i for kv in kvs for i in range(g)]:
        return take(q, heads), take(k, kvs), take(v, kvs)
    own = [h // g for h in heads]
    return take(q, heads), take(k, own), take(v, own)
