"""merge, kv_write, rope, norm, activation, gemv, argmax, moe_decode, fp8 helpers (Llama-8B / Qwen2.5-1.5B sizes)."""
import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from harness import *  # noqa
import torch
bf, f8 = torch.bfloat16, torch.float8_e4m3fn
from starshard.kernels import merge, kv_write, rope, norm, activation, gemv, argmax, moe_decode, fp8
for model, H, Hkv, Dm, F, V in (("llama", 32, 8, 4096, 14336, 128256), ("qwen", 12, 2, 1536, 8960, 151936)):
    # merge: partials [B, H, L, D] bf16 + lse, acc float32 (merge_into), stacked
    for L in (4096, 4099):
        o1 = torch.empty(1, H, L, 128, dtype=bf); l1 = torch.empty(1, H, L)
        attempt(f"merge_partials {model} L{L}", merge.merge_partials, o1, l1, o1.clone(), l1.clone(), use_triton=True)
        acc = torch.empty(1, H, L, 128); accl = torch.empty(1, H, L)
        attempt(f"merge_into {model} L{L}", merge.merge_into, acc, accl, o1, l1, use_triton=True)
        attempt(f"merge_stacked {model} L{L}", merge.merge_stacked, torch.empty(4, 1, H, L, 129), bf, use_triton=True)
    # kv_write: one token from the projection layout into the token-major cache
    for cap in (4096, 4099):
        qkv = torch.empty(1, 1, (H + 2 * Hkv) * 128, dtype=bf)
        k = qkv[..., H * 128:(H + Hkv) * 128].view(1, 1, Hkv, 128).transpose(1, 2)
        v = qkv[..., (H + Hkv) * 128:].view(1, 1, Hkv, 128).transpose(1, 2)
        ck = torch.empty(1, cap, Hkv, 128, dtype=bf).transpose(1, 2); cv = torch.empty_like(ck)
        cpos = torch.empty(cap, dtype=torch.long)
        attempt(f"kv_slot {model} cap{cap} dev", kv_write.write_kv_slot, k, v, torch.tensor([5]), torch.tensor([5]), ck, cv, cpos)
        attempt(f"kv_slot {model} cap{cap} host", kv_write.write_kv_slot, k, v, torch.tensor([5]), 7, ck, cv, cpos)
        ck8 = torch.empty(1, cap, Hkv, 128, dtype=f8).transpose(1, 2); cv8 = torch.empty_like(ck8)
        ks = torch.empty(1, Hkv, cap); vs = torch.empty(1, Hkv, cap)
        attempt(f"kv_slot8 {model} cap{cap}", kv_write.write_kv_slot, k, v, torch.tensor([5]), torch.tensor([5]), ck8, cv8, cpos, ks, vs)
        kb = torch.empty(1, 4096, Hkv, 128, dtype=bf).transpose(1, 2)
        attempt(f"kv_block8 {model} cap{cap}", kv_write.write_kv_block, kb, kb, 0, ck8, cv8, ks, vs)
    # rope: q, k views of the projection [B, L, H, D] -> transposed
    for L in (1, 4096):
        qkv = torch.empty(1, L, (H + 2 * Hkv) * 128, dtype=bf)
        q = qkv[..., :H * 128].view(1, L, H, 128).transpose(1, 2)
        k = qkv[..., H * 128:(H + Hkv) * 128].view(1, L, Hkv, 128).transpose(1, 2)
        cos = torch.empty(L, 64, dtype=bf); sin = torch.empty(L, 64, dtype=bf)
        attempt(f"rope {model} L{L}", rope.rope_qk, q, k, cos, sin)
        attempt(f"rope+norm {model} L{L}", rope.rope_qk, q, k, cos, sin, torch.empty(128, dtype=bf), torch.empty(128, dtype=bf), eps=1e-6)
    # norm / activation (decode row and prefill rows)
    for M in (1, 4096):
        x = torch.empty(M, Dm, dtype=bf); w = torch.empty(Dm, dtype=bf)
        if M == 1:
            attempt(f"rms_norm {model} M{M}", norm.rms_norm, x, w, 1e-6)
        attempt(f"rms_norm_quant {model} M{M}", activation.rms_norm_quant, x, w, 1e-6)
        gu = torch.empty(M, 2 * F, dtype=bf)
        attempt(f"silu_mul_rows {model} M{M}", activation.silu_mul_rows, gu)
        attempt(f"silu_mul_quant {model} M{M}", activation.silu_mul_quant, gu)
        attempt(f"quantize_heads {model} L{M}", activation.quantize_heads, torch.empty(1, H, M, 128, dtype=bf))
    # gemv: 16-bit qkv / o / gate_up / down / lm_head at one row; e4m3 weight-only
    for N, K in (((H + 2 * Hkv) * 128, Dm), (Dm, H * 128), (2 * F, Dm), (Dm, F), (V, Dm)):
        x = torch.empty(1, K, dtype=bf)
        attempt(f"gemv16 {model} {N}x{K}", gemv.gemv, x, torch.empty(N, K, dtype=bf))
        attempt(f"gemv8 {model} {N}x{K}", fp8.weight_only_linear, x, torch.empty(N, K, dtype=f8), torch.empty(N))
        attempt(f"gemv16 res {model} {N}x{K}", gemv.gemv, x, torch.empty(N, K, dtype=bf), residual=torch.empty(1, N, dtype=bf))
    attempt(f"argmax {model}", argmax.argmax_rows, torch.empty(1, V, dtype=bf))
    attempt(f"argmax16 {model}", argmax.argmax_rows, torch.empty(16, V, dtype=torch.float32))
    attempt(f"quantize_rows {model}", fp8.quantize_rows_cuda, torch.empty(4096, Dm, dtype=bf))
    attempt(f"dequantize_rows {model}", fp8.dequantize_rows_cuda, torch.empty(4096, Hkv, 128, dtype=f8), torch.empty(4096, Hkv), bf)
