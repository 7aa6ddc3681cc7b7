"""Held-out decontamination: the index of held-out documents (exact hashes and word n-grams) and
the filter that removes training documents copying them (docs/data.md).

Like every module of this package it imports datatrove only (no Prefect).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
from datatrove.data import Document
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


@dataclass
class HeldoutIndex:
    """Every held-out document's text hash and word n-grams, for decontaminating training text.

    `grams` holds one entry per (n-gram, held-out document) pair, sorted, with its document in
    `owners`; 12 bytes per held-out n-gram, so a held-out split of 10M words fits in ~120 MB.
    """

    ngram: int
    ids: list[str]  # held-out document ids ("source/id"), to say which one a text copies
    exact: np.ndarray  # sorted text hashes (uint64)
    grams: np.ndarray  # sorted n-gram hashes (uint64)
    owners: np.ndarray  # held-out document of each n-gram entry (int32)
    sizes: np.ndarray  # distinct n-grams per held-out document (int64)

    @classmethod
    def build(cls, docs: Iterable[tuple[str, str]], ngram: int) -> HeldoutIndex:
        """From (id, text) pairs."""
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

    def nbytes(self) -> int:
        """Bytes it takes in a process that loaded it: its arrays and its ids (as Python strings,
        about 50 bytes each besides their characters)."""
        arrays = self.exact.nbytes + self.grams.nbytes + self.owners.nbytes + self.sizes.nbytes
        return arrays + sum(50 + len(i) for i in self.ids)

    def report(self, caps: list[int | None]) -> dict:
        """Its size now and at the held-out caps of the sources it indexes (`caps`, one per
        source; None where a source has no cap, and then no bound): every datatrove task of a
        curate step loads it whole, so this is memory per task."""
        per_doc = self.nbytes() / len(self) if len(self) else 0.0
        bound = None if not caps or any(c is None for c in caps) else sum(caps)
        return {
            "documents": len(self),
            "ngrams": int(len(self.grams)),
            "bytes": self.nbytes(),
            "bytes_per_document": round(per_doc, 1),
            "documents_at_cap": bound,
            "bytes_at_cap": None if bound is None else round(per_doc * bound),
        }

    def save(self, path: Path) -> None:
        np.savez(path, exact=self.exact, grams=self.grams, owners=self.owners, sizes=self.sizes)
        Path(str(path) + ".json").write_text(json.dumps({"ngram": self.ngram, "ids": self.ids}), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> HeldoutIndex:
        head = json.loads(Path(str(path) + ".json").read_text(encoding="utf-8"))
        with np.load(path) as z:
            return cls(head["ngram"], head["ids"], z["exact"], z["grams"], z["owners"], z["sizes"])

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

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        if self._index is None:
            self._index = HeldoutIndex.load(Path(self.index_path))
        written = doc.metadata.pop(REWRITTEN_FROM, None)  # the hash of the text as the source wrote it
        reason, overlap, heldout_id = self._index.match(doc.text, self.min_ngrams)
        if reason == "exact" or (written is not None and self._index.has_text_hash(written)):
            return False, "exact"
        if overlap >= self.threshold:
            doc.metadata["heldout_overlap"] = round(overlap, 4)
            doc.metadata["heldout_id"] = heldout_id
            return False, "overlap"
        return True
