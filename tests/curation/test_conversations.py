"""curation/conversations.py: chat conversations and arithmetic prompts made from curated text."""

from __future__ import annotations

import random

from curation.conversations import math_conversation, prose_conversation


def test_a_math_document_becomes_a_question_and_its_worked_solution():
    conv = math_conversation("Problem: What is 2 + 3?\nSolution: 2 + 3 = 5.\nAnswer: 5")
    assert conv["messages"][0] == {"role": "system", "content": "/no_think"}  # a direct answer
    assert conv["messages"][2]["content"] == "2 + 3 = 5.\nAnswer: 5" and conv["answer"] == "5"
    assert math_conversation("Just some prose without a problem.") is None


def test_a_prose_passage_becomes_an_instruction_or_nothing_when_too_short():
    text = " ".join(f"word{i}" for i in range(100))
    kinds = set()
    for seed in range(8):
        system, user, assistant = (m["content"] for m in prose_conversation(text, random.Random(seed))["messages"])
        assert system == "/no_think"
        kind, passage = user.split(":\n", 1)
        kinds.add(kind)
        if kind == "Continue this passage":  # 40 words given, the next 20 expected, as written
            assert len(passage.split()) == 40 and f"{passage} {assistant}" in text
        else:  # a 60-word window, and its lead (no sentence ends here: its first 20 words)
            assert kind == "Summarise this passage in one sentence" and passage in text
            assert len(passage.split()) == 60 and passage.startswith(assistant) and len(assistant.split()) == 20
    assert kinds == {"Continue this passage", "Summarise this passage in one sentence"}
    assert prose_conversation("too short", random.Random(0)) is None
