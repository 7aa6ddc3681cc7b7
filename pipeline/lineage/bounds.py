"""Fixed bounds on a lineage journal line, checked before it is parsed.

A journal line is workspace data (pipeline/lineage/store.py). `json.loads` recurses once per
nesting level, so a planted line nested 100,000 deep raised `RecursionError`, which no caller
expected: ingestion stopped at that line for good (every later pipeline write stayed pending) and
`summary`, `runs`, `lineage` and `sql` crashed. Our own events are at most 6 levels deep
(event, ops, operation, rows, row, a tagged date) and far shorter than `MAX_LINE_BYTES`; a line
beyond either bound is refused with `JournalLineOutOfBounds` (a ValueError: the ingester keeps it
in `_journal_rejected`, counts it and goes on) before any parser sees it.
"""

from __future__ import annotations

import re

MAX_LINE_BYTES = 16 * 1024 * 1024  # one event; the largest we write (a run's metrics) is well under 1 MiB
MAX_DEPTH = 32  # nested JSON arrays and objects

# a JSON string (skipped whole, so brackets inside text do not count) or one bracket
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


class JournalLineOutOfBounds(ValueError):
    """A journal line longer than MAX_LINE_BYTES or nested deeper than MAX_DEPTH."""


def json_depth(line: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (brackets in strings ignored)."""
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:  # cannot be deeper: skip the scan
        return line.count(b"[") + line.count(b"{")
    depth = deepest = 0
    for m in _TOKEN.finditer(line):
        token = m.group()
        if token in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                break
        elif token in (b"]", b"}"):
            depth -= 1
    return deepest


def check_line(line: bytes) -> None:
    """Raise JournalLineOutOfBounds, naming the bound, for a line no writer of ours produces."""
    if len(line) > MAX_LINE_BYTES:
        raise JournalLineOutOfBounds(f"a journal line of {len(line)} bytes, over the bound of {MAX_LINE_BYTES}")
    if json_depth(line) > MAX_DEPTH:
        raise JournalLineOutOfBounds(f"a journal line nested deeper than {MAX_DEPTH} levels")


def within_bounds(line: bytes) -> bool:
    try:
        check_line(line)
    except JournalLineOutOfBounds:
        return False
    return True
