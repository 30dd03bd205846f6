"""Task metrics (RULER's string match): "all" = share of expected answers found in the output,
"any" = 1 if one of them is found. Case-insensitive substring match."""
from __future__ import annotations


def score(answers: list[str], metric: str, output: str) -> float:
    if not answers:
        raise ValueError("a sample needs at least one expected answer")
    out = output.lower()
    found = [a.lower() in out for a in answers]
    if metric == "all":
        return sum(found) / len(found)
    if metric == "any":
        return float(any(found))
    raise ValueError(f"unknown metric {metric!r}: use 'all' or 'any'")
