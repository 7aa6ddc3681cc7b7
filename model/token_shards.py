"""Token-shard data loading: the mixture plan contract, shard reader and packed mixture loader.

Shards are datatrove `DocumentTokenizer` output: `X.ds` holds raw little-endian uint16 or uint32
token ids, `X.ds.index` the uint64 end offset (exclusive, in tokens) of every document, and
`X.ds.metadata` three lines: "tokenizer|token_size", token count, human-readable count.

The mixture plan (JSON, written by the data pipeline) names, per source, its weight and files.

How the loader builds its stream, and why:
- Each source's files are concatenated into one token stream that wraps around when exhausted.
  Window w of a source is [w*L, w*L + L + 1) of that stream: inputs are its first L tokens,
  labels the last L. Documents are packed back to back and split at window edges; document ids
  (restarting at 0 in every row) drive intra-document attention masking.
- Within a source, the order of the windows is seeded: the n = tokens // L windows of each
  pass ("window epoch") are drawn in a seeded pseudo-random permutation (a Feistel network over
  the window index: O(1) memory however large the source), so every token of a pass is a
  target once and two seeds draw the same windows in different orders (seed replicas of an
  anneal measure data-order noise with it).
- Which source global sequence g comes from is a deterministic interleave in exact proportion:
  each sequence goes to the source whose count is furthest behind its weight x (g + 1), among
  the sources not already ahead (Tijdeman's rule for the chairman assignment problem, an
  earliest-deadline-first refinement of Megatron's blended-dataset rule). After any number of
  sequences every source's count is within one sequence of weight x sequences: 1 - 1/(2k - 2)
  for k sources (Megatron's plain largest-deficit rule reaches 1.07 with 12 sources). A random
  draw by weight drifted: the tiny stage 3 trained on 26.6% prose for a weight of 20%.
- The state is global: the global sequence counter and per-source sequence counters (which
  alone decide the next source, so resume is exact). Rank r of W takes its contiguous slice of
  each global micro-batch, so the set of sequences in an optimizer step depends only on the
  global batch, and a checkpoint written by 2 ranks resumes the very same stream on 1 rank (or
  any world size dividing the global batch).
- Nothing on a rank grows with the corpus (stage 1 of the 3B recipe: 4.5B documents in ~41k
  shards, which read whole took 72 GB and 41k open files per rank): start-up reads one file size
  per shard (and each source's first `.metadata`) and maps no shard; shards open when a window
  first reads them, at most `open_shards` at once (LRU), and a window's documents are found by
  binary search in the memory-mapped `.index`. A prefetch thread may draw the next micro-batches: a batch is a
  function of the counters it is drawn from, so the thread draws exactly what `next_batch`
  would, and the visible state stays that of the batches returned.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infra.files import path_from_file
from model.spec import LoaderConfig

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


# ---- the mixture plan contract --------------------------------------------------------------


@dataclass(frozen=True)
class SourcePlan:
    name: str  # source name, the key of every per-source counter
    weight: float  # sampling probability before normalisation over sources
    files: tuple[str, ...]  # absolute paths of `.ds` shards, read in this order
    available_tokens: int = 0  # tokens in the files (informational)
    budget_tokens: int = 0  # tokens this stage should draw from the source (informational)
    expected_epochs: float = 0.0  # budget / available (informational)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("mixture source has an empty name")
        if not self.weight >= 0 or math.isinf(self.weight):
            raise ValueError(f"source {self.name!r}: weight must be finite and >= 0")
        if not self.files:
            raise ValueError(f"source {self.name!r} lists no files")


@dataclass(frozen=True)
class MixturePlan:
    stage: str  # stage name, e.g. "stage1"
    seed: int  # seed of the source draws
    seq_len: int  # sequence length the data pipeline planned for
    tokens: int  # total tokens the stage should consume
    vocab_size: int  # tokenizer size the shards were written with
    eos_id: int  # end-of-document token id
    token_dtype: str  # "uint16" or "uint32": the `.ds` element type
    sources: tuple[SourcePlan, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.token_dtype not in TOKEN_DTYPES:
            raise ValueError(f"mixture plan token_dtype {self.token_dtype!r} is not one of {sorted(TOKEN_DTYPES)}")
        if not self.sources:
            raise ValueError(f"mixture plan for stage {self.stage!r} has no sources")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"mixture plan has duplicate source names: {names}")
        if sum(s.weight for s in self.sources) <= 0:
            raise ValueError(f"mixture plan for stage {self.stage!r}: weights sum to 0")
        if self.seq_len <= 0:
            raise ValueError(f"mixture plan seq_len must be > 0, got {self.seq_len}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MixturePlan:
        data = dict(data)
        sources = data.pop("sources", [])
        try:
            return cls(
                **data,
                sources=tuple(SourcePlan(**{**s, "files": tuple(s["files"])}) for s in sources),
            )
        except TypeError as err:  # unknown or missing keys
            raise ValueError(f"mixture plan does not match the contract: {err}") from err

    @classmethod
    def load(cls, path: str | Path) -> MixturePlan:
        """A plan file; shard paths it records relative to itself (`./`, `../`) made absolute."""
        try:
            data = json.loads(Path(path).read_text())
            for source in data.get("sources", []) if isinstance(data, dict) else []:
                if isinstance(source, dict) and isinstance(source.get("files"), list):
                    source["files"] = [path_from_file(f, path) if isinstance(f, str) else f for f in source["files"]]
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err

    def weights(self) -> np.ndarray:
        w = np.array([s.weight for s in self.sources], dtype=np.float64)
        return w / w.sum()


# ---- shards ---------------------------------------------------------------------------------

# shards a loader keeps open at once (two files and two maps each): the spec's default
DEFAULT_OPEN_SHARDS: int = LoaderConfig.model_fields["open_shards"].default


def check_token_size(path: str | Path, token_dtype: str) -> None:
    """ValueError when the shard's `.ds.metadata` (if any) names another token size than the plan."""
    meta = Path(str(path) + ".metadata")
    if meta.exists():
        # First line is "tokenizer|token_size"; a mismatch means the plan's dtype is wrong.
        token_size = meta.read_text().splitlines()[0].rsplit("|", 1)[-1]
        itemsize = np.dtype(TOKEN_DTYPES[token_dtype]).itemsize
        if token_size.isdigit() and int(token_size) != itemsize:
            raise ValueError(
                f"{meta} says {token_size}-byte tokens but the plan's token_dtype is {token_dtype} ({itemsize} bytes)"
            )


