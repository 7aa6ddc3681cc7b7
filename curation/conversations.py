"""Chat data from curated corpora: math documents as worked-solution conversations, prose as
"continue" and "summarise" instructions, and verifiable arithmetic prompts.

Math documents ("Problem / Solution / Answer") become a user question and an assistant worked
solution ending in `Answer: N`; prose documents become "Continue this passage" (the next words)
and "Summarise this passage" (its lead sentence: an extractive stand-in for a summary, honest
about being one). Corpora are curated corpus artifacts (`meta["domain"]`, `path/<split>/`
shards). The posttrain_data step (tasks/posttrain/data.py) writes what these return.

Every conversation and prompt opens with a system turn naming its reasoning mode for the dual-mode
chat template (curation/bpe.py). A math problem is answered in one of two modes, drawn per
document with a seeded generator (`think_share` of them in think mode):
- no-think (`/no_think`, which renders the template's short default instructions): the worked
  solution and `Answer: N`, as the document has them;
- think (`THINK_SYSTEM`: short custom instructions and `/think`, because the template's default
  /think instructions are ~1,100 characters, too long for the tiny recipe's rows): a worked trace
  inside `<think>...</think>` (the solution's equations split into place-value steps, then an
  inverse-operation check, see `worked_trace`), then `Answer: N`.
Prose instructions and the arithmetic prompts (APO, GRPO, OPD) are no-think.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from typing import Any

from curation.source_kinds import read_shards

NO_THINK = {"role": "system", "content": "/no_think"}  # a direct answer: an empty think block
THINK_SYSTEM = "Think step by step, then answer. /think"  # a worked trace in <think>...</think>
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


def math_conversation(text: str, think: bool = False) -> dict[str, Any] | None:
    """A math document as a conversation in one reasoning mode: no-think (the worked solution, then
    `Answer: N`) or think (a worked trace in <think>...</think>, then `Answer: N`); None if the
    text is not a math document."""
    m = _MATH.match(text.strip())
    if not m:
        return None
    problem, solution, answer = m["problem"].strip(), m["solution"].strip(), m["answer"]
    if think:
        system = {"role": "system", "content": THINK_SYSTEM}
        reply = f"<think>\n{worked_trace(problem, solution)}\n</think>\nAnswer: {answer}"
    else:
        system, reply = dict(NO_THINK), f"{solution}\nAnswer: {answer}"
    messages = [system, {"role": "user", "content": problem}, {"role": "assistant", "content": reply}]
    return {"messages": messages, "answer": answer}


def prose_conversation(text: str, rng: random.Random, words: int = 60) -> dict[str, Any] | None:
    """A prose passage as a "continue" or a "summarise" instruction."""
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
    return {"messages": [dict(NO_THINK), {"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def _corpus_texts(corpora: Sequence[Any], domain: str, split: str) -> Iterator[str]:
    for art in corpora:
        if art.meta.get("domain") == domain and (art.path / split).is_dir():
            for doc in read_shards(art.path / split):
                yield doc["text"]


def builtin_conversations(
    corpora: Sequence[Any], split: str, math_n: int, prose_n: int, seed: int, think_share: float = 0.0
) -> list[dict[str, Any]]:
    """`math_n` arithmetic and `prose_n` instruction conversations from one split, shuffled; each
    arithmetic one is in think mode with probability `think_share` (a seeded draw of its own)."""
    rng = random.Random(f"posttrain:{split}:{seed}")
    modes = random.Random(f"posttrain:think:{split}:{seed}")
    math, prose = [], []
    for text in _corpus_texts(corpora, "math", split):
        if len(math) >= math_n:
            break
        conv = math_conversation(text, think=modes.random() < think_share)
        if conv:
            math.append({"messages": conv["messages"]})
    for text in _corpus_texts(corpora, "web", split):
        if len(prose) >= prose_n:
            break
        conv = prose_conversation(text, rng)
        if conv:
            prose.append(conv)
    rows = math + prose
    rng.shuffle(rows)
    return rows


def arithmetic_prompts(corpora: Sequence[Any], skip: int, n: int) -> list[dict[str, Any]]:
    """`n` prompts with answers from math train documents after the first `skip` (SFT's)."""
    out, seen = [], 0
    for text in _corpus_texts(corpora, "math", "train"):
        conv = math_conversation(text)
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
