"""The step call reaches the child by a channel no other account writes, and names only this
project's modules (issue 35, item 3). Each attack is planted from outside the runner: a module
that runs a payload when imported (shown live on a control: a plain import in a process started
as the child is), a call naming it, and a `.step-call.json` swapped before the child runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from infra.proc import ChildFailed, run_streaming
from pipeline.child import (
    CALL_FILE,
    REPO_ROOT,
    RESULT_FILE,
    ForeignModule,
    call_text,
    check_module,
    child_command,
    child_env,
)
from pipeline.step import step


class Note(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str = "hello"


@step("note", version=1, kind="report", isolate=True)
def note(config: Note, *, out: Path, log=print) -> dict[str, Any]:
    (out / "note.txt").write_text(config.text)
    return {"text": config.text}


def _payload_module(folder: Path, name: str, marker: Path) -> None:
    """A package `name` in `folder` whose import creates `marker` (the payload)."""
    pkg = folder / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\nattr = None\n")


def _run_child(call: str, env: dict[str, str] | None = None) -> list[str]:
    lines: list[str] = []
    run_streaming(child_command(), lines.append, cwd=REPO_ROOT, env=env or child_env(None), stdin_text=call)
    return lines


def test_a_call_naming_a_module_outside_the_project_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    # a folder of the checkout (what the default workspace is) and a folder on PYTHONPATH
    in_checkout = f"ws_planted_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "path"))
    env = child_env(None)
    try:
        _payload_module(REPO_ROOT, in_checkout, marker)
        _payload_module(tmp_path / "path", "evilpkg", marker)
        for module in (in_checkout, "evilpkg"):
            # control: a process started as the child is imports it, and the payload runs
            subprocess.run([sys.executable, "-c", f"import {module}"], cwd=REPO_ROOT, env=env, check=True)
            assert marker.exists()
            marker.unlink()
            call = json.dumps({"module": module, "attr": "attr", "config": {}, "inputs": {}, "out": str(tmp_path)})
            with pytest.raises(ChildFailed) as err:
                _run_child(call, env)
            assert any(f"ForeignModule: step call names module {module!r}" in line for line in err.value.tail)
            assert not marker.exists()
    finally:
        shutil.rmtree(REPO_ROOT / in_checkout, ignore_errors=True)


@pytest.mark.parametrize(
    "module", ["workspace.source.abc.evil", "os", "subprocess", "tasks/../x", "tasks.x; import os", "", 5, None]
)
def test_only_the_projects_packages_pass_the_check(module):
    with pytest.raises(ForeignModule):
        check_module(module)
    assert check_module("tasks.sources") == "tasks.sources"
    assert check_module("tests.pipeline.test_child_call") == "tests.pipeline.test_child_call"


def test_a_swapped_call_file_is_never_what_the_child_runs(tmp_path):
    """Another process replaces `.step-call.json` after the runner wrote it (the race won): the
    child reads the call from its stdin, runs the step it was given, and the file's payload
    stays inert."""
    marker = tmp_path / "pwned"
    _payload_module(tmp_path / "path", "evilpkg", marker)
    out = tmp_path / "out"
    out.mkdir()
    call = call_text(note, Note(text="from the runner"), {}, out)
    assert json.loads((out / CALL_FILE).read_text()) == json.loads(call)  # the copy for people
    swapped = {**json.loads(call), "module": "evilpkg", "attr": "attr"}
    (out / CALL_FILE).write_text(json.dumps(swapped))  # the swap, before the child starts
    _run_child(call)
    assert json.loads((out / RESULT_FILE).read_text()) == {"text": "from the runner"}
    assert (out / "note.txt").read_text() == "from the runner"
    assert json.loads((out / CALL_FILE).read_text())["module"] == "evilpkg"  # the swap happened
    assert not marker.exists()
