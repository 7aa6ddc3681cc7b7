"""Planted eval-suite task files run nothing: lm-eval sees only task YAMLs the suite's builders
regenerate, in a private folder.

Each payload is shown live first (a control: lm-eval's own `TaskManager` on a plain folder runs it
and creates a marker file), then planted into a suite the `eval_suite` step built, from outside
the code under test, and shown inert: refused with the file named, or ignored and logged by name.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

import pytest

from evals.harness import ForeignTaskFile, suite_task_files
from evals.suite import task_yaml
from pipeline.artifact import Artifact
from tasks.evaluate import EvalConfig, EvalSpec, SuiteSpec, eval_suite, evaluate
from tests.tasks.test_evaluate import _corpus, tiny_hf_model  # noqa: F401  (a fixture)

ROW = {"context": "The sky is", "choices": ["blue", "green"], "gold": 0, "delimiter": " "}


def _jinja(marker: Path) -> str:
    """A `doc_to_text` template that runs a shell command through Jinja's globals."""
    return f"{{% set _ = cycler.__init__.__globals__.os.system('touch {marker}') %}}{{{{context}}}}"


def _jinja_yaml(name: str, data: Path, marker: Path) -> str:
    """Our own cloze task file with its `doc_to_text` swapped for the Jinja payload."""
    text = task_yaml(name, data, " ")
    return text.replace('doc_to_text: "{{context}}"', f"doc_to_text: {json.dumps(_jinja(marker))}")


def _function_yaml(name: str, data: Path, module: str) -> str:
    """Our own cloze task file whose `doc_to_text` is a `!function` of a module beside it."""
    text = task_yaml(name, data, " ")
    return text.replace('doc_to_text: "{{context}}"', f"doc_to_text: !function {module}.doc_to_text")


def _plant_module(folder: Path, module: str, marker: Path) -> None:
    (folder / f"{module}.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\ndef doc_to_text(doc):\n    return doc['context']\n"
    )


def _load(folder: Path, names: list[str]) -> dict:
    """lm-eval's own loader on `folder` (as `run_lm_eval` uses it); each task's first prompt rendered."""
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(folder), include_defaults=False).load_task_or_group(names)
    return {name: task.doc_to_text(next(iter(task.test_docs()))) for name, task in tasks.items()}


def test_control_lm_eval_runs_a_jinja_template_and_a_function_from_a_plain_folder(tmp_path):
    """The payloads are live: from a plain include folder, lm-eval's TaskManager renders the
    template with Jinja's unsandboxed globals, and imports the `!function` module beside it."""
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "x.jsonl").write_text(json.dumps(ROW) + "\n")
    marker = tmp_path / "jinja-ran"
    (folder / "x.yaml").write_text(_jinja_yaml("x", folder / "x.jsonl", marker))
    assert _load(folder, ["x"]) == {"x": "The sky is"}
    assert marker.exists()

    marker = tmp_path / "function-ran"
    (folder / "x.yaml").unlink()
    (folder / "y.yaml").write_text(_function_yaml("y", folder / "x.jsonl", "evil_y"))
    _plant_module(folder, "evil_y", marker)
    assert _load(folder, ["y"]) == {"y": "The sky is"}
    assert marker.exists()


@pytest.fixture
def suite(tmp_path):
    """A suite the eval_suite step built: prose, arithmetic, passkey and exact-match tasks."""
    sources = [
        _corpus(tmp_path, "prose", "builtin:prose", "web", 60),
        _corpus(tmp_path, "math", "builtin:math", "math", 300),
    ]
    cfg = EvalConfig(items_per_task=6, passkey_lengths=(30,), passkey_items=2, batch_size=4, device="cpu", limit=2)
    spec = SuiteSpec(eval=cfg, generation_items=3, max_gen_tokens=5)
    meta = eval_suite(spec, heldout=sources, train=sources, out=tmp_path / "suite", log=lambda _: None)
    return Artifact(kind="eval", uri=str(tmp_path / "suite"), fingerprint="s" * 64, meta=meta)


def _prepare(suite: Artifact, tasks: list[str], log) -> Path:
    out = Path(tempfile.mkdtemp(prefix="test-suite-tasks-", dir=suite.path.parent))
    return suite_task_files(Path(suite.meta["task_dir"]), tasks, suite.meta["tasks"], out, log)


