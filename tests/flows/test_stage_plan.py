"""Stage planning (flows/stage_plan.py): one WSD schedule across stages, fresh schedules for
context extension."""

from __future__ import annotations

import pytest

from flows.recipe import load_recipe
from flows.stage_plan import schedule_stages


def test_smollm3_3b_schedule_matches_the_published_numbers():
    recipe = load_recipe("smollm3-3b")
    runs = {r.name: r.spec for r in schedule_stages(recipe.training, recipe.stages, recipe.seed)}
    main = [runs[s] for s in ("stage1", "stage2", "stage3")]
    total = main[0].schedule.total_steps
    # 11.1T tokens at 2.36M tokens/step: ~4.7M steps; the decay (stage 3) is ~11% of them.
    assert 4.6e6 < total < 4.8e6 and all(r.schedule.total_steps == total for r in main)
    assert [r.schedule.start_step for r in main] == [0, main[0].steps, main[0].steps + main[1].steps]
    decay = main[2].schedule.decay_fraction
    assert decay == pytest.approx(main[2].steps / total) and 0.10 < decay < 0.12
    assert all(
        r.optimizer.lr == 2e-4
        and r.schedule.warmup_steps == 2000
        and r.schedule.kind == "wsd"
        and not r.reset_optimizer
        for r in main
    )
    long32k, long64k = runs["long32k"], runs["long64k"]
    assert long32k.reset_optimizer and long32k.schedule.kind == "cosine"
    assert long32k.optimizer.lr == pytest.approx(2e-5)
    assert long32k.rope_theta == 2e6 and long64k.rope_theta == 5e6
    # The published layout: 48 nodes x 8 H100, TP 2, DP 192, 576 x 4,096 tokens per step.
    assert recipe.launch.nodes * recipe.training.nproc_per_node == 384
    assert all(r.tp == 2 and r.global_batch == 576 and r.seq_len == 4096 for r in main)
    # The long-context stages at the published ~2.36M tokens per step: 47B / (72 x 32k) and
    # 52B / (36 x 64k) steps, the published 20k and 22k; 1,000 warmup steps are ~5% of each.
    assert long32k.global_batch * long32k.seq_len == 72 * 32768 and long32k.steps == 19922
    assert long64k.global_batch * long64k.seq_len == 36 * 65536 and long64k.steps == 22041
    assert long32k.schedule.warmup_steps == long64k.schedule.warmup_steps == 1000


def test_stage_specs_continue_or_reset_and_carry_the_recipe_seed(tmp_path):
    recipe = load_recipe("tiny", ["seed=7"])
    runs = schedule_stages(recipe.training, recipe.stages, recipe.seed)
    stage2 = runs[1].spec.bind(tmp_path / "plan.json", tmp_path, init_from="/ckpt/stage1")
    assert stage2.schedule.start_step == runs[0].spec.steps
    assert stage2.schedule.total_steps == sum(r.spec.steps for r in runs[:3])
    assert not stage2.reset_optimizer and not stage2.reset_schedule
    long1 = runs[3].spec.bind(tmp_path / "plan.json", tmp_path, init_from="/ckpt/stage3")
    assert long1.reset_optimizer and long1.reset_schedule and long1.seq_len == 512
    assert long1.rope_theta == 200000 and long1.optimizer.lr == pytest.approx(3e-4)
    # training.optimizer is the trainer's own OptimizerConfig: one name and one default end to end.
    assert runs[0].spec.optimizer is recipe.training.optimizer
    assert {r.spec.seed for r in runs} == {7}  # the recipe seed reaches initialisation
    # What the step writes is what trainers.pretrain reads.
    from model.spec import TrainSpec

    long1.save(tmp_path / "spec.json")
    assert TrainSpec.load(tmp_path / "spec.json") == long1


def test_every_tiny_long_context_stage_makes_several_real_updates_at_its_length():
    """Context extension trains: a long stage whose only full-LR step is followed by a step at
    min_lr (the old tiny long2: 2 steps, LR 3e-4 then 0) barely moves the model."""
    from model.schedule import lr_at

    recipe = load_recipe("tiny")
    longs = [r.spec for r in schedule_stages(recipe.training, recipe.stages, recipe.seed) if r.kind == "long_context"]
    assert [s.seq_len for s in longs] == [512, 1024]
    for spec in longs:
        lrs = [lr_at(i, spec.optimizer.lr, spec.schedule, spec.schedule.total_steps) for i in range(spec.steps)]
        real = [lr for lr in lrs if lr > spec.schedule.min_lr + 0.05 * spec.optimizer.lr]
        assert len(real) >= 4, (spec.stage, lrs)  # several updates at a useful LR
        assert lrs[-2] > spec.schedule.min_lr  # only the last step may reach min_lr
        assert spec.steps * spec.global_batch * spec.seq_len == {512: 32768, 1024: 49152}[spec.seq_len]


def test_doc_masking_is_a_recipe_switch_that_reaches_every_stage_and_its_fingerprint():
    from pipeline.artifact import identity

    on = schedule_stages(load_recipe("tiny").training, load_recipe("tiny").stages)
    off_recipe = load_recipe("tiny", ["training.doc_masking=false"])
    off = schedule_stages(off_recipe.training, off_recipe.stages)
    assert all(r.spec.doc_masking for r in on) and not any(r.spec.doc_masking for r in off)
    assert identity(on[0])["spec"]["doc_masking"] is True  # identity: another model, another folder
    assert identity(on[0]) != identity(off[0])


def test_the_reasoning_stage_continues_the_long_model_with_a_schedule_of_its_own(tmp_path):
    """Reasoning mid-training comes after context extension: a fresh optimizer and cosine schedule
    at lr_scale x the peak, the long stage's RoPE theta; SmolLM3's 140B tokens at 2e-5 in the 3B recipe."""
    recipe = load_recipe("tiny")
    runs = schedule_stages(recipe.training, recipe.stages, recipe.seed)
    assert [r.kind for r in runs][-3:] == ["long_context", "long_context", "reasoning"]
    spec = runs[-1].spec.bind(tmp_path / "plan.json", tmp_path, init_from="/ckpt/long2")
    assert spec.reset_optimizer and spec.reset_schedule and spec.schedule.kind == "cosine"
    assert spec.schedule.total_steps == spec.steps == 12 and spec.schedule.start_step == 0
    assert spec.optimizer.lr == pytest.approx(3e-4) and spec.rope_theta == runs[-2].spec.rope_theta == 500000
    big = load_recipe("smollm3-3b")
    reasoning = schedule_stages(big.training, big.stages, big.seed)[-1].spec
    assert reasoning.stage == "reasoning" and reasoning.optimizer.lr == pytest.approx(2e-5)
    assert reasoning.steps * reasoning.global_batch * reasoning.seq_len >= 140e9 and reasoning.rope_theta == 5e6


def test_reasoning_stages_come_after_the_long_context_stages():
    from flows.recipe import RecipeError

    with pytest.raises(RecipeError, match="and those before the reasoning stages; this recipe's kinds: pretrain"):
        load_recipe("tiny", ["stages.long2.kind=reasoning", "stages.reasoning.kind=long_context"])
    with pytest.raises(RecipeError, match="reasoning_data names must be unique and differ from the sources'"):
        load_recipe("tiny", ["reasoning_data=[{name: math}]"])
