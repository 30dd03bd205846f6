"""The FLOP counts of bench/sparse_components.py: the score entries that `minference.kernel_cost` and
`anchor.kernel_cost` read from an index, times 4 * head_dim, must be exactly the FLOPs the Triton
sparse kernels multiply. Counted here by running the kernels in the interpreter (TRITON_INTERPRET=1)
with every tl.dot intercepted (2 * M * K * N per product), on fresh random inputs with ragged lengths.
The bench's CPU smoke run (the real model, end to end) is a separate, slower command (its docstring)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from starshard.kernels import anchor as an  # noqa: E402
from starshard.kernels import minference as mi  # noqa: E402

pytest.importorskip("triton.runtime.interpreter")


def _qkv(lq, lk, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, lq, d, generator=g) * 1.5
    k, v = torch.randn(1, hkv, lk, d, generator=g), torch.randn(1, hkv, lk, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("lq,lk", [(150, 150), (90, 170)])
def test_minference_cost_is_the_kernels_flops(dot_flops, lq, lk):
    q, k, v = _qkv(lq, lk, seed=lq)
    d, off = q.shape[-1], lk - lq
    pattern = mi.SparsePattern((mi.VerticalSlash(5, 9), mi.VerticalSlash(12, 3), mi.AShape(8, 24), mi.BlockSparse(3)),
                               block_size=16, last_q=16, force_sink=2, force_local=3)
    groups = mi.build_plan(q, k, pattern, offset=off)
    assert {g.kind for g in groups} == {"vertical_slash", "a_shape", "block_sparse"}
    for grp in groups:
        dot_flops.clear()
        mi.attention_from_plan(q, k, v, [grp], offset=off, block_size=16, backend="triton")
        entries = int(mi.kernel_cost(grp, B=1, Lq=lq, Lk=lk, offset=off, block_size=16).sum())
        assert entries > 0 and sum(dot_flops) == entries * 4 * d, grp.kind


@pytest.mark.parametrize("lq,lk,theta", [(200, 200, 3.0), (120, 190, 3.0)])
def test_anchor_cost_is_the_kernels_flops(dot_flops, lq, lk, theta):
    q, k, v = _qkv(lq, lk, seed=lk)
    d, off = q.shape[-1], lk - lq
    cfg = an.AnchorConfig(theta=theta, block_q=16, block_k=16, init_tokens=16, local_window=8, step=2)
    index = an.build_index(q, k, cfg, offset=off, backend="torch")
    counts = index.count
    # stripes kept and dropped, full key chunks and a masked last one
    assert bool((counts < an.index_capacity(cfg, Lq=lq, Lk=lk, offset=off)).all())
    assert bool((counts > 16).any()) and bool((counts % 16 != 0).any())
    dot_flops.clear()
    an.sparse_attention(q, k, v, index, cfg, offset=off, backend="triton")
    cost = an.kernel_cost(index, cfg, Lq=lq, Lk=lk, offset=off)
    assert cost.shape == (1, q.shape[1])
    assert sum(dot_flops) == int(cost.sum()) * 4 * d
    # the kernel computes at least every pair the method keeps (chunks add masked entries)
    causal = sum(min(lk, i + off + 1) for i in range(lq))
    assert bool((cost.double() >= an.head_density(index, cfg, Lq=lq, Lk=lk, offset=off) * causal).all())
