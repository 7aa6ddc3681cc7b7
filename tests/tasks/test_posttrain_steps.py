"""Post-training trainers on tiny data, called in this process: chat data, verifier, SFT masks,
APO pairs, the soup and linear merges, GRPO resume after a crash, on-policy distillation, the
exact-match generation eval, the rank entry point and the recipe section's checks.

Models are 2-layer SmolLM3s (hidden 64) exported with our own BPE tokenizer and its chat
template, built once per module; every trainer runs 2-4 optimizer steps. The same trainers as
launched jobs (1 and 2 processes, killed and resumed): tests/trainers/test_posttrain.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from curation.conversations import math_conversation
from pipeline.artifact import Artifact, read_marker, run_step
from tasks.posttrain.data import posttrain_data
from trainers.posttrain.chat_data import exact_match_reward, format_reward, question, read_jsonl
from trainers.posttrain.sections import (
    ChatDataConfig,
    ChatDataSpec,
    DistillConfig,
    GRPOConfig,
    MergeConfig,
    MergeSpec,
    PosttrainConfig,
    PreferenceConfig,
    ReasoningModesConfig,
    SFTConfig,
    SoupConfig,
    micro_batches,
)


def make_tiny_model(folder: Path, texts: list[str], seed: int = 0, hidden: int = 64) -> Path:
    """A random 2-layer SmolLM3 exported with a BPE tokenizer (dual-mode template) trained on `texts`."""
    from curation.bpe import save_hf_tokenizer, train_bpe
    from model.config import ModelConfig
    from model.hf import export_hf
    from model.model import SmolLM3

    tok_dir = folder / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        meta = save_hf_tokenizer(train_bpe(iter(texts), 512), tok_dir)
    else:
        meta = {"vocab_size": 512, "eos_id": 0}
    model = SmolLM3(
        ModelConfig.tiny(
            vocab_size=meta["vocab_size"],
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_layers=2,
            max_seq_len=512,
        )
    )
    model.init_weights(seed=seed)
    return export_hf(model, folder / f"model-{hidden}-{seed}", tokenizer_dir=tok_dir, eos_token_id=meta["eos_id"])


def make_corpora(folder: Path, math_docs: int = 300, prose_docs: int = 40) -> list[Artifact]:
    """Built-in math and prose corpora (train/heldout shards) as corpus artifacts."""
    from curation.source_kinds import SourceConfig
    from tasks.sources import SourceSpec, source

    arts = []
    for name, uri, domain, n in (
        ("math", "builtin:math", "math", math_docs),
        ("prose", "builtin:prose", "web", prose_docs),
    ):
        cfg = SourceConfig(name=name, uri=uri, domain=domain, max_documents=n, held_out_fraction=0.2)
        meta = source(SourceSpec(source=cfg), out=folder / name, log=lambda _: None)
        arts.append(Artifact(kind="corpus", uri=str(folder / name), fingerprint=name * 8, meta=meta))
    return arts


def corpus_texts(corpora: list[Artifact]) -> list[str]:
    from curation.source_kinds import read_shards

    return [d["text"] for a in corpora for d in read_shards(a.path / "train")][:400]


DATA = ChatDataConfig(math_examples=80, prose_examples=16, heldout_examples=8, prompts=32, think_share=0.5)


# One pytest-xdist worker runs this module, so its module fixture (the base model, chat data and the 3-step SFT) is built once,
# not once per worker that draws one of its tests (CONTRIBUTING.md, Tests).
pytestmark = pytest.mark.xdist_group("posttrain-steps-world")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Corpora, chat data, a base model and a 3-step SFT model (shared by this module's tests)."""
    import torch

    from trainers.posttrain.sft import train_sft

    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("posttrain")
    corpora = make_corpora(root / "corpora")
    base = make_tiny_model(root, corpus_texts(corpora))
    data_meta = posttrain_data(ChatDataSpec(data=DATA), corpora, out=root / "data", log=lambda _: None)
    sft_log: list[str] = []
    sft_progress: list[float] = []
    sft_meta = train_sft(
        SFTConfig(max_steps=3, batch=4, max_length=256),
        base,
        root / "data",
        root / "sft",
        device="cpu",
        log=sft_log.append,
        progress=sft_progress.append,
    )
    return {
        "root": root,
        "corpora": corpora,
        "base": base,
        "data": root / "data",
        "data_meta": data_meta,
        "sft": sft_meta,
        "sft_log": sft_log,
        "sft_progress": sft_progress,
    }


