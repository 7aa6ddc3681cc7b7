"""The source step: one recipe source to a corpus artifact (its `train/` and `heldout/` shards).

The source kinds (builtin:, files:, hf:), the held-out split rule and the shard format live in
curation/source_kinds.py; the source read as datatrove tasks (read, duplicate ids by hash
bucket, finish) in curation/ingest.py, on the executor the recipe's curation section names. This
module is the step and its config.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from curation.executors import RayExecutorConfig, SlurmExecutorConfig, make_executors, run_executors
from curation.source_kinds import SourceConfig, resolve_kind, source_state
from pipeline.artifact import added_identity, operational
from pipeline.step import step


class SourceSpec(BaseModel):
    """The source step's config: one recipe source, and the recipe seed for kinds that generate
    text from it (builtin:math); None for kinds whose text does not depend on a seed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: SourceConfig
    seed: int | None = None
    # the held-out split holds at most this many documents: of those `held_out_fraction` selects,
    # the ones of smallest hash (the same set in any read order); the others go to train. None:
    # the fraction alone. Set from the recipe's `curation.heldout.max_docs` where it can bind.
    held_out_max_documents: int | None = added_identity(None, gt=0)
    # datatrove tasks that read the source (its files are dealt to them in contiguous blocks; at
    # most one task per file; the built-in kinds and a capped source: one), and the hash buckets
    # of the duplicate-id stage. Each task writes its own shards, so the count is part of the
    # output. None: one task. Set from the recipe's `curation.tasks` for an uncapped source of a
    # kind several tasks can read (files:, hf:).
    read_tasks: int | None = added_identity(None, gt=0)
    # where the tasks run: the recipe's curation executor (curation/executors.py)
    executor: Literal["local", "slurm", "ray"] = operational("local")
    workers: int | None = operational(None, gt=0)  # tasks at once; None: the cores (local), all (clusters)
    slurm: SlurmExecutorConfig | None = operational(None)
    ray: RayExecutorConfig = operational(RayExecutorConfig())

    @classmethod
    def of(
        cls, source: SourceConfig, seed: int, held_out_max_documents: int | None = None, curation: Any = None
    ) -> SourceSpec:
        """The step's config for a recipe source; a held-out cap the source cannot reach (its
        `max_documents` is at most the cap, or it holds nothing out) is left out, so it changes
        neither the output nor the fingerprint. `curation` (the recipe's section) gives the
        executor and, for a source without `max_documents`, the read tasks."""
        cap = held_out_max_documents
        if source.held_out_fraction == 0 or (source.max_documents is not None and source.max_documents <= (cap or 0)):
            cap = None
        seed = seed if resolve_kind(source.uri).seeded else None
        spec = cls(source=source, seed=seed, held_out_max_documents=cap)
        if curation is None:
            return spec
        one = source.max_documents is not None or curation.tasks == 1 or not resolve_kind(source.uri).parallel
        tasks = None if one else curation.tasks
        run = {k: getattr(curation, k) for k in ("executor", "workers", "slurm", "ray")}
        return spec.model_copy(update={"read_tasks": tasks, **run})


# 3: the train split is dealt into `shards` shards; blank lines of files are counted; the
# language is in the meta. Read as datatrove tasks since (issue 33): the same output for one task.
@step(
    "source",
    version=3,
    kind="corpus",
    resource="data",
    isolate=True,
    retries=2,
    extra=lambda spec: source_state(spec.source, spec.seed),
)
def source(config: SourceSpec, *, out: Path, log=print) -> dict[str, Any]:
    """One recipe source to a corpus artifact (no inputs): its documents read into train/heldout
    shards by datatrove tasks; the meta holds the counts."""
    cfg, seed = config.source, config.seed or 0
    kind = resolve_kind(cfg.uri)(cfg, seed)
    problems = kind.check()  # the same cheap check as `smollm3 recipe`, before the full read
    if problems:
        raise ValueError("; ".join(problems))
    from curation.ingest import ingest_stages, merge_stats  # datatrove: not for `smollm3 plan`

    wanted = config.read_tasks or 1
    tasks = 1 if cfg.max_documents is not None else kind.max_tasks(wanted)
    cap = config.held_out_max_documents
    stages = ingest_stages(cfg, seed, out, tasks, wanted, cap)
    log(
        f"source {cfg.name}: read by {tasks} task(s) on the {config.executor} executor, ids checked in {wanted} bucket(s)"
    )
    run_executors(config, make_executors(config, stages, out / "logs"), out / "logs", log)
    stats = merge_stats(out / "work", tasks)
    shutil.rmtree(out / "work")  # the id buckets and layouts: as large as the source's ids
    docs, rejected, capped = stats["documents"], stats["rejected"], stats["capped"]
    if capped:
        log(
            f"source {cfg.name}: held-out split capped at {cap:,} documents (curation.heldout.max_docs); "
            f"{capped:,} more the fraction {cfg.held_out_fraction:g} selected went to train"
        )
    if rejected:
        examples = stats["rejected_examples"]
        detail = ", ".join(f"{r}={n} (e.g. {', '.join(examples[r][:3])})" for r, n in sorted(rejected.items()))
        log(f"source {cfg.name}: rejected {sum(rejected.values())} records: {detail}")
    if not docs.get("train"):
        hint = ""
        if rejected.get("missing_text_field"):
            hint = (
                f"; sources[{cfg.name}].text_field {cfg.text_field!r} is not a text field of "
                f"the records (fields: {', '.join(stats['fields']) or 'none'}): set text_field"
            )
        raise ValueError(
            f"source {cfg.name!r} ({cfg.uri}) produced no training documents"
            + (f"; rejected: {dict(rejected)}" if rejected else "")
            + hint
        )
    return {
        "source": cfg.name,
        "domain": cfg.domain,
        "language": cfg.language,
        "format": cfg.output_format,
        "documents": docs.get("train", 0),
        "characters": stats["characters"].get("train", 0),
        "heldout_documents": docs.get("heldout", 0),
        "heldout_characters": stats["characters"].get("heldout", 0),
        "heldout_max_documents": cap,
        "heldout_capped": capped,
        "shards": stats["shards"],
        "rejected": rejected,
        "rejected_examples": stats["rejected_examples"],
        "read_tasks": tasks,
    }
