"""The S3 mirror of finished step folders is a cache: a step missing here is fetched, not rebuilt.

The runner mirrors every finished (non-resumable) step folder to `{storage.s3_uri}/{step}/{fp12}/`
(infra/storage.py: data files, then `_SHA256SUMS.json`, then the marker last). On a fresh machine
pointed at the same bucket, or after a local folder was lost, `fetcher` gives `run_step` a way
to bring such a folder back before building it: the download is verified file by file against
the mirror's manifest (sizes and SHA-256, paths inside the folder only), lands in a temporary
folder renamed into place, and is kept only if its marker is the one this step would write (the
step's name and version, and the fingerprint the graph planned). With `$SMOLLM3_MIRROR_KEY` set
the manifest must also be signed with that key (infra/storage.py), so a bucket writer who swaps an
object and rewrites `_SHA256SUMS.json` to match is refused, the log naming the object; without a
key the manifest only proves the transfer (what then holds: docs/architecture.md, threat model).
Anything else (nothing mirrored, a file that does not match, a forged or unsigned manifest when a
key is set, another step's marker, S3 unreachable) is a miss, said in the log, and the step builds
as it would without a mirror. Resumable steps (training stages) are not
fetched as folders: their checkpoints come back through `pull_latest_checkpoint`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from infra.files import STEP_MARKER
from pipeline.artifact import read_marker
from pipeline.workspace import Workspace


def mirror_prefix(ws: Workspace, step: str) -> str | None:
    """Where a step's folders are mirrored, or None when the workspace has no mirror."""
    if ws.storage is None or not ws.storage.s3_uri:
        return None
    return f"{ws.storage.s3_uri.rstrip('/')}/{step}"


def fetcher(ws: Workspace, step: str, version: int, log: Callable[[str], object]) -> Callable[[Path, str], bool] | None:
    """`fetch(folder, fingerprint)` for `run_step`, or None when the workspace has no mirror."""
    prefix = mirror_prefix(ws, step)
    if prefix is None:
        return None

    def fetch(folder: Path, fingerprint: str) -> bool:
        from infra.storage import S3Store

        where = f"{prefix}/{folder.name}"
        try:
            store = S3Store(prefix, ws.storage)
            if not store.remote_complete(folder.name, STEP_MARKER):
                return False
            report = store.download_folder(folder.name, folder, STEP_MARKER)
        except Exception as exc:  # noqa: BLE001 - the mirror is a cache: any failure means building
            log(f"{step} {fingerprint[:12]}: not fetched from {where} ({type(exc).__name__}: {exc}); building it")
            return False
        record = read_marker(folder)
        artifact = (record or {}).get("artifact") or {}
        if (
            record is None
            or record.get("step") != step
            or record.get("version") != version
            or artifact.get("fingerprint") != fingerprint
        ):
            shutil.rmtree(folder, ignore_errors=True)
            log(f"{step} {fingerprint[:12]}: {where} holds another step's folder; building it")
            return False
        how = "its manifest signed with $SMOLLM3_MIRROR_KEY" if report.signed else "its manifest (unsigned)"
        log(f"{step} {fingerprint[:12]}: fetched from {where}, every file verified against {how}")
        return True

    return fetch
