"""Convert a Hugging Face model dir (safetensors) or a GGUF file into starshard per-(tp, pp) shards.

    python -m starshard.checkpoints.convert --hf DIR --out OUT [--tp N] [--pp N] [--dtype bfloat16]
    python -m starshard.checkpoints.convert --gguf FILE --out OUT
    python -m starshard.checkpoints.convert --hf DIR --out OUT --tp 2 --fp8 linear   # e4m3 projections

Output: OUT/manifest.json (model config, layout, dtype, source, fp8, per-tensor sha256), one
`model-tp{t}-pp{p}.safetensors` per rank of the layout, and the tokenizer files. Safetensors sources
are streamed tensor by tensor, so peak memory is about one (fused) tensor, not the model. GGUF goes
through transformers' GGUF reader, which dequantizes the whole model in memory first. MoE GGUFs: Qwen3-MoE
(`qwen3moe`, transformers >= 4.56), its config completed from the metadata that reader does not map;
Mixtral (`llama` with experts, which that reader loads as a dense Llama) and other MoE architectures are
refused from the metadata, naming the fix (--hf DIR).

--fp8 linear stores the decoder projections (config.FP8_LINEARS: wqkv, wo, w13, w2) as e4m3 `*.weight`
plus float32 `*.weight_scale` (one per output channel), everything else (embedding, norms, LM head, MoE
experts and router) in --dtype. Each rank's shard is quantized after it is cut, exactly what `--fp8 linear`
does at load time from a --dtype checkpoint of the same layout: the same bytes, so the same results. That
matters for the row-parallel projections (wo, w2): a rank's channel scale is the amax over its own
input columns, not over the full row, so quantizing before slicing would give other scales.
"""
from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import mmap
import struct
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from starshard.checkpoints.hf import (
    SafetensorsSource,
    StateDictSource,
    TensorSource,
    TensorSpec,
    plan_shard,
    read_hf_config,
)
from starshard.config import FP8_LINEARS, Fp8Config, ModelConfig, UnsupportedArchitectureError
from starshard.kernels.fp8 import FP8_DTYPE, quantize_rows
from starshard.partition import TPShard, partition_layers

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", FP8_DTYPE: "F8_E4M3"}


