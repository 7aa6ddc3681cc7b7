"""The `ablation` flow: a baseline recipe and named variants, each trained with several seeds, and
a comparison that trusts only the evals carrying signal (evals/experiments.py).

`graph(arms, spec)` lays the whole experiment out as one DAG. Every arm (the baseline, then each
variant: the recipe with the variant's overrides) adds its steps through `Arm`, which returns the
node already in the graph when a step is identical (same step, same fingerprint): the data,
tokenizer, shards, eval suite and held-out sets a variant shares with the baseline appear once and
are built once; a variant that changes them gets its own, labelled with its name. Per arm and
seed k (init seed and data-order seed = recipe seed + k), the recipe's pretrain stages train
with a checkpoint kept every `eval_every` steps; each stage's held-out bits per byte is measured
at every kept checkpoint, and lm-eval (cloze) runs after each stage (or the last, or never). The
`compare` step reads them all. Runs are independent branches: variants x seeds train side by side
within the recipe's `resources.train.slots`.

Served as `ablation/on-demand`; `smollm3 ablate RECIPE --variant NAME:key=value,... --seeds N`
runs it in-process. An anneal (flows/anneal.py) is another experiment on the same comparison
(`add_comparison`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from evals.experiments import BASELINE, AblationConfig, ExperimentSpec, RunRef, TrustConfig, Variant, parse_variant
from evals.quality import CRITERIA
from flows.recipe import Recipe, RecipeError, check_data, load_recipe
from flows.smollm3 import data
from flows.stage_plan import schedule_stages
from pipeline.artifact import identity
from pipeline.graph import Graph, Node
from tasks.compare import compare
from tasks.evaluate import EvalSpec, SuiteSpec, eval_suite, evaluate
from tasks.export import export
from tasks.heldout import HeldoutEvalSpec, HeldoutSpec, heldout_eval, heldout_tokens
from tasks.mixture import MixtureSpec, mixture
from tasks.preflight import PreflightSpec, preflight
from tasks.pretrain import pretrain

# Settings of the run, not of a model: every arm trains in one flow run with the baseline's.
RUN_LEVEL = ("workspace", "resources", "launch", "storage")
EVAL_POINTS = 8  # evaluated checkpoints per run when eval_every is not given


@dataclass(frozen=True)
class Arm:
    """One arm's view of the experiment graph (what flows/smollm3.py `data` adds to): a step
    identical to one already added is that node, whatever its label; any other step is labelled
    with the arm's prefix ("" for the baseline, "NAME." for a variant)."""

    graph: Graph
    prefix: str

    def add(self, step, config, *, label: str, **kw) -> Node:
        return self.graph.add(step, config, label=f"{self.prefix}{label}", reuse=True, **kw)


def arm_recipes(recipe: str, overrides: Sequence[str], variants: Sequence[Variant]) -> dict[str, Recipe]:
    """The baseline recipe and each variant's (the recipe with the variant's overrides after the
    common ones), checked before anything runs."""
    from model.config import ModelConfig

    base = load_recipe(recipe, overrides)
    arms = {BASELINE: base}
    for v in variants:
        try:
            cfg = load_recipe(recipe, [*overrides, *v.overrides])
        except RecipeError as err:
            raise RecipeError(f"variant {v.name}: {err}") from None
        if cfg == base:
            raise ValueError(f"variant {v.name}: its overrides {list(v.overrides)} leave the recipe unchanged")
        changed = [f for f in RUN_LEVEL if getattr(cfg, f) != getattr(base, f)]
        if changed:
            raise ValueError(
                f"variant {v.name} changes {', '.join(changed)}: those are settings of the whole "
                "run, give them as overrides of the ablation instead"
            )
        if identity(cfg) == identity(base):  # every step would be the baseline's own
            raise ValueError(
                f"variant {v.name}: its overrides {list(v.overrides)} change only how steps run "
                "(operational fields), not what they compute: it would be the baseline again"
            )
        arms[v.name] = cfg
    for name, cfg in arms.items():
        t = cfg.training
        try:  # a model the trainer could not build fails here, not after the data steps
            ModelConfig.from_preset(t.model, **{**t.model_overrides, "vocab_size": cfg.tokenizer.vocab_size})
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"{'the recipe' if name == BASELINE else 'variant ' + name}: training.model_overrides: {err}"
            ) from None
        if not any(s.kind == "pretrain" for s in cfg.stages):
            raise ValueError(f"{name}: the recipe has no pretrain stage to train")
    return arms


