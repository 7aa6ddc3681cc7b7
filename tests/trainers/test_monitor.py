"""The straggler and throughput rules of trainers/monitor.py on gathered tables (ranks x [local s,
step s, steps], and the CPU wait s where a test gives the machine's load)."""

from __future__ import annotations

import json

import pytest
import torch

from model.spec import MonitorConfig
from trainers.monitor import Events, SpeedChecks

# `confirm=1`: each judgement flags at once; the hysteresis has tests of its own below
CONFIG = MonitorConfig(
    straggler_margin=1.0, straggler_min_share=0.05, window=3, reference_skip=0, reference_steps=1, confirm=1
)
TOKENS = 128  # per step; at the reference's 3,200 tokens/s a step takes 40 ms


def lines(checks: SpeedChecks, events: Events, per_rank: list[tuple[float, ...]], start: int, count: int) -> int:
    """`count` metrics lines of one step each, every rank's (local s, step s[, CPU wait s]) as given."""
    for step in range(start, start + count):
        table = torch.tensor([[r[0], r[1], 1.0, *r[2:]] for r in per_rank], dtype=torch.float64)
        checks.add(table, step, step, events)
    return start + count


def flags(tmp_path) -> list[dict]:
    """The flags raised (each launch's throughput reference is a measurement, not a flag)."""
    path = tmp_path / "monitor" / "events.jsonl"
    found = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [f for f in found if f["kind"] != "throughput_reference"]


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
    never shrinks a share. A rank 1.5x the other (under the 2x margin) is not named; rank 0 slow
    (10 ms) on two lines of the window of three makes its mean 3.1x the other's, an excess of
    5 ms, over 5% of the 40 ms step (under 5% of 128 ms): named, then cleared once its window
    is fast again (step 9: at step 8 its one slow line still makes its mean 2.7x)."""
    events = Events(tmp_path, "stage1", enabled=True)
    checks = SpeedChecks(CONFIG, ["a", "b"], TOKENS, reference(tokens_per_s=1000.0))
    step = lines(checks, events, [(0.002, 0.040), (0.003, 0.040)], 1, 4)
    assert flags(tmp_path) == []
    step = lines(checks, events, [(0.010, 0.040), (0.002, 0.040)], step, 2)
    lines(checks, events, [(0.002, 0.040), (0.002, 0.040)], step, 4)
    named = [f for f in flags(tmp_path) if f["kind"] == "straggler"]
    assert [(f["rank"], f["step"]) for f in named] == [(0, 6)] and "reference pace" not in named[0]["message"]
    assert named[0]["lines_over"] == 2 and "over 2.00x on 2 of them" in named[0]["message"]
    assert [(f["rank"], f["step"]) for f in flags(tmp_path) if f["kind"] == "straggler_cleared"] == [(0, 9)]


def test_a_rank_preempted_on_a_few_lines_is_no_straggler_and_a_flag_needs_confirm_lines_in_a_row(tmp_path):
    """A loaded machine preempts a rank for 10-20 ms inside its 2 ms sections now and then: a
    rank slow on one line of a window of five (its mean 2.8x the other's, but over the margin on
    one line, under `straggler_min_lines`' 30%) names nobody. A rank slow on every line is named
    only after `confirm` (3) judgements in a row, and cleared only after three in a row below
    half the margin."""
    config = CONFIG.model_copy(update={"window": 5, "confirm": 3})
    events = Events(tmp_path, "stage1", enabled=True)
    checks = SpeedChecks(config, ["a", "b"], TOKENS, reference())
    step = 1
    for _ in range(4):  # one preempted line in every five, on either rank
        step = lines(checks, events, [(0.002, 0.060), (0.002, 0.060)], step, 4)
        step = lines(checks, events, [(0.020, 0.060), (0.002, 0.060)], step, 1)
    assert flags(tmp_path) == []
    # rank 1 slow on every line from step 21: rank 0's preempted line (step 20) is in the others'
    # mean until step 24; rank 1's mean is 5x from step 25, named after 3 in a row
    step = lines(checks, events, [(0.002, 0.060), (0.010, 0.060)], step, 5)
    assert flags(tmp_path) == []
    lines(checks, events, [(0.002, 0.040), (0.002, 0.040)], step, 7)
    assert [(f["kind"], f["rank"], f["step"]) for f in flags(tmp_path)][0] == ("straggler", 1, 27)
    cleared = [(f["rank"], f["step"]) for f in flags(tmp_path) if f["kind"] == "straggler_cleared"]
    # at step 29 one slow line of five still makes its mean 1.8x; fast from step 30, 3 in a row
    assert cleared == [(1, 32)]


def test_a_rank_slowed_on_two_lines_of_five_is_named_and_two_lines_of_ten_name_nobody(tmp_path):
    """A CPU quota slows a rank's 2 ms sections only when its quota runs out inside one: rank 1
    slow (12 ms) on two lines of every five costs the others 4 ms a step on average (its mean 3x
    the other's, over the margin on 4 lines of the window of 10): named, where the median of its
    lines would be the fast ones'. The same rank slow (30 ms) on two lines of every ten (its mean
    3.8x, over the margin on 2 lines of 10, under 30%) names nobody."""
    config = CONFIG.model_copy(update={"window": 10, "confirm": 3})
    for name, slow_lines, slow_s in (("quota", (1, 3, 6, 8), 0.012), ("spikes", (4, 7), 0.030)):
        events = Events(tmp_path / name, "stage1", enabled=True)
        checks = SpeedChecks(config, ["a", "b"], TOKENS, reference())
        for step in range(1, 41):
            mine = slow_s if step % 10 in slow_lines else 0.002
            lines(checks, events, [(0.002, 0.060), (mine, 0.060)], step, 1)
        named = [f for f in flags(tmp_path / name) if f["kind"] == "straggler"]
        if name == "quota":
            assert [f["rank"] for f in named] == [1] and named[0]["step"] == 12 and named[0]["lines_over"] == 4
            assert named[0]["value"] == pytest.approx(3.0)
        else:
            assert named == []


def test_a_machine_slowed_as_a_whole_drops_no_throughput_while_a_fall_the_load_does_not_explain_does(tmp_path):
    """The launch's reference: 3,200 tokens/s (40 ms steps), 5 ms of CPU wait and 2 ms of own work
    a step. Then the machine is loaded from outside: steps take 120 ms, and every rank's thread
    now waits 85 ms a step for a CPU: a step at the reference pace is 40 + 80 ms, so 1,067
    tokens/s is the machine's pace, not a drop (no flag; `perf/machine_pace` says a third). Nor
    is a CPU three times slower at everything (every rank's own work 6 ms: a busy sibling
    thread, a lower clock). With three ranks, one slowed alone (its own work 9 ms, its wait as
    the others') is no pace of the machine's: its 120 ms steps are a drop, flagged after
    `confirm` lines in a row and dated to its first."""
    config = CONFIG.model_copy(update={"window": 3, "confirm": 2})
    for name, loaded in (("waits", (0.002, 0.120, 1.0, 0.085)), ("slower", (0.006, 0.120, 1.0, 0.005))):
        events = Events(tmp_path / name, "stage1", enabled=True)
        checks = SpeedChecks(config, ["a", "b"], TOKENS, None)
        step = lines(checks, events, [(0.002, 0.040, 0.005), (0.002, 0.040, 0.005)], 1, 4)
        for _ in range(6):
            scalars = checks.add(torch.tensor([loaded] * 2, dtype=torch.float64), step, step, events)
            step += 1
        assert flags(tmp_path / name) == []
        assert scalars["perf/machine_pace"] == pytest.approx(1 / 3)
        assert scalars["perf/throughput_vs_expected"] == pytest.approx(1.0)
        assert scalars["perf/throughput_vs_reference"] == pytest.approx(1 / 3)

    other = tmp_path / "three"
    events = Events(other, "stage1", enabled=True)
    checks = SpeedChecks(config, ["a", "b", "c"], TOKENS, None)
    fine = (0.002, 0.040, 0.005)
    step = lines(checks, events, [fine] * 3, 1, 4)
    lines(checks, events, [(0.002, 0.120, 0.005), (0.002, 0.120, 0.005), (0.009, 0.120, 0.005)], step, 3)
    drops = [f for f in flags(other) if f["kind"] == "throughput_drop"]
    assert [(f["step"], f["began_at"]) for f in drops] == [(6, 5)] and drops[0]["pace"] == 1.0
    named = [f for f in flags(other) if f["kind"] == "straggler"]
    assert [(f["rank"], f["step"]) for f in named] == [(2, 6)]  # its mean 2.2x from step 5, 2 in a row


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


def test_the_median_of_the_other_ranks_is_statistics_median_without_the_rank():
    """`_others_median` (one sort per line, for 384 ranks at every metrics line) gives, for each
    rank, what `statistics.median` gives on the list without it: odd and even counts, ties."""
    import random
    import statistics

    from trainers.monitor import _others_median

    rng = random.Random(7)
    for n in range(1, 41):
        for _ in range(25):
            values = [rng.choice([rng.random(), 0.5, 0.25, 0.5]) for _ in range(n)]
            want = [statistics.median(values[:r] + values[r + 1 :]) for r in range(n)] if n > 1 else values
            assert _others_median(values) == want, values
