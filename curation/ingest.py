"""Ingestion as datatrove tasks: one source read by N tasks, its duplicate ids found by P tasks.

The source step (tasks/sources.py) runs three stages on the recipe's executor
(curation/executors.py: local processes, Slurm array jobs or Ray), each a datatrove pipeline of
one step below, chained so each starts when the previous one has finished:

1. `ReadTask` (N tasks): task r reads its part of the source (`SourceKind.task_records`: a
   contiguous block of the files, so the tasks' parts are in read order), counts every rejected
   record under its reason, writes its kept documents to its own train and held-out shards
   (`{r:05d}-00000.jsonl.gz`, ...; with one task the names and bytes of a single reader,
   `00000.jsonl.gz`), and the id of each to one of P bucket files by a hash of the id. Memory:
   the shard buffers, a bounded buffer of ids and, with a held-out cap, at most `cap`
   candidates; never the source's ids.
2. `IdBucketTask` (P tasks): bucket b reads bucket b of every read task in read order and reports
   each id it has already seen as a duplicate of its first occurrence. Memory: one bucket's ids,
   about 1/P of the source's (P is the number of read tasks the recipe asks for).
3. `FinishTask` (N tasks): task r drops its duplicates (rewriting only the shards that hold one,
   so a source without duplicates is never rewritten), keeps the held-out cap across tasks (the
   `cap` smallest document hashes of all tasks' candidates) and writes its held-out shards; the
   candidates the cap leaves out go to an extra train shard of the task.

Each task writes a small JSON of its counts (`work/read/`, `work/finish/`); `merge_stats` sums
them. A position is (task, index among the task's kept documents): ordered as the source is read,
so "first occurrence" means what it meant for a single reader.

A capped source (`max_documents`) is read by one task that keeps its own id set (bounded by the
cap, and the cap is "the first N documents in read order", which only one reader knows): stage 2
then has nothing to find and is skipped.
"""

from __future__ import annotations

import gzip
import hashlib
import heapq
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from datatrove.pipeline.base import PipelineStep

from curation.source_kinds import (
    Document,
    Rejected,
    ShardWriter,
    SourceConfig,
    held_out_rank,
    is_held_out,
    read_shard,
    resolve_kind,
    write_shard,
)

EXAMPLES = 5  # example locations kept per rejection reason


def task_prefix(rank: int, world: int) -> str:
    """A read task's shard-name prefix: none for a single task (a single reader's names)."""
    return "" if world == 1 else f"{rank:05d}-"


def id_bucket(doc_id: str, buckets: int) -> int:
    """The bucket of a document id: a stable hash, the same in every process."""
    return int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "big") % buckets


