"""The smollm3 flow through Prefect: caching across runs, partial reruns, refresh, bad recipes."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from flows.prefect_flows import smollm3
from flows.recipe import RecipeError
from pipeline.lineage import Lineage
from tests.conftest import DATA_ONLY


def _states(lineage: Lineage, run_id: str) -> dict[str, str]:
    return {f"{s['step']}[{s['label']}]": s["state"] for s in lineage.steps_of(run_id)}


@pytest.mark.slow
def test_caching_partial_rerun_refresh_and_rebuild(workspace_copy, prefect_harness):
    # A copy of the data part of the tiny DAG, built once per session by the same flow from raw
    # sources (tests/conftest.py): its first run here reuses every finished folder by its marker.
    ws = workspace_copy("data")
    over = [*DATA_ONLY, f"workspace={ws}"]
    lineage = Lineage(ws / "lineage.duckdb")
    markers = {p: p.stat().st_mtime_ns for p in ws.glob("*/*/_COMPLETE.json")}

    first = smollm3(overrides=over)
    states = _states(lineage, first["run_id"])
    # reused, and shown so (Cached), not as work done: the copy's Prefect cache is its own
    assert states and set(states.values()) == {"cached"}
    assert markers and {p: p.stat().st_mtime_ns for p in markers} == markers  # nothing rebuilt
    assert (ws / "runs" / first["run_id"] / "recipe.yaml").read_text().startswith("name: tiny")

    second = smollm3(overrides=over)
    assert set(_states(lineage, second["run_id"]).values()) == {"cached"}
    assert second["final"] == first["final"]

    # With the tokenizer fixed by the recipe, changing one source's config reruns that source,
    # its curation, the held-out index, the decontamination of every source (each train split is
    # decontaminated against every source's held-out split) and so their token shards; the other
    # sources' curation and the tokenizer stay.
    trained = (
        ws
        / "tokenizer"
        / lineage.query("SELECT fingerprint FROM artifacts WHERE step = 'tokenizer'")[0][0][:12]
        / "tokenizer.json"
    )
    fixed = [*over, f"tokenizer.path={trained}"]
    smollm3(overrides=fixed)
    third = _states(lineage, smollm3(overrides=[*fixed, "sources.math.max_documents=150"])["run_id"])
    per_source = {k: v for k, v in third.items() if k.endswith(("[prose]", "[code]", "[math]"))}
    assert {k for k, v in per_source.items() if v == "completed"} == {
        "source[math]",
        "curate[math]",
        *(f"{step}[{s}]" for step in ("decontaminate", "tokenize") for s in ("prose", "code", "math")),
    }
    assert per_source["source[prose]"] == per_source["source[code]"] == "cached"
    assert per_source["curate[prose]"] == per_source["curate[code]"] == "cached"
    assert third["heldout_index[heldout]"] == "completed" and third["tokenizer[given]"] == "cached"

    # refresh forces the named step for every source.
    fourth = smollm3(overrides=over, refresh=["source"])
    sources = {k: v for k, v in _states(lineage, fourth["run_id"]).items() if k.startswith("source[")}
    assert set(sources.values()) == {"completed"} and len(sources) == 3

    # A step folder deleted by hand is rebuilt instead of being trusted from Prefect's cache.
    prose = lineage.query(
        "SELECT uri FROM artifacts WHERE step='source' AND label='prose' ORDER BY created DESC LIMIT 1"
    )[0][0]
    shutil.rmtree(prose)
    fifth = smollm3(overrides=over)
    assert _states(lineage, fifth["run_id"])["source[prose]"] == "completed"
    assert (ws / "source" / prose.rsplit("/", 1)[1] / "_COMPLETE.json").exists()

    runs = lineage.runs()
    assert [r["state"] for r in runs] == ["completed"] * (1 + 6)  # the session's build, then these six


def test_a_source_is_curated_from_its_own_source_alone_and_the_held_out_index_is_built_once():
    """Curation of a source waits for that source only; the held-out index (one step) reads every
    source; each source's decontamination reads its curated corpus and that index; every later
    step reads the decontaminated corpus."""
    from flows.recipe import load_recipe
    from flows.smollm3 import graph

    g = graph(load_recipe("tiny", []))
    names = ("prose", "code", "math")
    parents = {n.key: {p.key for p in n.parents()} for n in g}
    for s in names:
        assert parents[f"curate[{s}]"] == {f"source[{s}]"}, parents[f"curate[{s}]"]
        assert parents[f"decontaminate[{s}]"] == {f"curate[{s}]", "heldout_index[heldout]"}
        assert parents[f"tokenize[{s}]"] - {"tokenizer[bpe]"} == {f"decontaminate[{s}]"}
    assert [n.key for n in g if n.step.name == "heldout_index"] == ["heldout_index[heldout]"]
    assert parents["heldout_index[heldout]"] == {f"source[{s}]" for s in names}
    # nothing after curation reads a corpus that is not decontaminated
    readers = {n.key for n in g for p in n.parents() if p.step.name == "curate"}
    assert readers == {f"decontaminate[{s}]" for s in names}
    # without decontamination the curated corpora are the clean ones: no index, no decontaminate
    off = graph(load_recipe("tiny", ["curation.decontamination.enabled=false"]))
    assert not {n.step.name for n in off} & {"heldout_index", "decontaminate"}
    assert {p.key for p in off.node("tokenize[math]").parents()} - {"tokenizer[bpe]"} == {"curate[math]"}


def test_invalid_recipe_fails_before_any_step(tmp_path, prefect_harness):
    ws = tmp_path / "ws"
    with pytest.raises(RecipeError, match="sources\\[math\\].domain"):
        smollm3(overrides=[f"workspace={ws}", "sources.math.domain=algebra"])
    assert not (ws / "lineage.duckdb").exists() and not (ws / "source").exists()


def test_unknown_refresh_step_is_named(tmp_path, prefect_harness):
    from prefect.exceptions import ParameterTypeError

    # not a step of the flow: refused by the parameter schema, before the run starts
    with pytest.raises(ParameterTypeError, match="refresh"):
        smollm3(overrides=[*DATA_ONLY, f"workspace={tmp_path}"], refresh=["tokeniser"])
    # a step of the flow that this recipe's graph does not have (no stages, no post-training)
    with pytest.raises(ValueError, match="refresh names unknown step\\(s\\) sft"):
        smollm3(overrides=[*DATA_ONLY, f"workspace={tmp_path}"], refresh=["sft"])


@pytest.fixture
def s3(monkeypatch):
    from tests.infra.test_storage import s3 as moto_s3

    yield from moto_s3.__wrapped__(monkeypatch)


@pytest.mark.slow
def test_finished_step_folders_are_mirrored_to_s3(tmp_path, prefect_harness, s3):
    endpoint, client = s3
    ws = tmp_path / "ws"
    over = [
        *DATA_ONLY,
        f"workspace={ws}",
        "storage.s3_uri=s3://ckpts/mirror",
        f"storage.endpoint_url={endpoint}",
        "storage.backoff_seconds=0",
    ]
    smollm3(overrides=over)
    lineage = Lineage(ws / "lineage.duckdb")
    keys = {o["Key"] for o in client.list_objects_v2(Bucket="ckpts", Prefix="mirror/")["Contents"]}
    for step, uri in lineage.query("SELECT step, uri FROM artifacts"):
        assert f"mirror/{step}/{Path(uri).name}/_COMPLETE.json" in keys, f"{step} not mirrored"
    recorded = " ".join(str(r) for r in lineage.query("SELECT * FROM artifacts"))
    assert "SeCrEt" not in recorded  # the fixture's sentinel secret never reaches lineage


def _ui_edges(run_id: str) -> set[tuple[str, str]]:
    """(parent, child) task-run names from Prefect's API `task_inputs` of a flow run."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.objects import TaskRunResult

    with get_client(sync_client=True) as client:
        runs: list = []
        for _ in range(60):  # task runs reach the API through events: wait until all are there
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
            if runs and all(r.state and r.state.is_final() for r in runs):
                break
            time.sleep(0.5)
    name = {r.id: r.name for r in runs}
    return {
        (name[i.id], r.name)
        for r in runs
        for inputs in r.task_inputs.values()
        for i in inputs
        if isinstance(i, TaskRunResult) and i.id in name
    }


