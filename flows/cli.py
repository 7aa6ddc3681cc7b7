"""The `smollm3` command line: run the flow, inspect recipes, lineage and runs, drive the demo."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from infra.lineage import Lineage


def _lineage(args) -> Lineage:
    from infra.workspace import resolve_workspace

    return Lineage(resolve_workspace(args.workspace) / "lineage.duckdb")


def cmd_run(args) -> int:
    from flows.smollm3 import smollm3

    result = smollm3(recipe=args.recipe, overrides=args.overrides, refresh=args.refresh)
    print(result)
    return 0


def cmd_recipe(args) -> int:
    from tasks.recipe import check_data, dump_recipe, load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    check_data(recipe)  # a glob matching nothing or a missing text field fails here, not mid-run
    print(dump_recipe(recipe), end="")
    return 0


def cmd_plan(args) -> int:
    from flows.plan import format_plan, plan
    from tasks.recipe import check_data, load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    if args.flow == "smollm3":
        check_data(recipe)
    rows = plan(recipe, frozenset(args.refresh), args.flow, args.base)
    print(format_plan(rows))
    return 0


def cmd_lineage(args) -> int:
    from flows.report import resolve_artifact, tree

    lineage = _lineage(args)
    print(tree(lineage, resolve_artifact(lineage, args.artifact), descendants=args.descendants))
    return 0


def cmd_runs(args) -> int:
    from flows.report import runs_table

    print(runs_table(_lineage(args), args.limit, steps=not args.no_steps))
    return 0


def cmd_sql(args) -> int:
    """A query on a private, consistent copy of the lineage: never blocks the writers."""
    lineage = _lineage(args)
    if not lineage.path.exists():
        raise LookupError(f"no lineage at {lineage.path}")
    with lineage.snapshot() as con:
        print(con.sql(args.query))
    return 0


def cmd_report(args) -> int:
    from flows.report import find_run, run_report

    lineage = _lineage(args)
    out = Path(args.out) if args.out else lineage.path.parent / "reports" / f"{find_run(lineage, args.run)['run_id']}.md"
    print(run_report(lineage, args.run, out))
    return 0


def cmd_summary(args) -> int:
    from flows.report import summary

    print(summary(_lineage(args), args.ui))
    return 0


def cmd_preflight(args) -> int:
    """`smollm3 preflight RECIPE [key=value ...]` checks a recipe's training setup on this machine;
    without a recipe name the arguments go to `python -m infra.preflight` (facts and thresholds
    given by hand)."""
    argv = list(args.args)
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        from infra.preflight.cli import main as preflight_main

        return preflight_main(argv)
    from infra.preflight import PreflightFacts, format_table, run_preflight, should_stop
    from tasks.preflight import model_facts, spec_for
    from tasks.recipe import load_recipe

    recipe = load_recipe(argv[0], argv[1:])
    spec = spec_for(recipe)
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
    from infra.planner import main as planner_main

    return planner_main(args.args)


def cmd_serve(args) -> int:
    from flows.deployments import main

    main()
    return 0


def cmd_demo(args) -> int:
    from flows.demo import up

    return up(Path(args.workspace), args.port, Path(args.state))


def cmd_down(args) -> int:
    from flows.demo import down

    return down(Path(args.state))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smollm3",
        description="Train a SmolLM3-style model end to end as a Prefect DAG with DuckDB lineage.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn, help: str, workspace: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(fn=fn)
        if workspace:
            p.add_argument("--workspace", default="workspace",
                           help="workspace folder holding lineage.duckdb (default: ./workspace)")
        return p

    p = add("run", cmd_run, "run the smollm3 flow in this process (no deployment needed)")
    p.add_argument("recipe", nargs="?", default="tiny", help="recipe name in configs/ or a YAML path")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. sources.math.max_documents=100")
    p.add_argument("--refresh", type=lambda s: [x for x in s.split(",") if x], default=[],
                   help="comma-separated step names to rerun even if finished")

    p = add("recipe", cmd_recipe, "validate a recipe and print it resolved (with overrides)")
    p.add_argument("recipe", nargs="?", default="tiny")
    p.add_argument("overrides", nargs="*")

    p = add("plan", cmd_plan, "dry run of a flow: every step as run or reuse, and why a step would run")
    p.add_argument("recipe", nargs="?", default="tiny")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--flow", default="smollm3", choices=("smollm3", "anneal", "cpt"),
                   help="which deployed flow to plan: smollm3 (smollm3/full), anneal (anneal/nightly), "
                        "cpt (cpt/on-demand); default smollm3")
    p.add_argument("--base", default="",
                   help="anneal/cpt: the base checkpoint (path or fingerprint; default: resolved as the flow does)")
    p.add_argument("--refresh", type=lambda s: [x for x in s.split(",") if x], default=[],
                   help="comma-separated step names to plan as forced reruns")

    p = add("lineage", cmd_lineage, "print what produced an artifact (or what descends from it)", True)
    p.add_argument("artifact", help="a fingerprint (prefix of 4+ hex chars) or a path in a step folder")
    p.add_argument("--descendants", action="store_true", help="walk downstream instead of upstream")

    p = add("runs", cmd_runs, "list flow runs with their steps and states", True)
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--no-steps", action="store_true", help="one line per run")

    p = add("report", cmd_report, "write a run's report (steps, evals, stage summaries, loss curves, lineage) to a file", True)
    p.add_argument("run", nargs="?", default="latest", help="run id, id prefix or `latest`")
    p.add_argument("--out", default=None, help="markdown file (default: WORKSPACE/reports/RUN_ID.md)")

    p = add("sql", cmd_sql, "run a SQL query on a consistent copy of the lineage database (never blocks runs)", True)
    p.add_argument("query", help="e.g. \"SELECT step, label, state, seconds FROM steps ORDER BY started\"")

    p = add("summary", cmd_summary, "the newest run, its steps and the newest artifact's lineage", True)
    p.add_argument("--ui", default=None, help="Prefect UI address to print (default: from PREFECT_API_URL)")

    p = add("preflight", cmd_preflight, "preflight RECIPE [key=value]: GPU, network, storage, data and config checks (exit 1 = stop)")
    p.add_argument("args", nargs="*", help="see `smollm3 preflight --help`")

    p = add("capacity", cmd_capacity, "GPUs, memory per GPU and time for a model, tokens and deadline")
    p.add_argument("args", nargs="*", help="see `smollm3 capacity --help`")

    p = add("eval-quality", cmd_eval_quality, "eval-quality WORKSPACE: which eval tasks give signal (monotonicity, SNR, margin, ranking)")
    p.add_argument("args", nargs="*", help="see `smollm3 eval-quality --help`")

    add("serve", cmd_serve, "serve all deployments (smollm3/full, ...) against PREFECT_API_URL")

    p = add("demo", cmd_demo, "start the Prefect server and serve process, run smollm3/full, summarise", True)
    p.add_argument("--port", type=int, default=4200)
    p.add_argument("--state", default=".demo", help="folder for the demo's pid and log files")

    p = add("down", cmd_down, "stop exactly the processes `smollm3 demo` started")
    p.add_argument("--state", default=".demo")
    add_experiment_commands(add)
    return parser


# --- experiments: `smollm3 ablate`, `smollm3 experiments` (flows/ablation.py, tasks/experiment.py) ---


def cmd_ablate(args) -> int:
    """Run the ablation flow in this process (or plan it) and print the comparison."""
    if args.plan:
        from flows.ablation import ablation_spec, arm_recipes, graph
        from flows.plan import format_plan, plan_graph
        from infra.workspace import Workspace

        spec = ablation_spec(args.variant, args.seeds, args.eval_every, args.heldout_tokens, args.lm_eval,
                             args.confidence, args.name)
        arms = arm_recipes(args.recipe, args.overrides, spec.variants)
        base = arms["baseline"]
        print(format_plan(plan_graph(graph(arms, spec, tolerant=True), Workspace.at(base.workspace),
                                     frozenset(args.refresh))))
        return 0
    from flows.ablation import ablation

    result = ablation(recipe=args.recipe, variants=args.variant, seeds=args.seeds, overrides=args.overrides,
                      refresh=args.refresh, eval_every=args.eval_every, heldout_tokens=args.heldout_tokens,
                      lm_eval=args.lm_eval, confidence=args.confidence, name=args.name)
    print(Path(result["report"]).read_text())
    print(f"experiment {result['experiment'][:12]} (run {result['run_id']}): "
          f"`smollm3 experiments {result['experiment'][:12]}` prints it again")
    return 0


def cmd_experiments(args) -> int:
    from tasks.experiment import experiment_text

    print(experiment_text(_lineage(args), args.experiment, args.kind))
    return 0


def add_experiment_commands(add) -> None:
    p = add("ablate", cmd_ablate, "ablate RECIPE --variant NAME:key=value,... [--seeds N]: train the recipe and "
            "each variant with N seeds, compare them on the evals that carry signal")
    p.add_argument("recipe", nargs="?", default="tiny", help="recipe name in configs/ or a YAML path (the baseline)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every arm, e.g. a shorter stage")
    p.add_argument("--variant", action="append", default=[], required=True, metavar="NAME:key=value[,key=value]",
                   help="a variant: recipe overrides over the baseline (repeat for several), e.g. "
                        "docmask_off:training.doc_masking=false")
    p.add_argument("--seeds", type=int, default=2, help="runs per variant (seed + k); 1 leaves the noise unknown")
    p.add_argument("--eval-every", type=int, default=None,
                   help="steps between kept checkpoints scored on held-out bits per byte (default: ~8 per run)")
    p.add_argument("--heldout-tokens", type=int, default=8192, help="held-out tokens per source (default 8192)")
    p.add_argument("--lm-eval", choices=("stages", "final", "none"), default="stages",
                   help="lm-eval cloze tasks after every pretrain stage (default), the last one, or never")
    p.add_argument("--confidence", type=float, default=0.95, help="of each difference's interval (default 0.95)")
    p.add_argument("--name", default="", help="experiment name (default: the variant names joined by +)")
    p.add_argument("--refresh", type=lambda s: [x for x in s.split(",") if x], default=[],
                   help="comma-separated step names to rerun even if finished")
    p.add_argument("--plan", action="store_true", help="print the plan (each step run or reuse, and why); train nothing")

    p = add("experiments", cmd_experiments, "list experiments (ablations, anneals), or print one's comparison", True)
    p.add_argument("experiment", nargs="?", default=None, help="experiment id or prefix (default: list them)")
    p.add_argument("--kind", choices=("ablation", "anneal"), default=None, help="list only this kind")


def cmd_eval_quality(args) -> int:
    from tasks.eval_quality import main as quality_main

    return quality_main(args.args)


PASS_THROUGH = {"preflight": cmd_preflight, "capacity": cmd_capacity, "eval-quality": cmd_eval_quality}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in PASS_THROUGH:  # their own parsers own every option, --help included
        return PASS_THROUGH[argv[0]](argparse.Namespace(args=argv[1:])) or 0
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) == "summary" and args.ui is None:
        api = os.environ.get("PREFECT_API_URL", "")
        args.ui = api.removesuffix("/api") or None
    from tasks.recipe import RecipeError

    try:
        return args.fn(args) or 0
    except (RecipeError, LookupError, ValueError, FileNotFoundError) as exc:
        print(f"smollm3 {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
