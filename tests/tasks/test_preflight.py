"""The preflight step: report files, the stop rule as an error, lineage rows, the Prefect table
artifact, and a fingerprint that changes per run and per host."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the repo is not installed into the venv
    sys.path.insert(0, str(REPO))

import tasks.preflight as tp  # noqa: E402
from infra.preflight import PreflightConfig, PreflightFacts  # noqa: E402
from infra.preflight.core import PreflightFailed  # noqa: E402
from model.calibration import host_calibration  # noqa: E402
from pipeline.artifact import Artifact, run_step  # noqa: E402
from pipeline.workspace import Workspace  # noqa: E402

FAST = ("batch_layout", "seq_len", "vocab", "dcp_roundtrip", "cpu_matmul")
GOOD = PreflightFacts(
    nproc_per_node=2, global_batch=8, micro_batch=2, seq_len=64, max_positions=128, tokenizer_vocab=100, model_vocab=128
)


def config(**kw) -> PreflightConfig:
    return PreflightConfig(checks=FAST, cpu_matmul_size=64, cpu_matmul_seconds=0.05, **kw)


def spec(cfg: PreflightConfig, facts: PreflightFacts, run_id: str = "run-1") -> tp.PreflightSpec:
    return tp.PreflightSpec(preflight=cfg, facts=facts.to_dict(), run_id=run_id)


def build(ws: Workspace, cfg: PreflightConfig, facts: PreflightFacts, run_id="run-1"):
    """The step's build through the step contract (folder by fingerprint, marker last)."""
    d = tp.preflight
    s = spec(cfg, facts, run_id)
    return run_step(
        root=ws.path,
        step=d.name,
        version=d.version,
        kind=d.kind,
        config=s,
        inputs={},
        build=lambda out: d.run(s, {}, out, log=lambda _: None),
        extra=d.facts(s),
    )


def test_passing_preflight_writes_its_report(tmp_path):
    ws = Workspace.at(tmp_path / "ws")
    facts = dataclasses.replace(GOOD, workspace=ws.root)
    outcome = build(ws, config(), facts)
    art = outcome.artifact
    assert art.kind == "preflight" and art.meta["summary"]["fail"] == 0
    assert art.meta["cpu_gflops"] > 0 and art.meta["gpu_tflops"] is None
    report = json.loads((art.path / "preflight.json").read_text())
    assert report["run_id"] == "run-1" and not report["stop"]
    assert [r["name"] for r in report["results"]] == ["batch_layout", "seq_len", "cpu_matmul", "dcp_roundtrip", "vocab"]
    assert "| vocab | pass |" in (art.path / "preflight.md").read_text()


def test_preflight_stores_this_hosts_calibration_and_stages_find_the_newest(tmp_path):
    """cpu_matmul's figure becomes the host's MFU calibration (fp32, at the preflight's threads);
    `host_calibration` finds it for this host and device only, in finished preflights only."""
    import os
    import socket
    import time

    import torch

    ws = Workspace.at(tmp_path / "ws")
    facts = dataclasses.replace(GOOD, workspace=ws.root)
    art = build(ws, config(), facts).artifact
    [cal] = art.meta["calibration"]
    assert cal["host"] == socket.gethostname() and (cal["device"], cal["dtype"]) == ("cpu", "float32")
    assert cal["flops"] == pytest.approx(art.meta["cpu_gflops"] * 1e9) and cal["threads"] == torch.get_num_threads()
    assert cal["source"].startswith(f"preflight {art.path.name} on {cal['host']}: cpu_matmul fp32 64^2, best burst")
    assert json.loads((art.path / "preflight.json").read_text())["calibration"] == [cal]

    found = host_calibration(ws.path, "cpu")
    assert found is not None and found.model_dump() == cal
    assert host_calibration(ws.path, "cuda") is None  # no GPU measured here
    assert host_calibration(ws.path, "cpu", host="another-node") is None
    # A newer preflight (another recipe, same host) wins; an unfinished one does not count.
    newer = build(ws, PreflightConfig(checks=FAST, cpu_matmul_size=32, cpu_matmul_seconds=0.05), facts).artifact
    future = time.time() + 10
    os.utime(newer.path / "preflight.json", (future, future))
    assert host_calibration(ws.path, "cpu").source.startswith(f"preflight {newer.path.name}")
    (newer.path / "_COMPLETE.json").unlink()
    assert host_calibration(ws.path, "cpu").source.startswith(f"preflight {art.path.name}")


