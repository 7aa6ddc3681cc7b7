"""curation/reasoning.py: reasoning traces for the mid-training stage and their token shards."""

from __future__ import annotations

import re

import numpy as np

from curation.reasoning import as_messages, builtin_traces, heldout_problems, two_step_problem, write_token_shard
from model.token_shards import TokenShard, check_token_size
from trainers.posttrain.sections import ReasoningModesConfig

MODES = ReasoningModesConfig()  # the recipe's reasoning_modes at their defaults


def test_builtin_traces_are_seeded_think_conversations_whose_every_step_is_right():
    first, again, other = builtin_traces(40, 0, MODES), builtin_traces(40, 0, MODES), builtin_traces(40, 1, MODES)
    assert first == again and first != other
    two_step = 0
    for conv in first:
        system, user, reply = (m["content"] for m in conv["messages"])
        assert system == MODES.think_system and reply.startswith("<think>\nThe question: " + user)
        trace, final = reply.removeprefix("<think>\n").split("\n</think>\n")
        assert re.fullmatch(r"Answer: -?\d+", final) and "Check: " in trace
        equations = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", trace)
        assert equations and all(eval(f"{x} {op} {y}") == int(z) for x, op, y, z in equations)
        two_step += " * " in user and " + " in user or "change" in user
    assert 5 <= two_step <= 25  # about a third are two-step problems
    own = ReasoningModesConfig(think_system="Reason, then answer. /think")
    assert {c["messages"][0]["content"] for c in builtin_traces(5, 0, own)} == {"Reason, then answer. /think"}


def test_a_two_step_problem_is_worked_in_both_steps_and_its_answer_is_right():
    import random

    rng = random.Random(3)
    for _ in range(50):
        problem, solution, answer = two_step_problem(rng)
        steps = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", solution)
        assert len(steps) == 2 and steps[-1][3] == answer and int(answer) >= 0
        assert all(eval(f"{x} {op} {y}") == int(z) for x, op, y, z in steps)


def test_problems_the_evaluations_hold_out_are_never_generated():
    plain = builtin_traces(30, 0, MODES)
    asked = [c["messages"][1]["content"] for c in plain[:10]]
    heldout = [f"Problem: {q}\nSolution: x\nAnswer: 1" for q in asked] + ["not a math document"]
    assert list(heldout_problems(heldout)) == asked
    kept = builtin_traces(30, 0, MODES, exclude=heldout_problems(heldout))
    assert len(kept) == 30 and not {c["messages"][1]["content"] for c in kept} & set(asked)


def test_conversations_come_from_messages_or_sharegpt_rows():
    sharegpt = [{"from": "human", "value": "2 + 2?"}, {"from": "gpt", "value": "<think>\n2 + 2 = 4\n</think>\n4"}]
    assert as_messages(sharegpt) == [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "<think>\n2 + 2 = 4\n</think>\n4"},
    ]
    messages = [
        {"role": "system", "content": "/think"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    assert as_messages(messages) == messages
    assert as_messages([{"role": "user", "content": "no reply"}]) is None
    assert as_messages([{"from": "narrator", "value": "x"}]) is None and as_messages("text") is None


def test_a_token_shard_is_what_the_pretraining_loader_reads(tmp_path):
    docs = [[5, 6, 7, 0], [8, 0], [9, 10, 11, 12, 0]]
    path = tmp_path / "reasoning_00000.ds"
    assert write_token_shard(path, docs, "uint16", "trained") == 11
    shard = TokenShard(path, "uint16")
    assert len(shard) == 11 and shard.doc_ends.tolist() == [4, 6, 11]
    assert np.fromfile(path, dtype="<u2").tolist() == [t for d in docs for t in d]
    check_token_size(path, "uint16")  # the metadata names 2-byte tokens
    assert (tmp_path / "reasoning_00000.ds.metadata").read_text().splitlines()[:2] == ["trained|2", "11"]


def test_builtin_traces_with_max_operand_work_small_problems_in_every_step():
    import random

    rng = random.Random(4)
    for _ in range(100):
        problem, solution, answer = two_step_problem(rng, max_operand=9)
        steps = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", solution)
        assert len(steps) == 2 and steps[-1][3] == answer and int(answer) >= 0
        assert all(eval(f"{x} {op} {y}") == int(z) for x, op, y, z in steps)
        if "change" in problem:  # paid with the next multiple of 10 above the cost
            cost, paid = int(steps[0][3]), int(steps[1][0])
            assert paid % 10 == 0 and 0 < paid - cost <= 10
        else:
            assert max(int(n) for n in re.findall(r"\d+", problem)) <= 9
    small = builtin_traces(40, 0, MODES, max_operand=9)
    assert small == builtin_traces(40, 0, MODES, max_operand=9) and small != builtin_traces(40, 0, MODES)
    for conv in small:
        trace = conv["messages"][2]["content"]
        equations = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", trace)
        assert equations and all(eval(f"{x} {op} {y}") == int(z) for x, op, y, z in equations)
