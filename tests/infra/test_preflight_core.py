"""Preflight core (registry, config, run, stop rule, tables) and the config-review and data checks."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the repo is not installed into the venv
    sys.path.insert(0, str(REPO))

from infra.preflight import (  # noqa: E402
    CHECKS,
    Check,
    CheckResult,
    PreflightConfig,
    PreflightFacts,
    blocking,
    format_markdown,
    format_table,
    run_preflight,
    should_stop,
)
from infra.preflight.core import register  # noqa: E402

SMOLLM3 = PreflightFacts(  # the published 3B recipe: 384 GPUs, TP 2, DP 192 x micro 3 x 4096
    device="cuda",
    nodes=48,
    nproc_per_node=8,
    tp=2,
    global_batch=576,
    micro_batch=3,
    seq_len=4096,
    max_positions=65536,
    tokenizer_vocab=128256,
    model_vocab=128256,
    stage_tokens={"stable": 8_100_000_000_000, "stable2": 1_800_000_000_000, "decay": 1_200_000_000_000},
)


def run(checks, facts, **config):
    results = run_preflight(PreflightConfig(checks=tuple(checks), **config), facts, log=lambda _: None)
    return {r.name: r for r in results}


def R(status):
    return CheckResult("x", status)


def test_should_stop_on_fail_and_on_warn_unless_allowed():
    assert not should_stop([R("pass"), R("skip")])
    assert should_stop([R("pass"), R("fail")])
    assert should_stop([R("fail")], allow_warn=True)
    assert should_stop([R("warn")])
    assert not should_stop([R("warn")], allow_warn=True)
    assert [r.status for r in blocking([R("warn"), R("fail"), R("pass")], allow_warn=True)] == ["fail"]


def test_check_result_refuses_unknown_status():
    with pytest.raises(ValueError, match="status 'ok'"):
        CheckResult("x", "ok")  # type: ignore[arg-type]


def test_registry_refuses_duplicate_names():
    class Again(Check):
        name, group, order = "vocab", "data", 0

    with pytest.raises(ValueError, match="already registered"):
        register(Again)


def test_config_is_strict_and_names_unknown_checks():
    with pytest.raises(ValidationError, match="unknown preflight check"):
        PreflightConfig(checks=("gpu_matmull",))
    with pytest.raises(ValidationError, match="extra"):
        PreflightConfig(matmul_n=4096)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="s3://"):
        PreflightConfig(s3_uri="bucket/prefix")
    with pytest.raises(ValidationError):
        PreflightConfig().allow_warn = True  # frozen


def test_a_raising_check_is_reported_as_fail(monkeypatch):
    def boom(self, ctx):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(CHECKS.get("vocab"), "run", boom)
    res = run(["vocab"], PreflightFacts())["vocab"]
    assert res.status == "fail" and "RuntimeError: disk on fire" in res.advice


def test_skip_list_shows_up_as_skip_rows():
    results = run_preflight(
        PreflightConfig(checks=("vocab", "seq_len"), skip=("vocab",)),
        PreflightFacts(seq_len=8, max_positions=16),
        log=lambda _: None,
    )
    assert [(r.name, r.status) for r in results] == [("seq_len", "pass"), ("vocab", "skip")]


def test_tables_list_every_check_and_the_counts():
    results = [CheckResult("a", "pass", "1 GB/s", ">= 0"), CheckResult("b", "fail", advice="fix | it")]
    table = format_table(results)
    assert "a" in table and "FAIL" in table and "1 pass, 0 warn, 1 fail, 0 skip" in table
    md = format_markdown(results)
    assert "| b | fail |" in md and "fix \\| it" in md


def test_facts_round_trip_through_plain_data():
    d = SMOLLM3.to_dict()
    assert PreflightFacts.from_dict(d) == SMOLLM3
    with pytest.raises(ValueError, match="unknown field"):
        PreflightFacts.from_dict({"world": 8})


def test_facts_refuse_impossible_values_naming_the_field():
    with pytest.raises(ValueError, match="nproc_per_node must be >= 1"):
        PreflightFacts(nproc_per_node=0)
    with pytest.raises(ValueError, match="seq_len must be >= 0"):
        PreflightFacts(seq_len=-1)
    with pytest.raises(ValueError, match="device must be cuda or cpu"):
        PreflightFacts(device="tpu")  # type: ignore[arg-type]


def test_published_recipe_passes_config_review():
    r = run(["batch_layout", "seq_len", "stage_plan", "vocab"], SMOLLM3)
    assert {n: x.status for n, x in r.items()} == dict.fromkeys(r, "pass")
    assert r["batch_layout"].value.startswith("576 = dp 192 x micro 3 x accum 1")
    assert "2.36M tokens/step" in r["batch_layout"].value


def test_batch_that_ranks_cannot_split_fails_with_options():
    facts = PreflightFacts(nodes=1, nproc_per_node=8, global_batch=100, micro_batch=4)
    res = run(["batch_layout"], facts)["batch_layout"]
    assert res.status == "fail" and "use 96 or 128" in res.advice
    bad_tp = PreflightFacts(nproc_per_node=6, tp=4, global_batch=8, micro_batch=1)
    assert "not a multiple of tp x cp x pp = 4" in run(["batch_layout"], bad_tp)["batch_layout"].advice


def test_context_parallel_ranks_share_a_batch_in_each_stage_layout():
    """The published long-context layout (huggingface/smollm, smollm3 long-context configs): 12
    nodes x 8 GPUs at TP 2 x CP 4 is DP 12, so 72 sequences of 32k are micro 1 x accumulation 6.
    Counting DP as world / tp (48) would call it unsplittable."""
    long = {"nodes": 12, "tp": 2, "cp": 4, "micro_batch": 1, "global_batch": 72}
    facts = dataclasses.replace(SMOLLM3, stage_layouts={"long32k": long}, stage_seq_len={"long32k": 32768})
    res = run(["batch_layout"], facts)["batch_layout"]
    assert res.status == "pass", res.advice
    assert res.value.startswith("576 = dp 192 x micro 3 x accum 1")  # the training layout first
    assert "stage long32k: 72 = dp 12 x micro 1 x accum 6 (tp 2 x cp 4) (2.36M tokens/step)" in res.value
    # A CP degree that leaves the ranks a batch they cannot split fails, naming the stage.
    bad = dataclasses.replace(facts, stage_layouts={"long32k": {**long, "micro_batch": 5}})
    res = run(["batch_layout"], bad)["batch_layout"]
    assert res.status == "fail" and res.advice.startswith("stage long32k: global_batch 72 is not a multiple of 60")
    assert "(dp 12 = world 96 / (tp 2 x cp 4 x pp 1)" in res.advice
    whole = dataclasses.replace(SMOLLM3, nodes=12, tp=2, cp=4, global_batch=72, micro_batch=1)
    assert run(["batch_layout"], whole)["batch_layout"].value.startswith("72 = dp 12 x micro 1 x accum 6")
    with pytest.raises(ValueError, match=r"stage_layouts\[long32k\] has unknown key\(s\) pp"):
        PreflightFacts(stage_layouts={"long32k": {"pp": 2}})


def test_sequence_longer_than_positions_fails():
    assert run(["seq_len"], PreflightFacts(seq_len=8192, max_positions=4096))["seq_len"].status == "fail"


def test_stage_plan_rejects_empty_stages_strays_and_sub_step_stages():
    assert run(["stage_plan"], PreflightFacts(stage_tokens={"a": 0}))["stage_plan"].status == "fail"
    strays = PreflightFacts(stage_tokens={"a": 10}, available_tokens={"b": 10})
    assert "lacks" in run(["stage_plan"], strays)["stage_plan"].advice
    short = PreflightFacts(stage_tokens={"a": 100}, global_batch=4, seq_len=64)
    assert "shorter than one optimizer step" in run(["stage_plan"], short)["stage_plan"].advice


def test_tokenizer_larger_than_embedding_fails():
    res = run(["vocab"], PreflightFacts(tokenizer_vocab=50000, model_vocab=49152))["vocab"]
    assert res.status == "fail" and "at least 50000" in res.advice


def write_shard(folder: Path, tokens: int, width: int = 2, metadata: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "000.ds").write_bytes(b"\0" * tokens * width)
    if metadata:
        (folder / "000.ds.metadata").write_text(f"tok|{width}\n{tokens}\n", encoding="utf-8")


def test_shards_count_tokens_and_epochs_follow(tmp_path):
    write_shard(tmp_path / "web", 3000)
    write_shard(tmp_path / "code", 1000, width=4, metadata=False)
    facts = PreflightFacts(
        shards=(str(tmp_path / "web"), str(tmp_path / "code")),
        tokenizer_vocab=70000,
        stage_tokens={"s1": 2000, "s2": 6000},
    )
    r = run(["shards", "data_epochs"], facts)
    assert r["shards"].status == "pass" and r["shards"].metric == 4000
    assert r["data_epochs"].status == "warn"  # s2 needs 1.5 epochs of 4000 tokens
    assert "s2: 1.50 epochs" in r["data_epochs"].value
    many = PreflightFacts(stage_tokens={"s1": 50}, available_tokens={"s1": 10})
    assert run(["data_epochs"], many)["data_epochs"].status == "fail"
    enough = PreflightFacts(stage_tokens={"s1": 5}, available_tokens={"s1": 10})
    assert run(["data_epochs"], enough)["data_epochs"].status == "pass"


def test_a_stage_that_accepts_more_repeats_is_held_to_its_own_limit():
    """The tiny reasoning stage repeats its traces 4.18 times and says `max_epochs: 5` (SmolLM3's
    mid-training: 4-5 epochs): the check's default of 4 failed the demo at preflight."""
    reasoning = {"stage_tokens": {"s1": 100, "reasoning": 418}, "available_tokens": {"s1": 1000, "reasoning": 100}}
    assert run(["data_epochs"], PreflightFacts(**reasoning))["data_epochs"].status == "fail"
    facts = PreflightFacts(**reasoning, stage_max_epochs={"reasoning": 5.0})
    res = run(["data_epochs"], facts)["data_epochs"]
    assert res.status == "warn" and res.threshold == "<= 1 epoch (warn up to 4, reasoning 5)"
    more = PreflightFacts(
        **{**reasoning, "stage_tokens": {"s1": 100, "reasoning": 550}}, stage_max_epochs={"reasoning": 5}
    )
    res = run(["data_epochs"], more)["data_epochs"]
    assert res.status == "fail" and "stage(s) reasoning repeat their data more than 5 times" in res.advice
    # a stage's own limit never tightens the check's, and it survives the facts' JSON round trip
    lower = PreflightFacts(**reasoning, stage_max_epochs={"s1": 0.05, "reasoning": 5.0})
    assert run(["data_epochs"], lower)["data_epochs"].status == "warn"
    assert PreflightFacts.from_dict(facts.to_dict()) == facts


