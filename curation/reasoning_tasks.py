"""The reasoning_data step as datatrove tasks: conversations read by R tasks, rendered with the
chat template and tokenized into S token shards by S tasks (tasks/reasoning_data.py runs them on
the executor of the recipe's `tokenize` section).

1. `ReadConversations` (R tasks): task r makes or reads its part of the source and writes each
   conversation (its `messages`, one JSON line) to the bucket of its index k among the kept
   conversations, `work/convs/{k % S:05d}/{r:05d}.jsonl.gz`, and its counts (conversations,
   think-mode ones, rejected rows by reason) to `work/read/{r:05d}.json`. `builtin`: task r
   generates indices [r n / R, (r + 1) n / R) (curation/reasoning.py `builtin_trace`, seeded per
   index), excluding the held-out math problems it reads from the held-out folders (a split
   bounded by `curation.heldout.max_docs`); `files:`/`hf:`: one task (R = 1) streams the rows
   (`rows`, a picklable callable), since `examples` keeps the first rows in read order, which
   only a single reader knows. Memory: the S open gzip writers and, for builtin, the held-out
   problems; never the source.
2. `RenderedConversations` then datatrove's `DocumentTokenizer` (S tasks): task s reads bucket s
   (its files in reader order: the order of k, whatever R is), renders each conversation with the
   tokenizer's chat template and tokenizes it as the tokenize step does (EOS after every
   document, the documents of the file shuffled with the seed), into `{name}_{s:05d}_*.ds`.
   Memory: one conversation at a time, a batch of encodings and the shard's document ends.

So the output depends on the source, the seed and S, not on R, the workers or the executor.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from datatrove.data import Document
from datatrove.pipeline.base import PipelineStep

from curation.reasoning import as_messages, builtin_trace, heldout_problems
from curation.source_kinds import read_shards


def thinks(messages: list[dict[str, str]]) -> bool:
    """Whether a conversation renders in think mode: unless its system turn says `/no_think`."""
    first = messages[0]
    return not (first["role"] == "system" and "/no_think" in first["content"])


class ReadConversations(PipelineStep):
    """Stage 1: one part of the source's conversations, dealt into the S buckets by index."""

    name = "📖 Reasoning conversations"
    type = "📥 INGEST"

    def __init__(
        self,
        work: Path,
        buckets: int,
        examples: int,
        *,
        seed: int = 0,
        heldout: tuple[str, ...] = (),
        max_operand: int | None = None,
        rows: Callable[[], Iterable[Any]] | None = None,
        messages_field: str = "messages",
        systems: Any = None,
    ):
        super().__init__()
        self.work, self.buckets, self.examples = Path(work), buckets, examples
        self.seed, self.heldout, self.max_operand = seed, tuple(heldout), max_operand
        self.rows, self.messages_field = rows, messages_field
        # builtin: the recipe's reasoning_modes (trainers/posttrain/sections.py `ReasoningModesConfig`),
        # whose think_system is the traces' system turn
        if rows is None and systems is None:
            raise ValueError("ReadConversations: builtin traces need systems (the recipe's reasoning_modes)")
        self.systems = systems

    def conversations(self, rank: int, world: int, rejected: Counter) -> Iterator[tuple[int, list[dict]]]:
        """(index k among the kept conversations, messages) of this task's part."""
        if self.rows is None:  # builtin: generated per index
            texts = (d["text"] for folder in self.heldout for d in read_shards(Path(folder)))
            exclude = set(heldout_problems(texts))
            for k in range(rank * self.examples // world, (rank + 1) * self.examples // world):
                yield k, builtin_trace(k, self.seed, self.systems, exclude, self.max_operand)["messages"]
            return
        if world != 1:
            raise ValueError("reasoning_data: rows of files:/hf: data are read by one task")
        k = 0
        for i, row in enumerate(self.rows()):
            if i >= self.examples:
                break
            messages = as_messages(row.get(self.messages_field) if isinstance(row, dict) else None)
            if messages is None:
                rejected["not_a_conversation"] += 1
                continue
            yield k, messages
            k += 1

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> None:
        rejected: Counter = Counter()
        counts = {"conversations": 0, "think": 0}
        files: dict[int, Any] = {}
        try:
            for k, messages in self.conversations(rank, world_size, rejected):
                bucket = k % self.buckets
                if bucket not in files:
                    folder = self.work / "convs" / f"{bucket:05d}"
                    folder.mkdir(parents=True, exist_ok=True)
                    files[bucket] = gzip.open(folder / f"{rank:05d}.jsonl.gz", "wt", encoding="utf-8")
                files[bucket].write(json.dumps(messages, ensure_ascii=False) + "\n")
                counts["conversations"] += 1
                counts["think"] += thinks(messages)
                self.stat_update("conversations")
        finally:
            for fh in files.values():
                fh.close()
        for reason, n in rejected.items():
            self.stat_update(f"rejected_{reason}", value=n)
        (self.work / "read").mkdir(parents=True, exist_ok=True)
        part = self.work / "read" / f"{rank:05d}.json"
        tmp = part.with_suffix(".tmp")
        tmp.write_text(json.dumps({**counts, "rejected": dict(rejected)}), encoding="utf-8")
        tmp.replace(part)  # a task killed mid-write leaves no counts a rerun would take as its own


class RenderedConversations(PipelineStep):
    """Stage 2's reader: bucket `rank`'s conversations in reader order, each rendered with the
    chat template of the tokenizer folder `tokenizer` (SmolLM3's when it has none)."""

    name = "💬 Chat template"
    type = "📖 - READER"
    worker_imports = ("transformers.models.auto.tokenization_auto",)  # run's import (executors.preload_workers)

    def __init__(self, work: Path, tokenizer: str):
        super().__init__()
        self.work, self.tokenizer = Path(work), tokenizer

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Iterator[Document]:
        from transformers import AutoTokenizer

        from curation.bpe import CHAT_TEMPLATE

        tok = AutoTokenizer.from_pretrained(self.tokenizer)
        if not tok.chat_template:  # an adopted tokenizer.json without one: SmolLM3's template
            tok.chat_template = CHAT_TEMPLATE
        n = 0
        for path in sorted((self.work / "convs" / f"{rank:05d}").glob("*.jsonl.gz")):
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                for line in fh:
                    text = tok.apply_chat_template(json.loads(line), tokenize=False)
                    self.stat_update("rendered")
                    yield Document(text=text, id=f"{rank}/{n}")
                    n += 1


def tokenize_pipeline(work: Path, out: Path, tokenizer: dict[str, Any], name: str, seed: int, batch_size: int) -> list:
    """Stage 2's pipeline: a bucket's conversations rendered, then tokenized into `out` as the
    tokenize step tokenizes (`tokenizer`: curation/bpe.py `selected_tokenizer`'s choice)."""
    from datatrove.pipeline.tokens import DocumentTokenizer

    folder = Path(tokenizer["path"])
    step = DocumentTokenizer(
        output_folder=str(out),
        tokenizer_name_or_path=tokenizer["path"],
        eos_token=tokenizer["eos_token"],
        save_filename=name,
        batch_size=batch_size,
        shuffle_documents=True,
        seed=seed,
    )
    return [RenderedConversations(work, str(folder.parent if folder.is_file() else folder)), step]


def merge_counts(work: Path, tasks: int) -> dict[str, Any]:
    """The read tasks' counts summed: conversations, think-mode ones, rejected rows by reason."""
    total: dict[str, Any] = {"conversations": 0, "think": 0, "rejected": Counter()}
    for r in range(tasks):
        part = json.loads((work / "read" / f"{r:05d}.json").read_text(encoding="utf-8"))
        total["conversations"] += part["conversations"]
        total["think"] += part["think"]
        total["rejected"].update(part["rejected"])
    total["rejected"] = dict(total["rejected"])
    return total
