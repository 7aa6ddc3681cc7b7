"""Plain-text views of lineage for the CLI: ancestor trees, run listings, the demo summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.artifact import find_marker
from pipeline.lineage import Lineage
from pipeline.workspace import check_run_id


def _facts(meta: Any, limit: int = 5) -> str:
    if isinstance(meta, str):
        meta = json.loads(meta)
    scalars = [
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in (meta or {}).items()
        if isinstance(v, int | float) or (isinstance(v, str) and len(v) <= 40)
    ]
    return " ".join(scalars[:limit])


def model_path(row: dict[str, Any]) -> str | None:
    """The folder `AutoModelForCausalLM.from_pretrained` loads, for a model artifact row (its
    `model_dir`: the step folder holds the model one level down, in `model/`)."""
    meta = row.get("meta")
    if isinstance(meta, str):
        meta = json.loads(meta)
    return (meta or {}).get("model_dir") if row.get("kind") == "hf_model" else None


def _line(row: dict[str, Any]) -> str:
    label = f"[{row['label']}]" if row.get("label") else ""
    where = model_path(row) or row["uri"]  # a model: the path that loads, not its step folder
    return f"{row['kind']} {row['fingerprint'][:12]}  {row['step']}{label}  {where}  {_facts(row['meta'])}".rstrip()


def resolve_artifact(lineage: Lineage, ref: str) -> dict[str, Any]:
    """An artifact row from a fingerprint (or prefix) or a path inside a step folder."""
    path = Path(ref)
    if path.exists():
        row = lineage.artifact_by_uri(path)
        if row is None:
            record = find_marker(path)
            if record is not None:
                row = lineage.artifact(record["artifact"]["fingerprint"])
        if row is None:
            raise LookupError(f"{ref} is not inside any step folder recorded in {lineage.path}")
        return row
    if len(ref) < 4 or any(c not in "0123456789abcdef" for c in ref.lower()):
        raise LookupError(f"{ref!r} is neither an existing path nor a fingerprint prefix")
    row = lineage.artifact(ref.lower())
    if row is None:
        raise LookupError(f"no artifact with fingerprint {ref!r} in {lineage.path}")
    return row


def tree(lineage: Lineage, root: dict[str, Any], descendants: bool = False, full: bool = False) -> str:
    """The ancestor (or descendant) tree of one artifact, one line per artifact.

    Lineage is a DAG (every shard descends from the shared tokenizer): each artifact is printed
    once, where it is first reached; a later edge to it is counted in a closing line, or, with
    `full`, printed as a single line marked `(above)`.
    """
    step = lineage.children if descendants else lineage.parents
    shown = {root["fingerprint"]}
    hidden = 0

    def build(fp: str) -> list[tuple[dict[str, Any], list | None]]:
        nonlocal hidden
        children: list[tuple[dict[str, Any], list | None]] = []
        for row in step(fp):
            if row["fingerprint"] in shown:  # reached again: its subtree is printed already
                hidden += 1
                if full:
                    children.append((row, None))
                continue
            shown.add(row["fingerprint"])
            children.append((row, build(row["fingerprint"])))
        return children

    lines = [_line(root)]

    def render(children: list, prefix: str) -> None:
        for i, (row, below) in enumerate(children):
            last = i == len(children) - 1
            text = f"{row['kind']} {row['fingerprint'][:12]}  (above)" if below is None else _line(row)
            lines.append(prefix + ("└── " if last else "├── ") + text)
            if below:
                render(below, prefix + ("    " if last else "│   "))

    render(build(root["fingerprint"]), "")
    if hidden and not full:
        lines.append(f"({hidden} more edge(s) to artifacts listed above; `smollm3 lineage --full` prints them)")
    return "\n".join(lines)


def runs_table(lineage: Lineage, limit: int = 20, steps: bool = True) -> str:
    out = []
    for run in lineage.runs(limit):
        ended = run["ended"].strftime("%H:%M:%S") if run["ended"] else "-"
        out.append(
            f"{run['run_id']}  {run['flow']}/{run['deployment'] or '-'}  recipe={run['recipe']}  "
            f"{run['state']}  started {run['started']:%Y-%m-%d %H:%M:%S}  ended {ended}"
        )
        if steps:
            for s in lineage.steps_of(run["run_id"]):
                name = s["step"] + (f"[{s['label']}]" if s["label"] else "")
                err = f"  {s['error'][:120]}" if s["error"] else ""
                out.append(f"    {name:<26} {s['state']:<9} {(s['fingerprint'] or '')[:12]}  {s['seconds']:7.1f}s{err}")
    return "\n".join(out) if out else f"no runs recorded in {lineage.path}"


def eval_table(lineage: Lineage, run_id: str, markdown: bool = False) -> str:
    """Every model a run evaluated (rows: stages, then post-trained models) on every task
    (columns): each task's one metric, score ± stderr, with the random baseline and the items
    scored. The same table as the run report step's (tasks/run_report.py), from the same
    evaluate artifacts, with its flags of post-training steps that moved no score beyond noise
    once the run has its report."""
    from evals.report import eval_rows, eval_table_markdown, eval_table_text

    rows = eval_rows(lineage.labelled_outputs(run_id, "evaluate"))
    parents = _started_from(lineage, run_id)
    return eval_table_markdown(rows, parents) if markdown else eval_table_text(rows, parents)


# The RL steps and the reward whose trend each keeps (trainers/posttrain/common.py `reward_trend`):
# GRPO's exact-match reward (its format reward is shaping), SAO's reward (exact match plus the
# weighted format reward: the one reward its samples carry).
RL_REWARDS = {
    "grpo": ("exact-match reward", "exact_reward_by_part", "exact_reward_trend"),
    "sao": ("reward", "reward_by_part", "reward_trend"),
}
_TREND_SAID = {"rose": "ROSE beyond 2 stderr", "fell": "FELL beyond 2 stderr", "flat": "NO RISE beyond 2 stderr"}


def rl_rewards(lineage: Lineage, run_id: str, markdown: bool = False) -> str:
    """Did each RL step's reward rise? Per GRPO and SAO step of the run: its reward by quarter
    (or half) of its updates, mean ± stderr, and the verdict on last share - first share, from the
    step's meta (`reward_trend`). Empty when the run has no RL step."""
    rows = []
    for step, (reward, parts_key, trend_key) in RL_REWARDS.items():
        for label, art in lineage.labelled_outputs(run_id, step):
            parts, trend = art.meta.get(parts_key), art.meta.get(trend_key)
            updates = art.meta.get("steps")
            name = f"{step}[{label}]" if label != step else step
            if parts:
                share = {4: "quarter", 2: "half"}.get(len(parts), f"1/{len(parts)}")
                by = f"by {share}: " + ", ".join(f"{m:.3f} ± {e:.3f}" for m, e in parts)
                verdict = _TREND_SAID.get(trend, str(trend))
            elif trend_key in art.meta:  # too few updates for a trend (reward_trend)
                by, verdict = "", "too few for a trend"
            else:
                by, verdict = "", "not recorded (built before the trend was kept)"
            rows.append((name, reward, updates, by, verdict))
    if not rows:
        return ""
    if markdown:
        head = ["| step | reward | updates | mean ± stderr | verdict |", "|---|---|---|---|---|"]
        return "\n".join(head + [f"| {n} | {r} | {u} | {b or '-'} | {v} |" for n, r, u, b, v in rows])
    return "\n".join(f"{n}: {r} over {u} updates{', ' + b if b else ''}: {v}" for n, r, u, b, v in rows)


