"""model/host_memory.py: the host memory, CPUs and open files a stage's node needs, from its plan."""

from __future__ import annotations

import math

from flows.recipe import load_recipe
from flows.stage_plan import schedule_stages
from model.host_memory import HEADROOM, LOADER_GB, NODE_OVERHEAD_GB, RANK_PROCESS_GB, host_needs
from model.memory import GB, model_config_of, state_bytes


def _stages(recipe: str, *overrides: str):
    r = load_recipe(recipe, list(overrides))
    return {
        run.name: run.model_copy(update={"launch": run.on(r.launch)})
        for run in schedule_stages(r.training, r.stages, r.seed)
    }


def test_a_3b_node_holds_its_ranks_checkpoint_staging_and_loaders():
    run = _stages("smollm3-3b")["stage1"]
    layout = run.layout()
    needs = host_needs(run.spec, layout, run.nproc_per_node)
    state, _ = state_bytes(model_config_of(run.spec), layout.tp, layout.shard)
    # async_save copies each rank's slice of the fp32 state (~37 GB a checkpoint over 8 ranks of a node)
    assert run.spec.async_checkpoint and 36 < 8 * state / GB < 38
    assert needs.parts["checkpoint staging"] == 8 * state / GB
    assert needs.parts["processes"] == 8 * RANK_PROCESS_GB and needs.parts["node"] == NODE_OVERHEAD_GB
    assert 8 * LOADER_GB <= needs.parts["loader"] < 8 * LOADER_GB + 0.1  # plus 2 prefetched micro-batches
    assert needs.mem_gb == math.ceil(sum(needs.parts.values()) * HEADROOM)
    assert needs.cpus == 8 * 3 + 1  # a rank's driving thread, prefetch and writer threads; torchrun
    assert needs.open_files == 8192  # 2 x 64 shards + the 4096 allowance, to a power of two
    assert "host 94 GB per node" in needs.describe()


def test_the_figures_follow_the_settings_they_depend_on():
    base = _stages("smollm3-3b")["stage1"]
    sync = _stages("smollm3-3b", "training.async_checkpoint=false")["stage1"]
    wide = _stages("smollm3-3b", "training.loader.open_shards=4000")["stage1"]
    b, s, w = (host_needs(r.spec, r.layout(), r.nproc_per_node) for r in (base, sync, wide))
    assert s.parts["checkpoint staging"] < b.parts["checkpoint staging"] / 10  # one tensor at a time
    assert s.mem_gb < b.mem_gb
    assert w.open_files == 16384 and b.open_files == 8192


def test_a_cpu_stage_counts_its_training_step_and_threads():
    run = _stages("tiny")["stage1"]
    needs = host_needs(run.spec, run.layout(), run.nproc_per_node, threads=3)
    assert needs.parts["training step"] > 0 and needs.parts["checkpoint staging"] < 0.01
    assert needs.cpus == run.nproc_per_node * (3 + 2) + 1
