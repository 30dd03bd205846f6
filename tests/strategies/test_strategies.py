"""The context strategies' registry (starshard/strategies/): complete (every name has a spec and a torch
class), options and flags round trip from the command line to the built strategy, each refusal is raised
once with its message, and the specs' KV rows and FLOP models give the numbers the planner and the
prefill benchmark gave before the registry."""
import argparse
import dataclasses
from types import SimpleNamespace

import pytest

from starshard.cli import add_layout_arguments, layout_error, parallel_config, plan_layout
from starshard.config import ParallelConfig
from starshard.kernels.sparse import refuse_sparse
from starshard.parallel.context import CLASSES, make_strategy
from starshard.planner import Layout, Workload, kv_tokens_and_rows, plan_memory, smallest_layout
from starshard.presets import preset_config
from starshard.strategies import (OPTIONS, SPECS, STRATEGIES, check, fp8_attention_error, get_spec, given_options,
                                  sparse_error)
from starshard.strategies.flops import PrefillFlops

CFG = preset_config("llama-3.1-8b")


def parse(argv):
    ap = argparse.ArgumentParser()
    add_layout_arguments(ap)
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------- complete
def test_every_strategy_has_a_spec_and_a_torch_class():
    assert STRATEGIES == ("dense", "ring", "ulysses", "usp", "star", "apb")  # --cp-strategy's order
    assert set(CLASSES) == set(SPECS) == set(STRATEGIES)
    for name in STRATEGIES:
        assert SPECS[name].name == CLASSES[name].name == name
        kept, rows, flight = get_spec(name).kv_rows(Layout(cp=1 if name == "dense" else 2, strategy=name), Workload(64))
        assert kept > 0 and rows > 0 and flight >= 0


def test_every_option_is_a_parallel_config_field_with_one_flag():
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    assert set(OPTIONS) <= fields
    flags = [o.flag for o in OPTIONS.values()]
    assert len(set(flags)) == len(flags)
    for o in OPTIONS.values():  # an exclusive option belongs to exactly one strategy
        assert not o.exclusive or sum(o in s.options for s in SPECS.values()) == 1


# ---------------------------------------------------------------------------- options round trip
VALUES = {"ulysses_degree": "2", "block_size": "8", "num_blocks": "4", "anchor_size": "3", "passing_size": "5",
          "compressor": "random", "compressor_path": "w.safetensors", "prefix_len": "2", "apb_hosts": "4",
          "query_rank": "0"}


@pytest.mark.parametrize("field", list(OPTIONS))
def test_each_flag_sets_its_field(field):
    o = OPTIONS[field]
    args = parse([o.flag] if o.const is not None else [o.flag, VALUES[field]])
    want = o.const if o.const is not None else (o.type or str)(VALUES[field])
    assert getattr(args, field) == want
    assert given_options(args) == {field: want}


def test_flags_reach_the_built_strategy():
    args = parse(["--cp-strategy", "apb", "--apb-hosts", "3", "--anchor-size", "5", "--passing-size", "2",
                  "--compressor", "random", "--no-embed-query", "--prefix-len", "1", "--query-rank", "0"])
    assert layout_error(args) is None
    p = parallel_config(args)
    s = make_strategy(p.cp_strategy, **given_options(p))
    assert (s.hosts, s.anchor_size, s.passing_size, s.compressor.name, s.embed_query, s.prefix_len, s.query_rank) == \
        (3, 5, 2, "random", False, 1, 0)
    star = make_strategy("star", **given_options(parallel_config(parse(["--cp-strategy", "star", "--num-blocks", "4",
                                                                         "--anchor-size", "6"]))))
    assert (star.num_blocks, star.anchor_size, star.block_size) == (4, 6, None)
    assert make_strategy("usp").u == 1 and make_strategy("ring").name == "ring"


def test_the_planners_layout_of_the_flags_is_the_one_of_their_parallel_config():
    """What a command plans from its flags (cli.plan_layout) is what the LLM it builds runs (Layout.of(llm.parallel),
    which serve plans from)."""
    for argv in ([], ["--cp-strategy", "apb", "--apb-hosts", "3", "--anchor-size", "5"],
                 ["--tp", "2", "--pp", "2", "--pp-layers", "3,5", "--cp", "4", "--cp-strategy", "star", "--num-blocks",
                  "4", "--anchor-size", "6", "--block-size", "100", "--query-rank", "1"]):
        args = parse(argv)
        assert Layout.of(parallel_config(args)) == plan_layout(args), argv


