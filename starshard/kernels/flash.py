"""Triton flash-attention forward with log-sum-exp and a position-causal mask (docs/design.md contract).

    out, lse = flash_attention(q, k, v, q_pos=..., k_pos=..., causal=True, scale=None)

A key is visible to a query row iff k_pos <= q_pos, so query and key blocks may sit anywhere in the
sequence (ring chunks, zigzag shards, Star's anchor + block). GQA maps each query head to its KV head
inside the kernel; K/V are never repeated. Rows that see no key get out = 0 and lse = -inf.

Work per query block is cut into two key-block ranges computed on the device from block-wise
position bounds (no host sync): a prefix of key blocks every row of the block sees entirely (no mask
arithmetic), then the blocks up to the last one any row can see (masked). For sorted positions this
skips every invisible block; for arbitrary positions it stays exact, just masks more. With a sliding
`window` a third range comes first: the key blocks before it, wholly out of every row's window, are
skipped, and the blocks on the window's lower edge are masked.

`window`, `softcap` and `sinks` (attention.py contract) are compile-time switches (WINDOW, SOFTCAP,
SINK): without them the kernel is the one it was.
"""
from __future__ import annotations

import torch

from starshard.kernels.common import as_positions, cdiv, check_extras, check_kernel_inputs, check_shapes
from starshard.kernels.online_softmax import (LOG2E, qk_dot, softcap_scores, softmax_finish, softmax_finish_sink,
                                              softmax_init, softmax_step, softmax_update)

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # installs without triton (non-Linux CPU): the dispatcher never routes here
    triton = None


