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

The builtin conversations and prompts are curation/conversations.py's; reading `files:`/`hf:`
data, the verifier and the rewards are trainers/posttrain/chat_data.py's.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from curation.conversations import arithmetic_prompts, builtin_conversations
from pipeline.artifact import Artifact
from pipeline.step import step
from trainers.posttrain.chat_data import data_state, external_conversations, write_jsonl
from trainers.posttrain.sections import ChatDataSpec


@step(
    "posttrain_data",
    version=3,
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
        train = builtin_conversations(
            corpora, "train", cfg.math_examples, cfg.prose_examples, seed, config.modes, cfg.think_share
        )
        heldout = builtin_conversations(
            corpora,
            "heldout",
            cfg.heldout_examples - cfg.heldout_examples // 4,
            cfg.heldout_examples // 4,
            seed,
            config.modes,
            cfg.think_share,
        )
        if cfg.max_examples:
            train = train[: cfg.max_examples]
    else:
        train, heldout, rejected = external_conversations(cfg)
        heldout = heldout[: max(cfg.heldout_examples, 1)]
    if not train:
        raise ValueError("posttrain data: no training conversations could be built from the corpora")
    skip = cfg.math_examples if cfg.uri == "builtin" else 0
    prompts = arithmetic_prompts(corpora, skip, cfg.prompts, config.modes)
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
