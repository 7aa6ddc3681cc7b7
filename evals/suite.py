"""The eval suite's tasks: cloze items built from held-out text, passkey retrieval, the
generation task of chat models, their lm-eval task files, and the contamination report.

What the `eval_suite` step (tasks/evaluate.py) writes, one builder per task kind: `prose_items`,
`code_items`, `arithmetic_items` (cloze, from a domain's held-out documents), `passkey_items`
(retrieval at a context length), `arithmetic_generation_items` (exact match, chat models).
`cfg` is the recipe's `eval` section (tasks/evaluate.py `EvalConfig`); builders read its fields.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

CLOZE_TASKS = ("prose_cloze", "code_cloze", "arithmetic_cloze")


# --- building tasks -------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return text.split()


def prose_items(docs: Sequence[str], cfg: Any, rng: random.Random) -> list[dict[str, Any]]:
    """Context of `context_words`, gold = the next words, distractors = other docs' passages."""
    need = cfg.context_words + cfg.continuation_words
    passages = []
    for text in docs:
        words = _words(text)
        for start in range(0, len(words) - need + 1, need * 4):
            passages.append(words[start : start + need])
    rng.shuffle(passages)
    items = []
    for i, words in enumerate(passages[: cfg.items_per_task]):
        others = [p for j, p in enumerate(passages) if j != i]
        if len(others) < cfg.choices - 1:
            break
        distractors = [" ".join(p[cfg.context_words :]) for p in rng.sample(others, cfg.choices - 1)]
        items.append(
            _item(" ".join(words[: cfg.context_words]), " ".join(words[cfg.context_words :]), distractors, rng)
        )
    return items


def code_items(docs: Sequence[str], cfg: Any, rng: random.Random) -> list[dict[str, Any]]:
    """Context = `code_context_lines` lines, gold = the next non-empty line, distractors = lines
    from elsewhere of similar length."""
    windows: list[tuple[str, str]] = []
    pool: list[str] = []
    for text in docs:
        lines = text.splitlines()
        pool += [ln for ln in lines if len(ln.strip()) > 10]
        for start in range(0, len(lines) - cfg.code_context_lines - 1, cfg.code_context_lines * 5):
            target = lines[start + cfg.code_context_lines]
            if len(target.strip()) > 10:
                windows.append(("\n".join(lines[start : start + cfg.code_context_lines]) + "\n", target))
    rng.shuffle(windows)
    items = []
    for context, gold in windows[: cfg.items_per_task]:
        candidates = [ln for ln in rng.sample(pool, min(len(pool), 50)) if ln != gold]
        candidates.sort(key=lambda ln: abs(len(ln) - len(gold)))
        if len(candidates) < cfg.choices - 1:
            continue
        items.append(_item(context, gold, candidates[: cfg.choices - 1], rng, delimiter=""))
    return items


_ANSWER = re.compile(r"^Problem: (?P<problem>.*)\nSolution: (?P<solution>.*)\nAnswer: (?P<answer>-?\d+)\s*$", re.S)


def _wrong_numbers(answer: int, k: int, rng: random.Random) -> list[str]:
    candidates = {answer + d for d in (-10, -2, -1, 1, 2, 10, 100)} | {int(str(abs(answer))[::-1] or 0)}
    candidates.discard(answer)
    picked = rng.sample(sorted(candidates), min(k, len(candidates)))
    return [str(n) for n in picked]


def arithmetic_items(docs: Sequence[str], cfg: Any, rng: random.Random) -> list[dict[str, Any]]:
    """The worked solution up to its final result; choices = the right number and near misses."""
    items = []
    for text in docs:
        m = _ANSWER.match(text.strip())
        if not m:
            continue
        answer, solution = m["answer"], m["solution"]
        cut = solution.rfind(answer)
        if cut <= 0:
            continue
        context = f"Problem: {m['problem']}\nSolution: {solution[:cut].rstrip()}"
        items.append(_item(context, answer, _wrong_numbers(int(answer), cfg.choices - 1, rng), rng))
        if len(items) >= cfg.items_per_task:
            break
    return items


_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ").split()


def passkey_items(length_words: int, cfg: Any, rng: random.Random) -> list[dict[str, Any]]:
    """A pass key hidden at a random depth in `length_words` words of filler."""
    items = []
    for _ in range(cfg.passkey_items):
        key = rng.randint(10000, 99999)
        filler = [_FILLER[i % len(_FILLER)] for i in range(length_words)]
        depth = rng.randint(0, length_words)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key.".split()
        words = filler[:depth] + needle + filler[depth:]
        context = " ".join(words) + "\nWhat is the pass key? The pass key is"
        wrong = [str(k) for k in rng.sample(range(10000, 100000), cfg.choices - 1) if k != key]
        items.append(_item(context, str(key), wrong[: cfg.choices - 1], rng))
    return items


def _item(context: str, gold: str, distractors: list[str], rng: random.Random, delimiter: str = " ") -> dict[str, Any]:
    choices = [gold, *distractors]
    rng.shuffle(choices)
    return {"context": context, "choices": choices, "gold": choices.index(gold), "delimiter": delimiter}


