"""Mixture files: the SmolLM3 transcription, validation at recipe load, blending."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

from curation.mixtures import blend, load_weights
from flows.recipe import RecipeError, load_recipe

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


def test_tiny_mixtures_load():
    recipe = load_recipe("tiny")
    names = {s.name for s in recipe.sources}
    traces = {s.name for s in recipe.reasoning_data}  # the reasoning stage's traces (tasks/reasoning_data.py)
    for st in recipe.stages:
        assert set(load_weights(st.mixture)) <= (traces if st.kind == "reasoning" else names), st.name
    for stage in ("stage1", "stage2", "stage3"):  # the pretraining stages use every source
        assert set(load_weights(f"mixtures/tiny/{stage}.yaml")) == names


def test_blend_weighs_normalised_parts_by_their_share():
    # an anneal: 40% of the current mixture, 60% of the candidate
    assert blend([({"a": 3, "b": 1}, 0.4), ({"c": 2}, 0.6)]) == {"a": 0.3, "b": 0.1, "c": 0.6}
    assert blend([({"a": 1}, 0.4), ({"a": 1}, 0.6)]) == {"a": 1.0}
    # continued pretraining with no replay: the general part is skipped, even when empty
    assert blend([({"m": 1}, 1.0), ({}, 0.0)]) == {"m": 1.0}
    with pytest.raises(ValueError, match="must be >= 0 and not all 0"):
        blend([({"a": 1}, 0.4), ({"c": 0}, 0.6)])
