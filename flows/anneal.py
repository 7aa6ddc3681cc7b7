"""The `anneal` flow: base checkpoint -> baseline and candidate anneals -> evals -> comparison.

`graph(recipe, base)` lays the anneal out as one DAG: the pinned base; one held-out token set
per source; then per run (baseline, its seed replicas, one per candidate) a weights mixture, a
short decay (`pretrain`), an HF export, lm-eval and held-out loss and bits per byte; and the
comparison of every candidate against the baseline with its seed noise. An anneal is an
experiment (evals/experiments.py): its variants are the baseline and the candidates, sharing the
pinned base, and its comparison is the ablations' (`add_comparison`, the `compare` step). The runs
are independent branches: they train side by side as far as the recipe's train slots allow.

Served as `anneal/nightly` (cron, concurrency 1) and run on demand. The base checkpoint is
resolved when the run starts (the newest stable-phase checkpoint of the latest `smollm3/full`
run, or the one given) and pinned, so the main run may keep training and pruning.

The playbook's recipe: take a checkpoint from the stable phase of the main run, continue training
it on 40% of the current stage's mixture plus 60% of a candidate source with the learning rate
decaying linearly to 0 over a short run, evaluate, and compare against a baseline anneal on the
current mixture alone. The base is resolved through lineage by model/base_checkpoint.py and
pinned by tasks/pin.py; the mixtures are tasks/mixture.py's `weights_mixture`; each run is a
`pretrain` stage. Here:

- `anneal_runs` lays out the baseline (plus seed replicas of it: the same mixture with another
  data order, which measures seed noise) and one run per candidate;
- `anneal_stage` is the `pretrain` config of one run: the base stage's own TrainSpec, from the
  pinned checkpoint with its optimizer state, LR decaying linearly from the checkpoint's LR to 0;
- the comparison is the experiment framework's (evals/experiments.py, flows/ablation.py
  `add_comparison`): the baseline and its replicas and each candidate are the variants of an
  experiment of kind "anneal", compared on the runs' lm-eval scores and held-out bits per byte
  with seed noise; DuckDB `experiments` / `experiment_runs` / `experiment_results`.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from curation.mixtures import blend
from evals.experiments import BASELINE, ExperimentSpec, RunRef
from flows.ablation import add_comparison
from flows.params import RecipeParam, step_names
from flows.recipe import AnnealConfig, Recipe, load_recipe
from flows.stage_plan import optimizer_steps
from model.base_checkpoint import BaseCheckpoint, resolve_base
from model.spec import ScheduleSpec
from pipeline.graph import Given, Graph, Node
from pipeline.lineage import Lineage
from pipeline.workspace import Workspace
from tasks.evaluate import EvalSpec, evaluate
from tasks.export import export
from tasks.heldout import HeldoutEvalSpec, HeldoutSpec, heldout_eval, heldout_tokens
from tasks.mixture import WeightsMixtureSpec, weights_mixture
from tasks.pin import PinSpec, pin
from tasks.pretrain import StageSpec, pretrain


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
    pinned = g.add(pin, PinSpec.of(base), label=base.label)
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
        ckpt = g.add(
            pretrain, stage, label=f"anneal-{run.label}", mixture=plan, init=pinned, **cfg.training.retry_policy()
        )
        model = g.add(export, cfg.export, label=f"anneal-{run.label}", checkpoint=ckpt, tokenizer=tok)
        lm[run.label] = [g.add(evaluate, EvalSpec.of(cfg.eval), label=f"anneal-{run.label}", model=model, suite=suite)]
        held_scores[run.label] = [
            g.add(heldout_eval, HeldoutEvalSpec(), label=f"anneal-{run.label}", checkpoint=ckpt, heldout=held)
        ]
        refs.append(RunRef(label=run.label, variant=run.candidate, seed=run.replica, lm_steps=(stage.spec.steps,)))
    variants = {BASELINE: (f"weights={base.weights}",)}
    variants.update(
        {
            c.name: (f"candidate={c.weights}", f"candidate_share={cfg.anneal.candidate_share}")
            for c in cfg.anneal.candidates
        }
    )
    experiment = ExperimentSpec(
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


def run_anneal(
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
    from flows.recipe import run_setup
    from pipeline.runner import run_flow

    cfg = load_recipe(recipe, overrides or [])
    return run_flow("anneal", graph(cfg, resolve(cfg, base)), run_setup(cfg, recipe), refresh or [])


# --- the anneal runs: baseline, seed replicas, one per candidate ----------------------------


class AnnealArm(BaseModel):
    """One anneal launch: its label, which candidate it tests, and its mixture."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str  # baseline, baseline-s1, or the candidate name
    candidate: str  # "baseline" for the baseline and its seed replicas
    mixture: WeightsMixtureSpec  # weights, tokens, sequence length and data-order seed
    replica: int = 0  # seed index within its candidate (baseline-sK: K)


