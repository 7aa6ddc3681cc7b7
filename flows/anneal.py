"""The `anneal` flow: base checkpoint -> baseline and candidate anneals -> evals -> comparison.

Per run: mixture -> short decay (`pretrain`) -> HF export -> lm-eval, plus held-out loss per
source; the comparison puts every candidate's deltas against the baseline next to their noise.

Served as `anneal/nightly` (cron, concurrency 1) and run on demand. The base checkpoint is
resolved when the run starts (the newest stable-phase checkpoint of the latest `smollm3/full`
run, or the one given) and pinned by copying, so the main run may keep training and pruning.
Reads like the DAG it builds; the logic lives in tasks/anneal.py.
"""

from __future__ import annotations

from prefect import flow

from flows.runner import RunContext
from tasks.anneal import (
    CompareConfig,
    anneal_base,
    anneal_compare,
    anneal_runs,
    anneal_stage,
    heldout_sets,
    resolve_base,
    run_inputs,
    weights_mixture,
)
from tasks.evaluate import evaluate, stage_tasks
from tasks.export import export
from tasks.heldout import HeldoutEval, corpora_of, heldout_eval, heldout_tokens
from tasks.pretrain import pretrain
from tasks.recipe import load_recipe

STEPS = (
    "anneal_base", "heldout_tokens", "weights_mixture", "pretrain", "export", "evaluate",
    "heldout_eval", "anneal_compare",
)


@flow(name="anneal", log_prints=True)
def anneal(
    recipe: str = "tiny",
    overrides: list[str] | None = None,
    base: str = "",
    refresh: list[str] | None = None,
) -> dict:
    """Anneal the recipe's candidate data sources from a base checkpoint and compare them.

    base: "" = the newest stable-phase checkpoint of the latest smollm3 run (resolved now);
    else a checkpoint path or a pretrain artifact fingerprint.
    overrides: `key=value` items over the recipe (e.g. `anneal.tokens=65536`).
    """
    cfg = load_recipe(recipe, overrides or [])
    with RunContext("anneal", cfg, recipe, STEPS, refresh or []) as ctx:
        resolved = resolve_base(ctx.lineage, ctx.ws, cfg.anneal, base, cfg.training.nproc_per_node)
        pinned = ctx.run(anneal_base, resolved, label=f"{resolved.stage}-{resolved.step}")
        shards, tok, suite = run_inputs(ctx.lineage, resolved)
        held = [ctx.run(heldout_tokens, h, [tok, *corpora_of(ctx.lineage, shards)], label=h.domain)
                for h in heldout_sets(cfg.anneal, shards)]
        runs = anneal_runs(cfg.anneal, resolved, cfg.seed)
        scores, labels, candidates = [], [], []
        for run in runs:
            plan = ctx.run(weights_mixture, run.mixture, shards, label=run.label, params={"seed": run.seed})
            ckpt = ctx.run(pretrain, anneal_stage(cfg.anneal, resolved, run), [plan, pinned],
                           label=f"anneal-{run.label}", params={"launch": cfg.launch, "storage": cfg.storage})
            model = ctx.run(export, cfg.export, [ckpt, tok], label=f"anneal-{run.label}")
            scores += [
                ctx.run(evaluate, cfg.eval, [model, suite], label=f"anneal-{run.label}",
                        params={"tasks": stage_tasks(cfg.eval, suite, False)}),
                ctx.run(heldout_eval, HeldoutEval(), [ckpt, *held], label=f"anneal-{run.label}"),
            ]
            labels += [run.label] * 2
            candidates += [run.candidate] * 2
        ctx.run(
            anneal_compare,
            CompareConfig(labels=tuple(labels), candidates=tuple(candidates), metric=cfg.anneal.metric,
                          z_threshold=cfg.anneal.z_threshold, base=pinned.meta),
            scores, label=f"{resolved.stage}-{resolved.step}",
        )
        return ctx.summary()
