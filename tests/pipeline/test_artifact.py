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


def test_an_added_identity_field_moves_no_fingerprint_until_it_is_set():
    """A feature added after fingerprints were published (training's skip-step rule): configs
    that leave it at its default keep their identity; setting it is a new identity."""
    from pydantic import BaseModel, ConfigDict

    from pipeline.artifact import added_identity, identity

    class Before(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")
        lr: float = 1.0

    class After(Before):
        rule: dict | None = added_identity(None)

    assert identity(After()) == identity(Before()) == {"lr": 1.0}
    assert fingerprint("s", 1, After()) == fingerprint("s", 1, Before())
    assert identity(After(rule={"sigma": 6})) == {"lr": 1.0, "rule": {"sigma": 6}}
    assert fingerprint("s", 1, After(rule={"sigma": 6})) != fingerprint("s", 1, Before())


def test_a_marker_planted_from_another_folder_is_not_reused(tmp_path):
    """Another process copies a finished step's marker into the folder of a step that has not
    run (or writes one naming another folder or fingerprint). Control: the planted marker reads
    as a finished step there (`read_marker`), the path the attack takes. `run_step` reuses only
    a marker whose uri and fingerprint are the folder's own, and builds the step instead."""
    first = _run(tmp_path, lambda out: {"n": 1}).artifact
    fp = fingerprint("demo", 1, {"a": 2}, (), "")
    target = tmp_path / "demo" / fp[:12]
    marker = json.loads((first.path / MARKER).read_text())
    forged_fp = {**marker, "artifact": {**marker["artifact"], "uri": "{workspace}/demo/" + fp[:12]}}
    built: list[str] = []
    for planted in (marker, forged_fp):  # another folder's uri; then this uri but another fingerprint
        target.mkdir(parents=True, exist_ok=True)
        (target / MARKER).write_text(json.dumps(planted))
        assert read_marker(target) is not None  # the control: it looks finished
        built.clear()
        outcome = _run(tmp_path, lambda out: built.append("built") or {"n": 2}, config={"a": 2})
        assert built == ["built"] and outcome.built
        assert outcome.artifact.fingerprint == fp and outcome.artifact.path == target
        assert outcome.artifact.meta == {"n": 2}
        assert json.loads((target / MARKER).read_text())["artifact"]["fingerprint"] == fp
        (target / MARKER).unlink()
    # its own marker is reused as before
    assert _run(tmp_path, lambda out: {"n": 3}, config={"a": 2}).built
    assert not _run(tmp_path, lambda out: {"n": 4}, config={"a": 2}).built
