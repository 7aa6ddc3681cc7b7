"""Prefect's persisted step results, read back as data and nothing else.

A step's Prefect task persists its result (the step's Artifact as JSON) under
`{workspace}/results/{key}`, so a rerun shows finished steps as Cached. Prefect reads such a
record back with the serializer *the record names*: a record planted in the workspace that names
`pickle` would be unpickled, and even the JSON serializer it names can be pointed at any
`object_decoder` or `jsonlib`, and its default decoder imports any class a `__class__` key names.
So the results folder is read through `CheckedResults`, a local file system whose `read_path`
hands Prefect a record only when it is exactly what our tasks write:

- a JSON object `{"metadata", "result"}` of at most `MAX_BYTES`, whose serializer is Prefect's
  JSON serializer with its default settings and whose storage block is none;
- a result that is JSON of one Artifact, with no `__class__` or `__exc_type__` key anywhere (the
  two that make Prefect's decoder import), whose fingerprint matches the key's and whose folder is
  the step folder that fingerprint names in this workspace.

Anything else raises `RefusedResult` from `read_path` with a warning naming the file and why:
Prefect counts a record it cannot read as absent (a cache miss), so the step runs its body (which
reuses its finished folder, or builds it) and overwrites the record. The bytes Prefect parses are
the bytes checked here: a record swapped after the check is never read.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.filesystems import LocalFileSystem
from pydantic import ValidationError

from pipeline.artifact import Artifact

log = logging.getLogger(__name__)

MAX_BYTES = 4 << 20  # an Artifact record is a few KB; anything bigger is not ours
RECORD_KEYS = {"metadata", "result"}
METADATA_KEYS = {"storage_key", "expiration", "serializer", "prefect_version", "storage_block_id"}
# {step}-{fingerprint[:20]}-{code version}-{workspace tag}[-rebuild-x]: pipeline/runner.py StepCache
KEY = re.compile(r"^(?P<step>[a-z0-9_]+)-(?P<fp>[0-9a-f]{20})-")
IMPORTING_KEYS = ("__class__", "__exc_type__")  # prefect_json_object_decoder imports these names


class RefusedResult(ValueError):
    """A persisted result that is not exactly what our tasks write: never deserialized."""


def json_serializer() -> dict[str, Any]:
    """The serializer record our tasks write (`result_serializer="json"`, Prefect's defaults)."""
    from prefect.serializers import JSONSerializer

    return JSONSerializer().model_dump(mode="json")


def check_record(data: bytes, key: str, workspace: Path) -> None:
    """Raise RefusedResult unless `data` is a step result our tasks wrote for `key`."""
    if len(data) > MAX_BYTES:
        raise RefusedResult(f"{len(data)} bytes, more than a step result holds ({MAX_BYTES})")
    try:
        record = json.loads(data)
    except ValueError:
        raise RefusedResult("not JSON") from None
    if not isinstance(record, dict) or set(record) != RECORD_KEYS:
        raise RefusedResult(f"not a result record (keys {sorted(record) if isinstance(record, dict) else '-'})")
    metadata = record["metadata"]
    if not isinstance(metadata, dict) or not set(metadata) <= METADATA_KEYS:
        raise RefusedResult("its metadata has fields a step result does not")
    if metadata.get("serializer") != json_serializer():
        named = metadata.get("serializer")
        kind = named.get("type") if isinstance(named, dict) else type(named).__name__
        raise RefusedResult(f"it names serializer {kind!r} with other settings than the JSON one steps use")
    if metadata.get("storage_block_id") is not None:
        raise RefusedResult("it points at a storage block")
    if not isinstance(record["result"], str):
        raise RefusedResult("its result is not JSON text")
    try:
        value = json.loads(record["result"], object_pairs_hook=_no_importing_keys)
        artifact = Artifact.model_validate(value)
    except (ValueError, ValidationError) as exc:
        raise RefusedResult(f"its result is not an Artifact: {str(exc).splitlines()[0]}") from None
    match = KEY.match(key)
    if match is None or not artifact.fingerprint.startswith(match["fp"]):
        raise RefusedResult("its Artifact's fingerprint is not the one its key names")
    folder = workspace / match["step"] / artifact.short
    if artifact.uri != str(folder):
        raise RefusedResult(f"its Artifact points at {artifact.uri}, not the step folder {folder}")


def _no_importing_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = [k for k, _ in pairs if k in IMPORTING_KEYS]
    if found:
        raise ValueError(f"it holds a {found[0]!r} key, which Prefect's decoder would import")
    return dict(pairs)


class CheckedResults(LocalFileSystem):
    """The workspace's results folder for Prefect: reads only what `check_record` accepts."""

    _block_type_name = "smollm3 checked results"
    _block_type_slug = "smollm3-checked-results"

    def _checked(self, path: str, data: bytes) -> bytes:
        try:
            check_record(data, Path(path).name, Path(self.basepath).parent)
        except RefusedResult as exc:
            where = self._resolve_path(path)
            message = f"refusing the persisted result {where}: {exc}; treating it as a cache miss"
            _warn(message)
            raise RefusedResult(message) from None
        return data

    async def aread_path(self, path: str) -> bytes:
        return self._checked(path, _read(self._resolve_path(path)))

    @async_dispatch(aread_path)
    def read_path(self, path: str) -> bytes:
        return self._checked(path, _read(self._resolve_path(path)))


def _read(path: Path) -> bytes:
    if not path.is_file():
        raise ValueError(f"Path {path} does not exist or is not a file.")
    with open(path, "rb") as fh:
        return fh.read(MAX_BYTES + 1)


def _warn(message: str) -> None:
    """To this module's logger, and to the task run's log (the UI) when there is one."""
    log.warning(message)
    try:
        from prefect import get_run_logger

        get_run_logger().warning(message)
    except Exception:  # noqa: BLE001 - no run context: the module's logger has it
        pass
