"""Lineage in DuckDB: graph queries, and concurrent writers that lose nothing."""

from __future__ import annotations

import multiprocessing as mp
from datetime import datetime

from infra.artifact import Artifact
from infra.lineage import Lineage, StepRow


def _art(name: str, kind: str = "corpus") -> Artifact:
    return Artifact(kind=kind, uri=f"/ws/{name}", fingerprint=(name * 64)[:64], meta={"n": 1})


def test_ancestors_descendants_and_idempotence(tmp_path):
    lin = Lineage(tmp_path / "lineage.duckdb")
    raw_a, raw_b = _art("a"), _art("b")
    tok = _art("c", "tokenizer")
    shards = _art("d", "shards")
    for art in (raw_a, raw_b):
        lin.record_artifact(art, "source", art.fingerprint[0], {"cfg": 1})
    lin.record_artifact(tok, "tokenizer", "", {}, [raw_a, raw_b])
    lin.record_artifact(shards, "tokenize", "a", {}, [raw_a, tok])
    lin.record_artifact(shards, "tokenize", "a", {}, [raw_a, tok])  # recorded twice: no-op
    assert {r["fingerprint"][0] for r in lin.ancestors(shards.fingerprint)} == {"a", "b", "c"}
    assert {r["fingerprint"][0] for r in lin.parents(shards.fingerprint)} == {"a", "c"}
    assert {r["fingerprint"][0] for r in lin.descendants(raw_b.fingerprint)} == {"c", "d"}
    assert lin.query("SELECT count(*) FROM artifacts")[0][0] == 4
    assert lin.query("SELECT count(*) FROM edges")[0][0] == 4
    assert lin.artifact("dddd")["kind"] == "shards"


def test_runs_and_steps(tmp_path):
    lin = Lineage(tmp_path / "lineage.duckdb")
    lin.start_run("r1", "smollm3", "full", "tiny", {"name": "tiny"})
    now = datetime.now()
    lin.record_step(StepRow("r1", "source", "prose", "f" * 64, "cached", {}, "v", now, now))
    lin.end_run("r1", "completed")
    (run,) = lin.runs()
    assert run["state"] == "completed" and run["deployment"] == "full"
    assert [s["state"] for s in lin.steps_of("r1")] == ["cached"]


def test_reading_an_absent_database_is_empty(tmp_path):
    assert Lineage(tmp_path / "none.duckdb").runs() == []


def _writer(path: str, worker: int, n: int) -> None:
    lin = Lineage(path)
    for i in range(n):
        lin.record_rows("metrics", [(f"w{worker}", i, "loss", float(i))])


def test_four_processes_times_200_writes_lose_nothing(tmp_path):
    path = str(tmp_path / "lineage.duckdb")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, w, 200)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    lin = Lineage(path)
    assert lin.query("SELECT count(*) FROM metrics")[0][0] == 800
    per_worker = dict(lin.query("SELECT fingerprint, count(DISTINCT step) FROM metrics GROUP BY 1"))
    assert per_worker == {f"w{w}": 200 for w in range(4)}
