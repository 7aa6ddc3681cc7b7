"""The `cpt` flow: continued pretraining onto a new domain with replay and a forgetting monitor.

base (checkpoint, HF folder or fingerprint) -> pinned base -> domain + replay mixture -> one
fresh-optimizer WSD stage at a tenth of the peak LR -> held-out loss on both domains at every
eval interval, with forgetting flags -> HF export. The logic lives in tasks/cpt.py.
"""

from __future__ import annotations

from prefect import flow

from flows.runner import RunContext
from tasks.anneal import WeightsMixture, artifacts, weights_mixture
from tasks.cpt import (
    cpt_base,
    cpt_monitor,
    cpt_stage,
    cpt_weights,
    general_weights,
    heldout_configs,
    resolve_cpt_base,
)
from tasks.export import export
from tasks.heldout import corpora_of, heldout_tokens
from tasks.pretrain import pretrain
from tasks.recipe import load_recipe

STEPS = ("cpt_base", "weights_mixture", "heldout_tokens", "pretrain", "cpt_monitor", "export")


@flow(name="cpt", log_prints=True)
def cpt(
    recipe: str = "tiny",
    overrides: list[str] | None = None,
    base: str = "",
    refresh: list[str] | None = None,
) -> dict:
    """Continue pretraining `base` on the recipe's `cpt.domain` sources with general replay.

    base: "" = the last pretrain stage of the latest smollm3 run; else a checkpoint path, an HF
    `save_pretrained` folder or a checkpoint artifact fingerprint.
    """
    cfg = load_recipe(recipe, overrides or [])
    c = cfg.cpt
    with RunContext("cpt", cfg, recipe, STEPS, refresh or []) as ctx:
        resolved = resolve_cpt_base(ctx.lineage, ctx.ws, base, nproc_per_node=cfg.training.nproc_per_node)
        data = resolved.context
        general = general_weights(c, data.weights)
        pinned = ctx.run(cpt_base, resolved, label=resolved.kind)
        shards = artifacts(ctx.lineage, data.shards)
        (tok,) = artifacts(ctx.lineage, [data.tokenizer])
        corpora = corpora_of(ctx.lineage, shards)
        plan = ctx.run(
            weights_mixture,
            WeightsMixture(name="cpt", weights=cpt_weights(c, general), tokens=c.tokens, seq_len=data.seq_len),
            shards, label="cpt", params={"seed": cfg.seed},
        )
        held = [ctx.run(heldout_tokens, h, [tok, *corpora], label=h.domain) for h in heldout_configs(c, general)]
        stage = ctx.run(pretrain, cpt_stage(c, data, pinned.meta["model_config"]), [plan, pinned], label="cpt",
                        params={"launch": cfg.launch, "storage": cfg.storage})
        ctx.run(cpt_monitor, c, [pinned, stage, *held], label="cpt")
        ctx.run(export, cfg.export, [stage, tok], label="cpt")
        return ctx.summary()
