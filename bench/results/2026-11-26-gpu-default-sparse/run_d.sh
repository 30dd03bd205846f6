#!/bin/bash
# Call D (warm after C, whose GGUF conversion and /tmp/essay.txt it reuses): `launch/bench.py prefill` needs --model
# or --random-weights, so the embedded default (no path) is timed through the Python API: LLM(sparse=
# SparseConfig("minference")) on 128K tokens of the essay, warm-up 1, 3 runs (the same timer as the bench).
export LOG=run_d.log; source bench/gpu_env.sh >/dev/null 2>&1; python3 - <<'PY' 2>&1 | tail -5
import time, torch
from starshard import LLM
from starshard.kernels.sparse import SparseConfig, sparse_report
from starshard.benchmarks.common import timed
from starshard.benchmarks.prefill import text_ids, prompt_ids
llm = LLM(dtype=torch.bfloat16, device="cuda", progress=False, sparse=SparseConfig("minference"))
print("config", llm.sparse.config_path)
ids = torch.as_tensor(prompt_ids(131072, llm.config.vocab_size, text_ids(llm.tokenizer, "/tmp/essay.txt"))).cuda()
def run():
    sparse_report(llm.model, reset=True)
    cache = llm.runner.new_cache(131072 + 8)
    with torch.inference_mode():
        llm.model(ids[None], cache=cache, last_only=True)
t = timed(run, torch.device("cuda"), 3, warmup=1)
print("default model --sparse minference 128K", sorted(t), sparse_report(llm.model))
PY
