"""The trainer's S3 uploader (`CheckpointUploader`, infra/storage.py) against moto's S3 server.

Covers: retention keeps exactly the newest `keep_last` plus the milestones (the stage end, listed
steps, the last stable-phase checkpoint), and deletes an older checkpoint only after a newer one
was uploaded and verified, marker first; the recipe setting is validated with the bad value named;
a checkpoint waiting for its upload is never pruned locally; a process killed mid-upload (SIGKILL)
leaves nothing a resume takes as complete, and the next uploader completes it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.storage import (
    CHECKPOINT_MARKER,
    MANIFEST,
    CheckpointRetention,
    CheckpointUploader,
    StorageConfig,
    pull_latest_checkpoint,
)
from tests.infra.test_storage import MiB, cfg, fake_checkpoint, keys, record_writes, s3  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


def remote_complete(client, prefix: str) -> list[str]:
    """Step folders under `prefix` whose marker and manifest are both there."""
    names = {k[len(prefix) :].split("/")[0] for k in keys(client, prefix)}
    found = keys(client, prefix)
    return sorted(
        n for n in names if f"{prefix}{n}/{CHECKPOINT_MARKER}" in found and f"{prefix}{n}/{MANIFEST}" in found
    )


def test_retention_keeps_the_last_n_and_the_milestones_and_deletes_only_after_a_newer_upload(s3, tmp_path):  # noqa: F811
    endpoint, client = s3
    writes = record_writes(client)
    retention = CheckpointRetention(keep_last=2, milestones=[30, "decay_start"])
    storage = cfg(endpoint, checkpoints=retention)
    root = tmp_path / "checkpoints"
    lines: list[str] = []
    uploader = CheckpointUploader(
        "s3://ckpts/run/stage1",
        storage,
        root,
        stable_until=55,  # the WSD decay starts after step 55: step 50 is the last stable checkpoint
        record=tmp_path / "mirror.jsonl",
        log=lines.append,
        client=client,
    ).start()
    for step in range(10, 101, 10):  # as the trainer hands them over, each once its marker is written
        uploader.submit(fake_checkpoint(root, step, stage_end=step == 100))
    report = uploader.close()

    kept = ["step_00000030", "step_00000050", "step_00000090", "step_00000100"]
    assert remote_complete(client, "run/stage1/") == kept
    # a deleted folder is gone whole: no object of it is left
    assert {k.split("/")[2] for k in keys(client, "run/stage1/")} == set(kept)
    assert sorted(report.deleted_remote) == ["step_00000010", "step_00000020", "step_00000040"] + [
        f"step_{s:08d}" for s in (60, 70, 80)
    ]
    # Each deletion happened after a newer checkpoint's marker was uploaded (it is put last,
    # after its files were verified), and a deleted folder lost its marker before anything else.
    order = [(op, key) for op, key in writes]
    for name in report.deleted_remote:
        marker_del = order.index(("DeleteObject", f"run/stage1/{name}/{CHECKPOINT_MARKER}"))
        newer_markers = [
            i
            for i, (op, key) in enumerate(order)
            if op == "PutObject" and key.endswith(CHECKPOINT_MARKER) and key.split("/")[2] > name
        ]
        assert newer_markers and min(newer_markers) < marker_del, name
        manifest_del = order.index(("DeleteObject", f"run/stage1/{name}/{MANIFEST}"))
        assert marker_del < manifest_del
    rows = [json.loads(line) for line in (tmp_path / "mirror.jsonl").read_text().splitlines()]
    assert [r["checkpoint"] for r in rows if r["event"] == "uploaded"] == [f"step_{s:08d}" for s in range(10, 101, 10)]
    assert {r["pid"] for r in rows} == {os.getpid()}  # here the uploader ran in this process
    assert any(line.startswith(f"[mirror] pid {os.getpid()} uploaded step_00000100") for line in lines)

    # keep_last null keeps every checkpoint (today's default)
    every = CheckpointUploader("s3://ckpts/all", cfg(endpoint), root, client=client).start()
    every.close()
    assert remote_complete(client, "all/") == sorted(p.name for p in root.iterdir())


def test_the_retention_setting_names_a_bad_value():
    from flows.recipe import RecipeError, load_recipe

    for bad in (0, -3, "three", 2.5, True):
        with pytest.raises(ValueError, match=rf"keep_last must be a whole number >= 1.*got {bad!r}"):
            CheckpointRetention(keep_last=bad)
    with pytest.raises(ValueError, match=r"milestones: 'decay-start' is neither a step number"):
        CheckpointRetention(milestones=["decay-start"])
    with pytest.raises(ValueError, match=r"milestones: 0 is neither a step number"):
        StorageConfig(checkpoints={"keep_last": 2, "milestones": [0]})
    with pytest.raises(RecipeError, match=r"keep_last must be a whole number >= 1.*got 0"):
        load_recipe("tiny", ["storage.checkpoints.keep_last=0"])
    recipe = load_recipe("smollm3-3b")
    assert recipe.storage.checkpoints.keep_last is not None


def test_a_checkpoint_waiting_for_its_upload_is_not_pruned_locally(tmp_path):
    torch = pytest.importorskip("torch")  # noqa: F841 - model.checkpoint needs it
    from model.checkpoint import Checkpointer

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        fake_checkpoint(root, step)
    waiting = {"step_00000001", "step_00000002"}
    Checkpointer(root, keep_last=1, protect=lambda: waiting).prune()
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002", "step_00000004"]
    Checkpointer(root, keep_last=1, protect=set).prune()  # uploaded: now they may go
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004"]


CHILD = r"""
import sys, time
from pathlib import Path
from infra import storage
from infra.storage import CheckpointRetention, CheckpointUploader, StorageConfig

