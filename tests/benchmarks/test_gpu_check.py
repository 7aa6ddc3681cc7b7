"""Tests for benchmarks/gpu_check.py: its CPU smoke runs every code path that needs no CUDA.

The smoke is the real script as a subprocess (`--cpu-smoke`): the trainer with compiled blocks,
the transformers model, the flex-vs-dense comparison, the SIGKILL-and-resume, the memory rows
(every checkpointing mode, predicted against measured) and the loss rows, at toy size. So
the GPU check cannot rot between the rare runs on a GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
PREFLIGHT = ("gpu_count", "gpu_matmul", "gpu_throttle", "gpu_memory", "gpu_ecc", "dcgm_diag",
             "nccl_allreduce")  # fmt: skip
MEMORY = tuple(f"memory ckpt={m} T={t}" for t in (128, 256) for m in ("none", "selective", "full"))
RAN = ("train_ours", "train_transformers", "flex_fwd T=128", "flex_fwd T=100", "flex_fwd T=40",
       "resume_identical", *MEMORY, "loss chunked T=1024", "loss unfused T=1024")  # fmt: skip
CUDA_ONLY = ("ratio_vs_transformers", "flex_bwd T=128", "flex_bwd T=100", "flex_bwd T=40")
# the rental rows: the smollm3-3b recipe's per-GPU shapes at toy widths (eager only on CPU after stage1)
RENTAL_MEMORY = ("3b stage1 eager", "3b long32k eager", "3b long64k eager")
RENTAL_RAN = ("3b stage1 compiled", *RENTAL_MEMORY, "ckpt save (1 GPU share)", "ckpt load (1 GPU share)",
              "loader start-up")  # fmt: skip
MULTI_GPU = ("3b node TP 2 x HSDP over NCCL", "3b long-context CP 4 x TP 2 over NCCL",
             "two-node scaling and fabric bandwidth")  # fmt: skip
RENTAL_SKIP = ("3b stage1 compiled/eager", *MULTI_GPU)


def _megabytes(value: str) -> float:
    """The peak of a loss row's value, `peak 3.4 MB (...)` or `peak 1.20 GB (...)`, in MB."""
    number, unit = value.split()[1:3]
    return float(number) * (1000 if unit == "GB" else 1)


@pytest.mark.slow
def test_cpu_smoke_exits_0_and_prints_every_row(tmp_path):
    env = os.environ | {"PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path / "r.json"),
         "--out", str(tmp_path / "r.md")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:5] == ["check", "status", "s", "value", "detail"]
    printed = {line.split("  ")[0].strip(): line for line in lines[2:-1]}
    assert set(printed) == set(PREFLIGHT + RAN + CUDA_ONLY + RENTAL_RAN + RENTAL_SKIP)

    report = json.loads((tmp_path / "r.json").read_text())
    assert report["mode"] == "cpu-smoke"
    rows = {r["check"]: r for r in report["rows"]}
    for name in RAN + RENTAL_RAN:
        assert rows[name]["status"] == "PASS", rows[name]
        assert rows[name]["value"], name  # a measured value, not just a verdict
    for name in PREFLIGHT + CUDA_ONLY + RENTAL_SKIP:
        assert rows[name]["status"] == "SKIP" and rows[name]["detail"], rows[name]  # named why
    assert "no backward on CPU" in rows["flex_bwd T=40"]["detail"]
    assert "tok/s" in rows["train_ours"]["value"] and "tok/s" in rows["train_transformers"]["value"]
    assert rows["resume_identical"]["value"].startswith("bit-identical weights")
    for name in MEMORY:  # measured against predicted, within the 15% the row judges
        assert rows[name]["value"].startswith("measured ") and "predicted " in rows[name]["value"], rows[name]
    chunked, unfused = (_megabytes(rows[f"loss {k} T=1024"]["value"]) for k in ("chunked", "unfused"))
    assert chunked < unfused  # the chunked loss never holds the whole logits
    for name in RENTAL_MEMORY:  # one GPU's share of the recipe's layout, measured against the planner
        assert "tok/s/GPU" in rows[name]["value"] and "measured " in rows[name]["value"], rows[name]
        assert "predicted " in rows[name]["value"] and "rank 0 of " in rows[name]["detail"], rows[name]
    assert "TP 2" in rows["3b stage1 eager"]["detail"] and "CP 4" in rows["3b long64k eager"]["detail"]
    assert "checkpointing full" in rows["3b long64k eager"]["detail"]  # the recipe's mode, read from it
    assert "one document per sequence" in rows["3b long64k eager"]["detail"]
    assert "about 6 documents per row" in rows["3b stage1 eager"]["detail"]
    assert "every tensor equal" in rows["ckpt load (1 GPU share)"]["value"]
    assert "71 sources" in rows["loader start-up"]["detail"]
    assert "needs the 8 GPUs of one node" in rows["3b node TP 2 x HSDP over NCCL"]["detail"]
    ran, skipped = RAN + RENTAL_RAN, PREFLIGHT + CUDA_ONLY + RENTAL_SKIP
    assert lines[-1] == f"{len(ran)} PASS, 0 FAIL, {len(skipped)} SKIP"

    markdown = (tmp_path / "r.md").read_text()
    assert "| check | status | s | value | detail |" in markdown
    assert all(f"| {name} |" in markdown for name in rows)


