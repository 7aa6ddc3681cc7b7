"""Run recipes: validated, frozen configs loaded from YAML with `key=value` overrides.

Precedence: model defaults < recipe YAML < overrides (CLI or deployment parameters). A recipe is
named by a path or by the name of a file in `configs/` (`tiny` is embedded and the default). A
recipe can also be another plus changes, `base: NAME` and `overrides: [key=value, ...]` and
nothing else (configs/tiny-learn.yaml): the base's YAML with those overrides applied before the
command line's. An invalid recipe fails here, before any step runs, with the field at fault and
what it accepts.
Each component receives only its own section.

Numbers are strict in every section (`check_numbers`, one pass over the whole recipe against the
section models' annotations): `true` is not 1, a float with a fraction is not an int, while
scientific notation (`tokens: 1e9`, which YAML reads as a string) is an int when it is whole.
Errors name the field and the *type* of the value found, never the value: recipe files and
overrides can carry things that must not end up in logs.
"""

from __future__ import annotations

import math
import sys
import types
import typing
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from curation.languages import LANGUAGES
from curation.mixtures import check_stages, load_weights
from curation.presets import PRESETS
from curation.source_kinds import SourceConfig, check_sources, missing_sources
from infra.launchers import LaunchConfig
from infra.preflight import PreflightConfig
from infra.storage import StorageConfig
from infra.terminal import printable
from infra.yamlfile import YamlRefused, load_yaml
from pipeline.artifact import operational
from pipeline.slots import ResourcesConfig
from tasks.cpt import CptConfig
from tasks.curate import CurationConfig
from tasks.evaluate import EvalConfig
from tasks.export import ExportConfig
from tasks.fertility import FertilityConfig
from tasks.mixture import StageConfig
from tasks.pretrain import TrainingConfig
from tasks.reasoning_data import ReasoningDataConfig
from tasks.tokenize import TokenizeConfig
from tasks.tokenizer import TokenizerConfig
from trainers.posttrain.sections import PosttrainConfig, ReasoningModesConfig

if TYPE_CHECKING:
    from pipeline.runner import RunSetup

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
INT_MAX = 2**63 - 1  # int64: what numpy, torch, DuckDB and the data loader's counters hold


# --- the anneal section (its runs are laid out by flows/anneal.py) -------------------------------


