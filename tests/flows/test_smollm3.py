"""The smollm3 flow through Prefect: caching across runs, partial reruns, refresh, bad recipes."""

from __future__ import annotations

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
    fifth = _states(lineage, smollm3(overrides=over)["run_id"])
    assert fifth["source[prose]"] == "completed"
    assert (ws / "source" / prose.rsplit("/", 1)[1] / "_COMPLETE.json").exists()
    # ... and everything after it is reused by fingerprint: a step's fingerprint is its inputs',
    # so the rebuilt source leaves its curation, the index, the shards and the tokenizer as they were
    rest = {k: v for k, v in fifth.items() if k != "source[prose]"}
    assert rest and set(rest.values()) == {"cached"}, rest

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
