"""The checkpoint completeness rule, in one place: the `_CHECKPOINT.json` marker and its file manifest.

A checkpoint folder (`step_XXXXXXXX/`, written by model/checkpoint.py) is complete when its marker
`_CHECKPOINT.json` exists; the marker is written last, atomically, and lists every other file of the
folder with its size and SHA-256:

    {"format": 2, "step": 8, "stage_end": false,
     "files": {".metadata": {"size": 5321, "sha256": "9f2c..."}, "__0_0.distcp": {...}, ...}}

Two checks, for two purposes:
- `quick_check`: the marker parses and every listed file exists with its size. Cheap (stat only);
  what listing, pruning and mirroring use, many times a minute.
- `verify`: every listed file's SHA-256 matches. Reads every byte (in threads, or shared out over
  ranks by the caller); what resume, next-stage init, export and S3 pulls require before a
  checkpoint is trusted. It catches what sizes cannot: flipped bytes, a zeroed or replaced
  `.metadata`, a shard rewritten by something else.

Markers written before digests existed (`"files": {name: size}`) pass `quick_check`; `verify`
reports them as unverifiable (`legacy_files`) so callers can decide (they load with a warning).
Standard library only: the trainer, the S3 mirror and the tasks all import it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from infra.files import CHECKPOINT_MARKER

MARKER = CHECKPOINT_MARKER  # written last (infra/files.py)
FORMAT = 2
CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)  # releases the GIL: threads hash files in parallel
    return h.hexdigest()


def payload_files(folder: Path, marker: str = MARKER) -> list[str]:
    """Relative paths of the files a marker must list: everything but the marker and temporaries."""
    folder = Path(folder)
    return [
        p.relative_to(folder).as_posix()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != marker and not p.name.endswith(".tmp")
    ]


def entries(folder: Path, names: Iterable[str], threads: int = 4) -> dict[str, dict[str, Any]]:
    """{name: {"size", "sha256"}} for `names` under `folder`, hashed in `threads` threads."""
    folder = Path(folder)
    names = list(names)

    def one(name: str) -> tuple[str, dict[str, Any]]:
        path = folder / name
        return name, {"size": path.stat().st_size, "sha256": sha256_file(path)}

    with ThreadPoolExecutor(max(1, min(threads, len(names) or 1))) as pool:
        return dict(pool.map(one, names))


def marker_record(step: int, stage_end: bool, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"format": FORMAT, "step": step, "stage_end": stage_end, "files": files}


def read_record(folder: Path, marker: str = MARKER) -> dict[str, Any] | None:
    """The parsed marker, or None when it is absent or unreadable."""
    try:
        record = json.loads((Path(folder) / marker).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        return None
    return record


def _size(entry: Any) -> int | None:
    if isinstance(entry, dict):
        return entry.get("size")
    return entry if isinstance(entry, int) else None


def safe_name(name: str) -> bool:
    """A manifest entry names a file inside the folder (a manifest may come from elsewhere)."""
    return bool(name) and not name.startswith("/") and ".." not in Path(name).parts


def quick_check(folder: Path, marker: str = MARKER) -> dict[str, Any] | None:
    """The marker when it lists only existing files of the listed sizes, else None."""
    record = read_record(folder, marker)
    if record is None:
        return None
    for name, entry in record["files"].items():
        path = Path(folder) / name
        size = _size(entry)
        if not safe_name(name) or size is None:
            return None
        try:
            if path.stat().st_size != size:
                return None
        except OSError:
            return None
    return record


def legacy_files(record: dict[str, Any]) -> bool:
    """True for markers from before digests (sizes only): their content cannot be verified."""
    return any(not isinstance(e, dict) or "sha256" not in e for e in record["files"].values())


def file_problem(folder: Path, name: str, entry: Any) -> str | None:
    """What is wrong with one listed file, or None when its size and digest match."""
    path = Path(folder) / name
    if not safe_name(name):
        return f"{name}: unsafe path in the manifest"
    want = _size(entry)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{name}: missing"
    if size != want:
        return f"{name}: {size} bytes, the manifest says {want} (truncated or replaced)"
    if isinstance(entry, dict) and "sha256" in entry:
        got = sha256_file(path)
        if got != entry["sha256"]:
            zeros = _all_zero(path)
            return (
                f"{name}: content differs from the manifest (sha256 {got[:12]}..., expected "
                f"{entry['sha256'][:12]}...){'; the file is all zero bytes' if zeros else ''}"
            )
    return None


def _all_zero(path: Path) -> bool:
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            if chunk.count(0) != len(chunk):
                return False
    return True


def verify(folder: Path, marker: str = MARKER, names: Sequence[str] | None = None, threads: int = 4) -> list[str]:
    """Problems found in the folder (empty when it verifies): no marker, or for each listed file
    (or only `names` of them) missing, resized or with a different SHA-256."""
    folder = Path(folder)
    record = read_record(folder, marker)
    if record is None:
        return [f"{marker}: missing or unreadable (the save did not finish)"]
    files = record["files"]
    todo = list(files) if names is None else [n for n in names if n in files]
    with ThreadPoolExecutor(max(1, min(threads, len(todo) or 1))) as pool:
        found = list(pool.map(lambda n: file_problem(folder, n, files[n]), todo))
    return [p for p in found if p]
