"""Post-training through Prefect: the real `post_train` wiring of flows/smollm3.py on tiny data.

A small flow runs the sources, a stand-in base model step (a random tiny SmolLM3 plus a BPE
tokenizer trained on the sources: the pretraining stages are tested elsewhere), then the
post-training DAG: posttrain data -> SFT -> on-policy pairs per mode -> APO and a second APO run
(seed 1) -> soup -> merge
with the base -> GRPO and SAO beside it, each model scored by `evaluate` on the cloze tasks and the held-out
arithmetic exact-match task. Every trainer runs as a launched job (local torchrun) like a
pretraining stage. Checks: every step completed, the flow process never imported TRL's trainers,
the run's eval table has a row per model with the exact-match column, the merges' lineage names
every ingredient and the final model's lineage reaches the raw sources; a second run comes back
Cached.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from pipeline.artifact import Artifact
from pipeline.step import step
from tests.conftest import SMALL

POSTTRAIN = [
    "stages=[]",
    "eval.items_per_task=8",
    "eval.passkey_lengths=[]",
    "eval.contamination_max_docs=50",
    "posttrain.device=cpu",
    "posttrain.data.math_examples=80",
    "posttrain.data.prose_examples=16",
    "posttrain.data.heldout_examples=8",
    "posttrain.data.prompts=32",
    "posttrain.sft={max_steps: 3, batch: 4, max_length: 256, save_steps: 2}",
    "posttrain.pairs={think: {max_prompts: 4, max_new_tokens: 12}, no_think: {max_prompts: 4, max_new_tokens: 12}}",
    "posttrain.preference={max_steps: 2, batch: 4, pairs: on_policy}",
    "posttrain.merge={soup: [{name: apo-s1, seed: 1}], weights: [0.9, 0.1]}",
    "posttrain.grpo={max_steps: 2, batch: 4, num_generations: 2, max_completion_length: 12, save_steps: 2}",
    "posttrain.sao={enabled: true, max_steps: 2, value_warmup: 1, batch: 4, max_completion_length: 12, save_steps: 2}",
    "posttrain.eval={generation_items: 6, max_gen_tokens: 12, think_gen_tokens: 12, cloze_items: 4}",
]


@step("tiny_base", version=1, kind="hf_model")
def tiny_base(config: dict, corpora: tuple[Artifact, ...] = (), *, out: Path, log=print) -> dict:
    """A random tiny SmolLM3 exported with a tokenizer trained on the input corpora."""
    from tests.tasks.test_posttrain_steps import corpus_texts, make_tiny_model

    folder = make_tiny_model(out, corpus_texts(list(corpora)), hidden=config["hidden"])
    return {"stage": "long2", "model_dir": str(folder)}


@flow(name="posttrain-test", task_runner=ThreadPoolTaskRunner(max_workers=64))
def posttrain_flow(overrides: list[str]) -> str:
    from flows.recipe import load_recipe, run_setup
    from flows.smollm3 import post_train
    from pipeline.graph import Graph
    from pipeline.runner import run_flow
    from tasks.sources import SourceSpec, source

    cfg = load_recipe("tiny", overrides)
    g = Graph("posttrain-test")
    corpora = [g.add(source, SourceSpec.of(s, cfg.seed), label=s.name) for s in cfg.sources]
    base = g.add(tiny_base, {"hidden": 64}, label="long2", corpora=corpora)
    post_train(g, cfg, base, corpora)
    return run_flow("posttrain-test", g, run_setup(cfg, "tiny"))["run_id"]


@pytest.mark.slow
def test_posttrain_dag_scores_every_step_and_keeps_lineage(tmp_path, prefect_harness):
    import sys

    import torch

    from flows.views import eval_table, rl_rewards, summary
    from pipeline.lineage import Lineage

    torch.set_num_threads(2)
    ws = tmp_path / "ws"
    over = [*SMALL, *POSTTRAIN, f"workspace={ws}"]
    # The trainers run as launched jobs: TRL never enters this (the flow) process. Modules other
    # tests of this session imported are set aside, so that an import during the run shows.
    preloaded = {m: sys.modules.pop(m) for m in list(sys.modules) if m == "trl" or m.startswith("trl.")}
    try:
        run_id = posttrain_flow(over)
        imported = sorted(m for m in sys.modules if m.startswith("trl.trainer"))
    finally:
        sys.modules.update(preloaded)
    assert imported == []
    lineage = Lineage(ws / "lineage.duckdb")
    steps = lineage.steps_of(run_id)
    states = {f"{s['step']}[{s['label']}]": s["state"] for s in steps}
    for name in (
        "posttrain_data[chat]",
        "sft[sft]",
        "preference_pairs[pairs]",
        "preference[apo]",
        "preference[apo-s1]",
        "merge[soup]",
        "merge[merge]",
        "grpo[grpo]",
        "sao[sao]",
        "eval_suite[posttrain]",
        "evaluate[base]",
        "evaluate[sft]",
        "evaluate[apo]",
        "evaluate[apo-s1]",
        "evaluate[soup]",
        "evaluate[merge]",
        "evaluate[grpo]",
        "evaluate[sao]",
    ):
        assert states.get(name) == "completed", (name, states)

    # every trainer's curves in the flow run's tracker folder (tiny's tracker: tensorboard)
    boards = {p.name.split("-")[0] for p in (ws / "tensorboard").glob("*/*")}
    assert {"sft", "preference", "grpo", "sao"} <= boards, boards

    # Whether each RL step's reward rose, from the trainers' own meta (GRPO 2 updates, SAO 2 after
    # its value warm-up: 3): below 4 there is no trend
    rl = rl_rewards(lineage, run_id).splitlines()
    assert rl == [
        "grpo: exact-match reward over 2 updates: too few for a trend",
        "sao: reward over 3 updates: too few for a trend",
    ], rl
    assert "== RL reward ==" in summary(lineage, None)

    table = eval_table(lineage, run_id)
    head, models, _note = table.split("\n\n")
    tasks, metrics = head.splitlines()[0].split(), head.splitlines()[1].split()
    # both modes of the generation task, no-think then think, every model with its think statistics
    assert tasks[-3:] == ["arithmetic_exact", "arithmetic_exact_think", "items"], table
    assert metrics[-2:] == ["exact_match", "exact_match"], table
    assert all("% closed)" in line for line in models.splitlines()), table
    rows = {line.split()[0] for line in models.splitlines()}
    assert rows == {"base", "sft", "apo", "apo-s1", "soup", "merge", "grpo", "sao"}, table
    assert all("±" in line for line in models.splitlines()), table

    by_key = {f"{s['step']}[{s['label']}]": s["fingerprint"] for s in steps}
    soup = lineage.get(by_key["merge[soup]"])
    assert [i["fingerprint"] for i in soup.meta["ingredients"]] == [
        by_key["preference[apo]"],
        by_key["preference[apo-s1]"],
    ]
    assert [i["weight"] for i in soup.meta["ingredients"]] == [0.5, 0.5]
    assert {i["seed"] for i in soup.meta["ingredients"]} == {0, 1}
    # both APO runs train on the on-policy pairs, made from the SFT model and the chat data's prompts
    for run in ("preference[apo]", "preference[apo-s1]"):
        assert {a.fingerprint for a in lineage.inputs_of(by_key[run])} == {
            by_key["sft[sft]"],
            by_key["preference_pairs[pairs]"],
        }
    assert {a.fingerprint for a in lineage.inputs_of(by_key["preference_pairs[pairs]"])} == {
        by_key["sft[sft]"],
        by_key["posttrain_data[chat]"],
    }
    pairs = lineage.get(by_key["preference_pairs[pairs]"])
    assert set(pairs.meta["modes"]) == {"think", "no_think"}
    assert lineage.get(by_key["preference[apo]"]).meta["pairs"] == pairs.meta["pairs"]
    parents = {a.fingerprint for a in lineage.inputs_of(by_key["merge[merge]"])}
    assert parents == {by_key["merge[soup]"], by_key["tiny_base[long2]"]}
    for trainer in ("sft[sft]", "preference[apo]", "grpo[grpo]", "sao[sao]"):
        meta = lineage.get(by_key[trainer]).meta
        assert meta["launch"].startswith("local, 1 node x 1 process, direct, -m trainers.posttrain")
        assert (Path(lineage.get(by_key[trainer]).uri) / "spec.json").is_file()

    # SAO trains beside GRPO from the same merged model, on the same prompts
    assert {a.fingerprint for a in lineage.inputs_of(by_key["sao[sao]"])} == {
        a.fingerprint for a in lineage.inputs_of(by_key["grpo[grpo]"])
    }
    final = next(s for s in steps if s["step"] == "grpo")["fingerprint"]
    up = lineage.ancestors(final)
    assert {a["step"] for a in up} >= {
        "source",
        "tiny_base",
        "posttrain_data",
        "sft",
        "preference_pairs",
        "preference",
        "merge",
    }
    assert {a["label"] for a in up if a["step"] == "preference"} == {"apo", "apo-s1"}
    assert {a["label"] for a in up if a["step"] == "source"} == {"prose", "code", "math"}

    again = posttrain_flow(over)
    assert {s["state"] for s in lineage.steps_of(again)} == {"cached"}


def test_the_3b_plan_shows_each_trainer_with_its_launcher_and_the_published_settings(tmp_path):
    """`smollm3 plan smollm3-3b`'s rows (the CLI also checks that the recipe's data exists, which
    it does not on this machine): every trainer with where it runs, the soup and the merge."""
    from flows.graphs import flow_graph, plan
    from flows.recipe import load_recipe
    from pipeline.dryrun import format_plan

    cfg = load_recipe("smollm3-3b", [f"workspace={tmp_path / 'ws'}"])
    pt = cfg.posttrain
    assert (pt.sft.lr, pt.sft.assistant_only_loss, pt.sft.packing) == (2e-5, True, True)
    assert (pt.sft.warmup_ratio, pt.sft.max_length, pt.sft.batch) == (0.03, 65536, 128)  # sft.yaml
    assert (pt.data.uri, pt.data.hf_subset) == ("hf:HuggingFaceTB/smoltalk2", "SFT")
    splits = pt.data.hf_split.split("+")
    assert len(splits) == 25 and "OpenThoughts3_1.2M_think[:2%]" in splits  # sft.yaml's 25 subsets
    assert {s.rsplit("_", 1)[-1].split("[")[0] for s in splits} == {"think"}  # every one names its mode
    assert (pt.preference.loss_type, pt.preference.lr, pt.preference.beta) == ("apo_zero", 1e-6, 0.05)  # apo.yaml
    assert pt.preference.pairs == "on_policy"
    betas = {pt.preference.beta} | {r.apply(pt.preference).beta for r in pt.merge.soup}
    assert betas == {0.1, 0.075, 0.05} and all(0.05 <= b <= 0.1 for b in betas)  # the published range
    # the published preference sources: Qwen3-32B over Qwen3-0.6B in think mode, Tulu 3's pairs in no-think
    think, no_think = pt.pairs.think, pt.pairs.no_think
    tulu = "hf:allenai/llama-3.1-tulu-3-8b-preference-mixture"
    assert (think.prompts, think.chosen, think.rejected) == (tulu, "model:Qwen/Qwen3-32B", "model:Qwen/Qwen3-0.6B")
    assert no_think.pairs == tulu
    mid = {r.name: (r.uri, r.hf_subset, r.hf_split) for r in cfg.reasoning_data}
    assert mid["openthoughts3"][0] == "hf:open-thoughts/OpenThoughts3-1.2M"
    assert mid["nemotron"] == ("hf:HuggingFaceTB/smoltalk2", "Mid", "Llama_Nemotron_Post_Training_Dataset_reasoning_r1")
    assert pt.merge.weights == (0.9, 0.1) and pt.merge.stage == "long64k"
    rows = {r.key: r for r in plan(cfg)}
    where = (
        "slurm, 8 nodes x 8 processes (8 GPUs each), accelerate (configs/accelerate/fsdp.yaml), -m trainers.posttrain"
    )
    for key in ("sft[sft]", "preference[apo]", "preference[apo-b0075]", "preference[apo-b01]", "grpo[grpo]"):
        assert rows[key].launch.startswith(where), (key, rows[key].launch)
    assert rows["sft[sft]"].launch.endswith("batch 128 = 64 ranks x 1 x 2 accumulation")
    assert {"reasoning_data[nemotron]", "pretrain[reasoning]", "preference_pairs[pairs]"} <= set(rows)
    assert rows["merge[soup]"].launch == "" and f"[launch: {where}" in format_plan(list(rows.values()))
    g = flow_graph("smollm3", cfg)
    soup, final = g.node("merge[soup]"), g.node("merge[merge]")
    assert [n.key for n in soup.inputs["models"]] == [
        "preference[apo]",
        "preference[apo-b0075]",
        "preference[apo-b01]",
    ]
    pairs = g.node("preference_pairs[pairs]")
    assert pairs.inputs["model"].key == "sft[sft]" and pairs.inputs["data"].key == "posttrain_data[chat]"
    assert {g.node(k).inputs["data"].key for k in ("preference[apo]", "preference[apo-b01]")} == {pairs.key}
    assert [n.key for n in final.inputs["models"]] == ["merge[soup]", "export[long64k]"]
    assert soup.config.weights == pytest.approx((1 / 3, 1 / 3, 1 / 3)) and final.config.weights == (0.9, 0.1)
