"""The layering of docs/architecture.md, checked on the source: which package may import which,
where Prefect may appear, and that no two modules import each other (directly or in a cycle).

Imports are read with `ast` (top-level and function-level alike: a lazy import is still a
dependency), so the test sees what the code does without importing it.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("flows", "tasks", "model", "infra")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the project modules it imports (resolved to existing modules)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name and target.split(".")[0] in PACKAGES:
                    found.add(target)
        graph[name] = found
    return graph


def _external(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            tops.add(node.module.split(".")[0])
    return tops


def test_no_import_cycles():
    graph = _imports()
    # Tarjan's strongly connected components: any component of 2+ modules is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            # a package __init__ re-exporting its own submodules is not a cycle of logic
            real = [m for m in component if not any(o.startswith(m + ".") for o in component)]
            if len(real) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == [], f"import cycles: {cycles}"


def test_dependencies_flow_one_way():
    allowed = {
        "flows": {"flows", "tasks", "model", "infra"},
        "tasks": {"tasks", "model", "infra"},
        "model": {"model", "infra"},  # model uses infra.artifact's identity marker only
        "infra": {"infra"},
    }
    bad = [
        f"{m} -> {t}"
        for m, targets in _imports().items()
        for t in targets
        if t.split(".")[0] not in allowed[m.split(".")[0]]
    ]
    assert bad == [], f"imports against the layering: {bad}"


def test_prefect_only_in_flows_and_publish_hooks():
    """model/ and infra/ never import Prefect; tasks/ only inside publish hooks (lazily), so a step's
    build runs in a child process without Prefect."""
    for pkg in ("model", "infra"):
        for path in (REPO / pkg).rglob("*.py"):
            assert "prefect" not in _external(path), f"{path.relative_to(REPO)} imports prefect"
    for path in (REPO / "tasks").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level only
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] == "prefect" for n in names), (
                    f"{path.relative_to(REPO)} imports prefect at module level"
                )
