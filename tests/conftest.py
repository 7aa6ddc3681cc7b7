"""Shared test fixtures: an isolated Prefect home, a temporary Prefect server, small recipes, and
finished tiny workspaces built once per session and copied into each test that needs one."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# Before Prefect is imported anywhere: never touch the user's ~/.prefect, never phone home.
_PREFECT_HOME = tempfile.mkdtemp(prefix="smollm3-test-prefect-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_TO_API_ENABLED"] = "false"
os.environ.pop("PREFECT_API_URL", None)
# A served deployment's runner (`python -m flows.deployments`, Prefect's `serve`) looks for new
# flow runs every PREFECT_RUNNER_POLL_FREQUENCY seconds, 10 by default: each run a test starts or
# retries waited up to that long to be picked up. The serve processes the tests start inherit this.
os.environ["PREFECT_RUNNER_POLL_FREQUENCY"] = "1"
# ...and never the user's ~/.cache/smollm3 (the preset checks' cache outside a workspace)
os.environ["SMOLLM3_CACHE"] = tempfile.mkdtemp(prefix="smollm3-test-cache-")

import pytest  # noqa: E402

# The one-node Slurm cluster, one per test session (pytest worker). Registered here, once: a
# session fixture imported into several test modules is a separate fixture in each, and each
# module started a cluster of its own that lived until the session ended (five at once).
from tests.infra.slurm_cluster import local_slurm  # noqa: E402, F401

REPO = Path(__file__).resolve().parents[1]

# Curation and tokenization in their step's own process, one datatrove task after another: at test
# sizes a pool of worker processes per datatrove stage costs more than the work (the data part of
# the tiny DAG: 179 s with the machine's 2 cores as workers, 73 s with 1, at load 9). `workers` is
# operational: the same folders, bytes and fingerprints whatever the count (tests/tasks/
# test_tokenize.py); tests/tasks/test_curate.py runs the data steps with worker processes.
SERIAL_DATA = ["curation.workers=1", "tokenize.workers=1"]

# Small overrides that keep the tiny recipe's sources fast in flow tests.
SMALL = [
    "sources.prose.max_documents=60",
    "sources.code.max_documents=20",
    "sources.math.max_documents=200",
    *SERIAL_DATA,
]


# The data part of the DAG only (no stages: the flow stops after the data steps).
DATA_ONLY = [*SMALL, "stages=[]"]

# The whole DAG at a size that trains in about a minute on 2 cores: every stage a few steps.
TINY_TRAIN = [
    "sources.prose.max_documents=200",
    "sources.code.max_documents=60",
    "sources.math.max_documents=400",
    *SERIAL_DATA,
    "stages.stage1.tokens=12288",
    "stages.stage2.tokens=8192",
    "stages.stage3.tokens=4096",
    "stages.long1.tokens=8192",
    "stages.long2.tokens=16384",
    "stages.reasoning.tokens=8192",  # two steps of 8 x 512 tokens (preflight wants one step of training.global_batch)
    "reasoning_data.reasoning.examples=24",
    "training.checkpoint_interval=1",
    "eval.items_per_task=20",
    "eval.passkey_items=5",
    "preflight.max_epochs=1000",
    "posttrain=null",  # the pretraining DAG only; post-training: tests/tasks/test_posttrain_*.py
]


@pytest.fixture(autouse=True)
def _log_streams_outlive_capture():
    """A logging handler created during a test that captures output (`capsys`) keeps that test's
    stream, closed once the test ends: Prefect's console handler, set up by the first flow run
    of a process, then fails every later run of the process with `I/O operation on closed file`
    (seen with `TEST_WORKERS=0`: the ablation flow's test, then the anneal flow's setup). After
    each test, a handler whose stream is closed writes to the current `sys.stderr` again."""
    yield
    import logging

    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for handler in {h for logger in loggers for h in logger.handlers}:
        if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
            handler.stream = sys.stderr  # not setStream: it flushes the closed stream first
            console = getattr(handler, "console", None)  # Prefect's rich console keeps its own file
            if console is not None:
                console.file = sys.stderr


# What the local datatrove workers of the suite's pipelines import (curation/executors.py
# `preload_workers`). A step's process preloads its own pipelines' modules; a pytest worker runs
# many tests' pipelines, and its fork server, started by the first pool, keeps the modules it
# started with, so a later test's workers imported theirs each (tests/tasks/test_reasoning_data.py:
# 2 CPU-s per worker for transformers' tokenizer). Named here, every pool forks with them.
WORKER_PRELOAD = [
    "datatrove.pipeline.readers",
    "datatrove.pipeline.writers",
    "datatrove.pipeline.filters",
    "datatrove.pipeline.dedup",
    "datatrove.pipeline.tokens",
    "curation.bpe_task",
    "curation.filters",
    "curation.heldout",
    "curation.ingest",
    "curation.io",
    "curation.minhash_cluster",
    "curation.reasoning_tasks",
    "transformers.models.auto.tokenization_auto",
    "spacy",  # the English word tokenizer of datatrove's filters (curation/executors.py)
    "spacy.lang.en",
]


def pytest_configure(config) -> None:
    from curation.executors import preload_workers

    preload_workers([], modules=WORKER_PRELOAD)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """The `xdist_group` marks, made to work under pytest 9. pytest-xdist's `--dist loadgroup`
    sends the tests of one group to one worker by a `@group` suffix it adds to their node ids on
    each worker; it assigns `item._nodeid`, which pytest 9's `item.nodeid` (built from `item._id`)
    no longer reads, so every group was spread over the workers (a Slurm cluster and a module's
    fixture built on each). The suffix is added here where xdist's did not take. Then the items
    are put in the order the workers should draw them (`heaviest_first`)."""
    if not getattr(config.option, "loadgroup", False):
        return  # not a worker of `--dist loadgroup`
    from _pytest.nodeid import coerce_node_id

    for item in items:
        groups = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        suffix = "@" + "_".join(groups)
        if groups and not item.nodeid.endswith(suffix):
            item._id = coerce_node_id(item.nodeid + suffix)
    items[:] = heaviest_first(items)


# Seconds the slowest tests take in a full `make test` (3 workers on 2 cores; most from CI's run of
# b330d60), for `heaviest_first`; a test not named here counts 30 s if marked `slow`, else 0.5 s.
# Refresh it from the suite's "slowest 25 durations" when they change.
EXPECTED_SECONDS = {
    "tests/flows/test_chaos.py::test_a_served_run_survives_kills_and_corruption_and_ends_bit_identical": 341,
    "tests/flows/test_e2e.py::test_served_run_fails_in_stage2_and_retry_resumes": 299,
    "tests/flows/test_anneal_flow.py::test_anneal_two_candidates_compares_against_the_baseline": 81,
    "tests/trainers/test_marathon.py::test_a_stage_survives_three_faults_in_one_run_within_its_retry_budget": 67,
    "tests/flows/test_ablation_flow.py::test_ablation_shares_data_trains_seeds_side_by_side_and_compares_with_noise": 118,
    "tests/flows/test_smollm3.py::test_caching_partial_rerun_refresh_and_rebuild": 52,
    "tests/tasks/test_posttrain_flow.py::test_posttrain_dag_scores_every_step_and_keeps_lineage": 125,
    "tests/flows/test_smollm3.py::test_finished_step_folders_are_mirrored_to_s3": 49,
    "tests/flows/test_admission.py::test_smollm3_run_without_a_server_starts_one_for_the_run_and_stops_it": 27,
    "tests/flows/test_planted_suite_run.py::test_a_planted_suite_payload_stays_inert_through_smollm3_run": 49,
    "tests/benchmarks/test_gpu_check.py::test_cpu_smoke_exits_0_and_prints_every_row": 101,
    "tests/infra/test_launchers_slurm.py::test_a_post_training_step_runs_on_slurm_through_accelerate": 49,
    "tests/curation/test_executors.py::test_tiny_data_steps_run_as_slurm_jobs_with_the_local_executors_output": 190,
    "tests/trainers/test_parallel.py::test_dp2_x_tp2_matches_dp4_resumes_bit_identically_and_loads_at_another_layout": 64,
    "tests/curation/test_executors.py::test_tiny_curation_runs_on_a_ray_head_with_token_auth_with_the_local_executors_output": 113,
    "tests/infra/test_slurm_resilience.py::test_only_a_prefect_cancellation_cancels_the_job_a_sigterm_leaves_it": 47,
    "tests/tasks/test_curate.py::test_data_flow_through_prefect_in_a_worker_thread": 111,
    "tests/model/test_attention.py::test_fused_qkv_under_tensor_parallelism_trains_like_three_matmuls": 11,
    "tests/benchmarks/test_data_scale.py::test_every_component_runs_at_tiny_sizes": 108,
    "tests/infra/test_preflight_cluster.py::test_preflight_runs_as_a_job_on_the_node_and_a_node_made_bad_is_excluded": 45,
    "tests/flows/test_orchestrator_death.py::test_killed_serve_and_flow_processes_are_seen_in_seconds_and_the_run_retries": 53,
    "tests/pipeline/test_lineage.py::test_four_processes_times_200_writes_lose_nothing": 43,
}


def _expected_seconds(item) -> float:
    name = item.nodeid.split("@")[0].split("[")[0]
    return EXPECTED_SECONDS.get(name, 30.0 if item.get_closest_marker("slow") else 0.5)


def heaviest_first(items: list) -> list:
    """`items` in the order pytest-xdist should hand them out: the heaviest block first, a block
    being an `xdist_group` (one worker runs it whole) or else a test module, weighed by the
    `EXPECTED_SECONDS` of its tests; the items of a block keep their order and stay together
    (a module-scoped fixture is built once per worker that runs the module's tests in a row).
    `--dist loadgroup --no-loadscope-reorder` (Makefile) hands out the tests in this order, so the
    longest runs (chaos, end to end: ten minutes each on 2 cores) start at once on their own
    workers instead of wherever the collection order puts them, possibly last, when they alone
    would keep the suite running after every other test has finished. Every worker sorts the same
    collection the same way: xdist requires the workers' collections to be identical."""

    def block(item) -> str:
        nodeid = item.nodeid
        if nodeid.rfind("@") > nodeid.rfind("]"):  # xdist's own reading of a group suffix
            return "@" + nodeid.split("@")[-1]
        return nodeid.split("::")[0]

    weight: dict[str, float] = {}
    for item in items:
        weight[block(item)] = weight.get(block(item), 0.0) + _expected_seconds(item)
    rank = {b: i for i, b in enumerate(sorted(weight, key=lambda b: -weight[b]))}  # stable: ties keep collection order
    return sorted(items, key=lambda item: rank[block(item)])


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect server (SQLite) shared by every test that runs flows."""
    from prefect.testing.utilities import prefect_test_harness

    from flows.api import drain_events

    with prefect_test_harness(server_startup_timeout=120):
        try:
            yield
        finally:
            # bounded: the harness's own drain has no timeout, and a worker retrying a stopped
            # server's address held a whole CI run at 98% until its limit
            drain_events(timeout=60)


@pytest.fixture
def api_url(prefect_harness) -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


@pytest.fixture
def private_api_url(tmp_path) -> str:
    """A Prefect server of this test's own (its own home and SQLite database), for tests that
    serve the project's deployments (`smollm3/full`, `anneal/nightly`): on the shared server a
    deployment registered by an earlier test on the same pytest worker (and its schedule) would
    meet this test's serve process. The test process's own Prefect client talks to it too."""
    from flows.api import embedded_api

    home = tmp_path / "prefect-home"
    home.mkdir()
    with embedded_api(home=str(home), log=lambda _: None) as url:  # events drained before it stops
        yield url


# Workspaces built once per session (`built_workspace`), by name: the overrides of the tiny recipe.
BUILDS: dict[str, list[str]] = {
    "data": DATA_ONLY,  # the data part of the tiny DAG: sources, curation, tokenizer, token shards
    # The same at TINY_TRAIN's sizes: the data steps the ablation and anneal flows' runs share
    "tiny-data": [*(o for o in TINY_TRAIN if o.startswith("sources.")), *SERIAL_DATA, "stages=[]"],
}
# What a build depends on besides its overrides: the project's code and data files and the recipes.
_BUILD_INPUTS = ("pipeline", "flows", "tasks", "curation", "evals", "trainers", "model", "infra", "configs", "mixtures")


def _code_fingerprint() -> str:
    """sha256 of every file the tiny DAG's outputs can depend on (the packages, configs/ and
    mixtures/, caches excluded) and of the interpreter: a build is reused only by the same code."""
    digest = hashlib.sha256(sys.version.encode())
    for top in _BUILD_INPUTS:
        for path in sorted((REPO / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `name`, made by `make(folder)` once for every worker of the test session, and
    the one way a session fixture shares an expensive build. Under pytest-xdist every worker is
    its own session: the folder lives in the one the workers share (pytest's numbered session
    folder), one worker makes it under a file lock while the others wait, then all reuse it. It
    is finished when its `BUILT` marker, written after `make` returns, exists; a folder left by a
    make that died midway is removed and made again. Callers treat it as read-only."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker makes it; the others wait, then reuse it
        if not (root / "BUILT").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            make(root)
            (root / "BUILT").write_text("")
    return root


@pytest.fixture(scope="session")
def built_workspace(tmp_path_factory, prefect_harness) -> Callable[[str], Path]:
    """`built_workspace(name)`: the finished workspace of one real run of the smollm3 flow on the
    tiny recipe with `BUILDS[name]`, built once per session (`build_once`) and never written to
    afterwards (copy it with `workspace_copy`). Its folder is named by the fingerprint of the
    code, the recipe and the overrides, so a build of other code is never reused."""
    code = _code_fingerprint()

    def build(name: str) -> Path:
        from flows.prefect_flows import smollm3

        overrides = BUILDS[name]
        key = hashlib.sha256(json.dumps([code, name, overrides]).encode()).hexdigest()[:16]

        def run(root: Path) -> None:
            result = smollm3(overrides=[*overrides, f"workspace={root / 'ws'}"])
            assert set(result["states"]) == {"completed"}, result
            (root / "run.json").write_text(json.dumps({"run_id": result["run_id"], "overrides": overrides}))

        return build_once(tmp_path_factory, f"built-{name}-{key}", run) / "ws"

    return build


@pytest.fixture
def workspace_copy(tmp_path, built_workspace) -> Callable[[str], Path]:
    """`workspace_copy(name)`: this test's own copy (`tmp_path / "ws"`) of the finished workspace
    `built_workspace(name)`. A workspace can move (pipeline/artifact.py): markers and lineage store
    paths relative to its root, so the copy's steps, lineage and markers name the copy, never the
    build. Prefect's cache key holds the workspace's path, so the first run in a copy reuses every
    finished folder by its marker (state `completed`, nothing built) and later runs hit Prefect's
    cache (`cached`), as in a workspace restored to another disk."""

    return lambda name: copy_workspace(built_workspace(name), tmp_path / "ws")


def wait_for_deployment(name: str, timeout: float = 120.0, serve=None) -> None:
    """Until the Prefect API (this process's PREFECT_API_URL) knows deployment `name`, which a
    serve process registers as it starts: asked in this process every 0.5 s. Tests then start the
    run with one `prefect deployment run`, as a user does; retried every second until serve had
    registered it, each try was a new process importing Prefect (seconds of CPU each). `serve`
    (the serve process's `Popen`): fail at once, with its exit code, if it has ended."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            try:
                client.read_deployment_by_name(name)
                return
            except ObjectNotFound:
                if serve is not None and serve.poll() is not None:
                    raise AssertionError(
                        f"deployment {name} not registered: serve exited with {serve.returncode}"
                    ) from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"deployment {name} not registered after {timeout:g} s") from None
            time.sleep(0.5)


def copy_workspace(built: Path, ws: Path) -> Path:
    """A copy of the finished workspace `built` at `ws` (which must not exist), links kept as
    links. Prefect's persisted results (`results/`) stay behind: their keys hold the build's path,
    so no run in the copy would read them."""
    shutil.copytree(built, ws, symlinks=True, ignore=lambda folder, _: ["results"] if Path(folder) == built else [])
    return ws
