"""Causal prefill attention in FP8 (cuDNN's sdpa_fp8 through nvidia-cudnn-frontend) against our bf16
path (torch's cuDNN kernel), both with log-sum-exp, one GPU, Llama-3.1-8B heads by default.

    pip install nvidia-cudnn-frontend   # not a starshard dependency: this benchmark decides whether it becomes one
    python launch/bench.py fp8-attention --lengths 32768,65536,131072 --out fp8_attention.json

Inputs: random normal q / k / v (dense attention time does not depend on the values), q scaled by
--q-scale so the softmax is peaked rather than flat (flat attention hides quantization error).
FP8: q, k, v quantized per tensor to e4m3 (scale = 448 / amax); softmax probabilities enter the
P.V GEMM as e4m3 scaled by 448; the output is e4m3 on Hopper (cuDNN writes FP8 O there), scaled by
448 / amax(v) (an output row is a convex combination of v rows), dequantized after. The quantization
of q / k / v is timed apart (`quantize_s`): in a model it would be fused into the projection.

Accuracy: out and lse of --check-rows query rows (spread over the sequence, the last row included)
against a float32 reference on the same bf16 inputs; the bf16 kernel is measured the same way.
"""
from __future__ import annotations

import math

import torch

from starshard.benchmarks.common import DTYPES, header, ints, timed_median, write
from starshard.kernels.attention import attention
from starshard.kernels.reference import attention_math

HELP = "cuDNN FP8 causal attention vs our bf16 attention (speed and error, with lse)"
E4M3_MAX = 448.0


