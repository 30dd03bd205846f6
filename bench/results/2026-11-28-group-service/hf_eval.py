"""`starshard eval` with transformers as the engine (the peer), on the same prompts and scoring: the ids come
from our build_prompt with our tokenizer, transformers generates greedily from them.
    python hf_eval.py --model X.gguf --tasks ... --out DIR   (the eval flags; --device / --dtype as eval)"""
import sys
import types
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from starshard.commands import eval as ev
from starshard.runtime.prompt import build_prompt, load_tokenizer


class HFEngine:
    def __init__(self, path, device="cuda", dtype=torch.bfloat16, progress=False):
        p = Path(path)
        self.tokenizer = load_tokenizer(str(p))
        self.path = path
        kw = dict(gguf_file=p.name) if p.suffix == ".gguf" else {}
        self.model = AutoModelForCausalLM.from_pretrained(str(p.parent if kw else p), dtype=dtype, **kw).to(device).eval()
        self.config = types.SimpleNamespace(max_position_embeddings=self.model.config.max_position_embeddings)
        self.device = device
        self.eos = self.model.generation_config.eos_token_id

    def generate(self, *, context, question, max_new_tokens, temperature=0.0, raw=False):
        p = build_prompt(self.tokenizer, context=context, question=question, raw=raw)
        ids = torch.tensor([p.ids], device=self.device)
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=self.eos)
        new = out[0, ids.shape[1]:].tolist()
        eos = set(self.eos if isinstance(self.eos, list) else [self.eos])
        text = self.tokenizer.decode([t for t in new if t not in eos], skip_special_tokens=True)
        return types.SimpleNamespace(text=text, metrics={"prompt_tokens": len(p.ids)})


if __name__ == "__main__":
    sys.exit(ev.main(sys.argv[1:], llm_cls=HFEngine))
