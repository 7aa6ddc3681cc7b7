"""A mirror that cannot vouch for itself (issue 35, item 2), against moto's S3 server.

Each attack is planted from outside the code under test, with a plain boto3 client, as someone
holding the bucket credentials would: shown live on a control, then refused.

- A swapped object whose entry in `_SHA256SUMS.json` was rewritten to match: fetched as "verified"
  without a key (the control: the manifest lives in the same bucket), refused naming the object
  with `$SMOLLM3_MIRROR_KEY` set; so are an unsigned manifest, one signed with another key, an
  added file and a replaced marker.
- A corrupt object whose metadata still names the original sha256: the old check trusted that
  metadata and skipped it; re-mirroring now compares what the store computed, and uploads again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from infra.storage import (
    MANIFEST,
    MIRROR_KEY_ENV,
    STEP_MARKER,
    CheckpointMirror,
    ForgedManifest,
    S3Store,
    StorageError,
    fetch_artifact,
    mirror_artifact,
    pull_latest_checkpoint,
)
from tests.infra.test_storage import cfg, fake_checkpoint, s3  # noqa: F401  (s3: moto fixture)

KEY = "k3y-for-tests-only-0123456789abcdef"
PAYLOAD = b"task: x\ndoc_to_text: \"{% set _ = cycler.__init__.__globals__.os.system('touch /tmp/pwn') %}\"\n"


def step_folder(root: Path, finished: str = "2026-12-03T20:00:00") -> Path:
    """A finished step folder shaped like the runner's: data, a task YAML, the marker last."""
    folder = root / "eval_suite" / "0123456789ab"
    (folder / "tasks").mkdir(parents=True, exist_ok=True)
    (folder / "data.jsonl").write_text('{"context": "a", "answer": "b"}\n')
    (folder / "tasks" / "hellaswag.yaml").write_text("task: hellaswag\ndoc_to_text: '{{context}}'\n")
    marker = {"step": "eval_suite", "version": 1, "finished": finished, "artifact": {"fingerprint": "0" * 64}}
    (folder / STEP_MARKER).write_text(json.dumps(marker))
    return folder


def get(client, key: str) -> bytes:
    return client.get_object(Bucket="ckpts", Key=key)["Body"].read()


