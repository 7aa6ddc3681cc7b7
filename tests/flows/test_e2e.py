"""End to end: the tiny DAG as a served deployment, a crash in stage 2, and `prefect flow-run retry`.

This is the test of what a user does: `prefect deployment run smollm3/full`, watch a stage fail,
retry the run from the CLI, and find the earlier steps Cached, stage 2 resumed from its last
checkpoint, eval scores for every stage and the final model's lineage reaching the raw sources.
It is also the suite's one whole tiny DAG with every stage (`_assert_what_the_run_shows`): branches
ran at once, the graph Prefect's UI draws is the lineage and the flow's graph, and the progress,
MFU, loss curve, eval table and final model a user reads. The chaos test runs two stages, the
flow tests of tests/flows/test_smollm3.py the data part.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.views import eval_table, final_artifact
from pipeline.lineage import Lineage
from tests.conftest import TINY_TRAIN, wait_for_deployment

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")


def _state(run_id: str) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id).state.type.value


def _wait_terminal(run_id: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _state(run_id)
        if state in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}:
            return state
        time.sleep(2)
    raise AssertionError(f"flow run {run_id} still {state} after {timeout}s")


def _message(run_id: str) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return str(client.read_flow_run(run_id).state.message)[:2000]


def _wait_leaves(run_id: str, state: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _state(run_id) == state:
        time.sleep(0.5)


def _ui_edges(run_id: str) -> set[tuple[str, str]]:
    """(parent, child) task-run names from Prefect's API `task_inputs` of a flow run (its
    attempts together: a retried run's task runs carry the same names)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.objects import TaskRunResult

    with get_client(sync_client=True) as client:
        runs: list = []
        for _ in range(60):  # task runs reach the API through events: wait until all are there
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
            if runs and all(r.state and r.state.is_final() for r in runs):
                break
            time.sleep(0.5)
    name = {r.id: r.name for r in runs}
    return {
        (name[i.id], r.name)
        for r in runs
        for inputs in r.task_inputs.values()
        for i in inputs
        if isinstance(i, TaskRunResult) and i.id in name
    }


def _lineage_edges(lineage: Lineage, run_id: str) -> set[tuple[str, str]]:
    """(parent, child) step names of the lineage `edges` between the steps of one run."""
    key = {s["fingerprint"]: f"{s['step']}[{s['label']}]" for s in lineage.steps_of(run_id)}
    return {(key[p], key[c]) for p, c in lineage.query("SELECT parent, child FROM edges") if p in key and c in key}


def _overlap(span: dict[str, tuple], a: str, b: str) -> bool:
    return span[a][0] < span[b][1] and span[b][0] < span[a][1]


