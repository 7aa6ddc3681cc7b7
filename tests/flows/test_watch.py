"""The live view (flows/watch.py, pipeline/live.py): a running step's latest training line and
its percentage reach the terminal through the Prefect API, throttled per step, for steps in the
flow process and in child processes, and `smollm3 watch` follows a run by id prefix."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
from prefect import flow
from pydantic import BaseModel, ConfigDict

from flows.recipe import load_recipe, run_setup
from flows.watch import watch
from pipeline.graph import Graph
from pipeline.live import describe, is_status, line_percent, parse
from pipeline.named_runs import NamedTaskRunner
from pipeline.runner import run_flow
from pipeline.step import step

STEPS = 8


class Pace(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    seconds_per_step: float


def _train(config: Pace, log, progress) -> dict:
    for i in range(1, STEPS + 1):
        time.sleep(config.seconds_per_step)
        log(f"stage step {i}/{STEPS} | loss {5 - i * 0.25:.4f} | lr 3.00e-03 | 1,234 tok/s | ETA {STEPS - i}s")
        progress(100.0 * i / STEPS)
    return {"steps": STEPS}


@step("trains_here", version=1, kind="report")
def trains_here(config: Pace, *, out: Path, log=print, progress=None) -> dict:
    return _train(config, log, progress)


@step("trains_child", version=1, kind="report", isolate=True)
def trains_child(config: Pace, *, out: Path, log=print, progress=None) -> dict:
    return _train(config, log, progress)


def test_progress_lines_are_recognised_and_carried_in_the_description():
    assert is_status("stage1 step 40/100 | loss 5.4321 | lr 2.40e-03 | 9,870 tok/s | MFU 23.4% | ETA 1m12s")
    assert is_status("lm-eval: 1,000/1,000 items (100%) | prose_cloze 100/100 items | took 42s")
    assert not is_status("evaluating stage1 on prose_cloze (100 items)")
    line = "stage1 step 4/8 | loss 4.0 | ETA 3s"
    assert parse(describe("pretrain[stage1]", line)) == ("pretrain[stage1]", line)
    assert parse(describe("pretrain[stage1]", "")) == ("pretrain[stage1]", "")


def test_the_percentage_shown_is_the_one_the_line_states():
    """A live line reads `50.0% stage3 step 8/16`, never the step's last coarse progress mark
    beside a newer line (`43.8% stage3 step 8/16`, `0.0% lm-eval: 26/251 items (10%)`)."""
    assert line_percent("stage3 step 8/16 | loss 3.2 | 1,234 tok/s | ETA 5s") == 50.0
    assert line_percent("lm-eval: 26/251 items (10%) | prose_cloze 26/100 items | ETA 9s") == 100 * 26 / 251
    assert line_percent("lm-eval: 1,234/4,000 items (31%) | ETA 1m") == 100 * 1234 / 4000
    assert line_percent("sft step 3/0 | ETA 1s") is None and line_percent("merging | took 2s") is None


@pytest.mark.slow
def test_the_terminal_shows_each_running_steps_latest_training_line(tmp_path, prefect_harness, capsys):
    """Two steps train side by side for ~4 s each, a line every 0.5 s; the watcher (one look every
    0.2 s, a step's line at most every 1 s) prints their training lines as they go, and
    `smollm3 watch <id prefix>` follows the same run to its end."""
    from prefect.artifacts import Artifact as PrefectArtifact
    from prefect.runtime import flow_run as runtime_flow_run

    from flows.cli import main

    recipe = load_recipe("tiny", [f"workspace={tmp_path / 'ws'}"])
    ids: list = []

    @flow(name="watch-live-test", task_runner=NamedTaskRunner())
    def run() -> dict:
        ids.append(runtime_flow_run.id)
        g = Graph("watch-live-test")
        g.add(trains_here, Pace(seconds_per_step=0.5), label="a")
        g.add(trains_child, Pace(seconds_per_step=0.5), label="b")
        return run_flow("watch-live-test", g, run_setup(recipe, "tiny"))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not ids and time.monotonic() < deadline:
        time.sleep(0.05)
    cli: dict = {}
    follower = threading.Thread(
        target=lambda: cli.setdefault("rc", main(["watch", str(ids[0])[:8], "--poll", "0.3", "--every", "1"])),
        daemon=True,
    )
    follower.start()
    lines: list[str] = []
    final, _ = watch(ids[0], poll=0.2, out=lines.append, every_s=1.0)
    thread.join(timeout=60)
    follower.join(timeout=60)
    text = "\n".join(lines)
    print(text)  # what a user sees (pytest -s)
    assert final == "Completed", text
    for key in ("trains_here[a]", "trains_child[b]"):
        live = [ln for ln in lines if key in ln and "% stage step " in ln]
        assert len(live) >= 2, f"{key}: {text}"  # several training lines while it ran
        assert all(re.search(r"\d+\.\d% stage step \d/8 \| loss [\d.]+ \| .* tok/s \| ETA \d+s$", ln) for ln in live)
        for ln in live:  # the percentage is the line's own: step i of 8 is 12.5 * i %
            step_i = int(re.search(r"step (\d)/8", ln).group(1))
            assert f"{100 * step_i / 8:.1f}% stage step {step_i}/8" in ln, ln
        steps = [int(re.search(r"step (\d)/8", ln).group(1)) for ln in live]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)  # each new, in order
        assert len(live) <= 8 // 2 + 1  # at most one per second of a 4 s run (a line per 0.5 s)
        assert lines.index(next(ln for ln in lines if key in ln and "Running" in ln)) < lines.index(live[0])
    # the UI: each step's progress artifact ends at 100% with its last training line
    for key in ("trains-here-a-progress", "trains-child-b-progress"):
        art = PrefectArtifact.get(key)
        assert art.data == 100.0 and parse(art.description)[1].startswith("stage step 8/8"), art.description
    # `smollm3 watch` on the same run (by id prefix): its header, the steps, exit 0
    out = capsys.readouterr().out
    assert cli.get("rc") == 0, out
    assert out.startswith("watching flow run ") and str(ids[0]) in out.splitlines()[0]
    assert "flow run Completed" in out and "trains_child[b]" in out
