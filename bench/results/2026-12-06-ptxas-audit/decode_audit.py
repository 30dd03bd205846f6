import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from harness import *  # noqa
import torch
from starshard.kernels.decode import decode_attention
bf, f8 = torch.bfloat16, torch.float8_e4m3fn
def cache(cap, hkv, dt=bf):   # token-major store [1, cap, Hkv, D] viewed [1, Hkv, cap, D]
    return torch.empty(1, cap, hkv, 128, dtype=dt).permute(0, 2, 1, 3)
def qmodel(H, L):             # decode q from rope_qk: contiguous [1, H, L, D]
    return torch.empty(1, H, L, 128, dtype=bf)
sel = sys.argv[1] if len(sys.argv) > 1 else "all"
for model, H, Hkv in (("llama", 32, 8), ("qwen", 12, 2)):
    for Lq in (1, 16):
        q = qmodel(H, Lq)
        for cap in (4096, 4099):
            n = cap - 3 if cap % 2 else cap          # valid keys (length) <= capacity
            qp = torch.arange(n - Lq, n)
            if sel in ("all", "bf16"):
                k, v = cache(cap, Hkv), cache(cap, Hkv); kp = torch.arange(cap)
                for causal in (True, False):
                    # eager: a view of the first n rows;  graph: whole cache + device length
                    attempt(f"dec {model} Lq{Lq} cap{cap} c={causal} view", decode_attention, q, k[:, :, :n], v[:, :, :n],
                            q_pos=qp, k_pos=kp[:n], causal=causal, use_triton=True)
                    attempt(f"dec {model} Lq{Lq} cap{cap} c={causal} len", decode_attention, q, k, v, q_pos=qp, k_pos=kp,
                            causal=causal, use_triton=True, length=torch.tensor([n], dtype=torch.int32))
                if model == "llama" and cap == 4096:
                    attempt(f"dec {model} Lq{Lq} window", decode_attention, q, k, v, q_pos=qp, k_pos=kp, causal=True,
                            use_triton=True, window=1024, length=torch.tensor([n], dtype=torch.int32))
                    attempt(f"dec {model} Lq{Lq} softcap", decode_attention, q, k, v, q_pos=qp, k_pos=kp, causal=True,
                            use_triton=True, softcap=50.0)
                    attempt(f"dec {model} Lq{Lq} sinks", decode_attention, q, k, v, q_pos=qp, k_pos=kp, causal=True,
                            use_triton=True, sinks=torch.zeros(H))
            if sel in ("all", "fp8"):
                k, v = cache(cap, Hkv, f8), cache(cap, Hkv, f8); kp = torch.arange(cap)
                ks, vs = torch.empty(1, Hkv, cap), torch.empty(1, Hkv, cap)
                L = torch.tensor([n], dtype=torch.int32)
                for causal in (False, True):
                    for even in ((True, False) if not causal else (True,)):
                        attempt(f"dec8 {model} Lq{Lq} cap{cap} c={causal} even={even}", decode_attention, q, k, v,
                                q_pos=qp, k_pos=kp, causal=causal, use_triton=True, length=L, k_scale=ks, v_scale=vs,
                                options={"even": even})
                if cap == 4096:
                    k2, v2 = torch.empty(1, cap, Hkv, 128, dtype=f8).permute(0, 2, 1, 3), None
                    attempt(f"dec8 {model} Lq{Lq} cap{cap} even tma(contig)", decode_attention, q,
                            torch.empty(1, Hkv, cap, 128, dtype=f8), torch.empty(1, Hkv, cap, 128, dtype=f8),
                            q_pos=qp, k_pos=kp, causal=False, use_triton=True, length=L, k_scale=ks, v_scale=vs,
                            options={"tma": True})
    if sel in ("all", "table"):
        # TableCascade: q rows of B sequences as one block [1, Hq, B*L, D]; anchors = a cache's k, v, k_pos
        for rows in (1, 16):
            qg = torch.empty(rows, H, 1, 128, dtype=bf).transpose(0, 1).reshape(1, H, rows, 128)
            k, v = cache(4096, Hkv), cache(4096, Hkv); kp = torch.arange(4096)
            table = torch.tensor([0, 0, 0, 4000], dtype=torch.int64)
            attempt(f"dec table {model} rows{rows}", decode_attention, qg, k, v, q_pos=torch.full((rows,), 4000),
                    k_pos=kp, causal=True, use_triton=True, table=table)
