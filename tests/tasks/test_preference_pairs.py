"""The preference_pairs step: on-policy pairs per reasoning mode, each side's source recorded,
deterministic, and APO training on them; the pairing rules and the section's checks.

The policy is a random 2-layer SmolLM3 with our BPE tokenizer and dual-mode chat template
(tests/tasks/test_posttrain_steps.py `make_tiny_model`): its greedy answers are never right, so
every builtin prompt gives a pair against the verified reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from curation.pairing import final_answer
from pipeline.artifact import Artifact
from tasks.posttrain.data import posttrain_data
from tasks.posttrain.preference_pairs import preference_pairs
from tests.tasks.test_posttrain_steps import corpus_texts, make_corpora, make_tiny_model
from trainers.posttrain.chat_data import read_jsonl
from trainers.posttrain.sections import (
    ChatDataConfig,
    ChatDataSpec,
    PairModeConfig,
    PairsConfig,
    PairsSpec,
    PosttrainConfig,
    PreferenceConfig,
    ReasoningModesConfig,
)

DATA = ChatDataConfig(math_examples=40, prose_examples=8, heldout_examples=4, prompts=16, think_share=0.5)
PAIRS = PairsConfig(
    think=PairModeConfig(max_prompts=4, max_new_tokens=24), no_think=PairModeConfig(max_prompts=4, max_new_tokens=12)
)

pytestmark = pytest.mark.xdist_group("preference-pairs-world")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Builtin corpora, posttrain_data's folder and a random tiny policy, as input artifacts."""
    import torch

    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("pairs")
    corpora = make_corpora(root / "corpora", math_docs=120, prose_docs=16)
    texts = corpus_texts(corpora)
    policy = make_tiny_model(root, texts)
    posttrain_data(ChatDataSpec(data=DATA), corpora, out=root / "data", log=lambda _: None)
    return {
        "root": root,
        "texts": texts,
        "data": Artifact(kind="corpus", uri=str(root / "data"), fingerprint="d" * 64, meta={}),
        "policy": Artifact(
            kind="hf_model", uri=str(root), fingerprint="p" * 64, meta={"model_dir": str(policy), "stage": "sft"}
        ),
    }


def build(world, spec: PairsSpec, name: str) -> tuple[dict, list[dict]]:
    lines: list[str] = []
    out = world["root"] / name
    meta = preference_pairs(spec, model=world["policy"], data=world["data"], out=out, log=lines.append)
    meta["log"] = lines
    return meta, read_jsonl(out / "pairs.jsonl")


def test_pairs_per_mode_record_their_sources_and_are_deterministic(world):
    spec = PairsSpec(pairs=PAIRS, seed=3, device="cpu")
    meta, rows = build(world, spec, "a")
    assert meta["pairs"] == len(rows) == 8  # a random policy is never right: no pair dropped
    assert [r["mode"] for r in rows] == ["think"] * 4 + ["no_think"] * 4
    assert {(r["chosen_source"], r["rejected_source"]) for r in rows} == {("reference", "policy")}
    assert meta["modes"]["think"]["rejected_accuracy"] == 0.0 and meta["modes"]["think"]["chosen_accuracy"] == 1.0
    assert meta["policy"] == {"fingerprint": "p" * 64, "stage": "sft"}
    prompts = {q["question"]: q for q in map(_question, read_jsonl(world["data"].path / "prompts.jsonl"))}
    for r in rows:
        system, user = r["prompt"]
        question = prompts[user["content"]]
        chosen = r["chosen"][0]["content"]
        assert final_answer(chosen) == question["answer"]  # the verified answer, in the mode's format
        if r["mode"] == "think":
            assert system == {"role": "system", "content": ReasoningModesConfig().think_system}
            assert chosen.startswith("<think>\nThe question: ") and "</think>\nAnswer: " in chosen
        else:
            assert system == {"role": "system", "content": "/no_think"}
            assert chosen == question["reference"] and "<think>" not in chosen
    # the rejected side is the policy's greedy answer in that mode, and a rerun gives the same bytes
    from trainers.posttrain.sampling import chat_answers, load_chat_model

    model, tokenizer = load_chat_model(world["policy"].meta["model_dir"], "cpu")
    for mode, n in (("think", 24), ("no_think", 12)):
        mine = [r for r in rows if r["mode"] == mode]
        greedy = chat_answers(model, tokenizer, [r["prompt"] for r in mine], mode, n)
        assert [r["rejected"][0]["content"] for r in mine] == greedy
    _, again = build(world, spec, "b")
    assert (world["root"] / "a" / "pairs.jsonl").read_bytes() == (world["root"] / "b" / "pairs.jsonl").read_bytes()
    assert again == rows
    # another seed draws other prompts
    _, other = build(world, PairsSpec(pairs=PAIRS, seed=4, device="cpu"), "c")
    assert [r["prompt"] for r in other] != [r["prompt"] for r in rows]


