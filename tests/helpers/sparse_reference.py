"""Float64 masked-dense reference for the sparse prefill kernels (MInference, AnchorAttention) and
the check of a kernel's (out, lse) against it."""
from __future__ import annotations

import torch

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3)}  # (relative out error, lse abs error)


def masked_reference(q, k, v, vis, scale=None):
    """Attention of q [B, Hq, Lq, D] over k, v [B, Hkv, Lk, D] where vis [B, Hq, Lq, Lk] is True, in
    float64 -> (out, lse); rows that see nothing give out 0, lse -inf."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ vv, lse


def assert_matches(out, lse, ref, ref_lse, dtype):
    tol_out, tol_lse = TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < tol_out, f"relative error {err:.3e}"
    fin = torch.isfinite(ref_lse)
    assert (lse[fin].double() - ref_lse[fin]).abs().max().item() < tol_lse
    assert torch.isneginf(lse[~fin]).all() and (out[~fin] == 0).all()
