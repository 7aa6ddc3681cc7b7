"""Mixtures: the SmolLM3 transcription, validation at recipe load, budgets, epochs, plan.json."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from flows.recipe import RecipeError, load_recipe
from pipeline.artifact import Artifact
from tasks.mixture import MixtureError, MixtureSpec, MixtureWarning, StageConfig, load_weights, mixture

REPO = Path(__file__).resolve().parents[2]
CSV = REPO / "docs" / "reference" / "smollm3_mixture_weights.csv"  # the published weights
COLUMNS = {"stage1": "stage1_0_to_8T", "stage2": "stage2_8T_to_10T", "stage3": "stage3_decay_10T_to_11T"}


def _csv_rows() -> list[dict[str, str]]:
    with open(CSV, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.parametrize("stage", sorted(COLUMNS))
def test_smollm3_mixtures_transcribe_the_published_table(stage):
    rows = _csv_rows()
    data = yaml.safe_load((REPO / "mixtures" / "smollm3" / f"{stage}.yaml").read_text())
    weights = data["weights"]
    assert list(weights) == [r["source"] for r in rows]  # same names, same order
    for r in rows:
        assert weights[r["source"]] == pytest.approx(float(r[COLUMNS[stage]]), abs=1e-12), r["source"]


def test_smollm3_recipe_defines_every_mixture_source_and_loads():
    recipe = load_recipe("smollm3-3b")
    names = {s.name for s in recipe.sources}
    assert {r["source"] for r in _csv_rows()} == names
    pretraining = [st for st in recipe.stages if st.mixture.startswith("mixtures/smollm3/stage")]
    assert [st.name for st in pretraining] == ["stage1", "stage2", "stage3"]
    assert sum(st.tokens for st in pretraining) == 11_100_000_000_000
    assert recipe.source("fw2-fra").hf_subset == "fra_Latn"
    assert recipe.source("stack-edu-C-Sharp").hf_subset == "CSharp"


def _recipe_with(tmp_path, weights: dict) -> Path:
    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump({"weights": weights}))
    data = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    data["stages"] = [{"name": "stage1", "mixture": str(mix), "tokens": 1000, "seq_len": 16}]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"prose": 0.5, "poetry": 0.5}, "unknown source\\(s\\) poetry"),
        ({"prose": 1.0, "code": -0.1}, "weights must be finite and >= 0; bad: code"),
        ({"prose": 0, "code": 0}, "the weights sum to 0"),
        ({"prose": "lots"}, "weight of 'prose' is a str, not a finite number"),
    ],
)
def test_bad_mixtures_fail_when_the_recipe_loads(tmp_path, weights, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(str(_recipe_with(tmp_path, weights)))


def test_missing_mixture_file_is_named(tmp_path):
    data = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    data["stages"] = [{"name": "s", "mixture": "mixtures/none.yaml", "tokens": 1, "seq_len": 1}]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match="mixture file 'mixtures/none.yaml' not found"):
        load_recipe(str(path))


def _shards(tmp_path, name: str, tokens: int) -> Artifact:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / f"{name}_00000.ds").write_bytes(b"\0\0" * tokens)
    meta = {
        "source": name,
        "tokens": tokens,
        "files": [f"{name}_00000.ds"],
        "vocab_size": 4096,
        "eos_id": 0,
        "token_dtype": "uint16",
    }
    return Artifact(kind="shards", uri=str(folder), fingerprint=name.ljust(64, "0"), meta=meta)


def test_plan_budgets_epochs_and_contract(tmp_path):
    mix = tmp_path / "m.yaml"
    mix.write_text(yaml.safe_dump({"weights": {"prose": 0.9, "code": 0.45, "math": 0.15, "idle": 0}}))
    stage = StageConfig(name="stage1", mixture=str(mix), tokens=20_000, seq_len=256, max_epochs=4)
    shards = [_shards(tmp_path, n, t) for n, t in (("prose", 2000), ("code", 50_000), ("math", 1500), ("idle", 10))]
    out = tmp_path / "out"
    out.mkdir()
    with pytest.warns(MixtureWarning) as caught:
        meta = mixture(MixtureSpec.of(stage, 7), shards, out=out)
    messages = [str(w.message) for w in caught]
    assert any("weights sum to 1.5, not 1; normalised" in m for m in messages)
    assert any("'prose' would repeat 6.0 times" in m for m in messages)
    assert not any("'code'" in m for m in messages)
    plan = json.loads((out / "plan.json").read_text())
    assert list(plan) == ["stage", "seed", "seq_len", "tokens", "vocab_size", "eos_id", "token_dtype", "sources"]
    assert (plan["stage"], plan["seed"], plan["seq_len"], plan["tokens"]) == ("stage1", 7, 256, 20_000)
    assert (plan["vocab_size"], plan["eos_id"], plan["token_dtype"]) == (4096, 0, "uint16")
    by_name = {s["name"]: s for s in plan["sources"]}
    assert set(by_name) == {"prose", "code", "math"}  # weight 0: left out
    assert list(by_name["prose"]) == ["name", "weight", "files", "available_tokens", "budget_tokens", "expected_epochs"]
    assert by_name["prose"]["weight"] == pytest.approx(0.6) and by_name["prose"]["budget_tokens"] == 12_000
    assert by_name["prose"]["expected_epochs"] == 6.0 and by_name["math"]["budget_tokens"] == 2000
    files = [f for s in plan["sources"] for f in s["files"]]  # relative to the plan, inside the workspace
    assert all(f.startswith("../") and (out / f).resolve().is_file() for f in files), files
    assert meta["original_weight_sum"] == 1.5 and meta["unused"] == ["idle"]


def test_plan_is_read_by_the_trainer_loader(tmp_path):
    data = pytest.importorskip("model.token_shards")
    mix = tmp_path / "m.yaml"
    mix.write_text(yaml.safe_dump({"weights": {"a": 0.5, "b": 0.5}}))
    stage = StageConfig(name="stage2", mixture=str(mix), tokens=1000, seq_len=8)
    out = tmp_path / "out"
    out.mkdir()
    mixture(MixtureSpec.of(stage, 0), [_shards(tmp_path, "a", 600), _shards(tmp_path, "b", 600)], out=out)
    plan = data.MixturePlan.load(out / "plan.json")
    assert plan.stage == "stage2" and [s.name for s in plan.sources] == ["a", "b"]


def test_a_plan_moved_with_its_workspace_reads_the_shards_where_they_are_now(tmp_path):
    """The plan names its shards relative to itself: a copied workspace's plan, the original
    deleted, still loads for the trainer and the preflight with the copy's files."""
    import shutil

    from infra.preflight.data import load_plans
    from model.token_shards import MixturePlan

    ws = tmp_path / "ws"
    mix = tmp_path / "m.yaml"
    mix.write_text(yaml.safe_dump({"weights": {"a": 0.5, "b": 0.5}}))
    stage = StageConfig(name="stage1", mixture=str(mix), tokens=1000, seq_len=8)
    out = ws / "mixture" / "abcdef123456"
    out.mkdir(parents=True)
    (ws / "tokenize").mkdir()
    mixture(MixtureSpec.of(stage, 0), [_shards(ws / "tokenize", "a", 600), _shards(ws / "tokenize", "b", 600)], out=out)
    moved = tmp_path / "bigger-disk" / "ws"
    shutil.copytree(ws, moved)
    shutil.rmtree(ws)
    plan = MixturePlan.load(moved / "mixture" / "abcdef123456" / "plan.json")
    files = [Path(f) for s in plan.sources for f in s.files]
    assert files == [moved / "tokenize" / n / f"{n}_00000.ds" for n in ("a", "b")]
    assert all(f.is_file() for f in files)
    (loaded,) = load_plans((str(moved / "mixture" / "abcdef123456" / "plan.json"),))
    assert [Path(f) for s in loaded["sources"] for f in s["files"]] == files


