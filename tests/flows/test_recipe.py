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
        match=r"colour: unknown field; allowed: .*name, (posttrain, )?preflight, (reasoning_data, )?(reasoning_modes, )?(resources, )?seed, sources, .*workspace",
    ):
        load_recipe(_write(tmp_path, {**BASE, "colour": "red"}))
    with pytest.raises(RecipeError, match=r"sources\[m\]\.colour: unknown field; allowed: .*domain"):
        load_recipe(str(_write(tmp_path, BASE)), ["sources.m.colour=red"])


def test_reasoning_modes_default_to_the_built_in_system_turns_and_bad_ones_are_named():
    modes = load_recipe("tiny").reasoning_modes
    assert (modes.think_system, modes.no_think_system) == ("Think step by step, then answer. /think", "/no_think")
    own = load_recipe("tiny", ["reasoning_modes.think_system=Show each step. /think"]).reasoning_modes
    assert own.system("think") == "Show each step. /think" and own.system("no_think") == "/no_think"
    with pytest.raises(RecipeError, match=r"reasoning_modes.think_system 'Show each step.' does not say /think"):
        load_recipe("tiny", ["reasoning_modes.think_system=Show each step."])
    with pytest.raises(RecipeError, match=r"reasoning_modes.no_think_system .* does not say /no_think"):
        load_recipe("tiny", ["reasoning_modes.no_think_system=Be brief. /think"])
    with pytest.raises(RecipeError, match=r"reasoning_modes.think_system .* says /no_think"):
        load_recipe("tiny", ["reasoning_modes.think_system=/think /no_think"])
    with pytest.raises(RecipeError, match=r"reasoning_modes.think_system holds '<\|im_end\|>'"):
        load_recipe("tiny", ["reasoning_modes.think_system=Think.<|im_end|> /think"])


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


def _number_fields(model, path: str, shown: str, tiny: dict, kind: type) -> list[tuple[str, str]]:
    """(override path, path as errors print it) of every `kind` field (float or int, optional or
    not) reachable in the recipe's models; list items are addressed by the name of tiny's first
    item (lists tiny leaves empty have no item to address)."""
    import types
    import typing

    out = []
    for name, field in model.model_fields.items():
        here, shown_here = (f"{path}.{name}", f"{shown}.{name}") if path else (name, name)
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if typing.get_origin(ann) in (typing.Union, types.UnionType) and len(args) == 1:
            ann = args[0]
        if ann is kind:
            out.append((here, shown_here))
        elif hasattr(ann, "model_fields"):
            out += _number_fields(ann, here, shown_here, (tiny or {}).get(name) or {}, kind)
        elif typing.get_origin(ann) is tuple and hasattr(typing.get_args(ann)[0], "model_fields"):
            items = (tiny or {}).get(name) or []
            if items and isinstance(items[0], dict) and "name" in items[0]:
                item = items[0]["name"]
                out += _number_fields(
                    typing.get_args(ann)[0], f"{here}.{item}", f"{shown_here}[{item}]", items[0], kind
                )
    return out


def _tiny_data() -> dict:
    return load_recipe("tiny").model_dump(mode="json")


FLOATS = dict(_number_fields(__import__("flows.recipe").recipe.Recipe, "", "", _tiny_data(), float))
INTS = dict(_number_fields(__import__("flows.recipe").recipe.Recipe, "", "", _tiny_data(), int))


def test_the_field_walk_finds_the_fields_the_issue_names():
    assert {"training.optimizer.lr", "training.min_lr", "stages.stage1.max_epochs"} <= set(FLOATS)
    assert {"seed", "stages.stage1.tokens", "stages.stage1.seq_len", "training.global_batch"} <= set(INTS)
    assert len(FLOATS) > 30 and len(INTS) > 60


@pytest.mark.parametrize("field", FLOATS)
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1e400", "nan"])
def test_every_float_field_refuses_inf_and_nan(field, value):
    with pytest.raises(RecipeError) as err:
        load_recipe("tiny", [f"{field}={value}"])
    assert f"{FLOATS[field]}: expected a finite number, got" in str(err.value)


