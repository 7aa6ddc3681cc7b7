"""Tests for benchmarks/data_scale.py, the scale benchmark of the data and control plane: its fits
and projection on known inputs, the recipe's scale as the recipe and data plan state it, and a
run at tiny sizes whose table and last line have the promised structure."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flows.data_plan import source_sizes
from flows.recipe import load_recipe
from flows.stage_plan import stage_steps

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "data_scale.py"
LAST = re.compile(r"^worst per-process peak at recipe scale: ([0-9.]+) GB \(([a-z ]+)\)$")


def _module():
    spec = importlib.util.spec_from_file_location("data_scale_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_fit_and_projection_on_known_inputs():
    ds = _module()
    f = ds.fit([1e3, 1e4, 1e5], [2 * x for x in (1e3, 1e4, 1e5)])
    assert f.a == pytest.approx(0, abs=1e-6) and f.b == pytest.approx(2) and f.exponent == pytest.approx(1)
    line = ds.fit([1e3, 1e4, 1e5], [100 + 3 * x for x in (1e3, 1e4, 1e5)])
    assert line.a == pytest.approx(100) and line.b == pytest.approx(3)
    assert ds.project(line, [3100, 30100, 300100], 1e6) == pytest.approx(3_000_100)
    flat = ds.fit([10, 100, 1000], [5e7, 5e7, 5e7])
    assert flat.b == 0 and flat.exponent == pytest.approx(0) and ds.growth(flat.exponent) == "flat"
    # a falling peak is taken as flat: never below the largest measured
    falling = ds.fit([10, 100, 1000], [9e7, 8e7, 7e7])
    assert falling.b < 0 and ds.project(falling, [9e7, 8e7, 7e7], 1e9) == 9e7
    with pytest.raises(ValueError, match="two distinct sizes"):
        ds.fit([5, 5], [1, 2])


def test_projection_verdicts_and_last_line(capsys):
    ds = _module()
    xs = [1e3, 1e4, 1e5]
    rows = [{"part": "ingest ids", "x": x, "peak": 5e7 + 100 * x, "seconds": 1e-3 * x} for x in xs]
    rows += [{"part": "mixture plan", "x": x / 10, "peak": 1e7 + 1e5 * x / 10, "seconds": 0.1} for x in xs]
    scale = {"x": {"ingest ids": 3e6, "mixture plan": 46_900}}
    lines = {p["part"]: p for p in ds.projections(rows, scale, None)}
    assert lines["ingest ids"]["peak_at"] == pytest.approx(5e7 + 100 * 3e6)  # 0.35 GB
    assert lines["ingest ids"]["seconds_at"] == pytest.approx(3e3)
    assert lines["mixture plan"]["peak_at"] == pytest.approx(1e7 + 1e5 * 46_900)  # 4.70 GB, over 2

    class Args:
        sizes = [1000, 10000, 100000]

    ds.report(rows, scale, None, Args())
    out = capsys.readouterr().out.strip().splitlines()
    assert LAST.match(out[-1]).groups() == ("4.70", "mixture plan")
    assert any(s.startswith("MISSES THE GOAL: mixture plan (mixture plan, flow process): 4.7 GB") for s in out)
    assert not any(s.startswith("MISSES THE GOAL: ingest ids") for s in out)


def test_the_recipe_scale_comes_from_the_recipe_and_its_data_plan():
    ds = _module()
    recipe = load_recipe("smollm3-3b")
    scale = ds.recipe_scale(recipe)
    sizes = source_sizes(recipe)
    largest = max(sizes, key=lambda s: s.documents)
    assert scale["ranks"] == recipe.launch.nodes * recipe.launch.gpus_per_node == 384
    assert scale["sources"] == len(recipe.sources) == 71
    assert scale["x"]["curate exact"] == largest.documents
    assert scale["x"]["ingest read"] == pytest.approx(largest.documents / recipe.curation.tasks)
    stage1 = recipe.stages[0]
    assert scale["x"]["metrics curve"] == math.ceil(stage_steps(stage1, recipe.training) / recipe.training.log_interval)
    assert scale["x"]["heldout load"] == 71 * recipe.curation.heldout.max_docs * 750
    # the index's build: a shard task per source's split at least, a merge task per partition
    ngrams = scale["x"]["heldout finish"]
    assert ngrams == scale["x"]["heldout step"] == scale["x"]["heldout load"]
    assert scale["x"]["heldout shards"] == ngrams / min(recipe.curation.tasks, 71)
    assert scale["x"]["heldout merge"] == ngrams / recipe.curation.decontamination.index_partitions
    wider = ds.recipe_scale(load_recipe("smollm3-3b", ["curation.decontamination.index_partitions=64"]))
    assert wider["x"]["heldout merge"] == pytest.approx(scale["x"]["heldout merge"] / 4)
    # a recipe setting moves it: half the tasks, twice the documents per task
    halved = ds.recipe_scale(load_recipe("smollm3-3b", ["curation.tasks=500"]))
    assert halved["x"]["ingest read"] == pytest.approx(2 * scale["x"]["ingest read"])


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def _check_table(out: str, parts: set[str], sizes: int) -> None:
    lines = out.strip().splitlines()
    table = [s for s in lines if s.startswith("| ") and not s.startswith("| part")]
    assert {row.split(" | ")[0][2:] for row in table} == parts
    projected = []
    for row in table:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 3 + sizes + 6, row
        for cell in cells[3 : 3 + sizes]:
            x, peak, seconds = (float(v.replace(",", "")) for v in cell.split(", "))
            assert x > 0 and 1 < peak < 10_000 and seconds >= 0  # MB of a real process
        projected.append((float(cells[-3].split()[0].replace(",", "")), cells[0]))
    worst = LAST.match(lines[-1])
    assert worst, lines[-1]
    top = max(projected)
    assert worst.group(2) == top[1] and float(worst.group(1)) == pytest.approx(top[0], abs=0.01)


def test_runs_at_tiny_sizes_and_prints_the_table_and_the_worst_peak():
    done = _run("--sizes", "40", "160", "640", "--tasks", "2", "--components", "mixture", "metrics", "heldout")
    assert done.returncode == 0, done.stdout + done.stderr
    held = {"heldout shards", "heldout merge", "heldout finish", "heldout step", "heldout load"}
    parts = held | {"mixture plan", "metrics curve", "metrics stream"}
    _check_table(done.stdout, parts, 3)


def test_bad_sizes_are_refused_naming_the_option():
    done = _run("--sizes", "1000", "100")
    assert done.returncode != 0 and "--sizes: at least two, increasing" in done.stderr


@pytest.mark.slow
def test_every_component_runs_at_tiny_sizes():
    done = _run("--sizes", "64", "256", "--tasks", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    ds = _module()
    _check_table(done.stdout, set(ds.PARTS), 2)


def test_the_loader_fit_takes_the_per_document_slope_at_a_fixed_shard_count():
    """The loader's sizes in one shard count: a flat heap is no per-document growth, and the
    largest size in 10x more shards gives the per-shard slope alone (data_scale.LOADER_SHARDS)."""
    ds = _module()
    xs = [2_000, 20_000, 200_000]
    rows = [
        {"part": "loader rank", "x": x, "shards": 40, "peak": 250e6, "seconds": 0.01, "heap_mb": 0.3, "batch_ms": 3}
        for x in xs
    ]
    more = {"docs": 200_000, "shards": 400, "heap_mb": 0.3 + 360 * 300 / 2**20}  # 300 bytes per shard
    scale = {"x": {"loader rank": 8e9}, "loader_shards": 40_400}
    (line,) = ds.projections(rows, scale, more)
    assert line["peak_at"] == pytest.approx(250e6 + (40_400 - 40) * 300, rel=1e-6)  # no per-document term
    assert "+0.286 MB per thousand shards (40,400 shards)" in line["note"]  # 300 bytes per shard
