"""A long run that watches itself: faults injected from outside the trainer, on CPU.

Every fault comes from outside the code under test: a rank (or a whole launch) frozen with SIGSTOP
by this process, a rank slowed by SIGSTOP/SIGCONT cycles, a token shard crafted with a spike or a
poisoned batch. Stages run through the pretrain step (local torchrun launcher,
its supervisor, lineage rows), as a flow runs them; what the step's retry would do is done by
calling it again, except in the three-fault test, where a flow run's own retries do it. The TensorBoard files are read back with TensorBoard's own reader.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from pydantic import BaseModel, ConfigDict

from infra.launchers.base import LaunchFailed
from model.checkpoint import load_model
from model.spec import TrainSpec
from model.token_shards import MixtureLoader, MixturePlan
from pipeline.artifact import Artifact
from pipeline.lineage import Lineage
from pipeline.step import step, transient
from tasks.pretrain import StageSpec, pretrain
from tests.model.conftest import write_two_source_plan
from tests.trainers.faults import Throttle

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
L, GB = 32, 4  # sequence length, global batch: one step = 128 tokens


def stage(plan: Path, nproc: int = 1, **fields) -> StageSpec:
    spec = {
        "stage": "stage1",
        "steps": 8,
        "global_batch": GB,
        "micro_batch": GB // nproc,
        "seq_len": L,
        "model_overrides": TINY,
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 2, "total_steps": fields.get("steps", 8)},
        "checkpoint_interval": 2,
        "keep_last": 50,
        "num_threads": 1,
        "device": "cpu",
        "peak_flops": 1e12,
    }
    for key, value in fields.items():
        spec[key] = {**spec[key], **value} if isinstance(spec.get(key), dict) and isinstance(value, dict) else value
    return StageSpec(spec=TrainSpec(**spec), nproc_per_node=nproc, threads=1)


def train_stage(run: StageSpec, plan: Path, out: Path, lines: list[str] | None = None) -> dict:
    mixture = Artifact(kind="mixture", uri=str(plan.parent), fingerprint="m" * 64, meta={})
    out.mkdir(parents=True, exist_ok=True)
    return pretrain(run, mixture=mixture, out=out, log=(lines if lines is not None else []).append)


def write_plan(folder: Path, *, spikes=(), poisoned=(), nan_token: int = 127, tokens: int = 12_000) -> Path:
    """One source of predictable documents (runs of consecutive ids, so the loss falls fast); the
    data of the steps in `spikes` replaced by random ids the model never sees elsewhere (a real
    loss spike), one token of each step in `poisoned` replaced by `nan_token`. With one source the
    k-th step trains on global sequences (k-1) x GB .. k x GB - 1, each the window the loader's
    seeded order gives it (`MixtureLoader.window`), so the plants go into those windows."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    flat: list[int] = []
    while len(flat) < tokens:
        start, n = int(rng.integers(1, 61)), int(rng.integers(20, 60))
        flat += [1 + (start + i) % 60 for i in range(n)] + [0]
    data = np.array(flat, dtype="<u2")
    path = folder / "000_text.ds"

    def save() -> None:
        data.tofile(path)
        ends = np.nonzero(data == 0)[0] + 1
        np.append(ends[ends < len(data)], len(data)).astype("<u8").tofile(str(path) + ".index")

    save()
    plan = {
        "stage": "stage1",
        "seed": 0,
        "seq_len": L,
        "tokens": tokens,
        "vocab_size": 128,
        "eos_id": 0,
        "token_dtype": "uint16",
        "sources": [{"name": "text", "weight": 1.0, "files": [str(path)], "available_tokens": len(data)}],
    }
    (folder / "plan.json").write_text(json.dumps(plan))
    loader = MixtureLoader(MixturePlan.load(folder / "plan.json"), seq_len=L)

    def windows(k: int) -> list[int]:  # the token offsets of step k's windows
        return [loader.window(0, j) * L for j in range((k - 1) * GB, k * GB)]

    for k in spikes:
        for a in windows(k):
            data[a : a + L + 1] = rng.integers(100, 127, L + 1)
    for k in poisoned:
        data[windows(k)[0] + 5] = nan_token
    save()  # the same length: the window order (it depends on the token count only) holds
    return folder / "plan.json"


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def events(out: Path) -> list[dict]:
    path = out / "monitor" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train_events(ws: Path) -> list[dict]:
    return Lineage(ws / "lineage.duckdb").query_dicts("SELECT * FROM train_events ORDER BY created")


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_model(a).state_dict(), load_model(b).state_dict()
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def wait_for_step(out: Path, step: int, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if metrics(out) and metrics(out)[-1]["step"] >= step:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"{out} did not reach step {step}")


def launch_tree(out: Path) -> tuple[psutil.Process, psutil.Process, list[psutil.Process]]:
    """(guard, torchrun, ranks by rank) of the stage's running launch."""
    guard = psutil.Process(int((out / ".trainer.pgid").read_text()))
    torchrun = guard.children()[0]
    ranks = sorted(torchrun.children(), key=lambda p: int(p.environ().get("RANK", 0)))
    return guard, torchrun, ranks


