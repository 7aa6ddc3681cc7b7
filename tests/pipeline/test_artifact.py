"""The step contract: fingerprints, markers written last, rebuild after a crash, resumable steps."""

from __future__ import annotations

import json

import pytest

from pipeline.artifact import MARKER, Artifact, find_marker, fingerprint, read_marker, run_step


def _run(tmp_path, build, config=None, inputs=(), **kw):
    return run_step(
        root=tmp_path,
        step="demo",
        version=1,
        kind="corpus",
        config=config if config is not None else {"a": 1},
        inputs=inputs,
        build=build,
        **kw,
    )


def test_fingerprint_is_stable_and_sensitive():
    base = fingerprint("s", 1, {"a": 1, "b": [1, 2]})
    assert base == fingerprint("s", 1, {"b": [1, 2], "a": 1})  # key order is irrelevant
    assert base != fingerprint("s", 2, {"a": 1, "b": [1, 2]})
    assert base != fingerprint("s", 1, {"a": 2, "b": [1, 2]})
    assert base != fingerprint("t", 1, {"a": 1, "b": [1, 2]})
    assert base != fingerprint("s", 1, {"a": 1, "b": [1, 2]}, extra="files changed")
    parent = Artifact(kind="corpus", uri="/x", fingerprint="f" * 64)
    assert base != fingerprint("s", 1, {"a": 1, "b": [1, 2]}, inputs=[parent])


def test_marker_is_written_last_and_reused(tmp_path):
    calls = []

    def build(out):
        # While building, the folder must not look finished.
        assert read_marker(out) is None
        (out / "data.txt").write_text("hello")
        calls.append(out)
        return {"documents": 1}

    first = _run(tmp_path, build)
    assert first.built and calls == [first.artifact.path]
    marker = json.loads((first.artifact.path / MARKER).read_text())
    assert marker["artifact"]["fingerprint"] == first.artifact.fingerprint
    assert first.artifact.path == tmp_path / "demo" / first.artifact.fingerprint[:12]
    second = _run(tmp_path, build)
    assert not second.built and len(calls) == 1
    assert second.artifact == first.artifact
    assert marker["artifact"]["uri"] == f"{{workspace}}/demo/{first.artifact.short}"  # relative to the root
    assert find_marker(first.artifact.path / "data.txt")["artifact"] == first.artifact.model_dump(mode="json")


def test_crash_mid_step_is_never_taken_for_finished(tmp_path):
    def crash(out):
        (out / "half.txt").write_text("partial")
        raise RuntimeError("killed mid-step")

    with pytest.raises(RuntimeError):
        _run(tmp_path, crash)
    folders = list((tmp_path / "demo").iterdir())
    folder = next(f for f in folders if not f.name.startswith("."))
    assert read_marker(folder) is None  # the half-written folder is not finished

    def good(out):
        assert not (out / "half.txt").exists()  # a non-resumable step starts clean
        return {"ok": True}

    outcome = _run(tmp_path, good)
    assert outcome.built and outcome.artifact.meta == {"ok": True}


def test_resumable_step_keeps_partial_work(tmp_path):
    def crash(out):
        (out / "ckpt").write_text("step 5")
        raise RuntimeError("preempted")

    with pytest.raises(RuntimeError):
        _run(tmp_path, crash, resumable=True)

    def resume(out):
        return {"resumed_from": (out / "ckpt").read_text()}

    assert _run(tmp_path, resume, resumable=True).artifact.meta == {"resumed_from": "step 5"}


def test_refresh_rebuilds_a_finished_step(tmp_path):
    n = []

    def build(out):
        n.append(1)
        return {"n": len(n)}

    _run(tmp_path, build)
    again = _run(tmp_path, build, refresh=True)
    assert again.built and again.artifact.meta == {"n": 2}


def test_missing_input_is_named(tmp_path):
    ghost = Artifact(kind="corpus", uri=str(tmp_path / "gone"), fingerprint="ab" * 32)
    with pytest.raises(FileNotFoundError, match="corpus abababababab"):
        _run(tmp_path, lambda out: {}, inputs=[ghost])
