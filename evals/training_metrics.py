"""A training stage's metrics, as the trainer wrote them: read back, drawn as the stage's loss
curve (the pretrain step, tasks/pretrain.py), and laid end to end over a run's stages
(`stage_rows`, the rows evals/report.py plots and tabulates).

The flow process never reads a stage's whole metrics file (`metrics.jsonl`, one line per
`log_interval` steps: millions of lines at the published scale). It reads the curve file the
trainer writes beside it (`metrics.curve.jsonl`, model/spec.py `curve_path`: about
`CURVE_POINTS` lines at any stage length, the last line always among them); a stage trained
before the curve file existed is streamed a line at a time and downsampled as it is read
(`downsample`), so memory stays bounded either way. A stage of at most `CURVE_POINTS` lines
has every line in its curve: its rows are the metrics file's, with the per-source counts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from model.spec import CURVE_POINTS, curve_path
from pipeline.artifact import Artifact


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    """A JSONL file's objects, a line at a time (a line cut by a crash is skipped)."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if isinstance(row, dict):
                yield row


def downsample(rows: Iterable[dict[str, Any]], points: int = CURVE_POINTS) -> list[dict[str, Any]]:
    """Every k-th row and the last, at most about `points` of them whatever the input's length
    (k doubles each time the kept rows pass `points`); every row when there are no more."""
    kept: list[dict[str, Any]] = []
    stride, last, index = 1, None, 0
    for index, row in enumerate(rows):
        last = row
        if index % stride:
            continue
        kept.append(row)
        if len(kept) > points:
            kept, stride = kept[::2], stride * 2
    if last is not None and (not kept or kept[-1] is not last):
        kept.append(last)
    return kept


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """A stage's metrics rows as the flow process reads them, from its metrics file's path: the
    curve file beside it (model/spec.py `curve_path`), else the metrics file streamed and
    downsampled to about `CURVE_POINTS` rows; none when neither exists."""
    curve = curve_path(path)
    if curve.exists():
        return list(_rows(curve))
    if not path.exists():
        return []
    return downsample(_rows(path))


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A stage's figures from its rows (`read_metrics`): the final loss and per-source tokens
    (its last line), mean tokens/s and MFU over the lines after the first (which carries the
    start-up costs; null if any line found the peak wrong), the last reason MFU was not
    reported, the peak it was taken against."""
    timed = rows[1:] or rows
    speeds = [r["tokens_per_s"] for r in timed if isinstance(r.get("tokens_per_s"), int | float)]
    mfus = [r["mfu"] for r in timed if isinstance(r.get("mfu"), int | float)]
    # One peak serves the whole stage: if any line's rate exceeded it, the peak is wrong for
    # every line, and a mean over the other lines would report a figure against a wrong peak.
    invalid = next((r["mfu_invalid"] for r in reversed(rows) if r.get("mfu_invalid")), None)
    last = rows[-1] if rows else {}
    return {
        "final_loss": last.get("loss"),
        "tokens_per_source": last.get("tokens_per_source", {}),
        "tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
        # The trainer never records MFU above 1: a peak below the achieved rate is wrong, and
        # `mfu_invalid` says so instead.
        "mfu": sum(mfus) / len(mfus) if mfus and invalid is None else None,
        "mfu_invalid": invalid,
        "mfu_peak_flops": last.get("mfu_peak_flops"),
        "mfu_peak_source": last.get("mfu_peak_source"),
    }


def loss_curve(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """One stage's loss against its step, the learning rate on a second axis, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot([r["step"] for r in rows], [r["lr"] for r in rows], color="tab:orange", lw=0.8, alpha=0.7)
    ax2.set_ylabel("lr", color="tab:orange")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def stage_rows(labelled: Sequence[tuple[str, Artifact]]) -> list[dict[str, Any]]:
    """Per stage in training order: where it sits in the run (first step and token), its size
    and metrics rows. Steps and tokens come from the stage's own spec.json."""
    out, step0, token0 = [], 0, 0
    for label, art in labelled:
        spec = json.loads((art.path / "spec.json").read_text(encoding="utf-8"))
        steps = int(spec["steps"])
        per_step = int(spec["global_batch"]) * int(spec.get("seq_len") or art.meta.get("seq_len") or 0)
        out.append(
            {
                "label": label,
                "kind": art.meta.get("kind"),
                "first_step": step0,
                "steps": steps,
                "first_token": token0,
                "tokens": steps * per_step,
                "tokens_per_step": per_step,
                "metrics": read_metrics(art.path / "metrics.jsonl"),
                "meta": art.meta,
                "folder": art.path,
            }
        )
        step0, token0 = step0 + steps, token0 + steps * per_step
    return out
