"""The reasoning_data step: reasoning traces rendered with the chat template (think mode) and
written as token shards that the mixture step plans and the pretraining loader reads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from curation.reasoning import builtin_traces
from pipeline.artifact import Artifact, identity
from tasks.mixture import MixtureSpec, mixture
from tasks.reasoning_data import ReasoningDataConfig, ReasoningDataSpec, reasoning_data
from tasks.tokenizer import TokenizerConfig, tokenizer
from tests.tasks.datafiles import corpus
from trainers.posttrain.sections import ReasoningModesConfig

MODES = ReasoningModesConfig()  # the recipe's reasoning_modes at their defaults


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A BPE trained on arithmetic traces, and a math corpus whose held-out split asks the first
    problem the builtin generator would draw."""
    tmp = tmp_path_factory.mktemp("reasoning")
    texts = [c["messages"][2]["content"] for c in builtin_traces(200, 9, MODES)]
    src = corpus(tmp / "tokdata", [(f"t{i}", t) for i, t in enumerate(texts)])
    out = tmp / "tok"
    out.mkdir()
    meta = tokenizer(TokenizerConfig(vocab_size=600, min_frequency=1), [src], out=out)
    tok = Artifact(kind="tokenizer", uri=str(out), fingerprint="2" * 64, meta=meta)
    asked = builtin_traces(1, 0, MODES)[0]["messages"][1]["content"]
    math = corpus(
        tmp / "math", [("m0", "x")], heldout=[("h0", f"Problem: {asked}\nSolution: x\nAnswer: 1")], domain="math"
    )
    return tok, math, asked


def shard_texts(out, meta, hf) -> list[list[str]]:
    """Each token shard's documents decoded (EOS left off), checking every one ends in EOS."""
    got = []
    for name in meta["files"]:
        tokens = np.fromfile(out / name, dtype="<u2")
        ends = np.fromfile(out / f"{name}.index", dtype="<u8").astype(np.int64)
        assert ends[-1] == len(tokens) and (tokens[ends - 1] == meta["eos_id"]).all()
        starts = np.concatenate([[0], ends[:-1]])
        got.append([hf.decode(tokens[s : e - 1].tolist()) for s, e in zip(starts, ends, strict=True)])
    return got


def test_builtin_traces_become_think_mode_chatml_documents_each_closed_by_eos(world, tmp_path):
    from transformers import AutoTokenizer

    tok, math, asked = world
    spec = ReasoningDataSpec(data=ReasoningDataConfig(name="reasoning", examples=12), seed=0, shards=3)
    meta = reasoning_data(spec, tokenizer=tok, heldout=(math,), out=tmp_path)
    assert meta["source"] == "reasoning" and meta["documents"] == 12 == meta["think_conversations"]
    assert meta["files"] == [f"reasoning_{s:05d}_00000_doc_shuffled.ds" for s in range(3)]
    assert meta["token_dtype"] == "uint16" and meta["eos_id"] == 0
    hf = AutoTokenizer.from_pretrained(str(tok.path))
    texts = shard_texts(tmp_path, meta, hf)
    assert meta["tokens"] == sum(np.fromfile(tmp_path / f, dtype="<u2").size for f in meta["files"])
    # every document is the chat template's rendering of one conversation, in /think mode;
    # conversation k in shard k mod 3; the held-out problem is drawn again, so never asked
    convs = builtin_traces(12, 0, MODES, exclude=[asked])
    rendered = [hf.apply_chat_template(c["messages"], tokenize=False) for c in convs]
    assert [sorted(t) for t in texts] == [sorted(rendered[s::3]) for s in range(3)]
    assert all("Reasoning Mode: /think" in t and "</think>\nAnswer: " in t for t in rendered)
    assert not any(f"<|im_start|>user\n{asked}<|im_end|>" in t for shard in texts for t in shard)
    assert texts[0] != rendered[0::3]  # shuffled within the shard
    assert not (tmp_path / "work" / "convs").exists()  # the conversations' copy is removed
    # the system turn is the recipe's reasoning_modes.think_system (out of the identity at its default)
    own = ReasoningModesConfig(think_system="Reason it out. /think")
    (tmp_path.parent / "own").mkdir()
    meta_own = reasoning_data(
        spec.model_copy(update={"modes": own}), tokenizer=tok, heldout=(math,), out=tmp_path.parent / "own"
    )
    own_texts = [t for shard in shard_texts(tmp_path.parent / "own", meta_own, hf) for t in shard]
    assert meta_own["documents"] == 12 and all("## Custom Instructions\n\nReason it out.\n\n" in t for t in own_texts)
    assert (
        "modes" not in identity(spec) and identity(spec.model_copy(update={"modes": own}))["modes"] == own.model_dump()
    )
    # the mixture step plans it like any token shards, and a second build is byte-identical
    plan_dir = tmp_path.parent / "plan"
    plan_dir.mkdir()
    shards = Artifact(kind="shards", uri=str(tmp_path), fingerprint="3" * 64, meta=meta)
    mixture_file = tmp_path.parent / "reasoning.yaml"
    mixture_file.write_text("weights: {reasoning: 1.0}\n")
    planned = mixture(
        MixtureSpec(name="reasoning", mixture=str(mixture_file), tokens=4 * meta["tokens"], seq_len=64, max_epochs=5),
        shards=(shards,),
        out=plan_dir,
    )
    assert planned["expected_epochs"] == {"reasoning": 4.0}
    again = tmp_path.parent / "again"
    again.mkdir()
    reasoning_data(spec, tokenizer=tok, heldout=(math,), out=again)
    for name in meta["files"]:
        assert (again / name).read_bytes() == (tmp_path / name).read_bytes()


