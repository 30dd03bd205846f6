import time, torch
from starshard.llm import LLM
t=time.time()
llm = LLM("/work/gemma3/gemma-3-270m-q4_k_m.gguf", dtype=torch.float32, device="cpu", progress=False)
print("load", time.time()-t, llm.config.arch, getattr(llm.config, "layer_types", None)[:7], flush=True)
ref = torch.load("/work/gemma3/ref.pt")
from starshard.runtime.prompt import Prompt
m = llm.model
with torch.inference_mode():
    lg = m(ref["ids2"][None], cache=None, last_only=True)[0, -1].float()
r = ref["logits2"]
print("logits rel err", ((lg - r).norm() / r.norm()).item(), "argmax", lg.argmax().item(), r.argmax().item(), flush=True)
out = llm.generate([ref["ids"].tolist()], max_new_tokens=12, temperature=0.0) if hasattr(llm, "generate") else None
print(out)
print("ref gen", ref["gen"].tolist())