def shard_file(tp_rank: int, pp_rank: int) -> str:
    return f"model-tp{tp_rank}-pp{pp_rank}.safetensors"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of any dtype, without a copy of a contiguous tensor (numpy has no
    bfloat16, so view as uint8): what the shard stores and the manifest's sha256 is taken of."""
    return memoryview(t.contiguous().view(torch.uint8).numpy().reshape(-1) if t.numel() else b"")


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of a whole file, read in 16 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_safetensors_streaming(path: Path, specs, dtype: torch.dtype, metadata: dict[str, str]) -> dict[str, str]:
    """Write tensors one at a time in safetensors format (header first, computed from the specs), each in
    its spec's dtype, else `dtype`.

    Returns {name: sha256 of the tensor's bytes}. Each built tensor is checked against its spec shape.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for s in specs:
        stored = s.dtype or dtype
        n = torch.empty(0, dtype=stored).element_size()
        for dim in s.shape:
            n *= dim
        header[s.name] = {"dtype": _ST_DTYPE[stored], "shape": list(s.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data section starts 8-byte aligned
    sums = {}
    tmp = path.with_suffix(path.suffix + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for s in specs:
            t = s.build().to(s.dtype or dtype)
            if tuple(t.shape) != s.shape:
                raise ValueError(f"{s.name}: source gives shape {tuple(t.shape)}, expected {s.shape}")
            data = tensor_bytes(t)
            sums[s.name] = hashlib.sha256(data).hexdigest()
            f.write(data)
    tmp.replace(path)
    return sums


_FP8_WEIGHTS = {f"{x}.weight" for x in FP8_LINEARS}


def is_fp8_linear(name: str) -> bool:
    """Whether a starshard tensor name (layers.{i}.attention.wqkv.weight, ...) is a weight --fp8 linear holds
    in e4m3 (an MoE layer's experts.w13 / experts.w2 are not)."""
    parts = name.split(".", 2)
    return len(parts) == 3 and parts[0] == "layers" and parts[2] in _FP8_WEIGHTS


def fp8_specs(specs: list[TensorSpec], dtype: torch.dtype) -> list[TensorSpec]:
    """Each projection weight's spec becomes two: its e4m3 weight and its float32 `weight_scale` [out],
    quantize_rows of this rank's shard rounded to `dtype` (what --fp8 linear computes at load time from a
    `dtype` checkpoint). The scale spec follows its weight's, so one build of the source serves both."""
    out = []
    for s in specs:
        if not is_fp8_linear(s.name):
            out.append(s)
            continue
        held: dict[str, torch.Tensor] = {}

        def weight(s=s, held=held):
            w8, held["scale"] = quantize_rows(s.build().to(dtype))
            return w8

        out.append(TensorSpec(s.name, s.shape, weight, FP8_DTYPE))
        out.append(TensorSpec(s.name + "_scale", s.shape[:1], lambda held=held: held.pop("scale"), torch.float32))
    return out


def fp8_parts(fp8: str | Fp8Config | None) -> list[str]:
    """What the converter stores in FP8: [] or ["linear"]; kv, attention and experts are run-time choices."""
    cfg = Fp8Config.parse(fp8)
    if cfg.kv or cfg.attention or cfg.experts:
        raise ValueError(f"--fp8 {cfg.describe()}: the converter stores only `linear` (the projections' weights) in "
                         "e4m3; the KV cache, 8-bit scores and e4m3 experts are chosen at run time (experts are "
                         "quantized as they load): give --fp8 kv / attention / experts to infer / serve / eval")
    return ["linear"] if cfg.linear else []


# MoE GGUF architectures (`general.architecture`) starshard converts: the HF model_type transformers'
# GGUF reader maps each to, and the first transformers release whose reader loads its experts (4.55
# listed `qwen3moe` under the GGUF name, not the model type, and had no expert processor for it).
GGUF_MOE_READERS = {"qwen3moe": ("qwen3_moe", "4.56")}

# struct formats of the fixed-width GGUF metadata types (gguf.GGUFValueType's numbers)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_metadata(gguf_path: Path) -> dict[str, object]:
    """A GGUF file's scalar metadata (strings and numbers; arrays such as the vocabulary are stepped over,
    not parsed). Only the header is read. gguf's GGUFReader builds a numpy view per array element: for a
    262K-token vocabulary that is ~30 s on 2 cores, for the few scalars read here."""
    return _read_gguf_header(gguf_path)[0]


def gguf_array_items(gguf_path: Path) -> int:
    """How many elements a GGUF file's metadata arrays hold (vocabulary, merges, scores; nested ones counted
    whole): what transformers' reader parses one at a time, on a first load most of the time a large
    vocabulary takes (cache.convert_seconds)."""
    return _read_gguf_header(gguf_path)[2]


def _read_gguf_header(gguf_path: Path) -> tuple[dict[str, object], str, int]:
    """(scalar metadata, sha256 of the header: the metadata and the tensor table, all a config depends on,
    the metadata arrays' element count)."""
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{gguf_path} is not a GGUF file (it does not start with the GGUF magic bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _walk_gguf_header(buf, gguf_path)
            except struct.error as e:  # a length or count pointing past the end
                raise ValueError(f"{gguf_path}: the GGUF header is truncated or corrupt ({e})") from e


def _walk_gguf_header(buf, gguf_path: Path) -> tuple[dict[str, object], str, int]:
    from gguf import GGUFValueType

    order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # a big-endian file's version reads swapped
    version, tensors, count = struct.unpack_from(order + "IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{gguf_path} is GGUF version {version}; only versions 2 and 3 are read")

    def read(fmt, pos):
        return struct.unpack_from(order + fmt, buf, pos), pos + struct.calcsize(order + fmt)

    def string(pos):
        (n,), pos = read("Q", pos)
        if pos + n > len(buf):
            raise struct.error(f"a string of {n} bytes at offset {pos} runs past the end")
        return bytes(buf[pos : pos + n]).decode("utf-8"), pos + n

    items = 0

    def value(kind, pos, keep):
        """(the value, or None where not kept or an array, the position after it)."""
        nonlocal items
        if kind == GGUFValueType.STRING:
            return string(pos) if keep else (None, pos + 8 + read("Q", pos)[0][0])
        if kind == GGUFValueType.ARRAY:
            (item, n), pos = read("IQ", pos)
            items += n
            item = GGUFValueType(item)
            if item not in (GGUFValueType.STRING, GGUFValueType.ARRAY):  # fixed width: step over all at once
                return None, pos + n * struct.calcsize(order + _GGUF_SCALARS[item])
            for _ in range(n):
                _, pos = value(item, pos, False)
            return None, pos
        (v,), pos = read(_GGUF_SCALARS[kind], pos)
        return v, pos

    meta, pos = {"GGUF.version": version, "GGUF.tensor_count": tensors, "GGUF.kv_count": count}, 24  # as GGUFReader
    for _ in range(count):
        key, pos = string(pos)
        (kind,), pos = read("I", pos)
        v, pos = value(GGUFValueType(kind), pos, True)
        if v is not None:
            meta[key] = v
    for _ in range(tensors):  # the table: name, dimension count, dimensions, type, offset
        _, pos = string(pos)
        (dims,), pos = read("I", pos)
        pos += 8 * dims + 12
    if pos > len(buf):
        raise struct.error(f"the tensor table ends at offset {pos}, past the end ({len(buf)} bytes)")
    return meta, hashlib.sha256(buf[:pos]).hexdigest(), items


def _transformers_reads_moe_gguf(arch: str, model_type: str) -> bool:
    """Whether the installed transformers maps the architecture's metadata to a config and its stacked
    expert tensors (ffn_{gate,up,down}_exps) to the model's experts."""
    try:
        from transformers import modeling_gguf_pytorch_utils as reader
        from transformers.integrations import ggml
    except ImportError:
        return False
    return model_type in ggml.GGUF_CONFIG_MAPPING and arch in getattr(reader, "TENSOR_PROCESSORS", {})


def _check_moe_gguf(gguf_path: Path, arch: str, experts: int) -> None:
    """Refuse a mixture-of-experts GGUF starshard cannot read through transformers, naming the fix."""
    import transformers

    fix = ("convert the model's Hugging Face safetensors directory instead: "
           "python -m starshard.checkpoints.convert --hf DIR --out OUT")
    if arch not in GGUF_MOE_READERS:
        if arch == "llama":  # llama.cpp writes Mixtral as `llama` with experts
            raise UnsupportedArchitectureError(
                f"{gguf_path.name}: a Mixtral GGUF (general.architecture 'llama' with {experts} experts) is not "
                "supported: transformers' GGUF reader does not support Mixtral (it reads the file as a dense Llama "
                f"and leaves the experts out); {fix}")
        readable = ", ".join(sorted(GGUF_MOE_READERS))
        raise UnsupportedArchitectureError(
            f"{gguf_path.name}: GGUF files of the mixture-of-experts architecture {arch!r} ({experts} experts) are "
            f"not supported: starshard reads MoE GGUFs through transformers' GGUF reader for {readable} only; {fix}")
    model_type, since = GGUF_MOE_READERS[arch]
    if not _transformers_reads_moe_gguf(arch, model_type):
        raise UnsupportedArchitectureError(
            f"{gguf_path.name}: transformers {transformers.__version__}'s GGUF reader does not read {model_type} "
            f"(general.architecture {arch!r}) files; it needs transformers >= {since}: "
            f"pip install -U 'transformers>={since}', or {fix}")


def _moe_gguf_fields(meta: dict[str, object], arch: str) -> dict[str, object]:
    """Qwen3-MoE config fields transformers' GGUF reader leaves at Qwen3MoeConfig's defaults: the experts'
    width (`expert_feed_forward_length`, mapped by no release), whether the top-k weights are renormalized
    (llama.cpp's qwen3moe graph does, unless the file says otherwise; transformers < 5 keeps False), and
    the sparse layers (llama.cpp gives every layer experts)."""
    fields: dict[str, object] = dict(norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)),
                                     mlp_only_layers=[], decoder_sparse_step=1)
    width = meta.get(f"{arch}.expert_feed_forward_length")
    if width is not None:
        fields["moe_intermediate_size"] = int(width)
    return fields