def add_arguments(p) -> None:
    p.add_argument("--lengths", type=ints, default=[32768, 65536, 131072], help="sequence lengths (tokens)")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (GQA)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim")
    p.add_argument("--q-scale", type=float, default=4.0,
                   help="multiplies q so that attention is peaked (1.0: near-uniform softmax)")
    p.add_argument("--check-rows", type=int, default=256, help="query rows compared with the float32 reference")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point (median reported)")
    p.add_argument("--out", default=None, help="write the JSON here (also printed)")


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3: (x * scale in e4m3, descale = 1 / scale as a [1, 1, 1, 1] float32 tensor)."""
    scale = E4M3_MAX / x.abs().amax().float().clamp(min=1e-12)
    return (x.float() * scale).to(torch.float8_e4m3fn), (1.0 / scale).reshape(1, 1, 1, 1)


class CudnnFp8Attention:
    """One built cuDNN graph: causal FP8 SDPA of fixed shapes, returning (out e4m3, lse float32)."""

    def __init__(self, cudnn, B: int, H: int, Hkv: int, L: int, D: int, device):
        self.cudnn = cudnn
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(device).cuda_stream)
        fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32, handle=self.handle)

        def contiguous(name, heads):
            return g.tensor(name=name, dim=[B, heads, L, D], stride=[heads * L * D, L * D, D, 1], data_type=fp8)

        def scalar(name):
            return g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)

        self.q, self.k, self.v = contiguous("q", H), contiguous("k", Hkv), contiguous("v", Hkv)
        self.scalars = {n: scalar(n) for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
        o, stats, amax_s, amax_o = g.sdpa_fp8(
            q=self.q, k=self.k, v=self.v, **self.scalars, generate_stats=True,
            attn_scale=1.0 / math.sqrt(D), use_causal_mask=True, name="sdpa_fp8")
        o.set_output(True).set_dim([B, H, L, D]).set_stride([H * L * D, L * D, D, 1]).set_data_type(fp8)
        stats.set_output(True).set_dim([B, H, L, 1]).set_stride([H * L, L, 1, 1]).set_data_type(f32)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph, self.o, self.stats, self.amax = g, o, stats, (amax_s, amax_o)
        self.out = torch.empty(B, H, L, D, dtype=torch.float8_e4m3fn, device=device)
        self.lse = torch.empty(B, H, L, 1, dtype=torch.float32, device=device)
        self.amax_out = [torch.empty(1, 1, 1, 1, dtype=torch.float32, device=device) for _ in range(2)]
        self.workspace = torch.empty(g.get_workspace_size(), dtype=torch.uint8, device=device)

    def __call__(self, q8, k8, v8, scalars: dict[str, torch.Tensor]):
        pack = {self.q: q8, self.k: k8, self.v: v8, self.o: self.out, self.stats: self.lse,
                self.amax[0]: self.amax_out[0], self.amax[1]: self.amax_out[1]}
        pack.update({self.scalars[n]: t for n, t in scalars.items()})
        self.graph.execute(pack, self.workspace, handle=self.handle)
        return self.out, self.lse


def _errors(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> dict:
    return {"out_rel_err": ((out.float() - ref_out).norm() / ref_out.norm()).item(),
            "out_max_abs_err": (out.float() - ref_out).abs().max().item(),
            "lse_max_abs_err": (lse.float() - ref_lse).abs().max().item()}


def run(args) -> None:
    import cudnn  # nvidia-cudnn-frontend, imported here: only this benchmark needs it

    dev = torch.device("cuda")
    bf16 = DTYPES["bfloat16"]
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    rows = []
    for L in args.lengths:
        gen = torch.Generator(device=dev).manual_seed(L)
        q = (torch.randn(1, H, L, D, device=dev, generator=gen) * args.q_scale).to(bf16)
        k, v = (torch.randn(1, Hkv, L, D, device=dev, generator=gen).to(bf16) for _ in range(2))
        pos = torch.arange(L, device=dev)
        flops = 4 * H * D * L * L / 2  # causal: half of QK^T and PV
        row = {"length": L, "heads": H, "kv_heads": Hkv, "head_dim": D, "q_scale": args.q_scale}

        bf16_s = timed_median(lambda: attention(q, k, v, q_pos=pos, k_pos=pos), dev, args.repeats, 2)
        out_b, lse_b = attention(q, k, v, q_pos=pos, k_pos=pos)

        (q8, dq), (k8, dk), (v8, dv) = _quantize(q), _quantize(k), _quantize(v)
        quant_s = timed_median(lambda: (_quantize(q), _quantize(k), _quantize(v)), dev, args.repeats, 1)
        scale_o = 1.0 / dv  # = 448 / amax(v): the output's range is the range of v
        scalars = {"descale_q": dq, "descale_k": dk, "descale_v": dv,
                   "descale_s": torch.full_like(dq, 1.0 / E4M3_MAX), "scale_s": torch.full_like(dq, E4M3_MAX),
                   "scale_o": scale_o}
        try:
            fp8 = CudnnFp8Attention(cudnn, 1, H, Hkv, L, D, dev)
        except Exception as e:  # an unsupported shape / cuDNN build: say so in the result
            row.update(bf16_s=bf16_s, bf16_tflops=flops / bf16_s / 1e12, fp8_error=f"{type(e).__name__}: {e}")
            rows.append(row)
            print(row, flush=True)
            continue
        fp8_s = timed_median(lambda: fp8(q8, k8, v8, scalars), dev, args.repeats, 2)
        out8, lse8 = fp8(q8, k8, v8, scalars)
        out_f = out8.float() / scale_o.reshape(1, 1, 1, 1)

        # float32 reference for a spread of query rows (the last included): each sees keys <= its position
        sel = torch.linspace(0, L - 1, args.check_rows, device=dev).round().long().unique()
        ref_out, ref_lse = attention_math(q[:, :, sel].float(), k.float(), v.float(), q_pos=sel, k_pos=pos)
        row.update(
            bf16_s=bf16_s, bf16_tflops=flops / bf16_s / 1e12,
            fp8_s=fp8_s, fp8_tflops=flops / fp8_s / 1e12, fp8_quantize_s=quant_s,
            speedup=bf16_s / fp8_s, speedup_with_quantize=bf16_s / (fp8_s + quant_s),
            bf16_vs_fp32=_errors(out_b[:, :, sel], lse_b[:, :, sel], ref_out, ref_lse),
            fp8_vs_fp32=_errors(out_f[:, :, sel], lse8[:, :, sel, 0], ref_out, ref_lse),
        )
        rows.append(row)
        print(row, flush=True)
        del fp8, q8, k8, v8, out8, out_f, q, k, v, out_b
        torch.cuda.empty_cache()
    write(args.out, {**header("fp8-attention", dev, 1, args, cudnn_frontend=cudnn.__version__,
                              cudnn_backend=getattr(cudnn, "backend_version", lambda: None)()), "rows": rows})
