"""The pairing rules of preference pairs (curation/pairing.py): prompts and verified reference
answers in each reasoning mode, and the pairs dropped because they would teach the wrong thing.
The step that generates the answers: tests/tasks/test_preference_pairs.py."""

from __future__ import annotations

import pytest

from curation.pairing import final_answer, mode_prompt, pair_rows, reference_answer
from trainers.posttrain.sections import ReasoningModesConfig


def test_pair_rules_drop_what_would_teach_the_wrong_thing():
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(5)]
    chosen = ["Answer: 1", "Answer: 2", "Answer: 9", "same", ""]
    rejected = ["Answer: 0", "So, Answer: 2", "Answer: 3", "same", "x"]
    rows, facts = pair_rows(prompts, chosen, rejected, "no_think", ("reference", "policy"), ["1", "2", "3", None, None])
    assert [r["prompt"][0]["content"] for r in rows] == ["q0"]
    assert facts["dropped"] == {"chosen_wrong": 1, "empty_chosen": 1, "rejected_correct": 1, "same_answer": 1}
    assert (facts["chosen_accuracy"], facts["rejected_accuracy"]) == (0.6667, 0.6667)
    with pytest.raises(ValueError, match="2 prompts, 1 chosen"):
        pair_rows(prompts[:2], chosen[:1], rejected[:2], "think", ("reference", "policy"))
    with pytest.raises(ValueError, match="unknown reasoning mode 'fast'"):
        pair_rows(prompts, chosen, rejected, "fast", ("reference", "policy"))
    # a think answer counts only after its closed think block
    assert final_answer("<think>\nAnswer: 4\n</think>\nAnswer: 5") == "5"
    assert final_answer("<think>\nAnswer: 4") is None


def test_prompts_and_references_in_each_mode():
    hub = [{"role": "system", "content": "Be brief. /think"}, {"role": "user", "content": "Hi"}]
    assert mode_prompt(hub, "no_think")[0] == {"role": "system", "content": "Be brief. /no_think"}
    assert mode_prompt(hub[1:], "think")[0] == {"role": "system", "content": "/think"}
    # builtin prompts take the recipe's reasoning_modes, whatever system turn they carry
    modes = ReasoningModesConfig()
    builtin = [{"role": "system", "content": "/no_think"}, {"role": "user", "content": "What is 2 + 2?"}]
    assert mode_prompt(builtin, "think", builtin=True, systems=modes)[0]["content"] == modes.think_system
    assert mode_prompt(builtin, "no_think", builtin=True, systems=modes)[0]["content"] == "/no_think"
    own = ReasoningModesConfig(think_system="Work it out. /think", no_think_system="Answer only. /no_think")
    assert [m["content"] for m in mode_prompt(builtin, "think", builtin=True, systems=own)] == [
        "Work it out. /think",
        "What is 2 + 2?",
    ]
    assert mode_prompt(builtin, "no_think", builtin=True, systems=own)[0]["content"] == "Answer only. /no_think"
    with pytest.raises(ValueError, match="needs `systems`"):
        mode_prompt(builtin, "think", builtin=True)
    row = {
        "prompt": [{"role": "user", "content": "What is 12 + 30?"}],
        "answer": "42",
        "reference": "12 + 30 = 42.\nAnswer: 42",
    }
    assert reference_answer(row, "no_think") == "12 + 30 = 42.\nAnswer: 42"
    think = reference_answer(row, "think")
    assert think.startswith("<think>\nThe question: What is 12 + 30?\n") and think.endswith("</think>\nAnswer: 42")
    with pytest.raises(ValueError, match="has no reference"):
        reference_answer({"prompt": row["prompt"], "answer": "42"}, "think")
