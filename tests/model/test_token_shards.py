"""Tests for model/token_shards.py: datatrove shard format, mixture plan, packing, sharding, resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from model.token_shards import MixtureLoader, MixturePlan, SourcePlan, SourceStream, TokenShard


def write_shard(path: Path, docs: list[list[int]], dtype=np.uint16) -> str:
    """A `.ds` shard in datatrove's layout, written by hand (fast synthetic shards)."""
    flat = np.array([t for d in docs for t in d], dtype=dtype)
    flat.astype(np.dtype(dtype).newbyteorder("<")).tofile(path)
    np.cumsum([len(d) for d in docs]).astype("<u8").tofile(str(path) + ".index")
    Path(str(path) + ".metadata").write_text(f"synthetic|{np.dtype(dtype).itemsize}\n{len(flat)}\n")
    return str(path)


def make_plan(tmp_path: Path, sources: dict[str, tuple[float, list[list[list[int]]]]], **kw):
    entries = []
    for name, (weight, files) in sources.items():
        paths = [write_shard(tmp_path / f"{i:03d}_{name}.ds", docs) for i, docs in enumerate(files)]
        n = sum(len(d) for docs in files for d in docs)
        entries.append(
            {
                "name": name,
                "weight": weight,
                "files": paths,
                "available_tokens": n,
                "budget_tokens": n,
                "expected_epochs": 1.0,
            }
        )
    data = {
        "stage": "stage1",
        "seed": 0,
        "seq_len": 8,
        "tokens": 1000,
        "vocab_size": 4096,
        "eos_id": 0,
        "token_dtype": "uint16",
        "sources": entries,
    } | kw
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return MixturePlan.load(path)


def counting_docs(n_docs: int, start: int = 1, length=lambda i: 3 + i % 5):
    """Documents of consecutive token ids, so any window shows where it came from."""
    docs, t = [], start
    for i in range(n_docs):
        docs.append(list(range(t, t + length(i))))
        t += length(i)
    return docs


def test_reads_shards_written_by_datatrove_document_tokenizer(tmp_path):
    from datatrove.data import Document
    from datatrove.pipeline.tokens import DocumentTokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<eos>", "[UNK]"] + [f"w{i}" for i in range(30)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    texts = [" ".join(f"w{i}" for i in rng.integers(0, 30, rng.integers(2, 20))) for _ in range(40)]
    step = DocumentTokenizer(
        output_folder=str(tmp_path / "shards"),
        tokenizer_name_or_path=str(tmp_path / "tokenizer.json"),
        eos_token="<eos>",
        save_filename="prose",
        shuffle_documents=False,
    )
    step.run((Document(text=t, id=str(i)) for i, t in enumerate(texts)), rank=0, world_size=1)
    ds = sorted((tmp_path / "shards").glob("*.ds"))
    assert len(ds) == 1 and Path(str(ds[0]) + ".metadata").exists()

    expected = [tok.encode(t).ids + [0] for t in texts]  # datatrove appends <eos> (id 0)
    shard = TokenShard(ds[0], "uint16")
    assert shard.tokens.tolist() == [t for d in expected for t in d]
    assert shard.doc_ends.tolist() == np.cumsum([len(d) for d in expected]).tolist()

    plan = MixturePlan(
        stage="s",
        seed=0,
        seq_len=16,
        tokens=100,
        vocab_size=len(words),
        eos_id=0,
        token_dtype="uint16",
        sources=(SourcePlan("prose", 1.0, (str(ds[0]),)),),
    )
    loader = MixtureLoader(plan, vocab_size=len(words))
    flat = [t for d in expected for t in d]
    n = len(flat) // 16  # windows of one pass over the source
    batch = loader.next_batch(n)
    # One pass reads every window once, in a seeded order: each token is a target once.
    windows = sorted(range(n), key=lambda w: tuple(flat[w * 16 : w * 16 + 16]))
    rows = sorted(range(n), key=lambda r: tuple(batch.input_ids[r].tolist()))
    for w, r in zip(windows, rows, strict=True):
        assert batch.input_ids[r].tolist() == flat[w * 16 : w * 16 + 16]
        assert batch.labels[r].tolist() == flat[w * 16 + 1 : w * 16 + 17]
    assert batch.input_ids[:, 0].tolist() != [flat[w * 16] for w in range(n)]  # not in file order
    # A new document starts right after every <eos>, and only there.
    for ids, docs in zip(batch.input_ids, batch.doc_ids, strict=True):
        starts = (docs[1:] != docs[:-1]).tolist()
        assert starts == (ids[:-1] == 0).tolist()