@pytest.mark.parametrize("field", INTS)
def test_every_int_field_refuses_what_no_int64_holds(field):
    with pytest.raises(RecipeError) as err:
        load_recipe("tiny", [f"{field}=1e400"])
    assert f"{INTS[field]}: expected an integer within -2**63..2**63-1, got an integer of 401 digits" in str(err.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("seed=1e30", "seed: expected an integer within"),
        ("seed=-1", "seed: Input should be greater than or equal to 0"),
        (f"seed={2**63}", "seed: expected an integer within"),
        ("posttrain.seed=4294967296", "posttrain.seed: Input should be less than or equal to 4294967295"),
        ("stages.stage1.seq_len=1e9", r"stages\[stage1\].seq_len 1000000000 exceeds the 1024 positions of model"),
        ("stages.long2.seq_len=2048", r"stages\[long2\].seq_len 2048 exceeds the 1024 positions"),
        ("training.model_overrides.rope_theta=.inf", "ModelConfig.rope_theta must be a finite number"),
    ],
)
def test_seeds_and_sequence_lengths_are_in_range_at_recipe_time(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("tiny", [override])


def test_the_largest_seed_and_the_models_positions_are_accepted():
    assert load_recipe("tiny", [f"seed={2**63 - 1}"]).seed == 2**63 - 1
    assert load_recipe("tiny", ["stages.stage1.seq_len=1024"]).stages[0].seq_len == 1024
    raised = load_recipe("tiny", ["stages.long2.seq_len=2048", "training.model_overrides.max_seq_len=2048"])
    assert raised.stages[-2].seq_len == 2048  # long2 (the reasoning stage follows it)


def test_a_duplicate_key_names_the_key_and_both_lines(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "name: t\nseed: 0\nsources:\n  - {name: m, uri: 'builtin:math', domain: math}\nseed: 5\n", encoding="utf-8"
    )
    with pytest.raises(RecipeError, match=r"key 'seed' appears twice in one mapping \(lines 2 and 5\)"):
        load_recipe(str(path))
    path.write_text(
        "name: t\nsources:\n  - {name: m, uri: 'builtin:math', domain: math, max_documents: 1, max_documents: 9}\n",
        encoding="utf-8",
    )
    with pytest.raises(RecipeError, match=r"key 'max_documents' appears twice.*\(lines 3 and 3\)"):
        load_recipe(str(path))
    with pytest.raises(RecipeError, match=r"override 'training.optimizer': key 'lr' appears twice"):
        load_recipe("tiny", ["training.optimizer={lr: 1e-3, lr: 1e-2}"])


def test_a_duplicate_key_in_a_mixture_file_is_an_error(tmp_path):
    from curation.mixtures import MixtureError, load_weights

    path = tmp_path / "mix.yaml"
    path.write_text("weights:\n  prose: 0.5\n  code: 0.5\n  prose: 0.9\n", encoding="utf-8")
    with pytest.raises(MixtureError, match=r"key 'prose' appears twice in one mapping \(lines 2 and 4\)"):
        load_weights(str(path))
    path.write_text("weights:\n  prose: .inf\n", encoding="utf-8")
    with pytest.raises(MixtureError, match="weight of 'prose' is a float, not a finite number"):
        load_weights(str(path))


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


def test_a_derived_recipe_is_its_base_with_its_overrides_then_the_command_lines(tmp_path):
    path = _write(tmp_path, {"base": "tiny", "overrides": ["name=mine", "seed=5", "training.global_batch=8"]})
    mine, tiny = load_recipe(path, ["seed=7"]), load_recipe("tiny")
    assert (mine.name, mine.seed, mine.training.global_batch) == ("mine", 7, 8)
    # everything else is the base's
    assert mine.model_dump(exclude={"name", "seed", "training"}) == tiny.model_dump(
        exclude={"name", "seed", "training"}
    )
    assert mine.training.model_dump(exclude={"global_batch"}) == tiny.training.model_dump(exclude={"global_batch"})


def test_tiny_learn_is_tiny_with_the_learning_settings():
    learn, tiny = load_recipe("tiny-learn"), load_recipe("tiny")
    assert learn.name == "tiny-learn" and learn.training.global_batch == 8 and tiny.training.global_batch == 16
    assert [s.tokens for s in learn.stages[:3]] == [4 * s.tokens for s in tiny.stages[:3]]
    assert learn.posttrain.sft.max_steps == 200 and learn.posttrain.data.prose_examples == 0
    # the reasoning stage: 384 steps of 8 x 512 tokens, and its effect in the eval table
    reasoning = learn.stages[-1]
    assert (reasoning.kind, reasoning.tokens // (reasoning.global_batch * reasoning.seq_len)) == ("reasoning", 384)
    assert learn.posttrain.eval.before_reasoning and not tiny.posttrain.eval.before_reasoning
    # GRPO over a pool of 32 prompts, 12 epochs of it (96 updates x 16 / 4 prompts drawn)
    grpo = learn.posttrain.grpo
    assert (grpo.prompts, tiny.posttrain.grpo.prompts) == (32, None)
    assert grpo.max_steps * grpo.batch // grpo.num_generations == 12 * grpo.prompts


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"base": "tiny", "seed": 3}, "holds only `base` and `overrides` (also found: seed)"),
        ({"base": "nope"}, "base must name a recipe in configs/ (smollm3-3b, tiny, tiny-learn), got 'nope'"),
        ({"base": ["tiny"]}, "base must name a recipe in configs/ (smollm3-3b, tiny, tiny-learn), got a list"),
        ({"base": "tiny", "overrides": "seed=1"}, "overrides must be a list of key=value strings"),
        ({"base": "tiny", "overrides": ["seed"]}, "override 'seed' must look like key=value"),
        ({"base": "tiny-learn"}, "has a base itself; a recipe derives from one level only"),
        ({"base": "tiny", "overrides": ["training.global_batch=0"]}, "training.global_batch"),
    ],
)
def test_a_bad_derived_recipe_is_named(tmp_path, data, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(_write(tmp_path, data))
    assert message in str(err.value)