def test_without_cuda_the_full_check_refuses_and_names_the_smoke():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the full check would run")
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device visible" in proc.stderr and "--cpu-smoke" in proc.stderr


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _plan(*args: str) -> tuple[dict[str, list[str]], str]:
    """--plan's rows by name (expected s, predicted, shape) and its total line."""
    proc = _run("--plan", *args, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[2].split()[:4] == ["rows", "expected", "s", "predicted"]
    rows = {}
    for line in lines[3:-1]:
        name, rest = line.split("  ", 1)
        rows[name.strip()] = rest.split(None, 1)
    return rows, lines[-1]


def test_plan_lists_every_row_with_the_planners_memory_and_fits_8_minutes_on_one_h200():
    """--plan on CPU (no GPU here): the recipe's per-GPU shapes read through the recipe loader,
    each 3b row's predicted memory the one `smollm3 capacity --recipe smollm3-3b` prints for its
    stage, and the whole check within the 480 s it is sized for."""
    from flows.fit import stage_rows
    from flows.recipe import load_recipe

    rows, total = _plan()
    capacity = {r.name: r for r in stage_rows(load_recipe("smollm3-3b"))}
    expected = ["3b stage1 compiled", "3b stage1 eager", "3b long32k compiled", "3b long64k compiled",
                "ckpt save, ckpt load (1 GPU share)", "loader start-up", "resume_identical",
                "memory ckpt=full T=32768"]  # fmt: skip
    assert set(expected) <= set(rows), sorted(rows)
    for name, stage in (("3b stage1 compiled", "stage1"), ("3b long32k compiled", "long32k"),
                        ("3b long64k compiled", "long64k")):  # fmt: skip
        seconds, rest = rows[name]
        assert float(seconds) > 0
        assert rest.startswith(f"{capacity[stage].peak_gb:.2f} GB"), (name, rest, capacity[stage].peak_gb)
        assert capacity[stage].layout in rest, (capacity[stage].layout, rest)
    assert "checkpointing full" in rows["3b long64k compiled"][1]  # the recipe's own mode
    assert "65,536 / CP 4 = 16,384 query tokens" in rows["3b long64k compiled"][1]
    assert "8 of 16 heads" in rows["3b stage1 compiled"][1]  # TP 2's half of the heads
    words = total.split()
    seconds = sum(float(v[0]) for v in rows.values())
    assert words[0] == "total" and abs(float(words[1]) - seconds) <= len(rows)  # rounding of each row
    assert float(words[1]) <= 480 and "within the 480 s budget" in total


def test_plan_marks_what_a_smaller_budget_would_skip_and_only_narrows_it():
    rows, total = _plan("--budget-s", "120")
    assert "OVER the 120 s budget" in total
    assert "(over the budget: SKIP)" in rows["3b long64k compiled"][1]
    assert "(over the budget: SKIP)" not in rows["start-up"][1]
    only, total = _plan("--only", "checkpoint", "--only", "loader")
    assert set(only) == {"start-up", "ckpt save, ckpt load (1 GPU share)", "loader start-up"}
    assert "within the 120 s budget" not in total and "within the 480 s budget" in total


def test_cpu_smoke_of_the_checkpoint_share_and_the_loader(tmp_path):
    """The checkpoint of one GPU's share (real Checkpointer: DCP, manifest, verified load) and the
    loader's start-up over a 71-source corpus on disk, at toy size, alone (`--only`)."""
    proc = _run("--cpu-smoke", "--only", "checkpoint", "--only", "loader", "--out", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["check"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert set(rows) == {"ckpt save (1 GPU share)", "ckpt load (1 GPU share)", "loader start-up"}
    assert all(r["status"] == "PASS" for r in rows.values()), rows
    save, load = rows["ckpt save (1 GPU share)"], rows["ckpt load (1 GPU share)"]
    assert " GB/s" in save["value"] and "HSDP 48 x 4 x TP 2" in save["detail"]
    assert load["value"].endswith("every tensor equal")
    assert "213 shards" in rows["loader start-up"]["detail"]  # 71 sources x 3 shards


def test_long_context_rows_train_one_document_per_sequence():
    """Long-context data are long documents, and the MFU formula counts the full s x s attention:
    packed documents at 64k let the mask skip most of it (the H200 read MFU 94.6%). The rental
    rows' stages as the recipe gives them: stage1 packs documents, long32k and long64k do not."""
    import torch

    sys.path.insert(0, str(REPO))
    from benchmarks.gpu_check import Setup, rental_stages

    stages = {r.stage: r for r in rental_stages(Setup.cpu_smoke(None))}
    assert set(stages) == {"stage1", "long32k", "long64k"}
    gen = torch.Generator().manual_seed(0)
    for name in ("long32k", "long64k"):
        docs = stages[name].doc_ids(gen)
        assert docs.shape == (stages[name].spec.micro_batch, stages[name].seq_len)
        assert (docs == 0).all() and "one document per sequence" in stages[name].attention_note(True)
    packed = stages["stage1"].doc_ids(gen)
    assert (packed.max(dim=1).values >= 1).all()  # several documents in every row
    assert "about 6 documents per row" in stages["stage1"].attention_note(True)
