"""infra/storage.py against a real S3 API (moto's ThreadedMotoServer on 127.0.0.1, random port).

Covers: complete-last uploads (marker after manifest after data), multipart with verified SHA-256
checksums, a transfer that fails midway (the remote must not look complete; a retry completes it),
exponential backoff, local retention after verified upload, pulling the newest complete checkpoint
back, and that credentials never reach logs or returned metadata.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from infra.storage import (
    CHECKPOINT_MARKER,
    MANIFEST,
    STEP_MARKER,
    CheckpointMirror,
    S3Store,
    StorageConfig,
    StorageError,
    checkpoint_complete,
    describe,
    fetch_artifact,
    mirror_artifact,
    pull_latest_checkpoint,
    retry,
    split_s3_uri,
)

MiB = 1 << 20
SECRET = "SeCrEt-sentinel-7f3a9c-do-not-leak"
TOKEN = "ToKeN-sentinel-51e2b8-do-not-leak"
KEY_ID = "AKIASENTINEL0000TEST"


@pytest.fixture
def s3(monkeypatch):
    """(endpoint, client) of a fresh moto S3 server; sentinel credentials only in this test's env."""
    import boto3
    from moto.server import ThreadedMotoServer

    for var in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    moto_reset(endpoint)  # moto's state is process-global: start from an empty store
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="ckpts")
    try:
        yield endpoint, client
    finally:
        moto_reset(endpoint)
        server.stop()


def moto_reset(endpoint: str) -> None:
    """Empty every moto backend (they live in process-global state shared by all servers)."""
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=10)


def cfg(endpoint: str, uri: str = "s3://ckpts/run", **kw) -> StorageConfig:
    base = dict(
        s3_uri=uri,
        endpoint_url=endpoint,
        multipart_threshold_mb=5,
        multipart_chunk_mb=5,
        max_concurrency=2,
        attempts=3,
        backoff_seconds=0.0,
    )
    return StorageConfig(**(base | kw))


def fake_checkpoint(
    root: Path, step: int, *, big: int = 0, complete: bool = True, stage_end: bool = False, seed: int = 0
) -> Path:
    """A folder shaped like model/checkpoint.py's: data files, then the _CHECKPOINT.json marker."""
    folder = root / f"step_{step:08d}"
    folder.mkdir(parents=True)
    rnd = __import__("random").Random(step * 1000 + seed)
    (folder / "__0_0.distcp").write_bytes(rnd.randbytes(big or 4096))
    (folder / ".metadata").write_bytes(rnd.randbytes(300))
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    if complete:
        from infra import manifest

        files = manifest.entries(folder, manifest.payload_files(folder))
        (folder / CHECKPOINT_MARKER).write_text(json.dumps(manifest.marker_record(step, stage_end, files)))
    return folder


def keys(client, prefix: str = "") -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket="ckpts", Prefix=prefix)
    return sorted(o["Key"] for p in pages for o in p.get("Contents", []))


def record_writes(client) -> list[tuple[str, str]]:
    """(operation, key) of every write the client makes, in order."""
    calls: list[tuple[str, str]] = []

    def hook(params, model, **_):
        calls.append((model.name, params.get("Key", "")))

    for op in ("PutObject", "CreateMultipartUpload", "CompleteMultipartUpload", "DeleteObject"):
        client.meta.events.register(f"before-parameter-build.s3.{op}", hook)
    return calls


class FailParts:
    """Raises on UploadPart calls number `fail_from`.. (1-based) until `failures` were raised."""

    def __init__(self, fail_from: int, failures: int):
        self.fail_from, self.failures, self.parts, self.raised = fail_from, failures, 0, 0

    def __call__(self, **_):
        self.parts += 1
        if self.parts >= self.fail_from and self.raised < self.failures:
            self.raised += 1
            raise ConnectionError(f"injected network failure at part {self.parts}")


# --- plain helpers --------------------------------------------------------------------------------


def test_split_s3_uri_and_config_errors_name_the_input():
    assert split_s3_uri("s3://b/a/b/") == ("b", "a/b")
    assert split_s3_uri("s3://b") == ("b", "")
    with pytest.raises(ValueError, match="must start with s3://"):
        split_s3_uri("/local/path")
    with pytest.raises(ValueError, match="names no bucket"):
        split_s3_uri("s3:///x")
    with pytest.raises(ValueError, match="s3_uri"):
        StorageConfig(s3_uri="bucket/prefix")
    # credentials have no place in the config: they come from boto3's chain only
    with pytest.raises(ValueError, match="aws_secret_access_key"):
        StorageConfig(s3_uri="s3://b/p", aws_secret_access_key="x")


