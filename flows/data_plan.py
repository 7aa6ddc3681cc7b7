"""The data plan of a recipe: where each data step runs and what it costs, beside the training
table of `smollm3 capacity --recipe` (flows/fit.py).

For each data step (the source step, curation, decontamination and tokenization, one per
source; the held-out index, one per DAG; the reasoning traces: one per `reasoning_data` source a
stage weighs) its executor (the source step's, the index's and decontamination's are curation's,
the reasoning traces' tokenization's), its
datatrove tasks, CPU-hours, disk written and memory per task, projected from:

- the size of each source: the tokens the recipe draws from it, sum over the stages of its
  mixture weight x the stage's tokens (`stages[].mixture`, `stages[].tokens`); a source repeated
  for epochs is smaller, a subsampled one larger: the recipe holds no other size. Documents and
  bytes follow from `TOKENS_PER_DOCUMENT` and `BYTES_PER_TOKEN`;
- costs measured on this machine, each named where it is defined below.

Nothing here reads a source: `smollm3 capacity --recipe smollm3-3b` prints it offline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# --- what a source is made of (assumed: the recipe names tokens only) -----------------------------
BYTES_PER_TOKEN = 4.0  # assumed: UTF-8 bytes per Llama-3 token of English web text
TOKENS_PER_DOCUMENT = 1300  # issue 33's reading of DCLM: ~3B documents for ~4T tokens
WORDS_PER_DOCUMENT = 750  # assumed: words of a held-out web document (about 1,000 tokens)
# --- measured costs -------------------------------------------------------------------------------
# benchmarks/data_plan_costs.py, 20 MB of English web text on this 2-core VM: 2.1 CPU s, 0.103
# CPU-s per MB with the three datatrove stages (0.079 for the single reader before: the id buckets
# are written and read once more); written gzip shards 0.363 of the text
SOURCE_CPU_S_PER_MB = 0.103
SOURCE_GZIP_RATIO = 0.363
# the source step's duplicate-id stage (curation/ingest.py): a bucket task holds its bucket's ids,
# a Python str in a set, ~115 bytes per document (issue 33, from the data structure: 100-130
# bytes); a source uncapped by `max_documents` has `curation.tasks` buckets
SOURCE_ID_BYTES = 115
# benchmarks/ingest_scale.py: the largest peak of a read, id-bucket or finish task (its process,
# imports included) at 10k, 100k and 1M documents in files of 10k (one read task each): 24-33 MB,
# flat; rounded up for a shard buffer of 5,000 web documents (~5 KB each, not the benchmark's 160 B)
SOURCE_TASK_GB = 0.1
# benchmarks/curate.py --scale, 100 MB at 1 worker (docs/data.md, "Curation on every core"):
# the web preset with exact and MinHash dedup, 11.69 CPU-s per MB
CURATE_CPU_S_PER_MB = 11.69
# benchmarks/data_scale.py, its full run of 2026-12-05 05:27-05:38 UTC (docs/scale.md, its table):
# a curation task's peak projected to the largest source's task at recipe scale, the largest of its
# stages (the filter task, 1.64 GB, measured with the held-out decontamination filter in it: an
# upper bound since decontamination is its own step)
CURATE_TASK_GB = 1.64
# the held-out index's build at recipe scale (the same run): the largest task peak (a merge task,
# 0.20 GB) and per-task time (the finish task, 1.1 s) projected
HELDOUT_INDEX_TASK_GB = 0.20
HELDOUT_INDEX_TASK_S = 1.1
# benchmarks/data_plan_costs.py, 20 MB of English web text on this 2-core VM (2026-12-05, load 1.4):
# the decontaminate step, its 8 tasks one after another, 4.6 CPU-s for 10,593 documents against an
# index of the text's 576 held-out documents; the recipe's index is 142,000 documents, where a
# lookup's binary search takes ~8 more comparisons per n-gram
DECONTAMINATE_CPU_S_PER_MB = 0.231
# benchmarks/tokenize_step.py (docs/data.md, "Benchmarks"): the tokenize step, 260,583 tokens/s
TOKENIZE_TOKENS_PER_CPU_S = 260_583
# benchmarks/data_scale.py (the same run): a tokenize task's peak projected to the largest
# source's task at recipe scale (3,056,691 documents per task): 2.50 GB
TOKENIZE_TASK_GB = 2.50
# reasoning traces (tasks/reasoning_data.py): SmolLM3's ~35B tokens of traces (the blog,
# docs/reference/smollm3.md) over the 3B recipe's 11.2M rows (OpenThoughts3 1.2M, Nemotron 10M)
REASONING_TOKENS_PER_CONVERSATION = 3_100  # assumed from those two figures
# benchmarks/data_scale.py (the same run), 200,000 synthetic conversations of ~1,090 tokens: the
# reader task streaming a files: source, 200,000 in 10.02 s; a render-and-tokenize task, 50,000 in
# 24.83 s (the chat template and a 512-token BPE; the recipe's tokenizer is costed by the tokenize
# step's rate, TOKENIZE_TOKENS_PER_CPU_S, on top); a task's peak, 0.73 GB projected to the
# recipe's 10,000 conversations per task, plus a batch of 1,000 conversations at 3,100 tokens
# instead of 1,090 (198 bytes per token held while encoded, measured: docs/scale.md, ~0.40 GB): 1.1 GB
REASONING_READ_CONVERSATIONS_PER_CPU_S = 19_960
REASONING_RENDER_CONVERSATIONS_PER_CPU_S = 2_014
REASONING_TASK_GB = 1.1
# the tokenizer's training, its one task (tasks/tokenizer.py), as benchmarks/data_scale.py projects
# it (the same run): the least-squares line of its peak over 2, 20 and 200 MB of sample at a 128,256
# vocabulary (201, 817 and 1,371 MB): GB per 1e9 characters and the line's value at none (the
# interpreter and the trainer), 5.21 GB at the recipe's 1e9; and its time's slope (2.85, 11.41 and
# 48.10 s), 3.7 min at 1e9 with the line's 4.6 s at none, left out here
TOKENIZER_GB_PER_GCHAR, TOKENIZER_GB_AT_ZERO = 4.761, 0.444
TOKENIZER_S_PER_GCHAR = 218.5
GB = 1e9


def tokenizer_task(sample_chars: int) -> tuple[float, float]:
    """(GB, CPU-seconds) of the tokenizer's training task on `sample_chars` characters."""
    x = sample_chars / 1e9
    return TOKENIZER_GB_AT_ZERO + TOKENIZER_GB_PER_GCHAR * x, TOKENIZER_S_PER_GCHAR * x


