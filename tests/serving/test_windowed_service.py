"""The service runs sliding-window models over their whole window (issue 38), exactly: prompts of 120
tokens past windows of 16, the service's greedy tokens equal LLM.generate's (which runs the windows) for
a new document (whole, and prefilled in chunks smaller and larger than the window), follow-ups that extend
its entry (sharing all of the document, or only its first 90 tokens) and decode together, on a windowed
Mistral, Gemma 2 (alternating windows, soft-caps, query_pre_attn_scalar) and Gemma 3 (local RoPE), in one
process and over cp=2 ring and Star (gloo); those runs keep every key (window_trim=False). Window-trimmed
entries (the default: local layers keep only what a question after the document sees) answer the same for
follow-ups on all of the document, prefill a prompt sharing less, and count their exact bytes, in one
process and over cp=2 ring (chunked) and Star. The cascade attention itself (shared entry + own pool, with a
window, soft-cap and scale) is checked against a float64 reference. CUDA graphs are CUDA-only: the eager
cascade runs here (the captured step runs the same attend)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from starshard import LLM
from starshard.config import ParallelConfig
from starshard.engine.kv_cache import KVCache
from starshard.runtime.prompt import Prompt
from starshard.serving.cascade import CascadeAttention, CascadeGraph, OwnKV, SharedGroup, run_cascade
from starshard.serving.context_cache import CacheEntry, ContextCache, kv_bytes, served_prefix
from starshard.serving.scheduler import Scheduler
from starshard.serving.tiers import TierConfig
from tests.engine.test_gemma import FAMILIES as GEMMA
from tests.engine.test_sliding_window_families import FAMILIES as SWA
from tests.helpers.hf_models import make_hf_model
from tests.helpers.mp_harness import run_ranks
from tests.helpers.service import pool_with_history, submit

transformers.logging.set_verbosity_error()

MODELS = {"mistral": SWA["mistral"], **GEMMA}  # window 16 each
DOC, PART, NEW = 120, 90, 6  # document tokens, the shorter shared prefix, new tokens per request


def _ids(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 211, n)]


def _prompts() -> dict[str, Prompt]:
    """a: a new document; b, c: questions on all of it (one shape: one batched extend); d: on its first
    PART tokens only (the entry's later keys hidden by position)."""
    doc = _ids(0, DOC)
    q = [_ids(10 + i, 7) for i in range(4)]
    return dict(a=Prompt(doc + q[0], DOC), b=Prompt(doc + q[1], DOC), c=Prompt(doc + q[2], DOC),
                d=Prompt(doc[:PART] + q[3], PART))


def _tokens(events) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def _serve(llm, chunk: int, trim: bool = False, svc_out: list | None = None) -> dict:
    """The prompts through one Scheduler: a alone, then b, c, d together -> (tokens, cached tokens) each.
    trim: window_trim (d shares only part of a's entry: prefilled then); svc_out gets the scheduler."""
    p = _prompts()
    svc = Scheduler(llm, cache_bytes=1 << 26, max_batch=4, prefill_chunk=chunk, window_trim=trim)
    svc.start()
    try:
        runs = {"a": submit(svc, p["a"], NEW)}
        assert runs["a"][1].wait(120)
        with svc._lock:  # all three arrive before the loop plans again: they decode together
            runs |= {k: submit(svc, p[k], NEW) for k in "bcd"}
        assert all(done.wait(120) for _, done in runs.values())
    finally:
        svc.shutdown()
    if svc_out is not None:
        svc_out.append(svc)
    return {k: (_tokens(ev), ev[-1].cached_tokens) for k, (ev, _) in runs.items()}


def _check(served: dict, refs: dict, what, trim: bool = False) -> None:
    assert {k: t for k, (t, _) in served.items()} == refs, what
    assert {k: c for k, (_, c) in served.items()} == dict(a=0, b=DOC, c=DOC, d=0 if trim else PART), what


def _refs(llm) -> dict:
    return {k: llm.generate(p, max_new_tokens=NEW).token_ids for k, p in _prompts().items()}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    base = tmp_path_factory.mktemp("winserve")
    return {name: make_hf_model(arch, base / name, eos_token_id=None, initializer_range=0.1, **kw)[1]
            for name, (arch, kw) in MODELS.items()}


def _reference(q, keys, vals, kpos, qpos, window, softcap, scale):
    """float64 attention of each row over the keys at positions in (qpos - window, qpos]."""
    g = q.shape[1] // keys.shape[1]
    k, v = keys.double().repeat_interleave(g, 1), vals.double().repeat_interleave(g, 1)
    s = torch.einsum("bhld,bhnd->bhln", q.double(), k) * scale
    s = softcap * torch.tanh(s / softcap)
    kp, qp = kpos[:, None, None, :], qpos[:, None, :, None]
    return torch.softmax(s.masked_fill((kp > qp) | (kp <= qp - window), float("-inf")), -1) @ v


@pytest.mark.parametrize("L", [1, 5])
def test_cascade_with_a_window_softcap_and_scale(L):
    """Rows sharing all of an entry (shuffled, as a CP shard), 20 or 11 of its tokens, and a second
    entry, each with 3 own tokens held: every row sees exactly its window of the union."""
    torch.manual_seed(L)
    B, Hq, Hkv, D, N, W = 4, 4, 2, 8, 37, 6
    entries, ek, ev = [], [], []
    for n in (N, 25):
        perm = torch.randperm(n)
        e = KVCache([0], 1, Hkv, D, n, torch.float32, "cpu")
        k, v = torch.randn(1, Hkv, n, D), torch.randn(1, Hkv, n, D)
        e.layer(0).append(k[:, :, perm], v[:, :, perm], perm)
        entries.append(e), ek.append(k), ev.append(v)
    on, prefix = [0, 0, 0, 1], [N, 20, 11, 25]
    own, old_k, old_v, old_pos = pool_with_history(prefix, Hkv, D, L)  # 3 own tokens after each prefix
    q, k, v = torch.randn(B, Hq, L, D), torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    pos = torch.stack([torch.arange(p + 3, p + 3 + L) for p in prefix])
    groups = [SharedGroup(entries[0], [0, 1, 2], prefix[:3], N), SharedGroup(entries[1], [3], prefix[3:], 25)]
    out = CascadeAttention(groups, own).attend(0, q, k, v, pos, window=W, softcap=1.5, scale=0.3)
    for b, (e, p) in enumerate(zip(on, prefix)):
        keys = torch.cat([ek[e][:, :, :p], old_k[b : b + 1], k[b : b + 1]], 2)
        vals = torch.cat([ev[e][:, :, :p], old_v[b : b + 1], v[b : b + 1]], 2)
        kpos = torch.cat([torch.arange(p), old_pos[b], pos[b]])[None]
        ref = _reference(q[b : b + 1], keys, vals, kpos, pos[b : b + 1], W, 1.5, 0.3)
        assert (out[b : b + 1].double() - ref).abs().max() < 1e-5, (b, p)
        # guard: without the window every row answers otherwise
        wide = _reference(q[b : b + 1], keys, vals, kpos, pos[b : b + 1], 10**6, 1.5, 0.3)
        assert (out[b : b + 1].double() - wide).abs().max() > 1e-3, b
    with pytest.raises(ValueError, match="does not run sinks"):
        CascadeAttention(groups, own).attend(0, q, k, v, pos, window=W, sinks=torch.zeros(Hq))


def test_service_equals_generate_past_the_window(paths):
    """Mistral: whole, in chunks of 8 (< window) and 40 (> window); Gemma 2 and 3 whole. The guard: the
    same model without its windows answers otherwise, so the windows decide these tokens."""
    for name, path in paths.items():
        llm = LLM(path, progress=False)
        refs = _refs(llm)
        for chunk in (0, 8, 40) if name == "mistral" else (0,):
            _check(_serve(llm, chunk), refs, (name, chunk))
        llm.model.drop_windows()
        assert _refs(llm) != refs, name


def test_window_trimmed_entries(paths):
    """window_trim (the default): once a document of C tokens is prefilled, each local layer of its entry
    keeps only the keys at positions >= C - (W - 1) (the document's last W - 1 and its question). The
    follow-ups on all of the document (b, c) answer as generate does from those; d, sharing only its first
    90 tokens, is prefilled (cached 0) and answers right; the entries' bytes are the arithmetic (global
    layers L rows, local layers W - 1 + L - C) and so is the cache's accounting. Gemma 3 (local and global
    layers), whole and in chunks of 8 (< W)."""
    llm = LLM(paths["gemma3"], progress=False)
    refs = _refs(llm)
    for chunk in (0, 8):
        out = []
        _check(_serve(llm, chunk, trim=True, svc_out=out), refs, chunk, trim=True)
        svc = out[0]
        windows, layers = svc.executor.local_windows(), llm.model.layer_ids
        assert svc.window_trim and 0 < len(windows) < len(layers)
        per_layer = svc.executor.token_bytes() // len(layers)
        entries = sorted((len(e), e.serves_from, e) for e in svc.cache.entries.values())
        assert [(L, C) for L, C, _ in entries] == [(PART + 7, PART), (DOC + 7, DOC)]  # d's and a's entries
        total = 0
        for L, C, e in entries:
            for i, kv in e.kv.layers.items():
                want = range(C - windows[i] + 1, L) if i in windows else range(L)
                assert sorted(kv.pos[:kv.length].tolist()) == list(want), (chunk, L, i)
            rows = sum(windows[i] - 1 + L - C if i in windows else L for i in layers)
            assert e.trimmed and kv_bytes(e.kv) == e.nbytes == e.rank_bytes[0] == rows * per_layer, (chunk, L)
            total += rows * per_layer
        assert svc.cache.used_bytes == svc.stats()["cache_bytes"] == total
    # the host and disk tiers keep trimmed entries as they are (tests/serving/test_trimmed_tiers.py)
    tiered = Scheduler(llm, cache_bytes=1 << 26, tiers=TierConfig(host_bytes=1 << 26))
    assert tiered.window_trim and tiered.executor.window_trim
    assert not Scheduler(llm, cache_bytes=1 << 26, window_trim=False).executor.window_trim
    assert not Scheduler(llm, cache_bytes=1 << 26, tiers=TierConfig(host_bytes=1 << 26),
                         window_trim=False).executor.window_trim


def test_a_trimmed_entry_serves_the_same_prompt_again(paths):
    """A prompt that is all document (the completions API: context_len = its length) sent three times, then
    continued: its window-trimmed entry is trimmed from length - 1 (a prompt always runs its last token), so the
    same prompt reuses all but its last token and the continuation all of it, answering as generate does."""
    llm = LLM(paths["gemma3"], progress=False)
    doc = _ids(0, DOC)
    prompts = [Prompt(doc, DOC)] * 3 + [Prompt(doc + _ids(11, 5), DOC + 5)]
    svc = Scheduler(llm, cache_bytes=1 << 26, window_trim=True)
    svc.start()
    try:
        got = []
        for p in prompts:
            events, done = submit(svc, p, NEW)
            assert done.wait(120)
            got.append((_tokens(events), events[-1].cached_tokens))
    finally:
        svc.shutdown()
    assert [c for _, c in got] == [0, DOC - 1, DOC - 1, DOC]
    assert [t for t, _ in got] == [llm.generate(p, max_new_tokens=NEW).token_ids for p in prompts]
    first = min(svc.cache.entries.values(), key=lambda e: e.id)
    assert first.trimmed and first.serves_from == DOC - 1 and len(first) == DOC


@pytest.mark.parametrize("fp8", [False, True])
def test_compact_local_keeps_what_follows_the_document(fp8):
    """KVCache.compact_local on a CP-like shard (shuffled positions): the local layer keeps exactly the rows
    at positions >= start - (window - 1), as stored (e4m3 bytes and scales alike), in tensors of that many
    rows; a global layer, and a local one whose window covers everything, keep every row."""
    torch.manual_seed(0)
    perm = torch.randperm(12)
    kv = KVCache([0, 1, 2], 1, 2, 8, 12, torch.float32, "cpu", fp8=fp8)
    for i in kv.layers:
        kv.layer(i).append(torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8), perm)
    before = {i: kv.layer(i).stored() for i in kv.layers}
    kv.compact_local({0: 4, 2: 20}, 9)
    keep = perm >= 6
    s, b = kv.layer(0).stored(), before[0]
    assert kv.trimmed and kv.layer(0).capacity == kv.layer(0).length == int(keep.sum())
    assert torch.equal(s.pos, perm[keep])
    for part in ("k", "v") + (("k_scale", "v_scale") if fp8 else ()):
        got, want = getattr(s, part), getattr(b, part)[:, :, keep]
        assert torch.equal(got.view(torch.uint8) if fp8 and part in "kv" else got,
                           want.view(torch.uint8) if fp8 and part in "kv" else want), part
    for i in (1, 2):
        assert not kv.layer(i).trimmed and kv.layer(i).length == 12 and torch.equal(kv.layer(i).pos[:12], perm)
    kv.compact_local({0: 4}, 100)  # past every key: none left, nothing allocated
    assert kv.layer(0).length == kv.layer(0).nbytes() == 0


