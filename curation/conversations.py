"""Chat data from curated corpora: math documents as worked-solution conversations, prose as
"continue" and "summarise" instructions, and verifiable arithmetic prompts.

Math documents ("Problem / Solution / Answer") become a user question and an assistant worked
solution ending in `Answer: N`; prose documents become "Continue this passage" (the next words)
and "Summarise this passage" (its lead sentence: an extractive stand-in for a summary, honest
about being one). Corpora are curated corpus artifacts (`meta["domain"]`, `path/<split>/`
shards). The posttrain_data step (tasks/posttrain/data.py) writes what these return.

Every conversation and prompt opens with a system turn naming its reasoning mode for the dual-mode
chat template (curation/bpe.py); its content comes from `systems`, the recipe's `reasoning_modes`
(trainers/posttrain/sections.py `ReasoningModesConfig`: `think_system`, `no_think_system`), the one
source the reasoning traces and the eval prompts share. A math problem is answered in one of two
modes, drawn per document with a seeded generator (`think_share` of them in think mode):
- no-think (`no_think_system`, by default `/no_think`, which renders the template's short default
  instructions): the worked solution and `Answer: N`, as the document has them;
- think (`think_system`, by default short custom instructions and `/think`, because the template's
  default /think instructions are ~1,100 characters, too long for the tiny recipe's rows): a worked
  trace inside `<think>...</think>` (the solution's equations split into place-value steps, then an
  inverse-operation check, see `worked_trace`), then `Answer: N`.
Prose instructions and the arithmetic prompts (APO, GRPO, OPD) are no-think.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from typing import Any

from curation.source_kinds import read_shards

_MATH = re.compile(r"^Problem: (?P<problem>.*)\nSolution: (?P<solution>.*)\nAnswer: (?P<answer>-?\d+)\s*$", re.S)


_EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def _steps(x: int, op: str, y: int, z: int) -> list[str]:
    """One equation worked in place-value steps, then checked by the inverse operation."""
    if op == "+" and max(x, y) >= 100:
        hx, hy = x // 100 * 100, y // 100 * 100
        steps = [f"{hx} + {hy} = {hx + hy}", f"{x - hx} + {y - hy} = {x - hx + y - hy}"]
        steps.append(f"{hx + hy} + {x - hx + y - hy} = {z}")
    elif op == "-" and y >= 100:
        hy = y // 100 * 100
        steps = [f"{x} - {hy} = {x - hy}", f"{x - hy} - {y - hy} = {z}"]
    elif op == "*" and y >= 10:
        ty = y // 10 * 10
        steps = [f"{x} * {ty} = {x * ty}", f"{x} * {y - ty} = {x * (y - ty)}", f"{x * ty} + {x * (y - ty)} = {z}"]
    elif op == "*" and x >= 100:
        hx = x // 100 * 100
        steps = [f"{hx} * {y} = {hx * y}", f"{x - hx} * {y} = {(x - hx) * y}", f"{hx * y} + {(x - hx) * y} = {z}"]
    else:
        steps = []
    check = {"+": f"{z} - {y} = {x}", "-": f"{z} + {y} = {x}", "*": f"{z} / {y} = {x}", "/": f"{z} * {y} = {x}"}[op]
    worked = f"{x} {op} {y}: " + ", ".join(steps) + "." if steps else f"{x} {op} {y} = {z}."
    return [worked, f"Check: {check}."]


def worked_trace(problem: str, solution: str) -> str:
    """The reasoning of a think-mode answer: the question restated, each equation of the solution
    worked in steps and checked (`_steps`), the solution itself when it has no equation."""
    lines = [f"The question: {problem}"]
    for x, op, y, z in _EQUATION.findall(solution):
        lines += _steps(int(x), op, int(y), int(z))
    if len(lines) == 1:
        lines.append(solution)
    return "\n".join(lines)


def parse_math(text: str) -> tuple[str, str, str] | None:
    """(problem, solution, answer) of a math document (`Problem / Solution / Answer`); None if
    the text is not one."""
    m = _MATH.match(text.strip())
    return (m["problem"].strip(), m["solution"].strip(), m["answer"]) if m else None


def math_reply(problem: str, solution: str, answer: str, think: bool = False) -> str:
    """The assistant's answer in one reasoning mode: no-think, the worked solution then
    `Answer: N`; think, a worked trace in <think>...</think> then `Answer: N`."""
    if think:
        return f"<think>\n{worked_trace(problem, solution)}\n</think>\nAnswer: {answer}"
    return f"{solution}\nAnswer: {answer}"


def math_conversation(text: str, systems: Any, think: bool = False) -> dict[str, Any] | None:
    """A math document as a conversation in one reasoning mode, its system turn that mode's of
    `systems` (`think_system` / `no_think_system`); None if the text is not a math document."""
    parsed = parse_math(text)
    if parsed is None:
        return None
    problem, solution, answer = parsed
    system = {"role": "system", "content": systems.think_system if think else systems.no_think_system}
    reply = math_reply(problem, solution, answer, think)
    messages = [system, {"role": "user", "content": problem}, {"role": "assistant", "content": reply}]
    return {"messages": messages, "answer": answer}


def prose_conversation(text: str, rng: random.Random, systems: Any, words: int = 60) -> dict[str, Any] | None:
    """A prose passage as a "continue" or a "summarise" instruction (no-think: `systems`'s
    `no_think_system`)."""
    tokens = text.split()
    if len(tokens) < words:
        return None
    start = rng.randrange(0, len(tokens) - words + 1)
    passage = tokens[start : start + words]
    if rng.random() < 0.5:
        cut = words * 2 // 3
        user = "Continue this passage:\n" + " ".join(passage[:cut])
        reply = " ".join(passage[cut:])
    else:
        body = " ".join(passage)
        lead = re.split(r"(?<=[.!?])\s", body, maxsplit=1)[0]
        if len(lead.split()) < 5 or lead == body:
            lead = " ".join(passage[:20])
        user = "Summarise this passage in one sentence:\n" + body
        reply = lead
    system = {"role": "system", "content": systems.no_think_system}
    return {"messages": [system, {"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def _corpus_texts(corpora: Sequence[Any], domain: str, split: str) -> Iterator[str]:
    for art in corpora:
        if art.meta.get("domain") == domain and (art.path / split).is_dir():
            for doc in read_shards(art.path / split):
                yield doc["text"]


def builtin_conversations(
    corpora: Sequence[Any],
    split: str,
    math_n: int,
    prose_n: int,
    seed: int,
    systems: Any,
    think_share: float = 0.0,
) -> list[dict[str, Any]]:
    """`math_n` arithmetic and `prose_n` instruction conversations from one split, shuffled; each
    arithmetic one is in think mode with probability `think_share` (a seeded draw of its own);
    system turns from `systems` (the recipe's `reasoning_modes`)."""
    rng = random.Random(f"posttrain:{split}:{seed}")
    modes = random.Random(f"posttrain:think:{split}:{seed}")
    math, prose = [], []
    for text in _corpus_texts(corpora, "math", split):
        if len(math) >= math_n:
            break
        conv = math_conversation(text, systems, think=modes.random() < think_share)
        if conv:
            math.append({"messages": conv["messages"]})
    for text in _corpus_texts(corpora, "web", split):
        if len(prose) >= prose_n:
            break
        conv = prose_conversation(text, rng, systems)
        if conv:
            prose.append(conv)
    rows = math + prose
    rng.shuffle(rows)
    return rows


def arithmetic_prompts(corpora: Sequence[Any], skip: int, n: int, systems: Any) -> list[dict[str, Any]]:
    """`n` prompts with answers from math train documents after the first `skip` (SFT's), in
    no-think mode (`systems`'s `no_think_system`)."""
    out, seen = [], 0
    for text in _corpus_texts(corpora, "math", "train"):
        conv = math_conversation(text, systems)
        if conv is None:
            continue
        seen += 1
        if seen <= skip:
            continue
        out.append(
            {"prompt": conv["messages"][:-1], "answer": conv["answer"], "reference": conv["messages"][-1]["content"]}
        )
        if len(out) >= n:
            break
    return out
