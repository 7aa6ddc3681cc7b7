"""Flow parameters as users see them: the run form in the Prefect UI and the CLI's checks.

Prefect builds a flow's parameter schema from its signature (pydantic) and the `Args:` section of
its docstring (descriptions), validates every run's parameters against it (a deployment run with
an unknown step name in `refresh` is refused before the run exists) and draws the run form from it:

- `RecipeParam`: one of the recipes in `configs/` (a drop-down) or the path of a recipe YAML file;
- `step_names(namespace)`: the steps a flow module can run, so `refresh` is a multi-select of
  real step names instead of free text.

The CLI checks `--refresh` against the same names (`check_refresh`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import Field

from flows.recipe import recipe_names
from pipeline.step import StepDef

# Two alternatives, each titled: the UI shows the titles as the choice between them.
RecipeParam = (
    Annotated[Literal[recipe_names()], Field(title="a recipe in configs/")]  # type: ignore[valid-type]
    | Annotated[str, Field(title="the path of a recipe YAML file")]
)


def flow_steps(namespace: Mapping[str, Any]) -> tuple[str, ...]:
    """Names of the steps defined or imported in a flow module's namespace (what its graphs can
    contain), sorted."""
    return tuple(sorted({v.name for v in namespace.values() if isinstance(v, StepDef)}))


def step_names(namespace: Mapping[str, Any]) -> Any:
    """`Literal[...]` of a flow module's step names, for its `refresh` parameter."""
    return Literal[flow_steps(namespace)]  # type: ignore[valid-type]


def check_refresh(flow: str, names: Iterable[str]) -> None:
    """Refuse step names flow `flow` does not have, listing the ones it has (what the run form's
    schema enforces for deployment runs, for the CLI)."""
    import importlib

    steps = flow_steps(vars(importlib.import_module(f"flows.{flow}")))
    unknown = sorted(set(names) - set(steps))
    if unknown:
        raise ValueError(
            f"--refresh names unknown step(s) {', '.join(unknown)}; steps of flow {flow!r}: {', '.join(steps)}"
        )
