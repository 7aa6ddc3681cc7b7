"""Tokenization: a curated corpus to token shards with datatrove's DocumentTokenizer.

Each source becomes `{source}_{rank:05d}.ds` files (tokens; uint16 when the vocabulary has at
most 65,536 entries, else uint32: datatrove decides from the tokenizer's vocabulary size and we
record its choice), `.ds.index` (uint64 end offset of every document, in tokens) and
`.ds.metadata`. Every document ends with the EOS token, so documents never run into each other
and the trainer can mask attention at document boundaries. The model trainer reads the `.ds` and
`.ds.index` files directly; the mixture step lists them in its plan.

The tokenizer comes from the fertility artifact's decision (the trained one or a chosen
candidate). Documents are shuffled within each file (seeded) as datatrove does by default.
Unreadable input lines are counted per reason, as in curation, and reach the meta.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from curation.bpe import selected_tokenizer, token_dtype
from curation.executors import RayExecutorConfig, SlurmExecutorConfig, make_executors, run_executors
from curation.stages import read_stage_stats, shard_count
from pipeline.artifact import Artifact, operational
from pipeline.step import step


class TokenizeConfig(BaseModel):
    """The recipe's `tokenize` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    executor: Literal["local", "slurm", "ray"] = operational("local")  # datatrove executor, as for curation
    tasks: int = Field(default=8, gt=0)  # datatrove tasks = output files (capped by the input shards)
    workers: int | None = operational(None, gt=0)  # tasks run at once; None: the machine's cores (local)
    slurm: SlurmExecutorConfig | None = operational(None)  # required when executor is slurm (shared file system)
    ray: RayExecutorConfig = operational(RayExecutorConfig())  # used when executor is ray
    batch_size: int = operational(1000, gt=0)  # documents per encode_batch call
    shuffle_documents: bool = True  # shuffle documents within each output file (seeded)
    max_document_chars: int = Field(default=1_000_000, gt=0)  # longer documents: too_large


class TokenizeSpec(BaseModel):
    """The tokenize step's config: the recipe section and the seed of the document shuffle."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokenize: TokenizeConfig
    seed: int = 0


@step("tokenize", version=2, kind="shards", resource="data", isolate=True, retries=1)
def tokenize(config: TokenizeSpec, tokenizer: Artifact, corpus: Artifact, *, out: Path, log=print) -> dict[str, Any]:
    """A curated corpus's train shards to token shards `out/*.ds` with the chosen tokenizer
    (`tokenizer`: the fertility decision or the tokenizer itself); return counts for the meta."""
    from datatrove.pipeline.tokens import DocumentTokenizer

    from curation.io import CountingJsonlReader

    settings, seed = config.tokenize, config.seed
    tok = selected_tokenizer(tokenizer)
    source = corpus.meta.get("source", corpus.short)
    train = corpus.path / "train"
    tasks = max(1, min(settings.tasks, shard_count(train)))
    logs = out / "logs"
    tokenizer_step = DocumentTokenizer(
        output_folder=str(out),
        tokenizer_name_or_path=tok["path"],
        eos_token=tok["eos_token"],
        save_filename=re.sub(r"[^A-Za-z0-9_.-]", "_", source),  # names like dclm/dclm
        batch_size=settings.batch_size,
        shuffle_documents=settings.shuffle_documents,
        seed=seed,
    )
    dtype = token_dtype(tokenizer_step.tokenizer.get_vocab_size())
    pipeline = [CountingJsonlReader(str(train), max_chars=settings.max_document_chars), tokenizer_step]
    # The same executor choice as curation: local processes, Slurm array jobs or Ray tasks.
    run_executors(settings, make_executors(settings, [("tokenize", pipeline, tasks)], logs), logs, log)
    stats = read_stage_stats(logs, "tokenize")
    reader = stats[0]["stats"] if stats else {}
    rejected = {k[len("rejected_") :]: int(v) for k, v in reader.items() if k.startswith("rejected_")}
    files = sorted(out.glob("*.ds"))
    import numpy as np

    itemsize = np.dtype(dtype).itemsize
    tokens = sum(f.stat().st_size // itemsize for f in files)
    documents = sum((f.with_name(f.name + ".index")).stat().st_size // 8 for f in files)
    if documents == 0:
        raise ValueError(f"tokenize: source {source!r} produced no tokens; is its curated corpus empty?")
    log(
        f"tokenize {source}: {documents} documents, {tokens} tokens ({dtype}) in {len(files)} files"
        + (f"; rejected {rejected}" if rejected else "")
    )
    meta = {
        "source": source,
        "tokens": int(tokens),
        "documents": int(documents),
        "files": [f.name for f in files],
        "token_dtype": dtype,
        "vocab_size": tok["vocab_size"],
        "eos_id": tok["eos_id"],
        "eos_token": tok["eos_token"],
        "tokenizer": tok["name"],
        "tokenizer_path": tok["path"],
        "rejected": rejected,
        "input_documents": corpus.meta.get("documents"),
        # documents of the corpus that are neither tokenized nor rejected (0 unless a bug)
        "unaccounted": (corpus.meta["documents"] - documents - sum(rejected.values()))
        if isinstance(corpus.meta.get("documents"), int)
        else None,
    }
    (out / "shards.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return meta
