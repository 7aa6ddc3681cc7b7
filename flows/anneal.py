"""The `anneal` flow: base checkpoint -> baseline and candidate anneals -> evals -> comparison.

`graph(recipe, base)` lays the anneal out as one DAG: the pinned base; one held-out token set
per source; then per run (baseline, its seed replicas, one per candidate) a weights mixture, a
short decay (`pretrain`), an HF export, lm-eval and held-out loss and bits per byte; and the
comparison of every candidate against the baseline with its seed noise. An anneal is an
experiment (tasks/experiment.py): its variants are the baseline and the candidates, sharing the
pinned base, and its comparison is the ablations' (`add_comparison`, the `compare` step). The runs
are independent branches: they train side by side as far as the recipe's train slots allow.

Served as `anneal/nightly` (cron, concurrency 1) and run on demand. The base checkpoint is
resolved when the run starts (the newest stable-phase checkpoint of the latest `smollm3/full`
run, or the one given) and pinned, so the main run may keep training and pruning.
"""

from __future__ import annotations

from flows.ablation import add_comparison
from flows.graph import Given, Graph, Node, lazy_flow
from flows.params import RecipeParam, step_names
from infra.lineage import Lineage
from infra.workspace import Workspace
from tasks.anneal import anneal_runs, anneal_stage, heldout_sets
from tasks.base import BaseCheckpoint, pin, resolve_base
from tasks.evaluate import EvalSpec, evaluate
from tasks.experiment import BASELINE, ExperimentConfig, RunRef
from tasks.export import export
from tasks.heldout import HeldoutEval, heldout_eval, heldout_tokens
from tasks.mixture import weights_mixture
from tasks.pretrain import pretrain
from tasks.recipe import Recipe, load_recipe


def resolve(cfg: Recipe, base: str = "") -> BaseCheckpoint:
    """The anneal's base, read from the workspace's lineage now."""
    ws = Workspace.at(cfg.workspace)
    return resolve_base(
        Lineage(ws.lineage_path),
        ws,
        base,
        phase="stable",
        flow=cfg.anneal.base_flow,
        deployment=cfg.anneal.base_deployment,
    )


def graph(cfg: Recipe, base: BaseCheckpoint, *, tolerant: bool = False) -> Graph:
    """The anneal DAG from a resolved base (its data run's shards, tokenizer and eval suite are
    Given inputs: they exist already and are not steps of this run)."""
    lineage = Lineage(Workspace.at(cfg.workspace).lineage_path)
    if base.suite is None:
        raise LookupError(
            f"no eval suite in lineage for the data of {base.checkpoint}: run the smollm3 flow up to "
            "its eval_suite step (it runs before the first stage) on the same data"
        )
    shards = [Given(a) for a in lineage.get_many(base.shards)]
    tok, suite = Given(lineage.get(base.tokenizer)), Given(lineage.get(base.suite))
    corpora = [Given(c) for s in base.shards for c in lineage.inputs_of(s, kind="corpus")]
    g = Graph("anneal", tolerant=tolerant)
    pinned = g.add(pin, base.pin_spec(), label=base.label)
    held = [
        g.add(heldout_tokens, h, label=h.domain, tokenizer=tok, corpora=corpora) for h in heldout_sets(cfg.anneal, base)
    ]
    threads = cfg.resources.threads("train")
    lm: dict[str, list[Node]] = {}
    held_scores: dict[str, list[Node]] = {}
    refs: list[RunRef] = []
    for run in anneal_runs(cfg.anneal, base, cfg.seed):
        plan = g.add(weights_mixture, run.mixture, label=run.label, shards=shards)
        stage = anneal_stage(cfg.anneal, base, run, cfg.training.nproc_per_node, threads)
        stage = stage.model_copy(update={"launch": cfg.launch, "storage": cfg.storage})
        ckpt = g.add(pretrain, stage, label=f"anneal-{run.label}", mixture=plan, init=pinned)
        model = g.add(export, cfg.export, label=f"anneal-{run.label}", checkpoint=ckpt, tokenizer=tok)
        lm[run.label] = [g.add(evaluate, EvalSpec.of(cfg.eval), label=f"anneal-{run.label}", model=model, suite=suite)]
        held_scores[run.label] = [
            g.add(heldout_eval, HeldoutEval(), label=f"anneal-{run.label}", checkpoint=ckpt, heldout=held)
        ]
        refs.append(RunRef(label=run.label, variant=run.candidate, seed=run.replica, lm_steps=(stage.spec.steps,)))
    variants = {BASELINE: (f"weights={base.weights}",)}
    variants.update(
        {
            c.name: (f"candidate={c.weights}", f"candidate_share={cfg.anneal.candidate_share}")
            for c in cfg.anneal.candidates
        }
    )
    experiment = ExperimentConfig(
        kind="anneal",
        name=f"{base.label}: {', '.join(c.name for c in cfg.anneal.candidates)}",
        variants=variants,
        runs=tuple(refs),
        metric=cfg.anneal.metric,
        confidence=cfg.anneal.confidence,
    )
    add_comparison(g, experiment, lm, held_scores, label=base.label, base=pinned)
    return g


Step = step_names(globals())  # every step this module's graph can hold (the `refresh` choices)


def _anneal(
    recipe: RecipeParam = "tiny",
    overrides: list[str] | None = None,
    base: str = "",
    refresh: list[Step] | None = None,
) -> dict:
    """Anneal the recipe's candidate data sources from a base checkpoint and compare each
    against a baseline anneal and its seed noise.

    Args:
        recipe: A recipe in configs/ or the path of a recipe YAML file; its `anneal` section
            names the candidates, the token budget and the noise runs.
        overrides: `key=value` items applied over the recipe, e.g. `anneal.tokens=65536`.
        base: Empty: the newest stable-phase checkpoint of the latest smollm3 run, resolved when
            the run starts; else a checkpoint path or a pretrain artifact fingerprint.
        refresh: Steps to rebuild even when their finished folder exists.
    """
    from flows.runner import run_flow

    cfg = load_recipe(recipe, overrides or [])
    return run_flow("anneal", graph(cfg, resolve(cfg, base)), cfg, recipe, refresh or [])


__getattr__ = lazy_flow("anneal", _anneal, globals())  # the Prefect flow `anneal`, built on first use
