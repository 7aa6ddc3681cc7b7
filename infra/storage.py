"""S3 storage: mirror step folders and training checkpoints to `s3://bucket/prefix`, pull them back.

What a 384-GPU run needs from object storage, and how this module provides it:

- Only complete folders leave the machine, and they arrive complete-last. A checkpoint folder counts
  as complete only when its marker (`_CHECKPOINT.json`, written last by the trainer, listing every file with
  its size and SHA-256; infra/manifest.py) exists and the files match it; a step folder only when
  its `_COMPLETE.json` exists. A checkpoint whose bytes no longer match the trainer's digests
  (bit rot, a file changed on disk) is never uploaded: the mirror skips it with a warning.
  Uploads send every data file first, then `_SHA256SUMS.json` (our manifest: size and sha256 of each
  file), then the marker LAST. A remote reader applies the same rule as a local one: no marker
  object, no checkpoint. A stale marker of an earlier attempt at the same key is deleted before any
  file is replaced, so a half-replaced folder never looks complete either.
- Integrity end to end: each object is uploaded with `ChecksumAlgorithm=SHA256` (S3 verifies every
  part on receipt) and checked after the upload: its size, and its SHA-256 checksum against the
  whole-file digest or the composite digest of its parts, computed locally in the same pass. ETags
  are never trusted as content hashes (multipart ETags are not). An object is skipped as "already
  there" only when the checksum the store computed matches (or, on a store that keeps none, when
  it is the very object this process uploaded and verified, same ETag): the `sha256` we write
  into object metadata is never taken as proof, since anyone who replaces the object can write it
  too. Downloads are verified against the manifest before the local marker is written.
- A mirror that cannot vouch for itself: with `$SMOLLM3_MIRROR_KEY` set (at least 16 characters,
  from the environment only, never a recipe, so it never reaches lineage), every manifest is
  signed with HMAC-SHA256: each file entry (folder key, path, size, sha256) and the whole folder
  (its file list and the marker's sha256). A download then refuses, before any data file is
  fetched, an unsigned manifest, an entry whose signature fails (`ForgedManifest` names the object:
  it or its entry was changed after upload) and a folder whose file list or marker was changed.
  Without a key the manifest lives in the same bucket as the objects it describes, so it proves
  the transfer, not who wrote it: a bucket writer is then as trusted as a workspace writer (they
  can change results; no file read from a step folder or checkpoint is turned into code, see
  docs/architecture.md's threat model).
- Large files go multipart through boto3's `TransferConfig` (threshold, part size, concurrency).
- Every transfer is retried with exponential backoff and jitter on top of botocore's own
  per-request retries; an object already uploaded with the same size and digest is not sent again,
  so a retry after a failure midway resumes instead of restarting.
- `CheckpointUploader` runs in the trainer (rank 0 of pretraining, the main rank of
  post-training): each checkpoint is queued as its marker is written and uploaded from a
  background thread, and the bucket's retention (`storage.checkpoints`: the newest `keep_last`
  plus milestones) deletes older ones only after a newer one is uploaded and verified.
- `CheckpointMirror.sync` (a library call, no step uses it) uploads a checkpoints folder and keeps
  the newest `keep_local` complete checkpoints (and stage ends) on local disk; an older local copy
  is deleted only after its upload was verified.
- `pull_latest_checkpoint` brings back the newest complete remote checkpoint when the local copy is
  gone (a new node, a wiped scratch disk), into a temporary folder renamed into place at the end,
  and verifies it against the trainer's own digests in its marker; a remote checkpoint that fails
  is skipped (with a warning naming the files) for the next older one. On a cluster launch the
  trainer's rank 0 calls it (`pull_for_resume`, `MirrorTarget.pull`) into the shared checkpoints
  folder while the other ranks wait, so the flow host moves no checkpoint bytes; on the local
  launcher the step calls it before the launch. A download that fails on S3 or the network
  (throttling, a lost connection, after its retries) is raised as it is, transient
  (pipeline/step.py `transient`), not taken for damage: a retry of the step pulls again.
- `wait_for_pull`: how the other ranks wait for rank 0's pull, for as long as its bytes keep
  arriving (`pull_progress`), not for a fixed timeout: 36.9 GB at 20 MB/s is 31 minutes, longer
  than the 30-minute collective timeout.

Credentials come only from boto3's standard chain (environment, shared config/credentials files,
SSO, instance or pod roles); `endpoint_url` points at S3-compatible stores (MinIO, Ceph, R2). Nothing
here reads, logs or returns a credential: reports carry bucket, keys, sizes and timings only.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import queue
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from infra import manifest
from infra.files import CHECKPOINT_MARKER, STEP_MARKER, write_atomic

log = logging.getLogger(__name__)

# CHECKPOINT_MARKER: model/checkpoint.py's marker {"step", "stage_end", "files"}; STEP_MARKER:
# pipeline/artifact.py's marker of a finished step folder (both defined in infra/files.py)
MANIFEST = "_SHA256SUMS.json"  # ours: {"files": {relative path: {"size", "sha256"[, "hmac"]}}[, "hmac"]}
MIRROR_KEY_ENV = "SMOLLM3_MIRROR_KEY"  # the HMAC key that signs and checks manifests; environment only
MIN_KEY_CHARS = 16
MIRROR_RECORD = "mirror.jsonl"  # a stage folder's record of its trainer's uploads and deletions
MiB = 1 << 20
T = TypeVar("T")


class StorageError(RuntimeError):
    """A transfer or verification failed after every retry; the message names the object."""


class ForgedManifest(StorageError):
    """A manifest that `$SMOLLM3_MIRROR_KEY` did not sign as it is; the message names the object."""


class CorruptCheckpoint(StorageError):
    """A local checkpoint's files do not match the digests in its own marker: not uploaded."""


MILESTONE_NAMES = ("stage_end", "decay_start")


