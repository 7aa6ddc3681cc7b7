"""The reasoning_data step: reasoning traces rendered with the dual-mode chat template (think mode)
and tokenized into the token shards the pretraining trainer reads, for the reasoning mid-training
stage (docs/posttraining.md, "Reasoning mid-training").

A recipe's `reasoning_data` lists the trace sources by name; a stage's mixture weighs them like
any source (`mixtures/tiny/reasoning.yaml`: `weights: {reasoning: 1.0}`), and the mixture step
plans them with the shards of the tokenize step: the artifact is a `shards` artifact with the same
meta. Sources:
- `builtin`: arithmetic and word problems with worked traces, generated from the seed
  (curation/reasoning.py `builtin_traces`), under the recipe's `reasoning_modes.think_system`
  (the system turn of the SFT think rows and of the think-mode eval prompt), none of them a
  held-out math problem of the curated corpora (input `heldout`), which the evaluations ask;
- `files:GLOB` (JSONL), `hf:NAME`, `hf:/PATH`: rows whose `messages_field` holds a conversation
  (`[{role, content}]`, or ShareGPT `from`/`value` as OpenThoughts3's `conversations`).
Every conversation is rendered with the chosen tokenizer's chat template (ChatML, `/think` unless
its system turn says `/no_think`), shuffled with the seed and written as one `.ds` file, each
conversation one document ending in EOS, so the trainer packs them like pretraining text.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from curation.bpe import CHAT_TEMPLATE, selected_tokenizer, token_dtype, tokenizer_folder
from curation.reasoning import as_messages, builtin_traces, heldout_problems, write_token_shard
from curation.source_kinds import read_shards
from pipeline.artifact import Artifact, added_identity
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
    """The reasoning_data step's config: one source, the seed of its problems and order, and the
    recipe's `reasoning_modes` (the system turn of builtin traces: `think_system`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data: ReasoningDataConfig
    seed: int = 0
    modes: ReasoningModesConfig = added_identity(ReasoningModesConfig())  # out of the fingerprint at the default


def _conversations(config: ReasoningDataSpec, heldout: tuple[Artifact, ...]) -> tuple[list, Counter]:
    cfg = config.data
    if cfg.uri == "builtin":
        texts = (d["text"] for a in heldout if (a.path / "heldout").is_dir() for d in read_shards(a.path / "heldout"))
        traces = builtin_traces(cfg.examples, config.seed, config.modes, heldout_problems(texts), cfg.max_operand)
        return traces, Counter()
    where = ChatDataConfig(uri=cfg.uri, hf_subset=cfg.hf_subset, hf_split=cfg.hf_split, hf_revision=cfg.hf_revision)
    rows, rejected = [], Counter()
    for i, row in enumerate(load_rows(cfg.uri, where)):
        if i >= cfg.examples:
            break
        messages = as_messages(row.get(cfg.messages_field) if isinstance(row, dict) else None)
        if messages is None:
            rejected["not_a_conversation"] += 1
        else:
            rows.append({"messages": messages})
    if not rows:
        raise ValueError(
            f"reasoning data {cfg.name} ({cfg.uri}): no conversation in field {cfg.messages_field!r} "
            f"(rejected: {dict(rejected)}); set reasoning_data[{cfg.name}].messages_field to the right column"
        )
    return rows, rejected


@step(
    "reasoning_data",
    version=1,
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
    token shards `out/{name}_00000.ds` (the held-out math problems of the `heldout` corpora left
    out of builtin traces); return the meta a `shards` artifact carries."""
    from transformers import AutoTokenizer

    cfg = config.data
    conversations, rejected = _conversations(config, heldout)
    chosen = selected_tokenizer(tokenizer)
    folder, eos_id = tokenizer_folder(tokenizer)
    tok = AutoTokenizer.from_pretrained(str(folder))
    if not tok.chat_template:  # an adopted tokenizer.json without one: SmolLM3's template
        tok.chat_template = CHAT_TEMPLATE
    documents = []
    for conv in conversations:
        text = tok.apply_chat_template(conv["messages"], tokenize=False)
        documents.append([*tok(text, add_special_tokens=False)["input_ids"], eos_id])
    random.Random(f"reasoning_data:{cfg.name}:{config.seed}").shuffle(documents)
    dtype = token_dtype(chosen["vocab_size"])
    name = f"{cfg.name}_00000.ds"
    tokens = write_token_shard(out / name, documents, dtype, chosen["name"])
    first = [c["messages"][0] for c in conversations]
    think = sum(1 for m in first if not (m["role"] == "system" and "/no_think" in m["content"]))
    log(f"reasoning data {cfg.name} ({cfg.uri}): {len(documents)} conversations, {tokens} tokens ({dtype})")
    meta = {
        "source": cfg.name,
        "origin": cfg.uri,
        "tokens": tokens,
        "documents": len(documents),
        "think_conversations": think,
        "files": [name],
        "token_dtype": dtype,
        "vocab_size": chosen["vocab_size"],
        "eos_id": chosen["eos_id"],
        "eos_token": chosen["eos_token"],
        "tokenizer": chosen["name"],
        "tokenizer_path": chosen["path"],
        "rejected": dict(rejected),
    }
    (out / "shards.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return meta
