"""--disk-reload-policy split on CUDA: the tail's blocks go from pinned slots to the entry on a copy stream of
their own while the head's chunks compute, and the compute stream waits for them at the join. The entry equals
a pure reload of the file bit for bit and the answer equals the model's own; a damaged tail block is computed.
The CPU twin (tests/serving/test_split_reload.py) copies synchronously on the reader thread."""
import numpy as np
import pytest
import torch

from starshard import LLM
from starshard.serving import kv_file
from tests.helpers.kv_shards import assert_kv_equal
from tests.helpers.service import settle_writes
from tests.serving.test_split_reload import STEPS, _ask, _docs, _service

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="pinned copies on a copy stream need CUDA: `python -m pytest tests/gpu`")


@pytest.mark.parametrize("fp8", [None, "kv"])
def test_split_reload_on_cuda_copies_the_tail_while_the_head_computes(fp8, tmp_path, monkeypatch):
    monkeypatch.setattr(kv_file, "BLOCK_TOKENS", 16)
    tiny = LLM(random_weights="tiny", progress=False, device="cuda", dtype=torch.float32, fp8=fp8)
    (d1, d2), q1, q2 = _docs(13)
    want = tiny.generate(d1 + q2, max_new_tokens=STEPS).token_ids
    svc = _service(tiny, tmp_path, cut=32)
    try:
        _ask(svc, d1 + q1, len(d1))
        _ask(svc, d2 + q1, len(d2))  # d1 -> disk
        settle_writes(svc)
        disk = svc.tiers.disk
        reload = disk.load(disk.entry_for(d1 + q1), "cuda")  # beside it, on the same device
        tokens, cached = _ask(svc, d1 + q2, len(d1))
        m = int(np.flatnonzero(np.array(d1 + q1) != np.array(d1 + q2))[0])
        assert tokens == want and cached == m - 32
        entry = next(e for e in svc.cache.entries.values() if list(e.ids) == d1 + q1)
        assert entry.kv.layers[next(iter(entry.kv.layers))].k.is_cuda
        assert_kv_equal(entry.kv, reload)
        assert svc.counters["split_reloads_total"] == 1 and svc.counters["tail_failures_total"] == 0
    finally:
        svc.shutdown()
