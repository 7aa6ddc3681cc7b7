"""The flow runner: transient failures run again (each attempt its own lineage row), deterministic
ones fail at once, in the flow process and in a child process alike; a progress artifact ends at
100% when its step completes; the path it logs for a model is the folder `from_pretrained` loads."""

from __future__ import annotations

import errno
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from pydantic import BaseModel, ConfigDict

from flows.recipe import load_recipe, run_setup
from pipeline.graph import Graph
from pipeline.lineage import Lineage
from pipeline.named_runs import NamedTaskRunner
from pipeline.runner import FlowFailed, run_flow
from pipeline.step import step


class Flaky(BaseModel):
    """How a test step fails: `fail_times` attempts raise `error`, then it succeeds. Attempts are
    counted in `counter` (a file outside the step folder, which a failed attempt loses)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    counter: str
    fail_times: int
    error: str  # eio | enoent | value


def _attempt(config: Flaky) -> dict:
    counter = Path(config.counter)
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    if n <= config.fail_times:
        if config.error == "eio":
            raise OSError(errno.EIO, "Input/output error", "/mnt/flaky")
        if config.error == "enoent":
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/missing.jsonl")
        raise ValueError("sources.prose.uri: no files match (a config error)")
    return {"attempts": n}


@step("flaky_here", version=1, kind="report", retries=2, retry_delay=0)
def flaky_here(config: Flaky, *, out: Path, log=print) -> dict:
    return _attempt(config)


@step("flaky_child", version=1, kind="report", isolate=True, retries=1, retry_delay=0)
def flaky_child(config: Flaky, *, out: Path, log=print) -> dict:
    return _attempt(config)


def _run(tmp_path: Path, step_def, config: BaseModel, retries: int | None = None) -> tuple[Lineage, str, list[dict]]:
    ws = tmp_path / "ws"
    recipe = load_recipe("tiny", [f"workspace={ws}"])
    lineage = Lineage(ws / "lineage.duckdb")

    @flow(name="retry-test", task_runner=NamedTaskRunner())  # the project flows' runner
    def run() -> dict:
        g = Graph("retry-test")
        g.add(step_def, config, label="x", retries=retries)
        return run_flow("retry-test", g, run_setup(recipe, "tiny"))

    try:
        run()
    finally:
        run_id = lineage.runs(1)[0]["run_id"]
    return lineage, run_id, lineage.steps_of(run_id)


def test_transient_failure_in_the_flow_process_is_retried_with_a_row_per_attempt(tmp_path, prefect_harness):
    config = Flaky(counter=str(tmp_path / "n"), fail_times=2, error="eio")
    lineage, run_id, rows = _run(tmp_path, flaky_here, config)
    assert [r["state"] for r in rows] == ["retried", "retried", "completed"]
    assert "OSError" in rows[0]["error"] and "retrying" in rows[0]["error"]
    assert (tmp_path / "n").read_text() == "3"
    assert lineage.runs(1)[0]["state"] == "completed"


def test_deterministic_failure_is_not_retried(tmp_path, prefect_harness):
    config = Flaky(counter=str(tmp_path / "n"), fail_times=5, error="value")
    with pytest.raises(FlowFailed, match="flaky_here\\[x\\] failed: ValueError"):
        _run(tmp_path, flaky_here, config)
    rows = Lineage(tmp_path / "ws" / "lineage.duckdb").query_dicts("SELECT state, error FROM steps")
    assert [r["state"] for r in rows] == ["failed"]
    assert (tmp_path / "n").read_text() == "1"  # retries=2, yet one attempt


def test_a_missing_file_is_not_retried(tmp_path, prefect_harness):
    config = Flaky(counter=str(tmp_path / "n"), fail_times=5, error="enoent")
    with pytest.raises(FlowFailed, match="FileNotFoundError"):
        _run(tmp_path, flaky_here, config)
    assert (tmp_path / "n").read_text() == "1"


@pytest.mark.slow
def test_transient_failure_in_a_child_process_is_retried_once(tmp_path, prefect_harness):
    config = Flaky(counter=str(tmp_path / "n"), fail_times=1, error="eio")
    _, _, rows = _run(tmp_path, flaky_child, config)
    assert [r["state"] for r in rows] == ["retried", "completed"]
    assert rows[0]["error"].startswith("OSError: [Errno 5]")
    # still failing after its one retry: the step fails, with both attempts recorded
    config = Flaky(counter=str(tmp_path / "m"), fail_times=5, error="eio")
    with pytest.raises(FlowFailed, match="flaky_child\\[x\\] failed: OSError"):
        _run(tmp_path / "second", flaky_child, config)
    rows = Lineage(tmp_path / "second" / "ws" / "lineage.duckdb").query_dicts(
        "SELECT state FROM steps ORDER BY started"
    )
    assert [r["state"] for r in rows] == ["retried", "failed"]
    assert (tmp_path / "m").read_text() == "2"


class Stage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    counter: str
    exitcode: int  # how the first attempt's "trainer" ends: -9 (SIGKILL) or 3 (non-finite loss)


@step("stage_like", version=1, kind="checkpoint", resumable=True, retries=1, retry_delay=0)
def stage_like(config: Stage, *, out: Path, log=print) -> dict:
    """A training stage's contract: checkpoints in its folder, LaunchFailed when the job dies."""
    from infra.launchers.base import FailureFacts, LaunchFailed

    counter = Path(config.counter)
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    ckpt = out / "checkpoints" / "step_00000004"
    resumed = ckpt.exists()
    if n == 1:
        ckpt.mkdir(parents=True)
        signal = "SIGKILL" if config.exitcode == -9 else None
        facts = FailureFacts(rank=1, exitcode=config.exitcode, signal=signal, last_step=5, checkpoint_step=4)
        raise LaunchFailed("torchrun", facts=facts)
    return {"resumed_from_step": 4 if resumed else None}