# --- 1. hangs -------------------------------------------------------------------------------


HANG_WATCH = {"floor_s": 3.0, "multiple": 10.0, "grace_s": 2.0, "heartbeat_s": 0.5, "startup_s": 120.0}


@pytest.mark.slow
def test_a_frozen_rank_is_detected_its_stacks_logged_and_the_retry_resumes_bit_identically(tmp_path):
    """Rank 1, its torchrun and the guard frozen with SIGSTOP after step 5 (as the issue did from
    outside): rank 0's watchdog, blocked in a collective, reports within its bound and prints its
    stacks; the pretrain step asks the frozen rank for its stacks, ends the frozen launch (torchrun
    cannot) and fails the attempt as hung and transient; the retry resumes from step 4 and ends
    with the weights and losses of an uninterrupted run, and TensorBoard shows each step once."""
    plan = write_two_source_plan(tmp_path / "plan")
    run = stage(plan, nproc=2, watchdog=HANG_WATCH)
    ws = tmp_path / "ws"
    clean = ws / "pretrain" / "clean0000000"
    train_stage(run, plan, clean)

    out = ws / "pretrain" / "frozen000000"
    lines: list[str] = []
    frozen: dict[str, float] = {}
    frozen_procs: list[psutil.Process] = []

    def freeze() -> None:
        wait_for_step(out, 5)
        guard, torchrun, ranks = launch_tree(out)
        for p in (guard, torchrun, ranks[1]):
            p.send_signal(signal.SIGSTOP)
        frozen["at"], frozen["step"] = time.time(), metrics(out)[-1]["step"]
        frozen_procs.extend([guard, torchrun, *ranks])

    freezer = threading.Thread(target=freeze, daemon=True)
    freezer.start()
    slow = stage(plan, nproc=2, watchdog=HANG_WATCH, debug_step_sleep_s=0.3)  # room to freeze mid-stage
    with pytest.raises(LaunchFailed) as failed:
        train_stage(slow, plan, out, lines)
    freezer.join()
    ended = time.time()
    err = failed.value
    assert transient(err), "a hung launch must be retried"
    assert err.facts.hung and str(err).count("hung: rank") == 1, str(err)[:500]

    reports = [json.loads(p.read_text()) for p in sorted((out / "monitor" / "hang").glob("*.json"))]
    # rank 0 reports (it waited in the collective), and names rank 1, whose heartbeat stopped, as frozen
    assert reports[0]["rank"] == 0 and reports[0]["host"] == socket.gethostname()
    assert [(f["rank"], f["host"]) for f in reports[0]["frozen"]] == [(1, socket.gethostname())]
    assert f"hung: rank 1 on {socket.gethostname()} frozen (heartbeat silent" in str(err)
    detected = reports[0]["time"] - frozen["at"]
    bound = HANG_WATCH["floor_s"]  # 10 x a ~0.1 s median step is below the floor
    # The last step completed at most a step (and its 0.3 s sleep) before the freeze.
    assert reports[0]["bound_s"] == bound and reports[0]["idle_s"] > bound and bound - 1.0 < detected < bound + 3.0
    assert ended - frozen["at"] < bound + HANG_WATCH["grace_s"] + 8.0  # the frozen launch was ended
    text = "\n".join(lines)
    assert f"hang watchdog: rank 1 on {socket.gethostname()} is frozen" in text
    assert "rank 0 on" in text and "waiting on it completed no step" in text
    assert text.count("(most recent call first)") >= 2 and "in _train" in text  # stacks of the main threads
    rows = [r for r in train_events(ws) if r["kind"] == "hung"]
    assert len(rows) == 1 and rows[0]["stage_dir"] == str(out) and rows[0]["rank"] == 1  # the frozen one
    assert rows[0]["message"].startswith(f"hung: rank 1 on {socket.gethostname()} frozen")
    assert not [p for p in frozen_procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    meta = train_stage(run, plan, out, lines)  # what the step's retry does
    assert meta["resumed"] and json.loads((out / "result.json").read_text())["resumed_from"].endswith("step_00000004")
    assert same_weights(clean / "checkpoints" / "step_00000008", out / "checkpoints" / "step_00000008")
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(clean)]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(meta["tracker_dir"])
    board.Reload()
    losses = board.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, 9)), "the lost steps must be purged, the redone ones shown"
    assert [e.value for e in losses] == pytest.approx([m["loss"] for m in metrics(out)], rel=1e-6)


