"""Run a flow's graph as Prefect tasks: every step a future, independent branches at once.

`run_graph(graph, ctx)` submits every node of the graph (pipeline/graph.py) in graph order as a
Prefect future whose inputs are exactly its upstream futures, so:
- a step starts as soon as its inputs are finished, and independent branches run side by side
  (per-source data branches, the evaluation of stage N beside the training of stage N+1, anneal
  candidates beside each other), bounded by the recipe's resource slots (pipeline/slots.py);
- Prefect records each task run's inputs from those futures alone (every other parameter is
  quoted), so the graph the UI draws is the graph that ran, and equals the lineage edges.

One step (`execute`, the body of the Prefect task) reuses its finished folder or builds it
under its slot, in this process or in a child process (pipeline/child.py), then records its state,
artifact and input edges in lineage, publishes its Prefect artifacts, and mirrors the folder to
S3 when the recipe has storage. Prefect's cache (results persisted as JSON under
`{workspace}/results/`) makes a rerun or a UI retry show finished steps as Cached without running
their bodies; `StepCache` keys it on the fingerprint, so it never hands out a folder that was
deleted by hand, and the folder is read through `pipeline.results.CheckedResults`, so a record
that is not one of our JSON Artifacts is a cache miss, never deserialized. A step whose folder is
missing here but finished on the S3 mirror is fetched, verified, instead of rebuilt
(pipeline/mirror.py). Steps downstream of a failed one are recorded as `skipped`; the flow fails
after every independent branch has finished, naming each failed step and its cause. A served run
whose serve process dies stops its steps and ends `Crashed`, saying so (pipeline/owner.py); SIGTERM
or SIGINT stops the running steps' children at once and ends the run `cancelled`
(pipeline/signals.py). Work its steps follow but do not own (a cluster job) is told how the run
stopped through infra/stop_hooks.py: cancelled when the run is cancelled explicitly (Ctrl-C, or a
SIGTERM that Prefect's API confirms as a cancellation), else detached, left running for a retry to
re-attach; the runner knows nothing of who follows what.
"""

from __future__ import annotations

import subprocess
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import CachePolicy
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import deployment as runtime_deployment
from prefect.runtime import flow_run as runtime_flow_run
from prefect.states import Crashed, State
from prefect.utilities.annotations import quote

from infra.guard import ProcessRef
from infra.proc import ChildFailed, run_streaming, stop_all
from infra.stop_hooks import cancel_requested, set_cancel_probe
from infra.stop_hooks import stop as stop_followed
from pipeline.artifact import Artifact, reusable_marker, run_step
from pipeline.child import REPO_ROOT, call_text, child_command, child_env, progress_lines, read_error, read_result
from pipeline.graph import Graph, Node
from pipeline.lineage import StepRow
from pipeline.live import LiveStatus
from pipeline.mirror import fetcher
from pipeline.owner import (
    broken_pipe,
    mute_console,
    owner_died_before,
    quiet_console_streams,
    run_owner,
    survive_broken_console,
    watch_owner,
)
from pipeline.results import CheckedResults
from pipeline.sentinel import Sentinel
from pipeline.signals import stop_on_signals
from pipeline.slots import ResourcesConfig, hold
from pipeline.step import StepDef, transient
from pipeline.workspace import Workspace


def flow_run_name() -> str | None:
    """The calling thread's Prefect flow run name (e.g. `crimson-owl`), None outside a flow run:
    where a step's trackers group the run's stages and trainers (trainers/tracker.py)."""
    return str(runtime_flow_run.name) if runtime_flow_run.id else None


def flow_run_cancelled(run_id: str) -> bool:
    """Whether Prefect's API has flow run `run_id` cancelling or cancelled."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(uuid.UUID(run_id)).state
    return state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


@cache
def git_version() -> str:
    """The commit the code runs from (`+dirty` when the tree has changes), for lineage."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class StepFailed(RuntimeError):
    """A step failed; the message starts with `step[label] failed:` and names the cause."""


