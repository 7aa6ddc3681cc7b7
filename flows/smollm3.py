"""The `smollm3` flow: recipe -> data sources -> ... -> model. Reads like the DAG it builds."""

from __future__ import annotations

from prefect import flow

from flows.runner import RunContext
from tasks.curate import curate
from tasks.fertility import fertility
from tasks.mixture import mixture
from tasks.recipe import load_recipe
from tasks.sources import source
from tasks.tokenize import tokenize
from tasks.tokenizer import tokenizer

STEPS = ("source", "curate", "tokenizer", "fertility", "tokenize", "mixture")


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
        curated = {n: ctx.run(curate, cfg.curation, [c], label=n) for n, c in corpora.items()}
        tok = ctx.run(tokenizer, cfg.tokenizer, list(curated.values()), label="bpe")
        fert = ctx.run(
            fertility, cfg.fertility, [tok, *curated.values()], label="fertility",
            params={"weights": cfg.mixture_weights()},
        )
        shards = [
            ctx.run(tokenize, cfg.tokenize, [fert, c], label=n, params={"seed": cfg.seed})
            for n, c in curated.items()
        ]
        plans = {
            st.name: ctx.run(mixture, st, shards, label=st.name, params={"seed": cfg.seed})
            for st in cfg.stages
        }
        del plans  # consumed by pretraining once it lands
        return ctx.summary()
