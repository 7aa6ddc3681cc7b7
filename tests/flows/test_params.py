"""The run form: every flow parameter described, recipes offered by name (a path still accepted),
`refresh` limited to the flow's steps, in the schema Prefect builds and validates against."""

from __future__ import annotations

import pytest
from prefect.exceptions import ParameterTypeError
from prefect.utilities.callables import parameter_schema

from flows.params import check_refresh, flow_steps, recipe_names
from flows.prefect_flows import anneal, cpt, smollm3
from flows.recipe import CONFIGS_DIR, load_recipe
from flows.smollm3 import graph

FLOWS = {"smollm3": smollm3, "anneal": anneal, "cpt": cpt}


@pytest.mark.parametrize("name", FLOWS)
def test_every_parameter_has_a_description(name):
    props = parameter_schema(FLOWS[name].fn).model_dump()["properties"]
    assert set(props) >= {"recipe", "overrides", "refresh"}
    for param, schema in props.items():
        assert len(schema.get("description", "")) > 20, f"{name}.{param} has no description"


@pytest.mark.parametrize("name", FLOWS)
def test_recipe_offers_the_known_recipes_and_accepts_a_path(name, tmp_path):
    f = FLOWS[name]
    choices = parameter_schema(f.fn).model_dump()["properties"]["recipe"]["anyOf"]
    assert choices[0]["enum"] == sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml")) == list(recipe_names())
    assert {"tiny", "smollm3-3b"} <= set(choices[0]["enum"])
    assert choices[1] == {"title": "the path of a recipe YAML file", "type": "string"}
    path = str(tmp_path / "mine.yaml")
    assert f.validate_parameters({"recipe": path})["recipe"] == path
    assert f.validate_parameters({"recipe": "tiny"})["recipe"] == "tiny"


@pytest.mark.parametrize("name", FLOWS)
def test_refresh_offers_the_flows_steps_and_refuses_others(name):
    f = FLOWS[name]
    refresh = parameter_schema(f.fn).model_dump()["properties"]["refresh"]["anyOf"][0]
    assert refresh["type"] == "array" and refresh["items"]["enum"] == list(flow_steps(f.fn.__globals__))
    assert f.validate_parameters({"refresh": ["pretrain"]})["refresh"] == ["pretrain"]
    with pytest.raises(ParameterTypeError, match="refresh"):
        f.validate_parameters({"refresh": ["tokeniser"]})


def test_the_refresh_choices_cover_every_step_of_a_graph():
    g = graph(load_recipe("tiny", []), tolerant=True)
    assert set(g.steps) <= set(flow_steps(smollm3.fn.__globals__))


def test_check_refresh_names_the_flows_steps():
    check_refresh("anneal", ["pin", "pretrain"])
    with pytest.raises(ValueError, match="unknown step\\(s\\) bogus; steps of flow 'cpt': cpt_monitor, export"):
        check_refresh("cpt", ["bogus", "pin"])