@dataclass(frozen=True)
class DataStep:
    """One data step kind summed over the recipe's sources (or one source's step)."""

    step: str  # source, curate, heldout_index, decontaminate, tokenize
    executor: str  # where its tasks run
    tasks: int  # datatrove tasks, all sources (the source step: its three stages' tasks)
    cpu_hours: float
    disk_gb: float  # written
    mem_gb: float  # per task, the largest task's need (measured or projected), not what the executor asks for
    note: str = ""


def _drawn_tokens(recipe: Any) -> dict[str, float]:
    """Tokens the recipe draws from each source: weight x tokens, summed over its stages."""
    from curation.mixtures import load_weights

    drawn = dict.fromkeys((s.name for s in recipe.sources), 0.0)
    for stage in recipe.stages:
        weights = load_weights(stage.mixture)
        total = sum(weights.values()) or 1.0
        for name, w in weights.items():
            if name in drawn:
                drawn[name] += w / total * stage.tokens
    return drawn


@dataclass(frozen=True)
class SourceSize:
    """One source at the recipe's scale, as the plan sizes it: its documents and the datatrove
    tasks of its source, curate and tokenize steps (each task's share is documents / tasks)."""

    name: str
    tokens: float  # drawn by the recipe's stages
    documents: float
    shards: int  # input shards of curation and tokenization
    read_tasks: int  # the source step's read (and finish) tasks
    id_buckets: int  # its duplicate-id tasks (0: a capped source keeps its ids in its one task)
    curate_tasks: int
    tokenize_tasks: int


