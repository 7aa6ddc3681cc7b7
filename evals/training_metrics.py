"""A training stage's metrics, as the trainer wrote them (`metrics.jsonl`, one JSON row per
step): read back, drawn as the stage's loss curve (the pretrain step, tasks/pretrain.py), and
laid end to end over a run's stages (`stage_rows`, the rows evals/report.py plots and tabulates).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.artifact import Artifact


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a stage's metrics.jsonl (none when it does not exist; a line cut by a crash
    is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    return rows


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