def test_missing_or_empty_shard_folders_fail(tmp_path):
    (tmp_path / "empty").mkdir()
    facts = PreflightFacts(shards=(str(tmp_path / "nope"), str(tmp_path / "empty")))
    res = run(["shards"], facts)["shards"]
    assert res.status == "fail" and "missing" in res.advice and "no tokens" in res.advice


def test_eval_tasks_resolve_from_a_local_folder(tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "arc.yaml").write_text("task: smol_arc\ndataset_path: json\n")
    ok = run(
        ["eval_tasks"],
        PreflightFacts(eval_tasks=("smol_arc",)),
        eval_tasks_dir=str(tmp_path / "tasks"),
        eval_lm_eval_lookup=False,
    )["eval_tasks"]
    assert ok.status == "pass"
    bad = run(
        ["eval_tasks"],
        PreflightFacts(eval_tasks=("smol_arcc",)),
        eval_tasks_dir=str(tmp_path / "tasks"),
        eval_lm_eval_lookup=False,
    )["eval_tasks"]
    assert bad.status == "fail" and "did you mean smol_arc" in bad.advice
    gone = run(["eval_tasks"], PreflightFacts(eval_tasks=("x",)), eval_tasks_dir=str(tmp_path / "no"))
    assert "does not exist" in gone["eval_tasks"].advice


