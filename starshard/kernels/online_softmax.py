"""The streaming (online) softmax every Triton attention kernel here runs, as @triton.jit helpers.

    m_i, l_i, acc = softmax_init(BLOCK_M, BLOCK_D)                                          # prologue
    m_i, l_i, acc = softmax_step(q, kt, v, m_i, l_i, acc, visible, qk_scale, MASKED, IEEE)  # a key block
    out, lse = softmax_finish(m_i, l_i, acc, False)                    # epilogue (True: lse in log2 units)

softmax_step is qk_dot then softmax_update; kernels that build the mask after the product (so the
compiler schedules the loads as before) call the two themselves.

Scores live in log2 units: the host passes qk_scale = scale * LOG2E so that exp2 replaces exp. Per
query row the kernel keeps the running max m, the running sum l = sum 2^(s - m) and acc = sum of
2^(s - m) * v. A row that sees no key keeps m = -inf, l = 0, acc = 0 and ends with out = 0,
lse = -inf (the `attention` contract), so partial results merge by lse.

The sparse prefill kernels (MInference, AnchorAttention) work in key-index space (query row i sits at
key index q_idx[i] and sees key j iff j <= q_idx[i]) and gather keys by index: `key_chunk` folds one
chunk of key indices into the softmax, `key_span` a range of consecutive keys chunk by chunk.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ImportError:  # installs without triton (non-Linux CPU): the names import; torch paths never call them

    def _jit(fn):
        return fn


LOG2E = 1.4426950408889634


@_jit
def softmax_init(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Prologue: m = -inf, l = 0, acc = 0 for BLOCK_M rows of a BLOCK_D-wide head (float32)."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    return m_i, l_i, acc


@_jit
def qk_dot(q, kt, IEEE: tl.constexpr):
    """Raw scores q [M, D] . kt [D, N] (float32 accumulate; IEEE: exact float32 products)."""
    if IEEE:
        qk = tl.dot(q, kt, input_precision="ieee")
    else:
        qk = tl.dot(q, kt)
    return qk


@_jit
def softcap_scores(qk, cap_in, cap_out):
    """Logit soft-capping (Gemma 2) of raw scores qk: cap * tanh(scale * qk / cap) in log2 units, with
    cap_in = scale / cap and cap_out = cap * LOG2E from the host; then `softmax_update` with qk_scale 1.
    tanh from exp2 (libdevice's has no interpreter version): sign(x) (1 - e) / (1 + e), e = 2^(-2 |x| log2 e)."""
    x = qk * cap_in
    e = tl.math.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t) * cap_out


@_jit
def softmax_finish_sink(m_i, l_i, acc, sink2):
    """`softmax_finish` (natural-log lse) with an attention sink of logit sink2 (log2 units) in the
    denominator of out only: the lse excludes it (attention.py contract). A row that saw no key: out 0."""
    out = acc / (l_i + tl.math.exp2(sink2 - m_i))[:, None]  # m_i = -inf: 2^inf, acc = 0 -> 0
    return out, row_lse(m_i, l_i, False)


