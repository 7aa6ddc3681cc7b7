"""The step contract: Artifacts, fingerprints, and step folders that are complete only when marked.

An Artifact is a small frozen record (kind, uri, fingerprint, meta) that steps pass to each other.
A step's output folder is `{workspace}/{step}/{fingerprint[:12]}/`; it counts as finished only when
its completion marker (the Artifact as JSON) exists and names that very folder and fingerprint
(`reusable_marker`: a marker copied in from elsewhere is rebuilt over), and the marker is written last, atomically
(infra/files.py: a temporary file, fsync, `os.replace`). A crash mid-step therefore leaves a folder without a
marker, which the next run rebuilds (or, for resumable steps such as training, resumes inside).

A workspace can move (a copy, a restore from S3 to another mount, a bigger disk): what a marker
stores of paths is relative to the workspace root, every string under it written as
`{workspace}/REL` (`stored`) and read back against wherever the folder now is (`resolved`). A
marker written before this rule (absolute paths) is read against its folder's location too: its
own uri names the root it was written under.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from infra import files
from infra.files import STEP_MARKER

ArtifactKind = Literal[
    "corpus",
    "heldout_index",
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

MARKER = STEP_MARKER  # infra/files.py: the one home of atomic writes and completion markers


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


def operational(default: Any = ..., **kwargs: Any) -> Any:
    """A config field that says how a step runs, not what it computes (log intervals, worker
    counts, launcher, storage mirror, evaluation batch size...). It never enters a fingerprint, so
    changing it reruns nothing. Used like `Field`: `log_interval: int = operational(1, gt=0)`.

    Operational fields may change results at the level of floating-point summation order (thread
    counts, micro-batching), never the computation itself.
    """
    extra = dict(kwargs.pop("json_schema_extra", None) or {})
    return Field(default, json_schema_extra={**extra, "operational": True}, **kwargs)


def added_identity(default: Any = None, **kwargs: Any) -> Any:
    """An identity field added after fingerprints were published (a new, optional feature such as
    the skip-step rule of training): while it holds its default it is left out of the identity, so
    every config that does not use it keeps its fingerprint and its finished folders; once set it
    enters the fingerprint like any identity field. Used like `Field`."""
    extra = dict(kwargs.pop("json_schema_extra", None) or {})
    return Field(default, json_schema_extra={**extra, "identity_unless_default": True}, **kwargs)


def _left_out(model: type[BaseModel], name: str, value: Any) -> bool:
    """Whether field `name` holding `value` stays out of the identity (operational, or an
    `added_identity` field at its default)."""
    field = model.model_fields[name]
    extra = field.json_schema_extra
    if not isinstance(extra, dict):
        return False
    return bool(extra.get("operational")) or (bool(extra.get("identity_unless_default")) and value == field.default)


def is_operational(model: type[BaseModel], name: str) -> bool:
    """Whether field `name` of a config class is operational (see `operational`)."""
    extra = model.model_fields[name].json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("operational"))


def identity(config: Any) -> Any:
    """The part of a config that determines a step's output, as plain JSON data.

    Pydantic models lose their operational fields (recursively) and their `added_identity` fields
    left at the default; everything else is kept.
    """
    if isinstance(config, BaseModel):
        cls = type(config)
        return {
            name: identity(getattr(config, name))
            for name in cls.model_fields
            if not _left_out(cls, name, getattr(config, name))
        }
    if isinstance(config, Mapping):
        return {str(k): identity(v) for k, v in config.items()}
    if isinstance(config, list | tuple):
        return [identity(v) for v in config]
    return json.loads(canonical_json(config))


def config_dict(config: Any) -> Any:
    """A step config as plain JSON data (pydantic models are dumped, everything else kept)."""
    return json.loads(canonical_json(config))


# Named inputs of a step: one artifact, or a tuple of them, per input name.
Inputs = Mapping[str, Artifact | Sequence[Artifact]]


def input_fingerprints(inputs: Inputs | Sequence[Artifact]) -> Any:
    """What a fingerprint records of a step's inputs: fingerprints by input name (a list of them
    for a list input); positional inputs (plain sequences) keep their order. Anything with a
    `fingerprint` counts as an input (an Artifact, or a graph node before it has run)."""
    if isinstance(inputs, Mapping):
        return {
            name: [a.fingerprint for a in value] if isinstance(value, list | tuple) else value.fingerprint
            for name, value in inputs.items()
        }
    return [a.fingerprint for a in inputs]


def flat_inputs(inputs: Inputs | Sequence[Artifact]) -> list[Artifact]:
    """Every input artifact, in input order."""
    if not isinstance(inputs, Mapping):
        return list(inputs)
    out: list[Artifact] = []
    for value in inputs.values():
        out += list(value) if isinstance(value, list | tuple) else [value]
    return out


def fingerprint(step: str, version: int, config: Any, inputs: Inputs | Sequence[Artifact] = (), extra: str = "") -> str:
    """Hash of everything that determines a step's output.

    The config enters through `identity` (operational fields left out). `extra` carries facts
    outside the config that change the output: for a data source, a digest of the bytes it reads.
    Nothing here depends on the process computing it (cwd, sys.path, how it was started).
    """
    payload = {
        "step": step,
        "version": version,
        "config": identity(config),
        "inputs": input_fingerprints(inputs),
        "extra": extra,
    }
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


WORKSPACE = "{workspace}"  # stands for the workspace root in markers and lineage


def stored(value: Any, root: Path | str) -> Any:
    """`value` (JSON data) with every string that is `root` or a path under it written relative
    to it, as `{workspace}` or `{workspace}/REL`."""
    return _swap(value, str(root).rstrip("/"), WORKSPACE)


def resolved(value: Any, root: Path | str) -> Any:
    """The inverse of `stored`: `{workspace}` paths under `root` (the workspace as it is now)."""
    return _swap(value, WORKSPACE, str(root).rstrip("/"))


def _swap(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        if value == old:
            return new
        return new + value[len(old) :] if value.startswith(old + "/") else value
    if isinstance(value, dict):
        return {k: _swap(v, old, new) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_swap(v, old, new) for v in value]
    return value


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The completion record of a step folder, or None when the step never finished there; its
    paths are those of the folder where it is now (see the module docstring)."""
    record = files.read_marker(folder, STEP_MARKER)
    if record is None:
        return None
    folder = Path(folder)
    root = folder.parent.parent
    uri = (record.get("artifact") or {}).get("uri") if isinstance(record.get("artifact"), dict) else None
    if isinstance(uri, str) and uri.startswith("/") and uri != str(folder):  # written elsewhere, before the rule
        record = _swap(record, str(Path(uri).parent.parent), str(root))
    return resolved(record, root)


