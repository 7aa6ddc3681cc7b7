"""The data and control plane at growing sizes, projected to the `smollm3-3b` recipe: the peak
memory and time of every component per process, and whether each stays in issue 33's budgets
(no process above 8 GB, the loader at most 2 GB per rank, the flow process at most 2 GB).

    python benchmarks/data_scale.py                           # 2,000, 20,000 and 200,000 documents
    python benchmarks/data_scale.py --sizes 300 3000 30000 --tasks 2

Every size N is a synthetic corpus of N short documents (~60 common words, 1 in 100 a near
duplicate of an earlier one, 1 in 100 an exact copy), dealt over `--tasks` shards, so a task's
share grows with N as it does at the recipe's scale. The components, each measured in a fresh
process (`python data_scale.py --measure ...`, a new interpreter that imports only what its
component needs) whose peak is its VmHWM (peak resident set of /proc/self/status, the
interpreter and imports included; not `ru_maxrss`, which Linux carries over from the forking
parent across exec), or, where a step runs several datatrove tasks, the `ru_maxrss` of each task
forked from such a process (what the process held at the fork, its imports, included), the
largest task's; the inputs are written beforehand by this process, never by the measured one:

- ingestion: the source step's read, ids and finish stages (curation/ingest.py), measured by
  `benchmarks/ingest_scale.py`'s `measure` (its corpus, its forked tasks): x = documents per task;
- held-out index (curation/heldout.py): its build from N/10 held-out documents of ~100 words in
  `--tasks` shards, by the heldout_index step's stages (`index_stages`: a shard task per
  file, a merge task per partition, at the recipe's `index_partitions`, and one finish task),
  each task forked and run by datatrove's executor: x = n-grams per shard task, per partition,
  and of the index; the heldout_index step's own process meanwhile (the step with its
  executor's tasks forked from it, as a cluster runs them apart: what the flow host holds):
  x = the index's n-grams; and mapping and matching it (what each decontamination task does): x =
  the index's n-grams;
- a curation task: every stage of `curation/stages.py` `plan_stages` (the curate step's own
  plan, preset `--preset`, with the held-out decontamination filter kept in its filter stage, as
  the curate step ran it before the decontaminate step existed: that filter task maps the index
  and reads, filters and writes a shard, so its peak bounds both the curate step's filter task
  and a decontaminate task, whose pipeline is its reader, decontamination filter and writer), each task forked and run by datatrove's executor as a cluster task
  runs it: x = documents per task for the parallel stages, the source's documents for the
  stages whose tasks see all of it (exact-dedup find and MinHash cluster, one task each; MinHash
  buckets, a task per band), held-out documents for the held-out stage. Those four are projected
  thousands of times past the largest size, so their slope is the traced heap's (tracemalloc, a
  second run of the task), which page noise cannot hide, added to the largest RSS measured;
- a tokenization task: the `tokenize` step itself (tasks/tokenize.py, a BPE of 512 tokens, the
  local executor with one worker: its tasks one after another in this process): x = documents per task;
- reasoning data: the `reasoning_data` step's two stages (tasks/reasoning_data.py,
  curation/reasoning_tasks.py) over N synthetic ShareGPT conversations (a question and a
  think-mode reply of ~60 words) in a `files:` JSONL, a BPE of 512 tokens, `--tasks` shards, each
  task forked: the reader (one task streams a `files:`/`hf:` source): x = the source's
  conversations; a render-and-tokenize task: x = conversations per task;
- the tokenizer: the `tokenizer` step (tasks/tokenizer.py: a byte-level BPE at the recipe's
  `tokenizer.vocab_size`) on a sample of N x 1,000 characters (2,000 documents: 2 MB) of
  Zipf-distributed words (exponent 1.1 over 2M distinct words, so new words keep coming as real
  text's do), run in its fresh process as the step's child runs on the flow host: x = sample characters;
- the mixture plan: the `mixture` step (tasks/mixture.py) over N/4 token shards of 10 sources:
  x = shards;
- the loader: `benchmarks/loader_scale.py`'s `build` and `measure` (start-up, its own peak,
  heap, time per micro-batch) on N documents in `LOADER_SHARDS` shards at every size (so the
  shard cache holds as many shards at every size and the line's heap slope is the per-document
  one alone), plus the largest size in 10x more shards (its `project` separates per-document
  and per-shard growth): x = documents (and shards);
- metrics summarising: a stage's metrics file of N lines (the trainer's `MetricsWriter` and
  `benchmarks/metrics_line.py`'s line) read as the flow process reads it (evals/training_metrics.py
  `read_metrics` and `summarize`: the curve file, and the streamed fallback without one): x = lines;
- the run report: the `run_report` step over 3 stages of N/3 metrics lines each: x = lines.

Fits and projection: per part, the log-log slope of peak and of time against x (how it grows:
~0 flat, ~1 linear), and a least-squares line peak = a + b x; at the recipe's x the projection is
a + max(b, 0) x, never below the largest measured peak (so a flat part projects to about what
was measured, and noise in b can only raise it). The recipe's x comes from the recipe and the
data plan (`flows/data_plan.py` `source_sizes`: each source's documents and tasks), never from
constants here. The last line is `worst per-process peak at recipe scale: X GB (component)`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

GB = 1e9
WORDS = (
    "the of and to in is was for on that with as by at from this are be or an it not which have one had "
    "all were when we there can more if out so what up about into than them only other new some could time"
).split()
# curation stages whose tasks see every document of the source (a band of each, for buckets), so
# their x at the recipe is thousands of times the largest measured: their slope is taken from the
# traced heap, where page noise cannot hide a slow growth
WHOLE_SOURCE = ("exact", "buckets", "cluster", "heldout")
# likewise the held-out index's merge (a partition: x at the recipe ~60 times the largest here)
# and finish (the whole index) tasks
TRACED_INDEX = ("index_merge", "index_finish")
STAGES_IN_REPORT = 3  # stages of the synthetic run the report step draws
HELDOUT_WORDS = 100  # words of a synthetic held-out document
MIXTURE_SOURCES = 10
LOADER_SHARDS = 40  # the loader's corpus at every size; the largest size again in 10x as many

# --- the parts measured: (component, where it runs, what x counts, budget in GB) ---------------------
TASK, FLOW, RANK = 8.0, 2.0, 2.0  # issue 33's goals: any process, the flow process, a loader rank
PARTS: dict[str, tuple[str, str, str, float]] = {
    "ingest read": ("ingestion", "cluster task", "documents per task", TASK),
    "ingest ids": ("ingestion", "cluster task", "ids per bucket", TASK),
    "ingest finish": ("ingestion", "cluster task", "documents per task", TASK),
    "heldout shards": ("held-out index", "cluster task", "n-grams per shard task", TASK),
    "heldout merge": ("held-out index", "cluster task (1 per partition)", "n-grams per partition", TASK),
    "heldout finish": ("held-out index", "cluster task (1)", "index n-grams", TASK),
    "heldout step": ("held-out index", "heldout_index step process (flow host)", "index n-grams", FLOW),
    "heldout load": ("held-out index", "cluster task", "index n-grams", TASK),
    "curate filter": ("curation task", "cluster task", "documents per task", TASK),
    "curate exact": ("curation task", "cluster task (1)", "source documents", TASK),
    "curate unique": ("curation task", "cluster task", "documents per task", TASK),
    "curate buckets": ("curation task", "cluster task (1 per band)", "source documents", TASK),
    "curate cluster": ("curation task", "cluster task (1)", "source documents", TASK),
    "curate final": ("curation task", "cluster task", "documents per task", TASK),
    "curate heldout": ("curation task", "cluster task (1)", "held-out documents", TASK),
    "tokenize task": ("tokenization task", "cluster task", "documents per task", TASK),
    "reasoning read": ("reasoning data", "cluster task (1 per hub source)", "conversations of the source", TASK),
    "reasoning task": ("reasoning data", "cluster task", "conversations per task", TASK),
    "tokenizer train": ("tokenizer", "cluster task (1)", "sample characters", TASK),
    "mixture plan": ("mixture plan", "flow process", "token shards", FLOW),
    "loader rank": ("loader", "training rank", "documents", RANK),
    "metrics curve": ("metrics summarising", "flow process", "metrics lines", FLOW),
    "metrics stream": ("metrics summarising", "flow process", "metrics lines", FLOW),
    "run report": ("run report", "flow process", "metrics lines of the run", FLOW),
}


# ---- synthetic inputs ----------------------------------------------------------------------------


def texts(n: int, seed: int = 0, words: int = 60) -> list[str]:
    """`n` documents of `words` common words; 1 in 100 a near duplicate (its source's words with
    one changed), 1 in 100 an exact copy of an earlier document."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(n):
        r = rng.random()
        if i > 10 and r < 0.01:
            out.append(out[rng.randrange(i)])
        elif i > 10 and r < 0.02:
            w = out[rng.randrange(i)].split()
            w[rng.randrange(len(w))] = rng.choice(WORDS)
            out.append(" ".join(w))
        else:
            out.append(f"doc{i} " + " ".join(rng.choice(WORDS) for _ in range(words)))
    return out


