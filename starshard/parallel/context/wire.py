"""Keys and values on the wire between CP ranks, and a count of the bytes sent.

With an FP8 KV cache (--fp8 kv) the context strategies send keys and values as e4m3 plus one float32
scale per (KV head, token), instead of the compute dtype:

    buf = pack_fp8(x)                      # x [..., D] -> uint8 [..., D + 4]: e4m3 bytes, then the scale's 4
    x = unpack_fp8(buf, dtype)             # dequantized on arrival: what the FP8 cache holds for x

Why the receiver attends dequantized keys rather than the keys as computed: quantize_rows scales each
(head, token) row by itself, so the bytes that travel are exactly the bytes the sender's FP8 cache
stores for those keys. A received key is therefore attended in prefill as decode will read it from
the cache. A rank's own keys stay exact, as a one-device FP8 prefill attends the keys it computes.
The scale rides beside its row, so a block stays one message. Per (head, token): D + 4 bytes instead
of D * element size, 0.52x of bf16 at D = 128.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from starshard.engine.kv_cache import LayerKV
from starshard.kernels.fp8 import FP8_DTYPE, dequantize, quantize_rows

SCALE_BYTES = 4  # one float32 scale per row


def fp8_wire(cache: LayerKV | None) -> bool:
    """Whether K/V travel as e4m3: the layer's cache is FP8 (what the peers receive is what they store)."""
    return cache is not None and cache.fp8


def pack_fp8(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> uint8 [..., D + 4]: quantize_rows' e4m3 bytes, then its float32 scale's bytes."""
    x8, scale = quantize_rows(x)
    return torch.cat([x8.view(torch.uint8), scale.unsqueeze(-1).contiguous().view(torch.uint8)], dim=-1)


def unpack_fp8_raw(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [..., D + 4] -> (e4m3 [..., D], float32 scales [...]) as quantize_rows gave them."""
    D = buf.shape[-1] - SCALE_BYTES
    return buf[..., :D].view(FP8_DTYPE), buf[..., D:].contiguous().view(torch.float32).squeeze(-1)


def unpack_fp8(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., D + 4] -> the dequantized rows [..., D] in `dtype` (kernels/fp8.py dequantize)."""
    return dequantize(*unpack_fp8_raw(buf), dtype)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class WireStats:
    """Bytes of keys and values this rank sent to other ranks in prefill, counted on the host as the
    transfers are posted (no sync). Queries, outputs and lse are not counted, positions only where they
    ride in the K/V message (APB's passing blocks: 8 bytes per entry). A collective
    counts what leaves this rank whatever its algorithm: an all-to-all the (cp-1)/cp of the tensor that
    goes to the peers, an all-gather this rank's buffer once per peer. `local_kv_bytes`: the part sent by
    local (sliding-window) layers, where the sender tags it (ring attention: a local layer's window edges
    or ring steps), so a benchmark can set a local layer's traffic against a global one's."""

    kv_bytes: int = 0
    local_kv_bytes: int = 0

    def add(self, n: int, local: bool = False) -> None:
        self.kv_bytes += int(n)
        if local:
            self.local_kv_bytes += int(n)

    def reset(self) -> None:
        self.kv_bytes = self.local_kv_bytes = 0