def add_comparison(
    g: Graph,
    cfg: ExperimentSpec,
    lm: Mapping[str, Sequence[Node]],
    heldout: Mapping[str, Sequence[Node]],
    label: str,
    base: Node | None = None,
) -> Node:
    """The experiment's `compare` step over every run's lm-eval and held-out scores (inputs
    `{run}.lm`, `{run}.heldout`, and an anneal's pinned `base`); it is the graph's result."""
    inputs: dict[str, Any] = {}
    for run in cfg.runs:
        inputs[f"{run.label}.lm"] = list(lm.get(run.label, ()))
        inputs[f"{run.label}.heldout"] = list(heldout.get(run.label, ()))
    if base is not None:
        inputs["base"] = base
    node = g.add(compare, cfg, label=label, **inputs)
    g.final = node
    return node


def graph(
    arms: Mapping[str, Recipe], spec: AblationConfig, *, run_id: str | None = None, tolerant: bool = False
) -> Graph:
    """The ablation DAG (see the module docstring); `arms` starts with the baseline."""
    g = Graph("ablation", tolerant=tolerant)
    runs: list[RunRef] = []
    lm: dict[str, list[Node]] = {}
    held_scores: dict[str, list[Node]] = {}
    for name, cfg in arms.items():
        arm = Arm(g, "" if name == BASELINE else f"{name}.")
        d = data(arm, cfg)  # type: ignore[arg-type]  # Arm adds like a Graph
        check = arm.add(
            preflight,
            PreflightSpec.for_recipe(cfg, run_id),
            label="preflight",
            tokenizer=d.tokenizer,
            mixtures=list(d.plans.values()),
        )
        suite = None
        if spec.lm_eval != "none":
            suite = arm.add(
                eval_suite,
                SuiteSpec(eval=cfg.eval.for_suite(), seed=cfg.seed),
                label="suite",
                heldout=d.clean,
                train=d.clean,
            )
        held = [
            arm.add(
                heldout_tokens,
                HeldoutSpec(domain=s.name, sources=(s.name,), max_tokens=spec.heldout_tokens),
                label=s.name,
                tokenizer=d.tokenizer,
                corpora=d.clean,
            )
            for s in cfg.sources
        ]
        stages = {s.name: s for s in cfg.stages}
        threads = cfg.resources.threads("train")
        for k in range(spec.seeds):
            label = f"{name}-s{k}"
            plan = [r for r in schedule_stages(cfg.training, cfg.stages, cfg.seed + k) if r.kind == "pretrain"]
            every = spec.eval_every or max(1, math.ceil(sum(r.spec.steps for r in plan) / EVAL_POINTS))
            previous: Node | None = None
            lm[label], held_scores[label], lm_steps = [], [], []
            for i, run in enumerate(plan):
                run = run.model_copy(
                    update={"keep_every": every, "launch": cfg.launch, "storage": cfg.storage, "threads": threads}
                )
                # Seed k draws the data in another order: its own mixture plan (k = 0: the recipe's).
                mix = arm.add(
                    mixture,
                    MixtureSpec.of(stages[run.name], cfg.seed + k),
                    label=f"{run.name}-s{k}",
                    shards=list(d.plans[run.name].inputs["shards"]),
                )
                init = {"init": previous} if previous is not None else {}
                previous = g.add(
                    pretrain,
                    run,
                    label=f"{label}-{run.name}",
                    reuse=True,
                    mixture=mix,
                    after=[check] if previous is None else [],
                    **init,
                )
                held_scores[label].append(
                    g.add(
                        heldout_eval,
                        HeldoutEvalSpec(every_checkpoint=True),
                        label=f"{label}-{run.name}",
                        reuse=True,
                        checkpoint=previous,
                        heldout=held,
                    )
                )
                if suite is not None and (spec.lm_eval == "stages" or i == len(plan) - 1):
                    model = g.add(
                        export,
                        cfg.export,
                        label=f"{label}-{run.name}",
                        reuse=True,
                        checkpoint=previous,
                        tokenizer=d.tokenizer,
                    )
                    lm[label].append(
                        g.add(
                            evaluate,
                            EvalSpec(eval=cfg.eval.for_run()),
                            label=f"{label}-{run.name}",
                            reuse=True,
                            model=model,
                            suite=suite,
                        )
                    )
                    lm_steps.append((run.spec.schedule.start_step or 0) + run.spec.steps)
            runs.append(RunRef(label=label, variant=name, seed=k, lm_steps=tuple(lm_steps)))
    variants = {name: () for name in arms}
    variants.update({v.name: v.overrides for v in spec.variants})
    cfg = ExperimentSpec(
        kind="ablation",
        name=spec.label,
        variants=variants,
        runs=tuple(runs),
        confidence=spec.confidence,
        trust=TrustConfig(require=CRITERIA),
    )
    add_comparison(g, cfg, lm, held_scores, label=spec.label)
    return g


