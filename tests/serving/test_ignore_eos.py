"""ignore_eos (vLLM's extension, for benchmarks): a request runs to max_tokens past end-of-sequence tokens;
without it the first one ends the request. Over HTTP the field reaches the request's SamplingConfig."""
from __future__ import annotations


from starshard import LLM
from starshard.config import SamplingConfig
from starshard.runtime.prompt import Prompt
from starshard.server import protocol as P
from starshard.server.intake import sampling_of
from starshard.serving.scheduler import Scheduler
from tests.helpers.service import submit


def _run(svc, prompt, ignore_eos):
    events, done = submit(svc, prompt, 6, SamplingConfig(ignore_eos=ignore_eos))
    assert done.wait(60)
    return [e.token_id for e in events if e.token_id is not None], events[-1].finish_reason


def test_ignore_eos_runs_to_max_tokens():
    llm = LLM(random_weights="tiny", progress=False)
    prompt = Prompt(list(range(3, 40)), 37)
    first = llm.generate(prompt, max_new_tokens=1).token_ids[0]
    llm.eos_ids = {first}  # the greedy first token is an end-of-sequence token
    svc = Scheduler(llm, cache_bytes=1 << 30)
    svc.start()
    try:
        assert _run(svc, prompt, ignore_eos=False) == ([first], "stop")
        toks, finish = _run(svc, prompt, ignore_eos=True)
    finally:
        svc.shutdown()
    assert len(toks) == 6 and toks[0] == first and finish == "length"


def test_ignore_eos_reaches_the_sampling_config():
    body = P.CompletionRequest(prompt=[1, 2, 3], max_tokens=4, ignore_eos=True)
    assert sampling_of(body).ignore_eos
    assert not sampling_of(P.CompletionRequest(prompt=[1, 2, 3], max_tokens=4)).ignore_eos
