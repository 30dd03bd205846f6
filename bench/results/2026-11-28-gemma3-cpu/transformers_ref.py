import time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
t=time.time()
p="/work/gemma3/gemma-3-270m-q4_k_m.gguf"
tok=AutoTokenizer.from_pretrained("/work/gemma3", gguf_file="gemma-3-270m-q4_k_m.gguf")
m=AutoModelForCausalLM.from_pretrained("/work/gemma3", gguf_file="gemma-3-270m-q4_k_m.gguf", torch_dtype=torch.float32)
print("load", time.time()-t, type(m).__name__, m.config.sliding_window, getattr(m.config,'layer_types',None))
ids=tok("The capital of France is", return_tensors="pt").input_ids
out=m.generate(ids, max_new_tokens=12, do_sample=False)
print(tok.decode(out[0]))
# long prompt past the 512 window
import random
random.seed(0)
text=" ".join(random.choice(["alpha","beta","gamma","delta","river","stone","cloud","paper"]) for _ in range(900))
ids2=tok(text, return_tensors="pt").input_ids[:, :1200]
with torch.no_grad(): lg=m(ids2).logits[0,-1]
torch.save({"ids":ids[0], "gen":out[0], "ids2":ids2[0], "logits2":lg}, "/work/gemma3/ref.pt")
m.save_pretrained("/work/gemma3/hf"); tok.save_pretrained("/work/gemma3/hf")
print("done", time.time()-t, ids2.shape)
