"""How the flow process reads a stage's metrics (evals/training_metrics.py): from the curve file
the trainer writes beside the metrics file (trainers/pretrain.py `MetricsWriter`), else the
metrics file streamed and downsampled; the same rows and figures as reading every line on a
short stage, and memory that does not grow with the stage's length on a long one."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

from evals.training_metrics import downsample, read_metrics, stage_rows, summarize
from model.spec import CURVE_POINTS, curve_path, curve_stride
from pipeline.artifact import Artifact
from trainers.pretrain import MetricsWriter

SOURCES = {f"source-{i:02d}": 0 for i in range(8)}


def record(step: int, ranks: int = 0) -> dict:
    """A metrics line as the trainer records it (before the writer splits off the per-source counts)."""
    row = {
        "step": step,
        "loss": 10.0 / (1 + step) ** 0.1,
        "grad_norm": 1.0 + (step % 7) / 10,
        "lr": 3e-4,
        "tokens_per_s": 1000.0 + step % 13,
        "mfu": 0.3 + (step % 5) / 100,
        "mfu_invalid": None,
        "mfu_peak_flops": 1e15,
        "mfu_peak_source": "declared (training.peak_flops)",
        "tokens_per_source": {k: 4096 * step for k in SOURCES},
        "epochs_per_source": {k: step / 1e6 for k in SOURCES},
        "time": 1.7e9 + step,
        "peak_memory_gib": 60.0,
        "skipped": False,
        "skipped_steps": 0,
    }
    if ranks:  # the per-rank list every line carried before the summary
        row["rank_local_s"] = [0.01 + r / 1e5 for r in range(ranks)]
    return row


def todays(path: Path) -> tuple[list[dict], dict]:
    """Every line of a metrics file and the pretrain step's figures from them, as they were read
    before the curve file: the oracle on a short stage."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    timed = rows[1:] or rows
    speeds, mfus = [r["tokens_per_s"] for r in timed], [r["mfu"] for r in timed if r.get("mfu") is not None]
    return rows, {
        "final_loss": rows[-1]["loss"],
        "tokens_per_source": rows[-1].get("tokens_per_source", {}),
        "tokens_per_s": sum(speeds) / len(speeds),
        "mfu": sum(mfus) / len(mfus),
        "mfu_invalid": None,
        "mfu_peak_flops": rows[-1]["mfu_peak_flops"],
        "mfu_peak_source": rows[-1]["mfu_peak_source"],
    }


def stage(folder: Path, steps: int) -> Artifact:
    folder.mkdir(parents=True, exist_ok=True)
    spec = {"steps": steps, "global_batch": 8, "seq_len": 32}
    (folder / "spec.json").write_text(json.dumps(spec))
    return Artifact(kind="checkpoint", uri=str(folder), fingerprint="f" * 64, meta={"kind": "stable"})


