"""USP (exact): Ulysses inside each ring rank, a zigzag ring over the Ulysses groups."""
from __future__ import annotations

from starshard.partition import usp_rows
from starshard.strategies.ring import RingSpec
from starshard.strategies.spec import Option
from starshard.strategies.ulysses import check_ulysses_heads

ULYSSES_DEGREE = Option("ulysses_degree", "--ulysses-degree",
                        "usp: Ulysses ranks inside each ring rank (must divide --cp; default --cp, i.e. plain Ulysses); "
                        "keep them on one node, the all-to-alls are the bandwidth-hungry part")


def check_degree(u: int, cp: int) -> None:
    if u < 1 or cp % u:
        raise ValueError(f"--ulysses-degree {u} must divide --cp {cp}; valid: {[d for d in range(1, cp + 1) if cp % d == 0]}")


class UspSpec(RingSpec):  # the ring's zigzag shards, KV rows and FLOPs; Ulysses' head split
    name = "usp"
    options = (ULYSSES_DEGREE,)

    def degree(self, cp: int, options: dict) -> int:
        u = options.get("ulysses_degree")
        return cp if u is None else u

    def validate(self, cp, options):
        check_degree(self.degree(cp, options), cp)

    def whole_rows(self, cp, prompt_len, context_len, options):
        u = self.degree(cp, options)  # CP rank c: ring rank c // u, Ulysses rank c % u
        return [usp_rows(prompt_len, cp // u, u, c // u, c % u) for c in range(cp)]

    def check_heads(self, heads, kv_heads, cp, options):  # Ulysses' all-to-all splits the heads
        degree = self.degree(cp, options)
        if degree > 1:
            check_ulysses_heads(heads, kv_heads, degree)


USP = UspSpec()
