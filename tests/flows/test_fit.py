"""The recipe check of flows/fit.py: every stage's layout, batch split and predicted memory.

The published recipe passes at its published layout (48 nodes x 8 H100, TP 2, DP 192, 576 x 4,096
tokens per step; long-context stages at ~2.36M tokens per step on 12 nodes, TP 2 x CP 4 x DP 12)
with every stage inside 80 GB; a
stage that cannot fit is refused with its figure, the limit and the settings that would fit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flows.fit import stage_rows
from flows.recipe import RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[2]


def test_the_published_recipe_fits_80gb_h100s_at_the_published_layout():
    recipe = load_recipe("smollm3-3b")
    rows = {r.name: r for r in stage_rows(recipe)}
    for name in ("stage1", "stage2", "stage3"):
        r = rows[name]
        assert (r.nodes, r.layout, r.global_batch, r.micro_batch, r.accum) == (
            48,
            "HSDP 48 x 4 x TP 2 (384 ranks)",
            576,
            3,
            1,
        )
        assert r.tokens_per_step == 576 * 4096
    assert rows["long32k"].tokens_per_step == rows["long64k"].tokens_per_step == 72 * 32768
    assert rows["long32k"].steps == 19922 and rows["long64k"].steps == 22041  # published: 20k, 22k
    # The published long-context layout: 12 nodes, TP 2 x CP 4 x DP 12, micro-batch 1, accumulation 6 and 3.
    for name, accum in (("long32k", 6), ("long64k", 3)):
        r = rows[name]
        assert (r.nodes, r.layout, r.micro_batch, r.accum) == (12, "HSDP 12 x 1 x CP 4 x TP 2 (96 ranks)", 1, accum)
    for r in rows.values():
        assert r.limit_gb == 80 and r.budget_gb <= 80, (r.name, r.budget_gb)
        assert r.peak_gb > 1  # a real prediction, not an empty one
    assert rows["long64k"].mode == "full"  # the published recompute_layer: true (auto would take none)


def test_auto_checkpointing_takes_the_lightest_mode_that_fits():
    recipe = load_recipe("smollm3-3b", ["stages.long64k.activation_checkpointing=auto"])
    rows = {r.name: r for r in stage_rows(recipe)}
    assert rows["stage1"].mode == "none" and rows["long32k"].mode == "none"
    assert rows["long64k"].mode == "none" and rows["long64k"].budget_gb <= 80
    tight = load_recipe("smollm3-3b", ["stages.long64k.activation_checkpointing=auto", "training.gpu_memory_gb=60"])
    assert {r.name: r.mode for r in stage_rows(tight)}["long64k"] == "selective"


def test_a_stage_that_cannot_fit_is_refused_naming_stage_figure_limit_and_what_fits():
    with pytest.raises(RecipeError) as err:
        # the layout of before context parallelism: 18 nodes, TP 4 x DP 36, a whole 64k sequence per GPU
        load_recipe(
            "smollm3-3b",
            ["stages.long64k.activation_checkpointing=none", "stages.long64k.cp=1", "stages.long64k.tp=4",
             "stages.long64k.nodes=18"],
        )  # fmt: skip
    text = str(err.value)
    assert "stages[long64k] does not fit training.gpu_memory_gb 80 GB" in text
    assert "predicted peak 1" in text and "activation checkpointing none on HSDP 18 x 2 x TP 4" in text
    assert "settings that fit: activation_checkpointing=selective (" in text
    assert "activation_checkpointing=full (" in text
    # The data-parallel recipe of before (no TP, 24 nodes, 192-sequence long stages) is refused too.
    with pytest.raises(RecipeError, match=r"stages\[long32k\] does not fit .* settings that fit: .*full"):
        load_recipe(
            "smollm3-3b",
            ["training.tp=1", "launch.nodes=24", "stages.long32k.tp=1", "stages.long32k.cp=1",
             "stages.long32k.nodes=24", "stages.long32k.global_batch=192",
             "stages.long32k.activation_checkpointing=none"],
        )  # fmt: skip


def test_layout_and_batch_errors_name_the_stage_and_the_sizes():
    with pytest.raises(RecipeError, match=r"stages\[stage1\]: global_batch 576 must be a multiple of .* 3 x 188"):
        load_recipe("smollm3-3b", ["launch.nodes=47"])
    with pytest.raises(RecipeError, match="tp 3 must divide nproc_per_node 8"):
        load_recipe("smollm3-3b", ["training.tp=3"])
    with pytest.raises(RecipeError, match=r"stages\[long32k\]: tp 8 must divide num_kv_heads 4"):
        load_recipe("smollm3-3b", ["stages.long32k.tp=8", "stages.long32k.cp=1", "stages.long32k.nodes=72"])
    with pytest.raises(RecipeError, match=r"stages\[long32k\]: cp 8 x tp 2 must divide the processes per node \(8\)"):
        load_recipe("smollm3-3b", ["stages.long32k.cp=8"])
    with pytest.raises(RecipeError, match="cp 3 x tp 2 must divide nproc_per_node 8"):
        load_recipe("smollm3-3b", ["training.cp=3"])


def test_cpu_recipes_are_predicted_but_never_refused():
    rows = stage_rows(load_recipe("tiny"))
    assert rows and all(r.limit_gb is None and r.peak_gb > 0 for r in rows)


def test_capacity_recipe_prints_every_stage_and_plan_rows_carry_the_memory():
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "capacity", "--recipe", "smollm3-3b"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:4] == ["stage", "nodes", "layout", "batch"]
    assert [line.split()[0] for line in lines[1:6]] == ["stage1", "stage2", "stage3", "long32k", "long64k"]
    assert all("CP 4 x TP 2" in line and " 12  " in line for line in lines[4:6]), lines[4:6]
    # the host side of a node: memory, CPUs, open files per rank (model/host_memory.py)
    assert lines[0].split()[-4:] == ["host", "GB", "cpus", "nofile"]
    assert lines[1].split()[-3:] == ["94", "25", "8192"]
    # the data plan beside it (flows/data_plan.py)
    at = next(i for i, line in enumerate(lines) if line.startswith("data plan: 71 sources"))
    assert lines[at + 1].split() == ["step", "executor", "tasks", "CPU-hours", "disk", "GB", "GB/task"]
    assert [line.split()[0] for line in lines[at + 2 : at + 10]] == [
        "source",
        "curate",
        "heldout_index",
        "decontaminate",
        "tokenize",
        "reasoning",
        "tokenizer",
        "sizes:",
    ]

    from flows.graphs import plan

    rows = plan(load_recipe("smollm3-3b", ["workspace=/nonexistent-smollm3-plan"]))
    pretrain = [r for r in rows if r.step == "pretrain"]
    assert len(pretrain) == 6  # stages 1-3, the two long-context stages and the reasoning stage
    for r in pretrain:
        assert "peak " in r.launch and "of 80 GB" in r.launch and "checkpointing " in r.launch, r.launch
    assert "slurm, 12 nodes x 8 processes" in {r.label: r.launch for r in pretrain}["long64k"]
