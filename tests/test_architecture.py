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
    "curation": {"curation", "infra"},  # datatrove components, source kinds, presets (no Prefect, no torch)
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


def _is_step(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef) and any(
        isinstance(d, ast.Call) and getattr(d.func, "id", None) == "step" for d in node.decorator_list
    )


def _is_config(name: str) -> bool:
    return name.endswith(("Config", "Spec"))


def step_module_problems(source: str) -> list[str]:
    """What a module of tasks/ defines beyond its steps: a module declares at least one `@step`,
    and at module level defines only step functions, the hooks its `@step` names (`publish=`),
    its config classes (`XConfig`, `XSpec`) and private `_names`."""
    tree = ast.parse(source)
    steps = [n for n in tree.body if _is_step(n)]
    if not steps:
        return ["declares no step"]
    hooks = {
        kw.value.id for n in steps for d in n.decorator_list for kw in d.keywords if isinstance(kw.value, ast.Name)
    }
    problems = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
            allowed = _is_step(node) or node.name in hooks or (isinstance(node, ast.ClassDef) and _is_config(node.name))
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            allowed = False
        else:
            continue
        problems += [f"defines {n!r}" for n in names if not (allowed or n.startswith("_"))]
    return problems


def cross_step_imports(module: str, source: str) -> list[str]:
    """Names `module` (a module of tasks/) imports from another step module: only that step's
    config classes (`XConfig`, `XSpec`: a step may compose another step's config) are allowed."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "tasks" and node.module != module:
                bad += [f"{node.module}.{a.name}" for a in node.names if not _is_config(a.name)]
        elif isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.split(".")[0] == "tasks" and a.name != module]
    return bad


def module_getattr(source: str) -> bool:
    """Whether a module defines `__getattr__` at module level (a def or an assignment)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            return True
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__getattr__" for t in node.targets):
            return True
    return False


def shared_basenames(paths: list[Path]) -> dict[str, list[str]]:
    """File name -> the modules sharing it (package markers and entry points excepted)."""
    by_name: dict[str, list[str]] = {}
    for path in paths:
        if path.name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    return {name: sorted(found) for name, found in by_name.items() if len(found) > 1}


def _sources(pkg: str) -> list[Path]:
    return sorted((REPO / pkg).rglob("*.py"))


# Names of step modules not yet moved into the library they belong to, each with why; the test
# fails when a name here is gone (shrink the list) or a module defines a name not here.
NOT_YET_MOVED: dict[str, set[str]] = {}
# Cross-step imports not yet replaced by an import from a library, each with why.
CROSS_STEP_NOT_YET: dict[str, set[str]] = {}
# File names shared by modules where the folder says why: the step, the flow and the trainer of
# one thing (tasks/ the step, flows/ the flow, trainers/ what runs on the ranks), and the
# preflight checks named like what they check. Anything else gets a name of its own.
SHARED_NAMES = {
    "pretrain.py": "tasks/ the step, trainers/ the torchrun entry point",
    "sft.py": "tasks/posttrain/ the step, trainers/posttrain/ the TRL trainer",
    "preference.py": "tasks/posttrain/ the step, trainers/posttrain/ the TRL trainer",
    "grpo.py": "tasks/posttrain/ the step, trainers/posttrain/ the TRL trainer",
    "sao.py": "tasks/posttrain/ the step, trainers/posttrain/ its trainer loop",
    "distill.py": "tasks/posttrain/ the step, trainers/posttrain/ the TRL trainer",
    "cpt.py": "flows/ the flow, tasks/ its steps",
    "compare.py": "flows/ the flow, tasks/ its step",
    "heldout.py": "tasks/ the held-out loss step, curation/ the decontamination components",
    "data.py": "tasks/posttrain/ the posttrain_data step, infra/preflight/ the data check (named for what it checks)",
    "cli.py": "flows/ the smollm3 command, infra/preflight/ the preflight command",
    "storage.py": "infra/ S3 storage, infra/preflight/ the storage check (each check named for what it checks)",
}


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
    """Every module of tasks/ declares a step and defines only its steps, their publish hooks,
    its config classes and private helpers: libraries live in packages of their own."""
    found = {}
    for path in _sources("tasks"):
        if path.name == "__init__.py":
            continue
        rel = str(path.relative_to(REPO))
        problems = set(step_module_problems(path.read_text(encoding="utf-8")))
        pending = {f"defines {n!r}" for n in NOT_YET_MOVED.get(rel, ())}
        assert pending <= problems, f"{rel}: moved already, drop from NOT_YET_MOVED: {sorted(pending - problems)}"
        if problems - pending:
            found[rel] = sorted(problems - pending)
    assert found == {}, f"modules of tasks/ holding more than steps: {found}"


