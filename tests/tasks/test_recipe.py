"""Recipes: validation that names the field and the allowed values, overrides, shipped recipes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tasks.recipe import CONFIGS_DIR, RecipeError, check_data, load_recipe


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
    assert "'web', 'code' or 'math'" in str(err.value) and "'maths'" in str(err.value)


def test_one_bad_source_field_is_one_error(tmp_path):
    data = {**BASE, "sources": [{"name": "m", "uri": "builtin:math", "domain": "math", "max_documents": -1}]}
    with pytest.raises(RecipeError) as err:
        load_recipe(_write(tmp_path, data))
    assert str(err.value).splitlines()[1:] == ["  sources[m].max_documents: Input should be greater than 0 (got -1)"]
    assert "(1 problem(s))" in str(err.value)


def test_check_data_names_the_source_field_before_any_compute(tmp_path):
    recipe = load_recipe(_write(tmp_path, BASE), [f"sources.m.uri=files:{tmp_path}/none/*.jsonl", "sources.m.domain=web"])
    with pytest.raises(RecipeError, match=r"1 data source problem\(s\):\n  sources\[m\]\.uri: no files match"):
        check_data(recipe)
    check_data(load_recipe("tiny"))  # builtin sources: nothing to find


def test_unknown_keys_are_rejected_with_the_allowed_ones(tmp_path):
    with pytest.raises(RecipeError, match=r"colour: unknown field; allowed: .*name, (posttrain, )?preflight, (resources, )?seed, sources, .*workspace"):
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