# --- data and verifier ------------------------------------------------------------------------


def test_verifier_and_rewards():
    good = "12 + 30 = 42.\nAnswer: 42"
    assert exact_match_reward([good, "Answer: 41", "no answer"], ["42", "42", "42"]) == [1.0, 0.0, 0.0]
    # TRL passes conversational completions as message lists.
    assert exact_match_reward([[{"role": "assistant", "content": good}]], ["42"]) == [1.0]
    assert format_reward([good, "Answer: 42", "42"]) == [1.0, 0.0, 0.0]
    conv = math_conversation("Problem: What is 2 + 3?\nSolution: 2 + 3 = 5.\nAnswer: 5", ReasoningModesConfig())
    assert conv["messages"][2]["content"] == "2 + 3 = 5.\nAnswer: 5" and conv["answer"] == "5"


def test_builtin_chat_data_keeps_heldout_apart(world):
    meta = world["data_meta"]
    assert meta["train"] == 96 and meta["heldout"] == 8 and meta["prompts"] == 32
    train = read_jsonl(world["data"] / "train.jsonl")
    heldout = read_jsonl(world["data"] / "heldout.jsonl")
    prompts = read_jsonl(world["data"] / "prompts.jsonl")
    # both reasoning modes in SFT (think: a worked trace in <think>...</think>); RL prompts no-think
    systems = [r["messages"][0]["content"] for r in train + heldout]
    think_system = ReasoningModesConfig().think_system
    assert set(systems) == {"/no_think", think_system}
    assert all(
        r["messages"][2]["content"].startswith("<think>\n")
        for r in train
        if r["messages"][0]["content"] == think_system
    )
    assert all(p["prompt"][0] == {"role": "system", "content": "/no_think"} for p in prompts)
    key = lambda r: r["messages"][1]["content"]  # noqa: E731
    assert not {key(r) for r in heldout} & {key(r) for r in train}
    # RL prompts are math documents after the SFT ones: not SFT conversations replayed.
    sft_questions = {key(r) for r in train}
    assert not {p["prompt"][1]["content"] for p in prompts} & sft_questions
    kinds = {key(r).split("\n")[0] for r in train if "passage" in key(r)}
    assert kinds <= {"Continue this passage:", "Summarise this passage in one sentence:"} and kinds
    assert all(p["reference"].endswith(f"Answer: {p['answer']}") for p in prompts)


# --- SFT ------------------------------------------------------------------------------------------


def test_sft_trains_on_assistant_tokens_only(world):
    from transformers import AutoTokenizer

    meta = world["sft"]
    assert meta["stage"] == "sft" and meta["steps"] == 3 and meta["eval_loss"] > 0
    # the held-out loss per reasoning mode too: think conversations (a trace to predict) and no-think
    assert set(meta["eval_loss_by_mode"]) == {"think", "no_think"} and all(
        v > 0 for v in meta["eval_loss_by_mode"].values()
    )
    folder = Path(meta["model_dir"])
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    tok = AutoTokenizer.from_pretrained(str(folder))
    conv = read_jsonl(world["data"] / "train.jsonl")[0]["messages"]
    enc = tok.apply_chat_template(conv, return_dict=True, return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(enc["input_ids"], enc["assistant_masks"], strict=True) if m]
    assert tok.decode(masked) == conv[2]["content"] + "<|im_end|>"
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"][0] == tok.convert_tokens_to_ids("<|im_end|>")


