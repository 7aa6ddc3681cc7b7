"""The step contract: Artifacts, fingerprints, and step folders that are complete only when marked.

An Artifact is a small frozen record (kind, uri, fingerprint, meta) that steps pass to each other.
A step's output folder is `{workspace}/{step}/{fingerprint[:12]}/`; it counts as finished only when
its completion marker (the Artifact as JSON) exists, and the marker is written last, atomically
(write a temporary file, fsync, `os.replace`). A crash mid-step therefore leaves a folder without a
marker, which the next run rebuilds (or, for resumable steps such as training, resumes inside).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

ArtifactKind = Literal[
    "corpus",
    "tokenizer",
    "fertility",
    "shards",
    "mixture",
    "preflight",
    "checkpoint",
    "hf_model",
    "eval",
    "report",
]

MARKER = "_COMPLETE.json"


class Artifact(BaseModel):
    """What a step produced: a folder plus the few facts downstream steps and users need."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: ArtifactKind
    uri: str  # the step folder (a local path, or s3://... once mirrored)
    fingerprint: str  # sha256 hex of (step, version, config, input fingerprints)
    meta: dict[str, Any] = {}  # small facts only: counts, losses, scores; never payloads

    @property
    def short(self) -> str:
        return self.fingerprint[:12]

    @property
    def path(self) -> Path:
        if self.uri.startswith("s3://"):
            raise ValueError(f"artifact {self.short} lives at {self.uri}, not on local disk")
        return Path(self.uri)


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: the byte-stable form that fingerprints hash."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"cannot fingerprint a {type(obj).__name__}: {obj!r}")


def config_dict(config: Any) -> Any:
    """A step config as plain JSON data (pydantic models are dumped, everything else kept)."""
    return json.loads(canonical_json(config))


def fingerprint(
    step: str, version: int, config: Any, inputs: Sequence[Artifact] = (), extra: str = ""
) -> str:
    """Hash of everything that determines a step's output.

    `extra` carries facts outside the config that change the output: for a data source, a digest
    of the input files or of the installed packages its text comes from.
    """
    payload = {
        "step": step,
        "version": version,
        "config": config_dict(config),
        "inputs": [a.fingerprint for a in inputs],
        "extra": extra,
    }
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see either nothing or the whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The completion record of a step folder, or None when the step never finished there."""
    marker = Path(folder) / MARKER
    if not marker.is_file():
        return None
    return json.loads(marker.read_text(encoding="utf-8"))


def find_marker(path: Path) -> dict[str, Any] | None:
    """The completion record of the step folder holding `path` (itself or any parent)."""
    path = Path(path).resolve()
    for folder in (path, *path.parents):
        record = read_marker(folder)
        if record is not None:
            return record
    return None


@contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """Exclusive lock so two runs never build the same step folder at once."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock_path = folder.with_name(f".{folder.name}.lock")
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class StepOutcome(BaseModel):
    """An Artifact plus whether this call built it or found it already finished."""

    model_config = ConfigDict(frozen=True)

    artifact: Artifact
    built: bool
    seconds: float


def run_step(
    *,
    root: Path,
    step: str,
    version: int,
    kind: ArtifactKind,
    config: Any,
    inputs: Sequence[Artifact],
    build: Callable[[Path], dict[str, Any]],
    extra: str = "",
    refresh: bool = False,
    resumable: bool = False,
) -> StepOutcome:
    """Run `build(folder)` unless the step folder for this fingerprint is already complete.

    `build` writes its outputs into the folder and returns the Artifact's meta. A resumable step
    keeps what an interrupted earlier attempt left in its folder (training resumes from its last
    checkpoint); any other step starts from an empty folder. The marker is written last.
    """
    for artifact in inputs:
        if not artifact.uri.startswith("s3://") and read_marker(artifact.path) is None:
            raise FileNotFoundError(
                f"input artifact {artifact.kind} {artifact.short} of step {step!r} is missing or "
                f"incomplete at {artifact.uri}; rerun its producing step with refresh"
            )
    fp = fingerprint(step, version, config, inputs, extra)
    folder = Path(root) / step / fp[:12]
    start = time.monotonic()
    with folder_lock(folder):
        record = read_marker(folder)
        if record is not None and not refresh:
            return StepOutcome(
                artifact=Artifact(**record["artifact"]), built=False, seconds=0.0
            )
        if folder.exists() and (refresh or not resumable):
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta = build(folder)
        artifact = Artifact(kind=kind, uri=str(folder), fingerprint=fp, meta=meta)
        record = {
            "artifact": artifact.model_dump(mode="json"),
            "step": step,
            "version": version,
            "config": config_dict(config),
            "inputs": [a.fingerprint for a in inputs],
            "extra": extra,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_atomic(folder / MARKER, json.dumps(record, indent=2, sort_keys=True))
    return StepOutcome(artifact=artifact, built=True, seconds=time.monotonic() - start)