def test_the_output_is_the_same_for_any_reader_task_and_worker_count_and_follows_the_seed(world, tmp_path):
    tok, math, _ = world
    data = ReasoningDataConfig(name="reasoning", examples=30)
    runs = {}
    for read_tasks, workers in ((1, 1), (4, 2), (7, 3)):
        out = tmp_path / f"r{read_tasks}"
        out.mkdir()
        spec = ReasoningDataSpec(data=data, seed=0, shards=4, read_tasks=read_tasks, workers=workers)
        meta = reasoning_data(spec, tokenizer=tok, heldout=(math,), out=out)
        assert len(list((out / "work" / "read").glob("*.json"))) == read_tasks
        runs[read_tasks] = (meta, {f: (out / f).read_bytes() for f in meta["files"]})
        for f in meta["files"]:
            runs[read_tasks][1][f + ".index"] = (out / f"{f}.index").read_bytes()
    assert runs[1] == runs[4] == runs[7] and len(runs[1][0]["files"]) == 4
    other = tmp_path / "seed1"
    other.mkdir()
    meta = reasoning_data(ReasoningDataSpec(data=data, seed=1, shards=4), tokenizer=tok, heldout=(math,), out=other)
    assert (other / meta["files"][0]).read_bytes() != runs[1][1][meta["files"][0]]
    # fewer conversations than shards: one shard per conversation, none empty
    few = tmp_path / "few"
    few.mkdir()
    small = ReasoningDataSpec(data=ReasoningDataConfig(name="reasoning", examples=2), seed=0, shards=4)
    assert len(reasoning_data(small, tokenizer=tok, heldout=(math,), out=few)["files"]) == 2


def test_builtin_traces_with_max_operand_are_the_small_problems_and_only_builtin_takes_it(world, tmp_path):
    from pydantic import ValidationError
    from transformers import AutoTokenizer

    tok, math, _ = world
    cfg = ReasoningDataConfig(name="reasoning", examples=12, max_operand=9)
    meta = reasoning_data(ReasoningDataSpec(data=cfg, seed=0), tokenizer=tok, heldout=(math,), out=tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tok.path))
    texts = {t for shard in shard_texts(tmp_path, meta, hf) for t in shard}
    small = builtin_traces(12, 0, MODES, max_operand=9)
    assert meta["documents"] == 12 and texts == {hf.apply_chat_template(c["messages"], tokenize=False) for c in small}
    assert "max_operand" not in identity(ReasoningDataConfig(name="reasoning"))
    assert identity(cfg)["max_operand"] == 9
    with pytest.raises(ValidationError, match="max_operand"):
        ReasoningDataConfig(name="r", uri="files:/tmp/*.jsonl", max_operand=9)


def test_files_rows_in_sharegpt_form_are_read_and_bad_rows_counted(world, tmp_path):
    tok, _, _ = world
    rows = [
        {
            "conversations": [
                {"from": "human", "value": "What is 2 + 3?"},
                {"from": "gpt", "value": "<think>\n2 + 3 = 5\n</think>\nAnswer: 5"},
            ]
        },
        {"conversations": "not a conversation"},
    ]
    data = tmp_path / "traces.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    out.mkdir()
    cfg = ReasoningDataConfig(name="traces", uri=f"files:{data}", messages_field="conversations")
    meta = reasoning_data(ReasoningDataSpec(data=cfg), tokenizer=tok, out=out)
    assert meta["documents"] == 1 and meta["rejected"] == {"not_a_conversation": 1} and meta["think_conversations"] == 1
    wrong = ReasoningDataConfig(name="traces", uri=f"files:{data}")  # the default `messages` column is absent
    with pytest.raises(ValueError, match=r"reasoning_data\[traces\].messages_field"):
        reasoning_data(ReasoningDataSpec(data=wrong), tokenizer=tok, out=tmp_path / "bad")
