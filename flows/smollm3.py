"""The `smollm3` flow: recipe -> data -> token shards (and reasoning traces) -> mixtures -> preflight
-> stages (pretraining, context extension, reasoning mid-training) -> evals -> post-training -> the
run report (one loss curve, one eval table).

`graph(recipe)` is the DAG as a value (pipeline/graph.py): every step with its typed config and
named inputs, fingerprinted before anything runs. The flow runs it (pipeline/runner.py: independent
branches at once, within the recipe's resource slots) and `smollm3 plan` predicts it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from curation.mixtures import load_weights
from evals.report import BASE, BEFORE_REASONING
from flows.params import RecipeParam, step_names
from flows.recipe import Recipe, check_data, load_recipe
from flows.stage_plan import schedule_stages
from pipeline.graph import Graph, Node
from tasks.curate import curate
from tasks.decontaminate import DecontaminateSpec, decontaminate
from tasks.evaluate import EvalSpec, SuiteSpec, eval_suite, evaluate
from tasks.export import export
from tasks.fertility import FertilitySpec, fertility
from tasks.heldout_index import HeldoutIndexSpec, heldout_index
from tasks.mixture import MixtureSpec, mixture
from tasks.posttrain.data import posttrain_data
from tasks.posttrain.distill import distill
from tasks.posttrain.grpo import grpo
from tasks.posttrain.merge import merge
from tasks.posttrain.preference import preference
from tasks.posttrain.preference_pairs import preference_pairs
from tasks.posttrain.sao import sao
from tasks.posttrain.sft import sft
from tasks.preflight import PreflightSpec, preflight
from tasks.pretrain import pretrain
from tasks.reasoning_data import ReasoningDataSpec, reasoning_data
from tasks.run_report import RunReportSpec, run_report
from tasks.sources import SourceSpec, source
from tasks.tokenize import TokenizeSpec, tokenize
from tasks.tokenizer import tokenizer
from trainers.posttrain.sections import ChatDataSpec, MergeSpec, PairsSpec, PosttrainSpec


def graph(cfg: Recipe, *, tolerant: bool = False, run_id: str | None = None) -> Graph:
    """The whole DAG of a recipe (tolerant: unreadable facts mark steps instead of failing)."""
    g = Graph("smollm3", tolerant=tolerant)
    d = data(g, cfg)
    if not cfg.stages:
        return g

    # Training: preflight, eval suite, then every stage -> HF export -> evaluation. Each stage
    # waits for the previous one only: its export and evaluation run beside the next stage.
    threads = cfg.resources.threads("train")
    runs = [
        run.model_copy(update={"launch": run.on(cfg.launch), "storage": cfg.storage, "threads": threads})
        for run in schedule_stages(cfg.training, cfg.stages, cfg.seed)
    ]
    check = g.add(
        preflight,
        PreflightSpec.for_recipe(cfg, run_id, **_where_preflight_runs(runs)),
        label="preflight",
        tokenizer=d.tokenizer,
        mixtures=list(d.plans.values()),
    )
    # Eval items come from the curated held-out splits: text like what is trained on, never in it.
    suite = g.add(
        eval_suite, SuiteSpec(eval=cfg.eval.for_suite(), seed=cfg.seed), label="suite", heldout=d.clean, train=d.clean
    )
    previous: Node | None = None
    extended = None  # the last stage before the reasoning stages, and its export: read past its length
    for run in runs:
        # The first stage waits for preflight (a gate, not an input); later ones for their init.
        init = {"init": previous} if previous is not None else {}
        gate = [check] if previous is None else []
        previous = g.add(
            pretrain,
            run,
            label=run.name,
            mixture=d.plans[run.name],
            after=gate,
            **cfg.training.retry_policy(),
            **init,
        )
        model = g.add(export, cfg.export, label=run.name, checkpoint=previous, tokenizer=d.tokenizer)
        # After context extension (the reasoning stages too): passkeys, and cloze if asked.
        g.add(
            evaluate,
            EvalSpec.of(cfg.eval, long_context=run.kind != "pretrain"),
            label=run.name,
            model=model,
            suite=suite,
        )
        if run.kind != "reasoning":
            extended = (run, model)
    if cfg.eval.beyond_factor is not None and extended:  # past its length, plain RoPE and YaRN
        last, exported = extended
        for yarn in (False, True):
            g.add(
                evaluate,
                EvalSpec.past_training(cfg.eval, last.spec.seq_len, yarn),
                label=f"{last.name}-x{cfg.eval.beyond_factor:g}" + ("-yarn" if yarn else ""),
                model=exported,
                suite=suite,
            )
    final = model
    if cfg.posttrain is not None:
        # The model the reasoning stages started from, when they are the last stages.
        before = extended[1] if extended is not None and extended[1] is not model else None
        final = post_train(g, cfg, model, d.clean, before_reasoning=before)
    # Last: the run-wide loss curve and eval table, from every stage and every evaluation.
    stages = [n for n in g if n.step is pretrain]
    evals = [n for n in g if n.step is evaluate]
    g.add(
        run_report,
        RunReportSpec(
            stages=tuple(n.label for n in stages),
            evals=tuple(n.label for n in evals),
            parents=_reasoning_parent(evals) + started_from(evals),
        ),
        label="smollm3",
        stages=stages,
        evals=evals,
    )
    g.final = final
    return g


def started_from(evals: list[Node]) -> tuple[tuple[str, str], ...]:
    """(label, label) per evaluation of a post-trained model and the evaluation, on the same
    items (suite), of the model its step started from (a merge's: its first model), so the
    report can say whether the step moved the scores beyond noise."""
    scored = {(id(e.inputs["model"]), id(e.inputs["suite"])): e.label for e in evals}
    pairs = []
    for e in evals:
        trained = e.inputs["model"]
        inputs = getattr(trained, "inputs", {})
        start = inputs.get("model") or next(iter(inputs.get("models") or ()), None)
        parent = scored.get((id(start), id(e.inputs["suite"]))) if start is not None else None
        if parent is not None:
            pairs.append((e.label, parent))
    return tuple(pairs)


def _reasoning_parent(evals: list[Node]) -> tuple[tuple[str, str], ...]:
    """("base", "before-reasoning") when post-training's suite scored both the reasoning stages'
    export and the export they started from (`posttrain.eval.before_reasoning`): did reasoning
    mid-training move the scores?"""
    labels = {e.label for e in evals}
    return ((BASE, BEFORE_REASONING),) if {BASE, BEFORE_REASONING} <= labels else ()


def _where_preflight_runs(runs: list) -> dict:
    """On Slurm, the first stage's sized launch (preflight checks its nodes as a job) and what the
    most demanding stage needs of a node; elsewhere nothing (preflight runs in its process)."""
    if not runs or runs[0].launch.kind != "slurm":
        return {}
    needs = [run.host_needs() for run in runs]
    most = max(needs, key=lambda n: n.mem_gb)
    most = dataclasses.replace(most, open_files=max(n.open_files for n in needs))
    return {"launch": runs[0].launch_config(), "needs": most}


@dataclass(frozen=True)
class DataNodes:
    """The data part of the DAG, as the training part reads it."""

    raw: list[Node]  # source corpora, as read
    clean: list[Node]  # curated, decontaminated corpora (their held-out splits feed the eval suites)
    tokenizer: Node  # the tokenizer the shards were made with (or the fertility decision)
    plans: dict[str, Node]  # mixture plan per stage


def data(g: Graph, cfg: Recipe) -> DataNodes:
    """Sources -> curation -> decontamination -> tokenizer -> fertility -> token shards -> mixture
    plans: one branch per source up to the tokenizer, which samples every curated source; the
    held-out index (every source's held-out split) joins the branches at decontamination."""
    raw = {
        s.name: g.add(source, SourceSpec.of(s, cfg.seed, cfg.curation.heldout.max_docs, cfg.curation), label=s.name)
        for s in cfg.sources
    }
    # Each source is curated as soon as it is ingested (filters, dedup: its own data only).
    curated = {s.name: g.add(curate, cfg.curation.for_source(s), label=s.name, corpus=raw[s.name]) for s in cfg.sources}
    # Then its train split is decontaminated against every source's held-out split, indexed once.
    clean = curated
    if cfg.curation.decontamination.enabled:
        index = g.add(
            heldout_index,
            HeldoutIndexSpec.of(cfg.curation, cfg.sources),
            label="heldout",
            corpora=list(raw.values()),
        )
        decont = DecontaminateSpec.of(cfg.curation)
        clean = {
            name: g.add(decontaminate, decont, label=name, corpus=node, index=index) for name, node in curated.items()
        }
    # An adopted tokenizer.json needs no corpora; a trained one samples every curated source.
    if cfg.tokenizer.path:
        tok = g.add(tokenizer, cfg.tokenizer, label="given")
    else:
        tok = g.add(tokenizer, cfg.tokenizer, label="bpe", corpora=list(clean.values()))
    fert = g.add(
        fertility,
        FertilitySpec(fertility=cfg.fertility, weights=cfg.mixture_weights()),
        label="fertility",
        tokenizer=tok,
        corpora=list(clean.values()),
    )
    # When the recipe fixes the tokenizer (no other candidates, or choose: trained), shards depend
    # on the tokenizer itself rather than on the fertility report over every source, so changing
    # one source re-tokenizes only that source.
    chosen = tok if not cfg.fertility.candidates or cfg.fertility.choose == "trained" else fert
    shards = [
        g.add(tokenize, TokenizeSpec(tokenize=cfg.tokenize, seed=cfg.seed), label=name, tokenizer=chosen, corpus=node)
        for name, node in clean.items()
    ]
    # Reasoning traces in ChatML, tokenized like the shards; a stage's mixture takes the ones it
    # weighs (and traces no stage weighs are not made).
    weighs = {st.name: load_weights(st.mixture) for st in cfg.stages}
    traces = {
        r.name: g.add(
            reasoning_data,
            ReasoningDataSpec.of(r, cfg.seed, cfg.tokenize, cfg.reasoning_modes),
            label=r.name,
            tokenizer=chosen,
            heldout=list(clean.values()),
        )
        for r in cfg.reasoning_data
        if any(r.name in w for w in weighs.values())
    }
    plans = {
        st.name: g.add(
            mixture,
            MixtureSpec.of(st, cfg.seed),
            label=st.name,
            shards=shards + [node for name, node in traces.items() if name in weighs[st.name]],
        )
        for st in cfg.stages
    }
    return DataNodes(list(raw.values()), list(clean.values()), chosen, plans)


def post_train(g: Graph, cfg: Recipe, base: Node, clean: list[Node], before_reasoning: Node | None = None) -> Node:
    """SFT -> [on-policy preference pairs per mode] -> APO (a soup of preference runs, merged) ->
    linear merge with a mid-training or
    long-context checkpoint -> GRPO -> optional on-policy distillation (docs/posttraining.md).
    Every model is scored on the cloze tasks plus held-out arithmetic exact match, under its label
    (base, sft, apo and each soup run, soup, merge, grpo, opd). With `posttrain.eval.before_reasoning`,
    `before_reasoning` (the export the reasoning stages started from) is scored too, as
    before-reasoning. Trainers run as launched jobs on `posttrain.launch` over the recipe's
    `launch` (trainers/posttrain/launch.py)."""
    pt = cfg.posttrain
    suite = g.add(
        eval_suite,
        SuiteSpec(
            eval=cfg.eval.for_suite().model_copy(
                update={"items_per_task": pt.eval.cloze_items, "beyond_passkey_words": None}
            ),
            seed=cfg.seed,
            generation_items=pt.eval.generation_items,
            max_gen_tokens=pt.eval.max_gen_tokens,
            think_gen_tokens=pt.eval.think_gen_tokens,
            modes=cfg.reasoning_modes,
        ),
        label="posttrain",
        heldout=clean,
        train=clean,
    )
    scoring = EvalSpec.of(cfg.eval.model_copy(update={"batch_size": pt.eval.batch_size}))
    launch = pt.launch.resolve(cfg.launch, cfg.training.nproc_per_node)

    def score(model: Node, label: str) -> None:
        g.add(evaluate, scoring, label=label, model=model, suite=suite)

    def run(section, seed: int | None = None) -> PosttrainSpec:
        return PosttrainSpec.of(
            section,
            pt,
            launch=launch,
            storage=cfg.storage,
            threads=cfg.resources.threads("train"),
            seed=seed,
            tracker=cfg.training.tracker,
        )

    if pt.eval.base:
        if pt.eval.before_reasoning and before_reasoning is not None:
            score(before_reasoning, BEFORE_REASONING)
        score(base, BASE)
    chat = ChatDataSpec(data=pt.data, seed=pt.seed, modes=cfg.reasoning_modes)
    data = g.add(posttrain_data, chat, label="chat", corpora=clean)
    model = g.add(sft, run(pt.sft), label="sft", model=base, data=data)
    score(model, "sft")
    if pt.preference.enabled:
        tuned = model
        pairs = data
        if pt.preference.pairs == "on_policy":  # per mode: the SFT model's answers against stronger ones
            spec = PairsSpec(pairs=pt.pairs, seed=pt.seed, device=pt.device, modes=cfg.reasoning_modes)
            pairs = g.add(preference_pairs, spec, label="pairs", model=tuned, data=data)
        label = "apo" if pt.preference.loss_type.startswith("apo") else pt.preference.loss_type
        model = g.add(preference, run(pt.preference), label=label, model=tuned, data=pairs)
        score(model, label)
        if pt.merge.enabled and pt.merge.soup:
            # SmolLM3 merged a soup of APO checkpoints: more preference runs from the same SFT model
            ingredients = [model]
            for extra in pt.merge.soup:
                node = g.add(
                    preference, run(extra.apply(pt.preference), extra.seed), label=extra.name, model=tuned, data=pairs
                )
                score(node, extra.name)
                ingredients.append(node)
            model = g.add(merge, MergeSpec(weights=pt.merge.soup_mix()), label="soup", models=ingredients)
            score(model, "soup")
    if pt.merge.enabled:
        other = base
        if pt.merge.stage is not None:
            try:
                other = g.node(f"export[{pt.merge.stage}]")
            except KeyError:
                stages = ", ".join(st.name for st in cfg.stages) or "none"
                raise ValueError(
                    f"posttrain.merge.stage {pt.merge.stage!r} is not a stage of this recipe "
                    f"(stages: {stages}); name one, or leave it unset for the model "
                    "post-training starts from"
                ) from None
        model = g.add(merge, MergeSpec(weights=pt.merge.weights), label="merge", models=[model, other])
        score(model, "merge")
    if pt.sao.enabled:  # beside GRPO, from the same model: single-rollout asynchronous RL, one rank
        one = {
            "nodes": 1,
            "procs_per_node": 1,
            "gpus_per_node": min(launch.gpus_per_node, 1),
            "accelerate_config": None,
        }
        single = launch.model_copy(update=one)
        rl = PosttrainSpec.of(
            pt.sao,
            pt,
            launch=single,
            storage=cfg.storage,
            threads=cfg.resources.threads("train"),
            tracker=cfg.training.tracker,
        )
        score(g.add(sao, rl, label="sao", model=model, data=data), "sao")
    if pt.grpo.enabled:
        model = g.add(grpo, run(pt.grpo), label="grpo", model=model, data=data)
        score(model, "grpo")
    if pt.distill.teacher:
        model = g.add(distill, run(pt.distill), label="opd", model=model, data=data)
        score(model, "opd")
    return model


Step = step_names(globals())  # every step this module's graph can hold (the `refresh` choices)


def run_smollm3(
    recipe: RecipeParam = "tiny", overrides: list[str] | None = None, refresh: list[Step] | None = None
) -> dict:
    """Train SmolLM3 end to end from a recipe: data, tokenizer, shards, mixtures, preflight,
    pretraining stages with their exports and evaluations, post-training.

    Args:
        recipe: A recipe in configs/ (tiny: the CPU recipe, minutes; smollm3-3b: the published
            3B run) or the path of a recipe YAML file.
        overrides: `key=value` items applied over the recipe, list items addressed by name, e.g.
            `sources.math.max_documents=100`, `stages.stage2.tokens=1e9`, `stages=[]`.
        refresh: Steps to rebuild even when their finished folder exists, e.g. `preflight` to
            measure this host again; the others reuse what is finished.
    """
    from prefect.runtime import flow_run

    from flows.recipe import run_setup
    from pipeline.runner import run_flow

    cfg = load_recipe(recipe, overrides or [])  # an invalid recipe fails before any step
    check_data(cfg)  # so does a source whose data cannot be read as configured
    dag = graph(cfg, run_id=str(flow_run.id) if flow_run.id else None)  # unreadable input data fails here
    return run_flow("smollm3", dag, run_setup(cfg, recipe), refresh or [])