class TokenShard:
    """One datatrove `.ds` file and its `.ds.index`, both memory-mapped: opening one costs two
    files and two maps, never memory in proportion to its documents. The index is checked where it
    is read: its last end must be the token count (here), its ends increasing (`documents`)."""

    def __init__(self, path: str | Path, token_dtype: str, check_metadata: bool = True) -> None:
        self.path = Path(path)
        dtype = np.dtype(TOKEN_DTYPES[token_dtype]).newbyteorder("<")
        self.index = Path(str(self.path) + ".index")
        for needed in (self.path, self.index):
            if not needed.exists():
                raise FileNotFoundError(f"token shard file {needed} is missing")
        if check_metadata:
            check_token_size(self.path, token_dtype)
        size = self.path.stat().st_size
        if size % dtype.itemsize:
            raise ValueError(f"{self.path}: {size} bytes is not a whole number of {token_dtype}")
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
        index_size = self.index.stat().st_size
        # (D,) exclusive document ends, uint64 as written: searched with uint64 keys, never cast
        self.doc_ends = np.memmap(self.index, dtype="<u8", mode="r") if index_size >= 8 else np.zeros(0, "<u8")
        n = len(self.tokens)
        if index_size % 8 or len(self.doc_ends) == 0 or int(self.doc_ends[-1]) != n:
            raise ValueError(
                f"{self.index} does not describe {self.path}: last end "
                f"{int(self.doc_ends[-1]) if len(self.doc_ends) else None} vs {n} tokens"
            )

    def __len__(self) -> int:
        return len(self.tokens)

    def documents(self, start: int, stop: int) -> np.ndarray:
        """The shard's document number of each position in [start, stop) (stop > start): two
        binary searches of the mapped index, then only the ends between them are read."""
        ends = self.doc_ends
        first = int(np.searchsorted(ends, np.uint64(start), side="right"))
        last = int(np.searchsorted(ends, np.uint64(stop - 1), side="right"))
        between = np.array(ends[first : last + 1])  # (last - first + 1,) the ends the range crosses
        if last >= len(ends) or np.any(between[1:] <= between[:-1]):
            raise ValueError(f"{self.index} does not describe {self.path}: document ends are not increasing")
        positions = np.arange(start, stop, dtype=np.uint64)
        return first + np.searchsorted(between, positions, side="right").astype(np.int64)


