"""The Prefect side of the step contract: a decorator that turns a build function into a task.

    @step("corpus", version=1, kind="corpus", extra=lambda cfg, seed: ...)
    def corpus(config, inputs, out, *, seed) -> dict: ...   # writes into `out`, returns meta

gives a Prefect task `corpus(ws, config, inputs=(), label="", refresh=False, **params)` that returns
an Artifact. Its cache key is the step fingerprint (name, version, config, input fingerprints, extra
facts) plus a hash of the step module's source, with results persisted under the workspace, so a
rerun or a UI retry comes back Cached and a changed config reruns only the steps downstream of it.
If a cached result exists but its step folder was deleted, the key changes and the step rebuilds.
"""

from __future__ import annotations

import hashlib
import inspect
import re
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import CachePolicy

from infra.artifact import Artifact, ArtifactKind, fingerprint, read_marker, run_step
from infra.workspace import Workspace


@dataclass(frozen=True)
class StepDef:
    """A step as data: what it is called, its version, what it produces and how it builds."""

    name: str
    version: int
    kind: ArtifactKind
    build: Callable[..., dict[str, Any]]
    extra: Callable[..., str] | None = None  # facts outside the config that change the output
    resumable: bool = False  # keep an interrupted attempt's files (training resumes from them)
    # Called after a build (not on reuse) to publish Prefect artifacts and lineage fact rows:
    # publish(artifact, ws, label). Build functions stay free of Prefect and DuckDB.
    publish: Callable[..., None] | None = None
    # Params that say how a step runs, not what it computes (launcher, storage mirror): they are
    # passed to the build but left out of the fingerprint, so moving a stage to Slurm or adding
    # an S3 mirror does not retrain it.
    ephemeral: tuple[str, ...] = ()

    @cached_property
    def code_version(self) -> str:
        module = sys.modules[self.build.__module__]
        source = inspect.getsource(module)
        return hashlib.sha256(source.encode()).hexdigest()[:12]

    def identity(self, params: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in params.items() if k not in self.ephemeral}

    def fingerprint(self, config: Any, inputs: tuple[Artifact, ...], params: dict[str, Any]) -> str:
        extra = self.extra(config, **params) if self.extra else ""
        return fingerprint(
            self.name, self.version, {"config": config, "params": self.identity(params)}, inputs, extra
        )


@dataclass
class StepCache(CachePolicy):
    """Cache key = step fingerprint + step code version; stale when the step folder is gone."""

    definition: StepDef | None = field(default=None)

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str | None:
        d = self.definition
        assert d is not None
        ws: Workspace = inputs["ws"]
        params = inputs.get("params") or {}
        fp = d.fingerprint(inputs["config"], tuple(inputs.get("inputs") or ()), params)
        key = f"{d.name}-{fp[:20]}-{d.code_version}-{hashlib.sha256(ws.root.encode()).hexdigest()[:8]}"
        if (ws.results_dir / key).exists() and read_marker(ws.path / d.name / fp[:12]) is None:
            # A cached result points at a folder that was deleted: make Prefect miss and rebuild.
            return f"{key}-rebuild-{uuid.uuid4().hex[:8]}"
        return key


def step(
    name: str,
    *,
    version: int,
    kind: ArtifactKind,
    extra: Callable[..., str] | None = None,
    resumable: bool = False,
    publish: Callable[..., None] | None = None,
    ephemeral: tuple[str, ...] = (),
):
    """Declare a pipeline step; see the module docstring."""

    def wrap(build: Callable[..., dict[str, Any]]):
        definition = StepDef(name, version, kind, build, extra, resumable, publish, ephemeral)

        @task(
            name=name,
            task_run_name=name + "[{label}]",
            cache_policy=StepCache(definition=definition),
            persist_result=True,
        )
        def run(
            ws: Workspace,
            config: Any,
            inputs: tuple[Artifact, ...] = (),
            label: str = "",
            refresh: bool = False,
            params: dict[str, Any] | None = None,
        ) -> Artifact:
            return execute(definition, ws, config, inputs, label, refresh, params or {})

        run.definition = definition  # type: ignore[attr-defined]
        return run

    return wrap


def execute(
    d: StepDef,
    ws: Workspace,
    config: Any,
    inputs: tuple[Artifact, ...],
    label: str,
    refresh: bool,
    params: dict[str, Any],
) -> Artifact:
    """Build (or reuse) the step folder and record the artifact and its edges in lineage."""
    logger = get_run_logger()
    extra = d.extra(config, **params) if d.extra else ""
    outcome = run_step(
        root=ws.path,
        step=d.name,
        version=d.version,
        kind=d.kind,
        config={"config": config, "params": d.identity(params)},
        inputs=inputs,
        build=lambda out: d.build(config, inputs, out, log=logger.info, **_progress(d, label), **params),
        extra=extra,
        refresh=refresh,
        resumable=d.resumable,
    )
    artifact = outcome.artifact
    verb = "built" if outcome.built else "reused finished"
    logger.info(f"{d.name}[{label}] {verb} {artifact.kind} {artifact.short} at {artifact.uri}")
    ws.lineage().record_artifact(artifact, d.name, label, config, inputs)
    if outcome.built and d.publish is not None:
        d.publish(artifact, ws, label)
    if outcome.built and ws.storage is not None and ws.storage.s3_uri and not d.resumable:
        # Finished step folders go to S3 as they are built (marker last, checksums verified).
        # Resumable steps (training stages) mirror their checkpoints while they run instead.
        from infra.storage import mirror_artifact

        target = f"{ws.storage.s3_uri.rstrip('/')}/{d.name}"
        report = mirror_artifact(artifact.path, target, ws.storage)
        logger.info(f"{d.name}[{label}] mirrored to {target}/{artifact.path.name} ({report})")
    return artifact


def _progress(d: StepDef, label: str) -> dict[str, Any]:
    """A `progress(percent)` callback backed by a Prefect progress artifact, for build functions
    that accept one (long steps such as training stages)."""
    if "progress" not in inspect.signature(d.build).parameters:
        return {}
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    key = re.sub(r"[^a-z0-9-]+", "-", f"{d.name}-{label}-progress".lower())
    artifact_id = create_progress_artifact(progress=0.0, key=key, description=f"{d.name}[{label}]")

    def progress(percent: float) -> None:
        update_progress_artifact(artifact_id=artifact_id, progress=max(0.0, min(100.0, percent)))

    return {"progress": progress}


def results_storage(ws: Workspace) -> Path:
    ws.results_dir.mkdir(parents=True, exist_ok=True)
    return ws.results_dir
