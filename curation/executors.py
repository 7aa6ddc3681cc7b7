"""Where datatrove pipelines run: one executor per stage (local processes, Slurm array jobs or
Ray), each depending on the previous one, and the settings of the cluster executors.

Shared by the source, curate and tokenize steps: `config` is any recipe section (or the source
step's spec, which copies curation's) with `executor`, `workers`, `slurm` and `ray`. The worker
count is operational (the output is the same whatever it is), and so is the executor and its
settings; the number of datatrove tasks is not (it sets the output shards) and is chosen by the step.

- Slurm: each stage is an sbatch array job. Its script puts the submitting interpreter's `bin/`
  first on PATH (or activates `slurm.venv_path`) and this checkout first on PYTHONPATH, so the
  jobs unpickle the pipeline with the code that built it (both on the cluster's shared file system).
- Ray: the step connects with `ray.init(address=ray.address)` before the first stage and
  disconnects after the last; each stage runs through `curation/ray_stage.py`'s loop (one Ray
  task per rank, a time limit with kill and rerun, failures named per task). A head with token
  authentication (Ray 2.5x and later: `RAY_AUTH_MODE=token`) is reached with `ray.auth: token`:
  the token is read from `ray.token_path`, else `RAY_AUTH_TOKEN` or `RAY_AUTH_TOKEN_PATH` of the
  step's environment, else `~/.ray/auth_token`; the recipe never holds the token itself. Ray enables token mode on its
  own only for a cluster it finds on this machine, never for an explicit address, so without
  `auth: token` a driver is refused by such a head.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

CODE_ROOT = Path(__file__).resolve().parent.parent  # the checkout the jobs import (curation/, tasks/)


class SlurmExecutorConfig(BaseModel):
    """Where curation runs on a Slurm cluster (datatrove SlurmPipelineExecutor parameters)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    partition: str  # Slurm partition to submit to
    time: str = "24:00:00"  # wall-clock limit of each array job
    cpus_per_task: int = Field(default=1, gt=0)  # CPUs per datatrove task
    mem_per_cpu_gb: int = Field(default=2, gt=0)  # memory per CPU
    qos: str = "normal"  # Slurm quality of service
    venv_path: str | None = None  # activate this virtualenv in the jobs (else the submitting env)
    sbatch_args: dict[str, str] = {}  # extra `#SBATCH` options, e.g. {"account": "lm"}
    poll_seconds: float = Field(default=60.0, ge=0.01)  # how often to check for finished tasks (a floor)


class RayExecutorConfig(BaseModel):
    """Where curation runs on a Ray cluster (datatrove RayPipelineExecutor parameters, and the
    cluster the step connects to)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # the cluster: its GCS address `host:6379` (the flow host joins as a driver) or a Ray Client
    # address `ray://host:10001`; None: Ray's own lookup (RAY_ADDRESS, else a cluster started on
    # this machine, else a new Ray instance on this machine, sized by its cores)
    address: str | None = None
    # "token": the head runs with RAY_AUTH_MODE=token (see the module docstring for where the
    # token is read from); "none": no authentication
    auth: Literal["none", "token"] = "none"
    token_path: str | None = None  # file holding the token (e.g. a mounted secret); never the token
    # Ray runtime_env of the driver's jobs, e.g. {"env_vars": {...}, "py_modules": [...]} where
    # the workers do not see this checkout on a shared file system
    runtime_env: dict[str, Any] = {}
    cpus_per_task: int = Field(default=1, gt=0)  # CPUs reserved per datatrove task
    mem_per_cpu_gb: float = Field(default=2.0, gt=0)  # memory reserved per CPU
    # a task still running after this long is killed and run again (as Slurm's `time` ends a job)
    time_limit_s: float = Field(default=24 * 3600.0, gt=0)
    retries: int = Field(default=3, ge=0)  # reruns of a task killed by its limit or lost with its worker


def machine_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and Slurm set)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def stage_workers(config, tasks: int) -> int:
    """Tasks of a stage run at once: `workers`, or (unset) this machine's cores for the local
    executor and every task for the cluster ones; never more than the stage's tasks."""
    workers = getattr(config, "workers", None)  # a one-task section (the tokenizer's) has none
    if workers is not None:
        return min(workers, tasks)
    return min(machine_cores(), tasks) if config.executor == "local" else tasks


_WORKER_MODULES: set[str] = {"datatrove.executor.local"}  # what the fork server imports (preload_workers)
_WORKER_MODULES_LOCK = threading.Lock()  # steps of an in-process flow build their executors in threads


