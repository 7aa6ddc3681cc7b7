"""Lineage in DuckDB: graph queries, concurrent writers that lose nothing, outside readers that
cannot make a write fail, the journal's exactly-once ingestion, and one row per run attempt."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import time
from datetime import datetime

import duckdb
import pytest

from pipeline.artifact import Artifact
from pipeline.lineage import JournalRejected, Lineage, LineageError, StepRow


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


@pytest.mark.slow
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


# --- outside readers, the journal, attempts ------------------------------------------------------

HOLDER = (
    "import duckdb, sys, time\n"
    "con = duckdb.connect(sys.argv[1], read_only=True)  # a notebook, the duckdb CLI\n"
    "print(con.execute('SELECT count(*) FROM metrics').fetchone()[0], flush=True)\n"
    "sys.stdin.readline()  # held until the test says so\n"
    "print(con.execute('SELECT count(*) FROM metrics').fetchone()[0], flush=True)\n"
)


def _hold(path) -> subprocess.Popen:
    """Another process holding the database with a plain read-only DuckDB connection."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip().isdigit()
    return proc


def _release(proc: subprocess.Popen) -> int:
    """Let the holder go; returns the row count it saw last."""
    out, _ = proc.communicate("\n", timeout=30)
    return int(out.strip())


def _writer_reading_back(path: str, worker: int, n: int) -> None:
    lin = Lineage(path)
    for i in range(n):
        lin.record_rows("metrics", [(f"w{worker}", i, "loss", float(i))])
    # read-your-writes while the file is held: served from a copy with the journal applied
    got = lin.query("SELECT count(*) FROM metrics WHERE fingerprint = ?", [f"w{worker}"])[0][0]
    assert got == n, f"worker {worker} reads {got} of its {n} rows back"


def test_an_outside_read_only_connection_makes_no_write_fail_or_get_lost(tmp_path):
    path = tmp_path / "lineage.duckdb"
    Lineage(path).record_rows("metrics", [("seed", 0, "loss", 0.0)])
    holder = _hold(path)
    try:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_writer_reading_back, args=(str(path), w, 50)) for w in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0, 0, 0]  # no write failed, all read back
        assert holder.poll() is None  # ...and all of it while the file was held
        with pytest.raises(duckdb.IOException, match="lock"):
            duckdb.connect(str(path))  # really held: nobody could write the file itself
    finally:
        seen_by_outsider = _release(holder)
    assert seen_by_outsider == 1  # outside readers see the last ingested state
    lin = Lineage(path)
    assert lin.query("SELECT count(*) FROM metrics")[0][0] == 201
    per_worker = dict(lin.query("SELECT fingerprint, count(DISTINCT step) FROM metrics GROUP BY 1"))
    assert per_worker == {"seed": 1} | {f"w{w}": 50 for w in range(4)}
    assert lin.query("SELECT count(*) FROM _journal_rejected")[0][0] == 0


def test_pending_events_land_by_themselves_once_the_file_is_free(tmp_path):
    path = tmp_path / "lineage.duckdb"
    lin = Lineage(path)
    lin.start_run("r1", "smollm3", "full", "tiny", {})
    holder = _hold(path)
    try:
        lin.end_run("r1", "completed")
        assert lin.runs()[0]["state"] == "completed"  # read your writes: from a snapshot
    finally:
        _release(holder)
    deadline = time.monotonic() + 20  # no further lineage call: the retry thread ingests
    state = None
    while time.monotonic() < deadline and state != "completed":
        time.sleep(0.2)
        try:  # a raw look at the file itself, not through Lineage (which would ingest)
            con = duckdb.connect(str(path), read_only=True)
        except duckdb.ConnectionException:
            continue  # the retry thread has it open read-write right now
        try:
            state = con.execute("SELECT state FROM flow_runs").fetchone()[0]
        finally:
            con.close()
    assert state == "completed"


def test_an_event_is_applied_once_even_if_ingestion_is_repeated(tmp_path):
    lin = Lineage(tmp_path / "lineage.duckdb")
    lin.record_rows("metrics", [("a", 1, "loss", 1.0)])
    (lin.journal_dir / "applied.json").unlink()  # as if an ingester died before its hint
    with open(next(lin.journal_dir.glob("*.jsonl")), "ab") as fh:
        fh.write(b'{"id": "cut", "t": 1, "ops": [["INSERT')  # a line cut by a crash
    assert lin.query("SELECT count(*) FROM metrics")[0][0] == 1  # re-ingested: nothing doubled
    assert lin.query("SELECT count(*) FROM _journal_rejected")[0][0] == 0  # the cut line waits


