"""The `smollm3` command line: run the flow, inspect recipes, plans, lineage and runs, drive the demo.

Installed as `.venv/bin/smollm3` (the `[project.scripts]` entry of pyproject.toml). Light commands
(`--help`, `runs`, `summary`, `lineage`, `recipe`, `plan`) import only what they use: no torch,
datatrove or transformers at module level anywhere on their import path, and Prefect only where a
flow graph is built (`plan`, `run`). `benchmarks/cli_latency.py` measures them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from infra.terminal import printable_lines  # text from the workspace is printed with its control characters escaped

if TYPE_CHECKING:
    from pipeline.lineage import Lineage

WORKSPACE_HELP = (
    "workspace folder holding lineage.duckdb (default: workspace, relative to "
    "$SMOLLM3_HOME or else the project root, as the flows resolve it)"
)


def _lineage(args) -> Lineage:
    """The workspace's lineage for a view: read-only (it writes nothing in the workspace)."""
    from pipeline.lineage import Lineage
    from pipeline.workspace import resolve_workspace

    return Lineage(resolve_workspace(args.workspace) / "lineage.duckdb", read_only=True)


def _refresh(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def cmd_run(args) -> int:
    import signal

    from flows.admission import check_run

    # What `plan` checks, before any Prefect server is looked for or started (flows/admission.py).
    check_run("smollm3", {"recipe": args.recipe, "overrides": args.overrides, "refresh": args.refresh})
    from flows.api import prefect_api

    # The run stops its steps on SIGTERM and SIGINT (pipeline/signals.py), then Prefect re-sends
    # SIGTERM to the handler it found: exit through Python, so exit hooks run (a temporary Prefect
    # server started for this run is stopped instead of left behind).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with prefect_api(log=lambda line: print(f"smollm3 run: {line}", file=sys.stderr)):
        from flows.prefect_flows import smollm3

        result = smollm3(recipe=args.recipe, overrides=args.overrides, refresh=args.refresh)
    print(result)
    return 0


def cmd_recipe(args) -> int:
    from flows.recipe import check_data, dump_recipe, load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    check_data(recipe)  # a glob matching nothing or a missing text field fails here, not mid-run
    print(dump_recipe(recipe), end="")
    return 0


def cmd_plan(args) -> int:
    from flows.params import check_refresh

    check_refresh(args.flow, args.refresh)
    from flows.graphs import plan
    from flows.recipe import ExecutorRefused, RecipeError, check_data, load_recipe
    from pipeline.dryrun import format_plan

    recipe = load_recipe(args.recipe, args.overrides)
    missing: dict[str, str] = {}
    if args.flow == "smollm3":
        try:  # refused as `run` refuses it, unless the plan is for data that lives elsewhere
            missing = check_data(recipe, allow_missing=args.allow_missing)
        except ExecutorRefused:
            raise
        except RecipeError as exc:
            raise RecipeError(
                f"{exc}\n(to plan a recipe whose data is on another machine, e.g. the cluster that will "
                "run it, add --allow-missing: its steps are then planned as unresolved)"
            ) from None
    rows = plan(recipe, frozenset(args.refresh), args.flow, args.base)
    print(format_plan(rows))
    if missing:  # planned all the same (--allow-missing): their steps are marked unresolved above
        print(f"{len(missing)} source(s) not on this machine, planned as unresolved (--allow-missing):")
        print(printable_lines("\n".join(f"  {name}: {why}" for name, why in missing.items())))
    return 0


def cmd_lineage(args) -> int:
    from flows.views import resolve_artifact, trained_on_table, tree

    lineage = _lineage(args)
    if bool(args.artifact) == bool(args.trained_on):
        raise ValueError("give an ARTIFACT (fingerprint or path) or --trained-on SOURCE")
    with lineage.reading():
        if args.trained_on:
            source = args.trained_on
            if Path(source).exists():  # a path inside a source, corpus or shards folder
                source = resolve_artifact(lineage, source)["fingerprint"]
            print(printable_lines(trained_on_table(lineage, source)))
        else:
            print(
                printable_lines(
                    tree(
                        lineage, resolve_artifact(lineage, args.artifact), descendants=args.descendants, full=args.full
                    )
                )
            )
    return 0


def cmd_runs(args) -> int:
    from flows.views import runs_table

    lineage = _lineage(args)
    with lineage.reading():
        print(printable_lines(runs_table(lineage, args.limit, steps=not args.no_steps)))
    return 0


def cmd_sql(args) -> int:
    """A query on a private, consistent copy of the lineage: never blocks the writers, and the
    copy's connection reaches no file but itself (no COPY TO, read_csv or ATTACH)."""
    lineage = _lineage(args)
    if not lineage.path.exists():
        raise LookupError(f"no lineage at {lineage.path}")
    import duckdb

    with lineage.snapshot() as con:
        try:
            writes = [t.type.name for t in con.extract_statements(args.query) if t.type.name not in _READS]
            print(printable_lines(con.sql(args.query)))
        except duckdb.Error as exc:  # a bad query is the user's input: say what DuckDB said, no traceback
            tables = ", ".join(sorted(r[0] for r in con.execute("SHOW TABLES").fetchall() if not r[0].startswith("_")))
            raise ValueError(f"{type(exc).__name__}: {exc}\n(tables: {tables})") from None
    if writes:  # the copy is thrown away: say so, rather than let a count suggest a change
        print(
            f"smollm3 sql: {', '.join(sorted(set(writes)))} ran on a private copy of the lineage, which is "
            "discarded: the lineage is unchanged (it is written only by runs)",
            file=sys.stderr,
        )
    return 0


# Statement kinds that only read (anything else ran on the copy and is discarded with it)
_READS = {"SELECT", "EXPLAIN", "PRAGMA", "SET", "VARIABLE_SET", "RELATION", "CALL"}


def cmd_report(args) -> int:
    from flows.views import find_run, report_summary, run_report

    lineage = _lineage(args)
    with lineage.reading():
        out = (
            Path(args.out)
            if args.out
            else lineage.path.parent / "reports" / f"{find_run(lineage, args.run)['run_id']}.md"
        )
        path = run_report(lineage, args.run, out)
        print(printable_lines(report_summary(lineage, args.run)))
        print(printable_lines(f"report: {path}"))
    return 0


def cmd_compare(args) -> int:
    """Two runs side by side (flows/compare.py); also a Prefect artifact when a server runs."""
    from flows.compare import compare_runs, publish
    from flows.views import find_run

    lineage = _lineage(args)
    with lineage.reading():
        a, b = (find_run(lineage, ref)["run_id"] for ref in (args.run_a, args.run_b))
        out = Path(args.out) if args.out else lineage.path.parent / "reports" / f"compare-{a[:8]}-{b[:8]}.md"
        result = compare_runs(lineage, a, b, out)
    print(printable_lines(result["text"]))
    print(f"\nreport: {result['report']}")
    if args.no_artifact:
        return 0
    from flows.api import running_api

    try:
        with running_api() as url:
            key = publish(result)
        print(f"Prefect artifact: {key} ({url.removesuffix('/api')}/artifacts/key/{key})")
    except LookupError as exc:  # no server: the report file is the comparison
        print(f"no Prefect artifact: {exc}")
    return 0


def cmd_summary(args) -> int:
    from flows.views import summary

    ui = args.ui
    if ui is None:
        ui = os.environ.get("PREFECT_API_URL", "").removesuffix("/api") or None
    lineage = _lineage(args)
    with lineage.reading():
        print(printable_lines(summary(lineage, ui)))
    return 0


PREFLIGHT_USAGE = (
    "smollm3 preflight RECIPE [key=value ...]\n"
    "       smollm3 preflight [--config FILE] [--facts FILE] [--json FILE] [--list] "
    "[key=value | facts.key=value ...]"
)
PREFLIGHT_HELP = """\
Check that this machine can train a recipe before training starts: the config (batch layout,
sequence length, stage plan), GPUs (count, matmul throughput, throttling, memory, ECC, DCGM, NCCL
all-reduce) or CPU and gloo, storage (free space, checkpoint IO, S3, DCP) and data (shards, epochs,
vocabulary, eval tasks); `--list` names every check. Prints one row per check.
Exit status: 0 go, 1 stop (a check failed), 2 bad input.

With a RECIPE (a name in configs/ or a YAML path, plus key=value overrides of it), the facts come
from the recipe, as the flow's preflight step takes them. Without one, give the facts by hand."""
PREFLIGHT_EPILOG = """\
examples:
  smollm3 preflight tiny                                the tiny recipe on this machine
  smollm3 preflight smollm3-3b training.nproc_per_node=8
  smollm3 preflight --list                              the registered checks
  smollm3 preflight --facts facts.yaml allow_warn=true facts.nproc_per_node=8 --json out.json"""


def cmd_preflight(args) -> int:
    """`smollm3 preflight RECIPE [key=value ...]` checks a recipe's training setup on this machine;
    without a recipe the arguments are the hand-given form (facts and thresholds)."""
    argv = list(args.args)
    if not argv or argv[0].startswith("-") or "=" in argv[0] or {"-h", "--help"} & set(argv):
        from infra.preflight.cli import main as preflight_main

        return preflight_main(
            argv, prog="smollm3 preflight", usage=PREFLIGHT_USAGE, description=PREFLIGHT_HELP, epilog=PREFLIGHT_EPILOG
        )
    from flows.recipe import load_recipe
    from infra.preflight import PreflightFacts, format_table, run_preflight, should_stop
    from model.config import model_facts
    from tasks.preflight import PreflightSpec

    recipe = load_recipe(argv[0], argv[1:])
    spec = PreflightSpec.for_recipe(recipe)
    t = recipe.training
    facts = PreflightFacts.from_dict(
        {**spec.facts, **spec.run_facts, **model_facts(t.model, dict(t.model_overrides), recipe.tokenizer.vocab_size)}
    )
    results = run_preflight(recipe.preflight, facts, log=lambda _: None)
    print(format_table(results))
    stop = should_stop(results, recipe.preflight.allow_warn)
    print("preflight: STOP (fix the failing checks)" if stop else "preflight: go")
    return 1 if stop else 0


def cmd_capacity(args) -> int:
    argv = list(args.args)
    if "--recipe" in argv:  # a recipe's stages: layout and predicted memory per GPU (flows/fit.py)
        from flows.fit import format_rows, stage_rows
        from flows.recipe import load_recipe

        at = argv.index("--recipe")
        if at + 1 >= len(argv):
            raise ValueError("--recipe needs a recipe name or path, then optional key=value overrides")
        others = argv[:at] + argv[at + 2 :]
        if any(not a.count("=") for a in others):
            raise ValueError("with --recipe, the other arguments are key=value overrides of the recipe")
        from flows.data_plan import data_rows, format_data_rows

        recipe = load_recipe(argv[at + 1], others)
        print(format_rows(stage_rows(recipe)))
        print(format_data_rows(data_rows(recipe)[0], recipe))
        return 0
    from infra.capacity import main as planner_main

    return planner_main(argv)


def cmd_eval_quality(args) -> int:
    from evals.quality import main as quality_main

    return quality_main(args.args, prog="smollm3 eval-quality")


def cmd_serve(args) -> int:
    from flows.deployments import main

    main()
    return 0


def cmd_watch(args) -> int:
    """Follow a flow run until it ends (flows/watch.py); exit 0 when it Completed."""
    from flows.api import running_api

    with running_api() as url:
        from prefect.client.orchestration import get_client

        from flows.watch import find_flow_run, watch
        from pipeline.workspace import resolve_workspace

        with get_client(sync_client=True) as client:
            run = find_flow_run(client, args.run)
        state = run.state.name if run.state else "Pending"
        print(
            f"watching flow run {run.name} ({run.id}), {state}; UI: {url.removesuffix('/api')}/runs/flow-run/{run.id}"
        )
        path = resolve_workspace(args.workspace) / "lineage.duckdb"
        final, _ = watch(
            run.id,
            poll=args.poll,
            lineage=_lineage(args) if path.exists() else None,
            every_s=args.every,
            backlog=False,
            prefix="",
        )
    return 0 if final == "Completed" else 1


def cmd_demo(args) -> int:
    from flows.demo import up
    from flows.recipe import RecipeError, load_recipe, recipe_path

    try:  # a bad recipe fails here, before a server starts
        load_recipe(args.recipe)
    except RecipeError as exc:
        raise SystemExit(str(exc)) from None
    recipe = args.recipe
    if Path(recipe).suffix in {".yaml", ".yml"}:  # a file: the served run resolves it from elsewhere
        recipe = str(recipe_path(recipe).resolve())
    return up(Path(args.workspace), args.port, Path(args.state), recipe=recipe)


def cmd_down(args) -> int:
    from flows.demo import down

    return down(Path(args.state))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smollm3",
        description="Train a SmolLM3-style model end to end as a Prefect DAG with DuckDB lineage.",
        epilog="`smollm3 COMMAND --help` explains a command and its arguments.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn, help: str, workspace: bool = False, **kw) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=kw.pop("description", help), **kw)
        p.set_defaults(fn=fn)
        if workspace:
            p.add_argument("--workspace", default="workspace", help=WORKSPACE_HELP)
        return p

    known = ", ".join(sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "configs").glob("*.yaml")))
    recipe_help = f"recipe name in configs/ ({known}) or a YAML path (default: tiny)"
    overrides_help = (
        "key=value overrides of the recipe, list items by name, e.g. "
        "sources.math.max_documents=100 stages.stage2.tokens=1e9"
    )

    p = add(
        "run",
        cmd_run,
        "run the smollm3 flow in this process (no server or deployment needed)",
        description="Check the recipe, overrides and data as `plan` does (a bad one fails at once), "
        "then run the smollm3 flow in this process, reporting to PREFECT_API_URL when set, else to "
        "the demo's server when it runs, else to a Prefect server started for this run.",
    )
    p.add_argument("recipe", nargs="?", default="tiny", help=recipe_help)
    p.add_argument("overrides", nargs="*", help=overrides_help)
    p.add_argument(
        "--refresh",
        type=_refresh,
        default=[],
        metavar="STEP[,STEP]",
        help="step names to rebuild even if finished, e.g. preflight,evaluate "
        "(unknown names are refused with the flow's steps)",
    )

    p = add(
        "recipe",
        cmd_recipe,
        "validate a recipe (its data sources, and a sample of each readable one through its curation "
        "preset) and print it resolved",
    )
    p.add_argument("recipe", nargs="?", default="tiny", help=recipe_help)
    p.add_argument("overrides", nargs="*", help=overrides_help)

    p = add("plan", cmd_plan, "dry run of a flow: every step as run or reuse, and why a step would run")
    p.add_argument("recipe", nargs="?", default="tiny", help=recipe_help)
    p.add_argument("overrides", nargs="*", help=overrides_help)
    p.add_argument(
        "--flow",
        default="smollm3",
        choices=("smollm3", "anneal", "cpt"),
        help="which deployed flow to plan: smollm3 (smollm3/full), anneal (anneal/nightly), "
        "cpt (cpt/on-demand); default smollm3",
    )
    p.add_argument(
        "--base",
        default="",
        help="anneal/cpt: the base checkpoint (path or fingerprint; default: resolved as the flow does)",
    )
    p.add_argument(
        "--refresh",
        type=_refresh,
        default=[],
        metavar="STEP[,STEP]",
        help="step names to plan as forced reruns (unknown names are refused with the flow's steps)",
    )
    p.add_argument(
        "--allow-missing",
        action="store_true",
        help="plan sources whose data is not on this machine (a files: glob matching nothing, a "
        "folder not here) as unresolved instead of refusing the recipe as `run` does",
    )

    p = add(
        "lineage",
        cmd_lineage,
        "what produced an artifact, what descends from it, or which checkpoints trained on a source",
        True,
        description="Print the ancestor tree of an artifact (or its descendants), or, with "
        "--trained-on, the checkpoints whose training drew tokens from a source.",
    )
    p.add_argument("artifact", nargs="?", help="a fingerprint (prefix of 4+ hex chars) or a path in a step folder")
    p.add_argument("--descendants", action="store_true", help="walk downstream instead of upstream")
    p.add_argument(
        "--full",
        action="store_true",
        help="also print each edge to an artifact already listed (as `(above)`); by default they are counted",
    )
    p.add_argument(
        "--trained-on",
        metavar="SOURCE",
        help="list the checkpoints that drew tokens from SOURCE (a source name such as "
        "prose, or the fingerprint or folder of one source, curated corpus or shards "
        "artifact), per stage and cumulative through init; descent through the "
        "tokenizer is not training on a source and is not listed",
    )

    p = add("runs", cmd_runs, "list flow runs with their steps and states", True)
    p.add_argument("--limit", type=int, default=10, help="newest runs to list (default 10)")
    p.add_argument("--no-steps", action="store_true", help="one line per run")

    p = add(
        "report",
        cmd_report,
        "write a run's report (steps, evals, stage summaries, loss curves, lineage) to a file",
        True,
    )
    p.add_argument("run", nargs="?", default="latest", help="run id, id prefix or `latest`")
    p.add_argument("--out", default=None, help="markdown file (default: WORKSPACE/reports/RUN_ID.md)")

    p = add(
        "compare",
        cmd_compare,
        "compare two runs: config differences, both loss curves on one plot, evals side by side with noise",
        True,
        description="Compare two runs from lineage: the recipe fields that differ, both loss curves on "
        "one plot (against tokens), and the eval tables side by side, each difference with its "
        "stderr and whether it is beyond noise. Writes a markdown report (and its plot) and, when "
        "a Prefect server runs (PREFECT_API_URL or the demo's), a markdown artifact.",
    )
    p.add_argument("run_a", help="run id, id prefix or `latest`")
    p.add_argument("run_b", help="run id, id prefix or `latest`")
    p.add_argument("--out", default=None, help="markdown file (default: WORKSPACE/reports/compare-A-B.md)")
    p.add_argument("--no-artifact", action="store_true", help="do not publish the Prefect artifact")

    p = add("sql", cmd_sql, "run a SQL query on a consistent copy of the lineage database (never blocks runs)", True)
    p.add_argument("query", help='e.g. "SELECT step, label, state, seconds FROM steps ORDER BY started"')

    p = add("summary", cmd_summary, "the newest run, its steps and the newest artifact's lineage", True)
    p.add_argument("--ui", default=None, help="Prefect UI address to print (default: from PREFECT_API_URL)")

    # These three have parsers of their own (they run standalone too): `smollm3 X --help`.
    p = add(
        "preflight",
        cmd_preflight,
        "preflight RECIPE [key=value]: GPU, network, storage, data and config checks (exit 1 = stop)",
    )
    p.add_argument("args", nargs="*", help="see `smollm3 preflight --help`")
    p = add(
        "capacity",
        cmd_capacity,
        "GPUs, memory per GPU and time for a model, tokens and deadline; --recipe: per stage of a recipe",
    )
    p.add_argument("args", nargs="*", help="see `smollm3 capacity --help`")
    p = add(
        "eval-quality",
        cmd_eval_quality,
        "which eval tasks give signal in a run (monotonicity, SNR, margin, ranking) and why",
    )
    p.add_argument("args", nargs="*", help="see `smollm3 eval-quality --help`")

    add("serve", cmd_serve, "serve all deployments (smollm3/full, ...) against PREFECT_API_URL")

    p = add(
        "watch",
        cmd_watch,
        "follow a flow run live: state changes, each running step's training line or eval progress",
        True,
        description="Follow a flow run of the Prefect server (PREFECT_API_URL, else the demo's) until "
        "it ends: a line per step state change (retries included), each running step's latest "
        "training line (step/total, loss, tokens/s, ETA) or evaluation progress at most every "
        "--every seconds. Exit 0 when the run Completed, 1 otherwise.",
    )
    p.add_argument("run", nargs="?", default="latest", help="flow run id, id prefix or `latest` (default)")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between looks at the API (default 2)")
    p.add_argument(
        "--every", type=float, default=10.0, help="seconds between two progress lines of one step (default 10)"
    )

    p = add("demo", cmd_demo, "start the Prefect server and serve process, run smollm3/full, summarise", True)
    p.add_argument("--port", type=int, default=4200, help="Prefect server port on 127.0.0.1 (default 4200)")
    p.add_argument("--state", default=".demo", help="folder for the demo's pid and log files")
    p.add_argument(
        "--recipe",
        default="tiny",
        help="the recipe the demo's run trains (default tiny; tiny-learn: tuned to show learning, ~11 min)",
    )

    p = add("down", cmd_down, "stop exactly the processes `smollm3 demo` started")
    p.add_argument("--state", default=".demo", help="folder `smollm3 demo` kept its pid files in")
    add_experiment_commands(add)
    return parser