@pytest.mark.slow
def test_a_launch_frozen_whole_is_ended_by_the_pretrain_step(tmp_path):
    """Everything frozen (rank, torchrun, guard): no watchdog can run, so the pretrain step's
    supervisor reads the stale heartbeat, writes the hang report itself and ends the launch."""
    plan = write_two_source_plan(tmp_path / "plan")
    out = tmp_path / "ws" / "pretrain" / "whole0000000"
    watch = HANG_WATCH
    frozen: dict[str, float] = {}

    def freeze() -> None:
        wait_for_step(out, 3)
        guard, torchrun, ranks = launch_tree(out)
        for p in (guard, torchrun, *ranks):
            p.send_signal(signal.SIGSTOP)
        frozen["at"] = time.time()

    freezer = threading.Thread(target=freeze, daemon=True)
    freezer.start()
    lines: list[str] = []
    with pytest.raises(LaunchFailed) as failed:
        train_stage(stage(plan, watchdog=watch, debug_step_sleep_s=0.3), plan, out, lines)
    freezer.join()
    assert transient(failed.value) and failed.value.facts.hung
    report = json.loads(next((out / "monitor" / "hang").glob("step-rank0.json")).read_text())
    assert report["by"].startswith("pretrain step")
    detected = report["time"] - frozen["at"]
    # The last step ended before the freeze: the bound plus the grace, give or take a sleep and a poll.
    assert watch["floor_s"] + watch["grace_s"] - 1.0 <= detected < watch["floor_s"] + watch["grace_s"] + 2.5
    assert "(most recent call first)" in "\n".join(lines)  # the continued rank printed its stacks


# --- 2. stragglers and throughput ---------------------------------------------------------

# a shared 2-core machine: the ranks' millisecond sections are noisy, name only a clear 2x
SLOWED_MONITOR = {
    "reference_skip": 2,
    "reference_steps": 8,
    "window": 10,
    "straggler_margin": 1.0,
    "straggler_min_share": 0.05,
}


@pytest.mark.slow
def test_a_slowed_rank_is_named_with_its_host_and_the_throughput_drop_with_its_first_step(tmp_path):
    """Rank 1 slowed from outside after step 12 (a CPU quota: 1 ms of every 8): rank 0 names rank 1
    and its host as a straggler (never rank 0 once it is slowed), and flags the fall of tokens/s
    below 70% of the reference of steps 3..10 (at the machine's pace) with the step where it began; lineage rows and
    task-log warnings.

    On a loaded machine the cores make stragglers and drops of their own before the throttle
    (a rank preempted for 10-20 ms in its 2 ms sections, a reference measured in a quiet
    moment): those flags are right and allowed, and a drop may then be dated before the throttle,
    but only to a step from which the rate was already below the threshold."""
    plan = write_two_source_plan(tmp_path / "plan")
    ws = tmp_path / "ws"
    out = ws / "pretrain" / "slow00000000"
    run = stage(
        plan,
        nproc=2,
        steps=40,
        checkpoint_interval=100,
        monitor=SLOWED_MONITOR,
        watchdog={"floor_s": 60.0},
    )
    throttle: dict[str, Any] = {}

    def slow_down() -> None:
        wait_for_step(out, 12)
        _, _, ranks = launch_tree(out)
        throttle["t"] = Throttle(ranks[1])
        throttle["step"] = metrics(out)[-1]["step"]

    helper = threading.Thread(target=slow_down, daemon=True)
    helper.start()
    lines: list[str] = []
    try:
        meta = train_stage(run, plan, out, lines)
    finally:
        helper.join()
        if "t" in throttle:
            throttle["t"].stop()
    flags = events(out)
    began = throttle["step"]
    rows = metrics(out)
    seen = [
        (
            m["step"],
            round(m["tokens_per_s"]),
            *(
                (round(1e3 * r["min_s"], 2), round(1e3 * r["max_s"], 2), r["slowest_rank"])
                if (r := m.get("rank_local"))
                else ()
            ),
        )
        for m in rows
    ]
    # a string, not a tuple: pytest cuts the repr of a tuple message to a few hundred characters
    why = "\n".join(
        [f"throttle: {throttle['t'].how}, after step {began}", "flags:"]
        + [json.dumps(e) for e in flags]
        + ["(step, tokens/s, own work ms/step: fastest rank's, slowest rank's, slowest rank):"]
        + [str(row) for row in seen]
    )
    stragglers = [e for e in flags if e["kind"] == "straggler"]
    rank1 = [e for e in flags if e["kind"] in ("straggler", "straggler_cleared") and e["rank"] == 1]
    named = [e for e in rank1 if e["kind"] == "straggler" and e["step"] > began]
    before = [e for e in rank1 if e["step"] <= began]  # named by the load's own noise, not cleared
    assert named or (before and before[-1]["kind"] == "straggler"), why
    assert all(e["host"] == socket.gethostname() for e in rank1), why
    assert not [e for e in stragglers if e["rank"] == 0 and e["step"] > began], why
    if not [e for e in stragglers if e["step"] <= began]:  # the cores made no straggler of their own
        assert stragglers[0]["rank"] == 1 and stragglers[0]["step"] > began, why
    drops = [e for e in flags if e["kind"] == "throughput_drop"]
    assert drops, why

    def rate(first: int, last: int) -> float:
        """Tokens/s of the steps first..last taken together (tokens over seconds; one step's
        tokens each)."""
        steps = [m for m in rows if first <= m["step"] <= last]
        return len(steps) / sum(1 / m["tokens_per_s"] for m in steps)

    # The throttle starts while the step after the one seen is under way, and the drop is dated
    # within 3 steps of it. An earlier date is the load's own fall: the lines from it to the
    # throttle are below the threshold taken together. A later one is a throttle that did not yet
    # show on a loaded machine (its cores already shared out): the lines from the throttle to
    # that date are not below the threshold taken together (seen once in a full `make test`: a
    # drop dated 5 steps after the throttle). (On a loaded machine the throttled rate can recover
    # and fall again: a second flag is then right too.)
    if drops[0]["began_at"] < began - 1:
        assert rate(drops[0]["began_at"], began) < drops[0]["threshold"], why
    if drops[0]["began_at"] > began + 3:
        assert rate(began + 1, drops[0]["began_at"] - 1) >= drops[0]["threshold"], why
    reference = next(e for e in flags if e["kind"] == "throughput_reference")
    # 70% of the launch's reference at the machine's pace (1: as fast as while it was measured)
    assert reference["step"] <= 12 and 0 < drops[0]["pace"] <= 1
    assert drops[0]["threshold"] == pytest.approx(0.7 * reference["value"] * drops[0]["pace"])
    text = "\n".join(lines)
    assert f"WARNING: stage1: straggler: rank 1 on {socket.gethostname()}" in text
    assert "WARNING: stage1: throughput drop:" in text and f"since step {drops[0]['began_at']}" in text
    recorded = {(r["kind"], r["rank"]) for r in train_events(ws)}
    assert ("straggler", 1) in recorded and ("throughput_drop", None) in recorded
    assert meta["flags"]["straggler"] == len(stragglers) and meta["flags"]["throughput_drop"] == len(drops)
    detection = {e["kind"]: e["time"] - throttle["t"].started_at for e in ((named or before)[-1], drops[0])}
    print(f"detection after the throttle began: {detection}")