class ShardCache:
    """The shards a loader holds open, the least recently read closed first: at most `capacity`
    (two open files and two memory maps each) however many shards the plan lists."""

    def __init__(self, capacity: int = DEFAULT_OPEN_SHARDS) -> None:
        if capacity < 1:
            raise ValueError(f"open_shards must be >= 1, got {capacity}")
        self.capacity = capacity
        self._open: OrderedDict[str, TokenShard] = OrderedDict()
        self.opened = 0  # shards opened so far (each miss opens one)

    def get(self, path: str, token_dtype: str, tokens: int, check_metadata: bool) -> TokenShard:
        """The shard at `path`, opened if it is not, which must still hold `tokens` tokens."""
        shard = self._open.get(path)
        if shard is not None:
            self._open.move_to_end(path)
            return shard
        while len(self._open) >= self.capacity:  # closed before the next opens: never above capacity
            self._open.popitem(last=False)  # its files and maps close with the last reference
        shard = TokenShard(path, token_dtype, check_metadata=check_metadata)
        if len(shard) != tokens:
            raise ValueError(f"token shard {path} holds {len(shard)} tokens, {tokens} when the loader started")
        self.opened += 1
        self._open[path] = shard
        return shard

    def __len__(self) -> int:
        return len(self._open)

    def clear(self) -> None:
        self._open.clear()


