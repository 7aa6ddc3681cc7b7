"""The run-wide views as tables and a plot: one eval table over every model (headline metric ±
stderr per task, with each task's random baseline and items scored), one loss curve over every
stage, the stage table.

The run_report step (tasks/run_report.py) writes them into its folder; `smollm3 summary` and
`smollm3 report` (flows/views.py) and the comparisons (flows/compare.py) print them from the same
functions. A stage row is what evals/training_metrics.py `stage_rows` reads from a training stage.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evals.benchmarks.arithmetic_exact import GENERATION_TASK, THINK_TASK
from evals.harness import headline_metric, items_scored
from pipeline.artifact import Artifact


def eval_rows(labelled: Sequence[tuple[str, Artifact]]) -> list[dict[str, Any]]:
    """One row per (model, task): the headline metric, score, stderr, items, random baseline.

    Evaluations made before `items` and `random_baseline` were recorded read the items from
    lm-eval's results file and take 1 / choices (the suite's) as the multiple-choice baseline."""
    rows = []
    for label, art in labelled:
        meta = art.meta
        items = meta.get("items") or _items(art)
        random = meta.get("random_baseline") or {}
        for task, metrics in meta.get("scores", {}).items():
            metric = headline_metric(task, metrics)
            if metric is None:
                continue
            base = random.get(task)
            if base is None and task not in random:
                base = 0.0 if metric == "exact_match" else meta.get("random_accuracy")
            rows.append(
                {
                    "model": label,
                    "task": task,
                    "metric": metric,
                    "score": metrics[metric],
                    "stderr": metrics.get(f"{metric}_stderr"),
                    "items": items.get(task),
                    "random": base,
                    # think-mode tasks: mean tokens in the <think> block, share closing it
                    "think_tokens": metrics.get("think_tokens"),
                    "think_closed": metrics.get("think_closed"),
                }
            )
    return rows


def _items(art: Artifact) -> dict[str, int]:
    try:
        return items_scored(art.path / "lm_eval_results.json")
    except ValueError:  # an artifact only on S3
        return {}


def _task_order(task: str) -> tuple:
    """Columns: cloze tasks, passkeys by length (those past the trained length last), generation
    (no-think, then think mode), then other (hub) tasks."""
    if task.endswith("_cloze"):
        return (0, task)
    if task.startswith("passkey_") and task[8:].isdigit():
        return (1, int(task[8:]))
    if task.startswith("passkey_beyond_") and task[15:].isdigit():
        return (1, 1 << 30, int(task[15:]))
    if task in (GENERATION_TASK, THINK_TASK):
        return (2, task)
    return (3, task)


def _columns(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task (in `_task_order`): its metric and the usual random baseline."""
    tasks = sorted({r["task"] for r in rows}, key=_task_order)
    out = []
    for task in tasks:
        mine = [r for r in rows if r["task"] == task]
        random = Counter(r["random"] for r in mine).most_common(1)[0][0]
        out.append({"task": task, "metric": mine[0]["metric"], "random": random})
    return out


def _cell(row: dict[str, Any] | None, column: dict[str, Any], per_task_items: bool) -> str:
    if row is None:
        return "-"
    text = f"{row['score']:.3f}" + (f"±{row['stderr']:.3f}" if row["stderr"] is not None else "")
    notes = []
    if per_task_items:
        notes.append(f"n={row['items'] if row['items'] is not None else '?'}")
    if row["random"] is not None and (column["random"] is None or abs(row["random"] - column["random"]) > 0.005):
        notes.append(f"random {row['random']:.3f}")
    if row.get("think_tokens") is not None:
        notes.append(f"think {row['think_tokens']:.1f} tok")
    if row.get("think_closed") is not None:
        notes.append(f"{row['think_closed']:.0%} closed")
    return text + (f" ({', '.join(notes)})" if notes else "")


def _matrix(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """(header, body) of the table: two head rows (metric, random), then the models, each with
    the items it was scored on in its last column (or per cell, `n=`, where its tasks differ)."""
    columns = _columns(rows)
    models = list(dict.fromkeys(r["model"] for r in rows))
    at = {(r["model"], r["task"]): r for r in rows}
    header = ["model", *(c["task"] for c in columns), "items"]

    def fmt(value: Any) -> str:
        return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)

    body = [["metric", *(c["metric"] for c in columns), ""], ["random", *(fmt(c["random"]) for c in columns), ""]]
    for m in models:
        counts = {r["items"] for r in rows if r["model"] == m}
        varies = len(counts) > 1
        items = "per task" if varies else fmt(next(iter(counts)))
        body.append([m, *(_cell(at.get((m, c["task"])), c, varies) for c in columns), items])
    return header, body


