"""Recipes: validation that names the field and the allowed values, overrides, shipped recipes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from flows.recipe import CONFIGS_DIR, RecipeError, check_data, load_recipe


def _write(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


BASE = {"name": "t", "sources": [{"name": "m", "uri": "builtin:math", "domain": "math"}]}


@pytest.mark.parametrize("path", sorted(CONFIGS_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_validate(path):
    recipe = load_recipe(str(path))
    assert recipe.sources and recipe.name


def test_tiny_is_the_default_and_is_frozen():
    recipe = load_recipe()
    assert recipe.name == "tiny"
    with pytest.raises(ValidationError, match="frozen"):
        recipe.seed = 3  # type: ignore[misc]


def test_bad_value_names_field_and_allowed_values(tmp_path):
    data = {**BASE, "sources": [{"name": "m", "uri": "builtin:math", "domain": "maths"}]}
    with pytest.raises(RecipeError) as err:
        load_recipe(_write(tmp_path, data))
    assert "sources[m].domain" in str(err.value)
    assert "'web', 'code' or 'math'" in str(err.value) and "(got a string)" in str(err.value)
    assert "maths" not in str(err.value)  # the type of the value, never the value


def test_one_bad_source_field_is_one_error(tmp_path):
    data = {**BASE, "sources": [{"name": "m", "uri": "builtin:math", "domain": "math", "max_documents": -1}]}
    with pytest.raises(RecipeError) as err:
        load_recipe(_write(tmp_path, data))
    assert str(err.value).splitlines()[1:] == [
        "  sources[m].max_documents: Input should be greater than 0 (got an integer)"
    ]
    assert "(1 problem(s))" in str(err.value)


def test_check_data_names_the_source_field_before_any_compute(tmp_path):
    recipe = load_recipe(
        _write(tmp_path, BASE), [f"sources.m.uri=files:{tmp_path}/none/*.jsonl", "sources.m.domain=web"]
    )
    with pytest.raises(RecipeError, match=r"1 data source problem\(s\):\n  sources\[m\]\.uri: no files match"):
        check_data(recipe)
    check_data(load_recipe("tiny"))  # builtin sources: nothing to find


def test_unknown_keys_are_rejected_with_the_allowed_ones(tmp_path):
    with pytest.raises(
        RecipeError,
        match=r"colour: unknown field; allowed: .*name, (posttrain, )?preflight, (resources, )?seed, sources, .*workspace",
    ):
        load_recipe(_write(tmp_path, {**BASE, "colour": "red"}))
    with pytest.raises(RecipeError, match=r"sources\[m\]\.colour: unknown field; allowed: .*domain"):
        load_recipe(str(_write(tmp_path, BASE)), ["sources.m.colour=red"])


def test_unknown_source_uri_and_duplicates(tmp_path):
    with pytest.raises(RecipeError, match="unknown source uri 'builtin:poetry'"):
        load_recipe(_write(tmp_path, BASE), ["sources.m.uri=builtin:poetry"])
    dup = {**BASE, "sources": BASE["sources"] * 2}
    with pytest.raises(RecipeError, match="repeated: m"):
        load_recipe(_write(tmp_path, dup))


def test_overrides_take_precedence_and_parse_yaml_values():
    recipe = load_recipe("tiny", ["seed=7", "sources.math.max_documents=123", "workspace=/tmp/x"])
    assert recipe.seed == 7 and recipe.workspace == "/tmp/x"
    assert recipe.source("math").max_documents == 123
    assert load_recipe("tiny").source("math").max_documents != 123  # the file is untouched


def test_bad_overrides_are_named():
    with pytest.raises(RecipeError, match="must look like key=value"):
        load_recipe("tiny", ["seed"])
    with pytest.raises(RecipeError, match="no item named 'poetry'.*names: prose, code, math"):
        load_recipe("tiny", ["sources.poetry.max_documents=1"])
    with pytest.raises(RecipeError, match="no recipe 'huge'"):
        load_recipe("huge")


def test_numbers_are_strict_in_every_section_and_scientific_notation_is_an_int():
    recipe = load_recipe(
        "tiny", ["stages.stage2.tokens=1e9", "training.optimizer.lr=2e-4", "training.global_batch=16.0"]
    )
    assert recipe.stages[1].tokens == 1_000_000_000 and isinstance(recipe.stages[1].tokens, int)
    assert recipe.training.optimizer.lr == 2e-4 and recipe.training.global_batch == 16
    cases = {
        "training.global_batch=true": "training.global_batch: expected an integer, got a boolean",
        "training.optimizer.lr=false": "training.optimizer.lr: expected a number, got a boolean",
        "seed=2.5": "seed: expected an integer, got a number with a fractional part",
        "stages.stage1.tokens=1.5e0": r"stages\[stage1\].tokens: expected an integer, got a string "
        "holding a number with a fractional part",
        "sources.math.max_documents=yes": r"sources\[math\].max_documents: expected an integer, got "
        "a boolean",  # YAML 1.1 reads `yes` as true
        "training.optimizer.betas=[0.9, true]": r"training.optimizer.betas\[1\]: expected a number, got a boolean",
    }
    for override, message in cases.items():
        with pytest.raises(RecipeError, match=message):
            load_recipe("tiny", [override])


def test_errors_about_a_file_never_quote_it(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("name: t\nworkspace: hunter2-secret\nsources: [\n  - {name: m: x}\n")
    with pytest.raises(RecipeError, match=r"invalid YAML at line \d+, column \d+") as err:
        load_recipe(str(bad))
    assert "hunter2" not in str(err.value)
    data = {**BASE, "seed": "token-abc123"}
    with pytest.raises(RecipeError) as err:
        load_recipe(_write(tmp_path, data))
    assert "seed" in str(err.value) and "(got a string)" in str(err.value)
    assert "abc123" not in str(err.value)


def test_the_published_recipe_domains_give_the_published_shares():
    """SmolLM3's web/code/math shares per stage (docs/reference/smollm3.md: 85/12/3, 75/15/10,
    63/24/13) from the published weights and our recipe's domain labels: MegaMath's
    text-code-block is math (labelled code, stage 3's math share was 8.1%)."""
    import csv

    recipe = load_recipe("smollm3-3b")
    domain = {s.name: s.domain for s in recipe.sources}
    rows = list(csv.DictReader((CONFIGS_DIR.parent / "docs" / "reference" / "smollm3_mixture_weights.csv").open()))
    published = {
        "stage1_0_to_8T": (85, 12, 3),
        "stage2_8T_to_10T": (75, 15, 10),
        "stage3_decay_10T_to_11T": (63, 24, 13),
    }
    for column, (web, code, math) in published.items():
        share = dict.fromkeys(("web", "code", "math"), 0.0)
        for r in rows:
            share[domain[r["source"]]] += float(r[column] or 0)
        total = sum(share.values())
        got = {k: 100 * v / total for k, v in share.items()}
        assert abs(got["web"] - web) < 2 and abs(got["code"] - code) < 1.5 and abs(got["math"] - math) < 1, (
            column,
            got,
        )


def test_every_fineweb2_source_has_its_language_and_its_preset():
    recipe = load_recipe("smollm3-3b")
    fw2 = [s for s in recipe.sources if s.uri == "hf:HuggingFaceFW/fineweb-2"]
    assert len(fw2) == 14
    codes = {"fra": "fr", "spa": "es", "deu": "de", "ita": "it", "por": "pt", "cmn": "zh", "rus": "ru"}
    codes |= {"fas": "fa", "jpn": "ja", "kor": "ko", "hin": "hi", "tha": "th", "vie": "vi", "ell": "el"}
    for s in fw2:
        assert s.language == codes[s.hf_subset.split("_")[0]]
        assert recipe.curation.for_source(s).presets == {s.name: f"web-{s.language}"}
    english = recipe.source("fineweb-edu/fineweb-edu")
    assert english.language == "en" and recipe.curation.for_source(english).presets == {english.name: "web"}
