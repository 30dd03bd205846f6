"""Attention-level fidelity of approximate attention (Star, APB, MInference) against dense, per layer.

    python launch/fidelity.py --task niah_number --length 2048 --depth 0.5 \\
        --star cp=4 --star cp=4,anchor=64 --apb cp=4 --minference pattern=vs,vertical=256,slash=512 --out runs/fid
    python launch/fidelity.py --random-weights tiny --length 300 --star block=64,anchor=8 --out /tmp/fid

Teacher-forced: the dense model runs once over the input; at every layer its post-RoPE q, k, v go to
each approximation, so every approximation is judged per layer on the same inputs (errors do not
compound). Per approximation and layer:
    rel_err_all / rel_err_query   ||o_approx - o_dense||_F / ||o_dense||_F over all rows / the query rows
                                  (the rows that decide the answer)
    recall_mean / recall_min_head share of the dense softmax mass on the (query, key) pairs the
                                  approximation keeps, per row, averaged over rows and heads / the
                                  lowest head's mean (the AnchorAttention / MInference metric)
    recall_query, density         recall over the query rows; kept pairs / causal pairs
    kernel_rel_err_*              MInference only: its kernel's own output against dense
Mask-defined outputs are masked dense attention (float64). Star and APB compute the query rows
densely, so their query-row error is 0 here: what they lose shows in the context rows (whose KV the
query reads), i.e. in rel_err_all and recall_mean.

Approximation specs are comma-separated key=value lists; each flag may be repeated:
    --star        block=B, anchor=A (default: the block), or cp=N (block = ceil(context / N))
    --apb         cp=N (default 4), anchor=A, passing=P (default: the paper's sizes for the block),
                  compressor=query|random|retaining-heads, compressor_path=FILE, embed_query=0|1,
                  prefix_len=N, seed=S
    --minference  config=FILE (a starshard or published MInference config), or one pattern for every
                  head: pattern=vs,vertical=V,slash=S | pattern=ashape,sink=S,local=W |
                  pattern=bs,topk=K | pattern=dense; plus block_size=, last_q=, force_sink=,
                  force_local=; kernel=0 skips the kernel's own output; backend=torch|triton
    --mask        fn=MODULE:FUNCTION, any other key=value is passed on as a keyword argument (numbers
                  as numbers): FUNCTION(x, **kwargs) gets the layer's inputs (LayerInputs: q, k, v after
                  RoPE, context_len) and returns the kept pairs as a bool mask [heads, L, L] or as
                  BlockKeys index lists (starshard.evaluation.fidelity); how a kernel that is not wired in
                  here (AnchorAttention) is measured
    any spec      name=LABEL (default: derived from the settings)

Writes fidelity.json (per layer and means), fidelity.md (table) and fidelity.png (per-layer recall and
error) to --out, and prints the table.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from starshard.checkpoints.load import load_model
from starshard.checkpoints.named import resolve_model
from starshard.checkpoints.sources import random_model
from starshard.cli import parse_layer_ids
from starshard.evaluation.fidelity import (DEFAULT_TILE_ELEMENTS, APBApproximation, MaskApproximation,
                                          MInferenceApproximation, StarApproximation, measure)
from starshard.evaluation.tasks import TASKS, make_sample, template_overhead
from starshard.kernels import minference as mi
from starshard.presets import preset_config
from starshard.runtime.prompt import build_prompt, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def parse_spec(text: str, flag: str) -> dict[str, str]:
    """'a=1,b=x' -> {'a': '1', 'b': 'x'}; a clear error for anything else."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, val = part.partition("=")
        if not eq or not key.strip():
            raise SystemExit(f"error: {flag} {text!r}: expected key=value pairs separated by commas, e.g. "
                             f"{flag} cp=4,anchor=64")
        out[key.strip().replace("-", "_")] = val.strip()
    return out


