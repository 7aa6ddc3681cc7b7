"""A pipeline step as data: name, version, what it produces, its typed config and how it builds.

    @step("curate", version=2, kind="corpus", resource="data", isolate=True)
    def curate(config: CurationConfig, inputs: dict, out: Path, *, log=print) -> dict: ...

makes `curate` a `StepDef` (Marin's "a step is data"). The build function receives its typed
config, its inputs by name (one Artifact, or a tuple of them, per name), the step folder to write
into and a `log` callback, plus `progress(percent)` when it declares one; it returns the Artifact's
meta. Nothing here imports Prefect: pipeline/graph.py wires StepDefs into a graph, pipeline/runner.py
runs it as Prefect tasks and pipeline/dryrun.py predicts it.

Where a build runs:
- `isolate=True`: in a child process (pipeline/child.py), so Python-heavy work runs
  in parallel despite the GIL, libraries that patch globals (TRL, datatrove's loggers) stay out of
  the flow process, thread counts are the slot's own, and a cancelled or crashed run takes the
  child down with it (infra/proc.py). The child prints its log lines; `progress` reaches the parent
  as marked lines on the same stream.
- otherwise in the flow process (light steps, and steps whose work is already a subprocess, such
  as training stages launched through torchrun).
`resource` names the slot (recipe `resources`) the build holds while it runs: train, eval or
data; reusing a finished folder needs no slot.
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pipeline.artifact import Artifact, ArtifactKind, Inputs, fingerprint

Resource = Literal["train", "eval", "data"]


@dataclass(frozen=True, eq=False)
class StepDef:
    """A step as data: what it is called, its version, what it produces and how it builds."""

    name: str
    version: int
    kind: ArtifactKind
    build: Callable[..., dict[str, Any]]
    extra: Callable[[Any], str] | None = None  # facts outside the config that change the output
    resumable: bool = False  # keep an interrupted attempt's files (training resumes from them)
    # Called after a build (not on reuse) to publish Prefect artifacts and lineage fact rows:
    # publish(artifact, ws, label). Build functions stay free of Prefect and DuckDB.
    publish: Callable[..., None] | None = None
    resource: Resource | None = None  # slot held while building (recipe `resources`)
    isolate: bool = False  # build in a child process (see the module docstring)
    # Attempts after a failure whose cause is transient (see `transient`), `retry_delay` seconds
    # apart: a deterministic failure (bad config or data) fails at once.
    retries: int = 0
    retry_delay: float = 10.0

    @cached_property
    def config_type(self) -> type:
        """The class of the build's `config` argument (the step's typed config)."""
        annotation = self.build.__annotations__["config"]
        if isinstance(annotation, str):  # `from __future__ import annotations`
            annotation = eval(annotation, vars(sys.modules[self.build.__module__]))  # noqa: S307
        return annotation

    @cached_property
    def code_version(self) -> str:
        """Hash of the step module's source: a changed module misses Prefect's cache (the marker
        of an unchanged fingerprint is still reused: outputs change only with `version`)."""
        module = sys.modules[self.build.__module__]
        return hashlib.sha256(inspect.getsource(module).encode()).hexdigest()[:12]

    @cached_property
    def wants_progress(self) -> bool:
        return "progress" in inspect.signature(self.build).parameters

    def facts(self, config: Any) -> str:
        """`extra` of this config: facts outside it that change the output ("" when none)."""
        return self.extra(config) if self.extra else ""

    def fingerprint(self, config: Any, inputs: Inputs, extra: str) -> str:
        return fingerprint(self.name, self.version, config, inputs, extra)

    def run(
        self,
        config: Any,
        inputs: Inputs,
        out: Path,
        log: Callable[[str], None] = print,
        progress: Callable[[float], None] | None = None,
    ) -> dict[str, Any]:
        """Call the build function in this process."""
        kwargs: dict[str, Any] = {"log": log}
        if self.wants_progress:
            kwargs["progress"] = progress or (lambda _: None)
        return self.build(config, dict(inputs), out, **kwargs)

    def __repr__(self) -> str:
        return f"StepDef({self.name!r}, version={self.version})"


def step(
    name: str,
    *,
    version: int,
    kind: ArtifactKind,
    extra: Callable[[Any], str] | None = None,
    resumable: bool = False,
    publish: Callable[..., None] | None = None,
    resource: Resource | None = None,
    isolate: bool = False,
    retries: int = 0,
    retry_delay: float = 10.0,
) -> Callable[[Callable[..., dict[str, Any]]], StepDef]:
    """Declare a pipeline step; see the module docstring."""

    def wrap(build: Callable[..., dict[str, Any]]) -> StepDef:
        return StepDef(name, version, kind, build, extra, resumable, publish, resource, isolate, retries, retry_delay)

    return wrap


def one(inputs: Inputs, name: str) -> Artifact:
    """The single artifact of input `name`."""
    value = inputs[name]
    if not isinstance(value, Artifact):
        raise TypeError(f"input {name!r} is a list of {len(value)} artifacts, not one")
    return value


def many(inputs: Inputs, name: str) -> tuple[Artifact, ...]:
    """The artifacts of list input `name` (a single artifact counts as a list of one)."""
    value = inputs.get(name, ())
    return (value,) if isinstance(value, Artifact) else tuple(value)


# --- which failures a retry can fix ----------------------------------------------------------

# Errors of the file system or the network that a second attempt can outlive (a flaky mount, a
# dropped connection, S3 throttling after its own backoff), by class name: a build in a child
# process reaches the runner as "ClassName: message" (pipeline.child), not as the exception.
TRANSIENT_ERRORS = frozenset(
    {
        "OSError",
        "IOError",
        "TimeoutError",
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionAbortedError",
        "ConnectionRefusedError",
        "BrokenPipeError",
        "InterruptedError",
        "IncompleteRead",
        "RemoteDisconnected",
        "ProtocolError",
        "ChunkedEncodingError",
        "ReadTimeout",
        "ConnectTimeout",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ResponseStreamingError",
    }
)
# OSErrors that say something about the input or the machine that waiting does not change.
_LASTING_ERRNOS = {
    errno.ENOENT,
    errno.EACCES,
    errno.EPERM,
    errno.EEXIST,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ENOSPC,
    errno.EROFS,
    errno.ENAMETOOLONG,
    errno.EDQUOT,
}
_S3_RETRYABLE = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
}
# Scheduler end states of a training job that a resumed job outlives.
_JOB_STATES = {"NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "TIMEOUT", "DEADLINE"}


def transient(exc: BaseException | None) -> bool:
    """Whether a failure (or any exception it was raised from) can go away by running again:
    IO and network errors, S3 throttling, a training job whose rank was killed by a signal (OOM
    killer, preemption), that hung (ended by its watchdog) or whose node failed or time ran out (a
    retry resumes from the last checkpoint). Config, data and code errors (ValueError, a missing file, a non-finite loss, a
    Python error in a rank) are not: retrying them only repeats them."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        facts = getattr(exc, "facts", None)  # infra.launchers.LaunchFailed: how the job ended
        if facts is not None and hasattr(facts, "signal"):
            # A hung launch was ended by its watchdog: the retry resumes from the last checkpoint.
            hung = bool(getattr(facts, "hung", None))
            return hung or bool(facts.signal) or (facts.state or "").upper() in _JOB_STATES
        name = type(exc).__name__
        if name == "ClientError":  # botocore: only throttling and server-side errors
            code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
            if code in _S3_RETRYABLE:
                return True
        elif name.endswith("HTTPError"):  # requests/huggingface_hub: an OSError, but a 404 stays
            status = getattr(getattr(exc, "response", None), "status_code", None)
            return status in (408, 429, 500, 502, 503, 504)
        elif isinstance(exc, OSError) or name in TRANSIENT_ERRORS:
            return getattr(exc, "errno", None) not in _LASTING_ERRNOS and not isinstance(
                exc, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError | FileExistsError
            )
        elif type(exc) is RuntimeError:  # a child's failure: "ClassName: message"
            head, sep, rest = str(exc).partition(": ")
            if sep and head in TRANSIENT_ERRORS:
                return not any(f"[Errno {n}]" in rest for n in _LASTING_ERRNOS)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return False
