"""No import circles in ``atommem_rl/`` and ``envs/``: the layers point one way (docs/DESIGN.md, section 2).

Every ``import``/``from ... import`` of a project module counts, at module level or inside a function (a lazy
import that closes a circle is still a circle in the design); imports under ``if TYPE_CHECKING:`` never run
and are left out. A cycle fails the test with the modules on it."""

from __future__ import annotations

import ast

from .conftest import REPO

PACKAGES = ("atommem_rl", "envs")


def modules() -> dict[str, object]:
    out = {}
    for pkg in PACKAGES:
        for p in (REPO / pkg).rglob("*.py"):
            parts = p.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(name: str, path, known) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                   for b in n.body for x in ast.walk(b)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `from pkg import name`: the module pkg.name, else pkg
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    mods = modules()
    graph = {m: imports(m, p, mods) for m, p in mods.items()}
    assert "atommem_rl.memory.store" in graph["envs.core"] or any("atommem_rl.memory" in t for t in graph["envs.core"])
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)
