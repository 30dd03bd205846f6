"""RULER-style synthetic long-context tasks, generated locally from a seed (no downloads).

Every sample is a long `context` (filler text with needles at a stated depth) and a short `question`
(the query part, which Star/APB treat as such) with the expected `answers`. Lengths are counted in
the model's tokens: the filler is sized so that context + question + answer cue fill `length` minus
a `reserve` the caller keeps for the prompt template and the generated answer.

All randomness comes from one `random.Random` per sample, seeded from (task, length, depth, seed), so
a sample is the same in every run and every strategy sees the same prompts.
"""
from __future__ import annotations

import random
import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

# Bumped whenever a change alters the generated prompts: runs compare sample by sample only within one version.
TASKS_VERSION = 2

# ---------------------------------------------------------------------------------------------
# Vocabulary. Written for this module; the filler, key and value vocabularies are disjoint so an
# answer can only appear in the context where a needle put it.

NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is warm.", "Here we go again.",
                   "Back and forth, on and on.")

_ESSAY_SUBJECTS = ("the river", "a small town", "the old library", "the committee", "a quiet garden", "the market",
                   "our neighbour", "the long road", "a careful reader", "the harbour", "the museum", "the council",
                   "a young painter", "the night shift", "every student", "the orchestra", "a stubborn farmer",
                   "the newspaper", "the mountain village", "a retired sailor", "the bakery", "the city")
_ESSAY_VERBS = ("changed", "remembered", "described", "carried", "opened", "followed", "measured", "welcomed",
                "questioned", "painted", "repaired", "forgot", "studied", "protected", "ignored", "rebuilt",
                "celebrated", "explained", "shared", "discovered")
_ESSAY_BASE_VERBS = ("change", "remember", "describe", "carry", "open", "follow", "measure", "welcome",
                     "question", "paint", "repair", "study", "protect", "rebuild", "explain", "share")
_ESSAY_OBJECTS = ("the evening light", "a forgotten letter", "the first snow", "an honest answer", "the morning train",
                  "a wooden bridge", "the village map", "a patient teacher", "the northern hills", "a simple plan",
                  "the harvest", "an old promise", "the empty square", "a second chance", "the autumn fair",
                  "the stone wall", "a long winter", "the public garden", "a borrowed book", "the town clock")
_ESSAY_TAILS = ("before anyone noticed", "and nobody complained", "as the seasons turned", "with great care",
                "for the third time that year", "while the bells rang", "in a way few expected",
                "without a word", "long after the rain stopped", "as if nothing had happened")
_ESSAY_TIMES = ("the spring of that year", "the early morning", "a dry summer", "the weeks that followed",
                "those quiet years", "the middle of the night", "the last days of autumn")
_ESSAY_ADVERBS = ("slowly", "quietly", "carefully", "suddenly", "gladly", "patiently", "eventually", "openly")
_ESSAY_ABSTRACT = ("patience", "memory", "trust", "habit", "curiosity", "silence", "work", "kindness", "distance")

_KEY_ADJECTIVES = ("amber", "brisk", "crimson", "dusty", "eager", "fuzzy", "gentle", "hollow", "icy", "jolly",
                   "knotty", "lucky", "misty", "noisy", "oaken", "plump", "rusty", "sunny", "tidy", "vivid")
_KEY_NOUNS = ("anchor", "badger", "cactus", "dragon", "engine", "falcon", "goblet", "hammock", "igloo", "jigsaw",
              "kettle", "lantern", "magnet", "nutmeg", "otter", "pebble", "quiver", "rocket", "saddle", "trumpet")
_VALUE_WORDS = ("apricot", "bluebell", "cinnamon", "dolphin", "emerald", "flamingo", "glacier", "hazelnut",
                "iguana", "jasmine", "kiwi", "lobster", "mango", "narwhal", "octopus", "papaya", "quokka",
                "raspberry", "sapphire", "tangerine", "urchin", "vanilla", "walrus", "yak", "zucchini")
# Common-words task: each list is drawn from this pool (rare ones) plus five frequent ones.
_CWE_WORDS = _KEY_ADJECTIVES + _KEY_NOUNS + _VALUE_WORDS + ("basket", "candle", "desert", "forest", "garden",
                                                            "island", "jacket", "ladder", "marble", "needle",
                                                            "pillow", "quartz", "ribbon", "tunnel", "velvet")

