"""The reasoning_data step: reasoning traces rendered with the dual-mode chat template (think mode)
and tokenized into the token shards the pretraining trainer reads, for the reasoning mid-training
stage (docs/posttraining.md, "Reasoning mid-training").

A recipe's `reasoning_data` lists the trace sources by name; a stage's mixture weighs them like
any source (`mixtures/tiny/reasoning.yaml`: `weights: {reasoning: 1.0}`), and the mixture step
plans them with the shards of the tokenize step: the artifact is a `shards` artifact with the same
meta. Sources:
- `builtin`: arithmetic and word problems with worked traces, generated from the seed
  (curation/reasoning.py `builtin_trace`), under the recipe's `reasoning_modes.think_system`
  (the system turn of the SFT think rows and of the think-mode eval prompt), none of them a
  held-out math problem of the curated corpora (input `heldout`), which the evaluations ask;
- `files:GLOB` (JSONL), `hf:NAME` (streamed), `hf:/PATH`: rows whose `messages_field` holds a
  conversation (`[{role, content}]`, or ShareGPT `from`/`value` as OpenThoughts3's `conversations`).

It runs as datatrove tasks on the executor of the recipe's `tokenize` section (local processes,
Slurm array jobs or Ray; curation/reasoning_tasks.py): reader tasks deal the conversations into
`tokenize.tasks` buckets (conversation k to bucket k mod S), then one task per bucket renders
each with the chosen tokenizer's chat template (ChatML, `/think` unless its system turn says
`/no_think`) and tokenizes it with the tokenize step's DocumentTokenizer into
`{name}_{s:05d}_*.ds` (each conversation one document ending in EOS, so the trainer packs them
like pretraining text; the documents of a shard shuffled with the seed). No process holds the
source: a task's memory is bounded by its bucket's batch, not by the conversations.

Since version 2 (issue 33): S shards shuffled each within itself instead of one file shuffled
whole, and builtin problems drawn per index (the same for any reader task count); the output is
deterministic for a seed and S and the same for any reader task count, worker count or executor.
"""

from __future__ import annotations

import glob
import json
import shutil
from functools import partial
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from curation.bpe import selected_tokenizer, token_dtype
from curation.executors import RayExecutorConfig, SlurmExecutorConfig, make_executors, preload_workers, run_executors
from pipeline.artifact import Artifact, added_identity, operational
from pipeline.step import step
from trainers.posttrain.chat_data import data_state, load_rows
from trainers.posttrain.sections import ChatDataConfig, ReasoningModesConfig