def test_retry_backs_off_exponentially_with_a_cap_then_names_what_failed():
    delays: list[float] = []
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        raise ConnectionError("boom")

    with pytest.raises(StorageError, match=r"upload x failed after 5 attempts: ConnectionError: boom"):
        retry(flaky, what="upload x", attempts=5, base=1.0, cap=4.0, sleep=delays.append)
    assert calls["n"] == 5 and len(delays) == 4
    for got, nominal in zip(delays, [1.0, 2.0, 4.0, 4.0], strict=True):
        assert nominal * 0.5 <= got <= nominal  # jittered, doubling, capped

    results = iter([ConnectionError("once"), "ok"])

    def second_time():
        item = next(results)
        if isinstance(item, Exception):
            raise item
        return item

    assert retry(second_time, what="x", attempts=3, base=0.0, cap=0.0, sleep=delays.append) == "ok"


# --- step folders -------------------------------------------------------------------------------


def test_mirror_artifact_uploads_marker_last_and_fetches_back_verified(s3, tmp_path):
    endpoint, client = s3
    folder = tmp_path / "curate" / "abcdef123456"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "00000.jsonl.gz").write_bytes(os.urandom(2000))
    (folder / "stats.json").write_text("{}")
    (folder / STEP_MARKER).write_text(json.dumps({"artifact": {"kind": "corpus"}}))
    store_client = S3Store("s3://ckpts/ws/curate", cfg(endpoint)).client
    writes = record_writes(store_client)
    meta = mirror_artifact(folder, "s3://ckpts/ws/curate", cfg(endpoint), client=store_client)
    assert meta["uri"] == "s3://ckpts/ws/curate/abcdef123456" and meta["files"] == 3
    put_keys = [k for op, k in writes if op in ("PutObject", "CreateMultipartUpload")]
    assert put_keys[-2:] == ["ws/curate/abcdef123456/" + MANIFEST, "ws/curate/abcdef123456/" + STEP_MARKER]
    assert keys(client, "ws/") == sorted(
        f"ws/curate/abcdef123456/{n}" for n in ("train/00000.jsonl.gz", "stats.json", STEP_MARKER, MANIFEST)
    )

    back = fetch_artifact("s3://ckpts/ws/curate/abcdef123456", tmp_path / "back", cfg(endpoint))
    assert (back / "train" / "00000.jsonl.gz").read_bytes() == (folder / "train" / "00000.jsonl.gz").read_bytes()
    assert (back / STEP_MARKER).is_file()

    (tmp_path / "unfinished").mkdir()
    with pytest.raises(FileNotFoundError, match="unfinished.*no _COMPLETE.json"):
        mirror_artifact(tmp_path / "unfinished", "s3://ckpts/ws", cfg(endpoint))


# --- checkpoints --------------------------------------------------------------------------------


def test_sync_uploads_only_complete_checkpoints_multipart_verified_and_prunes_after(s3, tmp_path):
    endpoint, client = s3
    root = tmp_path / "stage1" / "checkpoints"
    fake_checkpoint(root, 10, stage_end=False)
    fake_checkpoint(root, 20, big=12 * MiB)  # 3 parts of 5 MiB
    fake_checkpoint(root, 30)
    fake_checkpoint(root, 40, complete=False)  # being written by the trainer right now
    mirror = CheckpointMirror("s3://ckpts/run/stage1", keep_local=2, config=cfg(endpoint))
    report = mirror.sync(root)

    assert report.verified == ["step_00000010", "step_00000020", "step_00000030"]
    assert report.uploaded == report.verified
    assert report.skipped_incomplete == ["step_00000040"]
    assert report.deleted_local == ["step_00000010"]  # only after its upload was verified
    assert sorted(p.name for p in root.iterdir()) == ["step_00000020", "step_00000030", "step_00000040"]
    assert mirror.remote_steps() == ["step_00000010", "step_00000020", "step_00000030"]
    assert not any(k.startswith("run/stage1/step_00000040") for k in keys(client))

    head = client.head_object(Bucket="ckpts", Key="run/stage1/step_00000020/__0_0.distcp", ChecksumMode="ENABLED")
    assert head["ContentLength"] == 12 * MiB and head["ChecksumSHA256"]
    assert head["ETag"].strip('"').endswith("-3")  # really multipart
    manifest = json.loads(client.get_object(Bucket="ckpts", Key=f"run/stage1/step_00000020/{MANIFEST}")["Body"].read())
    assert manifest["files"]["__0_0.distcp"]["size"] == 12 * MiB

    # a second sync sends nothing and keeps the local newest two
    again = mirror.sync(root)
    assert again.uploaded == [] and again.deleted_local == []
    assert again.verified == ["step_00000020", "step_00000030"]


