"""Greedy generation equals transformers' generate token for token; sampling knobs behave."""
import pytest
import torch

from tests.helpers.hf_models import make_hf_model
from starshard.llm import LLM
from starshard.runtime.prompt import PromptTooLongError


def hf_greedy(hf, ids, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_matches_hf_generate(arch, tmp_path):
    hf, path = make_hf_model(arch, tmp_path, eos_token_id=None)
    llm = LLM(path)
    prompt = torch.randint(0, 211, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    out = llm.generate(prompt, max_new_tokens=32)
    assert out.token_ids == hf_greedy(hf, prompt, 32)
    assert out.finish_reason == "length" and out.prompt_tokens == 23


def test_chunked_prefill_same_tokens(tmp_path):
    _, path = make_hf_model("qwen2", tmp_path, eos_token_id=None)
    llm = LLM(path)
    prompt = list(range(5, 60))
    assert llm.generate(prompt, max_new_tokens=8).token_ids == llm.generate(prompt, max_new_tokens=8, prefill_chunk=16).token_ids


def test_sampling_seeded_and_knobs(tmp_path):
    _, path = make_hf_model("llama", tmp_path, eos_token_id=None)
    llm = LLM(path)
    prompt = list(range(3, 20))
    a = llm.generate(prompt, max_new_tokens=12, temperature=1.5, seed=7).token_ids
    b = llm.generate(prompt, max_new_tokens=12, temperature=1.5, seed=7).token_ids
    c = llm.generate(prompt, max_new_tokens=12, temperature=1.5, seed=8).token_ids
    assert a == b and a != c
    greedy = llm.generate(prompt, max_new_tokens=12).token_ids
    assert llm.generate(prompt, max_new_tokens=12, temperature=1.0, top_k=1, seed=1).token_ids == greedy
    assert llm.generate(prompt, max_new_tokens=12, temperature=1.0, top_p=1e-6, seed=1).token_ids == greedy


def test_prompt_longer_than_window_is_refused(tmp_path):
    _, path = make_hf_model("llama", tmp_path, max_position_embeddings=64)
    llm = LLM(path)
    with pytest.raises(PromptTooLongError, match="exceeds the model window of 64"):
        llm.generate(list(range(60)), max_new_tokens=8)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer")