def _started_from(lineage: Lineage, run_id: str) -> tuple[tuple[str, str], ...]:
    """The run report's (post-trained model, model its step started from) labels, once the run
    has its report (tasks/run_report.py `parents`)."""
    for _, art in lineage.labelled_outputs(run_id, "run_report"):
        rows = lineage.query_dicts("SELECT config FROM artifacts WHERE fingerprint = ?", [art.fingerprint])
        config = json.loads(rows[0]["config"]) if rows and rows[0]["config"] else {}
        return tuple((str(a), str(b)) for a, b in config.get("parents") or ())
    return ()


def final_artifact(lineage: Lineage, run_id: str) -> dict[str, Any] | None:
    """The run's last exported model, else its newest artifact."""
    for kind in ("hf_model", None):
        outputs = lineage.labelled_outputs(run_id, kind=kind)
        if outputs:
            return lineage.artifact(outputs[-1][1].fingerprint)
    return None


def summary(lineage: Lineage, ui_url: str | None) -> str:
    """What `make demo` prints at the end: the newest run, its steps, eval scores per stage, the
    RL steps' reward by quarter (`rl_rewards`) and the lineage of the final model."""
    runs = lineage.runs(1)
    if not runs:
        return f"no runs recorded in {lineage.path}"
    run = runs[0]
    parts = ["== newest run ==", runs_table(lineage, 1), "", "== eval scores ==", eval_table(lineage, run["run_id"])]
    rl = rl_rewards(lineage, run["run_id"])
    if rl:
        parts += ["", "== RL reward ==", rl]
    final = final_artifact(lineage, run["run_id"])
    if final:
        parts += ["", f"== lineage of the final {final['kind']} ==", tree(lineage, final)]
        if model_path(final):
            parts += ["", f"final model:  {model_path(final)}  (AutoModelForCausalLM.from_pretrained loads it)"]
    rejected = lineage.rejected_events()
    if rejected:
        parts += ["", f"lineage journal: {rejected} event(s) rejected, never applied (table _journal_rejected)"]
    parts += ["", "== where to look =="]
    if ui_url:
        parts.append(f"Prefect UI:   {ui_url}/runs/flow-run/{run['run_id']}")
    parts.append(f"lineage:      smollm3 lineage <fingerprint|path>   (DuckDB file {lineage.path})")
    parts.append("runs:         smollm3 runs")
    return "\n".join(parts)


