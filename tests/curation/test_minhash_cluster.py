"""The bounded-memory MinHash cluster stage (curation/minhash_cluster.py) against datatrove's
`MinhashDedupCluster`: the same `.remove` files, byte for byte, and the same stats, on random
pair files (clusters chained across bands, ties, an index's sentinel document, chunks smaller
than a file) and on a synthetic near-duplicate corpus run through datatrove's whole MinHash
pipeline (the same documents kept and removed)."""

from __future__ import annotations

import gzip
import json
import random
import struct
from pathlib import Path

import pytest
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup import (
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
    MinhashDedupSignature,
)
from datatrove.pipeline.dedup.minhash import SENTINEL, MinhashConfig
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.hashing import HashConfig

from curation.minhash_cluster import MinhashClusterArrays
from curation.stages import plan_stages
from tasks.curate import CurationConfig

BANDS = 14


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.exists() else {}


def _stats(step) -> dict[str, tuple]:
    return {k: (v.total, v.n, v.min, v.max, v.unit) for k, v in step.stats.stats.items()}


def _random_pairs(rng: random.Random, files: int, docs: int, pairs: int, sentinel: bool) -> list[list[tuple]]:
    """Pairs per band file: documents drawn from a few hundred (so clusters chain and merge
    across bands, with ties of equal sizes), both orders, some repeated; with `sentinel`, some
    pairs against an index (datatrove writes those as SENTINEL, SENTINEL, file, doc)."""
    pool = [(rng.randrange(files), rng.randrange(docs)) for _ in range(300)]
    bands = []
    for _ in range(BANDS):
        band = []
        for _ in range(rng.randrange(pairs)):
            a, b = rng.sample(pool, 2)
            if sentinel and rng.random() < 0.05:
                a = (SENTINEL, SENTINEL)
            band.append((*a, *b))
        bands.append(band)
    return bands


def _write_dups(folder: Path, bands: list[list[tuple]]) -> None:
    folder.mkdir(parents=True)
    for b, band in enumerate(bands):
        (folder / f"{b:05d}_00.dups").write_bytes(b"".join(struct.pack("<4I", *p) for p in band))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("chunk_pairs", [1, 7, 1 << 20])
def test_same_remove_files_and_stats_as_datatrove_on_random_pairs(tmp_path, seed, chunk_pairs):
    rng = random.Random(seed)
    _write_dups(tmp_path / "dups", _random_pairs(rng, files=5, docs=400, pairs=60, sentinel=seed % 2 == 1))
    theirs = MinhashDedupCluster(str(tmp_path / "dups"), str(tmp_path / "theirs"))
    mine = MinhashClusterArrays(str(tmp_path / "dups"), str(tmp_path / "mine"), chunk_pairs=chunk_pairs)
    theirs.run(None, 0, 1)
    mine.run(None, 0, 1)
    expected = _files(tmp_path / "theirs")
    assert expected  # the pairs removed something: the comparison is not of two empty folders
    assert _files(tmp_path / "mine") == expected
    assert _stats(mine) == _stats(theirs)
    assert mine.stats["cluster_size"].mean == pytest.approx(theirs.stats["cluster_size"].mean)
    assert mine.stats["cluster_size"].variance == pytest.approx(theirs.stats["cluster_size"].variance)


def test_the_kept_document_follows_the_union_order_not_the_smallest_id(tmp_path):
    """Which document of a cluster stays is datatrove's union-by-size with its tie rule: (0, 9)
    and (0, 5) first (a tie: 5 under 9), then (0, 1), the smaller cluster, under 9: the kept
    document is (0, 9), neither the smallest id nor the first of the last pair."""
    _write_dups(tmp_path / "dups", [[(0, 9, 0, 5), (0, 1, 0, 9)]] + [[] for _ in range(BANDS - 1)])
    MinhashDedupCluster(str(tmp_path / "dups"), str(tmp_path / "theirs")).run(None, 0, 1)
    MinhashClusterArrays(str(tmp_path / "dups"), str(tmp_path / "mine")).run(None, 0, 1)
    removed = struct.unpack("<2I", (tmp_path / "mine" / "000000.remove").read_bytes())
    assert removed == (1, 5)
    assert _files(tmp_path / "mine") == _files(tmp_path / "theirs")


