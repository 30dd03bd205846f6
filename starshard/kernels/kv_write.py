"""KV-cache writes as one Triton launch (issue 19): a decode step's token, a prefill block's tokens.

    write_kv_slot(k, v, pos, slot, cache_k, cache_v, cache_pos, k_scale, v_scale)
    # cache_k[:, :, slot] = k (FP8: quantized per (batch, KV head) row, scale into k_scale[:, :, slot]);
    # likewise v; cache_pos[slot] = pos
    write_kv_block(k, v, start, cache_k, cache_v, k_scale, v_scale)
    # an e4m3 cache's rows start .. start + n quantized from k, v [B, Hkv, n, D] (any strides)

Why: the torch path (write_kv_slot_reference, what LayerKV.write_slot ran) is two quantize_rows
launches plus five index_copy_ launches per layer for an FP8 cache (three for a plain one): ~0.38 ms
of a 4.1 ms Llama-8B decode step at 8K on one H200, for a few kilobytes of data. Here one program per
(batch, KV head) row quantizes and stores that row of k and of v with their scales, and the first one
also stores the position.

write_kv_block: a prefill block into an e4m3 cache. The torch path (LayerKV._put) made a contiguous copy
of v (a view of the projection), quantized k and v into new tensors, then copied bytes and scales into the
cache: ~0.9 ms per layer of a 128K prefill on an H100 (docs/results.md, FP8); here each
program quantizes BLOCK_T rows of k and of v straight from their strides into the cache.

`slot` is a device tensor [1] (a captured CUDA-graph step: nothing read on the host) or a host int
(eager decode, where the cache length is known on the host). It must be < capacity; nothing checks.

Numerics: exactly kernels/fp8.py quantize_rows (scale = max(amax(|row|), 1e-12) / 448, division,
clamp to +-448, cast), so the stored bytes are the torch path's. A float32 cache given with scales
stores the values before the e4m3 cast: tests use it, as the interpreter's e4m3 conversion drops the
carry when a value rounds up across a power of two (kernels/activation.py says more).
"""
from __future__ import annotations

import torch

from starshard.kernels.fp8 import e4m3_scale, e4m3_values, quantize_rows
from starshard.kernels.pdl import pdl_launch, pdl_trigger, pdl_wait

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton keep the torch path
    triton = None


def write_kv_slot_reference(k, v, pos, slot, cache_k, cache_v, cache_pos, k_scale=None, v_scale=None) -> None:
    """The torch path: quantize_rows (FP8) then index_copy_ at the device index `slot` [1]."""
    if k_scale is not None:
        k8, ks = quantize_rows(k)
        v8, vs = quantize_rows(v)
        # as bytes: index_copy_ has no e4m3 kernel on every backend
        cache_k.view(torch.uint8).index_copy_(2, slot, k8.view(torch.uint8))
        cache_v.view(torch.uint8).index_copy_(2, slot, v8.view(torch.uint8))
        k_scale.index_copy_(2, slot, ks)
        v_scale.index_copy_(2, slot, vs)
    else:
        cache_k.index_copy_(2, slot, k)
        cache_v.index_copy_(2, slot, v)
    cache_pos.index_copy_(0, slot, pos)