def source_sizes(recipe: Any) -> list[SourceSize]:
    """Every source of the recipe at its scale (module docstring: sizes from the tokens drawn)."""
    drawn = _drawn_tokens(recipe)
    c, t = recipe.curation, recipe.tokenize
    out = []
    for s in recipe.sources:
        docs = drawn[s.name] / TOKENS_PER_DOCUMENT
        shards = max(s.shards, math.ceil(docs / s.documents_per_shard))
        read = 1 if s.max_documents is not None else c.tasks
        buckets = 0 if s.max_documents is not None else c.tasks
        out.append(
            SourceSize(s.name, drawn[s.name], docs, shards, read, buckets, min(c.tasks, shards), min(t.tasks, shards))
        )
    return out


def heldout_index_documents(recipe: Any) -> int | None:
    """Held-out documents every curate task indexes at the recipe's scale: each source's cap
    (`curation.heldout.max_docs`); None without a cap (the index grows with the sources)."""
    cap = recipe.curation.heldout.max_docs
    return None if cap is None else len(recipe.sources) * cap


def _where(executor: str, workers: int | None, slurm: Any) -> str:
    if executor == "slurm" and slurm is not None:
        return f"slurm ({slurm.partition}, {slurm.cpus_per_task} CPU x {slurm.mem_per_cpu_gb} GB)"
    if executor == "ray":
        return "ray cluster"
    return f"flow host ({workers} workers)" if workers else "flow host (a worker per core)"


@dataclass(frozen=True)
class ReasoningSize:
    """One reasoning-trace source a stage weighs, at the recipe's scale (tasks/reasoning_data.py)."""

    name: str
    conversations: int  # `examples`: the rows read at most (builtin: the problems)
    read_tasks: int  # one for files:/hf: (the first `examples` rows in read order)
    tokenize_tasks: int  # tokenize.tasks, at most one per conversation


def _reasoning_cpu_s(conversations: float, tokens: float, read: bool = True) -> float:
    """CPU-seconds of the reasoning traces: read (unless `read` is False), rendered, tokenized."""
    rendered = conversations / REASONING_RENDER_CONVERSATIONS_PER_CPU_S + tokens / TOKENIZE_TOKENS_PER_CPU_S
    return rendered + (conversations / REASONING_READ_CONVERSATIONS_PER_CPU_S if read else 0.0)


def reasoning_sizes(recipe: Any) -> list[ReasoningSize]:
    """The recipe's reasoning sources that some stage's mixture weighs (the flow makes no others)."""
    from curation.mixtures import load_weights

    weighed = {name for stage in recipe.stages for name in load_weights(stage.mixture)}
    tasks = recipe.tokenize.tasks
    return [
        ReasoningSize(r.name, r.examples, min(tasks, r.examples) if r.uri == "builtin" else 1, min(tasks, r.examples))
        for r in recipe.reasoning_data
        if r.name in weighed
    ]


