"""Helpers for the data-step tests: tiny corpus artifacts written straight into tmp_path."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

from pipeline.artifact import Artifact

WORDS = (
    "river stone garden window market engine silver forest bridge candle harbor meadow "
    "lantern pocket thunder valley copper island mirror orchard pepper rocket saddle tunnel "
    "velvet whistle yellow zebra anchor basket cactus dragon feather glacier hammer igloo "
    "jacket kettle ladder magnet needle oyster parrot quartz ribbon sponge tiger umbrella"
).split()

# English prose that FineWeb's web filters keep (one topic per paragraph).
PARAGRAPHS = [
    "The committee met on Tuesday to discuss the new library. Members agreed that the reading "
    "room needs more light and that the children's section should open earlier in the day. "
    "After a short debate, they voted to extend the opening hours during the summer months, "
    "when students have more time to read. The treasurer explained how the budget would cover "
    "the extra staff, and the chair thanked the volunteers who had repainted the entrance.",
    "Our garden changed slowly over the spring. The tulips came first, followed by a wave of "
    "bluebells under the old apple tree. We planted beans along the fence and watered them "
    "every evening, hoping the dry weather would break. By June the tomatoes were climbing "
    "their stakes, and the neighbours' cat had claimed the warm stones beside the pond as "
    "its favourite place to sleep through the long afternoons.",
    "Bread needs only flour, water, salt and yeast, yet the results vary widely. A wetter "
    "dough gives a more open crumb, while a long cold rise develops a deeper flavour. Bakers "
    "often fold the dough several times during the first hours instead of kneading it hard. "
    "Before baking, the loaf is scored with a sharp blade so that it can expand evenly in the "
    "oven, and a little steam helps the crust turn golden and crisp.",
]


def random_text(rng: random.Random, words: int = 200) -> str:
    """Sentences of random words: unique per seed, no near duplicates between seeds."""
    out, sentence = [], []
    for _ in range(words):
        sentence.append(rng.choice(WORDS))
        if len(sentence) >= rng.randint(8, 14):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    if sentence:
        out.append(" ".join(sentence).capitalize() + ".")
    return " ".join(out)


def write_lines(path: Path, lines: list[bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wb") as fh:
        for line in lines:
            fh.write(line.rstrip(b"\n") + b"\n")


def doc_line(doc_id: str, text: str, source: str = "toy") -> bytes:
    return json.dumps({"id": doc_id, "text": text, "metadata": {"source": source}}).encode()


def corpus(
    root: Path,
    train: list[tuple[str, str]] | list[bytes],
    heldout: list[tuple[str, str]] = (),
    source: str = "toy",
    domain: str = "web",
    shards: int = 1,
) -> Artifact:
    """A corpus artifact folder (train/ and heldout/ gzip JSONL shards) and its Artifact."""
    lines = [doc_line(x[0], x[1], source) if isinstance(x, tuple) else x for x in train]
    per = max(1, -(-len(lines) // shards))
    for k in range(shards):
        write_lines(root / "train" / f"{k:05d}.jsonl.gz", lines[k * per : (k + 1) * per])
    write_lines(root / "heldout" / "00000.jsonl.gz", [doc_line(i, t, source) for i, t in heldout])
    meta = {
        "source": source,
        "domain": domain,
        "format": "jsonl",
        "documents": len(lines),
        "heldout_documents": len(heldout),
    }
    return Artifact(kind="corpus", uri=str(root), fingerprint=hashlib.sha256(str(root).encode()).hexdigest(), meta=meta)
