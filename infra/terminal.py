"""Text from files printed to a terminal: control characters shown escaped, never sent raw.

A journal line, a run name, a step error or a recipe key is written by whoever can write the
workspace or the recipe; printed raw, an escape sequence in it can retitle the terminal, hide
lines, move the cursor or, on some terminals, answer back as typed input. `printable` keeps
every printable character (any script) and writes each control character as its Python escape
(`\\x1b`, `\\n`, `\\u2028`), so what is shown is what is stored, on one line.
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