@pytest.mark.slow
def test_an_uninterrupted_stage_on_a_machine_loaded_from_outside_flags_nothing(tmp_path):
    """No fault, but four processes spinning on the machine's cores for the whole stage (a
    machine loaded from outside: at least four runnable beside the two ranks): the stage, with
    the slowed-rank test's monitor settings and the frozen-rank test's 3 s hang floor, raises no
    flag (no hung, straggler or throughput drop), in its events, its lineage or its meta. Its
    ranks are preempted in their own sections and their steps slowed unevenly (the rules judge
    each rank's own work net of the CPU waits others caused: its mean over the window, counted
    only when it was slow on 30% of the window's lines, three judgements in a row; throughput
    at the machine's pace), and they end, slowly, without their teardown counting as silence."""
    plan = write_two_source_plan(tmp_path / "plan")
    ws = tmp_path / "ws"
    out = ws / "pretrain" / "loaded000000"
    run = stage(plan, nproc=2, steps=40, checkpoint_interval=20, monitor=SLOWED_MONITOR, watchdog=HANG_WATCH)
    spinners = [psutil.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    runnable: list[int] = []
    done = threading.Event()

    def sample() -> None:  # the kernel's count of runnable tasks (/proc/loadavg's fourth field)
        while not done.wait(0.5):
            runnable.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        meta = train_stage(run, plan, out)
    finally:
        done.set()
        sampler.join()
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    load = os.getloadavg()
    print(f"runnable tasks during the stage: median {statistics.median(runnable)}; load average {load}")
    assert statistics.median(runnable) >= 4, runnable
    flags = [e for e in events(out) if e["kind"] != "throughput_reference"]
    assert flags == [] and meta["flags"] == {} and train_events(ws) == [], (load, flags)
    assert [e["kind"] for e in events(out)] == ["throughput_reference"]  # the rules ran: a reference was measured


# --- 3. loss spikes and non-finite losses -------------------------------------------------


@pytest.mark.slow
def test_a_planted_spike_is_not_applied_and_a_resumed_stage_skips_the_same_step(tmp_path):
    """Step 16's data is random ids never seen elsewhere: its loss and gradient norm jump. With
    the skip-step rule the step is not applied (the weights after it equal those before it), it is
    counted in the metrics, the result and the lineage; without the rule it is applied. A stage
    stopped at step 12 and resumed skips the same step and ends with the same weights."""
    plan = write_plan(tmp_path / "plan", spikes=[16])
    ws = tmp_path / "ws"
    rule = {"window": 8, "sigma": 4.0, "min_history": 8}
    out = ws / "pretrain" / "spike0000000"
    meta = train_stage(stage(plan, steps=20, checkpoint_interval=1, skip_spikes=rule), plan, out)
    rows = metrics(out)
    assert [m["step"] for m in rows if m["skipped"]] == [16]
    assert [m["skipped_steps"] for m in rows] == [0] * 15 + [1] * 5
    assert meta["skipped_steps"] == 1 and meta["flags"] == {"skipped_step": 1}
    ckpt = out / "checkpoints"
    assert same_weights(ckpt / "step_00000015", ckpt / "step_00000016")
    assert not same_weights(ckpt / "step_00000016", ckpt / "step_00000017")
    assert [(r["kind"], r["step"]) for r in train_events(ws)] == [("skipped_step", 16)]

    plain = ws / "pretrain" / "plain0000000"
    train_stage(stage(plan, steps=20, checkpoint_interval=100), plan, plain)
    assert not any(m["skipped"] for m in metrics(plain)) and metrics(plain)[-1]["skipped_steps"] == 0
    spike = metrics(plain)[15]
    assert (
        spike["loss"] > 1.3 * metrics(plain)[14]["loss"] and spike["grad_norm"] > 1.8 * metrics(plain)[14]["grad_norm"]
    )
    assert not same_weights(plain / "checkpoints" / "step_00000020", ckpt / "step_00000020")

    resumed = ws / "pretrain" / "resumed00000"
    train_stage(
        stage(plan, steps=12, checkpoint_interval=100, skip_spikes=rule, schedule={"total_steps": 20}), plan, resumed
    )
    train_stage(stage(plan, steps=20, checkpoint_interval=100, skip_spikes=rule), plan, resumed)
    assert [m["step"] for m in metrics(resumed) if m["skipped"]] == [16]
    assert same_weights(ckpt / "step_00000020", resumed / "checkpoints" / "step_00000020")


@pytest.mark.slow
def test_after_a_nan_the_stage_rolls_back_and_skips_the_data_that_caused_it(tmp_path):
    """A token planted in the data of steps 5 and 7 makes their loss NaN (the trainer's debug
    hook turns the crafted shard into a NaN batch). The first NaN rolls the stage back to the
    checkpoint of step 4 and skips the data of step 5; the relaunch then meets the second at its
    step 6 (the data of the first attempt's step 7), rolls back to step 4 again and skips what it
    trained since. The stage ends with both windows skipped, never having trained on the planted
    token (it would be NaN); each NaN, rollback and skip is a lineage row."""
    plan = write_plan(tmp_path / "plan", poisoned=[5, 7])
    ws = tmp_path / "ws"
    out = ws / "pretrain" / "nan000000000"
    lines: list[str] = []
    meta = train_stage(stage(plan, steps=8, debug_nan_token=127), plan, out, lines)
    windows = [(w["from"], w["to"], w["failed_step"], w["checkpoint_step"]) for w in meta["skipped_data"]]
    # step 5's data is sequences 16..20; after skipping it, step 6 trains on old step 7's (24..28)
    assert windows == [(16, 20, 5, 4), (20, 28, 6, 4)], windows
    state = json.loads((out / "checkpoints" / "step_00000008" / "trainer_state.json").read_text())
    assert state["loader"]["sequence"] == (8 + 3) * GB  # 8 steps trained, 3 steps' data skipped
    assert all(np.isfinite(m["loss"]) for m in metrics(out))
    kinds = [(r["kind"], r["step"]) for r in train_events(ws)]
    assert kinds.count(("nonfinite", 5)) == 1 and kinds.count(("rollback", 5)) == 1
    assert ("data_skipped", 5) in kinds and ("rollback", 6) in kinds
    assert sum("rolling back to the checkpoint of step 4" in line for line in lines) == 2


def test_the_rollbacks_are_bounded(tmp_path):
    """`nonfinite.retries: 0`: the first NaN fails the stage (not transient), nothing is skipped."""
    plan = write_plan(tmp_path / "plan", poisoned=[3])
    out = tmp_path / "ws" / "pretrain" / "bounded00000"
    lines: list[str] = []
    with pytest.raises(LaunchFailed) as failed:
        train_stage(stage(plan, steps=6, debug_nan_token=127, nonfinite={"retries": 0}), plan, out, lines)
    assert failed.value.facts.exitcode == 3 and not transient(failed.value)
    assert "0 data window(s) skipped already" in "\n".join(lines)
    assert not (out / "monitor" / "skip.json").exists()


# --- 4. trackers ----------------------------------------------------------------------------


@pytest.mark.slow
def test_tensorboard_files_are_written_live_and_read_back_by_tensorboard(tmp_path):
    """Rank 0's event files, read with TensorBoard's own reader while the stage still trains, then
    after it: loss, LR, gradient norm, tokens/s, MFU, memory and skipped steps at every line; the
    evaluation of the checkpoint adds its scores at the stage's last step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainers.tracker import log_scores

    plan = write_two_source_plan(tmp_path / "plan")
    ws = tmp_path / "ws"
    out = ws / "pretrain" / "board0000000"
    seen: dict[str, list[int]] = {}

    def read_live() -> None:
        wait_for_step(out, 6)  # metrics.jsonl is written before the tracker's line of a step
        folder = ws / "tensorboard" / "stage1-board0000000"
        board = EventAccumulator(str(folder))
        board.Reload()
        seen["live"] = [e.step for e in board.Scalars("train/loss")]

    reader = threading.Thread(target=read_live, daemon=True)
    reader.start()
    meta = train_stage(stage(plan, steps=12, debug_step_sleep_s=0.2), plan, out)
    reader.join()
    assert meta["tracker_dir"] == str(ws / "tensorboard" / "stage1-board0000000")
    assert 4 <= len(seen["live"]) < 12, seen  # read mid-stage: the curve is live
    log_scores(out, 12, {"prose_cloze": {"acc_norm": 0.375, "acc_norm_stderr": 0.05}})
    board = EventAccumulator(meta["tracker_dir"])
    board.Reload()
    tags = set(board.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/grad_norm", "train/skipped_steps", "perf/tokens_per_s", "perf/mfu"}
    assert expected | {"memory/rss_gib", "eval/prose_cloze/acc_norm"} <= tags, tags
    rows = metrics(out)
    assert [e.value for e in board.Scalars("train/lr")] == pytest.approx([m["lr"] for m in rows])
    assert [e.value for e in board.Scalars("perf/tokens_per_s")] == pytest.approx([m["tokens_per_s"] for m in rows])
    assert [(e.step, e.value) for e in board.Scalars("eval/prose_cloze/acc_norm")] == [(12, 0.375)]
    # tokens seen beside the step, and the loss drawn against them (x = tokens)
    per_step = 4 * 32  # global_batch x seq_len of `stage`
    assert [(e.step, e.value) for e in board.Scalars("progress/tokens_seen")] == [
        (m["step"], m["step"] * per_step) for m in rows
    ]
    assert [e.step for e in board.Scalars("by_tokens/train_loss")] == [m["step"] * per_step for m in rows]


@pytest.mark.parametrize("kind", ["wandb", "mlflow"])
def test_wandb_and_mlflow_are_recipe_options_through_their_own_clients(tmp_path, kind, monkeypatch):
    """Where the client is installed, a stage's scalars reach it (W&B offline, MLflow's file
    store) and are read back with that client; where it is not (this project does not depend on
    them), the stage fails before any rank starts, naming the package to install."""
    from trainers.tracker import TrackerUnavailable

    plan = write_two_source_plan(tmp_path / "plan")
    out = tmp_path / "ws" / "pretrain" / f"{kind}00000000"[:12]
    run = stage(plan, steps=2, tracker={"kind": kind, "wandb_mode": "offline"})
    if importlib.util.find_spec(kind) is None:
        with pytest.raises(
            TrackerUnavailable, match=rf"'{kind}' package is not installed; install it \(pip install {kind}\)"
        ):
            train_stage(run, plan, out)
        assert not (out / "metrics.jsonl").exists()
        return
    monkeypatch.setenv("WANDB_MODE", "offline")
    meta = train_stage(run, plan, out)
    folder = Path(meta["tracker_dir"])
    if kind == "mlflow":
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=folder.parent.resolve().as_uri())
        history = client.get_metric_history((folder / "mlflow_run_id").read_text().strip(), "train/loss")
        assert [m.step for m in history] == [1, 2]
    else:
        assert list(folder.rglob("*.wandb")), "no offline W&B run file"


def test_stage_fields_keep_unchanged_fingerprints():
    """The new recipe settings: operational, or (the skip-step rule) left out of the identity
    while off, so every existing stage keeps its fingerprint and finished folder."""
    from model.spec import SpikeSkipConfig
    from pipeline.artifact import identity

    plain = TrainSpec(steps=4, global_batch=4, micro_batch=4)
    new = {"skip_spikes", "watchdog", "monitor", "tracker", "nonfinite", "tracker_dir", "debug_nan_token"}
    new |= {"run_first_step", "run_first_token"}
    assert not new & set(identity(plain))
    ruled = TrainSpec(steps=4, global_batch=4, micro_batch=4, skip_spikes=SpikeSkipConfig(window=8))
    assert identity(ruled)["skip_spikes"] == {"window": 8, "sigma": 6.0, "min_history": 20}
    assert identity(ruled) != identity(plain)


# --- flags as Prefect events, from a real flow run --------------------------------------------


class Planted(BaseModel):
    """A mixture step's config whose data holds a loss spike at the given steps."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spikes: tuple[int, ...]


