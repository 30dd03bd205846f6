"""float64 study: attention output error of quantized q . k on SmolLM2's real q / k / v (essay text).

    python bench/make_essay.py --out /tmp/study/essay.txt --sentences 800
    python bench/results/2026-11-26-h200-int8-attention/qk_quant_study.py   # CPU, ~1 min

Captures every layer's prefill q / k / v of the embedded SmolLM2-135M-Instruct on the first 2048 tokens,
then compares float64 causal attention on quantize-dequantized q / k (output relative error, lse max
error) with float64 attention on the originals. Output of 2026-11-26: qk_quant_study.txt.
"""
import math
import sys

import torch

sys.path.insert(0, ".")
import starshard.kernels.attention as A
import starshard.engine.model as M
from starshard.llm import LLM
torch.manual_seed(0)
caps = []
orig = M.attention
def rec(q, k, v, **kw):
    if q.shape[2] > 1: caps.append((q.detach().clone(), k.detach().clone(), v.detach().clone()))
    return orig(q, k, v, **kw)
M.attention = rec
llm = LLM()
text = open("/tmp/study/essay.txt").read()
ids = llm.tokenizer(text)["input_ids"][:2048]
llm.generate(ids, max_new_tokens=1)  # one prefill: every layer's q, k, v recorded
print("captured", len(caps), caps[0][0].shape, caps[0][1].shape)

def ref(q, k, v):
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, 1); v = v.repeat_interleave(g, 1)
    L = q.shape[2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse

def blocks(x, n):  # [B,H,L,D] -> per-block amax broadcast
    B, H, L, D = x.shape
    Lp = -(-L // n) * n
    xp = torch.nn.functional.pad(x, (0, 0, 0, Lp - L)).view(B, H, Lp // n, n, D)
    a = xp.abs().amax((-1, -2), keepdim=True).expand_as(xp).reshape(B, H, Lp, D)[:, :, :L]
    return a.clamp_min(1e-12)

def e4m3(x, n):
    s = blocks(x, n) / 448
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s

def int8(x, n, rows=False):
    s = (x.abs().amax(-1, keepdim=True).clamp_min(1e-12) if rows else blocks(x, n)) / 127
    return torch.round(x / s).clamp(-127, 127) * s

def run(name, fq, fk, smooth=False):
    errs, lerr = [], []
    for q, k, v in caps:
        q, k, v = q.double(), k.double(), v.double()
        o, l = ref(q, k, v)
        km = k.mean(2, keepdim=True) if smooth else torch.zeros_like(k[:, :, :1])
        o2, l2 = ref(fq(q), fk(k - km) + km, v)  # adding km back: same softmax, lse as exact
        errs.append(((o2 - o).norm() / o.norm()).item()); lerr.append((l2 - l).abs().max().item())
    errs = torch.tensor(errs)
    print(f"{name:38s} out rel err mean {errs.mean():.4f} max {errs.max():.4f} | lse max err {max(lerr):.3f}")

run("e4m3 q128/k128 (variant a)", lambda x: e4m3(x, 128), lambda x: e4m3(x, 128))
run("e4m3 q128/k128 + smooth K", lambda x: e4m3(x, 128), lambda x: e4m3(x, 128), True)
run("int8 q128/k128", lambda x: int8(x, 128), lambda x: int8(x, 128))
run("int8 q128/k128 + smooth K", lambda x: int8(x, 128), lambda x: int8(x, 128), True)
run("int8 q64/k128 + smooth K", lambda x: int8(x, 64), lambda x: int8(x, 128), True)
run("int8 qrow/k128 + smooth K", lambda x: int8(x, 0, True), lambda x: int8(x, 128), True)
bf = lambda x: x.to(torch.bfloat16).double()
run("bf16 q/k (cuDNN-level)", bf, bf)
run("int8 qrow/k64 + smooth K", lambda x: int8(x, 0, True), lambda x: int8(x, 64), True)
