"""SAO (asynchronous, single-rollout RL) against the named baseline "synchronous GRPO" on CPU.

Both trainers start from the same policy (a tiny SmolLM3 with a short SFT warm start on the
built-in no-think arithmetic conversations, so that the verifiable reward is not zero
everywhere; the arithmetic has operands of at most `--max-operand`, 9 as in the tiny recipe: with
the generator's 3-digit ranges the warm start scored 0), on the same arithmetic prompts and rewards (exact match of `Answer: N` +
`format_weight` x the format reward), with the same samples per update (`--batch` completions)
and the same wall-clock budget (`--budget` seconds from the call of the trainer, model loading
and the rollout worker's start included) on the same number of CPU threads:

- synchronous GRPO: TRL's `GRPOTrainer` (trainers/posttrain/grpo.py), `--batch` completions per
  step as groups of `--generations`, all `--threads` threads in one process; it is stopped by a
  callback once the budget is spent. Its idle share is the share of its time spent generating
  (the update waits for the whole batch).
- SAO (trainers/posttrain/sao.py) at `max_staleness` 0, 1 and 4 (`--staleness`): one rollout
  worker with `--threads - 1` threads beside a trainer with one; `--batch` samples per update;
  the budget ends it the way a cluster's time limit does (SIGUSR1 to itself: the trainer saves
  the step it is at and stops). Its idle share is the trainer's wait for samples.

Then each final policy is scored on every prompt (`--eval-samples` sampled answers each, one
sampling seed): the reward the training bought in that time. Prints one table (reward over the
budget's quarters, final score, updates, samples per second, idle share, dropped samples, ESS
share, KL to the start), a ratio line against synchronous GRPO, and the load average before and
after.

Uncertainty: every score is a mean over the prompts of each prompt's mean reward, printed with
its standard error over the prompts (n = `--prompts`). A score change (final - start, or SAO -
GRPO) is a paired difference: the same prompts are scored before and after, so its stderr is that
of the per-prompt differences. A quarter's training reward carries the stderr over the updates in
that quarter. With `--seeds N` (N > 1) every trainer is trained N times (seeds 0 .. N-1, N times
the training time) and each score change also carries its stderr across the seeds (N-1 degrees of
freedom: with few seeds it is itself rough). A difference is marked `*` where it exceeds 2 stderr
(each stderr that is printed for it).

    .venv/bin/python benchmarks/rl_async.py                     # ~5 min on 2 cores
    .venv/bin/python benchmarks/rl_async.py --budget 120 --prompts 128 --hidden 128 --layers 4
    .venv/bin/python benchmarks/rl_async.py --seeds 3                           # ~12 min

The model, data and warm start are built once into `--work` (default: a temporary folder) and
reused when it is given again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from curation.source_kinds import SourceConfig  # noqa: E402
from pipeline.artifact import Artifact  # noqa: E402
from trainers.posttrain.chat_data import read_jsonl  # noqa: E402
from trainers.posttrain.common import load_policy, stop_ids  # noqa: E402
from trainers.posttrain.rollout import score  # noqa: E402
from trainers.posttrain.sections import ChatDataConfig, ChatDataSpec, GRPOConfig, SAOConfig, SFTConfig  # noqa: E402
from trainers.rank_signals import StopRequested  # noqa: E402

BASELINE = "synchronous GRPO"


def quiet(_: str) -> None:
    pass


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def build_world(work: Path, args) -> tuple[Path, Path]:
    """(warm-started policy folder, data folder with prompts.jsonl), built once into `work`."""
    from curation.bpe import save_hf_tokenizer, train_bpe
    from curation.source_kinds import read_shards
    from model.config import ModelConfig
    from model.hf import export_hf
    from model.model import SmolLM3
    from tasks.posttrain.data import posttrain_data
    from tasks.sources import SourceSpec, source
    from trainers.posttrain.sft import train_sft

    policy, data = work / "sft" / "model", work / "data"
    if (policy / "config.json").is_file() and (data / "prompts.jsonl").is_file():
        return policy, data
    math = SourceConfig(
        name="math", uri="builtin:math", domain="math", max_documents=args.math_docs, max_operand=args.max_operand
    )
    meta = source(SourceSpec(source=math), out=work / "math", log=quiet)
    corpus = Artifact(kind="corpus", uri=str(work / "math"), fingerprint="m" * 64, meta=meta)
    texts = [d["text"] for d in read_shards(corpus.path / "train")]
    tok = save_hf_tokenizer(train_bpe(iter(texts), 512), work / "tokenizer")
    cfg = ModelConfig.tiny(
        vocab_size=tok["vocab_size"],
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_layers=args.layers,
        max_seq_len=512,
    )
    model = SmolLM3(cfg)
    model.init_weights(seed=0)
    base = export_hf(model, work / "base", tokenizer_dir=work / "tokenizer", eos_token_id=tok["eos_id"])
    chat = ChatDataConfig(
        math_examples=args.sft_examples, prose_examples=0, heldout_examples=8, prompts=args.prompts, think_share=0.0
    )
    posttrain_data(ChatDataSpec(data=chat), [corpus], out=data, log=quiet)
    # rows of 256 tokens: the chat template's /no_think system turn alone is ~160-175 tokens with this
    # 512-token BPE, so at 128 every row was cut before its answer and the warm start had no loss
    sft = SFTConfig(max_steps=args.sft_steps, lr=3e-3, batch=16, max_length=256, save_steps=10_000, warmup_ratio=0.1)
    train_sft(sft, base, data, work / "sft", device="cpu", log=quiet)
    return policy, data


class Clock:
    """Wall time since the trainer was called; (seconds, reward) per update."""

    def __init__(self, budget: float):
        self.budget, self.start, self.points = budget, time.monotonic(), []
        self.train_began = 0.0  # GRPO: when its training loop began (after TRL's set-up)

    def now(self) -> float:
        return time.monotonic() - self.start

    def over(self) -> bool:
        return self.now() >= self.budget


def run_grpo(policy: Path, data: Path, out: Path, args, seed: int = 0) -> dict[str, Any]:
    from transformers import TrainerCallback

    from trainers.posttrain.grpo import train_grpo

    torch.set_num_threads(args.threads)
    clock = Clock(args.budget)
    gen = {"s": 0.0, "steps": 0}

    class Budget(TrainerCallback):
        def on_train_begin(self, a, state, control, model=None, **kw):
            inner = model.generate

            def timed(*x, **k):  # the update waits for every completion of the batch
                began = time.monotonic()
                try:
                    return inner(*x, **k)
                finally:
                    gen["s"] += time.monotonic() - began

            model.generate = timed
            clock.train_began = clock.now()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                clock.points.append((clock.now(), float(logs["reward"]), logs.get("kl")))

        def on_step_end(self, a, state, control, **kw):
            gen["steps"] = state.global_step
            if clock.over():
                control.should_training_stop = True

    cfg = GRPOConfig(
        max_steps=100_000,
        lr=args.lr,
        batch=args.batch,
        num_generations=args.generations,
        beta=0.04,
        max_completion_length=args.max_tokens,
        save_steps=100_000,
        warmup_ratio=0.0,
    )
    train_grpo(cfg, policy, data, out, seed=seed, device="cpu", log=quiet, callbacks=[Budget()])
    ended = clock.points[-1][0] if clock.points else clock.now()
    steps = len(clock.points)
    training = ended - clock.train_began
    return {
        "name": BASELINE,
        "points": clock.points,
        "updates": steps,
        "samples": steps * args.batch,
        "samples_per_s": steps * args.batch / ended if ended else 0.0,
        "idle_share": gen["s"] / training if training > 0 else None,
        "dropped": 0,
        "ess_share": None,
        "kl": clock.points[-1][2] if clock.points else None,
        "model": lambda: load_policy(out / "model")[0],
    }


def run_sao(policy: Path, data: Path, out: Path, staleness: int, args, seed: int = 0) -> dict[str, Any]:
    from safetensors.torch import load_model

    from trainers.posttrain.common import complete_checkpoints
    from trainers.posttrain.sao import train_sao

    torch.set_num_threads(1)
    clock = Clock(args.budget)
    times: list[float] = []

    def progress(_: float) -> None:  # called after each trainer step: the budget is a time limit
        times.append(clock.now())
        if clock.over():
            os.kill(os.getpid(), signal.SIGUSR1)  # the trainer saves this step and stops

    cfg = SAOConfig(
        enabled=True,
        max_steps=100_000,
        value_warmup=1,
        batch=args.batch,
        lr=args.lr,
        max_completion_length=args.max_tokens,
        max_staleness=staleness,
        queue_size=args.queue,
        warmup_ratio=0.0,
        save_steps=100_000,
        rollout_workers=1,
        rollout_threads=max(1, args.threads - 1),
    )
    try:
        train_sao(cfg, policy, data, out, seed=seed, device="cpu", log=quiet, progress=progress)
    except StopRequested:
        pass
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    points = [(t, r["reward"], r.get("kl_start")) for t, r in zip(times, rows, strict=True)]
    final = complete_checkpoints(out / "checkpoints")[-1][1]
    policy_rows = [r for r in rows if r["phase"] == "policy"]
    trained = sum(len(r["seqs"]) for r in rows)
    trainer_s = rows[-1]["elapsed_s"] if rows else 0.0  # the trainer's own time: waiting + training
    waited = sum(r["wait_s"] for r in rows)

    def model():
        m, _ = load_policy(policy)
        load_model(m, str(final / "policy.safetensors"))
        return m

    return {
        "name": f"SAO, max_staleness {staleness}",
        "points": points,
        "updates": len(policy_rows),
        "samples": trained,
        "samples_per_s": trained / times[-1] if times else 0.0,
        "idle_share": waited / trainer_s if trainer_s else None,
        "dropped": sum(len(r["dropped_seqs"]) for r in rows),
        "ess_share": statistics.mean(r["ess_share"] for r in policy_rows) if policy_rows else None,
        "kl": policy_rows[-1]["kl_start"] if policy_rows else None,
        "model": model,
    }


def evaluate(model, tokenizer, prompts: list[dict], args) -> list[float]:
    """Each prompt's mean reward over `--eval-samples` sampled answers (seeded, batched, left-padded)."""
    model.eval()
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(p["prompt"], add_generation_prompt=True, tokenize=False) for p in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(1234)
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.max_tokens,
            num_return_sequences=args.eval_samples,
            eos_token_id=stop_ids(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
        )
    completions = out[:, enc["input_ids"].shape[1] :]
    rewards = [0.0] * len(prompts)
    for i, ids in enumerate(completions.tolist()):  # generate returns each prompt's samples together
        answer = prompts[i // args.eval_samples]["answer"]
        rewards[i // args.eval_samples] += score(tokenizer, ids, answer, GRPOConfig().format_weight)["reward"]
    return [r / args.eval_samples for r in rewards]


def mean_se(xs: list[float]) -> tuple[float, float | None]:
    """Mean and its standard error (sample stdev / sqrt(n)); no stderr from fewer than 2 values."""
    m = statistics.mean(xs)
    return m, (statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else None)


def paired(after: list[float], before: list[float]) -> tuple[float, float | None]:
    """Mean of the per-item differences and its stderr: the same items scored twice."""
    return mean_se([a - b for a, b in zip(after, before, strict=True)])


def per_item(seeds: list[list[float]]) -> list[float]:
    """Each item's score averaged over the seeds' runs."""
    return [statistics.mean(col) for col in zip(*seeds, strict=True)]


def pm(m: float, se: float | None, spec: str = ".3f") -> str:
    return format(m, spec) if se is None else f"{format(m, spec)}±{format(se, spec)}"


def beyond(m: float, *ses: float | None) -> bool:
    """Whether |m| exceeds 2 of every stderr given (those that exist; at least one must)."""
    known = [se for se in ses if se is not None]
    return bool(known) and all(abs(m) > 2 * se for se in known)


def change(after: list[list[float]], before: list[list[float]] | list[float]) -> str:
    """A score change over seeds: the paired mean ± its stderr over items, then (several seeds)
    ± its stderr across seeds; `*` where it exceeds 2 stderr."""
    if before and isinstance(before[0], float):
        before = [before] * len(after)  # the start policy: one score for every seed
    m, se_items = paired(per_item(after), per_item(before))
    text = f"{m:+.3f} ± {se_items:.3f} (items)" if se_items is not None else f"{m:+.3f}"
    se_seeds = None
    if len(after) > 1:
        _, se_seeds = mean_se([statistics.mean(a) - statistics.mean(b) for a, b in zip(after, before, strict=True)])
        text += f" ± {se_seeds:.3f} ({len(after)} seeds)"
    return text + (" *" if beyond(m, se_items, se_seeds) else "")


def quarters(points: list[tuple[float, float, Any]], budget: float) -> list[str]:
    """Mean training reward of the updates in each quarter of the budget ± its stderr over those
    updates ('-': none there)."""
    cells = []
    for q in range(4):
        lo, hi = q * budget / 4, (q + 1) * budget / 4 + (1e9 if q == 3 else 0)
        got = [r for t, r, _ in points if lo <= t < hi]
        cells.append(pm(*mean_se(got)) if got else "-")
    return cells


def fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def train_all(policy: Path, data: Path, work: Path, tokenizer, prompts: list[dict], args) -> list[dict[str, Any]]:
    """Every trainer, `--seeds` times each: the first seed's system figures, every seed's scores."""
    runs: dict[str, dict[str, Any]] = {}
    for seed in range(args.seeds):
        for name in ["grpo", *(f"sao-{s}" for s in args.staleness)]:
            out = work / "runs" / f"{name}-seed{seed}"
            if out.exists():
                shutil.rmtree(out)
            if name == "grpo":
                run = run_grpo(policy, data, out, args, seed)
            else:
                run = run_sao(policy, data, out, int(name.split("-")[1]), args, seed)
            torch.set_num_threads(args.threads)
            scores = evaluate(run.pop("model")(), tokenizer, prompts, args)
            print(
                f"{run['name']}, seed {seed}: {run['updates']} updates, score {statistics.mean(scores):.3f}", flush=True
            )
            runs.setdefault(name, run | {"scores": []})["scores"].append(scores)
    return list(runs.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=45.0, help="wall-clock seconds per trainer run")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 4], help="SAO max_staleness values")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="completions per update (both trainers)")
    parser.add_argument("--generations", type=int, default=4, help="GRPO group size")
    parser.add_argument("--queue", type=int, default=8, help="SAO queue size")
    parser.add_argument("--max-tokens", type=int, default=24, help="generated tokens per completion")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--math-docs", type=int, default=600)
    parser.add_argument(
        "--max-operand",
        type=lambda v: None if v == "none" else int(v),
        default=9,
        help="largest operand of the arithmetic (the tiny recipe's 9; 'none': the generator's ranges, up to 999)",
    )
    parser.add_argument("--sft-examples", type=int, default=300)
    parser.add_argument("--sft-steps", type=int, default=300, help="warm-start SFT steps (batch 16)")
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument(
        "--seeds", type=int, default=1, help="train every trainer this many times (seeds 0..N-1): stderr across seeds"
    )
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per run (SAO: 1 trainer + rest rollout)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the model and data (reused)")
    args = parser.parse_args()
    if args.batch % args.generations:
        parser.error(f"--batch {args.batch} must be a multiple of --generations {args.generations}")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds} must be at least 1")

    began, load_before = time.monotonic(), load()
    work = args.work or Path(tempfile.mkdtemp(prefix="rl_async-"))
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    t = time.monotonic()
    policy, data = build_world(work, args)
    setup_s = time.monotonic() - t
    prompts = read_jsonl(data / "prompts.jsonl")
    start_model, tokenizer = load_policy(policy)
    start = evaluate(start_model, tokenizer, prompts, args)
    runs = train_all(policy, data, work, tokenizer, prompts, args)

    print()
    print(
        f"RL on CPU, {args.budget:.0f} s wall each, {args.threads} threads, {len(prompts)} prompts, "
        f"{args.batch} completions per update, <= {args.max_tokens} tokens, lr {args.lr:g}, operands <= "
        f"{args.max_operand or 999}; model {args.layers} layers x {args.hidden} hidden (SFT warm start, "
        f"{args.sft_steps} steps, built in {setup_s:.0f} s); {args.seeds} seed(s)"
    )
    print(
        f"start policy: score {pm(*mean_se(start))} (mean over {len(prompts)} prompts of each one's mean reward "
        f"of {args.eval_samples} samples; ± stderr over prompts)"
    )
    seeds_note = f", seed 0 of {args.seeds}" if args.seeds > 1 else ""
    head = (
        f"{'trainer':<24} {'reward by quarter of the budget (± stderr over updates)':>55} {'score':>11} {'upd':>4} "
        f"{'samples/s':>9} {'idle':>5} {'dropped':>7} {'ESS':>5} {'KL':>7}"
    )
    print(
        f"(score: ± stderr over prompts{', seeds averaged' if args.seeds > 1 else ''}; other columns{seeds_note or ': one run'})"
    )
    print(head)
    print("-" * len(head))
    for r in runs:
        q = " ".join(f"{c:>13}" for c in quarters(r["points"], args.budget))
        print(
            f"{r['name']:<24} {q:>55} {pm(*mean_se(per_item(r['scores']))):>11} {r['updates']:>4} "
            f"{r['samples_per_s']:>9.2f} {fmt(r['idle_share'], '.2f'):>5} {r['dropped']:>7} "
            f"{fmt(r['ess_share'], '.2f'):>5} {fmt(r['kl'], '.4f'):>7}"
        )
    print("score changes (paired over prompts; * = beyond 2 stderr):")
    for r in runs:
        print(f"  {r['name']} over the start: {change(r['scores'], start)}")
    base = runs[0]
    for r in runs[1:]:
        print(
            f"{r['name']} vs {BASELINE}: samples/s x{r['samples_per_s'] / base['samples_per_s']:.2f}, "
            f"score difference {change(r['scores'], base['scores'])}"
        )
    print(f"load average before {load_before}, after {load()}; {os.cpu_count()} CPUs; {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
