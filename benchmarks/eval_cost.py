"""Cost of `evaluate` against the named baseline "stage training time", on the tiny recipe.

One run builds the tiny recipe's data with the project's own step functions (built-in sources
without curation, the recipe's tokenizer, datatrove token shards, mixture plans, the eval suite),
then for each of the recipe's stages: trains it with the `pretrain` step (a torchrun launch of
the trainer, checkpoints included), exports it, and times evaluation on that stage's tasks, once
with lm-eval's stock `hf` model (the old path, batch 8: `run_lm_eval`) and once with the
`evaluate` step (the default path). Evaluation runs in this process at
`--threads` torch threads (the eval slot's setting); the trainer gets `--train-threads`.

    .venv/bin/python benchmarks/eval_cost.py                    # all 5 tiny stages
    .venv/bin/python benchmarks/eval_cost.py --stages stage1 long1 --no-old

Prints per stage: training seconds, evaluate seconds and their ratio (target: <= 0.25), the old
path's seconds and ratio, whether both paths gave the same scores, and the load average before
and after (other processes on the machine slow both sides).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from evals.harness import run_lm_eval, stage_tasks
from flows.recipe import load_recipe  # noqa: E402
from flows.stage_plan import schedule_stages  # noqa: E402
from pipeline.artifact import Artifact  # noqa: E402
from tasks.evaluate import EvalSpec, SuiteSpec, eval_suite, evaluate  # noqa: E402
from tasks.export import ExportConfig, export  # noqa: E402
from tasks.mixture import MixtureSpec, mixture  # noqa: E402
from tasks.pretrain import pretrain  # noqa: E402
from tasks.sources import SourceSpec, source  # noqa: E402
from tasks.tokenize import TokenizeSpec, tokenize  # noqa: E402
from tasks.tokenizer import tokenizer  # noqa: E402


def quiet(_: str) -> None:
    pass


def artifact(kind: str, folder: Path, meta: dict, name: str) -> Artifact:
    return Artifact(kind=kind, uri=str(folder), fingerprint=(name * 64)[:64], meta=meta)


def children_cpu() -> float:
    """CPU seconds of finished child processes (the trainer and torchrun), all threads."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def build_data(recipe, root: Path):
    """Corpora, tokenizer, token shards and the eval suite of the tiny recipe (no curation)."""
    corpora = []
    for src in recipe.sources:
        out = root / "corpus" / src.name
        corpora.append(
            artifact("corpus", out, source(SourceSpec(source=src, seed=recipe.seed), out=out, log=quiet), src.name)
        )
    tok_dir = root / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok = artifact("tokenizer", tok_dir, tokenizer(recipe.tokenizer, corpora, out=tok_dir, log=quiet), "t")
    shards = []
    for corpus in corpora:
        out = root / "shards" / corpus.short
        out.mkdir(parents=True, exist_ok=True)
        meta = tokenize(
            TokenizeSpec(tokenize=recipe.tokenize, seed=recipe.seed), tokenizer=tok, corpus=corpus, out=out, log=quiet
        )
        shards.append(artifact("shards", out, meta, "s" + corpus.short))
    suite_dir = root / "suite"
    suite = artifact(
        "eval",
        suite_dir,
        eval_suite(
            SuiteSpec(eval=recipe.eval, seed=recipe.seed), heldout=corpora, train=corpora, out=suite_dir, log=quiet
        ),
        "e",
    )
    return tok, shards, suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--stages", nargs="*", help="stage names to measure (default: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for evaluation")
    parser.add_argument("--train-threads", type=int, default=1, help="threads of the trainer")
    parser.add_argument("--no-old", action="store_true", help="skip lm-eval's stock `hf` path")
    parser.add_argument("--workdir", type=Path, help="keep everything here (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe, [f"training.num_threads={args.train_threads}"])
    root = args.workdir or Path(tempfile.mkdtemp(prefix="eval_cost_"))
    print(f"load average before: {load()} ({os.cpu_count()} cores); workdir {root}", flush=True)
    t0 = time.perf_counter()
    # What the first evaluate of a process pays once: both paths are timed after it.
    import datasets  # noqa: F401
    import lm_eval.models.huggingface  # noqa: F401
    import transformers.models.smollm3.modeling_smollm3  # noqa: F401

    import evals.lm  # noqa: F401

    print(f"one-time imports of evaluation: {time.perf_counter() - t0:.1f}s", flush=True)
    t0 = time.perf_counter()
    tok, shards, suite = build_data(recipe, root)
    print(f"data: {time.perf_counter() - t0:.1f}s; suite tasks {suite.meta['tasks']}", flush=True)

    runs = schedule_stages(recipe.training, recipe.stages, recipe.seed)
    if args.stages:  # later stages need not train
        unknown = set(args.stages) - {r.name for r in runs}
        if unknown:
            raise SystemExit(f"--stages {sorted(unknown)} are not stages of {args.recipe}")
        runs = runs[: max(i for i, r in enumerate(runs) if r.name in args.stages) + 1]
    rows, previous = [], None
    for run in runs:
        name = run.name
        stage = next(s for s in recipe.stages if s.name == name)
        plan_dir = root / "plans" / name
        plan_dir.mkdir(parents=True, exist_ok=True)
        spec = MixtureSpec.of(stage, recipe.seed)
        plan = artifact("mixture", plan_dir, mixture(spec, shards, out=plan_dir, log=quiet), "p" + name)
        out = root / "stages" / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        t, c = time.perf_counter(), children_cpu()
        meta = pretrain(run, plan, previous, out=out, log=quiet)
        train_s, train_cpu = time.perf_counter() - t, children_cpu() - c
        previous = artifact("checkpoint", out, meta, "c" + name)
        if args.stages and name not in args.stages:
            continue
        export_dir = root / "export" / name
        export_dir.mkdir(parents=True, exist_ok=True)
        model = artifact(
            "hf_model", export_dir, export(ExportConfig(), previous, tok, out=export_dir, log=quiet), "m" + name
        )
        long = run.kind != "pretrain"  # after context extension: the reasoning stages too
        tasks = stage_tasks(recipe.eval, suite, long, cloze=not long or recipe.eval.long_context_cloze)
        timings, cpu, scores = {}, {}, {}
        for path in (["hf"] if not args.no_old else []) + ["default"]:
            eval_dir = root / "eval" / name / path
            eval_dir.mkdir(parents=True, exist_ok=True)
            cfg = recipe.eval
            t, c = time.perf_counter(), time.process_time()
            if path == "hf":  # lm-eval's stock model, without the step's tables around it
                model_dir, task_dir = Path(model.meta["model_dir"]), Path(suite.meta["task_dir"])
                scores[path] = run_lm_eval(model_dir, task_dir, tasks, cfg, eval_dir, harness_model="hf")
            else:
                spec = EvalSpec(eval=cfg, long_context=long, cloze=not long or cfg.long_context_cloze)
                scores[path] = evaluate(spec, model, suite, out=eval_dir, log=quiet)["scores"]
            timings[path], cpu[path] = time.perf_counter() - t, time.process_time() - c
        same = "-"
        if "hf" in scores:
            same = all(
                abs(scores["hf"][t][m] - scores["default"][t][m]) < 1e-9
                for t in scores["hf"]
                for m in ("acc", "acc_norm")
            )
        row = {
            "stage": name,
            "steps": run.spec.steps,
            "seq_len": run.spec.seq_len,
            "train_s": train_s,
            "eval_s": timings["default"],
            "ratio": timings["default"] / train_s,
            "old_eval_s": timings.get("hf"),
            "old_ratio": timings["hf"] / train_s if "hf" in timings else None,
            "same_scores": same,
            "train_cpu_s": train_cpu,
            "eval_cpu_s": cpu["default"],
            "cpu_ratio": cpu["default"] / train_cpu,
            "old_eval_cpu_s": cpu.get("hf"),
            "load": load(),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(
        f"\nbaseline: stage training time (the pretrain step, trainer at {args.train_threads} thread(s)); "
        f"evaluation at {args.threads} torch thread(s); target ratio <= 0.25"
    )
    print(
        "wall seconds, then CPU seconds (robust to other load: eval in this process, training in its child processes)"
    )
    print(
        "| stage | steps x seq | train s | evaluate s | ratio | old evaluate s | old ratio | same acc "
        "| train cpu s | evaluate cpu s | cpu ratio | old evaluate cpu s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        old = f"{r['old_eval_s']:.1f} | {r['old_ratio']:.2f}" if r["old_eval_s"] is not None else "- | -"
        old_cpu = f"{r['old_eval_cpu_s']:.1f}" if r["old_eval_cpu_s"] is not None else "-"
        print(
            f"| {r['stage']} | {r['steps']} x {r['seq_len']} | {r['train_s']:.1f} | {r['eval_s']:.1f} | "
            f"{r['ratio']:.2f} | {old} | {r['same_scores']} | {r['train_cpu_s']:.1f} | "
            f"{r['eval_cpu_s']:.1f} | {r['cpu_ratio']:.2f} | {old_cpu} |"
        )
    print(f"load average after: {load()}")
    if args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
