"""A step's build in a child process: the call as JSON on the child's stdin, the result back in the step folder.

`python -m pipeline.child -` loads the step (by module and name), its typed config, its input
Artifacts and its folder from the call the runner wrote to its stdin (`call_text`), runs the
build and writes its meta to `.step-result.json`, or its one-line error to `.step-error.json`
before failing.

The call names a module the child imports, so it travels by a channel no other account can
write: the pipe from the runner (a copy goes to `.step-call.json` in the step folder for people
to read; the child never reads it, so swapping it changes nothing; `python -m pipeline.child
CALL.json` still runs a call file by hand). And the child imports only modules of this project:
the module's top-level package must be one of `PROJECT_PACKAGES` and its file inside the
checkout (`check_module`), so neither a call naming `workspace.x` (the default workspace is a
folder of the checkout, which is on the child's path) nor a package earlier on `PYTHONPATH` is
ever imported. Log lines are the child's stdout; `progress(percent)` reaches the parent as lines that
start with `PROGRESS_MARK` on the same stream (`progress_lines` splits them).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from infra.files import write_atomic
from pipeline.artifact import Artifact, Inputs
from pipeline.step import StepDef

PROGRESS_MARK = "@@smollm3-progress "  # a child's progress line: the mark, then a percentage
CALL_FILE, RESULT_FILE, ERROR_FILE = ".step-call.json", ".step-result.json", ".step-error.json"
REPO_ROOT = Path(__file__).resolve().parent.parent
# Top-level packages a step may live in (steps are in tasks/; the tests define some of their own).
PROJECT_PACKAGES = frozenset({"tasks", "pipeline", "flows", "curation", "evals", "model", "trainers", "infra", "tests"})
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


class ForeignModule(ImportError):
    """A step call naming a module that is not this project's; the message names it."""


def child_command(call_file: Path | None = None) -> list[str]:
    """The child's argv: the call on stdin (`-`), or from a file given by hand."""
    return [sys.executable, "-u", "-m", "pipeline.child", str(call_file) if call_file else "-"]


def child_env(threads: int | None) -> dict[str, str]:
    """The child's environment: this code first on its path, and the slot's thread count for
    every library that reads one (torch/OpenMP, MKL, tokenizers' rayon pool)."""
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)}
    if threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
            env[var] = str(threads)
        env["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    return env


def call_text(d: StepDef, config: Any, inputs: Inputs, out: Path) -> str:
    """Everything the child needs, as JSON (for its stdin); a copy is written to the step folder
    for people to read."""
    text = _payload(d, config, inputs, out)
    write_call(d, config, inputs, out, text)
    return text


def _payload(d: StepDef, config: Any, inputs: Inputs, out: Path) -> str:
    return json.dumps(
        {
            "module": d.build.__module__,
            "attr": d.build.__name__,
            "config": config.model_dump(mode="json") if hasattr(config, "model_dump") else config,
            "inputs": {
                name: v.model_dump(mode="json") if isinstance(v, Artifact) else [a.model_dump(mode="json") for a in v]
                for name, v in inputs.items()
            },
            "out": str(out),
        },
        indent=2,
    )


def write_call(d: StepDef, config: Any, inputs: Inputs, out: Path, text: str | None = None) -> Path:
    """The call as JSON in the step folder (`.step-call.json`), for people and hand runs."""
    for stale in (RESULT_FILE, ERROR_FILE):
        (out / stale).unlink(missing_ok=True)
    path = out / CALL_FILE
    write_atomic(path, text if text is not None else _payload(d, config, inputs, out))
    return path


def read_result(out: Path) -> dict[str, Any]:
    """The meta the child wrote; removes the call and result files (not part of the output)."""
    meta = json.loads((out / RESULT_FILE).read_text(encoding="utf-8"))
    for name in (CALL_FILE, RESULT_FILE):
        (out / name).unlink(missing_ok=True)
    return meta


def read_error(out: Path) -> str | None:
    """The one-line error the child recorded before failing, if any."""
    try:
        return json.loads((out / ERROR_FILE).read_text(encoding="utf-8"))["error"]
    except (OSError, ValueError, KeyError):
        return None


def check_module(name: object) -> str:
    """Import module `name` only if it is this project's (see the module docstring); raise
    ForeignModule naming it otherwise."""
    if not isinstance(name, str) or not _MODULE.fullmatch(name) or name.split(".")[0] not in PROJECT_PACKAGES:
        raise ForeignModule(
            f"step call names module {name!r}: a step runs only from this project's packages "
            f"({', '.join(sorted(PROJECT_PACKAGES))}); refused before importing anything"
        )
    top = importlib.util.find_spec(name.split(".")[0])
    origins = list(top.submodule_search_locations or []) if top is not None else []
    if top is None or not origins or any(not Path(o).resolve().is_relative_to(REPO_ROOT) for o in origins):
        raise ForeignModule(f"step call names module {name!r}, whose package is not the one in {REPO_ROOT}; refused")
    return name


def load_call(path: Path | str) -> tuple[StepDef, Any, dict[str, Any], Path]:
    """A call from a file, or from stdin when `path` is `-` (read once, from the pipe)."""
    text = sys.stdin.read() if str(path) == "-" else Path(path).read_text(encoding="utf-8")
    payload = json.loads(text)
    d = getattr(importlib.import_module(check_module(payload["module"])), payload["attr"])
    if not isinstance(d, StepDef):
        raise TypeError(f"{payload['module']}.{payload['attr']} is not a step")
    config = d.config_type.model_validate(payload["config"])
    inputs = {
        name: Artifact(**v) if isinstance(v, dict) else tuple(Artifact(**a) for a in v)
        for name, v in payload["inputs"].items()
    }
    return d, config, inputs, Path(payload["out"])


def _child(call_file: Path | str) -> int:
    d, config, inputs, out = load_call(call_file)

    def progress(percent: float) -> None:
        print(f"{PROGRESS_MARK}{float(percent):.2f}", flush=True)

    try:
        meta = d.run(config, inputs, out, log=lambda line: print(line, flush=True), progress=progress)
    except BaseException as exc:  # noqa: BLE001 (recorded, then re-raised for the exit code)
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}".strip()
        write_atomic(out / ERROR_FILE, json.dumps({"error": error[:4000]}))
        raise
    write_atomic(out / RESULT_FILE, json.dumps(meta, default=str))
    return 0


def split_progress(line: str) -> float | None:
    """The percentage of a child's progress line, None for an ordinary log line."""
    if not line.startswith(PROGRESS_MARK):
        return None
    try:
        return float(line[len(PROGRESS_MARK) :])
    except ValueError:
        return None


def progress_lines(log: Callable[[str], None], progress: Callable[[float], None] | None) -> Callable[[str], None]:
    """A line sink for a child's output: progress marks go to `progress`, other lines to `log`."""

    def line(text: str) -> None:
        percent = split_progress(text)
        if percent is None:
            log(text)
        elif progress is not None:
            progress(percent)

    return line


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m pipeline.child - | CALL.json  (the call the flow runner writes)", file=sys.stderr)
        return 2
    return _child(argv[0] if argv[0] == "-" else Path(argv[0]))


if __name__ == "__main__":
    # Run as `python -m pipeline.child`: hand over to the imported module, so the call is loaded
    # by the same module objects the step definitions use.
    from infra.exit import exit_process
    from pipeline import child as _module

    exit_process(_module.main())  # sys.exit without the final collections over the step's imports