def test_no_step_module_imports_another_steps_internals():
    found = {}
    for path in _sources("tasks"):
        module = _module_name(path)
        bad = set(cross_step_imports(module, path.read_text(encoding="utf-8")))
        pending = CROSS_STEP_NOT_YET.get(module, set())
        assert pending <= bad, f"{module}: fixed already, drop from CROSS_STEP_NOT_YET: {sorted(pending - bad)}"
        if bad - pending:
            found[module] = sorted(bad - pending)
    assert found == {}, f"step modules importing another step's internals (move them to a library): {found}"


def test_no_module_level_getattr():
    """No module re-exports names through a module `__getattr__`: imports say where a name lives."""
    found = {
        str(p.relative_to(REPO))
        for pkg in PACKAGES
        for p in _sources(pkg)
        if module_getattr(p.read_text(encoding="utf-8"))
    }
    assert found == set(), f"module-level __getattr__ in {sorted(found)}: import the names where they are used"


def test_no_two_modules_share_a_name_unless_the_folder_says_why():
    shared = shared_basenames([p for pkg in PACKAGES for p in _sources(pkg)])
    assert set(shared) <= set(SHARED_NAMES), (
        f"modules sharing a file name: { {n: shared[n] for n in set(shared) - set(SHARED_NAMES)} }"
    )
    assert set(SHARED_NAMES) <= set(shared), (
        f"no longer shared, drop from SHARED_NAMES: {sorted(set(SHARED_NAMES) - set(shared))}"
    )


def test_the_checkers_catch_planted_violations():
    """Each rule above fails on a violation planted in a module's source."""
    step = "@step('x', version=1, kind='k', publish=publish_x)\ndef x(config: XConfig, *, out, log=print): ...\n"
    clean = f"class XConfig: ...\ndef _helper(): ...\n_TABLE = {{}}\ndef publish_x(a, ws, label): ...\n{step}"
    assert step_module_problems(clean) == []
    assert step_module_problems("def helper(): ...\n") == ["declares no step"]
    assert step_module_problems(clean + "class Preset: ...\nPRESETS = {}\ndef build(): ...\n") == [
        "defines 'Preset'",
        "defines 'PRESETS'",
        "defines 'build'",
    ]
    assert cross_step_imports("tasks.a", "from tasks.b import BConfig, BSpec\nfrom curation.x import y\n") == []
    assert cross_step_imports("tasks.a", "def f():\n    from tasks.b import helper, BSpec\n") == ["tasks.b.helper"]
    assert cross_step_imports("tasks.a", "import tasks.b\n") == ["tasks.b"]
    assert module_getattr("def __getattr__(name): ...\n") and module_getattr("__getattr__ = make()\n")
    assert not module_getattr("class A:\n    def __getattr__(self, name): ...\n")
    planted = [REPO / "a" / "data.py", REPO / "b" / "data.py", REPO / "a" / "__init__.py", REPO / "b" / "__init__.py"]
    assert shared_basenames(planted) == {"data.py": ["a/data.py", "b/data.py"]}


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


# Tests mirror the tree for the libraries: curation/x.py is tested in tests/curation/test_x.py,
# evals/benchmarks/y.py in tests/evals/benchmarks/test_y.py. Modules without their file yet, each
# with where they are tested now; the test fails when one gets its file (shrink the list) or a new
# module comes without one.
MIRRORED = ("curation", "evals")
NOT_YET_MIRRORED: dict[str, str] = {}


def mirror_test(module: Path) -> Path:
    """The test file of a library module, both relative to the repository root."""
    return Path("tests") / module.parent / f"test_{module.name}"


def test_library_modules_have_their_test_file():
    assert mirror_test(Path("evals/benchmarks/passkey.py")) == Path("tests/evals/benchmarks/test_passkey.py")
    missing = {
        str(path.relative_to(REPO))
        for pkg in MIRRORED
        for path in _sources(pkg)
        if path.name != "__init__.py" and not (REPO / mirror_test(path.relative_to(REPO))).is_file()
    }
    listed = set(NOT_YET_MIRRORED)
    assert listed <= missing, f"have their test file now, drop from NOT_YET_MIRRORED: {sorted(listed - missing)}"
    assert missing <= listed, f"library modules without tests/<path>/test_<module>.py: {sorted(missing - listed)}"