# ---------------------------------------------------------------------------- refusals, each from its spec
def test_one_rank_strategy_on_a_cp_group():
    msg = "cp=2 needs a context strategy: --cp-strategy ring, ulysses, usp, star or apb"
    for raise_it in (lambda: check("dense", 2, {}), lambda: Layout(cp=2), lambda: ParallelConfig(cp=2)):
        with pytest.raises(ValueError, match=msg):
            raise_it()
    tiny = preset_config("tiny")
    plan = smallest_layout(tiny, Workload(64), "dense", 1 << 40)
    assert plan.layout.cp == 1 and plan.layout.strategy == "dense"


def test_query_rank_outside_the_group():
    """--query-rank is checked before anything loads (a negative one would plan the query's KV on no rank)."""
    for q in (-1, 2):
        with pytest.raises(ValueError, match=f"--query-rank {q} is outside the CP group of 2 ranks: give 0..1"):
            check("ring", 2, {"query_rank": q})
    check("ring", 2, {"query_rank": 0})
    assert "--query-rank -1 is outside" in layout_error(parse(["--cp", "2", "--query-rank", "-1"]))


def test_unknown_strategy():
    for raise_it in (lambda: check("spiral", 1, {}), lambda: Layout(strategy="spiral"), lambda: make_strategy("spiral")):
        with pytest.raises(ValueError, match="unknown --cp-strategy 'spiral'; choose one of dense, ring"):
            raise_it()


def test_exclusive_options_are_refused_elsewhere():
    msg = r"--passing-size, --apb-hosts only apply to --cp-strategy apb \(got star\); drop them or use --cp-strategy apb"
    with pytest.raises(ValueError, match=msg):
        check("star", 1, {"passing_size": 3, "apb_hosts": 2})
    assert "--no-embed-query only apply to --cp-strategy apb" in layout_error(parse(["--no-embed-query"]))
    check("ring", 2, {"block_size": 8, "anchor_size": 3, "ulysses_degree": 2})  # shared options: ignored, as before


def test_sparse_with_ring_or_usp():
    for name in STRATEGIES:
        assert (sparse_error(name) is None) == (name not in ("ring", "usp"))
    msg = "--sparse does not compose with --cp-strategy usp: .* use dense, ulysses, star or apb"
    with pytest.raises(ValueError, match=msg):
        refuse_sparse(object(), "usp")
    refuse_sparse(None, "ring")


def test_fp8_attention_strategies():
    assert [n for n in STRATEGIES if fp8_attention_error(n, 2, False) is None] == ["dense", "ulysses", "star"]
    bad = fp8_attention_error("star", 2, True)
    assert bad.startswith("--fp8 attention (8-bit prefill scores) runs on the dense path, in Star's context blocks "
                          "and in Ulysses, without --sparse; got --cp 2 --cp-strategy star with --sparse")
    assert bad.endswith("use --cp-strategy dense / star / ulysses without --sparse")
    args = parse(["--cp", "2", "--cp-strategy", "ring"])
    args.fp8 = "attention"
    assert "got --cp 2 --cp-strategy ring:" in layout_error(args)


def test_ulysses_heads_and_usp_degree():
    with pytest.raises(ValueError, match=r"Ulysses needs the query heads .* 6, divisible by cp=4"):
        get_spec("ulysses").check_heads(6, 2, 4, {})
    with pytest.raises(ValueError, match=r"Ulysses needs the query heads .* 6, divisible by cp=4"):
        get_spec("usp").check_heads(6, 2, 8, {"ulysses_degree": 4})
    get_spec("usp").check_heads(6, 2, 8, {"ulysses_degree": 2})
    get_spec("ulysses").check_heads(6, 2, 1, {})  # one rank: nothing to split
    get_spec("ring").check_heads(6, 2, 4, {})
    with pytest.raises(ValueError, match=r"--ulysses-degree 3 must divide --cp 4; valid: \[1, 2, 4\]"):
        check("usp", 4, {"ulysses_degree": 3})


@pytest.mark.parametrize("name, options, msg", [
    ("star", {"block_size": 0}, "--block-size must be >= 1, got 0"),
    ("star", {"num_blocks": 2, "block_size": 8}, "give --block-size or --num-blocks, not both"),
    ("apb", {"passing_size": -1}, "--passing-size must be >= 0, got -1"),
    ("apb", {"anchor_size": -2}, "--anchor-size must be >= 0, got -2"),
    ("apb", {"apb_hosts": 0}, "--apb-hosts must be >= 1, got 0"),
    ("apb", {"block_size": 8}, "--block-size is Star's"),
    ("apb", {"num_blocks": 3, "apb_hosts": 4}, "--num-blocks 3 and --apb-hosts 4 disagree"),
    ("apb", {"compressor": "retaining-heads"}, "--compressor retaining-heads and --compressor-path FILE go together"),
    ("apb", {"compressor_path": "w.pt"}, "go together"),
])
def test_option_values_each_strategy_refuses(name, options, msg):
    with pytest.raises(ValueError, match=msg):
        check(name, 1, options)
    with pytest.raises(ValueError, match=msg):
        make_strategy(name, **options)