def data_rows(recipe: Any) -> tuple[list[DataStep], str]:
    """The data steps of a recipe summed over its sources (and its reasoning traces), and the
    largest source's name."""
    drawn = _drawn_tokens(recipe)
    c, t = recipe.curation, recipe.tokenize
    index_gb = 0.0
    indexed = heldout_index_documents(recipe)
    if indexed is not None:  # curation/heldout.py: 12 bytes per n-gram (a word each) + ~60 per document
        index_gb = indexed * (WORDS_PER_DOCUMENT * 12 + 60) / GB
    id_bytes = 4 if recipe.tokenizer.vocab_size > 65535 else 2
    steps = ("source", "curate", "heldout_index", "decontaminate", "tokenize")
    rows = {step: [0, 0.0, 0.0, 0.0] for step in steps}
    # the held-out index, once: at most a shard task per held-out file (curation.tasks), a merge
    # task per partition and one finish task; it writes the index
    index_tasks = c.tasks + c.decontamination.index_partitions + 1
    # memory per task: what a task needs (measured or projected), whatever the executor asks for
    # (the executor column shows a Slurm request; executor_problems compares the two)
    rows["heldout_index"] = [index_tasks, index_tasks * HELDOUT_INDEX_TASK_S / 3600, index_gb, HELDOUT_INDEX_TASK_GB]
    buckets = {}  # source -> the id buckets of its duplicate-id stage (none: a capped source)
    for size in source_sizes(recipe):
        tokens, docs = size.tokens, size.documents
        mb = tokens * BYTES_PER_TOKEN / 1e6
        # a decontamination task maps the whole index (its pages counted as resident)
        curate_mem, decont_mem = CURATE_TASK_GB, index_gb
        # the source step: read and finish tasks (one for a capped source, else `curation.tasks`,
        # at most one per file) and as many id buckets, each holding its share of the ids
        read = size.read_tasks
        buckets[size.name] = size.id_buckets
        source_mem = max(SOURCE_TASK_GB * GB, docs / max(size.id_buckets, 1) * SOURCE_ID_BYTES)
        for step, tasks, cpu_s, disk, mem in (
            ("source", 2 * read + size.id_buckets, mb * SOURCE_CPU_S_PER_MB, mb * 1e6 * SOURCE_GZIP_RATIO, source_mem),
            ("curate", size.curate_tasks, mb * CURATE_CPU_S_PER_MB, mb * 1e6 * SOURCE_GZIP_RATIO, curate_mem * GB),
            # a task per curated train shard (curate's tasks write one each)
            (
                "decontaminate",
                size.curate_tasks,
                mb * DECONTAMINATE_CPU_S_PER_MB,
                mb * 1e6 * SOURCE_GZIP_RATIO,
                decont_mem * GB,
            ),
            (
                "tokenize",
                size.tokenize_tasks,
                tokens / TOKENIZE_TOKENS_PER_CPU_S,
                tokens * id_bytes + docs * 8,
                TOKENIZE_TASK_GB * GB,
            ),
        ):
            row = rows[step]
            row[0] += tasks
            row[1] += cpu_s / 3600
            row[2] += disk / GB
            row[3] = max(row[3], mem / GB)
    reasoning = reasoning_sizes(recipe)
    if reasoning:
        row = rows["reasoning"] = [0, 0.0, 0.0, 0.0]
        for r in reasoning:
            tokens = r.conversations * REASONING_TOKENS_PER_CONVERSATION
            row[0] += r.read_tasks + r.tokenize_tasks
            row[1] += _reasoning_cpu_s(r.conversations, tokens) / 3600
            copy = tokens * BYTES_PER_TOKEN * SOURCE_GZIP_RATIO  # the conversations' gzip copy, removed at the end
            row[2] += (tokens * id_bytes + r.conversations * 8 + copy) / GB
            row[3] = REASONING_TASK_GB
    trained = not recipe.tokenizer.path
    if trained:  # one task on the tokenizer section's executor; it writes tokenizer.json (a few MB)
        gb, cpu_s = tokenizer_task(recipe.tokenizer.sample_chars)
        rows["tokenizer"] = [1, cpu_s / 3600, 0.0, gb]
    largest = max(drawn, key=drawn.get)
    per_bucket = drawn[largest] / TOKENS_PER_DOCUMENT / max(buckets[largest], 1) * SOURCE_ID_BYTES / GB
    notes = {
        "source": f"per task: a read task's shard buffers ({SOURCE_TASK_GB:g} GB measured, flat in the source's size) "
        + (
            f"or an id bucket's ids: {largest} in {buckets[largest]:,} buckets, {per_bucket:.2f} GB each"
            if buckets[largest]
            else f"and its ids: {largest} is capped (max_documents), read by one task"
        ),
        "curate": f"per task: the largest task's projection (the filter task, {CURATE_TASK_GB:g} GB); "
        "disk at most the source's shards",
        "heldout_index": f"once for all sources: the index of every held-out split ({index_gb:.2f} GB written); "
        f"per task: a merge task's projection ({HELDOUT_INDEX_TASK_GB:g} GB)",
        "decontaminate": f"per task: the held-out index the task maps ({index_gb:.2f} GB) and the pipeline; "
        "disk at most the source's shards",
        "tokenize": f"{id_bytes}-byte token ids + an 8-byte index entry per document",
        "reasoning": f"{sum(r.conversations for r in reasoning):,.0f} conversations of "
        f"{', '.join(r.name for r in reasoning)} at {REASONING_TOKENS_PER_CONVERSATION:,} tokens each; "
        "a hub or files source read by one streaming task, rendered and tokenized by tokenize.tasks "
        "tasks; disk: the shards and the conversations' gzip copy the step writes and removes"
        if reasoning
        else "",
        "tokenizer": f"one task training the BPE on {recipe.tokenizer.sample_chars:,} sample characters "
        "(benchmarks/data_scale.py's projection)"
        if trained
        else "",
    }
    where = {
        "source": _where(c.executor, c.workers, c.slurm),
        "curate": _where(c.executor, c.workers, c.slurm),
        "heldout_index": _where(c.executor, c.workers, c.slurm),
        "decontaminate": _where(c.executor, c.workers, c.slurm),
        "tokenize": _where(t.executor, t.workers, t.slurm),
        "reasoning": _where(t.executor, t.workers, t.slurm),
        "tokenizer": _where(recipe.tokenizer.executor, None, recipe.tokenizer.slurm),
    }
    out = [DataStep(k, where[k], int(v[0]), v[1], v[2], v[3], notes[k]) for k, v in rows.items()]
    return out, largest