@step("planted_mixture", version=1, kind="mixture")
def planted_mixture(config: Planted, *, out: Path, log=print) -> dict:
    write_plan(out, spikes=config.spikes)
    return {"stage": "stage1"}


@pytest.mark.slow
def test_flags_are_prefect_events_and_lineage_rows_of_the_flow_run(tmp_path, prefect_harness):
    """The pretrain step in a flow run (the real runner): the skipped step the rank flags becomes a
    Prefect event `smollm3.training.skipped_step` about the stage, related to the flow run and the
    task run (what a Prefect automation matches on), and a lineage row of that run, attempt and try."""
    from prefect import flow
    from prefect.events.clients import AssertingEventsClient
    from prefect.events.worker import EventsWorker

    from flows.recipe import load_recipe, run_setup
    from pipeline.graph import Graph
    from pipeline.runner import run_flow

    ws = tmp_path / "ws"
    recipe = load_recipe("tiny", [f"workspace={ws}"])
    run = stage(Path("unused"), steps=20, skip_spikes={"window": 8, "sigma": 4.0, "min_history": 8})

    @flow(name="marathon-events-test")
    def train() -> dict:
        g = Graph("marathon-events-test")
        data = g.add(planted_mixture, Planted(spikes=(16,)), label="stage1")
        g.add(pretrain, run, label="stage1", mixture=data)
        return run_flow("marathon-events-test", g, run_setup(recipe, "tiny"))

    EventsWorker.set_client_override(AssertingEventsClient)
    try:
        train()
        # this client's worker only: `drain_all` also waits on the workers earlier tests of this
        # process left behind (a stopped server's client retrying), which may never finish
        EventsWorker.instance().drain()
        sent = [e for client in AssertingEventsClient.all for e in client.events]
    finally:
        EventsWorker.set_client_override(None)
        AssertingEventsClient.reset()
    ours = [e for e in sent if e.event.startswith("smollm3.training.")]
    assert [e.event for e in ours] == ["smollm3.training.skipped_step"], [e.event for e in sent]
    event = ours[0]
    assert event.resource.name == "stage1" and event.resource.id.startswith("smollm3.stage.")
    assert event.payload["step"] == 16 and "not applied" in event.payload["message"]
    roles = {r.role: r.id for r in event.related}
    run_id = Lineage(ws / "lineage.duckdb").runs(1)[0]["run_id"]
    assert roles["flow-run"] == f"prefect.flow-run.{run_id}" and roles["task-run"].startswith("prefect.task-run.")
    (row,) = train_events(ws)
    assert (row["kind"], row["step"], row["run_id"], row["attempt"], row["task_try"]) == (
        "skipped_step",
        16,
        run_id,
        1,
        1,
    )


