"""APB wiring: make_strategy / ParallelConfig / LLM / CLI flags reach APBAttention, the runner binds
the model and hands it the chat template's head (Prompt.head_len), bad flag combinations are refused
before any model loads, and launch/eval.py runs APB in study mode (--apb-hosts)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.helpers.hf_models import make_hf_model
from starshard.config import ParallelConfig
from starshard.runtime.prompt import Prompt, build_prompt
from starshard.parallel.context import apb_options, make_strategy
from starshard.parallel.context.apb import APBAttention, RandomCompressor
from starshard.runtime.context_parallel import ContextParallelRunner

ROOT = Path(__file__).resolve().parents[2]


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"{name}_cli", ROOT / "starshard" / "commands" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    _, path = make_hf_model("llama", tmp_path_factory.mktemp("apbw"))
    return path


@pytest.fixture(scope="module")
def smol_tok():
    from starshard.checkpoints.default import default_checkpoint
    from starshard.runtime.prompt import load_tokenizer

    try:
        tok = load_tokenizer(default_checkpoint(progress=False))
    except Exception as e:  # noqa: BLE001 - no default model in this environment
        pytest.skip(f"the default model is not available: {e}")
    if tok is None or not getattr(tok, "chat_template", None):
        pytest.skip("the default model has no tokenizer with a chat template")
    return tok


def test_make_strategy_builds_apb_with_its_options():
    s = make_strategy("apb", anchor_size=5, passing_size=3, compressor="random", embed_query=False, prefix_len=2,
                      apb_hosts=4)
    assert isinstance(s, APBAttention) and isinstance(s.compressor, RandomCompressor)
    assert (s.anchor_size, s.passing_size, s.embed_query, s.prefix_len, s.hosts, s.cp) == (5, 3, False, 2, 4, 1)
    d = make_strategy("apb")
    assert d.hosts == 1 and d.prefix_len is None and d.embed_query and d.compressor.name == "query"
    p = ParallelConfig(cp_strategy="apb", passing_size=0, embed_query=False, apb_hosts=3)
    assert apb_options(p) == {"passing_size": 0, "embed_query": False, "apb_hosts": 3}
    assert make_strategy("apb", **apb_options(p)).hosts == 3
    assert make_strategy("apb", num_blocks=4).hosts == 4  # Star's --num-blocks means the same for APB
    assert make_strategy("apb", num_blocks=4, apb_hosts=4).hosts == 4
    with pytest.raises(ValueError, match="disagree"):
        make_strategy("apb", num_blocks=3, apb_hosts=4)


def test_apb_options_are_refused_elsewhere_with_the_flag_named():
    with pytest.raises(ValueError, match="--passing-size, --apb-hosts only apply to --cp-strategy apb"):
        make_strategy("star", passing_size=3, apb_hosts=2)
    with pytest.raises(ValueError, match="--block-size is Star's"):
        make_strategy("apb", block_size=8)
    with pytest.raises(TypeError, match="bogus"):
        make_strategy("apb", bogus=1)
    with pytest.raises(ValueError, match="--apb-hosts must be >= 1"):
        make_strategy("apb", apb_hosts=0)
    with pytest.raises(ValueError, match="--compressor-path"):
        make_strategy("apb", compressor="retaining-heads")
    with pytest.raises(ValueError, match="per host"):
        APBAttention(num_blocks=5).segments(10, 4)
    assert make_strategy("star", passing_size=None).name == "star"  # unset options are fine


def test_runner_binds_the_model_and_passes_the_template_head(model_path):
    """The runner binds the RoPE (query re-rotation) and sets prefix_len from Prompt.head_len: the
    cache then equals an explicit prefix_len run and differs from prefix_len 0."""
    from starshard.checkpoints.load import load_model
    from starshard.config import SamplingConfig

    model = load_model(model_path)
    ids = torch.randint(0, 211, (57,), generator=torch.Generator().manual_seed(4)).tolist()
    C, head = 49, 4

    def cache_after(prompt, **kw):
        runner = ContextParallelRunner(model, APBAttention(num_blocks=3, anchor_size=8, passing_size=3, **kw))
        assert runner.strategy.inv_freq is not None and runner.strategy.layer_ids == [0, 1, 2]
        cache = runner.new_cache(len(ids) + 1)
        with torch.no_grad():
            runner.prefill(prompt, cache, SamplingConfig(), None)
        return runner.strategy, cache.layer(2).view()[0].clone()

    s, auto = cache_after(Prompt(ids, C, head_len=head))
    assert s.effective_prefix_len == head
    _, explicit = cache_after(Prompt(ids, C), prefix_len=head)
    _, none = cache_after(Prompt(ids, C, head_len=head), prefix_len=0)  # an explicit value wins
    assert torch.equal(auto, explicit)
    assert (auto - none).abs().max() > 1e-4


def test_llm_runs_apb_study_mode_from_the_parallel_config(model_path):
    from starshard import LLM

    p = ParallelConfig(cp_strategy="apb", apb_hosts=3, anchor_size=6, passing_size=2, compressor="random")
    llm = LLM(model_path, parallel=p, progress=False)
    s = llm.runner.strategy
    assert isinstance(s, APBAttention) and s.hosts == 3 and s.passing_size == 2 and s.compressor.name == "random"
    ids = torch.randint(0, 211, (50,), generator=torch.Generator().manual_seed(6)).tolist()
    out = llm.generate(ids, max_new_tokens=3)
    # The same strategy run by hand (the token-id prompt borrows its last token as the query).
    runner = ContextParallelRunner(llm.model, APBAttention(num_blocks=3, anchor_size=6, passing_size=2,
                                                           compressor="random"))
    cache = runner.new_cache(60)
    with torch.no_grad():
        logits, _ = runner.prefill_logits(torch.tensor(ids), 49, cache)
    assert out.token_ids[0] == int(logits[0, -1].argmax())


def test_build_prompt_exposes_the_template_head(smol_tok):
    context, question = "Alpha beta gamma delta.", "Which letter?"
    p = build_prompt(smol_tok, context=context, question=question)
    text = smol_tok.apply_chat_template([{"role": "user", "content": context + "\n\n" + question}], tokenize=False,
                                        add_generation_prompt=True)
    head_text = text[: text.find(context)]
    assert p.head_len > 0 and p.ids[: p.head_len] == smol_tok.encode(head_text, add_special_tokens=False)
    assert smol_tok.decode(p.ids[p.head_len : p.context_len]) == context
    assert build_prompt(smol_tok, context=context, question=question, raw=True).head_len == 0
    assert build_prompt(None, prompt=[5, 6, 7]).head_len == 0


@pytest.mark.parametrize("script", ["infer", "eval"])
def test_cli_flags_and_errors(script, capsys):
    cli = load_script(script)
    base = ["--out", "x"] if script == "eval" else []
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--passing-size", "--compressor", "--compressor-path", "--no-embed-query", "--prefix-len",
                 "--apb-hosts", "--anchor-size", "query,retaining-heads,random"):
        assert flag in text
    assert "apb" in text
    bad = [(["--cp-strategy", "star", "--passing-size", "3"], "--passing-size only apply to --cp-strategy apb"),
           (["--no-embed-query"], "--no-embed-query only apply"),
           (["--cp-strategy", "apb", "--cp", "4", "--apb-hosts", "2"], "the CP ranks are the hosts"),
           (["--cp-strategy", "apb", "--compressor", "retaining-heads"], "--compressor-path FILE go together"),
           (["--cp-strategy", "apb", "--compressor-path", "w.safetensors"], "go together"),
           (["--cp-strategy", "apb", "--passing-size", "-1"], "--passing-size must be >= 0"),
           (["--cp-strategy", "apb", "--apb-hosts", "0"], "--apb-hosts must be >= 1")]
    for argv, msg in bad:
        with pytest.raises(SystemExit):
            cli.parse_args(base + argv)
        assert msg in capsys.readouterr().err
    args = cli.parse_args(base + ["--cp-strategy", "apb", "--apb-hosts", "4", "--passing-size", "0",
                                  "--no-embed-query", "--compressor", "random", "--prefix-len", "3"])
    assert (args.apb_hosts, args.passing_size, args.embed_query, args.compressor, args.prefix_len) == (4, 0, False,
                                                                                                      "random", 3)


def test_eval_flags_reach_the_parallel_config():
    cli = load_script("eval")

    class Strict:  # the real LLM's shape: layout flags go through a ParallelConfig
        def __init__(self, path=None, *, dtype=None, device="cpu", parallel=None, progress=True):
            self.parallel = parallel

    args = cli.parse_args(["--out", "x", "--cp-strategy", "apb", "--apb-hosts", "4", "--anchor-size", "0",
                           "--no-embed-query", "--compressor", "random"])
    p = cli.build_llm(args, Strict).parallel
    assert (p.cp_strategy, p.apb_hosts, p.anchor_size, p.embed_query, p.compressor) == ("apb", 4, 0, False, "random")
    assert apb_options(p) == {"compressor": "random", "embed_query": False, "apb_hosts": 4}


@pytest.mark.slow
def test_eval_smoke_apb_study_mode(tmp_path, smol_tok):
    """launch/eval.py --cp-strategy apb --apb-hosts 4 runs the real model end to end (a smoke, not a score)."""
    cli = load_script("eval")
    out = tmp_path / "apb"
    assert cli.main(["--tasks", "passkey", "--lengths", "1024", "--depths", "0.5", "--max-new-tokens", "12",
                     "--no-progress", "--cp-strategy", "apb", "--apb-hosts", "4", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["summary"]["samples"] == 1 and s["engine"]["apb_hosts"] == 4 and s["strategy"] == "apb"


STEPS = 4


def apb_logits_and_tokens(llm, ids):
    """(full-vocab query-phase logits of the last token, greedy tokens) through LLM's runner."""
    runner = llm.runner
    cache = runner.new_cache(len(ids) + 1)
    with torch.inference_mode():
        logits, _ = runner.prefill_logits(ids, len(ids) - 1, cache)  # as prefill(): the last token is the query
    sampler = getattr(runner.sample, "vocab", None)
    if sampler is not None:  # tensor parallel: this rank holds a vocab shard
        from starshard.parallel.tensor import gather_logits

        logits = gather_logits(logits, sampler)
    return logits[0, -1], llm.generate(ids.tolist(), max_new_tokens=STEPS).token_ids