def test_metadata_token_size_must_match_the_plan(tmp_path):
    path = write_shard(tmp_path / "a.ds", [[1, 2, 3]])
    with pytest.raises(ValueError, match="uint32"):
        TokenShard(path, "uint32")


def test_index_must_describe_the_tokens(tmp_path):
    path = write_shard(tmp_path / "a.ds", [[1, 2, 3], [4, 5]])
    np.array([3, 9], dtype="<u8").tofile(path + ".index")
    with pytest.raises(ValueError, match="a.ds.index"):
        TokenShard(path, "uint16")
    Path(path + ".index").unlink()
    with pytest.raises(FileNotFoundError, match="a.ds.index"):
        TokenShard(path, "uint16")


def test_plan_rejects_contract_violations(tmp_path):
    plan = make_plan(tmp_path, {"a": (1.0, [counting_docs(5)])})
    good = json.loads((tmp_path / "plan.json").read_text())
    with pytest.raises(ValueError, match="token_dtype"):
        MixturePlan.from_dict(good | {"token_dtype": "int8"})
    with pytest.raises(ValueError, match="colour"):
        MixturePlan.from_dict(good | {"colour": "red"})
    dup = good | {"sources": good["sources"] * 2}
    with pytest.raises(ValueError, match="duplicate"):
        MixturePlan.from_dict(dup)
    assert plan.sources[0].name == "a" and plan.stage == "stage1"


def test_uint32_shards(tmp_path):
    docs = [[70_000, 70_001, 5], [70_002, 9]]
    path = write_shard(tmp_path / "big.ds", docs, dtype=np.uint32)
    stream = SourceStream(SourcePlan("big", 1.0, (path,)), "uint32")
    tokens, doc = stream.read(0, 5)
    assert tokens.tolist() == [70_000, 70_001, 5, 70_002, 9] and doc.tolist() == [0, 0, 0, 1, 1]


def test_packing_splits_long_documents_and_numbers_docs_per_row(tmp_path):
    docs = [list(range(1, 30)), [100, 101], [200, 201, 202]]  # the first is longer than 8
    plan = make_plan(tmp_path, {"a": (1.0, [docs])})
    batch = MixtureLoader(plan).next_batch(4)  # the 4 windows of the 34 tokens, in seeded order
    row = {int(batch.input_ids[r, 0]): r for r in range(4)}
    assert sorted(row) == [1, 9, 17, 25]
    assert batch.input_ids[row[1]].tolist() == list(range(1, 9))
    assert batch.labels[row[1]].tolist() == list(range(2, 10))
    for first in (1, 9, 17):  # rows inside the long document: one document
        assert batch.doc_ids[row[first]].eq(0).all()
    assert batch.input_ids[row[25]].tolist() == [25, 26, 27, 28, 29, 100, 101, 200]
    assert batch.doc_ids[row[25]].tolist() == [0, 0, 0, 0, 0, 1, 1, 2]


def test_wraps_around_an_exhausted_source_and_counts_epochs(tmp_path):
    docs = counting_docs(3, length=lambda i: 4)  # 12 tokens: ids 1..12
    plan = make_plan(tmp_path, {"a": (1.0, [docs[:2], docs[2:]])})  # two files
    loader = MixtureLoader(plan)
    batch = loader.next_batch(3)  # 3 rows x 8 = 24 inputs = two epochs
    stream = [1 + (i % 12) for i in range(25)]
    assert batch.input_ids.flatten().tolist() == stream[:24]
    assert batch.labels.flatten().tolist() == stream[1:25]
    assert loader.epochs_per_source() == {"a": 2.0}
    assert loader.tokens_per_source() == {"a": 24}
    # The wrap starts a new document even though the ids repeat.
    assert batch.doc_ids[1].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def _max_drift(sources: list[str], weights: dict[str, float]) -> float:
    """The largest |count - weight x n| over every prefix of n sequences and every source."""
    counts = dict.fromkeys(weights, 0)
    worst = 0.0
    for n, name in enumerate(sources, 1):
        counts[name] += 1
        worst = max(worst, max(abs(counts[s] - w * n) for s, w in weights.items()))
    return worst


