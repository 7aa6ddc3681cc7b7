"""Held-out decontamination (curation/heldout.py): the overlap rules of the held-out index."""

from __future__ import annotations

import json
import random
import subprocess
import sys

from curation.heldout import HeldoutIndex, word_ngrams
from tests.tasks.datafiles import random_text


def test_heldout_index_overlap_rules():
    rng = random.Random(3)
    held = [("h/long", random_text(rng, 300)), ("h/short", "Copyright the authors. All rights reserved by them here.")]
    index = HeldoutIndex.build(held, 8)
    assert index.match("  " + held[0][1] + "\n", 50)[0] == "exact"  # surrounding whitespace only
    unrelated = random_text(rng, 300)
    assert index.match(unrelated, 50)[1] == 0.0
    half = " ".join(held[0][1].split()[:150])  # half of the long one: all of its n-grams are held-out
    assert index.match(half, 50)[1:] == (1.0, "h/long")
    # A long text quoting the short held-out document: the short one counts as 50 n-grams, so
    # quoting it (3 shared n-grams) is not a copy; a text that is mostly it is.
    reason, score, _ = index.match(unrelated + " " + held[1][1], 50)
    assert reason is None and score < 0.1
    assert index.match(held[1][1] + " Yes.", 50)[1] > 0.5
    # hashes are the same in every process (datatrove workers load the parent's index)
    script = "from curation.heldout import word_ngrams; print(word_ngrams('a b c d e f g h i', 8).tolist())"
    other = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, "PYTHONHASHSEED": "123"},
    )
    assert json.loads(other.stdout) == word_ngrams("a b c d e f g h i", 8).tolist()


def test_the_index_reports_its_memory_now_and_at_the_sources_caps():
    from curation.heldout import HeldoutIndex

    docs = [(f"s/{i}", " ".join(f"word{i}x{j}" for j in range(40))) for i in range(10)]
    index = HeldoutIndex.build(docs, 8)
    report = index.report([2000, 2000, 2000])
    arrays = index.exact.nbytes + index.grams.nbytes + index.owners.nbytes + index.sizes.nbytes
    assert report["documents"] == 10 and report["ngrams"] == 10 * 33
    assert report["bytes"] == arrays + sum(50 + len(i) for i, _ in docs)
    assert report["documents_at_cap"] == 6000
    assert report["bytes_at_cap"] == round(report["bytes"] / 10 * 6000)
    assert index.report([2000, None])["bytes_at_cap"] is None  # a source without a cap: no bound
