"""Two runs side by side: `smollm3 compare RUN_A RUN_B` (and a Prefect markdown artifact).

From lineage alone (the runs' resolved recipes, their training stages and evaluations):
- the config differences: every recipe field whose value differs, by its override path
  (`training.optimizer.lr`, `stages.long2.tokens`; list items by name), A's value then B's;
- both loss curves on one plot against tokens seen (the axis that stays comparable when batch
  or sequence length differ), each run's stages marked, written next to the report;
- the eval tables side by side: per evaluated model and task, A's and B's headline metric ±
  stderr, B - A ± the stderr of the difference (sqrt(se_A^2 + se_B^2), the runs independent),
  and whether the difference is more than twice that: otherwise it is noise.

One run's numbers are one draw: seed noise is not in these stderrs (they are the eval items'
sampling noise). Comparisons that need it are ablations with seeds (`smollm3 ablate`,
docs/ablations.md).
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

from pipeline.lineage import Lineage


def _config(run: dict[str, Any]) -> dict[str, Any]:
    config = run.get("config") or {}
    return json.loads(config) if isinstance(config, str) else config


def flatten(value: Any, path: str = "") -> dict[str, Any]:
    """Leaf values by override path; lists of named items (sources, stages) by their names."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out |= flatten(item, f"{path}.{key}" if path else str(key))
        return out or {path: {}}
    if isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
        out = {}
        for item in value:
            out |= flatten({k: v for k, v in item.items() if k != "name"}, f"{path}.{item['name']}")
        return out
    return {path: value}


def config_differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(path, A's value, B's value) of every field that differs; absent on one side is None.
    The workspace and the recipe's name are where a run was kept, not what it computed."""
    fa, fb = flatten(a), flatten(b)
    keys = sorted(set(fa) | set(fb))
    return [(k, fa.get(k), fb.get(k)) for k in keys if fa.get(k) != fb.get(k) and k not in ("workspace", "name")]


def _value(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, dict | list) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- evals ---------------------------------------------------------------------------------------


