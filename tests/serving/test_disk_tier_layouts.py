"""Files another exact layout can read, through the service (issue 49): a document's entry written to disk by
one process is reused by a cp=2 ring group and a tp=2 group on the same directory, one written by either
group is reused by one process, each answering as a fresh prefill in its own layout does; a Star group's
entry is not reused by ring. One spawn of two gloo ranks runs every group's part."""
from __future__ import annotations

import numpy as np

from starshard import LLM
from starshard.config import ParallelConfig
from starshard.runtime.prompt import Prompt
from starshard.serving.scheduler import Scheduler
from starshard.serving.tiers import TierConfig
from tests.helpers.mp_harness import run_ranks
from tests.helpers.service import submit

STEPS = 4


def _docs():
    rng = np.random.default_rng(11)
    doc = [int(x) for x in rng.integers(1, 500, 90)]
    qs = [[int(x) for x in rng.integers(1, 500, 5)] for _ in range(3)]
    for i, q in enumerate(qs):
        q[0] = 500 + i  # the questions differ at their first token: a follow-up shares the document only
    return doc, qs


def _service(llm, directory):
    tiers = TierConfig(disk_dir=directory, disk_bytes=1 << 30, disk_reload="always", shutdown_write_s=0)
    return Scheduler(llm, cache_bytes=1 << 26, max_batch=2, tiers=tiers)


def _ask(svc, ids, context_len):
    events, done = submit(svc, Prompt(ids, context_len), STEPS)
    assert done.wait(120)
    return [e.token_id for e in events if e.token_id is not None], events[-1].cached_tokens


def _session(llm, rank, directory, reuse=None, write=None):
    """One server on `directory`: rank 0 asks `reuse` (ids, context_len) -> (tokens, cached tokens), then
    writes `write` (ids, context_len) down to disk; the other ranks serve."""
    svc = _service(llm, directory)
    if rank != 0:
        svc.serve_forever()
        return None
    svc.start()
    try:
        got = _ask(svc, *reuse) if reuse else None
        if write:
            _ask(svc, *write)
            svc.demote(write[0], "disk")
        return got
    finally:
        svc.shutdown()


def _one_process(directory, reuse=None, write=None):
    return _session(LLM(random_weights="tiny", progress=False), 0, directory, reuse, write)


def _groups(rank, world, dirs):
    doc, (q1, q2, q3) = _docs()
    out = {}
    for name, parallel in (("ring", ParallelConfig(cp=world, cp_strategy="ring")), ("tp", ParallelConfig(tp=world))):
        llm = LLM(random_weights="tiny", progress=False, parallel=parallel)
        out[f"{name}-fresh"] = llm.generate(doc + q2, max_new_tokens=STEPS).token_ids
        out[name] = _session(llm, rank, dirs["one"], reuse=(doc + q2, len(doc)))  # one process's file
        _session(llm, rank, dirs[name], write=(doc + q1, len(doc)))  # for one process to read
    star = LLM(random_weights="tiny", progress=False, parallel=ParallelConfig(cp=world, cp_strategy="star"))
    _session(star, rank, dirs["star"], write=(doc + q1, len(doc)))
    ring = LLM(random_weights="tiny", progress=False, parallel=ParallelConfig(cp=world, cp_strategy="ring"))
    out["star-by-ring"] = _session(ring, rank, dirs["star"], reuse=(doc + q2, len(doc)))
    return out


def test_exact_layouts_reuse_each_others_files(tmp_path):
    doc, (q1, q2, q3) = _docs()
    dirs = {k: str(tmp_path / k) for k in ("one", "ring", "tp", "star")}
    _one_process(dirs["one"], write=(doc + q1, len(doc)))
    lead = run_ranks(_groups, 2, dirs)[0]
    assert lead["ring"] == (lead["ring-fresh"], len(doc))  # one process -> cp=2 ring
    assert lead["tp"] == (lead["tp-fresh"], len(doc))  # tp=1 -> tp=2
    assert lead["star-by-ring"] == (lead["ring-fresh"], 0)  # Star's KV is not ring's: prefilled
    fresh = LLM(random_weights="tiny", progress=False).generate(doc + q3, max_new_tokens=STEPS).token_ids
    assert _one_process(dirs["ring"], reuse=(doc + q3, len(doc))) == (fresh, len(doc))  # cp=2 ring -> one process
    assert _one_process(dirs["tp"], reuse=(doc + q3, len(doc))) == (fresh, len(doc))  # tp=2 -> tp=1
