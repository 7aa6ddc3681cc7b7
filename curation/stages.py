"""The curation pipeline as datatrove stages, and the per-filter statistics they leave.

`plan_stages` lays one source's curation out as (name, datatrove pipeline, tasks) in order
(filter, exact, unique, buckets, cluster, final, heldout: tasks/curate.py's docstring says what
each does); `filter_rows` reads the stages' `stats.json` back as one row per filter (documents
and characters in and out, drop reasons), the rows the curate step records as `filter_stats`.
`config` is the curate step's `CurationConfig` (tasks/curate.py); this module reads its fields only.
"""

from __future__ import annotations

import json
import re
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


def has_lines(path: Path) -> bool:
    """Whether a gzip JSONL shard, or any of a folder's, holds a non-blank line (a Parquet
    shard: a row)."""
    import gzip

    for shard in sorted(path.glob("*.jsonl.gz")) if path.is_dir() else [path]:
        if shard.suffix == ".parquet":
            import pyarrow.parquet as pq

            if pq.ParquetFile(shard).metadata.num_rows:
                return True
            continue
        if not shard.name.endswith(".jsonl.gz"):
            continue
        with gzip.open(shard, "rb") as fh:
            if any(line.strip() for line in fh):
                return True
    return False


def low_kept_share(rows: list[dict], docs_in: int, kept: int, floor: float) -> dict[str, Any] | None:
    """A source that kept less than `floor` of its documents (every preset keeps all the natural
    paragraphs of tests/tasks/data/multilingual.json: far below that is a preset that does not
    fit the text), with the filter that removed the most and its main reasons; else None."""
    if not docs_in or kept / docs_in >= floor:
        return None
    removals = [(r["docs_in"] - r["docs_out"], r) for r in rows if r["filter"] != "read"]
    removed, worst = max(removals, key=lambda x: x[0]) if removals else (0, {"filter": "read", "reasons": {}})
    reasons = dict(sorted(worst["reasons"].items(), key=lambda kv: -kv[1])[:3])
    share = kept / docs_in
    return {
        "kept_share": round(share, 4),
        "floor": floor,
        "filter": worst["filter"],
        "removed": removed,
        "reasons": reasons,
        "message": (
            f"kept {kept} of {docs_in} documents ({share:.1%}), below curation.min_kept_share "
            f"{floor:g}: {worst['filter']} removed the most ({removed}: "
            f"{', '.join(f'{k} {v}' for k, v in reasons.items())}); check the source's preset "
            "(curation.presets, its language) against a sample of its text"
        ),
    }


def publication(fingerprint: str, source: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """What a curated corpus publishes (the publish hooks of tasks/curate.py and
    tasks/decontaminate.py make the calls): its `filter_stats` lineage rows, from position
    `meta["published_rows"]` on (a step after curate records only its own rows: the per-filter
    table of a source is the union), the Prefect table of every row (`curate-<source>`, the
    latest version the whole table), and, for a low kept share (`meta["low_kept_share"]`), its
    `data_events` row and Prefect event (else `event` is None; also when
    `meta["low_kept_share_published"]`: the curate step before it published it)."""
    from datetime import UTC, datetime

    since = meta.get("published_rows", 0)
    low = meta.get("low_kept_share")
    stats = [
        (
            fingerprint,
            source,
            r["position"],
            r["filter"],
            r["docs_in"],
            r["docs_out"],
            r["chars_in"],
            r["chars_out"],
            json.dumps(r["reasons"], sort_keys=True),
        )
        for r in rows[since:]
    ]
    table = [
        {
            **{k: r[k] for k in ("filter", "docs_in", "docs_out", "chars_in", "chars_out")},
            "reasons": ", ".join(f"{k}={v}" for k, v in sorted(r["reasons"].items())),
        }
        for r in rows
    ]
    out: dict[str, Any] = {
        "filter_stats": stats,
        "table": {
            "table": table,
            "key": f"curate-{re.sub(r'[^a-z0-9-]', '-', source.lower())}",
            "description": f"Curation of {source}: documents and characters per filter, removal reasons",
        },
        "data_events": [],
        "event": None,
    }
    if low and not meta.get("low_kept_share_published"):
        facts = {k: low[k] for k in ("filter", "removed", "reasons")}
        now = datetime.now(UTC).replace(tzinfo=None)
        out["data_events"] = [
            (
                fingerprint,
                source,
                "low_kept_share",
                low["kept_share"],
                low["floor"],
                low["message"],
                json.dumps(facts, sort_keys=True),
                now,
            )
        ]
        out["event"] = {
            "event": "smollm3.curation.low_kept_share",
            "resource": {"prefect.resource.id": f"smollm3.source.{source}", "prefect.resource.name": source},
            "payload": {"kept_share": low["kept_share"], "floor": low["floor"], **facts},
        }
    return out


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