def test_failing_preflight_raises_listing_the_checks_and_records_lineage(tmp_path):
    ws = Workspace.at(tmp_path / "ws")
    bad = PreflightFacts(
        nproc_per_node=2,
        global_batch=7,
        micro_batch=2,
        seq_len=256,
        max_positions=128,
        tokenizer_vocab=100,
        model_vocab=128,
        workspace=str(tmp_path / "ws"),
    )
    with pytest.raises(PreflightFailed) as err:
        build(ws, config(), bad, run_id="run-bad")
    msg = str(err.value)
    assert "2 blocking check(s)" in msg and "batch_layout: FAIL" in msg and "seq_len: FAIL" in msg
    assert "vocab" not in msg.split("\n", 1)[1]
    rows = ws.lineage().query("SELECT check_name, status FROM preflight WHERE run_id = 'run-bad' ORDER BY check_name")
    assert ("batch_layout", "fail") in rows and ("vocab", "pass") in rows
    folder = next(p for p in (ws.path / "preflight").iterdir() if p.is_dir())
    assert (folder / "preflight.json").exists() and not (folder / "_COMPLETE.json").exists()


def test_publish_records_rows_and_a_prefect_table(tmp_path, monkeypatch):
    ws = Workspace.at(tmp_path / "ws")
    art: Artifact = build(ws, config(), dataclasses.replace(GOOD, workspace=ws.root), run_id="run-pub").artifact
    tables = []
    monkeypatch.setattr("prefect.artifacts.create_table_artifact", lambda **kw: tables.append(kw))
    tp.publish_preflight(art, ws, "Main Node")
    rows = ws.lineage().query("SELECT run_id, check_name, status FROM preflight ORDER BY check_name")
    assert len(rows) == 5 and rows[0] == ("run-pub", "batch_layout", "pass")
    assert tables[0]["key"] == "preflight-main-node"
    assert {r["check"] for r in tables[0]["table"]} == set(FAST)


def test_fingerprint_is_per_host_and_recipe_facts_not_per_run(monkeypatch):
    """A measurement of this host for this recipe: reused by the next run (the run id is
    operational), redone on another host or for other identity facts."""
    d = tp.preflight

    def fp(s: tp.PreflightSpec) -> str:
        return d.fingerprint(s, {}, d.facts(s))

    base = fp(spec(config(), GOOD, "run-a"))
    assert fp(spec(config(), GOOD, "run-b")) == base
    # ranks per node, micro-batch and the workspace path are how a run runs: operational facts
    run_facts = tp.PreflightSpec(preflight=config(), facts=GOOD.to_dict(), run_facts={"micro_batch": 4})
    assert fp(run_facts) == base
    assert fp(spec(config(), dataclasses.replace(GOOD, seq_len=128))) != base
    monkeypatch.setattr(tp.socket, "gethostname", lambda: "other-node")
    assert fp(spec(config(), GOOD, "run-a")) != base


@pytest.mark.slow
def test_step_in_a_prefect_flow_publishes_and_stops(tmp_path, prefect_harness):
    """Through the flow runner (a one-step graph, built in a child process): a passing preflight
    publishes its table and lineage rows; a failing one fails the flow naming the step and check."""
    from prefect import flow
    from prefect.artifacts import Artifact as PrefectArtifact

    from flows.recipe import load_recipe, run_setup
    from pipeline.graph import Graph
    from pipeline.runner import FlowFailed, run_flow

    ws = Workspace.at(tmp_path / "ws")
    recipe = load_recipe("tiny", [f"workspace={ws.root}"])

    @flow
    def pf(facts: dict, run_id: str):
        g = Graph("preflight-test")
        g.add(tp.preflight, spec(config(), PreflightFacts.from_dict(facts), run_id), label="node0")
        return run_flow("preflight-test", g, run_setup(recipe, "tiny"))

    good = dataclasses.replace(GOOD, workspace=ws.root)  # dcp_roundtrip writes under it
    result = pf(good.to_dict(), "flow-ok")
    assert result["final"]["kind"] == "preflight" and result["final"]["meta"]["summary"]["pass"] == 5
    assert PrefectArtifact.get("preflight-node0") is not None
    assert len(ws.lineage().query("SELECT * FROM preflight WHERE run_id = 'flow-ok'")) == 5
    bad = dataclasses.replace(good, max_positions=32)
    with pytest.raises(FlowFailed, match=r"(?s)preflight\[node0\] failed: PreflightFailed: .*seq_len: FAIL"):
        pf(bad.to_dict(), "flow-bad")
    assert ws.lineage().query("SELECT status FROM preflight WHERE run_id = 'flow-bad' AND check_name = 'seq_len'") == [
        ("fail",)
    ]