def format_data_rows(rows: list[DataStep], recipe: Any) -> str:
    """The data table printed under the training table."""
    drawn = sum(_drawn_tokens(recipe).values())
    lines = [
        "",
        f"data plan: {len(recipe.sources)} sources, {drawn:,.0f} tokens drawn "
        f"(~{drawn / TOKENS_PER_DOCUMENT:,.0f} documents, {drawn * BYTES_PER_TOKEN / 1e9:,.1f} GB of text)",
        f"{'step':<15}{'executor':<44}{'tasks':>8}{'CPU-hours':>12}{'disk GB':>11}{'GB/task':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r.step:<15}{r.executor:<44}{r.tasks:>8,}{r.cpu_hours:>12,.0f}{r.disk_gb:>11,.0f}{r.mem_gb:>9,.1f}"
        )
    lines.append(
        "sizes: tokens drawn per source (stage weight x stage tokens), "
        f"{BYTES_PER_TOKEN:g} bytes per token, {TOKENS_PER_DOCUMENT:,} tokens per document; costs measured "
        "(flows/data_plan.py names each)"
    )
    for r in rows:
        lines.append(f"  {r.step}: {r.note}")
    return "\n".join(lines)


# --- where the data steps may run -----------------------------------------------------------------
# A data step is "at scale" when the flow host would need more than a day for it at full use of
# every core: past that, the recipe must name a cluster executor (Slurm or Ray) for it.
HOST_DAY_HOURS = 24


def task_hours(recipe: Any) -> dict[str, tuple[float, str]]:
    """The longest task of each data step (hours on one CPU, every stage of the step summed) and
    its source: the source with the most tokens drawn, split over the step's tasks."""
    drawn = _drawn_tokens(recipe)
    c, t = recipe.curation, recipe.tokenize
    longest: dict[str, tuple[float, str]] = {}
    for s in recipe.sources:
        tokens = drawn[s.name]
        mb = tokens * BYTES_PER_TOKEN / 1e6
        shards = max(s.shards, math.ceil(tokens / TOKENS_PER_DOCUMENT / s.documents_per_shard))
        read = 1 if s.max_documents is not None else c.tasks
        for step, cpu_s, tasks in (
            ("source", mb * SOURCE_CPU_S_PER_MB, read),
            ("curate", mb * CURATE_CPU_S_PER_MB, min(c.tasks, shards)),
            ("decontaminate", mb * DECONTAMINATE_CPU_S_PER_MB, min(c.tasks, shards)),
            ("tokenize", tokens / TOKENIZE_TOKENS_PER_CPU_S, min(t.tasks, shards)),
        ):
            hours = cpu_s / max(tasks, 1) / 3600
            if hours > longest.get(step, (-1.0, ""))[0]:
                longest[step] = (hours, s.name)
    longest["heldout_index"] = (HELDOUT_INDEX_TASK_S / 3600, "every source's held-out split")
    if not recipe.tokenizer.path:
        longest["tokenizer"] = (tokenizer_task(recipe.tokenizer.sample_chars)[1] / 3600, "the training sample")
    for r in reasoning_sizes(recipe):  # the reader streams a hub source alone
        tokens = r.conversations * REASONING_TOKENS_PER_CONVERSATION
        read = r.conversations / REASONING_READ_CONVERSATIONS_PER_CPU_S / r.read_tasks
        hours = max(read, _reasoning_cpu_s(r.conversations, tokens, read=False) / r.tokenize_tasks) / 3600
        if hours > longest.get("reasoning", (-1.0, ""))[0]:
            longest["reasoning"] = (hours, r.name)
    return longest