def _question(row: dict) -> dict:
    return {"question": row["prompt"][-1]["content"], "answer": row["answer"], "reference": row["reference"]}


def test_a_named_model_and_a_pairs_dataset_are_sources(world, tmp_path):
    """chosen `model:FOLDER` (here a second tiny model standing in for a stronger one) against the
    policy in think mode, on the prompts of a dataset file (no known answers: nothing is dropped
    for being wrong); no-think pairs read from a Tulu-3-style dataset file."""
    stronger = make_tiny_model(tmp_path, world["texts"], seed=7)
    prompts_file = tmp_path / "prompts.jsonl"
    asks = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Add {i} and 3."}] for i in range(6)
    ]
    prompts_file.write_text("".join(json.dumps({"prompt": a}) + "\n" for a in asks))
    pairs_file = tmp_path / "tulu.jsonl"
    tulu = [
        {
            "prompt": f"Name a colour ({i}).",
            "chosen": [{"role": "user", "content": f"Name a colour ({i})."}, {"role": "assistant", "content": "Blue."}],
            "rejected": [{"role": "user", "content": f"Name a colour ({i})."}, {"role": "assistant", "content": "No."}],
        }
        for i in range(5)
    ]
    pairs_file.write_text("".join(json.dumps(r) + "\n" for r in tulu))
    cfg = PairsConfig(
        think=PairModeConfig(
            prompts=f"files:{prompts_file}",
            max_prompts=3,
            max_new_tokens=16,
            chosen=f"model:{stronger}",
            temperature=1.0,  # seeded sampling: a random model's greedy answer may be empty
        ),
        no_think=PairModeConfig(pairs=f"files:{pairs_file}", max_prompts=4),
    )
    meta, rows = build(world, PairsSpec(pairs=cfg, device="cpu"), "named")
    think = [r for r in rows if r["mode"] == "think"]
    assert {(r["chosen_source"], r["rejected_source"]) for r in think} == {(f"model:{stronger}", "policy")}
    assert len(think) == meta["modes"]["think"]["prompts"] == 3 and "chosen_accuracy" not in meta["modes"]["think"]
    assert {r["prompt"][0]["content"] for r in think} == {"Be brief. /think"}
    assert len({r["prompt"][1]["content"] for r in think}) == 3
    no_think = [r for r in rows if r["mode"] == "no_think"]
    assert len(no_think) == 4 and meta["modes"]["no_think"]["source"] == f"files:{pairs_file}"
    assert all(r["chosen_source"] == r["rejected_source"] == f"files:{pairs_file}" for r in no_think)
    assert no_think[0]["prompt"] == [
        {"role": "system", "content": "/no_think"},
        {"role": "user", "content": "Name a colour (0)."},
    ]
    assert (no_think[0]["chosen"], no_think[0]["rejected"]) == (
        [{"role": "assistant", "content": "Blue."}],
        [{"role": "assistant", "content": "No."}],
    )


