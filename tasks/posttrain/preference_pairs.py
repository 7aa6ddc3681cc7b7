"""On-policy preference pairs per reasoning mode: the policy (the SFT model) answers the
preference prompts, a stronger source answers the same prompts, and each pair records which side
came from where and its mode (curation/pairing.py has the row format and the rules).

For each mode of `posttrain.pairs` (think, no_think):
- prompts: the builtin arithmetic prompts of `posttrain_data` (`prompts.jsonl`, known answers and
  worked reference solutions), or a files:/hf: prompts dataset, in a seeded order, the first
  `max_prompts`, each with a system turn naming the mode;
- chosen and rejected: `reference` (the verified worked answer; in think mode with the SFT data's
  `<think>` trace), `policy` (the input model) or `model:NAME` (a local folder or hub model),
  answered greedily (temperature 0) or with seeded sampling (trainers/posttrain/sampling.py);
- or `pairs`: the prompt/chosen/rejected rows of a dataset (Tulu 3's preference mixture in the
  3B recipe's no-think mode), put in the mode.
SmolLM3's think-mode pairs took chosen answers from Qwen3-32B and rejected ones from Qwen3-0.6B;
the tiny recipe rejects the policy's own greedy answer against the verified reference.

Streams: a mode's prompts are answered in chunks of `chunk_batches` generate calls, each chunk's
pairs written to `chunks/` before the next is generated (curation/pair_chunks.py), so memory is
one chunk's answers, not the mode's; the folder is kept after a kill (`resumable`) and a rerun
makes only the chunks not yet written. At the end the chunks are streamed into `pairs.jsonl`
(every mode's rows, through a temporary name renamed last: the same bytes as one uninterrupted
run) and the counts per mode (pairs, dropped by reason, each side's accuracy where answers are
known), summed over the chunks, are the artifact's meta. `preference.pairs:
on_policy` makes APO train on them (trainers/posttrain/preference.py). Runs in a child process
(torch and transformers stay out of the flow process) on the eval slot.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from curation.pair_chunks import ChunkStore, Span, spans
from curation.pairing import as_messages, dataset_pair, mode_prompt, pair_chunk, pair_facts, reference_answer
from pipeline.artifact import Artifact
from pipeline.step import step
from trainers.posttrain.chat_data import data_state, load_rows, preference_rows, read_jsonl
from trainers.posttrain.common import model_dir
from trainers.posttrain.sections import ChatDataConfig, PairModeConfig, PairsSpec


def _sources_state(spec: PairsSpec) -> str:
    """Facts outside the config: local data files and local model folders named as sources."""
    h = hashlib.sha256()
    for cfg in spec.pairs.modes().values():
        for uri in (cfg.prompts, cfg.pairs or ""):
            h.update(data_state(uri).encode())
        for side in (cfg.chosen, cfg.rejected):
            folder = Path(side[6:]).expanduser() if side.startswith("model:") else None
            if folder is not None and folder.is_dir():
                for f in sorted(folder.glob("*.safetensors")):
                    st = f.stat()
                    h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _prompt_rows(cfg: PairModeConfig, data: Path, mode: str, seed: int) -> list[dict[str, Any]]:
    """This mode's prompt rows ({prompt, answer?, reference?}), seeded order, at most max_prompts."""
    if cfg.prompts == "builtin":
        path = data / "prompts.jsonl"
        if not path.is_file():
            raise FileNotFoundError(
                f"preference_pairs: input `data` {data} has no prompts.jsonl (a posttrain_data folder)"
            )
        rows = read_jsonl(path)
    else:
        where = ChatDataConfig(
            uri=cfg.prompts, hf_subset=cfg.hf_subset, hf_split=cfg.hf_split, hf_revision=cfg.hf_revision
        )
        rows = []
        for i, row in enumerate(load_rows(cfg.prompts, where)):
            if cfg.prompt_field not in row:
                raise KeyError(
                    f"preference_pairs {mode}: prompts {cfg.prompts!r} row {i} has no column "
                    f"{cfg.prompt_field!r} (columns: {', '.join(row)}); set posttrain.pairs.{mode}.prompt_field"
                )
            rows.append({"prompt": as_messages(row[cfg.prompt_field], f"{cfg.prompts} row {i}")})
            if len(rows) >= cfg.max_prompts * 4:  # enough to draw from without reading the whole hub set
                break
    if not rows:
        raise ValueError(f"preference_pairs {mode}: no prompts in {cfg.prompts!r}")
    random.Random(f"pairs:{mode}:{seed}").shuffle(rows)
    return rows[: cfg.max_prompts]


def _answers(side: str, prompts, rows, cfg: PairModeConfig, mode: str, seed: int, offset: int, ctx):
    """One answer per prompt from a source (reference, policy or model:NAME); models are loaded
    once per step (`ctx.cache`). `offset`: the first prompt's position in the mode's prompts."""
    if side == "reference":
        return [reference_answer(r, mode) for r in rows]
    from trainers.posttrain.sampling import chat_answers, load_chat_model

    name = str(ctx.policy) if side == "policy" else side[6:]
    if name not in ctx.cache:  # 32B in fp32 fits no GPU
        ctx.cache[name] = load_chat_model(name, ctx.device, bf16=ctx.device.startswith("cuda"))
    model, tokenizer = ctx.cache[name]
    return chat_answers(
        model, tokenizer, prompts, mode, cfg.max_new_tokens, cfg.temperature, seed, cfg.batch_size, offset
    )


