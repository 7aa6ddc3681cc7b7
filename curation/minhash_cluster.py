"""MinHash clustering in bounded memory: datatrove's `MinhashDedupCluster`, same output, arrays.

datatrove's cluster stage (the third of its four MinHash steps) reads the duplicate pairs that
the buckets stage wrote (`{band:05d}_{worker:02d}.dups`: little-endian uint32 records `file1,
doc1, file2, doc2`), joins them with a union-find and writes, per input file, the documents to
drop (`{file:06d}.remove`: little-endian uint32 document indexes, ascending), every member of a
cluster but its root. Its union-find is a Python dict keyed by `(file, doc)` tuples: 168 bytes
per document in a pair measured at 1-2M of them, in the one task of the stage (docs/scale.md).

`MinhashClusterArrays` does the same union-find on arrays, in three passes over the pair files:

1. the documents that occur in a pair: per input file, a sorted uint32 array of its document
   indexes (4 bytes each), a chunk's new ones merged in; a document's position is its file's
   offset plus its place in that array;
2. the pairs again, in the same order, each document turned into its position (`searchsorted`
   in its file's array), joined in a parent array of int32 (int64 past 2^31 documents) that
   holds, at a root, minus the size of its cluster: 4 bytes per document;
3. every document's root (pointer jumping, in place, a chunk at a time), and the documents that
   are not their root written out, file by file, in document order.

So about 8 bytes per document in a pair (9.7 measured from 4M to 8M of them), plus a chunk of
pairs (`chunk_pairs`, 1M by default: 16 MB read, ~160 MB with its working arrays, the 4M run
less 9.7 bytes per document) and one file's array while a chunk is merged into it
(benchmarks/minhash_cluster.py).

The output is datatrove's byte for byte, whatever the pairs: the root of a cluster is the
document kept, and a union-find's roots depend only on the order of its unions and its rule for
which root joins which, not on its path compression. This one reads the files in datatrove's
order (`list_files`, sorted), the pairs in file order, and applies its rule: the smaller cluster
joins the larger, on a tie the second document's root joins the first's, and the index's
sentinel document (`SENTINEL, SENTINEL`, a match against a MinHash index) always stays a root.
The stats are datatrove's too: `duplicates` (documents in a pair), `to_remove`, `cluster_size`
(per cluster). Only what curation uses is implemented: no `save_cluster_id`/`save_cluster_size`
files and no `ignore_index_matches`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import numpy as np
from datatrove.data import DocumentsPipeline
from datatrove.io import DataFolderLike, get_datafolder
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.minhash import SENTINEL, MinhashConfig
from datatrove.utils.logging import logger
from datatrove.utils.stats import MetricStats

PAIR_BYTES = 16  # four little-endian uint32
_LOW = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def _keys(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two documents of each pair (rows of file1, doc1, file2, doc2) as `file << 32 | doc`."""
    col = lambda k: pairs[:, k].astype(np.uint64)  # noqa: E731
    return (col(0) << _SHIFT) | col(1), (col(2) << _SHIFT) | col(3)