def word_tokenizer_modules(step: Any) -> tuple[str, ...]:
    """What a datatrove step's word tokenizer imports when the step first splits a text: spaCy
    (`import spacy`: 2.2 CPU-s, measured on this project's 2-core machine) for the languages
    datatrove tokenizes with it, English among them. A step with a `language` (datatrove's
    Gopher, C4 and FineWeb filters, the MinHash signatures) splits words with
    `load_word_tokenizer(language)`; one whose language has no tokenizer, or another kind of
    tokenizer, names nothing (its worker imports what it needs, as before)."""
    language = getattr(step, "language", None)
    if language is None:
        return ()
    from datatrove.utils.word_tokenizers import SpaCyTokenizer, load_word_tokenizer

    try:
        tokenizer = load_word_tokenizer(language)
    except (ValueError, TypeError, ImportError):  # no tokenizer for it: the worker says so when it runs
        return ()
    if isinstance(tokenizer, SpaCyTokenizer):
        return ("spacy", f"spacy.lang.{tokenizer.language}")
    return ()


def preload_workers(pipelines: list[list], modules: Iterable[str] = ()) -> None:
    """Have the local executor's worker processes start with the pipelines' modules imported.

    datatrove's local executor runs a stage of more than one worker as a `multiprocess` pool
    started from a fork server, a process of its own started by the process's first pool; each
    worker forked from it imported datatrove, the steps' modules and what their `run` imports
    on its own: 0.5 s of CPU per worker, 2 s where a step renders with transformers' tokenizer
    or splits words with spaCy (`word_tokenizer_modules`), for a task of a few documents.
    Preloaded, the fork server imports them once and every worker is forked with them. A step names what its `run` imports late in `worker_imports`. The
    modules named by every call so far are preloaded, so a step that runs two executors one
    after the other names both pipelines before the first runs; once the server runs (a process's
    first pool) it keeps its modules, and a worker imports anything else itself, as before. A
    module that fails to import in the server is left to the worker (the fork server skips it).
    `modules`: more to preload (the test suite names what its many pipelines use)."""
    import multiprocess.forkserver as forkserver

    with _WORKER_MODULES_LOCK:
        _WORKER_MODULES.update(modules)
        for pipeline in pipelines:
            for step in pipeline:
                _WORKER_MODULES.add(getattr(step, "__module__", None) or type(step).__module__)
                _WORKER_MODULES.update(getattr(step, "worker_imports", ()))
                _WORKER_MODULES.update(word_tokenizer_modules(step))
        _WORKER_MODULES.discard("__main__")
        forkserver.set_forkserver_preload(["__main__", *sorted(_WORKER_MODULES)])


def make_executors(config: Any, stages: list[tuple[str, list, int]], logs: Path) -> list:
    """One datatrove executor per stage, each depending on the previous one. `config` is any
    section with `executor`, `workers`, `slurm` and `ray` (curation, tokenization)."""
    executors: list = []
    previous = None
    if config.executor == "local":
        preload_workers([pipeline for _, pipeline, _ in stages])
    for name, pipeline, tasks in stages:
        workers = stage_workers(config, tasks)
        logging_dir = str(logs / name)
        if config.executor == "local":
            from datatrove.executor import LocalPipelineExecutor

            ex = LocalPipelineExecutor(
                pipeline, tasks=tasks, workers=workers, logging_dir=logging_dir, depends=previous
            )
        elif config.executor == "slurm":
            from datatrove.executor import SlurmPipelineExecutor

            if config.slurm is None:
                section = {
                    "CurationConfig": "curation",
                    "SourceSpec": "curation",
                    "TokenizeConfig": "tokenize",
                    "ReasoningDataSpec": "tokenize",
                    "TokenizerConfig": "tokenizer",
                }.get(type(config).__name__, type(config).__name__)
                raise ValueError(
                    f"{section}.executor is slurm but {section}.slurm is not set; add a slurm section with at least partition"
                )
            s = config.slurm
            ex = SlurmPipelineExecutor(
                pipeline,
                tasks=tasks,
                workers=workers,
                time=s.time,
                partition=s.partition,
                cpus_per_task=s.cpus_per_task,
                mem_per_cpu_gb=s.mem_per_cpu_gb,
                qos=s.qos,
                venv_path=s.venv_path,
                sbatch_args=dict(s.sbatch_args),
                env_command=slurm_env_command(s.venv_path),
                job_name=f"curate-{name}",
                logging_dir=logging_dir,
                depends=previous,
            )
        else:
            from curation.ray_stage import RayStage

            ex = RayStage(
                pipeline,
                tasks=tasks,
                workers=workers,
                logging_dir=logging_dir,
                depends=previous,
                cpus_per_task=config.ray.cpus_per_task,
                mem_per_cpu_gb=config.ray.mem_per_cpu_gb,
                time=config.ray.time_limit_s,
                retries=config.ray.retries,
            )
        executors.append(ex)
        previous = ex
    return executors


