"""The `smollm3` flow: recipe -> data sources -> ... -> model. Reads like the DAG it builds."""

from __future__ import annotations

from prefect import flow

from flows.runner import RunContext
from tasks.recipe import load_recipe
from tasks.sources import source

STEPS = ("source",)


@flow(name="smollm3", log_prints=True)
def smollm3(
    recipe: str = "tiny", overrides: list[str] | None = None, refresh: list[str] | None = None
) -> dict:
    """Train SmolLM3 end to end from `recipe` (a name in configs/ or a path).

    overrides: `key=value` items applied over the recipe (e.g. `sources.math.max_documents=100`).
    refresh: step names to rerun even when a finished result exists.
    """
    cfg = load_recipe(recipe, overrides or [])  # an invalid recipe fails before any step
    with RunContext("smollm3", cfg, recipe, STEPS, refresh or []) as ctx:
        corpora = {
            s.name: ctx.run(source, s, label=s.name, params={"seed": cfg.seed}) for s in cfg.sources
        }
        del corpora  # consumed by curation once it lands
        return ctx.summary()