# ---------------------------------------------------------------------------------------------
# Public types


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass
class Sample:
    task: str
    length: int  # the cell's sequence length in tokens (prompt + answer)
    depth: float | None  # where the target needle starts in the context, 0..1; None for tasks without one
    seed: int
    context: str
    question: str
    answers: list[str]
    metric: str  # scoring.METRICS: "all" = share of answers found, "any" = 1 if one is found
    answer_prefix: str = ""  # completion cue ("The pass key is"); completion-format prompts end with it
    needle_spans: list[tuple[int, int]] = field(default_factory=list)  # char spans in context; [0] is the target
    target_tokens: int = 0  # what context + question + cue were sized to: length - reserve
    distractors: list[str] = field(default_factory=list)  # the other needles' values: a wrong answer may be one

    @property
    def needle_span(self) -> tuple[int, int] | None:
        return self.needle_spans[0] if self.needle_spans else None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Parts:
    """What one task contributes: needles (target first), their depths, the query and the answers."""

    needles: list[str]
    depths: list[float]
    question: str
    answers: list[str]
    metric: str
    answer_prefix: str
    filler: Callable[[random.Random, int], str]  # (rng, unit index) -> one filler unit with its trailing space
    distractors: list[str] = field(default_factory=list)  # values of the needles not asked for, if any


@dataclass(frozen=True)
class TaskSpec:
    name: str
    description: str
    build: Callable[[random.Random, float], _Parts]
    uses_depth: bool = True


# ---------------------------------------------------------------------------------------------
# Filler


def noise_unit(rng: random.Random, i: int) -> str:
    """The classic passkey haystack: a few plain sentences repeated in order."""
    return NOISE_SENTENCES[i % len(NOISE_SENTENCES)] + " "


def essay_unit(rng: random.Random, i: int) -> str:
    """One sentence of varied, meaningless prose; a paragraph break every few sentences."""
    c = rng.choice
    form = rng.randrange(5)
    if form == 0:
        s = f"{c(_ESSAY_SUBJECTS).capitalize()} {c(_ESSAY_VERBS)} {c(_ESSAY_OBJECTS)} {c(_ESSAY_TAILS)}."
    elif form == 1:
        s = (f"In {c(_ESSAY_TIMES)}, {c(_ESSAY_SUBJECTS)} {c(_ESSAY_VERBS)} {c(_ESSAY_OBJECTS)}, "
             f"and {c(_ESSAY_SUBJECTS)} {c(_ESSAY_VERBS)} {c(_ESSAY_OBJECTS)}.")
    elif form == 2:
        s = f"It is often said that {c(_ESSAY_ABSTRACT)} matters more than {c(_ESSAY_ABSTRACT)}."
    elif form == 3:
        s = f"{c(_ESSAY_ADVERBS).capitalize()}, {c(_ESSAY_SUBJECTS)} began to {c(_ESSAY_BASE_VERBS)} {c(_ESSAY_OBJECTS)}."
    else:
        s = f"Nobody expected {c(_ESSAY_SUBJECTS)} to {c(_ESSAY_BASE_VERBS)} {c(_ESSAY_OBJECTS)} so {c(_ESSAY_ADVERBS)}."
    return s + ("\n\n" if rng.random() < 0.18 else " ")


# ---------------------------------------------------------------------------------------------
# Values


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _word(rng: random.Random) -> str:
    return rng.choice(_VALUE_WORDS)


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_KEY_ADJECTIVES)}-{rng.choice(_KEY_NOUNS)}"