def test_plan_refuses_sources_without_shards_and_mixed_tokenizers(tmp_path):
    mix = tmp_path / "m.yaml"
    mix.write_text(yaml.safe_dump({"weights": {"a": 1.0, "ghost": 1.0}}))
    stage = StageConfig(name="s", mixture=str(mix), tokens=10, seq_len=2)
    with pytest.raises(MixtureError, match="unknown source\\(s\\) ghost"):
        mixture(MixtureSpec.of(stage, 0), [_shards(tmp_path, "a", 100)], out=tmp_path)
    mix.write_text(yaml.safe_dump({"weights": {"a": 1.0, "b": 1.0}}))
    b = _shards(tmp_path, "b", 100)
    b = b.model_copy(update={"meta": {**b.meta, "vocab_size": 128256, "token_dtype": "uint32"}})
    with pytest.raises(MixtureError, match="shards disagree on vocab_size"):
        mixture(MixtureSpec.of(stage, 0), [_shards(tmp_path, "a", 100), b], out=tmp_path)


def test_tiny_mixtures_load():
    recipe = load_recipe("tiny")
    names = {s.name for s in recipe.sources}
    for st in recipe.stages:
        assert set(load_weights(st.mixture)) <= names
    for stage in ("stage1", "stage2", "stage3"):  # the pretraining stages use every source
        assert set(load_weights(f"mixtures/tiny/{stage}.yaml")) == names


def test_blend_weighs_normalised_parts_by_their_share():
    from tasks.mixture import blend

    # an anneal: 40% of the current mixture, 60% of the candidate
    assert blend([({"a": 3, "b": 1}, 0.4), ({"c": 2}, 0.6)]) == {"a": 0.3, "b": 0.1, "c": 0.6}
    assert blend([({"a": 1}, 0.4), ({"a": 1}, 0.6)]) == {"a": 1.0}
    # continued pretraining with no replay: the general part is skipped, even when empty
    assert blend([({"m": 1}, 1.0), ({}, 0.0)]) == {"m": 1.0}
    with pytest.raises(ValueError, match="must be >= 0 and not all 0"):
        blend([({"a": 1}, 0.4), ({"c": 0}, 0.6)])