def reusable_marker(folder: Path, fp: str) -> dict[str, Any] | None:
    """The completion record of step folder `folder` when it describes this very folder: its
    artifact's uri is the folder and its fingerprint `fp` (the folder's name is fp[:12]). A marker
    copied from another folder, or naming another artifact, is not reused: the step builds again."""
    record = read_marker(folder)
    artifact = record.get("artifact") if record is not None else None
    if not isinstance(artifact, dict) or artifact.get("fingerprint") != fp:
        return None
    uri = artifact.get("uri")
    if not isinstance(uri, str) or Path(uri) != Path(folder):
        return None
    return record


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
    fetched: bool = False  # found on the mirror (pipeline/mirror.py), not built here


def run_step(
    *,
    root: Path,
    step: str,
    version: int,
    kind: ArtifactKind,
    config: Any,
    inputs: Inputs | Sequence[Artifact],
    build: Callable[[Path], dict[str, Any]],
    extra: str = "",
    refresh: bool = False,
    resumable: bool = False,
    fetch: Callable[[Path, str], bool] | None = None,
) -> StepOutcome:
    """Run `build(folder)` unless the step folder for this fingerprint is already complete.

    `build` writes its outputs into the folder and returns the Artifact's meta. A resumable step
    keeps what an interrupted earlier attempt left in its folder (training resumes from its last
    checkpoint); any other step starts from an empty folder. The marker is written last and
    records what the fingerprint hashed (the identity config, named input fingerprints, extra),
    its paths relative to the workspace root. `fetch(folder, fingerprint)`, when given, may fill a
    missing folder from a mirror first (it returns whether a finished folder is now there).
    """
    for artifact in flat_inputs(inputs):
        if not artifact.uri.startswith("s3://") and read_marker(artifact.path) is None:
            raise FileNotFoundError(
                f"input artifact {artifact.kind} {artifact.short} of step {step!r} is missing or "
                f"incomplete at {artifact.uri}; rerun its producing step with refresh"
            )
    fp = fingerprint(step, version, config, inputs, extra)
    folder = Path(root) / step / fp[:12]
    start = time.monotonic()
    with folder_lock(folder):
        record = reusable_marker(folder, fp)
        fetched = record is None and not refresh and fetch is not None and fetch(folder, fp)
        if fetched:
            record = reusable_marker(folder, fp)
        if record is not None and not refresh:
            artifact = Artifact(**record["artifact"])
            return StepOutcome(artifact=artifact, built=False, seconds=time.monotonic() - start, fetched=fetched)
        if folder.exists() and (refresh or not resumable):
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta = build(folder)
        artifact = Artifact(kind=kind, uri=str(folder), fingerprint=fp, meta=meta)
        record = {
            "artifact": stored(artifact.model_dump(mode="json"), root),
            "step": step,
            "version": version,
            "config": identity(config),
            "settings": stored(config_dict(config), root),
            "inputs": input_fingerprints(inputs),
            "extra": extra,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        files.mark_complete(folder, STEP_MARKER, record, sort_keys=True)
    return StepOutcome(artifact=artifact, built=True, seconds=time.monotonic() - start)