def write_plan(path: Path, stage: str, sources: list[dict]) -> str:
    plan = {
        "stage": stage,
        "seed": 0,
        "seq_len": 64,
        "tokens": 1000,
        "vocab_size": 300,
        "eos_id": 0,
        "token_dtype": "uint16",
        "sources": sources,
    }
    path.write_text(json.dumps(plan))
    return str(path)


def test_mixture_plans_give_per_source_epochs_files_and_vocab(tmp_path):
    write_shard(tmp_path / "web", 900)
    web = str(tmp_path / "web" / "000.ds")
    one = write_plan(
        tmp_path / "s1.json",
        "s1",
        [
            {"name": "web", "files": [web], "available_tokens": 900, "budget_tokens": 800, "expected_epochs": 0.89},
            {"name": "math", "files": [web], "available_tokens": 20, "budget_tokens": 200, "expected_epochs": 10.0},
        ],
    )
    facts = PreflightFacts(mixture_plans=(one,), model_vocab=256)
    r = run(["shards", "data_epochs", "vocab"], facts, max_epochs=4)
    assert r["shards"].status == "pass" and "1/1 planned files present (1 plans)" in r["shards"].value
    assert r["data_epochs"].status == "fail" and "s1: 10.00 epochs (math)" in r["data_epochs"].value
    assert r["vocab"].status == "fail" and "tokenizer 300, model 256" == r["vocab"].value
    gone = write_plan(
        tmp_path / "s2.json", "s2", [{"name": "web", "files": [str(tmp_path / "gone.ds")], "expected_epochs": 0.5}]
    )
    res = run(["shards"], PreflightFacts(mixture_plans=(gone,)))["shards"]
    assert res.status == "fail" and "gone.ds" in res.advice
    broken = run(["shards"], PreflightFacts(mixture_plans=(str(tmp_path / "nope.json"),)))["shards"]
    assert broken.status == "fail" and "nope.json" in broken.advice and "mixture step" in broken.advice