def test_the_skipped_window_follows_the_policy_and_the_loader_skips_it_as_if_drawn(tmp_path):
    """`nonfinite.skip_steps`: None skips the data since the checkpoint, k the last k steps' up
    to the failing one; `retries` bounds the windows. Skipping sequences leaves the loader where
    drawing them would have."""
    from model.spec import NonFiniteConfig
    from trainers.monitor import plan_skip, read_skips

    record = {
        "step": 7,
        "what": "loss",
        "checkpoint_step": 4,
        "checkpoint_sequence": 16,
        "step_sequences": {"5": 16, "6": 20, "7": 24},
        "sequence_after": 28,
        "seq_len": L,
    }
    assert plan_skip(tmp_path / "a", record, NonFiniteConfig())["from"] == 16
    assert plan_skip(tmp_path / "b", record, NonFiniteConfig(skip_steps=1))["from"] == 24
    assert plan_skip(tmp_path / "c", record, NonFiniteConfig(skip_steps=2))["from"] == 20
    assert plan_skip(tmp_path / "b", record, NonFiniteConfig(retries=1, skip_steps=1)) is None
    assert [(w["from"], w["to"]) for w in read_skips(tmp_path / "b")] == [(24, 28)]

    plan = MixturePlan.load(write_two_source_plan(tmp_path / "plan"))
    drawn, skipped = MixtureLoader(plan, seq_len=L), MixtureLoader(plan, seq_len=L)
    for _ in range(5):
        drawn.next_batch(4)
    skipped.skip(20)
    assert skipped.state_dict() == drawn.state_dict()
    assert torch.equal(skipped.next_batch(4).input_ids, drawn.next_batch(4).input_ids)