class StepStopped(StepFailed):
    """A step stopped because its run lost its owner (the serve process died): never retried. Its
    message starts with `step[label] stopped:`."""


class FlowFailed(RuntimeError):
    """Some steps of a run failed (each named with its cause); the others finished."""


class OwnerGone(RuntimeError):
    """A step not started because the serve process that owns the run died."""


@dataclass(frozen=True, eq=False)
class StepCall:
    """What one task run needs besides its inputs (passed quoted: Prefect never inspects it)."""

    node: Node
    ctx: RunContext
    refresh: bool
    resources: ResourcesConfig

    @property
    def ws(self) -> Workspace:
        return self.ctx.ws

    @property
    def folder(self) -> Path:
        return self.ws.path / self.node.step.name / self.node.short


@dataclass(frozen=True)
class RunSetup:
    """What the runner needs of the application's config, and nothing more: the workspace, the
    resource slots, and what to record of the config (the flows build it from their recipe:
    flows/recipe.py `run_setup`)."""

    ws: Workspace
    resources: ResourcesConfig
    name: str  # the config's name (the recipe), shown in lineage and the UI
    settings: dict[str, Any]  # the resolved config as JSON: lineage's flow_runs.config
    settings_text: str = ""  # the same as a file, saved as runs/{run_id}/{saved_as}
    saved_as: str = "recipe.yaml"