def test_sources_interleave_in_exact_proportion_and_seeds_change_only_the_order_within(tmp_path):
    plan = make_plan(
        tmp_path,
        {"web": (0.75, [counting_docs(50)]), "code": (0.25, [counting_docs(50, start=1000)])},
    )
    a, b = MixtureLoader(plan), MixtureLoader(plan)
    batches_a = [a.next_batch(7) for _ in range(40)]
    rows_a = [s for batch in batches_a for s in batch.sources]
    assert rows_a == [s for _ in range(40) for s in b.next_batch(7).sources]
    assert _max_drift(rows_a, {"web": 0.75, "code": 0.25}) < 1  # at every prefix, not on average
    assert a.tokens_per_source() == {"web": rows_a.count("web") * 8, "code": rows_a.count("code") * 8}
    other = MixtureLoader(plan, seed=1)
    batches_o = [other.next_batch(7) for _ in range(40)]
    assert [s for batch in batches_o for s in batch.sources] == rows_a  # the interleave is the weights'
    first = lambda batches: [row.tolist() for batch in batches for row in batch.input_ids]  # noqa: E731
    assert first(batches_o) != first(batches_a)  # the windows within a source follow the seed
    assert sorted(first(batches_o)[:30]) != first(batches_o)[:30]


@pytest.mark.parametrize("stage", ["stage1", "stage2", "stage3", "long_context"])
def test_every_tiny_stage_draws_its_weights_within_one_sequence(tmp_path, stage):
    """The tiny recipe's mixtures, drawn for as many sequences as the stage trains on."""
    import yaml

    from curation.mixtures import mixture_path

    weights = yaml.safe_load(mixture_path(f"mixtures/tiny/{stage}.yaml").read_text())["weights"]
    plan = make_plan(
        tmp_path, {n: (w, [counting_docs(30, start=1 + 500 * i)]) for i, (n, w) in enumerate(weights.items())}
    )
    loader = MixtureLoader(plan)
    sequences = {"stage1": 160000, "stage2": 96000, "stage3": 64000, "long_context": 32768}[stage] // 256
    rows = [s for _ in range(sequences // 16) for s in loader.next_batch(16).sources]
    drift = _max_drift(rows, {n: w / sum(weights.values()) for n, w in weights.items()})
    assert drift < 1, f"{stage}: a source drifted {drift:.2f} sequences from its weight"


def test_the_interleave_stays_within_one_sequence_for_many_sources():
    """Tijdeman's bound, 1 - 1/(2k - 2), on random weights of up to 40 sources (the 3B recipe's
    stage 1 has 32); Megatron's largest-deficit rule exceeds 1 on some of them."""
    from model.token_shards import interleave

    rng = np.random.default_rng(0)
    for _ in range(60):
        k = int(rng.integers(2, 40))
        w = rng.dirichlet(np.ones(k) * rng.uniform(0.1, 2))
        seq = interleave(w, [0] * k, 0, 2000)
        counts = np.zeros(k)
        for n, j in enumerate(seq, 1):
            counts[j] += 1
            assert np.abs(counts - w * n).max() <= 1 - 1 / (2 * k - 2) + 1e-9


def test_window_order_is_a_permutation_of_each_pass():
    from model.token_shards import permute

    for n in (1, 2, 7, 64, 1000, 4097):
        assert sorted(permute(i, n, (1, 2, 3, 4)) for i in range(n)) == list(range(n))
    assert [permute(i, 1000, (1, 2, 3, 4)) for i in range(5)] != [permute(i, 1000, (5, 6, 7, 8)) for i in range(5)]


def _two_source_plan(tmp_path):
    return make_plan(
        tmp_path,
        {"web": (0.6, [counting_docs(40)]), "code": (0.4, [counting_docs(40, start=1000)])},
    )


def test_ranks_take_disjoint_slices_of_the_global_stream(tmp_path):
    plan = _two_source_plan(tmp_path)
    whole = MixtureLoader(plan, world_size=1).next_batch(6).input_ids
    r0 = MixtureLoader(plan, rank=0, world_size=2).next_batch(3).input_ids
    r1 = MixtureLoader(plan, rank=1, world_size=2).next_batch(3).input_ids
    assert torch.equal(torch.cat([r0, r1]), whole)


def test_resume_continues_exactly_also_on_another_world_size(tmp_path):
    plan = _two_source_plan(tmp_path)
    reference = MixtureLoader(plan)
    ref_rows = [reference.next_batch(4).input_ids for _ in range(6)]
    ranks = [MixtureLoader(plan, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        for loader in ranks:
            loader.next_batch(2)
    state = json.loads(json.dumps(ranks[0].state_dict()))  # it must survive JSON
    assert state == ranks[1].state_dict()  # global: every rank holds the same state
    resumed = MixtureLoader(plan, world_size=1)
    resumed.load_state_dict(state)
    for step in range(3, 6):
        assert torch.equal(resumed.next_batch(4).input_ids, ref_rows[step])
    assert resumed.tokens_per_source() == reference.tokens_per_source()


def test_resume_refuses_a_different_seed_or_seq_len(tmp_path):
    plan = _two_source_plan(tmp_path)
    state = MixtureLoader(plan).state_dict()
    with pytest.raises(ValueError, match="seq_len"):
        MixtureLoader(plan, seq_len=16).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        MixtureLoader(plan, seed=5).load_state_dict(state)


def test_tokens_beyond_the_model_vocab_are_named(tmp_path):
    plan = make_plan(tmp_path, {"a": (1.0, [[[1, 2, 3, 5000, 4, 5, 6, 7, 8, 9]]])})
    with pytest.raises(ValueError, match="'a'.*5000.*vocab_size 4096"):
        MixtureLoader(plan, vocab_size=4096).next_batch(1)


def _many_shard_plan(tmp_path: Path):
    """Three sources over 31 shards of documents of 1 to 40 tokens (some longer than a window),
    uint16 ids from a seeded generator: every path of the reader (file edges, wraps, long
    documents) is crossed many times in a few hundred rows."""
    rng = np.random.default_rng(7)
    sources = {}
    for name, weight, shards in (("web", 0.5, 17), ("code", 0.3, 9), ("math", 0.2, 5)):
        files = []
        for _ in range(shards):
            lengths = rng.integers(1, 41, size=int(rng.integers(1, 12)))
            files.append([rng.integers(1, 4096, size=int(n)).tolist() for n in lengths])
        sources[name] = (weight, files)
    return make_plan(tmp_path, sources, seq_len=16, seed=3)


def _digest(batches) -> str:
    import hashlib

    h = hashlib.sha256()
    for b in batches:
        for t in (b.input_ids, b.labels, b.doc_ids):
            h.update(t.numpy().tobytes())
        h.update(",".join(b.sources).encode())
    return h.hexdigest()


def test_batches_are_bit_identical_to_the_pinned_stream(tmp_path):
    """The loader's output pinned by a digest taken before the shards were read through bounded
    caches and a prefetch thread: the same rows, labels, document ids and sources, bit for bit,
    across skips and on every rank."""
    plan = _many_shard_plan(tmp_path)
    whole = MixtureLoader(plan)
    batches = [whole.next_batch(6) for _ in range(30)]
    whole.skip(17)
    batches += [whole.next_batch(6) for _ in range(30)]
    ranks = [MixtureLoader(plan, rank=r, world_size=3) for r in range(3)]
    sliced = [loader.next_batch(2) for _ in range(20) for loader in ranks]
    assert _digest(batches) == "e07ff166c66080bd96a95048212e63fee650678b56314caee384a560a43d36ad"
    assert _digest(sliced) == "adbdc5657b03ca9c0bc2394b028f356a54e6ba9173faccce8c30dd174e35a341"


def _open_shard_files(folder: Path) -> tuple[int, int]:
    """(open file descriptors, memory maps) of this process on files under `folder`."""
    fds = sum(1 for fd in Path("/proc/self/fd").iterdir() if str(folder) in str(_readlink(fd)))
    maps = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if str(folder) in line}
    return fds, len(maps)


def _readlink(path: Path) -> str:
    try:
        return str(path.readlink())
    except OSError:  # the descriptor closed while listing
        return ""


@pytest.mark.parametrize("prefetch", [0, 3])
def test_a_bounded_shard_cache_and_the_prefetch_thread_give_the_pinned_stream(tmp_path, prefetch):
    """Two shards open at most (of 31), batches drawn ahead by a thread: the pinned digests, and
    never more than the cap's files and maps open (and the file a map is being made of)."""
    plan = _many_shard_plan(tmp_path)
    whole = MixtureLoader(plan, open_shards=2, prefetch=prefetch)
    assert len(whole.cache) == 0 and _open_shard_files(tmp_path) == (0, 0)  # start-up opens nothing
    batches, most = [], (0, 0)
    for i in range(60):
        if i == 30:
            whole.skip(17)
        batches.append(whole.next_batch(6))
        most = tuple(max(a, b) for a, b in zip(most, _open_shard_files(tmp_path), strict=True))
    assert _digest(batches) == "e07ff166c66080bd96a95048212e63fee650678b56314caee384a560a43d36ad"
    assert most[0] <= 2 * 2 + 1 and most[1] <= 2 * 2 and len(whole.cache) <= 2
    assert whole.cache.opened > 31  # shards were closed and opened again
    ranks = [MixtureLoader(plan, rank=r, world_size=3, open_shards=2, prefetch=prefetch) for r in range(3)]
    sliced = [loader.next_batch(2) for _ in range(20) for loader in ranks]
    assert _digest(sliced) == "adbdc5657b03ca9c0bc2394b028f356a54e6ba9173faccce8c30dd174e35a341"
    for loader in (whole, *ranks):
        loader.close()
    assert _open_shard_files(tmp_path) == (0, 0)


def test_prefetched_batches_follow_skips_resumes_and_a_new_micro_batch_size(tmp_path):
    plan = _many_shard_plan(tmp_path)
    plain, ahead = MixtureLoader(plan), MixtureLoader(plan, prefetch=4)
    saved = None
    for op in ["b4"] * 5 + ["save", "skip7"] + ["b4"] * 3 + ["b2"] * 2 + ["load"] + ["b4"] * 3 + ["b3"]:
        if op == "save":
            saved = plain.state_dict()
            assert ahead.state_dict() == saved  # the state of the batches returned, not of those drawn ahead
        elif op == "skip7":
            plain.skip(7), ahead.skip(7)
        elif op == "load":
            plain.load_state_dict(saved), ahead.load_state_dict(saved)
        else:
            a, b = plain.next_batch(int(op[1])), ahead.next_batch(int(op[1]))
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.doc_ids, b.doc_ids)
            assert a.sources == b.sources
        assert ahead.state_dict() == plain.state_dict()
    ahead.close()


def test_a_bad_token_drawn_ahead_fails_the_batch_that_holds_it(tmp_path):
    plan = make_plan(tmp_path, {"a": (1.0, [[[1, 2, 3, 5000, 4, 5, 6, 7, 8, 9]]])})
    loader = MixtureLoader(plan, vocab_size=4096, prefetch=2)
    for _ in range(2):  # and again: the error is the batch's, not a broken thread's
        with pytest.raises(ValueError, match="'a'.*5000.*vocab_size 4096"):
            loader.next_batch(1)
        assert loader.sequence == 0
    loader.close()


def test_a_shard_is_checked_when_it_is_first_read(tmp_path):
    """Start-up reads file sizes and each source's first metadata; a shard's missing or corrupt
    index is named when a window first reads that shard."""
    plan = make_plan(tmp_path, {"a": (1.0, [counting_docs(4, length=lambda i: 4)] * 2)})
    Path(plan.sources[0].files[1] + ".index").unlink()
    loader = MixtureLoader(plan)
    with pytest.raises(FileNotFoundError, match="001_a.ds.index"):
        [loader.next_batch(1) for _ in range(4)]
    np.array([4, 3, 12, 16], dtype="<u8").tofile(plan.sources[0].files[1] + ".index")
    with pytest.raises(ValueError, match="001_a.ds.index.*not increasing"):
        [MixtureLoader(plan).next_batch(4) for _ in range(2)]
    wrong = MixturePlan.from_dict({**json.loads((tmp_path / "plan.json").read_text()), "token_dtype": "uint32"})
    with pytest.raises(ValueError, match="000_a.ds.metadata says 2-byte tokens.*uint32"):
        MixtureLoader(wrong)  # the plan's dtype is checked at start-up, on each source's first shard
    Path(plan.sources[0].files[0]).unlink()
    with pytest.raises(FileNotFoundError, match="000_a.ds is missing"):
        MixtureLoader(plan)


def test_loader_memory_does_not_grow_with_the_documents(tmp_path):
    """A shard of a million one-token documents (an 8 MB index): building the loader and drawing
    a batch allocate under 1 MB (reading the index into memory took 16 MB)."""
    import tracemalloc

    path = tmp_path / "many.ds"
    n = 1_000_000
    (np.arange(n, dtype=np.uint16) % 4000 + 1).tofile(path)
    np.arange(1, n + 1, dtype="<u8").tofile(str(path) + ".index")
    plan = MixturePlan("s", 0, 64, 1000, 4096, 0, "uint16", (SourcePlan("a", 1.0, (str(path),)),))
    tracemalloc.start()
    try:
        loader = MixtureLoader(plan)
        batch = loader.next_batch(4)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak
    assert batch.doc_ids[0].tolist() == list(range(64))  # one-token documents: a new one at every position
