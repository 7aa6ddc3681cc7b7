"""Tokenizer fertility: the measures that compare candidate tokenizers on text, and the choice rule.

Definitions (the Smol Training Playbook's, lower is better for the first two):
- fertility: tokens per word (words are whitespace-separated strings);
- continued words: share of words split into 2+ tokens (a token counts for every word its
  character span overlaps, so context-dependent merges are measured as they happen in text);
- bytes per token: UTF-8 bytes of the text over its tokens (compression);
- vocabulary used: share of the candidate's vocabulary that appears in the text.

The rule `lowest_weighted_fertility` picks the lowest mean fertility over sources weighted by
mixture weights, unless the recipe fixes the choice. The step is tasks/fertility.py.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.artifact import Artifact

TRAINED = "trained"
_WORD = re.compile(r"\S+")
# EOS spellings of common tokenizers, looked up when a candidate has no tokenizer_config.json
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


def load_candidate(name: str, trained: Path | None = None):
    """A `tokenizers.Tokenizer` and the path datatrove can load it from (file or hub name)."""
    from tokenizers import Tokenizer

    if name == TRAINED:
        if trained is None:
            raise ValueError("fertility: candidate 'trained' needs the tokenizer artifact as input")
        return Tokenizer.from_file(str(trained / "tokenizer.json")), str(trained / "tokenizer.json")
    p = Path(name).expanduser()
    if p.is_dir() and (p / "tokenizer.json").is_file():
        p = p / "tokenizer.json"
    if p.is_file():
        return Tokenizer.from_file(str(p)), str(p.resolve())
    if p.suffix == ".json" or name.startswith((".", "/", "~")):
        raise FileNotFoundError(f"fertility candidate {name!r}: no such tokenizer file")
    try:
        # through huggingface_hub: it uses the saved token (gated models) and the local cache, and
        # hands datatrove a file path its workers can read without the hub
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(name, "tokenizer.json")
        try:
            hf_hub_download(name, "tokenizer_config.json")  # beside it: find_eos reads eos_token
        except Exception:
            pass
        return Tokenizer.from_file(path), path
    except Exception as exc:  # the hub raises many types; the message is what the user needs
        raise RuntimeError(
            f"fertility candidate {name!r}: cannot load it from the Hugging Face hub ({exc}); "
            "it needs network access (and a token for gated models), or give a local "
            "tokenizer.json path instead"
        ) from None


def find_eos(tok, path: str) -> tuple[str, int]:
    """The EOS token of a candidate: its tokenizer_config.json if present, else a known name."""
    config = Path(path).parent / "tokenizer_config.json"
    if Path(path).is_file() and config.is_file():
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and tok.token_to_id(eos) is not None:
            return eos, tok.token_to_id(eos)
    for name in _EOS_NAMES:
        if tok.token_to_id(name) is not None:
            return name, tok.token_to_id(name)
    raise ValueError(
        f"tokenizer {path}: no EOS token found (looked for {', '.join(_EOS_NAMES)}); add a "
        "tokenizer_config.json with eos_token beside it"
    )


def split_texts(corpus: Artifact, split: str, max_chars: int) -> list[str]:
    """Documents of one split of a corpus, up to `max_chars` characters."""
    texts: list[str] = []
    used = 0
    for path in sorted((corpus.path / split).glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                text = json.loads(line)["text"][: max_chars - used]
                texts.append(text)
                used += len(text)
                if used >= max_chars:
                    return texts
    return texts


def heldout_texts(corpus: Artifact, max_chars: int) -> list[str]:
    """The held-out documents of a corpus, up to `max_chars` characters."""
    return split_texts(corpus, "heldout", max_chars)


def measured_texts(corpus: Artifact, max_chars: int) -> tuple[str, list[str]]:
    """What fertility is measured on for one source, and its texts: the held-out split (curated
    when the corpus says so), else a sample of the curated train split."""
    curated = bool(corpus.meta.get("heldout_curated"))
    texts = heldout_texts(corpus, max_chars)
    if texts:
        return ("curated held-out" if curated else "uncurated held-out"), texts
    if curated:
        return "curated train sample", split_texts(corpus, "train", max_chars)
    return "uncurated held-out", []


def measure(tok, texts: Sequence[str]) -> dict[str, float]:
    """Fertility, continued-word share, bytes per token and vocabulary share on `texts`."""
    words = tokens = continued = nbytes = 0
    used: set[int] = set()
    encodings = tok.encode_batch(list(texts), add_special_tokens=False)
    for text, enc in zip(texts, encodings, strict=True):
        tokens += len(enc.ids)
        used.update(enc.ids)
        nbytes += len(text.encode("utf-8"))
        offsets = enc.offsets
        t = 0
        for match in _WORD.finditer(text):
            start, end = match.span()
            words += 1
            while t < len(offsets) and offsets[t][1] <= start:
                t += 1
            k, n = t, 0
            while k < len(offsets) and offsets[k][0] < end:
                if offsets[k][1] > start:
                    n += 1
                k += 1
            if n >= 2:
                continued += 1
    return {
        "words": words,
        "tokens": tokens,
        "fertility": tokens / words if words else float("nan"),
        "continued_words": continued / words if words else float("nan"),
        "bytes_per_token": nbytes / tokens if tokens else float("nan"),
        "vocab_used": len(used) / tok.get_vocab_size(),
    }


def decide(rows: list[dict[str, Any]], choose: str | None, weights: Mapping[str, float]) -> dict[str, Any]:
    """Which candidate to use, and why: `choose` (the recipe's `fertility.choose`) when set, else
    the rule's scores."""
    names = list(dict.fromkeys(r["tokenizer"] for r in rows))
    sources = list(dict.fromkeys(r["source"] for r in rows))
    w = {s: float(weights.get(s, 0.0)) for s in sources}
    if sum(w.values()) <= 0:
        w = {s: 1.0 for s in sources}  # no mixture weights for these sources: equal weights
    total = sum(w.values())
    scores = {n: sum(r["fertility"] * w[r["source"]] for r in rows if r["tokenizer"] == n) / total for n in names}
    if choose is not None:
        if choose not in names:
            raise ValueError(f"fertility.choose {choose!r} is not a candidate; candidates: {', '.join(names)}")
        return {
            "selected": choose,
            "reason": f"fixed by the recipe (fertility.choose); weighted fertility {scores[choose]:.3f}",
            "scores": scores,
        }
    best = min(names, key=lambda n: (scores[n], n != TRAINED))
    ranked = ", ".join(f"{n}={scores[n]:.3f}" for n in sorted(names, key=scores.get))
    return {
        "selected": best,
        "reason": f"lowest mean fertility weighted by mixture weight ({ranked})",
        "scores": scores,
        "weights": {s: w[s] / total for s in sources},
    }


def write_chart(rows: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars: fertility and continued-word share per source, one bar per tokenizer."""
    import matplotlib

    matplotlib.use("Agg")  # no display in workers or CI
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["tokenizer"] for r in rows))
    sources = list(dict.fromkeys(r["source"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(len(names), 1)
    for ax, metric, title in (
        (axes[0], "fertility", "fertility (tokens per word)"),
        (axes[1], "continued_words", "continued words (share)"),
    ):
        for i, name in enumerate(names):
            values = [next(r[metric] for r in rows if r["tokenizer"] == name and r["source"] == s) for s in sources]
            ax.bar([x + i * width for x in range(len(sources))], values, width, label=name[-30:])
        ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(sources))], sources)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown_table(rows: list[dict[str, Any]], decision: dict[str, Any]) -> str:
    """The report's table, one row per tokenizer and source, and the decision below it."""
    head = "| tokenizer | source | text | fertility | continued words | bytes/token | vocab used |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['tokenizer']} | {r['source']} | {r['text']} | {r['fertility']:.3f} | "
            f"{r['continued_words']:.3f} | {r['bytes_per_token']:.2f} | {r['vocab_used']:.3f} |"
        )
    lines += ["", f"Selected: **{decision['selected']}**: {decision['reason']}."]
    return "\n".join(lines)