def _lineage_edges(lineage: Lineage, run_id: str) -> set[tuple[str, str]]:
    """(parent, child) step names of the lineage `edges` between the steps of one run."""
    key = {s["fingerprint"]: f"{s['step']}[{s['label']}]" for s in lineage.steps_of(run_id)}
    return {(key[p], key[c]) for p, c in lineage.query("SELECT parent, child FROM edges") if p in key and c in key}


@pytest.mark.slow
def test_tiny_dag_runs_branches_at_once_and_the_ui_graph_is_the_lineage(workspace_copy, prefect_harness):
    """The whole tiny DAG (pretraining, export and eval per stage) through Prefect: independent
    branches overlap in time (per-source data steps; the evaluation of stage 1 beside the training
    of stage 2), every task run's inputs in the Prefect API equal the lineage edges, and both equal
    the graph the flow built.

    From a copy of the session's data steps at these sizes (tests/conftest.py) with its source
    folders deleted: the three sources build again (two at once in the `data` slots), their
    curations, held-out index, decontaminations, tokenizer and shards are reused by fingerprint,
    and the rest is built."""
    from flows.recipe import load_recipe
    from flows.smollm3 import graph
    from tests.conftest import TINY_TRAIN

    ws = workspace_copy("tiny-data")
    shutil.rmtree(ws / "source")
    over = [*TINY_TRAIN, f"workspace={ws}"]
    result = smollm3(overrides=over)
    assert set(result["states"]) == {"completed", "cached"}  # built, or reused from the copy
    lineage = Lineage(ws / "lineage.duckdb")
    steps = lineage.steps_of(result["run_id"])
    span = {f"{s['step']}[{s['label']}]": (s["started"], s["ended"]) for s in steps}
    state = {f"{s['step']}[{s['label']}]": s["state"] for s in steps}
    reused = {k for k, v in state.items() if v == "cached"}  # (fertility reads the stages' weights: it runs)
    assert reused == {
        f"{step}[{s}]" for step in ("curate", "decontaminate", "tokenize") for s in ("prose", "code", "math")
    } | {"heldout_index[heldout]", "tokenizer[bpe]"}, reused

    def overlap(a: str, b: str) -> bool:
        return span[a][0] < span[b][1] and span[b][0] < span[a][1]

    assert overlap("evaluate[stage1]", "pretrain[stage2]"), (span["evaluate[stage1]"], span["pretrain[stage2]"])
    sources = ("source[prose]", "source[code]", "source[math]")
    assert any(overlap(a, b) for a in sources for b in sources if a < b), {k: span[k] for k in sources}

    expected = graph(load_recipe("tiny", over)).edges()
    assert _lineage_edges(lineage, result["run_id"]) == expected
    assert _ui_edges(result["run_id"]) == expected

    # What a user sees: progress artifacts end at 100%; every stage's MFU is against this host's
    # preflight calibration and below 1 (evaluations ran beside training); one loss curve and one
    # eval table for the run, under stable keys.
    from prefect.artifacts import Artifact as PrefectArtifact

    stages = ("stage1", "stage2", "stage3", "long1", "long2", "reasoning")
    for key in [*(f"pretrain-{s}-progress" for s in stages), *(f"evaluate-{s}-progress" for s in stages)]:
        assert PrefectArtifact.get(key).data == 100.0, key
    # ... each with the step's last progress line, what the demo terminal showed while it ran
    from pipeline.live import parse

    for s in stages:
        key, line = parse(PrefectArtifact.get(f"pretrain-{s}-progress").description)
        assert key == f"pretrain[{s}]" and re.match(rf"{s} step (\d+)/\1 \| loss [\d.]+ \| .* tok/s", line), line
        key, line = parse(PrefectArtifact.get(f"evaluate-{s}-progress").description)
        assert key == f"evaluate[{s}]" and line.startswith("lm-eval: ") and "items" in line, line
    for label, stage in lineage.labelled_outputs(result["run_id"], "pretrain"):
        assert stage.meta["mfu_peak_source"].startswith("preflight "), (label, stage.meta["mfu_peak_source"])
        # On a loaded machine the calibration can fall below what training achieved: then no MFU is
        # reported and `mfu_invalid` says why (never a figure above 100%)
        mfu, invalid = stage.meta["mfu"], stage.meta["mfu_invalid"]
        assert (mfu is not None and 0 < mfu < 1 and not invalid) or (mfu is None and invalid), (label, mfu, invalid)
    # Reasoning mid-training: its mixture holds only the reasoning traces (ChatML, think mode)
    plans = dict(lineage.labelled_outputs(result["run_id"], "mixture"))
    assert plans["reasoning"].meta["budgets"] == {"reasoning": 8192}
    (traces,) = [a for _, a in lineage.labelled_outputs(result["run_id"], "reasoning_data")]
    assert traces.meta["documents"] == 24 == traces.meta["think_conversations"] and traces.meta["tokens"] > 0
    assert "data:image/png;base64," in PrefectArtifact.get("smollm3-loss-curve").data
    table = PrefectArtifact.get("smollm3-evals").data
    assert all(f"| {s} | " in table for s in stages) and "| *random* |" in table
    # long2 read at twice its length, plain RoPE and YaRN: two rows, scored on the long passkeys
    assert "| long2-x2 | " in table and "| long2-x2-yarn | " in table and "passkey_beyond_1300" in table
    beyond = {label: ev for label, ev in lineage.labelled_outputs(result["run_id"], "evaluate") if "-x2" in label}
    assert {label: ev.meta["beyond"]["yarn"] for label, ev in beyond.items()} == {
        "long2-x2": False,
        "long2-x2-yarn": True,
    }
    assert all(set(ev.meta["scores"]) == {"passkey_beyond_1300"} for ev in beyond.values())
    # The model path the summary prints loads; lm-eval's own results sit beside every eval's scores.
    from transformers import AutoModelForCausalLM

    from flows.views import summary

    final = re.search(r"^final model:  (\S+)", summary(lineage, None), re.M).group(1)
    assert final.endswith("/model") and AutoModelForCausalLM.from_pretrained(final) is not None
    for _, ev in lineage.labelled_outputs(result["run_id"], "evaluate"):
        assert (ev.path / "scores.json").is_file() and (ev.path / "lm_eval_results.json").is_file()