def _gguf_config(gguf_path: Path):
    """transformers' config of a GGUF file, plus the MoE fields its reader does not map. MoE files it cannot
    read are refused here, from the metadata alone (no tensor is read)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    meta, header, _ = _read_gguf_header(gguf_path)
    arch = str(meta.get("general.architecture", ""))
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if experts:
        _check_moe_gguf(gguf_path, arch, experts)
        scaling = meta.get(f"{arch}.rope.scaling.type", "none")
        if scaling != "none":  # the reader maps no rope.scaling key for these: the RoPE would silently be plain
            raise UnsupportedArchitectureError(
                f"{gguf_path.name}: the file's RoPE scaling ({arch}.rope.scaling.type = {scaling!r}) is not read by "
                "transformers' GGUF reader, so its positions would be wrong; convert the model's Hugging Face "
                "safetensors directory instead (--hf DIR), whose config.json carries the scaling")
    config = copy.deepcopy(_transformers_gguf_config(str(gguf_path.resolve()), header))
    if experts:
        for key, value in _moe_gguf_fields(meta, arch).items():
            setattr(config, key, value)
    return config


@functools.lru_cache(maxsize=4)
def _transformers_gguf_config(path: str, header: str):
    """AutoConfig of a GGUF file, read once per process for each (path, sha256 of its header): transformers'
    reader parses all the metadata, ~30 s for a 262K-token vocabulary on 2 cores, and a load asks for the
    config several times (preflight, weights, tokenizer). A file rewritten with other metadata is read again."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(Path(path).parent, gguf_file=Path(path).name)