def test_stage_end_checkpoints_stay_local(s3, tmp_path):
    endpoint, _ = s3
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        fake_checkpoint(root, step, stage_end=(step == 1))
    CheckpointMirror("s3://ckpts/se", keep_local=1, config=cfg(endpoint)).sync(root)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000004"]


def test_upload_failing_midway_leaves_remote_incomplete_and_a_retry_completes_it(s3, tmp_path):
    endpoint, client = s3
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 100)
    fake_checkpoint(root, 200, big=16 * MiB)  # 4 parts
    fake_checkpoint(root, 300)

    # No retries: the transfer of step 200 dies after its first part went through.
    mirror = CheckpointMirror("s3://ckpts/fail", keep_local=1, config=cfg(endpoint, attempts=1))
    injected = FailParts(fail_from=2, failures=10**6)
    mirror.store.client.meta.events.register("before-call.s3.UploadPart", injected)
    with pytest.raises(StorageError, match=r"upload .*step_00000200/__0_0.distcp.*injected network failure"):
        mirror.sync(root)
    assert injected.raised >= 1
    assert mirror.remote_steps() == ["step_00000100"]
    assert f"fail/step_00000200/{CHECKPOINT_MARKER}" not in keys(client)
    assert f"fail/step_00000200/{MANIFEST}" not in keys(client)
    assert client.list_multipart_uploads(Bucket="ckpts").get("Uploads", []) == []  # aborted
    assert (root / "step_00000100").is_dir()  # nothing deleted locally when a sync fails
    # a reader (a fresh node) sees only the complete one
    pulled = pull_latest_checkpoint("s3://ckpts/fail", tmp_path / "node2", cfg(endpoint))
    assert pulled == tmp_path / "node2" / "step_00000100"

    # With retries and backoff, the same failure is absorbed and the upload completes.
    sleeps: list[float] = []
    mirror = CheckpointMirror(
        "s3://ckpts/fail", keep_local=1, config=cfg(endpoint, attempts=3, backoff_seconds=0.01), sleep=sleeps.append
    )
    mirror.store.client.meta.events.register("before-call.s3.UploadPart", FailParts(fail_from=3, failures=1))
    report = mirror.sync(root)
    assert len(sleeps) == 1
    assert report.verified == ["step_00000100", "step_00000200", "step_00000300"]
    assert mirror.remote_steps() == report.verified
    assert report.deleted_local == ["step_00000100", "step_00000200"]
    big = client.get_object(Bucket="ckpts", Key="fail/step_00000200/__0_0.distcp")["Body"].read()
    assert len(big) == 16 * MiB


def test_replacing_a_mirrored_checkpoint_removes_the_remote_marker_first(s3, tmp_path):
    endpoint, client = s3
    root = tmp_path / "checkpoints"
    folder = fake_checkpoint(root, 5)
    mirror = CheckpointMirror("s3://ckpts/re", keep_local=3, config=cfg(endpoint))
    mirror.sync(root)
    # the run was redone from an older checkpoint: same step, new content
    import shutil

    shutil.rmtree(folder)
    fake_checkpoint(root, 5, seed=1)
    (folder / "extra.pt").write_bytes(b"x" * 10)
    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != CHECKPOINT_MARKER}
    (folder / CHECKPOINT_MARKER).write_text(json.dumps({"step": 5, "stage_end": False, "files": files}))
    writes = record_writes(mirror.store.client)
    mirror.sync(root)
    assert writes[0] == ("DeleteObject", f"re/step_00000005/{CHECKPOINT_MARKER}")
    assert writes[-1] == ("PutObject", f"re/step_00000005/{CHECKPOINT_MARKER}")
    remote = client.get_object(Bucket="ckpts", Key="re/step_00000005/__0_0.distcp")["Body"].read()
    assert remote == (folder / "__0_0.distcp").read_bytes()


