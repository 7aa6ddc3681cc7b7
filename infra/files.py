"""Files that readers see whole or not at all, and the completion markers written last.

Every writer that must never leave a half-written file behind goes through `write_atomic`: the
data goes to a temporary file beside the target (named with the writer's pid, so two writers never
share one), is flushed and fsynced, then `os.replace`d over the target (atomic on POSIX), and the
folder is fsynced so the rename itself survives a power loss. A reader sees the old file, the new
one, or none; a crash leaves at most a `.tmp` file that no reader opens.

Two kinds of folder are finished only when their marker exists, and the marker is written last,
with `write_atomic`:

    STEP_MARKER        `_COMPLETE.json`    a step folder (pipeline/artifact.py): the Artifact and
                                           what its fingerprint hashed
    CHECKPOINT_MARKER  `_CHECKPOINT.json`  a training checkpoint (model/checkpoint.py, the TRL
                                           trainers): its step and every file's size and SHA-256
                                           (infra/manifest.py)

Standard library only: the trainer ranks import it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STEP_MARKER = "_COMPLETE.json"
CHECKPOINT_MARKER = "_CHECKPOINT.json"
TMP_SUFFIX = ".tmp"  # every temporary file written here ends with it (uploads and prunes skip them)


def write_atomic(path: Path | str, data: str | bytes) -> None:
    """Write `data` (text as UTF-8, or bytes) to `path` so that readers see either nothing or the
    whole file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def write_json_atomic(path: Path | str, obj: Any, *, indent: int | None = 2, sort_keys: bool = False) -> None:
    """`write_atomic` of `obj` as JSON."""
    write_atomic(path, json.dumps(obj, indent=indent, sort_keys=sort_keys))


def read_json(path: Path | str) -> Any | None:
    """The JSON in `path`, or None when it is absent or not JSON (a marker never written)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def mark_complete(folder: Path | str, marker: str, record: dict[str, Any], *, sort_keys: bool = False) -> Path:
    """Write the completion marker of `folder` (last, atomically) and return its path."""
    path = Path(folder) / marker
    write_json_atomic(path, record, sort_keys=sort_keys)
    return path


def read_marker(folder: Path | str, marker: str) -> dict[str, Any] | None:
    """The completion record of `folder`, or None when it never finished there."""
    path = Path(folder) / marker
    if not path.is_file():
        return None
    record = read_json(path)
    return record if isinstance(record, dict) else None


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not fsync folders; the rename is still atomic
    finally:
        os.close(fd)


# --- paths a file records of files near it ----------------------------------------------------
# A file inside a workspace that names other files of the same workspace (a mixture plan its
# shards, a stage's spec.json its plan and init checkpoint) names them relative to its own folder,
# as `./REL` or `../REL`, so the workspace can move; anything else (another tree, s3://) as given.


def path_for_file(target: str | Path, file: str | Path, root: str | Path) -> str:
    """`target` as `file` should record it: relative to the file's folder when both are inside
    `root` (the workspace), else unchanged."""
    target, root = str(target), Path(root)
    if not target.startswith("/") or not Path(target).is_relative_to(root):
        return target
    rel = os.path.relpath(target, Path(file).parent)
    return rel if rel.startswith("..") else f"./{rel}" if rel != "." else "."


def path_from_file(value: str, file: str | Path) -> str:
    """A path `file` recorded, made absolute: `./REL` and `../REL` are relative to its folder."""
    if value == "." or value.startswith(("./", "../")):
        return os.path.normpath(Path(file).parent / value)
    return value