def _take(spec: dict, flag: str, allowed: dict):
    """Typed values of the allowed keys; unknown keys are an error that lists the known ones."""
    bad = set(spec) - set(allowed) - {"name"}
    if bad:
        raise SystemExit(f"error: {flag}: unknown key(s) {', '.join(sorted(bad))}; known: "
                         f"{', '.join(sorted(allowed))}, name")
    try:
        return {k: allowed[k](v) for k, v in spec.items() if k != "name"}
    except ValueError as e:
        raise SystemExit(f"error: {flag} {spec}: {e}") from None


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{v!r} is not a boolean (use 0 or 1)")


def build_approximations(args) -> list:
    out = []
    for text in args.star or []:
        spec = parse_spec(text, "--star")
        kw = _take(spec, "--star", {"block": int, "anchor": int, "cp": int})
        if "block" in kw and "cp" in kw:
            raise SystemExit("error: --star: give block= or cp=, not both (cp= sets block = ceil(context / cp))")
        try:
            a = StarApproximation(block_size=kw.get("block"), anchor_size=kw.get("anchor"), cp=kw.get("cp", 4))
        except ValueError as e:
            raise SystemExit(f"error: --star {text}: {e}") from None
        out.append(_named(a, spec))
    for text in args.apb or []:
        spec = parse_spec(text, "--apb")
        kw = _take(spec, "--apb", {"cp": int, "anchor": int, "passing": int, "compressor": str,
                                   "compressor_path": str, "embed_query": _bool, "prefix_len": int, "seed": int})
        try:
            a = APBApproximation(kw.get("cp", 4), anchor_size=kw.get("anchor"), passing_size=kw.get("passing"),
                                 compressor=kw.get("compressor", "query"), compressor_path=kw.get("compressor_path"),
                                 embed_query=kw.get("embed_query", True), prefix_len=kw.get("prefix_len", 0),
                                 seed=kw.get("seed", 0))
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"error: --apb {text}: {e}") from None
        out.append(_named(a, spec))
    for text in args.minference or []:
        spec = parse_spec(text, "--minference")
        kw = _take(spec, "--minference", {"config": str, "pattern": str, "vertical": int, "slash": int, "sink": int,
                                          "local": int, "topk": int, "block_size": int, "last_q": int,
                                          "force_sink": int, "force_local": int, "kernel": _bool, "backend": str})
        shared = {k: kw[k] for k in ("block_size", "last_q", "force_sink", "force_local") if k in kw}
        try:
            if "config" in kw:
                if "pattern" in kw:
                    raise SystemExit("error: --minference: give config= or pattern=, not both")
                cfg = mi.MInferenceConfig.load(kw["config"])
                for k, v in shared.items():
                    setattr(cfg, k, v)
                label = f"minference({Path(kw['config']).stem})"
            else:
                pattern = kw.get("pattern")
                if pattern is None:
                    raise SystemExit("error: --minference needs config=FILE or pattern=vs|ashape|bs|dense")
                fields = {k: kw[k] for k in ("vertical", "slash", "sink", "local", "topk") if k in kw}
                head = mi.head_pattern({"pattern": pattern, **fields})
                cfg = mi.MInferenceConfig(default=head, **shared)
                label = "minference(" + ",".join([head.kind] + [f"{k}={v}" for k, v in fields.items()]) + ")"
            if kw.get("backend") not in (None, "torch", "triton"):
                raise SystemExit(f"error: --minference backend={kw['backend']}: use torch or triton")
            a = MInferenceApproximation(cfg, name=spec.get("name", label), backend=kw.get("backend"),
                                        kernel_output=kw.get("kernel", True))
        except (ValueError, OSError) as e:
            raise SystemExit(f"error: --minference {text}: {e}") from None
        out.append(a)
    for text in args.mask or []:
        spec = parse_spec(text, "--mask")
        out.append(mask_approximation(spec, text))
    if not out:
        raise SystemExit("error: give at least one approximation: --star, --apb, --minference or --mask (see --help)")
    names = [a.name for a in out]
    if len(set(names)) != len(names):
        raise SystemExit(f"error: two approximations share a name ({names}); add name=LABEL to tell them apart")
    return out


