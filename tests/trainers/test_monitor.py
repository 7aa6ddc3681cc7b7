"""The straggler rule of trainers/monitor.py on gathered tables (ranks x [local s, step s, steps])."""

from __future__ import annotations

import json

import torch

from model.spec import MonitorConfig
from trainers.monitor import Events, SpeedChecks

CONFIG = MonitorConfig(straggler_margin=1.0, straggler_min_share=0.05, window=3, reference_skip=0, reference_steps=1)
TOKENS = 128  # per step; at the reference's 3,200 tokens/s a step takes 40 ms


def lines(checks: SpeedChecks, events: Events, per_rank: list[tuple[float, float]], start: int, count: int) -> int:
    """`count` metrics lines of one step each, every rank's (local s, step s) as given."""
    for step in range(start, start + count):
        table = torch.tensor([[local, step_s, 1.0] for local, step_s in per_rank], dtype=torch.float64)
        checks.add(table, step, step, events)
    return start + count


def flags(tmp_path) -> list[dict]:
    path = tmp_path / "monitor" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def reference(tokens_per_s: float = 3200.0) -> dict:
    return {"tokens_per_s": tokens_per_s, "from_step": 1, "to_step": 1, "tokens_per_step": TOKENS, "world_size": 2}


def test_a_straggler_that_lengthens_the_step_is_judged_against_the_reference_pace(tmp_path):
    """Rank 1's own work takes 4x rank 0's (8 ms vs 2 ms); waiting for it, every rank's step takes
    130 ms instead of the reference's 40. The 6 ms excess is 4.6% of the slowed step (below the 5%
    share) but 15% of a step at the reference pace: rank 1 is named, and the message says so."""
    events = Events(tmp_path, "stage1", enabled=True)
    checks = SpeedChecks(CONFIG, ["host-a", "host-b"], TOKENS, reference())
    lines(checks, events, [(0.002, 0.130), (0.008, 0.130)], 1, 3)
    named = [f for f in flags(tmp_path) if f["kind"] == "straggler"]
    assert [(f["rank"], f["host"], f["step"]) for f in named] == [(1, "host-b", 3)]
    assert "step 40 ms at the reference pace" in named[0]["message"]


def test_without_a_reference_the_measured_step_decides_and_a_small_excess_names_nobody(tmp_path):
    """Before the reference exists the measured step is the basis: the same 6 ms of a 130 ms step
    (4.6%) is under the 5% share, so nobody is named; at 10 ms (7.7%) rank 1 is."""
    events = Events(tmp_path, "stage1", enabled=True)
    checks = SpeedChecks(CONFIG.model_copy(update={"reference_steps": 1000}), ["a", "b"], TOKENS, None)
    step = lines(checks, events, [(0.002, 0.130), (0.008, 0.130)], 1, 3)
    assert [f for f in flags(tmp_path) if f["kind"] == "straggler"] == []
    lines(checks, events, [(0.002, 0.130), (0.012, 0.130)], step, 3)
    named = [f for f in flags(tmp_path) if f["kind"] == "straggler"]
    assert [f["rank"] for f in named] == [1] and "reference pace" not in named[0]["message"]


def test_a_reference_slower_than_the_step_is_not_the_basis_and_a_rank_under_the_margin_is_never_named(tmp_path):
    """Steps faster than the reference (40 ms against 128 ms) are their own basis: the reference
    never shrinks a share. A rank 1.5x the other (under the 2x margin) is not named; one slow line
    of rank 0 (12 ms) makes its window 2.7x the other's with an excess of 3.3 ms a line, over 5%
    of the 40 ms step (under 5% of 128 ms): named while it is in the window, cleared after."""
    events = Events(tmp_path, "stage1", enabled=True)
    checks = SpeedChecks(CONFIG, ["a", "b"], TOKENS, reference(tokens_per_s=1000.0))
    step = lines(checks, events, [(0.002, 0.040), (0.003, 0.040)], 1, 4)
    assert flags(tmp_path) == []
    step = lines(checks, events, [(0.012, 0.040), (0.002, 0.040)], step, 1)
    lines(checks, events, [(0.002, 0.040), (0.002, 0.040)], step, 4)
    named = [f for f in flags(tmp_path) if f["kind"] == "straggler"]
    assert [(f["rank"], f["step"]) for f in named] == [(0, 6)] and "reference pace" not in named[0]["message"]
    assert [f["rank"] for f in flags(tmp_path) if f["kind"] == "straggler_cleared"] == [0]


def test_a_resumed_launchs_warm_up_is_not_judged_against_the_reference(tmp_path):
    """A launch resumed at step 100 with the earlier launch's reference (3,200 tokens/s): its
    first `reference_skip` lines run at a fifth of that (first batches, allocations) and flag
    nothing; a fall after the warm-up is still flagged, with the step it began."""
    config = CONFIG.model_copy(update={"reference_skip": 3, "window": 3})
    events = Events(tmp_path, "stage1", enabled=True)
    checks = SpeedChecks(config, ["a", "b"], TOKENS, reference())
    step = lines(checks, events, [(0.002, 0.200), (0.002, 0.200)], 100, 3)  # warm-up: 640 tokens/s
    step = lines(checks, events, [(0.002, 0.040), (0.002, 0.040)], step, 5)  # the reference pace
    assert [f["kind"] for f in flags(tmp_path)] == []
    lines(checks, events, [(0.002, 0.100), (0.002, 0.100)], step, 3)  # 1,280 tokens/s: 40%
    drops = [f for f in flags(tmp_path) if f["kind"] == "throughput_drop"]
    assert [(f["step"], f["began_at"]) for f in drops] == [(108, 108)]