def test_apo_trains_on_the_on_policy_pairs(world):
    from trainers.posttrain.preference import train_preference

    build(world, PairsSpec(pairs=PAIRS, device="cpu"), "for-apo")
    cfg = PreferenceConfig(max_steps=2, batch=4, pairs="on_policy")
    out = world["root"] / "apo"
    meta = train_preference(
        cfg, Path(world["policy"].meta["model_dir"]), world["root"] / "for-apo", out, device="cpu", log=lambda _: None
    )
    assert meta["steps"] == 2 and meta["pairs"] == 8
    assert meta["pairs_by_mode"] == {"think": 4, "no_think": 4}
    assert meta["pair_sources"] == {"reference > policy": 8}
    assert read_jsonl(out / "pairs.jsonl")[0]["chosen_source"] == "reference"
    with pytest.raises(FileNotFoundError, match="preference_pairs step's folder"):
        train_preference(cfg, Path(world["policy"].meta["model_dir"]), world["data"].path, out / "x", device="cpu")


def test_the_pairs_section_refuses_pairs_without_two_sources():
    with pytest.raises(ValidationError, match="chosen and rejected are both 'policy'"):
        PairModeConfig(chosen="policy", rejected="policy")
    with pytest.raises(ValidationError, match="rejected 'reference'"):
        PairModeConfig(chosen="policy", rejected="reference")
    with pytest.raises(ValidationError, match="needs the builtin prompts"):
        PairModeConfig(prompts="hf:allenai/llama-3.1-tulu-3-8b-preference-mixture")
    with pytest.raises(ValidationError, match="unknown pair source 'qwen'"):
        PairModeConfig(chosen="qwen")
    with pytest.raises(ValidationError, match="posttrain.pairs names no mode"):
        PosttrainConfig(preference=PreferenceConfig(pairs="on_policy"))
    with pytest.raises(ValidationError, match="pairs"):
        PosttrainConfig.model_validate({"merge": {"soup": [{"name": "pairs"}]}})


