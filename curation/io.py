"""datatrove readers and writers of the data steps: a JSONL reader that counts what it rejects, and
the writer of examples of what each filter removed.

Like every module of this package it imports datatrove only (no Prefect): datatrove's worker
processes unpickle the pipeline and import the modules its components come from, so a worker
starts in under a second instead of several.
"""

from __future__ import annotations

from collections import Counter

from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter

READ_REASONS = ("malformed_json", "invalid_utf8", "missing_text_field", "empty", "too_large", "blank_line")


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
                where = f"{filepath}:{li + 1}"
                if not raw.strip():  # a line without a document is counted like the others
                    self._reject("blank_line", where)
                    continue
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
