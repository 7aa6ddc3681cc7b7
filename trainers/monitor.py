"""What a long stage watches in itself, rank side: stragglers, throughput drops, loss spikes, data skips.

The rules, each usable alone; the training loop (trainers/pretrain.py) reaches them through its
callbacks (trainers/callbacks.py: `SpeedMonitor`, `SpikeSkip`, `NonFiniteRollback`), beside the
hang watchdog (trainers/watchdog.py) and the tracker (trainers/tracker.py).

- Stragglers. In synchronous data parallelism every rank's step takes as long as the slowest
  rank's, so step times name nobody. What differs is the work a rank does without waiting for any
  other: loading its batches and applying its optimizer update (timed in `local()`: host time for
  the loader, CUDA events for the update, read only at the metrics line, so nothing blocks in a
  step). Every metrics line the ranks all-gather those seconds and their step seconds (three
  floats each); the line keeps their summary (`rank_summary`: min, median, max, the slowest rank
  and its host), and the full per-rank list only while a rank is flagged;
  rank 0 names a rank whose local seconds per step, over the last `monitor.window` lines, exceed
  the median of the other ranks' by `monitor.straggler_margin` (and by at least
  `straggler_min_share` of a step at the stage's reference pace: the straggler lengthens the
  step it is measured against), with its host. A rank slow only inside forward and backward
  (whose collectives make everyone wait alike) shows as a throughput drop, not by name.
- Throughput drops. The stage's reference is the median tokens/s over `reference_steps` steps
  after the first `reference_skip` of the first launch that trains them; it is kept in
  `monitor/throughput.json`, so a resumed launch a day later compares with the first hour.
  Tokens/s over the last `window` metrics lines below `throughput_fraction` of it is flagged, with
  the step where the fall began (the window's first line below); it counts as recovered half-way
  back to the reference. A straggler is likewise cleared only at half its margin.
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


class SpeedChecks:
    """Rank 0's view of the gathered step times (see the module docstring)."""

    def __init__(self, config: MonitorConfig, hosts: list[str], tokens_per_step: int, reference: dict | None) -> None:
        self.config, self.hosts, self.tokens_per_step = config, hosts, tokens_per_step
        self.lines: deque[tuple[torch.Tensor, int]] = deque(maxlen=config.window)  # (per-rank sums, end step)
        self.slow: set[int] = set()  # ranks named and not cleared
        self.reference = reference  # {"tokens_per_s", "from_step", "to_step", ...}
        self.samples: list[float] = []  # line rates while the reference is measured
        self.launch_start: int | None = None
        self.rates: deque[tuple[int, float, float]] = deque(maxlen=config.window)  # (first step, steps, seconds)
        self.dropped = False

    def add(self, sums: torch.Tensor, first_step: int, end_step: int, events: Events) -> dict[str, Any]:
        """One metrics line's gathered sums (ranks x [local s, step s, steps]); returns scalars."""
        out: dict[str, Any] = {}
        steps = float(sums[0, 2])
        if steps <= 0:
            return out
        out |= self._throughput(first_step, steps, float(sums[0, 1]), end_step, events)
        # A launch's first steps (first batches read, allocations, compilation) name nobody.
        if sums.shape[0] > 1 and first_step >= (self.launch_start or first_step) + self.config.reference_skip:
            self.lines.append((sums, end_step))
            out |= self._stragglers(end_step, events)
        return out

    def _stragglers(self, step: int, events: Events) -> dict[str, Any]:
        total = torch.stack([s for s, _ in self.lines]).sum(0)  # ranks x 3 over the window
        local = (total[:, 0] / total[:, 2].clamp(min=1)).tolist()
        step_s = float((total[:, 1] / total[:, 2].clamp(min=1)).mean())
        # The excess is judged against a step at the stage's reference pace when there is one: a
        # slow rank lengthens every rank's step (the others wait for it in the collectives), so a
        # share of the step as measured shrinks the slower the straggler is.
        paced = ""
        if self.reference is not None and self.reference.get("tokens_per_s"):
            reference_s = self.tokens_per_step / self.reference["tokens_per_s"]
            if reference_s < step_s:
                step_s, paced = reference_s, " at the reference pace"
        ratios = []
        for rank, mine in enumerate(local):
            others = statistics.median(local[:rank] + local[rank + 1 :])
            ratio = mine / others if others > 0 else 1.0
            ratios.append(ratio)
            slow = (
                ratio > 1 + self.config.straggler_margin and mine - others >= self.config.straggler_min_share * step_s
            )
            # Cleared only well below the margin: a rank near it is not named and cleared by turns.
            fine = ratio < 1 + self.config.straggler_margin / 2
            full = len(self.lines) == self.config.window
            if slow and full and rank not in self.slow:
                self.slow.add(rank)
                events.emit(
                    "straggler",
                    step,
                    f"straggler: rank {rank} on {self.hosts[rank]} takes {ratio:.2f}x the other ranks' time "
                    f"for its own work (data and optimizer: {1e3 * mine:.1f} ms/step vs a median "
                    f"{1e3 * others:.1f} ms; step {1e3 * step_s:.0f} ms{paced}) over the last "
                    f"{len(self.lines)} metrics lines",
                    rank=rank,
                    host=self.hosts[rank],
                    value=ratio,
                    threshold=1 + self.config.straggler_margin,
                )
            elif fine and full and rank in self.slow:
                self.slow.discard(rank)
                events.emit(
                    "straggler_cleared",
                    step,
                    f"rank {rank} on {self.hosts[rank]} is no longer a straggler ({ratio:.2f}x)",
                    level=logging.INFO,
                    rank=rank,
                    host=self.hosts[rank],
                    value=ratio,
                    threshold=1 + self.config.straggler_margin,
                )
        slowest = max(range(len(ratios)), key=ratios.__getitem__)
        return {"perf/slowest_rank_ratio": ratios[slowest], "perf/slowest_rank": slowest}

    def _throughput(self, first_step: int, steps: float, seconds: float, step: int, events: Events) -> dict[str, Any]:
        """The reference first; then tokens/s over the last `window` lines against it: one line
        (a step that met a slow file, a fast one right after) decides nothing alone."""
        if seconds <= 0:
            return {}
        c, rate = self.config, self.tokens_per_step * steps / seconds
        if self.launch_start is None:
            self.launch_start = first_step
        if self.reference is None:
            start = self.launch_start + c.reference_skip
            if first_step >= start:
                self.samples.append(rate)
            if step >= start + c.reference_steps - 1 and self.samples:
                self.reference = {
                    "tokens_per_s": statistics.median(self.samples),
                    "from_step": start,
                    "to_step": step,
                    "tokens_per_step": self.tokens_per_step,
                    "world_size": len(self.hosts),
                    "measured": time.time(),
                }
                events.emit(
                    "throughput_reference",
                    step,
                    f"throughput reference: {self.reference['tokens_per_s']:,.0f} tokens/s (median of steps "
                    f"{start}..{step}); a fall below {c.throughput_fraction:.0%} of it is flagged",
                    level=logging.INFO,
                    value=self.reference["tokens_per_s"],
                )
            return {}
        if first_step < self.launch_start + c.reference_skip:
            # a resumed launch's warm-up (first batches, allocations, compilation): judged by no
            # reference, as the reference's own warm-up was not (flagged a drop after every resume)
            return {}
        reference = self.reference["tokens_per_s"]
        self.rates.append((first_step, steps, seconds))
        window = self.tokens_per_step * sum(n for _, n, _ in self.rates) / sum(t for _, _, t in self.rates)
        ratio = window / reference
        if ratio < c.throughput_fraction and len(self.rates) == c.window and not self.dropped:
            self.dropped = True
            began = self._began(c.throughput_fraction * reference)
            events.emit(
                "throughput_drop",
                step,
                f"throughput drop: {window:,.0f} tokens/s over the last {len(self.rates)} metrics lines is "
                f"{ratio:.0%} of the stage's reference {reference:,.0f} (steps {self.reference['from_step']}.."
                f"{self.reference['to_step']}), below {c.throughput_fraction:.0%} since step {began}",
                value=window,
                threshold=c.throughput_fraction * reference,
                began_at=began,
                reference=reference,
            )
        elif self.dropped and ratio >= c.throughput_fraction + (1 - c.throughput_fraction) / 2:
            self.dropped = False  # recovered well above the fraction (no flag and clear by turns)
            events.emit(
                "throughput_recovered",
                step,
                f"throughput recovered: {window:,.0f} tokens/s ({ratio:.0%} of the reference)",
                level=logging.INFO,
                value=window,
                threshold=c.throughput_fraction * reference,
            )
        return {"perf/throughput_vs_reference": ratio}

    def _began(self, threshold: float) -> int:
        """Where the fall began: the first step of the window when every line of it is below
        `threshold`, else the change point of the window's (log) rates, the split that leaves
        the least spread on either side (one slow line before fast ones is noise, not the start)."""
        rates = [math.log(self.tokens_per_step * n / t) for _, n, t in self.rates]
        if all(r < math.log(threshold) for r in rates):
            return self.rates[0][0]

        def spread(part: list[float]) -> float:
            mean = sum(part) / len(part)
            return sum((r - mean) ** 2 for r in part)

        splits = [i for i in range(1, len(rates)) if sum(rates[i:]) / (len(rates) - i) < sum(rates[:i]) / i]
        best = min(splits, key=lambda i: spread(rates[:i]) + spread(rates[i:]), default=0)
        return self.rates[best][0]


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
