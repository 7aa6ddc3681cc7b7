"""The size of a metrics line at the published layout (384 ranks, stage 1's sources), before and
after the per-rank summary, and what a 3B stage writes and the flow process reads.

    python benchmarks/metrics_line.py

Builds real lines with the trainer's own code: `StepReport.record` for a line's fields (the
loader's per-source counts for `mixtures/smollm3/stage1.yaml`'s sources), `SpeedChecks.add` on a
table of 384 fake ranks (rank 17 slower) for the monitor's verdict, `rank_summary` for the line's
summary, and `MetricsWriter` for what lands in `metrics.jsonl` and `metrics.curve.jsonl`. The
"before" line is the same record as it was written before: every rank's seconds and both
per-source dicts on every line. Stage 1 of `smollm3-3b` is 8.1T tokens at 576 x 4096 per step.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model.spec import MonitorConfig, curve_stride  # noqa: E402
from trainers.monitor import Events, SpeedChecks, rank_summary  # noqa: E402
from trainers.pretrain import MetricsWriter, StepReport  # noqa: E402

RANKS, STEPS = 384, 8_100_000_000_000 // (576 * 4096)


class Counts:
    """The loader's per-source counts, as `MixtureLoader` reports them (one entry per source)."""

    def __init__(self, sources: list[str], step: int) -> None:
        self.sources, self.step = sources, step

    def tokens_per_source(self) -> dict[str, int]:
        return {s: 2_359_296 * self.step // (i + 2) for i, s in enumerate(self.sources)}

    def epochs_per_source(self) -> dict[str, float]:
        return {s: self.step / (3.1 * (i + 1)) / 1e4 for i, s in enumerate(self.sources)}


def line_parts(step: int) -> tuple[dict, list[float], list[str], list[str]]:
    """A metrics line's record at `step` (the trainer's own `StepReport.record`, stage 1's
    sources), the 384 ranks' local seconds (rank 17 slower), their hosts, and the sources."""
    sources = list(yaml.safe_load((REPO / "mixtures/smollm3/stage1.yaml").read_text())["weights"])
    hosts = [f"ip-10-0-{r // 8 // 256}-{r // 8 % 256}" for r in range(RANKS)]
    report = StepReport("stage1", STEPS, 576 * 4096, 6 * 3.08e9, 989e12 * RANKS, "datasheet (H100 SXM bf16)", 989e12)
    record = report.record(step, 2.0123456789, 0.31234567, 1.98765e-4, 5_312_345.678, Counts(sources, step))
    record |= {"skipped": False, "skipped_steps": 0}
    local = [0.0123456789 + (r % 7) * 1.3e-4 + (0.02 if r == 17 else 0.0) for r in range(RANKS)]
    return record, local, hosts, sources


def summary_line(step: int) -> dict:
    """The line as the trainer writes it now: the record with its per-rank summary."""
    record, local, hosts, _ = line_parts(step)
    return {**record, "rank_local": rank_summary(local, hosts)}


def main() -> None:
    step = 1_234_567
    record, local, hosts, sources = line_parts(step)
    table = torch.tensor([[x * 10, 4.4, 10.0] for x in local], dtype=torch.float64)
    config = MonitorConfig(window=3, reference_skip=0, reference_steps=1, confirm=1)
    with tempfile.TemporaryDirectory() as tmp:
        checks = SpeedChecks(config, hosts, 576 * 4096, None)
        for line in range(3):
            checks.add(table, 10 * line + 1, 10 * line + 10, Events(Path(tmp), "stage1", True))
        before = json.dumps({**record, "rank_local_s": local})
        summary = {**record, "rank_local": rank_summary(local, hosts)}
        writer = MetricsWriter(Path(tmp) / "metrics.jsonl", True, 0, curve_stride(STEPS, 1), 1)
        writer.write(summary, step, True)
        writer.write({**summary, "rank_local_s": local}, step, False)
        after, flagged = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
        curve = (Path(tmp) / "metrics.curve.jsonl").read_text().splitlines()[0]
    named = sorted(checks.slow)
    sizes = {k: len(v) + 1 for k, v in (("before", before), ("after", after), ("flagged", flagged), ("curve", curve))}
    print(f"{RANKS} ranks, {len(sources)} sources, stage 1: {STEPS:,} steps; rank(s) named: {named}")
    print(f"metrics line before: {sizes['before']:,} bytes (every rank's seconds, both per-source dicts)")
    print(f"metrics line after:  {sizes['after']:,} bytes (summary: min, median, max, slowest rank and host)")
    print(f"  a line while a rank is flagged: {sizes['flagged']:,} bytes; a curve line: {sizes['curve']:,} bytes")
    for interval in (1, 10):
        lines = -(-STEPS // interval)
        points = -(-lines // curve_stride(STEPS, interval)) + 1
        print(
            f"log_interval {interval}: {lines:,} lines; metrics.jsonl {sizes['before'] * lines / 1e9:.1f} GB before, "
            f"{sizes['after'] * lines / 1e9:.2f} GB after; the curve file {points:,} lines, "
            f"{sizes['curve'] * points / 1e6:.1f} MB (what the flow process reads)"
        )


if __name__ == "__main__":
    main()
