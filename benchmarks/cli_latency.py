"""How long the light `smollm3` commands take, each as a fresh process (what a user waits for).

    python benchmarks/cli_latency.py [--runs 5] [--workspace WORKSPACE] [--keep]

Each command runs `--runs` times as `python -m flows.cli ...` (the `smollm3` console script is
the same entry point) and the median wall time is printed against its target: 1.5 s for `--help`,
`runs`, `summary`, `lineage`, `lineage --trained-on`, `recipe` and `eval-quality`, 3 s for
`plan tiny`.

The lineage commands need a lineage to read. With `--workspace`, the benchmark reads that
workspace (a real run's). Without it, it writes one of the tiny recipe's shape into a temporary
`$SMOLLM3_HOME`: every node of the tiny DAG (as `smollm3 plan tiny` builds it) recorded as an
artifact with its real fingerprint and input edges, three runs of step rows, a mixture ledger on
each training stage and scores on each evaluation, through the same `Lineage` writes the runner
uses. It measures the reads,
not a training run, so it takes seconds. `plan tiny` plans against that workspace too.

Print `uptime` with the figures: the machine is shared, and the load changes them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FAST, PLAN = 1.5, 3.0


def build_tiny_lineage(home: Path, runs: int = 3) -> tuple[str, str]:
    """A lineage of the tiny DAG's shape under `home/workspace`; returns (a fingerprint of the
    final model, a source name) for the lineage commands."""
    from flows.recipe import load_recipe
    from flows.smollm3 import graph
    from pipeline.artifact import Artifact
    from pipeline.lineage import Lineage, StepRow

    recipe = load_recipe("tiny", [])
    g = graph(recipe, tolerant=True)
    lineage = Lineage(home / "workspace" / "lineage.duckdb")
    sources = [s.name for s in recipe.sources]
    artifacts: dict[str, Artifact] = {}
    for node in g:
        meta: dict = {"seconds": 1.0}
        if node.step.name in ("source", "curate", "tokenize"):
            meta["source"] = node.label
        if node.step.name == "pretrain":  # every stage draws from every source of the tiny mixes
            meta |= {
                "stage": node.label,
                "steps": 10,
                "tokens_per_source": {s: 4096 * (i + 1) for i, s in enumerate(sources)},
            }
        if node.step.name == "evaluate":  # scores for eval-quality: rising a little per stage
            k = sum(n.step.name == "evaluate" for n in list(g)[: list(g).index(node)])
            meta |= {
                "random_accuracy": 0.25,
                "scores": {
                    t: {"acc_norm": 0.25 + 0.01 * k * (j + 1), "acc_norm_stderr": 0.03}
                    for j, t in enumerate(("prose_cloze", "code_cloze", "math_cloze"))
                },
            }
        art = Artifact(
            kind=node.step.kind,
            uri=str(home / "workspace" / node.step.name / node.short),
            fingerprint=node.fingerprint,
            meta=meta,
        )
        artifacts[node.key] = art
        parents = [artifacts[r.key] for r in node.refs() if hasattr(r, "key")]
        parents += [artifacts[gate.key] for gate in node.after]
        lineage.record_artifact(art, node.step.name, node.label, node.config, parents)
    start = datetime(2026, 1, 1)
    for r in range(runs):
        run_id = f"bench-{r:04d}-0000-0000-0000-000000000000"
        lineage.start_run(run_id, "smollm3", "full", "tiny", {"name": "tiny"}, attempt=1)
        for i, node in enumerate(g):
            t = start + timedelta(hours=r, seconds=i)
            lineage.record_step(
                StepRow(
                    run_id,
                    node.step.name,
                    node.label,
                    node.fingerprint,
                    "completed" if r == 0 else "cached",
                    {},
                    "bench",
                    t,
                    t + timedelta(seconds=1),
                )
            )
        lineage.end_run(run_id, "completed", attempt=1)
    return g.final.fingerprint, sources[0]


def time_command(args: list[str], env: dict[str, str], runs: int) -> tuple[float, list[float], int]:
    """Median seconds of `python -m flows.cli ARGS` as a fresh process, every time, the exit code.

    Exit 2 (the command's answer to bad input, e.g. a recipe whose data is not on this machine)
    is an answer too; anything else fails the benchmark."""
    times, code = [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True
        )
        times.append(time.perf_counter() - t0)
        code = done.returncode
        if code not in (0, 2):
            raise SystemExit(f"smollm3 {' '.join(args)} failed ({code}):\n{done.stderr[-2000:]}")
    return statistics.median(times), times, code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per command (median reported)")
    parser.add_argument("--workspace", default=None, help="read this workspace's lineage instead of a generated one")
    parser.add_argument("--keep", action="store_true", help="keep the generated workspace")
    args = parser.parse_args(argv)

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    tmp = None
    if args.workspace:
        workspace = str(Path(args.workspace).resolve())
        from flows.views import final_artifact
        from pipeline.lineage import Lineage

        lineage = Lineage(Path(workspace) / "lineage.duckdb")
        runs = lineage.runs(1)
        final = final_artifact(lineage, runs[0]["run_id"]) if runs else None
        if final is None:
            raise SystemExit(f"no run with artifacts in {lineage.path}")
        fingerprint, source = final["fingerprint"], "prose"
    else:
        tmp = Path(tempfile.mkdtemp(prefix="cli-latency-"))
        env["SMOLLM3_HOME"] = str(tmp)
        os.environ["SMOLLM3_HOME"] = str(tmp)
        t0 = time.perf_counter()
        fingerprint, source = build_tiny_lineage(tmp)
        print(f"generated a tiny-shaped lineage in {tmp / 'workspace'} ({time.perf_counter() - t0:.1f} s)")
        workspace = "workspace"
    commands = [
        (["--help"], FAST),
        (["runs", "--workspace", workspace], FAST),
        (["summary", "--workspace", workspace], FAST),
        (["lineage", fingerprint[:12], "--workspace", workspace], FAST),
        (["lineage", "--trained-on", source, "--workspace", workspace], FAST),
        (["recipe", "smollm3-3b"], FAST),
        (["recipe", "tiny"], FAST),
        (["eval-quality", workspace], FAST),
        (["plan", "tiny", f"workspace={workspace}"], PLAN),
    ]
    print(
        f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} "
        f"(1/5/15 min), {os.cpu_count()} CPUs, {args.runs} runs per command"
    )
    print(f"{'command':<48}{'median':>8}{'target':>8}  {'ok':<4}{'exit':<5}runs")
    failed = 0
    for cmd, target in commands:
        median, times, code = time_command(cmd, env, args.runs)
        ok = median <= target
        failed += not ok
        shown = " ".join(c if len(c) < 24 else "..." + c[-12:] for c in cmd if c != "--workspace" and c != workspace)
        print(
            f"smollm3 {shown:<40}{median:>7.2f}s{target:>7.1f}s  {'yes' if ok else 'NO':<4}{code:<5}"
            + " ".join(f"{t:.2f}" for t in times)
        )
    print(f"load after: {os.getloadavg()[0]:.2f}")
    if tmp is not None and not args.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
