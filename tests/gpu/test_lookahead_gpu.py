"""The host one step ahead on CUDA (Executor._read): a decode step's tokens come back through a page-locked copy
whose event is waited on, not a copy on the stream (that would wait for the step queued after it too); the tokens
equal the serialized loop's, with batches that change and seeded sampling."""
import pytest
import torch

from starshard import LLM
from starshard.serving import executor as executor_mod
from tests.serving.test_lookahead import _streams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: `python -m pytest tests/gpu`")


def test_tokens_read_through_the_event_equal_the_serialized_loop(monkeypatch):
    llm = LLM(random_weights="tiny", progress=False, device="cuda", dtype=torch.float32)
    serialized = _streams(llm, lookahead=False)
    reads = []
    real = executor_mod.Executor._read

    def read(self, issued):
        reads.append(issued.ready is not None and issued.host.is_pinned())
        return real(self, issued)

    monkeypatch.setattr(executor_mod.Executor, "_read", read)
    assert _streams(llm, lookahead=True) == serialized
    assert reads and all(reads)