def ablation_spec(
    variants: Sequence[str],
    seeds: int = 2,
    eval_every: int | None = None,
    heldout_tokens: int = 8192,
    lm_eval: str = "stages",
    confidence: float = 0.95,
    name: str = "",
) -> AblationConfig:
    """The flow's parameters as an AblationConfig (variants as `NAME:key=value,...` strings)."""
    if not variants:
        raise ValueError(
            "an ablation needs at least one variant: NAME:key=value[,key=value...] "
            "(e.g. lr_low:training.optimizer.lr=0.001)"
        )
    return AblationConfig(
        variants=tuple(parse_variant(v) for v in variants),
        seeds=seeds,
        eval_every=eval_every,
        heldout_tokens=heldout_tokens,
        lm_eval=lm_eval,
        confidence=confidence,
        name=name,
    )


def run_ablation(
    recipe: str = "tiny",
    variants: list[str] | None = None,
    seeds: int = 2,
    overrides: list[str] | None = None,
    refresh: list[str] | None = None,
    eval_every: int | None = None,
    heldout_tokens: int = 8192,
    lm_eval: str = "stages",
    confidence: float = 0.95,
    name: str = "",
) -> dict:
    """Train the recipe (the baseline) and each variant with several seeds and compare them on the
    evals that carry signal, with their seed noise.

    Args:
        recipe: A recipe in configs/ or the path of a recipe YAML file: the baseline.
        variants: `NAME:key=value[,key=value...]` recipe overrides, one variant each, e.g.
            `docmask_off:training.doc_masking=false`.
        seeds: Runs per variant (init and data-order seed = recipe seed + k); 1 leaves the noise
            unknown, so no difference is called significant.
        overrides: `key=value` items applied over the recipe for every arm, e.g. a shorter stage.
        refresh: Steps to rebuild even when their finished folder exists.
        eval_every: Steps between kept checkpoints whose held-out bits per byte is measured
            (default: about 8 per run).
        heldout_tokens: Held-out tokens per source for bits per byte.
        lm_eval: When lm-eval (cloze) runs: after every pretrain stage (stages), the last (final)
            or never (none).
        confidence: Of each difference's interval.
        name: The experiment's name (default: the variant names joined by +).
    """
    from prefect.runtime import flow_run

    from flows.recipe import run_setup
    from pipeline.runner import run_flow

    spec = ablation_spec(variants or [], seeds, eval_every, heldout_tokens, lm_eval, confidence, name)
    arms = arm_recipes(recipe, overrides or [], spec.variants)
    checked: list[Any] = []
    for cfg in arms.values():  # each distinct set of sources once
        if cfg.sources not in checked:
            check_data(cfg)
            checked.append(cfg.sources)
    dag = graph(arms, spec, run_id=str(flow_run.id) if flow_run.id else None)
    result = run_flow("ablation", dag, run_setup(arms[BASELINE], recipe), refresh or [])
    final = result.get("final") or {}
    result["experiment"] = final.get("fingerprint")
    result["report"] = f"{final['uri']}/comparison.md" if final else None
    return result