def test_a_killed_training_stage_is_retried_once_and_resumes_from_its_checkpoint(tmp_path, prefect_harness):
    lineage, run_id, rows = _run(tmp_path, stage_like, Stage(counter=str(tmp_path / "n"), exitcode=-9))
    assert [r["state"] for r in rows] == ["retried", "completed"]
    assert "rank 1 killed by SIGKILL after step 5 (last checkpoint: step 4)" in rows[0]["error"]
    ((label, artifact),) = lineage.labelled_outputs(run_id, "stage_like")
    assert artifact.meta["resumed_from_step"] == 4


class Faults(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    counter: str


# How each of three launches ends before the fourth finishes: a rank killed (OOM killer,
# preemption), a hang ended by the watchdog, the scheduler's node failure.
FAULTS = [
    {"rank": 1, "exitcode": -9, "signal": "SIGKILL", "last_step": 5, "checkpoint_step": 4},
    {
        "rank": 0,
        "exitcode": 1,
        "hung": "rank 1 on node-b (no heartbeat for 300 s)",
        "last_step": 9,
        "checkpoint_step": 8,
    },
    {"rank": 0, "exitcode": 1, "state": "NODE_FAIL", "last_step": 13, "checkpoint_step": 12},
]


@step("stage_faults", version=1, kind="checkpoint", resumable=True, retries=1, retry_delay=0)
def stage_faults(config: Faults, *, out: Path, log=print) -> dict:
    from infra.launchers.base import FailureFacts, LaunchFailed

    counter = Path(config.counter)
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    if n <= len(FAULTS):
        raise LaunchFailed("torchrun", facts=FailureFacts(**FAULTS[n - 1]))
    return {"attempts": n}


def test_a_stage_survives_three_faults_within_its_recipe_budget_each_attempt_in_lineage(tmp_path, prefect_harness):
    """The recipe's `training.retries` (3 here) replaces the step's own budget (1): three
    different transient faults in one run, each attempt a lineage row naming its cause and
    attempt; the same faults with a budget of 1 fail the stage at the second."""
    lineage, run_id, rows = _run(tmp_path, stage_faults, Faults(counter=str(tmp_path / "n")), retries=3)
    assert [r["state"] for r in rows] == ["retried", "retried", "retried", "completed"]
    assert "killed by SIGKILL" in rows[0]["error"] and "(attempt 1 of 4; retrying in 0s)" in rows[0]["error"]
    assert "hung" in rows[1]["error"] and "attempt 2 of 4" in rows[1]["error"]
    assert "NODE_FAIL" in rows[2]["error"] and "attempt 3 of 4" in rows[2]["error"]
    assert lineage.runs(1)[0]["state"] == "completed"
    with pytest.raises(FlowFailed, match="stage_faults\\[x\\] failed"):
        _run(tmp_path / "one", stage_faults, Faults(counter=str(tmp_path / "m")))
    assert (tmp_path / "m").read_text() == "2"


def test_retry_delays_back_off_from_the_steps_delay():
    from pipeline.graph import Graph

    g = Graph("delays")
    node = g.add(stage_like, Stage(counter="/nonexistent", exitcode=-9), label="s", retries=7)
    assert node.retry_delays() == [0.0] * 7  # the step's delay is 0
    ours = step("backoff", version=1, kind="report", retries=1, retry_delay=30)(stage_like.build)
    delays = Graph("d").add(ours, Stage(counter="/x", exitcode=-9), label="s", retries=7).retry_delays()
    assert delays == [30, 60, 120, 240, 480, 900, 900]
    assert Graph("d").add(ours, Stage(counter="/x", exitcode=-9), label="s").retry_delays() == [30]
    # the recipe's backoff (training.retry_backoff_s, retry_backoff_max_s) replaces the step's
    mine = Graph("d").add(
        ours, Stage(counter="/x", exitcode=-9), label="s", retries=5, retry_delay=2, retry_delay_max=10
    )
    assert mine.retry_delays() == [2, 4, 8, 10, 10]
    with pytest.raises(ValueError, match="retry delays must be >= 0"):
        Graph("d").add(ours, Stage(counter="/x", exitcode=-9), label="s", retry_delay=-1)
    with pytest.raises(ValueError, match="retries must be >= 0"):
        Graph("d").add(ours, Stage(counter="/x", exitcode=-9), label="s", retries=-1)


def test_a_stage_stopped_on_a_non_finite_loss_is_not_retried(tmp_path, prefect_harness):
    with pytest.raises(FlowFailed, match="non-finite"):
        _run(tmp_path, stage_like, Stage(counter=str(tmp_path / "n"), exitcode=3))
    assert (tmp_path / "n").read_text() == "1"


class Steps(BaseModel):
    """How far the test step reports before it returns."""

    last_report: float


@step("stops_early", version=1, kind="report")
def stops_early(config: Steps, *, out: Path, log=print, progress=None) -> dict[str, Any]:
    progress(config.last_report)  # e.g. a watcher reporting in 10% steps, never the end
    return {"reported": config.last_report}


@step("stops_early_child", version=1, kind="report", isolate=True)
def stops_early_child(config: Steps, *, out: Path, log=print, progress=None) -> dict[str, Any]:
    progress(config.last_report)
    return {"reported": config.last_report}


@step("scores_a_model", version=1, kind="eval")
def scores_a_model(config: Steps, *, out: Path, log=print) -> dict[str, Any]:
    """An evaluation's meta, as `evaluate` writes it: it names the model it scored."""
    return {"model_dir": str(out.parent / "elsewhere" / "model"), "scores": {}}


@step("tiny_model", version=1, kind="hf_model")
def tiny_model(config: Steps, *, out: Path, log=print) -> dict[str, Any]:
    """A model step as export and post-training write them: the model in `out/model`."""
    from model.config import ModelConfig
    from model.hf import export_hf
    from model.model import SmolLM3

    model = SmolLM3(ModelConfig.tiny(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2))
    model.init_weights(seed=0)
    return {"model_dir": str(export_hf(model, out / "model"))}


def test_progress_ends_at_100_and_a_model_is_logged_at_its_loadable_path(tmp_path, prefect_harness):
    from prefect import flow
    from prefect.artifacts import Artifact as PrefectArtifact
    from transformers import AutoModelForCausalLM

    from flows.recipe import load_recipe
    from pipeline.graph import Graph
    from pipeline.runner import run_flow

    recipe = load_recipe("tiny", [f"workspace={tmp_path / 'ws'}"])

    @flow
    def progress_flow() -> dict:
        g = Graph("runner-test")
        g.add(stops_early, Steps(last_report=40.0), label="here")
        g.add(stops_early_child, Steps(last_report=92.5), label="child")
        g.add(tiny_model, Steps(last_report=0.0), label="model")
        g.add(scores_a_model, Steps(last_report=0.0), label="eval")
        return run_flow("runner-test", g, run_setup(recipe, "tiny"))

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("prefect.task_runs")
    logger.addHandler(handler)
    try:
        progress_flow()
    finally:
        logger.removeHandler(handler)
    for key in ("stops-early-here-progress", "stops-early-child-child-progress"):
        assert PrefectArtifact.get(key).data == 100.0, key
    [line] = [text for text in lines if "tiny_model[model] built hf_model" in text]
    path = re.search(r" at (\S+)$", line).group(1)
    assert Path(path).name == "model"
    assert AutoModelForCausalLM.from_pretrained(path) is not None
    # An evaluation is logged at its own folder, not at the model its meta names.
    [line] = [text for text in lines if "scores_a_model[eval] built eval" in text]
    folder = Path(re.search(r" at (\S+)$", line).group(1))
    assert folder.parent.name == "scores_a_model" and (folder / "_COMPLETE.json").is_file()