class SourceStream:
    """A source's shards as one endless (wrapping) token stream with document ids.

    Memory is one int64 per shard (where each starts in the stream) however many documents the
    source holds: start-up reads one file size per shard (and the first shard's metadata) and maps
    nothing; a shard is opened (through `cache`, bounded) when a window first reads it, its
    metadata checked then, once."""

    def __init__(self, plan: SourcePlan, token_dtype: str, cache: ShardCache | None = None) -> None:
        self.name = plan.name
        self.token_dtype = token_dtype
        self.cache = cache if cache is not None else ShardCache()
        self.files = plan.files  # the plan's own strings: nothing per shard but two numbers below
        itemsize = np.dtype(TOKEN_DTYPES[token_dtype]).itemsize
        sizes = np.empty(len(self.files), dtype=np.int64)
        for i, path in enumerate(self.files):
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                raise FileNotFoundError(f"token shard file {path} is missing") from None
            if size % itemsize:
                raise ValueError(f"{path}: {size} bytes is not a whole number of {token_dtype}")
            if size == 0:  # an empty shard has no document to end: its index cannot describe it
                raise ValueError(f"{path}.index does not describe {path}: last end None vs 0 tokens")
            sizes[i] = size // itemsize
        self.file_starts = np.concatenate([[0], np.cumsum(sizes)])  # (F+1,)
        self.num_tokens = int(self.file_starts[-1])
        self._checked = np.zeros(len(self.files), dtype=bool)  # (F,) metadata checked once
        check_token_size(self.files[0], token_dtype)  # a plan with the wrong dtype fails here, not at a step
        self._checked[0] = True

    def shard(self, f: int) -> TokenShard:
        """File f of the source, from the cache."""
        tokens = int(self.file_starts[f + 1] - self.file_starts[f])
        shard = self.cache.get(self.files[f], self.token_dtype, tokens, check_metadata=not self._checked[f])
        self._checked[f] = True
        return shard

    def read(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and document ids of stream positions [start, start + length). A document's id
        is its number in its file plus the file's first stream position, plus the stream length
        per wrap: equal ids are one document, and a file edge or a wrap always starts a new one."""
        tokens = np.empty(length, dtype=np.int64)
        docs = np.empty(length, dtype=np.int64)
        done = 0
        while done < length:
            pos = start + done
            epoch, offset = divmod(pos, self.num_tokens)
            f = int(np.searchsorted(self.file_starts, offset, side="right") - 1)
            take = min(length - done, int(self.file_starts[f + 1]) - offset)
            local = offset - int(self.file_starts[f])
            shard = self.shard(f)
            tokens[done : done + take] = shard.tokens[local : local + take]
            first = int(self.file_starts[f]) + epoch * self.num_tokens
            docs[done : done + take] = shard.documents(local, local + take) + first
            done += take
            shard = None  # the cache alone keeps shards open
        return tokens, docs


# ---- the interleave and the window order -----------------------------------------------------


def interleave(weights: np.ndarray, counts: list[int], start: int, count: int) -> np.ndarray:
    """Source of global sequences [start, start + count), given the per-source counts before
    `start` (they sum to `start`), and the counts updated in place.

    Tijdeman's rule with d = 1 / (2k - 2): sequence t (1-based) may go to a source j whose
    deficit w_j t - c_j is at least d (it is not ahead); among those, the one whose deadline
    (c_j + 1 - d) / w_j comes first. Ties go to the earlier source of the plan.
    """
    k = len(weights)
    out = np.empty(count, dtype=np.int64)
    if k == 1:
        out[:] = 0
        counts[0] += count
        return out
    d = 1.0 / (2 * k - 2)
    w = [float(x) for x in weights]
    for i in range(count):
        t = start + i + 1
        best, deadline = -1, math.inf
        for j in range(k):
            # 1e-6: float64 rounding of w * t stays far below it for t < 2**40 sequences
            if w[j] > 0 and w[j] * t - counts[j] >= d - 1e-6:
                due = (counts[j] + 1 - d) / w[j]
                if due < deadline:
                    best, deadline = j, due
        if best < 0:  # unreachable in exact arithmetic (the deficits sum to 1): Megatron's rule
            best = max(range(k), key=lambda j: w[j] * t - counts[j])
        out[i] = best
        counts[best] += 1
    return out


def _round(x: int, key: int, bits: int) -> int:
    """One Feistel round function: a 64-bit mix (splitmix64) of x and the round key."""
    z = (x * 0x9E3779B97F4A7C15 + key) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & ((1 << bits) - 1)


def permute(index: int, n: int, keys: tuple[int, ...]) -> int:
    """A seeded bijection of [0, n): a Feistel network on the smallest even number of bits
    covering n, cycle-walking until the value falls inside [0, n) (under 4 steps on average)."""
    if n <= 1:
        return 0
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = index
    while True:
        left, right = x >> half, x & mask
        for key in keys:
            left, right = right, left ^ _round(right, key, half)
        x = (left << half) | right
        if x < n:
            return x


# ---- the loader -----------------------------------------------------------------------------


@dataclass
class Batch:
    input_ids: torch.Tensor  # (n, L) int64
    labels: torch.Tensor  # (n, L) int64, labels[:, t] is the target of input_ids[:, t]
    doc_ids: torch.Tensor  # (n, L) int64, equal ids = same document, from 0 in each row
    sources: list[str]  # (n,) which source each row came from


class MixtureLoader:
    """Deterministic, resumable, rank-sharded stream of packed sequences from a mixture plan.

    At most `open_shards` shards are open at once, over all sources. With `prefetch` > 0 a
    background thread draws that many micro-batches ahead of the one asked for: a batch is a
    function of the state it is drawn from (the counters, the micro-batch size), so the thread
    draws exactly what `next_batch` would, and the state visible here (`sequence`,
    `source_sequences`, `state_dict`) is always that of the batches returned, never of those
    drawn ahead. `skip` and `load_state_dict` drop what was drawn ahead."""

    def __init__(
        self,
        plan: MixturePlan,
        seq_len: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        seed: int | None = None,
        vocab_size: int | None = None,
        open_shards: int = DEFAULT_OPEN_SHARDS,
        prefetch: int = 0,
        pin_memory: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 micro-batches, got {prefetch}")
        self.plan = plan
        self.seq_len = seq_len or plan.seq_len
        self.rank, self.world_size = rank, world_size
        self.seed = plan.seed if seed is None else seed
        self.vocab_size = vocab_size
        self.names = [s.name for s in plan.sources]
        self.cache = ShardCache(open_shards)
        self.streams = [SourceStream(s, plan.token_dtype, self.cache) for s in plan.sources]
        self.weights = plan.weights()
        self.sequence = 0  # global sequences drawn so far, over all ranks
        self.source_sequences = [0] * len(self.streams)  # global sequences drawn per source
        self._keys: dict[tuple[int, int], tuple[int, ...]] = {}  # (source, window epoch) -> round keys
        self.prefetch = prefetch
        # CUDA: batches in page-locked memory, so the step's host-to-device copies can be
        # non_blocking (a copy from pageable memory synchronises the stream); pinned in the
        # prefetch thread when there is one, off the step's path
        self.pin_memory = pin_memory
        self._pool: ThreadPoolExecutor | None = None  # the prefetch thread, started by the first batch
        self._ahead: deque[tuple[int, Future]] = deque()  # (per_rank, the draw) in stream order

    # -- window order --

    def window(self, source: int, k: int) -> int:
        """The window the k-th sequence of `source` reads: the k-th of a seeded permutation of
        each window epoch's n windows (see the module docstring)."""
        n = max(1, self.streams[source].num_tokens // self.seq_len)
        epoch, j = divmod(k, n)
        keys = self._keys.get((source, epoch))
        if keys is None:
            rng = np.random.default_rng([self.seed, source, epoch])
            keys = tuple(int(x) for x in rng.integers(0, 2**63, size=4))
            self._keys[(source, epoch)] = keys
        return epoch * n + permute(j, n, keys)

    # -- drawing --

    def next_batch(self, per_rank: int) -> Batch:
        """This rank's `per_rank` rows of the next global micro-batch of per_rank * W rows."""
        state = (self.sequence, tuple(self.source_sequences))
        _, batch, after = self._prefetched(per_rank, state) if self.prefetch else self._draw(state, per_rank)
        self.sequence, self.source_sequences = after[0], list(after[1])
        return batch

    def _draw(self, state: tuple[int, tuple[int, ...]], per_rank: int):
        """(state, batch, state after it): the micro-batch drawn from `state`. Reads the shards,
        changes nothing but the shard cache (only one thread ever calls it)."""
        sequence, before = state
        total = per_rank * self.world_size
        counts = list(before)
        choices = interleave(self.weights, list(counts), sequence, total)
        mine = range(self.rank * per_rank, (self.rank + 1) * per_rank)
        L = self.seq_len
        ids = np.empty((per_rank, L), dtype=np.int64)
        labels = np.empty((per_rank, L), dtype=np.int64)
        docs = np.empty((per_rank, L), dtype=np.int64)
        sources = []
        for j, src in enumerate(choices):
            k = counts[src]
            counts[src] += 1
            if j not in mine:
                continue
            row = j - mine.start
            tokens, doc = self.streams[src].read(self.window(src, k) * L, L + 1)
            if self.vocab_size is not None and tokens.max() >= self.vocab_size:
                raise ValueError(
                    f"source {self.names[src]!r} holds token id {int(tokens.max())} >= model "
                    f"vocab_size {self.vocab_size}; the shards and the model disagree"
                )
            ids[row], labels[row] = tokens[:-1], tokens[1:]
            d = doc[:-1]
            docs[row] = np.concatenate([[0], np.cumsum(d[1:] != d[:-1])])
            sources.append(self.names[src])
        batch = Batch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(docs), sources)
        if self.pin_memory:
            batch = Batch(batch.input_ids.pin_memory(), batch.labels.pin_memory(), batch.doc_ids.pin_memory(), sources)
        return state, batch, (sequence + total, tuple(counts))

    def _after(self, previous: Future, per_rank: int):
        """The draw that follows `previous` (done already: one thread runs the draws in order)."""
        return self._draw(previous.result()[2], per_rank)

    def _prefetched(self, per_rank: int, state: tuple[int, tuple[int, ...]]):
        """The draw from `state`, taken from the thread's queue (started there on a miss), and
        the queue topped up to `prefetch` draws after it."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loader-prefetch")
        if not self._ahead or self._ahead[0][0] != per_rank:
            self._drop_ahead()
            self._ahead.append((per_rank, self._pool.submit(self._draw, state, per_rank)))
        _, current = self._ahead.popleft()
        while len(self._ahead) < self.prefetch:
            previous = self._ahead[-1][1] if self._ahead else current
            self._ahead.append((per_rank, self._pool.submit(self._after, previous, per_rank)))
        try:
            result = current.result()
        except BaseException:
            self._drop_ahead()  # the draws after it would fail the same way
            raise
        if result[0] != state:  # not reachable: skip and load_state_dict drop the queue
            self._drop_ahead()
            return self._prefetched(per_rank, state)
        return result

    def _drop_ahead(self) -> None:
        """Forget the draws made ahead (the one running finishes; its result is never used)."""
        while self._ahead:
            self._ahead.pop()[1].cancel()

    def close(self) -> None:
        """Stop the prefetch thread and close the open shards; the loader draws again if asked."""
        self._drop_ahead()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.cache.clear()

    def skip(self, sequences: int) -> None:
        """Advance past the next `sequences` global sequences without reading them (data skipped
        after a non-finite loss): the stream then continues as if they had been drawn, on every
        rank and at any world size."""
        if sequences < 0:
            raise ValueError(f"cannot skip {sequences} sequences")
        self._drop_ahead()
        counts = list(self.source_sequences)
        interleave(self.weights, counts, self.sequence, sequences)  # counts as if they had been drawn
        self.source_sequences = counts
        self.sequence += sequences

    # -- accounting --

    def tokens_per_source(self) -> dict[str, int]:
        """Target tokens drawn from each source so far, over all ranks."""
        return {n: k * self.seq_len for n, k in zip(self.names, self.source_sequences, strict=True)}

    def epochs_per_source(self) -> dict[str, float]:
        return {
            n: k * self.seq_len / s.num_tokens
            for n, k, s in zip(self.names, self.source_sequences, self.streams, strict=True)
        }

    # -- resume --

    def state_dict(self) -> dict[str, Any]:
        return {
            "stage": self.plan.stage,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "sequence": self.sequence,
            "source_sequences": dict(zip(self.names, self.source_sequences, strict=True)),
            "tokens_per_source": self.tokens_per_source(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "seq_len"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"data loader state has {key}={state[key]} but this loader has "
                    f"{getattr(self, key)}; resume with the spec that wrote the checkpoint"
                )
        if set(state["source_sequences"]) != set(self.names):
            raise ValueError(
                f"data loader state has sources {sorted(state['source_sequences'])} but the "
                f"mixture plan has {sorted(self.names)}"
            )
        self._drop_ahead()
        self.sequence = int(state["sequence"])
        self.source_sequences = [int(state["source_sequences"][n]) for n in self.names]
