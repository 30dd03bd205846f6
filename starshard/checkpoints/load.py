"""Load weights: a starshard checkpoint (this rank's shard, or all shards merged for one process),
a Hugging Face model dir, or a GGUF file. Errors name the missing or broken piece and the fix.

An FP8 checkpoint (converted with --fp8 linear) holds each projection as e4m3 `weight` + float32
`weight_scale`: they load as stored, into Fp8Linear modules the caller puts in the meta model first
(runtime/build.py, llm.py), never through the compute dtype."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from starshard.checkpoints.convert import DTYPES, MANIFEST, gguf_to_hf, tensor_sha256
from starshard.checkpoints.hf import (
    SafetensorsSource,
    StateDictSource,
    merge_tp_shards,
    plan_shard,
    read_hf_config,
)
from starshard.checkpoints.rope import with_rope_scaling
from starshard.config import ModelConfig
from starshard.engine.model import Transformer, local_rope_inv_freq, rope_inv_freq
from starshard.kernels.fp8 import FP8_DTYPE
from starshard.partition import TPShard


class CheckpointError(RuntimeError):
    pass


def gguf_source(ckpt: Path) -> tuple[Path, str | None] | None:
    """(the GGUF file, its sha256) a starshard checkpoint was converted from, as its manifest records them (the
    sha256 None for one converted before the manifest recorded it); None for any other checkpoint."""
    try:
        source = read_manifest(ckpt).get("source") or {}
    except (CheckpointError, ValueError):  # not a starshard checkpoint (a Hugging Face dir), or unreadable
        return None
    return (Path(source["path"]), source.get("sha256")) if source.get("kind") == "gguf" and "path" in source else None


def read_manifest(ckpt: Path) -> dict:
    path = Path(ckpt) / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt} is not a starshard checkpoint (no {MANIFEST}); create one with "
            "`python -m starshard.checkpoints.convert --hf DIR --out {ckpt}` or pass a HF dir / .gguf file"
        )
    m = json.loads(path.read_text())
    if m.get("format") != "starshard":
        raise CheckpointError(f"{path} is not a starshard manifest")
    return m


def stored_fp8(manifest: dict) -> list[str]:
    """What the checkpoint stores in FP8: ["linear"] (converted with --fp8 linear) or []."""
    return list(manifest.get("fp8", []))


def check_fp8_request(manifest: dict, ckpt: Path, fp8_linear: bool) -> None:
    """An FP8 checkpoint runs only with --fp8 linear: its projections exist only in e4m3."""
    if "linear" in stored_fp8(manifest) and not fp8_linear:
        raise CheckpointError(
            f"checkpoint {ckpt} stores the decoder projections in FP8 e4m3 (converted with --fp8 linear), so it "
            f"runs only with them in FP8: add --fp8 linear (or --fp8 linear,kv; LLM(..., fp8=\"linear\")), or "
            f"convert the model again without --fp8 for {manifest.get('dtype', 'bfloat16')} projections"
        )


def load_shard(ckpt: Path, manifest: dict, tp_rank: int, pp_rank: int, verify: bool = True) -> dict[str, torch.Tensor]:
    """Tensors of one (tp rank, pipeline stage), checked against the manifest's checksums."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    key = f"tp{tp_rank}-pp{pp_rank}"
    entry = manifest["shards"].get(key)
    if entry is None:
        raise CheckpointError(f"manifest of {ckpt} lists no shard {key} (layout tp={manifest['tp']} pp={manifest['pp']})")
    path = Path(ckpt) / entry["file"]
    if not path.is_file():
        raise CheckpointError(f"missing shard file {path} (tp rank {tp_rank}, pp stage {pp_rank}); re-run the converter")
    try:
        sd = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"corrupted shard {path}: {e}; re-run the converter") from e
    expected = entry["tensors"]
    if set(sd) != set(expected):
        missing, extra = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
        raise CheckpointError(f"corrupted shard {path}: missing tensors {missing[:5]}, unexpected {extra[:5]}")
    if verify:  # hashlib lets go of the GIL: the tensors are hashed on every core (a 6 GB model: ~2 s on 2)
        names = list(expected)
        with ThreadPoolExecutor(min(8, len(os.sched_getaffinity(0)))) as pool:
            sums = pool.map(lambda name: tensor_sha256(sd[name]), names)
            bad = next((name for name, got in zip(names, sums) if got != expected[name]), None)
        if bad is not None:
            raise CheckpointError(f"corrupted shard {path}: checksum mismatch in tensor {bad!r}; re-run the converter")
    return sd


def check_layout(manifest: dict, ckpt: Path, tp: int, pp: int) -> None:
    if (manifest["tp"], manifest["pp"]) != (tp, pp):
        raise CheckpointError(
            f"checkpoint {ckpt} was converted for tp={manifest['tp']} pp={manifest['pp']}, but this run uses "
            f"tp={tp} pp={pp}; convert again with `--tp {tp} --pp {pp}` (or run with the checkpoint's layout)"
        )


