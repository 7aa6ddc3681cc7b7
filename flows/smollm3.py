"""The `smollm3` flow: recipe -> data -> token shards -> mixtures -> preflight -> stages -> evals.

Reads like the DAG it builds; every call is one cached, fingerprinted step (see tasks/step.py).
"""

from __future__ import annotations

from prefect import flow

from flows.runner import RunContext
from tasks.curate import curate
from tasks.evaluate import eval_suite, evaluate, stage_tasks
from tasks.export import export
from tasks.fertility import fertility
from tasks.mixture import mixture
from tasks.posttrain.data import posttrain_data
from tasks.posttrain.distill import distill
from tasks.posttrain.grpo import grpo
from tasks.posttrain.merge import merge
from tasks.posttrain.preference import preference
from tasks.posttrain.sft import sft
from tasks.preflight import preflight, recipe_facts
from tasks.pretrain import pretrain, schedule_stages, training_facts
from tasks.recipe import Recipe, load_recipe
from tasks.sources import source
from tasks.tokenize import tokenize
from tasks.tokenizer import tokenizer

STEPS = (
    "source", "curate", "tokenizer", "fertility", "tokenize", "mixture", "preflight",
    "eval_suite", "pretrain", "export", "evaluate",
    "posttrain_data", "sft", "preference", "merge", "grpo", "distill",
)


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
        dag(ctx, cfg)
        return ctx.summary()


def dag(ctx, cfg: Recipe) -> None:
    """The DAG itself, shared by the flow (a RunContext runs each step) and by `smollm3 plan`
    (a PlanContext only computes fingerprints and looks for finished step folders)."""
    # Data: sources -> curated corpora -> tokenizer -> fertility -> token shards -> mixtures.
    corpora = {s.name: ctx.run(source, s, label=s.name, params={"seed": cfg.seed}) for s in cfg.sources}
    curated = {n: ctx.run(curate, cfg.curation, [c], label=n) for n, c in corpora.items()}
    # An adopted tokenizer.json needs no corpora; a trained one samples every curated source.
    tok = ctx.run(
        tokenizer, cfg.tokenizer, [] if cfg.tokenizer.path else list(curated.values()),
        label="given" if cfg.tokenizer.path else "bpe",
    )
    fert = ctx.run(
        fertility, cfg.fertility, [tok, *curated.values()], label="fertility",
        params={"weights": cfg.mixture_weights()},
    )
    # When the recipe fixes the tokenizer (no other candidates, or choose: trained), shards depend
    # on the tokenizer itself rather than on the fertility report over every source, so changing
    # one source re-tokenizes only that source.
    chosen = tok if not cfg.fertility.candidates or cfg.fertility.choose == "trained" else fert
    shards = [
        ctx.run(tokenize, cfg.tokenize, [chosen, c], label=n, params={"seed": cfg.seed})
        for n, c in curated.items()
    ]
    plans = {
        st.name: ctx.run(mixture, st, shards, label=st.name, params={"seed": cfg.seed})
        for st in cfg.stages
    }
    if not cfg.stages:
        return

    # Training: preflight, eval suite, then every stage -> HF export -> evaluation.
    vocab = (fert.meta.get("selected") or chosen.meta).get("vocab_size", cfg.tokenizer.vocab_size)
    facts = recipe_facts(
        cfg, tuple(plans.values()), **training_facts(cfg.training, vocab, len(cfg.stages))
    )
    ctx.run(preflight, cfg.preflight, label="preflight",
            params={"facts": facts.to_dict(), "run_id": ctx.run_id})
    suite = ctx.run(
        eval_suite, cfg.eval, [*corpora.values(), *curated.values()], label="suite",
        params={"seed": cfg.seed, "n_sources": len(corpora)},
    )
    previous = None
    for run in schedule_stages(cfg.training, cfg.stages):
        inputs = [plans[run.stage.name], *([previous] if previous else [])]
        previous = ctx.run(pretrain, run, inputs, label=run.stage.name,
                           params={"launch": cfg.launch, "storage": cfg.storage})
        model = ctx.run(export, cfg.export, [previous, chosen], label=run.stage.name)
        ctx.run(
            evaluate, cfg.eval, [model, suite], label=run.stage.name,
            params={"tasks": stage_tasks(cfg.eval, suite, run.kind == "long_context")},
        )

    # Post-training on the last (long-context) export, each step scored like the stages.
    if cfg.posttrain is not None:
        post_train(ctx, cfg, model, list(corpora.values()), list(curated.values()))


def post_train(ctx, cfg: Recipe, base, corpora: list, curated: list) -> None:
    """SFT -> APO -> linear merge with the long-context base -> GRPO -> optional on-policy
    distillation (docs/posttraining.md); every model is scored on the cloze tasks plus held-out
    arithmetic exact match, under its label (base, sft, apo, merge, grpo, opd)."""
    pt = cfg.posttrain
    run = {"seed": pt.seed, "device": pt.device}
    suite = ctx.run(
        eval_suite, cfg.eval.model_copy(update={"items_per_task": pt.eval.cloze_items}),
        [*corpora, *curated], label="posttrain",
        params={"seed": cfg.seed, "n_sources": len(corpora),
                "generation_items": pt.eval.generation_items, "max_gen_tokens": pt.eval.max_gen_tokens},
    )
    tasks = stage_tasks(cfg.eval, suite, long_context=False)
    scoring = cfg.eval.model_copy(update={"batch_size": pt.eval.batch_size})

    def score(model, label: str) -> None:
        ctx.run(evaluate, scoring, [model, suite], label=label, params={"tasks": tasks})

    if pt.eval.base:
        score(base, "base")
    data = ctx.run(posttrain_data, pt.data, curated, label="chat", params={"seed": pt.seed})
    model = ctx.run(sft, pt.sft, [base, data], label="sft", params=run)
    score(model, "sft")
    if pt.preference.enabled:
        label = "apo" if pt.preference.loss_type.startswith("apo") else pt.preference.loss_type
        model = ctx.run(preference, pt.preference, [model, data], label=label, params=run)
        score(model, label)
    if pt.merge.enabled:
        model = ctx.run(merge, pt.merge, [model, base], label="merge")
        score(model, "merge")
    if pt.grpo.enabled:
        model = ctx.run(grpo, pt.grpo, [model, data], label="grpo", params=run)
        score(model, "grpo")
    if pt.distill.teacher:
        model = ctx.run(distill, pt.distill, [model, data], label="opd", params=run)
        score(model, "opd")
