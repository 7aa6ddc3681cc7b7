"""Reasoning traces for the reasoning mid-training stage: think-mode conversations, and the token
shards the pretraining trainer reads them from.

SmolLM3 trained on reasoning traces (OpenThoughts3, Llama-Nemotron post-training data) in ChatML
with packing, after context extension and before SFT (docs/posttraining.md). Here:
- `builtin_traces`: arithmetic and word problems (the `builtin:math` kinds plus two-step ones),
  each drawn by a generator seeded with the seed and its index (so the reader tasks of the
  reasoning_data step make any part of them), each a think-mode conversation whose reply is a
  worked trace in `<think>...</think>` and `Answer: N` (curation/conversations.py, the same shape as
  the think rows of SFT, under the same system turn: `systems.think_system`, the recipe's
  `reasoning_modes`). Problems whose text is in `exclude` (the held-out math problems the
  evaluations ask) are drawn again, so the stage never trains on an eval question.
- `as_messages`: a `files:`/`hf:` row's conversation as `[{role, content}]`, from either the
  `messages` layout or ShareGPT's `from`/`value` (OpenThoughts3's `conversations` column).
- `write_token_shard`: token ids per document (each ending in EOS) as one datatrove `.ds` file with
  its `.ds.index` and `.ds.metadata` (model/token_shards.py reads them).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from curation.conversations import math_conversation, parse_math
from curation.source_kinds import math_problem, operand_draw

_NAMES = ["Ada", "Ben", "Chloe", "Dev", "Elif", "Femi", "Grace", "Hugo", "Ines", "Jun"]
_ITEMS = ["apples", "books", "pencils", "marbles", "stickers", "cookies", "cards", "shells"]
_DRAWS = 100  # draws of one problem before its held-out exclusions are taken to cover the generator
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def two_step_problem(rng: random.Random, max_operand: int | None = None) -> tuple[str, str, str]:
    """A problem that takes two operations: an expression or a purchase with change. With
    `max_operand` every operand is at most that and the payment is the next multiple of 10 above
    the cost (of 100 without it)."""
    draw = operand_draw(rng, max_operand)
    if rng.random() < 0.5:
        a, b, c = draw(2, 99), draw(2, 99), draw(2, 999)
        t = a * b
        return f"What is {a} * {b} + {c}?", f"{a} * {b} = {t}, and {t} + {c} = {t + c}.", str(t + c)
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    n, price = draw(2, 12), draw(2, 25)
    cost = n * price
    unit = 100 if max_operand is None else 10
    paid = (cost // unit + 1) * unit
    return (
        f"{name} buys {n} {item} at {price} dollars each and pays with {paid} dollars. "
        "How many dollars of change does " + name + " get?",
        f"{n} * {price} = {cost}, and {paid} - {cost} = {paid - cost}.",
        str(paid - cost),
    )


def builtin_trace(
    index: int, seed: int, systems: Any, exclude: Collection[str] = (), max_operand: int | None = None
) -> dict:
    """The `index`-th think-mode conversation (`{"messages": [...]}`) with a worked trace under
    `systems.think_system`, drawn from a generator seeded with (seed, index) alone, so any task
    can make any index: a third two-step problems, the rest the `builtin:math` kinds, every
    operand at most `max_operand` when it is set; a problem whose text is in `exclude` is drawn
    again."""
    rng = random.Random(f"reasoning:{seed}:{index}")
    for _ in range(_DRAWS):
        two_step = rng.random() < 1 / 3
        problem, solution, answer = (two_step_problem if two_step else math_problem)(rng, max_operand)
        if problem in exclude:
            continue
        conv = math_conversation(f"Problem: {problem}\nSolution: {solution}\nAnswer: {answer}", systems, think=True)
        return {"messages": conv["messages"]}
    raise ValueError(
        f"reasoning traces: problem {index} drew only excluded (held-out) problems in {_DRAWS} draws; "
        "the held-out set covers the generator's problems (raise max_operand)"
    )


def builtin_traces(
    n: int, seed: int, systems: Any, exclude: Iterable[str] = (), max_operand: int | None = None, start: int = 0
) -> list[dict[str, Any]]:
    """Conversations `start` .. `start + n - 1` of `builtin_trace`: deterministic per seed, and
    the same whichever task makes which of them; none whose problem text is in `exclude`."""
    skip = set(exclude)
    return [builtin_trace(i, seed, systems, skip, max_operand) for i in range(start, start + n)]


def heldout_problems(texts: Iterable[str]) -> Iterator[str]:
    """The problem text of every math document among `texts` (`Problem: ...` first line)."""
    for text in texts:
        parsed = parse_math(text)
        if parsed is not None:
            yield parsed[0]


def as_messages(value: Any) -> list[dict[str, str]] | None:
    """A conversation as `[{role, content}]`, from `messages` rows or ShareGPT `from`/`value`
    rows; None when it is neither."""
    if not isinstance(value, list) or not value:
        return None
    out = []
    for m in value:
        if not isinstance(m, dict):
            return None
        role = _ROLES.get(str(m.get("role", m.get("from", ""))))
        content = m.get("content", m.get("value"))
        if role is None or not isinstance(content, str):
            return None
        out.append({"role": role, "content": content})
    return out if any(m["role"] == "assistant" for m in out) else None


def write_token_shard(path: Path, documents: Sequence[Sequence[int]], dtype: str, tokenizer: str) -> int:
    """Write `documents` (token ids, each ending in EOS) as `path` (`.ds`), `path.index` (uint64
    end offsets) and `path.metadata` (datatrove's three lines); return the token count."""
    import numpy as np

    tokens = np.fromiter((t for doc in documents for t in doc), dtype=np.dtype(dtype))
    ends = np.cumsum([len(doc) for doc in documents], dtype="<u8")
    path.write_bytes(tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
    Path(f"{path}.index").write_bytes(ends.tobytes())
    count = int(tokens.size)
    Path(f"{path}.metadata").write_text(f"{tokenizer}|{tokens.itemsize}\n{count}\n{count:,} tokens\n", encoding="utf-8")
    return count