def test_spec_for_a_recipe_splits_identity_from_operational_facts(tmp_path):
    """What the recipe trains is identity (stage tokens and lengths, device, global batch); how it
    runs (ranks, micro-batch, TP, checkpoints kept, the workspace) is checked but operational."""
    from flows.recipe import load_recipe

    recipe = load_recipe("tiny", [f"workspace={tmp_path / 'ws'}", "training.device=cpu"])
    s = tp.PreflightSpec.for_recipe(recipe, "run-x")
    assert s.facts["stage_tokens"] == {st.name: st.tokens for st in recipe.stages}
    assert s.facts["seq_len"] == max(st.seq_len for st in recipe.stages) and s.facts["device"] == "cpu"
    assert s.run_facts["stage_max_epochs"] == {"reasoning": 5.0}  # the one stage whose recipe says
    assert s.run_facts["workspace"] == str(tmp_path / "ws") and s.run_facts["tp"] == recipe.training.tp
    assert s.run_facts["checkpoint_keep"] == recipe.training.keep_last + len(recipe.stages)
    assert (s.model, s.run_id) == (recipe.training.model, "run-x")
    d = tp.preflight
    other = s.model_copy(update={"run_facts": {**s.run_facts, "micro_batch": 99}, "run_id": "run-y"})
    assert d.fingerprint(other, {}, d.facts(other)) == d.fingerprint(s, {}, d.facts(s))


def test_published_recipe_batch_check_sees_each_stage_layout_with_cp(tmp_path):
    """smollm3-3b's long-context stages run at TP 2 x CP 4 on 12 nodes (DP 12, micro 1): the
    batch check is held to each stage's own layout, CP included, and passes."""
    from flows.recipe import load_recipe
    from infra.preflight import run_preflight

    recipe = load_recipe("smollm3-3b", [f"workspace={tmp_path / 'ws'}"])
    s = tp.PreflightSpec.for_recipe(recipe, "run-x")
    assert s.run_facts["stage_layouts"]["long32k"] == {
        "nodes": 12, "tp": 2, "cp": 4, "micro_batch": 1, "global_batch": 72,
    }  # fmt: skip
    facts = PreflightFacts.from_dict({**s.facts, **s.run_facts})
    [res] = run_preflight(PreflightConfig(checks=("batch_layout",)), facts, log=lambda _: None)
    assert res.status == "pass", res.advice
    assert "stage long32k: 72 = dp 12 x micro 1 x accum 6 (tp 2 x cp 4)" in res.value
    assert "stage long64k: 36 = dp 12 x micro 1 x accum 3 (tp 2 x cp 4)" in res.value


def test_the_3b_recipes_preflight_checks_the_first_stages_nodes_and_moves_no_fingerprint(tmp_path):
    """On Slurm the graph hands preflight the first stage's sized launch (its nodes run the node
    checks as a job) and what the most demanding stage needs of a node (the host checks'
    thresholds): both operational, so the fingerprint is the one the same spec has without them,
    and a local recipe's spec is as before (no launch, no host facts)."""
    from flows.recipe import load_recipe
    from flows.smollm3 import graph
    from infra.launchers import LaunchConfig

    recipe = load_recipe("smollm3-3b", [f"workspace={tmp_path / 'ws'}"])
    (node,) = [n for n in graph(recipe, tolerant=True) if n.label == "preflight"]
    s = node.config
    assert s.launch.kind == "slurm" and s.launch.nodes == 48 and s.launch.gpus_per_node == 8
    assert s.launch.slurm.mem == f"{s.run_facts['host_memory_gb']}G" and s.run_facts["open_files"] >= 4096
    plain = s.model_copy(update={"launch": LaunchConfig(), "run_facts": {"nodes": 48}})
    d = tp.preflight
    assert d.fingerprint(plain, {}, d.facts(plain)) == d.fingerprint(s, {}, d.facts(s))

    tiny = load_recipe("tiny", [f"workspace={tmp_path / 'ws'}", "training.device=cpu"])
    (local,) = [n.config for n in graph(tiny, tolerant=True) if n.label == "preflight"]
    assert local.launch == LaunchConfig() and "open_files" not in local.run_facts
