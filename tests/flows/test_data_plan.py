"""flows/data_plan.py: the data plan of `smollm3 capacity --recipe`, from the recipe's stages and
the measured per-megabyte costs."""

from __future__ import annotations

import pytest

from flows.data_plan import (
    BYTES_PER_TOKEN,
    CURATE_CPU_S_PER_MB,
    CURATE_TASK_GB,
    DECONTAMINATE_CPU_S_PER_MB,
    REASONING_READ_CONVERSATIONS_PER_CPU_S,
    REASONING_RENDER_CONVERSATIONS_PER_CPU_S,
    REASONING_TASK_GB,
    REASONING_TOKENS_PER_CONVERSATION,
    SOURCE_ID_BYTES,
    TOKENIZE_TOKENS_PER_CPU_S,
    TOKENS_PER_DOCUMENT,
    data_rows,
    executor_problems,
    format_data_rows,
    slurm_hours,
    task_hours,
    tokenizer_task,
)
from flows.recipe import ExecutorRefused, check_data, load_recipe


def test_the_3b_data_plan_follows_the_stages_tokens_and_the_measured_costs():
    recipe = load_recipe("smollm3-3b")
    rows, largest = data_rows(recipe)
    by = {r.step: r for r in rows}
    # every stage's mixture is drawn in full; the reasoning stage's traces are not curated sources
    # (`reasoning_data`, tasks/reasoning_data.py), so they are not in the data plan's three steps
    tokens = sum(s.tokens for s in recipe.stages if s.kind != "reasoning")
    assert largest == "dclm/dclm"
    mb = tokens * BYTES_PER_TOKEN / 1e6
    assert by["curate"].cpu_hours == pytest.approx(mb * CURATE_CPU_S_PER_MB / 3600, rel=1e-9)
    assert by["tokenize"].cpu_hours == pytest.approx(tokens / TOKENIZE_TOKENS_PER_CPU_S / 3600, rel=1e-9)
    assert by["tokenize"].disk_gb == pytest.approx((tokens * 4 + tokens / TOKENS_PER_DOCUMENT * 8) / 1e9, rel=1e-9)
    assert by["decontaminate"].cpu_hours == pytest.approx(mb * DECONTAMINATE_CPU_S_PER_MB / 3600, rel=1e-9)
    # where each runs: curation on the recipe's Slurm partition, 4 GB a task; what a task needs is
    # its projection, not the request (the filter task's, benchmarks/data_scale.py); decontamination
    # there too, a task needing the held-out index it maps
    assert by["curate"].executor == "slurm (cpu, 1 CPU x 4 GB)" and by["curate"].mem_gb == CURATE_TASK_GB
    assert by["decontaminate"].executor == by["curate"].executor
    assert by["decontaminate"].mem_gb == pytest.approx(1.29, abs=0.01) == by["heldout_index"].disk_gb
    assert by["decontaminate"].tasks == by["curate"].tasks  # a task per curated shard
    assert "held-out index the task maps (1.29 GB)" in by["decontaminate"].note
    # the held-out index once for the 71 sources: shard tasks, 16 merge tasks, a finish task
    assert by["heldout_index"].tasks == 1000 + 16 + 1 and by["heldout_index"].disk_gb == pytest.approx(1.29, abs=0.01)
    assert by["heldout_index"].executor == by["curate"].executor
    # tokenization on Slurm too (it ran 500 local workers on the flow host when the recipe named none)
    assert by["tokenize"].executor == "slurm (cpu, 1 CPU x 4 GB)"
    # the source step: datatrove tasks on curation's executor (read, id buckets, finish: 1,000 each
    # per source), no task holding more than one bucket of DCLM's ids
    assert by["source"].executor == by["curate"].executor and by["source"].tasks == 71 * 3 * 1000
    assert by["source"].mem_gb == pytest.approx(
        _drawn(recipe, "dclm/dclm") / TOKENS_PER_DOCUMENT / 1000 * SOURCE_ID_BYTES / 1e9, rel=1e-9
    )
    assert by["source"].mem_gb < 1 and "dclm/dclm in 1,000 buckets" in by["source"].note
    # the reasoning traces: on tokenization's executor, a streaming reader per hub source and
    # tokenize's 1,000 tasks per source; CPU from the measured rates, memory the projected task's
    reasoning = by["reasoning"]
    convs = 1_200_000 + 10_000_000
    assert reasoning.executor == by["tokenize"].executor and reasoning.tasks == 2 * (1 + 1000)
    cpu_s = (
        convs / REASONING_READ_CONVERSATIONS_PER_CPU_S
        + convs / REASONING_RENDER_CONVERSATIONS_PER_CPU_S
        + convs * REASONING_TOKENS_PER_CONVERSATION / TOKENIZE_TOKENS_PER_CPU_S
    )
    assert reasoning.cpu_hours == pytest.approx(cpu_s / 3600, rel=1e-9) and reasoning.mem_gb == REASONING_TASK_GB
    assert "11,200,000 conversations of openthoughts3, nemotron" in reasoning.note
    # the tokenizer (trained for comparison): one task on its own section's Slurm request, its
    # memory and time data_scale's line at the recipe's sample
    tok = by["tokenizer"]
    gb, cpu_s = tokenizer_task(recipe.tokenizer.sample_chars)
    assert recipe.tokenizer.sample_chars == 1_000_000_000 and gb == pytest.approx(5.21, abs=0.01)
    assert tok.tasks == 1 and tok.mem_gb == gb and tok.cpu_hours == pytest.approx(cpu_s / 3600)
    assert tok.executor == "slurm (cpu, 4 CPU x 4 GB)" and gb < 8 < tokenizer_task(2_000_000_000)[0]
    text = format_data_rows(rows, recipe)
    assert tokens == 11_199_000_000_000 and "data plan: 71 sources, 11,199,000,000,000 tokens drawn" in text


