"""Pipeline parallelism: which layers each stage holds."""
from __future__ import annotations


def partition_layers(num_layers: int, pp: int, pp_layers: list[int] | None = None) -> list[list[int]]:
    """Global layer indices per stage: `pp_layers` counts if given, else an even split (earlier
    stages take the remainder, since the last stage also runs the LM head)."""
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    if pp > num_layers:
        raise ValueError(f"pp={pp} exceeds the model's {num_layers} layers; use pp <= {num_layers}")
    if pp_layers is None:
        base, extra = divmod(num_layers, pp)
        pp_layers = [base + (1 if s < extra else 0) for s in range(pp)]
    if len(pp_layers) != pp or sum(pp_layers) != num_layers or min(pp_layers) < 1:
        raise ValueError(
            f"--pp-layers {pp_layers} must give {pp} positive counts summing to the model's {num_layers} layers"
        )
    stages, start = [], 0
    for n in pp_layers:
        stages.append(list(range(start, start + n)))
        start += n
    return stages