def test_same_sizes_but_new_content_is_uploaded_again(s3, tmp_path):
    """A step re-trained after resuming from an older checkpoint: same marker, different bytes."""
    endpoint, client = s3
    root = tmp_path / "checkpoints"
    folder = fake_checkpoint(root, 9)
    marker = (folder / CHECKPOINT_MARKER).read_bytes()
    CheckpointMirror("s3://ckpts/same", keep_local=2, config=cfg(endpoint)).sync(root)
    import shutil

    shutil.rmtree(folder)
    fake_checkpoint(root, 9, seed=7)
    # the marker now carries content digests, so it differs too; sizes alone would not
    assert (folder / CHECKPOINT_MARKER).read_bytes() != marker
    assert checkpoint_complete(folder)["files"]["__0_0.distcp"]["size"] == 4096
    # a new process (fresh digest cache) must still notice
    report = CheckpointMirror("s3://ckpts/same", keep_local=2, config=cfg(endpoint)).sync(root)
    assert report.uploaded == ["step_00000009"]
    remote = client.get_object(Bucket="ckpts", Key="same/step_00000009/__0_0.distcp")["Body"].read()
    assert remote == (folder / "__0_0.distcp").read_bytes()


def test_a_checkpoint_pruned_by_the_trainer_mid_sync_is_reported_not_fatal(s3, tmp_path, caplog):
    endpoint, _ = s3
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 1)
    fake_checkpoint(root, 2)
    mirror = CheckpointMirror("s3://ckpts/gone", keep_local=2, config=cfg(endpoint, backoff_seconds=5))
    import shutil

    def prune_step_1(**_):
        shutil.rmtree(root / "step_00000001", ignore_errors=True)  # the trainer's keep_last=1

    mirror.store.client.meta.events.register("before-call.s3.GetObject", prune_step_1)
    report = mirror.sync(root)
    assert report.vanished == ["step_00000001"]
    assert report.verified == ["step_00000002"]
    assert mirror.remote_steps() == ["step_00000002"]
    assert "raise the trainer's keep_last" in caplog.text