if triton is not None:

    @triton.jit
    def _load_kv(K, V, kt_ptrs, v_ptrs, kv_row, start, s_kn, s_vn, col_ok, d_ok,
                 MASK_COLS: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr):
        """K^T [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D] of key block `start`; masked entries are 0.

        With USE_TMA, K and V are descriptors over the contiguous [B * Hkv * Lk, D] rows: a tail block
        reads the next head's rows (finite data, later weighted by exactly 0) or zero fill at the end."""
        if USE_TMA:
            kt = K.load([kv_row + start, 0]).T
            v = V.load([kv_row + start, 0])
        elif MASK_COLS:
            kt = tl.load(kt_ptrs + start * s_kn, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs + start * s_vn, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            kt = tl.load(kt_ptrs + start * s_kn)
            v = tl.load(v_ptrs + start * s_vn)
        else:
            kt = tl.load(kt_ptrs + start * s_kn, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs + start * s_vn, mask=d_ok[None, :], other=0.0)
        return kt, v

    # Lengths change every call: don't compile a variant per divisibility of Lq/Lk.
    @triton.jit(do_not_specialize=["Lq", "Lk", "n_qblocks"])
    def _flash_fwd_kernel(
        Q, K, V, O, LSE, QPOS, KPOS, RANGES, SINKS,
        qk_scale, window, cap_in, cap_out,
        s_qb, s_qh, s_qm, s_qd,
        s_kb, s_kh, s_kn, s_kd,
        s_vb, s_vh, s_vn, s_vd,
        s_ob, s_oh, s_om, s_od,
        s_qpb, s_kpb, s_rb,
        H, G, Lq, Lk, n_qblocks,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, IEEE: tl.constexpr, USE_TMA: tl.constexpr,
        WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, SINK: tl.constexpr = False,
    ):
        # Heaviest query blocks (latest positions, most keys) first: shortens the tail of a causal grid.
        pid_m = n_qblocks - 1 - tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        kvh = h // G
        EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < Lq
        d_ok = offs_d < HEAD_DIM

        q_ptrs = Q + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        kv_row = (b * (H // G) + kvh) * Lk  # first row of this (batch, KV head) in the TMA view
        if USE_TMA:
            kt_ptrs = K
            v_ptrs = V
        else:
            kt_ptrs = K + b.to(tl.int64) * s_kb + kvh.to(tl.int64) * s_kh + offs_n[None, :] * s_kn + offs_d[:, None] * s_kd
            v_ptrs = V + b.to(tl.int64) * s_vb + kvh.to(tl.int64) * s_vh + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd

        full_lo = 0
        if WINDOW:  # (causal only) block_ranges with a window: (first seen, first full, end of full, end)
            n_skip = tl.load(RANGES + b * s_rb + pid_m * 4)
            full_lo = tl.load(RANGES + b * s_rb + pid_m * 4 + 1)
            n_full = tl.load(RANGES + b * s_rb + pid_m * 4 + 2)
            n_blocks = tl.load(RANGES + b * s_rb + pid_m * 4 + 3)
            q_pos = tl.load(QPOS + b * s_qpb + offs_m, mask=row_ok, other=0)
        elif CAUSAL:
            n_full = tl.load(RANGES + b * s_rb + pid_m * 2)
            n_blocks = tl.load(RANGES + b * s_rb + pid_m * 2 + 1)
            q_pos = tl.load(QPOS + b * s_qpb + offs_m, mask=row_ok, other=0)
        else:
            n_full = Lk // BLOCK_N
            n_blocks = tl.cdiv(Lk, BLOCK_N)

        m_i, l_i, acc = softmax_init(BLOCK_M, BLOCK_D)

        if WINDOW:
            # Blocks on the window's lower edge (those before n_skip are out of every row's window).
            for j in range(n_skip, full_lo):
                start = j * BLOCK_N
                col_ok = (start + offs_n) < Lk
                kt, v = _load_kv(K, V, kt_ptrs, v_ptrs, kv_row, start, s_kn, s_vn, col_ok, d_ok, True, EVEN_D, USE_TMA)
                k_pos = tl.load(KPOS + b * s_kpb + start + offs_n, mask=col_ok, other=0)
                visible = col_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
                if SOFTCAP:
                    qk = softcap_scores(qk_dot(q, kt, IEEE), cap_in, cap_out)
                    m_i, l_i, acc = softmax_update(qk, v, m_i, l_i, acc, visible, 1.0, True, IEEE)
                else:
                    m_i, l_i, acc = softmax_step(q, kt, v, m_i, l_i, acc, visible, qk_scale, True, IEEE)

        # Key blocks every row sees in full: no mask arithmetic.
        for j in range(full_lo, n_full):
            start = j * BLOCK_N
            kt, v = _load_kv(K, V, kt_ptrs, v_ptrs, kv_row, start, s_kn, s_vn, None, d_ok, False, EVEN_D, USE_TMA)
            if SOFTCAP:
                qk = softcap_scores(qk_dot(q, kt, IEEE), cap_in, cap_out)
                m_i, l_i, acc = softmax_update(qk, v, m_i, l_i, acc, None, 1.0, False, IEEE)
            else:
                m_i, l_i, acc = softmax_step(q, kt, v, m_i, l_i, acc, None, qk_scale, False, IEEE)

        # Blocks on the causal boundary and the key tail: masked by position and length.
        for j in range(n_full, n_blocks):
            start = j * BLOCK_N
            col_ok = (start + offs_n) < Lk
            kt, v = _load_kv(K, V, kt_ptrs, v_ptrs, kv_row, start, s_kn, s_vn, col_ok, d_ok, True, EVEN_D, USE_TMA)
            visible = col_ok[None, :]
            if CAUSAL:
                k_pos = tl.load(KPOS + b * s_kpb + start + offs_n, mask=col_ok, other=0)
                visible = visible & (k_pos[None, :] <= q_pos[:, None])
                if WINDOW:
                    visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            if SOFTCAP:
                qk = softcap_scores(qk_dot(q, kt, IEEE), cap_in, cap_out)
                m_i, l_i, acc = softmax_update(qk, v, m_i, l_i, acc, visible, 1.0, True, IEEE)
            else:
                m_i, l_i, acc = softmax_step(q, kt, v, m_i, l_i, acc, visible, qk_scale, True, IEEE)

        if SINK:
            out, lse = softmax_finish_sink(m_i, l_i, acc, tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634)
        else:
            out, lse = softmax_finish(m_i, l_i, acc, False)
        o_ptrs = O + b.to(tl.int64) * s_ob + h.to(tl.int64) * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + pid_bh.to(tl.int64) * Lq + offs_m, lse, mask=row_ok)


def default_config(head_dim: int, element_size: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim: common Hopper choices, not
    yet tuned here (launch/bench.py kernels sweeps them). float32 (element_size 4) at head dim 256
    takes half the tiles: 64 x 256 float32 tiles over two stages need ~320 KB of shared memory, above
    Hopper's 227 KB (sm_90a builds: 100 KB with the half tiles; 16-bit inputs at 64 x 64: 97 KB)."""
    if head_dim <= 64:
        return 128, 64, 4, 3
    if head_dim <= 128:
        return 128, 64, 8, 3
    if element_size > 2:
        return 32, 32, 4, 2
    return 64, 64, 4, 2


def block_ranges(q_pos: torch.Tensor, k_pos: torch.Tensor, block_m: int, block_n: int,
                 window: int | None = None) -> torch.Tensor:
    """Per query block: (number of leading key blocks fully visible to every row, number of key
    blocks up to the last one visible to some row), int32 [P, n_qblocks, 2], computed on the device.

    Exact for any positions: the first count is a prefix where the running max of key positions is
    at or below the block's smallest query position; the second ends at the last key block whose
    smallest position is at or below the block's largest query position (suffix-min search).

    With a `window`: int32 [P, n_qblocks, 4], (n_skip, full_lo, n_full, n_blocks). The n_skip leading
    blocks hold only keys at or below q_min - window (running max), out of every row's window; blocks
    from full_lo on hold only keys above q_max - window (suffix min), so [full_lo, n_full) is seen in
    full by every row. n_skip <= full_lo <= n_full <= n_blocks."""
    P, Lq = q_pos.shape
    Lk = k_pos.shape[1]
    big = 1 << 62  # beyond any position; pad() takes its fill value as a double, so not int64 max
    nqb, nkb = cdiv(Lq, block_m), cdiv(Lk, block_n)
    qp, kp = q_pos.to(torch.int64), k_pos.to(torch.int64)
    pad_q, pad_k = nqb * block_m - Lq, nkb * block_n - Lk
    q_min = torch.nn.functional.pad(qp, (0, pad_q), value=big).view(P, nqb, block_m).amin(-1)
    q_max = torch.nn.functional.pad(qp, (0, pad_q), value=-big).view(P, nqb, block_m).amax(-1)
    # Padding the key tail with +big keeps a partial last block out of the unmasked prefix.
    kp = torch.nn.functional.pad(kp, (0, pad_k), value=big).view(P, nkb, block_n)
    prefix_max = kp.amax(-1).cummax(-1).values
    suffix_min = kp.amin(-1).flip(-1).cummin(-1).values.flip(-1)
    n_full = torch.searchsorted(prefix_max, q_min, right=True)
    n_blocks = torch.maximum(torch.searchsorted(suffix_min, q_max, right=True), n_full)
    if window is None:
        return torch.stack([n_full, n_blocks], -1).to(torch.int32).contiguous()
    n_skip = torch.minimum(torch.searchsorted(prefix_max, q_min - window, right=True), n_full)
    full_lo = torch.minimum(torch.maximum(torch.searchsorted(suffix_min, q_max - window, right=True), n_skip), n_full)
    return torch.stack([n_skip, full_lo, n_full, n_blocks], -1).to(torch.int32).contiguous()


def _tma_ok(t: torch.Tensor, block_d: int) -> bool:
    """Descriptors here view K/V as contiguous [rows, D] with a power-of-two D; the copy engine
    wants a 16-byte aligned base and row stride."""
    return t.shape[-1] == block_d and t.is_contiguous() and t.data_ptr() % 16 == 0 and block_d * t.element_size() % 16 == 0


def flash_attention(q, k, v, *, q_pos, k_pos, causal=True, scale=None, config=None, tma=False, window=None,
                    softcap=None, sinks=None):
    """Triton forward. q [B, Hq, Lq, D]; k, v [B, Hkv, Lk, D]; positions [L] or [B, L].
    `window`, `softcap`, `sinks`: the attention.py contract (sinks [Hq]: the lse excludes them).
    `config` = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides `default_config` (tests, tuning).
    `tma=True` loads K/V through tensor descriptors (Hopper's copy engine) when K/V are contiguous;
    off by default until launch/bench.py kernels has measured it against plain loads on a GPU."""
    check_shapes(q, k, v)
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    check_kernel_inputs(q, k, v, "flash_attention")
    check_extras(q, causal, window, softcap, sinks, "flash_attention")
    if triton is None:
        raise RuntimeError("flash_attention: the Triton kernel needs the triton package")
    scale = D**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    if Lq == 0 or B * Hq == 0:
        return out, lse
    if Lk == 0:
        return out.zero_(), lse.fill_(float("-inf"))  # with sinks too: no key, out 0
    block_d = max(16, triton.next_power_of_2(D))
    block_m, block_n, warps, stages = config or default_config(block_d, q.element_size())
    n_qblocks = triton.cdiv(Lq, block_m)
    if causal:
        qp = as_positions(q_pos, B, Lq, "q_pos", q.device)
        kp = as_positions(k_pos, B, Lk, "k_pos", q.device)
        if qp.shape[0] != kp.shape[0]:  # one side per batch: give both a batch dim
            qp, kp = qp.expand(B, Lq).contiguous(), kp.expand(B, Lk).contiguous()
        ranges = block_ranges(qp, kp, block_m, block_n, window)
        s_pb = 0 if qp.shape[0] == 1 else 1
        s_qpb, s_kpb, s_rb = s_pb * Lq, s_pb * Lk, s_pb * n_qblocks * ranges.shape[-1]
    else:
        qp = kp = ranges = lse  # unused by the kernel when CAUSAL is off
        s_qpb = s_kpb = s_rb = 0
    tma = bool(tma) and _tma_ok(k, block_d) and _tma_ok(v, block_d)
    if tma:
        rows = B * Hkv * Lk
        k_arg = TensorDescriptor(k, [rows, D], [D, 1], [block_n, block_d])
        v_arg = TensorDescriptor(v, [rows, D], [D, 1], [block_n, block_d])
    else:
        k_arg, v_arg = k, v
    grid = (n_qblocks, B * Hq)
    extras = {}  # only the switches that are on: the default launch is the kernel as it was
    if window is not None:
        extras["WINDOW"] = True
    if softcap is not None:
        extras["SOFTCAP"] = True
    if sinks is not None:
        extras["SINK"] = True
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    cap = float(softcap) if softcap is not None else 1.0
    _flash_fwd_kernel[grid](
        q, k_arg, v_arg, out, lse, qp, kp, ranges, sinks if sinks is not None else lse,
        scale * LOG2E, int(window or 0), scale / cap, cap * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        s_qpb, s_kpb, s_rb,
        Hq, Hq // Hkv, Lq, Lk, n_qblocks,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal), IEEE=q.dtype == torch.float32, USE_TMA=tma,
        num_warps=warps, num_stages=stages, **extras,
    )
    return out, lse
