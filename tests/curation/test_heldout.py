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


# --- the index built by datatrove tasks (curation/heldout.py index_stages) ----------------------

DOC_PAGE = (
    "Install the [package](https://example.org/pkg) with `pip install thing` and read the guide "
    "before you configure the service for the first time on a new machine.\n\n"
    "```\nthing --init --verbose\n```\n\n"
    "The service reads its settings from the file that the installer writes into your home folder "
    "and keeps them there until you change them by hand or run the installer again."
)


def _held_corpora(root):
    """Three sources' held-out splits: `a` in two shards, `docs` (a preset that rewrites text to
    prose: both forms indexed), `c` with a document too short for an n-gram and a repeated text."""
    from tests.tasks.datafiles import doc_line, write_lines

    rng = random.Random(5)
    a = [(f"a{i}", random_text(rng, 120)) for i in range(7)]
    c = [("short", "too short to hold an n-gram"), ("c1", random_text(rng, 90)), ("c2", a[2][1])]
    layout = {"a": [a[:4], a[4:]], "docs": [[("page", DOC_PAGE), ("d1", random_text(rng, 80))]], "c": [c]}
    for source, shards in layout.items():
        for k, docs in enumerate(shards):
            write_lines(root / source / "heldout" / f"{k:05d}.jsonl.gz", [doc_line(i, t, source) for i, t in docs])
    return [root / s for s in layout], [t for shards in layout.values() for docs in shards for _, t in docs]


def _old_documents(folders):
    """(source/id, text) as the curate step fed `HeldoutIndex.build` before the sharded build:
    every held-out document in folder and file order, and the prose form of a `docs` source's."""
    from curation.filters import prose_text
    from curation.source_kinds import read_shards

    for folder in folders:
        for doc in read_shards(folder / "heldout"):
            yield f"{folder.name}/{doc['id']}", doc["text"]
            kept = prose_text(doc["text"]) if folder.name == "docs" else ""
            if kept and kept != doc["text"]:
                yield f"{folder.name}/{doc['id']}", kept


def _files(folders):
    from curation.heldout import HeldoutFile

    return tuple(
        HeldoutFile(str(p), f.name, f.name == "docs") for f in folders for p in sorted((f / "heldout").iterdir())
    )


def _run(plan, logs):
    from curation.executors import make_executors, run_executors
    from curation.heldout import index_stages
    from tasks.curate import CurationConfig

    config = CurationConfig(workers=1)
    run_executors(config, make_executors(config, index_stages(plan), logs), logs, lambda _: None)


def test_the_index_built_by_tasks_is_the_one_built_in_one_process(tmp_path):
    import numpy as np

    from curation.heldout import HeldoutIndex, IndexPlan

    folders, texts = _held_corpora(tmp_path / "src")
    old = HeldoutIndex.build(_old_documents(folders), 8)
    assert len(old) == 13 and old.ids.count("docs/page") == 2  # the page and its prose form
    # 3 shard tasks over 4 files, 4 partitions, chunks of 100 pairs: every path of the build taken
    plan = IndexPlan(_files(folders), tmp_path / "idx", 8, partitions=4, shards=3, flush_ngrams=100)
    _run(plan, tmp_path / "logs")
    assert len(list((plan.folder / "shards" / "00000").glob("g00000-*.npy"))) > 1  # flushed in chunks
    built = HeldoutIndex.load(plan.index)
    assert isinstance(built.grams, np.memmap)  # mapped, not read into the task
    assert built.ids == old.ids and built.ngram == 8
    for name in ("grams", "owners", "exact", "sizes"):
        got, want = getattr(built, name), getattr(old, name)
        assert got.dtype == want.dtype and np.array_equal(got, want), name
    assert built.header() == old.header() == HeldoutIndex.read_header(plan.index)
    rng = random.Random(9)
    words = texts[5].split()
    queries = [*texts, " ".join(words[: len(words) // 2]), texts[1] + " " + random_text(rng, 300), random_text(rng)]
    queries.append("Install the package with and read the guide before you configure the service for the first")
    assert [built.match(q, 50) for q in queries] == [old.match(q, 50) for q in queries]
    # the other order of documents gives other owners: the comparison above can fail
    assert not np.array_equal(HeldoutIndex.build(reversed(list(_old_documents(folders))), 8).owners, old.owners)


def test_a_build_task_that_dies_leaves_nothing_a_later_run_takes_as_finished(tmp_path):
    import gzip

    import numpy as np
    import pytest

    from curation.heldout import HeldoutIndex, HeldoutIndexMerge, IndexPlan

    folders, _ = _held_corpora(tmp_path / "src")
    files = _files(folders)
    broken = folders[2] / "heldout" / "00000.jsonl.gz"  # `c`: the last file, rank 1's
    whole = broken.read_bytes()
    lines = gzip.decompress(whole)
    broken.write_bytes(gzip.compress(lines)[:-12])  # its end cut off: the reader dies after its first lines
    assert len(gzip.compress(lines)) > 12
    plan = IndexPlan(files, tmp_path / "idx", 8, partitions=2, shards=2, flush_ngrams=50)
    logs = tmp_path / "logs"
    with pytest.raises(EOFError):  # gzip: the stream ended before its end marker
        _run(plan, logs)
    shards = plan.folder / "shards"
    assert (logs / "index_shards" / "completions" / "00000").is_file()
    assert not (logs / "index_shards" / "completions" / "00001").exists()
    assert list((shards / "00001.tmp").glob("g*.npy"))  # it died mid-build, chunks written
    assert not (shards / "00001").exists() and not (plan.folder / "parts").exists()
    with pytest.raises(FileNotFoundError, match="shard 1 of 2"):  # a merge would refuse the half shard
        HeldoutIndexMerge(str(plan.folder), 2).run(None, 0, 2)
    with pytest.raises(FileNotFoundError, match="no index.json"):
        HeldoutIndex.load(plan.index)
    # the file repaired, the same stages again: rank 0 is skipped, rank 1 redone, the index whole
    done = (shards / "00000" / "shard.json").stat().st_mtime_ns
    broken.write_bytes(whole)
    _run(plan, logs)
    assert (shards / "00000" / "shard.json").stat().st_mtime_ns == done
    assert not (shards / "00001.tmp").exists()
    old = HeldoutIndex.build(_old_documents(folders), 8)
    built = HeldoutIndex.load(plan.index)
    assert built.ids == old.ids
    assert all(np.array_equal(getattr(built, n), getattr(old, n)) for n in ("grams", "owners", "exact", "sizes"))