def eval_table_text(rows: list[dict[str, Any]], parents: Sequence[tuple[str, str]] = ()) -> str:
    """The eval table as aligned text (the CLI's); with `parents`, then the change of each
    post-trained model from the model its step started from (`moves_text`)."""
    if not rows:
        return "no evaluations in this run"
    header, body = _matrix(rows)
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in [header, *body]
    ]
    lines.insert(3, "")  # between the column heads and the models
    return (
        "\n".join(line.rstrip() for line in lines)
        + (
            "\n\nscore ± stderr of each task's metric, on the items of its row (per task: n= in each "
            f"cell; {THINK_TASK}: think mode, with the mean think length and the share closing it); a model is ahead of another, or of random, only by more than about two stderr"
        )
        + _after(moves_text(rows, parents))
    )


def eval_table_markdown(rows: list[dict[str, Any]], parents: Sequence[tuple[str, str]] = ()) -> str:
    """The eval table as markdown (the UI's and the report file's); with `parents`, as
    `eval_table_text`."""
    if not rows:
        return "No evaluations in this run."
    header, body = _matrix(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, line in enumerate(body):
        cells = [f"*{c}*" if c else c for c in line] if i < 2 else line
        lines.append("| " + " | ".join(cells) + " |")
    return (
        "\n".join(lines)
        + (
            "\n\nScore ± stderr of each task's metric, on the items of its row (`items`; per task: "
            "n= in each cell) (acc_norm: length-normalised accuracy; "
            f"{GENERATION_TASK}: exact match of the final answer, no-think mode; {THINK_TASK}: the same in "
            "think mode, the answer after the closed think block, with the mean think length in tokens "
            "and the share of answers closing the block). A difference smaller than about two "
            "stderr, to another model or to the random baseline, is noise."
        )
        + _after(moves_text(rows, parents).replace("\n", "\n- ").replace(":\n", ":\n\n", 1))
    )


def _after(text: str) -> str:
    return f"\n\n{text}" if text else ""


# --- did a post-training step move the scores? ----------------------------------------------

NOISE_Z = 2.0  # a change of more than this many combined stderr is more than noise
BASE = "base"  # the eval label of the model post-training starts from
BEFORE_REASONING = "before-reasoning"  # ...and of the one the reasoning stages started from


def moves(rows: list[dict[str, Any]], parents: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """Per (model, parent) of `parents` (a post-trained model and the model its step started
    from, scored on the same items): each shared task's change, score - parent's, in units of the
    combined stderr sqrt(se^2 + se_parent^2) (`z`; unpaired, so cautious: both were scored on the
    same items), and whether any task moved by more than `NOISE_Z` of them (`moved`).

    On exact match a change moves the task only when the higher of the two scores also beats the
    task's random baseline, the constant guess (the most common answer's share of the items), by
    more than `NOISE_Z` of its own stderr (`beyond_guess`): going from no right answer to always
    saying the most common number is no learning."""
    at = {(r["model"], r["task"]): r for r in rows}
    out = []
    for model, parent in parents:
        changes = []
        for task in sorted({r["task"] for r in rows if r["model"] == model}, key=_task_order):
            a, b = at.get((model, task)), at.get((parent, task))
            if b is None or a["stderr"] is None or b["stderr"] is None:
                continue
            diff = a["score"] - b["score"]
            se = (a["stderr"] ** 2 + b["stderr"] ** 2) ** 0.5
            z = diff / se if se > 0 else (0.0 if diff == 0 else float("inf") if diff > 0 else float("-inf"))
            change = {"task": task, "diff": diff, "z": z}
            if a["metric"] == "exact_match" and a["random"] is not None:
                top = max(a, b, key=lambda r: r["score"])
                change["guess"] = a["random"]
                change["beyond_guess"] = top["score"] - a["random"] > NOISE_Z * top["stderr"]
            changes.append(change)
        if changes:
            moved = any(_moved(c) for c in changes)
            out.append({"model": model, "parent": parent, "changes": changes, "moved": moved})
    return out


def _moved(change: dict[str, Any]) -> bool:
    return abs(change["z"]) > NOISE_Z and change.get("beyond_guess", True)


def moves_text(rows: list[dict[str, Any]], parents: Sequence[tuple[str, str]]) -> str:
    """One line per post-trained model: the tasks it moved beyond noise from the model its step
    started from, or a flag that it moved none (with its largest change)."""
    lines = []
    for m in moves(rows, parents):
        step = f"{m['model']} vs {m['parent']}:"
        if m["moved"]:
            big = [c for c in m["changes"] if _moved(c)]
            lines.append(f"{step} " + ", ".join(f"{c['task']} {c['diff']:+.3f} ({c['z']:+.1f} se)" for c in big))
        else:
            c = max(m["changes"], key=lambda c: abs(c["z"]))
            guess = (
                f", within noise of the constant guess {c['guess']:.3f}"
                if abs(c["z"]) > NOISE_Z and not c.get("beyond_guess", True)
                else ""
            )
            lines.append(
                f"{step} NO CHANGE BEYOND NOISE on any task (largest: {c['task']} {c['diff']:+.3f}, "
                f"{c['z']:+.1f} se{guess})"
            )
    if not lines:
        return ""
    reasoning = (
        f" (and the reasoning stages: base vs {BEFORE_REASONING})" if (BASE, BEFORE_REASONING) in parents else ""
    )
    return (
        f"Change from the model each post-training step{reasoning} started from, on the same items (score difference, "
        f"in combined stderr; beyond {NOISE_Z:g} is more than noise; on exact match, only where a score also "
        f"beats the constant guess, the task's random, by {NOISE_Z:g} stderr):\n" + "\n".join(lines)
    )


# --- the run's loss curve ---------------------------------------------------------------------


def run_series(stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per stage, its metrics on the run's axis: x = the optimizer step of the whole run."""
    return [
        {
            "label": st["label"],
            "x": [st["first_step"] + r["step"] for r in st["metrics"]],
            "loss": [r["loss"] for r in st["metrics"]],
            "lr": [r["lr"] for r in st["metrics"]],
        }
        for st in stages
    ]


def plot_run_loss(stages: list[dict[str, Any]], path: Path, title: str = "loss over the run") -> Path:
    """Loss and learning rate against the run's optimizer step, stage boundaries marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import EngFormatter, MaxNLocator

    fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
    lr_ax = ax.twinx()
    total = sum(st["steps"] for st in stages) or 1
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (st, series) in enumerate(zip(stages, run_series(stages), strict=True)):
        x = series["x"]
        ax.plot(x, series["loss"], lw=1.4, color=colors[i % len(colors)], label=st["label"])
        lr_ax.plot(x, series["lr"], lw=0.9, ls="--", color="tab:gray")
        if i:
            ax.axvline(st["first_step"], color="black", lw=0.6, alpha=0.4)
        ax.annotate(
            st["label"],
            (st["first_step"] + st["steps"] / 2, 0.98),
            xycoords=("data", "axes fraction"),
            ha="center",
            va="top",
            fontsize=8,
            rotation=90 if st["steps"] < total / 12 else 0,
        )
    ax.set_xlabel("optimizer step (whole run)")
    ax.set_ylabel("training loss")
    lr_ax.set_ylabel("learning rate (dashed)", color="tab:gray")
    ax.grid(alpha=0.3)
    if stages:
        last = stages[-1]
        ax.set_xlim(0, last["first_step"] + last["steps"])
        # Tokens on top: piecewise linear in steps (tokens per step change with sequence length).
        steps = [0, *(s["first_step"] + s["steps"] for s in stages)]
        tokens = [0, *(s["first_token"] + s["tokens"] for s in stages)]
        top = ax.secondary_xaxis(
            "top", functions=(lambda s: np.interp(s, steps, tokens), lambda t: np.interp(t, tokens, steps))
        )
        top.set_xlabel("tokens", fontsize=8)
        top.xaxis.set_major_formatter(EngFormatter(sep=""))
        top.xaxis.set_major_locator(MaxNLocator(6))
        top.tick_params(labelsize=7)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def stages_markdown(stages: list[dict[str, Any]]) -> str:
    lines = [
        "| stage | kind | steps (run) | tokens | final loss | tokens/s | MFU (peak) |",
        "|---|---|---|---|---|---|---|",
    ]
    for st in stages:
        m = st["meta"]
        mfu = m.get("mfu")
        peak = m.get("mfu_peak_source")
        mfu_text = "n/a" if mfu is None else f"{mfu:.1%}" + (" **(> 100%: wrong peak)**" if mfu > 1 else "")
        if peak:
            mfu_text += f" ({peak})"
        loss = m.get("final_loss")
        speed = m.get("tokens_per_s")
        lines.append(
            f"| {st['label']} | {st['kind'] or '-'} | {st['first_step'] + 1}-{st['first_step'] + st['steps']} | "
            f"{st['tokens']:,} | {'-' if loss is None else f'{loss:.4f}'} | "
            f"{'-' if speed is None else f'{speed:,.0f}'} | {mfu_text} |"
        )
    return "\n".join(lines)