# --- experiments: `smollm3 ablate`, `smollm3 experiments` (flows/ablation.py, evals/experiments.py) ---


def cmd_ablate(args) -> int:
    """Run the ablation flow in this process (or plan it) and print the comparison."""
    if args.plan:
        from flows.ablation import ablation_spec, arm_recipes, graph
        from pipeline.dryrun import format_plan, plan_graph
        from pipeline.workspace import Workspace

        spec = ablation_spec(
            args.variant, args.seeds, args.eval_every, args.heldout_tokens, args.lm_eval, args.confidence, args.name
        )
        arms = arm_recipes(args.recipe, args.overrides, spec.variants)
        base = arms["baseline"]
        print(
            format_plan(
                plan_graph(graph(arms, spec, tolerant=True), Workspace.at(base.workspace), frozenset(args.refresh))
            )
        )
        return 0
    from flows.prefect_flows import ablation

    result = ablation(
        recipe=args.recipe,
        variants=args.variant,
        seeds=args.seeds,
        overrides=args.overrides,
        refresh=args.refresh,
        eval_every=args.eval_every,
        heldout_tokens=args.heldout_tokens,
        lm_eval=args.lm_eval,
        confidence=args.confidence,
        name=args.name,
    )
    print(Path(result["report"]).read_text())
    print(
        f"experiment {result['experiment'][:12]} (run {result['run_id']}): "
        f"`smollm3 experiments {result['experiment'][:12]}` prints it again"
    )
    return 0