def write_shards(folder: Path, docs: list[str], shards: int, prefix: str = "d") -> None:
    """`docs` as `shards` gzip JSONL files of contiguous blocks, as the source step writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(docs) // shards)
    for s in range(shards):
        with gzip.open(folder / f"{s:05d}.jsonl.gz", "wt", encoding="utf-8") as fh:
            for i in range(s * per, min(len(docs), (s + 1) * per)):
                fh.write(json.dumps({"id": f"{prefix}{i}", "text": docs[i]}) + "\n")


def forked_peak(run) -> int:
    """Peak resident bytes of a task forked from this process (benchmarks/ingest_scale.py's)."""
    from ingest_scale import forked_peak as peak

    return peak(run)


def forked_heap(run) -> int:
    """Peak traced heap bytes (tracemalloc: Python's and numpy's allocations, exact and free of
    page noise, but slow) of a task forked from this process."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            import tracemalloc

            tracemalloc.start()
            run()
            os.write(write, str(tracemalloc.get_traced_memory()[1]).encode())
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    os.close(write)
    _, status, _ = os.wait4(pid, 0)
    with os.fdopen(read) as fh:
        got = fh.read()
    if status != 0:
        raise RuntimeError(f"a traced task failed (status {status}); its traceback is above")
    return int(got)


# ---- the measurements, each in a fresh process ----------------------------------------------------


def m_ingest(work: Path, n: int, args: argparse.Namespace) -> list[dict]:
    from ingest_scale import measure

    per_file = -(-n // args.tasks)
    r = measure(n, per_file, args.cap)
    x = n / r["tasks"]
    return [
        {"part": f"ingest {s}", "x": x, "peak": r[s], "seconds": r["seconds"] / 3} for s in ("read", "ids", "finish")
    ]


def _heldout_docs(n: int) -> list[tuple[str, str]]:
    return [(f"held/{i}", t) for i, t in enumerate(texts(max(n // 10, 2), seed=1, words=HELDOUT_WORDS))]


def _index_plan(work: Path):
    from curation.heldout import HeldoutFile, IndexPlan
    from tasks.curate import DecontaminationConfig

    files = tuple(HeldoutFile(str(p), "held", False) for p in sorted((work / "heldout").iterdir()))
    return IndexPlan(files, work / "index", 8, DecontaminationConfig().index_partitions, len(files))


def m_heldout_build(work: Path, n: int, args: argparse.Namespace) -> list[dict]:
    """The index's three stages, each task forked and run as a cluster runs it; the index lands
    at `work/index/index` for `m_heldout_load`."""
    from curation.executors import make_executors
    from curation.heldout import HeldoutIndex, index_stages
    from tasks.curate import CurationConfig

    plan = _index_plan(work)
    stages = index_stages(plan)
    config = CurationConfig(workers=1)
    rows = []
    for (name, _, tasks), ex in zip(stages, make_executors(config, stages, work / "logs"), strict=True):
        start = time.perf_counter()
        peak = max(forked_peak(lambda ex=ex, r=r: ex._run_for_rank(r)) for r in range(tasks))
        seconds = (time.perf_counter() - start) / tasks
        rows.append({"part": f"heldout {name.removeprefix('index_')}", "peak": peak, "seconds": seconds})
        if name in TRACED_INDEX:  # x at the recipe far past the largest size: the traced heap's slope
            for r in range(tasks):
                (work / "logs" / name / "completions" / f"{r:05d}").unlink()
            rows[-1]["heap"] = max(forked_heap(lambda ex=ex, r=r: ex._run_for_rank(r)) for r in range(tasks))
    heads = [json.loads(p.read_text()) for p in sorted((plan.folder / "shards").glob("*/shard.json"))]
    per_partition = [sum(h["ngrams"][p] for h in heads) for p in range(plan.partitions)]
    rows[0]["x"] = max(sum(h["ngrams"]) for h in heads)
    rows[1]["x"] = max(per_partition)
    rows[2]["x"] = HeldoutIndex.read_header(plan.index)["ngrams"]
    return rows


def m_heldout_step(work: Path, n: int, args: argparse.Namespace) -> list[dict]:
    """The heldout_index step's own process (tasks/heldout_index.py: it lists the held-out shards,
    runs the index's stages and reads `index.json`) with every task of its executor forked from it
    and run apart, as Slurm or Ray run them: its peak is what the flow host holds for the index,
    built once per DAG."""
    import tracemalloc

    import tasks.heldout_index as index_module
    from pipeline.artifact import Artifact

    apart = [0.0]  # seconds in the tasks, not the step's own
    heap = [0]  # the step's traced heap at its peak (an upper bound: see below)

    def run_apart(config, executors, logs, log) -> None:
        # the tasks run untraced (tracemalloc would slow them and they are not this process);
        # the heap held while they run is counted under what is allocated after
        live, peak = tracemalloc.get_traced_memory()
        heap[0] = max(heap[0], peak)
        tracemalloc.stop()
        t0 = time.perf_counter()
        for ex in executors:
            for r in range(ex.world_size):
                forked_peak(lambda ex=ex, r=r: ex._run_for_rank(r))
        apart[0] += time.perf_counter() - t0
        tracemalloc.start()
        heap.append(live)

    index_module.run_executors = run_apart
    meta = {"source": "held", "domain": "web", "format": "jsonl"}
    corpus = Artifact(kind="corpus", uri=str(work), fingerprint="2" * 64, meta=meta)
    config = index_module.HeldoutIndexSpec(presets={"held": args.preset}, tasks=args.tasks, workers=1)
    out = work / "step"
    out.mkdir()
    start = time.perf_counter()
    tracemalloc.start()
    got = index_module.heldout_index(config, [corpus], out=out, log=lambda _: None)
    traced = max(heap[0], heap[-1] + tracemalloc.get_traced_memory()[1])
    tracemalloc.stop()
    seconds = time.perf_counter() - start - apart[0]
    x = got["heldout_index"]["ngrams"]
    return [{"part": "heldout step", "x": x, "seconds": seconds, "heap": traced}]


def m_heldout_load(work: Path, n: int, args: argparse.Namespace) -> list[dict]:
    from datatrove.data import Document

    from curation.heldout import HeldoutDecontFilter

    start = time.perf_counter()
    task = HeldoutDecontFilter(str(work / "index" / "index"), 0.5, 50)
    kept = sum(task.filter(Document(text=t, id=str(i))) is True for i, t in enumerate(texts(1000, seed=2)))
    grams = len(task._index.grams)  # mapped by the first document, as in a curation task
    return [{"part": "heldout load", "x": grams, "seconds": time.perf_counter() - start, "kept": kept}]


def m_curate(work: Path, n: int, args: argparse.Namespace) -> list[dict]:
    from curation.executors import make_executors
    from curation.stages import plan_stages
    from tasks.curate import CurationConfig

    held = json.loads((work / "heldout.json").read_text())["documents"]  # not the index: tasks load it
    config = CurationConfig(tasks=args.tasks, workers=1, removed_samples=0)
    out = work / "out"
    stages = plan_stages(
        config, args.preset, work / "train", out, args.tasks, heldout=work / "heldout", index=work / "index"
    )
    rows = []
    for (name, _, tasks), ex in zip(stages, make_executors(config, stages, out / "logs"), strict=True):
        start = time.perf_counter()
        peak = max(forked_peak(lambda ex=ex, r=r: ex._run_for_rank(r)) for r in range(tasks))
        seconds = (time.perf_counter() - start) / tasks
        x = {"exact": n, "cluster": n, "heldout": held, "buckets": n}.get(name, n / tasks)
        rows.append({"part": f"curate {name}", "x": x, "peak": peak, "seconds": seconds})
        if name in WHOLE_SOURCE:  # a task that sees the whole source: its growth, exactly, traced once more
            (out / "logs" / name / "completions" / "00000").unlink()  # or datatrove skips the done rank
            rows[-1]["heap"] = forked_heap(lambda ex=ex: ex._run_for_rank(0))
    return rows


def m_tokenize(work: Path, n: int, args: argparse.Namespace) -> list[dict]:
    from pipeline.artifact import Artifact
    from tasks.tokenize import TokenizeConfig, TokenizeSpec, tokenize

    meta = json.loads((work / "tokenizer" / "meta.json").read_text())
    tok = Artifact(kind="tokenizer", uri=str(work / "tokenizer"), fingerprint="0" * 64, meta=meta)
    corpus = Artifact(kind="corpus", uri=str(work), fingerprint="1" * 64, meta={"source": "web", "documents": n})
    spec = TokenizeSpec(tokenize=TokenizeConfig(tasks=args.tasks, workers=1))
    start = time.perf_counter()
    got = tokenize(spec, tok, corpus, out=work / "shards", log=lambda _: None)
    seconds = (time.perf_counter() - start) / args.tasks
    return [{"part": "tokenize task", "x": got["documents"] / args.tasks, "seconds": seconds}]


def m_reasoning(work: Path, n: int, args: argparse.Namespace) -> list[dict]:
    from curation.bpe import selected_tokenizer
    from curation.executors import make_executors
    from curation.reasoning_tasks import merge_counts, tokenize_pipeline
    from pipeline.artifact import Artifact
    from tasks.reasoning_data import ReasoningDataConfig, ReasoningDataSpec, _reader

    meta = json.loads((work / "tokenizer" / "meta.json").read_text())
    tok = Artifact(kind="tokenizer", uri=str(work / "tokenizer"), fingerprint="0" * 64, meta=meta)
    data = ReasoningDataConfig(
        name="traces", uri=f"files:{work}/convs.jsonl", examples=n, messages_field="conversations"
    )
    spec = ReasoningDataSpec(data=data, shards=args.tasks, workers=1)
    out = work / "out"
    reader, read_tasks = _reader(spec, (), out / "work")
    (ex,) = make_executors(spec, [("read", [reader], read_tasks)], out / "logs")
    start = time.perf_counter()
    read_peak = forked_peak(lambda: ex._run_for_rank(0))
    read_s = time.perf_counter() - start
    convs = merge_counts(out / "work", read_tasks)["conversations"]
    pipeline = tokenize_pipeline(out / "work", out, selected_tokenizer(tok), "traces", 0, spec.batch_size)
    (ex,) = make_executors(spec, [("tokenize", pipeline, args.tasks)], out / "logs")
    start = time.perf_counter()
    peak = max(forked_peak(lambda r=r: ex._run_for_rank(r)) for r in range(args.tasks))
    seconds = (time.perf_counter() - start) / args.tasks
    tokens = sum(f.stat().st_size // 2 for f in out.glob("*.ds"))
    return [
        {"part": "reasoning read", "x": convs, "peak": read_peak, "seconds": read_s},
        {"part": "reasoning task", "x": convs / args.tasks, "peak": peak, "seconds": seconds, "tokens": tokens},
    ]


def m_tokenizer(work: Path, n: int, args: argparse.Namespace) -> list[dict]:
    from pipeline.artifact import Artifact
    from tasks.tokenizer import TokenizerConfig, tokenizer

    chars = n * SAMPLE_CHARS_PER_DOCUMENT
    corpus = Artifact(kind="corpus", uri=str(work), fingerprint="1" * 64, meta={"source": "web"})
    start = time.perf_counter()
    out = work / "tok"
    out.mkdir()
    got = tokenizer(TokenizerConfig(vocab_size=args.vocab, sample_chars=chars), (corpus,), out=out, log=lambda _: None)
    seconds = time.perf_counter() - start
    return [{"part": "tokenizer train", "x": got["sample_chars"], "seconds": seconds, "vocab": got["vocab_size"]}]


def m_mixture(work: Path, n: int, args: argparse.Namespace) -> list[dict]:
    from pipeline.artifact import Artifact
    from tasks.mixture import MixtureSpec, mixture

    per = max(1, n // 40)  # token shards per source: N/4 in all
    names = [f"s{i}" for i in range(MIXTURE_SOURCES)]
    (work / "mix.yaml").write_text("weights:\n" + "".join(f"  {s}: {1 / len(names)}\n" for s in names))
    arts = tuple(
        Artifact(
            kind="shards",
            uri=str(work / "ws" / "tokenize" / s),
            fingerprint=f"{i:064d}",
            meta={
                "source": s,
                "tokens": 10**9,
                "files": [f"{s}_{k:05d}.ds" for k in range(per)],
                "vocab_size": 128256,
                "eos_id": 0,
                "token_dtype": "uint32",
            },
        )
        for i, s in enumerate(names)
    )
    out = work / "ws" / "mixture" / "plan"
    out.mkdir(parents=True)
    spec = MixtureSpec(name="stage1", mixture=str(work / "mix.yaml"), tokens=10**10, seq_len=4096)
    start = time.perf_counter()
    mixture(spec, arts, out=out, log=lambda _: None)
    return [{"part": "mixture plan", "x": per * len(names), "seconds": time.perf_counter() - start}]


def m_loader(work: Path, n: int, args: argparse.Namespace) -> list[dict]:
    from loader_scale import measure

    from model.spec import LoaderConfig

    got = measure("new", str(work / args.plan), 30, LoaderConfig().open_shards)
    return [{"part": "loader rank", "x": n, "seconds": got["startup_s"], **got}]


def m_metrics(work: Path, n: int, args: argparse.Namespace) -> list[dict]:
    from evals.training_metrics import read_metrics, summarize

    path = work / "stage0" / "metrics.jsonl"
    if args.stream:
        path.with_name("metrics.curve.jsonl").unlink()
    start = time.perf_counter()
    rows = read_metrics(path)
    summarize(rows)
    part = "metrics stream" if args.stream else "metrics curve"
    return [{"part": part, "x": n, "seconds": time.perf_counter() - start, "rows": len(rows)}]


def m_report(work: Path, n: int, args: argparse.Namespace) -> list[dict]:
    from pipeline.artifact import Artifact
    from tasks.run_report import RunReportSpec, run_report

    labels = tuple(f"stage{i}" for i in range(STAGES_IN_REPORT))
    arts = tuple(
        Artifact(kind="checkpoint", uri=str(work / s), fingerprint=f"{i:064d}", meta={"kind": "pretrain"})
        for i, s in enumerate(labels)
    )
    out = work / "report"
    out.mkdir()
    start = time.perf_counter()
    run_report(RunReportSpec(stages=labels), stages=arts, evals=(), out=out, log=lambda _: None)
    return [{"part": "run report", "x": n, "seconds": time.perf_counter() - start}]


# the recipe section whose Slurm request a cluster task's part runs under (else curation's)
SECTION_OF = {"tokenize task": "tokenize", "reasoning read": "tokenize", "reasoning task": "tokenize"}
SECTION_OF["tokenizer train"] = "tokenizer"

COMPONENTS = (
    "ingest",
    "heldout",
    "curate",
    "tokenize",
    "reasoning",
    "tokenizer",
    "mixture",
    "loader",
    "metrics",
    "report",
)
MEASURES = {
    "ingest": m_ingest,
    "heldout_build": m_heldout_build,
    "heldout_load": m_heldout_load,
    "heldout_step": m_heldout_step,
    "curate": m_curate,
    "tokenize": m_tokenize,
    "reasoning": m_reasoning,
    "tokenizer": m_tokenizer,
    "mixture": m_mixture,
    "loader": m_loader,
    "metrics": m_metrics,
    "report": m_report,
}


def vm_hwm() -> int:
    """This process's peak resident bytes since it started (VmHWM: the interpreter, imports and
    work; the peak of the forking parent, which `ru_maxrss` keeps across exec, is not in it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def fresh(what: str, work: Path, n: int, args: argparse.Namespace, *extra: str) -> list[dict]:
    """Run a measurement in a fresh interpreter; its rows (each with its peak: the process's
    VmHWM, or a forked task's own)."""
    cmd = [sys.executable, __file__, "--measure", what, str(work), str(n), "--tasks", str(args.tasks)]
    cmd += ["--cap", str(args.cap), "--preset", args.preset, "--vocab", str(args.vocab), *extra]
    with open(work / f"{what}.out", "w") as out, open(work / f"{what}.err", "w") as err:
        proc = subprocess.run(cmd, stdout=out, stderr=err, cwd=REPO, check=False)
    if proc.returncode:
        tail = (work / f"{what}.err").read_text()[-3000:]
        raise SystemExit(f"measuring {what} at {n:,} documents failed (exit {proc.returncode}):\n{tail}")
    return json.loads((work / f"{what}.out").read_text().strip().splitlines()[-1])


# ---- preparing the inputs of one size (in this process: not measured) ----------------------------


def prepare_heldout(work: Path, n: int, tasks: int) -> None:
    """N/10 held-out documents in `tasks` shards, and a train split of as many documents (the
    held-out step's filter stage reads it)."""
    held = _heldout_docs(n)
    write_shards(work / "heldout", [t for _, t in held], tasks, prefix="held/")
    write_shards(work / "train", texts(len(held), seed=3), tasks)


def prepare_curate(work: Path, n: int, tasks: int) -> None:
    """A source's train shards and held-out split, and the index of its held-out documents."""
    from curation.heldout import HeldoutIndex

    held = _heldout_docs(n)
    write_shards(work / "train", texts(n), tasks)
    write_shards(work / "heldout", [t for _, t in held], 1, prefix="held/")
    HeldoutIndex.build(held, 8).save(work / "index")
    (work / "heldout.json").write_text(json.dumps({"documents": len(held)}))


def prepare_tokenize(work: Path, n: int, tasks: int) -> None:
    from curation.bpe import save_hf_tokenizer, train_bpe

    docs = texts(n)
    write_shards(work / "train", docs, tasks)
    meta = save_hf_tokenizer(train_bpe(iter(docs[:2000]), 512), work / "tokenizer")
    (work / "tokenizer" / "meta.json").write_text(json.dumps(meta))


def prepare_reasoning(work: Path, n: int) -> None:
    """`n` ShareGPT conversations (a question, a think-mode reply of ~60 words) and a BPE."""
    from curation.bpe import save_hf_tokenizer, train_bpe

    replies = texts(n, seed=4)
    with open(work / "convs.jsonl", "w", encoding="utf-8") as fh:
        for i, reply in enumerate(replies):
            turns = [
                {"from": "human", "value": f"What is {i} + {i % 97}?"},
                {"from": "gpt", "value": f"<think>\n{reply}\n</think>\nAnswer: {i + i % 97}"},
            ]
            fh.write(json.dumps({"conversations": turns}) + "\n")
    meta = save_hf_tokenizer(train_bpe(iter(replies[:2000]), 512), work / "tokenizer")
    (work / "tokenizer" / "meta.json").write_text(json.dumps(meta))


SAMPLE_CHARS_PER_DOCUMENT = 1000  # the tokenizer's sample: N x this many characters
ZIPF_WORDS = 2_000_000  # distinct words of the tokenizer's synthetic text


def prepare_tokenizer(work: Path, n: int) -> None:
    """A corpus's train shards of N x 1,000 characters of Zipf-distributed words (documents of ~5,000)."""
    import numpy as np

    chars = n * SAMPLE_CHARS_PER_DOCUMENT
    rng = np.random.default_rng(0)
    letters = "etaoinshrdlcumwfgypbvkjxqz"

    def word(rank: int) -> str:
        out = ""
        while True:
            rank, d = divmod(rank, 26)
            out += letters[d]
            if not rank:
                return out

    folder = work / "train"
    folder.mkdir(parents=True)
    written, shard = 0, 0
    while written < chars:
        with gzip.open(folder / f"{shard:05d}.jsonl.gz", "wt", encoding="utf-8") as fh:
            for _ in range(2000):
                ranks = (rng.zipf(1.1, 850) - 1) % ZIPF_WORDS
                text = " ".join(word(int(r)) for r in ranks)
                fh.write(json.dumps({"text": text}) + "\n")
                written += len(text)
                if written >= chars:
                    break
        shard += 1


def prepare_metrics(folder: Path, lines: int, log_interval: int = 10) -> None:
    """A stage folder whose trainer wrote `lines` metrics lines (and their curve file)."""
    from metrics_line import summary_line

    from model.spec import curve_stride
    from trainers.pretrain import MetricsWriter

    folder.mkdir(parents=True)
    steps = lines * log_interval
    (folder / "spec.json").write_text(json.dumps({"steps": steps, "global_batch": 576, "seq_len": 4096}))
    writer = MetricsWriter(folder / "metrics.jsonl", True, 0, curve_stride(steps, log_interval), log_interval)
    line = summary_line(1)
    for i in range(1, lines + 1):
        step = i * log_interval
        writer.write({**line, "step": step, "loss": 2.0 + 1.0 / i}, step, i == lines)


def measure_size(n: int, args: argparse.Namespace, tmp: Path, plan: dict | None) -> list[dict]:
    """Every part at `n` documents; `plan` also measures the loader on the more-shards corpus."""
    rows: list[dict] = []

    def folder(name: str) -> Path:
        p = tmp / f"{name}-{n}"
        p.mkdir()
        return p

    want = set(args.components)
    if "ingest" in want:
        rows += fresh("ingest", folder("ingest"), n, args)
    if "heldout" in want:
        held = folder("heldout")
        prepare_heldout(held, n, args.tasks)
        rows += fresh("heldout_build", held, n, args)
        rows += fresh("heldout_load", held, n, args)
        step = folder("heldout-step")
        prepare_heldout(step, n, args.tasks)
        rows += fresh("heldout_step", step, n, args)
    if "curate" in want:
        cur = folder("curate")
        prepare_curate(cur, n, args.tasks)
        rows += fresh("curate", cur, n, args)
    if "tokenize" in want:
        tok = folder("tokenize")
        prepare_tokenize(tok, n, args.tasks)
        rows += fresh("tokenize", tok, n, args)
    if "reasoning" in want:
        rea = folder("reasoning")
        prepare_reasoning(rea, n)
        rows += fresh("reasoning", rea, n, args)
    if "tokenizer" in want:
        bpe = folder("tokenizer")
        prepare_tokenizer(bpe, n)
        rows += fresh("tokenizer", bpe, n, args)
    if "mixture" in want:
        rows += fresh("mixture", folder("mixture"), n, args)
    if "loader" in want:
        from loader_scale import build

        # Every size in the same number of shards, so the line's slope is the per-document one
        # alone: with shards growing along the sizes (as this did before 2026-12-05 06:40 UTC)
        # the shard cache fills (a few kB per open shard, up to `open_shards`) as the sizes grow,
        # and that bounded step, not linear in anything, was fitted as 0.2 bytes per document
        # (1.7 GB at the recipe); at a fixed shard count the heap is flat from 2*10^4 to 2*10^6
        # documents (docs/scale.md, "The trainer's data loader").
        load = folder("loader")
        per_shard = -(-n // LOADER_SHARDS)
        build(load, n, per_shard)
        rows += [r | {"shards": -(-n // per_shard)} for r in fresh("loader", load, n, args, "--plan", "plan.json")]
        if plan is not None:  # the largest size in 10x more shards: the loader's per-shard share
            more = folder("loader-more")
            per_shard = -(-n // (10 * LOADER_SHARDS))
            build(more, n, per_shard)
            got = fresh("loader", more, n, args, "--plan", "plan.json")[0]
            plan["fewer"] = got | {"docs": n, "shards": -(-n // per_shard)}
    if "metrics" in want:
        met = folder("metrics")
        prepare_metrics(met / "stage0", n)
        rows += fresh("metrics", met, n, args)
        rows += fresh("metrics", met, n, args, "--stream")
    if "report" in want:
        rep = folder("report")
        for i in range(STAGES_IN_REPORT):
            prepare_metrics(rep / f"stage{i}", max(n // STAGES_IN_REPORT, 1))
        rows += fresh("report", rep, n, args)
    return rows


# ---- the recipe's scale ------------------------------------------------------------------------------


def recipe_scale(recipe: Any) -> dict[str, Any]:
    """Each part's x at the recipe's scale, from the recipe and its data plan (flows/data_plan.py)."""
    from curation.mixtures import load_weights
    from flows.data_plan import WORDS_PER_DOCUMENT, heldout_index_documents, source_sizes
    from flows.stage_plan import stage_steps

    sizes = {s.name: s for s in source_sizes(recipe)}
    largest = max(sizes.values(), key=lambda s: s.documents)
    per_read = max(s.documents / max(s.read_tasks, 1) for s in sizes.values())
    per_bucket = (
        max(s.documents / s.id_buckets for s in sizes.values() if s.id_buckets)
        if any(s.id_buckets for s in sizes.values())
        else per_read
    )
    per_curate = max(s.documents / s.curate_tasks for s in sizes.values())
    per_tokenize = max(s.documents / s.tokenize_tasks for s in sizes.values())
    indexed = heldout_index_documents(recipe)
    cap = recipe.curation.heldout.max_docs
    held_docs = cap if cap is not None else largest.documents * 0.05
    stage_docs, stage_shards, lines = {}, {}, {}
    for stage in recipe.stages:
        used = [n for n, w in load_weights(stage.mixture).items() if w > 0 and n in sizes]
        stage_docs[stage.name] = sum(sizes[n].documents for n in used)
        stage_shards[stage.name] = sum(sizes[n].tokenize_tasks for n in used)
        interval = getattr(stage, "log_interval", None) or recipe.training.log_interval
        lines[stage.name] = -(-stage_steps(stage, recipe.training) // interval)
    loader_stage = max(stage_docs, key=stage_docs.get)
    # reasoning data: a files:/hf: source is read by one task; its conversations in tokenize.tasks shards
    reasoning = [(r.examples, 1 if r.uri != "builtin" else recipe.tokenize.tasks) for r in recipe.reasoning_data]
    reasoning_read = max((n / tasks for n, tasks in reasoning), default=0)
    reasoning_task = max((n / min(recipe.tokenize.tasks, n) for n, _ in reasoning), default=0)
    ngrams = (indexed if indexed is not None else largest.documents * 0.05 * len(sizes)) * WORDS_PER_DOCUMENT
    # a shard task per held-out file, at most curation.tasks: every source's split is one file
    # at least, so its n-grams per task are at most the index's over this many tasks
    shard_tasks = min(recipe.curation.tasks, len(sizes))
    return {
        "x": {
            "ingest read": per_read,
            "ingest ids": per_bucket,
            "ingest finish": per_read,
            "heldout shards": ngrams / shard_tasks,
            "heldout merge": ngrams / recipe.curation.decontamination.index_partitions,
            "heldout finish": ngrams,
            "heldout step": ngrams,
            "heldout load": ngrams,
            "curate filter": per_curate,
            "curate exact": largest.documents,
            "curate unique": per_curate,
            "curate buckets": largest.documents,
            "curate cluster": largest.documents,
            "curate final": per_curate,
            "curate heldout": held_docs,
            "tokenize task": per_tokenize,
            "reasoning read": reasoning_read,
            "reasoning task": reasoning_task,
            "tokenizer train": 0 if recipe.tokenizer.path else recipe.tokenizer.sample_chars,
            "mixture plan": max(stage_shards.values()),
            "loader rank": stage_docs[loader_stage],
            "metrics curve": max(lines.values()),
            "metrics stream": max(lines.values()),
            "run report": sum(lines.values()),
        },
        "loader_stage": loader_stage,
        "loader_shards": stage_shards[loader_stage],
        "largest": largest.name,
        "ranks": recipe.launch.nodes * recipe.launch.gpus_per_node,
        # what a task asks its Slurm partition for, per section, where the recipe says: curation's
        # (the source step's, the index's and decontamination's too), tokenize's (the reasoning
        # traces' too) and the tokenizer's own
        "task_requests_gb": {
            name: section.slurm.cpus_per_task * section.slurm.mem_per_cpu_gb
            for name, section in (
                ("curation", recipe.curation),
                ("tokenize", recipe.tokenize),
                ("tokenizer", recipe.tokenizer),
            )
            if section.executor == "slurm" and section.slurm
        },
        "sources": len(sizes),
        "tokens": sum(s.tokens for s in recipe.stages),
    }


# ---- fits and projection ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    """How y grows with x over the measured sizes."""

    a: float  # least-squares y = a + b x
    b: float
    exponent: float  # log-log slope of y on x (0: flat, 1: linear)


def fit(xs: list[float], ys: list[float]) -> Fit:
    """The line and the log-log slope of `ys` against `xs` (at least two distinct x)."""
    if len(set(xs)) < 2:
        raise ValueError(f"a fit needs two distinct sizes, got x = {xs}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    lx = [math.log(x) for x, y in zip(xs, ys, strict=True) if y > 0]
    ly = [math.log(y) for y in ys if y > 0]
    if len(set(lx)) < 2:
        exponent = 0.0
    else:
        mlx, mly = sum(lx) / len(lx), sum(ly) / len(ly)
        exponent = sum((u - mlx) * (v - mly) for u, v in zip(lx, ly, strict=True)) / sum((u - mlx) ** 2 for u in lx)
    return Fit(my - b * mx, b, exponent)


def project(f: Fit, ys: list[float], x: float) -> float:
    """y at `x`: the line, with a negative slope taken as flat, never below the largest y measured."""
    return max(max(ys), f.a + max(f.b, 0.0) * x)


def growth(exponent: float) -> str:
    if exponent < 0.15:
        return "flat"
    if exponent < 0.85:
        return "sublinear"
    return "linear" if exponent < 1.15 else "superlinear"


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:,.1f} h"


def projections(rows: list[dict], scale: dict, fewer: dict | None) -> list[dict]:
    """One line per part: its fits and its peak and time at the recipe's x."""
    out = []
    for part in PARTS:
        mine = sorted((r for r in rows if r["part"] == part), key=lambda r: r["x"])
        if not mine:
            continue
        xs, peaks, secs = [r["x"] for r in mine], [r["peak"] for r in mine], [r["seconds"] for r in mine]
        mem, tim = fit(xs, peaks), fit(xs, secs)
        at = scale["x"][part]
        peak_at = project(mem, peaks, at)
        note, slope = "", mem.b
        if all("heap" in r for r in mine):
            # the traced heap's slope (exact) instead of the RSS's (page noise hides a slow growth)
            heap = fit(xs, [r["heap"] for r in mine])
            peak_at, slope = max(peaks) + max(heap.b, 0.0) * max(at - xs[-1], 0.0), heap.b
            note = (
                f"traced heap {mine[0]['heap'] / 1e6:,.1f} -> {mine[-1]['heap'] / 1e6:,.1f} MB, "
                f"{heap.b:,.1f} bytes per unit of x (the projection's slope)"
            )
        if part == "loader rank" and fewer is not None:
            # documents and shards apart (loader_scale.project), on the loader's own heap
            from loader_scale import project as two_slopes

            line = [r | {"docs": r["x"]} for r in mine]
            per_doc, per_shard, heap_at = two_slopes(line, fewer, "heap_mb", at, scale["loader_shards"])
            peak_at = mine[-1]["peak"] + max(heap_at - mine[-1]["heap_mb"], 0.0) * 2**20
            note = (
                f"{per_doc * 1e6:+.3g} MB heap per million documents, {per_shard * 1e3:+.3g} MB per thousand shards "
                f"({scale['loader_shards']:,} shards); {mine[-1]['batch_ms']:.1f} ms per micro-batch at the largest size"
            )
        out.append(
            {
                "part": part,
                "fit": mem,
                "time_fit": tim,
                "x_at": at,
                "peak_at": peak_at,
                "seconds_at": project(tim, secs, at),
                "budget": PARTS[part][3],
                "note": note,
                "slope": slope,
                "rows": mine,
            }
        )
    return out


def report(rows: list[dict], scale: dict, fewer: dict | None, args: argparse.Namespace) -> list[dict]:
    lines = projections(rows, scale, fewer)
    sizes = args.sizes
    print()
    print(
        "| part | runs in | x | "
        + " | ".join(f"N={n:,}: x, peak MB, s" for n in sizes)
        + " | peak ~ x^ | time ~ x^ | x at recipe | peak at recipe GB | time at recipe | budget GB |"
    )
    print("|---|---|---|" + "---|" * len(sizes) + "---|---|---|---|---|---|")
    for p in lines:
        _, where, unit, budget = PARTS[p["part"]]
        cells = " | ".join(f"{r['x']:,.0f}, {r['peak'] / 1e6:,.0f}, {r['seconds']:.2f}" for r in p["rows"])
        verdict = "" if p["peak_at"] <= budget * GB else " **over**"
        print(
            f"| {p['part']} | {where} | {unit} | {cells} | {p['fit'].exponent:.2f} ({growth(p['fit'].exponent)}) "
            f"| {p['time_fit'].exponent:.2f} | {p['x_at']:,.0f} | {p['peak_at'] / GB:,.2f}{verdict} "
            f"| {duration(p['seconds_at'])} | {budget:g} |"
        )
    print()
    for p in lines:
        if p["note"]:
            print(f"{p['part']}: {p['note']}")
    over = [p for p in lines if p["peak_at"] > p["budget"] * GB]
    for p in over:
        component, where, unit, budget = PARTS[p["part"]]
        print(
            f"MISSES THE GOAL: {p['part']} ({component}, {where}): {p['peak_at'] / GB:,.1f} GB at {p['x_at']:,.0f} "
            f"{unit} against {budget:g} GB; it grows as x^{p['fit'].exponent:.2f}, "
            f"{p['slope']:,.1f} bytes per unit of x"
        )
    if not over:
        print("every part within its budget at recipe scale")
    requests = scale.get("task_requests_gb") or {}
    for p in lines:
        if not PARTS[p["part"]][1].startswith("cluster task"):
            continue
        section = SECTION_OF.get(p["part"], "curation")
        request = requests.get(section)
        if request is not None and p["peak_at"] > request * GB:
            print(
                f"above the recipe's Slurm request per task ({request:g} GB, {section}.slurm): {p['part']} "
                f"at {p['peak_at'] / GB:,.2f} GB"
            )
    worst = max(lines, key=lambda p: p["peak_at"])
    print(f"worst per-process peak at recipe scale: {worst['peak_at'] / GB:.2f} GB ({worst['part']})")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2_000, 20_000, 200_000], help="documents per size")
    ap.add_argument("--tasks", type=int, default=4, help="datatrove tasks (shards) of each data step")
    ap.add_argument("--cap", type=int, default=2000, help="held-out documents per source at most (ingestion)")
    ap.add_argument("--preset", default="math", help="the curation preset (math: a length floor)")
    ap.add_argument("--recipe", default="smollm3-3b", help="the recipe projected to")
    ap.add_argument(
        "--components", nargs="+", choices=COMPONENTS, default=list(COMPONENTS), help="what to measure (default: all)"
    )
    ap.add_argument("--save", type=Path, help="also write the measurements to this JSON file")
    ap.add_argument("--replay", type=Path, help="report the measurements of a --save file, measuring nothing")
    ap.add_argument("--measure", nargs=3, metavar=("WHAT", "DIR", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--plan", default="plan.json", help=argparse.SUPPRESS)
    ap.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)  # the tokenizer's: the recipe's
    args = ap.parse_args()
    if args.measure:
        what, work, n = args.measure
        rows = MEASURES[what](Path(work), int(n), args)
        for r in rows:  # this process's peak resident set (not ru_maxrss: Linux keeps the forking parent's across exec)
            r.setdefault("peak", vm_hwm())
        print(json.dumps(rows))
        return
    if len(args.sizes) < 2 or sorted(args.sizes) != args.sizes:
        raise SystemExit(f"--sizes: at least two, increasing; got {args.sizes}")
    if args.sizes[0] < 8 * args.tasks:
        raise SystemExit(f"--sizes: the smallest ({args.sizes[0]}) must be at least 8 x --tasks ({args.tasks})")
    from flows.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    scale = recipe_scale(recipe)
    args.vocab = recipe.tokenizer.vocab_size
    print(
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; sizes {args.sizes} documents, "
        f"{args.tasks} tasks per data step; peaks: VmHWM of each fresh process, ru_maxrss of each forked task (imports included)"
    )
    print(
        f"recipe {args.recipe}: {scale['tokens']:,} tokens over its stages, {scale['sources']} sources (largest {scale['largest']}), "
        f"{scale['ranks']} ranks; the loader at {scale['loader_stage']} "
        f"({scale['x']['loader rank']:,.0f} documents in {scale['loader_shards']:,} shards)"
    )
    rows: list[dict] = []
    fewer: dict = {}
    if args.replay:
        saved = json.loads(args.replay.read_text())
        rows, fewer, args.sizes = saved["rows"], saved["fewer"], saved["sizes"]
    else:
        with tempfile.TemporaryDirectory(prefix="bench-data-scale-") as tmp:
            for n in args.sizes:
                t0 = time.perf_counter()
                rows += measure_size(n, args, Path(tmp), fewer if n == args.sizes[-1] else None)
                print(f"{n:,} documents measured in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.save:
        args.save.write_text(json.dumps({"sizes": args.sizes, "rows": rows, "fewer": fewer}))
    report(rows, scale, fewer.get("fewer"), args)


if __name__ == "__main__":
    main()