def _distinct(rng: random.Random, make: Callable[[random.Random], str], n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = make(rng)
        if v not in out:
            out.append(v)
    return out


def _spread(depth: float, n: int, step: float = 0.1) -> list[float]:
    """Depths of n needles: the target at `depth`, the others `step` apart towards the side with more room."""
    sign = 1.0 if depth < 0.5 else -1.0
    return [min(1.0, max(0.0, depth + sign * step * i)) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# Tasks


def _passkey(rng, depth):
    key = str(rng.randint(10_000, 99_999))
    return _Parts([f"Remember this pass key: {key}. The pass key is {key}."], [depth], "What is the pass key?",
                  [key], "all", "The pass key is", noise_unit)


def _single(value: Callable[[random.Random], str], noun: str, filler):
    def build(rng, depth):
        key, val = _key(rng), value(rng)
        return _Parts([f"The secret {noun} assigned to {key} is {val}."], [depth],
                      f"What is the secret {noun} assigned to {key}?", [val], "all",
                      f"The secret {noun} assigned to {key} is", filler)

    return build


def _multikey(rng, depth):
    keys, vals = _distinct(rng, _key, 4), _distinct(rng, _number, 4)
    needles = [f"The secret number assigned to {k} is {v}." for k, v in zip(keys, vals)]
    return _Parts(needles, _spread(depth, 4), f"What is the secret number assigned to {keys[0]}?", [vals[0]], "all",
                  f"The secret number assigned to {keys[0]} is", essay_unit, vals[1:])


def _multivalue(rng, depth):
    key, vals = _key(rng), _distinct(rng, _number, 4)
    needles = [f"One secret number assigned to {key} is {v}." for v in vals]
    return _Parts(needles, _spread(depth, 4), f"What are all the secret numbers assigned to {key}?", vals, "all",
                  f"The secret numbers assigned to {key} are", essay_unit)


def _multiquery(rng, depth):
    keys, vals = _distinct(rng, _key, 4), _distinct(rng, _number, 4)
    needles = [f"The secret number assigned to {k} is {v}." for k, v in zip(keys, vals)]
    return _Parts(needles, _spread(depth, 4),
                  f"What are the secret numbers assigned to {keys[0]} and to {keys[1]}?", vals[:2], "all",
                  f"The secret numbers assigned to {keys[0]} and to {keys[1]} are", essay_unit, vals[2:])


def _variable_tracking(rng, depth):
    value = str(rng.randint(10_000, 99_999))
    names = _distinct(rng, lambda r: "".join(r.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)), 4)
    needles = [f"Set {names[0]} = {value}."] + [f"Set {names[i]} = {names[i - 1]}." for i in range(1, 4)]
    # The chain reads in order, each assignment after the one it copies: it starts at `depth`.
    step = min(0.1, (1.0 - depth) / 3)
    return _Parts(needles, [depth + step * i for i in range(4)], f"Which variables end up equal to {value}? List every name.",
                  names, "all", f"The variables equal to {value} are:", noise_unit)


def _common_words(rng, depth):
    common = rng.sample(_CWE_WORDS, 5)
    rare = [w for w in _CWE_WORDS if w not in common]

    def line(r: random.Random, i: int) -> str:
        # Two frequent words per line in a fixed rotation (each gets 2/5 of the lines) against two of
        # ~70 rare ones: the five stay the most frequent at any length.
        words = [common[i % 5], common[(i + 2) % 5], r.choice(rare), r.choice(rare)]
        r.shuffle(words)
        return " ".join(words) + "\n"

    return _Parts([], [], "Which 5 words appear most often in the list above?", common, "all",
                  "The 5 most frequent words are:", line)


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("passkey", "one 5-digit pass key in repeated noise sentences", _passkey),
    TaskSpec("niah_number", "one key -> 7-digit number, noise filler", _single(_number, "number", noise_unit)),
    TaskSpec("niah_uuid", "one key -> UUID, noise filler", _single(_uuid, "code", noise_unit)),
    TaskSpec("niah_word", "one key -> word, noise filler", _single(_word, "word", noise_unit)),
    TaskSpec("niah_essay", "one key -> 7-digit number, essay-like filler", _single(_number, "number", essay_unit)),
    TaskSpec("multikey", "4 keys, one asked; essay filler", _multikey),
    TaskSpec("multivalue", "one key with 4 values, all asked; essay filler", _multivalue),
    TaskSpec("multiquery", "4 keys, two asked; essay filler", _multiquery),
    TaskSpec("variable_tracking", "a 4-step assignment chain from one value; noise filler", _variable_tracking),
    TaskSpec("common_words", "the 5 most frequent words of a word list", _common_words, uses_depth=False),
)}

# ---------------------------------------------------------------------------------------------
# Assembly


