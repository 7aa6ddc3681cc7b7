"""Text from files printed to a terminal: control characters shown escaped, never sent raw.

A journal line, a run name, a step error or a recipe key is written by whoever can write the
workspace or the recipe; printed raw, an escape sequence in it can retitle the terminal, hide
lines, move the cursor or, on some terminals, answer back as typed input. `printable` keeps
every printable character (any script) and writes each control character as its Python escape
(`\\x1b`, `\\n`, `\\u2028`), so what is shown is what is stored, on one line;
`printable_lines` does the same to a multi-line view, keeping its own newlines (`smollm3 summary`,
`runs`, `lineage`, `sql`, `report`, `compare` print through it).
"""

from __future__ import annotations

import re

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    return repr(match.group())[1:-1]


def printable(text: object) -> str:
    """`str(text)` with every control character (newline and tab included) escaped."""
    return _CONTROL.sub(_escape, str(text))


_CONTROL_BUT_NEWLINE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def printable_lines(text: object) -> str:
    """A multi-line view (a table, a tree) with every control character but the newlines that
    separate its lines escaped: what the CLI's views print."""
    return _CONTROL_BUT_NEWLINE.sub(_escape, str(text))