@_jit
def softmax_update(qk, v, m_i, l_i, acc, visible, qk_scale, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """Fold raw scores qk [M, N] of one key block, with v [N, D], into (m_i, l_i, acc).
    MASKED: `visible` (broadcastable to [M, N]) hides scores; off, every score counts (no mask
    arithmetic, and the scale goes on the row max and into the exponent, where it fuses)."""
    if MASKED:
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen nothing yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_use[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_use = m_new
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@_jit
def softmax_update_scaled_v(qk, v, v_scale, m_i, l_i, acc, visible, qk_scale, IEEE: tl.constexpr):
    """`softmax_update` (masked) for values stored as v * v_scale[:, None] with one scale per key
    (an e4m3 cache): the scale goes on the probabilities [M, N] before the product, not on v [N, D].
    The block's largest scale is factored out first, so the probabilities stay in [0, 1] when cast to
    a 16-bit dtype (p * v_scale alone can fall below fp16's normal range, ~6e-5) and multiplies the
    product afterwards."""
    qk = tl.where(visible, qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    s_max = tl.max(v_scale, 0)
    s_max = tl.where(s_max > 0.0, s_max, 1.0)  # a block of masked keys has scales 0
    pv = p * (v_scale / s_max)[None, :]
    if IEEE:
        acc += tl.dot(pv, v, input_precision="ieee") * s_max
    else:
        acc += tl.dot(pv.to(v.dtype), v) * s_max
    return m_new, l_i, acc


@_jit
def softmax_step(q, kt, v, m_i, l_i, acc, visible, qk_scale, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """One key block: scores q . kt, then `softmax_update`."""
    return softmax_update(qk_dot(q, kt, IEEE), v, m_i, l_i, acc, visible, qk_scale, MASKED, IEEE)


@_jit
def row_lse(m_i, l_i, LOG2: tl.constexpr):
    """Log-sum-exp of rows with running max m_i and sum l_i (log2 units): natural log, or log2 units
    with LOG2 (partials that a merge converts once); -inf where l_i == 0 (the row saw no key)."""
    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    if not LOG2:
        lse = lse * 0.6931471805599453  # ln 2
    return lse


@_jit
def softmax_finish(m_i, l_i, acc, LOG2: tl.constexpr):
    """Epilogue: (out = acc / l float32, lse as `row_lse`); rows that saw no key get out = 0."""
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    return out, row_lse(m_i, l_i, LOG2)


@_jit
def key_chunk(q, m_i, l_i, acc, kt_base, v_base, cols, col_ok, s_kn, s_vn, d_ok, q_idx, sink, window, qk_scale,
              MASKED: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr):
    """Keys `cols` (any order or gaps) of one head, folded into the softmax. MASKED: `col_ok` and
    causality (cols <= q_idx) apply, and with WINDOW also j < sink or j > q_idx - window; off, every
    key of the chunk is visible to every row."""
    if MASKED:
        kt = tl.load(kt_base + cols[None, :] * s_kn, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * s_vn, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        kt = tl.load(kt_base + cols[None, :] * s_kn)
        v = tl.load(v_base + cols[:, None] * s_vn)
    else:
        kt = tl.load(kt_base + cols[None, :] * s_kn, mask=d_ok[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * s_vn, mask=d_ok[None, :], other=0.0)
    qk = qk_dot(q, kt, IEEE)
    visible = None
    if MASKED:
        visible = col_ok[None, :] & (cols[None, :] <= q_idx[:, None])
        if WINDOW:
            visible = visible & ((cols[None, :] < sink) | (cols[None, :] > q_idx[:, None] - window))
    return softmax_update(qk, v, m_i, l_i, acc, visible, qk_scale, MASKED, IEEE)


@_jit
def key_span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx, lo, hi, unm_lo, unm_hi,
             sink, window, qk_scale,
             BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr):
    """Keys lo..hi-1 in BLOCK_N chunks; chunks inside [unm_lo, unm_hi) skip all mask arithmetic."""
    n_chunks = (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N
    n_head = tl.minimum((tl.maximum(unm_lo - lo, 0) + BLOCK_N - 1) // BLOCK_N, n_chunks)
    n_fit = tl.maximum(tl.minimum(tl.maximum(unm_hi - lo, 0) // BLOCK_N, n_chunks), n_head)
    for c in range(n_head, n_fit):
        cols = lo + c * BLOCK_N + offs_n
        m_i, l_i, acc = key_chunk(q, m_i, l_i, acc, kt_base, v_base, cols, cols < hi, s_kn, s_vn, d_ok, q_idx,
                                  sink, window, qk_scale, False, WINDOW, EVEN_D, IEEE)
    # Masked chunks, before n_head and from n_fit on, in one loop (one copy of the code).
    for i in range(0, n_head + n_chunks - n_fit):
        c = tl.where(i < n_head, i, i - n_head + n_fit)
        cols = lo + c * BLOCK_N + offs_n
        m_i, l_i, acc = key_chunk(q, m_i, l_i, acc, kt_base, v_base, cols, cols < hi, s_kn, s_vn, d_ok, q_idx,
                                  sink, window, qk_scale, True, WINDOW, EVEN_D, IEEE)
    return m_i, l_i, acc