def test_syncing_mirrors_in_the_background_while_training_and_once_at_the_end(s3, tmp_path):
    import time as _time

    endpoint, _ = s3
    root = tmp_path / "checkpoints"
    mirror = CheckpointMirror("s3://ckpts/bg", keep_local=1, config=cfg(endpoint))
    seen_during: list[list[str]] = []
    lines: list[str] = []
    with mirror.syncing(root, every_s=0.2, log=lines.append) as final:
        for step in (1, 2, 3):  # the "trainer": a checkpoint every ~0.5 s
            fake_checkpoint(root, step)
            deadline = _time.monotonic() + 10
            while f"step_{step:08d}" not in mirror.remote_steps() and _time.monotonic() < deadline:
                _time.sleep(0.1)
            seen_during.append(mirror.remote_steps())
        fake_checkpoint(root, 4, complete=False)  # still being written when the stage ends
    assert seen_during[0] == ["step_00000001"]  # uploaded while the block was still running
    assert seen_during[-1] == ["step_00000001", "step_00000002", "step_00000003"]
    assert final.verified == ["step_00000003"] and final.skipped_incomplete == ["step_00000004"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000004"]
    assert any("uploaded step_00000001" in line for line in lines)

    # a failing stage: its exception wins, the final sync still runs
    fake_checkpoint(root, 5)
    with pytest.raises(RuntimeError, match="trainer died"):
        with mirror.syncing(root, every_s=60, log=lines.append):
            raise RuntimeError("trainer died")
    assert "step_00000005" in mirror.remote_steps()


def test_pull_latest_checkpoint_restores_the_newest_complete_one(s3, tmp_path, caplog):
    endpoint, client = s3
    assert pull_latest_checkpoint("s3://ckpts/none", tmp_path / "x", cfg(endpoint)) is None
    root = tmp_path / "run" / "checkpoints"
    fake_checkpoint(root, 7)
    fake_checkpoint(root, 8, big=6 * MiB)
    original = (root / "step_00000008" / "__0_0.distcp").read_bytes()
    CheckpointMirror("s3://ckpts/p", keep_local=2, config=cfg(endpoint)).sync(root)
    # a half-uploaded newer checkpoint (no marker) must be ignored by readers
    client.put_object(Bucket="ckpts", Key="p/step_00000009/__0_0.distcp", Body=b"partial")

    import shutil

    shutil.rmtree(tmp_path / "run")  # the node's scratch disk is gone
    local = tmp_path / "run" / "checkpoints"
    got = pull_latest_checkpoint("s3://ckpts/p", local, cfg(endpoint))
    assert got == local / "step_00000008"
    assert (got / "__0_0.distcp").read_bytes() == original
    assert checkpoint_complete(got) is not None
    assert not any(p.name.startswith(".") and p.name.endswith(".partial") for p in local.iterdir())
    # the trainer's own completeness rule accepts it
    from model.checkpoint import read_marker

    assert read_marker(got) is not None
    # already there: returned without another download
    assert pull_latest_checkpoint("s3://ckpts/p", local, cfg(endpoint)) == got

    # a remote object damaged after upload is caught by the manifest, never used: the next
    # older remote checkpoint is pulled instead, with a warning naming the damaged one
    client.put_object(Bucket="ckpts", Key="p/step_00000008/.metadata", Body=b"corrupted")
    with caplog.at_level(logging.WARNING, logger="infra.storage"):
        got = pull_latest_checkpoint("s3://ckpts/p", tmp_path / "other", cfg(endpoint, attempts=2))
    assert got == tmp_path / "other" / "step_00000007"
    assert "step_00000008 is damaged" in caplog.text and "does not match its manifest" in caplog.text
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["step_00000007"]  # no half folder

    # damage that also rewrote the uploader's _SHA256SUMS.json consistently: the trainer's own
    # digests in _CHECKPOINT.json still catch it
    bad = b"x" * 300
    client.put_object(Bucket="ckpts", Key="p/step_00000007/.metadata", Body=bad)
    sums = json.loads(client.get_object(Bucket="ckpts", Key=f"p/step_00000007/{MANIFEST}")["Body"].read())
    sums["files"][".metadata"] = {"size": 300, "sha256": __import__("hashlib").sha256(bad).hexdigest()}
    client.put_object(Bucket="ckpts", Key=f"p/step_00000007/{MANIFEST}", Body=json.dumps(sums))
    with pytest.raises(
        StorageError,
        match=r"no checkpoint under s3://ckpts/p verifies.*"
        r"step_00000007: \.metadata: content differs",
    ):
        pull_latest_checkpoint("s3://ckpts/p", tmp_path / "fourth", cfg(endpoint, attempts=1))
    assert list((tmp_path / "fourth").iterdir()) == []

    # a manifest is remote input: paths escaping the destination are refused
    client.put_object(
        Bucket="ckpts",
        Key=f"p/step_00000008/{MANIFEST}",
        Body=json.dumps({"files": {"../../escape": {"size": 1, "sha256": "0"}}}),
    )
    with pytest.raises(StorageError, match="unsafe path '../../escape'"):
        pull_latest_checkpoint("s3://ckpts/p", tmp_path / "third", cfg(endpoint, attempts=1))


def test_credentials_never_reach_logs_or_returned_metadata(s3, tmp_path, caplog, capsys):
    endpoint, _ = s3
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="infra")
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 1)
    fake_checkpoint(root, 2, big=6 * MiB)
    step = tmp_path / "ws" / "tokenize" / "0123456789ab"
    step.mkdir(parents=True)
    (step / "a.ds").write_bytes(b"\0" * 64)
    (step / STEP_MARKER).write_text("{}")
    config = cfg(endpoint, uri="s3://ckpts/sec")
    # the client is built by the module itself, from the default chain (our env sentinels)
    mirror = CheckpointMirror("s3://ckpts/sec", keep_local=1, config=config)
    creds = mirror.store.client._request_signer._credentials.get_frozen_credentials()
    assert creds.secret_key == SECRET  # the chain really supplied the sentinels
    outputs = [
        mirror.sync(root).as_meta(),
        mirror_artifact(step, "s3://ckpts/sec/tokenize", config),
        str(pull_latest_checkpoint("s3://ckpts/sec", tmp_path / "pulled", config)),
        describe(config),
        config.model_dump(),
    ]
    captured = capsys.readouterr()
    text = json.dumps(outputs) + caplog.text + captured.out + captured.err
    assert "mirrored" in caplog.text  # the logs were captured at all
    for secret in (SECRET, TOKEN, KEY_ID):
        assert secret not in text
    for path in (tmp_path / "pulled").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert SECRET.encode() not in data and TOKEN.encode() not in data