@dataclass
class _Run:
    """What every mode of one step run shares."""

    data: Path
    policy: Path
    seed: int
    device: str
    store: ChunkStore
    log: Any
    modes: Any  # the recipe's reasoning_modes: the system turns of builtin prompts
    cache: dict = field(default_factory=dict)


def _dataset_mode(cfg: PairModeConfig, mode: str, ctx: _Run) -> tuple[list[Span], dict[str, Any]]:
    rows = preference_rows(cfg.pairs, cfg.hf_subset, cfg.hf_split, cfg.hf_revision, cfg.max_prompts)
    plan = spans(len(rows), cfg.chunk_batches * cfg.batch_size)
    for a, b in plan:
        if ctx.store.counts(mode, (a, b)) is None:
            pairs = [dataset_pair(r, mode, cfg.pairs, f"{cfg.pairs} row {i}") for i, r in enumerate(rows[a:b], a)]
            ctx.store.write(mode, (a, b), pairs, {"prompts": b - a, "pairs": len(pairs)})
    facts = {"prompts": len(rows), "pairs": len(rows), "dropped": {}, "source": cfg.pairs}
    ctx.log(f"preference_pairs {mode}: {len(rows)} pairs from {cfg.pairs}")
    return plan, facts


def _sampled_mode(cfg: PairModeConfig, mode: str, ctx: _Run) -> tuple[list[Span], dict[str, Any]]:
    """A mode's pairs from answers, chunk by chunk (curation/pair_chunks.py): each chunk's
    chosen and rejected answers, paired and written before the next chunk is generated; the
    chunks a killed attempt wrote are kept."""
    rows = _prompt_rows(cfg, ctx.data, mode, ctx.seed)
    builtin = cfg.prompts == "builtin"
    plan = spans(len(rows), cfg.chunk_batches * cfg.batch_size)  # whole batches: seeds as in one list
    kept = sum(ctx.store.counts(mode, s) is not None for s in plan)
    if kept:
        ctx.log(f"preference_pairs {mode}: resuming, {kept} of {len(plan)} chunks already written")
    for k, (a, b) in enumerate(plan):
        if ctx.store.counts(mode, (a, b)) is not None:
            continue
        part = rows[a:b]
        prompts = [mode_prompt(r["prompt"], mode, builtin, ctx.modes) for r in part]
        chosen = _answers(cfg.chosen, prompts, part, cfg, mode, ctx.seed, a, ctx)
        rejected = _answers(cfg.rejected, prompts, part, cfg, mode, ctx.seed, a, ctx)
        answers = [r.get("answer") for r in part] if builtin else None
        pairs, counts = pair_chunk(prompts, chosen, rejected, mode, (cfg.chosen, cfg.rejected), answers)
        ctx.store.write(mode, (a, b), pairs, counts)
        if len(plan) > 1:
            ctx.log(f"preference_pairs {mode}: chunk {k + 1}/{len(plan)} written (prompts {a}-{b - 1})")
    facts = pair_facts(ctx.store.counts(mode, s) for s in plan)
    facts.update(chosen_source=cfg.chosen, rejected_source=cfg.rejected)
    ctx.log(
        f"preference_pairs {mode}: {facts['pairs']} pairs from {len(rows)} prompts (chosen: {cfg.chosen}, "
        f"rejected: {cfg.rejected}; dropped {facts['dropped'] or 'none'}"
        + (f"; rejected side right on {facts['rejected_accuracy']:.0%}" if "rejected_accuracy" in facts else "")
        + ")"
    )
    return plan, facts


@step(
    "preference_pairs",
    version=1,
    kind="corpus",
    resource="eval",
    isolate=True,
    resumable=True,  # the chunks of a killed attempt are kept (curation/pair_chunks.py)
    extra=_sources_state,
)
def preference_pairs(config: PairsSpec, model: Artifact, data: Artifact, *, out: Path, log=print) -> dict[str, Any]:
    """Pairs per reasoning mode from the policy (`model`, the SFT model) and the recipe's
    sources on the prompts of `data` (posttrain_data's folder) or of a dataset."""
    from trainers.posttrain.common import resolve_device

    modes = config.pairs.modes()
    if not modes:
        raise ValueError("preference_pairs: posttrain.pairs names no mode; set posttrain.pairs.think and/or no_think")
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(config.device)
    ctx = _Run(data.path, model_dir(model), config.seed, device, ChunkStore(out), log, config.modes)
    parts, by_mode = [], {}
    for mode, cfg in modes.items():
        plan, by_mode[mode] = (_dataset_mode if cfg.pairs is not None else _sampled_mode)(cfg, mode, ctx)
        parts += [(mode, s) for s in plan]
    total = sum(f["pairs"] for f in by_mode.values())
    if not total:
        raise ValueError(
            f"preference_pairs: no pair kept ({by_mode}); every rejected answer was right or the "
            "prompts are empty: raise posttrain.pairs.<mode>.max_prompts or use a weaker rejected source"
        )
    ctx.store.assemble(out / "pairs.jsonl", parts)
    return {
        "pairs": total,
        "modes": by_mode,
        "policy": {"fingerprint": model.fingerprint, "stage": model.meta.get("stage")},
        "files": {"pairs": str(out / "pairs.jsonl")},
    }