# fp8 weight-only tensor-core kernel (autotuned): every config, 16 rows
import triton
for cfg in fp8._WO_CONFIGS:
    N, K, M = 14336 * 2, 4096, 16
    x = torch.empty(M, K, dtype=bf); w8 = torch.empty(N, K, dtype=f8); s = torch.empty(N); y = torch.empty(M, N, dtype=bf)
    attempt(f"weight_only {cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}", fp8._weight_only_kernel.fn[(1, 1)],
            x, w8, s, s, y, M, N, K, K, K, N, HAS_BIAS=False, BLOCK_M=16, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **cfg.kwargs)
# MoE decode (Qwen-MoE-like: 60 experts, top-4, H 2048, F 1408; and Mixtral-like 8 experts H 4096 F 14336)
for E, k, Hm, Fm in ((60, 4, 2048, 1408), (8, 2, 4096, 14336), (128, 8, 2048, 768)):
    for wdt in (bf, f8):
        x = torch.empty(1, Hm, dtype=bf); logits = torch.empty(1, E, dtype=bf)
        w13 = torch.empty(E, 2 * Fm, Hm, dtype=wdt); w2 = torch.empty(E, Hm, Fm, dtype=wdt)
        s13 = torch.empty(E, 2 * Fm) if wdt == f8 else None; s2 = torch.empty(E, Hm) if wdt == f8 else None
        tag = "e4m3" if wdt == f8 else "bf16"
        attempt(f"route E{E}", moe_decode.route_topk, logits, k, True)
        experts = torch.zeros(1, k, dtype=torch.int32)
        attempt(f"gate_up E{E} {tag}", moe_decode.expert_gate_up, x, experts, w13, w13_scale=s13)
        attempt(f"routed_gate_up E{E} {tag}", moe_decode.routed_gate_up, x, logits, w13, k, True, w13_scale=s13)
        attempt(f"down E{E} {tag}", moe_decode.expert_down, torch.empty(k, Fm, dtype=bf), experts, torch.empty(1, k), w2,
                w2_scale=s2, residual=torch.empty(1, Hm, dtype=bf))