def _drawn(recipe, name: str) -> float:
    from curation.mixtures import load_weights

    total = 0.0
    for stage in recipe.stages:
        weights = load_weights(stage.mixture)
        total += weights.get(name, 0.0) / sum(weights.values()) * stage.tokens
    return total


def test_the_tiny_data_plan_runs_on_the_flow_host():
    recipe = load_recipe("tiny")
    rows, _ = data_rows(recipe)
    steps = ["source", "curate", "heldout_index", "decontaminate", "tokenize", "reasoning", "tokenizer"]
    assert [r.step for r in rows] == steps
    assert all(r.executor.startswith("flow host") for r in rows)
    # capped sources: one read and one finish task each; curation's 4 tasks x 3 sources, and as
    # many decontamination tasks (a task per curated shard); the index: 4 + 16 + 1 tasks at most;
    # the builtin traces: 4 generating tasks and tokenize's 4
    assert {r.step: r.tasks for r in rows} == {
        "source": 6,
        "curate": 12,
        "heldout_index": 21,
        "decontaminate": 12,
        "tokenize": 12,
        "reasoning": 8,
        "tokenizer": 1,
    }


def test_no_data_step_of_the_3b_recipe_runs_on_the_flow_host():
    """Every data step of smollm3-3b on Slurm, its time limit and memory per task covering the
    data plan's longest task; the same recipe with tokenization left on the local executor (its
    500 workers) is refused on a flow host of any size below 500 cores, naming the field."""
    recipe = load_recipe("smollm3-3b")
    assert {recipe.curation.executor, recipe.tokenize.executor} == {"slurm"}
    assert executor_problems(recipe, cores=2) == ([], [])
    hours, source = task_hours(recipe)["curate"]
    assert source == "dclm/dclm" and 24 < hours < slurm_hours(recipe.curation.slurm.time)
    assert task_hours(recipe)["tokenize"][0] < slurm_hours(recipe.tokenize.slurm.time)

    local = load_recipe("smollm3-3b", ["tokenize.executor=local"])
    for cores in (2, 64, 256):
        refused, _ = executor_problems(local, cores=cores)
        assert len(refused) == 1 and refused[0].startswith(
            "tokenize.executor is local: the tokenize step would run 500"
        )
    assert executor_problems(local, cores=500) == ([], [])  # one worker per core, under a day
    # one worker per core of a small host: not refused, but the months it would take are said
    refused, warned = executor_problems(
        load_recipe("smollm3-3b", ["tokenize.executor=local", "tokenize.workers=null"]), 2
    )
    assert refused == [] and warned == [
        "tokenize.executor is local: the tokenize step needs ~11,938 CPU-hours, ~248.7 days on this host's 2 "
        "cores; a cluster executor runs it in parallel"
    ]
    with pytest.raises(ExecutorRefused, match=r"tokenize.executor is local: .* 500 workers on this \d+-core"):
        check_data(local, allow_missing=True, sample=False)


