"""The layering of docs/architecture.md, checked on the source: which package may import which,
where Prefect may appear, and that no two modules import each other (directly or in a cycle).

Imports are read with `ast` (top-level and function-level alike: a lazy import is still a
dependency), so the test sees what the code does without importing it.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "flows", "tasks", "curation", "evals", "trainers", "model", "infra")


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


# What each package may import (docs/architecture.md "Layout"): the step engine and infra know
# nothing of the application; libraries know nothing of steps and flows.
ALLOWED = {
    "infra": {"infra"},  # clusters, storage, processes, files: no engine, no application
    "pipeline": {"pipeline", "infra"},  # the step engine
    "model": {"model", "pipeline", "infra"},  # pipeline: the `operational` field marker only
    "curation": {"curation"},  # datatrove components (their workers import them)
    "evals": {"evals", "model", "pipeline", "infra"},
    "trainers": {"trainers", "model", "pipeline", "infra"},  # what runs on the ranks
    "tasks": {"tasks", "curation", "evals", "trainers", "model", "pipeline", "infra"},
    "flows": set(PACKAGES),
}


def test_dependencies_flow_one_way():
    bad = [
        f"{m} -> {t}"
        for m, targets in _imports().items()
        for t in targets
        if t.split(".")[0] not in ALLOWED[m.split(".")[0]]
    ]
    assert bad == [], f"imports against the layering: {bad}"


def test_the_engine_imports_nothing_of_the_application():
    """pipeline/ can be read, tested and reused without the SmolLM3 application: no module of it
    imports tasks, flows, model or the libraries (directly or lazily)."""
    application = {"tasks", "flows", "model", "curation", "evals", "trainers"}
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in _imports().items()
        if m.split(".")[0] == "pipeline"
        for t in targets
        if t.split(".")[0] in application
    )
    assert bad == [], f"the engine imports the application: {bad}"


def test_the_engine_knows_nothing_of_cluster_launchers():
    """Following a cluster job is the launchers' business behind a small interface
    (infra/stop_hooks.py: a launcher registers a stop hook, the runner calls the hooks): no
    module of pipeline/ imports infra.launchers (directly or lazily)."""
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in _imports().items()
        if m.split(".")[0] == "pipeline"
        for t in targets
        if t == "infra.launchers" or t.startswith("infra.launchers.")
    )
    assert bad == [], f"the engine imports the cluster launchers: {bad}"


def test_tasks_holds_steps_only():
    """Every module of tasks/ declares a step (`@step`): libraries live in packages of their own."""
    no_step = []
    for path in (REPO / "tasks").rglob("*.py"):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        decorated = [
            d
            for node in tree.body
            if isinstance(node, ast.FunctionDef)
            for d in node.decorator_list
            if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "step"
        ]
        if not decorated:
            no_step.append(str(path.relative_to(REPO)))
    assert no_step == [], f"modules of tasks/ that declare no step: {no_step}"


def test_prefect_only_in_flows_and_publish_hooks():
    """model/, infra/ and the libraries never import Prefect; tasks/ only inside publish hooks
    (lazily), so a step's build runs in a child process without Prefect."""
    for pkg in ("model", "infra", "curation", "evals", "trainers"):
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
