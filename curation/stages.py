"""The curation pipeline as datatrove stages, and the per-filter statistics they leave.

`plan_stages` lays one source's curation out as (name, datatrove pipeline, tasks) in order
(filter, exact, unique, buckets, cluster, final, heldout: tasks/curate.py's docstring says what
each does); `filter_rows` reads the stages' `stats.json` back as one row per filter (documents
and characters in and out, drop reasons), the rows the curate step records as `filter_stats`.
`config` is the curate step's `CurationConfig` (tasks/curate.py); this module reads its fields only.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from curation.presets import quality_filters


def attach_samples(pipeline: list, folder: Path, per_reason: int) -> list:
    """Give every filter of `pipeline` (datatrove's dedup filters included: they take an
    exclusion writer without being BaseFilters) a sample writer at `folder/<filter_name>`."""
    from curation.filters import filter_name
    from curation.io import SampleWriter

    for component in pipeline:
        if hasattr(component, "exclusion_writer"):
            component.exclusion_writer = (
                SampleWriter(str(folder / filter_name(component)), per_reason) if per_reason else None
            )
    return pipeline


def plan_stages(
    config: Any,
    preset: str,
    train: Path,
    out: Path,
    tasks: int,
    *,
    heldout: Path | None = None,
    index: Path | None = None,
) -> list[tuple[str, list, int]]:
    """The curation stages as (name, datatrove pipeline, tasks), in order.

    `index` (a HeldoutIndex folder, built by `curation.heldout.index_stages` before these stages
    run) adds decontamination after the filters; `heldout` (a folder of held-out shards) adds the
    `heldout` stage, one task: the split is small by design and an in-memory exact dedup needs
    to see all of it.
    """
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.exact_dedup import (
        ExactDedupConfig,
        ExactDedupFilter,
        ExactDedupSignature,
        ExactFindDedups,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig

    from curation.filters import ExactDedupInMemoryFilter
    from curation.heldout import HeldoutDecontFilter, exact_text
    from curation.io import CountingJsonlReader
    from curation.minhash_cluster import MinhashClusterArrays

    decont = config.decontamination
    read = CountingJsonlReader(str(train), max_chars=config.max_document_chars)
    exact_cfg = ExactDedupConfig(content_getter=exact_text, hash_config=HashConfig(precision=64))
    mh_cfg = MinhashConfig(
        n_grams=config.minhash_ngrams,
        num_buckets=config.minhash_buckets,
        hashes_per_bucket=config.minhash_hashes_per_bucket,
        hash_config=HashConfig(precision=64),
    )
    work = out / "work"
    final = str(out / "train")
    filtered = final if not (config.exact_dedup or config.minhash) else str(work / "filtered")
    stages: list[tuple[str, list, int]] = []
    # Decontamination judges the text that will be trained on: after the filters, one of which
    # (documentation prose) rewrites the text and can turn a partial copy into a near duplicate.
    first: list = [read, *quality_filters(config, preset)]
    if index is not None:
        first.append(HeldoutDecontFilter(str(index), decont.threshold, decont.min_ngrams))
    first.append(JsonlWriter(filtered, output_filename="${rank}.jsonl.gz"))
    if config.exact_dedup:
        first.append(ExactDedupSignature(str(work / "exact_sigs"), config=exact_cfg))
    stages.append(("filter", first, tasks))
    current = filtered
    if config.exact_dedup:
        unique = final if not config.minhash else str(work / "unique")
        stages.append(
            ("exact", [ExactFindDedups(str(work / "exact_sigs"), str(work / "exact_dups"), config=exact_cfg)], 1)
        )
        second = [
            CountingJsonlReader(current, rank_files=True),
            ExactDedupFilter(str(work / "exact_dups"), config=exact_cfg),
            JsonlWriter(unique, output_filename="${rank}.jsonl.gz"),
        ]
        if config.minhash:
            second.append(MinhashDedupSignature(str(work / "minhash_sigs"), config=mh_cfg))
        stages.append(("unique", second, tasks))
        current = unique
    elif config.minhash:
        stages.append(
            (
                "signatures",
                [
                    CountingJsonlReader(current, rank_files=True),
                    MinhashDedupSignature(str(work / "minhash_sigs"), config=mh_cfg),
                ],
                tasks,
            )
        )
    if config.minhash:
        stages.append(
            (
                "buckets",
                [MinhashDedupBuckets(str(work / "minhash_sigs"), str(work / "minhash_buckets"), config=mh_cfg)],
                config.minhash_buckets,
            )
        )
        stages.append(
            (
                "cluster",
                [MinhashClusterArrays(str(work / "minhash_buckets"), str(work / "minhash_remove"), config=mh_cfg)],
                1,
            )
        )
        stages.append(
            (
                "final",
                [
                    CountingJsonlReader(current, rank_files=True),
                    MinhashDedupFilter(str(work / "minhash_remove")),
                    JsonlWriter(final, output_filename="${rank}.jsonl.gz"),
                ],
                tasks,
            )
        )
    for _, pipeline, _ in stages:
        attach_samples(pipeline, out / "removed", config.removed_samples)
    if heldout is not None:
        held = [
            CountingJsonlReader(str(heldout), max_chars=config.max_document_chars),
            *quality_filters(config, preset),
            ExactDedupInMemoryFilter(),
            JsonlWriter(str(out / "heldout"), output_filename="${rank}.jsonl.gz"),
        ]
        stages.append(("heldout", attach_samples(held, out / "heldout_removed", config.removed_samples), 1))
    return stages


# --- statistics -------------------------------------------------------------------------------


def _chars(stats: dict[str, Any]) -> int | None:
    doc_len = stats.get("doc_len")
    return int(doc_len["total"]) if isinstance(doc_len, dict) else None


def read_stage_stats(logs: Path, stage: str) -> list[dict[str, Any]]:
    """A stage's statistics per pipeline component, summed over its tasks, in the same form on
    every executor: merged here from the tasks' own files (`stats/{rank:05d}.json`, written by
    every datatrove executor). The stage's `stats.json` is not read: on Slurm a separate job
    (datatrove's `merge_stats`, after the array) writes it, maybe after the chain's wait has
    returned, and there, as on Ray, a counter read back from a task's file is summed as a summary
    (`{"total": 3, "n": 2, ..., "unit": "task"}`) where the local executor writes `3`: such a
    summary is turned back into its total, the local executor's form."""
    from datatrove.utils.stats import PipelineStats

    files = sorted((logs / stage / "stats").glob("*.json"))
    if not files:
        return []
    merged = sum(
        (PipelineStats.from_json(json.loads(f.read_text(encoding="utf-8"))) for f in files), start=PipelineStats()
    )
    entries = json.loads(merged.to_json())
    for entry in entries:
        stats = entry.get("stats")
        if isinstance(stats, dict):
            entry["stats"] = {
                k: v["total"] if isinstance(v, dict) and v.get("unit") == "task" else v for k, v in stats.items()
            }
    return entries


def filter_rows(logs: Path, stages: list[tuple[str, list, int]]) -> list[dict[str, Any]]:
    """Per-filter rows (docs and chars in and out, drop reasons) from the stages' stats.json.

    The first row is the reader of the first stage's input (its drops are unreadable or
    rejected lines); then every filter and dedup filter in pipeline order.
    """
    from datatrove.pipeline.filters.base_filter import BaseFilter

    from curation.filters import filter_name
    from curation.io import CountingJsonlReader

    rows: list[dict[str, Any]] = []
    for index, (stage, pipeline, _) in enumerate(stages):
        steps = read_stage_stats(logs, stage)
        if not steps:
            continue
        chars_in: int | None = None
        docs_in: int | None = None
        for position, (component, entry) in enumerate(zip(pipeline, steps, strict=False)):
            stats = entry.get("stats", {})
            if isinstance(component, CountingJsonlReader):
                read = (
                    int(stats.get("documents", {}).get("total", 0)) if isinstance(stats.get("documents"), dict) else 0
                )
                chars_in = _chars(stats) or 0
                docs_in = read
                if index == 0:
                    reasons = {k[len("rejected_") :]: int(v) for k, v in stats.items() if k.startswith("rejected_")}
                    rows.append(
                        {
                            "stage": stage,
                            "position": position,
                            "filter": "read",
                            "docs_in": read + sum(reasons.values()),
                            "docs_out": read,
                            "chars_in": chars_in,
                            "chars_out": chars_in,
                            "reasons": reasons,
                        }
                    )
                continue
            if not (isinstance(component, BaseFilter) or "total" in stats and "forwarded" in stats):
                continue
            total = int(stats.get("total", docs_in or 0))
            out = int(stats.get("forwarded", 0))
            chars_out = _chars(stats)
            if chars_out is None:  # dedup filters keep no doc_len: take it from the next writer
                nxt = steps[position + 1]["stats"] if position + 1 < len(steps) else {}
                chars_out = _chars(nxt) or 0
            reasons = {k[len("dropped_") :]: int(v) for k, v in stats.items() if k.startswith("dropped_")}
            dropped = int(stats.get("dropped", total - out))
            if dropped and not reasons:
                reasons = {filter_name(component): dropped}
            rows.append(
                {
                    "stage": stage,
                    "position": position,
                    "filter": filter_name(component),
                    "docs_in": total,
                    "docs_out": out,
                    "chars_in": chars_in or 0,
                    "chars_out": chars_out,
                    "reasons": reasons,
                }
            )
            docs_in, chars_in = out, chars_out
    for i, row in enumerate(rows):
        row["position"] = i
    return rows


def removed_counts(rows: list[dict[str, Any]]) -> Counter[str]:
    """`<filter>:<reason>` -> documents, over every row but the reader's."""
    removed = Counter[str]()
    for row in rows:
        if row["filter"] != "read":
            for reason, n in row["reasons"].items():
                removed[f"{row['filter']}:{reason}"] += n
    return removed


def shard_count(folder: Path) -> int:
    """The gzip JSONL shards of `folder`."""
    return len(list(folder.glob("*.jsonl.gz")))


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The per-filter table as Markdown (documents and characters in and out, reasons)."""
    lines = ["| filter | docs in | docs out | chars in | chars out | reasons |", "|---|---|---|---|---|---|"]
    for r in rows:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {r['filter']} | {r['docs_in']} | {r['docs_out']} | {r['chars_in']:,} | {r['chars_out']:,} | {reasons} |"
        )
    return "\n".join(lines)