def test_a_short_stage_reads_as_every_line_whether_written_before_or_after_the_curve_file(tmp_path):
    old = stage(tmp_path / "old", 40)  # a stage written before the curve file: every line whole
    (old.path / "metrics.jsonl").write_text("".join(json.dumps(record(s, ranks=4)) + "\n" for s in range(1, 41)))
    new = stage(tmp_path / "new", 40)  # the trainer's files now
    writer = MetricsWriter(new.path / "metrics.jsonl", True, 0, curve_stride(40, 1), 1)
    for s in range(1, 41):
        writer.write(record(s), s, s == 40)

    every, figures = todays(old.path / "metrics.jsonl")
    assert read_metrics(old.path / "metrics.jsonl") == every
    assert summarize(read_metrics(old.path / "metrics.jsonl")) == figures
    rows = read_metrics(new.path / "metrics.jsonl")
    assert rows == [record(s) for s in range(1, 41)]  # from the curve file, with the per-source counts
    assert summarize(rows) == todays(curve_path(new.path / "metrics.jsonl"))[1]
    assert summarize(rows) == {**figures, "tokens_per_source": rows[-1]["tokens_per_source"]}
    # the metrics lines themselves leave the per-source counts out
    lines = [json.loads(line) for line in (new.path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{k: v for k, v in r.items() if not k.endswith("_per_source")} for r in rows]
    (one, two) = stage_rows([("one", old), ("two", new)])
    assert one["metrics"] == every and two["metrics"] == rows
    assert (two["first_step"], two["first_token"]) == (40, 40 * 8 * 32)


def test_the_curve_file_keeps_evenly_spaced_lines_and_the_last_one_and_survives_a_resume(tmp_path):
    """5,000 steps logged every 2: 2,500 lines, every third in the curve (at most CURVE_POINTS)
    and the last; a resume at step 3,001 drops the lines after the checkpoint from both files."""
    path = tmp_path / "metrics.jsonl"
    stride = curve_stride(5000, 2)
    assert stride == 3
    writer = MetricsWriter(path, True, 0, stride, 2)
    logged = [*range(2, 5000, 2), 4999]  # the last step of an odd stage length is logged too
    for s in logged[:2000]:
        writer.write(record(s), s, False)
    with path.open("a") as fh:
        fh.write('{"step": 40')  # cut by SIGKILL mid-line
    writer = MetricsWriter(path, True, 3000, stride, 2)  # resumed from the checkpoint of step 3000
    for s in logged[1500:]:
        writer.write(record(s), s, s == 4999)
    lines = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert lines == logged
    curve = [r["step"] for r in read_metrics(path)]
    assert curve == [*logged[:-1:3], 4999] and len(curve) <= CURVE_POINTS + 1


def peak_while(fn) -> tuple[object, int]:
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_flow_process_reads_a_long_stage_in_bounded_memory(tmp_path):
    """200,000 metrics lines (a 3B stage logs millions): without a curve file the stage is
    streamed and downsampled, with one only the curve is read; either way the reader's peak
    (tracemalloc) stays under a bound set by `CURVE_POINTS`, not by the stage's length (the file
    is over 8 times the bound; read whole it would take tens of times it), and the figures
    still come from the last line."""
    bound, lines = 12 * 2**20, 200_000
    art = stage(tmp_path / "long", lines)
    with open(art.path / "metrics.jsonl", "w") as fh:
        for s in range(1, lines + 1):
            fh.write(json.dumps(record(s)) + "\n")
    assert (art.path / "metrics.jsonl").stat().st_size > 8 * bound
    (row,), peak = peak_while(lambda: stage_rows([("stage1", art)]))
    figures, _ = peak_while(lambda: summarize(row["metrics"]))
    assert peak < bound, peak
    steps = [r["step"] for r in row["metrics"]]
    assert steps[0] == 1 and steps[-1] == lines and len(steps) <= 2 * CURVE_POINTS + 1
    assert figures["final_loss"] == record(lines)["loss"]
    assert figures["tokens_per_source"] == record(lines)["tokens_per_source"]
    # the trainer's curve file for the long stage: about CURVE_POINTS lines, read in less still
    art = stage(tmp_path / "curve", 200_000)
    writer = MetricsWriter(art.path / "metrics.jsonl", True, 0, curve_stride(200_000, 1), 1)
    writer.path = tmp_path / "discarded.jsonl"  # the full file is the one measured above
    for s in range(1, 200_001):
        if (s - 1) % writer.stride == 0 or s == 200_000:
            writer.write(record(s), s, s == 200_000)
    rows, peak = peak_while(lambda: read_metrics(art.path / "metrics.jsonl"))
    assert len(rows) == CURVE_POINTS + 1 and rows[-1]["step"] == 200_000 and peak < bound


def test_downsample_keeps_every_row_up_to_its_bound_then_evenly_spaced_ones_and_the_last():
    rows = [{"step": s} for s in range(1, 11)]
    assert downsample(iter(rows), points=10) == rows
    kept = [r["step"] for r in downsample(iter(rows), points=4)]
    assert kept == [1, 5, 9, 10]
    assert downsample(iter([])) == []


def test_one_line_above_the_peak_makes_the_stage_mfu_null_with_the_reason():
    """The CI failure of 2026-12-04: under load, one interval of the tiny DAG ran faster than the
    preflight peak measured on the same busy cores; the stage's MFU was the mean of the other
    lines (0.61) beside a 'peak is wrong' reason. One peak serves the stage, so it is wrong for
    every line: the stage reports no MFU and says why."""
    rows = [record(s) for s in range(1, 6)]
    assert summarize(rows)["mfu"] is not None and summarize(rows)["mfu_invalid"] is None
    why = "the peak is wrong: 5.35e+10 FLOP/s achieved, above the peak of 4.65e+10 FLOP/s (preflight)"
    rows[2] = {**rows[2], "mfu": None, "mfu_invalid": why}
    figures = summarize(rows)
    assert figures["mfu"] is None and figures["mfu_invalid"] == why
    assert figures["tokens_per_s"] == sum(r["tokens_per_s"] for r in rows[1:]) / 4