def test_planted_task_files_beside_the_suite_are_ignored_and_named(tmp_path, suite):
    """A planted Jinja YAML and a `!function` YAML with its module, in the suite's tasks folder:
    the folder lm-eval gets holds only our regenerated tasks (what the suite wrote, byte for byte),
    the planted files are logged by name, and rendering every task runs nothing."""
    task_dir = Path(suite.meta["task_dir"])
    jinja_marker, function_marker = tmp_path / "jinja-ran", tmp_path / "function-ran"
    (task_dir / "x.jsonl").write_text(json.dumps(ROW) + "\n")
    (task_dir / "x.yaml").write_text(_jinja_yaml("x", task_dir / "x.jsonl", jinja_marker))
    (task_dir / "y.yaml").write_text(_function_yaml("y", task_dir / "x.jsonl", "evil_y"))
    _plant_module(task_dir, "evil_y", function_marker)
    # A data item carrying the template: data is substituted, never rendered as a template.
    rows = [json.loads(line) for line in (task_dir / "prose_cloze.jsonl").read_text().splitlines()]
    rows[0]["context"] = _jinja(jinja_marker)
    (task_dir / "prose_cloze.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the same for the chat prompt an exact-match item carries
    rows = [json.loads(line) for line in (task_dir / "arithmetic_exact.jsonl").read_text().splitlines()]
    rows[0]["prompt"] = _jinja(jinja_marker)
    (task_dir / "arithmetic_exact.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    lines: list[str] = []
    tasks = list(suite.meta["tasks"])
    private = _prepare(suite, tasks, lines.append)
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
    assert sorted(p.name for p in private.iterdir()) == sorted(f"{t}.yaml" for t in tasks)
    for t in tasks:
        assert (private / f"{t}.yaml").read_bytes() == (task_dir / f"{t}.yaml").read_bytes()
    (line,) = lines
    assert all(repr(n) in line for n in ("x.yaml", "x.jsonl", "y.yaml", "evil_y.py")) and "ignored" in line

    prompts = _load(private, tasks)
    assert prompts["prose_cloze"] == prompts["arithmetic_exact"] == _jinja(jinja_marker)  # the payload as text
    with pytest.raises(Exception):  # noqa: B017  (lm-eval's own error for an unknown task)
        _load(private, ["x"])
    assert not jinja_marker.exists() and not function_marker.exists()


@pytest.mark.parametrize("attack", ["jinja", "function", "include", "symlink", "moved path"])
def test_a_swapped_suite_task_file_is_refused_naming_it(tmp_path, suite, attack):
    """A suite YAML swapped for the payload (the same task name, every other line ours) is
    refused before lm-eval sees anything, the error naming the file; nothing runs."""
    task_dir = Path(suite.meta["task_dir"])
    target, data = task_dir / "prose_cloze.yaml", task_dir / "prose_cloze.jsonl"
    marker = tmp_path / "ran"
    if attack == "jinja":
        target.write_text(_jinja_yaml("prose_cloze", data, marker))
    elif attack == "function":
        target.write_text(_function_yaml("prose_cloze", data, "evil"))
        _plant_module(task_dir, "evil", marker)
    elif attack == "include":
        base = tmp_path / "base.yaml"
        base.write_text(_function_yaml("base", data, "evil"))
        _plant_module(tmp_path, "evil", marker)
        target.write_text(f"include: {base}\n" + target.read_text())
    elif attack == "symlink":
        evil = tmp_path / "evil.yaml"
        evil.write_text(_jinja_yaml("prose_cloze", data, marker))
        target.unlink()
        target.symlink_to(evil)
    else:  # our own file with its data path elsewhere but one extra space: not byte for byte
        target.write_text(task_yaml("prose_cloze", tmp_path / "elsewhere.jsonl", " ") + " ")
    with pytest.raises(ForeignTaskFile, match="prose_cloze.yaml"):
        _prepare(suite, list(suite.meta["tasks"]), print)
    assert not marker.exists()


def test_a_suite_in_a_moved_workspace_is_regenerated_to_its_data(tmp_path, suite):
    """Our own file naming the data where the suite was built (the workspace moved since) is
    accepted, and the regenerated task reads the JSONL where it is now."""
    task_dir = Path(suite.meta["task_dir"])
    old = tmp_path / "old-place" / "prose_cloze.jsonl"
    (task_dir / "prose_cloze.yaml").write_text(task_yaml("prose_cloze", old, " "))
    private = _prepare(suite, ["prose_cloze"], print)
    assert (private / "prose_cloze.yaml").read_text() == task_yaml("prose_cloze", task_dir / "prose_cloze.jsonl", " ")


def test_evaluate_on_a_planted_suite_runs_nothing_and_names_the_files(tmp_path, suite, tiny_hf_model):  # noqa: F811
    """A whole evaluate call on a real model: planted files are ignored and named in its log,
    the scores are those of our tasks only, and no payload runs; a swapped YAML stops the step."""
    task_dir = Path(suite.meta["task_dir"])
    marker = tmp_path / "ran"
    (task_dir / "x.jsonl").write_text(json.dumps(ROW) + "\n")
    (task_dir / "x.yaml").write_text(_jinja_yaml("x", task_dir / "x.jsonl", marker))
    _plant_module(task_dir, "utils", marker)
    model = Artifact(
        kind="hf_model",
        uri=str(tiny_hf_model.parent),
        fingerprint="m" * 64,
        meta={"stage": "stage1", "model_dir": str(tiny_hf_model)},
    )
    cfg = EvalConfig(batch_size=4, device="cpu", limit=2)
    lines: list[str] = []
    out = tmp_path / "eval"
    out.mkdir()
    meta = evaluate(EvalSpec(eval=cfg), model, suite, out=out, log=lines.append)
    assert set(meta["scores"]) == {"prose_cloze", "arithmetic_cloze", "arithmetic_exact"}
    # exact match's random baseline: the constant guess over the items scored (limit 2)
    items = [json.loads(x) for x in (task_dir / "arithmetic_exact.jsonl").read_text().splitlines()][:2]
    assert meta["random_baseline"]["arithmetic_exact"] == (1.0 if items[0]["answer"] == items[1]["answer"] else 0.5)
    assert any("ignored" in line and "'x.yaml'" in line and "'utils.py'" in line for line in lines)
    assert not marker.exists()

    (task_dir / "arithmetic_cloze.yaml").write_text(
        _jinja_yaml("arithmetic_cloze", task_dir / "arithmetic_cloze.jsonl", marker)
    )
    with pytest.raises(ForeignTaskFile, match="arithmetic_cloze.yaml"):
        evaluate(EvalSpec(eval=cfg), model, suite, out=tmp_path / "eval2", log=lines.append)
    assert not marker.exists()
