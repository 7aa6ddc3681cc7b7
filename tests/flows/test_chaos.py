"""Chaos: a served tiny run survives a killed rank, a dead serve process, a SIGKILL of the flow and
serve processes together and a corrupted checkpoint, and ends with the weights of a run that was
never interrupted.

One served run (`python -m flows.deployments` + `prefect deployment run smollm3/full`, two stages
of 8 steps of a 2-layer model), faults at random moments (seeded; the seed, each choice and each
kill are logged to `chaos.log` and stdout; rerun one with `SMOLLM3_CHAOS_SEED=N`):

1. a training rank of stage 1 is SIGKILLed: the stage's attempt fails naming the rank and signal
   (its lineage row says `retried`), Prefect retries the step within the same run (a killed
   trainer is transient; `pretrain` retries once) and the trainer resumes from its checkpoint;
2. the serve process alone is SIGKILLed during stage 2: the run stops its children and ends
   Crashed saying the serve process (its owner) died and that `prefect flow-run retry` resumes it;
   stage 1 keeps its marker. A new serve process starts; the run is retried;
3. the serve process and the flow process are SIGKILLed together during stage 2: the guards end
   torchrun and its ranks, the run's sentinel marks it Crashed (pipeline/sentinel.py);
4. bytes are flipped in stage 2's newest checkpoint; after a new serve process and a retry the
   trainer skips that checkpoint (it fails verification) and resumes from the one before.

Then: the run is Completed, no process of the run is left (by command line under this test's
folder and by flow-run id), lineage has one row per step per attempt (and every step in the last
attempt), and the final checkpoint's tensors equal, bit for bit, those of the same recipe run
uninterrupted in another workspace (CPU training is deterministic; resume is exact). Both runs start
from copies of the session's data part (tests/conftest.py `built_workspace("data")`): the faults are
all in training, and the data steps from raw sources are the build's own run (and the end-to-end
test's, tests/flows/test_e2e.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from flows.recipe import load_recipe
from flows.smollm3 import graph
from model.checkpoint import load_model
from model.checkpoint import read_marker as checkpoint_complete
from pipeline.artifact import read_marker
from pipeline.lineage import Lineage
from tests.conftest import SMALL, copy_workspace, wait_for_deployment

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")
STEPS = 8  # per stage: room for a kill in stage 1 and two in stage 2, each after a checkpoint

# The tiny recipe at the smallest size that keeps every guarantee in play: two pretrain stages
# (a finished stage beside one in progress; the second initialised from the first), a 2-layer
# model, a checkpoint every step (keep 2, so a corrupted newest one has an older one to fall back
# to), small sources and evaluations.
CHAOS = [
    *SMALL,  # the sources of the session's `data` build, which the uninterrupted run copies
    "stages=[{name: stage1, mixture: mixtures/tiny/stage1.yaml, tokens: 16384, seq_len: 256},"
    " {name: stage2, mixture: mixtures/tiny/stage2.yaml, tokens: 16384, seq_len: 256}]",
    "training.model_overrides={num_layers: 2}",
    "training.global_batch=8",
    "training.micro_batch=8",
    "training.checkpoint_interval=1",
    "training.keep_last=2",
    # The retry after the killed rank starts 1 s after it, not 30 (the default backoff): a clock, not
    # what is tested (operational: no fingerprint or weight changes; the reference run has it too).
    "training.retry_backoff_s=1",
    "eval.items_per_task=5",
    "eval.passkey_lengths=[100]",
    "eval.passkey_items=2",
    "preflight.max_epochs=1000",
    "posttrain=null",
]


class Chaos:
    """The run under test: its serve process, its Prefect state, its stage folders, the log."""

    def __init__(self, tmp: Path, api_url: str, seed: int):
        self.tmp, self.ws = tmp, tmp / "ws"
        self.env = {
            **os.environ,
            "PREFECT_API_URL": api_url,
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
        }  # Prefect's minimum
        self.rng = random.Random(seed)
        self.logfile = tmp / "chaos.log"
        self.serve: subprocess.Popen | None = None
        self.serves = 0
        self.run_id = ""
        self.say(f"seed {seed} (rerun with SMOLLM3_CHAOS_SEED={seed}); load {os.getloadavg()}")

    def say(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {text}"
        print(line, flush=True)
        with open(self.logfile, "a") as fh:
            fh.write(line + "\n")

    # --- processes ------------------------------------------------------------------------

    def start_serve(self) -> None:
        self.serves += 1
        log = open(self.tmp / f"serve{self.serves}.log", "wb")
        self.serve = subprocess.Popen(
            [sys.executable, "-m", "flows.deployments"],
            cwd=REPO,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.say(f"serve process {self.serve.pid} started")

    def stop_serve(self) -> None:
        if self.serve is not None and self.serve.poll() is None:
            os.killpg(self.serve.pid, signal.SIGKILL)
        if self.serve is not None:
            self.serve.wait()

    def prefect(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([PREFECT, *args], env=self.env, capture_output=True, text=True, check=check, timeout=120)

    def flow_process(self) -> psutil.Process:
        """The flow-run process of this run (Prefect's runner starts it under serve)."""
        for child in psutil.Process(self.serve.pid).children(recursive=True):
            try:
                if child.environ().get("PREFECT__FLOW_RUN_ID") == self.run_id:
                    return child
            except psutil.Error:
                continue
        raise AssertionError(f"no flow-run process of {self.run_id} under serve {self.serve.pid}")

    def leftovers(self, folder: Path) -> list[str]:
        """Processes of the run: anything with `folder` in its command line (trainers, torchrun,
        guards, child steps) or the run's id in its environment (the flow-run process)."""
        found = []
        me = os.getpid()
        live_serve = self.serve.pid if self.serve and self.serve.poll() is None else None
        for p in psutil.process_iter(["pid", "cmdline"]):
            if p.info["pid"] in (me, live_serve):
                continue
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                mine = f"{folder}/" in cmd
                if not mine and "prefect.engine" in cmd:
                    mine = p.environ().get("PREFECT__FLOW_RUN_ID") == self.run_id
                if mine and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(f"{p.info['pid']}: {cmd[:160]}")
            except psutil.Error:
                continue
        return found

    def assert_no_leftovers(self, when: str, folder: Path | None = None, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while (left := self.leftovers(folder or self.ws)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"{when}: processes left over: {left}"
        self.say(f"{when}: no process of the run left")

    # --- the run --------------------------------------------------------------------------

    def deploy(self, ws: Path) -> str:
        params = json.dumps({"recipe": "tiny", "overrides": [*CHAOS, f"workspace={ws}"]})
        wait_for_deployment("smollm3/full", timeout=120, serve=self.serve)  # serve has registered it
        res = self.prefect("deployment", "run", "smollm3/full", "--params", params, check=False)
        assert res.returncode == 0, f"could not start smollm3/full: {res.stdout}\n{res.stderr}"
        return next(ln.split("UUID:")[1].strip() for ln in res.stdout.splitlines() if "UUID:" in ln)

    def state(self) -> tuple[str, str]:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(self.run_id).state
        return state.type.value, str(state.message or "")

    def wait_terminal(self, timeout: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state, message = self.state()
            if state in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}:
                self.say(f"run {state}: {message[:300]}")
                return state, message
            time.sleep(2)
        raise AssertionError(f"run {self.run_id} still {state} after {timeout}s")

    def retry(self) -> None:
        before, _ = self.state()
        self.prefect("flow-run", "retry", self.run_id)
        deadline = time.monotonic() + 120
        while self.state()[0] == before and time.monotonic() < deadline:
            time.sleep(0.5)  # scheduled, then picked up by serve
        self.say("retried")

    def stage_dir(self, stage: str, ws: Path | None = None) -> Path:
        for spec in sorted((ws or self.ws).glob("pretrain/*/spec.json")):
            try:
                if json.loads(spec.read_text())["stage"] == stage:
                    return spec.parent
            except ValueError:
                continue  # being rewritten by a new attempt of the step
        raise FileNotFoundError(stage)

    def wait_step(self, stage: str, step: int, since: float = 0.0, timeout: float = 600) -> None:
        """Until the stage has logged `step` (a metrics line written after `since`, epoch s). The
        metrics file is read every 50 ms (a kill lands right after the step it follows); the run's
        state, an API call (about 30 ms of this process's CPU and 7 ms of the server's, measured),
        once a second: asked every 50 ms it took a third of a core from the run under test."""
        deadline = time.monotonic() + timeout
        next_state = 0.0
        while time.monotonic() < deadline:
            try:
                lines = (self.stage_dir(stage) / "metrics.jsonl").read_text().splitlines()
            except (FileNotFoundError, OSError):
                lines = []
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec["step"] >= step and rec["time"] > since:
                    return
            if time.monotonic() >= next_state:
                state, message = self.state()
                assert state in {"RUNNING", "PENDING", "SCHEDULED"}, f"run ended {state}: {message}"
                next_state = time.monotonic() + 1.0
            time.sleep(0.05)
        raise AssertionError(f"{stage} did not reach step {step} in {timeout}s")

    def rank(self, stage: str) -> psutil.Process:
        """The training rank of a stage: the process running trainers.pretrain on its spec (one
        rank: the guard's child, no torchrun; infra/launchers/local.py), not the guard itself."""
        spec = str(self.stage_dir(stage) / "spec.json")
        for p in psutil.process_iter(["cmdline", "environ"]):
            cmd = p.info["cmdline"] or []
            if (
                "trainers.pretrain" in cmd
                and spec in cmd
                and "guard" not in cmd
                and "torch.distributed.run" not in cmd
                and (p.info["environ"] or {}).get("RANK") == "0"
            ):
                return p
        raise AssertionError(f"no rank of {stage} running")

    def jitter(self) -> float:
        return round(self.rng.uniform(0.0, 0.4), 3)


def _kill(proc: psutil.Process) -> None:
    proc.send_signal(signal.SIGKILL)


def _corrupt_newest_checkpoint(stage_dir: Path) -> tuple[Path, Path]:
    """Flip bytes in the newest complete checkpoint's shard (same size: only a digest notices)."""
    complete = [p for p in sorted((stage_dir / "checkpoints").glob("step_*")) if checkpoint_complete(p)]
    assert complete, f"{stage_dir} has no complete checkpoint to corrupt"
    shard = next(complete[-1].glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    shard.write_bytes(bytes(data))
    return complete[-1], shard


def _weights(stage_dir: Path) -> dict[str, torch.Tensor]:
    result = json.loads((stage_dir / "result.json").read_text())
    return load_model(result["checkpoint"]).state_dict()


@pytest.mark.slow
def test_a_served_run_survives_kills_and_corruption_and_ends_bit_identical(tmp_path, private_api_url, built_workspace):
    api_url = private_api_url
    # Both runs start from copies of the session's data part (tests/conftest.py: the same sources
    # at the same sizes, so the same data steps): they only train, export and score.
    data = built_workspace("data")
    ref_ws = copy_workspace(data, tmp_path / "reference")
    copy_workspace(data, tmp_path / "ws")
    seed = int(os.environ.get("SMOLLM3_CHAOS_SEED") or time.time_ns() % 100_000)
    c = Chaos(tmp_path, api_url, seed)
    k1 = c.rng.randint(1, STEPS - 3)  # stage 1 step after which a rank dies
    k2 = c.rng.randint(1, STEPS - 5)  # stage 2 step after which the serve process dies
    k3 = c.rng.randint(k2 + 2, STEPS - 2)  # ...and later, the serve and flow processes together
    c.say(
        f"plan: rank kill after stage1 step {k1}, serve kill after stage2 step {k2}, serve+flow "
        f"kill after stage2 step {k3}, then corrupt stage2's newest checkpoint"
    )
    reference = None
    started = time.monotonic()
    try:
        c.start_serve()
        c.run_id = c.deploy(c.ws)
        c.say(f"run {c.run_id}")

        # 1. a rank dies
        c.wait_step("stage1", k1)
        time.sleep(delay := c.jitter())
        rank = c.rank("stage1")
        killed_at = time.time()
        _kill(rank)
        c.say(f"SIGKILL rank {rank.pid} of stage1 ({delay}s after step {k1})")
        # the step is retried in the same run: a new trainer resumes and logs the next step
        c.wait_step("stage1", k1 + 1, since=killed_at, timeout=300)
        c.say("stage1 retried within the run and resumed")
        assert c.state()[0] == "RUNNING"

        # 2. the serve process dies alone; the run ends itself, saying why
        c.wait_step("stage2", k2)
        time.sleep(delay := c.jitter())
        flow = c.flow_process()
        dead_serve = c.serve.pid
        os.kill(dead_serve, signal.SIGKILL)
        c.say(f"SIGKILL serve {dead_serve} alone ({delay}s after stage2 step {k2}); flow {flow.pid} lives")
        c.serve.wait()
        state, message = c.wait_terminal(120)
        assert state == "CRASHED", message
        assert f"the serve process (pid {dead_serve}) that owns this run died" in message, message
        assert f"prefect flow-run retry {c.run_id}" in message, message
        _, alive = psutil.wait_procs([flow], timeout=30)
        assert not alive, f"flow process {flow.pid} outlived its run"
        c.assert_no_leftovers("after the serve process died")
        assert read_marker(c.stage_dir("stage1")) is not None, "finished stage 1 lost its marker"
        assert read_marker(c.stage_dir("stage2")) is None

        # 3. the serve and flow processes die together (systemctl stop, a lost node)
        c.start_serve()
        c.retry()
        since = time.time()
        c.wait_step("stage2", k3, since=since)
        time.sleep(delay := c.jitter())
        flow = c.flow_process()
        assert os.getpgid(flow.pid) == c.serve.pid, "the flow process is not in serve's group"
        os.killpg(c.serve.pid, signal.SIGKILL)
        c.say(f"SIGKILL serve {c.serve.pid} and flow {flow.pid} ({delay}s after stage2 step {k3})")
        c.serve.wait()
        c.assert_no_leftovers("after the serve and flow processes died")
        # The uninterrupted run, meanwhile
        reference = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", "tiny", *CHAOS, f"workspace={ref_ws}"],
            cwd=REPO,
            env=c.env,
            stdout=open(tmp_path / "reference.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        c.say(f"reference run started (pid {reference.pid}) in {ref_ws}")
        state, message = c.wait_terminal(400)
        assert state == "CRASHED" and "the flow-run process (pid" in message, message  # its sentinel

        # 4. the newest checkpoint of the interrupted stage is corrupted
        bad, shard = _corrupt_newest_checkpoint(c.stage_dir("stage2"))
        c.say(f"flipped 64 bytes in {shard.relative_to(tmp_path)}")
        c.start_serve()
        c.retry()
        state, message = c.wait_terminal(900)
        assert state == "COMPLETED", message
        stage2 = c.stage_dir("stage2")
        result = json.loads((stage2 / "result.json").read_text())
        assert result["resumed_from"] != str(bad), "resumed from the corrupted checkpoint"
        c.say(f"stage2 resumed from {result['resumed_from']}")
        c.assert_no_leftovers("after the run completed")  # the reference may still run

        # lineage: attempts, one row per step per attempt, every step in the last one
        lineage = Lineage(c.ws / "lineage.duckdb")
        attempts = [(a["attempt"], a["state"]) for a in lineage.attempts_of(c.run_id)]
        assert attempts == [(1, "crashed"), (2, "crashed"), (3, "completed")], attempts
        all_rows = lineage.steps_of(c.run_id)
        retried = [r for r in all_rows if r["state"] == "retried"]
        assert [(r["attempt"], r["step"], r["label"]) for r in retried] == [(1, "pretrain", "stage1")], retried
        assert "rank 0 killed by SIGKILL" in retried[0]["error"], retried[0]["error"]
        rows = [r for r in all_rows if r["state"] != "retried"]
        keys = [(r["attempt"], f"{r['step']}[{r['label']}]") for r in rows]
        assert len(keys) == len(set(keys)), f"a step recorded twice in one attempt: {keys}"
        assert {a for a, _ in keys} == {1, 2, 3}
        nodes = {n.key for n in graph(load_recipe("tiny", [*CHAOS, f"workspace={c.ws}"]))}
        last = {k: r["state"] for (a, k), r in zip(keys, rows, strict=True) if a == 3}
        assert set(last) == nodes and set(last.values()) <= {"completed", "cached"}, last
        stopped = [r for r in rows if r["attempt"] == 1 and r["state"] == "failed"]
        assert [f"{r['step']}[{r['label']}]" for r in stopped if r["step"] == "pretrain"] == ["pretrain[stage2]"], (
            stopped
        )
        assert all("stopped: the serve process" in r["error"] for r in stopped), stopped

        # the weights of a run never interrupted
        assert reference.wait(900) == 0, (tmp_path / "reference.log").read_text()[-3000:]
        c.say("reference run finished")
        c.assert_no_leftovers("after the reference run", folder=tmp_path)
        want, got = _weights(c.stage_dir("stage2", ref_ws)), _weights(stage2)
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), f"{name} differs from the uninterrupted run"
        losses = [
            [json.loads(ln)["loss"] for ln in (d / "metrics.jsonl").read_text().splitlines()]
            for d in (c.stage_dir("stage2", ref_ws), stage2)
        ]
        assert losses[0] == losses[1] and len(losses[0]) == STEPS
        c.say(
            f"final weights equal the uninterrupted run's, bit for bit; test took "
            f"{time.monotonic() - started:.0f}s; load {os.getloadavg()}"
        )
    finally:
        c.stop_serve()
        if reference is not None and reference.poll() is None:
            os.killpg(reference.pid, signal.SIGKILL)
            reference.wait()