def test_no_pairs_writes_nothing(tmp_path):
    _write_dups(tmp_path / "dups", [[] for _ in range(BANDS)])
    step = MinhashClusterArrays(str(tmp_path / "dups"), str(tmp_path / "mine"))
    step.run(None, 0, 1)
    assert _files(tmp_path / "mine") == {}


def test_a_truncated_pair_file_is_an_error(tmp_path):
    _write_dups(tmp_path / "dups", [[(0, 1, 0, 2)]] + [[] for _ in range(BANDS - 1)])
    with open(tmp_path / "dups" / "00000_00.dups", "ab") as fh:
        fh.write(b"\0" * 5)
    with pytest.raises(ValueError, match="5 bytes after the last whole pair"):
        MinhashClusterArrays(str(tmp_path / "dups"), str(tmp_path / "mine"), chunk_pairs=1).run(None, 0, 1)


# ---- a near-duplicate corpus through datatrove's whole MinHash pipeline ------------------------------

WORDS = "amber basil cedar delta ember fjord grove harbor iris jade kelp lumen maple north onyx pearl".split()


def _corpus(folder: Path, shards: int = 3) -> list[str]:
    """Documents of 80 random words; a third of them near duplicates (one to three words changed)
    of an earlier document or of an earlier near duplicate, so clusters chain over several
    documents in different shards."""
    rng = random.Random(7)
    texts: list[str] = []
    for i in range(240):
        if i > 10 and rng.random() < 0.35:
            words = texts[rng.randrange(i)].split()
            for _ in range(rng.randint(1, 3)):
                words[rng.randrange(len(words))] = rng.choice(WORDS)
            texts.append(" ".join(words))
        else:
            texts.append(" ".join(rng.choice(WORDS) + str(rng.randrange(50)) for _ in range(80)))
    folder.mkdir(parents=True)
    per = -(-len(texts) // shards)
    ids = []
    for s in range(shards):
        with gzip.open(folder / f"{s:05d}.jsonl.gz", "wt", encoding="utf-8") as fh:
            for i in range(s * per, min(len(texts), (s + 1) * per)):
                fh.write(json.dumps({"id": f"d{i}", "text": texts[i]}) + "\n")
                ids.append(f"d{i}")
    return ids


def _kept(folder: Path) -> list[str]:
    out = []
    for path in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            out += [json.loads(line)["id"] for line in fh]
    return out


def test_same_documents_kept_as_datatrove_on_a_near_duplicate_corpus(tmp_path):
    ids = _corpus(tmp_path / "in")
    cfg = MinhashConfig(hash_config=HashConfig(precision=64))  # curation's settings (curation/stages.py)
    work = tmp_path / "work"

    def run(steps, tasks, name):
        LocalPipelineExecutor(steps, tasks=tasks, workers=1, logging_dir=str(work / "logs" / name)).run()

    run([JsonlReader(str(tmp_path / "in")), MinhashDedupSignature(str(work / "sigs"), config=cfg)], 3, "sigs")
    run([MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=cfg)], BANDS, "buckets")
    clusters = {
        "theirs": MinhashDedupCluster(str(work / "buckets"), str(work / "remove-theirs"), config=cfg),
        "mine": MinhashClusterArrays(str(work / "buckets"), str(work / "remove-mine"), config=cfg, chunk_pairs=3),
    }
    kept = {}
    for name, cluster in clusters.items():
        run([cluster], 1, f"cluster-{name}")
        run(
            [
                JsonlReader(str(tmp_path / "in")),
                MinhashDedupFilter(str(work / f"remove-{name}")),
                JsonlWriter(str(tmp_path / f"out-{name}"), output_filename="${rank}.jsonl.gz"),
            ],
            3,
            f"filter-{name}",
        )
        kept[name] = _kept(tmp_path / f"out-{name}")
    assert _files(work / "remove-mine") == _files(work / "remove-theirs")
    assert kept["mine"] == kept["theirs"]
    assert 20 < len(ids) - len(kept["mine"]) < len(ids) // 2  # near duplicates found and removed, not everything
    # some cluster has more than two documents, so which one stays is a real choice
    stats = json.loads((work / "logs" / "cluster-mine" / "stats.json").read_text())
    assert stats[0]["stats"]["cluster_size"]["max"] > 2