def slurm_env_command(venv_path: str | None) -> str:
    """The sbatch script's environment line: the venv (`venv_path`, else the submitting
    interpreter's `bin/`, where datatrove's `launch_pickled_pipeline` is) and this checkout on
    PYTHONPATH, whatever environment the cluster's sbatch exports."""
    import shlex

    first = (
        f"source {shlex.quote(venv_path)}"
        if venv_path
        else f'export PATH={shlex.quote(str(Path(sys.executable).parent))}:"$PATH"'
    )
    return f'{first}; export PYTHONPATH={shlex.quote(str(CODE_ROOT))}"${{PYTHONPATH:+:$PYTHONPATH}}"'


def ray_auth_env(settings: RayExecutorConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment Ray's driver needs for `settings.auth`; a missing token is an error
    naming the fields that give one."""
    environ = os.environ if environ is None else environ
    if settings.auth == "none":
        return {}
    if settings.token_path is not None:
        path = Path(settings.token_path).expanduser()
        if not path.is_file() or not path.read_text(encoding="utf-8").strip():
            raise ValueError(
                f"ray.token_path {settings.token_path}: no such file, or it is empty; it must hold the Ray cluster's token"
            )
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}
    default = Path.home() / ".ray" / "auth_token"
    if not (environ.get("RAY_AUTH_TOKEN") or environ.get("RAY_AUTH_TOKEN_PATH") or default.is_file()):
        raise ValueError(
            "ray.auth is token but no token was found: set ray.token_path to a file holding it, or "
            f"RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) in the flow's environment, or write it to {default}"
        )
    return {"RAY_AUTH_MODE": "token"}


@contextmanager
def ray_connection(settings: RayExecutorConfig, log=print) -> Iterator[None]:
    """Connected to the recipe's Ray cluster while the block runs (`ray.init(address=...)`, then
    `ray.shutdown()`); a connection the caller already opened is used as it is."""
    import ray

    if ray.is_initialized():
        yield
        return
    env = ray_auth_env(settings)
    with ray_environment():
        os.environ.update(env)
        if env:  # Ray caches its config (the auth mode among it) per process: read the new mode
            _reload_ray_auth()
        where = settings.address or "Ray's default (RAY_ADDRESS, else this machine)"
        log(f"ray: connecting to {where}" + (" with token authentication" if env else ""))
        try:
            ray.init(
                address=settings.address,
                runtime_env=dict(settings.runtime_env) or None,
                log_to_driver=False,
                configure_logging=False,
            )
        except ConnectionError as exc:
            hint = "" if env else "; a head with token authentication needs ray.auth: token"
            raise ConnectionError(f"ray.address {settings.address}: {exc}{hint}") from exc
        try:
            yield
        finally:
            ray.shutdown()


@contextmanager
def ray_environment() -> Iterator[None]:
    """Ray's environment (`RAY_*`) as it was before the block, and Ray's cached auth settings
    read again if the block changed it: not only what a connection sets, since a local instance
    that `ray.init` starts turns token authentication on by itself and leaves
    RAY_AUTH_MODE=token behind."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("RAY_")}
    try:
        yield
    finally:
        changed = {k: v for k, v in os.environ.items() if k.startswith("RAY_")} != saved
        for key in [k for k in os.environ if k.startswith("RAY_")]:
            del os.environ[key]
        os.environ.update(saved)
        if changed:  # the mode this process had before, without the token it loaded
            _reload_ray_auth()


def _reload_ray_auth() -> None:
    """Make Ray read its auth mode and token again. It caches both per process: its config (the
    auth mode among it) and the token its loader read. Refreshing the config alone left the token
    of a cluster with token authentication cached, and a local Ray started later in the same
    process failed to start its GCS (`InvalidAuthToken`; seen in a serial `make test`). The same
    two calls, in this order, are what Ray's own tests do between clusters
    (`ray._private.authentication_test_utils.reset_auth_token_state`)."""
    import ray._raylet

    ray._raylet.Config.initialize("")
    loader = getattr(ray._raylet, "AuthenticationTokenLoader", None)  # Ray releases with token auth
    if loader is not None:
        loader.instance().reset_cache()


def run_executors(config: Any, executors: list, logs: Path, log=print) -> None:
    """Run the chain; the local executor runs in-process stage by stage, clusters are awaited."""
    if config.executor == "local":
        for ex in executors:
            ex.run()
        return
    if config.executor == "ray":
        with ray_connection(config.ray, log):
            for ex in executors:  # stage by stage: a stage with failed tasks stops the chain here
                ex.run(log)
        return
    executors[-1].run()  # launches its dependencies first (slurm: sbatch with afterok)
    from infra.launchers.slurm import wait_for_datatrove

    # polls the array jobs too: a failed stage raises (and cancels the chain) instead of
    # leaving its afterok dependents pending forever
    wait_for_datatrove(executors, config.slurm.poll_seconds if config.slurm else 60.0)