def test_post_training_logs_step_loss_lr_and_eta_and_reports_progress(world):
    """The TRL callback's lines in the step's log: the steps to come, then per logged step
    step/total, loss, LR and ETA; the progress percentage reaches 100 with the last step."""
    import re

    lines = world["sft_log"]
    assert lines[0] == "training 3 steps"
    steps = [line for line in lines if line.startswith("step ") and " | loss " in line]
    assert [line.split(" |")[0] for line in steps] == ["step 1/3", "step 2/3", "step 3/3"]
    assert any(line.startswith("step 3/3 | eval_loss ") for line in lines)  # held-out loss after training
    for mode in ("think", "no_think"):  # and per reasoning mode, a line per held-out set
        assert any(line.startswith(f"step 3/3 | eval_{mode}_loss ") for line in lines), mode
    assert all(re.fullmatch(r"step \d/3 \| loss [\d.e-]+ \| lr \S+ \| ETA \S+", line) for line in steps), steps
    assert steps[-1].endswith("ETA 0s")
    assert world["sft_progress"] == pytest.approx([100 / 3, 200 / 3, 100.0])


# --- preference -------------------------------------------------------------------------------


def test_verified_pairs_prefer_correct_answers():
    from trainers.posttrain.preference import verified_pairs

    prompts = [
        {"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in (("q1", "5"), ("q2", "7"), ("q3", "1"))
    ]
    samples = [["Answer: 5", "Answer: 4"], ["Answer: 8", "Answer: 9"], ["Answer: 1", "Answer: 1"]]
    rows, facts = verified_pairs(prompts, samples, {"q2": "3 + 4 = 7.\nAnswer: 7"})
    assert [(r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in rows] == [
        ("Answer: 5", "Answer: 4"),
        ("3 + 4 = 7.\nAnswer: 7", "Answer: 8"),
    ]
    assert facts == {"sample_accuracy": 0.5, "pairs": 2, "chosen_from_policy": 1}


def test_apo_from_self_sampled_pairs(world):
    from trainers.posttrain.preference import train_preference

    cfg = PreferenceConfig(max_steps=2, batch=4, samples_per_prompt=2, max_new_tokens=12)
    meta = train_preference(
        cfg, Path(world["sft"]["model_dir"]), world["data"], world["root"] / "apo", device="cpu", log=lambda _: None
    )
    assert meta["stage"] == "apo" and meta["loss_type"] == "apo_zero" and meta["steps"] == 2
    assert meta["pairs"] > 0 and len(read_jsonl(world["root"] / "apo" / "pairs.jsonl")) == meta["pairs"]


# --- merge ------------------------------------------------------------------------------------


def test_linear_merge_is_the_weighted_sum(world, tmp_path):
    from safetensors.torch import load_file

    from pipeline.artifact import Artifact
    from tasks.posttrain.merge import merge

    post, base = Path(world["sft"]["model_dir"]), world["base"]
    arts = [
        Artifact(kind="hf_model", uri=str(p), fingerprint=c * 64, meta={"model_dir": str(p), "stage": s})
        for p, c, s in ((post, "a", "sft"), (base, "b", "long2"))
    ]
    meta = merge(MergeSpec(weights=(0.9, 0.1)), arts, out=tmp_path, log=lambda _: None)
    merged = load_file(str(tmp_path / "model" / "model.safetensors"))
    a, b = load_file(str(post / "model.safetensors")), load_file(str(base / "model.safetensors"))
    for name in a:
        assert (merged[name] - (0.9 * a[name] + 0.1 * b[name])).abs().max() < 1e-6
    assert meta["merged"] == ["sft", "long2"] and (tmp_path / "model" / "tokenizer.json").is_file()
    assert [(i["fingerprint"][0], i["weight"]) for i in meta["ingredients"]] == [("a", 0.9), ("b", 0.1)]
    with pytest.raises(ValueError, match="summing to 1"):
        MergeSpec(weights=(0.9, 0.2))
    with pytest.raises(ValueError, match="2 models but the config has 3 weights"):
        merge(MergeSpec(weights=(0.5, 0.3, 0.2)), arts, out=tmp_path / "w")
    other = make_tiny_model(world["root"], [], hidden=32)
    with pytest.raises(ValueError, match="not the same architecture"):
        merge(
            MergeSpec(weights=(0.9, 0.1)),
            [arts[0], Artifact(kind="hf_model", uri=str(other), fingerprint="c" * 64, meta={"model_dir": str(other)})],
            out=tmp_path / "x",
        )


def test_a_soup_then_a_linear_merge_is_the_smollm3_weighted_sum(world, tmp_path):
    """0.9 x uniform soup of three models + 0.1 x the base, through the two merge steps."""
    from safetensors.torch import load_file

    from tasks.posttrain.merge import merge

    soup_in = [make_tiny_model(world["root"], [], seed=s) for s in (3, 4, 5)]
    arts = [
        Artifact(
            kind="hf_model", uri=str(p), fingerprint=f"{i}" * 64, meta={"model_dir": str(p), "stage": "apo", "seed": i}
        )
        for i, p in enumerate(soup_in)
    ]
    section = MergeConfig(soup=(SoupConfig(name="apo-s1", seed=1), SoupConfig(name="apo-s2", seed=2)))
    assert section.soup_mix() == pytest.approx((1 / 3, 1 / 3, 1 / 3))
    soup = merge(MergeSpec(weights=section.soup_mix()), arts, out=tmp_path / "soup", log=lambda _: None)
    assert soup["merged"] == ["apo (seed 0)", "apo (seed 1)", "apo (seed 2)"]
    soup_art = Artifact(
        kind="hf_model",
        uri=str(tmp_path / "soup"),
        fingerprint="s" * 64,
        meta={"model_dir": soup["model_dir"], "stage": "merge"},
    )
    base = Artifact(
        kind="hf_model",
        uri=str(world["base"]),
        fingerprint="b" * 64,
        meta={"model_dir": str(world["base"]), "stage": "long2"},
    )
    merge(MergeSpec(weights=section.weights), [soup_art, base], out=tmp_path / "final", log=lambda _: None)
    final = load_file(str(tmp_path / "final" / "model" / "model.safetensors"))
    parts = [load_file(str(p / "model.safetensors")) for p in soup_in]
    b = load_file(str(world["base"] / "model.safetensors"))
    for name in final:
        want = 0.9 * sum(p[name] for p in parts) / 3 + 0.1 * b[name]
        assert (final[name] - want).abs().max() < 1e-5


def test_merge_section_checks_the_soup():
    weighted = MergeConfig(soup=(SoupConfig(name="apo-b005", beta=0.05),), soup_weights=(0.7, 0.3))
    assert weighted.soup_mix() == (0.7, 0.3)
    assert SoupConfig(name="b", beta=0.05).apply(PreferenceConfig(beta=0.1, lr=1e-6)).beta == 0.05
    with pytest.raises(ValueError, match="soup_weights must be 2 non-negative numbers summing to 1"):
        MergeConfig(soup=(SoupConfig(name="x"),), soup_weights=(0.5, 0.3, 0.2))
    with pytest.raises(ValueError, match="soup_weights is set but posttrain.merge.soup is empty"):
        MergeConfig(soup_weights=(0.5, 0.5))
    with pytest.raises(ValueError, match="repeated: x"):
        MergeConfig(soup=(SoupConfig(name="x"), SoupConfig(name="x", seed=2)))
    with pytest.raises(ValueError, match="must be 2 non-negative"):
        MergeConfig(weights=(0.8, 0.1, 0.1))
    for taken in ("apo", "sao"):
        with pytest.raises(ValueError, match="labels of other post-training steps"):
            PosttrainConfig(merge={"soup": [{"name": taken}]})
    with pytest.raises(ValueError, match="preference.enabled is false"):
        PosttrainConfig(merge={"soup": [{"name": "apo2"}]}, preference={"enabled": False})
    with pytest.raises(ValueError, match="beta"):
        SoupConfig(name="y", beta=-1)


def test_micro_batches_make_the_batch_on_any_world_size():
    assert micro_batches(8, 8, 1) == (8, 1)
    assert micro_batches(8, 4, 1) == (4, 2)
    assert micro_batches(8, 8, 2) == (4, 1)
    assert micro_batches(256, 1, 64) == (1, 4)
    assert micro_batches(12, 5, 2) == (3, 2)  # 6 per rank: the largest divisor that fits is 3
    with pytest.raises(ValueError, match="posttrain.sft.batch 6 is not divisible by the 4 ranks"):
        micro_batches(6, 8, 4, "posttrain.sft.batch")


# --- GRPO: crash after a checkpoint, rerun resumes ----------------------------------------


class _Crash(Exception):
    pass


@pytest.mark.slow
def test_grpo_resumes_from_its_checkpoint_after_a_crash(world, tmp_path):
    """An exception right after the step-3 checkpoint; the rerun in the kept folder continues at
    step 4 (the launched variant, killed from outside: test_posttrain_launch.py)."""
    from transformers import TrainerCallback

    from tasks.posttrain.grpo import grpo
    from trainers.posttrain.common import complete_checkpoints
    from trainers.posttrain.grpo import train_grpo

    class CrashAfterSave(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            if state.global_step == 3:
                raise _Crash("killed after the step-3 checkpoint")

    class FirstStep(TrainerCallback):
        seen: list[int] = []
        pool: list[str] = []

        def on_step_begin(self, args, state, control, **kw):
            self.seen.append(state.global_step)

        def on_train_begin(self, args, state, control, train_dataloader=None, **kw):
            self.pool = [question(p) for p in train_dataloader.dataset["prompt"]]  # what the trainer samples from

    # a pool of the first 3 prompts: 6 updates x 2 prompts = 4 epochs of it
    cfg = GRPOConfig(
        max_steps=6, batch=4, num_generations=2, max_completion_length=12, save_steps=3, lr=1e-3, prompts=3
    )
    policy = Path(world["sft"]["model_dir"])
    d = grpo
    first, second = FirstStep(), FirstStep()
    first.seen, second.seen = [], []

    def build(callbacks):
        # the crash callback runs after the publishing one: the checkpoint is complete first
        return lambda out: train_grpo(
            cfg, policy, world["data"], out, device="cpu", log=lambda _: None, callbacks=callbacks
        )

    step_args = dict(
        root=tmp_path,
        step=d.name,
        version=d.version,
        kind=d.kind,
        config=cfg.model_dump(),
        inputs=(),
        resumable=d.resumable,
    )
    with pytest.raises(_Crash):
        run_step(**step_args, build=build([CrashAfterSave(), first]))
    folder = next(p for p in (tmp_path / "grpo").iterdir() if p.is_dir())
    assert read_marker(folder) is None
    assert [s for s, _, _ in complete_checkpoints(folder / "checkpoints")] == [3]
    outcome = run_step(**step_args, build=build([second]))
    meta = outcome.artifact.meta
    assert outcome.built and meta["resumed_from_step"] == 3 and meta["steps"] == 6
    written = [question(r["prompt"]) for r in read_jsonl(world["data"] / "prompts.jsonl")]
    assert len(written) > 3 and first.pool == second.pool == written[:3] and meta["prompts"] == 3
    assert first.seen[0] == 0 and second.seen[0] == 3  # continued at step 4, not from scratch
    assert Path(meta["model_dir"]).joinpath("model.safetensors").is_file()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    exact = [r["rewards/exact_match_reward/mean"] for r in rows if "rewards/exact_match_reward/mean" in r]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]  # no step twice after the resume
    # the reward's trend is over all 6 updates, across the resume: halves of 3 updates each
    assert len(exact) == 6 and meta["exact_reward_trend"] in {"rose", "fell", "flat"}
    assert [m for m, _ in meta["exact_reward_by_part"]] == [round(sum(exact[:3]) / 3, 4), round(sum(exact[3:]) / 3, 4)]
    final = complete_checkpoints(folder / "checkpoints")[-1]
    assert final[0] == 6 and final[2]["stage_end"] is True


def test_a_grpo_pool_larger_than_the_prompts_is_refused_naming_both(world, tmp_path):
    from trainers.posttrain.grpo import train_grpo

    n = len(read_jsonl(world["data"] / "prompts.jsonl"))
    cfg = GRPOConfig(max_steps=1, batch=2, num_generations=2, prompts=n + 1)
    with pytest.raises(ValueError, match=rf"posttrain.grpo.prompts = {n + 1}, but .*prompts.jsonl holds {n} prompts"):
        train_grpo(cfg, Path(world["sft"]["model_dir"]), world["data"], tmp_path, device="cpu", log=lambda _: None)
    assert not (tmp_path / "model").exists()
    # the recipe refuses it before any step runs when posttrain.data.prompts is smaller
    with pytest.raises(ValidationError, match="posttrain.grpo.prompts = 9 is more than the posttrain.data.prompts = 8"):
        PosttrainConfig(data={"prompts": 8}, grpo={"prompts": 9})
    # silent when the pool fits: as many as the data step writes, or unset
    assert PosttrainConfig(data={"prompts": 8}, grpo={"prompts": 8}).grpo.prompts == 8
    assert PosttrainConfig(data={"prompts": 8}).grpo.prompts is None


# --- on-policy distillation -------------------------------------------------------------------


def test_on_policy_distillation_from_a_local_teacher(world, tmp_path):
    from trainers.posttrain.distill import train_distill

    teacher = make_tiny_model(world["root"], [], seed=1, hidden=96)  # bigger, same tokenizer
    cfg = DistillConfig(teacher=str(teacher), max_steps=2, batch=4, max_completion_length=12)
    meta = train_distill(
        cfg, Path(world["sft"]["model_dir"]), world["data"], tmp_path, device="cpu", log=lambda _: None
    )
    assert meta["stage"] == "opd" and meta["steps"] == 2 and meta["last_loss"] is not None
    small_vocab = tmp_path / "other"
    make_tiny_model(small_vocab, ["abc def"] * 20)  # its own 300-token tokenizer
    with pytest.raises(ValueError, match="same tokenizer"):
        train_distill(
            cfg.model_copy(update={"teacher": str(next(small_vocab.glob("model-*")))}),
            Path(world["sft"]["model_dir"]),
            world["data"],
            tmp_path / "y",
            device="cpu",
        )
    # Same size, different tokens: a tokenizer trained on other text, padded to 512 entries.
    other = tmp_path / "other512"
    texts = [f"zq{i} xw{i * 7} vv{i % 13}" for i in range(3000)]
    make_tiny_model(other, texts)
    teacher2 = next(other.glob("model-*"))
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(str(teacher2)).vocab_size == 512
    with pytest.raises(ValueError, match="different vocabulary"):
        train_distill(
            cfg.model_copy(update={"teacher": str(teacher2)}),
            Path(world["sft"]["model_dir"]),
            world["data"],
            tmp_path / "z",
            device="cpu",
        )


# --- exact-match generation eval ------------------------------------------------------------


def test_generation_task_scores_exact_match_with_lm_eval(world, tmp_path):
    from curation.source_kinds import math_problem
    from evals.harness import run_lm_eval
    from evals.suite import arithmetic_generation_items, generation_task_yaml
    from tasks.evaluate import EvalConfig, SuiteSpec

    rng = random.Random(3)
    docs = ["Problem: {}\nSolution: {}\nAnswer: {}".format(*math_problem(rng)) for _ in range(6)]
    spec = SuiteSpec(eval=EvalConfig())
    items = arithmetic_generation_items(docs, 6, lambda q: spec.chat_prompt(q, think=False))
    assert all(set(i) == {"problem", "answer", "prompt"} for i in items) and len(items) == 6
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "g.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    (task_dir / "g.yaml").write_text(generation_task_yaml("gen_exact_test", task_dir / "g.jsonl", 8))
    scores = run_lm_eval(
        Path(world["sft"]["model_dir"]), task_dir, ["gen_exact_test"], EvalConfig(batch_size=6, device="cpu"), tmp_path
    )
    assert 0.0 <= scores["gen_exact_test"]["exact_match"] <= 1.0


def test_preference_rows_from_a_pairs_file(tmp_path):
    from trainers.posttrain.chat_data import preference_rows

    whole = {
        "prompt": "2+2?",
        "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}],
    }
    plain = {"prompt": "3+3?", "chosen": "6", "rejected": "7"}
    (tmp_path / "p.jsonl").write_text(json.dumps(whole) + "\n" + json.dumps(plain) + "\n")
    rows = preference_rows(f"files:{tmp_path}/p.jsonl")
    assert rows[0] == {
        "prompt": [{"role": "user", "content": "2+2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    assert rows[1] == plain
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x", "chosen": "y"}) + "\n")
    with pytest.raises(ValueError, match="row 0: missing rejected"):
        preference_rows(f"files:{tmp_path}/bad.jsonl")


def test_command_line_entry_runs_a_trainer_from_a_spec(world, tmp_path, capsys):
    """What every rank of a launch runs: `python -m trainers.posttrain spec.json` (here rank 0 alone)."""
    from trainers.posttrain.__main__ import main
    from trainers.posttrain.launch import TrainerSpec

    out = tmp_path / "sft"
    spec = TrainerSpec(
        trainer="sft",
        section={"max_steps": 1, "batch": 2, "max_length": 64},
        policy=str(world["base"]),
        data=str(world["data"]),
        out=str(out),
        device="cpu",
        tracker={"kind": "tensorboard"},
        tracker_dir=str(tmp_path / "tensorboard" / "run-a" / "sft-x"),
    )
    spec.save(tmp_path / "spec.json")
    assert main([str(tmp_path / "spec.json")]) == 0
    meta = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert meta["steps"] == 1 and Path(meta["model_dir"]).joinpath("model.safetensors").is_file()
    # the main rank's log rows reach the recipe's tracker, in the flow run's folder
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(spec.tracker_dir)
    board.Reload()
    assert [e.step for e in board.Scalars("train/loss")] == [1], board.Tags()["scalars"]
    # the held-out loss per reasoning mode, evaluated at the last step (and every save_steps)
    for mode in ("all", "think", "no_think"):
        assert [e.step for e in board.Scalars(f"train/eval_{mode}_loss")] == [1], board.Tags()["scalars"]
    assert json.loads((out / "result.json").read_text()) == meta  # what the launching step reads
    assert not (out / ".lease.json").exists()  # released
    assert main(["sft", str(tmp_path / "spec.json")]) == 2  # the old two-argument form is refused


def test_a_second_trainer_in_the_same_folder_is_refused(world, tmp_path, capsys):
    """Rank 0 leases the step folder first: a retry that starts while the old trainer lives exits
    with code 4 (the launchers' "another trainer holds the stage folder") and writes nothing."""
    import os
    import subprocess
    import sys
    import time

    from trainers.posttrain.__main__ import main
    from trainers.posttrain.launch import TrainerSpec

    out = tmp_path / "sft"
    TrainerSpec(
        trainer="sft",
        section={"max_steps": 1, "batch": 2},
        policy=str(world["base"]),
        data=str(world["data"]),
        out=str(out),
        device="cpu",
    ).save(tmp_path / "spec.json")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from infra.guard import StageLease; "
            "StageLease(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        assert main([str(tmp_path / "spec.json")]) == 4
        assert time.monotonic() - started < 30  # refused before loading anything
        assert "LeaseHeld" in capsys.readouterr().err and not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()


def test_posttrain_launch_is_the_recipe_launcher_with_its_own_size():
    from infra.launchers import LaunchConfig, SlurmLaunchConfig
    from trainers.posttrain.sections import PosttrainLaunchConfig

    base = LaunchConfig(
        kind="slurm",
        nodes=24,
        gpus_per_node=8,
        env={"NCCL_DEBUG": "WARN"},
        slurm=SlurmLaunchConfig(partition="hopper-prod"),
    )
    got = PosttrainLaunchConfig(
        nodes=8, accelerate_config="configs/accelerate/fsdp.yaml", env={"NCCL_IB_DISABLE": "0"}
    ).resolve(base, 8)
    assert (got.kind, got.nodes, got.procs_per_node, got.gpus_per_node, got.module) == (
        "slurm",
        8,
        8,
        8,
        "trainers.posttrain",
    )
    assert got.slurm.partition == "hopper-prod" and got.accelerate_config == "configs/accelerate/fsdp.yaml"
    assert got.env == {"NCCL_DEBUG": "WARN", "NCCL_IB_DISABLE": "0"}
    assert PosttrainLaunchConfig().resolve(base, 8).nodes == 24  # unset: the recipe's
    with pytest.raises(ValueError, match="posttrain.launch.env must not carry credentials"):
        PosttrainLaunchConfig(env={"HF_TOKEN": "x"})