def cmd_experiments(args) -> int:
    from evals.experiments import experiment_text

    print(experiment_text(_lineage(args), args.experiment, args.kind))
    return 0


def add_experiment_commands(add) -> None:
    p = add(
        "ablate",
        cmd_ablate,
        "ablate RECIPE --variant NAME:key=value,... [--seeds N]: train the recipe and "
        "each variant with N seeds, compare them on the evals that carry signal",
    )
    p.add_argument("recipe", nargs="?", default="tiny", help="recipe name in configs/ or a YAML path (the baseline)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every arm, e.g. a shorter stage")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        required=True,
        metavar="NAME:key=value[,key=value]",
        help="a variant: recipe overrides over the baseline (repeat for several), e.g. "
        "docmask_off:training.doc_masking=false",
    )
    p.add_argument("--seeds", type=int, default=2, help="runs per variant (seed + k); 1 leaves the noise unknown")
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="steps between kept checkpoints scored on held-out bits per byte (default: ~8 per run)",
    )
    p.add_argument("--heldout-tokens", type=int, default=8192, help="held-out tokens per source (default 8192)")
    p.add_argument(
        "--lm-eval",
        choices=("stages", "final", "none"),
        default="stages",
        help="lm-eval cloze tasks after every pretrain stage (default), the last one, or never",
    )
    p.add_argument("--confidence", type=float, default=0.95, help="of each difference's interval (default 0.95)")
    p.add_argument("--name", default="", help="experiment name (default: the variant names joined by +)")
    p.add_argument(
        "--refresh",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        help="comma-separated step names to rerun even if finished",
    )
    p.add_argument(
        "--plan", action="store_true", help="print the plan (each step run or reuse, and why); train nothing"
    )

    p = add("experiments", cmd_experiments, "list experiments (ablations, anneals), or print one's comparison", True)
    p.add_argument("experiment", nargs="?", default=None, help="experiment id or prefix (default: list them)")
    p.add_argument("--kind", choices=("ablation", "anneal"), default=None, help="list only this kind")


PASS_THROUGH = {"preflight": cmd_preflight, "capacity": cmd_capacity, "eval-quality": cmd_eval_quality}


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the process's entry (console script, `python -m flows.cli`), not a caller's
        import faulthandler

        # A native crash (torch or a library's C code in the flow `run` or `ablate` runs here, an
        # in-process evaluation's, say) prints every thread's Python stack on stderr before it dies.
        faulthandler.enable(all_threads=True)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in PASS_THROUGH:  # their own parsers own every option, --help included
        command, fn, args = argv[0], PASS_THROUGH[argv[0]], argparse.Namespace(args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
        command, fn = args.command, args.fn
    try:
        return fn(args) or 0
    except (LookupError, ValueError, FileNotFoundError) as exc:  # RecipeError is a ValueError
        print(f"smollm3 {command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
