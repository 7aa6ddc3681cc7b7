"""Does every training stage of a recipe fit its cluster: layout, batch and memory per GPU.

The recipe check (flows/recipe.py) calls `check_stages_fit` when a recipe loads, so a stage that
cannot run is refused before anything is scheduled, naming the stage and what to change:
- the layout: nodes (the stage's own or the launch's) x `training.nproc_per_node` ranks, `tp` of
  them per TP group inside a node, the rest data-parallel (model/layout.py);
- the batch: the global batch must split into whole micro-batches over the DP ranks;
- the memory, where the recipe declares its GPU (`training.gpu_memory_gb`): the predicted peak per
  GPU (model/memory.py: model state under the sharding, activations under the stage's
  checkpointing mode, the loss chunk, buffers) plus the assumed CUDA context and fragmentation
  must fit; "auto" checkpointing resolves here to the lightest mode that does. A stage that does
  not fit is refused with its figure, the limit and the settings that would make it fit.

`stage_rows` gives the same figures per stage for `smollm3 plan` (through each stage's
`launch_summary`) and `smollm3 capacity --recipe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StageFit:
    """One stage on its layout: what `smollm3 capacity --recipe` prints."""

    name: str
    nodes: int
    layout: str  # Layout.describe()
    global_batch: int
    micro_batch: int
    accum: int
    seq_len: int
    tokens_per_step: int
    steps: int
    mode: str  # activation checkpointing, "auto" resolved
    peak_gb: float  # predicted allocated peak per GPU
    budget_gb: float | None  # + context and fragmentation (GPU stages); None on CPU
    limit_gb: float | None  # the declared GPU memory
    detail: str  # MemoryEstimate.describe()
    host: Any = None  # HostNeeds per node (model/host_memory.py): what the launch asks the cluster for


def _vocab(recipe: Any) -> int:
    """The vocabulary the stages train with: the recipe's override, else its tokenizer's (the
    mixture plan's at run time, which the trainer takes)."""
    return int(recipe.training.model_overrides.get("vocab_size", recipe.tokenizer.vocab_size))


def stage_rows(recipe: Any) -> list[StageFit]:
    """Every stage's layout and predicted memory (ValueError naming the stage when one cannot run)."""
    from flows.stage_plan import schedule_stages, stage_batch

    t = recipe.training
    for st in recipe.stages:  # before the stages become TrainSpecs, so the message names the stage
        gb, mb = stage_batch(st, t)
        if gb % mb:
            raise ValueError(f"stages[{st.name}]: global_batch {gb} must be a multiple of micro_batch {mb}")
    from model.host_memory import host_needs

    threads = t.num_threads or recipe.resources.threads("train") or 1
    rows = []
    for run in schedule_stages(t, recipe.stages, recipe.seed):
        run = run.model_copy(update={"launch": run.on(recipe.launch)})
        spec = run.spec
        where = f"stages[{run.name}]"
        try:
            layout = run.layout()
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        nodes = run.launch.nodes
        unit = spec.micro_batch * layout.dp
        if spec.global_batch % unit:
            raise ValueError(
                f"{where}: global_batch {spec.global_batch} must be a multiple of micro_batch x data-parallel "
                f"size = {spec.micro_batch} x {layout.dp} (nodes {nodes} x training.nproc_per_node "
                f"{t.nproc_per_node} / tp {layout.tp}{f' / cp {layout.cp}' if layout.cp > 1 else ''})"
            )
        try:
            est = run.memory(_vocab(recipe))  # on GPU where the recipe trains there, else CPU
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        rows.append(
            StageFit(
                name=run.name,
                nodes=nodes,
                layout=layout.describe(),
                global_batch=spec.global_batch,
                micro_batch=spec.micro_batch,
                accum=spec.global_batch // unit,
                seq_len=spec.seq_len or 0,
                tokens_per_step=spec.global_batch * (spec.seq_len or 0),
                steps=spec.steps,
                mode=est.mode,
                peak_gb=est.peak_gb,
                budget_gb=est.budget_gb() if t.gpu_memory_gb is not None or t.device == "cuda" else None,
                limit_gb=t.gpu_memory_gb,
                detail=est.describe(),
                host=host_needs(run.spec, layout, t.nproc_per_node, threads=threads, vocab_size=_vocab(recipe)),
            )
        )
    return rows


def check_stages_fit(recipe: Any) -> None:
    """Refuse a stage whose layout, batch or memory cannot work (module docstring)."""
    from flows.stage_plan import schedule_stages
    from model.memory import DoesNotFit, does_not_fit, fitting_alternatives

    rows = stage_rows(recipe)
    limit = recipe.training.gpu_memory_gb
    if limit is None:
        return
    runs = {
        run.name: run.model_copy(update={"launch": run.on(recipe.launch)})
        for run in schedule_stages(recipe.training, recipe.stages, recipe.seed)
    }
    for row in rows:
        if row.budget_gb is None or row.budget_gb <= limit:
            continue
        run = runs[row.name]
        options = fitting_alternatives(run.spec, run.layout, _vocab(recipe), limit)
        est = run.memory(_vocab(recipe))
        raise DoesNotFit(does_not_fit(f"stages[{row.name}]", est, row.layout, limit, "training.gpu_memory_gb", options))


def _tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,}"


def format_rows(rows: list[StageFit]) -> str:
    """The per-stage table of `smollm3 capacity --recipe`."""
    head = (
        f"{'stage':<10}{'nodes':>6}  {'layout':<38}{'batch':>6}{'micro':>6}{'accum':>6}{'seq':>7}"
        f"{'tok/step':>10}{'steps':>10}  {'ckpt':<10}{'peak GB':>8}{'budget':>8}{'limit':>7}"
        f"{'host GB':>9}{'cpus':>6}{'nofile':>8}"
    )
    lines = [head]
    for r in rows:
        limit = f"{r.limit_gb:g}" if r.limit_gb else "-"
        budget = f"{r.budget_gb:.1f}" if r.budget_gb is not None else "-"
        lines.append(
            f"{r.name:<10}{r.nodes:>6}  {r.layout:<38}{r.global_batch:>6}{r.micro_batch:>6}{r.accum:>6}"
            f"{r.seq_len:>7}{_tokens(r.tokens_per_step):>10}{r.steps:>10,}  {r.mode:<10}{r.peak_gb:>8.2f}"
            f"{budget:>8}{limit:>7}{r.host.mem_gb:>9}{r.host.cpus:>6}{r.host.open_files:>8}"
        )
    lines.append(
        "peak: predicted allocated peak per GPU or CPU rank, GB (model/memory.py); "
        "budget: + fragmentation and context (GPU); host GB, cpus: per node, nofile: open files per rank, "
        "what the launch asks for where the recipe sets none (model/host_memory.py)"
    )
    for r in rows:
        lines.append(f"  {r.name}: {r.detail}; {r.host.describe()}")
    return "\n".join(lines)
