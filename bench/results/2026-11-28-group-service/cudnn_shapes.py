"""First-call vs steady cost of the held-prefix attention (q = one 4096 chunk, keys = held prefix) per new key length:
does cuDNN pay a per-shape plan/compile cost that a fresh server meets on every chunk of its first document?"""
import json, sys, time
import torch
from starshard.kernels.attention import _fused
from starshard.kernels.flash import flash_attention

dev = torch.device("cuda")
res = {"device": torch.cuda.get_device_name(0), "cudnn": torch.backends.cudnn.version(), "rows": []}
def timed(f):
    torch.cuda.synchronize(); t = time.perf_counter(); f(); torch.cuda.synchronize(); return time.perf_counter() - t
q = torch.randn(1, 32, 4096, 128, device=dev, dtype=torch.bfloat16)
kmax = torch.randn(1, 8, 131072, 128, device=dev, dtype=torch.bfloat16)
vmax = torch.randn_like(kmax)
for n in list(range(1, 33)) + [7.5, 13.25]:
    Lk = int(4096 * n)
    k, v = kmax[:, :, :Lk], vmax[:, :, :Lk]
    first = timed(lambda: _fused(q, k, v, causal=False, scale=None, op="cudnn"))
    second = timed(lambda: _fused(q, k, v, causal=False, scale=None, op="cudnn"))
    pos_q = torch.arange(Lk, Lk + 4096, device=dev); pos_k = torch.arange(Lk, device=dev)
    tri1 = timed(lambda: flash_attention(q, k, v, q_pos=pos_q, k_pos=pos_k, causal=False))
    tri2 = timed(lambda: flash_attention(q, k, v, q_pos=pos_q, k_pos=pos_k, causal=False))
    res["rows"].append(dict(Lk=Lk, cudnn_first_ms=first * 1e3, cudnn_second_ms=second * 1e3, triton_first_ms=tri1 * 1e3,
                            triton_second_ms=tri2 * 1e3))
    print(res["rows"][-1], flush=True)
# odd query rows (a document's last chunk) over a held prefix
for rows in (1000, 2345, 3999):
    qq = q[:, :, :rows]
    res["rows"].append(dict(Lq=rows, Lk=65536, cudnn_first_ms=1e3 * timed(lambda: _fused(qq, kmax[:, :, :65536], vmax[:, :, :65536], causal=False, scale=None, op="cudnn")),
                            cudnn_second_ms=1e3 * timed(lambda: _fused(qq, kmax[:, :, :65536], vmax[:, :, :65536], causal=False, scale=None, op="cudnn"))))
    print(res["rows"][-1], flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
