"""datatrove pipeline components of the data steps: a counting reader, filters, sample writer,
the held-out n-gram index and the filter that decontaminates training text against it.

They live apart from tasks/curate.py because datatrove's worker processes unpickle the pipeline
and import the modules its components come from: this one imports datatrove only, not Prefect,
so a worker starts in under a second instead of several.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.lid import FastTextLID

READ_REASONS = ("malformed_json", "invalid_utf8", "missing_text_field", "empty", "too_large")

# Names that camel-case splitting gets wrong: FineWeb is one word in FineWeb's own papers.
_NAME_OVERRIDES = {"FineWebQualityFilter": "fineweb_quality"}


def filter_name(component) -> str:
    """The one name of a pipeline component everywhere: filter_stats rows, `removed/<name>/`
    folders, `<name>:<reason>` keys of the meta and the docs (GopherQualityFilter ->
    gopher_quality). A component may set `slug` to choose its own."""
    slug = getattr(component, "slug", None)
    if slug:
        return slug
    cls = type(component).__name__
    if cls in _NAME_OVERRIDES:
        return _NAME_OVERRIDES[cls]
    if cls.endswith("Filter") and cls != "Filter":
        cls = cls[: -len("Filter")]
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls).lower()


# --- reading with accounting ------------------------------------------------------------------


class CountingJsonlReader(JsonlReader):
    """datatrove's JsonlReader, but every line that does not become a document is counted.

    The stock reader logs malformed lines and skips documents without text; here each such line
    becomes a `rejected_{reason}` statistic with a few example locations, so nothing vanishes.
    With `rank_files`, rank r reads exactly `{r:05d}.jsonl.gz` (the dedup stages need the same
    per-rank document order as the stage that computed their signatures).
    """

    name = "🐿 Jsonl (counted)"

    def __init__(self, data_folder, *, max_chars: int = 1_000_000, rank_files: bool = False, **kw):
        super().__init__(data_folder, compression="gzip", glob_pattern="*.jsonl.gz", **kw)
        self.max_chars = max_chars
        self.rank_files = rank_files

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1):
        if not self.rank_files:
            yield from super().run(data, rank, world_size)
            return
        name = f"{rank:05d}.jsonl.gz"
        if self.data_folder.exists(name):
            for doc in self.read_files_shard([name]):
                self.update_doc_stats(doc)
                yield doc

    def _reject(self, reason: str, where: str) -> None:
        self.stat_update(f"rejected_{reason}")
        self.stat_update("rejected")
        self._examples = getattr(self, "_examples", Counter())
        self._examples[reason] += 1
        if self._examples[reason] <= 5:  # a few locations per reason, in the stage's task log
            from datatrove.utils.logging import logger

            logger.warning(f"rejected line ({reason}) at {where}")

    def read_file(self, filepath: str):
        import orjson

        with self.data_folder.open(filepath, "rb", compression=self.compression) as f:
            for li, raw in enumerate(f):
                if not raw.strip():
                    continue
                where = f"{filepath}:{li + 1}"
                try:
                    record = orjson.loads(raw)
                except orjson.JSONDecodeError as exc:
                    # orjson validates UTF-8 itself, and refuses lone surrogates (\ud800): text
                    # that could not be written back as UTF-8
                    bad_text = "UTF-8" in str(exc) or "surrogate" in str(exc)
                    self._reject("invalid_utf8" if bad_text else "malformed_json", where)
                    continue
                if not isinstance(record, dict) or not isinstance(record.get(self.text_key), str):
                    self._reject("missing_text_field" if isinstance(record, dict) else "malformed_json", where)
                    continue
                text = record[self.text_key]
                if not text.strip():
                    self._reject("empty", where)
                    continue
                if len(text) > self.max_chars:
                    self._reject("too_large", where)
                    continue
                record.setdefault(self.id_key, where)
                document = self.get_document_from_dict(record, filepath, li)
                if document is not None:
                    yield document


class SampleWriter(JsonlWriter):
    """An exclusion writer that keeps at most `per_reason` removed documents per drop reason."""

    def __init__(self, output_folder, per_reason: int):
        super().__init__(output_folder, output_filename="${rank}.jsonl.gz")
        self.per_reason = per_reason
        self._seen: Counter[str] = Counter()

    def write(self, document: Document, rank: int = 0, **kwargs):
        reason = document.metadata.get("filter_reason", "duplicate")
        self._seen[reason] += 1
        if self._seen[reason] <= self.per_reason:
            super().write(document, rank, **kwargs)


# --- filters that suit code and math ----------------------------------------------------------


class CodeLineLengthFilter(BaseFilter):
    """Drops minified or data-like files: a very long line, or long lines on average."""

    name = "📏 Code line length"

    def __init__(self, max_line_length: int = 1000, max_mean_line_length: int = 100, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.max_line_length = max_line_length
        self.max_mean_line_length = max_mean_line_length

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        lengths = [len(line) for line in doc.text.splitlines()] or [0]
        if max(lengths) > self.max_line_length:
            return False, "max_line_length"
        if sum(lengths) / len(lengths) > self.max_mean_line_length:
            return False, "mean_line_length"
        return True


class AlphanumericFractionFilter(BaseFilter):
    """Drops files that are mostly symbols or binary-like blobs (The Stack's heuristic)."""

    name = "🔤 Alphanumeric fraction"

    def __init__(self, min_fraction: float = 0.25, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.min_fraction = min_fraction

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        text = doc.text
        alnum = sum(c.isalnum() for c in text)
        if alnum / max(len(text), 1) < self.min_fraction:
            return False, "alphanumeric_fraction"
        return True


_AUTOGENERATED = re.compile(
    r"auto-?generated|automatically generated|generated by|do not edit|code generator",
    re.IGNORECASE,
)


class AutogeneratedFilter(BaseFilter):
    """Drops files whose header says a tool generated them (lock files, protobuf stubs, ...)."""

    name = "🤖 Autogenerated"

    def __init__(self, header_lines: int = 5, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.header_lines = header_lines

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        header = "\n".join(doc.text.splitlines()[: self.header_lines])
        if _AUTOGENERATED.search(header):
            return False, "autogenerated"
        return True


class LengthFilter(BaseFilter):
    """Drops documents shorter than `min_chars` (too little text to teach anything)."""

    name = "📐 Length"

    def __init__(self, min_chars: int = 20, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.min_chars = min_chars

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        if len(doc.text.strip()) < self.min_chars:
            return False, "too_short"
        return True


def exact_text(doc: Document) -> str:
    """What exact dedup compares: the text without surrounding whitespace."""
    return doc.text.strip()


class LocalLID(FastTextLID):
    """datatrove's fastText language identifier reading a local model file (no download)."""

    def __init__(self, path: str, languages: list[str] | None = None):
        super().__init__(languages)
        self.path = path

    @property
    def model(self):
        if self._model is None:
            from fasttext.FastText import _FastText

            self._model = _FastText(self.path)
        return self._model


# --- documentation prose ----------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)")
# Lines that are markup or code, never prose: doctest prompts, reST directives and fields
# (`.. image::`, `   :target: url`, `:param name: ...`), table rows, HTML, badges and images,
# heading underlines, lines holding only a URL.
_MARKUP_LINE = re.compile(
    r"^\s*(>>>|\.\.\.(\s|$)|\.\.(\s|$)|:[\w -]+:(\s|$)|\||<[a-zA-Z/!]|\[!\[|!\[|"
    r"[=\-*~^#+_`'\"]{3,}\s*$|https?://\S+\s*$)"
)
# Inline markup unwrapped to its text (the words stay, the syntax goes).
_INLINE = (
    (re.compile(r"!\[[^\]]*\]\([^)]*\)"), ""),  # Markdown image
    (re.compile(r"\[([^\]]+)\]\([^)]*\)"), r"\1"),  # Markdown link
    (re.compile(r"`([^`<]+?)\s*<[^>]+>`_+"), r"\1"),  # reST link
    (re.compile(r":[\w:.-]+:`~?([^`]+)`"), r"\1"),  # reST role (:func:`name`)
    (re.compile(r"``([^`]+)``"), r"\1"),
    (re.compile(r"`([^`]+)`_*"), r"\1"),
    (re.compile(r"\*\*([^*]+)\*\*"), r"\1"),
    (re.compile(r"(?<!\w)\*([^*\s][^*]*)\*(?!\w)"), r"\1"),
    (re.compile(r"<[^>\n]+>"), ""),  # inline HTML tag
)
_LIST_ITEM = re.compile(r"^\s*([-*+\u2022]|\d+[.)])\s")
_CODE_CHARS = frozenset("{}[]()<>=;_\\|`$@#")


def prose_text(text: str) -> str:
    """The English prose of documentation text (reStructuredText, Markdown, docstrings, pydoc).

    Code (fenced, indented literal blocks, doctest), tables, directives, badges and heading
    underlines are dropped; inline markup is unwrapped to its words; hard-wrapped lines of a
    paragraph are joined (web heuristics read a line as a paragraph: wrapped at 72 columns,
    almost no line ends in punctuation); a paragraph repeated inside the document is kept once
    (a module's docstrings repeat across sync and async variants).
    """
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced or _MARKUP_LINE.match(line) else line.rstrip())
    kept: list[str] = []
    seen: set[str] = set()
    for block in re.split(r"\n\s*\n", "\n".join(lines)):
        if not block.strip():
            continue
        first = block.lstrip("\n").split("\n", 1)[0]
        if len(first) - len(first.lstrip()) >= 3:  # a literal or code block
            continue
        for pattern, repl in _INLINE:
            block = pattern.sub(repl, block)
        words = block.split()
        if len(words) < 4:
            continue
        if sum(c in _CODE_CHARS for c in block) > 0.05 * len(block):  # code-like paragraph
            continue
        if sum(any(ch.isalpha() for ch in w) for w in words) < 0.8 * len(words):
            continue
        paragraph = _unwrap(block)
        if paragraph not in seen:
            seen.add(paragraph)
            kept.append(paragraph)
    return "\n\n".join(kept)


def _unwrap(block: str) -> str:
    out: list[str] = []
    for line in block.strip("\n").splitlines():
        line = line.strip()
        if not line:
            continue
        if out and not _LIST_ITEM.match(line):
            out[-1] += " " + line
        else:
            out.append(line)
    return "\n".join(out)


# Metadata key: the hash of a document's text before a filter rewrote it (read and removed by
# the held-out decontamination that runs after the filters).
REWRITTEN_FROM = "rewritten_from_hash"


class DocumentationProseFilter(BaseFilter):
    """Keeps the prose of documentation (see `prose_text`); a document with none is dropped.

    Rewrites the text like C4's line filter does, so the filters after it judge prose, not the
    code examples and markup around it.
    """

    name = "📚 Documentation prose"

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        text = prose_text(doc.text)
        if not text:
            return False, "no_prose"
        if text != doc.text:  # decontamination still recognises a verbatim copy as written
            doc.metadata.setdefault(REWRITTEN_FROM, text_hash(doc.text))
        doc.text = text
        return True


# --- held-out decontamination -----------------------------------------------------------------

_WORD = re.compile(r"\w+")
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier of the polynomial n-gram hash


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


def text_hash(text: str) -> int:
    """What exact duplicates share: the hash of the text without surrounding whitespace."""
    return xxhash.xxh64_intdigest(text.strip())


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


class ExactDedupInMemoryFilter(BaseFilter):
    """Exact dedup within one small stream (the held-out split, read by one task): the first
    copy stays. Named like datatrove's exact dedup so one reason means one thing."""

    name = "🎯 Exact dedup (in memory)"
    slug = "exact_dedup"

    def __init__(self, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self._seen: set[int] = set()

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        h = text_hash(doc.text)
        if h in self._seen:
            return False, "exact_dedup"
        self._seen.add(h)
        return True