def slurm_hours(limit: str) -> float:
    """A Slurm time limit (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS`) in hours."""
    days, _, rest = limit.rpartition("-")
    parts = [float(p) for p in rest.split(":")]
    if days:  # after a day count the first field is hours
        h, m, sec = (parts + [0.0, 0.0])[:3]
    else:
        h, m, sec = {1: (0.0, parts[0], 0.0), 2: (0.0, *parts), 3: tuple(parts)}[len(parts)]
    return float(days or 0) * 24 + h + m / 60 + sec / 3600


def executor_problems(recipe: Any, cores: int | None = None) -> tuple[list[str], list[str]]:
    """(refusals, warnings) about where the recipe's data steps run, for a flow host of `cores`
    cores (default: this machine's). Refused: a step at scale (more than `HOST_DAY_HOURS` of the
    host's cores) on the local executor with more workers than the host has cores, the recipe
    that would start hundreds of processes on the flow host. Warned: any other local step with
    more workers than cores, a step at scale on the local executor, and a Slurm request shorter
    than the step's longest task or smaller than its memory per task."""
    from curation.executors import machine_cores

    cores = cores or machine_cores()
    rows = {r.step: r for r in data_rows(recipe)[0]}
    longest = task_hours(recipe)
    sections = {step: ("curation", recipe.curation) for step in ("source", "curate", "heldout_index", "decontaminate")}
    sections["tokenize"] = ("tokenize", recipe.tokenize)
    if "reasoning" in rows:
        sections["reasoning"] = ("tokenize", recipe.tokenize)
    if "tokenizer" in rows:
        sections["tokenizer"] = ("tokenizer", recipe.tokenizer)
    refusals: list[str] = []
    warnings: list[str] = []
    for step, (name, section) in sections.items():
        hours, days = rows[step].cpu_hours, rows[step].cpu_hours / cores / 24
        at_scale = hours > HOST_DAY_HOURS * cores
        if section.executor == "local":
            workers = getattr(section, "workers", None)  # the tokenizer's one task has none
            over = workers is not None and workers > cores
            if over and at_scale:
                refusals.append(
                    f"{name}.executor is local: the {step} step would run {workers} workers on this "
                    f"{cores}-core flow host for ~{hours:,.0f} CPU-hours; set {name}.executor to slurm "
                    f"(with {name}.slurm) or ray (with {name}.ray.address) (docs/scale.md)"
                )
            elif over:
                warnings.append(
                    f"{name}.workers {workers} is more than this host's {cores} cores: the {step} step "
                    "oversubscribes them (unset it to run one worker per core)"
                )
            elif at_scale:
                warnings.append(
                    f"{name}.executor is local: the {step} step needs ~{hours:,.0f} CPU-hours, ~{days:,.1f} "
                    f"days on this host's {cores} cores; a cluster executor runs it in parallel"
                )
        elif section.executor == "slurm" and section.slurm is not None:
            limit = slurm_hours(section.slurm.time)
            task, source = longest[step]
            if task > limit:
                warnings.append(
                    f"{name}.slurm.time {section.slurm.time} is shorter than the {step} step's longest "
                    f"task, ~{task:,.1f} h ({source}; flows/data_plan.py): raise it or {name}.tasks"
                )
            request = section.slurm.cpus_per_task * section.slurm.mem_per_cpu_gb
            if request < rows[step].mem_gb:
                warnings.append(
                    f"{name}.slurm asks {request:g} GB per task, less than the {step} step's "
                    f"{rows[step].mem_gb:.1f} GB (flows/data_plan.py): raise mem_per_cpu_gb"
                )
    return refusals, warnings
