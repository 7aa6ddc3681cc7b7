"""Chat data from curated corpora: math documents as worked-solution conversations, prose as
"continue" and "summarise" instructions, and verifiable arithmetic prompts.

Math documents ("Problem / Solution / Answer") become a user question and an assistant worked
solution ending in `Answer: N`; prose documents become "Continue this passage" (the next words)
and "Summarise this passage" (its lead sentence: an extractive stand-in for a summary, honest
about being one). Corpora are curated corpus artifacts (`meta["domain"]`, `path/<split>/`
shards). The posttrain_data step (tasks/posttrain/data.py) writes what these return.

Every conversation and prompt opens with a system turn naming its reasoning mode for the dual-mode
chat template (curation/bpe.py): `/no_think` for direct answers, which renders the template's
short default instructions (the default /think instructions are ~1,100 characters, too long for
the tiny recipe's rows).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from typing import Any

from curation.source_kinds import read_shards

NO_THINK = {"role": "system", "content": "/no_think"}  # a direct answer: an empty think block
_MATH = re.compile(r"^Problem: (?P<problem>.*)\nSolution: (?P<solution>.*)\nAnswer: (?P<answer>-?\d+)\s*$", re.S)


def math_conversation(text: str) -> dict[str, Any] | None:
    """A math document as a no-think conversation (user question, assistant worked solution);
    None if not one."""
    m = _MATH.match(text.strip())
    if not m:
        return None
    return {
        "messages": [
            dict(NO_THINK),
            {"role": "user", "content": m["problem"].strip()},
            {"role": "assistant", "content": f"{m['solution'].strip()}\nAnswer: {m['answer']}"},
        ],
        "answer": m["answer"],
    }


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
    corpora: Sequence[Any], split: str, math_n: int, prose_n: int, seed: int
) -> list[dict[str, Any]]:
    """`math_n` arithmetic and `prose_n` instruction conversations from one split, shuffled."""
    rng = random.Random(f"posttrain:{split}:{seed}")
    math, prose = [], []
    for text in _corpus_texts(corpora, "math", split):
        if len(math) >= math_n:
            break
        conv = math_conversation(text)
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
