"""How well a model predicts held-out text: next-token loss and bits per byte, each with its
standard error over the windows (the held-out steps, tasks/heldout.py, and CPT's monitor use them).

Bits per byte (BPB) is the tokenizer-independent form: total nats over the text's tokens / ln 2 /
the UTF-8 bytes of that text. `token_bytes` gives the bytes of text each token covers (from the
tokenizer's character offsets: every byte of a document is counted exactly once, a character
split over several byte-level tokens goes to the first); the end-of-document token covers none
and its loss is left out of BPB (it is not text). A model guessing uniformly over its vocabulary
scores log2(V) x text tokens / bytes: the `random` BPB the quality criteria measure against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


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
