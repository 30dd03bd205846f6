"""float64 study: flash_fp8 variants s (int8 smoothed scores, P . V in the compute dtype) and t (the
same scores, P and V in e4m3) on SmolLM2's real q / k / v (essay text), against exact attention.

    python bench/make_essay.py --out /tmp/study/essay.txt --sentences 800
    python bench/results/2026-11-26-h200-fp8-pv/pv_study.py   # CPU, a few minutes

Captures every layer's prefill q / k / v of the embedded SmolLM2-135M-Instruct on the first 2048 tokens
(as ../2026-11-26-h200-int8-attention/qk_quant_study.py), then runs `flash_fp8_reference` (the kernels'
blockwise algorithm in float64: the kernel's own numerics) for each variant on bf16 copies, and
reports the output relative error and the lse max error against float64 exact attention.
"""
import math
import sys

import torch

sys.path.insert(0, ".")
import starshard.engine.model as M  # noqa: E402
import starshard.kernels.flash_fp8 as ff  # noqa: E402
from starshard.llm import LLM  # noqa: E402

torch.manual_seed(0)
caps = []
orig = M.attention


def rec(q, k, v, **kw):
    if q.shape[2] > 1:
        caps.append((q.detach().clone(), k.detach().clone(), v.detach().clone()))
    return orig(q, k, v, **kw)


M.attention = rec
llm = LLM()
ids = llm.tokenizer(open("/tmp/study/essay.txt").read())["input_ids"][:2048]
llm.generate(ids, max_new_tokens=1)
print("captured", len(caps), tuple(caps[0][0].shape), tuple(caps[0][1].shape))


def exact(q, k, v):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    L = q.shape[2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


errs = {v: [] for v in ("s", "t", "bf16")}
for q, k, v in caps:
    q64, k64, v64 = q.double(), k.double(), v.double()
    want, want_lse = exact(q64, k64, v64)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    for var in ("s", "t"):
        out, lse = ff.flash_fp8_reference(qb, kb, vb, variant=var, block_m=128, block_n=128)
        errs[var].append(((out.double() - want).norm() / want.norm()).item())
    got, got_lse = exact(qb.double(), kb.double(), vb.double())  # bf16 inputs, exact math
    errs["bf16"].append(((got.to(torch.bfloat16).double() - want).norm() / want.norm()).item())
for name, e in errs.items():
    t = torch.tensor(e)
    print(f"{name:5s} out rel err mean {t.mean():.4f} max {t.max():.4f} (per layer: {' '.join(f'{x:.3f}' for x in e)})")