def task_yaml(name: str, data_file: Path, delimiter: str) -> str:
    """An lm-eval task over a local JSONL file (offline: `dataset_path: json`)."""
    return "\n".join(
        [
            f"task: {name}",
            "dataset_path: json",
            "dataset_kwargs:",
            "  data_files:",
            f"    test: {json.dumps(str(data_file))}",
            "test_split: test",
            "output_type: multiple_choice",
            'doc_to_text: "{{context}}"',
            'doc_to_choice: "{{choices}}"',
            "doc_to_target: gold",
            f"target_delimiter: {json.dumps(delimiter)}",
            "metric_list:",
            "  - metric: acc",
            "    aggregation: mean",
            "    higher_is_better: true",
            "  - metric: acc_norm",
            "    aggregation: mean",
            "    higher_is_better: true",
            "",
        ]
    )


# Generation (exact match) task for chat models: the ChatML prompt our tokenizer's template
# renders is written into the prompt itself (not lm-eval's --apply_chat_template), so the task
# file alone reproduces the score and a base model sees the same string; generation stops at the
# end of the assistant turn and the final `Answer: N` is compared with the known answer.
CHAT_PROMPT = "<|im_start|>user\n{{problem}}<|im_end|>\n<|im_start|>assistant\n"
GENERATION_TASK = "arithmetic_exact"
ANSWER_PATTERN = r"Answer:\s*(-?\d+)"  # the final answer the worked solutions end with


def arithmetic_generation_items(docs: Sequence[str], n: int) -> list[dict[str, Any]]:
    """Held-out math problems as {problem, answer} for the exact-match generation task."""
    items = []
    for text in docs:
        m = _ANSWER.match(text.strip())
        if m:
            items.append({"problem": m["problem"].strip(), "answer": m["answer"]})
        if len(items) >= n:
            break
    return items


def generation_task_yaml(name: str, data_file: Path, max_gen_toks: int = 48) -> str:
    """An lm-eval `generate_until` task: greedy answer, exact match on the final integer."""
    return "\n".join(
        [
            f"task: {name}",
            "dataset_path: json",
            "dataset_kwargs:",
            "  data_files:",
            f"    test: {json.dumps(str(data_file))}",
            "test_split: test",
            "output_type: generate_until",
            f"doc_to_text: {json.dumps(CHAT_PROMPT)}",
            'doc_to_target: "{{answer}}"',
            "generation_kwargs:",
            '  until: ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]',
            f"  max_gen_toks: {max_gen_toks}",
            "  do_sample: false",
            "filter_list:",
            "  - name: answer",
            "    filter:",
            "      - function: regex",
            f"        regex_pattern: {json.dumps(ANSWER_PATTERN)}",
            "      - function: take_first",
            "metric_list:",
            "  - metric: exact_match",
            "    aggregation: mean",
            "    higher_is_better: true",
            "",
        ]
    )


SUITE_TASK = re.compile(r"prose_cloze|code_cloze|arithmetic_cloze|passkey_[1-9][0-9]{0,6}|" + GENERATION_TASK)


def suite_task_yaml(name: str, data_file: Path, max_gen_tokens: int = 48) -> str:
    """The task YAML the `eval_suite` step writes for its task `name` over `data_file`: the
    builders above with the arguments the step gives them (the code cloze task joins context and
    choice with no space, the other cloze and passkey tasks with one). Templates are plain
    `{{field}}` substitutions; no `!function`, no `include:`."""
    if name == GENERATION_TASK:
        return generation_task_yaml(name, data_file, max_gen_tokens)
    if SUITE_TASK.fullmatch(name):
        return task_yaml(name, data_file, "" if name == "code_cloze" else " ")
    raise ValueError(f"{name!r} is not a task the eval suite builds")


def ngrams(text: str, n: int) -> Iterator[int]:
    words = re.findall(r"\w+", text.lower())
    for i in range(len(words) - n + 1):
        yield hash(" ".join(words[i : i + n]))


def contamination(
    tasks: dict[str, list[dict[str, Any]]], training_texts: Iterable[str], n: int
) -> dict[str, dict[str, float]]:
    """Share of each task's items sharing a word n-gram (context + gold) with training text."""
    item_grams: dict[tuple[str, int], set[int]] = {}
    wanted: set[int] = set()
    for name, items in tasks.items():
        for i, item in enumerate(items):
            text = item["context"] + item["delimiter"] + item["choices"][item["gold"]]
            grams = set(ngrams(text, n))
            item_grams[(name, i)] = grams
            wanted |= grams
    seen: set[int] = set()
    scanned = 0
    for text in training_texts:
        scanned += 1
        seen.update(g for g in ngrams(text, n) if g in wanted)
    report = {}
    for name, items in tasks.items():
        hit = sum(1 for i in range(len(items)) if item_grams[(name, i)] & seen)
        report[name] = {"items": len(items), "contaminated": hit, "rate": hit / len(items) if items else 0.0}
    return report