def anneal_runs(cfg: AnnealConfig, base: BaseCheckpoint, seed: int = 0) -> list[AnnealArm]:
    """The baseline, its seed replicas, then one run per candidate."""
    if not cfg.candidates:
        raise ValueError("anneal.candidates is empty: name at least one candidate data source")

    def mix(name: str, weights: Mapping[str, float], run_seed: int) -> WeightsMixtureSpec:
        return WeightsMixtureSpec(
            name=f"anneal-{name}", weights=dict(weights), tokens=cfg.tokens, seq_len=base.seq_len, seed=run_seed
        )

    runs = [AnnealArm(label="baseline", candidate="baseline", mixture=mix("baseline", base.weights, seed))]
    runs += [
        AnnealArm(
            label=f"baseline-s{i}", candidate="baseline", mixture=mix("baseline", base.weights, seed + i), replica=i
        )
        for i in range(1, cfg.seed_runs + 1)
    ]
    runs += [
        AnnealArm(
            label=c.name,
            candidate=c.name,
            mixture=mix(
                c.name, blend([(base.weights, 1 - cfg.candidate_share), (c.weights, cfg.candidate_share)]), seed
            ),
        )
        for c in cfg.candidates
    ]
    return runs


def anneal_stage(
    cfg: AnnealConfig, base: BaseCheckpoint, run: AnnealArm, nproc_per_node: int = 1, threads: int | None = None
) -> StageSpec:
    """The `pretrain` config of one anneal: the base stage's spec, from the pinned checkpoint with
    its optimizer state, LR decaying linearly from the checkpoint's LR to 0 over the run."""
    steps = optimizer_steps(cfg.tokens, base.spec.global_batch, base.seq_len)
    spec = base.spec.model_copy(
        update={
            "stage": run.mixture.name,
            "steps": steps,
            "optimizer": base.spec.optimizer.model_copy(update={"lr": base.lr}),
            "schedule": ScheduleSpec(
                kind="wsd", warmup_steps=0, decay_fraction=1.0, min_lr=0.0, total_steps=steps, start_step=0
            ),
            "reset_optimizer": False,
            "reset_schedule": False,
            "checkpoint_interval": min(cfg.checkpoint_interval, steps),
            "keep_last": 1,
            "mixture_plan": "",
            "out_dir": "",
            "init_from": None,
        }
    )
    return StageSpec(spec=spec, kind="anneal", nproc_per_node=nproc_per_node, threads=threads)


def heldout_sets(cfg: AnnealConfig, base: BaseCheckpoint) -> list[HeldoutSpec]:
    """One held-out set per source of the base stage's mixture: the loss deltas show which
    domain each candidate moves, long before cloze accuracy of a small model does."""
    return [HeldoutSpec(domain=n, sources=(n,), max_tokens=cfg.heldout_tokens) for n in sorted(base.weights)]