def test_a_checkpoint_corrupted_on_disk_is_never_uploaded_nor_pruned(s3, tmp_path, caplog):
    """Bytes flipped after the trainer wrote its digests (same size): the mirror must not make the
    damaged copy the remote one, nor delete it as if it were safely mirrored."""
    endpoint, client = s3
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        fake_checkpoint(root, step)
    shard = root / "step_00000001" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="infra.storage"):
        report = CheckpointMirror("s3://ckpts/c", keep_local=2, config=cfg(endpoint)).sync(root)
    assert report.skipped_corrupt == ["step_00000001"]
    assert "does not match the sha256 in its _CHECKPOINT.json" in caplog.text
    assert not any(k.startswith("c/step_00000001/") for k in keys(client, "c/"))
    assert (root / "step_00000001").exists()  # not "verified on S3", so not deleted locally
    assert report.verified == ["step_00000002", "step_00000003", "step_00000004"]


def test_a_pull_that_fails_on_the_network_is_transient_not_a_damaged_checkpoint(s3, tmp_path, caplog):
    """The newest checkpoint's download loses its connection on every try: the pull raises that
    failure (transient: the step's retry pulls again) instead of calling the checkpoint damaged
    and falling back to an older one, and leaves no half folder."""
    from infra.transient import transient

    endpoint, _ = s3
    root = tmp_path / "run" / "checkpoints"
    fake_checkpoint(root, 7)
    fake_checkpoint(root, 8)
    mirror = CheckpointMirror("s3://ckpts/p", keep_local=2, config=cfg(endpoint))
    mirror.sync(root)

    def lost(params, model, **_):
        if "step_00000008" in params.get("Key", ""):
            raise ConnectionError("injected: connection reset by peer")

    pulled = CheckpointMirror("s3://ckpts/p", config=cfg(endpoint, attempts=2))
    pulled.store.client.meta.events.register("before-parameter-build.s3.GetObject", lost)
    local = tmp_path / "node" / "checkpoints"
    with caplog.at_level(logging.WARNING, logger="infra.storage"), pytest.raises(StorageError) as err:
        pull_latest_checkpoint("s3://ckpts/p", local, cfg(endpoint, attempts=2), client=pulled.store.client)
    assert transient(err.value), err.value
    assert "injected: connection reset by peer" in str(err.value)
    assert "is damaged" not in caplog.text  # not taken for damage: no older checkpoint was pulled
    assert not local.exists() or list(local.iterdir()) == []


def test_wait_for_pull_waits_while_bytes_arrive_and_stops_at_a_stall(tmp_path):
    """`wait_for_pull` outlasts its stall bound while the pull's partial folder grows, calling
    `on_progress` as it does, and raises naming the folder once nothing arrives for the bound."""
    import threading
    import time

    from infra.storage import pull_progress, wait_for_pull

    partial = tmp_path / "checkpoints" / ".step_00000003.partial"
    partial.mkdir(parents=True)
    (tmp_path / "checkpoints" / "unrelated.txt").write_text("not a checkpoint")
    assert pull_progress(tmp_path / "checkpoints") == (0, 0)
    seen: list[float] = []

    def pull() -> None:
        for i in range(25):
            (partial / f"shard{i}").write_bytes(b"y" * 100)
            time.sleep(0.1)
        (tmp_path / ".pulled").write_text("1")

    writer = threading.Thread(target=pull)
    started = time.monotonic()
    writer.start()
    wait_for_pull(
        tmp_path / ".pulled", tmp_path / "checkpoints", stall_s=1.0, poll_s=0.05, on_progress=lambda: seen.append(1)
    )
    writer.join()
    assert time.monotonic() - started >= 2.4 and len(seen) >= 7  # a walk every 0.25 s (a quarter of the bound)
    assert pull_progress(tmp_path / "checkpoints") == (25, 2500)

    with pytest.raises(TimeoutError, match=r"moved no byte in 0.5 s \(it has 25 files"):
        wait_for_pull(tmp_path / "never", tmp_path / "checkpoints", stall_s=0.5, poll_s=0.05)