def test_served_prefix_of_a_trimmed_entry():
    """A trimmed entry of a 20-token document (and a 2-token question) serves a prompt sharing at least the
    document (capped at len - 1: a token runs), none sharing fewer; an untrimmed one any shared prefix."""
    ids = np.arange(10, 32)
    cache = ContextCache(1 << 20)
    cache.add(CacheEntry(1, ids, None, 1, serves_from=20))
    assert cache.peek(np.concatenate([ids, [7, 8]])) == (cache.entries[1], 22)
    assert cache.peek(np.concatenate([ids[:20], [7, 8]])) == (cache.entries[1], 20)
    assert cache.peek(ids) == (cache.entries[1], 21)
    for prompt in (ids[:20], ids[:15], np.concatenate([ids[:19], [7, 8]])):
        assert cache.peek(prompt) == (None, 0)
    cache.entries[1].serves_from = 0
    assert cache.peek(ids[:15])[1] == 14 and cache.peek(ids[:20])[1] == 19
    assert served_prefix(cache.entries[1], 5) == 5


def test_cascade_graph_step_with_windows(paths):
    """The CUDA-graph step's eager twin (capture=False) on Gemma 2 (windows, soft-caps, scale): rows sharing
    all of a 40-token entry and its first 30 tokens step like run_cascade, and each row's logits are the
    model's own over its whole sequence (the windows hide most of the entry)."""
    model = LLM(paths["gemma2"], progress=False).model
    ids = torch.tensor([_ids(1, 40)])
    entry = KVCache(model.layer_ids, 1, 2, 8, 40, torch.float32, "cpu")
    with torch.inference_mode():
        model(ids, cache=entry, last_only=True)
        tok, pos = torch.tensor([[3], [4]]), torch.tensor([[40], [30]])
        outs = []
        for graph in (False, True):
            pool = OwnKV(model.layer_ids, 2, 2, 8, 4, torch.float32, "cpu")
            cascade = CascadeAttention([SharedGroup(entry, [0, 1], [40, 30], 40)], pool)
            step = CascadeGraph(model, cascade, 2, "cpu", capture=False).step if graph else (
                lambda t, p, c=cascade: run_cascade(model, t, p, c))
            outs.append(torch.stack([step(tok, pos), step(tok + 1, pos + 1)]))
        assert torch.allclose(outs[0], outs[1], atol=1e-5)
        for b, n in enumerate((40, 30)):
            seq = torch.cat([ids[:, :n], torch.tensor([[3 + b, 4 + b]])], 1)
            want = model(seq)[0, -2:]
            assert torch.allclose(outs[1][:, b], want, atol=1e-4), b
        # window-trimmed (the local layers keep positions >= 40 - (W - 1)): the row after all of it steps alike
        windows = {i: layer.attention.extras["window"] for i, layer in zip(model.layer_ids, model.layers)
                   if "window" in layer.attention.extras}
        entry.compact_local(windows, 40)
        assert entry.trimmed and 0 < len(windows) < len(model.layers)
        pool = OwnKV(model.layer_ids, 1, 2, 8, 4, torch.float32, "cpu")
        step = CascadeGraph(model, CascadeAttention([SharedGroup(entry, [0], [40], 40)], pool), 1, "cpu",
                            capture=False).step
        trimmed = torch.stack([step(tok[:1], pos[:1]), step(tok[:1] + 1, pos[:1] + 1)])
        assert torch.allclose(trimmed[:, 0], outs[1][:, 0], atol=1e-5)


