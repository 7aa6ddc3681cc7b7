"""The decontaminate step: one per source, a curated corpus's train split matched against the
held-out index of every source (tasks/heldout_index.py); training documents that copy held-out
text leave train.

Held-out is held out. The source step splits by document id, before any dedup, so a copy of a
held-out document under another id can sit in train; the eval suite's cloze items, held-out loss
and fertility are built from held-out text (of every source of a domain), so none of it may have
a copy in train. The index holds every held-out document as its source wrote it and, where its
source's preset rewrites text (`docs`), as curation keeps it; the training documents are matched
as curation left them (after the filters and dedup: tasks/curate.py says what that changes).

Inputs: the source's curated corpus (tasks/curate.py, filters and dedup done) and the
`heldout_index` artifact. The match is curation/heldout.py's `HeldoutDecontFilter` (the same
text, or a word n-gram overlap with one held-out document at or above `threshold`: counted as
`heldout_decont:exact` and `heldout_decont:overlap`, a few removed documents kept under
`removed/heldout_decont/`), run as datatrove tasks on the recipe's curation executor, one task
per curated train shard, each memory-mapping the index.

Its artifact is the curated corpus as every later step reads it (tokenizer, fertility, tokenize,
eval suites, reasoning data, lineage): `train/` decontaminated; `heldout/`, `heldout_removed/`,
`heldout_filter_stats.json` and curate's `removed/` samples hard-linked from the curate step's
folder (copied where a link cannot be made), so nothing is stored twice; `filter_stats.json`
curate's rows plus this step's; the meta curate's, with the kept counts, the removals and the
index's size updated. A task that dies leaves no datatrove completion marker and the step no
completion marker: a rerun skips the finished tasks and redoes the others, rewriting their shards.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from curation.executors import RayExecutorConfig, SlurmExecutorConfig, make_executors, run_executors
from curation.stages import attach_samples, filter_rows, low_kept_share, publication, removed_counts
from pipeline.artifact import Artifact, operational
from pipeline.step import step


class DecontaminateSpec(BaseModel):
    """The step's config: the recipe's `curation.decontamination` match rules, and where its
    tasks run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # share of a held-out document's n-grams (or of the training document's, when it is the
    # shorter) that makes a copy (curation.decontamination.threshold)
    threshold: float = Field(default=0.5, gt=0, le=1)
    min_ngrams: int = Field(default=50, ge=1)  # a held-out document counts as at least this many n-grams
    removed_samples: int = Field(default=20, ge=0)  # removed documents kept per reason (curation.removed_samples)
    min_kept_share: float = operational(0.2, ge=0, le=1)  # below it, a warning (curation.min_kept_share)
    # where the tasks run: the recipe's curation executor (curation/executors.py)
    executor: Literal["local", "slurm", "ray"] = operational("local")
    workers: int | None = operational(None, gt=0)
    slurm: SlurmExecutorConfig | None = operational(None)
    ray: RayExecutorConfig = operational(RayExecutorConfig())

    @classmethod
    def of(cls, curation: Any) -> DecontaminateSpec:
        """The step's config from the recipe's `curation` section."""
        d = curation.decontamination
        return cls(
            threshold=d.threshold,
            min_ngrams=d.min_ngrams,
            removed_samples=curation.removed_samples,
            min_kept_share=curation.min_kept_share,
            **{k: getattr(curation, k) for k in ("executor", "workers", "slurm", "ray")},
        )


def _link(src: Path, dst: Path) -> None:
    """The file `src`, or every file under the folder `src`, at the same place under `dst`,
    hard-linked (copied where the file system cannot link); a file already there (an earlier
    attempt's) is replaced."""
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    for path in files:
        target = dst if path == src else dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".link")
        tmp.unlink(missing_ok=True)
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copy2(path, tmp)
        os.replace(tmp, target)


def _stages(config: DecontaminateSpec, train: Path, index: Path, out: Path, tasks: int) -> list:
    from datatrove.pipeline.writers import JsonlWriter

    from curation.heldout import HeldoutDecontFilter
    from curation.io import CountingJsonlReader

    pipeline = [
        # one curated shard per task (datatrove deals a folder's files by rank); curate already
        # applied the length limit, so none is applied again here
        CountingJsonlReader(str(train), max_chars=sys.maxsize),
        HeldoutDecontFilter(str(index), config.threshold, config.min_ngrams),
        JsonlWriter(str(out / "train"), output_filename="${rank}.jsonl.gz"),
    ]
    return [("decontaminate", attach_samples(pipeline, out / "removed", config.removed_samples), tasks)]