def _full_state_from_checkpoint(ckpt: Path, manifest: dict, verify: bool) -> dict[str, torch.Tensor]:
    """All shards of any layout merged into tp=1, pp=1 tensors (for one process)."""
    cfg = ModelConfig.from_dict(manifest["model_config"])
    if stored_fp8(manifest) and manifest["tp"] > 1:
        raise CheckpointError(
            f"checkpoint {ckpt} holds FP8 projections cut for tp={manifest['tp']}: each rank's row-parallel shard "
            f"(wo, w2) has its own channel scales, so the shards do not merge into one process's weights; run "
            f"with --tp {manifest['tp']} (the checkpoint's layout), or convert again with --tp 1 for one process"
        )
    full: dict[str, torch.Tensor] = {}
    for p in range(manifest["pp"]):
        parts = [load_shard(ckpt, manifest, t, p, verify) for t in range(manifest["tp"])]
        full.update(merge_tp_shards(cfg, parts) if len(parts) > 1 else parts[0])
    if cfg.tie_word_embeddings:
        full.pop("output.weight", None)
    return full


def _full_state_from_source(cfg: ModelConfig, src) -> dict[str, torch.Tensor]:
    specs = plan_shard(cfg, src, TPShard(cfg, 1, 0), list(range(cfg.num_layers)), True, True)
    return {s.name: s.build() for s in specs}


def read_weights(path: str | Path, verify: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, full single-process state dict) from any supported source."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not .gguf; pass a .gguf file, a HF model dir or a starshard checkpoint dir")
        hf_cfg, sd, _ = gguf_to_hf(path, tokenizer=False)
        cfg = ModelConfig.from_hf(hf_cfg)
        return cfg, _full_state_from_source(cfg, StateDictSource(sd))
    if (path / MANIFEST).is_file():
        manifest = read_manifest(path)
        return ModelConfig.from_dict(manifest["model_config"]), _full_state_from_checkpoint(path, manifest, verify)
    cfg = ModelConfig.from_hf(read_hf_config(path))
    return cfg, _full_state_from_source(cfg, SafetensorsSource(path))


def as_stored(name: str, t: torch.Tensor) -> bool:
    """An FP8 checkpoint's e4m3 weights and their float32 scales keep their dtype when loaded."""
    return t.dtype == FP8_DTYPE or name.endswith(".weight_scale")


def materialize(model: Transformer, state: dict[str, torch.Tensor], dtype: torch.dtype, device) -> Transformer:
    """Fill a meta-device model with `state` (cast to dtype, moved to device) without a second copy. FP8
    weights and scales keep their dtype (the model must hold Fp8Linear modules there: parallel/fp8.py)."""
    state = {k: v.to(device=device, dtype=None if as_stored(k, v) else dtype) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"output.weight"} if model.config.tie_word_embeddings and model.tok_embeddings is not None else set()
    if set(missing) - tied or unexpected:
        raise CheckpointError(f"weights do not fit the model: missing {sorted(set(missing) - tied)[:5]}, unexpected {unexpected[:5]}")
    if tied and model.output is not None:
        model.output.weight = model.tok_embeddings.weight
    # Buffers made on meta hold no data; the frequencies follow the model's RoPE length (None: its window).
    model.inv_freq = rope_inv_freq(model.config, getattr(model, "rope_length", None)).to(device)
    local = local_rope_inv_freq(model.config)
    model.local_inv_freq = None if local is None else local.to(device)
    return model.eval().requires_grad_(False)


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32, device="cpu", verify: bool = True,
               fp8_modules: Callable[[Transformer], object] | None = None,
               rope_scaling: str | None = None) -> Transformer:
    """A single-process model from a starshard checkpoint dir, a HF model dir, or a .gguf file.
    fp8_modules: for an FP8 checkpoint, swaps the meta model's projections for Fp8Linear modules before
    the e4m3 weights and scales are assigned (llm.py passes parallel.fp8.quantize_linears).
    rope_scaling: the user's RoPE switch ("yarn:4"; checkpoints/rope.py)."""
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    cfg, state = read_weights(path, verify=verify)
    cfg = with_rope_scaling(cfg, rope_scaling)
    with torch.device("meta"):
        model = Transformer(cfg)
    if any(t.dtype == FP8_DTYPE for t in state.values()):
        if fp8_modules is None:
            raise CheckpointError(f"checkpoint {path} stores the decoder projections in FP8 e4m3 (converted with "
                                  "--fp8 linear): load it with LLM(path, fp8=\"linear\") or run with --fp8 linear")
        fp8_modules(model)
    return materialize(model, state, dtype, device)