endpoint, root, signal_file = sys.argv[1:4]
original = storage.S3Store.put_file

def put_then_hang(self, path, key, digest=None):
    sent = original(self, path, key, digest)
    if "step_00000020" in key:
        Path(signal_file).write_text(key)  # one file of step 20 is on S3: kill me now
        time.sleep(600)
    return sent

storage.S3Store.put_file = put_then_hang
config = StorageConfig(
    s3_uri="s3://ckpts/run", endpoint_url=endpoint, multipart_threshold_mb=5, multipart_chunk_mb=5,
    attempts=1, backoff_seconds=0.0, checkpoints=CheckpointRetention(keep_last=1),
)
CheckpointUploader("s3://ckpts/run/stage1", config, root).start().close()
"""


def test_a_kill_mid_upload_leaves_nothing_a_resume_takes_as_complete(s3, tmp_path):  # noqa: F811
    endpoint, client = s3
    storage = cfg(endpoint, checkpoints=CheckpointRetention(keep_last=1))
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 10)
    CheckpointUploader("s3://ckpts/run/stage1", storage, root, client=client).start().close()
    fake_checkpoint(root, 20, big=12 * MiB)  # written, then the uploading process dies midway

    signal_file = tmp_path / "half-sent"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, endpoint, str(root), str(signal_file)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + 120
        while not signal_file.exists():
            assert child.poll() is None, "the uploader exited before it sent a file of step 20"
            assert time.monotonic() < deadline, "no file of step 20 was sent within 120 s"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    sent = keys(client, "run/stage1/step_00000020/")
    assert sent, "nothing of step 20 reached S3 before the kill"
    assert f"run/stage1/step_00000020/{CHECKPOINT_MARKER}" not in sent
    assert remote_complete(client, "run/stage1/") == ["step_00000010"]  # not deleted for a half upload
    fresh = tmp_path / "fresh" / "checkpoints"
    pulled = pull_latest_checkpoint("s3://ckpts/run/stage1", fresh, storage, client=client)
    assert pulled is not None and pulled.name == "step_00000010"

    # the next launch's uploader completes step 20, then retention drops step 10
    report = CheckpointUploader("s3://ckpts/run/stage1", storage, root, client=client).start().close()
    assert "step_00000020" in report.uploaded and report.deleted_remote == ["step_00000010"]
    assert remote_complete(client, "run/stage1/") == ["step_00000020"]
    assert keys(client, "run/stage1/step_00000010/") == []
    again = tmp_path / "again" / "checkpoints"
    pulled = pull_latest_checkpoint("s3://ckpts/run/stage1", again, storage, client=client)
    assert pulled is not None and pulled.name == "step_00000020"
    assert (pulled / "__0_0.distcp").read_bytes() == (root / "step_00000020" / "__0_0.distcp").read_bytes()


PULL_CHILD = r"""
import sys, time
from pathlib import Path
from infra import storage
from infra.storage import MirrorTarget, StorageConfig, pull_for_resume

