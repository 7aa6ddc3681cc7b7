"""Anneal helpers: the runs (baseline, seed replicas, candidates) and the linear-decay launch built
from the base stage's own spec. The comparison is the experiment framework's
(tests/evals/test_experiments.py)."""

from __future__ import annotations

import pytest

from flows.anneal import anneal_runs, anneal_stage
from flows.recipe import AnnealConfig, CandidateConfig
from model.base_checkpoint import resolve_base
from model.schedule import lr_at


def test_runs_are_baseline_seed_replicas_and_candidates_with_linear_decay(run_ws):
    ws, _ = run_ws
    base = resolve_base(ws.lineage(), ws)
    cfg = AnnealConfig(candidates=(CandidateConfig(name="code", weights={"b": 1}),), tokens=4 * 32 * 8, seed_runs=2)
    runs = anneal_runs(cfg, base)
    assert [(r.label, r.candidate, r.mixture.seed, r.replica) for r in runs] == [
        ("baseline", "baseline", 0, 0),
        ("baseline-s1", "baseline", 1, 1),
        ("baseline-s2", "baseline", 2, 2),
        ("code", "code", 0, 0),
    ]
    assert runs[-1].mixture.weights == {"a": 0.3, "b": 0.7}
    stage = anneal_stage(cfg, base, runs[-1])
    spec = stage.spec.bind("plan.json", "out", "ckpt")
    assert spec.steps == 8 and spec.reset_optimizer is False  # continue with the optimizer state
    assert spec.seed == base.spec.seed and spec.global_batch == base.spec.global_batch
    sched = spec.schedule
    lrs = [lr_at(p, spec.optimizer.lr, sched, sched.total_steps) for p in range(spec.steps)]
    assert lrs[0] == pytest.approx(base.lr * 7 / 8) and lrs[-1] == 0.0
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False))  # linear decay to 0
    with pytest.raises(ValueError, match="anneal.candidates is empty"):
        anneal_runs(AnnealConfig(), base)


def test_recipe_rejects_candidates_naming_unknown_sources():
    from flows.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"anneal.candidates\[x\] names unknown source\(s\) nope"):
        load_recipe("tiny", ["anneal.candidates=[{name: x, weights: {nope: 1}}]"])