def test_curation_plans_the_bounded_cluster_stage(tmp_path):
    stages = dict(
        (name, pipeline) for name, pipeline, _ in plan_stages(CurationConfig(), "none", tmp_path, tmp_path, 2)
    )
    assert [type(s) for s in stages["cluster"]] == [MinhashClusterArrays]


def _contents(folder: Path) -> dict[str, bytes]:
    """Each gzip shard of `folder`, decompressed (a gzip header carries the time it was written)."""
    return {p.name: gzip.decompress(p.read_bytes()) for p in sorted(folder.glob("*.jsonl.gz"))}


@pytest.mark.slow
def test_the_curate_step_writes_the_same_corpus_as_with_datatrove_cluster(tmp_path, monkeypatch):
    """The curate step (tasks/curate.py) on a corpus with chains of near duplicates over 3
    shards: its curated train and held-out shards, removed samples, filter rows and removal
    counts are the same with this cluster stage as with datatrove's `MinhashDedupCluster`
    planned in its place."""
    import curation.minhash_cluster as module
    from tasks.curate import curate
    from tests.tasks.datafiles import corpus, random_text

    rng = random.Random(3)
    train: list[tuple[str, str]] = []
    for i in range(60):
        if i > 5 and rng.random() < 0.4:  # two words changed in 200, of an earlier document or copy
            words = train[rng.randrange(i)][1].split(" ")
            for _ in range(2):
                words[rng.randrange(len(words))] = "zeppelin"
            train.append((f"near{i}", " ".join(words)))
        else:
            train.append((f"u{i}", random_text(rng)))
    held = [("h0", random_text(rng))]
    art = corpus(tmp_path / "in", train, heldout=held, source="toy", shards=3)
    # the tasks one after another in this process: the worker count is operational (the same
    # bytes, tests/tasks/test_curate_cores.py), and a pool per stage costs more than this corpus
    config = CurationConfig(presets={"toy": "none"}, tasks=3, workers=1)
    got = {}
    for name in ("theirs", "mine"):
        if name == "theirs":
            monkeypatch.setattr(module, "MinhashClusterArrays", MinhashDedupCluster)
        else:
            monkeypatch.undo()
        out = tmp_path / name
        out.mkdir()
        meta = curate(config, art, out=out, log=lambda _: None)
        got[name] = {
            "train": _contents(out / "train"),
            "heldout": _contents(out / "heldout"),
            "removed": {p.parent.name: gzip.decompress(p.read_bytes()) for p in (out / "removed").rglob("*.gz")},
            "rows": (out / "filter_stats.json").read_text(),
            "meta": {k: v for k, v in meta.items() if k != "seconds"},
        }
        stats = json.loads((out / "logs" / "cluster" / "stats.json").read_text())
        got[name]["cluster"] = stats[0]["name"]  # which cluster stage ran
    assert got["theirs"].pop("cluster").endswith(MinhashDedupCluster.name)
    assert got["mine"].pop("cluster").endswith(MinhashClusterArrays.name)
    assert got["mine"] == got["theirs"]
    assert got["mine"]["meta"]["removed"].get("minhash_dedup:minhash_dedup", 0) >= 10
