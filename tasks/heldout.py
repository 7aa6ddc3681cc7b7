"""Held-out loss and bits per byte: the held-out split of a set of sources, tokenized with the
run's tokenizer, and how well a checkpoint predicts it.

Loss on text the model never trained on is the most sensitive signal a small run has: cloze
accuracy of a barely trained model often does not move at all between two short anneals, while
the held-out loss of each domain does, with a standard error over its windows. The CPT monitor
tracks it on the general and the new domain; anneals and ablations compare it per source.

Bits per byte (BPB) is the tokenizer-independent form: total nats over the text's tokens / ln 2 /
the UTF-8 bytes of that text, so a variant with another tokenizer (or vocabulary) is compared on
the same footing. `heldout_tokens` records how many bytes of text each token covers (from the
tokenizer's character offsets: every byte of a document is counted exactly once, a character
split over several byte-level tokens goes to the first); the end-of-document token covers none
and its loss is left out of BPB (it is not text). A model guessing uniformly over its vocabulary
scores log2(V) x text tokens / bytes: the `random` BPB the quality criteria measure against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline.artifact import Artifact
from pipeline.step import step


class HeldoutSpec(BaseModel):
    """Held-out tokens of one domain (a set of sources)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    domain: str  # "general" or "domain"
    sources: tuple[str, ...] = Field(min_length=1)  # recipe source names
    max_tokens: int = Field(gt=0)  # cap, split evenly over the sources


def token_bytes(text: str, offsets: Sequence[tuple[int, int]]) -> list[int]:
    """UTF-8 bytes of `text` each token covers, from its (start, end) character offsets: the
    characters up to a token's end not yet given to an earlier token (text a normaliser skipped
    goes to the next token, a trailing rest to the last), so the counts sum to the text's bytes."""
    if text and not offsets:
        raise ValueError("token_bytes: a non-empty text produced no tokens")
    counts, done = [], 0
    for _, end in offsets:
        end = max(end, done)
        counts.append(len(text[done:end].encode("utf-8")))
        done = end
    if counts:
        counts[-1] += len(text[done:].encode("utf-8"))
    return counts


@step("heldout_tokens", version=3, kind="shards", resource="data", isolate=True, retries=1)
def heldout_tokens(
    config: HeldoutSpec, tokenizer: Artifact, corpora: tuple[Artifact, ...], *, out: Path, log=print
) -> dict[str, Any]:
    """The held-out tokens of one domain: the held-out split of each of its sources (`corpora`)
    tokenized with `tokenizer` (the run's fertility decision or tokenizer), EOS after each
    document, with the bytes of text each token covers."""
    import numpy as np
    from tokenizers import Tokenizer

    from curation.bpe import selected_tokenizer
    from curation.source_kinds import read_shards

    tok_info = selected_tokenizer(tokenizer)
    tok = Tokenizer.from_file(tok_info["path"])
    eos = int(tok_info["eos_id"])
    by_source = {a.meta.get("source"): a for a in corpora}
    missing = sorted(set(config.sources) - set(by_source))
    if missing:
        raise ValueError(
            f"held-out {config.domain}: no corpus for source(s) {', '.join(missing)}; have {sorted(by_source)}"
        )
    per_source = config.max_tokens // len(config.sources)
    ids: list[int] = []
    nbytes: list[int] = []
    counts = {}
    for name in config.sources:
        taken: list[int] = []
        covered: list[int] = []
        for doc in read_shards(by_source[name].path / "heldout"):
            enc = tok.encode(doc["text"])
            taken += [*enc.ids, eos]
            covered += [*token_bytes(doc["text"], enc.offsets), 0]  # EOS covers no text
            if len(taken) >= per_source:
                break
        taken, covered = taken[:per_source], covered[:per_source]
        if not taken:
            raise ValueError(f"held-out {config.domain}: source {name!r} has an empty held-out split")
        counts[name] = len(taken)
        ids += taken
        nbytes += covered
    np.save(out / "tokens.npy", np.asarray(ids, dtype=np.int64))
    np.save(out / "bytes.npy", np.asarray(nbytes, dtype=np.int32))
    log(f"held-out {config.domain}: {len(ids)} tokens, {sum(nbytes)} bytes of text from {counts}")
    return {
        "domain": config.domain,
        "tokens": len(ids),
        "bytes": sum(nbytes),
        "per_source": counts,
        "eos_id": eos,
        "file": str(out / "tokens.npy"),
        "bytes_file": str(out / "bytes.npy"),
        "tokenizer": tok_info["path"],
    }


def token_losses(model, tokens, seq_len: int, batch: int, eos_id: int):
    """Next-token cross-entropy of every target in consecutive windows of `tokens`, with the
    trainer's intra-document masking (document ids restart after each EOS, so each held-out
    document is scored on its own), and the targets: two (N, T) tensors. Every token but the
    first is a target once; the tail that does not fill a window is left out."""
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
    losses = []
    with torch.no_grad():
        for i in range(0, n, batch):
            logits = model(inputs[i : i + batch], doc_ids[i : i + batch]).logits  # (b, T, V)
            ce = F.cross_entropy(logits.flatten(0, 1).float(), labels[i : i + batch].flatten(), reduction="none")
            losses.append(ce.view(-1, seq_len))  # (b, T)
    return torch.cat(losses), labels


