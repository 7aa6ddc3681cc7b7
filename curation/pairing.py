"""Preference pairs per reasoning mode, from answers already generated: prompts in a mode, the
verified reference answers of the builtin prompts, and the pairing rules.

The preference_pairs step (tasks/posttrain/preference_pairs.py) generates the answers (the policy's,
a named model's) and hands them here. A pair row is

    {"prompt": [...], "chosen": [{"role": "assistant", ...}], "rejected": [...],
     "mode": "think" | "no_think", "chosen_source": ..., "rejected_source": ...}

where a source is `reference` (the worked answer of a builtin prompt), `policy` (the model being
post-trained), `model:NAME` or a pairs dataset (`hf:NAME`, `files:GLOB`). The prompt's system turn
names the mode (`/think` or `/no_think`), so the chat template renders the pair in that mode
whatever `enable_thinking` the trainer passes.

When a prompt's answer is known (builtin arithmetic), a pair is kept only when it teaches the
right thing: a rejected answer that is correct, a chosen answer that is wrong, or two identical
answers drop the pair, counted by reason.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from curation.conversations import math_reply, parse_math

MODES = ("think", "no_think")
_FLAGS = re.compile(r"\s*/(?:no_think|think)\b")
_ANSWER = re.compile(r"Answer:\s*(-?\d+)")


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown reasoning mode {mode!r}; use one of {', '.join(MODES)}")
    return mode


def as_messages(prompt: Any, where: str) -> list[dict[str, str]]:
    """A prompt as a message list: a string becomes one user turn; a list must hold
    {role, content} turns and end with a user turn."""
    if isinstance(prompt, str) and prompt.strip():
        return [{"role": "user", "content": prompt}]
    ok = (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict)
            and isinstance(m.get("content"), str)
            and m.get("role") in ("system", "user", "assistant")
            for m in prompt
        )
    )
    if not ok or prompt[-1]["role"] != "user":
        raise ValueError(
            f"{where}: a prompt must be a non-empty string or a list of {{role, content}} turns "
            f"ending with a user turn, got {str(prompt)[:120]!r}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def mode_prompt(
    prompt: list[dict[str, str]], mode: str, builtin: bool = False, systems: Any = None
) -> list[dict[str, str]]:
    """`prompt` with a system turn naming `mode`: its own instructions (flags removed) and the
    flag. A builtin prompt takes the mode's system turn of `systems` (the recipe's
    `reasoning_modes`, what the SFT data and the eval prompts carry), so pairs look like what SFT
    trained on."""
    _check_mode(mode)
    if builtin:
        if systems is None:
            raise ValueError("mode_prompt: a builtin prompt needs `systems` (the recipe's reasoning_modes)")
        content = systems.think_system if mode == "think" else systems.no_think_system
        return [{"role": "system", "content": content}, *(dict(m) for m in prompt if m["role"] != "system")]
    system = next((m["content"] for m in prompt if m["role"] == "system"), "")
    rest = [dict(m) for m in prompt if m["role"] != "system"]
    text = _FLAGS.sub("", system).strip()
    content = f"{text} /{'think' if mode == 'think' else 'no_think'}".strip()
    return [{"role": "system", "content": content}, *rest]


def reference_answer(row: dict[str, Any], mode: str) -> str:
    """The verified answer of a builtin prompt row (`posttrain_data`'s prompts.jsonl) in `mode`:
    no-think, its worked solution and `Answer: N`; think, the SFT data's worked trace in
    `<think>...</think>` then `Answer: N` (curation/conversations.py `math_reply`)."""
    _check_mode(mode)
    missing = [k for k in ("prompt", "answer", "reference") if k not in row]
    if missing:
        raise ValueError(
            f"prompt row {str(row)[:120]!r} has no {', '.join(missing)}: chosen 'reference' needs "
            "posttrain_data's builtin prompts (prompt, answer, reference)"
        )
    if mode == "no_think":
        return row["reference"]
    problem = row["prompt"][-1]["content"]
    solution = row["reference"].rsplit("\nAnswer:", 1)[0]
    parsed = parse_math(f"Problem: {problem}\nSolution: {solution}\nAnswer: {row['answer']}")
    if parsed is None:
        raise ValueError(f"prompt row {problem[:80]!r}: its reference is not a worked solution ending in Answer: N")
    return math_reply(*parsed, think=True)


def final_answer(text: str) -> str | None:
    """The integer of an answer's `Answer: N`, read after the think block when there is one (an
    answer inside the trace, or a block never closed, is no answer)."""
    if "<think>" in text:
        if "</think>" not in text:
            return None
        text = text.rsplit("</think>", 1)[1]
    m = _ANSWER.search(text)
    return m.group(1) if m else None


def pair_rows(
    prompts: Sequence[list[dict[str, str]]],
    chosen: Sequence[str],
    rejected: Sequence[str],
    mode: str,
    sources: tuple[str, str],
    answers: Sequence[str | None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Pair rows (module docstring) from aligned prompts and answers, and the counts: pairs,
    dropped pairs by reason, and each side's accuracy where the answers are known."""
    rows, counts = pair_chunk(prompts, chosen, rejected, mode, sources, answers)
    return rows, pair_facts([counts])