# --- 3. a stage that meets three faults in one run ------------------------------------------


class Faults:
    """Three faults sent to a stage's launches from outside, one per launch, each once its launch
    trained past a step: rank 1 SIGKILLed (a lost rank or node: the OOM killer, a dead host),
    rank 1 with its torchrun and guard frozen by SIGSTOP (a frozen node: its heartbeat stops),
    SIGTERM to torchrun (preemption, a pod's eviction). Runs in a thread of the test process."""

    PLAN = (("kill", 3), ("freeze", 7), ("preempt", 11))

    def __init__(self, ws: Path) -> None:
        self.ws, self.sent, self.stop = ws, [], threading.Event()
        self.thread = threading.Thread(target=self._run, name="faults", daemon=True)

    def _launch(self, after: int | None) -> tuple[Path, int] | None:
        """(stage folder, guard pid) of a launch other than the guard `after`, if one runs."""
        for pgid in self.ws.glob("pretrain/*/.trainer.pgid"):
            try:
                guard = int(pgid.read_text())
            except (OSError, ValueError):
                continue
            if guard != after and psutil.pid_exists(guard):
                return pgid.parent, guard
        return None

    def _run(self) -> None:
        guard = None
        for kind, at in self.PLAN:
            while not self.stop.is_set():
                found = self._launch(guard)
                try:
                    if found and metrics(found[0])[-1]["step"] >= at:
                        break
                except (OSError, ValueError, IndexError):
                    pass
                time.sleep(0.02)
            if self.stop.is_set():
                return
            out, guard = found
            _, torchrun, ranks = launch_tree(out)
            step = metrics(out)[-1]["step"]
            if kind == "kill":
                ranks[1].send_signal(signal.SIGKILL)
            elif kind == "freeze":
                for p in (psutil.Process(guard), torchrun, ranks[1]):
                    p.send_signal(signal.SIGSTOP)
            else:
                torchrun.send_signal(signal.SIGTERM)
            self.sent.append((kind, step))


