import time, torch
from starshard.llm import LLM
from starshard.runtime.prompt import Prompt
t=time.time()
llm = LLM("/work/gemma3/gemma-3-270m-q4_k_m.gguf", dtype=torch.float32, device="cpu", progress=False)
ref = torch.load("/work/gemma3/ref.pt")
ids = ref["ids"].tolist()
out = llm.generate(Prompt(ids, len(ids)), max_new_tokens=12)
print("ours", out.token_ids)
print("ref ", ref["gen"].tolist()[len(ids):])
print("text", llm.tokenizer.decode(out.token_ids) if llm.tokenizer else None, time.time()-t)