class CandidateConfig(BaseModel):
    """One candidate data source (or blend of sources) to test in an anneal."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")  # label of its anneal run, e.g. math
    weights: dict[str, float] = Field(min_length=1)  # candidate data by recipe source name


class AnnealConfig(BaseModel):
    """The recipe's `anneal` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    candidates: tuple[CandidateConfig, ...] = ()  # candidate data, one anneal run each
    candidate_share: float = Field(default=0.6, gt=0, lt=1)  # playbook: 60% candidate, 40% current
    tokens: int = Field(default=32768, gt=0, le=10**15)  # tokens per anneal run (short: a few % of the run)
    seed_runs: int = Field(default=1, ge=0)  # extra baseline runs with another data order (noise)
    checkpoint_interval: int = Field(default=100, gt=0)  # anneal runs checkpoint (resume) this often
    metric: str = "acc_norm"  # lm-eval metric compared (cloze: length-normalised accuracy)
    heldout_tokens: int = Field(default=16384, gt=0)  # held-out tokens per source (bits per byte)
    confidence: float = Field(default=0.95, gt=0, lt=1)  # of each difference's interval (needs seed_runs >= 1)
    base_flow: str = "smollm3"  # flow whose latest run provides the default base checkpoint
    base_deployment: str = "full"  # runs of this deployment are preferred for the default base

    @field_validator("candidates")
    @classmethod
    def _unique(cls, value: tuple[CandidateConfig, ...]) -> tuple[CandidateConfig, ...]:
        names = [c.name for c in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes or "baseline" in names:
            raise ValueError(f"anneal.candidates names must be unique and not 'baseline'; bad: {dupes or ['baseline']}")
        return value

    def check_sources(self, sources: Sequence[str]) -> None:
        """Every candidate names recipe sources (checked when the recipe loads)."""
        for c in self.candidates:
            unknown = sorted(set(c.weights) - set(sources))
            if unknown:
                raise ValueError(
                    f"anneal.candidates[{c.name}] names unknown source(s) {', '.join(unknown)}; "
                    f"sources: {', '.join(sources)}"
                )


class RecipeError(ValueError):
    """A recipe or override that cannot be used; the message names the field and the fix."""


class ExecutorRefused(RecipeError):
    """A data step the recipe would run on this machine at a scale it cannot take."""


class Recipe(BaseModel):
    """A whole run: which data, and (as later sections land) how to curate and train on it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str  # recipe name, shown in the UI and lineage
    seed: int = Field(default=0, ge=0, le=INT_MAX)  # seed for generated data, sampling and initialisation
    workspace: str = operational("workspace")  # folder for step outputs, lineage and Prefect state
    sources: tuple[SourceConfig, ...] = Field(min_length=1)  # data sources, by unique name
    curation: CurationConfig = CurationConfig()  # filters, dedup and executor per source
    tokenizer: TokenizerConfig = TokenizerConfig()  # train a BPE or adopt a tokenizer.json
    fertility: FertilityConfig = FertilityConfig()  # candidate tokenizers and the choice rule
    tokenize: TokenizeConfig = TokenizeConfig()  # token shards per source
    stages: tuple[StageConfig, ...] = ()  # pretraining stages: mixture file, tokens, seq_len
    # reasoning traces by source name, token shards a stage's mixture may weigh (reasoning stages)
    reasoning_data: tuple[ReasoningDataConfig, ...] = ()
    # the system turn of each reasoning mode, for reasoning traces, SFT data, pairs and eval prompts
    reasoning_modes: ReasoningModesConfig = ReasoningModesConfig()
    preflight: PreflightConfig = PreflightConfig()  # checks before training, and thresholds
    training: TrainingConfig = TrainingConfig()  # model, batch, optimizer, schedule, launcher
    export: ExportConfig = ExportConfig()  # Hugging Face export of every stage
    eval: EvalConfig = EvalConfig()  # cloze/passkey suite, contamination, lm-eval settings
    posttrain: PosttrainConfig | None = None  # SFT, APO, merge, GRPO, OPD (none: stop at export)
    launch: LaunchConfig = operational(LaunchConfig())  # where stages run: local torchrun, Slurm, Kubernetes
    storage: StorageConfig = operational(StorageConfig())  # S3 mirror of checkpoints (and resume from it)
    anneal: AnnealConfig = AnnealConfig()  # annealing experiments: candidates, budget, noise runs
    cpt: CptConfig = CptConfig()  # continued pretraining: domain, replay, LR, forgetting monitor
    resources: ResourcesConfig = operational(
        ResourcesConfig()
    )  # slots: how many train/eval/data steps run at once, threads each

    @model_validator(mode="after")
    def _unique_sources(self) -> Recipe:
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"source names must be unique; repeated: {', '.join(dupes)}")
        return self

    @model_validator(mode="after")
    def _data_sections_match_sources(self) -> Recipe:
        names = [s.name for s in self.sources]
        for source, preset in self.curation.presets.items():
            if source not in names:
                raise ValueError(f"curation.presets names unknown source {source!r}; sources: {', '.join(names)}")
            if preset not in PRESETS:
                raise ValueError(
                    f"curation.presets.{source}: unknown preset {preset!r}; allowed: {', '.join(PRESETS.names())}"
                )
        for s in self.sources:
            if self.curation.preset_for(s.name, s.domain, s.language) not in PRESETS:  # a web source
                known = ", ".join(sorted(LANGUAGES))
                raise ValueError(
                    f"sources[{s.name}].language: no web preset for language {s.language!r} (languages "
                    f"with one: {known}); add an entry to curation/languages.py LANGUAGES (docs/data.md, "
                    f"'Languages'), or keep the source without quality filters: curation.presets.{s.name}=none "
                    "(exact and near dedup and decontamination still run)"
                )
        unknown = sorted(set(self.curation.minhash_skip) - set(names))
        if unknown:
            raise ValueError(f"curation.minhash_skip names unknown source(s) {', '.join(unknown)}")
        traces = [r.name for r in self.reasoning_data]
        clash = sorted(set(traces) & set(names) | {n for n in traces if traces.count(n) > 1})
        if clash:
            raise ValueError(
                f"reasoning_data names must be unique and differ from the sources'; repeated: {', '.join(clash)}"
            )
        check_stages(self.stages, names + traces)  # mixtures fail here, before any compute
        kinds = [st.kind for st in self.stages]
        order = {"pretrain": 0, "long_context": 1, "reasoning": 2}
        if [order[k] for k in kinds] != sorted(order[k] for k in kinds):
            raise ValueError(
                "stages: every pretrain stage must come before the long_context stages, and those "
                f"before the reasoning stages; this recipe's kinds: {', '.join(kinds)}"
            )
        if kinds and kinds[0] != "pretrain":
            raise ValueError("stages: the first stage must be a pretrain stage")
        t = self.training
        positions = t.model_shape().max_seq_len
        for st in self.stages:
            if st.seq_len > positions:
                raise ValueError(
                    f"stages[{st.name}].seq_len {st.seq_len} exceeds the {positions} positions of model "
                    f"{t.model!r}: shorten it or raise training.model_overrides.max_seq_len"
                )
        if self.launch.procs_per_node not in (1, t.nproc_per_node):
            raise ValueError(
                f"launch.procs_per_node {self.launch.procs_per_node} differs from "
                f"training.nproc_per_node {t.nproc_per_node}: set training.nproc_per_node only"
            )
        from flows.fit import check_stages_fit

        # Every stage's layout, batch split and, where a GPU is declared, memory (flows/fit.py).
        check_stages_fit(self)
        return self

    @model_validator(mode="after")
    def _values_together(self) -> Recipe:
        from flows.recipe_values import check_values

        check_values(self)  # min_lr below the peaks, tokenizer.path a regular file, checkpoint_dir placed
        return self

    @model_validator(mode="after")
    def _experiments_name_sources(self) -> Recipe:
        names = [s.name for s in self.sources]
        self.anneal.check_sources(names)
        self.cpt.check_sources(names)
        return self

    @model_validator(mode="after")
    def _before_reasoning_scored(self) -> Recipe:
        ev = self.posttrain.eval if self.posttrain is not None else None
        if ev is not None and ev.before_reasoning:
            if not (self.stages and self.stages[-1].kind == "reasoning"):
                kinds = ", ".join(f"{st.name} ({st.kind})" for st in self.stages) or "none"
                raise ValueError(
                    "posttrain.eval.before_reasoning scores the model the reasoning stages started from, "
                    f"but this recipe's last stage is not a reasoning stage (stages: {kinds})"
                )
            if not ev.base:
                raise ValueError(
                    "posttrain.eval.before_reasoning is compared with the base model's scores: set "
                    "posttrain.eval.base (it is off)"
                )
        return self

    def mixture_weights(self) -> dict[str, float]:
        """The first stage's raw source weights (the fertility rule weighs sources by them)."""
        return load_weights(self.stages[0].mixture) if self.stages else {}

    def source(self, name: str) -> SourceConfig:
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(f"no source {name!r}; sources: {', '.join(s.name for s in self.sources)}")


def recipe_names() -> tuple[str, ...]:
    """The recipes `load_recipe` finds by name (files in configs/), sorted."""
    return tuple(sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml")))


def recipe_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in {".yaml", ".yml"} and path.is_file():
        return path
    candidate = CONFIGS_DIR / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    raise RecipeError(f"no recipe {name_or_path!r}: not a YAML file, nor one of: {', '.join(recipe_names())}")


def _read_recipe(path: Path) -> dict[str, Any]:
    try:
        data = load_yaml(path.read_text(encoding="utf-8")) or {}
    except YamlRefused as exc:  # a repeated key, or nesting and aliases beyond infra/yamlfile.py's bounds
        raise RecipeError(f"recipe {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {path}: invalid YAML{yaml_where(exc)}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path}: expected a mapping at the top level")
    return data


def _derived(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """A recipe written as another plus changes (`base: NAME`, `overrides: [key=value, ...]`, and
    nothing else): the base recipe's data with the changes applied, in order, before any given on
    the command line. One level only: a base is a recipe of configs/ by name and has no base."""
    extra = sorted(set(data) - {"base", "overrides"})
    if extra:
        raise RecipeError(
            f"recipe {path}: a recipe with `base` holds only `base` and `overrides` (also found: {', '.join(extra)})"
        )
    base, items = data["base"], data.get("overrides") or []
    known = recipe_names()
    if not isinstance(base, str) or base not in known:
        got = repr(base) if isinstance(base, str) else type_name(base)
        raise RecipeError(f"recipe {path}: base must name a recipe in configs/ ({', '.join(known)}), got {got}")
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise RecipeError(f"recipe {path}: overrides must be a list of key=value strings")
    base_path = CONFIGS_DIR / f"{base}.yaml"
    out = _read_recipe(base_path)
    if "base" in out:
        raise RecipeError(
            f"recipe {path}: its base {base_path} has a base itself; a recipe derives from one level only"
        )
    for item in items:
        try:
            apply_override(out, item)
        except RecipeError as exc:
            raise RecipeError(f"recipe {path}: {exc}") from None
    return out


def load_recipe(name_or_path: str = "tiny", overrides: Sequence[str] = ()) -> Recipe:
    """Load, override and validate a recipe."""
    path = recipe_path(name_or_path)
    data = _read_recipe(path)
    if "base" in data:
        data = _derived(path, data)
    for item in overrides:
        apply_override(data, item)
    problems = check_numbers(Recipe, data)
    if problems:
        raise RecipeError(
            "\n".join([f"recipe {path} is invalid ({len(problems)} problem(s)):", *(f"  {p}" for p in problems)])
        )
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(format_errors(path, data, exc)) from None


def yaml_where(exc: yaml.YAMLError) -> str:
    """Where and what YAML could not parse, without the snippet of the file PyYAML quotes."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None)
    return f"{where}: {problem}" if problem else where


def type_name(value: Any) -> str:
    """How a value is described in errors: its YAML type, never the value itself."""
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}.get(
        type(value), f"a {type(value).__name__}"
    )


NON_FINITE = "a number that is not finite (inf, nan, or beyond a float's range)"


def _number(value: str) -> Decimal | None:
    try:
        number = Decimal(value.strip())
    except InvalidOperation:
        return None
    return number if number.is_finite() else None


def _non_finite_text(value: str) -> bool:
    """A string a float field would read as inf or nan ("inf", "-Infinity", "nan", "1e400")."""
    try:
        return not math.isfinite(float(value))
    except ValueError:
        return False


def _int_in_range(value: int, where: str) -> list[str]:
    if -INT_MAX - 1 <= value <= INT_MAX:
        return []
    return [f"{where}: expected an integer within -2**63..2**63-1, got an integer of {len(str(abs(value)))} digits"]


def check_numbers(model: Any, data: Any, where: str = "") -> list[str]:
    """Make every int and float field of `model` (recursively through sections, lists of
    sections and mappings) strict, in place: booleans are refused; numeric strings such as
    "1e9" become numbers (ints only when whole); floats with a fraction are refused for ints.
    Returns the problems, each naming the field and the type of value found."""
    problems: list[str] = []
    if not isinstance(data, dict) or not hasattr(model, "model_fields"):
        return problems
    for name, field in model.model_fields.items():
        if name in data:
            here = f"{where}.{name}" if where else name
            data[name], found = _check_value(field.annotation, data[name], here)
            problems += found
    return problems


def _check_value(ann: Any, value: Any, where: str) -> tuple[Any, list[str]]:
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return _check_value(typing.get_args(ann)[0], value, where)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(ann) if a is not type(None)]
        if value is None:
            return value, []
        numeric = [a for a in options if a in (int, float)]
        if numeric and len(numeric) == len(options):
            return _check_value(float if float in numeric else int, value, where)
        models = [a for a in options if hasattr(a, "model_fields")]
        if isinstance(value, dict) and len(models) == 1:
            return value, check_numbers(models[0], value, where)
        return value, []
    if ann in (int, float):
        expected = "an integer" if ann is int else "a finite number"
        if isinstance(value, bool):
            kind = "an integer" if ann is int else "a number"
            return value, [f"{where}: expected {kind}, got a boolean (true and false are not numbers)"]
        if isinstance(value, float) and not math.isfinite(value):
            return value, [f"{where}: expected {expected}, got {NON_FINITE}"]
        if isinstance(value, str) and ann is float and _non_finite_text(value):
            return value, [f"{where}: expected {expected}, got a string holding {NON_FINITE}"]
        if isinstance(value, str) and (number := _number(value)) is not None:
            if ann is float:
                if number != 0 and float(number) == 0:  # "1e-400": a float would read it as 0
                    return value, [f"{where}: expected {expected}, got a number too small for a float (it reads as 0)"]
                return float(number), []
            if number == number.to_integral_value():
                return int(number), _int_in_range(int(number), where)
            return value, [f"{where}: expected an integer, got a string holding a number with a fractional part"]
        if ann is int and isinstance(value, float):
            if not value.is_integer():
                return value, [f"{where}: expected an integer, got a number with a fractional part"]
            return int(value), _int_in_range(int(value), where)
        if ann is int and isinstance(value, int):
            return value, _int_in_range(value, where)
        return value, []
    if hasattr(ann, "model_fields"):
        return value, check_numbers(ann, value, where)
    if origin in (tuple, list) and isinstance(value, list):
        args = [a for a in typing.get_args(ann) if a is not Ellipsis]
        if len(args) == 1 or (args and all(a == args[0] for a in args)):
            problems: list[str] = []
            for i, item in enumerate(value):
                label = item.get("name", i) if isinstance(item, dict) else i
                value[i], found = _check_value(args[0], item, f"{where}[{label}]")
                problems += found
            return value, problems
        return value, []
    if origin is dict and isinstance(value, dict):
        _, vtype = typing.get_args(ann) or (Any, Any)
        problems = []
        for key in list(value):
            value[key], found = _check_value(vtype, value[key], f"{where}.{key}")
            problems += found
        return value, problems
    return value, []


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply `a.b.c=value` in place; list items (sources) are addressed by their name.

    The value is parsed as YAML, so `max_documents=100` is an int and `refresh=[a,b]` a list.
    """
    if "=" not in item:
        raise RecipeError(f"override {item!r} must look like key=value (e.g. seed=1)")
    key, raw = item.split("=", 1)
    try:
        value = load_yaml(raw)
    except YamlRefused as exc:
        raise RecipeError(f"override {key.strip()!r}: {exc}") from None
    except yaml.YAMLError:
        value = raw
    parts = key.strip().split(".")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        node = _child(node, part, parts[: depth + 1], item)
    last = parts[-1]
    if isinstance(node, list):
        raise RecipeError(f"override {item!r}: name a list item by its name, then a field")
    if not isinstance(node, dict):  # `training.optimizer.lr.x=1`: lr holds a value, not fields
        where = ".".join(parts[:-1])
        raise RecipeError(f"override {key.strip()!r}: {where} is {type_name(node)}, not a section with fields")
    node[last] = value


def _child(node: Any, part: str, path: list[str], item: str) -> Any:
    where = ".".join(path)
    if isinstance(node, list):
        for entry in node:
            if isinstance(entry, dict) and entry.get("name") == part:
                return entry
        names = ", ".join(str(e.get("name")) for e in node if isinstance(e, dict))
        raise RecipeError(f"override {item!r}: no item named {part!r} at {where}; names: {names}")
    if not isinstance(node, dict):
        raise RecipeError(f"override {item!r}: {where} is not a section")
    if part not in node or node[part] is None:
        node[part] = {}
    return node[part]


def check_data(recipe: Recipe, *, allow_missing: bool = False, sample: bool = True) -> dict[str, str]:
    """Raise RecipeError naming every source whose data cannot be read as configured (a glob
    that matches nothing, a text field the files lack or that holds no strings; tasks/sources.py
    check_sources), in milliseconds, and every readable source whose preset would curate it
    away (flows/datacheck.py: a sample through the preset), in seconds, before any compute.

    Not part of `load_recipe`: a recipe must load where its data is not (the laptop that
    submits a cluster run whose `files:` paths exist on the cluster only, `lineage` and
    `report` on a copy of the workspace), and hub datasets are not checked offline. Call it
    where data will be read or planned: `smollm3 recipe`, `smollm3 plan`, the flow entry.

    `allow_missing` (the dry run): sources whose data is not on this machine are returned
    (name -> why) instead of refused, and planned as unresolved.

    Also refused: a data step at scale on the local executor with more workers than this
    machine (the flow host) has cores; warned on stderr: other local steps that oversubscribe or
    would take days here, a Slurm time limit below a step's longest task (flows/data_plan.py
    `executor_problems`).
    """
    missing = missing_sources(recipe.sources) if allow_missing else {}
    present = [s for s in recipe.sources if s.name not in missing]
    problems = check_sources(present)
    if not problems and sample:
        from flows.datacheck import preset_problems
        from infra.home import user_cache
        from pipeline.workspace import WorkspaceError, resolve_workspace

        # cached in the workspace once a run made it; before that in the user's cache: a check
        # alone (`recipe`, `plan`) creates no workspace and writes nothing in the current directory
        try:
            root = resolve_workspace(recipe.workspace)
            cache = root / "checks" / "presets" if root.is_dir() else user_cache() / "preset-checks"
        except WorkspaceError:
            cache = user_cache() / "preset-checks"
        problems = preset_problems(recipe.curation, present, recipe.seed, cache)
    from flows.data_plan import executor_problems

    # where the data steps run, for this machine as the flow host (flows/data_plan.py)
    refused, warned = executor_problems(recipe)
    for warning in warned:
        print(f"WARNING: recipe {recipe.name}: {warning}", file=sys.stderr)
    if problems:
        raise RecipeError(
            f"recipe {recipe.name}: {len(problems)} data source problem(s):\n" + "\n".join(f"  {p}" for p in problems)
        )
    if refused:
        raise ExecutorRefused(
            f"recipe {recipe.name}: {len(refused)} data step(s) on this machine at scale:\n"
            + "\n".join(f"  {p}" for p in refused)
        )
    return missing


def _relevant(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pydantic's errors without the echoes of another: a list whose item failed also reports
    `too_short` ("at least 1 item after validation, not 0") at the list itself."""
    locs = [tuple(e["loc"]) for e in errors]
    return [
        e
        for e in errors
        if not (
            e["type"] == "too_short"
            and any(len(other) > len(e["loc"]) and other[: len(e["loc"])] == tuple(e["loc"]) for other in locs)
        )
    ]


def format_errors(path: Path, data: dict[str, Any], exc: ValidationError) -> str:
    errors = _relevant(exc.errors())
    lines = [f"recipe {path} is invalid ({len(errors)} problem(s)):"]
    for err in errors:
        loc = _readable_loc(data, err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = f"unknown field; allowed: {', '.join(_allowed_fields(err['loc']))}"
        got = err.get("input")
        hide = err["type"] in {"extra_forbidden", "missing"} or isinstance(got, dict | list)
        shown = "" if hide else f" (got {type_name(got)})"  # the type only: values may be secrets
        loc = printable(loc or "recipe")  # a mapping key is part of the location: never raw
        lines.append(f"  {loc}: {msg}{shown}")
    return "\n".join(lines)


def _readable_loc(data: dict[str, Any], loc: tuple) -> str:
    """`sources.1.domain` becomes `sources[code].domain` so the user sees which source."""
    out: list[str] = []
    node: Any = data
    for part in loc:
        if isinstance(part, int) and isinstance(node, list):
            entry = node[part] if part < len(node) else None
            label = entry.get("name") if isinstance(entry, dict) else None
            out[-1] = f"{out[-1]}[{label if label is not None else part}]" if out else str(part)
            node = entry
        else:
            out.append(str(part))
            node = node.get(part) if isinstance(node, dict) else None
    return ".".join(out)


def _allowed_fields(loc: tuple) -> list[str]:
    model: Any = Recipe
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            return []
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        model = next((a for a in (ann, *args) if hasattr(a, "model_fields")), None)
        if model is None:
            return []
    return sorted(model.model_fields)


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def run_setup(recipe: Recipe, name: str) -> RunSetup:
    """What the runner needs of a recipe (pipeline/runner.py): its workspace (and S3 mirror), its
    resource slots, and the resolved recipe to record in lineage and save with the run."""
    from pipeline.runner import RunSetup
    from pipeline.workspace import Workspace

    return RunSetup(
        ws=Workspace.at(recipe.workspace, recipe.storage),
        resources=recipe.resources,
        name=name,
        settings=recipe.model_dump(mode="json"),
        settings_text=dump_recipe(recipe),
    )