endpoint, root, signal_file = sys.argv[1:4]
original = storage.file_digest

def digest_then_hang(path, *args, **kwargs):
    got = original(path, *args, **kwargs)
    if Path(path).name == "__0_0.distcp" and ".partial" in str(path):
        Path(signal_file).write_text(str(path))  # the big file is down, the marker is not: kill me now
        time.sleep(600)
    return got

storage.file_digest = digest_then_hang
config = StorageConfig(
    s3_uri="s3://ckpts/run", endpoint_url=endpoint, multipart_threshold_mb=5, multipart_chunk_mb=5,
    attempts=1, backoff_seconds=0.0,
)
pull_for_resume(MirrorTarget(uri="s3://ckpts/run/stage1", storage=config, pull=True), Path(root))
"""


def test_a_kill_mid_pull_leaves_nothing_a_resume_takes_as_complete_and_the_next_pull_completes(s3, tmp_path):  # noqa: F811
    """The trainer's pull before a resume (`pull_for_resume`, rank 0 on a cluster launch) killed
    midway: its `.partial` folder is no checkpoint to the trainer, does not stop the next pull,
    and that pull (in its own process, recorded with its pid) brings the checkpoint back whole."""
    from infra.storage import MirrorTarget, has_complete_checkpoint, pull_for_resume
    from model.checkpoint import Checkpointer

    endpoint, client = s3
    storage = cfg(endpoint)
    written = tmp_path / "written" / "checkpoints"
    fake_checkpoint(written, 30, big=12 * MiB)
    CheckpointUploader("s3://ckpts/run/stage1", storage, written, client=client).start().close()
    root = tmp_path / "fresh" / "checkpoints"
    signal_file = tmp_path / "half-pulled"
    child = subprocess.Popen(
        [sys.executable, "-c", PULL_CHILD, endpoint, str(root), str(signal_file)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + 120
        while not signal_file.exists():
            assert child.poll() is None, "the pull exited before it downloaded the big file"
            assert time.monotonic() < deadline, "the big file was not downloaded within 120 s"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    assert [p.name for p in root.iterdir()] == [".step_00000030.partial"]  # what the kill left
    assert (root / ".step_00000030.partial" / "__0_0.distcp").exists()
    assert not has_complete_checkpoint(root)
    assert Checkpointer(root, keep_last=2).latest_verified() is None  # nothing to resume from

    lines: list[str] = []
    mirror = MirrorTarget(uri="s3://ckpts/run/stage1", storage=storage, pull=True)
    pulled = pull_for_resume(mirror, root, record=tmp_path / "mirror.jsonl", log=lines.append, client=client)
    assert pulled == root / "step_00000030"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000030"]  # the leftover was replaced
    assert Checkpointer(root, keep_last=2).latest_verified() == pulled
    assert (pulled / "__0_0.distcp").read_bytes() == (written / "step_00000030" / "__0_0.distcp").read_bytes()
    row = json.loads((tmp_path / "mirror.jsonl").read_text())
    assert row["event"] == "pulled" and row["checkpoint"] == "step_00000030" and row["pid"] == os.getpid()
    assert lines[-1].startswith(f"[mirror] pid {os.getpid()} pulled step_00000030 from s3://ckpts/run/stage1")
    # a complete local checkpoint is there now: the next launch pulls nothing
    assert pull_for_resume(mirror, root, log=lines.append, client=client) is None


def test_a_checkpoint_that_cannot_be_uploaded_fails_the_close_naming_it_and_stays_local(s3, tmp_path):  # noqa: F811
    """S3 refuses (no such bucket): training is not stopped by it, the checkpoint stays on local
    disk while it waits, and the stage's end fails naming it instead of ending as if it were safe."""
    from infra.storage import StorageError

    endpoint, _ = s3
    root = tmp_path / "checkpoints"
    lines: list[str] = []
    uploader = CheckpointUploader(
        "s3://no-such-bucket/run", cfg(endpoint, "s3://no-such-bucket/run", attempts=1), root, log=lines.append
    ).start()
    uploader.submit(fake_checkpoint(root, 10))
    with pytest.raises(StorageError, match=r"not mirrored to s3://no-such-bucket/run: step_00000010: .*NoSuchBucket"):
        uploader.close()
    assert uploader.pending() == {"step_00000010"}  # still protected from local pruning
    assert any("upload of step_00000010" in line and "failed" in line for line in lines)