def heldout_loss(model, tokens, seq_len: int, batch: int, eos_id: int) -> tuple[float, float]:
    """Mean next-token cross-entropy over consecutive windows of `tokens` (`token_losses`), and
    its standard error over the windows."""
    ce, _ = token_losses(model, tokens, seq_len, batch, eos_id)
    per_window = ce.mean(dim=1)  # (N,)
    n = len(per_window)
    stderr = float(per_window.std() / math.sqrt(n)) if n > 1 else 0.0
    return float(per_window.mean()), stderr


def heldout_scores(model, tokens, nbytes, seq_len: int, batch: int, eos_id: int) -> dict[str, float]:
    """Loss and bits per byte of `model` on one held-out set, each with its standard error over
    the windows (BPB's by the delta method for a ratio of sums), and the BPB of uniform guessing.

    nbytes: UTF-8 bytes of text each token covers (aligned with `tokens`; 0 for EOS)."""
    import torch

    ce, labels = token_losses(model, tokens, seq_len, batch, eos_id)
    n, t = ce.shape
    covered = torch.as_tensor(nbytes, dtype=torch.float64)[1 : n * t + 1].view(n, t)  # bytes of each target
    text = labels != eos_id  # EOS is not text: its loss is not in BPB
    bits = (ce.double() * text).sum(dim=1) / math.log(2)  # (N,) bits of text per window
    size = covered.sum(dim=1)  # (N,) bytes per window
    if float(size.sum()) <= 0:
        raise ValueError("held-out set covers no bytes of text (only end-of-document tokens)")
    bpb = float(bits.sum() / size.sum())
    se_bpb = float(((bits - bpb * size).pow(2).sum() / (n * (n - 1))).sqrt() / size.mean()) if n > 1 else 0.0
    per_window = ce.mean(dim=1)
    vocab = model.config.vocab_size
    return {
        "loss": float(per_window.mean()),
        "loss_stderr": float(per_window.std() / math.sqrt(n)) if n > 1 else 0.0,
        "bpb": bpb,
        "bpb_stderr": se_bpb,
        "random_bpb": math.log2(vocab) * float(text.sum()) / float(size.sum()),
        "random_loss": math.log(vocab),
    }


class HeldoutEvalSpec(BaseModel):
    """Held-out loss and BPB of a stage's checkpoint(s) on each held-out set."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch: int = Field(default=8, gt=0)  # sequences per forward pass
    # Every complete checkpoint the stage kept (its `keep_every` ones), not only the last: the
    # points an experiment's quality criteria (monotonicity, ordering) are measured on.
    every_checkpoint: bool = False


@step("heldout_eval", version=3, kind="eval", resource="eval", isolate=True)
def heldout_eval(
    config: HeldoutEvalSpec, checkpoint: Artifact, heldout: tuple[Artifact, ...], *, out: Path, log=print
) -> dict[str, Any]:
    """Held-out loss and BPB of a stage's `checkpoint` on each set of `heldout`: scores in the
    eval artifacts' shape, {heldout_<set>: {loss, loss_stderr, bpb, bpb_stderr}}, of the stage's
    last checkpoint; `points` holds them per evaluated checkpoint with its step and global step
    (the position in the run's schedule), and `random` the uniform guesser's."""
    import numpy as np

    from model.checkpoint import Checkpointer, load_model, read_marker, read_trainer_state
    from model.spec import TrainSpec
    from model.token_shards import MixturePlan

    spec = TrainSpec.load(checkpoint.path / "spec.json")
    seq_len = int(spec.seq_len or MixturePlan.load(spec.mixture_plan).seq_len)  # the trained length
    final = Path(checkpoint.meta["checkpoint"])
    folders = [final]
    if config.every_checkpoint:
        folders = [
            f for f in Checkpointer(checkpoint.path / "checkpoints").step_folders() if read_marker(f) is not None
        ]
        if final not in folders:
            raise ValueError(
                f"{checkpoint.meta.get('stage')}: the stage's last checkpoint {final} is not among "
                f"the complete checkpoints of {checkpoint.path / 'checkpoints'}"
            )
    held = [(a, np.load(a.meta["file"]), np.load(a.meta["bytes_file"])) for a in heldout]
    points, random = [], {}
    for folder in folders:
        model = load_model(folder).eval()
        state = read_trainer_state(folder)
        scores = {}
        for a, tokens, nbytes in held:
            s = heldout_scores(model, tokens, nbytes, seq_len, config.batch, int(a.meta["eos_id"]))
            task = f"heldout_{a.meta['domain']}"
            random[task] = {"bpb": s.pop("random_bpb"), "loss": s.pop("random_loss")}
            scores[task] = s
        points.append({"step": int(state["step"]), "global_step": int(state["global_step"]), "scores": scores})
        log(
            f"{checkpoint.meta.get('stage')} step {state['step']}: held-out "
            + ", ".join(f"{t[8:]} {s['bpb']:.4f} bpb ({s['loss']:.4f} nats/token)" for t, s in scores.items())
        )
    return {"stage": checkpoint.meta.get("stage"), "scores": points[-1]["scores"], "points": points, "random": random}