class CheckpointRetention(BaseModel):
    """Which mirrored checkpoints stay in the bucket (the recipe's `storage.checkpoints`).

    The newest `keep_last` complete checkpoints of a stage, plus its milestones, which are never
    deleted: the stage's final checkpoint (always; the next stage and continued pretraining start
    from it), and each entry of `milestones`: a step number of the stage, or `decay_start`, the
    newest checkpoint still in the stable phase of the WSD schedule (global step <= the decay's
    start: what an anneal's base resolves to, model/base_checkpoint.py). An older checkpoint is
    deleted only by the uploader, right after a newer one was uploaded and verified.
    `keep_last: null` keeps every checkpoint.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    keep_last: int | None = None  # newest complete checkpoints kept on S3; None: all of them
    milestones: tuple[int | str, ...] = ()  # step numbers of the stage, or "decay_start"

    @field_validator("keep_last", mode="before")
    @classmethod
    def _keep_last(cls, v: Any) -> Any:
        if v is not None and (type(v) is not int or v < 1):
            raise ValueError(
                f"storage.checkpoints.keep_last must be a whole number >= 1 (or null to keep every "
                f"checkpoint), got {v!r}"
            )
        return v

    @field_validator("milestones", mode="before")
    @classmethod
    def _milestones(cls, v: Any) -> Any:
        if v is None:
            return ()
        if isinstance(v, str | int) or not isinstance(v, list | tuple):
            raise ValueError(f"storage.checkpoints.milestones must be a list, got {v!r}")
        for m in v:
            if not ((type(m) is int and m >= 1) or m in MILESTONE_NAMES):
                raise ValueError(
                    f"storage.checkpoints.milestones: {m!r} is neither a step number (>= 1) nor one of "
                    f"{', '.join(MILESTONE_NAMES)}"
                )
        return tuple(v)

    def kept(self, checkpoints: Sequence[tuple[str, int, bool]], stable_until: int | None = None) -> set[str]:
        """The names to keep among `checkpoints` (name, step, stage end) of the complete remote
        checkpoints, oldest first. `stable_until`: the stage's last step in the stable phase
        (None: the stage's schedule has no decay), for `decay_start`."""
        ordered = sorted(checkpoints, key=lambda c: c[1])
        if self.keep_last is None:
            return {name for name, _, _ in ordered}
        keep = {name for name, _, _ in ordered[-self.keep_last :]}
        keep |= {name for name, _, end in ordered if end}  # the stage's final checkpoint
        steps = {m for m in self.milestones if type(m) is int}
        keep |= {name for name, step, _ in ordered if step in steps}
        if "decay_start" in self.milestones and stable_until is not None:
            stable = [name for name, step, _ in ordered if step <= stable_until]
            keep |= set(stable[-1:])
        return keep


class StorageConfig(BaseModel):
    """Where and how artifacts and checkpoints are mirrored (the recipe's `storage` section)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    s3_uri: str | None = None  # s3://bucket/prefix; None keeps everything local only
    endpoint_url: str | None = None  # S3-compatible store (MinIO, Ceph, R2); None = AWS
    region: str | None = None  # None = boto3's default chain (AWS_REGION, config file)
    multipart_threshold_mb: int = Field(default=64, ge=5)  # files above go multipart
    multipart_chunk_mb: int = Field(default=64, ge=5)  # part size (S3's minimum is 5 MiB)
    max_concurrency: int = Field(default=8, gt=0)  # parts in flight per file
    attempts: int = Field(default=5, gt=0)  # tries per object before giving up
    backoff_seconds: float = Field(default=1.0, ge=0)  # first retry delay; doubles each try
    max_backoff_seconds: float = Field(default=60.0, ge=0)  # cap on one retry delay
    # `CheckpointMirror` only (a library call syncing a checkpoints folder by hand; no step uses
    # it: a trainer uploads its own checkpoints and keeps `keep_last` of them locally)
    keep_local: int = Field(default=2, gt=0)  # newest complete checkpoints kept on local disk
    keep_stage_ends: bool = True  # never delete a stage-end checkpoint locally (next stage inits)
    sync_every_s: float = Field(default=300.0, gt=0)  # `CheckpointMirror.syncing`'s period
    checkpoints: CheckpointRetention = CheckpointRetention()  # what stays in the bucket
    upload_queue: int = Field(default=2, ge=1)  # checkpoints waiting for the trainer's uploader

    @field_validator("s3_uri")
    @classmethod
    def _s3(cls, v: str | None) -> str | None:
        if v is not None:
            split_s3_uri(v)
        return v


class MirrorTarget(BaseModel):
    """Where one stage's checkpoints are mirrored, as its trainer reads it (`TrainSpec.mirror`):
    the stage's own prefix, `{storage.s3_uri}/{step}/{fp12}/checkpoints`, and the storage settings.
    `pull`: the trainer's rank 0 brings the newest checkpoint back itself before resuming when its
    checkpoints folder holds no complete one (`pull_for_resume`; a cluster launch, whose flow host
    moves no checkpoint bytes); False: the step did that before the launch (the local launcher)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    uri: str
    storage: StorageConfig
    pull: bool = False

    @field_validator("uri")
    @classmethod
    def _s3(cls, v: str) -> str:
        split_s3_uri(v)
        return v


def split_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, key prefix without slashes at the ends) of `s3://bucket/prefix`."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise ValueError(f"s3 uri {uri!r} must start with s3:// (e.g. s3://my-bucket/runs/smollm3)")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"s3 uri {uri!r} names no bucket (expected s3://bucket/prefix)")
    return bucket, prefix.strip("/")


