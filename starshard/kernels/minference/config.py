"""A model's MInference patterns (per layer, per head) and their file formats: ours (JSON, written by
the pattern search) and MInference's published one."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from starshard.kernels.common import INT32_MAX
from starshard.kernels.minference.attend import SparsePattern
from starshard.kernels.minference.patterns import AShape, BlockSparse, HeadPattern, VerticalSlash, head_pattern


@dataclass
class MInferenceConfig:
    """Per-layer, per-head patterns of a model (found by `minference_search`, or a published
    MInference config). `pattern(layer, num_heads, head_offset)` gives one call's SparsePattern;
    heads and layers the file does not name use `default`."""

    layers: list = field(default_factory=list)  # list[dict[int, HeadPattern]]
    default: HeadPattern = field(default_factory=VerticalSlash)
    block_size: int = 64
    last_q: int = 64
    force_sink: int = 30
    force_local: int = 100
    vertical_aware: bool = True
    meta: dict = field(default_factory=dict)

    FORMAT = "starshard.minference/1"

    def __post_init__(self):
        self.layers = [{int(h): head_pattern(p) for h, p in layer.items()} for layer in self.layers]
        self.default = head_pattern(self.default)

    def head(self, layer: int, head: int) -> HeadPattern:
        if 0 <= layer < len(self.layers):
            return self.layers[layer].get(head, self.default)
        return self.default

    def pattern(self, layer: int, num_heads: int, head_offset: int = 0) -> SparsePattern:
        """SparsePattern of `layer` for the query heads head_offset .. head_offset + num_heads - 1
        (a tensor- or Ulysses-parallel rank holds a slice of the heads)."""
        heads = tuple(self.head(layer, head_offset + h) for h in range(num_heads))
        return SparsePattern(heads, self.block_size, self.last_q, self.force_sink, self.force_local, self.vertical_aware)

    def attention(self, *args, **kwargs):
        raise TypeError("an MInferenceConfig covers a whole model: pass `config.pattern(layer, num_heads)` as sparse=")

    # ---- JSON ----
    def to_dict(self) -> dict:
        def entry(p):
            d = p.to_dict()
            if p.score is not None:
                d["score"] = p.score
            return d

        return {
            "format": self.FORMAT,
            "block_size": self.block_size,
            "last_q": self.last_q,
            "force_sink": self.force_sink,
            "force_local": self.force_local,
            "vertical_aware": self.vertical_aware,
            "default": entry(self.default),
            "meta": self.meta,
            "layers": [{str(h): entry(p) for h, p in sorted(layer.items())} for layer in self.layers],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def to_published(self) -> list:
        """MInference's own format: per layer {head: [name, vertical, slash, score]}. Dense heads have
        no published name and are written as vertical_and_slash with budgets that cover everything."""
        out = []
        for layer in self.layers:
            row = {}
            for h, p in sorted(layer.items()):
                s = p.score if p.score is not None else 0.0
                if isinstance(p, AShape):
                    row[str(h)] = ["stream_llm", p.sink, p.local, s]
                elif isinstance(p, VerticalSlash):
                    row[str(h)] = ["vertical_and_slash", p.vertical, p.slash, s]
                elif isinstance(p, BlockSparse):
                    row[str(h)] = ["block_sparse", p.topk, 0, s]
                else:
                    row[str(h)] = ["vertical_and_slash", INT32_MAX, INT32_MAX, s]
            out.append(row)
        return out

    @classmethod
    def from_dict(cls, obj) -> "MInferenceConfig":
        if isinstance(obj, list):  # MInference's published format
            return cls.from_published(obj)
        if not isinstance(obj, dict) or obj.get("format") != cls.FORMAT:
            raise ValueError(f"not a MInference config: expected a published list of layers or a dict with format {cls.FORMAT!r}")
        return cls(
            layers=obj.get("layers", []),
            default=obj.get("default", {"pattern": "vertical_slash", "vertical": 1000, "slash": 6096}),
            block_size=int(obj.get("block_size", 64)),
            last_q=int(obj.get("last_q", 64)),
            force_sink=int(obj.get("force_sink", 30)),
            force_local=int(obj.get("force_local", 100)),
            vertical_aware=bool(obj.get("vertical_aware", True)),
            meta=obj.get("meta", {}),
        )

    @classmethod
    def from_published(cls, layers: list, **kwargs) -> "MInferenceConfig":
        """A published MInference config: a list (one per layer) of {head: [pattern, v, s, score]}.
        Semantics follow MInference's runtime: stream_llm = A-shape (sink v, local s),
        vertical_and_slash (v columns, s diagonals, 64-row blocks, last 64 queries, first 30
        columns and nearest 100 diagonals forced), block_sparse = top-100 64x64 blocks; heads the
        file misses use vertical_and_slash (1000, 6096)."""
        if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
            raise ValueError("a published MInference config is a JSON list of {head: [pattern, vertical, slash, score]} per layer")
        parsed = [{int(h): head_pattern(list(p)) for h, p in layer.items()} for layer in layers]
        return cls(layers=parsed, **kwargs)

    @classmethod
    def load(cls, path: str | Path) -> "MInferenceConfig":
        """Our JSON format or a published MInference file (told apart by shape)."""
        with open(path) as f:
            obj = json.load(f)
        cfg = cls.from_dict(obj)
        cfg.meta = {**cfg.meta, "source": str(path)}
        return cfg
