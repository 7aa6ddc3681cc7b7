"""Tokenizer: train a byte-level BPE on a sample of the curated corpora, or adopt a given one.

The output is a Hugging Face tokenizer folder (`PreTrainedTokenizerFast.save_pretrained`) with
`tokenizer.json`, the special tokens for documents and chat (`<|endoftext|>` = id 0, the EOS
between documents; `<|im_start|>`, `<|im_end|>`, `<|pad|>`; `<think>`, `</think>`, kept when
decoding) and SmolLM3's dual-mode (think / no-think) chat template (curation/bpe.py), whose
assistant turns sit inside `{% generation %}` ... `{% endgeneration %}`, so
`apply_chat_template(..., return_assistant_tokens_mask=True)` (TRL's assistant-only loss) marks
exactly the assistant's content and its closing `<|im_end|>`.

Design choices:
- Byte-level BPE (GPT-2 style pre-tokenizer, byte alphabet seeded) never meets an unknown
  character, so every document tokenizes whatever the source.
- The training sample gives each source an equal character budget, so one large source (code)
  does not decide the vocabulary alone; documents are taken in shard order (deterministic).
- `path` adopts an existing `tokenizer.json` (or a folder holding one) instead of training; the
  chat template and missing special tokens are added so downstream steps see one contract.
- Training runs as a one-task datatrove stage on the executor the section names (curation/bpe_task.py:
  `executor: slurm` with a `slurm` request sized to its memory, or `ray`), never in the flow host's
  step process at scale: the trainer's word counts grow with the sample's distinct words (9.9 GB
  projected at the 3B recipe's 2e9 characters, benchmarks/data_scale.py, docs/scale.md). The
  sample is streamed from the shards, never held. The output is the same on every executor.
- BPE stops merging when no pair is seen `min_frequency` times: a small sample gives fewer
  entries than `vocab_size`. That is said (a WARNING log line and `warnings` in the meta, with
  `requested_vocab_size` beside `vocab_size`), and `vocab_size` in the meta is always the real
  size: tokenize, the mixture plan and the model's embedding (trainers/pretrain.py) take it from here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from curation.bpe import load_tokenizer_file, save_hf_tokenizer
from curation.executors import RayExecutorConfig, SlurmExecutorConfig, make_executors, run_executors
from pipeline.artifact import Artifact, operational
from pipeline.step import step


class TokenizerConfig(BaseModel):
    """The recipe's `tokenizer` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(default=4096, ge=300)  # BPE vocabulary incl. 256 bytes and specials
    path: str | None = None  # adopt this tokenizer.json (or folder) instead of training one
    sample_chars: int = Field(default=4_000_000, gt=0)  # training sample, split evenly by source
    min_frequency: int = Field(default=2, ge=1)  # merges seen fewer times are not learned
    # where the training task runs (one datatrove task; curation/executors.py): local (a process on
    # the flow host), slurm (with `slurm`, whose cpus_per_task x mem_per_cpu_gb is its memory) or ray
    executor: Literal["local", "slurm", "ray"] = operational("local")
    slurm: SlurmExecutorConfig | None = operational(None)  # required when executor is slurm
    ray: RayExecutorConfig = operational(RayExecutorConfig())  # used when executor is ray


def given_tokenizer_digest(config: TokenizerConfig) -> str:
    """Digest of an adopted tokenizer file (a changed file changes the tokenizer)."""
    if not config.path:
        return ""
    import hashlib

    path = Path(config.path).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():  # a device or FIFO (/dev/zero) would be read forever
        raise FileNotFoundError(f"tokenizer.path {config.path!r}: no regular tokenizer.json file there")
    return hashlib.sha256(file.read_bytes()).hexdigest()[:16]


@step("tokenizer", version=3, kind="tokenizer", resource="data", isolate=True, extra=given_tokenizer_digest, retries=1)
def tokenizer(config: TokenizerConfig, corpora: tuple[Artifact, ...] = (), *, out: Path, log=print) -> dict[str, Any]:
    """Train a BPE tokenizer on curated `corpora` (none when adopting `tokenizer.path`) or adopt
    the given one, and save it into `out`; return the artifact meta."""
    if config.path:
        tok = load_tokenizer_file(config.path)
        origin = {"origin": "given", "path": str(Path(config.path).expanduser().resolve())}
    else:
        if not corpora:
            raise ValueError("tokenizer: no curated corpora to train on and no tokenizer.path given")
        from curation.bpe_task import FACTS, TrainTokenizer

        train = TrainTokenizer(tuple(corpora), config.sample_chars, config.vocab_size, config.min_frequency, out)
        log(f"tokenizer: training on {config.sample_chars:,} characters, one task on the {config.executor} executor")
        run_executors(config, make_executors(config, [("train", [train], 1)], out / "logs"), out / "logs", log)
        facts = json.loads((out / FACTS).read_text(encoding="utf-8"))  # kept: a rerun skips the finished task
        sample = facts["sample"]
        origin = {
            "origin": "trained",
            "requested_vocab_size": config.vocab_size,
            "sample_chars": sample["chars"],
            "sample_documents": sample["documents"],
            "sources": [c.meta.get("source", c.short) for c in corpora],
        }
    meta = {**origin, **(save_hf_tokenizer(tok, out) if config.path else facts["meta"]), "warnings": []}
    if meta["origin"] == "trained" and meta["vocab_size"] < config.vocab_size:
        meta["warnings"].append(
            f"tokenizer: the trained vocabulary has {meta['vocab_size']} entries, "
            f"{config.vocab_size} requested (tokenizer.vocab_size): the sample "
            f"({meta['sample_chars']} characters from {', '.join(meta['sources'])}) has no more "
            f"pairs seen {config.min_frequency}+ times. The model's embedding follows the real "
            f"size; to reach the requested one, train on more text (tokenizer.sample_chars, more "
            f"data) or lower tokenizer.min_frequency"
        )
    for warning in meta["warnings"]:
        log(f"WARNING {warning}")
    log(f"tokenizer ({meta['origin']}): vocab {meta['vocab_size']}, eos id {meta['eos_id']}")
    return meta