def gguf_hf_config(gguf_path: Path) -> dict:
    """The HF config (dict) of a GGUF file: what starshard's ModelConfig.from_hf reads."""
    hf_cfg = _gguf_config(gguf_path).to_dict()
    hf_cfg.pop("quantization_config", None)
    return hf_cfg


def gguf_tokenizer(gguf_path: Path):
    """transformers' tokenizer of a GGUF file, built from its metadata. The tokenizer type is the config's
    model type (read once per process): without it AutoTokenizer parses the whole file again only to learn
    that type (~50 s of a ~60 s build for a 262K-token vocabulary on 2 cores)."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    gguf_path = Path(gguf_path)
    model_type = _gguf_config(gguf_path).model_type
    typed = dict(tokenizer_type=model_type) if TOKENIZER_MAPPING_NAMES.get(model_type) else {}
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, **typed)


def gguf_to_hf(gguf_path: Path, *, tokenizer: bool = True):
    """Dequantize a GGUF through transformers: (hf config dict, state dict, tokenizer or None). tokenizer=False
    skips building the tokenizer (loading weights needs none)."""
    from transformers import AutoModelForCausalLM

    gguf_path = Path(gguf_path)
    config = _gguf_config(gguf_path)
    hf_cfg = config.to_dict()
    hf_cfg.pop("quantization_config", None)
    ModelConfig.from_hf(hf_cfg)  # refuse unsupported models before the slow load
    # The completed config builds the model, so the reader fills tensors of the file's shapes.
    model, info = AutoModelForCausalLM.from_pretrained(gguf_path.parent, config=config, torch_dtype=torch.float32,
                                                       output_loading_info=True, gguf_file=gguf_path.name)
    if info["missing_keys"]:  # transformers warns and keeps random weights there; a conversion must not
        missing = sorted(info["missing_keys"])
        raise ValueError(
            f"{gguf_path.name}: transformers' GGUF reader left {len(missing)} weights of {type(model).__name__} "
            f"unread ({', '.join(missing[:3])}, ...): the file's tensors are not what transformers expects for "
            f"{hf_cfg.get('model_type')}; convert the model's Hugging Face safetensors directory instead (--hf DIR)")
    return hf_cfg, model.state_dict(), gguf_tokenizer(gguf_path) if tokenizer else None


def convert(
    *,
    out: Path,
    hf_dir: Path | None = None,
    gguf: Path | None = None,
    tp: int = 1,
    pp: int = 1,
    pp_layers: list[int] | None = None,
    dtype: str = "bfloat16",
    fp8: str | Fp8Config | None = None,
    progress: bool = True,
) -> Path:
    """fp8: "linear" stores the decoder projections in e4m3 with per-output-channel scales (module doc)."""
    if (hf_dir is None) == (gguf is None):
        raise ValueError("give exactly one source: hf_dir or gguf")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    stored_fp8 = fp8_parts(fp8)
    out = Path(out)
    if hf_dir is not None:
        hf_dir = Path(hf_dir)
        if not hf_dir.is_dir():
            raise FileNotFoundError(f"Hugging Face model directory not found: {hf_dir}")
        hf_cfg = read_hf_config(hf_dir)
        cfg = ModelConfig.from_hf(hf_cfg)
        src: TensorSource = SafetensorsSource(hf_dir)
        source = {"kind": "hf", "path": str(hf_dir.resolve())}
        tokenizer = None
        tok_dir = hf_dir
    else:
        hf_cfg, sd, tokenizer = gguf_to_hf(Path(gguf))
        cfg = ModelConfig.from_hf(hf_cfg)
        src = StateDictSource(sd)
        # the file's sha256 names the model whatever the file is called (named.py: the configs shipped for it)
        source = {"kind": "gguf", "path": str(Path(gguf).resolve()), "sha256": file_sha256(Path(gguf))}
        tok_dir = None
    stages = partition_layers(cfg.num_layers, pp, pp_layers)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # a half-written dir must never look complete
    shards = {}

    def rank_specs(t, p):
        specs = plan_shard(cfg, src, TPShard(cfg, tp, t), stages[p], p == 0, p == pp - 1)
        return fp8_specs(specs, DTYPES[dtype]) if stored_fp8 else specs

    total = sum(len(rank_specs(0, p)) for p in range(pp))
    bar = tqdm(total=total * tp, desc="convert", unit="tensor", disable=not progress)
    for p in range(pp):
        for t in range(tp):
            specs = [_ticking(s, bar) for s in rank_specs(t, p)]
            fname = shard_file(t, p)
            sums = write_safetensors_streaming(out / fname, specs, DTYPES[dtype], {"format": "pt"})
            shards[f"tp{t}-pp{p}"] = {"file": fname, "tensors": sums}
    bar.close()
    _save_tokenizer(out, tok_dir, tokenizer)
    manifest = {
        "format": "starshard",
        "version": FORMAT_VERSION,
        "model_config": cfg.to_dict(),
        "hf_config": hf_cfg,
        "tp": tp,
        "pp": pp,
        "pp_layers": [len(s) for s in stages],
        "dtype": dtype,
        "fp8": stored_fp8,  # ["linear"]: projections in e4m3 + float32 weight_scale (load with --fp8 linear)
        "source": source,
        "shards": shards,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out


def _ticking(spec, bar):
    build = spec.build

    def wrapped():
        t = build()
        bar.update(1)
        return t

    spec.build = wrapped
    return spec


# Files one of which an HF directory's tokenizer is read from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def _save_tokenizer(out: Path, tok_dir: Path | None, tokenizer) -> None:
    if tokenizer is None:
        from transformers import AutoTokenizer

        no_files = tok_dir is None or not any((Path(tok_dir) / f).is_file() for f in TOKENIZER_FILES)
        try:
            # Without tokenizer files transformers' lookup can fail in other ways than OSError / ValueError
            # (5.17: AttributeError on a config without model_type): do not ask it.
            tokenizer = None if no_files else AutoTokenizer.from_pretrained(tok_dir)
        except (OSError, ValueError) as e:
            print(f"warning: no tokenizer saved ({e}); pass token ids, not text, to this checkpoint", file=sys.stderr)
            return
        if tokenizer is None:
            print(f"warning: no tokenizer saved ({tok_dir} has none of {', '.join(TOKENIZER_FILES)}); pass token ids, "
                  "not text, to this checkpoint", file=sys.stderr)
            return
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="starshard convert",  # also run as python -m starshard.checkpoints.convert
        description="Convert a Hugging Face model directory or a GGUF file into starshard shards, "
        "one safetensors file per (tensor-parallel rank, pipeline stage).",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", type=Path, metavar="DIR", help="Hugging Face model directory (config.json + *.safetensors)")
    src.add_argument("--gguf", type=Path, metavar="FILE", help="GGUF file (dequantized through transformers)")
    ap.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size the shards are cut for (default 1)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages (default 1)")
    ap.add_argument(
        "--pp-layers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        metavar="N,N,..",
        help="layers per pipeline stage, comma separated (default: even split)",
    )
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                    help="stored dtype (default bfloat16); with --fp8 linear the dtype of every tensor but the "
                    "projections, and the one the projections are rounded to before they are quantized")
    ap.add_argument("--fp8", nargs="?", const="linear", default=None, metavar="linear",
                    help="store the decoder projections (wqkv, wo, w13, w2; not MoE experts) as e4m3 with one "
                    "float32 scale per output channel, each rank's shard quantized as --fp8 linear does at load "
                    "time (same bytes, same results): about half the bytes on disk and read at load. Such a checkpoint "
                    "must be run with --fp8 linear (or linear,kv); the KV cache's FP8 is chosen at run time")
    args = ap.parse_args(argv)
    try:
        fp8 = fp8_parts(args.fp8)
    except ValueError as e:
        ap.error(str(e))
    path = convert(
        out=args.out, hf_dir=args.hf, gguf=args.gguf, tp=args.tp, pp=args.pp, pp_layers=args.pp_layers, dtype=args.dtype,
        fp8=",".join(fp8) or None,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