class ReasoningDataConfig(BaseModel):
    """One entry of the recipe's `reasoning_data`: a source of reasoning traces."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")  # the source name mixtures weigh
    uri: str = "builtin"  # builtin (generated problems), files:GLOB, hf:NAME or hf:/PATH
    examples: int = Field(default=1000, gt=0)  # builtin: problems generated; else the most rows read
    # builtin: the largest operand of the problems (as a builtin:math source's `max_operand`);
    # None: the generator's ranges. Out of the fingerprint while None.
    max_operand: int | None = added_identity(None, ge=3)
    messages_field: str = "messages"  # files:/hf: column holding the conversation
    hf_subset: str | None = None  # hub dataset configuration
    hf_split: str = "train"  # split of hf: data
    hf_revision: str | None = None  # pinned hub revision

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        if v == "builtin" or (v.startswith(("files:", "hf:")) and v.split(":", 1)[1]):
            return v
        raise ValueError(f"unknown reasoning data {v!r}; use 'builtin', 'files:GLOB', 'hf:NAME' or 'hf:/PATH'")

    @model_validator(mode="after")
    def _operands_of_builtin(self) -> ReasoningDataConfig:
        if self.max_operand is not None and self.uri != "builtin":
            raise ValueError(f"reasoning_data {self.name}: max_operand sets builtin problems, not {self.uri}")
        return self


class ReasoningDataSpec(BaseModel):
    """The reasoning_data step's config: one source, the seed of its problems and order, the
    recipe's `reasoning_modes` (the system turn of builtin traces: `think_system`), the shards it
    is tokenized into and where its tasks run (the recipe's `tokenize` section)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data: ReasoningDataConfig
    seed: int = 0
    modes: ReasoningModesConfig = added_identity(ReasoningModesConfig())  # out of the fingerprint at the default
    shards: int = Field(default=1, gt=0)  # token shards (buckets, tokenize tasks): the recipe's tokenize.tasks
    # builtin: tasks that generate the problems (each a contiguous block of indices; the output is
    # the same for any count); None: one per shard. files:/hf: one task streams the rows.
    read_tasks: int | None = operational(None, gt=0)
    executor: Literal["local", "slurm", "ray"] = operational("local")  # as the tokenize step's
    workers: int | None = operational(None, gt=0)  # tasks at once; None: the cores (local), all (clusters)
    slurm: SlurmExecutorConfig | None = operational(None)
    ray: RayExecutorConfig = operational(RayExecutorConfig())
    # conversations per encode_batch call: a batch's encodings are in memory at once (not the
    # tokenize section's batch_size: a reasoning conversation is a few thousand tokens)
    batch_size: int = operational(1000, gt=0)

    @classmethod
    def of(cls, data: ReasoningDataConfig, seed: int, tokenize: Any = None, modes: Any = None) -> ReasoningDataSpec:
        """The step's config for a recipe's reasoning source: shards and executor from the
        recipe's `tokenize` section (tasks/tokenize.py `TokenizeConfig`) when given, the system
        turns from its `reasoning_modes`."""
        extra = {} if modes is None else {"modes": modes}
        if tokenize is None:
            return cls(data=data, seed=seed, **extra)
        run = {k: getattr(tokenize, k) for k in ("executor", "workers", "slurm", "ray")}
        return cls(data=data, seed=seed, shards=tokenize.tasks, **run, **extra)


def _reader(config: ReasoningDataSpec, heldout: tuple[Artifact, ...], work: Path) -> tuple[Any, int]:
    """The read stage's step and its task count."""
    from curation.reasoning_tasks import ReadConversations

    cfg = config.data
    common = {"work": work, "buckets": config.shards, "examples": cfg.examples, "seed": config.seed}
    if cfg.uri == "builtin":
        folders = tuple(str(a.path / "heldout") for a in heldout if (a.path / "heldout").is_dir())
        tasks = max(1, min(config.read_tasks or config.shards, cfg.examples))
        reader = ReadConversations(**common, heldout=folders, max_operand=cfg.max_operand, systems=config.modes)
        return reader, tasks
    if cfg.uri.startswith("files:") and not glob.glob(str(Path(cfg.uri[6:]).expanduser()), recursive=True):
        raise FileNotFoundError(f"reasoning_data[{cfg.name}].uri {cfg.uri!r}: no file matches")
    where = ChatDataConfig(uri=cfg.uri, hf_subset=cfg.hf_subset, hf_split=cfg.hf_split, hf_revision=cfg.hf_revision)
    rows = partial(load_rows, cfg.uri, where, streaming=True)
    return ReadConversations(**common, rows=rows, messages_field=cfg.messages_field), 1


# 2: datatrove tasks on the tokenize section's executor, S shards each shuffled, builtin problems
# drawn per index (issue 33)
@step(
    "reasoning_data",
    version=2,
    kind="shards",
    resource="data",
    isolate=True,
    retries=1,
    extra=lambda spec: data_state(spec.data.uri),
)
def reasoning_data(
    config: ReasoningDataSpec, tokenizer: Artifact, heldout: tuple[Artifact, ...] = (), *, out: Path, log=print
) -> dict[str, Any]:
    """Reasoning conversations rendered with the chosen `tokenizer`'s chat template and written as
    token shards `out/{name}_{s:05d}_*.ds` by datatrove tasks (the held-out math problems of the
    `heldout` corpora left out of builtin traces); return the meta a `shards` artifact carries."""
    import numpy as np

    from curation.reasoning_tasks import merge_counts, tokenize_pipeline

    cfg = config.data
    chosen = selected_tokenizer(tokenizer)
    work, logs = out / "work", out / "logs"
    reader, read_tasks = _reader(config, heldout, work)
    log(
        f"reasoning data {cfg.name} ({cfg.uri}): read by {read_tasks} task(s), tokenized into at most "
        f"{config.shards} shard(s) on the {config.executor} executor"
    )
    pipeline = tokenize_pipeline(work, out, chosen, cfg.name, config.seed, config.batch_size)
    if config.executor == "local":
        preload_workers([[reader], pipeline])  # both stages' workers fork from one server
    run_executors(config, make_executors(config, [("read", [reader], read_tasks)], logs), logs, log)
    counts = merge_counts(work, read_tasks)
    rejected = counts["rejected"]
    if not counts["conversations"]:
        raise ValueError(
            f"reasoning data {cfg.name} ({cfg.uri}): no conversation in field {cfg.messages_field!r} "
            f"(rejected: {rejected}); set reasoning_data[{cfg.name}].messages_field to the right column"
        )
    tasks = min(config.shards, counts["conversations"])  # conversation k is in bucket k mod S
    run_executors(config, make_executors(config, [("tokenize", pipeline, tasks)], logs), logs, log)
    shutil.rmtree(work / "convs")  # the conversations' copy (as large as the source); the counts stay
    dtype = token_dtype(chosen["vocab_size"])
    files = sorted(out.glob("*.ds"))
    tokens = sum(f.stat().st_size // np.dtype(dtype).itemsize for f in files)
    documents = sum(f.with_name(f.name + ".index").stat().st_size // 8 for f in files)
    if documents != counts["conversations"]:
        raise RuntimeError(
            f"reasoning data {cfg.name}: {counts['conversations']} conversations read but {documents} "
            f"tokenized; see {logs}/tokenize/logs"
        )
    log(
        f"reasoning data {cfg.name} ({cfg.uri}): {documents} conversations, {tokens} tokens ({dtype}) in {len(files)} files"
    )
    meta = {
        "source": cfg.name,
        "origin": cfg.uri,
        "tokens": int(tokens),
        "documents": int(documents),
        "think_conversations": counts["think"],
        "files": [f.name for f in files],
        "token_dtype": dtype,
        "vocab_size": chosen["vocab_size"],
        "eos_id": chosen["eos_id"],
        "eos_token": chosen["eos_token"],
        "tokenizer": chosen["name"],
        "tokenizer_path": chosen["path"],
        "rejected": rejected,
    }
    (out / "shards.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return meta
