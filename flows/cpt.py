"""The `cpt` flow: continued pretraining onto a new domain with replay and a forgetting monitor.

base (checkpoint, HF folder or fingerprint) -> pinned base -> domain + replay mixture -> one
fresh-optimizer WSD stage at a tenth of the peak LR -> held-out loss on both domains at every
eval interval, with forgetting flags -> HF export. The mixture, the launch and the held-out sets
are planned here from the recipe's `cpt` section and the resolved base (model/base_checkpoint.py);
the steps are tasks/pin.py, tasks/cpt.py and tasks/heldout.py; `graph` is the DAG as a value (the
flow runs it, `smollm3 plan` predicts it).
"""

from __future__ import annotations

from collections.abc import Mapping

from curation.mixtures import blend
from flows.params import RecipeParam, step_names
from flows.recipe import Recipe, load_recipe
from flows.stage_plan import optimizer_steps
from model.base_checkpoint import BaseCheckpoint, resolve_base
from model.spec import ScheduleSpec
from pipeline.graph import Given, Graph
from pipeline.lineage import Lineage
from pipeline.workspace import Workspace
from tasks.cpt import CptConfig, cpt_monitor
from tasks.export import export
from tasks.heldout import HeldoutSpec, heldout_tokens
from tasks.mixture import WeightsMixtureSpec, weights_mixture
from tasks.pin import PinSpec, pin
from tasks.pretrain import StageSpec, pretrain


def resolve(cfg: Recipe, base: str = "") -> BaseCheckpoint:
    """The CPT base, read from the workspace's lineage now."""
    ws = Workspace.at(cfg.workspace)
    return resolve_base(Lineage(ws.lineage_path), ws, base, phase="last", allow_hf=True)


def general_weights(cfg: CptConfig, base_weights: Mapping[str, float]) -> dict[str, float]:
    """The general data to replay: the recipe's choice, else the base stage's minus the domain."""
    weights = dict(cfg.general) or {k: v for k, v in base_weights.items() if k not in cfg.domain}
    if cfg.replay > 0 and not any(w > 0 for w in weights.values()):
        raise ValueError(
            f"cpt.replay is {cfg.replay} but there is no general data to replay (base mixture "
            f"{dict(base_weights)} minus cpt.domain {sorted(cfg.domain)}); set cpt.general"
        )
    return weights


def cpt_weights(cfg: CptConfig, general: Mapping[str, float]) -> dict[str, float]:
    """(1 - replay) x new-domain data + replay x general data, each normalised first."""
    if not any(w > 0 for w in cfg.domain.values()):
        raise ValueError("cpt.domain names no new-domain source with a positive weight (e.g. cpt.domain={math: 1})")
    return blend([(cfg.domain, 1 - cfg.replay), (general, cfg.replay)])


def cpt_stage(cfg: CptConfig, base: BaseCheckpoint, nproc_per_node: int = 1, threads: int | None = None) -> StageSpec:
    """The CPT launch: the base stage's spec with a fresh optimizer and WSD schedule at
    lr_fraction x its peak LR, keeping a checkpoint every eval_interval steps for the monitor.
    The model shape comes from the base itself (an imported HF model need not be a preset)."""
    steps = optimizer_steps(cfg.tokens, base.spec.global_batch, base.seq_len)
    overrides = {k: v for k, v in base.model_shape.items() if k != "max_seq_len"} or base.spec.model_overrides
    spec = base.spec.model_copy(
        update={
            "stage": "cpt",
            "steps": steps,
            "model_overrides": overrides,
            "optimizer": base.spec.optimizer.model_copy(update={"lr": base.peak_lr * cfg.lr_fraction}),
            "schedule": ScheduleSpec(
                kind="wsd",
                warmup_steps=min(cfg.warmup_steps, steps),
                decay_fraction=cfg.decay_fraction,
                min_lr=0.0,
                total_steps=steps,
                start_step=0,
            ),
            "reset_optimizer": True,
            "reset_schedule": True,
            "mixture_plan": "",
            "out_dir": "",
            "init_from": None,
        }
    )
    return StageSpec(
        spec=spec, kind="cpt", keep_every=cfg.eval_interval, nproc_per_node=nproc_per_node, threads=threads
    )


def heldout_configs(cfg: CptConfig, general: Mapping[str, float]) -> list[HeldoutSpec]:
    """The two held-out sets the monitor compares: general (replayed) data and the new domain."""
    return [
        HeldoutSpec(domain=d, sources=tuple(sorted(k for k, v in w.items() if v > 0)), max_tokens=cfg.heldout_tokens)
        for d, w in (("general", general), ("domain", cfg.domain))
    ]


def graph(cfg: Recipe, base: BaseCheckpoint, *, tolerant: bool = False) -> Graph:
    c = cfg.cpt
    lineage = Lineage(Workspace.at(cfg.workspace).lineage_path)
    general = general_weights(c, base.weights)
    shards = [Given(a) for a in lineage.get_many(base.shards)]
    tok = Given(lineage.get(base.tokenizer))
    corpora = [Given(x) for s in base.shards for x in lineage.inputs_of(s, kind="corpus")]
    g = Graph("cpt", tolerant=tolerant)
    pinned = g.add(pin, PinSpec.of(base), label=base.label)
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
    stage = g.add(pretrain, run, label="cpt", mixture=plan, init=pinned, **cfg.training.retry_policy())
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
