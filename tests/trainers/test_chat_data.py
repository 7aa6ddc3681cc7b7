"""Chat data of files:/hf: datasets: conversations with held-out rows apart and bad rows counted,
and the digest of local data files that enters the posttrain_data step's fingerprint."""

from __future__ import annotations

import json

import pytest

from trainers.posttrain.chat_data import data_state, external_conversations
from trainers.posttrain.sections import ChatDataConfig


def test_external_chat_data_from_jsonl_and_save_to_disk(tmp_path):
    import datasets

    rows = [
        {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
        for i in range(40)
    ]
    rows += [{"messages": [{"role": "user", "content": "no reply"}]}, {"messages": "oops"}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, heldout, rejected = external_conversations(
        ChatDataConfig(uri=f"files:{tmp_path}/*.jsonl", held_out_fraction=0.2)
    )
    assert len(train) + len(heldout) == 40 and heldout and dict(rejected) == {"no_assistant_turn": 1, "not_a_list": 1}
    datasets.Dataset.from_list(rows[:40]).save_to_disk(str(tmp_path / "disk"))
    train2, heldout2, _ = external_conversations(ChatDataConfig(uri=f"hf:{tmp_path}/disk", held_out_fraction=0.2))
    assert (len(train2), len(heldout2)) == (len(train), len(heldout))
    with pytest.raises(ValueError, match="messages_field"):
        external_conversations(ChatDataConfig(uri=f"files:{tmp_path}/*.jsonl", messages_field="conversation"))
    with pytest.raises(ValueError, match="unknown chat data 'smoltalk'"):
        ChatDataConfig(uri="smoltalk")


def test_edited_local_data_changes_the_fingerprint(tmp_path):
    import os

    f = tmp_path / "chat.jsonl"
    f.write_text("{}\n")
    before = data_state(f"files:{tmp_path}/*.jsonl")
    f.write_text("{}\n{}\n")
    os.utime(f, ns=(1, 1))
    assert data_state(f"files:{tmp_path}/*.jsonl") != before
    assert data_state("builtin") == "" and data_state("self") == ""


def test_a_conversation_is_in_the_mode_its_system_turn_renders():
    from trainers.posttrain.chat_data import by_mode, conversation_mode

    no_think = [{"role": "system", "content": "/no_think"}, {"role": "user", "content": "q"}]
    think = [{"role": "system", "content": "Think step by step, then answer. /think"}, {"role": "user", "content": "q"}]
    default = [{"role": "user", "content": "q"}]  # no system turn: the template's default, /think
    assert [conversation_mode(m) for m in (no_think, think, default)] == ["no_think", "think", "think"]
    rows = [{"messages": m} for m in (no_think, think, default)]
    assert by_mode(rows) == {"think": rows[1:], "no_think": rows[:1]}
    assert by_mode(rows[:1]) == {"no_think": rows[:1]}


def test_smoltalk2_style_rows_keep_their_mode_and_a_split_list_reads_as_one(tmp_path):
    """SmolTalk2's no-think rows say so in `chat_template_kwargs`: the conversation gets the
    /no_think flag (a flag already in the system turn wins); a list of splits with shares is read
    as `datasets` reads `a+b[:50%]`."""
    import datasets

    def row(i: int, thinking: bool | None, system: str | None = None) -> dict:
        msgs = [{"role": "system", "content": system}] if system is not None else []
        msgs += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]
        return {"messages": msgs, "chat_template_kwargs": {"enable_thinking": thinking}}

    think = [row(i, True) for i in range(4)]
    plain = [row(i, False) for i in range(4, 8)]
    plain[1] = row(5, False, "Be brief.")
    plain[2] = row(6, False, "Reason. /think")
    datasets.DatasetDict(
        {"a_think": datasets.Dataset.from_list(think), "b_no_think": datasets.Dataset.from_list(plain)}
    ).save_to_disk(str(tmp_path / "disk"))
    cfg = ChatDataConfig(uri=f"hf:{tmp_path}/disk", hf_split=["a_think", "b_no_think[:50%]"], held_out_fraction=0.0)
    assert cfg.hf_split == "a_think+b_no_think[:50%]"
    train, _, _ = external_conversations(cfg)
    assert [m["messages"][0] for m in train[4:]] == [
        {"role": "system", "content": "/no_think"},
        {"role": "system", "content": "Be brief. /no_think"},
    ]
    assert len(train) == 6 and all(m["messages"][0]["role"] == "user" for m in train[:4])
    with pytest.raises(ValueError, match="a list must hold split names"):
        ChatDataConfig(hf_split=[])