def test_the_run_report_knows_where_each_post_training_step_started():
    """The report flags a post-training step that moved no score beyond noise: it compares each
    post-trained model with the model its step started from, scored on the same items."""
    from flows.recipe import load_recipe
    from flows.smollm3 import graph

    g = graph(load_recipe("tiny", ["workspace=/nonexistent-smollm3-plan"]), tolerant=True)
    assert g.node("run_report[smollm3]").config.parents == (
        ("sft", "base"),  # base: the reasoning stage's export on post-training's suite, not evaluate[reasoning]
        ("apo", "sft"),
        ("apo-s1", "sft"),
        ("soup", "apo"),  # a merge: its first model
        ("merge", "soup"),
        ("sao", "merge"),
        ("grpo", "merge"),
    )
    assert g.node("evaluate[base]").inputs["model"] is g.node("export[reasoning]")
    assert "evaluate[before-reasoning]" not in {n.key for n in g}  # off unless asked


def test_the_report_says_whether_the_reasoning_stage_moved_the_scores_when_asked():
    """`posttrain.eval.before_reasoning`: the export the reasoning stage started from is scored on
    post-training's suite too, and the report compares the base (the reasoning export) with it."""
    from flows.recipe import RecipeError, load_recipe
    from flows.smollm3 import graph

    over = ["workspace=/nonexistent-smollm3-plan", "posttrain.eval.before_reasoning=true"]
    g = graph(load_recipe("tiny", over), tolerant=True)
    before = g.node("evaluate[before-reasoning]")
    assert before.inputs["model"] is g.node("export[long2]")
    assert before.inputs["suite"] is g.node("evaluate[base]").inputs["suite"]  # the same items
    assert before.config == g.node("evaluate[base]").config
    parents = g.node("run_report[smollm3]").config.parents
    assert parents[:2] == (("base", "before-reasoning"), ("sft", "base"))  # in the order they trained
    # Refused, naming why, where there is no such model or nothing to compare it with.
    one = "stages=[{name: stage1, mixture: mixtures/tiny/stage1.yaml, tokens: 8192, seq_len: 256}]"
    with pytest.raises(RecipeError, match=r"last stage is not a reasoning stage \(stages: stage1 \(pretrain\)\)$"):
        load_recipe("tiny", [*over, one])
    with pytest.raises(RecipeError, match="set posttrain.eval.base"):
        load_recipe("tiny", [*over, "posttrain.eval.base=false"])