class _IngestStep(PipelineStep):
    """What the three stages share: the source, the output folder and the work folder."""

    type = "📥 INGEST"

    def __init__(self, source: SourceConfig, seed: int, out: Path, buckets: int, cap: int | None):
        super().__init__()
        self.source, self.seed, self.out, self.buckets, self.cap = source, seed, Path(out), buckets, cap
        self.work = self.out / "work"

    def _streams(self, world: int) -> int:
        """Train streams per task: together at least the source's `shards`."""
        return max(1, -(-self.source.shards // world))


class ReadTask(_IngestStep):
    """Stage 1: read one part of the source, write its shards, its id buckets and its counts."""

    name = "📖 Read source part"

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> None:
        cfg = self.source
        kind = resolve_kind(cfg.uri)(cfg, self.seed)
        prefix = task_prefix(rank, world_size)
        for sub in ("layout", "read", "candidates"):
            (self.work / sub).mkdir(parents=True, exist_ok=True)
        layouts = {split: _layout(self.work, rank, split, "w") for split in ("train", "heldout")}
        train = ShardWriter(
            self.out / "train", cfg.output_format, cfg.documents_per_shard, self._streams(world_size), prefix=prefix
        )
        train.layout = layouts["train"]
        # without a cap the task writes its held-out documents itself; with one it keeps at most
        # `cap` candidates and the finish stage chooses across tasks
        held = ShardWriter(self.out / "heldout", cfg.output_format, cfg.documents_per_shard, 1, prefix=prefix)
        held.layout = layouts["heldout"]
        ids = _IdBuckets(self.work / "ids", rank, self.buckets) if cfg.max_documents is None else None
        seen: set[str] = set()  # a capped source only: bounded by max_documents
        counts = _Counts()
        candidates: list[tuple[int, int, Document]] = []  # max-heap by hash: (-hash, position, doc)
        # the candidates' ids: a second copy of one is a duplicate found here (it would hold a
        # second place under the cap); with distinct ids in every task's candidates, the `cap`
        # smallest of all tasks' surviving candidates are the `cap` smallest of the source
        candidate_ids: set[str] = set()
        kept = capped = 0
        duplicates: list[tuple[float, str]] = []  # the first found here, with where they fall
        for record in kind.task_records(rank, world_size):
            record = self._check(record, seen, candidate_ids)
            if isinstance(record, Rejected):
                counts.reject(record)
                if record.reason == "duplicate_id" and len(duplicates) < EXAMPLES:
                    duplicates.append((kept - 0.5, record.where))  # where it falls among the positions
                continue
            position = kept
            kept += 1
            if ids is None:
                seen.add(record.id)
            held_out = is_held_out(cfg.name, record.id, cfg.held_out_fraction)
            if ids is not None:
                ids.add(record.id, position, held_out and self.cap is not None)
            if not held_out:
                counts.write(train, "train", record, cfg.name, position)
            elif self.cap is None:
                counts.write(held, "heldout", record, cfg.name, position)
            else:  # keep the `cap` smallest hashes; the largest is pushed out to train
                heapq.heappush(candidates, (-held_out_rank(cfg.name, record.id), position, record))
                candidate_ids.add(record.id)
                if len(candidates) > self.cap:
                    _, pos, doc = heapq.heappop(candidates)
                    candidate_ids.discard(doc.id)
                    counts.write(train, "train", doc, cfg.name, pos)
                    capped += 1
            if kept % 5000 == 0:
                self.stat_update("documents", value=5000)
            if cfg.max_documents and kept >= cfg.max_documents:
                break
        train.flush()
        held.flush()
        for fh in layouts.values():
            fh.close()
        if ids is not None:
            ids.close()
        self._write_candidates(rank, sorted(candidates, key=lambda c: c[1]))
        for reason, n in counts.rejected.items():
            self.stat_update(f"rejected_{reason}", value=n)
        _write_json(
            self.work / "read" / f"{rank:05d}.json",
            {
                **counts.as_dict(),
                "duplicates": duplicates,
                "kept": kept,
                "capped": capped,
                "shards": {"train": train.shards, "heldout": held.shards},
            },
        )

    def _check(self, record: Document | Rejected, *known: set[str]) -> Document | Rejected:
        if isinstance(record, Document):
            if not record.text.strip():
                return Rejected("empty", record.id)
            if len(record.text) > self.source.max_document_chars:
                return Rejected("too_large", record.id)
            if any(record.id in ids for ids in known):
                return Rejected("duplicate_id", record.id)
        return record

    def _write_candidates(self, rank: int, candidates: list[tuple[int, int, Document]]) -> None:
        """The task's held-out candidates, in read order: their hashes (read by every finishing
        task) and the documents (read by this task's)."""
        folder = self.work / "candidates"
        with open(folder / f"{rank:05d}.tsv", "w", encoding="utf-8") as fh:
            for neg, position, _ in candidates:
                fh.write(f"{-neg}\t{position}\n")
        with gzip.open(folder / f"{rank:05d}.jsonl.gz", "wt", encoding="utf-8") as fh:
            for _, position, doc in candidates:
                fh.write(json.dumps([position, doc.id, doc.text, doc.metadata], ensure_ascii=False) + "\n")


class IdBucketTask(_IngestStep):
    """Stage 2: the duplicate ids of one hash bucket, each after its first occurrence."""

    name = "🪪 Duplicate ids (one bucket)"

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> None:
        bucket = rank
        seen: set[str] = set()
        drops: dict[int, list[str]] = {}  # read task -> its duplicates in this bucket
        dropped_candidates = []
        readers = sorted((self.work / "ids").glob(f"*/{bucket:05d}.jsonl"))  # task folders, in task order
        for path in readers:
            task = int(path.parent.name)
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    position, candidate, doc_id = json.loads(line)
                    if doc_id not in seen:
                        seen.add(doc_id)
                        continue
                    drops.setdefault(task, []).append(json.dumps([position, doc_id], ensure_ascii=False) + "\n")
                    if candidate:
                        dropped_candidates.append(f"{task}\t{position}\n")
                    self.stat_update("duplicate_id")
        for task, lines in drops.items():  # one file open at a time
            folder = self.work / "drops" / f"{task:05d}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{bucket:05d}.jsonl").write_text("".join(lines), encoding="utf-8")
        (self.work / "dropped_candidates").mkdir(parents=True, exist_ok=True)
        (self.work / "dropped_candidates" / f"{bucket:05d}.tsv").write_text("".join(dropped_candidates))


class FinishTask(_IngestStep):
    """Stage 3: drop one read task's duplicates, write its held-out split, count what is left."""

    name = "🧾 Finish source part"

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> None:
        read = json.loads((self.work / "read" / f"{rank:05d}.json").read_text(encoding="utf-8"))
        self._rank = rank
        drops = self._drops(rank)
        counts = _Counts.of(read)
        shards = {split: list(names) for split, names in read["shards"].items()}
        for split in shards if drops else ():  # rewrite only the shards that hold a duplicate
            with _layout(self.work, rank, split, "r") as fh:
                for line in fh:
                    name, positions = line.rstrip("\n").split("\t")
                    self._rewrite(self.out / split, name, [int(p) for p in positions.split(",")], drops, counts, split)
                    if not (self.out / split / name).exists():
                        shards[split].remove(name)
        capped = -self._evicted_duplicates(drops)
        if self.cap is not None:
            capped += self._heldout(rank, world_size, drops, counts, shards)
        # the first duplicates in read order: those the read task found and those found here
        found = sorted([*map(tuple, read["duplicates"]), *drops.items()])[:EXAMPLES]
        if found:
            counts.examples["duplicate_id"] = [doc_id for _, doc_id in found]
        if drops:
            counts.rejected["duplicate_id"] += len(drops)
        (self.work / "finish").mkdir(parents=True, exist_ok=True)
        _write_json(
            self.work / "finish" / f"{rank:05d}.json",
            {**counts.as_dict(), "capped": read["capped"] + capped, "shards": shards},
        )

    def _drops(self, rank: int) -> dict[int, str]:
        """This task's duplicates: position -> id (the task's duplicates only)."""
        found: dict[int, str] = {}
        for path in sorted((self.work / "drops" / f"{rank:05d}").glob("*.jsonl")):
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    position, where = json.loads(line)
                    found[position] = where
        return found

    def _evicted_duplicates(self, drops: dict[int, str]) -> int:
        """Duplicates the read task had counted as pushed out by the cap (a held-out hash, in
        train): under a cap a hash-selected document reaches train only that way."""
        if self.cap is None:
            return 0
        cfg = self.source
        candidates = self.work / "candidates" / f"{self._rank:05d}.tsv"
        kept = {int(line.split("\t")[1]) for line in candidates.read_text(encoding="utf-8").splitlines()}
        return sum(
            1
            for position, doc_id in drops.items()
            if position not in kept and is_held_out(cfg.name, doc_id, cfg.held_out_fraction)
        )

    def _rewrite(
        self, folder: Path, name: str, positions: list[int], drops: dict[int, str], counts: _Counts, split: str
    ) -> None:
        if not drops.keys() & set(positions):
            return
        rows = []
        for position, row in zip(positions, read_shard(folder / name), strict=True):
            if position in drops:
                counts.docs[split] -= 1
                counts.chars[split] -= len(row["text"])
            else:
                rows.append(row)
        if rows:
            tmp = folder / f".{name}.tmp{Path(name).suffix}"
            write_shard(tmp, rows)
            os.replace(tmp, folder / name)
        else:
            (folder / name).unlink()

    def _heldout(
        self, rank: int, world: int, drops: dict[int, str], counts: _Counts, shards: dict[str, list[str]]
    ) -> int:
        """The held-out split under the cap across tasks: the `cap` smallest hashes of every
        task's candidates that are not duplicates (at most tasks x cap lines read); this task's
        chosen ones go to its held-out shards in read order, the others to an extra train shard.
        Returns how many of its candidates the cap sent to train."""
        cfg = self.source
        dropped = set()
        for path in (self.work / "dropped_candidates").glob("*.tsv"):
            for line in path.read_text(encoding="utf-8").splitlines():
                task, position = line.split("\t")
                dropped.add((int(task), int(position)))
        everyone = []
        for task in range(world):
            for line in (self.work / "candidates" / f"{task:05d}.tsv").read_text(encoding="utf-8").splitlines():
                rank_hash, position = map(int, line.split("\t"))
                if (task, position) not in dropped:
                    everyone.append((rank_hash, task, position))
        chosen = {(t, p) for _, t, p in heapq.nsmallest(self.cap, everyone)}
        prefix = task_prefix(rank, world)
        held = ShardWriter(self.out / "heldout", cfg.output_format, cfg.documents_per_shard, 1, prefix=prefix)
        extra = ShardWriter(self.out / "train", cfg.output_format, cfg.documents_per_shard, 1, prefix=f"{prefix}cap-")
        capped = 0
        with gzip.open(self.work / "candidates" / f"{rank:05d}.jsonl.gz", "rt", encoding="utf-8") as fh:
            for line in fh:
                position, doc_id, text, metadata = json.loads(line)
                if position in drops:
                    continue
                doc = Document(doc_id, text, metadata)
                if (rank, position) in chosen:
                    counts.write(held, "heldout", doc, cfg.name, position)
                else:
                    counts.write(extra, "train", doc, cfg.name, position)
                    capped += 1
        held.flush()
        extra.flush()
        shards["heldout"] += held.shards
        shards["train"] += extra.shards
        return capped


class _IdBuckets:
    """A read task's ids, one JSON-lines file per bucket. Lines are buffered and appended a
    bucket at a time, so a task never holds more than one file open (P can be thousands, above
    the open-file limit) nor more than `FLUSH_LINES` lines."""

    FLUSH_LINES = 200_000

    def __init__(self, folder: Path, rank: int, buckets: int):
        self.folder = folder / f"{rank:05d}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.buckets = buckets
        self.lines: dict[int, list[str]] = {}
        self.held = 0

    def add(self, doc_id: str, position: int, candidate: bool) -> None:
        b = id_bucket(doc_id, self.buckets)
        self.lines.setdefault(b, []).append(json.dumps([position, int(candidate), doc_id], ensure_ascii=False) + "\n")
        self.held += 1
        if self.held >= self.FLUSH_LINES:
            self.close()

    def close(self) -> None:
        for b, lines in sorted(self.lines.items()):
            with open(self.folder / f"{b:05d}.jsonl", "a", encoding="utf-8") as fh:
                fh.writelines(lines)
        self.lines, self.held = {}, 0


class _Counts:
    """Documents and characters written per split, rejected records by reason, examples."""

    def __init__(self) -> None:
        self.docs: Counter[str] = Counter()
        self.chars: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}
        self.fields: tuple[str, ...] = ()

    @classmethod
    def of(cls, stats: dict[str, Any]) -> _Counts:
        c = cls()
        c.docs.update(stats["documents"])
        c.chars.update(stats["characters"])
        c.rejected.update(stats["rejected"])
        c.examples = {k: list(v) for k, v in stats["rejected_examples"].items()}
        c.fields = tuple(stats["fields"])
        return c

    def reject(self, record: Rejected) -> None:
        self.rejected[record.reason] += record.count
        examples = self.examples.setdefault(record.reason, [])
        if len(examples) < EXAMPLES:
            examples.append(record.where)
        self.fields = self.fields or record.fields

    def write(self, writer: ShardWriter, split: str, doc: Document, source: str, position: int) -> None:
        writer.add(doc, source, position)
        self.docs[split] += 1
        self.chars[split] += len(doc.text)

    def as_dict(self) -> dict[str, Any]:
        return {
            "documents": dict(self.docs),
            "characters": dict(self.chars),
            "rejected": dict(self.rejected),
            "rejected_examples": self.examples,
            "fields": list(self.fields),
        }


