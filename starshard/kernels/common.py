"""Input checks, position layouts and sizes shared by the dispatcher (attention.py) and every kernel.

A leaf: plain torch, no Triton, no other kernels module, so each kernel and the dispatcher import it
without importing one another.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

# Query rows at or below which calls take the split-KV decode kernel (CUDA) or the math path (CPU),
# without classifying the mask: too few rows to fill a GPU one program per (head, row block).
DECODE_MAX_ROWS = 16
# Query blocks shorter than this (decode steps) run the sparse prefill methods dense: no sparse
# estimate is meaningful.
MIN_SPARSE_ROWS = DECODE_MAX_ROWS + 1
INT32_MAX = 2**31 - 1  # index sentinels and "covers every key" budgets of the int32 kernel arguments


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def for_head_dim(measured: dict, head_dim: int, wider):
    """The entry of `measured` (keyed by head dim) for the smallest measured head dim >= head_dim (the
    kernels' tiles pad a head dim up to that), else `wider`: what the rates measured per head dim hand
    to the sparse cost models (minference.measured_rates, anchor.measured_anchor_rates)."""
    return next((measured[d] for d in sorted(measured) if head_dim <= d), wider)


@dataclass(frozen=True)
class _Known:
    """What the host knows of a position tensor's layout (`mark_arange`, `mark_increasing`, `mark_end`)."""
    start: int | None  # a run start, start + 1, ...
    increasing: bool  # strictly increasing (gaps allowed)
    end: int | None  # max + 1


# id -> (weak reference, _Known): the note goes with the tensor and dies with it.
_NOTES: dict[int, tuple] = {}


def _note(pos: torch.Tensor, known: _Known, what: str) -> torch.Tensor:
    if pos.dim() != 1:
        raise ValueError(f"{what} takes 1-D positions, got shape {tuple(pos.shape)}")
    key = id(pos)
    _NOTES[key] = (weakref.ref(pos, lambda _: _NOTES.pop(key, None)), known)
    return pos


def _known(pos: torch.Tensor) -> _Known | None:
    entry = _NOTES.get(id(pos))
    return entry[1] if entry is not None and entry[0]() is pos else None


def mark_arange(pos: torch.Tensor, start: int) -> torch.Tensor:
    """Note on the host that 1-D `pos` holds start, start + 1, ... (made by torch.arange and never
    written afterwards), so that `query_offset` and `attention.mask_mode` take its layout from here
    instead of reading the device (a host sync per attention call, which leaves the GPU idle while
    the host launches what follows). The note goes with the tensor. Returns pos."""
    return _note(pos, _Known(int(start), True, int(start) + pos.numel()), "mark_arange")


def mark_increasing(pos: torch.Tensor, end: int | None = None) -> torch.Tensor:
    """Note on the host that 1-D `pos` is strictly increasing (built so on the host, never written
    afterwards; gaps allowed: Star's [anchor; block]), and with `end` that its last position is end - 1. A
    call given the same tensor as q_pos and k_pos is then index-causal at offset 0, which `query_offset` and
    `attention.mask_mode` answer without a device read; `known_end` answers the model's cache the same way.
    Returns pos. (A run's note says more and stays.)"""
    known = _known(pos)
    if known is not None and known.start is not None:
        return pos
    return _note(pos, _Known(None, True, end if end is not None or known is None else known.end), "mark_increasing")


def mark_end(pos: torch.Tensor, end: int) -> torch.Tensor:
    """Note on the host that max(pos) = end - 1, for `known_end` (positions in no known order: APB's query rows
    before its block; what an earlier note says of the order stays). Returns pos."""
    known = _known(pos) or _Known(None, False, None)
    return _note(pos, _Known(known.start, known.increasing, int(end)), "mark_end")


def arange_start(pos: torch.Tensor) -> int | None:
    """The first position of a tensor marked by `mark_arange`, else None."""
    known = _known(pos)
    return None if known is None else known.start


def known_end(pos: torch.Tensor) -> int | None:
    """max(pos) + 1 where the host knows it (a note with an end), else None: the caller then reads it from the
    device (a sync)."""
    known = _known(pos)
    return None if known is None else known.end


def square_increasing(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """q_pos and k_pos are one tensor known (marked) to be strictly increasing: key j is visible to
    row i iff j <= i."""
    known = _known(q_pos) if q_pos is k_pos else None
    return known is not None and known.increasing


def to_device(values, device, dtype=torch.long) -> torch.Tensor:
    """A small host list as a tensor on `device` without a device sync: torch.tensor(..., device=cuda)
    copies synchronously, which drains the GPU's queue and leaves the next kernels waiting on host
    launches; a non-blocking copy from pageable memory is staged on the host at once (safe to drop)."""
    t = torch.tensor(values, dtype=dtype)
    return t if torch.device(device).type == "cpu" else t.to(device, non_blocking=True)


def upload(t: torch.Tensor, device) -> torch.Tensor:
    """Host tensor `t` on `device` without waiting on the GPU's queue: CUDA gets it from pinned memory,
    non-blocking (from pageable memory the driver may wait for the stream first; the caching host allocator
    keeps the pinned block until the copy is done). Anything else: `t.to(device)`."""
    if t.device.type != "cpu" or torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-D [B, H, L, D] tensors, got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"batch/head_dim mismatch: q{tuple(q.shape)} k{tuple(k.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"GQA needs Hq % Hkv == 0, got Hq={q.shape[1]} Hkv={k.shape[1]}")


def check_kernel_inputs(q, k, v, name: str) -> None:
    """What the dense Triton kernels (flash.py, decode.py) take."""
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{name}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} supports float16/bfloat16/float32, got {q.dtype}")
    if q.shape[-1] > 256:
        raise ValueError(f"{name} supports head_dim <= 256, got {q.shape[-1]}")


def check_extras(q: torch.Tensor, causal: bool, window, softcap, sinks, name: str) -> None:
    """The optional score arguments of the attention contract (attention.py): `window` a positive int
    and only with causal=True (it is measured back from each query's position), `softcap` a positive
    number, `sinks` a float tensor [Hq] (one logit per query head)."""
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"{name}: window must be a positive int (keys per query, itself included), got {window!r}")
        if not causal:
            raise ValueError(f"{name}: window needs causal=True (a query sees keys at positions in (p - window, p])")
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"{name}: softcap must be a positive number, got {softcap!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point or sinks.shape != (q.shape[1],):
            raise ValueError(f"{name}: sinks must be a float tensor [Hq] = [{q.shape[1]}] (one logit per query head), "
                             f"got {getattr(sinks, 'shape', type(sinks))}")


