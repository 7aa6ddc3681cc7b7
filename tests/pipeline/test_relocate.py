"""A workspace is relocatable and its S3 mirror is a cache.

- Copied to another place and the original deleted, a workspace reuses every finished step
  (`plan` and the run), and a downstream step that is new reads its inputs from the copy: markers
  and lineage hold paths relative to the workspace root (`{workspace}/...`), a stage's spec.json
  and a mixture plan relative to themselves.
- On a fresh machine pointed at the same bucket (moto's S3 server), finished steps are fetched
  and verified against the mirror's manifest instead of recomputed; a mirrored file that no
  longer matches, or another step's marker, is a miss and the step builds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from prefect import flow
from pydantic import BaseModel, ConfigDict

from flows.recipe import load_recipe, run_setup
from pipeline.artifact import Artifact, read_marker
from pipeline.dryrun import plan_graph
from pipeline.graph import Graph
from pipeline.lineage import Lineage
from pipeline.runner import run_flow
from pipeline.step import step
from pipeline.workspace import Workspace
from tests.infra.test_storage import s3  # noqa: F401  (fixture: a moto S3 server)


class Make(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str
    counter: str  # a file outside every workspace counting builds


class Use(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    suffix: str
    counter: str


def _bump(counter: str) -> None:
    path = Path(counter)
    path.write_text(str(int(path.read_text()) + 1 if path.exists() else 1))


@step("make", version=1, kind="corpus", isolate=True)
def make(config: Make, *, out: Path, log=print) -> dict:
    _bump(config.counter)
    (out / "data.txt").write_text(config.text)
    return {"file": str(out / "data.txt"), "nested": {"files": [str(out / "data.txt")]}}


@step("use", version=1, kind="report")
def use(config: Use, made: Artifact, *, out: Path, log=print) -> dict:
    _bump(config.counter)
    text = Path(made.meta["file"]).read_text()  # the path its input's meta names
    (out / "copy.txt").write_text(text + config.suffix)
    return {"from": made.meta["nested"]["files"][0], "file": str(out / "copy.txt")}


def _graph(tmp_path: Path, suffixes: tuple[str, ...]) -> Graph:
    g = Graph("relocate-test")
    made = g.add(make, Make(text="hello", counter=str(tmp_path / "makes")), label="a")
    for s in suffixes:
        g.add(use, Use(suffix=s, counter=str(tmp_path / "uses")), label=s, made=made)
    return g


def _run(tmp_path: Path, ws: Path, suffixes: tuple[str, ...], overrides: tuple[str, ...] = ()) -> dict:
    recipe = load_recipe("tiny", [f"workspace={ws}", *overrides])

    @flow(name="relocate-test")
    def run() -> dict:
        return run_flow("relocate-test", _graph(tmp_path, suffixes), run_setup(recipe, "tiny"))

    return run()


def _count(tmp_path: Path, name: str) -> int:
    path = tmp_path / name
    return int(path.read_text()) if path.exists() else 0


def test_a_copied_workspace_reuses_every_step_and_reads_nothing_from_the_old_place(tmp_path, prefect_harness):
    old, new = tmp_path / "old" / "ws", tmp_path / "bigger-disk" / "ws"
    _run(tmp_path, old, ("1",))
    assert (_count(tmp_path, "makes"), _count(tmp_path, "uses")) == (1, 1)
    shutil.copytree(old, new)
    shutil.rmtree(tmp_path / "old")

    for marker in new.glob("*/*/_COMPLETE.json"):  # nothing names the old place...
        assert str(old) not in marker.read_text() and "{workspace}/" in marker.read_text(), marker
    with Lineage(new / "lineage.duckdb").snapshot() as con:  # the stored values, as written
        rows = con.execute("SELECT uri, meta FROM artifacts").fetchall()
    assert rows and all(uri.startswith("{workspace}/") and str(old) not in meta for uri, meta in rows), rows

    plan = plan_graph(_graph(tmp_path, ("1",)), Workspace.at(new), frozenset())
    assert [r.action for r in plan] == ["reuse", "reuse"]  # `plan` reuses all
    summary = _run(tmp_path, new, ("1", "2"))  # ...and a downstream step that is new runs
    assert (_count(tmp_path, "makes"), _count(tmp_path, "uses")) == (1, 2)
    assert summary["states"] == {"cached": 2, "completed": 1}  # reused as `cached`, the new one built
    outputs = dict(Lineage(new / "lineage.duckdb").labelled_outputs(summary["run_id"], "use"))
    second = outputs["2"]
    assert second.meta["from"] == str(new / "make" / second.meta["from"].split("/")[-2] / "data.txt")
    assert Path(second.meta["file"]).read_text() == "hello2"
    made = Lineage(new / "lineage.duckdb").artifact(
        read_marker(Path(second.meta["from"]).parent)["artifact"]["fingerprint"]
    )
    assert made["uri"].startswith(str(new))  # lineage reads the copy's paths


@pytest.mark.slow
def test_a_fresh_machine_fetches_finished_steps_from_the_mirror_and_verifies_them(tmp_path, prefect_harness, s3):  # noqa: F811
    endpoint, client = s3
    storage = ["storage.s3_uri=s3://ckpts/mirror", f"storage.endpoint_url={endpoint}", "storage.attempts=1"]
    first = tmp_path / "first" / "ws"
    _run(tmp_path, first, ("1",), tuple(storage))
    assert (_count(tmp_path, "makes"), _count(tmp_path, "uses")) == (1, 1)
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="ckpts", Prefix="mirror/")["Contents"])
    assert any(k.startswith("mirror/make/") and k.endswith("_COMPLETE.json") for k in keys)
    shutil.rmtree(tmp_path / "first")  # the machine is gone; the bucket is not

    fresh = tmp_path / "fresh" / "ws"
    summary = _run(tmp_path, fresh, ("1",), tuple(storage))
    assert (_count(tmp_path, "makes"), _count(tmp_path, "uses")) == (1, 1)  # fetched, not recomputed
    assert summary["states"] == {"completed": 2}
    (made_folder,) = [p for p in (fresh / "make").iterdir() if p.is_dir()]
    assert (made_folder / "data.txt").read_text() == "hello" and read_marker(made_folder) is not None
    assert read_marker(made_folder)["artifact"]["uri"] == str(made_folder)

    # A mirrored file changed behind the manifest's back: refused, and the step builds instead.
    data_key = next(k for k in keys if k.startswith("mirror/make/") and k.endswith("data.txt"))
    client.put_object(Bucket="ckpts", Key=data_key, Body=b"forged")
    third = tmp_path / "third" / "ws"
    _run(tmp_path, third, ("1",), tuple(storage))
    assert _count(tmp_path, "makes") == 2  # rebuilt: the forged copy never landed
    (rebuilt,) = [p for p in (third / "make").iterdir() if p.is_dir()]
    assert (rebuilt / "data.txt").read_text() == "hello"


def test_a_mirrored_marker_of_another_step_is_not_taken(tmp_path, prefect_harness, s3):  # noqa: F811
    endpoint, client = s3
    storage = ["storage.s3_uri=s3://ckpts/mirror", f"storage.endpoint_url={endpoint}", "storage.attempts=1"]
    first = tmp_path / "first" / "ws"
    _run(tmp_path, first, ("1",), tuple(storage))
    (made_folder,) = [p for p in (first / "make").iterdir() if p.is_dir()]
    marker_key = f"mirror/make/{made_folder.name}/_COMPLETE.json"
    record = json.loads(client.get_object(Bucket="ckpts", Key=marker_key)["Body"].read())
    record["artifact"]["fingerprint"] = "f" * 64  # a marker copied from elsewhere
    body = json.dumps(record).encode()
    client.put_object(Bucket="ckpts", Key=marker_key, Body=body)
    sums_key = f"mirror/make/{made_folder.name}/_SHA256SUMS.json"
    client.put_object(Bucket="ckpts", Key=sums_key, Body=client.get_object(Bucket="ckpts", Key=sums_key)["Body"].read())
    shutil.rmtree(tmp_path / "first")
    _run(tmp_path, tmp_path / "fresh" / "ws", ("1",), tuple(storage))
    assert _count(tmp_path, "makes") == 2


def test_a_stage_spec_names_workspace_paths_relative_to_itself(tmp_path):
    from model.spec import TrainSpec

    root = tmp_path / "ws"
    stage = root / "pretrain" / "abcdef123456"
    stage.mkdir(parents=True)
    outside = tmp_path / "base" / "checkpoints" / "step_00000010"
    spec = TrainSpec(steps=4, global_batch=4, micro_batch=4).bind(
        root / "mixture" / "0123456789ab" / "plan.json", stage, str(outside)
    )
    spec.save(stage / "spec.json", relative_to=root)
    raw = json.loads((stage / "spec.json").read_text())
    assert raw["mixture_plan"] == "../../mixture/0123456789ab/plan.json" and raw["out_dir"] == "."
    assert raw["init_from"] == str(outside)  # outside the workspace: as given
    moved = tmp_path / "moved"
    shutil.move(root, moved)
    loaded = TrainSpec.load(moved / "pretrain" / "abcdef123456" / "spec.json")
    assert loaded.mixture_plan == str(moved / "mixture" / "0123456789ab" / "plan.json")
    assert loaded.out_dir == str(moved / "pretrain" / "abcdef123456") and loaded.init_from == str(outside)


def test_a_marker_written_before_relative_paths_is_read_where_its_folder_is(tmp_path):
    """Old markers hold absolute paths: their own uri names the root they were written under."""
    old = tmp_path / "old"
    folder = old / "make" / "abcdef123456"
    folder.mkdir(parents=True)
    artifact = {"kind": "corpus", "uri": str(folder), "fingerprint": "a" * 64, "meta": {"file": str(folder / "x")}}
    (folder / "_COMPLETE.json").write_text(json.dumps({"artifact": artifact, "step": "make", "version": 1}))
    shutil.move(old, tmp_path / "new")
    record = read_marker(tmp_path / "new" / "make" / "abcdef123456")
    assert record["artifact"]["uri"] == str(tmp_path / "new" / "make" / "abcdef123456")
    assert record["artifact"]["meta"]["file"] == str(tmp_path / "new" / "make" / "abcdef123456" / "x")


@pytest.mark.parametrize("value", ["/elsewhere/x", "s3://b/k", "plain text", "{workspace}"])
def test_stored_and_resolved_touch_only_paths_under_the_root(value):
    from pipeline.artifact import resolved, stored

    root = "/data/ws"
    assert resolved(stored(value, root), root) == (root if value == "{workspace}" else value)
    assert stored("/data/ws/make/x", root) == "{workspace}/make/x" and stored("/data/wsx", root) == "/data/wsx"