def pair_chunk(
    prompts: Sequence[list[dict[str, str]]],
    chosen: Sequence[str],
    rejected: Sequence[str],
    mode: str,
    sources: tuple[str, str],
    answers: Sequence[str | None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`pair_rows` for one chunk of a mode's prompts: the rows and the raw counts (prompts,
    pairs, dropped by reason, known answers, right answers per side) that `pair_facts` sums over
    the chunks into the mode's facts."""
    _check_mode(mode)
    answers = list(answers) if answers is not None else [None] * len(prompts)
    if not (len(prompts) == len(chosen) == len(rejected) == len(answers)):
        raise ValueError(
            f"pair_rows: {len(prompts)} prompts, {len(chosen)} chosen, {len(rejected)} rejected and "
            f"{len(answers)} answers; each prompt needs one of each"
        )
    rows, dropped, right = [], Counter(), Counter()
    for prompt, good, bad, answer in zip(prompts, chosen, rejected, answers, strict=True):
        if answer is not None:
            right["chosen"] += final_answer(good) == str(answer)
            right["rejected"] += final_answer(bad) == str(answer)
        if not good.strip():
            dropped["empty_chosen"] += 1
        elif good.strip() == bad.strip():
            dropped["same_answer"] += 1
        elif answer is not None and final_answer(good) != str(answer):
            dropped["chosen_wrong"] += 1
        elif answer is not None and final_answer(bad) == str(answer):
            dropped["rejected_correct"] += 1
        else:
            rows.append(
                {
                    "prompt": prompt,
                    "chosen": [{"role": "assistant", "content": good}],
                    "rejected": [{"role": "assistant", "content": bad}],
                    "mode": mode,
                    "chosen_source": sources[0],
                    "rejected_source": sources[1],
                }
            )
    counts = {
        "prompts": len(prompts),
        "pairs": len(rows),
        "dropped": dict(dropped),
        "known": sum(a is not None for a in answers),
        "right": {"chosen": right["chosen"], "rejected": right["rejected"]},
    }
    return rows, counts


def pair_facts(chunks: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """A mode's facts from its chunks' counts (`pair_chunk`): prompts, pairs, dropped pairs by
    reason, and each side's accuracy where answers are known."""
    prompts = pairs = known = 0
    dropped, right = Counter(), Counter()
    for c in chunks:
        prompts, pairs, known = prompts + c["prompts"], pairs + c["pairs"], known + c["known"]
        dropped.update(c["dropped"])
        right.update(c["right"])
    facts: dict[str, Any] = {"prompts": prompts, "pairs": pairs, "dropped": dict(sorted(dropped.items()))}
    if known:
        facts["chosen_accuracy"] = round(right["chosen"] / known, 4)
        facts["rejected_accuracy"] = round(right["rejected"] / known, 4)
    return facts


def dataset_pair(row: dict[str, Any], mode: str, source: str, where: str) -> dict[str, Any]:
    """A prompt/chosen/rejected row of a pairs dataset (as trainers/posttrain/chat_data.py
    `preference_rows` returns it) as a pair row in `mode`."""
    prompt = mode_prompt(as_messages(row["prompt"], where), mode)
    sides = []
    for side in ("chosen", "rejected"):
        value = row[side]
        text = value[-1].get("content") if isinstance(value, list) and value else value
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: {side} holds no answer text ({str(value)[:120]!r})")
        sides.append([{"role": "assistant", "content": text}])
    return {
        "prompt": prompt,
        "chosen": sides[0],
        "rejected": sides[1],
        "mode": mode,
        "chosen_source": source,
        "rejected_source": source,
    }
