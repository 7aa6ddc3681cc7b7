"""The `cpt` flow: continued pretraining onto a new domain with replay and a forgetting monitor.

base (checkpoint, HF folder or fingerprint) -> pinned base -> domain + replay mixture -> one
fresh-optimizer WSD stage at a tenth of the peak LR -> held-out loss on both domains at every
eval interval, with forgetting flags -> HF export. The logic lives in tasks/cpt.py and
tasks/pin.py; `graph` is the DAG as a value (the flow runs it, `smollm3 plan` predicts it).
"""

from __future__ import annotations

from flows.params import RecipeParam, step_names
from flows.recipe import Recipe, load_recipe
from pipeline.graph import Given, Graph
from pipeline.lineage import Lineage
from pipeline.workspace import Workspace
from tasks.cpt import cpt_monitor, cpt_stage, cpt_weights, general_weights, heldout_configs
from tasks.export import export
from tasks.heldout import heldout_tokens
from tasks.mixture import WeightsMixtureSpec, weights_mixture
from tasks.pin import BaseCheckpoint, pin, resolve_base
from tasks.pretrain import pretrain


def resolve(cfg: Recipe, base: str = "") -> BaseCheckpoint:
    """The CPT base, read from the workspace's lineage now."""
    ws = Workspace.at(cfg.workspace)
    return resolve_base(Lineage(ws.lineage_path), ws, base, phase="last", allow_hf=True)


def graph(cfg: Recipe, base: BaseCheckpoint, *, tolerant: bool = False) -> Graph:
    c = cfg.cpt
    lineage = Lineage(Workspace.at(cfg.workspace).lineage_path)
    general = general_weights(c, base.weights)
    shards = [Given(a) for a in lineage.get_many(base.shards)]
    tok = Given(lineage.get(base.tokenizer))
    corpora = [Given(x) for s in base.shards for x in lineage.inputs_of(s, kind="corpus")]
    g = Graph("cpt", tolerant=tolerant)
    pinned = g.add(pin, base.pin_spec(), label=base.label)
    plan = g.add(
        weights_mixture,
        WeightsMixtureSpec(
            name="cpt", weights=cpt_weights(c, general), tokens=c.tokens, seq_len=base.seq_len, seed=cfg.seed
        ),
        label="cpt",
        shards=shards,
    )
    held = [
        g.add(heldout_tokens, h, label=h.domain, tokenizer=tok, corpora=corpora) for h in heldout_configs(c, general)
    ]
    run = cpt_stage(c, base, cfg.training.nproc_per_node, cfg.resources.threads("train"))
    run = run.model_copy(update={"launch": cfg.launch, "storage": cfg.storage})
    stage = g.add(pretrain, run, label="cpt", mixture=plan, init=pinned)
    g.add(cpt_monitor, c, label="cpt", base=pinned, stage=stage, heldout=held)
    g.add(export, cfg.export, label="cpt", checkpoint=stage, tokenizer=tok)
    return g


Step = step_names(globals())  # every step this module's graph can hold (the `refresh` choices)


def run_cpt(
    recipe: RecipeParam = "tiny",
    overrides: list[str] | None = None,
    base: str = "",
    refresh: list[Step] | None = None,
) -> dict:
    """Continue pretraining a base checkpoint on the recipe's `cpt.domain` sources with general
    replay, watching held-out loss on both domains for forgetting.

    Args:
        recipe: A recipe in configs/ or the path of a recipe YAML file; its `cpt` section names
            the domain sources, the replay share, the tokens and the LR.
        overrides: `key=value` items applied over the recipe, e.g. `cpt.tokens=65536`.
        base: Empty: the last pretrain stage of the latest smollm3 run; else a checkpoint path,
            an HF `save_pretrained` folder or a checkpoint artifact fingerprint.
        refresh: Steps to rebuild even when their finished folder exists.
    """
    from flows.recipe import run_setup
    from pipeline.runner import run_flow

    cfg = load_recipe(recipe, overrides or [])
    return run_flow("cpt", graph(cfg, resolve(cfg, base)), run_setup(cfg, recipe), refresh or [])
