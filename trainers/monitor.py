"""What a long stage watches in itself, rank side: stragglers, throughput drops, loss spikes, data skips.

The rules, each usable alone; the training loop (trainers/pretrain.py) reaches them through its
callbacks (trainers/callbacks.py: `SpeedMonitor`, `SpikeSkip`, `NonFiniteRollback`), beside the
hang watchdog (trainers/watchdog.py) and the tracker (trainers/tracker.py).

- Stragglers. In synchronous data parallelism every rank's step takes as long as the slowest
  rank's, so step times name nobody. What differs is the work a rank does without waiting for any
  other: loading its batches and applying its optimizer update (timed in `local()`: host time for
  the loader, net of the time the rank's thread waited for a CPU that other processes held
  (`run_delay`; a CPU quota's throttling stays in: that is the rank's own slowness), CUDA events
  for the update, read only at the metrics line, so nothing blocks in a step). Every metrics
  line the ranks all-gather those seconds, their step seconds and their CPU wait (four floats
  each); the line keeps their summary (`rank_summary`: min, median, max, the slowest rank and
  its host), and the full per-rank list only while a rank is flagged;
  rank 0 names a rank whose local seconds per step (the mean over the last `monitor.window`
  lines: what the others waited for in all) exceed the median of the other ranks' by
  `monitor.straggler_margin` (and by at least `straggler_min_share` of a step at the reference
  pace: the straggler lengthens the step it is measured against), and did so on at least
  `straggler_min_lines` of those lines (the one or two lines a loaded machine still slows on
  any rank name nobody; a rank slowed on 4 lines of 10, as a CPU quota does, is named), with
  its host, once that has held on `confirm` metrics lines in a row. A rank slow only inside
  forward and backward (whose collectives make everyone wait alike) shows as a throughput drop,
  not by name.
- Throughput drops. Each launch measures its own reference after its own warm-up: the median
  tokens/s over `reference_steps` steps after its first `reference_skip` (its first batches,
  allocations, compilation are judged by nothing), with the CPU wait per step its ranks met
  meanwhile. The stage's first launch's reference is kept in `monitor/throughput.json` and
  reported (`perf/throughput_vs_reference`; a later launch's reference says what share of it it
  runs at), but a launch is judged against its own: a resume on a busier machine is no drop.
  The machine's pace: a step at the reference pace, longer by as much as the fastest rank's own
  work is slower than while the reference was measured (a CPU slower at everything), plus the
  CPU wait per step of the rank that waits most beyond what it waited then (a machine loaded
  from outside; a quota's throttling is no wait, and one rank throttled alone does not slow the
  fastest rank's own work). Tokens/s over the
  last `window` metrics lines below `throughput_fraction` of the reference at that pace, on
  `confirm` lines in a row, is flagged with the step where the fall began (the window's first
  line below); it counts as recovered half-way back, on `confirm` lines in a row too. A
  straggler is likewise cleared only at half its margin. A slowdown every rank meets (CPU wait on a
  loaded host, a slower CPU) is the machine's pace, not a drop (`perf/machine_pace`); one that
  neither explains (one rank's slower compute, the network, a quota, the file system) is.
- Loss spikes (`skip_spikes`, off by default): OLMo-core's skip-step rule (`SpikeRule`); the
  rolling history is checkpointed, so a resumed stage skips exactly what an uninterrupted one does.
- Non-finite values: `nonfinite()` writes `monitor/nonfinite.json` (the failing step, the
  checkpoint the stage can roll back to, where each step's data began) before the trainer stops;
  the pretrain step then plans a data window to skip (`plan_skip`, `monitor/skip.json`) and
  relaunches, and `DataSkips` steps the loader over it.

Flags are JSON lines in `monitor/events.jsonl` (rank 0) and WARNING lines in the stage log; the
pretrain step turns each into a lineage row and a Prefect event (trainers/supervise.py).
"""

from __future__ import annotations

import json
import logging
import math
import resource
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infra.files import write_atomic
from model.spec import MonitorConfig, NonFiniteConfig, SpikeSkipConfig
from model.token_shards import MixtureLoader

log = logging.getLogger("trainers.pretrain")

