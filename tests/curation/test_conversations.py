"""curation/conversations.py: chat conversations and arithmetic prompts made from curated text."""

from __future__ import annotations

import random

from curation.conversations import math_conversation, prose_conversation
from trainers.posttrain.sections import ReasoningModesConfig

MODES = ReasoningModesConfig()  # the recipe's reasoning_modes at their defaults


def test_a_math_document_becomes_a_question_and_its_worked_solution():
    conv = math_conversation("Problem: What is 2 + 3?\nSolution: 2 + 3 = 5.\nAnswer: 5", MODES)
    assert conv["messages"][0] == {"role": "system", "content": "/no_think"}  # a direct answer
    assert conv["messages"][2]["content"] == "2 + 3 = 5.\nAnswer: 5" and conv["answer"] == "5"
    assert math_conversation("Just some prose without a problem.", MODES) is None
    # the system turns are the recipe's reasoning_modes
    own = ReasoningModesConfig(think_system="Show your work. /think", no_think_system="Be direct. /no_think")
    text = "Problem: What is 2 + 3?\nSolution: 2 + 3 = 5.\nAnswer: 5"
    assert math_conversation(text, own)["messages"][0]["content"] == "Be direct. /no_think"
    assert math_conversation(text, own, think=True)["messages"][0]["content"] == "Show your work. /think"


def test_a_prose_passage_becomes_an_instruction_or_nothing_when_too_short():
    text = " ".join(f"word{i}" for i in range(100))
    kinds = set()
    for seed in range(8):
        system, user, assistant = (
            m["content"] for m in prose_conversation(text, random.Random(seed), MODES)["messages"]
        )
        assert system == "/no_think"
        kind, passage = user.split(":\n", 1)
        kinds.add(kind)
        if kind == "Continue this passage":  # 40 words given, the next 20 expected, as written
            assert len(passage.split()) == 40 and f"{passage} {assistant}" in text
        else:  # a 60-word window, and its lead (no sentence ends here: its first 20 words)
            assert kind == "Summarise this passage in one sentence" and passage in text
            assert len(passage.split()) == 60 and passage.startswith(assistant) and len(assistant.split()) == 20
    assert kinds == {"Continue this passage", "Summarise this passage in one sentence"}
    assert prose_conversation("too short", random.Random(0), MODES) is None


def test_a_think_answer_holds_a_worked_trace_whose_every_step_is_right():
    import re

    from curation.source_kinds import math_problem

    rng = random.Random(5)
    for _ in range(60):
        problem, solution, answer = math_problem(rng)
        conv = math_conversation(f"Problem: {problem}\nSolution: {solution}\nAnswer: {answer}", MODES, think=True)
        system, user, reply = (m["content"] for m in conv["messages"])
        assert system == "Think step by step, then answer. /think" and user == problem
        trace, final = reply.removeprefix("<think>\n").split("\n</think>\n")
        assert reply.startswith("<think>\n") and final == f"Answer: {answer}" and trace.startswith("The question: ")
        equations = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", trace)
        assert equations and all(eval(f"{x} {op} {y}") == int(z) for x, op, y, z in equations)
        assert "Check: " in trace
    # place-value steps where the numbers are large
    conv = math_conversation("Problem: What is 412 + 389?\nSolution: 412 + 389 = 801.\nAnswer: 801", MODES, think=True)
    assert (
        "412 + 389: 400 + 300 = 700, 12 + 89 = 101, 700 + 101 = 801.\nCheck: 801 - 389 = 412."
        in (conv["messages"][2]["content"])
    )


def test_builtin_conversations_draw_the_think_share_per_math_document_deterministically(tmp_path):
    from curation.conversations import builtin_conversations
    from tests.tasks.test_posttrain_steps import make_corpora

    corpora = make_corpora(tmp_path, math_docs=250, prose_docs=10)
    rows = builtin_conversations(corpora, "train", 160, 4, seed=0, systems=MODES, think_share=0.5)
    assert rows == builtin_conversations(corpora, "train", 160, 4, seed=0, systems=MODES, think_share=0.5)
    modes = [r["messages"][0]["content"] for r in rows]
    think = [r for r in rows if r["messages"][0]["content"].endswith("/think")]
    assert 50 <= len(think) <= 110 and modes.count("/no_think") == len(rows) - len(think)
    # the same kind of prompt in both modes: arithmetic questions, some answered each way
    assert all(r["messages"][2]["content"].startswith("<think>\n") for r in think)
    assert {r["messages"][1]["content"].split()[0] for r in think} & {
        r["messages"][1]["content"].split()[0] for r in rows if r["messages"][0]["content"] == "/no_think"
    }
    no_think = builtin_conversations(corpora, "train", 160, 4, seed=0, systems=MODES)
    assert all(r["messages"][0]["content"] == "/no_think" for r in no_think)