def find_run(lineage: Lineage, ref: str) -> dict[str, Any]:
    """A run by id, id prefix, or `latest`."""
    if ref == "latest":
        runs = lineage.runs(1)
    else:
        runs = lineage.find_runs(ref)
    if not runs:
        raise LookupError(f"no run {ref!r} in {lineage.path}; list them with `smollm3 runs`")
    if len(runs) > 1:
        raise LookupError(f"run prefix {ref!r} is ambiguous: {', '.join(r['run_id'][:8] for r in runs)}")
    check_run_id(runs[0]["run_id"], str(lineage.path))  # reports and comparisons are named by it
    return runs[0]


def run_report(lineage: Lineage, ref: str, out: Path) -> Path:
    """The run's report as markdown (plus its loss curve beside it): what the UI shows, in a file."""
    from evals.report import plot_run_loss, stages_markdown
    from evals.training_metrics import stage_rows

    run = find_run(lineage, ref)
    run_id = run["run_id"]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = [
        f"# smollm3 run {run_id}",
        "",
        f"Recipe `{run['recipe']}`, state **{run['state']}**, started {run['started']:%Y-%m-%d %H:%M:%S}.",
        "",
        "## Steps",
        "",
        "```",
        _steps_only(lineage, run_id),
        "```",
        "",
        "## Eval scores",
        "",
        eval_table(lineage, run_id, markdown=True),
    ]
    rl = rl_rewards(lineage, run_id, markdown=True)
    if rl:
        parts += ["", "## RL reward", "", rl]
    try:
        stages = stage_rows(lineage.labelled_outputs(run_id, "pretrain"))
    except (OSError, ValueError) as exc:  # stage folders deleted, or only on S3
        stages = []
        parts += ["", f"(no loss curve: a stage folder of this run is not readable here: {exc})"]
    if stages:
        png = plot_run_loss(stages, out.with_name(f"{out.stem}-loss.png"))
        parts += ["", "## Loss over the run", "", f"![loss over the run]({png.name})", "", stages_markdown(stages)]
    for st in stages:
        summary_md = st["folder"] / "summary.md"
        if summary_md.exists():
            parts += ["", summary_md.read_text().replace("# ", "## Stage ", 1)]
    final = final_artifact(lineage, run_id)
    if final:
        parts += ["", f"## Lineage of the final {final['kind']}", "", "```", tree(lineage, final), "```"]
        if model_path(final):
            parts += ["", f"Final model: `{model_path(final)}` (`AutoModelForCausalLM.from_pretrained` loads it)."]
    out.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return out


