"""The Vertical-Slash estimate's softmax rows in two Triton launches (issue 18: the index build).

    estimate_probs(q, k, z, vscore, h0=..., h1=..., rows=R, offset=off, scale=s)

For query heads h0..h1-1, the last R query rows' causal softmax over all keys (q . k, float32) is
written into z [B, h1 - h0, R, W] at columns R-1 .. R-1+Lk-1 (masked entries 0; z's other columns are
the caller's) and its column sums into vscore[:, h0:h1]: what `index.vs_estimate` computed with a
matmul into z, a scale, a mask, a softmax and a sum (eight passes over z at 128K keys; 5.3 ms of a
SmolLM2 layer's 7.3 ms index build on one H200; docs/results.md, FP8).
Launch 1 streams the keys once for each row's max and sum (partials over key chunks, merged in torch);
launch 2 recomputes the scores per key block and writes the probabilities: z is written once.
Runs on CUDA or under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch

from starshard.kernels.common import cdiv, sm_count
from starshard.kernels.online_softmax import LOG2E, qk_dot

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton keep index.py's torch path
    triton = None

BLOCK_N = 128  # keys per tile


if triton is not None:

    @triton.jit
    def _rows(Q, b, h, s_qb, s_qh, s_qm, Lq, R, offset, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_D: tl.constexpr):
        """The last R query rows of head h: q [BLOCK_R, BLOCK_D], their key indices and validity."""
        r = tl.arange(0, BLOCK_R)
        row_ok = r < R
        qi = Lq - R + r
        d = tl.arange(0, BLOCK_D)
        q = tl.load(Q + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh + qi[:, None].to(tl.int64) * s_qm + d[None, :],
                    mask=row_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        return q, qi + offset, row_ok

    @triton.jit
    def _scores(q, K, kvh_off, s_kn, cols, col_ok, qidx, row_ok, qk_scale, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
        """Scores (log2 units) of the rows against keys `cols`, -inf where invisible, and the mask."""
        d = tl.arange(0, BLOCK_D)
        kt = tl.load(K + kvh_off + cols[None, :].to(tl.int64) * s_kn + d[:, None],
                     mask=col_ok[None, :] & (d < HEAD_DIM)[:, None], other=0.0)
        s = qk_dot(q, kt, IEEE) * qk_scale
        visible = row_ok[:, None] & col_ok[None, :] & (cols[None, :] <= qidx[:, None])
        return tl.where(visible, s, float("-inf")), visible

    @triton.jit
    def _row_stats_kernel(Q, K, MP, LP, qk_scale,
                          s_qb, s_qh, s_qm, s_kb, s_kh, s_kn,
                          n, h0, G, Lq, Lk, R, offset, chunk, n_chunks,
                          HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Per row: running max m and sum l = sum 2^(s - m) over one key chunk (partials)."""
        pid = tl.program_id(0)  # b * n + local head
        c = tl.program_id(1)
        b = pid // n
        h = h0 + pid % n
        q, qidx, row_ok = _rows(Q, b, h, s_qb, s_qh, s_qm, Lq, R, offset, HEAD_DIM, BLOCK_R, BLOCK_D)
        kvh_off = b.to(tl.int64) * s_kb + (h // G).to(tl.int64) * s_kh
        m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_R], dtype=tl.float32)
        lo = c * chunk
        hi = tl.minimum(lo + chunk, Lk)
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            s, _ = _scores(q, K, kvh_off, s_kn, cols, cols < hi, qidx, row_ok, qk_scale, HEAD_DIM, BLOCK_D, IEEE)
            m_new = tl.maximum(m, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            l = l * tl.math.exp2(m - m_use) + tl.sum(tl.math.exp2(s - m_use[:, None]), 1)
            m = m_new
        r = tl.arange(0, BLOCK_R)
        out = (pid * n_chunks + c).to(tl.int64) * BLOCK_R + r
        tl.store(MP + out, m)
        tl.store(LP + out, l)

    @triton.jit
    def _probs_kernel(Q, K, M, L, Z, VS, qk_scale,
                      s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_zb, s_zh, s_zr, s_vb, s_vh,
                      n, h0, G, Lq, Lk, R, offset,
                      HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """One key block: p = 2^(s - m) / l per row into z (row r at column R-1+j), column sums into VS."""
        pid = tl.program_id(0)
        b = pid // n
        hl = pid % n
        h = h0 + hl
        q, qidx, row_ok = _rows(Q, b, h, s_qb, s_qh, s_qm, Lq, R, offset, HEAD_DIM, BLOCK_R, BLOCK_D)
        kvh_off = b.to(tl.int64) * s_kb + (h // G).to(tl.int64) * s_kh
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < Lk
        s, visible = _scores(q, K, kvh_off, s_kn, cols, col_ok, qidx, row_ok, qk_scale, HEAD_DIM, BLOCK_D, IEEE)
        r = tl.arange(0, BLOCK_R)
        m = tl.load(M + pid.to(tl.int64) * BLOCK_R + r)
        m = tl.where(row_ok, m, 0.0)  # padding rows have m = -inf: keep -inf - -inf out of the exponent
        inv_l = 1.0 / tl.load(L + pid.to(tl.int64) * BLOCK_R + r)
        p = tl.where(visible, tl.math.exp2(s - m[:, None]) * inv_l[:, None], 0.0)
        z = Z + b.to(tl.int64) * s_zb + hl.to(tl.int64) * s_zh + r[:, None].to(tl.int64) * s_zr + (R - 1) + cols[None, :]
        tl.store(z, p, mask=row_ok[:, None] & col_ok[None, :])
        tl.store(VS + b.to(tl.int64) * s_vb + h.to(tl.int64) * s_vh + cols, tl.sum(p, 0), mask=col_ok)


# On for CUDA since a GPU run checked them (bench/minference_index_bench.py; docs/results.md, Sparse prefill;
# one H200, SmolLM2 shapes at 128K keys): their column scores within 1.2e-9 of float64 (the torch ops'
# bf16 products: 2.4e-5), picks keeping all of the float64 picks' mass; in bf16 the picks 1.2-2.7x and
# the column lists 2.0-3.0x faster than the torch ops (SmolLM2 and Llama-8B shapes). Not for float32
# inputs on a GPU: there the IEEE dot product made the estimate 3.7x slower than torch's matmul.
ON_CUDA_BY_DEFAULT = True


def use_estimate_kernel(q: torch.Tensor) -> bool:
    """Whether vs_estimate uses the kernels by default: CUDA inputs in 16-bit floats, when enabled."""
    return ON_CUDA_BY_DEFAULT and triton is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def estimate_probs(q, k, z, vscore, *, h0: int, h1: int, rows: int, offset: int, scale: float) -> None:
    """Fill z[..., R-1 : R-1+Lk] and vscore[:, h0:h1] for query heads h0..h1-1 (module docstring).
    q [B, Hq, Lq, D], k [B, Hkv, Lk, D] (last dim contiguous); z float32 [B, h1-h0, R, W >= Lk + R - 1]
    with unit stride along W; vscore float32 [B, Hq, Lk] with unit stride along Lk."""
    if triton is None:
        raise RuntimeError("estimate_probs: the Triton kernels need the triton package")
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    n, R = h1 - h0, rows
    if q.stride(3) != 1 or k.stride(3) != 1 or z.stride(3) != 1 or vscore.stride(2) != 1:
        raise ValueError("estimate_probs: q, k, z and vscore need unit stride along their last dimension")
    block_r = max(16, triton.next_power_of_2(R))
    block_d = max(16, triton.next_power_of_2(D))
    ieee = q.dtype == torch.float32
    scale2 = scale * LOG2E
    programs = 4 * (sm_count(q.device) if q.is_cuda else 2)  # enough key chunks to fill the GPU
    chunk = BLOCK_N * cdiv(cdiv(Lk, max(1, programs // max(1, B * n))), BLOCK_N)
    n_chunks = cdiv(Lk, chunk)
    m_part = torch.empty(B * n, n_chunks, block_r, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    common = dict(HEAD_DIM=D, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_N=BLOCK_N, IEEE=ieee, num_warps=4)
    _row_stats_kernel[(B * n, n_chunks)](q, k, m_part, l_part, scale2, q.stride(0), q.stride(1), q.stride(2),
                                         k.stride(0), k.stride(1), k.stride(2), n, h0, Hq // Hkv, Lq, Lk, R, offset,
                                         chunk, n_chunks, **common)
    m = m_part.max(1).values  # every estimate row sees key 0, so m is finite on rows < R
    l = (l_part * torch.exp2(m_part - m.nan_to_num(neginf=0.0)[:, None])).sum(1)
    m, l = m.contiguous(), torch.where(l > 0, l, 1.0).contiguous()  # padding rows: never read into z
    _probs_kernel[(B * n, cdiv(Lk, BLOCK_N))](q, k, m, l, z, vscore, scale2, q.stride(0), q.stride(1), q.stride(2),
                                              k.stride(0), k.stride(1), k.stride(2), z.stride(0), z.stride(1),
                                              z.stride(2), vscore.stride(0), vscore.stride(1), n, h0, Hq // Hkv,
                                              Lq, Lk, R, offset, **common)
