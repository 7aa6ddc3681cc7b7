"""End to end: the tiny DAG as a served deployment, a crash in stage 2, and `prefect flow-run retry`.

This is the test of what a user does: `prefect deployment run smollm3/full`, watch a stage fail,
retry the run from the CLI, and find the earlier steps Cached, stage 2 resumed from its last
checkpoint, eval scores for every stage and the final model's lineage reaching the raw sources.
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
