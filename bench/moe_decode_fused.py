"""One MoE layer's decode work on the GPU (Qwen3-30B-A3B shape by default), before and after folding the
routing and the per-pair bookkeeping into the kernels (kernels/moe_decode.py):

    before: router GEMV, route() in torch (softmax, topk, renormalize), the pair -> token arange, the
            per-pair gate_up and down kernels, the per-token weighted sum and cast (the kernels as of
            db24bd1, copied below to time against)
    after:  router GEMV, route_topk, expert_gate_up, expert_down (per-token sum in-kernel)

Prints one JSON object: per token count, microseconds per layer from a CUDA graph of 20 layers replayed
10 times (whole layer and its routing / down parts alone), GPU kernels per layer (profiler, eager), the
error of both against a float32 reference, and whether both routings chose the same experts (bf16
logits can tie exactly; then either choice is a valid top k).

    python bench/moe_decode_fused.py --out moe_decode_fused.json      # ~30 s on one H200
"""
import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from starshard.benchmarks.common import graph_time_us
from starshard.engine.moe import grouped_experts, route
from starshard.kernels.moe_decode import DOWN_TILE, GATE_UP_TILE, expert_down, expert_gate_up, route_topk


# ---- the per-pair kernels as of db24bd1 (token_of_pair tensor; down writes [P, H] float32, summed in torch)
@triton.jit
def _old_gate_up_kernel(x_ptr, tok_ptr, exp_ptr, w_ptr, out_ptr, K, F, stride_x, stride_we, stride_wn, stride_o,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < F
    x_row = x_ptr + tl.load(tok_ptr + p).to(tl.int64) * stride_x
    w = w_ptr + tl.load(exp_ptr + p).to(tl.int64) * stride_we
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        m = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(w + n[:, None] * stride_wn + k[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(w + (n[:, None] + F) * stride_wn + k[None, :], mask=m, other=0.0).to(tl.float32)
        gate += tl.sum(wg * xv, axis=1)
        up += tl.sum(wu * xv, axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + p * stride_o + n, act.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _old_down_kernel(a_ptr, exp_ptr, pw_ptr, w_ptr, out_ptr, K, N, stride_a, stride_we, stride_wn, stride_o,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    a_row = a_ptr + p.to(tl.int64) * stride_a
    w = w_ptr + tl.load(exp_ptr + p).to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        av = tl.load(a_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        wv = tl.load(w + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(wv.to(tl.float32) * av, axis=1)
    acc = acc * tl.load(pw_ptr + p)
    tl.store(out_ptr + p * stride_o + n, acc, mask=n_ok)


def old_experts(x, weights, experts, w13, w2):
    T, k = experts.shape
    (E, F2, H), Fw = w13.shape, w13.shape[1] // 2
    flat = experts.reshape(-1)
    tok = torch.arange(T, device=x.device).repeat_interleave(k)
    act = torch.empty(T * k, Fw, dtype=x.dtype, device=x.device)
    _old_gate_up_kernel[(T * k, triton.cdiv(Fw, 4))](x, tok, flat, w13, act, H, Fw, x.stride(0), w13.stride(0),
                                                    w13.stride(1), act.stride(0), BLOCK_N=4, BLOCK_K=512, num_warps=2)
    y = torch.empty(T * k, H, dtype=torch.float32, device=x.device)
    _old_down_kernel[(T * k, triton.cdiv(H, 8))](act, flat, weights.reshape(-1).float().contiguous(), w2, y, Fw, H,
                                                 act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
                                                 BLOCK_N=8, BLOCK_K=256, num_warps=2)
    return y.view(T, k, -1).sum(dim=1).to(x.dtype)


def kernels_per_call(fn):
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    except Exception as e:  # the profiler is optional here
        return f"unavailable: {str(e)[:100]}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--no-renormalize", action="store_true", help="Qwen3-30B-A3B renormalizes (norm_topk_prob)")
    ap.add_argument("--tokens", default="1,4,8", help="comma-separated token counts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, E, k, H, Fw = torch.device("cuda"), args.experts, args.top_k, args.hidden, args.width
    renorm = not args.no_renormalize
    g = torch.Generator(device=dev).manual_seed(0)
    router = (torch.randn(E, H, device=dev, generator=g) * 0.02).bfloat16()
    w13 = (torch.randn(E, 2 * Fw, H, device=dev, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, Fw, device=dev, generator=g) * 0.02).bfloat16()

    rows = []
    for T in map(int, args.tokens.split(",")):
        x = torch.randn(T, H, device=dev, generator=g).bfloat16()
        logits = F.linear(x, router)

        def before():
            return old_experts(x, *route(F.linear(x, router), k, renorm), w13, w2)

        def after():
            w, e = route_topk(F.linear(x, router), k, renorm)
            return expert_down(expert_gate_up(x, e, w13), e, w, w2, out_dtype=x.dtype)

        w_old, e_old = route(logits, k, renorm)
        w_new, e_new = route_topk(logits, k, renorm)
        same = (e_new.long() == e_old).all(dim=-1)
        want = grouped_experts(x.float(), w_old, e_old, w13.float(), w2.float(), impl="padded")
        want_new = grouped_experts(x.float(), w_new, e_new.long(), w13.float(), w2.float(), impl="padded")
        act = expert_gate_up(x, e_new, w13)
        row = {"tokens": T, "pairs": T * k,
               "same_experts_tokens": int(same.sum()), "weights_max_abs_diff":
                   (w_new - w_old)[same].abs().max().item() if same.any() else None,
               "before_rel_err": ((before().float() - want).norm() / want.norm()).item(),
               "after_rel_err": ((after().float() - want_new).norm() / want_new.norm()).item(),
               "before_us": graph_time_us(before), "after_us": graph_time_us(after),
               "route_before_us": graph_time_us(lambda: route(logits, k, renorm)),
               "route_after_us": graph_time_us(lambda: route_topk(logits, k, renorm)),
               "gate_up_after_us": graph_time_us(lambda: expert_gate_up(x, e_new, w13)),
               "down_after_us": graph_time_us(lambda: expert_down(act, e_new, w_new, w2, out_dtype=x.dtype)),
               "kernels_before": kernels_per_call(before), "kernels_after": kernels_per_call(after)}
        chosen = e_new.unique().numel()
        row["bytes_read"] = (chosen * 3 * Fw * H + E * H) * 2  # chosen experts + the router
        row["bytes_bound_us"] = row["bytes_read"] / 4.8e12 * 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "shape": dict(E=E, k=k, H=H, F=Fw, renormalize=renorm),
              "tiles": dict(gate_up=GATE_UP_TILE, down=DOWN_TILE), "rows": rows}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
