"""The source step: one recipe source to a corpus artifact (its `train/` and `heldout/` shards).

The source kinds (builtin:, files:, hf:), the held-out split rule and the shard format live in
curation/source_kinds.py; this module is the step and its config.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from curation.source_kinds import (
    Document,
    Rejected,
    ShardWriter,
    SourceConfig,
    held_out_rank,
    is_held_out,
    resolve_kind,
    source_state,
)
from pipeline.artifact import added_identity
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

    @classmethod
    def of(cls, source: SourceConfig, seed: int, held_out_max_documents: int | None = None) -> SourceSpec:
        """The step's config for a recipe source; a held-out cap the source cannot reach (its
        `max_documents` is at most the cap, or it holds nothing out) is left out, so it changes
        neither the output nor the fingerprint."""
        cap = held_out_max_documents
        if source.held_out_fraction == 0 or (source.max_documents is not None and source.max_documents <= (cap or 0)):
            cap = None
        seed = seed if resolve_kind(source.uri).seeded else None
        return cls(source=source, seed=seed, held_out_max_documents=cap)


# 3: the train split is dealt into `shards` shards; blank lines of files are counted; the
# language is in the meta
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
    shards; the meta holds the counts."""
    cfg, seed = config.source, config.seed or 0
    kind = resolve_kind(cfg.uri)(cfg, seed)
    problems = kind.check()  # the same cheap check as `smollm3 recipe`, before the full read
    if problems:
        raise ValueError("; ".join(problems))
    # the held-out split is small by design and curated by one task: one stream
    writers = {
        split: ShardWriter(out / split, cfg.output_format, cfg.documents_per_shard, streams)
        for split, streams in (("train", cfg.shards), ("heldout", 1))
    }
    docs: Counter[str] = Counter()
    chars: Counter[str] = Counter()
    rejected: Counter[str] = Counter()
    examples: dict[str, list[str]] = defaultdict(list)
    seen_ids: set[str] = set()
    fields_seen: tuple[str, ...] = ()
    kept = 0
    cap = config.held_out_max_documents
    held: list[tuple[int, int, Document]] = []  # capped split: (-hash, read order, document)
    capped = 0  # documents the fraction selected and the cap sent to train
    for record in kind.records():
        if isinstance(record, Document):
            text = record.text
            if not text.strip():
                record = Rejected("empty", record.id)
            elif len(text) > cfg.max_document_chars:
                record = Rejected("too_large", record.id)
            elif record.id in seen_ids:
                record = Rejected("duplicate_id", record.id)
        if isinstance(record, Rejected):
            rejected[record.reason] += record.count
            if len(examples[record.reason]) < 5:
                examples[record.reason].append(record.where)
            fields_seen = fields_seen or record.fields
            continue
        seen_ids.add(record.id)
        kept += 1
        if not is_held_out(cfg.name, record.id, cfg.held_out_fraction):
            _write(writers, "train", record, cfg.name, docs, chars)
        elif cap is None:
            _write(writers, "heldout", record, cfg.name, docs, chars)
        else:  # keep the `cap` smallest hashes: a max-heap of them, the largest pushed out to train
            heapq.heappush(held, (-held_out_rank(cfg.name, record.id), kept, record))
            if len(held) > cap:
                _write(writers, "train", heapq.heappop(held)[2], cfg.name, docs, chars)
                capped += 1
        if kept % 5000 == 0:
            log(f"source {cfg.name}: {kept} documents")
        if cfg.max_documents and kept >= cfg.max_documents:
            break
    if capped:
        log(
            f"source {cfg.name}: held-out split capped at {cap:,} documents (curation.heldout.max_docs); "
            f"{capped:,} more the fraction {cfg.held_out_fraction:g} selected went to train"
        )
    for _, _, record in sorted(held, key=lambda entry: entry[1]):  # the capped split, in read order
        _write(writers, "heldout", record, cfg.name, docs, chars)
    for w in writers.values():
        w.flush()
    if rejected:
        detail = ", ".join(f"{r}={n} (e.g. {', '.join(examples[r][:3])})" for r, n in sorted(rejected.items()))
        log(f"source {cfg.name}: rejected {sum(rejected.values())} records: {detail}")
    if docs["train"] == 0:
        hint = ""
        if rejected["missing_text_field"]:
            hint = (
                f"; sources[{cfg.name}].text_field {cfg.text_field!r} is not a text field of "
                f"the records (fields: {', '.join(fields_seen) or 'none'}): set text_field"
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
        "documents": docs["train"],
        "characters": chars["train"],
        "heldout_documents": docs["heldout"],
        "heldout_characters": chars["heldout"],
        "heldout_max_documents": cap,
        "heldout_capped": capped,
        "shards": {split: w.shards for split, w in writers.items()},
        "rejected": dict(rejected),
        "rejected_examples": {k: v for k, v in examples.items()},
    }


def _write(writers, split: str, record: Document, source: str, docs: Counter[str], chars: Counter[str]) -> None:
    writers[split].add(record, source)
    docs[split] += 1
    chars[split] += len(record.text)
