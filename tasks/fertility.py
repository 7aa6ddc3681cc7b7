"""Fertility analysis: compare candidate tokenizers on each source's curated held-out text, pick one.

The measures (fertility, continued words, bytes per token, vocabulary used) and the choice
rule are defined in evals/tokenizer_fertility.py.

Candidates are the trained tokenizer (the input artifact, named `trained`) plus the recipe's
`tokenizer.json` paths, tokenizer folders or hub names (hub names need network access and, for
gated models, a token; tests use local files). The recipe either fixes the tokenizer (`choose`)
or it is selected by the rule `lowest_weighted_fertility`: the lowest mean fertility over sources
weighted by the first stage's mixture weights. The decision and its reason go into the meta.
Outputs: `fertility.csv`, `fertility.md`, `fertility.png` and `decision.json`. The measures,
the rule, the chart and the table are evals/tokenizer_fertility.py's.

Measured on what is trained: the curated corpora's held-out split, which curation runs through
the same filters as train (`heldout_curated` in the corpus meta). Uncurated text would judge
tokenizers on markup and boilerplate that curation removes. A source whose curated held-out
split is empty falls back to a sample of its curated train split, which the trained tokenizer
learnt from (it favours `trained`); the text used per source is in the meta (`text`), the CSV
and the report.
"""

from __future__ import annotations

import base64
import csv
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from evals.tokenizer_fertility import (
    TRAINED,
    decide,
    find_eos,
    load_candidate,
    markdown_table,
    measure,
    measured_texts,
    write_chart,
)
from pipeline.artifact import Artifact
from pipeline.step import step


class FertilityConfig(BaseModel):
    """The recipe's `fertility` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    candidates: tuple[str, ...] = ()  # tokenizer.json paths, folders or hub names to compare
    choose: str | None = None  # fix the tokenizer ("trained" or a candidate); None: use the rule
    rule: Literal["lowest_weighted_fertility"] = "lowest_weighted_fertility"  # selection rule
    max_chars_per_source: int = Field(default=300_000, gt=0)  # held-out text read per source


def publish_fertility(artifact: Artifact, ws, label: str) -> None:
    """The table, and the decision with the chart, as Prefect artifacts."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    with open(artifact.path / "fertility.csv", encoding="utf-8") as fh:
        table = list(csv.DictReader(fh))
    create_table_artifact(table=table, key="fertility", description="Tokenizer fertility per source")
    md = (artifact.path / "fertility.md").read_text(encoding="utf-8")
    png = artifact.path / "fertility.png"
    # the chart inline (a data URI: tens of kB), so the UI shows it without file access
    image = base64.b64encode(png.read_bytes()).decode("ascii")
    create_markdown_artifact(
        markdown=f"# Tokenizer fertility\n\n{md}\n\n![fertility](data:image/png;base64,{image})\n\nChart: `{png}`",
        key="fertility-decision",
        description="Tokenizer choice and its reason",
    )


class FertilitySpec(BaseModel):
    """The fertility step's config: the recipe section and the first stage's source weights
    (the selection rule weighs sources by them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fertility: FertilityConfig
    weights: dict[str, float] = {}


@step("fertility", version=2, kind="fertility", publish=publish_fertility, resource="data", isolate=True, retries=1)
def fertility(
    config: FertilitySpec,
    tokenizer: Artifact | None = None,
    corpora: tuple[Artifact, ...] = (),
    *,
    out: Path,
    log=print,
) -> dict[str, Any]:
    """Measure every candidate (the trained `tokenizer`, if any, and the configured ones) on every
    source's curated held-out text (`corpora`); write tables, chart and the tokenizer decision."""
    settings, weights, trained = config.fertility, config.weights, tokenizer
    if not corpora:
        raise ValueError("fertility: needs at least one corpus artifact with a heldout/ split")
    names = ([TRAINED] if trained else []) + [c for c in settings.candidates if c != TRAINED]
    if not names:
        raise ValueError("fertility: no candidates (no tokenizer artifact and fertility.candidates empty)")
    measured = {c.meta.get("source", c.short): measured_texts(c, settings.max_chars_per_source) for c in corpora}
    texts = {source: t for source, (_, t) in measured.items()}
    what = {source: label for source, (label, t) in measured.items() if t}
    for source, label in what.items():
        if label != "curated held-out":
            log(
                f"WARNING fertility: source {source} is measured on its {label}"
                + (
                    " (the trained tokenizer learnt from it)"
                    if label.endswith("train sample")
                    else " (run it through curation first)"
                )
            )
    rows: list[dict[str, Any]] = []
    loaded: dict[str, dict[str, Any]] = {}
    for name in names:
        tok, path = load_candidate(name, trained.path if trained else None)
        eos, eos_id = find_eos(tok, path)
        loaded[name] = {"path": path, "vocab_size": tok.get_vocab_size(), "eos_token": eos, "eos_id": eos_id}
        for source, source_texts in texts.items():
            if not source_texts:
                log(f"fertility: source {source} has no held-out text; skipped")
                continue
            rows.append({"tokenizer": name, "source": source, "text": what[source], **measure(tok, source_texts)})
    if not rows:
        raise ValueError("fertility: no source has held-out or curated text; set held_out_fraction > 0")
    decision = decide(rows, settings.choose, weights or {})
    with open(out / "fertility.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "fertility.md").write_text(markdown_table(rows, decision) + "\n", encoding="utf-8")
    write_chart(rows, out / "fertility.png")
    selected = {"name": decision["selected"], **loaded[decision["selected"]]}
    (out / "decision.json").write_text(json.dumps({**decision, "tokenizer": selected}, indent=2), encoding="utf-8")
    log(f"fertility: selected {selected['name']}: {decision['reason']}")
    return {
        "selected": selected,
        "reason": decision["reason"],
        "scores": {k: round(v, 4) for k, v in decision["scores"].items()},
        "candidates": list(loaded),
        "text": what,  # per source: curated held-out | curated train sample | uncurated held-out
        "text_chars": {source: sum(len(t) for t in texts[source]) for source in what},
    }
