"""Issue 48's GPU parity: Qwen2.5-Coder-1.5B-Instruct through starshard and through transformers (reading the
same GGUF), bf16 against bf16 on one GPU, on a prompt of about N tokens (default 16,384) of generated code and
a question: the last position's max |delta| / max |logit|, and 16 greedy tokens with each step's top-2 margin
on both sides (a differing token is a near-tie when both margins are small). Writes JSON to the given path.
Usage: python parity.py OUT.json [N]"""
import json
import sys
import time

import torch

from starshard import LLM
from starshard.checkpoints.named import named_gguf

NAME = "qwen2.5-coder-1.5b-instruct"
out, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 16384
# CPU (a check of this script at a short length): float32
DEV, DTYPE = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)


def prompt_ids(tok, n: int) -> list[int]:
    lines, i = [], 0
    while True:
        lines.append(f"def f{i}(x):\n    return x * {i % 7 + 2} + {i * 3 % 11}\n")
        i += 1
        if i % 64 == 0 and len(tok("\n".join(lines))["input_ids"]) > n - 64:
            break
    text = "\n".join(lines) + f"\n# What does f{i // 2}(5) return? Show the arithmetic.\n"
    return tok(text)["input_ids"][-n:]


def greedy(step, ids, steps: int = 16):
    """step(ids) -> last logits [V]: 16 greedy tokens and each step's top-1 minus top-2 logit."""
    toks, margins = [], []
    for _ in range(steps):
        logits = step(ids).float()
        top = torch.topk(logits, 2)
        toks.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        ids = ids + [toks[-1]]
    return toks, margins


with torch.inference_mode():
    t0 = time.perf_counter()
    llm = LLM(NAME, device=DEV, dtype=DTYPE, progress=False)
    load_s = time.perf_counter() - t0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = named_gguf(NAME, progress=False)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=DTYPE).to(DEV).eval()
    ids = prompt_ids(tok, n)
    ours = lambda x: llm.model(torch.tensor([x], device=DEV), last_only=True)[0, -1]  # noqa: E731
    theirs = lambda x: hf(torch.tensor([x], device=DEV), logits_to_keep=1).logits[0, -1]  # noqa: E731
    a, b = ours(ids).float(), theirs(ids).float()
    rel = float((a - b).abs().max() / b.abs().max())
    ta, ma = greedy(ours, ids)
    tb, mb = greedy(theirs, ids)
res = {"model": NAME, "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "tokens": len(ids),
       "dtype": str(DTYPE).removeprefix("torch."),
       "load_s": load_s, "max_abs_delta_over_max_logit": rel, "greedy_equal": ta == tb,
       "starshard": {"tokens": ta, "margins": ma}, "transformers": {"tokens": tb, "margins": mb}}
first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
res["first_difference"] = None if first is None else {"step": first, "margins": [ma[first], mb[first]]}
json.dump(res, open(out, "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k not in ("starshard", "transformers")}))
