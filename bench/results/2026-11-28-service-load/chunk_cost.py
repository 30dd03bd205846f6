"""One-off probe: the runner's chunked prefill vs whole at 128K (warm), and where a chunk's time goes."""
import json, sys, time, torch
from starshard.llm import LLM
from starshard.config import SamplingConfig
from starshard.runtime.prompt import Prompt
llm = LLM(None, dtype=torch.bfloat16, device="cuda", random_weights="llama-3.1-8b", progress=False)
r = llm.runner
L = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
ids = torch.randint(100, 120000, (L,)).tolist()
p = Prompt(ids, L)
out = {"device": torch.cuda.get_device_name(), "L": L}
def run(chunk):
    cache = r.new_cache(L + 8, L, L, chunk)
    torch.cuda.synchronize(); t = time.perf_counter()
    r.prefill(p, cache, SamplingConfig(temperature=0.0), None, chunk)
    torch.cuda.synchronize(); dt = time.perf_counter() - t
    r.end_generation(); del cache; torch.cuda.empty_cache(); return dt
run(None)
for c in (None, 2048, 4096, 8192, 16384):
    out[str(c)] = run(c); print(c, out[str(c)], flush=True)
# one chunk step at a long prefix, profiled
cache = r.new_cache(L + 8, L, L, 2048)
for s, e in r.prefill_bounds(L, L, 2048)[:-1]:
    r.prefill_step(p, cache, s, e, SamplingConfig(temperature=0.0), None)
torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
s, e = r.prefill_bounds(L, L, 2048)[-1]
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    r.prefill_step(p, cache, s, e, SamplingConfig(temperature=0.0), None); torch.cuda.synchronize()
out["last_chunk_profile"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14)
print(out["last_chunk_profile"])
json.dump(out, open(sys.argv[2], "w"), indent=1)