def test_a_write_the_database_refuses_raises_and_is_kept(tmp_path):
    lin = Lineage(tmp_path / "lineage.duckdb")
    with pytest.raises(JournalRejected, match="'no_such_table': not a lineage table"):
        with lin.writer() as ops:  # refused before it is journaled, naming the table
            ops.insert("no_such_table", ["a"], [[1]])
    with pytest.raises(LineageError, match="Conversion Error"):
        lin.record_rows("metrics", [("a", "not a step", "loss", 1.0)])  # refused by the database
    (row,) = lin.query_dicts("SELECT * FROM _journal_rejected")
    assert "Conversion" in row["error"] and "not a step" in row["event"]
    lin.record_rows("metrics", [("a", 1, "loss", 1.0)])  # later writes are not blocked by it
    assert lin.query("SELECT count(*) FROM metrics")[0][0] == 1


def test_writer_blocks_are_one_transaction_and_write_only(tmp_path):
    lin = Lineage(tmp_path / "lineage.duckdb")
    when = [datetime(2026, 1, 2, 3, 4, 5), datetime(2026, 1, 2, 3, 4, 6)]
    with lin.writer() as ops:
        ops.insert("evals", ["fingerprint", "task", "value", "created"], [["f", "a", 1.0, when[0]]])
        ops.insert("evals", ["fingerprint", "task", "value", "created"], [["f", "b", 2.0, when[1]]])
        assert not hasattr(ops, "execute") and not hasattr(ops, "fetchall")  # typed operations only
    assert lin.query("SELECT task, created FROM evals ORDER BY task") == [("a", when[0]), ("b", when[1])]
    with pytest.raises(RuntimeError, match="abandoned"):
        with lin.writer() as ops:
            ops.insert("evals", ["fingerprint", "task"], [["f", "c"]])
            raise RuntimeError("abandoned")
    assert lin.query("SELECT count(*) FROM evals")[0][0] == 2  # the failed block wrote nothing


def test_snapshot_reads_a_consistent_copy_without_blocking_writers(tmp_path):
    lin = Lineage(tmp_path / "lineage.duckdb")
    lin.record_rows("metrics", [("a", 1, "loss", 1.0)])
    with lin.snapshot() as con:
        lin.record_rows("metrics", [("a", 2, "loss", 2.0)])  # lands while the snapshot is open
        assert con.sql("SELECT count(*) FROM metrics").fetchall() == [(1,)]
    assert lin.snapshot_query("SELECT count(*) AS n FROM metrics") == [{"n": 2}]


def test_every_attempt_of_a_run_is_kept_and_cancelled_is_its_own_state(tmp_path):
    lin = Lineage(tmp_path / "lineage.duckdb")
    lin.start_run("r1", "smollm3", "full", "tiny", {})
    lin.end_run("r1", "crashed")
    first_start = lin.runs()[0]["started"]
    lin.start_run("r1", "smollm3", "full", "tiny", {})  # `prefect flow-run retry`
    lin.end_run("r1", "failed")
    lin.start_run("r1", "smollm3", "full", "tiny", {}, attempt=5)  # Prefect's run_count
    lin.end_run("r1", "cancelled")
    (run,) = lin.runs()
    assert run["state"] == "cancelled" and run["started"] == first_start
    attempts = lin.attempts_of("r1")
    assert [(a["attempt"], a["state"]) for a in attempts] == [(1, "crashed"), (2, "failed"), (5, "cancelled")]
    assert all(a["ended"] >= a["started"] for a in attempts)
    with pytest.raises(ValueError, match="not one of"):
        lin.end_run("r1", "Cancelled")


def test_reading_block_shares_one_connection_and_sees_every_write(tmp_path):
    lin = Lineage(tmp_path / "lineage.duckdb")
    with lin.reading():  # nothing recorded yet: reads are empty, as outside a block
        assert lin.runs() == []
    lin.record_artifact(_art("a"), "source", "a", {})
    with lin.reading():
        con = lin._session[1]
        assert lin.artifact("aaaa")["step"] == "source" and lin.parents("a" * 64) == []
        assert lin._session[1] is con  # the same connection for every read of the block
        # a write from inside the block is journaled at once and lands once the block ends
        lin.record_artifact(_art("b"), "source", "b", {})
    assert lin._session is None
    assert lin.artifact("bbbb")["step"] == "source"


def test_reading_block_reads_pending_events_while_an_outside_reader_holds_the_file(tmp_path):
    lin = Lineage(tmp_path / "lineage.duckdb")
    lin.record_artifact(_art("a"), "source", "a", {})
    outside = duckdb.connect(str(lin.path), read_only=True)  # a notebook: ingestion must wait
    try:
        lin.record_artifact(_art("b"), "source", "b", {})  # pending in the journal
        with lin.reading():
            assert {r["fingerprint"][0] for r in lin.query_dicts("SELECT * FROM artifacts")} == {"a", "b"}
    finally:
        outside.close()


