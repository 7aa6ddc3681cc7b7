"""Held-out decontamination: the index of held-out documents (exact hashes and word n-grams),
built by datatrove tasks, and the filter that removes training documents copying them (docs/data.md).

The index is built on the curation executor in three stages, so that no process holds more than
its share of it and the step's own process (on the flow host) holds none of it:

    index_shards  (one task per block of held-out files) each held-out document's text hash and
                  n-grams, with its document number, written per partition (the top bits of the
                  hash) in chunks of at most `flush_ngrams` n-grams
    index_merge   (one task per partition) the partition's n-grams of every shard task, sorted
    index_finish  (one task) the partitions laid end to end (top bits first: the whole array is
                  sorted), the documents' ids and sizes, and `index.json`, written last

The result is the same arrays, byte for byte, as `HeldoutIndex.build` over the same documents in
the same order (tests/curation/test_heldout.py), saved as `.npy` files that every curation task
memory-maps (file pages, shared by the tasks of a node) instead of loading. A task that dies
leaves no completion marker (datatrove's) and no file a later stage reads: every output is
written under a temporary name and renamed, and a folder without `index.json` is no index.

Like every module of this package it imports datatrove only (no Prefect).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
from datatrove.data import Document
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters.base_filter import BaseFilter

from curation.filters import REWRITTEN_FROM, text_hash

_WORD = re.compile(r"\w+")


_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier of the polynomial n-gram hash


def exact_text(doc: Document) -> str:
    """What exact dedup compares: the text without surrounding whitespace."""
    return doc.text.strip()


def word_ngrams(text: str, n: int) -> np.ndarray:
    """Sorted distinct 64-bit hashes of the lowercased word n-grams of `text`.

    Words are `\\w+` runs, as in the eval suite's contamination report; hashes are xxhash, so
    they are the same in every process (Python's `hash` of a str is salted per process).
    """
    words = _WORD.findall(text.lower())
    m = len(words) - n + 1
    if m <= 0:
        return np.empty(0, dtype=np.uint64)
    h = np.fromiter((xxhash.xxh64_intdigest(w) for w in words), dtype=np.uint64, count=len(words))
    grams = np.zeros(m, dtype=np.uint64)
    for k in range(n):
        grams = grams * _MIX + h[k : k + m]  # wraps modulo 2**64, as intended
    return np.unique(grams)


def heldout_forms(doc_id: str, text: str, rewrites: bool) -> Iterator[tuple[str, str]]:
    """What the index holds of one held-out document: its text as the source wrote it and, where
    its source's preset rewrites text (`docs`: prose only), also as curation keeps it: the eval
    suite's items come from that form, and rewriting changes the n-grams (links and inline markup
    unwrapped, code dropped) so that the written form alone misses copies of it."""
    yield doc_id, text
    if rewrites:
        from curation.filters import prose_text

        kept = prose_text(text)
        if kept and kept != text:
            yield doc_id, kept


@dataclass(frozen=True)
class HeldoutFile:
    """One shard of a source's held-out split, as the index reads it."""

    path: str
    source: str  # the ids are "source/id"
    rewrites: bool  # the source's preset rewrites text: index the kept form too (`heldout_forms`)


def read_heldout_files(files: Sequence[HeldoutFile]) -> Iterator[tuple[str, str]]:
    """(source/id, text) of every document the index holds, in the index's order."""
    from curation.source_kinds import read_shard

    for f in files:
        for doc in read_shard(Path(f.path)):
            yield from heldout_forms(f"{f.source}/{doc['id']}", doc["text"], f.rewrites)


# a held-out document id as Python holds it in a task's list: ~50 bytes besides its characters
ID_OVERHEAD = 50
INDEX_FILES = ("grams.npy", "owners.npy", "exact.npy", "sizes.npy", "ids.json")