def test_a_prompts_dataset_without_the_prompt_column_is_named(world, tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(json.dumps({"question": "Hi"}) + "\n")
    cfg = PairsConfig(
        think=PairModeConfig(
            prompts=f"files:{bad}", chosen=f"model:{world['policy'].meta['model_dir']}", rejected="policy"
        )
    )
    with pytest.raises(KeyError, match="has no column 'prompt'.*posttrain.pairs.think.prompt_field"):
        preference_pairs(
            PairsSpec(pairs=cfg, device="cpu"), model=world["policy"], data=world["data"], out=tmp_path / "o"
        )


# The kill test's child: one attempt of the step as the runner makes it (run_step with the step's
# own `resumable`), its log lines on stdout.
_ATTEMPT = """
import json, sys
from pathlib import Path
from tests.tasks.test_preference_pairs import attempt
from trainers.posttrain.sections import PairsSpec
from pipeline.artifact import Artifact
args = json.loads(sys.argv[1])
inputs = {k: Artifact.model_validate_json(v) for k, v in args["inputs"].items()}
attempt(Path(args["root"]), PairsSpec.model_validate_json(args["spec"]), inputs, print)
"""


def attempt(root: Path, spec: PairsSpec, inputs: dict, log) -> Artifact:
    """One run of the step in workspace `root`, through run_step as the runner calls it."""
    from pipeline.artifact import run_step

    d = preference_pairs
    return run_step(
        root=root,
        step=d.name,
        version=d.version,
        kind=d.kind,
        config=spec,
        inputs=inputs,
        extra=d.facts(spec),
        build=lambda out: d.run(spec, inputs, out, log=log),
        resumable=d.resumable,
    ).artifact


def _marked_inputs(world, tmp_path) -> dict:
    """The world's data and policy as finished step folders (run_step checks its inputs' markers)."""
    import shutil

    from infra.files import STEP_MARKER, mark_complete

    shutil.copytree(world["data"].path, tmp_path / "inputs" / "data")
    (tmp_path / "inputs" / "policy").mkdir()
    data = world["data"].model_copy(update={"uri": str(tmp_path / "inputs" / "data")})
    policy = world["policy"].model_copy(update={"uri": str(tmp_path / "inputs" / "policy")})
    for art in (data, policy):
        mark_complete(art.path, STEP_MARKER, {"artifact": art.model_dump(mode="json")})
    return {"model": policy, "data": data}


@pytest.mark.slow
def test_a_killed_step_resumes_from_its_chunks_and_writes_the_same_bytes(world, tmp_path):
    """Chunks of 2 prompts (batches of 1, 2 per chunk): 4 chunks per mode. Think mode pairs the
    policy with itself as a named model (every pair dropped, as the same or an empty answer: the
    counts are summed over chunks); both modes sample (seeded, temperature 1), so the chunked
    answers must draw what one batch list draws. A run killed from outside after its first chunk
    leaves no pairs.jsonl; the rerun keeps the chunks written and writes the bytes and counts of
    an uninterrupted run, which are also those of one chunk per mode."""
    import signal
    import subprocess
    import sys
    import time

    inputs = _marked_inputs(world, tmp_path)
    policy = world["policy"].meta["model_dir"]
    common = {"max_prompts": 8, "batch_size": 1}
    pairs = PairsConfig(
        think=PairModeConfig(chosen=f"model:{policy}", max_new_tokens=16, temperature=1.0, chunk_batches=2, **common),
        no_think=PairModeConfig(max_new_tokens=12, temperature=1.0, chunk_batches=2, **common),
    )
    spec = PairsSpec(pairs=pairs, seed=5, device="cpu")
    whole = attempt(tmp_path / "whole", spec, inputs, lambda _: None)
    one_chunk = PairsConfig(
        think=pairs.think.model_copy(update={"chunk_batches": 8}),
        no_think=pairs.no_think.model_copy(update={"chunk_batches": 8}),
    )
    single = attempt(tmp_path / "single", PairsSpec(pairs=one_chunk, seed=5, device="cpu"), inputs, lambda _: None)
    expected = (whole.path / "pairs.jsonl").read_bytes()
    assert (single.path / "pairs.jsonl").read_bytes() == expected and single.fingerprint == whole.fingerprint
    think = whole.meta["modes"]["think"]  # the same model twice: no pair kept, each drop counted
    assert think["pairs"] == 0 and sum(think["dropped"].values()) == 8, think
    assert set(think["dropped"]) <= {"same_answer", "empty_chosen"}
    assert whole.meta["modes"]["no_think"]["pairs"] == 8 and whole.meta["pairs"] == 8
    assert not (whole.path / "chunks").exists()

    root = tmp_path / "killed"
    args = {
        "root": str(root),
        "spec": spec.model_dump_json(),
        "inputs": {k: v.model_dump_json() for k, v in inputs.items()},
    }
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", _ATTEMPT, json.dumps(args)],
        cwd=repo,
        env={**__import__("os").environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not list(root.glob("preference_pairs/*/chunks/*.json")):
        assert child.poll() is None, f"the step ended before its first chunk: {child.stdout.read().decode()[-2000:]}"
        assert time.monotonic() < deadline, "no chunk written within 300 s"
        time.sleep(0.01)
    __import__("os").killpg(child.pid, signal.SIGKILL)
    child.wait(timeout=60)
    child.stdout.close()
    (folder,) = [p for p in root.glob("preference_pairs/*") if p.is_dir()]  # beside it: its lock file
    done = {m: len(list(folder.glob(f"chunks/{m}-*.json"))) for m in ("think", "no_think")}
    assert 1 <= done["think"] + done["no_think"] < 8, done
    assert not (folder / "pairs.jsonl").exists() and not (folder / "_COMPLETE.json").exists()

    lines: list[str] = []
    again = attempt(root, spec, inputs, lines.append)
    assert (again.path / "pairs.jsonl").read_bytes() == expected
    assert again.meta["modes"] == whole.meta["modes"] and again.meta["pairs"] == 8
    for mode, n in done.items():
        resumed = [line for line in lines if line.startswith(f"preference_pairs {mode}: resuming")]
        assert resumed == ([f"preference_pairs {mode}: resuming, {n} of 4 chunks already written"] if n else [])
    assert not (again.path / "chunks").exists()