def test_step_rows_carry_their_attempt_and_a_dead_attempt_is_marked_crashed(tmp_path):
    lin = Lineage(tmp_path / "lineage.duckdb")
    now = datetime.now()
    lin.start_run("r1", "smollm3", "full", "tiny", {}, attempt=1)
    lin.record_step(StepRow("r1", "source", "prose", "f" * 64, "completed", {}, "v", now, now, None, 1))
    # attempt 1's process was SIGKILLed: no end_run; `prefect flow-run retry` starts attempt 2
    lin.start_run("r1", "smollm3", "full", "tiny", {}, attempt=2)
    lin.record_step(StepRow("r1", "source", "prose", "f" * 64, "cached", {}, "v", now, now, None, 2))
    lin.end_run("r1", "completed", attempt=2)
    assert [(s["attempt"], s["state"]) for s in lin.steps_of("r1")] == [(1, "completed"), (2, "cached")]
    assert [s["state"] for s in lin.steps_of("r1", attempt=2)] == ["cached"]
    assert [(a["attempt"], a["state"], a["ended"]) for a in lin.attempts_of("r1")][0] == (1, "crashed", None)
    assert lin.attempts_of("r1")[1]["state"] == "completed"


def _experiment_rows(exp: str, kind: str, created: datetime, delta: float):
    experiment = {
        "experiment": exp,
        "run_id": "r1",
        "kind": kind,
        "name": exp[:4],
        "baseline": "baseline",
        "variants": '{"baseline": [], "v": ["x=1"]}',
        "seeds": '{"baseline": 2, "v": 2}',
        "confidence": 0.95,
        "trusted": '["heldout_prose"]',
        "quality": "{}",
        "base_checkpoint": None,
        "base_global_step": None,
        "created": created,
    }
    runs = [
        {
            "experiment": exp,
            "label": f"{v}-s{k}",
            "variant": v,
            "seed": k,
            "task": "heldout_prose",
            "metric": "bpb",
            "step": s,
            "value": 3.0 - s / 100,
            "stderr": 0.01,
            "eval_fingerprint": "e",
        }
        for v in ("baseline", "v")
        for k in (0, 1)
        for s in (10, 20)
    ]
    results = [
        {
            "experiment": exp,
            "variant": "v",
            "task": "heldout_prose",
            "metric": "bpb",
            "better": "lower",
            "baseline": 2.8,
            "score": 2.8 + delta,
            "delta": delta,
            "seed_std": 0.01,
            "df": 2,
            "ci_low": delta - 0.03,
            "ci_high": delta + 0.03,
            "p_value": 0.01,
            "significant": True,
            "improved": delta < 0,
            "stderr": 0.01,
            "trusted": True,
            "why": "",
            "verdict": "better",
            "baseline_runs": 2,
            "variant_runs": 2,
            "created": created,
        }
    ]
    return experiment, runs, results


def test_experiments_are_recorded_once_and_read_back_by_id_prefix(tmp_path):
    lineage = Lineage(tmp_path / "lineage.duckdb")
    assert lineage.experiments() == [] and lineage.find_experiment("ab") is None
    lineage.record_experiment(*_experiment_rows("abc1" + "0" * 60, "ablation", datetime(2026, 1, 1), -0.1))
    lineage.record_experiment(*_experiment_rows("abd2" + "0" * 60, "anneal", datetime(2026, 1, 2), 0.05))
    # A rebuilt comparison replaces its rows instead of adding a second copy.
    lineage.record_experiment(*_experiment_rows("abc1" + "0" * 60, "ablation", datetime(2026, 1, 3), -0.2))
    assert [e["kind"] for e in lineage.experiments()] == ["ablation", "anneal"]  # newest first
    assert [e["experiment"][:4] for e in lineage.experiments("anneal")] == ["abd2"]
    found = lineage.find_experiment("abc")
    assert found["name"] == "abc1" and found["seeds"] == '{"baseline": 2, "v": 2}'
    with pytest.raises(ValueError, match="ambiguous"):
        lineage.find_experiment("ab")
    runs = lineage.experiment_runs(found["experiment"])
    assert len(runs) == 8 and {(r["variant"], r["seed"]) for r in runs} == {
        ("baseline", 0),
        ("baseline", 1),
        ("v", 0),
        ("v", 1),
    }
    (result,) = lineage.experiment_results(found["experiment"])
    assert result["delta"] == pytest.approx(-0.2) and result["significant"] is True
    bad = _experiment_rows("abe3" + "0" * 60, "ablation", datetime(2026, 1, 4), 0.0)
    del bad[2][0]["verdict"]
    with pytest.raises(ValueError, match=r"experiment_results row columns differ from the table's: \['verdict'\]"):
        lineage.record_experiment(*bad)
    assert lineage.find_experiment("abe") is None  # nothing of the refused experiment landed