def _atomic_save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        np.save(fh, array)
    os.replace(tmp, path)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def index_report(header: dict, caps: list[int | None]) -> dict:
    """An index's size (from its `index.json`) now and at the held-out caps of the sources it
    indexes (`caps`, one per source; None where a source has no cap, and then no bound): the
    bytes a task holds once it has touched every page of it (its arrays are memory-mapped, so
    the tasks of a node share them)."""
    documents = header["documents"]
    nbytes = 8 * header["exact"] + 12 * header["ngrams"] + 8 * documents + header["id_bytes"]
    per_doc = nbytes / documents if documents else 0.0
    bound = None if not caps or any(c is None for c in caps) else sum(caps)
    return {
        "documents": documents,
        "ngrams": header["ngrams"],
        "bytes": nbytes,
        "bytes_per_document": round(per_doc, 1),
        "documents_at_cap": bound,
        "bytes_at_cap": None if bound is None else round(per_doc * bound),
    }


@dataclass
class HeldoutIndex:
    """Every held-out document's text hash and word n-grams, for decontaminating training text.

    `grams` holds one entry per (n-gram, held-out document) pair, sorted, with its document in
    `owners`; 12 bytes per held-out n-gram, so a held-out split of 10M words takes ~120 MB.
    """

    ngram: int
    ids: list[str]  # held-out document ids ("source/id"), to say which one a text copies
    exact: np.ndarray  # sorted text hashes (uint64)
    grams: np.ndarray  # sorted n-gram hashes (uint64)
    owners: np.ndarray  # held-out document of each n-gram entry (int32)
    sizes: np.ndarray  # distinct n-grams per held-out document (int64)

    @classmethod
    def build(cls, docs: Iterable[tuple[str, str]], ngram: int) -> HeldoutIndex:
        """From (id, text) pairs, in this process (the reference the sharded build is held to,
        and small indexes); the curate step builds with `index_stages` on its executor."""
        ids, exact, grams, owners, sizes = [], [], [], [], []
        for i, (doc_id, text) in enumerate(docs):
            ids.append(doc_id)
            exact.append(text_hash(text))
            g = word_ngrams(text, ngram)
            grams.append(g)
            owners.append(np.full(len(g), i, dtype=np.int32))
            sizes.append(len(g))
        all_grams = np.concatenate(grams) if grams else np.empty(0, dtype=np.uint64)
        all_owners = np.concatenate(owners) if owners else np.empty(0, dtype=np.int32)
        order = np.argsort(all_grams, kind="stable")
        return cls(
            ngram,
            ids,
            np.unique(np.asarray(exact, dtype=np.uint64)),
            all_grams[order],
            all_owners[order],
            np.asarray(sizes, dtype=np.int64),
        )

    def __len__(self) -> int:
        return len(self.ids)

    def header(self) -> dict:
        """What `index.json` says of it."""
        return {
            "ngram": self.ngram,
            "documents": len(self.ids),
            "ngrams": int(len(self.grams)),
            "exact": int(len(self.exact)),
            "id_bytes": sum(ID_OVERHEAD + len(i) for i in self.ids),
        }

    def nbytes(self) -> int:
        """Bytes it takes in a process that touched all of it: its arrays and its ids (as Python
        strings, about 50 bytes each besides their characters)."""
        arrays = self.exact.nbytes + self.grams.nbytes + self.owners.nbytes + self.sizes.nbytes
        return arrays + sum(ID_OVERHEAD + len(i) for i in self.ids)

    def report(self, caps: list[int | None]) -> dict:
        """Its size now and at the held-out caps of the sources it indexes (`index_report`)."""
        return index_report(self.header(), caps)

    def save(self, folder: Path) -> None:
        """As the sharded build writes it: one `.npy` per array, the ids, `index.json` last."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("grams", "owners", "exact", "sizes"):
            _atomic_save(folder / f"{name}.npy", getattr(self, name))
        _atomic_text(folder / "ids.json", json.dumps(self.ids))
        _atomic_text(folder / "index.json", json.dumps(self.header()))

    @staticmethod
    def read_header(folder: Path) -> dict:
        """`index.json` of a finished index; a folder without it is not one (a build that died)."""
        path = Path(folder) / "index.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"held-out index {folder}: no index.json, so its build did not finish; rerun the curate step "
                "(finished build tasks are skipped)"
            )
        return json.loads(path.read_text(encoding="utf-8"))

    @classmethod
    def load(cls, folder: Path, mmap: bool = True) -> HeldoutIndex:
        """A finished index; its arrays memory-mapped (`mmap`: pages read as lookups touch them,
        shared by every process of the machine that maps them) or read whole."""
        folder = Path(folder)
        head = cls.read_header(folder)
        mode = "r" if mmap else None
        arrays = {n: np.load(folder / f"{n}.npy", mmap_mode=mode) for n in ("exact", "grams", "owners", "sizes")}
        ids = json.loads((folder / "ids.json").read_text(encoding="utf-8"))
        return cls(head["ngram"], ids, arrays["exact"], arrays["grams"], arrays["owners"], arrays["sizes"])

    def has_text_hash(self, h: int) -> bool:
        """Whether a held-out document's text has hash `h` (`text_hash`)."""
        i = np.searchsorted(self.exact, np.uint64(h))
        return bool(i < len(self.exact) and self.exact[i] == np.uint64(h))

    def match(self, text: str, min_ngrams: int) -> tuple[str | None, float, str | None]:
        """(reason, overlap, held-out id) of the held-out document `text` copies most.

        reason is "exact" for the same text, else None; overlap is the largest share of shared
        n-grams, |G(text) & G(h)| / min(|G(text)|, max(|G(h)|, min_ngrams)) over held-out
        documents h: a training text that is mostly held-out text, or that contains most of a
        held-out document, scores near 1. The `min_ngrams` floor keeps a short held-out
        document (a license header, a one-line module) from making every long text that
        quotes it count as a copy.
        """
        h = np.uint64(text_hash(text))
        i = np.searchsorted(self.exact, h)
        if i < len(self.exact) and self.exact[i] == h:
            return "exact", 1.0, None
        grams = word_ngrams(text, self.ngram)
        if not len(grams) or not len(self.grams):
            return None, 0.0, None
        left = np.searchsorted(self.grams, grams, "left")
        counts = np.searchsorted(self.grams, grams, "right") - left
        total = int(counts.sum())
        if total == 0:
            return None, 0.0, None
        starts = np.repeat(left - np.cumsum(counts) + counts, counts)
        owners = self.owners[starts + np.arange(total)]
        shared = np.bincount(owners)
        docs = np.nonzero(shared)[0]
        denom = np.minimum(len(grams), np.maximum(self.sizes[docs], min_ngrams))
        scores = shared[docs] / denom
        best = int(np.argmax(scores))
        return None, float(scores[best]), self.ids[int(docs[best])]


