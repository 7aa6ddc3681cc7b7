"""The `smollm3` flow: recipe -> data -> token shards -> mixtures -> preflight -> stages -> evals
-> post-training -> the run report (one loss curve, one eval table).

`graph(recipe)` is the DAG as a value (flows/graph.py): every step with its typed config and
named inputs, fingerprinted before anything runs. The flow runs it (flows/runner.py: independent
branches at once, within the recipe's resource slots) and `smollm3 plan` predicts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.graph import Graph, Node
from flows.runner import run_flow
from tasks.curate import curate
from tasks.evaluate import EvalSpec, SuiteSpec, eval_suite, evaluate
from tasks.export import export
from tasks.fertility import FertilitySpec, fertility
from tasks.mixture import MixtureSpec, mixture
from tasks.posttrain.config import ChatDataSpec, TrainerRun
from tasks.posttrain.data import posttrain_data
from tasks.posttrain.distill import distill
from tasks.posttrain.grpo import grpo
from tasks.posttrain.merge import merge
from tasks.posttrain.preference import preference
from tasks.posttrain.sft import sft
from tasks.preflight import preflight, spec_for
from tasks.pretrain import pretrain, schedule_stages
from tasks.recipe import Recipe, check_data, load_recipe
from tasks.run_report import RunReportSpec, run_report
from tasks.sources import SourceSpec, source
from tasks.tokenize import TokenizeSpec, tokenize
from tasks.tokenizer import tokenizer


def graph(cfg: Recipe, *, tolerant: bool = False, run_id: str | None = None) -> Graph:
    """The whole DAG of a recipe (tolerant: unreadable facts mark steps instead of failing)."""
    g = Graph("smollm3", tolerant=tolerant)
    d = data(g, cfg)
    if not cfg.stages:
        return g

    # Training: preflight, eval suite, then every stage -> HF export -> evaluation. Each stage
    # waits for the previous one only: its export and evaluation run beside the next stage.
    check = g.add(preflight, spec_for(cfg, run_id), label="preflight", tokenizer=d.tokenizer,
                  mixtures=list(d.plans.values()))
    # Eval items come from the curated held-out splits: text like what is trained on, never in it.
    suite = g.add(eval_suite, SuiteSpec(eval=cfg.eval.for_suite(), seed=cfg.seed), label="suite",
                  heldout=d.clean, train=d.clean)
    previous: Node | None = None
    threads = cfg.resources.threads("train")
    for run in schedule_stages(cfg.training, cfg.stages, cfg.seed):
        run = run.model_copy(update={"launch": cfg.launch, "storage": cfg.storage, "threads": threads})
        # The first stage waits for preflight (a gate, not an input); later ones for their init.
        init = {"init": previous} if previous is not None else {}
        gate = [check] if previous is None else []
        previous = g.add(pretrain, run, label=run.name, mixture=d.plans[run.name], after=gate, **init)
        model = g.add(export, cfg.export, label=run.name, checkpoint=previous, tokenizer=d.tokenizer)
        g.add(evaluate, EvalSpec(eval=cfg.eval.for_run(), long_context=run.kind == "long_context"), label=run.name,
              model=model, suite=suite)
    final = model
    if cfg.posttrain is not None:
        final = post_train(g, cfg, model, d.clean)
    # Last: the run-wide loss curve and eval table, from every stage and every evaluation.
    stages = [n for n in g if n.step is pretrain]
    evals = [n for n in g if n.step is evaluate]
    g.add(run_report, RunReportSpec(stages=tuple(n.label for n in stages), evals=tuple(n.label for n in evals)),
          label="smollm3", stages=stages, evals=evals)
    g.final = final
    return g


@dataclass(frozen=True)
class DataNodes:
    """The data part of the DAG, as the training part reads it."""

    raw: list[Node]  # source corpora, as read
    clean: list[Node]  # curated corpora (their held-out splits feed the eval suites)
    tokenizer: Node  # the tokenizer the shards were made with (or the fertility decision)
    plans: dict[str, Node]  # mixture plan per stage


def data(g: Graph, cfg: Recipe) -> DataNodes:
    """Sources -> curation -> tokenizer -> fertility -> token shards -> mixture plans: one branch
    per source up to the tokenizer, which samples every curated source."""
    raw = {s.name: g.add(source, SourceSpec.of(s, cfg.seed), label=s.name) for s in cfg.sources}
    # Each source's train split is decontaminated against every source's held-out split.
    clean = {
        s.name: g.add(curate, cfg.curation.for_source(s.name), label=s.name, corpus=raw[s.name],
                      others=[raw[o.name] for o in cfg.sources if o.name != s.name])
        for s in cfg.sources
    }
    # An adopted tokenizer.json needs no corpora; a trained one samples every curated source.
    if cfg.tokenizer.path:
        tok = g.add(tokenizer, cfg.tokenizer, label="given")
    else:
        tok = g.add(tokenizer, cfg.tokenizer, label="bpe", corpora=list(clean.values()))
    fert = g.add(fertility, FertilitySpec(fertility=cfg.fertility, weights=cfg.mixture_weights()),
                 label="fertility", tokenizer=tok, corpora=list(clean.values()))
    # When the recipe fixes the tokenizer (no other candidates, or choose: trained), shards depend
    # on the tokenizer itself rather than on the fertility report over every source, so changing
    # one source re-tokenizes only that source.
    chosen = tok if not cfg.fertility.candidates or cfg.fertility.choose == "trained" else fert
    shards = [
        g.add(tokenize, TokenizeSpec(tokenize=cfg.tokenize, seed=cfg.seed), label=name,
              tokenizer=chosen, corpus=node)
        for name, node in clean.items()
    ]
    plans = {st.name: g.add(mixture, MixtureSpec.of(st, cfg.seed), label=st.name, shards=shards)
             for st in cfg.stages}
    return DataNodes(list(raw.values()), list(clean.values()), chosen, plans)


def post_train(g: Graph, cfg: Recipe, base: Node, clean: list[Node]) -> Node:
    """SFT -> APO -> linear merge with the long-context base -> GRPO -> optional on-policy
    distillation (docs/posttraining.md); every model is scored on the cloze tasks plus held-out
    arithmetic exact match, under its label (base, sft, apo, merge, grpo, opd)."""
    pt = cfg.posttrain
    suite = g.add(
        eval_suite,
        SuiteSpec(eval=cfg.eval.for_suite().model_copy(update={"items_per_task": pt.eval.cloze_items}),
                  seed=cfg.seed, generation_items=pt.eval.generation_items,
                  max_gen_tokens=pt.eval.max_gen_tokens),
        label="posttrain", heldout=clean, train=clean,
    )
    scoring = EvalSpec(eval=cfg.eval.for_run().model_copy(update={"batch_size": pt.eval.batch_size}))

    def score(model: Node, label: str) -> None:
        g.add(evaluate, scoring, label=label, model=model, suite=suite)

    if pt.eval.base:
        score(base, "base")
    data = g.add(posttrain_data, ChatDataSpec(data=pt.data, seed=pt.seed), label="chat", corpora=clean)
    model = g.add(sft, TrainerRun.of(pt.sft, pt), label="sft", model=base, data=data)
    score(model, "sft")
    if pt.preference.enabled:
        label = "apo" if pt.preference.loss_type.startswith("apo") else pt.preference.loss_type
        model = g.add(preference, TrainerRun.of(pt.preference, pt), label=label, model=model, data=data)
        score(model, label)
    if pt.merge.enabled:
        model = g.add(merge, pt.merge, label="merge", models=[model, base])
        score(model, "merge")
    if pt.grpo.enabled:
        model = g.add(grpo, TrainerRun.of(pt.grpo, pt), label="grpo", model=model, data=data)
        score(model, "grpo")
    if pt.distill.teacher:
        model = g.add(distill, TrainerRun.of(pt.distill, pt), label="opd", model=model, data=data)
        score(model, "opd")
    return model


@flow(name="smollm3", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=256))
def smollm3(
    recipe: str = "tiny", overrides: list[str] | None = None, refresh: list[str] | None = None
) -> dict:
    """Train SmolLM3 end to end from `recipe` (a name in configs/ or a path).

    overrides: `key=value` items applied over the recipe (e.g. `sources.math.max_documents=100`).
    refresh: step names to rerun even when a finished result exists.
    """
    from prefect.runtime import flow_run

    cfg = load_recipe(recipe, overrides or [])  # an invalid recipe fails before any step
    check_data(cfg)  # so does a source whose data cannot be read as configured
    dag = graph(cfg, run_id=str(flow_run.id) if flow_run.id else None)  # unreadable input data fails here
    return run_flow("smollm3", dag, cfg, recipe, refresh or [])
