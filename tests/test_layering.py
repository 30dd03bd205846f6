"""The package's dependency rule: every starshard import points down the layers, and starshard
imports sit at module top (a function-local one hides an edge from readers and from this test)."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "starshard"

# Lowest first. A module may import its own unit and anything in a lower layer, never above or beside.
LAYERS = [
    {"config"},
    {"partition", "presets"},
    {"strategies"},  # the context strategies' registry, pure part: names, options, validation, sizes, FLOPs
    {"planner", "runconfig"},
    {"kernels"},
    {"engine"},
    {"parallel", "checkpoints"},
    {"runtime"},
    {"serving"},  # the long-document service: scheduler, typed executor operations, cascade, context cache
    {"llm"},
    {"cli", "evaluation", "server"},
    # offline tools (MInference pattern search) run the harness's tasks through the model; the benchmark
    # programs behind launch/bench.py build models and runners through llm and cli
    {"tools", "benchmarks"},
    {"commands"},  # the `starshard` console script's subcommands (launch/*.py wrap them)
    {"__main__"},  # python -m starshard: the console script
]
LEVEL = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def unit_of(module: str) -> str:
    """starshard.parallel.context.ring -> parallel; starshard.llm -> llm."""
    return module.split(".")[1]


def modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def starshard_imports(tree: ast.AST):
    """(imported module, line, at module top?) for every `import starshard...` / `from starshard... import`."""
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "starshard" and node.level == 0:
            names = [node.module]
            if node.module == "starshard":  # from starshard import x: x is a unit
                names = [f"starshard.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "starshard"]
        for name in names:
            yield name, node.lineno, id(node) in top


def test_every_unit_has_a_layer():
    units = {unit_of(m) for m, _ in modules() if m != "starshard"}
    assert units <= set(LEVEL), f"units without a layer in this test: {sorted(units - set(LEVEL))}"


def test_imports_point_down_and_sit_at_module_top():
    upward, local = [], []
    for module, path in modules():
        if module == "starshard":
            continue  # the package root's lazy __getattr__ re-exports LLM for users
        unit = unit_of(module)
        tree = ast.parse(path.read_text())
        for target, line, at_top in starshard_imports(tree):
            where = f"{path.relative_to(PKG.parent)}:{line} imports {target}"
            if not at_top:
                local.append(where)
            if target == "starshard":
                continue
            t = unit_of(target)
            if t != unit and LEVEL[t] >= LEVEL[unit]:
                upward.append(where + f" ({unit} is layer {LEVEL[unit]}, {t} layer {LEVEL[t]})")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)
    assert not local, "function-local starshard imports (move them to the module top):\n" + "\n".join(local)


def test_package_imports_have_no_cycles():
    """No cycle between units, and none between the modules of one unit either."""
    graph: dict[str, set[str]] = {}
    names = dict(modules())
    for module, path in names.items():
        deps = set()
        for target, _, _ in starshard_imports(ast.parse(path.read_text())):
            while target not in names and "." in target:  # from pkg.mod import name -> pkg.mod
                target = target.rsplit(".", 1)[0]
            if target != module and target in names:
                deps.add(target)
        graph[module] = deps
    # A package's __init__ importing its own submodules is how packages re-export: not an edge back.
    for module in graph:
        graph[module] = {d for d in graph[module] if not module.startswith(d + ".")}
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for d in sorted(graph[m]):
            visit(d)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# The registry answers strategy questions (StrategySpec's fields): no module outside it compares a strategy's
# name. "dense" is also a sparse pattern's name (kernels/minference, the sparse benchmark), and config sits
# below the registry (its construction-time guard repeats one rule).
REGISTRY = ("starshard/strategies/", "starshard/parallel/context/")
DENSE_ALLOWED = ("starshard/config.py", "starshard/kernels/minference/patterns.py", "starshard/benchmarks/sparse.py")


def strategy_literals(node: ast.AST, names: set[str]) -> list[str]:
    """The strategy names among a comparison operand's string constants (a tuple / list / set's too)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]


def test_only_the_registry_compares_strategy_names():
    from starshard.strategies import SINGLE_RANK, STRATEGIES

    found = []
    for _, path in modules():
        rel = str(path.relative_to(PKG.parent))
        if rel.startswith(REGISTRY):
            continue
        names = set(STRATEGIES) - ({SINGLE_RANK} if rel in DENSE_ALLOWED else set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                hits = [n for side in (node.left, *node.comparators) for n in strategy_literals(side, names)]
            elif isinstance(node, ast.match_case):
                hits = strategy_literals(getattr(node.pattern, "value", node.pattern), names)
            else:
                continue
            if hits:
                line = getattr(node, "lineno", None) or node.pattern.lineno  # a match case has no line of its own
                found.append(f"{rel}:{line} compares {', '.join(hits)}")
    assert not found, "ask the strategy's spec (starshard.strategies) instead:\n" + "\n".join(found)
