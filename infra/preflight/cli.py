"""Command line of preflight: `python -m infra.preflight` (and the `smollm3 preflight` subcommand).

    python -m infra.preflight --facts facts.json --config preflight.yaml allow_warn=true \
        facts.nproc_per_node=8 --json preflight.json

`key=value` items override PreflightConfig fields, `facts.key=value` items PreflightFacts fields
(values parsed as YAML: `checks=[gpu_matmul,gpu_throttle]`). Prints the table; exits 0 when
training may start, 1 when `should_stop`, 2 on bad input. `--json` is written atomically (a
reader sees the whole report or none), with `--node` naming the node in it (default: the host
name): the preflight job (infra/preflight/cluster.py) runs this on every node of an allocation,
each writing `nodes/{node}.json`.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from infra.files import write_json_atomic
from infra.preflight.core import PreflightConfig, PreflightFacts, format_table, should_stop
from infra.preflight.run import run_preflight
from infra.yamlfile import YamlRefused, load_yaml


def _load(path: str | None, what: str) -> dict[str, Any]:
    if not path:
        return {}
    try:
        data = load_yaml(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError, YamlRefused) as exc:
        raise SystemExit(f"--{what} {path}: cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"--{what} {path}: expected a mapping at the top level")
    return data


def build_parser(**kw: str) -> argparse.ArgumentParser:
    """The parser; `kw` (prog, usage, description, epilog) lets `smollm3 preflight` present it as
    its own."""
    p = argparse.ArgumentParser(
        **{"prog": "python -m infra.preflight", "description": __doc__.splitlines()[0], **kw},
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="YAML/JSON file of PreflightConfig fields")
    p.add_argument("--facts", help="YAML/JSON file of PreflightFacts fields (from the recipe)")
    p.add_argument("--json", help="write every result (and host, config, facts) to this file")
    p.add_argument("--node", help="the node's name in the --json report (default: the host name)")
    p.add_argument("--list", action="store_true", help="list the registered checks and exit")
    p.add_argument("overrides", nargs="*", help="key=value (config) or facts.key=value")
    return p


def main(argv: Sequence[str] | None = None, **parser: str) -> int:
    args = build_parser(**parser).parse_args(argv)
    from infra.preflight.core import CHECKS, selected

    if args.list:
        for cls in selected(PreflightConfig()):
            doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
            print(f"{cls.name:16s} {cls.group:8s} {doc}")
        return 0
    config_data, facts_data = _load(args.config, "config"), _load(args.facts, "facts")
    for item in args.overrides:
        if "=" not in item:
            print(f"override {item!r} must look like key=value", file=sys.stderr)
            return 2
        key, raw = item.split("=", 1)
        try:
            value = load_yaml(raw)
        except (yaml.YAMLError, YamlRefused) as exc:
            print(f"override {key!r}: {exc}", file=sys.stderr)
            return 2
        if key.startswith("facts."):
            facts_data[key[len("facts.") :]] = value
        else:
            config_data[key] = value
    try:
        config = PreflightConfig.model_validate(config_data)
        facts = PreflightFacts.from_dict(facts_data)
    except (ValidationError, ValueError, TypeError) as exc:
        print(f"invalid preflight input: {exc}\nchecks: {', '.join(CHECKS.names())}", file=sys.stderr)
        return 2
    results = run_preflight(config, facts, log=lambda _: None)
    print(format_table(results))
    stop = should_stop(results, config.allow_warn)
    if args.json:
        report = {
            "host": socket.gethostname(),
            "node": args.node or socket.gethostname(),
            "stop": stop,
            "config": config.model_dump(mode="json"),
            "facts": facts.to_dict(),
            "results": [r.to_dict() for r in results],
        }
        write_json_atomic(Path(args.json), report)
    print(
        "STOP: fix the failing checks" + ("" if config.allow_warn else " (or allow_warn=true for warnings)")
        if stop
        else "GO: training may start"
    )
    return 1 if stop else 0
