"""Gemma 3 270M at a long prompt: our last-token logits and greedy continuation vs transformers (float32, CPU),
on one of the harness's needle prompts (completion form)."""
import sys, time, torch
from transformers import AutoModelForCausalLM
from starshard.llm import LLM
from starshard.evaluation.tasks import make_samples, template_overhead
from starshard.runtime.prompt import build_prompt
N = int(sys.argv[1]); depth = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
torch.set_num_threads(2)
t = time.time()
llm = LLM("/work/gemma3/gemma-3-270m-q4_k_m.gguf", dtype=torch.float32, device="cpu", progress=False)
tok = llm.tokenizer
s = make_samples(["niah_number"], tok, [N], [depth], 1, 0, template_overhead(tok, False) + 16)[0]
p = build_prompt(tok, context=s.context, question=f"{s.question} {s.answer_prefix}", raw=True)
print("prompt", len(p.ids), "answer", s.answers, "load", round(time.time() - t), flush=True)
ids = torch.tensor([p.ids])
with torch.inference_mode():
    ours = llm.model(ids, cache=None, last_only=True)[0, -1].float()
g = llm.generate(p, max_new_tokens=10, temperature=0.0)
print("ours", round(time.time() - t), repr(g.text), flush=True)
hf = AutoModelForCausalLM.from_pretrained("/work/gemma3", gguf_file="gemma-3-270m-q4_k_m.gguf", dtype=torch.float32, attn_implementation="sdpa").eval()
with torch.inference_mode():
    ref = hf(ids, logits_to_keep=1).logits[0, -1].float()
    out = hf.generate(ids, max_new_tokens=10, do_sample=False)
print("hf", round(time.time() - t), repr(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)), flush=True)
print("logits rel err", ((ours - ref).norm() / ref.norm()).item(), "top5 ours", ours.topk(5).indices.tolist(),
      "hf", ref.topk(5).indices.tolist(), flush=True)