@pytest.mark.slow
def test_served_run_fails_in_stage2_and_retry_resumes(tmp_path, private_api_url):
    api_url = private_api_url
    ws = tmp_path / "ws"
    env = {**os.environ, "PREFECT_API_URL": api_url, "SMOLLM3_INJECT_FAILURE": "stage2"}
    serve = subprocess.Popen(
        [sys.executable, "-m", "flows.deployments"],
        cwd=REPO,
        env=env,
        stdout=open(tmp_path / "serve.log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    watcher = None
    try:
        params = json.dumps({"recipe": "tiny", "overrides": [*TINY_TRAIN, f"workspace={ws}"]})
        wait_for_deployment("smollm3/full", timeout=90, serve=serve)  # serve has registered it
        res = subprocess.run(
            [PREFECT, "deployment", "run", "smollm3/full", "--params", params], env=env, capture_output=True, text=True
        )
        out = res.stdout
        assert res.returncode == 0, f"could not start smollm3/full: {out}\n{res.stderr}"
        run_id = next(ln.split("UUID:")[1].strip() for ln in out.splitlines() if "UUID:" in ln)

        assert _wait_terminal(run_id, 900) == "FAILED"
        lineage = Lineage(ws / "lineage.duckdb")
        first = lineage.steps_of(run_id)
        failed = [s for s in first if s["state"] == "failed"]
        assert [(s["step"], s["label"]) for s in failed] == [("pretrain", "stage2")]
        assert "injected failure" in failed[0]["error"]
        stage2_dir = ws / "pretrain" / failed[0]["fingerprint"][:12]
        assert list((stage2_dir / "checkpoints").glob("step_*")), "stage 2 left no checkpoint"

        subprocess.run([PREFECT, "flow-run", "retry", run_id], env=env, check=True, capture_output=True, text=True)
        # The retried run, live: `smollm3 watch` follows it to its end.
        watcher = subprocess.Popen(
            [str(Path(sys.executable).parent / "smollm3"), "watch", run_id[:8], "--poll", "1", "--every", "5"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        _wait_leaves(run_id, "FAILED", 120)  # the retry is scheduled before it runs
        final = _wait_terminal(run_id, 900)
        watched, _ = watcher.communicate(timeout=120)
        assert watcher.returncode == 0, watched[-3000:]
        assert watched.startswith("watching flow run ") and run_id in watched.splitlines()[0]
        assert " Cached " in watched and "pretrain[stage2]" in watched, watched[-3000:]
        # training lines of the stages that ran after the retry (stage2 resumed, stage3, long1, long2)
        assert re.search(r"\d% (stage[23]|long[12]) step \d+/\d+ \| loss [\d.]+ \|.* tok/s", watched), watched[-3000:]
        assert watched.rstrip().endswith("flow run Completed"), watched[-3000:]
        assert final == "COMPLETED", (
            f"retry ended {final}: {_message(run_id)}\nsteps after the retry: "
            f"{[(s['step'], s['label'], s['state'], s['error']) for s in lineage.steps_of(run_id)[len(first) :]]}"
        )

        retry = lineage.steps_of(run_id)[len(first) :]
        states = {f"{s['step']}[{s['label']}]": s["state"] for s in retry}
        before = [k for k in states if k.startswith(("source", "curate", "tokenize", "mixture"))]
        before += [
            "tokenizer[bpe]",
            "fertility[fertility]",
            "eval_suite[suite]",
            "pretrain[stage1]",
            "export[stage1]",
            "evaluate[stage1]",
        ]
        assert {k: states[k] for k in before} == {k: "cached" for k in before}
        assert states["pretrain[stage2]"] == "completed"
        for stage in ("stage3", "long1", "long2", "reasoning"):
            assert states[f"pretrain[{stage}]"] == "completed"
        (stage2,) = lineage.query_dicts("SELECT meta FROM artifacts WHERE step = 'pretrain' AND label = 'stage2'")
        meta = json.loads(stage2["meta"])
        assert meta["resumed"] is True and meta["steps"] == 2
        metrics = [json.loads(ln) for ln in (stage2_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2]  # resumed at step 2: step 1 not trained twice

        table = eval_table(lineage, run_id)
        for stage in ("stage1", "stage2", "stage3", "long1", "long2", "reasoning"):
            assert stage in table
        assert "passkey_100" in table
        # Every stage has its TensorBoard run, read back by TensorBoard: the loss as it trained,
        # the evaluation of its checkpoint at its last step.
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        # One folder per flow run, a sub-run per stage, the stages on one global step.
        end = 0
        for stage in ("stage1", "stage2", "stage3", "long1", "long2", "reasoning"):
            (run_dir,) = (ws / "tensorboard").glob(f"*/{stage}-*")
            board = EventAccumulator(str(run_dir))
            board.Reload()
            tags = board.Tags()["scalars"]
            assert "train/loss" in tags and any(t.startswith("eval/") for t in tags), (stage, tags)
            steps = [e.step for e in board.Scalars("train/loss")]
            assert steps[0] == end + 1, (stage, steps[:3], end)
            end = steps[-1]
            evals = {e.step for t in tags if t.startswith("eval/") for e in board.Scalars(t)}
            assert evals == {end}, (stage, evals)  # its checkpoint's scores at its last global step
        assert len({p.parent for p in (ws / "tensorboard").glob("*/*")}) == 1
        final = final_artifact(lineage, run_id)
        assert final["kind"] == "hf_model" and final["label"] == "reasoning"
        raw = {a["label"] for a in lineage.ancestors(final["fingerprint"]) if a["step"] == "source"}
        assert raw == {"prose", "code", "math"}
        _assert_what_the_run_shows(lineage, run_id, first, retry, ws)

        # After the served run, `smollm3 plan` from the console script in another cwd reuses
        # every step: the served deployment and the CLI compute the same fingerprints.
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        console = str(Path(sys.executable).parent / "smollm3")
        out = subprocess.run(
            [console, "plan", "tiny", *TINY_TRAIN, f"workspace={ws}"],
            cwd=elsewhere,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1].endswith(" 0 run, 45 reuse"), (
            out.stdout
        )  # 34 + the two YaRN evaluations + the reasoning stage's 5 (traces, mixture, pretrain, export,
        # evaluate) + the held-out index and the three sources' decontamination
    finally:
        if watcher is not None and watcher.poll() is None:  # a test failing while it watches
            watcher.kill()
            watcher.wait()
        os.killpg(serve.pid, 9)
        serve.wait()


def _assert_what_the_run_shows(lineage: Lineage, run_id: str, first: list[dict], retry: list[dict], ws: Path) -> None:
    """The whole tiny DAG as it ran (pretraining, export and evaluation per stage): independent
    branches overlapped in time (the three sources from raw in the first attempt, two at once in
    the `data` slots; the evaluation of stage 2 beside the training of stage 3 after the retry),
    every task run's inputs in the Prefect API equal the lineage edges and both equal the graph
    the flow built; and what a user reads of it."""
    from prefect.artifacts import Artifact as PrefectArtifact
    from transformers import AutoModelForCausalLM

    from flows.recipe import load_recipe
    from flows.smollm3 import graph
    from flows.views import summary
    from pipeline.live import parse

    def spans(rows: list[dict]) -> dict[str, tuple]:
        return {f"{s['step']}[{s['label']}]": (s["started"], s["ended"]) for s in rows}

    sources = ("source[prose]", "source[code]", "source[math]")
    built = spans(first)
    assert any(_overlap(built, a, b) for a in sources for b in sources if a < b), {k: built[k] for k in sources}
    after = spans(retry)
    assert _overlap(after, "evaluate[stage2]", "pretrain[stage3]"), (
        after["evaluate[stage2]"],
        after["pretrain[stage3]"],
    )

    expected = graph(load_recipe("tiny", [*TINY_TRAIN, f"workspace={ws}"])).edges()
    assert _lineage_edges(lineage, run_id) == expected
    assert _ui_edges(run_id) == expected

    # Progress artifacts end at 100%, each with the step's last progress line (what the demo
    # terminal showed while it ran); every stage's MFU is against this host's preflight
    # calibration and below 1 (evaluations ran beside training); one loss curve and one eval
    # table for the run, under stable keys.
    stages = ("stage1", "stage2", "stage3", "long1", "long2", "reasoning")
    for key in [*(f"pretrain-{s}-progress" for s in stages), *(f"evaluate-{s}-progress" for s in stages)]:
        assert PrefectArtifact.get(key).data == 100.0, key
    for s in stages:
        key, line = parse(PrefectArtifact.get(f"pretrain-{s}-progress").description)
        assert key == f"pretrain[{s}]" and re.match(rf"{s} step (\d+)/\1 \| loss [\d.]+ \| .* tok/s", line), line
        key, line = parse(PrefectArtifact.get(f"evaluate-{s}-progress").description)
        assert key == f"evaluate[{s}]" and line.startswith("lm-eval: ") and "items" in line, line
    for label, stage in lineage.labelled_outputs(run_id, "pretrain"):
        assert stage.meta["mfu_peak_source"].startswith("preflight "), (label, stage.meta["mfu_peak_source"])
        # On a loaded machine the calibration can fall below what training achieved: then no MFU is
        # reported and `mfu_invalid` says why (never a figure above 100%)
        mfu, invalid = stage.meta["mfu"], stage.meta["mfu_invalid"]
        assert (mfu is not None and 0 < mfu < 1 and not invalid) or (mfu is None and invalid), (label, mfu, invalid)
    # Reasoning mid-training: its mixture holds only the reasoning traces (ChatML, think mode)
    plans = dict(lineage.labelled_outputs(run_id, "mixture"))
    assert plans["reasoning"].meta["budgets"] == {"reasoning": 8192}
    (traces,) = [a for _, a in lineage.labelled_outputs(run_id, "reasoning_data")]
    assert traces.meta["documents"] == 24 == traces.meta["think_conversations"] and traces.meta["tokens"] > 0
    assert "data:image/png;base64," in PrefectArtifact.get("smollm3-loss-curve").data
    table = PrefectArtifact.get("smollm3-evals").data
    assert all(f"| {s} | " in table for s in stages) and "| *random* |" in table
    # long2 read at twice its length, plain RoPE and YaRN: two rows, scored on the long passkeys
    assert "| long2-x2 | " in table and "| long2-x2-yarn | " in table and "passkey_beyond_1300" in table
    beyond = {label: ev for label, ev in lineage.labelled_outputs(run_id, "evaluate") if "-x2" in label}
    assert {label: ev.meta["beyond"]["yarn"] for label, ev in beyond.items()} == {
        "long2-x2": False,
        "long2-x2-yarn": True,
    }
    assert all(set(ev.meta["scores"]) == {"passkey_beyond_1300"} for ev in beyond.values())
    # The model path the summary prints loads; lm-eval's own results sit beside every eval's scores.
    final = re.search(r"^final model:  (\S+)", summary(lineage, None), re.M).group(1)
    assert final.endswith("/model") and AutoModelForCausalLM.from_pretrained(final) is not None
    for _, ev in lineage.labelled_outputs(run_id, "evaluate"):
        assert (ev.path / "scores.json").is_file() and (ev.path / "lm_eval_results.json").is_file()