def _number(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def mask_approximation(spec: dict, text: str):
    """--mask fn=MODULE:FUNCTION,...: a kept set from any importable function of the layer's inputs."""
    import functools
    import importlib

    target = spec.get("fn")
    if not target or ":" not in target:
        raise SystemExit(f"error: --mask {text}: needs fn=MODULE:FUNCTION (e.g. fn=mypkg.kept:select)")
    mod_name, _, fn_name = target.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"error: --mask {text}: cannot load {target}: {e}") from None
    kwargs = {k: _number(v) for k, v in spec.items() if k not in ("fn", "name")}
    a = MaskApproximation(spec.get("name", f"mask({fn_name})"), functools.partial(fn, **kwargs) if kwargs else fn)
    a.config = lambda: {"kind": "mask", "fn": target, "kwargs": kwargs}
    return a


def _named(a, spec: dict):
    if "name" in spec:
        a.name = spec["name"]
    return a


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = ap.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help="starshard checkpoint dir, HF model dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    m.add_argument("--random-weights", default=None, metavar="PRESET",
                   help="random weights of a preset shape (starshard.presets, e.g. tiny) or a config.json; the "
                        "input is then random token ids of --length (no tokenizer)")
    m.add_argument("--weights-seed", type=int, default=0, help="seed of --random-weights (default: 0)")
    m.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="model dtype for the dense forward pass (default: float32)")
    m.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device of the model and of the metrics (default: cuda if available, else cpu)")
    i = ap.add_argument_group("input (one of: a harness sample, a prompt file, a context file + question)")
    i.add_argument("--task", default="niah_number",
                   help="harness task (starshard.evaluation.tasks.TASKS) of the sample (default: niah_number)")
    i.add_argument("--length", type=int, default=2048,
                   help="sample length in tokens, sized as launch/eval.py sizes it (prompt + --max-new-tokens); "
                        "with --random-weights the number of random tokens (default: 2048)")
    i.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1] (default: 0.5)")
    i.add_argument("--seed", type=int, default=0, help="sample seed, as launch/eval.py's per-sample seed (default: 0)")
    i.add_argument("--format", choices=["chat", "completion"], default="chat",
                   help="prompt format, as in launch/eval.py: chat template (default) or plain completion with "
                        "the task's answer cue")
    i.add_argument("--max-new-tokens", type=int, default=64,
                   help="answer budget that launch/eval.py reserves when sizing a sample; nothing is generated "
                        "here (default: 64)")
    i.add_argument("--prompt-file", type=Path, default=None,
                   help="a text file as the whole prompt (chat template unless --format completion); its last "
                        "token is the query")
    i.add_argument("--context-file", type=Path, default=None, help="a text file as the context (with --question)")
    i.add_argument("--question", default=None, help="the query text that follows --context-file")
    i.add_argument("--query-len", type=int, default=16,
                   help="--random-weights: trailing tokens that form the query part (default: 16)")
    a = ap.add_argument_group("approximations (repeatable; specs in the description above)")
    a.add_argument("--star", action="append", metavar="SPEC", help="Star Attention, e.g. cp=4 or block=512,anchor=64")
    a.add_argument("--apb", action="append", metavar="SPEC", help="APB, e.g. cp=4,anchor=128,passing=64")
    a.add_argument("--minference", action="append", metavar="SPEC",
                   help="MInference, e.g. config=cfg.json or pattern=vs,vertical=256,slash=512")
    a.add_argument("--mask", action="append", metavar="SPEC",
                   help="any kept set from a function of the layer's inputs, e.g. fn=mypkg.kept:select,topk=8")
    r = ap.add_argument_group("measurement and output")
    r.add_argument("--layers", default=None, metavar="I,J,A-B",
                   help="layers to measure, e.g. 0,5,10-14 (default: all)")
    r.add_argument("--metrics-dtype", choices=["float64", "float32"], default="float64",
                   help="precision of the metric math (default: float64; float32 is faster on a GPU)")
    r.add_argument("--tile-elements", type=int, default=None,
                   help="score elements per row chunk [heads x rows x keys]; bounds memory (default: 8M)")
    r.add_argument("--out", type=Path, default=None, help="directory for fidelity.json, fidelity.md, fidelity.png")
    r.add_argument("--quiet", action="store_true", help="no per-layer progress on stderr")
    return ap.parse_args(argv)