def test_small_local_recipes_and_cluster_limits_are_warned_not_refused(capsys):
    # tiny: a few CPU-seconds; more workers than cores only oversubscribes them
    tiny = load_recipe("tiny", ["curation.workers=64"])
    refused, warned = executor_problems(tiny, cores=2)
    assert refused == [] and warned == [
        "curation.workers 64 is more than this host's 2 cores: the source step oversubscribes them "
        "(unset it to run one worker per core)",
        "curation.workers 64 is more than this host's 2 cores: the curate step oversubscribes them "
        "(unset it to run one worker per core)",
        "curation.workers 64 is more than this host's 2 cores: the heldout_index step oversubscribes them "
        "(unset it to run one worker per core)",
        "curation.workers 64 is more than this host's 2 cores: the decontaminate step oversubscribes them "
        "(unset it to run one worker per core)",
    ]
    assert executor_problems(load_recipe("tiny"), cores=1) == ([], [])
    # a Slurm limit below the longest task; a request below the memory per task (100 id buckets
    # of DCLM: 3.5 GB each)
    short = load_recipe(
        "smollm3-3b",
        ['curation.slurm.time="1-00:00:00"', "curation.tasks=100", "curation.slurm.mem_per_cpu_gb=2"],
    )
    _, warned = executor_problems(short, cores=2)
    assert any(
        w.startswith("curation.slurm.time 1-00:00:00 is shorter than the curate step's longest task") for w in warned
    )
    assert "curation.slurm asks 2 GB per task, less than the source step's 3.5 GB" in " ".join(warned)
    # a curation request of 1 GB holds the source step's and the index's tasks, not a curate task
    # (its filter task) nor a decontaminate task (the index it maps)
    _, warned = executor_problems(load_recipe("smollm3-3b", ["curation.slurm.mem_per_cpu_gb=1"]), cores=2)
    assert warned == [
        f"curation.slurm asks 1 GB per task, less than the curate step's {CURATE_TASK_GB:.1f} GB (flows/data_plan.py): "
        "raise mem_per_cpu_gb",
        "curation.slurm asks 1 GB per task, less than the decontaminate step's 1.3 GB (flows/data_plan.py): "
        "raise mem_per_cpu_gb",
    ]
    # the tokenizer's task asked for less than its projected 5.2 GB
    _, warned = executor_problems(load_recipe("smollm3-3b", ["tokenizer.slurm.mem_per_cpu_gb=1"]), cores=2)
    assert warned == [
        "tokenizer.slurm asks 4 GB per task, less than the tokenizer step's 5.2 GB (flows/data_plan.py): raise mem_per_cpu_gb"
    ]
    check_data(short, allow_missing=True, sample=False)  # warned on stderr, not refused
    assert "WARNING: recipe smollm3-3b: curation.slurm.time 1-00:00:00" in capsys.readouterr().err


def test_slurm_time_limits_in_every_format():
    assert slurm_hours("90") == 1.5 and slurm_hours("30:00") == 0.5 and slurm_hours("72:00:00") == 72
    assert slurm_hours("2-12") == 60 and slurm_hours("1-00:30") == 24.5 and slurm_hours("1-01:00:00") == 25