def merge_stats(work: Path, tasks: int) -> dict[str, Any]:
    """The finish stage's counts of every task summed: documents and characters per split,
    rejected records per reason with the first examples in read order, shards in task order."""
    total = _Counts()
    capped = 0
    shards: dict[str, list[str]] = {"train": [], "heldout": []}
    for rank in range(tasks):
        stats = json.loads((work / "finish" / f"{rank:05d}.json").read_text(encoding="utf-8"))
        part = _Counts.of(stats)
        total.docs.update(part.docs)
        total.chars.update(part.chars)
        total.rejected.update(part.rejected)
        total.fields = total.fields or part.fields
        for reason, where in part.examples.items():
            examples = total.examples.setdefault(reason, [])
            examples += where[: EXAMPLES - len(examples)]
        capped += stats["capped"]
        for split in shards:
            shards[split] += stats["shards"][split]
    merged = total.as_dict()
    merged["rejected_examples"] = {k: v for k, v in merged["rejected_examples"].items() if v}
    return {**merged, "capped": capped, "shards": shards}


def ingest_stages(
    source: SourceConfig, seed: int, out: Path, tasks: int, buckets: int, cap: int | None
) -> list[tuple[str, list, int]]:
    """The stages of one source's ingestion, as `make_executors` takes them: (name, pipeline,
    tasks). The duplicate-id stage is left out for a capped source (its one task keeps the ids)."""
    args = (source, seed, out, buckets, cap)
    stages = [("read", [ReadTask(*args)], tasks)]
    if source.max_documents is None:
        stages.append(("ids", [IdBucketTask(*args)], buckets))
    stages.append(("finish", [FinishTask(*args)], tasks))
    return stages


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False), encoding="utf-8")


def _layout(work: Path, rank: int, split: str, mode: str) -> Any:
    """A read task's layout of one split: a line per shard, its name and the positions it holds."""
    return open(work / "layout" / f"{rank:05d}-{split}.tsv", mode, encoding="utf-8")