def test_apb_hosts_on_a_cp_group():
    with pytest.raises(ValueError, match="--apb-hosts 2 simulates hosts on one device; with --cp 4 the CP ranks are "
                                         "the hosts: drop --apb-hosts or run --cp 1"):
        check("apb", 4, {"apb_hosts": 2})
    check("apb", 4, {"apb_hosts": 4})


def test_compositions():
    assert [n for n in STRATEGIES if SPECS[n].exact] == ["dense", "ring", "ulysses", "usp"]
    assert [n for n in STRATEGIES if not SPECS[n].context_cache] == ["apb"]  # its KV depends on the question
    assert [n for n in STRATEGIES if SPECS[n].chunked_prefill] == ["dense", "ring", "ulysses", "usp", "star"]


# ---------------------------------------------------------------------------- sizes and FLOPs, as before
# (KV tokens kept, rows, KV in flight) and the peak bytes from the planner before the registry
# (llama-3.1-8b, tp 2), keyed by (strategy, cp, prompt, context, new tokens, prefill chunk + fp8 kv, pp).
KV_BEFORE = {
    ("dense", 1, 10000, 9000, 16, None, 2): ((10016, 1250, 0), 4447410688),
    # a context strategy's plan follows --prefill-chunk since issue 36 (the whole prompt's was ((1026, 1026, 2052),
    # 8153969664), the plan with no chunk still): one chunk's zigzag shard per forward, the chunked layout's KV
    ("ring", 4, 4097, 4000, 0, 1024, 1): ((1025, 256, 512), 8113004288),
    ("ulysses", 4, 131072, None, 64, None, 1): ((32832, 32768, 0), 13210765824),
    ("usp", 4, 10000, 9000, 16, None, 2): ((2516, 2500, 5000), 4313330688),
    ("star", 3, 10000, 9000, 16, None, 2): ((4016, 6000, 0), 4639154688),
    ("apb", 4, 131072, None, 64, None, 1): ((32833, 40961, 16384), 13580012288),
}


@pytest.mark.parametrize("key", list(KV_BEFORE))
def test_kv_rows_and_peak_as_before(key):
    name, cp, L, C, N, chunk, pp = key
    lay = Layout(tp=2, pp=pp, cp=cp, strategy=name)
    w = Workload(L, C, N, chunk, fp8_kv=chunk is not None)
    rows, peak = KV_BEFORE[key]
    assert kv_tokens_and_rows(CFG, lay, w) == get_spec(name).kv_rows(lay, w) == rows
    assert plan_memory(CFG, lay, w).peak_bytes == peak


def test_sized_star_and_apb_as_before():
    w = Workload(9000, 8000, 5)
    star = Layout(cp=4, strategy="star", block_size=1000, anchor_size=500)
    apb = Layout(cp=4, strategy="apb", anchor_size=100, query_rank=0)
    assert kv_tokens_and_rows(CFG, star, w) == (3005, 1500, 0) and plan_memory(CFG, star, w).peak_bytes == 16664572160
    assert kv_tokens_and_rows(CFG, apb, w) == (3005, 3100, 1000) and plan_memory(CFG, apb, w).peak_bytes == 16891490560


# Per-rank totals of the prefill benchmark's FLOP models before the registry: an 8192-token prompt,
# cp 4; star block = anchor = 2000 and apb anchor 512, passing 256 over an 8000-token context.
FLOPS_BEFORE = {
    "dense": [131962847625216.0],
    "ring": [32895654690816.0, 33022397644800.0, 33022397644800.0, 33022397644800.0],
    "star": [31848824569856.0, 62912364281856.0, 62912364281856.0, 62922078289920.0],
    "apb": [34639261466624.0, 42913113309184.0, 43181548765184.0, 43359034933248.0],
}


def test_flops_as_before():
    built = {"dense": None, "ring": SimpleNamespace(cp=4), "ulysses": SimpleNamespace(cp=4),
             "usp": SimpleNamespace(cp=4), "star": SimpleNamespace(cp=4, resolved_sizes=lambda c: (2000, 2000),
                                     anchor_stored=lambda: False),  # the anchor recomputed, as before
             "apb": SimpleNamespace(hosts=4, resolved_sizes=lambda c: (512, 256), embed_query=True)}
    for name in STRATEGIES:
        ranks = get_spec(name).prefill_flops(CFG, 8192, 8000, built[name])
        assert all(isinstance(r, PrefillFlops) for r in ranks)
        assert [r.total for r in ranks] == FLOPS_BEFORE[{"ulysses": "ring", "usp": "ring"}.get(name, name)], name
