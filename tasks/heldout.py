"""Held-out loss: the held-out split of a set of sources, tokenized with the run's tokenizer, and
the mean next-token loss of a checkpoint on it.

Loss on text the model never trained on is the most sensitive signal a small run has: cloze
accuracy of a barely trained model often does not move at all between two short anneals, while
the held-out loss of each domain does, with a standard error over its windows. The CPT monitor
tracks it on the general and the new domain; the anneal comparison reports it per source next to
the eval scores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from infra.artifact import Artifact, Inputs
from tasks.step import many, one, step


class HeldoutConfig(BaseModel):
    """Held-out tokens of one domain (a set of sources)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    domain: str  # "general" or "domain"
    sources: tuple[str, ...] = Field(min_length=1)  # recipe source names
    max_tokens: int = Field(gt=0)  # cap, split evenly over the sources


def build_heldout(cfg: HeldoutConfig, inputs: Sequence[Artifact], out: Path, log=print) -> dict[str, Any]:
    """Tokenize the held-out split of each source with the run's tokenizer (EOS after each doc)."""
    import numpy as np
    from tokenizers import Tokenizer

    from tasks.sources import read_shards
    from tasks.tokenize import selected_tokenizer

    tok_info = selected_tokenizer(tuple(a for a in inputs if a.kind in ("fertility", "tokenizer")))
    tok = Tokenizer.from_file(tok_info["path"])
    eos = int(tok_info["eos_id"])
    corpora = {a.meta.get("source"): a for a in inputs if a.kind == "corpus"}
    missing = sorted(set(cfg.sources) - set(corpora))
    if missing:
        raise ValueError(f"held-out {cfg.domain}: no corpus for source(s) {', '.join(missing)}; have {sorted(corpora)}")
    per_source = cfg.max_tokens // len(cfg.sources)
    ids: list[int] = []
    counts = {}
    for name in cfg.sources:
        taken: list[int] = []
        for doc in read_shards(corpora[name].path / "heldout"):
            taken += [*tok.encode(doc["text"]).ids, eos]
            if len(taken) >= per_source:
                break
        taken = taken[:per_source]
        if not taken:
            raise ValueError(f"held-out {cfg.domain}: source {name!r} has an empty held-out split")
        counts[name] = len(taken)
        ids += taken
    np.save(out / "tokens.npy", np.asarray(ids, dtype=np.int64))
    log(f"held-out {cfg.domain}: {len(ids)} tokens from {counts}")
    return {"domain": cfg.domain, "tokens": len(ids), "per_source": counts, "eos_id": eos,
            "file": str(out / "tokens.npy"), "tokenizer": tok_info["path"]}


@step("heldout_tokens", version=2, kind="shards", resource="data", isolate=True, retries=1)
def heldout_tokens(config: HeldoutConfig, inputs: Inputs, out: Path, *, log=print) -> dict[str, Any]:
    """The held-out tokens of one domain: the corpora of input `corpora`, tokenized with input
    `tokenizer` (the run's fertility decision or tokenizer)."""
    return build_heldout(config, (one(inputs, "tokenizer"), *many(inputs, "corpora")), out, log)


def heldout_loss(model, tokens, seq_len: int, batch: int, eos_id: int) -> tuple[float, float]:
    """Mean next-token cross-entropy over consecutive windows of `tokens`, with the trainer's
    intra-document masking (document ids restart after each EOS), and its standard error over
    the windows."""
    import torch
    import torch.nn.functional as F

    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n = (len(tokens) - 1) // seq_len
    if n == 0:
        raise ValueError(f"held-out set of {len(tokens)} tokens is shorter than one {seq_len}-token window")
    inputs = tokens[: n * seq_len].view(n, seq_len)  # (N, T)
    labels = tokens[1 : n * seq_len + 1].view(n, seq_len)  # (N, T)
    # A document ends after its EOS: the next token starts a new document id.
    ends = (inputs == eos_id).long()
    doc_ids = torch.cumsum(ends, dim=1) - ends  # (N, T)
    per_window = []
    with torch.no_grad():
        for i in range(0, n, batch):
            logits = model(inputs[i : i + batch], doc_ids[i : i + batch]).logits  # (b, T, V)
            ce = F.cross_entropy(logits.flatten(0, 1).float(), labels[i : i + batch].flatten(), reduction="none")
            per_window.append(ce.view(-1, seq_len).mean(dim=1))  # (b,)
    losses = torch.cat(per_window)  # (N,)
    stderr = float(losses.std() / math.sqrt(n)) if n > 1 else 0.0
    return float(losses.mean()), stderr


class HeldoutEval(BaseModel):
    """Held-out loss of one checkpoint on each held-out set."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch: int = Field(default=8, gt=0)  # sequences per forward pass


def build_heldout_eval(cfg: HeldoutEval, inputs: Sequence[Artifact], out: Path, log=print) -> dict[str, Any]:
    """Scores in the eval artifacts' shape: {heldout_<set>: {loss, loss_stderr}}."""
    import numpy as np

    from model.checkpoint import load_model
    from model.spec import TrainSpec

    ckpt = next(a for a in inputs if a.kind == "checkpoint")
    seq_len = int(TrainSpec.load(ckpt.path / "spec.json").seq_len or 0)
    model = load_model(ckpt.meta["checkpoint"])
    scores = {}
    for held in (a for a in inputs if a.kind == "shards"):
        mean, se = heldout_loss(model, np.load(held.meta["file"]), seq_len, cfg.batch, int(held.meta["eos_id"]))
        scores[f"heldout_{held.meta['domain']}"] = {"loss": mean, "loss_stderr": se}
        log(f"{ckpt.meta.get('stage')}: held-out {held.meta['domain']} loss {mean:.4f} +- {se:.4f}")
    return {"stage": ckpt.meta.get("stage"), "scores": scores}


@step("heldout_eval", version=2, kind="eval", resource="eval", isolate=True)
def heldout_eval(config: HeldoutEval, inputs: Inputs, out: Path, *, log=print) -> dict[str, Any]:
    """Held-out loss of a stage's checkpoint (input `checkpoint`) on each set of input `heldout`."""
    return build_heldout_eval(config, (one(inputs, "checkpoint"), *many(inputs, "heldout")), out, log)