class HeldoutDecontFilter(BaseFilter):
    """Drops training documents that copy held-out text: the same text (`exact`), or an n-gram
    overlap with one held-out document at or above `threshold` (`overlap`; near duplicates,
    and texts that contain most of a held-out document). The held-out id and overlap go into
    the dropped document's metadata, so `removed/heldout_decont/` shows what it copied."""

    name = "🧪 Held-out decontamination"
    slug = "heldout_decont"

    def __init__(self, index_path: str, threshold: float, min_ngrams: int, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.index_path = index_path
        self.threshold = threshold
        self.min_ngrams = min_ngrams
        self._index: HeldoutIndex | None = None  # loaded in the worker, not pickled

    def __getstate__(self) -> dict:
        # a task's mapped index stays in its process: the executor of a later stage pickles
        # this one (its `depends`) for its workers, and a memory map cannot travel
        return {**self.__dict__, "_index": None}

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        if self._index is None:
            self._index = HeldoutIndex.load(Path(self.index_path))  # memory-mapped
        written = doc.metadata.pop(REWRITTEN_FROM, None)  # the hash of the text as the source wrote it
        reason, overlap, heldout_id = self._index.match(doc.text, self.min_ngrams)
        if reason == "exact" or (written is not None and self._index.has_text_hash(written)):
            return False, "exact"
        if overlap >= self.threshold:
            doc.metadata["heldout_overlap"] = round(overlap, 4)
            doc.metadata["heldout_id"] = heldout_id
            return False, "overlap"
        return True


# --- the index built by datatrove tasks ---------------------------------------------------------


def _partition(grams: np.ndarray, partitions: int) -> np.ndarray:
    """The partition of each n-gram hash: its top bits, so partition p holds a contiguous range
    of hashes and the partitions laid end to end are sorted."""
    bits = partitions.bit_length() - 1
    if bits == 0:
        return np.zeros(len(grams), dtype=np.int64)
    return (grams >> np.uint64(64 - bits)).astype(np.int64)


def _block(items: int, rank: int, world_size: int) -> range:
    """Rank's contiguous share of `items` (so the ranks' documents, in rank order, are the
    index's document order)."""
    return range(items * rank // world_size, items * (rank + 1) // world_size)


class HeldoutIndexShards(PipelineStep):
    """Stage `index_shards`: this task's block of held-out files to its document ids, sizes and
    text hashes, and its (n-gram, document) pairs per partition, in chunks of `flush_ngrams`
    pairs at most: its memory is a chunk plus ~100 bytes per document of its block."""

    name = "🧪 Held-out index: shards"
    type = "🔢 - INDEX"

    def __init__(self, files: Sequence[HeldoutFile], folder: str, ngram: int, partitions: int, flush_ngrams: int):
        super().__init__()
        self.files = list(files)
        self.folder = folder
        self.ngram = ngram
        self.partitions = partitions
        self.flush_ngrams = flush_ngrams

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        final = Path(self.folder) / "shards" / f"{rank:05d}"
        tmp = final.with_name(final.name + ".tmp")
        for stale in (tmp, final):  # an earlier attempt of this task that died before its marker
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
        mine = [self.files[i] for i in _block(len(self.files), rank, world_size)]
        ids: list[str] = []
        sizes: list[int] = []
        exact: list[int] = []
        grams: list[np.ndarray] = []
        owners: list[np.ndarray] = []
        pending = chunks = 0
        counts = np.zeros(self.partitions, dtype=np.int64)

        def flush() -> None:
            nonlocal pending, chunks, grams, owners
            g = np.concatenate(grams) if grams else np.empty(0, dtype=np.uint64)
            o = np.concatenate(owners) if owners else np.empty(0, dtype=np.int32)
            grams, owners = [], []
            part = _partition(g, self.partitions)
            order = np.argsort(part, kind="stable")  # keeps document order within a partition
            g, o = g[order], o[order]
            ends = np.cumsum(np.bincount(part, minlength=self.partitions))
            for p in range(self.partitions):
                lo, hi = (ends[p - 1] if p else 0), ends[p]
                np.save(tmp / f"g{p:05d}-{chunks:05d}.npy", g[lo:hi])
                np.save(tmp / f"o{p:05d}-{chunks:05d}.npy", o[lo:hi])
                counts[p] += hi - lo
            chunks += 1
            pending = 0

        for doc_id, text in read_heldout_files(mine):
            g = word_ngrams(text, self.ngram)
            grams.append(g)
            owners.append(np.full(len(g), len(ids), dtype=np.int32))
            ids.append(doc_id)
            sizes.append(len(g))
            exact.append(text_hash(text))
            self.stat_update("documents")
            self.stat_update("ngrams", value=len(g))
            pending += len(g)
            if pending >= self.flush_ngrams:
                flush()
        if pending or not chunks:
            flush()
        hashes = np.asarray(exact, dtype=np.uint64)
        part = _partition(hashes, self.partitions)
        for p in range(self.partitions):
            np.save(tmp / f"e{p:05d}.npy", hashes[part == p])
        np.save(tmp / "sizes.npy", np.asarray(sizes, dtype=np.int64))
        (tmp / "ids.json").write_text(json.dumps(ids), encoding="utf-8")
        (tmp / "shard.json").write_text(
            json.dumps({"documents": len(ids), "chunks": chunks, "ngrams": counts.tolist()}), encoding="utf-8"
        )
        os.replace(tmp, final)  # the shard exists only whole
        return data


def _shard_heads(folder: Path, shards: int) -> list[dict]:
    heads = []
    for r in range(shards):
        path = folder / "shards" / f"{r:05d}" / "shard.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"held-out index: shard {r} of {shards} is missing ({path}); its task did not finish"
            )
        heads.append(json.loads(path.read_text(encoding="utf-8")))
    return heads


class HeldoutIndexMerge(PipelineStep):
    """Stage `index_merge`: partition `rank`'s pairs of every shard, numbered in the index's
    document order and sorted by n-gram (stably: a tie keeps document order, as
    `HeldoutIndex.build` does), and its text hashes, unique; its memory grows ~20 bytes per
    pair of its partition (benchmarks/data_scale.py, traced heap)."""

    name = "🧪 Held-out index: merge"
    type = "🔢 - INDEX"

    def __init__(self, folder: str, shards: int):
        super().__init__()
        self.folder = folder
        self.shards = shards

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        folder = Path(self.folder)
        heads = _shard_heads(folder, self.shards)
        offsets = np.cumsum([0] + [h["documents"] for h in heads])
        grams, owners, exact = [], [], []
        for r, head in enumerate(heads):
            shard = folder / "shards" / f"{r:05d}"
            for c in range(head["chunks"]):
                grams.append(np.load(shard / f"g{rank:05d}-{c:05d}.npy"))
                owners.append(np.load(shard / f"o{rank:05d}-{c:05d}.npy") + np.int32(offsets[r]))
            exact.append(np.load(shard / f"e{rank:05d}.npy"))
        g = np.concatenate(grams)
        o = np.concatenate(owners)
        del grams, owners
        order = np.argsort(g, kind="stable")
        parts = folder / "parts"
        parts.mkdir(exist_ok=True)
        _atomic_save(parts / f"grams-{rank:05d}.npy", g[order])
        _atomic_save(parts / f"owners-{rank:05d}.npy", o[order].astype(np.int32))
        _atomic_save(parts / f"exact-{rank:05d}.npy", np.unique(np.concatenate(exact)))
        self.stat_update("ngrams", value=len(g))
        return data


def _npy_body(path: Path, dtype: np.dtype):
    """An open `.npy` file of a 1-D `dtype` array positioned at its data, and its length."""
    fh = open(path, "rb")  # noqa: SIM115 (the caller closes it)
    version = np.lib.format.read_magic(fh)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, got = read(fh)
    if got != dtype or len(shape) != 1 or fortran:
        fh.close()
        raise ValueError(f"held-out index: {path} holds {got} {shape}, not a 1-D {dtype} array")
    return fh, shape[0]


def _concat_npy(path: Path, parts: Sequence[Path], dtype: np.dtype, block: int = 1 << 22) -> int:
    """The 1-D arrays in `parts` (all of `dtype`), end to end, as one `.npy` at `path` (written
    under a temporary name, renamed), copied through a buffer of `block` entries with plain
    reads: its memory is the buffer whatever the size (a memory map would keep every page it
    read resident in this task until it is unmapped)."""
    dtype = np.dtype(dtype)
    total = 0
    for part in parts:
        fh, n = _npy_body(part, dtype)
        fh.close()
        total += n
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as out:
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (total,)}
        np.lib.format.write_array_header_1_0(out, header)
        for part in parts:
            fh, n = _npy_body(part, dtype)
            with fh:
                left = n * dtype.itemsize
                while left:
                    chunk = fh.read(min(left, block * dtype.itemsize))
                    if not chunk:
                        raise EOFError(f"held-out index: {part} ends before its {n} entries")
                    out.write(chunk)
                    left -= len(chunk)
    os.replace(tmp, path)
    return total