def count_tokens(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


# Counting a long context by its words. _fit measures six to eight candidate contexts of about the whole
# length; encoding each of them whole cost ~1.5 s of CPU per 131,072-token sample with Qwen2.5's
# tokenizer (the work grows with the length times the probes), most of eval's prompt time at long lengths.
# The contexts are words joined by single spaces, and the BPE tokenizers run here (GPT-2, Llama-3 and
# Qwen-style: their pre-tokenizer regex starts a new piece at a space between two non-space characters;
# Gemma-3's vocabulary has no token with "▁" after another character) never make a token across such a
# space. A context then has exactly as many tokens as its words have one by one, each with its leading
# space. The words repeat (small vocabularies), so each is encoded once per tokenizer and counting a
# context is a sum of cached numbers: the same counts as before, so the same prompts. A tokenizer where
# that sum can differ (one that prepends "▁" to every text, say) is caught by a check on every task's
# text when first seen, and its contexts are encoded whole as before.
_WORD_COUNTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {word: count} or None
_WORD_COUNTS_LOCK = threading.Lock()


def _summed_count(tok: Tokenizer, words: dict[str, int], text: str) -> int | None:
    """Tokens of `text` as the sum of its space-separated words' (cached in `words`: the count of
    " " + word); None where a space touches other whitespace or an end, which is no clean cut."""
    parts = text.split(" ")
    try:
        total = sum(map(words.__getitem__, parts))
    except KeyError:
        new = set(parts).difference(words)
        if any(not w or w[0].isspace() or w[-1].isspace() for w in new):
            return None
        for w in new:
            words[w] = count_tokens(tok, " " + w)
        total = sum(map(words.__getitem__, parts))
    return total - words[parts[0]] + count_tokens(tok, parts[0])  # the first word has no space before it


def _word_counts(tok: Tokenizer) -> dict[str, int] | None:
    """`tok`'s word-count cache, or None if summing words is not exact for it (then count texts whole)."""
    with _WORD_COUNTS_LOCK:  # made once per tokenizer, before the threads of make_samples share it
        try:
            if tok in _WORD_COUNTS:
                return _WORD_COUNTS[tok]
        except TypeError:  # not weakly referable or not hashable: count whole
            return None
        words: dict[str, int] | None = {}
        for name, spec in TASKS.items():  # every task's filler, needles and cuts, counted both ways
            rng = random.Random(f"word-count check|{name}")
            parts = spec.build(rng, 0.5)
            text = _build([parts.filler(rng, i) for i in range(200)], parts.needles, parts.depths)[0]
            if _summed_count(tok, words, text) != count_tokens(tok, text):
                words = None
                break
        _WORD_COUNTS[tok] = words
        return words


def _count_context(tok: Tokenizer, text: str) -> int:
    """count_tokens(tok, text) for a task's context, by its words where that is exact for `tok`."""
    words = _word_counts(tok)
    n = None if words is None else _summed_count(tok, words, text)
    return count_tokens(tok, text) if n is None else n


def template_overhead(tok, chat: bool = True) -> int:
    """Tokens the prompt format adds around context + question (chat template, separators), for `reserve`."""
    probe = "x\n\ny"
    if chat and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": probe}], tokenize=False, add_generation_prompt=True)
        return max(0, count_tokens(tok, text) - count_tokens(tok, probe)) + 4
    return 4  # separators and a BOS token


def _build(units: list[str], needles: list[str], depths: list[float]) -> tuple[str, list[tuple[int, int]]]:
    """Filler units with each needle inserted at unit index round(depth * n); needle char spans."""
    n = len(units)
    at = [round(d * n) for d in depths]
    order = sorted(range(len(needles)), key=lambda j: (at[j], j))
    pieces: list[str] = []
    spans: list[tuple[int, int]] = [(0, 0)] * len(needles)
    pos, k = 0, 0
    for i in range(n + 1):
        while k < len(order) and at[order[k]] == i:
            j = order[k]
            spans[j] = (pos, pos + len(needles[j]))
            pieces.append(needles[j] + " ")
            pos += len(needles[j]) + 1
            k += 1
        if i < n:
            pieces.append(units[i])
            pos += len(units[i])
    return "".join(pieces).rstrip(), spans


def _fit(tok: Tokenizer, budget: int, fixed: int, parts: _Parts, rng: random.Random):
    """The most filler units whose context, with the needles, keeps context + `fixed` tokens <= budget."""
    units: list[str] = []

    def size(n: int) -> int:
        return _count_context(tok, _build(units[:n], parts.needles, parts.depths)[0]) + fixed

    base = cur = size(0)
    if base > budget:
        raise ValueError(f"a {budget}-token budget cannot hold this task's needles and question "
                         f"({base} tokens); use a longer length or a smaller reserve")
    # Grow until over budget: a probe of 32 units measures the tokens per unit, then one step to just past
    # the budget. lo / hi: the largest count measured within the budget and the count measured past it.
    lo, s_lo = 0, base
    while cur <= budget:
        lo, s_lo = len(units), cur
        more = int((budget - cur) / max(1.0, (cur - base) / len(units))) + 8 if units else 32
        units += [parts.filler(rng, len(units) + i) for i in range(more)]
        cur = size(len(units))
    # Then the boundary, size(lo) <= budget < size(lo + 1). Tokens grow about linearly with the units, so
    # interpolating lands within a unit or two of it: ~4 encodes of the whole context where growing from a
    # guess and bisecting took ~15 (most of a sample's cost on a GPU). A step that does not halve the
    # bracket is followed by a bisection step, so the worst case stays logarithmic. Prompts are unchanged.
    hi, s_hi = len(units), cur
    bisect = False
    while hi - lo > 1:
        if bisect:
            mid = (lo + hi) // 2
        else:
            mid = min(hi - 1, max(lo + 1, lo + round((budget - s_lo) * (hi - lo) / max(1, s_hi - s_lo))))
        width, s = hi - lo, size(mid)
        lo, hi, s_lo, s_hi = (mid, hi, s, s_hi) if s <= budget else (lo, mid, s_lo, s)
        bisect = not bisect and 2 * (hi - lo) > width
    return _build(units[:lo], parts.needles, parts.depths)


def parse_tasks(text: str) -> list[str]:
    """The comma-separated task names of a --tasks flag (eval, minference-search, anchor-calibrate); ValueError
    naming the known ones."""
    tasks = [t for t in text.split(",") if t]
    if not tasks or any(t not in TASKS for t in tasks):
        raise ValueError(f"--tasks {text!r}: give one or more of {', '.join(TASKS)}, comma-separated")
    return tasks


def make_sample(task: str, tok: Tokenizer, length: int, depth: float | None, seed: int, reserve: int = 0) -> Sample:
    """One sample: context + question + answer cue sized to `length - reserve` tokens of `tok`."""
    spec = TASKS.get(task)
    if spec is None:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if spec.uses_depth:
        if depth is None or not 0.0 <= depth <= 1.0:
            raise ValueError(f"task {task} needs a needle depth in [0, 1], got {depth!r}")
    else:
        depth = None
    rng = random.Random(f"{task}|{length}|{depth}|{seed}")
    parts = spec.build(rng, 0.0 if depth is None else depth)
    budget = length - reserve
    fixed = count_tokens(tok, parts.question) + count_tokens(tok, parts.answer_prefix) + 2  # + separators
    context, spans = _fit(tok, budget, fixed, parts, rng)
    return Sample(task, length, depth, seed, context, parts.question, parts.answers, parts.metric,
                  parts.answer_prefix, spans, budget, parts.distractors)


def make_samples(tasks, tok: Tokenizer, lengths, depths, per_cell: int, seed: int, reserve: int = 0,
                 workers: int = 1, skip=frozenset()) -> list[Sample]:
    """Every (task, length, depth) cell `per_cell` times. Tasks without a needle get the same number of
    samples per length (depth None), so each task weighs the same in the summaries. `workers` threads
    make them (the tokenizer's encode releases the GIL: that helps where contexts are encoded whole; counted
    by their words they are mostly Python); each sample is its own seed's, so the list is the same for any
    count. `skip`: (task, length, depth, seed) keys not to make (a resumed run's)."""
    cells = []
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}; choose from {', '.join(TASKS)}")
        for L in lengths:
            if TASKS[t].uses_depth:
                cells += [(t, L, d, seed * 1000 + i) for d in depths for i in range(per_cell)]
            else:
                cells += [(t, L, None, seed * 1000 + i) for i in range(per_cell * len(depths))]
    cells = [c for c in cells if c not in skip]
    make = lambda c: make_sample(c[0], tok, c[1], c[2], c[3], reserve)  # noqa: E731
    if workers <= 1 or len(cells) <= 1:
        return [make(c) for c in cells]
    count_tokens(tok, "x")  # the tokenizer's settings made once, before threads share it
    with ThreadPoolExecutor(min(workers, len(cells))) as pool:
        return list(pool.map(make, cells))
