"""Post-training data: chat conversations, verifiable arithmetic prompts, and the verifier.

The `posttrain_data` step writes, into one folder:
- `train.jsonl`: SFT conversations (`{"messages": [{role, content}, ...]}`),
- `heldout.jsonl`: conversations never trained on (SFT eval loss),
- `prompts.jsonl`: arithmetic prompts with their answers and worked reference solutions
  (`{"prompt": [...], "answer": "42", "reference": "..."}`) for preference pairs, GRPO and
  on-policy distillation.

Sources (`posttrain.data.uri`):
- `builtin`: made from the curated corpora. Math documents ("Problem / Solution / Answer") become
  a user question and an assistant worked solution ending in `Answer: N`; prose documents become
  "Continue this passage" (the next words) and "Summarise this passage" (its lead sentence: an
  extractive stand-in for a summary, honest about being one). Training conversations come from
  each corpus's `train/` split, held-out ones from `heldout/`, which pretraining never saw either.
  Prompts for preference/RL come from math train documents after those used for SFT, so RL does
  not simply replay memorised SFT answers.
- `files:GLOB`: local JSONL with a `messages` column; `hf:NAME` a hub dataset (e.g.
  `HuggingFaceTB/smoltalk` with `hf_subset: all`, the SmolLM SFT mixture); `hf:/PATH` a
  `datasets.save_to_disk` folder. Held-out rows are picked by a stable hash of the row index.
  Prompts still come from the builtin math corpus, because the verifier needs known answers.

The verifier reads the final `Answer: N` of a completion; rewards are plain functions with TRL's
reward signature (`completions`, dataset columns as keyword arguments).
"""

from __future__ import annotations

import glob
import hashlib
import random
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from curation.source_kinds import read_shards
from pipeline.artifact import Artifact
from pipeline.step import step
from trainers.posttrain.config import ChatDataConfig, ChatDataSpec
from trainers.posttrain.data import check_messages, load_rows, write_jsonl

_MATH = re.compile(r"^Problem: (?P<problem>.*)\nSolution: (?P<solution>.*)\nAnswer: (?P<answer>-?\d+)\s*$", re.S)


# --- verifier and rewards -------------------------------------------------------------------


# --- conversations from the built-in corpora ------------------------------------------------


def math_conversation(text: str) -> dict[str, Any] | None:
    """A math document as (user question, assistant worked solution); None if not one."""
    m = _MATH.match(text.strip())
    if not m:
        return None
    return {
        "messages": [
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
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def _corpus_texts(corpora: Sequence[Artifact], domain: str, split: str) -> Iterator[str]:
    for art in corpora:
        if art.meta.get("domain") == domain and (art.path / split).is_dir():
            for doc in read_shards(art.path / split):
                yield doc["text"]


def builtin_conversations(
    corpora: Sequence[Artifact], split: str, math_n: int, prose_n: int, seed: int
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


def arithmetic_prompts(corpora: Sequence[Artifact], skip: int, n: int) -> list[dict[str, Any]]:
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
            {"prompt": conv["messages"][:1], "answer": conv["answer"], "reference": conv["messages"][1]["content"]}
        )
        if len(out) >= n:
            break
    return out


# --- conversations from files and Hugging Face datasets --------------------------------------


def data_state(uri: str) -> str:
    """A digest of local data files (names, sizes, mtimes), so edited data changes fingerprints;
    hub data is pinned by its revision in the config instead."""
    if uri.startswith("files:"):
        paths = [Path(p) for p in sorted(glob.glob(str(Path(uri[6:]).expanduser()), recursive=True))]
    elif uri.startswith("hf:") and Path(uri[3:]).expanduser().exists():
        paths = sorted(p for p in Path(uri[3:]).expanduser().rglob("*") if p.is_file())
    else:
        return ""
    h = hashlib.sha256()
    for p in paths:
        st = p.stat()
        h.update(f"{p}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _held_out(i: int, fraction: float) -> bool:
    h = int(hashlib.sha256(f"posttrain-row:{i}".encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def external_conversations(cfg: ChatDataConfig) -> tuple[list[dict], list[dict], Counter]:
    """(train, held-out, rejected counts) from a files:/hf: dataset."""
    train, heldout, rejected = [], [], Counter()
    for i, row in enumerate(load_rows(cfg.uri, cfg)):
        if cfg.max_examples and i >= cfg.max_examples:
            break
        messages = row.get(cfg.messages_field) if isinstance(row, dict) else None
        why = check_messages(messages, f"{cfg.uri} row {i}")
        if why:
            rejected[why] += 1
            continue
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        (heldout if _held_out(i, cfg.held_out_fraction) else train).append({"messages": messages})
    if not train:
        raise ValueError(
            f"posttrain data {cfg.uri!r}: no usable conversations in field {cfg.messages_field!r} "
            f"(rejected: {dict(rejected)}); set posttrain.data.messages_field to the right column"
        )
    return train, heldout, rejected


@step(
    "posttrain_data",
    version=2,
    kind="corpus",
    resource="data",
    isolate=True,
    retries=1,
    extra=lambda spec: data_state(spec.data.uri),
)
def posttrain_data(config: ChatDataSpec, corpora: tuple[Artifact, ...], *, out: Path, log=print) -> dict[str, Any]:
    """Curated `corpora` to SFT conversations, held-out conversations and arithmetic prompts in
    `out`; return the meta."""
    cfg, seed = config.data, config.seed
    domains = {a.meta.get("domain") for a in corpora}
    if "math" not in domains:
        raise ValueError(
            "posttrain data: no math corpus among the inputs; the arithmetic prompts and the "
            "verifier need a builtin:math (domain: math) source in the recipe"
        )
    rejected: Counter = Counter()
    if cfg.uri == "builtin":
        train = builtin_conversations(corpora, "train", cfg.math_examples, cfg.prose_examples, seed)
        heldout = builtin_conversations(
            corpora,
            "heldout",
            cfg.heldout_examples - cfg.heldout_examples // 4,
            cfg.heldout_examples // 4,
            seed,
        )
        if cfg.max_examples:
            train = train[: cfg.max_examples]
    else:
        train, heldout, rejected = external_conversations(cfg)
        heldout = heldout[: max(cfg.heldout_examples, 1)]
    if not train:
        raise ValueError("posttrain data: no training conversations could be built from the corpora")
    skip = cfg.math_examples if cfg.uri == "builtin" else 0
    prompts = arithmetic_prompts(corpora, skip, cfg.prompts)
    if not prompts:
        raise ValueError(
            f"posttrain data: no arithmetic prompts left after the {skip} SFT math documents; raise "
            "the math source's max_documents or lower posttrain.data.math_examples"
        )
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "heldout.jsonl", heldout)
    write_jsonl(out / "prompts.jsonl", prompts)
    log(
        f"posttrain data ({cfg.uri}): {len(train)} train and {len(heldout)} held-out conversations, "
        f"{len(prompts)} arithmetic prompts"
    )
    return {
        "origin": cfg.uri,
        "train": len(train),
        "heldout": len(heldout),
        "prompts": len(prompts),
        "rejected": dict(rejected),
        "files": {k: str(out / f"{k}.jsonl") for k in ("train", "heldout", "prompts")},
    }