if triton is not None:

    @triton.jit
    def _store_rows(X, s_xt, s_xd, C, s_ct, s_cd, S, s_st, t, n, D, QUANTIZE: tl.constexpr, BLOCK_D: tl.constexpr):
        """Rows t ([BLOCK_T] row indices; those >= n skipped) of X into C (strides per row / per element);
        QUANTIZE: each row divided by its scale and clamped, the scales into S (stride s_st)."""
        d = tl.arange(0, BLOCK_D)
        ok = (t < n)[:, None] & (d < D)[None, :]
        x = tl.load(X + t[:, None] * s_xt + d[None, :] * s_xd, mask=ok, other=0.0)
        if QUANTIZE:
            xf = x.to(tl.float32)
            scale = e4m3_scale(tl.max(tl.abs(xf), 1))
            tl.store(C + t[:, None] * s_ct + d[None, :] * s_cd,
                     e4m3_values(xf, scale[:, None]).to(C.dtype.element_ty), mask=ok)
            tl.store(S + t * s_st, scale, mask=t < n)
        else:
            tl.store(C + t[:, None] * s_ct + d[None, :] * s_cd, x.to(C.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["slot_value"])  # a host slot changes every step: no recompiles
    def _write_kv_slot_kernel(K, V, POS, SLOT, slot_value, CK, CV, CPOS, KS, VS, H, D,
                              s_kb, s_kh, s_kd, s_vb, s_vh, s_vd,
                              s_ckb, s_ckh, s_cks, s_ckd, s_cvb, s_cvh, s_cvs, s_cvd,
                              s_ksb, s_ksh, s_kss, s_vsb, s_vsh, s_vss, s_pos,
                              SLOT_ON_DEVICE: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK_D: tl.constexpr,
                              USE_PDL: tl.constexpr = False):
        """One (batch, KV head) row of k and of v per program; program 0 also stores the position."""
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        row = tl.program_id(0)
        b = (row // H).to(tl.int64)
        h = (row % H).to(tl.int64)
        if SLOT_ON_DEVICE:
            slot = tl.load(SLOT).to(tl.int64)
        else:
            slot = slot_value.to(tl.int64)
        one = tl.arange(0, 1)  # the token's row: a one-row tile (row strides unused)
        _store_rows(K + b * s_kb + h * s_kh, 0, s_kd, CK + b * s_ckb + h * s_ckh + slot * s_cks, 0, s_ckd,
                    KS + b * s_ksb + h * s_ksh + slot * s_kss, 0, one, 1, D, QUANTIZE, BLOCK_D)
        _store_rows(V + b * s_vb + h * s_vh, 0, s_vd, CV + b * s_cvb + h * s_cvh + slot * s_cvs, 0, s_cvd,
                    VS + b * s_vsb + h * s_vsh + slot * s_vss, 0, one, 1, D, QUANTIZE, BLOCK_D)
        if row == 0:
            tl.store(CPOS + slot * s_pos, tl.load(POS))

    @triton.jit(do_not_specialize=["start", "n"])  # block offsets change every chunk: no recompiles
    def _write_kv_block_kernel(K, V, CK, CV, KS, VS, start, n, H, D,
                               s_kb, s_kh, s_kt, s_kd, s_vb, s_vh, s_vt, s_vd,
                               s_ckb, s_ckh, s_ckt, s_ckd, s_cvb, s_cvh, s_cvt, s_cvd,
                               s_ksb, s_ksh, s_kst, s_vsb, s_vsh, s_vst,
                               BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """BLOCK_T tokens of one (batch, KV head) row of k and of v per program."""
        row = tl.program_id(0)
        b = (row // H).to(tl.int64)
        h = (row % H).to(tl.int64)
        t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        at = start.to(tl.int64)
        _store_rows(K + b * s_kb + h * s_kh, s_kt, s_kd, CK + b * s_ckb + h * s_ckh + at * s_ckt, s_ckt, s_ckd,
                    KS + b * s_ksb + h * s_ksh + at * s_kst, s_kst, t, n, D, True, BLOCK_D)
        _store_rows(V + b * s_vb + h * s_vh, s_vt, s_vd, CV + b * s_cvb + h * s_cvh + at * s_cvt, s_cvt, s_cvd,
                    VS + b * s_vsb + h * s_vsh + at * s_vst, s_vst, t, n, D, True, BLOCK_D)


def use_kv_write_kernel(cache_k: torch.Tensor) -> bool:
    """Whether write_kv_slot / write_kv_block run for a cache: on CUDA with triton (the CPU keeps the torch path)."""
    return cache_k.is_cuda and triton is not None


def write_kv_slot(k, v, pos, slot, cache_k, cache_v, cache_pos, k_scale=None, v_scale=None) -> None:
    """Write one token's k, v [B, Hkv, 1, D] (any strides) and pos [1] at cache row `slot` (a device
    tensor [1], or a host int) of cache_k / cache_v [B, Hkv, capacity, D] and cache_pos [capacity], in one
    Triton launch (CUDA, or the interpreter). With k_scale / v_scale [B, Hkv, capacity] (float32) the rows
    are quantized as quantize_rows does (an e4m3 cache; a float32 one gets the values before the cast)."""
    if triton is None:
        raise RuntimeError("write_kv_slot: the Triton kernel needs the triton package")
    B, H, n, D = k.shape
    if n != 1 or v.shape != k.shape or cache_k.shape[:2] != (B, H) or cache_k.shape[3] != D:
        raise ValueError(f"write_kv_slot: one token's k, v [B, Hkv, 1, D] into [B, Hkv, capacity, D]; got "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(cache_k.shape)}")
    quantize = k_scale is not None
    if not quantize:  # unused pointers: any tensor with strides will do
        k_scale = v_scale = cache_pos
    ks_strides = k_scale.stride() if quantize else (0, 0, 0)
    vs_strides = v_scale.stride() if quantize else (0, 0, 0)
    on_device = isinstance(slot, torch.Tensor)
    _write_kv_slot_kernel[(B * H,)](
        k, v, pos, slot if on_device else cache_pos, 0 if on_device else int(slot),
        cache_k, cache_v, cache_pos, k_scale, v_scale, H, D,
        k.stride(0), k.stride(1), k.stride(3), v.stride(0), v.stride(1), v.stride(3),
        *cache_k.stride(), *cache_v.stride(), *ks_strides, *vs_strides, cache_pos.stride(0),
        SLOT_ON_DEVICE=on_device, QUANTIZE=quantize, BLOCK_D=triton.next_power_of_2(D),
        num_warps=1 if D <= 256 else 4, **pdl_launch(k))


def write_kv_block(k, v, start: int, cache_k, cache_v, k_scale, v_scale) -> None:
    """Quantize k, v [B, Hkv, n, D] (any strides) per (batch, KV head, token) row as quantize_rows does
    into rows start .. start + n of an e4m3 cache_k / cache_v [B, Hkv, capacity, D] and their scales
    k_scale / v_scale [B, Hkv, capacity] (float32), in one Triton launch (CUDA, or the interpreter; a
    float32 cache gets the values before the e4m3 cast). The rows must fit: start + n <= capacity."""
    if triton is None:
        raise RuntimeError("write_kv_block: the Triton kernel needs the triton package")
    B, H, n, D = k.shape
    if v.shape != k.shape or cache_k.shape[:2] != (B, H) or cache_k.shape[3] != D or cache_v.shape != cache_k.shape:
        raise ValueError(f"write_kv_block: k, v [B, Hkv, n, D] into [B, Hkv, capacity, D]; got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, cache {tuple(cache_k.shape)} / {tuple(cache_v.shape)}")
    if not 0 <= start <= start + n <= cache_k.shape[2]:
        raise ValueError(f"write_kv_block: rows {start} .. {start + n} of a cache of {cache_k.shape[2]}")
    if n == 0:
        return
    block_d = triton.next_power_of_2(D)
    block_t = max(1, 2048 // block_d)  # ~2K values of k and of v per program
    _write_kv_block_kernel[(B * H, triton.cdiv(n, block_t))](
        k, v, cache_k, cache_v, k_scale, v_scale, start, n, H, D, *k.stride(), *v.stride(), *cache_k.stride(),
        *cache_v.stride(), *k_scale.stride(), *v_scale.stride(), BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