def report_summary(lineage: Lineage, ref: str) -> str:
    """What `smollm3 report` prints besides the report's path: the run's state, its final
    training loss, its best eval score against that task's random baseline, and where its
    final model is."""
    from evals.report import eval_rows
    from evals.training_metrics import stage_rows

    run = find_run(lineage, ref)
    run_id = run["run_id"]
    lines = [f"run {run_id}: recipe {run['recipe']}, {run['state']}"]
    try:
        stages = stage_rows(lineage.labelled_outputs(run_id, "pretrain"))
    except (OSError, ValueError):  # a stage folder not readable here
        stages = []
    losses = [(st["label"], r) for st in stages for r in st["metrics"] if r.get("loss") is not None]
    if losses:
        label, last = losses[-1]
        lines.append(f"final training loss: {last['loss']:.4f} (stage {label}, step {last.get('step', '?')})")
    else:
        lines.append("final training loss: none recorded in this run")
    rows = [r for r in eval_rows(lineage.labelled_outputs(run_id, "evaluate")) if r["random"] is not None]
    if rows:
        best = max(rows, key=lambda r: r["score"] - r["random"])
        err = f" ± {best['stderr']:.3f}" if best["stderr"] is not None else ""
        lines.append(
            f"best eval over random: {best['task']} {best['metric']} {best['score']:.3f}{err} "
            f"(random {best['random']:.3f}) by {best['model']}"
        )
    else:
        lines.append("best eval over random: no evaluation with a random baseline in this run")
    final = final_artifact(lineage, run_id)
    where = model_path(final) if final else None
    lines.append(
        f"final model: {where} (AutoModelForCausalLM.from_pretrained loads it)"
        if where
        else "final model: none exported in this run"
    )
    return "\n".join(lines)


def _steps_only(lineage: Lineage, run_id: str) -> str:
    rows = lineage.steps_of(run_id)
    return "\n".join(
        f"{r['step'] + ('[' + r['label'] + ']' if r['label'] else ''):<28} {r['state']:<9} {r['seconds']:7.1f}s"
        for r in rows
    )


# model.checkpoint.TRAINER_STATE, named here because that module imports torch (a second or more
# for a lineage question); tests/flows/test_cli.py checks that the two agree.
TRAINER_STATE = "trainer_state.json"


def _pinned_tokens(pin) -> dict[str, int] | None:
    """Tokens per source a pinned checkpoint had drawn in its stage (its trainer state, plain
    JSON), or None when the pinned folder is not readable here."""
    path = pin.meta.get("checkpoint")
    if not path:
        return None
    try:
        state = json.loads((Path(path) / TRAINER_STATE).read_text(encoding="utf-8"))
        return {str(k): int(v) for k, v in (state.get("tokens_per_source") or {}).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def trained_on_table(lineage: Lineage, source: str) -> str:
    """`smollm3 lineage --trained-on SOURCE`: every checkpoint whose weights saw tokens of a
    source, with the tokens drawn in its own stage and in its whole init chain."""
    rows = lineage.trained_on(source, pinned_tokens=_pinned_tokens)
    if not rows:
        return f"no training stage in {lineage.path} drew tokens from {source!r} (nor continues one that did)"
    name = rows[0].source
    out = [
        f"checkpoints trained on source {name!r} (tokens: the mixture ledger at the end of each "
        "stage; cumulative: this stage and the stages its init chain continues)",
        f"{'stage':<22}{'checkpoint':<14}{'this stage':>14}{'cumulative':>14}  runs (built or reused it)",
    ]
    for r in rows:
        cumulative = f"{r.cumulative_tokens:,}" + ("" if r.complete else "+")
        runs = f"{len(r.runs)}, last {r.runs[-1][:8]}" if r.runs else "-"
        out.append(
            f"{'pretrain[' + r.label + ']':<22}{r.checkpoint.short:<14}{r.stage_tokens:>14,}{cumulative:>14}  {runs}"
        )
        if len(r.chain) > 1:
            out.append(" " * 4 + "chain: " + " -> ".join(f"{label} {tokens:,}" for label, _, tokens in r.chain))
        out.append(" " * 4 + r.checkpoint.uri)
    if any(not r.complete for r in rows):
        out.append("+: at least; a pinned base checkpoint's own count was not readable here")
    out.append(
        "Every checkpoint also descends from every source through the tokenizer (and each "
        "curation reads the other sources' held-out text): that is not training on them, "
        "and is not counted here. The query: docs/architecture.md (Lineage)."
    )
    return "\n".join(out)
