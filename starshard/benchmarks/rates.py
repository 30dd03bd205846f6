"""The rates a prefill's FLOP model is read at, measured on this rank's card in the same process (so the
same lease): the GEMM rate at the model's own projection shapes per tp rank (the FP8 GEMM under
--fp8 linear), the causal attention rate at this rank's heads and rows, and the tp group's all-reduce
rate on a rows x hidden tensor (the bytes of the tensor over the all-reduce's seconds).

strategies/flops.py counts the work; PrefillFlops.seconds(gemm, attention, allreduce) turns the two into
the prediction that `bench prefill` sets beside the measured time.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from starshard.benchmarks.common import timed
from starshard.config import ModelConfig
from starshard.kernels.attention import causal_attention
from starshard.kernels.fp8 import fp8_linear, quantize_rows


def probe_rows(device: torch.device) -> int:
    """Rows of the GEMM and all-reduce probes: a long prefill's chunk-sized calls on a GPU; few on the
    CPU (tests), where the rates only fill the JSON."""
    return 8192 if device.type == "cuda" else 128


def projection_shapes(cfg: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """(out, in) of one layer's projections on one tp rank: QKV, O, gate and up, down."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return [((q + 2 * kv) // tp, h), (h, q // tp), (2 * i // tp, h), (h, i // tp)]


def _median(fn, device, repeats: int = 3) -> float:
    return statistics.median(timed(fn, device, repeats, warmup=1))


def gemm_rate(cfg: ModelConfig, tp: int, rows: int, dtype: torch.dtype, device: torch.device,
              fp8_linear_on: bool = False) -> float:
    """FLOP/s of one layer's projections (projection_shapes) on `rows` rows, one after another as the
    model runs them; the FP8 GEMM (activations quantized per row, as engine's FP8 linears) with fp8."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = {k: torch.randn(rows, k, dtype=dtype, device=device, generator=gen) for _, k in projection_shapes(cfg, tp)}
    ws = []
    for n, k in projection_shapes(cfg, tp):
        w = torch.randn(n, k, dtype=dtype, device=device, generator=gen) * 0.02
        ws.append((k, quantize_rows(w) if fp8_linear_on else w))

    def layer():
        for k, w in ws:
            if fp8_linear_on:
                fp8_linear(x[k], w[0], w[1], weight_only=False)
            else:
                x[k] @ w.T

    flops = sum(2.0 * rows * n * k for n, k in projection_shapes(cfg, tp))
    return flops / _median(layer, device)


def attention_rate(cfg: ModelConfig, tp: int, rows: int, dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of causal attention over `rows` rows with this tp rank's heads (the kernel the model's
    prefill calls); FLOPs as strategies/flops.py counts them (visible pairs only)."""
    hq, hkv, d = cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp), cfg.head_dim
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(1, hq, rows, d, dtype=dtype, device=device, generator=gen)
    k = torch.randn(1, hkv, rows, d, dtype=dtype, device=device, generator=gen)
    v = torch.randn(1, hkv, rows, d, dtype=dtype, device=device, generator=gen)
    flops = 4.0 * hq * d * rows * (rows + 1) / 2
    return flops / _median(lambda: causal_attention(q, k, v), device)


def allreduce_rate(cfg: ModelConfig, rows: int, dtype: torch.dtype, device: torch.device, group,
                   barrier=None) -> float | None:
    """Bytes/s of an all-reduce of a rows x hidden tensor over the tp `group` (None without one)."""
    if group is None:
        return None
    x = torch.ones(rows, cfg.hidden_size, dtype=dtype, device=device)
    t = statistics.median(timed(lambda: dist.all_reduce(x, group=group), device, 5, warmup=2, barrier=barrier))
    return x.numel() * x.element_size() / t