class HeldoutIndexFinish(PipelineStep):
    """Stage `index_finish` (one task): the partitions end to end, the shards' ids and sizes in
    rank order, then `index.json`, last. Arrays are copied in blocks and the ids a shard at a
    time, so its memory is a block plus one shard's ids."""

    name = "🧪 Held-out index: finish"
    type = "🔢 - INDEX"

    def __init__(self, folder: str, shards: int, partitions: int, ngram: int):
        super().__init__()
        self.folder = folder
        self.shards = shards
        self.partitions = partitions
        self.ngram = ngram

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        folder = Path(self.folder)
        index = folder / "index"
        index.mkdir(exist_ok=True)
        (index / "index.json").unlink(missing_ok=True)  # rewritten last
        heads = _shard_heads(folder, self.shards)
        shards = [folder / "shards" / f"{r:05d}" for r in range(self.shards)]
        parts = folder / "parts"
        for name, dtype in (("grams", np.uint64), ("owners", np.int32), ("exact", np.uint64)):
            files = [parts / f"{name}-{p:05d}.npy" for p in range(self.partitions)]
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(
                    f"held-out index: partition file {missing[0]} is missing; its merge task did not finish"
                )
            _concat_npy(index / f"{name}.npy", files, dtype)
        documents = _concat_npy(index / "sizes.npy", [s / "sizes.npy" for s in shards], np.int64)
        tmp = index / "ids.json.tmp"
        id_bytes, first = 0, True
        with open(tmp, "w", encoding="utf-8") as fh:  # a JSON list, written a shard at a time
            fh.write("[")
            for s in shards:
                for doc_id in json.loads((s / "ids.json").read_text(encoding="utf-8")):
                    fh.write(("" if first else ", ") + json.dumps(doc_id))
                    id_bytes += ID_OVERHEAD + len(doc_id)
                    first = False
            fh.write("]")
        os.replace(tmp, index / "ids.json")
        header = {
            "ngram": self.ngram,
            "documents": documents,
            "ngrams": int(sum(sum(h["ngrams"]) for h in heads)),
            "exact": int(len(np.load(index / "exact.npy", mmap_mode="r"))),
            "id_bytes": id_bytes,
        }
        _atomic_text(index / "index.json", json.dumps(header))
        self.stat_update("documents", value=documents)
        return data