EVENTS_FILE = Path("monitor") / "events.jsonl"
NONFINITE_FILE = Path("monitor") / "nonfinite.json"
SKIP_FILE = Path("monitor") / "skip.json"
REFERENCE_FILE = Path("monitor") / "throughput.json"


# --- flags ------------------------------------------------------------------------------------


class Events:
    """Rank 0's flags: one JSON line each in `monitor/events.jsonl`, and a log line."""

    def __init__(self, out_dir: Path, stage: str, enabled: bool) -> None:
        self.path, self.stage, self.enabled = Path(out_dir) / EVENTS_FILE, stage, enabled

    def emit(self, kind: str, step: int, message: str, *, level: int = logging.WARNING, **facts: Any) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "stage": self.stage, "step": step, "message": message, "time": time.time(), **facts}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        log.log(level, "%s: %s", self.stage, message)


# --- loss spikes ------------------------------------------------------------------------------


class SpikeRule:
    """OLMo-core's skip-step rule (`SkipStepOptimizer.get_step_factor`): a step is skipped when
    |x - mean| / std > sigma for its loss or its gradient norm, mean and (sample) deviation taken
    over the previous `window` steps, once `min_history` steps are known. Every step's values
    enter the history, skipped ones included, as in OLMo-core."""

    def __init__(self, config: SpikeSkipConfig) -> None:
        self.config = config
        self.losses: deque[float] = deque(maxlen=config.window)
        self.grad_norms: deque[float] = deque(maxlen=config.window)
        self.skipped = 0

    def _z(self, history: deque[float], value: float) -> float:
        if len(history) < max(2, self.config.min_history):
            return 0.0
        std = statistics.stdev(history)
        return abs(value - statistics.fmean(history)) / std if std > 0 else 0.0

    def judge(self, loss: float, grad_norm: float) -> str | None:
        """Why this step must not be applied (None: apply it); records the step's values."""
        z_loss, z_grad = self._z(self.losses, loss), self._z(self.grad_norms, grad_norm)
        known = len(self.losses)
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        sigma = self.config.sigma
        if z_loss <= sigma and z_grad <= sigma:
            return None
        self.skipped += 1
        return (
            f"loss {loss:.4f} is {z_loss:.1f} sigma and gradient norm {grad_norm:.3f} is {z_grad:.1f} sigma "
            f"from the mean of the last {known} steps (limit {sigma:g})"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms), "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses.extend(float(x) for x in state.get("losses", []))
        self.grad_norms.extend(float(x) for x in state.get("grad_norms", []))
        self.skipped = int(state.get("skipped", 0))


# --- data windows skipped after a non-finite loss ---------------------------------------------


def read_skips(out_dir: Path) -> list[dict[str, Any]]:
    """The data windows a stage skips (`monitor/skip.json`), oldest first."""
    try:
        windows = json.loads((Path(out_dir) / SKIP_FILE).read_text())
    except (OSError, ValueError):
        return []
    return windows if isinstance(windows, list) else []


