"""The embedded default model (SmolLM2-135M-Instruct GGUF): parity with transformers, and a real
long-context answer."""

import pytest
import torch

from starshard.checkpoints.default import DEFAULT_GGUF, default_gguf
from starshard.llm import LLM

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM(progress=False)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_gguf()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=DEFAULT_GGUF, torch_dtype=torch.float32).eval()


def passkey_prompt(n_filler: int, key: int, depth: float) -> str:
    """The classic passkey retrieval prompt, as a completion (SmolLM2-135M answers it without the
    chat template; with the template it loses the key beyond ~1K tokens)."""
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    lines = [filler] * n_filler
    lines.insert(int(depth * n_filler), f"The pass key is {key}. Remember it. {key} is the pass key. ")
    return (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.\n" + "".join(lines)
        + "\nWhat is the pass key? The pass key is"
    )


def test_logits_match_transformers(llm, hf_model):
    ids = llm.encode("Explain rotary position embeddings in one paragraph.").ids
    t = torch.tensor([ids])
    with torch.no_grad():
        ref = hf_model(t).logits
        out = llm.model(t)
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-4


def test_greedy_matches_transformers(llm, hf_model):
    ids = llm.encode("Write a haiku about distributed computing.").ids
    out = llm.generate(ids, max_new_tokens=32)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    assert out.token_ids == ref[: len(out.token_ids)]
    assert len(out.token_ids) == 32 or out.finish_reason == "eos"


@pytest.mark.parametrize("depth", [0.2, 0.8])
def test_passkey_in_4k_context(llm, depth):
    key = 50000 + int(depth * 1000)
    out = llm.generate(passkey_prompt(n_filler=180, key=key, depth=depth), raw=True, max_new_tokens=8)
    assert out.metrics["prompt_tokens"] > 4000
    assert str(key) in out.text