def tp_layouts_rank(rank, world, path, ids, layouts):
    from starshard import LLM

    out = []
    for lay in layouts:
        llm = LLM(path, parallel=ParallelConfig(**lay), progress=False)
        logits, tokens = apb_logits_and_tokens(llm, ids)
        out.append({"logits": logits, "tokens": tokens, "coords": llm.topology.coords,
                    "hosts": llm.runner.strategy.hosts})
    return out


@pytest.mark.slow  # ~40 s on 2 cores: four spawned ranks build three tensor-parallel LLMs
def test_apb_composes_with_tp(tmp_path):
    """tp=2 x cp=2 and tp=2 with 2 virtual hosts (cp=1, dp=2) on 4 gloo ranks equal one process in
    study mode: one KV head (and its GQA group) per TP rank, random selection (tp-independent by
    construction), and the query compressor with whole blocks passed."""
    from tests.helpers.mp_harness import run_ranks
    from starshard import LLM

    _, path = make_hf_model("llama", tmp_path, num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                            eos_token_id=None)
    ids = torch.randint(0, 211, (61,), generator=torch.Generator().manual_seed(5))
    rnd = dict(cp_strategy="apb", anchor_size=6, passing_size=5, compressor="random")
    whole = dict(cp_strategy="apb", anchor_size=6, passing_size=40)
    layouts = [dict(tp=2, cp=2, **rnd), dict(tp=2, apb_hosts=2, **rnd), dict(tp=2, cp=2, **whole)]
    refs = [apb_logits_and_tokens(LLM(path, parallel=ParallelConfig(apb_hosts=2, **o), progress=False), ids)
            for o in (rnd, rnd, whole)]
    with torch.inference_mode():
        dense = LLM(path, progress=False).model(ids[None])[0, -1]
    assert rel(refs[0][0], dense) > 1e-3  # the selection matters: the comparison below can fail
    results = run_ranks(tp_layouts_rank, 4, path, ids, layouts)
    for i, (ref_logits, ref_tokens) in enumerate(refs):
        for res in results:
            r = res[i]
            assert r["hosts"] == 2
            assert rel(r["logits"], ref_logits) <= 1e-4, (layouts[i], rel(r["logits"], ref_logits))
            assert r["tokens"] == ref_tokens, layouts[i]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