def _cp_rank(rank, world, paths):
    """Each layout's (served, refs, each entry's rank_bytes) on rank 0; every rank: its entries' bytes held.
    The last two trim the local layers (window_trim)."""
    out = {}
    for name, strategy, chunk, trim in (("mistral", "ring", 0, False), ("mistral", "ring", 8, False),
                                        ("gemma2", "ring", 0, False), ("gemma3", "ulysses", 0, False),
                                        ("mistral", "star", 0, False), ("gemma3", "ring", 8, True),
                                        ("mistral", "star", 0, True)):
        llm = LLM(paths[name], progress=False, parallel=ParallelConfig(cp=world, cp_strategy=strategy))
        refs = _refs(llm)
        svcs = []
        if rank == 0:
            served = _serve(llm, chunk, trim, svcs)
        else:
            svcs.append(Scheduler(llm, cache_bytes=1 << 26, max_batch=4, prefill_chunk=chunk, window_trim=trim))
            svcs[0].serve_forever()
        entries = svcs[0].cache.entries.values()
        held = {e.id: (kv_bytes(e.kv), e.trimmed, e.rank_bytes) for e in entries}
        out[(name, strategy, chunk, trim)] = (served, refs, held) if rank == 0 else held
    return out


def test_service_equals_generate_past_the_window_cp2(paths):
    """cp=2 ring, Ulysses and Star, keeping every key and window-trimmed: the tokens equal generate's, and
    every rank records each entry's bytes as each rank holds them."""
    ranks = run_ranks(_cp_rank, 2, paths)
    assert len(ranks[0]) == 7
    for key, (served, refs, held) in ranks[0].items():
        trim = key[-1]
        _check(served, refs, key, trim)
        assert len(held) == (2 if trim else 1), key  # d prefilled when trimmed
        for entry, (mine, trimmed, rank_bytes) in held.items():
            assert trimmed == trim and ranks[1][key][entry] == (rank_bytes[1], trimmed, rank_bytes), (key, entry)
            assert mine == rank_bytes[0], (key, entry)
