"""Where a flow run's time goes: wall time, the sum of step times, parallelism, the critical path.

    python benchmarks/dag_timing.py WORKSPACE [--run RUN_ID] [--baseline OTHER_WORKSPACE]

Reads the run's rows from the workspace's lineage (`flow_runs`, `steps`, `edges`), so it measures
any run of any version of the pipeline that recorded them: the newest run by default.

- wall: the flow run's recorded start to end (what a user waits for);
- parallelism: sum of step seconds / wall seconds, against the baseline of serial execution (1.00:
  every step waits for the last);
- critical path: the longest chain of dependent steps (lineage edges) by their durations, i.e. the
  wall time no amount of concurrency can remove;
- with --baseline, the wall-time ratio of this run to the baseline workspace's newest run of the
  same flow (below 1.00: faster).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.lineage import Lineage  # noqa: E402


def run_timing(workspace: Path, run_id: str | None = None, flow: str = "smollm3") -> dict:
    lineage = Lineage(Path(workspace) / "lineage.duckdb")
    if run_id is None:
        rows = lineage.query(
            "SELECT run_id FROM flow_runs WHERE flow = ? AND ended IS NOT NULL ORDER BY started DESC LIMIT 1", [flow]
        )
        if not rows:
            raise SystemExit(f"no finished {flow} run in {lineage.path}")
        run_id = rows[0][0]
    (run,) = lineage.query_dicts("SELECT * FROM flow_runs WHERE run_id = ?", [run_id])
    steps = [s for s in lineage.steps_of(run_id) if s["state"] in ("completed", "cached")]
    key = {s["fingerprint"]: f"{s['step']}[{s['label']}]" for s in steps}
    seconds = {f"{s['step']}[{s['label']}]": float(s["seconds"]) for s in steps}
    parents: dict[str, set[str]] = {k: set() for k in seconds}
    for parent, child in lineage.query("SELECT parent, child FROM edges"):
        if parent in key and child in key:
            parents[key[child]].add(key[parent])
    order = [f"{s['step']}[{s['label']}]" for s in sorted(steps, key=lambda s: s["started"])]
    best: dict[str, tuple[float, list[str]]] = {}

    def chain(k: str) -> tuple[float, list[str]]:
        if k not in best:
            before = max((chain(p) for p in parents[k]), default=(0.0, []), key=lambda b: b[0])
            best[k] = (before[0] + seconds[k], [*before[1], k])
        return best[k]

    critical = max((chain(k) for k in order), default=(0.0, []), key=lambda b: b[0])
    wall = (run["ended"] - run["started"]).total_seconds()
    total = sum(seconds.values())
    return {
        "run_id": run_id,
        "wall": wall,
        "sum": total,
        "parallelism": total / wall if wall else 0.0,
        "critical": critical,
        "steps": steps,
        "states": sorted({s["state"] for s in steps}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workspace", type=Path)
    p.add_argument("--run", default=None, help="flow run id (default: the newest finished run)")
    p.add_argument("--flow", default="smollm3")
    p.add_argument("--baseline", type=Path, default=None, help="another workspace: compare wall times")
    p.add_argument("--steps", action="store_true", help="also list every step's start, end and seconds")
    args = p.parse_args(argv)
    t = run_timing(args.workspace, args.run, args.flow)
    if args.steps:
        t0 = min(s["started"] for s in t["steps"])
        for s in sorted(t["steps"], key=lambda s: s["started"]):
            print(
                f"  {s['step'] + '[' + s['label'] + ']':26} {(s['started'] - t0).total_seconds():8.1f} "
                f"{(s['ended'] - t0).total_seconds():8.1f} {s['seconds']:7.1f}  {s['state']}"
            )
    print(f"run {t['run_id']} ({', '.join(t['states'])}): {len(t['steps'])} steps")
    print(f"wall {t['wall']:.1f} s, sum of step seconds {t['sum']:.1f} s")
    print(f"parallelism {t['parallelism']:.2f} (baseline: serial execution 1.00)")
    seconds, path = t["critical"]
    print(f"critical path {seconds:.1f} s ({seconds / t['wall']:.0%} of wall): {' -> '.join(path)}")
    if args.baseline is not None:
        b = run_timing(args.baseline, None, args.flow)
        print(f"baseline run {b['run_id']}: wall {b['wall']:.1f} s, parallelism {b['parallelism']:.2f}")
        print(f"wall ratio (this / baseline): {t['wall'] / b['wall']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
