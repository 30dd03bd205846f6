"""One-off probe (not committed): the service over a CP group in process, admission of a long document,
uncached vs cached time to first token, and N concurrent questions' token rate on the cached doc."""
import argparse, json, os, sys, threading, time
import numpy as np, torch, torch.distributed as dist
from starshard.config import ParallelConfig, SamplingConfig
from starshard.llm import LLM
from starshard.serving.scheduler import Scheduler

ap = argparse.ArgumentParser()
ap.add_argument("--strategy", default="star"); ap.add_argument("--length", type=int, default=1 << 20)
ap.add_argument("--block", type=int, default=None); ap.add_argument("--cache-gib", type=float, default=40)
ap.add_argument("--conc", default="1,8"); ap.add_argument("--decode", type=int, default=64)
ap.add_argument("--out", required=True)
a = ap.parse_args()
cp = int(os.environ.get("WORLD_SIZE", "1"))
opts = dict(block_size=a.block, anchor_size=a.block) if a.block else {}
par = ParallelConfig(cp=cp, cp_strategy=a.strategy if cp > 1 else "dense", **opts)
llm = LLM(None, dtype=torch.bfloat16, device="cuda", random_weights="llama-3.1-8b", progress=False, parallel=par)
conc = [int(c) for c in a.conc.split(",")]
svc = Scheduler(llm, cache_bytes=int(a.cache_gib * 2**30), max_batch=max(conc), max_queue=64, max_extend=512)
if dist.is_initialized() and dist.get_rank() != 0:
    svc.serve_forever(); dist.destroy_process_group(); sys.exit(0)
svc.start()
rng = np.random.default_rng(0)
V = llm.config.vocab_size
tok = lambda n: [int(x) for x in rng.integers(100, V - 100, n)]
doc = tok(a.length - 64)

def ask(ids, n):
    rec = {"t0": time.perf_counter(), "times": [], "finish": None, "cached": 0, "err": None}
    done = threading.Event()
    def on(ev):
        if ev.token_id is not None: rec["times"].append(time.perf_counter())
        rec["cached"] = ev.cached_tokens
        if ev.finish_reason is not None:
            rec["finish"], rec["err"] = ev.finish_reason, ev.error; done.set()
    p = svc.text_prompt(ids)
    svc.submit(p, max_tokens=n, sampling=SamplingConfig(temperature=0.0), on_event=on)
    return done, rec

res = {"strategy": a.strategy, "cp": cp, "length": a.length, "block": a.block, "device": torch.cuda.get_device_name(),
       "mem_gib": torch.cuda.get_device_properties(0).total_memory / 2**30}
try:
    d, r = ask(doc + tok(64), 2); d.wait(1800)
    res["uncached_ttft_s"] = r["times"][0] - r["t0"] if r["times"] else None; res["uncached"] = r["finish"], r["err"]
    for i in range(2):
        d, r = ask(doc + tok(64), 2); d.wait(600)
        res[f"cached_ttft_s_{i}"] = r["times"][0] - r["t0"] if r["times"] else None
        res[f"cached_{i}"] = r["finish"], r["err"], r["cached"]
    for c in conc:
        recs = [ask(doc + tok(64), a.decode) for _ in range(c)]
        for d, _ in recs: d.wait(600)
        t0 = min(r["t0"] for _, r in recs); t1 = max(r["times"][-1] for _, r in recs)
        n = sum(len(r["times"]) for _, r in recs)
        gaps = sorted(b - a_ for _, r in recs for a_, b in zip(r["times"], r["times"][1:]))
        res[f"conc_{c}"] = {"tokens": n, "seconds": t1 - t0, "tok_s": n / (t1 - t0),
                            "itl_p50_ms": 1e3 * gaps[len(gaps) // 2], "itl_p99_ms": 1e3 * gaps[int(len(gaps) * .99)],
                            "itl_last_ms": 1e3 * gaps[-1],
                            "first_tok_s": [r["times"][0] - r["t0"] for _, r in recs][:2]}
    res["stats"] = svc.stats()
    res["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
except Exception as e:
    res["error"] = repr(e)
print(json.dumps(res, indent=1))
json.dump(res, open(a.out, "w"), indent=1)
svc.shutdown(); os._exit(0)