def join_key(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def mirror_key() -> bytes | None:
    """The manifest signing key from `$SMOLLM3_MIRROR_KEY`, None when unset or empty.

    The error never shows the value, only its length.
    """
    raw = os.environ.get(MIRROR_KEY_ENV, "")
    if not raw:
        return None
    if len(raw) < MIN_KEY_CHARS:
        raise ValueError(
            f"${MIRROR_KEY_ENV} holds {len(raw)} characters; a manifest signing key needs at least "
            f"{MIN_KEY_CHARS} (e.g. the output of `openssl rand -hex 32`), or unset it to mirror unsigned"
        )
    return raw.encode()


def entry_mac(key: bytes, folder_key: str, rel: str, size: int, sha256: str) -> str:
    """HMAC-SHA256 of one manifest entry, bound to the folder's key in the bucket."""
    msg = json.dumps(["entry", folder_key, rel, size, sha256]).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def folder_mac(key: bytes, folder_key: str, marker: str, marker_sha256: str, files: dict[str, Any]) -> str:
    """HMAC-SHA256 of a whole folder: its file list with sizes and digests, and its marker."""
    listing = [[rel, files[rel]["size"], files[rel]["sha256"]] for rel in sorted(files)]
    msg = json.dumps(["folder", folder_key, marker, marker_sha256, listing]).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def retry(
    fn: Callable[[], T],
    *,
    what: str,
    attempts: int,
    base: float,
    cap: float,
    sleep: Callable[[float], None] = time.sleep,
    retry_on: tuple[type[BaseException], ...] = (Exception,),
) -> T:
    """`fn()` with up to `attempts` tries, sleeping base x 2^i (x jitter 0.5-1, capped) between.

    Jitter spreads 384 ranks' retries after a shared outage instead of hammering S3 in lockstep.
    """
    for attempt in range(attempts):
        try:
            return fn()
        except FileNotFoundError:
            raise  # a local file that vanished will not come back by waiting
        except retry_on as exc:
            if attempt == attempts - 1:
                raise StorageError(f"{what} failed after {attempts} attempts: {type(exc).__name__}: {exc}") from exc
            delay = min(cap, base * (2**attempt)) * random.uniform(0.5, 1.0)
            log.warning(
                "%s failed (%s: %s); retry %d/%d in %.1fs",
                what,
                type(exc).__name__,
                exc,
                attempt + 1,
                attempts - 1,
                delay,
            )
            sleep(delay)
    raise AssertionError("unreachable")


# --- local digests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileDigest:
    """Size, whole-file SHA-256 (hex) and the S3 composite SHA-256 for the given part size."""

    size: int
    sha256: str
    composite_b64: str | None  # base64(sha256(concat(part digests))), None for single-part uploads
    parts: int

    @property
    def sha256_b64(self) -> str:
        return base64.b64encode(bytes.fromhex(self.sha256)).decode()


def file_digest(path: Path, part_size: int | None) -> FileDigest:
    """One read of `path` computing the whole digest and, when multipart, the per-part digests."""
    whole = hashlib.sha256()
    parts: list[bytes] = []
    block = part_size or 8 * MiB
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            whole.update(chunk)
            if part_size:
                parts.append(hashlib.sha256(chunk).digest())
    size = path.stat().st_size
    composite = base64.b64encode(hashlib.sha256(b"".join(parts)).digest()).decode() if part_size else None
    return FileDigest(size, whole.hexdigest(), composite, len(parts) if part_size else 1)


def folder_files(folder: Path, exclude: Iterable[str] = ()) -> list[str]:
    """Relative paths of the regular files under `folder`, sorted, without temporaries."""
    skip = set(exclude)
    out = []
    for p in sorted(Path(folder).rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if not p.is_file() or rel in skip or p.name.endswith(".tmp") or ".tmp-" in p.name:
            continue
        out.append(rel)
    return out


def checkpoint_complete(folder: Path, marker: str = CHECKPOINT_MARKER) -> dict[str, Any] | None:
    """The checkpoint's marker when the folder is complete (every listed file there, with its
    size), else None. The rule lives in infra/manifest.py, shared with the trainer."""
    return manifest.quick_check(Path(folder), marker)


def has_complete_checkpoint(root: Path, marker: str = CHECKPOINT_MARKER) -> bool:
    """Whether a checkpoints root holds a complete checkpoint (`checkpoint_complete`). Leftovers
    do not count: a killed save's folder without its marker, a killed pull's `.step_*.partial`."""
    return any(checkpoint_complete(f, marker) is not None for f in step_folders(root))


def step_folders(root: Path) -> list[Path]:
    """`step_XXXXXXXX` folders under a checkpoints root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())


# --- the store ----------------------------------------------------------------------------------


@dataclass
class FolderReport:
    """What one folder upload or download did; safe to log and to record in lineage."""

    uri: str
    files: int = 0
    bytes: int = 0
    sent: int = 0  # files actually transferred (the rest were already there, verified)
    seconds: float = 0.0
    signed: bool = False  # a download checked against a manifest signed with $SMOLLM3_MIRROR_KEY

    def as_meta(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "files": self.files,
            "bytes": self.bytes,
            "sent": self.sent,
            "seconds": round(self.seconds, 3),
        }


class S3Store:
    """Folder-level uploads and downloads under one `s3://bucket/prefix`.

    `client` is for tests and callers that already hold one; otherwise a client is built from
    boto3's default credential chain. The retry `sleep` is injectable so tests do not wait.
    """

    def __init__(
        self,
        s3_uri: str,
        config: StorageConfig | None = None,
        *,
        client: Any = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.config = config or StorageConfig(s3_uri=s3_uri)
        self.bucket, self.prefix = split_s3_uri(s3_uri)
        self.client = client or make_client(self.config)
        self._sleep = sleep
        self.signing_key = mirror_key()  # None: manifests are written and read unsigned
        # (path, size, mtime_ns) -> digest: a long-lived mirror hashes each file once
        self._digests: dict[tuple[str, int, int], FileDigest] = {}
        # key -> (size, sha256, ETag) of objects this store uploaded and verified: on a store that
        # keeps no checksum, the only objects known to hold our bytes without downloading them
        self._sent: dict[str, tuple[int, str, str]] = {}
        from boto3.s3.transfer import TransferConfig

        self.transfer = TransferConfig(
            multipart_threshold=self.config.multipart_threshold_mb * MiB,
            multipart_chunksize=self.config.multipart_chunk_mb * MiB,
            max_concurrency=self.config.max_concurrency,
        )

    @property
    def uri(self) -> str:
        return f"s3://{join_key(self.bucket, self.prefix)}"

    def key(self, *parts: str) -> str:
        return join_key(self.prefix, *parts)

    def _retry(self, fn: Callable[[], T], what: str) -> T:
        c = self.config
        return retry(
            fn, what=what, attempts=c.attempts, base=c.backoff_seconds, cap=c.max_backoff_seconds, sleep=self._sleep
        )

    # -- objects --

    def part_size(self, size: int) -> int | None:
        """The part size boto3 will use for a file of `size` bytes, None when single-part."""
        if size < self.transfer.multipart_threshold:
            return None
        from s3transfer.utils import ChunksizeAdjuster

        return ChunksizeAdjuster().adjust_chunksize(self.transfer.multipart_chunksize, size)

    def digest(self, path: Path) -> FileDigest:
        """The file's digests, computed once per (path, size, mtime) in this store's lifetime."""
        st = Path(path).stat()
        key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
        if key not in self._digests:
            self._digests[key] = file_digest(Path(path), self.part_size(st.st_size))
        return self._digests[key]

    def head(self, key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in {"404", "NoSuchKey", "NotFound"}:
                return None
            raise

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def matches(self, key: str, digest: FileDigest, *, just_sent: bool = False) -> bool:
        """The remote object has this size and this content, by the SHA-256 checksum the store computed.

        An object without a store checksum (put by someone else without one, or on an
        S3-compatible store that keeps none) matches only when it is the object this store
        uploaded and verified (same ETag): the `sha256` metadata is written by the uploader, so
        whoever replaced the object could have written it too. `just_sent` is the check right
        after our own upload, where that metadata and the size are all a store without checksums
        offers.
        """
        head = self.head(key)
        if head is None or head.get("ContentLength") != digest.size:
            return False
        remote = head.get("ChecksumSHA256")
        if remote is None:
            if just_sent:
                return head.get("Metadata", {}).get("sha256") == digest.sha256
            return self._sent.get(key) == (digest.size, digest.sha256, head.get("ETag"))
        remote = remote.split("-")[0]  # AWS appends -N (parts) to composite checksums
        return remote in {digest.sha256_b64, digest.composite_b64}

    def put_file(self, path: Path, key: str, digest: FileDigest | None = None) -> bool:
        """Upload `path` to `key` unless an identical object is there; verify; True if sent."""
        path = Path(path)
        digest = digest or self.digest(path)
        if self.matches(key, digest):
            return False

        def once() -> None:
            self.client.upload_file(
                str(path),
                self.bucket,
                key,
                Config=self.transfer,
                ExtraArgs={"ChecksumAlgorithm": "SHA256", "Metadata": {"sha256": digest.sha256}},
            )
            if not self.matches(key, digest, just_sent=True):
                raise StorageError(
                    f"s3://{self.bucket}/{key} does not match {path} after upload "
                    f"(size {digest.size}, sha256 {digest.sha256[:16]}...)"
                )
            head = self.head(key) or {}
            self._sent[key] = (digest.size, digest.sha256, head.get("ETag"))

        self._retry(once, f"upload {path} -> s3://{self.bucket}/{key}")
        return True

    def put_bytes(self, data: bytes, key: str) -> None:
        sha = base64.b64encode(hashlib.sha256(data).digest()).decode()

        def once() -> None:
            self.client.put_object(
                Bucket=self.bucket, Key=key, Body=data, ChecksumAlgorithm="SHA256", ChecksumSHA256=sha
            )

        self._retry(once, f"upload s3://{self.bucket}/{key}")

    def get_bytes(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        def once() -> bytes | None:
            try:
                return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in {"404", "NoSuchKey", "NotFound"}:
                    return None
                raise

        return self._retry(once, f"download s3://{self.bucket}/{key}")

    def delete(self, key: str) -> None:
        self._retry(lambda: self.client.delete_object(Bucket=self.bucket, Key=key), f"delete s3://{self.bucket}/{key}")

    def subfolders(self, *parts: str) -> list[str]:
        """Names of the immediate 'folders' under a key prefix (S3 common prefixes)."""
        base = self.key(*parts)
        base = base + "/" if base else ""
        names = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=base, Delimiter="/"):
            for cp in page.get("CommonPrefixes", []):
                names.append(cp["Prefix"][len(base) :].rstrip("/"))
        return sorted(names)

    # -- folders --

    def upload_folder(self, folder: Path, name: str, marker: str) -> FolderReport:
        """Upload `folder` to `{prefix}/{name}/`: data files, then the manifest, then `marker`.

        The caller has checked that the folder is complete. A previous remote marker at the same
        place is deleted first: while files are being replaced the remote must not look complete.
        """
        folder = Path(folder)
        start = time.monotonic()
        report = FolderReport(uri=f"s3://{join_key(self.bucket, self.key(name))}")
        marker_key = self.key(name, marker)
        marker_bytes = (folder / marker).read_bytes()
        files = folder_files(folder, exclude=(marker, MANIFEST))
        if (
            self.get_bytes(marker_key) == marker_bytes
            and self._manifest_matches(folder, name, marker, marker_bytes)
            and all(self.matches(self.key(name, rel), self.digest(folder / rel)) for rel in files)
        ):
            report.files = len(files) + 1
            report.seconds = time.monotonic() - start
            return report  # already mirrored and verified
        if self.exists(marker_key):
            self.delete(marker_key)
        # The trainer's digests, when the marker has them: a file that no longer matches is
        # corrupt here, and a corrupt copy must not become the remote "good" one.
        record = manifest.read_record(folder, marker)
        trusted = record["files"] if record is not None else {}
        digests = {rel: self.digest(folder / rel) for rel in files}  # all checked before any upload
        for rel, digest in digests.items():
            want = trusted.get(rel)
            if isinstance(want, dict) and "sha256" in want and want["sha256"] != digest.sha256:
                raise CorruptCheckpoint(
                    f"{folder / rel} does not match the sha256 in its {marker} (corrupted on disk "
                    f"after it was written); not uploading {folder.name}"
                )
        sums: dict[str, dict[str, Any]] = {}
        for rel, digest in digests.items():
            path = folder / rel
            sums[rel] = {"size": digest.size, "sha256": digest.sha256}
            report.sent += self.put_file(path, self.key(name, rel), digest)
            report.files += 1
            report.bytes += digest.size
        # The folder must still be what was uploaded before the remote may call it complete
        # (the trainer prunes and rewrites step folders while a mirror reads them).
        current = folder / marker
        if (
            not current.is_file()
            or current.read_bytes() != marker_bytes
            or folder_files(folder, exclude=(marker, MANIFEST)) != files
        ):
            raise FileNotFoundError(
                f"{folder} changed or vanished while it was uploaded; {report.uri} is left "
                "without its marker (incomplete) and the next sync retries it"
            )
        body = json.dumps(self._manifest(name, marker, marker_bytes, sums), indent=1, sort_keys=True).encode()
        self.put_bytes(body, self.key(name, MANIFEST))
        self.put_bytes(marker_bytes, marker_key)  # last: now the remote folder is complete
        report.files += 1
        report.seconds = time.monotonic() - start
        log.info(
            "mirrored %s to %s: %d files, %.1f MB (%d sent) in %.1fs",
            folder,
            report.uri,
            report.files,
            report.bytes / 1e6,
            report.sent,
            report.seconds,
        )
        return report

    def _manifest(self, name: str, marker: str, marker_bytes: bytes, sums: dict[str, dict[str, Any]]) -> dict:
        """The manifest of a folder: its files' sizes and digests, signed when a key is set."""
        if self.signing_key is None:
            return {"files": sums}
        folder_key = self.key(name)
        signed = {
            rel: entry | {"hmac": entry_mac(self.signing_key, folder_key, rel, entry["size"], entry["sha256"])}
            for rel, entry in sums.items()
        }
        marker_sha = hashlib.sha256(marker_bytes).hexdigest()
        return {"files": signed, "hmac": folder_mac(self.signing_key, folder_key, marker, marker_sha, sums)}

    def _manifest_matches(self, folder: Path, name: str, marker: str, marker_bytes: bytes) -> bool:
        """The remote manifest lists exactly the local files, with their sizes and sha256.

        Content, not just sizes: a checkpoint re-trained at the same step after a resume from an
        older one has the same marker and sizes but different bytes. Digests are cached, so a
        long-lived mirror hashes each file once. With a signing key, the manifest must also be
        signed with it (else it is written again, signed).
        """
        raw = self.get_bytes(self.key(name, MANIFEST))
        if raw is None:
            return False
        try:
            doc = self._parse_manifest(raw, name)
            self._check_signature(doc, name, marker, marker_bytes)
        except StorageError:
            return False
        remote = doc["files"]
        local = folder_files(folder, exclude=(marker, MANIFEST))
        if sorted(remote) != local:
            return False
        for rel in local:
            d = self.digest(folder / rel)
            if remote[rel]["size"] != d.size or remote[rel]["sha256"] != d.sha256:
                return False
        return True

    def _parse_manifest(self, raw: bytes, name: str) -> dict[str, Any]:
        """The manifest as remote input: a JSON object whose `files` map safe relative paths to a
        size and a sha256; anything else is a `StorageError` naming the manifest object."""
        where = f"s3://{join_key(self.bucket, self.key(name, MANIFEST))}"
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise StorageError(f"{where} is not JSON ({exc}); refusing its folder") from None
        files = doc.get("files") if isinstance(doc, dict) else None
        if not isinstance(files, dict):
            raise StorageError(f"{where} holds no `files` object; refusing its folder")
        for rel, entry in files.items():
            if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in Path(rel).parts:
                raise StorageError(f"{where} lists an unsafe path {rel!r}; refusing to download it")
            if (
                not isinstance(entry, dict)
                or type(entry.get("size")) is not int
                or entry["size"] < 0
                or not isinstance(entry.get("sha256"), str)
            ):
                raise StorageError(f"{where} entry {rel!r} has no integer size and sha256; refusing its folder")
        return doc

    def _check_signature(self, doc: dict[str, Any], name: str, marker: str, marker_bytes: bytes) -> None:
        """With a signing key: every entry and the whole folder signed by it, else `ForgedManifest`."""
        key = self.signing_key
        if key is None:
            return
        folder_key = self.key(name)
        uri = f"s3://{join_key(self.bucket, folder_key)}"
        if "hmac" not in doc:
            raise ForgedManifest(
                f"{uri}/{MANIFEST} is not signed and ${MIRROR_KEY_ENV} is set: refusing {uri} "
                "(mirror it again from a machine that holds the key)"
            )
        files = doc["files"]
        for rel, entry in sorted(files.items()):
            want = entry_mac(key, folder_key, rel, entry["size"], entry["sha256"])
            if not isinstance(entry.get("hmac"), str) or not hmac.compare_digest(entry["hmac"], want):
                raise ForgedManifest(
                    f"{uri}/{rel}: its entry in {MANIFEST} is not signed with ${MIRROR_KEY_ENV} (the "
                    "object and its entry were changed after upload, or signed with another key); "
                    f"refusing {uri}"
                )
        marker_sha = hashlib.sha256(marker_bytes).hexdigest()
        want = folder_mac(key, folder_key, marker, marker_sha, files)
        if not isinstance(doc["hmac"], str) or not hmac.compare_digest(doc["hmac"], want):
            raise ForgedManifest(
                f"{uri}/{MANIFEST} does not match its signature with ${MIRROR_KEY_ENV}: a file was added "
                f"or removed, or {uri}/{marker} replaced, after upload; refusing {uri}"
            )

    def remote_complete(self, name: str, marker: str) -> bool:
        """A remote folder is complete when its marker object exists (it is uploaded last)."""
        return self.exists(self.key(name, marker)) and self.exists(self.key(name, MANIFEST))

    def download_folder(self, name: str, dest: Path, marker: str) -> FolderReport:
        """Download `{prefix}/{name}/` into `dest` (replaced), verified, marker written last."""
        start = time.monotonic()
        report = FolderReport(uri=f"s3://{join_key(self.bucket, self.key(name))}")
        marker_bytes = self.get_bytes(self.key(name, marker))
        raw = self.get_bytes(self.key(name, MANIFEST))
        if marker_bytes is None or raw is None:
            raise StorageError(
                f"{report.uri} is incomplete (no {marker} or {MANIFEST}); upload it again from a complete local copy"
            )
        doc = self._parse_manifest(raw, name)  # remote input: never a path outside the destination
        self._check_signature(doc, name, marker, marker_bytes)  # before any data file is fetched
        report.signed = self.signing_key is not None
        files = doc["files"]
        dest = Path(dest)
        partial = dest.with_name(f".{dest.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            self._download_files(name, files, partial, report)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)  # never leave a half folder behind
            raise
        (partial / MANIFEST).write_bytes(raw)
        write_atomic(partial / marker, marker_bytes)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(partial, dest)
        report.files += 1
        report.seconds = time.monotonic() - start
        log.info(
            "pulled %s into %s: %d files, %.1f MB in %.1fs",
            report.uri,
            dest,
            report.files,
            report.bytes / 1e6,
            report.seconds,
        )
        return report

    def _download_files(self, name: str, files: dict, partial: Path, report: FolderReport) -> None:
        for rel, want in sorted(files.items()):
            target = partial / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            key = self.key(name, rel)

            def once(target: Path = target, key: str = key, want: dict = want) -> None:
                self.client.download_file(self.bucket, key, str(target), Config=self.transfer)
                got = file_digest(target, None)
                if got.size != want["size"] or got.sha256 != want["sha256"]:
                    raise StorageError(
                        f"s3://{self.bucket}/{key} does not match its manifest "
                        f"entry (size {got.size} vs {want['size']})"
                    )

            self._retry(once, f"download s3://{self.bucket}/{key}")
            report.files += 1
            report.bytes += want["size"]
            report.sent += 1


def make_client(config: StorageConfig) -> Any:
    """An S3 client from boto3's default credential chain, with botocore's adaptive retries.

    Deliberately no access-key arguments: credentials are the environment's business (env vars,
    ~/.aws, SSO, instance/pod roles), so they never pass through recipes, logs or lineage.
    """
    import boto3
    from botocore.config import Config

    session = boto3.session.Session()
    return session.client(
        "s3",
        endpoint_url=config.endpoint_url,
        region_name=config.region,
        config=Config(retries={"max_attempts": 5, "mode": "adaptive"}),
    )


# --- public API for steps ----------------------------------------------------------------------


def mirror_artifact(
    folder: str | Path, s3_uri: str, config: StorageConfig | None = None, *, client: Any = None
) -> dict[str, Any]:
    """Upload a finished step folder to `{s3_uri}/{folder name}/`; return its report as meta.

    `s3_uri` is the parent: a workspace's `{root}/{step}/{fp12}` maps to `s3_uri/{fp12}`, so pass
    `s3://bucket/prefix/{step}`. Raises when the step folder has no completion marker.
    """
    folder = Path(folder)
    if not (folder / STEP_MARKER).is_file():
        raise FileNotFoundError(
            f"step folder {folder} has no {STEP_MARKER}: it is unfinished; run its step to "
            "completion before mirroring it"
        )
    store = S3Store(s3_uri, config, client=client)
    return store.upload_folder(folder, folder.name, STEP_MARKER).as_meta()


def fetch_artifact(
    s3_folder_uri: str, local: str | Path, config: StorageConfig | None = None, *, client: Any = None
) -> Path:
    """Download a mirrored step folder `s3://bucket/prefix/{name}` into `local` (verified)."""
    bucket, key = split_s3_uri(s3_folder_uri)
    parent, _, name = key.rpartition("/")
    store = S3Store(f"s3://{join_key(bucket, parent)}", config, client=client)
    store.download_folder(name, Path(local), STEP_MARKER)
    return Path(local)


@dataclass
class SyncReport:
    """What one `CheckpointMirror.sync` did (names of step folders); safe to log and record."""

    uploaded: list[str] = field(default_factory=list)  # sent this time (verified)
    verified: list[str] = field(default_factory=list)  # complete on S3 after this sync
    skipped_incomplete: list[str] = field(default_factory=list)  # no valid marker: not sent
    skipped_corrupt: list[str] = field(default_factory=list)  # files fail their digests: not sent
    vanished: list[str] = field(default_factory=list)  # deleted locally (trainer pruning) mid-sync
    deleted_local: list[str] = field(default_factory=list)  # pruned after verified upload
    bytes_sent: int = 0
    seconds: float = 0.0

    def as_meta(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


class CheckpointMirror:
    """Mirror a trainer's `checkpoints/` folder to S3 and keep the newest few locally.

        mirror = CheckpointMirror("s3://bucket/runs/smollm3/stage1/checkpoints", keep_local=2)
        mirror.sync(stage_dir / "checkpoints")          # between stages, or in a loop during one
        pull_latest_checkpoint(mirror.s3_uri, stage_dir / "checkpoints")   # on a fresh node

    Safe to call repeatedly and while the trainer writes: folders without a valid marker are left
    alone (neither uploaded nor deleted), and an already-mirrored folder costs two small requests.
    """

    def __init__(
        self,
        s3_uri: str,
        keep_local: int | None = None,
        config: StorageConfig | None = None,
        *,
        client: Any = None,
        sleep: Callable[[float], None] = time.sleep,
        marker: str = CHECKPOINT_MARKER,
    ):
        base = config or StorageConfig(s3_uri=s3_uri)
        if keep_local is not None:
            base = base.model_copy(update={"keep_local": keep_local})
        if base.keep_local < 1:
            raise ValueError(f"keep_local must be >= 1, got {base.keep_local}")
        self.s3_uri = s3_uri
        self.config = base
        self.marker = marker
        self.store = S3Store(s3_uri, base, client=client, sleep=sleep)

    def sync(self, checkpoints_dir: str | Path) -> SyncReport:
        start = time.monotonic()
        report = SyncReport()
        complete: list[tuple[Path, dict[str, Any]]] = []
        for folder in step_folders(Path(checkpoints_dir)):
            record = checkpoint_complete(folder, self.marker)
            if record is None:
                report.skipped_incomplete.append(folder.name)
            else:
                complete.append((folder, record))
        for folder, _ in complete:
            try:
                result = self.store.upload_folder(folder, folder.name, self.marker)
            except CorruptCheckpoint as exc:
                # Not fatal for training (the trainer itself skips it on resume), but it must
                # never replace a good remote copy, nor be deleted locally as "mirrored".
                log.warning("%s", exc)
                report.skipped_corrupt.append(folder.name)
                continue
            except (OSError, StorageError):
                if checkpoint_complete(folder, self.marker) is not None:
                    raise
                # The trainer pruned it while we read it (its keep_last is smaller than ours):
                # not an error, but that checkpoint will be missing on S3, so say so.
                log.warning(
                    "checkpoint %s disappeared while mirroring it; raise the trainer's "
                    "keep_last above keep_local=%d so the mirror decides what is deleted",
                    folder,
                    self.config.keep_local,
                )
                report.vanished.append(folder.name)
                continue
            if result.sent or result.bytes:
                report.uploaded.append(folder.name)
                report.bytes_sent += result.bytes
            report.verified.append(folder.name)
        keep = {f for f, _ in complete[-self.config.keep_local :]}
        if self.config.keep_stage_ends:
            keep |= {f for f, r in complete if r.get("stage_end")}
        for folder, _ in complete:
            # Only what this sync saw complete on S3 may go; never the newest few.
            if folder not in keep and folder.name in report.verified:
                shutil.rmtree(folder)
                report.deleted_local.append(folder.name)
        report.seconds = time.monotonic() - start
        return report

    @contextmanager
    def syncing(
        self, checkpoints_dir: str | Path, every_s: float = 300.0, log: Callable[[str], None] = print
    ) -> Iterator[SyncReport]:
        """Sync every `every_s` seconds in a background thread while the block runs, then once more.

            with mirror.syncing(stage_dir / "checkpoints", every_s=300, log=logger.info) as final:
                launcher.launch(spec, stage_dir, logger.info)
            # here every complete checkpoint is on S3, verified; `final` holds the last report

        A failing background round is logged and retried next round (S3 hiccups must not kill a
        24-day run); the final sync's failure propagates. If the block raises, the final sync
        still runs (the checkpoints written before the failure are what a retry resumes from) and
        the block's exception wins.
        """
        final = SyncReport()
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(every_s):
                try:
                    r = self.sync(checkpoints_dir)
                    if r.uploaded:
                        log(f"[mirror] uploaded {', '.join(r.uploaded)} to {self.s3_uri}")
                except Exception as exc:  # noqa: BLE001 - reported, retried next round
                    log(
                        f"[mirror] background sync to {self.s3_uri} failed, retrying in "
                        f"{every_s:.0f}s: {type(exc).__name__}: {exc}"
                    )

        thread = threading.Thread(target=loop, name="checkpoint-mirror", daemon=True)
        thread.start()
        failed = False
        try:
            yield final
        except BaseException:
            failed = True
            raise
        finally:
            stop.set()
            thread.join()
            try:
                r = self.sync(checkpoints_dir)
                final.__dict__.update(r.__dict__)
                log(
                    f"[mirror] {len(r.verified)} checkpoint(s) verified on {self.s3_uri}"
                    + (f"; uploaded {', '.join(r.uploaded)}" if r.uploaded else "")
                )
            except Exception as exc:
                if not failed:
                    raise
                log(f"[mirror] final sync after a failed stage also failed: {exc}")

    def remote_steps(self) -> list[str]:
        """Complete checkpoints on S3 (marker present), oldest first."""
        return [
            n
            for n in self.store.subfolders()
            if n.startswith("step_") and n[5:].isdigit() and self.store.remote_complete(n, self.marker)
        ]


@dataclass
class UploadReport:
    """What a `CheckpointUploader` did (names of step folders); safe to log and record."""

    uploaded: list[str] = field(default_factory=list)  # complete on S3, verified, by this uploader
    deleted_remote: list[str] = field(default_factory=list)  # removed from the bucket by retention
    skipped_corrupt: list[str] = field(default_factory=list)  # files fail their digests: not sent
    failed: dict[str, str] = field(default_factory=dict)  # still not on S3: name -> last error
    bytes_sent: int = 0


_STOP = object()


class CheckpointUploader:
    """Uploads a trainer's checkpoints from the process that wrote them, in a background thread.

        uploader = CheckpointUploader(s3_prefix, storage, stage_dir / "checkpoints", record=stage_dir / "mirror.jsonl")
        uploader.start()                       # first: the complete local checkpoints not yet on S3
        ckpt = Checkpointer(root, on_complete=uploader.submit, protect=uploader.pending)
        ...                                    # every save's marker hands its folder to submit()
        uploader.close()                       # the stage's end: everything verified on S3, or raises

    The trainer's rank 0 runs it (trainers/pretrain.py): it writes each checkpoint's marker, so it
    knows first that the folder is complete, and the folder is on the shared file system every
    rank wrote its shards to. `submit` only queues the folder; it blocks the training step only
    when `storage.upload_queue` checkpoints are already waiting (backpressure: local disk then
    holds at most keep_last + upload_queue + 1 checkpoints, since a folder waiting for its upload
    is never pruned locally: `pending`). Each upload is `S3Store.upload_folder`: digests checked
    against the trainer's marker, every object verified, the manifest (signed with
    `$SMOLLM3_MIRROR_KEY` when set) then the marker last, so a process killed mid-upload leaves a
    folder without its marker, which no resume takes. After each verified upload the retention of
    `storage.checkpoints` runs: complete checkpoints older than the one just verified that are
    neither among the newest `keep_last` nor milestones are deleted (marker first, so a
    half-deleted folder is incomplete too), and incomplete leftovers of killed uploads older than
    it go as well. A failed upload is logged and retried with the next one; `close` retries what is
    still missing once more and raises `StorageError` naming it. Each verified upload and each
    deletion is a line of `record` (JSONL: event, checkpoint, pid, host, bytes, seconds).
    """

    def __init__(
        self,
        s3_uri: str,
        config: StorageConfig,
        checkpoints_dir: str | Path,
        *,
        stable_until: int | None = None,
        record: str | Path | None = None,
        log: Callable[[str], None] | None = None,
        client: Any = None,
        sleep: Callable[[float], None] = time.sleep,
        marker: str = CHECKPOINT_MARKER,
    ):
        self.s3_uri = s3_uri
        self.config = config
        self.root = Path(checkpoints_dir)
        self.stable_until = stable_until
        self.record = Path(record) if record is not None else None
        self.marker = marker
        self._log = log or log_info
        self._store_args = (s3_uri, config, client, sleep)
        self.store: S3Store | None = None
        self.report = UploadReport()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.upload_queue)
        self._lock = threading.Lock()
        self._pending: set[str] = set()  # accepted, not yet verified on S3 (never pruned locally)
        self._newest: str | None = None  # the newest checkpoint this uploader verified on S3
        self._thread: threading.Thread | None = None
        self._abandoned = threading.Event()

    def start(self) -> CheckpointUploader:
        """Start the thread; it first uploads the complete local checkpoints (a crash or a kill may
        have left some written but not mirrored: `upload_folder` skips what is already there)."""
        backlog = [f for f in step_folders(self.root) if checkpoint_complete(f, self.marker) is not None]
        with self._lock:
            self._pending |= {f.name for f in backlog}
        self._thread = threading.Thread(target=self._run, args=(backlog,), name="checkpoint-upload", daemon=True)
        self._thread.start()
        return self

    def pending(self) -> set[str]:
        """Names of the checkpoints handed over and not yet verified on S3: keep them locally.

        Of those whose upload failed, only the newest `upload_queue` are kept (a long outage must
        not fill the disk): an older one pruned meanwhile is reported and never reaches S3."""
        with self._lock:
            failed = sorted(self.report.failed)[-self.config.upload_queue :]
            return set(self._pending) | set(failed)

    def _failed(self) -> list[str]:
        with self._lock:
            return sorted(self.report.failed)

    def submit(self, folder: str | Path) -> None:
        """Queue a complete checkpoint folder; blocks only while the queue is full (and never
        once the thread has died: the folder is then reported as failed by `close`)."""
        folder = Path(folder)
        with self._lock:
            self._pending.add(folder.name)
        try:
            self._queue.put_nowait(folder)
            return
        except queue.Full:
            self._log(
                f"[mirror] {self.config.upload_queue} checkpoint(s) still waiting for their upload to "
                f"{self.s3_uri}; training waits until there is room for {folder.name}"
            )
        while not self._put(folder, timeout=1.0):
            if self._thread is None or not self._thread.is_alive():
                self._fail(folder.name, "the upload thread has stopped")
                return

    def _put(self, item: Any, timeout: float) -> bool:
        try:
            self._queue.put(item, timeout=timeout)
            return True
        except queue.Full:
            return False

    def _fail(self, name: str, error: str) -> None:
        with self._lock:
            self._pending.discard(name)
            self.report.failed[name] = error

    def close(self) -> UploadReport:
        """Upload what is queued, retry what failed once, stop; `StorageError` if any is still
        not on S3 (the stage must not end as if its checkpoints were safe)."""
        if self._thread is not None:
            while self._thread.is_alive() and not self._put(_STOP, timeout=1.0):
                pass
            self._thread.join()
            self._thread = None
        if self.report.failed:
            raise StorageError(
                f"checkpoints not mirrored to {self.s3_uri}: "
                + "; ".join(f"{n}: {e}" for n, e in sorted(self.report.failed.items()))
                + " (they stay on local disk; a rerun of the stage uploads them first)"
            )
        return self.report

    def abandon(self) -> None:
        """Stop without waiting (the trainer is failing or stopping): a folder being uploaded stays
        without its marker on S3, and the next launch's `start` uploads it again."""
        self._abandoned.set()
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            pass  # the thread sees the event after its current folder

    # -- the thread --

    def _run(self, backlog: list[Path]) -> None:
        s3_uri, config, client, sleep = self._store_args
        try:
            self.store = S3Store(s3_uri, config, client=client, sleep=sleep)
        except Exception as exc:  # noqa: BLE001 - reported by close(), like a failed upload
            for f in backlog:
                self._fail(f.name, f"{type(exc).__name__}: {exc}")
            self._drain_failing(exc)
            return
        for folder in backlog:
            if self._abandoned.is_set():
                return
            self._upload(folder)
        while not self._abandoned.is_set():
            item = self._queue.get()
            if item is _STOP or self._abandoned.is_set():
                break
            for name in self._failed():  # a failed one first: it is older
                self._upload(self.root / name)
            self._upload(item)
        if not self._abandoned.is_set():
            for name in self._failed():
                self._upload(self.root / name)

    def _drain_failing(self, exc: BaseException) -> None:
        while not self._abandoned.is_set():
            item = self._queue.get()
            if item is _STOP:
                return
            self._fail(Path(item).name, f"{type(exc).__name__}: {exc}")

    def _upload(self, folder: Path) -> None:
        """`_upload_one`, never raising: the thread must outlive any one checkpoint."""
        try:
            self._upload_one(folder)
        except Exception as exc:  # noqa: BLE001 - e.g. the record file's disk is full
            self._fail(folder.name, f"{type(exc).__name__}: {exc}")
            self._log(f"WARNING: [mirror] {folder.name}: {type(exc).__name__}: {exc}")

    def _upload_one(self, folder: Path) -> None:
        assert self.store is not None
        name = folder.name
        start = time.monotonic()
        if checkpoint_complete(folder, self.marker) is None:
            self._log(f"WARNING: [mirror] {folder} is not a complete checkpoint (or was pruned); not uploaded")
            self._settle(name)
            return
        try:
            result = self.store.upload_folder(folder, name, self.marker)
        except CorruptCheckpoint as exc:
            self._log(f"WARNING: [mirror] {exc}")
            self.report.skipped_corrupt.append(name)
            self._settle(name)
            return
        except Exception as exc:  # noqa: BLE001 - S3 hiccups must not kill a 24-day run: retried
            self._fail(name, f"{type(exc).__name__}: {exc}")
            self._log(f"WARNING: [mirror] upload of {name} to {self.s3_uri} failed, retried with the next one: {exc}")
            return
        seconds = time.monotonic() - start
        self.report.uploaded.append(name)
        self.report.bytes_sent += result.bytes if result.sent else 0
        self._settle(name)
        if self._newest is None or name > self._newest:
            self._newest = name
        self._note("uploaded", name, bytes=result.bytes, sent=result.sent, seconds=round(seconds, 3))
        self._log(
            f"[mirror] pid {os.getpid()} uploaded {name} to {self.s3_uri} "
            f"({result.bytes / 1e6:.1f} MB, {result.sent} file(s) sent, verified, {seconds:.1f}s)"
        )
        try:
            self._retain()
        except Exception as exc:  # noqa: BLE001 - deleting is tried again after the next upload
            self._log(f"WARNING: [mirror] retention on {self.s3_uri} failed, tried again next upload: {exc}")

    def _settle(self, name: str) -> None:
        with self._lock:
            self._pending.discard(name)
            self.report.failed.pop(name, None)

    def _note(self, event: str, name: str, **fields: Any) -> None:
        if self.record is None:
            return
        import socket

        row = {"event": event, "checkpoint": name, "pid": os.getpid(), "host": socket.gethostname(), **fields}
        self.record.parent.mkdir(parents=True, exist_ok=True)
        with open(self.record, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def _retain(self) -> None:
        """Delete what `storage.checkpoints` does not keep, older than the newest verified upload."""
        store, newest = self.store, self._newest
        assert store is not None and newest is not None
        names = [n for n in store.subfolders() if n.startswith("step_") and n[5:].isdigit()]
        busy = self.pending()
        complete: list[tuple[str, int, bool]] = []
        leftovers: list[str] = []
        for n in names:
            raw = store.get_bytes(store.key(n, self.marker))
            if raw is None or not store.exists(store.key(n, MANIFEST)):
                if n < newest and n not in busy:
                    leftovers.append(n)  # a killed upload's files: nothing will complete them
                continue
            try:
                record = json.loads(raw)
                stage_end = bool(record.get("stage_end")) if isinstance(record, dict) else False
            except ValueError:
                stage_end = False
            complete.append((n, int(n[5:]), stage_end))
        keep = self.config.checkpoints.kept(complete, self.stable_until)
        doomed = [n for n, _, _ in complete if n < newest and n not in keep and n not in busy]
        for n in doomed + leftovers:
            self._delete_remote(n)
            self.report.deleted_remote.append(n)
            self._note("deleted", n)
        if doomed:
            self._log(f"[mirror] deleted {', '.join(doomed)} from {self.s3_uri} (storage.checkpoints retention)")

    def _delete_remote(self, name: str) -> None:
        """Marker first (from then on the folder is incomplete), then the manifest, then the rest."""
        store = self.store
        assert store is not None
        store.delete(store.key(name, self.marker))
        store.delete(store.key(name, MANIFEST))
        prefix = store.key(name) + "/"
        paginator = store.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=store.bucket, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                store._retry(
                    lambda keys=keys: store.client.delete_objects(Bucket=store.bucket, Delete={"Objects": keys}),
                    f"delete {len(keys)} objects under s3://{store.bucket}/{prefix}",
                )


def log_info(message: str) -> None:
    log.info("%s", message)


def pull_latest_checkpoint(
    s3_prefix: str,
    local_dir: str | Path,
    config: StorageConfig | None = None,
    *,
    client: Any = None,
    marker: str = CHECKPOINT_MARKER,
) -> Path | None:
    """The newest complete checkpoint that verifies, downloaded from `s3_prefix` into `local_dir`.

    `local_dir` is the trainer's checkpoints root. Returns the local step folder, or None when S3
    holds no complete checkpoint. A local complete copy that is as new as the newest remote one is
    returned without downloading (the trainer verifies it before use); remote folders without
    their marker are ignored (still uploading or abandoned midway). A download is checked against
    the uploader's `_SHA256SUMS.json` file by file, then the whole folder against the trainer's
    digests in its marker; a remote checkpoint that fails either is skipped, with a warning, for
    the next older one. Raises `StorageError` when every complete remote checkpoint fails.
    """
    mirror = CheckpointMirror(s3_prefix, config=config, client=client, marker=marker)
    local_dir = Path(local_dir)
    names = [n for n in mirror.store.subfolders() if n.startswith("step_") and n[5:].isdigit()]
    local_complete = [f for f in step_folders(local_dir) if checkpoint_complete(f, marker)]
    failures: list[str] = []
    # newest first, stopping at the first good one: a long run has thousands on S3
    for name in reversed(names):
        if not mirror.store.remote_complete(name, marker):
            continue
        if local_complete and local_complete[-1].name >= name:
            return local_complete[-1]
        dest = local_dir / name
        try:
            mirror.store.download_folder(name, dest, marker)
        except StorageError as exc:
            from infra.transient import transient

            if transient(exc):  # S3 or the network failed, not the checkpoint: no older one is better
                raise
            failures.append(f"{name}: {exc}")
            log.warning("remote checkpoint %s/%s is damaged (%s); trying an older one", s3_prefix, name, exc)
            continue
        problems = manifest.verify(dest, marker)
        if not problems:
            return dest
        shutil.rmtree(dest, ignore_errors=True)
        failures.append(f"{name}: {'; '.join(problems)}")
        log.warning(
            "checkpoint %s pulled from %s fails the trainer's digests (%s); trying an older one",
            name,
            s3_prefix,
            "; ".join(problems),
        )
    if failures:
        raise StorageError(
            f"no checkpoint under {s3_prefix} verifies: "
            + " | ".join(failures)
            + "; delete the damaged ones and re-upload from a good copy"
        )
    return None


def pull_for_resume(
    mirror: MirrorTarget,
    local_dir: str | Path,
    *,
    record: Path | None = None,
    log: Callable[[str], None] = log_info,
    client: Any = None,
) -> Path | None:
    """The trainer's pull before it resumes (`MirrorTarget.pull`, rank 0 only, the other ranks
    wait for it): when `local_dir` holds no complete checkpoint (a fresh machine, a wiped shared
    folder, only a killed pull's or save's leftovers), `pull_latest_checkpoint` brings the newest
    one that verifies from `mirror.uri` into it. Returns the pulled folder, or None (nothing pulled:
    a complete local one is there, or S3 holds none). Each pull is logged with this process's pid
    and recorded in `record` (`mirror.jsonl`, event "pulled")."""
    local_dir = Path(local_dir)
    if has_complete_checkpoint(local_dir):
        return None
    start = time.monotonic()
    pulled = pull_latest_checkpoint(mirror.uri, local_dir, mirror.storage, client=client)
    if pulled is None:
        log(f"[mirror] pid {os.getpid()}: no complete checkpoint under {mirror.uri} to resume from")
        return None
    seconds = time.monotonic() - start
    log(f"[mirror] pid {os.getpid()} pulled {pulled.name} from {mirror.uri} ({seconds:.1f}s, verified)")
    if record is not None:
        import socket

        row = {"event": "pulled", "checkpoint": pulled.name, "pid": os.getpid(), "host": socket.gethostname()}
        record.parent.mkdir(parents=True, exist_ok=True)
        with open(record, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return pulled


PULL_PROGRESS_S = 10.0  # a waiting rank's walk of the checkpoints folder, at most this often (`wait_for_pull`)
PULLED = ".pulled"  # in a stage's folder: written by a cluster launch's main rank when its pull ended


def pull_progress(local_dir: str | Path) -> tuple[int, int]:
    """(files, bytes) in `local_dir`'s checkpoint folders, the pulls in progress
    (`.step_*.partial`) included: what grows while a pull downloads."""
    files = size = 0
    root = Path(local_dir)
    if not root.is_dir():
        return 0, 0
    for folder in root.iterdir():
        if not folder.is_dir() or not (folder.name.startswith("step_") or folder.name.endswith(".partial")):
            continue
        for path in folder.rglob("*"):
            try:
                size += path.stat().st_size
                files += 1
            except OSError:
                continue  # renamed or removed while listed: the next poll sees where it went
    return files, size


def wait_for_pull(
    done: Path,
    local_dir: str | Path,
    *,
    stall_s: float,
    poll_s: float = 1.0,
    on_progress: Callable[[], None] | None = None,
) -> None:
    """Return once `done` exists (the main rank wrote it when its pull ended). A pull may take as
    long as it moves bytes: each look that finds `local_dir` grown (`pull_progress`) restarts the
    clock and calls `on_progress` (a rank's watchdog); `TimeoutError` after `stall_s` seconds in
    which nothing arrived. A main rank that dies ends the launch, and this rank with it.

    `done` is checked every `poll_s`; the folder is walked at most every `PULL_PROGRESS_S` (a
    quarter of the stall bound when that is shorter): at the 3B recipe's 384 ranks, 383 of them
    wait, and a walk stats each of the pull's files (a DCP checkpoint holds a few hundred) on the
    shared file system, so a walk a second per rank would be ~10^5 stats a second there."""
    every = min(PULL_PROGRESS_S, stall_s / 4)
    last, since = pull_progress(local_dir), time.monotonic()
    looked = since
    while not Path(done).exists():
        if time.monotonic() - looked >= every:
            now, looked = pull_progress(local_dir), time.monotonic()
            if now != last:
                last, since = now, looked
                if on_progress is not None:
                    on_progress()
            elif looked - since > stall_s:
                raise TimeoutError(
                    f"the main rank's checkpoint pull into {local_dir} moved no byte in {stall_s:g} s "
                    f"(it has {last[0]} files, {last[1] / 1e6:.1f} MB there); {done} was never written"
                )
        time.sleep(poll_s)


def describe(config: StorageConfig) -> dict[str, Any]:
    """Facts about the storage setup for lineage and logs: never credentials."""
    return {
        "s3_uri": config.s3_uri,
        "endpoint_url": config.endpoint_url,
        "region": config.region,
        "keep_local": config.keep_local,
        "checkpoints": config.checkpoints.model_dump(mode="json"),
    }


__all__: Sequence[str] = (
    "CheckpointMirror",
    "CheckpointRetention",
    "CheckpointUploader",
    "ForgedManifest",
    "MIRROR_KEY_ENV",
    "MirrorTarget",
    "S3Store",
    "StorageConfig",
    "StorageError",
    "SyncReport",
    "UploadReport",
    "describe",
    "fetch_artifact",
    "has_complete_checkpoint",
    "mirror_artifact",
    "PULLED",
    "pull_for_resume",
    "pull_latest_checkpoint",
    "pull_progress",
    "split_s3_uri",
    "wait_for_pull",
)