def _by_file(keys: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(file, positions in `keys`) for each file of `keys` (uint64 `file << 32 | doc`)."""
    files = keys >> _SHIFT
    order = np.argsort(files, kind="stable")
    cuts = np.flatnonzero(np.diff(files[order])) + 1
    for part in np.split(order, cuts) if len(order) else ():
        yield int(files[part[0]]), part


def _unite(parent: array, first: np.ndarray, second: np.ndarray, sentinel: int) -> None:
    """Join each pair (positions in the key array) as datatrove's `union` does: find both roots
    (compressing the paths), the smaller cluster under the larger, on a tie the second's root
    under the first's, the sentinel always a root. `parent[x]` is x's parent, or, at a root,
    minus the size of its cluster."""
    for a, b in zip(memoryview(first), memoryview(second), strict=True):
        ra = a
        while parent[ra] >= 0:
            ra = parent[ra]
        while a != ra:
            up = parent[a]
            parent[a] = ra
            a = up
        rb = b
        while parent[rb] >= 0:
            rb = parent[rb]
        while b != rb:
            up = parent[b]
            parent[b] = rb
            b = up
        if ra == rb:
            continue
        size_a, size_b = -parent[ra], -parent[rb]
        if rb == sentinel or (ra != sentinel and size_a < size_b):
            ra, rb = rb, ra
        parent[ra] = -(size_a + size_b)
        parent[rb] = ra


def _metric(total: int, n: int, low: int, high: int, sum_squares: int, unit: str = "doc") -> MetricStats:
    """datatrove's MetricStats of `n` updates summing to `total` (their squares to `sum_squares`)."""
    mean = total / n
    return MetricStats(
        total=total,
        n=n,
        mean=mean,
        min=low,
        max=high,
        _running_variance=float(sum_squares - total * total / n),
        unit=unit,
    )


class MinhashClusterArrays(PipelineStep):
    """Minhash deduplication, third step, in bounded memory: `MinhashDedupCluster`'s `.remove`
    files and stats from the buckets stage's `.dups` files, with ~8 bytes per duplicate document
    instead of ~260 (the module's docstring)."""

    type = "🫂 - DEDUP"
    name = "🎯 MinHash stage 3 (arrays)"

    def __init__(
        self,
        input_folder: DataFolderLike,
        output_folder: DataFolderLike,
        config: MinhashConfig | None = None,
        chunk_pairs: int = 1 << 20,
    ):
        super().__init__()
        if chunk_pairs < 1:
            raise ValueError(f"chunk_pairs must be positive, got {chunk_pairs}")
        self.input_folder = get_datafolder(input_folder)
        self.output_folder = get_datafolder(output_folder)
        self.config = config or MinhashConfig()
        self.chunk_pairs = chunk_pairs

    def _pairs(self, files: list[str]) -> Iterator[np.ndarray]:
        """The pairs of `files`, in order, as (m, 4) uint32 arrays of at most `chunk_pairs` rows."""
        want = self.chunk_pairs * PAIR_BYTES
        for name in files:
            with self.input_folder.open(name, "rb") as fh:
                rest = b""
                while True:
                    raw = fh.read(want - len(rest))
                    if not raw:
                        break
                    raw = rest + raw
                    whole = len(raw) - len(raw) % PAIR_BYTES
                    rest = raw[whole:]
                    if whole:
                        yield np.frombuffer(raw, dtype="<u4", count=whole // 4).reshape(-1, 4)
                if rest:
                    raise ValueError(f"{name}: {len(rest)} bytes after the last whole pair of 16")

    def _documents(self, files: list[str]) -> dict[int, np.ndarray]:
        """Pass 1: per input file, the sorted indexes (uint32) of its documents in a pair."""
        docs: dict[int, np.ndarray] = {}
        for pairs in self._pairs(files):
            first, second = _keys(pairs)
            new = np.unique(np.concatenate((first, second)))
            del first, second
            for file, at in _by_file(new):
                mine = (new[at] & _LOW).astype(np.uint32)
                old = docs.get(file)
                if old is not None:
                    where = np.searchsorted(old, mine)
                    known = where < len(old)
                    known[known] = old[where[known]] == mine[known]
                    mine = mine[~known]
                    if not len(mine):
                        continue
                    mine = np.concatenate((old, mine))
                    del old
                    mine.sort(kind="stable")  # two sorted runs: one linear merge
                docs[file] = mine
        return docs

    def _positions(self, keys: np.ndarray) -> np.ndarray:
        """Each document of `keys` (`file << 32 | doc`) as its position: its file's offset plus
        its place in the file's array."""
        out = np.empty(len(keys), dtype=np.int64)
        for file, at in _by_file(keys):
            slot = self._slot[file]
            out[at] = self._offsets[slot] + np.searchsorted(self._docs[slot], (keys[at] & _LOW).astype(np.uint32))
        return out

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        dup_files = self.input_folder.list_files(glob_pattern="*.dups")
        assert len(dup_files) % self.config.num_buckets == 0, (
            "Number of .dups files should be divisible by number of buckets"
        )
        assert world_size == 1, "World size must be 1 for clustering"
        with self.track_time():
            per_file = self._documents(dup_files)
            self._files = sorted(per_file)
            self._docs = [per_file.pop(f) for f in self._files]
            self._slot = {f: i for i, f in enumerate(self._files)}
            self._offsets = np.cumsum([0] + [len(d) for d in self._docs], dtype=np.int64)
            n = int(self._offsets[-1])
            logger.info(f"{n:,} documents of {len(self._files)} files in {len(dup_files)} pair files")
            code, dtype = ("i", np.int32) if n < 2**31 - 1 else ("q", np.int64)
            parent = array(code, [-1]) * n
            sentinel = n - 1 if self._files and self._files[-1] == SENTINEL else -1
            for pairs in self._pairs(dup_files):  # pass 2
                first, second = _keys(pairs)
                _unite(parent, self._positions(first), self._positions(second), sentinel)
            self._write(np.frombuffer(parent, dtype=dtype))

    def _write(self, parent: np.ndarray) -> None:
        """Pass 3: the stats, every document's root, and the `.remove` files."""
        n, step = len(parent), self.chunk_pairs
        if not n:
            return
        clusters = sizes = squares = 0
        low, high = n, 0
        for start in range(0, n, step):
            seg = parent[start : start + step]
            roots = np.flatnonzero(seg < 0)
            if len(roots):
                size = -seg[roots].astype(np.int64)
                clusters += len(roots)
                sizes += int(size.sum())
                squares += int((size * size).sum())
                low, high = min(low, int(size.min())), max(high, int(size.max()))
                seg[roots] = roots + start  # a root points at itself from here on
        changed = True
        while changed:  # pointer jumping, in place: every document ends pointing at its root
            changed = False
            for start in range(0, n, step):
                seg = parent[start : start + step]
                up = parent[seg]
                if not np.array_equal(up, seg):
                    seg[:] = up
                    changed = True
        removed = 0
        with self.output_folder.get_output_file_manager(mode="wb") as out:
            for file, docs, offset in zip(self._files, self._docs, self._offsets.tolist(), strict=False):
                for start in range(0, len(docs), step):
                    end = min(start + step, len(docs))
                    here = np.arange(offset + start, offset + end)
                    drop = docs[start:end][parent[offset + start : offset + end] != here]
                    if len(drop):
                        out.write(f"{file:06d}.remove", drop.astype("<u4").tobytes())
                        removed += len(drop)
        self.stats["duplicates"] = _metric(n, n, 1, 1, n)
        if removed:
            self.stats["to_remove"] = _metric(removed, removed, 1, 1, removed)
        self.stats["cluster_size"] = _metric(sizes, clusters, low, high, squares, unit="cluster")
