"""Where a recipe's relative paths are taken from: `$SMOLLM3_HOME`, else the project root.

Never the current directory: a relative workspace, a relative `files:` glob and a relative
`hf:` folder mean the same files whether the command runs from the checkout, from `/tmp`, as a
served flow run or on a cluster node (the README's "a relative workspace never is").
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "SMOLLM3_HOME"
CACHE_ENV = "SMOLLM3_CACHE"
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def project_base() -> Path:
    """$SMOLLM3_HOME (absolute), else the project root."""
    home = os.environ.get(HOME_ENV)
    if not home:
        return PROJECT_ROOT
    base = Path(home).expanduser()
    if not base.is_absolute():
        raise ValueError(f"{HOME_ENV}={home!r} must be an absolute path")
    return base.resolve()


def from_base(path: str | Path) -> Path:
    """`path` with `~` expanded, taken from `project_base()` when relative."""
    raw = Path(path).expanduser()
    return raw if raw.is_absolute() else project_base() / raw


def user_cache() -> Path:
    """Where checks that belong to no workspace yet keep their results: $SMOLLM3_CACHE, else
    $XDG_CACHE_HOME/smollm3, else ~/.cache/smollm3 (never the current directory)."""
    raw = os.environ.get(CACHE_ENV)
    if raw:
        return Path(raw).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "smollm3"