def eval_pairs(rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, task) in either run: both scores and stderrs, the difference and its noise."""
    at_a = {(r["model"], r["task"]): r for r in rows_a}
    at_b = {(r["model"], r["task"]): r for r in rows_b}
    order = list(dict.fromkeys([*at_a, *at_b]))
    out = []
    for key in order:
        a, b = at_a.get(key), at_b.get(key)
        row: dict[str, Any] = {"model": key[0], "task": key[1], "metric": (a or b)["metric"], "a": a, "b": b}
        if a and b and a["metric"] == b["metric"]:
            row["diff"] = b["score"] - a["score"]
            se = [r["stderr"] for r in (a, b)]
            row["se"] = math.sqrt(se[0] ** 2 + se[1] ** 2) if None not in se else None
            row["signal"] = row["se"] is not None and abs(row["diff"]) > 2 * row["se"]
        out.append(row)
    return out


def _score(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    think = ""  # think-mode tasks: mean think length and the share of answers closing the block
    if r.get("think_tokens") is not None and r.get("think_closed") is not None:
        think = f", think {r['think_tokens']:.1f} tok, {r['think_closed']:.0%} closed"
    stderr = f"±{r['stderr']:.3f}" if r["stderr"] is not None else ""
    return f"{r['score']:.3f}{stderr} (n={r['items']}{think})"


def _diff(row: dict[str, Any]) -> tuple[str, str]:
    if "diff" not in row:
        return "-", "only in one run"
    se = row["se"]
    text = f"{row['diff']:+.3f}" + (f"±{se:.3f}" if se is not None else "")
    if se is None:
        return text, "noise unknown (no stderr)"
    return text, f"beyond noise ({abs(row['diff']) / se:.1f} se)" if row["signal"] else "within noise"


# --- loss curves ---------------------------------------------------------------------------------


def plot_losses(runs: list[tuple[str, list[dict[str, Any]]]], path: Path) -> Path:
    """Both runs' training loss against tokens seen, one color per run, stages marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
    for (name, stages), color, style in zip(runs, ("tab:blue", "tab:orange"), ("-", "--"), strict=False):
        for i, st in enumerate(stages):
            x = [st["first_token"] + r["step"] * st["tokens_per_step"] for r in st["metrics"]]
            ax.plot(
                x, [r["loss"] for r in st["metrics"]], ls=style, lw=1.3, color=color, label=name if i == 0 else None
            )
            if i:
                ax.axvline(st["first_token"], color=color, lw=0.5, alpha=0.4, ls=style)
    ax.set_xlabel("tokens seen")
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("loss over the runs (stage boundaries: thin lines)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _stages(lineage: Lineage, run_id: str) -> tuple[list[dict[str, Any]], str | None]:
    from evals.training_metrics import stage_rows

    try:
        return stage_rows(lineage.labelled_outputs(run_id, "pretrain")), None
    except (OSError, ValueError) as exc:  # stage folders deleted, or only on S3
        return [], f"run {run_id[:8]}: a stage folder is not readable here ({exc})"


# --- the comparison ------------------------------------------------------------------------------


def compare_runs(lineage: Lineage, ref_a: str, ref_b: str, out: Path) -> dict[str, Any]:
    """The comparison of two runs as text (the terminal's) and markdown (the report file and the
    Prefect artifact), the loss plot written beside `out`."""
    from evals.report import eval_rows
    from flows.views import find_run

    runs = [find_run(lineage, ref) for ref in (ref_a, ref_b)]
    ids = [r["run_id"] for r in runs]
    names = [f"A {i[:8]}" for i in ids[:1]] + [f"B {i[:8]}" for i in ids[1:]]
    diffs = config_differences(_config(runs[0]), _config(runs[1]))
    stages, notes = [], []
    for run_id in ids:
        rows, note = _stages(lineage, run_id)
        stages.append(rows)
        notes += [note] if note else []
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = plot_losses(list(zip(names, stages, strict=True)), out.with_name(f"{out.stem}-loss.png"))
    pairs = eval_pairs(*(eval_rows(lineage.labelled_outputs(i, "evaluate")) for i in ids))
    finals = _final_losses(stages)
    text = _text(runs, names, diffs, finals, pairs, png, notes)
    markdown = _markdown(runs, names, diffs, finals, pairs, png, notes)
    out.write_text(markdown + "\n", encoding="utf-8")
    return {"text": text, "markdown": markdown, "report": out, "plot": png, "runs": ids, "pairs": pairs}


def _final_losses(stages: list[list[dict[str, Any]]]) -> list[tuple[str, float | None, float | None]]:
    labels = list(dict.fromkeys(st["label"] for run in stages for st in run))
    last = [{st["label"]: (st["metrics"][-1]["loss"] if st["metrics"] else None) for st in run} for run in stages]
    return [(label, last[0].get(label), last[1].get(label)) for label in labels]


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _text(runs, names, diffs, finals, pairs, png, notes) -> str:
    lines = [
        f"{n}: run {r['run_id']}  {r['flow']}  recipe={r['recipe']}  {r['state']}"
        for n, r in zip(names, runs, strict=True)
    ]
    lines += ["", f"== config differences ({len(diffs)}) =="]
    lines += [f"  {k}: {_value(a)} -> {_value(b)}" for k, a, b in diffs] or ["  none: the same resolved recipe"]
    lines += ["", "== final training loss per stage (A, B) =="]
    lines += [f"  {label:<12} {_loss(a):>8}  {_loss(b):>8}" for label, a, b in finals] or ["  no training stages"]
    lines += [f"  loss curves of both: {png}", "", "== evals side by side (headline metric ± stderr) =="]
    width = max([len(f"{p['model']} {p['task']}") for p in pairs] + [10])
    for p in pairs:
        diff, verdict = _diff(p)
        lines.append(
            f"  {p['model'] + ' ' + p['task']:<{width}}  A {_score(p['a']):<22} B {_score(p['b']):<22} "
            f"B-A {diff:<14} {verdict}"
        )
    if not pairs:
        lines.append("  no evaluations in either run")
    lines += ["", _NOISE, *notes]
    return "\n".join(lines)


_NOISE = (
    "B-A ± sqrt(se_A^2 + se_B^2): beyond noise when more than twice that. These stderrs are the "
    "eval items' sampling noise only; seed noise needs runs with several seeds (smollm3 ablate)."
)


def _markdown(runs, names, diffs, finals, pairs, png, notes) -> str:
    md = [f"# Runs compared: {names[0]} vs {names[1]}", ""]
    md += [
        f"- **{n}**: `{r['run_id']}` {r['flow']}, recipe `{r['recipe']}`, {r['state']}"
        for n, r in zip(names, runs, strict=True)
    ]
    md += ["", f"## Config differences ({len(diffs)})", ""]
    if diffs:
        md += [
            "| field | A | B |",
            "|---|---|---|",
            *(f"| `{k}` | `{_value(a)}` | `{_value(b)}` |" for k, a, b in diffs),
        ]
    else:
        md.append("None: the same resolved recipe.")
    md += ["", "## Loss", ""]
    if png.exists():
        md.append(f"![loss over both runs](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()})")
    md += ["", "| stage | final loss A | final loss B |", "|---|---|---|"]
    md += [f"| {label} | {_loss(a)} | {_loss(b)} |" for label, a, b in finals]
    md += [
        "",
        "## Evals side by side",
        "",
        "| model | task | metric | A | B | B - A | |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in pairs:
        diff, verdict = _diff(p)
        md.append(
            f"| {p['model']} | {p['task']} | {p['metric']} | {_score(p['a'])} | {_score(p['b'])} | {diff} | {verdict} |"
        )
    md += ["", _NOISE, *(f"\n{n}" for n in notes)]
    return "\n".join(md)


def publish(result: dict[str, Any]) -> str:
    """The comparison as a Prefect markdown artifact, made by a short `compare` flow run (Prefect
    attaches artifacts to runs); returns its key."""
    from prefect import flow
    from prefect.artifacts import create_markdown_artifact

    a, b = (i[:8] for i in result["runs"])
    key = f"compare-{a}-{b}".lower()

    def compare(run_a: str, run_b: str) -> str:
        create_markdown_artifact(markdown=result["markdown"], key=key, description=f"runs {a} and {b} compared")
        return key

    return flow(name="compare", flow_run_name=f"{a} vs {b}", log_prints=False)(compare)(*result["runs"])
