"""Preference pairs on disk in chunks: the preference_pairs step (tasks/posttrain/preference_pairs.py)
streams its pairs instead of holding a mode's pairs in memory, and resumes after a kill.

A mode's prompts are cut into spans of `size` prompts (the last one shorter); span `[a, b)` is
one chunk, two files in the step folder's `chunks/`:

    {mode}-{a:09d}-{b:09d}.jsonl   its pair rows (curation/pairing.py), one JSON line each
    {mode}-{a:09d}-{b:09d}.json    its counts (`pairing.pair_chunk`), written last: the chunk is done

each written whole or not at all (infra/files.py `write_atomic`). A chunk's answers depend on its
prompts and their positions only (sampling seeds are positional, batches never straddle a
chunk), so chunks can be made in any order, by any process, and a rerun after a kill makes only
the chunks whose counts file is missing. `assemble` streams the chunks into the step's output
file through a temporary name renamed last, the same bytes as one list written at once; the
chunks are removed after it. A chunk of another span (the chunk size changed between attempts,
`chunk_batches` is operational) is not reused.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infra.files import TMP_SUFFIX, read_json, write_atomic, write_json_atomic

Span = tuple[int, int]


def spans(n: int, size: int) -> list[Span]:
    """The chunks' prompt spans of `n` prompts, `size` per chunk."""
    if size <= 0:
        raise ValueError(f"pair chunks: chunk size must be positive, got {size}")
    return [(a, min(a + size, n)) for a in range(0, n, size)]


class ChunkStore:
    """The `chunks/` folder of one step folder."""

    def __init__(self, folder: Path):
        self.dir = Path(folder) / "chunks"

    def _base(self, mode: str, span: Span) -> Path:
        return self.dir / f"{mode}-{span[0]:09d}-{span[1]:09d}"

    def counts(self, mode: str, span: Span) -> dict[str, Any] | None:
        """The counts of a finished chunk, or None when it is not done."""
        base = self._base(mode, span)
        if not base.with_suffix(".jsonl").is_file():
            return None
        counts = read_json(base.with_suffix(".json"))
        return counts if isinstance(counts, dict) else None

    def write(self, mode: str, span: Span, rows: Sequence[dict[str, Any]], counts: dict[str, Any]) -> None:
        """Write one chunk: its rows, then its counts (the chunk is done once they exist)."""
        base = self._base(mode, span)
        write_atomic(base.with_suffix(".jsonl"), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        write_json_atomic(base.with_suffix(".json"), counts, sort_keys=True)

    def assemble(self, target: Path, parts: Sequence[tuple[str, Span]]) -> int:
        """Stream the chunks `parts` (mode, span), in order, into `target` (temporary name, fsync,
        rename last) and return its size in bytes; then remove the chunks."""
        missing = [f"{m} {s}" for m, s in parts if self.counts(m, s) is None]
        if missing:
            raise RuntimeError(f"pair chunks in {self.dir}: not done: {', '.join(missing)}")
        target = Path(target)
        tmp = target.with_name(f".{target.name}.{os.getpid()}{TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as out:
                for mode, span in parts:
                    with open(self._base(mode, span).with_suffix(".jsonl"), "rb") as chunk:
                        shutil.copyfileobj(chunk, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
                size = out.tell()
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        shutil.rmtree(self.dir)
        return size
