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

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from evals.heldout_loss import heldout_scores, token_bytes
from pipeline.artifact import Artifact
from pipeline.step import step


class HeldoutSpec(BaseModel):
    """Held-out tokens of one domain (a set of sources)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    domain: str  # "general" or "domain"
    sources: tuple[str, ...] = Field(min_length=1)  # recipe source names
    max_tokens: int = Field(gt=0)  # cap, split evenly over the sources


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
