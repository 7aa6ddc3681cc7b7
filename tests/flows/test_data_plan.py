"""flows/data_plan.py: the data plan of `smollm3 capacity --recipe`, from the recipe's stages and
the measured per-megabyte costs."""

from __future__ import annotations

import pytest

from flows.data_plan import (
    BYTES_PER_TOKEN,
    CURATE_CPU_S_PER_MB,
    SOURCE_ID_BYTES,
    TOKENIZE_TOKENS_PER_CPU_S,
    TOKENS_PER_DOCUMENT,
    data_rows,
    format_data_rows,
)
from flows.recipe import load_recipe


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
    # where each runs: curation on the recipe's Slurm partition, 2 GB a task, the held-out index inside
    assert by["curate"].executor == "slurm (cpu, 1 CPU x 2 GB)" and by["curate"].mem_gb == 2
    assert "held-out index every task loads (1.29 GB)" in by["curate"].note
    # the recipe names no tokenize executor: its 500 workers run on the flow host, and the plan says so
    assert by["tokenize"].executor == "flow host (500 workers)"
    # the source step: datatrove tasks on curation's executor (read, id buckets, finish: 1,000 each
    # per source), no task holding more than one bucket of DCLM's ids
    assert by["source"].executor == by["curate"].executor and by["source"].tasks == 71 * 3 * 1000
    assert by["source"].mem_gb == pytest.approx(
        _drawn(recipe, "dclm/dclm") / TOKENS_PER_DOCUMENT / 1000 * SOURCE_ID_BYTES / 1e9, rel=1e-9
    )
    assert by["source"].mem_gb < 1 and "dclm/dclm in 1,000 buckets" in by["source"].note
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
    assert [r.step for r in rows] == ["source", "curate", "tokenize"]
    assert all(r.executor.startswith("flow host") for r in rows)
    # capped sources: one read and one finish task each; curation's 4 tasks x 3 sources
    assert {r.step: r.tasks for r in rows} == {"source": 6, "curate": 12, "tokenize": 12}
