"""curation/reasoning_tasks.py: the reasoning_data step's datatrove tasks (conversations dealt
into buckets by reader tasks, rendered and tokenized per bucket)."""

from __future__ import annotations

import gzip
import json
import tracemalloc

import pytest

from curation.reasoning import builtin_traces
from curation.reasoning_tasks import ReadConversations, merge_counts, thinks
from trainers.posttrain.sections import ReasoningModesConfig

MODES = ReasoningModesConfig()  # the recipe's reasoning_modes at their defaults


def bucket(work, s: int) -> list:
    """Bucket s's conversations in reader order (the order the tokenize task reads them)."""
    out = []
    for path in sorted((work / "convs" / f"{s:05d}").glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            out += [json.loads(line) for line in fh]
    return out


def test_builtin_readers_deal_conversation_k_to_bucket_k_mod_s_whatever_the_task_count(tmp_path):
    want = [c["messages"] for c in builtin_traces(23, 5, MODES)]
    for tasks in (1, 3, 23):
        work = tmp_path / str(tasks)
        step = ReadConversations(work, 4, 23, seed=5, systems=MODES)
        for r in range(tasks):
            step.run(rank=r, world_size=tasks)
        assert [bucket(work, s) for s in range(4)] == [want[s::4] for s in range(4)]
        assert merge_counts(work, tasks) == {"conversations": 23, "think": 23, "rejected": {}}


def test_row_readers_count_what_is_not_a_conversation_and_stop_at_examples(tmp_path):
    def rows():
        for i in range(10):
            reply = {"role": "assistant", "content": f"{i}"}
            system = {"role": "system", "content": "/no_think" if i % 2 else "hi"}
            yield {"m": [system, {"role": "user", "content": "q"}, reply]} if i % 3 else {"m": "text"}

    step = ReadConversations(tmp_path, 2, 8, rows=rows, messages_field="m")
    step.run(rank=0, world_size=1)
    kept = [m for s in range(2) for m in bucket(tmp_path, s)]
    assert sorted(m[2]["content"] for m in kept) == ["1", "2", "4", "5", "7"]  # rows 0-7, 0/3/6 rejected
    assert merge_counts(tmp_path, 1) == {"conversations": 5, "think": 2, "rejected": {"not_a_conversation": 3}}
    assert thinks(kept[0]) == ("/no_think" not in kept[0][0]["content"])
    with pytest.raises(ValueError, match="one task"):
        step.run(rank=0, world_size=2)


def test_a_reader_holds_one_conversation_at_a_time_not_the_source(tmp_path):
    """20 MB of conversations pass through a reader whose traced heap stays under 2 MB."""
    reply = {"role": "assistant", "content": "x" * 2000}

    def rows():
        for i in range(10_000):
            yield {"messages": [{"role": "user", "content": f"q{i}"}, reply]}

    step = ReadConversations(tmp_path, 4, 10_000, rows=rows)
    tracemalloc.start()
    try:
        step.run(rank=0, world_size=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert merge_counts(tmp_path, 1)["conversations"] == 10_000
    assert peak < 2_000_000, f"the reader's traced heap peaked at {peak:,} bytes for 20 MB of conversations"