@pytest.mark.slow
def test_a_stage_survives_three_faults_in_one_run_within_its_retry_budget(tmp_path, prefect_harness):
    """The pretrain step in a flow run (real runner, local torchrun, 2 ranks), its budget and
    backoff from the recipe's fields (`training.retries` 3, `retry_backoff_s` 1 doubling to
    `retry_backoff_max_s` 2): a killed rank, a frozen node and a preemption, sent from outside to
    three launches in turn, are each a `retried` lineage row naming its cause, its attempt and its
    backoff; the fourth launch finishes the stage with the weights and losses of a run never
    interrupted, bit for bit."""
    from prefect import flow

    from flows.recipe import load_recipe, run_setup
    from pipeline.graph import Graph
    from pipeline.named_runs import NamedTaskRunner
    from pipeline.runner import run_flow

    ws = tmp_path / "ws"
    fields = ["training.retries=3", "training.retry_backoff_s=1", "training.retry_backoff_max_s=2"]
    recipe = load_recipe("tiny", [f"workspace={ws}", *fields])
    steps = 14
    run = stage(Path("unused"), nproc=2, steps=steps, watchdog=HANG_WATCH)
    clean = tmp_path / "clean" / "pretrain" / "clean0000000"
    train_stage(run, write_plan(tmp_path / "clean-plan"), clean)  # the same data as planted_mixture's

    @flow(name="three-faults-test", task_runner=NamedTaskRunner())
    def train() -> dict:
        g = Graph("three-faults-test")
        data = g.add(planted_mixture, Planted(spikes=()), label="stage1")
        slow = run.model_copy(update={"spec": run.spec.model_copy(update={"debug_step_sleep_s": 0.3})})
        g.add(pretrain, slow, label="stage1", mixture=data, **recipe.training.retry_policy())
        return run_flow("three-faults-test", g, run_setup(recipe, "tiny"))

    faults = Faults(ws)
    faults.thread.start()
    began = time.monotonic()
    try:
        train()
    finally:
        faults.stop.set()
        faults.thread.join()
    took = time.monotonic() - began
    assert [kind for kind, _ in faults.sent] == ["kill", "freeze", "preempt"], faults.sent

    lineage = Lineage(ws / "lineage.duckdb")
    run_id = lineage.runs(1)[0]["run_id"]
    rows = [r for r in lineage.steps_of(run_id) if r["step"] == "pretrain"]
    assert [r["state"] for r in rows] == ["retried", "retried", "retried", "completed"], rows
    kill, freeze, preempt = (r["error"] for r in rows[:3])
    assert "rank 1 killed by SIGKILL" in kill and "(attempt 1 of 4; retrying in 1s)" in kill, kill
    assert f"hung: rank 1 on {socket.gethostname()} frozen" in freeze and "(attempt 2 of 4; retrying in 2s)" in freeze
    assert "stopped on a signal" in preempt and "(attempt 3 of 4; retrying in 2s)" in preempt, preempt
    assert lineage.runs(1)[0]["state"] == "completed"
    # each retry waited its backoff: the next attempt began at least that long after the last ended
    for before, after, delay in zip(rows[:3], rows[1:], (1, 2, 2), strict=True):
        assert (after["started"] - before["ended"]).total_seconds() >= delay - 0.1

    (out,) = ws.glob("pretrain/*/result.json")
    out = out.parent
    result = json.loads((out / "result.json").read_text())
    saved_at = int(re.search(r"stopped on SIGTERM after step (\d+)", preempt).group(1))
    assert f"(last checkpoint: step {saved_at})" in preempt
    assert result["resumed_from"].endswith(f"step_{saved_at:08d}")  # the preemption lost no step
    assert same_weights(clean / "checkpoints" / f"step_{steps:08d}", out / "checkpoints" / f"step_{steps:08d}")
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(clean)]
    print(f"three faults {faults.sent} survived in {took:.0f}s (load {os.getloadavg()[0]:.1f})")
