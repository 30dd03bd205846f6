"""The service's decode graphs that serve any entry (cascade.TableCascade): the entry is named through a device
table, the prefixes and the own-KV pool sit in place, so one graph of a batch size and pool capacity is bound
to each new batch instead of captured anew. On CPU the step runs eagerly through the same buffers
(CascadeGraph capture=False) and the decode kernel through TRITON_INTERPRET; it must equal CascadeAttention's
step, batch after batch, on entries of other lengths."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from starshard import LLM  # noqa: E402
from starshard.kernels.common import DECODE_MAX_ROWS  # noqa: E402
from starshard.serving.cascade import (CascadeAttention, CascadeGraph, OwnKV, SharedGroup, TableCascade,  # noqa: E402
                                       run_cascade)


@pytest.fixture(scope="module")
def tiny():
    return LLM(random_weights="tiny", progress=False, device="cpu", dtype=torch.float32)


def _entry(tiny, n: int, seed: int):
    entry = tiny.runner.new_cache(n)
    with torch.inference_mode():
        tiny.model(torch.randint(1, 500, (1, n), generator=torch.Generator().manual_seed(seed)), cache=entry,
                   last_only=True)
    return entry


def _pool(model, prefixes: list[int], held: int, seed: int) -> OwnKV:
    """Each row holds `held` own tokens after its prefix (a question), room for 4 more."""
    g = torch.Generator().manual_seed(seed)
    attn = model.layers[0].attention
    pool = OwnKV(model.layer_ids, len(prefixes), attn.n_kv_heads, attn.head_dim, held + 5, torch.float32, "cpu")
    pos = torch.stack([torch.arange(p, p + held) for p in prefixes])
    for i in model.layer_ids:
        k = torch.randn(len(prefixes), attn.n_kv_heads, held, attn.head_dim, generator=g)
        pool.append(i, k, -k, pos)
    pool.advance(held)
    return pool


def test_one_table_graph_serves_batch_after_batch_on_other_entries(tiny):
    model = tiny.model
    attn = model.layers[0].attention
    store = OwnKV(model.layer_ids, 4, attn.n_kv_heads, attn.head_dim, 16, torch.float32, "cpu")
    graph = CascadeGraph(model, TableCascade(model.layer_ids, 2, attn.n_kv_heads, attn.head_dim, store, torch.float32,
                                             "cpu", use_triton=True), 2, "cpu", capture=False)
    batches = [(_entry(tiny, 40, 1), [40, 30], 3), (_entry(tiny, 23, 2), [23, 9], 5), (_entry(tiny, 57, 3), [57, 57], 1)]
    for n, (entry, prefixes, held) in enumerate(batches):
        mine, ref = _pool(model, prefixes, held, n), _pool(model, prefixes, held, n)
        graph.cascade.bind(entry, prefixes, mine)
        cascade = CascadeAttention([SharedGroup(entry, [0, 1], prefixes, entry.layer(model.layer_ids[0]).length)], ref)
        tok = torch.tensor([[3 + n], [4 + n]])
        pos = torch.tensor([[p + held] for p in prefixes])
        with torch.inference_mode():
            for step in range(3):
                got = graph.step(tok + step, pos + step)
                want = run_cascade(model, tok + step, pos + step, cascade)
                assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (n, step, (got - want).abs().max())
        own = graph.cascade.own
        assert own.lengths == ref.lengths == [held + 3] * 2
        for i in model.layer_ids:
            assert torch.allclose(own.k[i][:, :, :held + 3], ref.k[i][:, :, :held + 3], atol=1e-5)
            assert torch.equal(own.pos[i][:, :held + 3], ref.pos[i][:, :held + 3])
            assert (own.pos[i][:, held + 3:] > 10**9).all()  # no stale slot of an earlier batch is visible


def test_a_table_refuses_what_its_kernel_would_misread(tiny):
    model = tiny.model
    attn = model.layers[0].attention
    store = OwnKV(model.layer_ids, 2, attn.n_kv_heads, attn.head_dim, 8, torch.float32, "cpu")
    table = TableCascade(model.layer_ids, 2, attn.n_kv_heads, attn.head_dim, store, torch.float32, "cpu",
                         use_triton=True)
    entry = _entry(tiny, 12, 4)
    with pytest.raises(ValueError, match="rows for a graph of 2"):
        table.bind(entry, [12], _pool(model, [12], 1, 0))
    with pytest.raises(ValueError, match="own-KV pool does not fit"):
        big = OwnKV(model.layer_ids, 2, attn.n_kv_heads, attn.head_dim, 9, torch.float32, "cpu")
        table.bind(entry, [12, 12], big)
    fp8 = tiny.runner.new_cache(12)
    for layer in fp8.layers.values():
        layer.fp8 = True
    with pytest.raises(ValueError, match="e4m3 or window-trimmed"):
        table.bind(fp8, [12, 12], _pool(model, [12, 12], 1, 0))


def test_the_service_binds_kept_graphs_to_each_batch_on_one_entry(monkeypatch):
    """The executor's wiring (Executor._table_graph, prepare_tables) on CPU: graphs made "captured" (eager through
    their buffers), the kernel interpreted. The kept graphs of 1..4 rows serve batches of follow-ups on
    documents of other lengths, joining and leaving; each answer is the model's own, and no batch builds a
    graph of its own (a CascadeAttention one)."""
    import numpy as np

    from starshard.runtime.prompt import Prompt
    from starshard.serving import executor as executor_mod
    from starshard.serving.scheduler import Scheduler
    from tests.helpers.service import submit

    own_graphs = []

    class Eager(CascadeGraph):
        def __init__(self, model, cascade, batch, device, capture=True, warm=False):
            super().__init__(model, cascade, batch, device, capture=False, warm=warm)
            if isinstance(cascade, CascadeAttention):
                own_graphs.append(cascade)

    monkeypatch.setattr(executor_mod, "CascadeGraph", Eager)
    monkeypatch.setattr(executor_mod, "TableCascade", lambda *a, **k: TableCascade(*a, **k, use_triton=True))
    monkeypatch.setattr(executor_mod, "TABLE_MIN_CAPACITY", 16)
    llm = LLM(random_weights="tiny", progress=False, device="cpu", dtype=torch.float32)
    svc = Scheduler(llm, cache_bytes=1 << 26, max_batch=4)
    ex = svc.executor
    ex.cuda_graphs = ex.table_graphs = True
    assert ex.prepare_tables(4) == 4
    svc.start()
    answers = []  # (prompt, max tokens, tokens): compared once the service is down (it hooks the shared model)
    try:
        rng = np.random.default_rng(3)
        for doc_len, n in ((61, 3), (20, 2), (97, 4)):
            doc = [int(x) for x in rng.integers(1, 500, doc_len)]
            questions = [[int(x) for x in rng.integers(1, 500, 3 + j)] for j in range(n)]
            first = submit(svc, Prompt(doc + questions[0], doc_len), 4)
            assert first[1].wait(120)
            asks = [submit(svc, Prompt(doc + q, doc_len), 4 + j) for j, q in enumerate(questions)]  # leave apart
            for j, ((events, done), q) in enumerate(zip(asks, questions)):
                assert done.wait(300)
                answers.append((doc + q, 4 + j, [e.token_id for e in events if e.token_id is not None]))
                assert events[-1].cached_tokens >= doc_len
        assert own_graphs == [] and list(ex._tables) == [16] and svc.stats()["decode_graphs_kept"] == 4
        assert all(g.cascade.table.abs().sum() > 0 for g in ex._tables[16].graphs.values())  # each bound since
    finally:
        svc.shutdown()
    for prompt, steps, got in answers:
        assert got == llm.generate(prompt, max_new_tokens=steps).token_ids


def test_a_capture_that_fails_in_the_warm_up_turns_the_kept_graphs_off(monkeypatch, caplog):
    from starshard.serving import executor as executor_mod
    from starshard.serving.scheduler import Scheduler

    class Failing(CascadeGraph):
        def step(self, tokens, positions):
            raise RuntimeError("capture failed")

    monkeypatch.setattr(executor_mod, "CascadeGraph", Failing)
    llm = LLM(random_weights="tiny", progress=False, device="cpu", dtype=torch.float32)
    ex = Scheduler(llm, cache_bytes=1 << 26, max_batch=2).executor
    ex.cuda_graphs = ex.table_graphs = True
    assert ex.prepare_tables(2) == 0
    assert not ex.table_graphs and ex._tables == {} and "capture failed" in caplog.text


def test_the_warm_up_checks_a_kept_graph_against_the_per_batch_path(monkeypatch, caplog):
    """prepare_tables compares one kept graph's logits with CascadeAttention's on a random entry: within the
    tolerance the graphs stay; beyond it (here a tolerance nothing meets) they are turned off, logged."""
    from starshard.serving import executor as executor_mod
    from starshard.serving.scheduler import Scheduler

    class Eager(CascadeGraph):
        def __init__(self, model, cascade, batch, device, capture=True, warm=False):
            super().__init__(model, cascade, batch, device, capture=False, warm=warm)

    monkeypatch.setattr(executor_mod, "CascadeGraph", Eager)
    monkeypatch.setattr(executor_mod, "TableCascade", lambda *a, **k: TableCascade(*a, **k, use_triton=True))
    monkeypatch.setattr(executor_mod, "TABLE_CHECK_ROWS", 40)
    llm = LLM(random_weights="tiny", progress=False, device="cpu", dtype=torch.float32)
    ex = Scheduler(llm, cache_bytes=1 << 26, max_batch=2).executor
    ex.cuda_graphs = ex.table_graphs = True
    assert ex.prepare_tables(2) == 2 and ex.table_graphs and ex._check_tables() is None
    monkeypatch.setattr(executor_mod, "TABLE_CHECK_TOL", -1.0)
    ex._tables.clear()
    assert ex.prepare_tables(2) == 0 and not ex.table_graphs and ex._tables == {} and ex.kept_graphs() == 0
    assert "logits differ from the per-batch path's" in caplog.text


def test_kept_stores_stay_within_their_budget_least_recently_used_first(monkeypatch):
    """Executor._kept_graph: each capacity bucket keeps one own-KV store; a new bucket drops the least recently used
    ones until the stores fit TABLE_STORE_BYTES, and a bucket whose store alone is larger keeps nothing."""
    from starshard.serving import executor as executor_mod
    from starshard.serving.scheduler import Scheduler

    class Eager(CascadeGraph):
        def __init__(self, model, cascade, batch, device, capture=True, warm=False):
            super().__init__(model, cascade, batch, device, capture=False, warm=warm)

    monkeypatch.setattr(executor_mod, "CascadeGraph", Eager)
    llm = LLM(random_weights="tiny", progress=False, device="cpu", dtype=torch.float32)
    ex = Scheduler(llm, cache_bytes=1 << 26, max_batch=4).executor
    per_token = DECODE_MAX_ROWS * ex.own_token_bytes()
    monkeypatch.setattr(executor_mod, "TABLE_STORE_BYTES", 48 * per_token)  # room for 16 + 32 tokens, not 64
    for bucket in (16, 32, 16):
        assert ex._kept_graph(1, bucket) is not None
    assert list(ex._tables) == [32, 16]  # 16 used last
    assert ex._kept_graph(2, 32) is not None and list(ex._tables) == [16, 32]
    assert ex._kept_graph(1, 64) is None and list(ex._tables) == [16, 32]  # 64 alone is over: nothing kept
    monkeypatch.setattr(executor_mod, "TABLE_STORE_BYTES", 64 * per_token)
    assert ex._kept_graph(1, 32) is not None and ex._kept_graph(1, 64) is not None
    assert list(ex._tables) == [64]  # 32 + 64 and 16 + 64 are over: both dropped, least recently used first
    assert ex._tables[64].store.capacity == 64 and list(ex._tables[64].graphs) == [1]
