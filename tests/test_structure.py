"""The house rules of hyla/, read from the code (ast): no import cycle, not
even one hidden behind a function-level import or a package's ``__init__``; the layers point
one way; one concept a module; and docs/architecture.md names only modules that exist."""

from __future__ import annotations

import ast
import collections
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hyla"
# who may import whom: ops <- model <- (train, eval, serve) <- disagg <- cli
LAYER = {"ops": 0, "data": 0, "model": 1, "train": 2, "eval": 2, "serve": 2, "disagg": 3,
         "cli": 4}
FORBIDDEN = {("eval", "train"), ("model", "serve"), ("train", "serve")}
MAX_LINES = 600


def modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    found = {}
    for f in PACKAGE.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        package = name.endswith(".__init__")
        found[name.removesuffix(".__init__")] = (f, package)
    return found


def import_graph(mods) -> dict[str, dict[str, int]]:
    """Module -> {imported module: line}, every import statement at any depth (a function's
    too), relative ones resolved; importing ``a.b.c`` also runs ``a/__init__`` and
    ``a/b/__init__``, which count unless they enclose the importer."""
    def resolve(target: str) -> str:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target

    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for m, (f, package) in mods.items():
        here = m if package else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here
                    for _ in range(node.level - 1):
                        up = up.rpartition(".")[0]
                    base = f"{up}.{base}" if base else up
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            for t in filter(None, map(resolve, targets)):
                if t == m:
                    continue
                graph[m].setdefault(t, node.lineno)
                parent = t.rpartition(".")[0]
                while parent in mods:
                    if m != parent and not m.startswith(parent + "."):
                        graph[m].setdefault(parent, node.lineno)
                    parent = parent.rpartition(".")[0]
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph(modules())


def test_no_import_cycle_even_through_function_level_imports_or_package_inits(graph):
    assert cycles(graph) == []


def test_the_cycle_finder_sees_a_function_level_cycle():
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 9}, "d": {"a": 1}}) == \
        [["a", "b", "c"]]


def test_layers_point_one_way(graph):
    wrong = []
    for m, targets in graph.items():
        part = m.split(".")[1] if m.count(".") else None
        for t in targets:
            other = t.split(".")[1] if t.count(".") else None
            if part in LAYER and other in LAYER and (
                    LAYER[other] > LAYER[part] or (part, other) in FORBIDDEN):
                wrong.append(f"{m} imports {t} (line {targets[t]})")
    assert wrong == []


def test_one_concept_a_module_no_shared_prefixes_no_giant_files():
    prefixed, long = [], []
    for folder in sorted({p.parent for p in PACKAGE.rglob("*.py")}):
        stems = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
        groups = collections.defaultdict(list)
        for stem in stems:
            groups[stem.split("_")[0]].append(stem)
        prefixed += [f"{folder.relative_to(ROOT)}: {sorted(g)}" for g in groups.values()
                     if len(g) > 1]
        long += [f"{p.relative_to(ROOT)}: {n}" for p in folder.glob("*.py")
                 if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
                 and "triton" not in p.name]
    assert prefixed == [] and long == []


def test_architecture_page_names_only_modules_and_folders_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(hyla(?:\.[A-Za-z_0-9]+)+)", text))
    paths = set(re.findall(r"`(hyla/[a-z_0-9/]+(?:\.py)?)`", text))
    mods = modules()

    def exists(name: str) -> bool:    # a module, or a name its parent module has
        parent, _, attr = name.rpartition(".")
        return name in mods or (parent in mods and hasattr(importlib.import_module(parent),
                                                           attr))

    missing = [n for n in named if not exists(n)]
    missing += [p for p in paths if not (ROOT / p).exists()]
    assert len(named) + len(paths) > 40 and sorted(missing) == []