def forge(client, prefix: str, rel: str, body: bytes) -> None:
    """The attack: swap one object and rewrite its manifest entry to match (any hmac kept as is)."""
    client.put_object(Bucket="ckpts", Key=f"{prefix}/{rel}", Body=body)
    sums = json.loads(get(client, f"{prefix}/{MANIFEST}"))
    sums["files"][rel] = sums["files"][rel] | {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    client.put_object(Bucket="ckpts", Key=f"{prefix}/{MANIFEST}", Body=json.dumps(sums).encode())


def test_a_forged_manifest_is_taken_without_a_key_and_refused_naming_the_object_with_one(
    s3,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    endpoint, client = s3
    config = cfg(endpoint, uri="s3://ckpts/m", attempts=1)
    monkeypatch.setenv(MIRROR_KEY_ENV, KEY)
    folder = step_folder(tmp_path / "ws")
    mirror_artifact(folder, "s3://ckpts/m/eval_suite", config)
    prefix = "m/eval_suite/0123456789ab"
    sums = json.loads(get(client, f"{prefix}/{MANIFEST}"))
    assert isinstance(sums["hmac"], str) and all("hmac" in e for e in sums["files"].values())

    # signed and untouched: fetched, and the report says it was checked against the key
    store = S3Store("s3://ckpts/m/eval_suite", config)
    report = store.download_folder("0123456789ab", tmp_path / "good", STEP_MARKER)
    assert (
        report.signed
        and (tmp_path / "good" / "tasks" / "hellaswag.yaml").read_bytes()
        == (folder / "tasks" / "hellaswag.yaml").read_bytes()
    )

    forge(client, prefix, "tasks/hellaswag.yaml", PAYLOAD)
    # control: without a key, the forged folder is "verified" and the payload lands on disk
    monkeypatch.delenv(MIRROR_KEY_ENV)
    fetch_artifact(f"s3://ckpts/{prefix}", tmp_path / "control", config)
    assert (tmp_path / "control" / "tasks" / "hellaswag.yaml").read_bytes() == PAYLOAD

    # with the key: refused before any file is fetched, naming the swapped object
    monkeypatch.setenv(MIRROR_KEY_ENV, KEY)
    with pytest.raises(ForgedManifest, match=rf"s3://ckpts/{prefix}/tasks/hellaswag\.yaml: its entry in"):
        fetch_artifact(f"s3://ckpts/{prefix}", tmp_path / "fresh", config)
    assert not (tmp_path / "fresh").exists() and not list(tmp_path.glob(".fresh*"))

    # signed with another key (a writer who made up their own): refused the same way
    monkeypatch.setenv(MIRROR_KEY_ENV, "another-key-of-the-attacker-000000")
    mirror_artifact(step_folder(tmp_path / "other"), "s3://ckpts/m/eval_suite", config)
    monkeypatch.setenv(MIRROR_KEY_ENV, KEY)
    with pytest.raises(ForgedManifest, match=rf"s3://ckpts/{prefix}/data\.jsonl: its entry"):
        fetch_artifact(f"s3://ckpts/{prefix}", tmp_path / "fresh", config)

    # a manifest with no signature at all (written by a keyless uploader, or stripped): refused
    monkeypatch.delenv(MIRROR_KEY_ENV)
    mirror_artifact(step_folder(tmp_path / "keyless", finished="later"), "s3://ckpts/m/eval_suite", config)
    monkeypatch.setenv(MIRROR_KEY_ENV, KEY)
    with pytest.raises(ForgedManifest, match=rf"s3://ckpts/{prefix}/{MANIFEST} is not signed"):
        fetch_artifact(f"s3://ckpts/{prefix}", tmp_path / "fresh", config)

    # re-mirrored with the key, then a file added with a copied entry signature, then the marker
    # replaced: the whole-folder signature refuses both, naming the manifest and the marker
    mirror_artifact(folder, "s3://ckpts/m/eval_suite", config)
    assert json.loads(get(client, f"{prefix}/{MANIFEST}"))["hmac"]  # the keyless manifest was replaced
    fetch_artifact(f"s3://ckpts/{prefix}", tmp_path / "again", config)
    good = get(client, f"{prefix}/{MANIFEST}")
    sums = json.loads(good)
    client.put_object(Bucket="ckpts", Key=f"{prefix}/tasks/evil.yaml", Body=PAYLOAD)
    sums["files"]["tasks/evil.yaml"] = sums["files"]["tasks/hellaswag.yaml"]
    client.put_object(Bucket="ckpts", Key=f"{prefix}/{MANIFEST}", Body=json.dumps(sums).encode())
    with pytest.raises(ForgedManifest, match=r"tasks/evil\.yaml: its entry"):
        fetch_artifact(f"s3://ckpts/{prefix}", tmp_path / "fresh", config)
    client.put_object(Bucket="ckpts", Key=f"{prefix}/{MANIFEST}", Body=good)
    client.put_object(Bucket="ckpts", Key=f"{prefix}/{STEP_MARKER}", Body=b'{"step": "eval_suite", "forged": 1}')
    with pytest.raises(ForgedManifest, match=rf"does not match its signature.*{prefix}/{STEP_MARKER} replaced"):
        fetch_artifact(f"s3://ckpts/{prefix}", tmp_path / "fresh", config)
    assert not (tmp_path / "fresh").exists()


def test_a_forged_checkpoint_is_skipped_for_an_older_signed_one(s3, tmp_path, monkeypatch):  # noqa: F811
    endpoint, client = s3
    config = cfg(endpoint, attempts=1)
    monkeypatch.setenv(MIRROR_KEY_ENV, KEY)
    root = tmp_path / "run" / "checkpoints"
    fake_checkpoint(root, 7)
    fake_checkpoint(root, 8)
    CheckpointMirror("s3://ckpts/p", keep_local=2, config=config).sync(root)
    # the trainer's marker is in the bucket too: rewrite it and the manifest around a new file
    bad = b"y" * 300
    forge(client, "p/step_00000008", "__0_0.distcp", bad)
    record = json.loads(get(client, "p/step_00000008/_CHECKPOINT.json"))
    record["files"]["__0_0.distcp"] = {"size": 300, "sha256": hashlib.sha256(bad).hexdigest()}
    client.put_object(Bucket="ckpts", Key="p/step_00000008/_CHECKPOINT.json", Body=json.dumps(record).encode())
    got = pull_latest_checkpoint("s3://ckpts/p", tmp_path / "fresh", config)
    assert got == tmp_path / "fresh" / "step_00000007"  # the forged newer one never landed


def test_a_short_key_is_refused_by_length_never_shown(s3, monkeypatch):  # noqa: F811
    endpoint, _ = s3
    monkeypatch.setenv(MIRROR_KEY_ENV, "short-secret")
    with pytest.raises(ValueError, match=rf"\${MIRROR_KEY_ENV} holds 12 characters.*at least 16") as err:
        S3Store("s3://ckpts/m", cfg(endpoint))
    assert "short-secret" not in str(err.value)


def test_a_corrupt_object_whose_metadata_claims_the_right_digest_is_uploaded_again(s3, tmp_path):  # noqa: F811
    endpoint, client = s3
    config = cfg(endpoint, uri="s3://ckpts/m", attempts=1)
    folder = step_folder(tmp_path / "ws")
    mirror_artifact(folder, "s3://ckpts/m/eval_suite", config)
    key = "m/eval_suite/0123456789ab/data.jsonl"
    original = (folder / "data.jsonl").read_bytes()
    head = client.head_object(Bucket="ckpts", Key=key, ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"]  # what the store computed on our upload

    def corrupt() -> None:
        """Same size, other bytes, and the metadata the uploader would have written."""
        client.put_object(
            Bucket="ckpts",
            Key=key,
            Body=b"X" * len(original),
            Metadata={"sha256": hashlib.sha256(original).hexdigest()},
        )
        head = client.head_object(Bucket="ckpts", Key=key, ChecksumMode="ENABLED")
        # control: everything the old check compared says "this is our file"
        assert head["ContentLength"] == len(original) and "ChecksumSHA256" not in head
        assert head["Metadata"]["sha256"] == hashlib.sha256(original).hexdigest()
        assert get(client, key) != original

    # the same folder mirrored again (the marker unchanged): the objects are checked, not only the
    # manifest, and the corrupt one is sent again
    corrupt()
    report = mirror_artifact(folder, "s3://ckpts/m/eval_suite", config)
    assert get(client, key) == original and report["sent"] == 1
    # a rebuilt step (a new marker): the corrupt object is sent again, the others are not
    corrupt()
    rebuilt = step_folder(tmp_path / "rebuilt", finished="2026-12-03T21:00:00")
    report = mirror_artifact(rebuilt, "s3://ckpts/m/eval_suite", config)
    assert get(client, key) == original and report["sent"] == 1
    # and once repaired, nothing is sent again
    assert mirror_artifact(rebuilt, "s3://ckpts/m/eval_suite", config)["sent"] == 0
    fetch_artifact("s3://ckpts/m/eval_suite/0123456789ab", tmp_path / "fresh", config)
    assert (tmp_path / "fresh" / "data.jsonl").read_bytes() == original


def test_a_manifest_that_is_not_an_object_of_entries_is_refused_by_name(s3, tmp_path):  # noqa: F811
    endpoint, client = s3
    config = cfg(endpoint, uri="s3://ckpts/m", attempts=1)
    mirror_artifact(step_folder(tmp_path / "ws"), "s3://ckpts/m/eval_suite", config)
    where = "m/eval_suite/0123456789ab/_SHA256SUMS.json"
    for body, why in [
        (b"[1, 2]", "holds no `files` object"),
        (b'{"files": {"a": {"size": "1", "sha256": "0"}}}', "entry 'a' has no integer size"),
        (b"{", "is not JSON"),
    ]:
        client.put_object(Bucket="ckpts", Key=where, Body=body)
        with pytest.raises(StorageError, match=rf"s3://ckpts/{where} {why}"):
            fetch_artifact("s3://ckpts/m/eval_suite/0123456789ab", tmp_path / "fresh", config)
