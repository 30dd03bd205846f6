"""What a user's first prompt pays on top of a warm run (one GPU, Llama-3.1-8B shape, random bf16):
first prefill at a length, the same length again, then a new length (warm allocator, new shapes),
and cuDNN vs flash SDPA at a never-seen attention shape. JSON lines."""
import json
import time

import torch

from starshard import LLM
from starshard.runtime.prompt import Prompt
from starshard.config import SamplingConfig


def prefill_s(llm, n):
    ids = torch.randint(100, 120000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    cache = llm.runner.new_cache(n + 1)
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.inference_mode():
        llm.runner.prefill(Prompt(ids, n), cache, SamplingConfig(), None)
    torch.cuda.synchronize()
    return time.perf_counter() - t


llm = LLM(device="cuda", dtype=torch.bfloat16, progress=False, random_weights="llama-3.1-8b")
L = 32768
print(json.dumps({"prefill_first_s": prefill_s(llm, L), "prefill_again_s": prefill_s(llm, L),
                  "prefill_new_length_s": prefill_s(llm, L - 1000), "new_length_again_s": prefill_s(llm, L - 1000)}), flush=True)
for n in (30001, 30002):
    q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    row = {"L": n}
    for name, fn in (("cudnn", lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)),
                     ("flash", lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), 0.0, True, False))):
        for attempt in ("first", "second"):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            row[f"{name}_{attempt}_ms"] = 1e3 * (time.perf_counter() - t)
    print(json.dumps(row), flush=True)