def read_nonfinite(out_dir: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((Path(out_dir) / NONFINITE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def plan_skip(out_dir: Path, record: dict[str, Any], config: NonFiniteConfig) -> dict[str, Any] | None:
    """The data window to skip after the non-finite value in `record` (nonfinite.json), appended
    to `monitor/skip.json`; None when `config.retries` windows were skipped already (the stage
    must fail). The window runs from where the data of step `failed - skip_steps + 1` began (never
    before the checkpoint the stage rolls back to; `skip_steps` None: the checkpoint itself) to
    the end of the failing step's data, in global sequences of the loader."""
    windows = read_skips(out_dir)
    if len(windows) >= config.retries:
        return None
    failed, starts = int(record["step"]), {int(k): int(v) for k, v in record["step_sequences"].items()}
    begin = int(record["checkpoint_sequence"])
    if config.skip_steps is not None:
        begin = max(begin, starts.get(failed - config.skip_steps + 1, begin))
    window = {
        "from": begin,
        "to": int(record["sequence_after"]),
        "failed_step": failed,
        "what": record.get("what"),
        "checkpoint_step": record.get("checkpoint_step"),
        "sequence_tokens": int(record.get("seq_len", 0)),
        "planned": time.time(),
    }
    write_atomic(Path(out_dir) / SKIP_FILE, json.dumps([*windows, window], indent=2))
    (Path(out_dir) / NONFINITE_FILE).unlink(missing_ok=True)  # handled: a later failure writes its own
    return window


class DataSkips:
    """Steps the loader over the planned windows when it reaches their start (a step boundary)."""

    def __init__(self, out_dir: Path) -> None:
        self.windows = read_skips(out_dir)

    def apply(self, loader: MixtureLoader) -> list[dict[str, Any]]:
        applied = []
        for window in self.windows:
            if window["from"] == loader.sequence and window["to"] > window["from"]:
                loader.skip(window["to"] - window["from"])
                applied.append(window)
        return applied


# --- stragglers and throughput ----------------------------------------------------------------


def run_delay() -> float:
    """Seconds the calling thread has waited for a CPU that others held (Linux: its run-queue wait
    in schedstat, less what its cgroup's CPU quota throttled it: a quota is the rank's own
    slowness, not the machine's load); 0.0 where the kernel does not say."""
    try:
        waited = int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0
    return waited - _quota_throttled()


def _quota_throttled() -> float:
    """Seconds this process's cgroup (v1 `cpu` or v2) was throttled by its CPU quota; 0.0 without one."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return 0.0
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # the unified hierarchy (v2)
            stat, key, unit = Path("/sys/fs/cgroup") / path.lstrip("/") / "cpu.stat", "throttled_usec", 1e6
        elif "cpu" in controllers.split(","):
            stat, key, unit = Path("/sys/fs/cgroup/cpu") / path.lstrip("/") / "cpu.stat", "throttled_time", 1e9
        else:
            continue
        try:
            for row in stat.read_text().splitlines():
                name, _, value = row.partition(" ")
                if name == key:
                    return int(value) / unit
        except (OSError, ValueError):
            continue
    return 0.0


@dataclass(frozen=True)
class _Line:
    """One metrics line of the gathered table, per step: every rank's own work and CPU wait."""

    first: int  # its first step
    end: int  # its last step
    steps: float
    seconds: float  # rank 0's wall seconds over its steps (every rank's, in synchronous training)
    local: list[float]  # per rank: seconds per step of its own work (data, optimizer)
    delay: list[float]  # per rank: seconds per step its training thread waited for a CPU


def _others_median(values: list[float]) -> list[float]:
    """For each rank, the median of the other ranks' values: one sort, not one per rank (384
    ranks x a window of lines at every metrics line)."""
    n = len(values)
    if n < 2:
        return list(values)
    order = sorted(range(n), key=values.__getitem__)
    ranked = [values[r] for r in order]
    place = [0] * n
    for i, r in enumerate(order):
        place[r] = i
    m = n - 1  # the others

    def kth(k: int, skip: int) -> float:  # the k-th smallest of the others (skipping position `skip`)
        return ranked[k if k < skip else k + 1]

    if m % 2:
        return [kth(m // 2, place[r]) for r in range(n)]
    return [(kth(m // 2 - 1, place[r]) + kth(m // 2, place[r])) / 2 for r in range(n)]


def _judge(
    lines: list[_Line], margin: float, least: float, recurring: float
) -> list[tuple[float, float, float, int, bool, bool]]:
    """Every rank's own work over `lines` against the other ranks': (its mean seconds per step,
    the median of the others' means, their ratio, the lines on which it was over the margin,
    slow, fine).

    Slow: the mean over 1 + `margin` and `least` seconds more, and over the margin (by `least`)
    on at least `recurring` of the lines. The mean is what the others waited for in all (a rank
    slowed on 4 lines of 10 costs 40% of its excess; a median over the lines sees nothing); the
    recurrence keeps the one or two lines a loaded machine still slows on any rank (a
    preemption the run-queue wait did not net out) from naming it. Fine: under half the margin
    or half that excess, or over the margin on under half those lines: cleared only well below,
    no flag by turns."""
    n, steps = len(lines[0].local), sum(line.steps for line in lines)
    means = [sum(line.local[r] * line.steps for line in lines) / steps for r in range(n)]
    over = [0] * n
    for line in lines:
        for r, other in enumerate(_others_median(line.local)):
            mine = line.local[r]
            over[r] += mine > (1 + margin) * other and mine - other >= least
    needed = max(1, math.ceil(recurring * len(lines) - 1e-9))
    out = []
    for r, other in enumerate(_others_median(means)):
        mine = means[r]
        ratio = mine / other if other > 0 else 1.0
        slow = ratio > 1 + margin and mine - other >= least and over[r] >= needed
        fine = ratio < 1 + margin / 2 or mine - other < least / 2 or 2 * over[r] < needed
        out.append((mine, other, ratio, over[r], slow, fine))
    return out


class SpeedChecks:
    """Rank 0's view of the gathered step times (see the module docstring)."""

    def __init__(self, config: MonitorConfig, hosts: list[str], tokens_per_step: int, reference: dict | None) -> None:
        self.config, self.hosts, self.tokens_per_step = config, hosts, tokens_per_step
        self.reference = reference  # the stage's, its first launch's: {"tokens_per_s", "delay_s", "from_step", ...}
        self.launch: dict[str, Any] | None = None  # this launch's own, measured after its warm-up
        self.samples: list[tuple[float, float, float]] = []  # (tokens/s, CPU wait, own work s/step) while measured
        self.launch_start: int | None = None
        self.lines: deque[_Line] = deque(maxlen=config.window)  # after the launch's warm-up
        self.slow: set[int] = set()  # ranks named and not cleared
        self.dropped = False
        self._streaks: dict[Any, int] = {}  # (rule, rank): judgements in a row that it held

    def add(self, sums: torch.Tensor, first_step: int, end_step: int, events: Events) -> dict[str, Any]:
        """One metrics line's gathered sums (ranks x [local s, step s, steps, CPU wait s]; the last
        column may be absent: no wait known); returns scalars."""
        steps, seconds = float(sums[0, 2]), float(sums[0, 1])
        if steps <= 0 or seconds <= 0:
            return {}
        if self.launch_start is None:
            self.launch_start = first_step
        if first_step < self.launch_start + self.config.reference_skip:
            # the launch's warm-up (first batches, allocations, compilation; a resumed launch's
            # too) is judged by nothing and measures nothing
            return {}
        per_step = sums / sums[:, 2:3].clamp(min=1)
        delay = per_step[:, 3].tolist() if sums.shape[1] > 3 else [0.0] * sums.shape[0]
        self.lines.append(_Line(first_step, end_step, steps, seconds, per_step[:, 0].tolist(), delay))
        out: dict[str, Any] = {}
        if self.launch is None:
            self._measure(events)
        else:
            out |= self._throughput(events)
        if sums.shape[0] > 1 and len(self.lines) == self.config.window:
            out |= self._stragglers(end_step, events)
        return out

    # -- the launch's pace --

    @staticmethod
    def _wait(lines: list[_Line]) -> float:
        """The CPU wait per step over `lines` of the rank that waited most (the others wait for it
        in every collective); the wait excludes quota throttling, so a throttled rank's is its load's."""
        steps = sum(line.steps for line in lines)
        return max(sum(line.delay[r] * line.steps for line in lines) / steps for r in range(len(lines[0].delay)))

    @staticmethod
    def _own(lines: list[_Line]) -> float:
        """The machine's speed at a rank's own work: the fastest rank's median seconds per step of
        it over `lines` (a CPU shared with a busy sibling thread or a slower clock slows every
        rank's; one rank throttled alone does not slow the fastest)."""
        return min(statistics.median(line.local[r] for line in lines) for r in range(len(lines[0].local)))

    def _paced_step(self, reference: dict[str, Any] | None, lines: list[_Line]) -> float | None:
        """Seconds a step takes at `reference`'s pace on the machine as it runs now: its step,
        longer by as much as the fastest rank's own work is slower than then, plus the CPU wait
        per step beyond what the ranks met while it was measured."""
        if reference is None or not reference.get("tokens_per_s"):
            return None
        extra = max(0.0, self._wait(lines) - float(reference.get("delay_s") or 0.0))
        then = float(reference.get("local_s") or 0.0)
        slower = max(1.0, self._own(lines) / then) if then > 0 else 1.0
        return self.tokens_per_step / reference["tokens_per_s"] * slower + extra

    def _measure(self, events: Events) -> None:
        c, line = self.config, self.lines[-1]
        self.samples.append((self.tokens_per_step * line.steps / line.seconds, self._wait([line]), self._own([line])))
        start = self.launch_start + c.reference_skip
        if line.end < start + c.reference_steps - 1:
            return
        rate = statistics.median(r for r, _, _ in self.samples)
        self.launch = {
            "tokens_per_s": rate,
            "delay_s": statistics.median(d for _, d, _ in self.samples),
            "local_s": statistics.median(o for _, _, o in self.samples),
            "from_step": start,
            "to_step": line.end,
        }
        share = ""
        if self.reference is None:  # the stage's first launch: its reference is the stage's
            self.reference = self.launch | {
                "tokens_per_step": self.tokens_per_step,
                "world_size": len(self.hosts),
                "measured": time.time(),
            }
        else:
            share = f" ({rate / self.reference['tokens_per_s']:.0%} of the stage's first launch's)"
        events.emit(
            "throughput_reference",
            line.end,
            f"throughput reference: {rate:,.0f} tokens/s (median of steps {start}..{line.end}){share}; "
            f"a fall below {c.throughput_fraction:.0%} of it, at the machine's pace, is flagged",
            level=logging.INFO,
            value=rate,
        )

    # -- the rules --

    def _held(self, key: Any, holds: bool) -> bool:
        """Whether `holds` has been true on `confirm` judgements in a row (hysteresis)."""
        self._streaks[key] = self._streaks.get(key, 0) + 1 if holds else 0
        return self._streaks[key] >= self.config.confirm

    def _stragglers(self, step: int, events: Events) -> dict[str, Any]:
        c, lines = self.config, list(self.lines)
        # Each rank's own work per step, net of the time it waited for a CPU others held (a CPU
        # quota's throttling stays in): its mean over the window, counted only when it was over
        # the margin on `straggler_min_lines` of the window's lines (`_judge`).
        step_s = statistics.median(line.seconds / line.steps for line in lines)
        # The excess is judged against a step at the reference pace (the stage's or this
        # launch's, the faster, plus the CPU wait the machine adds now) when that is shorter: a
        # slow rank lengthens every rank's step (the others wait for it in the collectives), so a
        # share of the step as measured shrinks the slower the straggler is.
        paced = ""
        for reference in (self.reference, self.launch):
            reference_s = self._paced_step(reference, lines)
            if reference_s is not None and reference_s < step_s:
                step_s, paced = reference_s, " at the reference pace"
        judged = _judge(lines, c.straggler_margin, c.straggler_min_share * step_s, c.straggler_min_lines)
        ratios = [ratio for _, _, ratio, _, _, _ in judged]
        for rank, (mine, others, ratio, over, slow, fine) in enumerate(judged):
            if rank not in self.slow and self._held(("slow", rank), slow):
                self.slow.add(rank)
                self._streaks[("fine", rank)] = 0
                events.emit(
                    "straggler",
                    step,
                    f"straggler: rank {rank} on {self.hosts[rank]} takes {ratio:.2f}x the other ranks' time "
                    f"for its own work (data and optimizer: {1e3 * mine:.1f} ms/step vs a median "
                    f"{1e3 * others:.1f} ms, the means of the last {len(lines)} metrics lines; over "
                    f"{1 + c.straggler_margin:.2f}x on {over} of them; step {1e3 * step_s:.0f} ms{paced}), "
                    f"{c.confirm} judgement(s) in a row",
                    rank=rank,
                    host=self.hosts[rank],
                    value=ratio,
                    threshold=1 + c.straggler_margin,
                    lines_over=over,
                )
            elif rank in self.slow and self._held(("fine", rank), fine):
                self.slow.discard(rank)
                self._streaks[("slow", rank)] = 0
                events.emit(
                    "straggler_cleared",
                    step,
                    f"rank {rank} on {self.hosts[rank]} is no longer a straggler ({ratio:.2f}x)",
                    level=logging.INFO,
                    rank=rank,
                    host=self.hosts[rank],
                    value=ratio,
                    threshold=1 + c.straggler_margin,
                )
        slowest = max(range(len(ratios)), key=ratios.__getitem__)
        return {"perf/slowest_rank_ratio": ratios[slowest], "perf/slowest_rank": slowest}

    def _throughput(self, events: Events) -> dict[str, Any]:
        """Tokens/s over the last `window` lines (one line, a step that met a slow file, decides
        nothing alone) against this launch's own reference at the machine's pace now."""
        c, launch = self.config, self.launch
        lines = [line for line in self.lines if line.first > launch["to_step"]]
        if not lines:
            return {}
        window = self.tokens_per_step * sum(line.steps for line in lines) / sum(line.seconds for line in lines)
        paced_s = self._paced_step(launch, lines)
        expected = self.tokens_per_step / paced_s
        pace = expected / launch["tokens_per_s"]  # 1: the machine as fast as while the reference was measured
        ratio = window / expected
        full = len(lines) == c.window
        if not self.dropped and self._held("drop", full and ratio < c.throughput_fraction):
            self.dropped, self._streaks["recovered"] = True, 0
            began = self._began(lines, c.throughput_fraction * expected)
            machine = f" at the machine's pace now ({pace:.0%} of it)" if pace < 0.995 else ""
            events.emit(
                "throughput_drop",
                lines[-1].end,
                f"throughput drop: {window:,.0f} tokens/s over the last {len(lines)} metrics lines is "
                f"{ratio:.0%} of this launch's reference {launch['tokens_per_s']:,.0f} (steps {launch['from_step']}.."
                f"{launch['to_step']}){machine}, below {c.throughput_fraction:.0%} since step {began}",
                value=window,
                threshold=c.throughput_fraction * expected,
                began_at=began,
                reference=launch["tokens_per_s"],
                pace=pace,
            )
        elif self.dropped and self._held("recovered", ratio >= c.throughput_fraction + (1 - c.throughput_fraction) / 2):
            self.dropped, self._streaks["drop"] = False, 0  # recovered well above the fraction
            events.emit(
                "throughput_recovered",
                lines[-1].end,
                f"throughput recovered: {window:,.0f} tokens/s ({ratio:.0%} of the reference at the machine's pace)",
                level=logging.INFO,
                value=window,
                threshold=c.throughput_fraction * expected,
            )
        return {
            "perf/throughput_vs_reference": window / self.reference["tokens_per_s"],  # the stage's
            "perf/throughput_vs_expected": ratio,
            "perf/machine_pace": pace,
        }

    def _began(self, lines: list[_Line], threshold: float) -> int:
        """Where the fall began: the first step of the window when every line of it is below
        `threshold`, else the change point of the window's (log) rates, the split that leaves
        the least spread on either side (one slow line before fast ones is noise, not the start)."""
        rates = [math.log(self.tokens_per_step * line.steps / line.seconds) for line in lines]
        if all(r < math.log(threshold) for r in rates):
            return lines[0].first

        def spread(part: list[float]) -> float:
            mean = sum(part) / len(part)
            return sum((r - mean) ** 2 for r in part)

        splits = [i for i in range(1, len(rates)) if sum(rates[i:]) / (len(rates) - i) < sum(rates[:i]) / i]
        best = min(splits, key=lambda i: spread(rates[:i]) + spread(rates[i:]), default=0)
        return lines[best].first


def rank_summary(local: list[float], hosts: list[str]) -> dict[str, Any]:
    """A metrics line's per-rank local seconds per step, summarised: its size does not grow with
    the world (the full list is written only while a rank is flagged, `SpeedMonitor`)."""
    slowest = max(range(len(local)), key=local.__getitem__)
    return {
        "min_s": min(local),
        "median_s": statistics.median(local),
        "max_s": local[slowest],
        "slowest_rank": slowest,
        "slowest_host": hosts[slowest] if slowest < len(hosts) else None,
    }


# --- memory, for the tracker ------------------------------------------------------------------


def memory_scalars(device: torch.device) -> dict[str, float]:
    """Peak CUDA allocation, or the process's peak resident memory on CPU, in GiB."""
    if device.type == "cuda":
        return {"memory/peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"memory/rss_gib": rss_kib / 2**20}
