"""The token-shard loader at growing corpus sizes: start-up, peak memory, open files and time per
micro-batch of `model/token_shards.py` against the loader it replaced, projected to the
`smollm3-3b` recipe's stage 1 (4.5B documents in about 41k shards, read by every rank).

    .venv/bin/python benchmarks/loader_scale.py                          # 10^4, 10^5, 10^6 documents
    .venv/bin/python benchmarks/loader_scale.py --sizes 10000,100000 --batches 50

Each size is a synthetic corpus in datatrove's layout (`.ds`, `.ds.index`, `.ds.metadata`),
documents of 1 to 63 tokens in shards of `--docs-per-shard` documents, split 70/30 (by shards) over
two sources of one mixture plan; one more corpus holds the largest size's documents in 10x fewer
shards. Every (loader, corpus) runs in a fresh process, from reading the plan on, as a rank does:

- baseline: the loader as it was: every shard memory-mapped at start-up and every `.index` read
  into memory (uint64, then int64) and concatenated per source, 16-24 bytes per document;
- new: `MixtureLoader` as it is: one file size per shard at start-up, shards opened on demand
  through a bounded cache (`--open-shards`, the spec's default), indexes searched where they are
  mapped; its batches are checked equal to the baseline's, bit for bit, on every corpus.

Measured: start-up (plan and loader), peak RSS (VmHWM, reset just before, less the RSS then), peak
heap (tracemalloc, a second pass: exact and free of page noise, the fit's input), the most open
files on this process's /proc/self/fd, time per micro-batch of 8 x 512 tokens, and for the new
loader the wait in `next_batch` with its prefetch thread under a step three times as long as a
read (a sleep): the stall a training step sees.

Projection to the recipe: start-up and heap as a + b_doc x documents + b_shard x shards (along the
sizes shards grow with documents; the fewer-shards corpus separates the two slopes), from the
largest size; peak RSS is the largest size's plus that heap growth. The last line is the
headline: `loader peak at recipe scale: X GB per rank (baseline: Y GB)`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECIPE_DOCS = 4.5e9  # stage 1 of smollm3-3b: documents every rank indexes
RECIPE_SHARDS = 41_000  # and the shards they are in
SEQ_LEN, PER_RANK = 512, 8


# ---- the corpus ------------------------------------------------------------------------------


def build(root: Path, docs: int, per_shard: int, seed: int = 0) -> Path:
    """A mixture plan over `docs` synthetic documents in shards of `per_shard`; its path."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 64, size=docs)
    tokens = rng.integers(1, 4000, size=int(lengths.sum()), dtype=np.uint16)
    ends = np.cumsum(lengths).astype("<u8")
    shards = -(-docs // per_shard)
    if shards < 2:
        raise SystemExit(f"{docs} documents in shards of {per_shard} make one shard; two sources need two")
    web_shards = min(shards - 1, max(1, round(0.7 * shards)))  # the first 70% of shards: web
    files: dict[str, list[str]] = {"web": [], "code": []}
    for first in range(0, docs, per_shard):
        last = min(docs, first + per_shard)
        name = "web" if first // per_shard < web_shards else "code"
        start = int(ends[first - 1]) if first else 0
        path = root / f"{name}_{first // per_shard:06d}.ds"
        tokens[start : int(ends[last - 1])].tofile(path)
        (ends[first:last] - np.uint64(start)).tofile(str(path) + ".index")
        Path(str(path) + ".metadata").write_text(f"synthetic|2\n{int(ends[last - 1]) - start}\n")
        files[name].append(str(path))
    plan = {
        "stage": "stage1",
        "seed": 0,
        "seq_len": SEQ_LEN,
        "tokens": int(ends[-1]),
        "vocab_size": 4096,
        "eos_id": 0,
        "token_dtype": "uint16",
        "sources": [{"name": n, "weight": w, "files": files[n]} for n, w in (("web", 0.7), ("code", 0.3))],
    }
    path = root / "plan.json"
    path.write_text(json.dumps(plan))
    return path


# ---- the baseline: the loader's sources as they were -------------------------------------------


class BaselineStream:
    """`SourceStream` before the bounded loader (model/token_shards.py at f23f5c5): every shard
    mapped and every index read and checked at start-up, concatenated per source."""

    def __init__(self, plan, token_dtype: str, cache=None) -> None:
        dtype = np.dtype(token_dtype).newbyteorder("<")
        self.name = plan.name
        self.tokens = [np.memmap(f, dtype=dtype, mode="r") for f in plan.files]
        ends = [np.fromfile(f + ".index", dtype="<u8").astype(np.int64) for f in plan.files]
        for f, e, t in zip(plan.files, ends, self.tokens, strict=True):
            if len(e) == 0 or e[-1] != len(t) or np.any(np.diff(e) <= 0):
                raise ValueError(f"{f}.index does not describe {f}")
        self.file_starts = np.concatenate([[0], np.cumsum([len(t) for t in self.tokens])])
        self.num_tokens = int(self.file_starts[-1])
        self.doc_ends = np.concatenate([e + s for e, s in zip(ends, self.file_starts[:-1], strict=True)])
        self.num_docs = len(self.doc_ends)

    def read(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.empty(length, dtype=np.int64)
        docs = np.empty(length, dtype=np.int64)
        done = 0
        while done < length:
            epoch, offset = divmod(start + done, self.num_tokens)
            f = int(np.searchsorted(self.file_starts, offset, side="right") - 1)
            take = min(length - done, int(self.file_starts[f + 1]) - offset)
            local = offset - int(self.file_starts[f])
            tokens[done : done + take] = self.tokens[f][local : local + take]
            doc = np.searchsorted(self.doc_ends, np.arange(offset, offset + take), side="right")
            docs[done : done + take] = doc + epoch * self.num_docs
            done += take
        return tokens, docs


# ---- one measurement, in its own process --------------------------------------------------------


def _status_kb(field: str) -> int:
    """A memory figure of /proc/self/status (VmRSS: resident now, VmHWM: the peak), in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _open_files(folder: str) -> int:
    n = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            n += folder in os.readlink(fd)
        except OSError:
            pass
    return n


def measure(kind: str, plan_path: str, batches: int, open_shards: int) -> dict:
    """Start-up, peak RSS and heap, open files, time per micro-batch and the batches' digest of
    one loader, from reading the plan on (as a trainer rank does)."""
    import tracemalloc

    import model.token_shards as ts

    folder = str(Path(plan_path).parent)
    if kind == "baseline":
        ts.SourceStream = BaselineStream  # the old sources behind the same interleave and windows
    # The peak counts from here: Linux resets VmHWM to the current RSS on "5" (the imports' peak
    # would otherwise hide the loader's); ru_maxrss cannot be reset.
    Path("/proc/self/clear_refs").write_text("5")
    rss0 = _status_kb("VmRSS")
    start = time.perf_counter()
    plan = ts.MixturePlan.load(plan_path)
    loader = ts.MixtureLoader(plan, open_shards=open_shards)
    startup = time.perf_counter() - start
    digest, most_files = hashlib.sha256(), 0
    start = time.perf_counter()
    for _ in range(batches):
        b = loader.next_batch(PER_RANK)
        for t in (b.input_ids, b.labels, b.doc_ids):
            digest.update(t.numpy().tobytes())
        most_files = max(most_files, _open_files(folder))
    per_batch = (time.perf_counter() - start) / batches
    out = {
        "startup_s": startup,
        "peak_mb": max(_status_kb("VmHWM") - rss0, 0) / 1024,
        "open_files": most_files,
        "batch_ms": per_batch * 1e3,
        "digest": digest.hexdigest(),
    }
    state = loader.state_dict()
    del loader, plan, b
    # The heap again, traced (exact and free of page noise, but slow: not timed): the fit's input.
    tracemalloc.start()
    again = ts.MixtureLoader(ts.MixturePlan.load(plan_path), open_shards=open_shards)
    for _ in range(min(batches, 10)):
        again.next_batch(PER_RANK)
    out["heap_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    del again
    if kind == "new":  # the prefetch thread under a step three times as long as a read
        step_s = max(3 * per_batch, 0.005)
        ahead = ts.MixtureLoader(ts.MixturePlan.load(plan_path), open_shards=open_shards, prefetch=2)
        ahead.load_state_dict(state)
        waits = []
        for _ in range(min(batches, 60)):
            t0 = time.perf_counter()
            ahead.next_batch(PER_RANK)
            waits.append(time.perf_counter() - t0)
            time.sleep(step_s)
        ahead.close()
        out["stall_ms"] = float(np.median(waits[2:])) * 1e3  # the first waits fill the queue
        out["step_ms"] = step_s * 1e3
    return out


# ---- the table and the projection ----------------------------------------------------------------


def exponent(x: list[float], y: list[float]) -> float:
    """The slope of log y on log x (how y grows with x), over the positive y."""
    pos = [(xi, yi) for xi, yi in zip(x, y, strict=True) if yi > 0]
    return float(np.polyfit(np.log([p[0] for p in pos]), np.log([p[1] for p in pos]), 1)[0]) if len(pos) > 1 else 0.0


def project(
    line: list[dict], fewer: dict, key: str, at_docs: float = RECIPE_DOCS, at_shards: float = RECIPE_SHARDS
) -> tuple[float, float, float]:
    """(per document, per shard, at `at_docs` documents in `at_shards` shards: the recipe's stage 1 by
    default) of `key` ~ a + b_doc D + b_shard S. `fewer`: the largest size's documents in another
    number of shards (fewer here, more in data_scale.py), which gives b_shard; along the sizes
    the slope is b_doc + b_shard dS/dD (dS/dD = S/D here, where shards grow with documents; 0
    where the sizes hold their shard count, so the line measures b_doc directly). Projected from
    the largest size."""
    docs = np.array([r["docs"] for r in line], dtype=float)
    slope = float(np.polyfit(docs, [r[key] for r in line], 1)[0])
    shards_per_doc = float(np.polyfit(docs, [float(r["shards"]) for r in line], 1)[0])
    top = line[-1]
    per_shard = (top[key] - fewer[key]) / (top["shards"] - fewer["shards"])
    per_doc = slope - per_shard * shards_per_doc
    at = top[key] + max(per_doc, 0.0) * (at_docs - top["docs"]) + max(per_shard, 0.0) * (at_shards - top["shards"])
    return per_doc, per_shard, at


def run(kind: str, plan: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--measure", kind, str(plan), "--batches", str(args.batches)]
    done = subprocess.run([*cmd, "--open-shards", str(args.open_shards)], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{kind} on {plan} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000", help="documents per corpus, comma-separated")
    parser.add_argument("--docs-per-shard", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=100, help="micro-batches of 8 x 512 tokens timed per run")
    parser.add_argument("--open-shards", type=int, default=None, help="the new loader's cache; default: the spec's")
    parser.add_argument("--measure", nargs=2, metavar=("KIND", "PLAN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.open_shards is None:
        from model.spec import LoaderConfig

        args.open_shards = LoaderConfig().open_shards
    if args.measure:
        print(json.dumps(measure(args.measure[0], args.measure[1], args.batches, args.open_shards)))
        return

    sizes = [int(s) for s in args.sizes.split(",")]
    # the sizes, then the largest one's documents in 10x fewer shards (the per-shard share)
    corpora = [(d, args.docs_per_shard) for d in sizes] + [(sizes[-1], 10 * args.docs_per_shard)]
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; open_shards {args.open_shards}")
    rows: dict[str, list[dict]] = {"baseline": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp:
        for i, (docs, per_shard) in enumerate(corpora):
            root = Path(tmp) / str(i)
            root.mkdir()
            t0 = time.perf_counter()
            plan = build(root, docs, per_shard)
            shards = -(-docs // per_shard)
            print(f"{docs:,} documents in {shards} shards built in {time.perf_counter() - t0:.1f}s")
            for kind in rows:
                rows[kind].append(run(kind, plan, args) | {"docs": docs, "shards": shards})
            if rows["new"][-1]["digest"] != rows["baseline"][-1]["digest"]:
                raise SystemExit(f"at {docs} documents the new loader's batches differ from the baseline's")

    print()
    print(
        "| documents | shards | loader | start-up s | peak RSS MB | peak heap MB | open files "
        "| ms / micro-batch | wait with prefetch ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for i in range(len(corpora)):
        for kind in rows:
            r = rows[kind][i]
            stall = f"{r['stall_ms']:.2f} (step {r['step_ms']:.0f})" if "stall_ms" in r else "-"
            print(
                f"| {r['docs']:,} | {r['shards']} | {kind} | {r['startup_s']:.3f} | {r['peak_mb']:.1f} | "
                f"{r['heap_mb']:.2f} | {r['open_files']} | {r['batch_ms']:.2f} | {stall} |"
            )
    print(f"batches equal to the baseline's, bit for bit, on all {len(corpora)} corpora")
    print()
    at = {}
    for kind in rows:
        line, fewer = rows[kind][:-1], rows[kind][-1]
        docs = [r["docs"] for r in line]
        for key, unit in (("startup_s", "s"), ("heap_mb", "MB")):
            per_doc, per_shard, at[kind, key] = project(line, fewer, key)
            print(
                f"{kind:8s} {key:9s} grows as documents^{exponent(docs, [r[key] for r in line]):.2f}: "
                f"{per_doc * 1e6:+.4g} {unit} per million documents, {per_shard * 1e3:+.4g} {unit} per thousand "
                f"shards; at 4.5B documents in 41k shards: {at[kind, key]:,.2f} {unit}"
            )
        # peak RSS at the recipe: the largest size's, plus the heap's growth to the recipe
        at[kind, "peak_mb"] = line[-1]["peak_mb"] + at[kind, "heap_mb"] - line[-1]["heap_mb"]
        print(
            f"{kind:8s} batch_ms  grows as documents^{exponent(docs, [r['batch_ms'] for r in line]):.2f}: "
            f"{line[-1]['batch_ms']:.2f} ms per micro-batch at the largest size"
        )
    files_new = max(r["open_files"] for r in rows["new"])
    print(
        f"open files per rank at recipe scale: {files_new} (at most 2 x {args.open_shards}; baseline: {RECIPE_SHARDS:,})"
    )
    print(f"ratio baseline/new start-up at recipe scale: {at['baseline', 'startup_s'] / at['new', 'startup_s']:,.1f}x")
    print(f"ratio baseline/new peak at recipe scale: {at['baseline', 'peak_mb'] / at['new', 'peak_mb']:,.0f}x")
    print(
        f"loader peak at recipe scale: {at['new', 'peak_mb'] / 1024:.2f} GB per rank "
        f"(baseline: {at['baseline', 'peak_mb'] / 1024:.1f} GB)"
    )


if __name__ == "__main__":
    main()