@dataclass(frozen=True)
class IndexPlan:
    """The sharded build of one curate step's held-out index (`index_stages`)."""

    files: tuple[HeldoutFile, ...]  # every held-out shard indexed, in the index's order
    folder: Path  # its work folder; the finished index is `folder/index`
    ngram: int
    partitions: int  # merge tasks; a power of two
    shards: int  # shard tasks (at most one per file)
    flush_ngrams: int = 2_000_000  # pairs a shard task holds before writing a chunk

    @property
    def index(self) -> Path:
        return self.folder / "index"


def index_stages(plan: IndexPlan) -> list[tuple[str, list, int]]:
    """The three stages that build the index, as (name, datatrove pipeline, tasks)."""
    if plan.partitions & (plan.partitions - 1) or plan.partitions < 1:
        raise ValueError(f"decontamination.index_partitions must be a power of two, got {plan.partitions}")
    folder = str(plan.folder)
    shards = max(1, min(plan.shards, len(plan.files)))
    return [
        (
            "index_shards",
            [HeldoutIndexShards(plan.files, folder, plan.ngram, plan.partitions, plan.flush_ngrams)],
            shards,
        ),
        ("index_merge", [HeldoutIndexMerge(folder, shards)], plan.partitions),
        ("index_finish", [HeldoutIndexFinish(folder, shards, plan.partitions, plan.ngram)], 1),
    ]


INDEX_STAGES = ("index_shards", "index_merge", "index_finish")