class RunContext:
    """One flow run: its workspace, resolved config, and the run's row in lineage."""

    def __init__(self, flow: str, setup: RunSetup):
        self.flow = flow
        self.setup = setup
        self.recipe_name = setup.name
        self.ws = setup.ws
        self.lineage = self.ws.lineage()
        self.run_id = str(runtime_flow_run.id or uuid.uuid4())
        self.deployment = runtime_deployment.name
        self.attempt = int(runtime_flow_run.run_count or 1) if runtime_flow_run.id else None
        self.records: list[StepRow] = []
        self.reused: set[str] = set()  # steps whose body found their folder finished (recorded `cached`)
        self._records_lock = threading.Lock()
        self.owner_gone: str | None = None  # set when the serve process that owns the run died
        self.owner: ProcessRef | None = None
        self._owner_lock = threading.Lock()
        self.cancelled: str | None = None  # set when SIGTERM or SIGINT stopped the run
        self._signals: Any = None
        self.sentinel: Sentinel | None = None  # marks the run Crashed if this process dies (pipeline/sentinel.py)

    def __enter__(self) -> RunContext:
        run_dir = self.ws.run_dir(self.run_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        saved = run_dir / self.setup.saved_as
        saved.write_text(self.setup.settings_text, encoding="utf-8")
        self.lineage.start_run(
            self.run_id,
            self.flow,
            self.deployment,
            self.recipe_name,
            self.setup.settings,
            attempt=self.attempt,
        )
        self.logger = get_run_logger()  # usable from the watchdog's and the signal's threads
        self.logger.info(
            f"run {self.run_id}: recipe {self.recipe_name!r}, workspace {self.ws.root}, "
            f"resolved recipe saved to {saved}"
        )
        survive_broken_console()
        quiet_console_streams()  # a print or progress bar into a dead parent's pipe fails nothing
        if runtime_flow_run.id:  # followed work stops with this run only when Prefect cancelled it
            set_cancel_probe(lambda: flow_run_cancelled(self.run_id))
        self._signals = stop_on_signals(self._signalled, self._deadline)
        self._signals.__enter__()
        owner = run_owner()
        if owner is not None:
            self.owner = owner
            watch_owner(owner, self._owner_died)
        if runtime_flow_run.id:  # last: once started, only __exit__ (or the deadline) closes it
            self.sentinel = self._start_sentinel(run_dir)
        return self

    def _start_sentinel(self, run_dir: Path) -> Sentinel | None:
        """The process that marks this run Crashed and its running steps stopped if this process
        dies without closing it (pipeline/sentinel.py); a run without one is only slower to be
        seen dead (the heartbeat automation), so a failure to start it fails nothing."""
        from prefect.settings import PREFECT_API_URL

        try:
            return Sentinel.start(
                self.run_id, self.attempt or 1, run_dir, self.ws.lineage_path, PREFECT_API_URL.value()
            )
        except OSError as exc:
            self.logger.warning(
                f"no sentinel for this run ({type(exc).__name__}: {exc}): if this process "
                "is killed, the run is marked Crashed only by the heartbeat automation"
            )
            return None

    def step_entered(self, node: Node) -> None:
        """Tell the sentinel a step's task runs (it may still wait for its slot)."""
        if self.sentinel is None:
            return
        from prefect.runtime import task_run

        row = {
            "run_id": self.run_id,
            "step": node.step.name,
            "label": node.label,
            "fingerprint": node.fingerprint,
            "config": _config_json(node),
            "code_version": f"{git_version()}/{node.step.code_version}",
            "attempt": self.attempt,
        }
        self.sentinel.entered(node.key, row, str(task_run.id) if task_run.id else None)

    def step_building(self, node: Node, started: datetime) -> None:
        if self.sentinel is not None:
            self.sentinel.building(node.key, started)

    def _owner_died(self, owner: ProcessRef) -> None:
        """The serve process died: stop the children, start no further step (pipeline/owner.py).
        Called once, by the watchdog or by the first step that failed with the death."""
        with self._owner_lock:
            if self.owner_gone is not None:
                return
            mute_console()  # nobody reads the console any more; the API keeps the log
            when = datetime.now(UTC).strftime("%H:%M:%S UTC")
            self.owner_gone = f"the serve process (pid {owner.pid}) that owns this run died at {when}"
        self.logger.error(
            f"{self.owner_gone}: stopping the steps that run and starting no new one; "
            f"`prefect flow-run retry {self.run_id}` resumes the run"
        )
        left = stop_followed("detach")  # cluster jobs keep training; `flow-run retry` re-attaches to them
        if left:
            self.logger.error(f"left {', '.join(left)} running; the retry re-attaches to them")
        stopped = stop_all(grace=5.0)
        if stopped:
            self.logger.error(f"stopped {len(stopped)} child process(es): " + "; ".join(stopped))

    def _signalled(self, name: str) -> None:
        """SIGTERM or SIGINT (pipeline/signals.py): kill the steps' children, start no new step."""
        self.cancelled = f"the run was cancelled by {name}"
        # Before the deadline can end the process: Ctrl-C or a confirmed Prefect cancellation
        # cancels the followed work (cluster jobs); any other SIGTERM leaves it for the retry.
        self._stop_followed(name == "SIGINT" or cancel_requested())
        stopped = stop_all(grace=2.0)
        self.logger.warning(
            f"{self.cancelled}: stopped {len(stopped)} child process(es)"
            + (": " + "; ".join(stopped) if stopped else "")
        )

    def _deadline(self, name: str) -> None:
        """Still running long after the signal (a step inside this process): record the end."""
        self.lineage.end_run(self.run_id, "cancelled", attempt=self.attempt)
        if self.sentinel is not None:  # the process exits on purpose: nothing for it to report
            self.sentinel.close()

    @property
    def stop_reason(self) -> str | None:
        """Why the run is stopping (its owner died, or a signal), or None while it runs on."""
        return self.owner_gone or self.cancelled

    def check_owner(self) -> None:
        if self.stop_reason is not None:
            raise OwnerGone(f"not started: {self.stop_reason}")

    def lost_owner(self, exc: BaseException) -> bool:
        """Whether the run has lost its owner, asked when a step fails: the watchdog may not have
        looked yet (a broken log pipe is often the first sign), so look now."""
        if self.owner_gone is None and self.owner is not None and owner_died_before(self.owner, exc):
            self._owner_died(self.owner)
        return self.owner_gone is not None

    def owner_crash(self) -> State:
        """The final state of a run that lost its serve process (see pipeline/owner.py)."""
        failed = [r for r in self.records if r.state == "failed"]
        stopped = sorted(f"{r.step}[{r.label}]" for r in failed if (r.error or "").startswith("stopped: "))
        earlier = sorted(f"{r.step}[{r.label}]" for r in failed if not (r.error or "").startswith("stopped: "))
        unstarted = [r for r in self.records if r.state == "skipped"]
        return Crashed(
            message=(
                f"{self.owner_gone}. Stopped while running: {', '.join(stopped) or 'none'}; "
                f"{len(unstarted)} step(s) not started"
                f"{'; failed before: ' + ', '.join(earlier) if earlier else ''}. "
                "Finished steps keep their outputs. Resume with "
                f"`prefect flow-run retry {self.run_id}` once a serve process runs again "
                "(`python -m flows.deployments`)."
            )
        )

    def __exit__(self, exc_type, exc, tb) -> None:
        from prefect.exceptions import CancelledRun, TerminationSignal

        if self._signals is not None:
            self._signals.__exit__(None, None, None)
        if self.owner_gone is not None:
            state = "crashed"
        elif self.cancelled is not None:
            state = "cancelled"
        elif exc_type is None:
            state = "completed"
        elif issubclass(exc_type, TerminationSignal | CancelledRun | KeyboardInterrupt):
            state = "cancelled"  # Prefect cancels a run with SIGTERM, raised as TerminationSignal
        else:
            state = "failed"
        if state == "cancelled" and self.cancelled is None:  # a signal's were decided in _signalled
            terminated = exc_type is not None and issubclass(exc_type, TerminationSignal)
            self._stop_followed(not terminated or cancel_requested())
        set_cancel_probe(None)
        self.lineage.end_run(self.run_id, state, attempt=self.attempt)
        if self.sentinel is not None:
            self.sentinel.close()

    def _stop_followed(self, explicit: bool) -> None:
        """Cancel the work this run's steps follow from worker threads that never see the
        cancellation (cluster jobs: infra/stop_hooks.py) when the run was really cancelled
        (`explicit`: Ctrl-C, or a SIGTERM that Prefect's API confirms as a cancellation). A
        SIGTERM from anything else (a host shutting down) leaves it running; the retry re-attaches."""
        if not explicit:
            left = stop_followed("detach")
            if left:
                self.logger.warning(
                    f"SIGTERM without a cancellation: left {', '.join(left)} running; a retry re-attaches"
                )
            return
        stopped = stop_followed("cancel")
        if stopped:
            self.logger.warning(f"run cancelled: cancelled {', '.join(stopped)}")

    def record(self, node: Node, state: str, started: datetime, ended: datetime, error: str | None = None) -> None:
        config = _config_json(node)
        row = StepRow(
            self.run_id,
            node.step.name,
            node.label,
            node.fingerprint,
            state,
            config,
            f"{git_version()}/{node.step.code_version}",
            started,
            ended,
            error,
            self.attempt,
        )
        with self._records_lock:
            self.records.append(row)
        self.lineage.record_step(row)
        if self.sentinel is not None:
            self.sentinel.ended(node.key)


def _config_json(node: Node) -> Any:
    return node.config.model_dump(mode="json") if hasattr(node.config, "model_dump") else node.config


# --- the Prefect task of a step --------------------------------------------------------------


@dataclass
class StepCache(CachePolicy):
    """Cache key = step fingerprint + step code version + workspace; stale (a fresh key, so
    Prefect misses and the step rebuilds) when the step folder is gone."""

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str | None:
        call: StepCall = inputs["call"]
        node = call.node
        key = f"{node.step.name}-{node.fingerprint[:20]}-{node.step.code_version}-{_ws_tag(call.ws)}"
        if (call.ws.results_dir / key).exists() and reusable_marker(call.folder, node.fingerprint) is None:
            return f"{key}-rebuild-{uuid.uuid4().hex[:8]}"
        return key


def _ws_tag(ws: Workspace) -> str:
    import hashlib

    return hashlib.sha256(ws.root.encode()).hexdigest()[:8]


_TASKS: dict[int, Any] = {}
_TASKS_LOCK = threading.Lock()


def prefect_task(d: StepDef):
    """The Prefect task that runs step `d` (one per step definition)."""
    with _TASKS_LOCK:
        if id(d) not in _TASKS:
            # Retries only for failures a second attempt can fix (pipeline.step.transient): the
            # attempt records its own lineage row, a resumable step continues its folder.
            @task(
                name=d.name,
                cache_policy=StepCache(),
                persist_result=True,
                result_serializer="json",
                retries=d.retries,
                retry_delay_seconds=d.retry_delay,
                retry_condition_fn=_retry_if_transient,
            )
            def run(call: StepCall, inputs: dict[str, Any], gates: list[Any]) -> Any:
                artifact = execute(call, inputs, gates)
                data = artifact.model_dump(mode="json")
                if call.node.key in call.ctx.reused:  # shown as reuse in the UI and `watch`, not as work
                    from prefect.states import Completed

                    return Completed(name="Cached", data=data, message="reused its finished folder")
                return data

            _TASKS[id(d)] = (d, run)
        return _TASKS[id(d)][1]


def _retry_if_transient(task, task_run, state) -> bool:
    """Prefect's retry condition: only a transient failure (IO, network, a killed trainer)."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return isinstance(exc, Exception) and not isinstance(exc, StepStopped) and transient(exc)


def _retrying(node: Node, exc: BaseException) -> tuple[int, float] | None:
    """This attempt's number and the delay before Prefect runs the step again (what
    `_retry_if_transient` will answer); None when it will not: the node's budget (Node.retries)
    is spent or the failure lasts."""
    from prefect.runtime import task_run

    attempt = task_run.run_count or 0  # 0 outside a task run
    if 0 < attempt <= node.attempts_after_failure and isinstance(exc, Exception) and transient(exc):
        return attempt, node.retry_delays()[attempt - 1]
    return None


def _artifact(value: Any) -> Artifact:
    return value if isinstance(value, Artifact) else Artifact(**value)


def execute(call: StepCall, raw_inputs: dict[str, Any], gates: Sequence[Any] = ()) -> Artifact:
    """Reuse the step's finished folder or build it under its slot; record it in lineage (its
    inputs and gates are its parents there, as they are in Prefect)."""
    logger = get_run_logger()
    node, d, ws = call.node, call.node.step, call.ws
    inputs = {
        name: tuple(_artifact(v) for v in value) if isinstance(value, list | tuple) else _artifact(value)
        for name, value in raw_inputs.items()
    }
    ctx = call.ctx
    started = [_now()]  # when the build began: after the slot was granted (waiting is not work)
    try:
        ctx.check_owner()
        ctx.step_entered(node)
        got = d.fingerprint(node.config, inputs, node.extra)
        if got != node.fingerprint:  # an input changed between planning and running
            raise RuntimeError(
                f"inputs resolved to fingerprint {got[:12]}, the graph planned {node.short}; rerun the flow"
            )
        if reusable_marker(call.folder, node.fingerprint) is not None and not call.refresh:
            outcome = run_step(
                root=ws.path,
                step=d.name,
                version=d.version,
                kind=d.kind,
                config=node.config,
                inputs=inputs,
                extra=node.extra,
                build=_unreachable,
                resumable=d.resumable,
            )
        else:
            resources = call.resources
            slot = d.resource
            threads = resources.threads(slot) if slot else None
            # A finished folder on the S3 mirror is fetched (verified) instead of rebuilt.
            fetch = None if d.resumable else fetcher(ws, d.name, d.version, logger.info)

            def build(out: Path) -> dict[str, Any]:
                ctx.check_owner()  # the run may have lost its owner while this step waited
                ctx.step_building(node, started[0])
                if d.isolate:
                    return _build_in_child(d, node, inputs, out, threads, logger.info)
                return _build_here(d, node, inputs, out, threads, logger.info)

            if slot:
                with hold(
                    ws.path / ".slots",
                    slot,
                    getattr(resources, slot).slots,
                    poll=resources.poll_seconds,
                    log=logger.info,
                    who=node.key,
                ):
                    started[0] = _now()
                    outcome = run_step(
                        root=ws.path,
                        step=d.name,
                        version=d.version,
                        kind=d.kind,
                        config=node.config,
                        inputs=inputs,
                        extra=node.extra,
                        build=build,
                        refresh=call.refresh,
                        resumable=d.resumable,
                        fetch=fetch,
                    )
            else:
                outcome = run_step(
                    root=ws.path,
                    step=d.name,
                    version=d.version,
                    kind=d.kind,
                    config=node.config,
                    inputs=inputs,
                    extra=node.extra,
                    build=build,
                    refresh=call.refresh,
                    resumable=d.resumable,
                    fetch=fetch,
                )
    except BaseException as exc:
        cause = _cause(exc)
        if isinstance(exc, OwnerGone):
            cause = str(exc)
            ctx.record(node, "skipped", started[0], _now(), cause)
        elif ctx.lost_owner(exc) or ctx.stop_reason is not None:  # owner died or run cancelled: no retry
            why = "its console pipe broke with it" if broken_pipe(exc) and ctx.owner_gone else cause
            cause = f"stopped: {ctx.stop_reason} ({why})"
            ctx.record(node, "failed", started[0], _now(), cause)
        elif (retry := _retrying(node, exc)) is not None:  # this attempt's own row; the next records its outcome
            attempt, delay = retry
            why = f"{cause} (attempt {attempt} of {node.attempts_after_failure + 1}; retrying in {delay:g}s)"
            ctx.record(node, "retried", started[0], _now(), why)
        else:
            ctx.record(node, "failed", started[0], _now(), cause)
        if isinstance(exc, Exception):
            if ctx.stop_reason is not None:
                raise StepStopped(f"{node.key} {cause}") from exc
            raise StepFailed(f"{node.key} failed: {cause}") from exc
        raise
    artifact = outcome.artifact
    verb = "built" if outcome.built else "fetched" if outcome.fetched else "reused finished"
    # A model's path is the folder `from_pretrained` loads (model_dir), not the step folder; any
    # other artifact's is its own folder (an evaluation's meta names the model it scored).
    where = (artifact.meta.get("model_dir") if artifact.kind == "hf_model" else None) or artifact.uri
    logger.info(f"{node.key} {verb} {artifact.kind} {artifact.short} at {where}")
    lineage = ws.lineage()
    # A folder fetched from the mirror publishes its facts (metrics, evals, ...) into a lineage
    # that has not seen it, as a built one does.
    publish = outcome.built or (outcome.fetched and lineage.artifact(artifact.fingerprint) is None)
    lineage.record_artifact(artifact, d.name, node.label, node.config, [*_flat(inputs), *(_artifact(g) for g in gates)])
    reused = not outcome.built and not outcome.fetched  # a finished folder Prefect's cache did not know
    if reused:
        ctx.reused.add(node.key)
    ctx.record(node, "cached" if reused else "completed", started[0], _now())
    if publish and d.publish is not None:
        d.publish(artifact, ws, node.label)
    if outcome.built and ws.storage is not None and ws.storage.s3_uri and not d.resumable:
        # Finished step folders go to S3 as they are built (marker last, checksums verified).
        # Resumable steps (training stages) mirror their checkpoints while they run instead.
        from infra.storage import mirror_artifact

        target = f"{ws.storage.s3_uri.rstrip('/')}/{d.name}"
        report = mirror_artifact(artifact.path, target, ws.storage)
        logger.info(f"{node.key} mirrored to {target}/{artifact.path.name} ({report})")
    return artifact


def _unreachable(out: Path) -> dict[str, Any]:
    raise RuntimeError(f"{out} lost its marker while being reused; rerun the flow")


def _flat(inputs: dict[str, Artifact | tuple[Artifact, ...]]) -> list[Artifact]:
    out: list[Artifact] = []
    for value in inputs.values():
        out += list(value) if isinstance(value, tuple) else [value]
    return out


def _cause(exc: BaseException) -> str:
    """One line (or a few) saying why a step failed, without the traceback."""
    sentence = getattr(exc, "cause", None)  # LaunchFailed: "rank 0 killed by SIGKILL after step 9 ..."
    if callable(sentence):
        sentence = sentence()
    text = str(sentence or exc).strip()
    if type(exc) is not RuntimeError:  # a plain RuntimeError carries a child's "Type: message"
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text[:2000] or type(exc).__name__


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _live(d: StepDef, node: Node) -> LiveStatus | None:
    """The build's progress artifact (percentage and latest progress line, pipeline/live.py), for
    builds that report progress."""
    if not d.wants_progress:
        return None
    import re

    return LiveStatus(node.key, re.sub(r"[^a-z0-9-]+", "-", f"{d.name}-{node.label}-progress".lower()))


# In-process evaluation (lm-eval) is not thread-safe and torch's thread count is per process: in
# one flow process, one in-process eval build at a time, whatever the eval slot count.
_IN_PROCESS_EVAL = threading.Lock()


def _build_here(d: StepDef, node: Node, inputs, out: Path, threads: int | None, log) -> dict[str, Any]:
    live = _live(d, node)
    progress = live.progress if live else None
    log = live.wrap(log) if live else log
    if d.resource != "eval":
        meta = d.run(node.config, inputs, out, log=log, progress=progress)
    else:
        with _IN_PROCESS_EVAL:
            _set_threads(threads)  # in-process torch work takes its slot's thread count
            meta = d.run(node.config, inputs, out, log=log, progress=progress)
    if live is not None:
        live.finish()
    return meta


def _build_in_child(d: StepDef, node: Node, inputs, out: Path, threads: int | None, log) -> dict[str, Any]:
    live = _live(d, node)
    progress = live.progress if live else None
    line = progress_lines(live.wrap(log) if live else log, progress)

    call = call_text(d, node.config, inputs, out)  # on the child's stdin; the file is a copy for people
    try:
        run_streaming(child_command(), line, cwd=REPO_ROOT, env=child_env(threads), stdin_text=call)
    except ChildFailed as exc:
        error = read_error(out)
        raise RuntimeError(error or f"child exited with code {exc.returncode}: " + "\n".join(exc.tail[-5:])) from None
    meta = read_result(out)
    if live is not None:
        live.finish()
    return meta


# --- running a graph -------------------------------------------------------------------------


def run_graph(graph: Graph, ctx: RunContext, refresh: Sequence[str] = ()) -> dict[str, Any] | State:
    """Submit every node as a Prefect future, wait for all, record their states; return a summary.

    Raises FlowFailed naming every failed step once every independent branch has finished; a run
    whose serve process died returns the `Crashed` state that says so (the flow's final state)."""
    unknown = sorted(set(refresh) - set(graph.steps))
    if unknown:
        raise ValueError(
            f"refresh names unknown step(s) {', '.join(unknown)}; steps of flow {graph.name!r}: "
            f"{', '.join(graph.steps)}"
        )
    ctx.ws.results_dir.mkdir(parents=True, exist_ok=True)
    storage = CheckedResults(basepath=str(ctx.ws.results_dir))  # reads back only our JSON Artifacts
    resources = ctx.setup.resources
    futures: dict[str, PrefectFuture] = {}
    node_of: dict[Any, Node] = {}
    for node in graph:
        inputs: dict[str, Any] = {}
        for name, value in node.inputs.items():
            refs = value if isinstance(value, tuple) else (value,)
            resolved = [futures[r.key] if isinstance(r, Node) else quote(r.artifact) for r in refs]
            inputs[name] = resolved if isinstance(value, tuple) else resolved[0]
        fresh = node.step.name in refresh
        call = StepCall(node, ctx, fresh, resources)
        task_ = prefect_task(node.step).with_options(
            task_run_name=node.key,
            refresh_cache=fresh or None,
            retries=node.attempts_after_failure,
            retry_delay_seconds=node.retry_delays() or 0,
        )
        # Set after `with_options`, which accepts only blocks saved on the server (so that another
        # process could load them): a step's result is read back by the flow process that runs it.
        task_.result_storage = storage
        future = task_.submit(call=quote(call), inputs=inputs, gates=[futures[g.key] for g in node.after])
        futures[node.key] = future
        node_of[future.task_run_id] = node
    artifacts: dict[str, Artifact] = {}
    failed: list[str] = []
    for future in as_completed(list(futures.values())):
        node = node_of[future.task_run_id]
        future.wait()  # sets the future's final state from the worker (the API's copy may lag)
        state = future.state
        if state.is_completed():
            artifacts[node.key] = _artifact(future.result())
            if state.name == "Cached" and node.key not in ctx.reused:  # a hit of Prefect's cache
                now = _now()
                ctx.record(node, "cached", now, now)
        elif state.is_failed() or state.is_crashed():
            failed.append(_message(future) or f"{node.key} failed")
        else:  # never ran: an input failed
            blocked = [p.key for p in node.parents() if p.key not in artifacts]
            now = _now()
            ctx.record(node, "skipped", now, now, f"upstream {', '.join(blocked)} did not finish")
    if failed and ctx.owner_gone is not None:
        summary(ctx, graph, artifacts)
        return ctx.owner_crash()
    if failed:
        raise FlowFailed(f"{len(failed)} step(s) failed:\n" + "\n".join(f"  {m}" for m in failed))
    return summary(ctx, graph, artifacts)


def _message(future: PrefectFuture) -> str | None:
    try:
        future.result(raise_on_failure=True)
    except StepFailed as exc:
        return str(exc)
    except BaseException as exc:  # noqa: BLE001 (a crash outside `execute`)
        return f"{type(exc).__name__}: {exc}"
    return None


def summary(ctx: RunContext, graph: Graph, artifacts: dict[str, Artifact]) -> dict[str, Any]:
    """Steps and states of this run, also published as a markdown artifact in the UI."""
    from prefect.artifacts import create_markdown_artifact

    order = {n.key: i for i, n in enumerate(graph)}
    records = sorted(ctx.records, key=lambda r: order.get(f"{r.step}[{r.label}]", 1 << 30))
    dropped = {
        key: {k: a.meta[k] for k in ("rejected", "removed", "heldout_removed", "unaccounted") if a.meta.get(k)}
        for key, a in artifacts.items()
    }
    dropped = {k: v for k, v in dropped.items() if v}
    rows = [
        f"| {r.step} | {r.label} | {r.state} | `{(r.fingerprint or '')[:12]}` | "
        f"{(r.ended - r.started).total_seconds():.1f} |"
        for r in records
    ]
    markdown = "\n".join(
        [
            f"# {ctx.flow} run `{ctx.run_id}`",
            f"Recipe `{ctx.recipe_name}`, workspace `{ctx.ws.root}`.",
            "",
            "| step | label | state | fingerprint | seconds |",
            "|---|---|---|---|---|",
            *rows,
            *(["", "## Dropped input", "", "| step | counts |", "|---|---|"] if dropped else []),
            *(f"| {k} | {v} |" for k, v in dropped.items()),
        ]
    )
    create_markdown_artifact(markdown=markdown, key=f"{ctx.flow}-summary", description="Steps and states")
    states: dict[str, int] = {}
    for r in records:
        states[r.state] = states.get(r.state, 0) + 1
    final = artifacts.get(graph.final.key) if graph.final is not None else None
    return {
        "run_id": ctx.run_id,
        "workspace": ctx.ws.root,
        "states": states,
        "final": final.model_dump(mode="json") if final else None,
        "dropped": dropped,
    }


def run_flow(flow: str, graph: Graph, setup: RunSetup, refresh: Sequence[str] = ()) -> dict[str, Any] | State:
    """The body every flow shares: open the run, run its graph, close the run (a served run that
    lost its serve process returns its `Crashed` state, which the flow returns)."""
    with RunContext(flow, setup) as ctx:
        return run_graph(graph, ctx, refresh)