def as_positions(pos: torch.Tensor, B: int, L: int, name: str, device: torch.device) -> torch.Tensor:
    """[L], [1, L] or [B, L] integer positions -> contiguous [P, L] with P in {1, B} on `device`."""
    if pos.dtype.is_floating_point or pos.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {pos.dtype}")
    p = pos if pos.dim() == 2 else pos.unsqueeze(0)
    if p.dim() != 2 or p.shape[1] != L or p.shape[0] not in (1, B):
        raise ValueError(f"{name} must have shape [{L}] or [{B}, {L}], got {tuple(pos.shape)}")
    return p.to(device).contiguous()


def query_offset(q_pos: torch.Tensor, k_pos: torch.Tensor, Lq: int, Lk: int) -> int:
    """Query block offset in key-index space, the layout of the sparse prefill methods (MInference,
    AnchorAttention), one device-to-host sync (none for runs marked by `mark_arange`): row i sits at
    key index i + off. Accepted layouts,
    positions shared by the batch:
    - q_pos and k_pos runs of consecutive positions, q_pos[0] >= k_pos[0]: off = q_pos[0] - k_pos[0];
    - k_pos strictly increasing and q_pos equal to its last Lq entries (a query block that is the
      tail of its keys, gaps allowed: Star's [anchor; block], a zigzag shard's own block): off = Lk - Lq.
    Key j is visible to row i iff j <= i + off, which is causality by position in both cases.
    ValueError for anything else."""

    def flat(p, L, name):
        if p.dtype.is_floating_point or p.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {p.dtype}")
        if p.dim() == 2:
            if p.shape[1] != L:
                raise ValueError(f"{name} must have {L} positions per row, got {tuple(p.shape)}")
            return p[0], (p != p[:1]).any()
        if p.dim() != 1 or p.shape[0] != L:
            raise ValueError(f"{name} must have shape [{L}] or [B, {L}], got {tuple(p.shape)}")
        return p, torch.zeros((), dtype=torch.bool, device=p.device)

    if square_increasing(q_pos, k_pos) and q_pos.shape == (Lq,) and Lq == Lk:
        return 0
    q0, k0 = arange_start(q_pos), arange_start(k_pos)
    if q0 is not None and k0 is not None and q_pos.shape == (Lq,) and k_pos.shape == (Lk,):
        if q0 < k0:  # both runs, known on the host (mark_arange): as read below, without the read
            raise ValueError(f"sparse (MInference) attention needs the query block to start at or after the first key "
                             f"(q_pos[0]={q0} < k_pos[0]={k0}); use dense attention for this layout")
        return q0 - k0
    qp, q_rows_differ = flat(q_pos, Lq, "q_pos")
    kp, k_rows_differ = flat(k_pos, Lk, "k_pos")
    qp, kp = qp.long(), kp.long().to(qp.device)
    zero = qp.new_zeros(())
    tail = (qp != kp[Lk - Lq :]).any().long() if Lq <= Lk else qp.new_ones(())
    stats = torch.stack([
        qp[0], kp[0],
        (qp.diff() != 1).any().long() if Lq > 1 else zero,
        (kp.diff() != 1).any().long() if Lk > 1 else zero,
        (kp.diff() <= 0).any().long() if Lk > 1 else zero,
        tail,
        q_rows_differ.long().to(qp.device), k_rows_differ.long().to(qp.device),
    ]).tolist()
    q0, k0, q_gap, k_gap, k_unsorted, not_tail, q_diff, k_diff = stats
    if q_diff or k_diff:
        raise ValueError("sparse (MInference) attention needs the same positions for every batch row; use dense attention")
    if not q_gap and not k_gap:
        if q0 < k0:
            raise ValueError(f"sparse (MInference) attention needs the query block to start at or after the first key "
                             f"(q_pos[0]={q0} < k_pos[0]={k0}); use dense attention for this layout")
        return int(q0 - k0)
    if not k_unsorted and not not_tail:
        return Lk - Lq
    raise ValueError("sparse (MInference) attention needs q_pos and k_pos to be runs of consecutive positions "
                     "(a contiguous causal block, or a query block at or after the start of its keys), or q_pos "
                     "to be the last entries of strictly increasing k_pos; use dense attention for other layouts")


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def triton_interpreted(fn) -> bool:
    """Whether a @triton.jit function was decorated under TRITON_INTERPRET=1 (runs on CPU tensors)."""
    return type(fn).__name__ == "InterpretedFunction"