def publish_decontaminated(artifact: Artifact, ws, label: str) -> None:
    """This step's filter row to lineage (`filter_stats`, after the curate step's rows of the
    source), the source's whole per-filter table to its Prefect table artifact (a new version),
    and a low kept share as the curate step publishes it (curation/stages.py `publication`)."""
    from prefect.artifacts import create_table_artifact
    from prefect.events import emit_event

    rows = json.loads((artifact.path / "filter_stats.json").read_text(encoding="utf-8"))
    out = publication(artifact.fingerprint, artifact.meta.get("source", label), rows, artifact.meta)
    if out["event"]:
        ws.lineage().record_rows("data_events", out["data_events"])
        emit_event(**out["event"])
    ws.lineage().record_rows("filter_stats", out["filter_stats"])
    create_table_artifact(**out["table"])


# 1: decontamination after curation's dedup, against the index built once (tasks/heldout_index.py)
@step(
    "decontaminate", version=1, kind="corpus", publish=publish_decontaminated, resource="data", isolate=True, retries=1
)
def decontaminate(
    config: DecontaminateSpec, corpus: Artifact, index: Artifact, *, out: Path, log=print
) -> dict[str, Any]:
    """A curated corpus's train split without copies of held-out text, in `out/train`; its
    held-out split and curate's records linked beside it; the meta curate's, updated."""
    from curation.heldout import HeldoutIndex

    meta = dict(corpus.meta)
    source = meta.get("source", corpus.short)
    train = corpus.path / "train"
    shards = sorted(train.glob("*.jsonl.gz"))
    if not shards:
        raise FileNotFoundError(
            f"decontamination of source {source!r}: no train shards in {train}; rerun its curate step"
        )
    folder = index.path / "index"
    header = HeldoutIndex.read_header(folder)  # refuses an index whose build did not finish
    start = time.monotonic()
    logs = out / "logs"
    stages = _stages(config, train, folder, out, len(shards))
    run_executors(config, make_executors(config, stages, logs), logs, log)
    read, decont = filter_rows(logs, stages)
    if read["docs_in"] != meta["documents"]:
        raise ValueError(
            f"decontamination of source {source!r}: read {read['docs_in']} documents of {train}, but its "
            f"curate step kept {meta['documents']}; the curated corpus changed after it finished: rerun curate"
        )
    for name in ("heldout", "heldout_removed", "removed", "heldout_filter_stats.json"):
        _link(corpus.path / name, out / name)
    (out / "heldout").mkdir(exist_ok=True)
    rows = json.loads((corpus.path / "filter_stats.json").read_text(encoding="utf-8"))
    rows.append({**decont, "position": len(rows)})
    (out / "filter_stats.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    removed = Counter(meta.get("removed", {}))
    found = removed_counts([decont])
    removed.update(found)
    documents, characters = decont["docs_out"], decont["chars_out"]
    unaccounted = meta.get("unaccounted", 0) + decont["docs_in"] - documents - sum(found.values())
    seconds = time.monotonic() - start
    report = index.meta.get("heldout_index")
    log(
        f"decontaminate {source}: {decont['docs_in']} in -> {documents} kept ({characters} chars) in "
        f"{seconds:.1f}s; copies of held-out text removed {dict(found)} "
        f"(index: {header['documents']:,} documents of {len(index.meta.get('sources', []))} sources)"
    )
    flagged = meta.pop("low_kept_share", None) is not None  # curate published it already
    low = low_kept_share(rows, meta.get("input_documents", 0), documents, config.min_kept_share)
    if low is not None:
        log(f"WARNING decontaminate {source} ({meta.get('preset')}): {low['message']}")
    if documents == 0:
        raise ValueError(
            f"decontamination of source {source!r} kept no documents: every curated document copies "
            f"held-out text; see {out / 'removed' / 'heldout_decont'}"
        )
    return {
        **meta,
        "documents": documents,
        "characters": characters,
        "decontaminated_against": list(index.meta.get("sources", [])),
        "heldout_index": report,
        "removed": dict(removed),
        "unaccounted": unaccounted,
        **({"low_kept_share": low, "low_kept_share_published": flagged} if low is not None else {}),
        "curate_seconds": meta.get("seconds"),
        "seconds": round(seconds, 2),
        "decontaminate_tasks": len(shards),
        "published_rows": len(rows) - 1,  # the curate step's rows: it published them
    }
