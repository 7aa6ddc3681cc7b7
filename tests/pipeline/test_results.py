"""Prefect results are data: a result record planted in `workspace/results/` that names another
serializer (pickle), points Prefect's JSON decoder at an importing key, or describes another
folder is refused as a cache miss with a warning naming the file, and never deserialized; the
step reuses its finished folder and the record is rewritten as ours."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from prefect import flow
from pydantic import BaseModel, ConfigDict

from flows.recipe import load_recipe, run_setup
from pipeline.graph import Graph
from pipeline.lineage import Lineage
from pipeline.results import RefusedResult, check_record, json_serializer
from pipeline.runner import run_flow
from pipeline.step import step

# Run by a separate process (the attacker): a record in Prefect's own format whose serializer is
# pickle and whose payload runs `touch CANARY` when unpickled.
PICKLE_RECORD = """
import os, sys
from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
from prefect.serializers import PickleSerializer
canary, path = sys.argv[1:]
class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + canary,))
record = ResultRecord(metadata=ResultRecordMetadata(serializer=PickleSerializer(), storage_key=path), result=Evil())
open(path, "wb").write(record.serialize())
"""


class Counted(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    counter: str  # a file outside the step folder counting builds


@step("counted", version=1, kind="report")
def counted(config: Counted, *, out: Path, log=print) -> dict:
    counter = Path(config.counter)
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    return {"builds": n}


def _run(ws: Path, config: Counted) -> list[dict]:
    recipe = load_recipe("tiny", [f"workspace={ws}"])

    @flow(name="results-test")
    def run() -> dict:
        g = Graph("results-test")
        g.add(counted, config, label="x")
        return run_flow("results-test", g, run_setup(recipe, "tiny"))

    run()
    lineage = Lineage(ws / "lineage.duckdb")
    return lineage.steps_of(lineage.runs(1)[0]["run_id"])


def test_a_planted_pickle_result_never_runs_and_is_a_cache_miss(tmp_path, prefect_harness, caplog):
    ws, canary = tmp_path / "ws", tmp_path / "pwned"
    config = Counted(counter=str(tmp_path / "n"))
    assert [r["state"] for r in _run(ws, config)] == ["completed"]
    assert [r["state"] for r in _run(ws, config)] == ["cached"]  # the record as our task wrote it
    (record,) = (ws / "results").iterdir()
    subprocess.run([sys.executable, "-c", PICKLE_RECORD, str(canary), str(record)], check=True)
    assert json.loads(record.read_bytes())["metadata"]["serializer"]["type"] == "pickle"

    with caplog.at_level(logging.WARNING, logger="pipeline.results"):
        rows = _run(ws, config)
    assert not canary.exists()
    assert [r["state"] for r in rows] == ["cached"]  # not served from the planted record...
    assert (tmp_path / "n").read_text() == "1"  # ...but the body reused the finished folder
    assert f"refusing the persisted result {record}: it names serializer 'pickle'" in caplog.text
    assert json.loads(record.read_bytes())["metadata"]["serializer"] == json_serializer()  # rewritten
    assert [r["state"] for r in _run(ws, config)] == ["cached"]
    assert not canary.exists()


def _record(ws: Path, key: str, artifact: dict, serializer: dict | None = None, result: str | None = None) -> bytes:
    return json.dumps(
        {
            "metadata": {
                "storage_key": str(ws / "results" / key),
                "expiration": None,
                "serializer": serializer or json_serializer(),
                "prefect_version": "3",
                "storage_block_id": None,
            },
            "result": result if result is not None else json.dumps(artifact),
        }
    ).encode()


FP = "ab" * 32
KEY = f"counted-{FP[:20]}-1-abcdef12"


@pytest.mark.parametrize(
    "change, why",
    [
        ({}, None),
        ({"serializer": {**json_serializer(), "object_decoder": "os.system"}}, "serializer 'json' with other settings"),
        ({"serializer": {**json_serializer(), "jsonlib": "antigravity"}}, "serializer 'json' with other settings"),
        ({"serializer": {"type": "pickle", "picklelib": "cloudpickle"}}, "serializer 'pickle'"),
        ({"result": json.dumps({"__class__": "subprocess.Popen", "data": ["touch", "x"]})}, "'__class__' key"),
        ({"meta": {"x": {"__exc_type__": "builtins.SystemExit", "message": "1"}}}, "'__exc_type__' key"),
        ({"uri": "/elsewhere/counted/ababababab"}, "points at /elsewhere"),
        ({"fingerprint": "cd" * 32}, "fingerprint is not the one its key names"),
        ({"result": "not json"}, "not an Artifact"),
    ],
)
def test_check_record_accepts_only_our_json_artifacts(tmp_path, change, why):
    ws = tmp_path / "ws"
    artifact = {"kind": "report", "uri": str(ws / "counted" / FP[:12]), "fingerprint": FP, "meta": {"builds": 1}}
    artifact.update({k: v for k, v in change.items() if k in artifact})
    data = _record(ws, KEY, artifact, change.get("serializer"), change.get("result"))
    if why is None:
        check_record(data, KEY, ws)
        return
    with pytest.raises(RefusedResult, match=why):
        check_record(data, KEY, ws)


def test_a_legacy_blob_and_extra_fields_are_refused(tmp_path):
    """Prefect also reads the old `{"serializer", "data"}` blob and extra metadata fields."""
    ws = tmp_path / "ws"
    legacy = json.dumps({"serializer": {"type": "pickle"}, "data": "gASV"}).encode()
    with pytest.raises(RefusedResult, match="not a result record"):
        check_record(legacy, KEY, ws)
    artifact = {"kind": "report", "uri": str(ws / "counted" / FP[:12]), "fingerprint": FP, "meta": {}}
    record = json.loads(_record(ws, KEY, artifact))
    record["metadata"]["storage_block_id"] = "6f1b0c2e-0000-0000-0000-000000000000"
    with pytest.raises(RefusedResult, match="storage block"):
        check_record(json.dumps(record).encode(), KEY, ws)
    with pytest.raises(RefusedResult, match="more than a step result holds"):
        check_record(b" " * (5 << 20), KEY, ws)


def test_a_finished_folder_the_cache_does_not_know_is_shown_cached_not_as_work(tmp_path, prefect_harness):
    """Without Prefect's record (a moved workspace, `results/` deleted) the body finds the folder
    finished: the task run ends `Cached` (what the UI and `smollm3 watch` show) with a message
    saying so, and lineage records `cached`, not `completed` as if the step had been built."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    ws = tmp_path / "ws"
    config = Counted(counter=str(tmp_path / "n"))
    assert [r["state"] for r in _run(ws, config)] == ["completed"]
    for record in (ws / "results").iterdir():
        record.unlink()
    assert [r["state"] for r in _run(ws, config)] == ["cached"]
    assert (tmp_path / "n").read_text() == "1"  # built once
    lineage = Lineage(ws / "lineage.duckdb")
    run_id = lineage.runs(1)[0]["run_id"]
    with get_client(sync_client=True) as client:
        (task_run,) = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    assert (task_run.state.type.value, task_run.state.name) == ("COMPLETED", "Cached")
    assert task_run.state.message == "reused its finished folder"
    assert [r["state"] for r in _run(ws, config)] == ["cached"]  # the record was written: a cache hit now
