"""Held-out leakage, checked from outside: every held-out document against every curated train
document of a workspace, with none of the curation code.

    python benchmarks/heldout_leakage.py WORKSPACE [--threshold 0.5] [--ngram 8]

Reads the gzip JSONL shards directly: held-out documents as the sources wrote them
(`source/*/heldout/`) and as curation kept them (`curate/*/heldout/`, what the eval suite and
held-out loss read), and curated train (`curate/*/train/`). Prints, against the baseline of
"no copy at all" (0):

- train documents identical to a held-out document;
- the worst pair overlap: shared word 8-grams over the smaller document's, both documents with at
  least 50 8-grams (the curation rule's measure), and every pair at or above `--threshold`;
- pooled overlap: held-out documents with half their 8-grams anywhere in train (several train
  documents together; not a copy, shown for context).

Exit status 1 when a pair reaches the threshold or a document is identical. Words are `\\w+`
runs, lowercased, as in the curation rule; a finished workspace of any run of the pipeline works.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import Counter
from pathlib import Path

WORD = re.compile(r"\w+")


def documents(root: Path, pattern: str) -> list[tuple[str, str]]:
    out = []
    for shard in sorted(root.glob(pattern)):
        with gzip.open(shard, "rt", encoding="utf-8") as fh:
            for line in fh:
                doc = json.loads(line)
                out.append((f"{shard.parts[-4]}/{shard.parts[-3][:12]}:{doc.get('id')}", doc["text"]))
    return out


def grams(text: str, n: int) -> set[str]:
    words = WORD.findall(text.lower())
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workspace", type=Path)
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--ngram", type=int, default=8)
    parser.add_argument("--min-ngrams", type=int, default=50)
    args = parser.parse_args(argv)
    ws = args.workspace
    held = documents(ws, "source/*/heldout/*.jsonl.gz") + documents(ws, "curate/*/heldout/*.jsonl.gz")
    train = documents(ws, "curate/*/train/*.jsonl.gz")
    if not held or not train:
        raise SystemExit(f"no held-out or curated train shards under {ws}")
    texts = {t.strip() for _, t in held}
    identical = [name for name, t in train if t.strip() in texts]
    train_grams = [grams(t, args.ngram) for _, t in train]
    where: dict[str, list[int]] = {}
    for i, g in enumerate(train_grams):
        for x in g:
            where.setdefault(x, []).append(i)
    worst, pairs, pooled, measured = 0.0, [], 0, 0
    for name, text in held:
        g = grams(text, args.ngram)
        shared = Counter(i for x in g for i in where.get(x, ()))
        if len(g) >= args.min_ngrams:
            measured += 1
            pooled += sum(1 for x in g if x in where) >= 0.5 * len(g)
        for i, k in shared.items():
            small = min(len(g), len(train_grams[i]))
            if small < args.min_ngrams:
                continue
            share = k / small
            worst = max(worst, share)
            if share >= args.threshold:
                pairs.append((share, name, train[i][0]))
    print(f"{ws}: {len(held)} held-out documents (as written and as curated), {len(train)} curated train documents")
    print(f"identical to a held-out document: {len(identical)} (baseline 0) {identical[:5]}")
    print(
        f"worst pair overlap: {worst:.4f} (threshold {args.threshold}); pairs at or above it: {len(pairs)} (baseline 0)"
    )
    for share, h, t in sorted(pairs, reverse=True)[:10]:
        print(f"  {share:.3f}  held-out {h}  <->  train {t}")
    print(f"pooled: {pooled} of {measured} held-out documents have half their {args.ngram}-grams somewhere in train")
    return 1 if pairs or identical else 0


if __name__ == "__main__":
    sys.exit(main())
