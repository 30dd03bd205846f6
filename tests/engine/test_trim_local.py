"""Trimmed local layers (issue 38, "a local layer keeps only its last window keys"): with
LocalRunner.new_cache(trim_local=True) a sliding-window layer holds at most window - 1 + step rows (a
ring for decode, the last window - 1 rows kept before each prefill block), global layers every key.
Tiny random Gemma 2, Gemma 3 and windowed Mistral saved by transformers, window 16, prompts of 100
tokens, 40 new tokens: greedy tokens and every step's logits equal the untrimmed cache's and
transformers', for the whole prompt and for chunks below, at and above the window, eagerly and through
the device-indexed step CUDA graphs replay."""
import pytest
import torch
import transformers
from tests.engine.test_gemma import FAMILIES as GEMMA
from tests.engine.test_sliding_window_families import FAMILIES as SWA
from tests.helpers.hf_models import make_hf_model

from starshard.checkpoints.load import load_model
from starshard.engine.kv_cache import LayerKV
from starshard.llm import LLM
from starshard.runtime.cuda_graph import GraphDecoder
from starshard.runtime.local import LocalRunner

transformers.logging.set_verbosity_error()

W = 16
L = 100
STEPS = 40
NAMES = {"gemma2": GEMMA["gemma2"], "gemma3": GEMMA["gemma3"], "mistral": SWA["mistral"]}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    base = tmp_path_factory.mktemp("trim")
    out = {}
    for name, (arch, kw) in NAMES.items():
        assert kw["sliding_window"] == W
        hf, path = make_hf_model(arch, base / name, eos_token_id=None, initializer_range=0.1, **kw)
        ids = torch.randint(0, 211, (L,), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            g = hf.generate(ids[None], attention_mask=torch.ones(1, L, dtype=torch.long), max_new_tokens=STEPS,
                            do_sample=False, output_logits=True, return_dict_in_generate=True)
        out[name] = (path, ids, g.sequences[0, L:].tolist(), torch.cat(g.logits))
    return out


def greedy(model, ids, chunk, trim, graph=False, kv_fp8=False):
    """Greedy decode (prompt whole or in chunks of `chunk`, then STEPS - 1 one-token steps, eager or the
    graph decoder's step run eagerly) -> (logits per step, tokens, cache)."""
    cache = LocalRunner(model, kv_fp8=kv_fp8).new_cache(L + STEPS, L, None, chunk, trim_local=trim)
    rows, toks = [], []
    with torch.no_grad():
        for s in range(0, L, chunk or L):
            logits = model(ids[None, s : s + (chunk or L)], cache=cache, last_only=True)
        dec = GraphDecoder(model, cache, capture=False) if graph else None
        for i in range(STEPS):
            if i:
                x = torch.tensor([[toks[-1]]])
                if dec is not None:
                    assert dec.fits()  # the ring never asks the cache to grow
                logits = dec.step(x) if dec is not None else model(x, cache=cache, last_only=True)
            rows.append(logits[0, -1].clone())
            toks.append(int(rows[-1].argmax()))
    return torch.stack(rows), toks, cache


def assert_trimmed(model, cache, step):
    """Local layers: at most window - 1 + step rows allocated (and the bytes of that), global ones every token."""
    local = [i for i, layer in zip(model.layer_ids, model.layers) if "window" in layer.attention.extras]
    assert local and (len(local) < len(model.layer_ids)) == (model.config.arch != "mistral")
    for i in model.layer_ids:
        kv = cache.layer(i)
        if i in local:
            assert kv.trimmed and kv.capacity <= W - 1 + step and kv.length <= kv.capacity, (i, kv.capacity)
            full = LayerKV(1, kv.k.shape[1], kv.k.shape[3], L + STEPS, kv.dtype, kv.k.device)
            assert kv.nbytes() * (L + STEPS) == full.nbytes() * kv.capacity
        else:
            assert not kv.trimmed and kv.capacity == kv.length + 1 == L + STEPS  # the last token's KV is never stored


@pytest.mark.parametrize("name", sorted(NAMES))
def test_trimmed_cache_decodes_as_the_full_one(families, name):
    path, ids, ref_toks, ref = families[name]
    model = load_model(path)
    full_logits, full_toks, full = greedy(model, ids, None, trim=False)
    assert not full.trimmed and full_toks == ref_toks and rel(full_logits, ref) <= 1e-4
    # chunk None: the prompt attends its own keys, keeps 15; 8: below the window (the decode path), 24: above
    for chunk, graph, step in ((None, False, 1), (8, False, 8), (24, False, 24), (None, True, 1), (24, True, 24)):
        logits, toks, cache = greedy(model, ids, chunk, trim=True, graph=graph)
        assert toks == ref_toks, (chunk, graph)
        assert rel(logits, full_logits) <= 1e-5, (chunk, graph, rel(logits, full_logits))
        assert rel(logits, ref) <= 1e-4, (chunk, graph, rel(logits, ref))
        assert_trimmed(model, cache, step)
        assert cache.next_position == full.next_position == L + STEPS - 1


def test_fp8_kv_trimmed_decodes_as_untrimmed(families):
    """--fp8 kv: the trimmed e4m3 cache (held rows read as stored, the first block as given) gives the
    untrimmed e4m3 cache's tokens and logits, whole prompt and chunks of 24, eager and graph step."""
    path, ids, _, _ = families["gemma3"]
    model = load_model(path)
    for chunk, graph in ((None, False), (24, True)):
        want_logits, want, _ = greedy(model, ids, chunk, trim=False, kv_fp8=True)
        logits, toks, cache = greedy(model, ids, chunk, trim=True, graph=graph, kv_fp8=True)
        assert toks == want and rel(logits, want_logits) <= 1e-5, (chunk, rel(logits, want_logits))
        assert cache.trimmed and all(kv.fp8 for kv in cache.layers.values())


def test_ring_keeps_exactly_the_window():
    """LayerKV alone: after a prefill block, single-token ring writes and another block, it holds the
    newest keys by position (some overwritten in place), nothing older than window - 1 back."""
    kv = LayerKV(1, 2, 4, 8, torch.float32, "cpu", window=5)
    def rows(a, b):
        x = torch.arange(a, b, dtype=torch.float32)[None, None, :, None].expand(1, 2, b - a, 4)
        return x, -x, torch.arange(a, b)
    k, v, p = kv.append(*rows(0, 30))  # nothing held: the block as given, its last 4 kept
    assert torch.equal(p, torch.arange(30)) and kv.length == 4
    assert sorted(kv.view()[2].tolist()) == [26, 27, 28, 29]
    for t in range(30, 43):
        kv.store(*rows(t, t + 1))
    assert kv.capacity == 8 and kv.length == 8 and kv.head != 0  # wrapped round the ring
    ks, vs, ps = kv.view()
    assert sorted(ps.tolist()) == list(range(35, 43))
    assert torch.equal(ks[0, 0, :, 0], ps.float()) and torch.equal(vs[0, 1, :, 0], -ps.float())
    held = kv.append_stored(*rows(43, 47))  # a block: the last 4 held come first, in order
    assert held.pos.tolist() == [39, 40, 41, 42] and torch.equal(held.k[0, 0, :, 0], held.pos.float())
    assert kv.view()[2].tolist() == list(range(39, 47)) and kv.capacity == 8
    kv.store(*rows(47, 52))  # a block that does not fit next to the window - 1 rows: the cache grows
    assert kv.view()[2].tolist() == list(range(43, 52)) and kv.capacity >= 9


def test_fp8_trimmed_cache_keeps_the_same_bytes():
    """An e4m3 cache moves its bytes and scales with the rows: the same stored entries as untrimmed."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 60, 8, generator=g), torch.randn(1, 2, 60, 8, generator=g)
    full = LayerKV(1, 2, 8, 60, torch.float32, "cpu", fp8=True)
    trim = LayerKV(1, 2, 8, 12, torch.float32, "cpu", fp8=True, window=6)
    for kv in (full, trim):
        kv.append(k[:, :, :20], v[:, :, :20], torch.arange(20))
        kv.append_stored(k[:, :, 20:26], v[:, :, 20:26], torch.arange(20, 26))
        for t in range(26, 60):
            kv.store(k[:, :, t : t + 1], v[:, :, t : t + 1], torch.arange(t, t + 1))
    s, f = trim.stored(), full.stored()
    idx = s.pos
    assert sorted(idx.tolist()) == list(range(48, 60)) and trim.capacity == 12
    for a, b in ((s.k, f.k), (s.v, f.v)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)[:, :, idx])
    assert torch.equal(s.k_scale, f.k_scale[:, :, idx]) and torch.equal(s.v_scale, f.v_scale[:, :, idx])


def test_generate_trims_only_where_the_runner_can(families, monkeypatch):
    """LLM.generate trims (tokens still transformers'); a cache for anything else (the service's, a
    context strategy's) keeps every key."""
    from starshard.parallel.context import make_strategy
    from starshard.runtime.context_parallel import ContextParallelRunner

    path, ids, ref_toks, _ = families["gemma3"]
    llm = LLM(path)
    made = []
    new_cache = llm.runner.new_cache
    monkeypatch.setattr(llm.runner, "new_cache", lambda *a, **kw: made.append(new_cache(*a, **kw)) or made[-1])
    for chunk in (None, 24):
        assert llm.generate(ids.tolist(), max_new_tokens=STEPS, prefill_chunk=chunk).token_ids == ref_toks
        assert made[-1].trimmed
    assert not llm.runner.new_cache(L + STEPS, L).trimmed  # the default: every key
    cp = ContextParallelRunner(load_model(path), make_strategy("star"))
    assert not cp.trims_local() and not cp.new_cache(L + STEPS, L, trim_local=True).trimmed


def test_short_prompts_and_blocks_within_the_window(families):
    """A prompt of a few tokens (the decode path, <= 16 rows) and prompts shorter than the window, whole or
    chunked: the trimmed cache still decodes as the full one and never grows past its plan."""
    path, ids, _, _ = families["gemma2"]
    model = load_model(path)
    for layer in model.layers:  # a window of 5: a first block of up to 16 rows (the decode path) outgrows it
        if "window" in layer.attention.extras:
            layer.attention.extras["window"] = 5
    for n, chunk in ((3, None), (10, None), (10, 4), (30, 7), (30, 12)):
        p = ids[:n]
        out = {}
        for trim in (False, True):
            cache = LocalRunner(model).new_cache(n + 20, n, None, chunk, trim_local=trim)
            caps = {i: kv.capacity for i, kv in cache.layers.items()}
            toks, rows = [], []
            with torch.no_grad():
                for s in range(0, n, chunk or n):
                    logits = model(p[None, s : s + (chunk or n)], cache=cache, last_only=True)
                for _ in range(20):
                    rows.append(logits[0, -1])
                    toks.append(int(rows[-1].argmax()))
                    logits = model(torch.tensor([[toks[-1]]]), cache=cache, last_only=True)
            assert {i: kv.capacity for i, kv in cache.layers.items()} == caps  # planned rows sufficed
            out[trim] = toks, torch.stack(rows), cache
        assert out[True][0] == out[False][0] and rel(out[True][1], out[False][1]) <= 1e-5, (n, chunk)
        assert out[True][2].trimmed


def test_planner_counts_local_layers_by_window(families):
    """plan_memory's KV cache (Workload.trim_local) is the bytes LocalRunner allocates, for
    a whole and a chunked prefill; tp trims too, pp and a CP group (and trim_local off) count every token."""
    from starshard.planner import Layout, Workload, plan_memory

    path, _, _, _ = families["gemma3"]
    model = load_model(path)
    cfg = model.config
    for chunk in (None, 24):
        w = Workload(L, None, STEPS, chunk, dtype_bytes=4, trim_local=True)
        cache = LocalRunner(model).new_cache(L + STEPS, L, None, chunk, trim_local=True)
        assert plan_memory(cfg, Layout(), w).worst.kv_cache == sum(kv.nbytes() for kv in cache.layers.values())
        full = LocalRunner(model).new_cache(L + STEPS, L, None, chunk)
        untrimmed = plan_memory(cfg, Layout(), Workload(L, None, STEPS, chunk, dtype_bytes=4))
        assert untrimmed.worst.kv_cache == sum(kv.nbytes() for kv in full.layers.values())
        assert plan_memory(cfg, Layout(), w).worst.kv_cache < untrimmed.worst.kv_cache
    w = Workload(L, None, STEPS, None, dtype_bytes=4, trim_local=True)
    for lay in (Layout(cp=2, strategy="ring"), Layout(pp=2), Layout(tp=2)):
        off = plan_memory(cfg, lay, Workload(L, None, STEPS, None, dtype_bytes=4))
        on = plan_memory(cfg, lay, w)
        assert on.worst.kv_cache < off.worst.kv_cache if lay.tp == 2 else on.worst.kv_cache == off.worst.kv_cache


def _tp_rank(rank, world, path, ids):
    from starshard.config import ParallelConfig

    llm = LLM(path, parallel=ParallelConfig(tp=world))
    made = []
    new_cache = llm.runner.new_cache
    llm.runner.new_cache = lambda *a, **kw: made.append(new_cache(*a, **kw)) or made[-1]
    toks = llm.generate(ids.tolist(), max_new_tokens=STEPS, prefill_chunk=24).token_ids
    return toks, {i: kv.capacity for i, kv in made[-1].layers.items()}


def test_tp2_trims_as_one_process(families):
    """tp=2 (gloo), prefill in chunks of 24: each rank's local layers keep window - 1 + 24 rows, the global
    ones every token, and the tokens are transformers'."""
    from tests.helpers.mp_harness import run_ranks

    path, ids, ref_toks, _ = families["gemma3"]
    model = load_model(path)
    local = [i for i, layer in zip(model.layer_ids, model.layers) if "window" in layer.attention.extras]
    for toks, caps in run_ranks(_tp_rank, 2, path, ids):
        assert toks == ref_toks
        assert all(caps[i] == (W - 1 + 24 if i in local else L + STEPS) for i in caps), caps


def test_whole_cache_readers_refuse_a_trimmed_cache(families):
    """The service's context cache takes a trimmed cache only as a trimmed entry (serves_from); its host /
    disk tiers copy one as it is, each layer's rows and window (tests/serving/test_trimmed_tiers.py)."""
    import numpy as np

    from starshard.serving.context_cache import CacheEntry, ContextCache
    from starshard.serving.host_tier import to_device, to_host

    path, ids, _, _ = families["mistral"]
    model = load_model(path)
    cache = LocalRunner(model).new_cache(L + 2, L, trim_local=True)
    with torch.no_grad():
        model(ids[None], cache=cache)
    assert cache.trimmed
    host = to_host(cache, serves_from=L)
    assert host.windows and all(host.rows(i) <= w - 1 for i, w in host.windows.items())
    back = to_device(host, "cpu").kv
    assert [(kv.window, kv.length) for kv in back.layers.values()] == [(kv.window, kv.length)
                                                                       for kv in cache.layers.values()]
    with pytest.raises(ValueError, match=r"ContextCache: a trimmed KV cache .* cannot be a context cache entry"):
        ContextCache(1 << 30).add(CacheEntry(0, np.asarray(ids), cache, 0))
    full = LocalRunner(model).new_cache(L + 2, L)
    with torch.no_grad():
        model(ids[None], cache=full)
    assert to_host(full).length == L  # the same cache untrimmed is taken