def load(args):
    """(model, tokenizer or None, model label)."""
    dtype = DTYPES[args.dtype]
    if args.random_weights is not None:
        if args.model is not None:
            raise SystemExit("error: give --model or --random-weights, not both")
        try:
            cfg = preset_config(args.random_weights)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        return (random_model(cfg, dtype=dtype, device=args.device, seed=args.weights_seed), None,
                f"random:{args.random_weights}:seed{args.weights_seed}")
    try:
        path = resolve_model(args.model)[0]  # a GGUF or a model by name: converted once into the cache
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    tok = load_tokenizer(path)
    if tok is None:
        raise SystemExit(f"error: {path} has no tokenizer; text inputs need one (or use --random-weights)")
    return load_model(path, dtype=dtype, device=args.device), tok, str(path)


def build_input(args, tok, vocab: int):
    """(token ids, context_len, description)."""
    files = [f for f in (args.prompt_file, args.context_file) if f is not None]
    if len(files) > 1:
        raise SystemExit("error: give --prompt-file or --context-file (+ --question), not both")
    if tok is None:
        if files:
            raise SystemExit("error: --random-weights has no tokenizer: text files cannot be used, the input is "
                             "--length random token ids")
        if not 2 <= args.length or not 1 <= args.query_len < args.length:
            raise SystemExit(f"error: need --length >= 2 and 1 <= --query-len < --length, got {args.length}, "
                             f"{args.query_len}")
        ids = torch.randint(0, vocab, (args.length,), generator=torch.Generator().manual_seed(args.seed))
        return ids, args.length - args.query_len, f"random tokens (seed {args.seed})"
    raw = args.format == "completion"
    for f in files:
        if not f.is_file():
            raise SystemExit(f"error: {f} is not a file")
    if args.prompt_file is not None:
        p = build_prompt(tok, prompt=args.prompt_file.read_text(), raw=raw)
        return torch.tensor(p.ids), p.context_len, f"prompt file {args.prompt_file.name}"
    if args.context_file is not None:
        if not args.question:
            raise SystemExit("error: --context-file needs --question (the query part)")
        p = build_prompt(tok, context=args.context_file.read_text(), question=args.question, raw=raw)
        return torch.tensor(p.ids), p.context_len, f"context file {args.context_file.name}"

    if args.task not in TASKS:
        raise SystemExit(f"error: unknown --task {args.task!r}; choose from {', '.join(TASKS)}")
    reserve = template_overhead(tok, not raw) + args.max_new_tokens
    try:
        s = make_sample(args.task, tok, args.length, args.depth, args.seed, reserve)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    question = f"{s.question} {s.answer_prefix}".strip() if raw else s.question
    p = build_prompt(tok, context=s.context, question=question, raw=raw)
    depth = "" if s.depth is None else f", depth {s.depth:g}"
    desc = f"{args.task}, length {args.length}{depth}, seed {args.seed}, {args.format}"
    return torch.tensor(p.ids), p.context_len, desc


def main(argv=None) -> int:
    args = parse_args(argv)

    approximations = build_approximations(args)
    layers = parse_layer_ids(args.layers)
    t0 = time.time()
    model, tok, label = load(args)
    ids, context_len, desc = build_input(args, tok, model.config.vocab_size)
    window = model.config.max_position_embeddings
    if ids.numel() > window:
        raise SystemExit(f"error: the input has {ids.numel()} tokens, over the model window of {window}")

    def progress(layer):
        if not args.quiet:
            print(f"layer {layer} done ({time.time() - t0:.1f} s)", file=sys.stderr, flush=True)

    try:
        report = measure(model, ids, context_len, approximations, layers=layers,
                         tile_elements=args.tile_elements or DEFAULT_TILE_ELEMENTS,
                         dtype=DTYPES[args.metrics_dtype], progress=progress,
                         meta={"input": desc, "model": label, "model_dtype": args.dtype, "device": str(args.device)})
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    report.meta["seconds"] = round(time.time() - t0, 2)
    print(report.markdown())
    if args.out is not None:
        for path in report.write(args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0
