"""What lineage answers: artifacts and their ancestry, runs and their steps, what a checkpoint was
trained on, experiments. Reads only: every write goes through `LineageStore` (pipeline/lineage/store.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.artifact import Artifact
from pipeline.lineage.store import LineageStore


class Lineage(LineageStore):
    """The lineage database of one workspace, with the questions it answers."""

    def attempts_of(self, run_id: str) -> list[dict[str, Any]]:
        """Every attempt of a flow run (retries keep their own start, end and state)."""
        return self.query_dicts("SELECT * FROM run_attempts WHERE run_id = ? ORDER BY attempt", [run_id])

    def artifact(self, fingerprint_prefix: str) -> dict[str, Any] | None:
        rows = self.query_dicts(
            "SELECT * FROM artifacts WHERE fingerprint LIKE ? ORDER BY created", [fingerprint_prefix + "%"]
        )
        if len(rows) > 1:
            names = ", ".join(r["fingerprint"][:12] for r in rows)
            raise ValueError(f"fingerprint prefix {fingerprint_prefix!r} is ambiguous: {names}")
        return rows[0] if rows else None

    def artifact_by_uri(self, path: Path) -> dict[str, Any] | None:
        path = Path(path).resolve()
        rows = self.query_dicts("SELECT * FROM artifacts")
        best = None
        for row in rows:
            uri = Path(row["uri"]).resolve()
            if path == uri or uri in path.parents:
                if best is None or len(str(uri)) > len(best["uri"]):
                    best = row
        return best

    def parents(self, fingerprint: str) -> list[dict[str, Any]]:
        return self.query_dicts(
            "SELECT a.* FROM edges e JOIN artifacts a ON a.fingerprint = e.parent "
            "WHERE e.child = ? ORDER BY a.step, a.label",
            [fingerprint],
        )

    def children(self, fingerprint: str) -> list[dict[str, Any]]:
        return self.query_dicts(
            "SELECT a.* FROM edges e JOIN artifacts a ON a.fingerprint = e.child "
            "WHERE e.parent = ? ORDER BY a.step, a.label",
            [fingerprint],
        )

    def ancestors(self, fingerprint: str) -> list[dict[str, Any]]:
        """Every artifact upstream of `fingerprint` (a recursive query over the edges)."""
        return self._closure(fingerprint, near="child", far="parent")

    def descendants(self, fingerprint: str) -> list[dict[str, Any]]:
        """Every artifact downstream of `fingerprint`."""
        return self._closure(fingerprint, near="parent", far="child")

    def _closure(self, fingerprint: str, near: str, far: str) -> list[dict[str, Any]]:
        return self.query_dicts(
            f"""
            WITH RECURSIVE walk(fp) AS (
                SELECT {far} FROM edges WHERE {near} = ?
                UNION SELECT e.{far} FROM edges e JOIN walk ON e.{near} = walk.fp
            )
            SELECT a.* FROM artifacts a JOIN walk ON a.fingerprint = walk.fp ORDER BY a.step, a.label
            """,
            [fingerprint],
        )

    def runs(self, limit: int = 20) -> list[dict[str, Any]]:
        return self.query_dicts("SELECT * FROM flow_runs ORDER BY started DESC LIMIT ?", [limit])

    def steps_of(self, run_id: str, attempt: int | None = None) -> list[dict[str, Any]]:
        """The step rows of a run (one per step per attempt), attempt by attempt; or of one
        attempt."""
        return self.query_dicts(
            "SELECT * FROM steps WHERE run_id = ? AND (? IS NULL OR attempt = ?) ORDER BY attempt NULLS FIRST, started",
            [run_id, attempt, attempt],
        )

    def get(self, fingerprint_prefix: str) -> Artifact:
        """The artifact with this fingerprint (or unique prefix); an error names a missing one."""
        row = self.artifact(fingerprint_prefix)
        if row is None:
            raise LookupError(f"artifact {fingerprint_prefix[:12]} is not in lineage {self.path}")
        return artifact_of(row)

    def get_many(self, fingerprints: Sequence[str]) -> list[Artifact]:
        """Artifacts by fingerprint, in the order given."""
        return [self.get(fp) for fp in fingerprints]

    def find_by_path(self, path: Path) -> Artifact | None:
        """The artifact whose step folder holds `path` (the innermost one)."""
        row = self.artifact_by_uri(path)
        return artifact_of(row) if row else None

    def inputs_of(self, fingerprint: str, kind: str | None = None) -> list[Artifact]:
        """The artifacts a step read to make this one (optionally only those of one kind)."""
        return [artifact_of(r) for r in self.parents(fingerprint) if kind is None or r["kind"] == kind]

    def made_from(self, fingerprint: str, step: str | None = None) -> list[Artifact]:
        """The artifacts steps made from this one (optionally only those of one step), oldest first."""
        rows = sorted(self.children(fingerprint), key=lambda r: r["created"])
        return [artifact_of(r) for r in rows if step is None or r["step"] == step]

    def latest_run(self, flow: str, deployment: str | None = None) -> str | None:
        """The newest run of `flow`, runs of `deployment` first (a served `smollm3/full` run beats
        an ad hoc run of the same flow)."""
        rows = self.query(
            "SELECT run_id FROM flow_runs WHERE flow = ? "
            "ORDER BY coalesce(deployment = ?, false) DESC, started DESC LIMIT 1",
            [flow, deployment],
        )
        return rows[0][0] if rows else None

    def previous(self, step: str, label: str) -> tuple[Artifact, Any, set[str]] | None:
        """The newest artifact of `step[label]`: the artifact, the identity config it was built
        with, and its parents' fingerprints (what `smollm3 plan` compares against)."""
        rows = self.query_dicts(
            "SELECT * FROM artifacts WHERE step = ? AND label = ? ORDER BY created DESC LIMIT 1", [step, label]
        )
        if not rows:
            return None
        config = json.loads(rows[0]["config"]) if rows[0]["config"] else {}
        parents = {r["fingerprint"] for r in self.parents(rows[0]["fingerprint"])}
        return artifact_of(rows[0]), config, parents

    def run_outputs(self, run_id: str, step: str) -> list[Artifact]:
        """Artifacts of `step` that a run built or reused (completed or cached), in run order."""
        return [a for _, a in self.labelled_outputs(run_id, step)]

    def labelled_outputs(
        self, run_id: str, step: str | None = None, kind: str | None = None
    ) -> list[tuple[str, Artifact]]:
        """(label, artifact) of the steps a run built or reused, optionally of one step name or
        one artifact kind, in the order they finished."""
        rows = self.query_dicts(
            "SELECT s.label AS step_label, a.*, min(s.ended) AS finished FROM steps s "
            "JOIN artifacts a ON a.fingerprint = s.fingerprint "
            "WHERE s.run_id = ? AND s.state IN ('completed', 'cached') "
            "AND (? IS NULL OR s.step = ?) AND (? IS NULL OR a.kind = ?) "
            "GROUP BY ALL ORDER BY finished",
            [run_id, step, step, kind, kind],
        )
        return [(r["step_label"], artifact_of(r)) for r in rows]

    def find_runs(self, prefix: str) -> list[dict[str, Any]]:
        """Runs whose id starts with `prefix`, newest first."""
        return self.query_dicts("SELECT * FROM flow_runs WHERE run_id LIKE ? ORDER BY started DESC", [prefix + "%"])

    def experiments(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Experiments (all, or of one kind: ablation, anneal), newest first."""
        return self.query_dicts(
            "SELECT * FROM experiments WHERE ? IS NULL OR kind = ? ORDER BY created DESC", [kind, kind]
        )

    def find_experiment(self, prefix: str) -> dict[str, Any] | None:
        """The experiment whose id starts with `prefix` (None: none; an ambiguous prefix is an error)."""
        rows = self.query_dicts(
            "SELECT * FROM experiments WHERE experiment LIKE ? ORDER BY created DESC", [prefix + "%"]
        )
        if len(rows) > 1:
            raise ValueError(
                f"experiment id prefix {prefix!r} is ambiguous: " + ", ".join(r["experiment"][:12] for r in rows)
            )
        return rows[0] if rows else None

    def experiment_runs(self, experiment: str) -> list[dict[str, Any]]:
        """Every score of an experiment's runs: label, variant, seed, task, metric, step, value, stderr."""
        return self.query_dicts(
            "SELECT * FROM experiment_runs WHERE experiment = ? ORDER BY variant, seed, task, step", [experiment]
        )

    def experiment_results(self, experiment: str) -> list[dict[str, Any]]:
        """An experiment's comparison: each variant vs the baseline, per task."""
        return self.query_dicts(
            "SELECT * FROM experiment_results WHERE experiment = ? ORDER BY variant, task", [experiment]
        )

    def trained_on(
        self,
        source: str,
        pinned_tokens: Callable[[Artifact], dict[str, int] | None] | None = None,
    ) -> list[TrainedOn]:
        """The training stages whose weights saw tokens of `source`, oldest first.

        `source` is a source name (`prose`: every source artifact of that name) or the
        fingerprint (prefix) of one source, curated corpus or shards artifact (only the data
        that came from it). A stage *drew* from the source when its mixture read those shards
        and its ledger (the pretrain meta `tokens_per_source`, the loader's count at the end of
        the stage) counts tokens of that name; a stage that continues such a stage through its
        `init` input trained on it too (its `cumulative_tokens`), even at weight 0. Descent
        through the tokenizer (trained on every source) or through decontamination (a curation
        reads every source's held-out split) is not training on a source and is left out.

        An anneal or CPT stage starts from a pin of a checkpoint part-way through a stage: the
        tokens that stage had drawn by then are in the pinned checkpoint, which lineage does not
        hold; `pinned_tokens(pin: Artifact) -> {source: tokens} | None` reads them (the CLI reads
        the checkpoint's trainer state). Without it, or when it returns None, cumulative counts
        through that pin are lower bounds (`complete` False).
        """
        name, shards = self._source_shards(source)
        rows = self.query_dicts(
            "SELECT a.*, list(DISTINCT s.fingerprint) AS read FROM artifacts s "
            "JOIN edges e1 ON e1.parent = s.fingerprint "
            "JOIN artifacts m ON m.fingerprint = e1.child AND m.kind = 'mixture' "
            "JOIN edges e2 ON e2.parent = m.fingerprint "
            "JOIN artifacts a ON a.fingerprint = e2.child AND a.step = 'pretrain' "
            f"WHERE s.fingerprint IN ({', '.join('?' * len(shards)) or 'NULL'}) GROUP BY ALL",
            list(shards),
        )
        drew = {r["fingerprint"]: r for r in rows}
        stages = {
            r["fingerprint"]: r for r in self.query_dicts("SELECT * FROM artifacts WHERE step IN ('pretrain', 'pin')")
        }
        init = dict(
            self.query(
                "SELECT e.child, e.parent FROM edges e "
                "JOIN artifacts c ON c.fingerprint = e.child AND c.step = 'pretrain' "
                "JOIN artifacts p ON p.fingerprint = e.parent AND p.step IN ('pretrain', 'pin')"
            )
        )
        runs: dict[str, list[str]] = {}
        for fp, run in self.query(
            "SELECT fingerprint, run_id FROM steps WHERE step = 'pretrain' AND state IN "
            "('completed', 'cached') GROUP BY ALL ORDER BY min(started)"
        ):
            runs.setdefault(fp, []).append(run)

        def ledger(row: dict[str, Any]) -> int:
            meta = row["meta"] if isinstance(row["meta"], dict) else json.loads(row["meta"] or "{}")
            return int((meta.get("tokens_per_source") or {}).get(name, 0))

        def base_of(pin: dict[str, Any]) -> str | None:
            """The pretrain artifact whose folder holds the pinned checkpoint."""
            meta = json.loads(pin["meta"] or "{}") if isinstance(pin["meta"], str) else pin["meta"]
            path = str(meta.get("source") or "")
            owners = [
                fp
                for fp, r in stages.items()
                if r["step"] == "pretrain" and path.startswith(r["uri"].rstrip("/") + "/")
            ]
            return owners[0] if owners else None

        Walk = tuple[int, tuple[tuple[str, str, int], ...], bool]
        memo: dict[str, Walk] = {}
        nothing: Walk = (0, (), True)

        def walk(fp: str, depth: int = 0) -> Walk:
            """(cumulative tokens, the chain of (label, fingerprint, tokens), complete) of a stage
            or a pin, following `init` edges and pins back to the first stage."""
            if fp in memo:
                return memo[fp]
            row = stages[fp]
            if row["step"] == "pin":  # what its base stage had drawn at the pinned step, and before
                base = base_of(row)
                earlier = walk(init[base], depth + 1) if base and init.get(base) in stages and depth < 64 else nothing
                known = pinned_tokens(artifact_of(row)) if pinned_tokens else None
                got = int(known.get(name, 0)) if known is not None and base in drew else 0
                complete = earlier[2] and (known is not None or base not in drew)
                label = f"{stages[base]['label']} (pinned)" if base else row["label"]
                memo[fp] = (earlier[0] + got, (*earlier[1], (label, fp, got)), complete)
            else:
                before = walk(init[fp], depth + 1) if init.get(fp) in stages and depth < 64 else nothing
                mine = ledger(row) if fp in drew else 0
                memo[fp] = (before[0] + mine, (*before[1], (row["label"], fp, mine)), before[2])
            return memo[fp]

        out = []
        for fp, row in sorted(stages.items(), key=lambda kv: kv[1]["created"]):
            if row["step"] != "pretrain":
                continue
            cumulative, chain, complete = walk(fp)
            if cumulative > 0 or not complete:  # incomplete: a pinned base drew from it
                mine = chain[-1][2]
                out.append(
                    TrainedOn(
                        checkpoint=artifact_of(row),
                        label=row["label"],
                        source=name,
                        shards=tuple(sorted(drew[fp]["read"])) if fp in drew else (),
                        stage_tokens=mine,
                        cumulative_tokens=cumulative,
                        chain=chain,
                        complete=complete,
                        runs=tuple(runs.get(fp, ())),
                    )
                )
        return out

    def _source_shards(self, source: str) -> tuple[str, tuple[str, ...]]:
        """(source name, fingerprints of the token shards made from it) for a source name or the
        fingerprint of a source, curated corpus or shards artifact of one source."""
        named = self.query(
            "SELECT fingerprint FROM artifacts WHERE step = 'tokenize' AND json_extract_string(meta, '$.source') = ?",
            [source],
        )
        if named:
            return source, tuple(sorted(r[0] for r in named))
        row = self.artifact(source.lower()) if re.fullmatch(r"[0-9a-fA-F]{4,64}", source) else None
        if row is None:
            names = sorted(
                {
                    r[0]
                    for r in self.query(
                        "SELECT json_extract_string(meta, '$.source') FROM artifacts WHERE step = 'tokenize'"
                    )
                    if r[0]
                }
            )
            raise LookupError(
                f"no token shards of a source {source!r} in {self.path}, and no "
                f"artifact with that fingerprint; sources with shards: "
                f"{', '.join(names) or 'none'}"
            )
        meta = json.loads(row["meta"] or "{}") if isinstance(row["meta"], str) else row["meta"]
        name = meta.get("source")
        if row["step"] not in ("source", "curate", "decontaminate", "tokenize") or not name:
            raise LookupError(
                f"artifact {row['fingerprint'][:12]} is a {row['kind']} made by "
                f"{row['step']}, not a source, curated corpus or token shards"
            )
        # Follow only the data of this one source: the held-out index reads every source's
        # held-out split (decontamination), which makes the other corpora descendants too. Names are
        # unique within a recipe and those other sources are the run's others, so keeping to
        # artifacts of this source's name keeps to its own data.
        shards = self.query(
            """
            WITH RECURSIVE walk(fp) AS (
                SELECT ?
                UNION SELECT e.child FROM edges e JOIN walk ON e.parent = walk.fp
                JOIN artifacts c ON c.fingerprint = e.child
                WHERE c.step IN ('curate', 'decontaminate', 'tokenize') AND json_extract_string(c.meta, '$.source') = ?
            )
            SELECT a.fingerprint FROM walk JOIN artifacts a ON a.fingerprint = walk.fp
            WHERE a.step = 'tokenize'
            """,
            [row["fingerprint"], name],
        )
        return name, tuple(sorted(r[0] for r in shards))


@dataclass(frozen=True)
class TrainedOn:
    """One training stage's checkpoint and the tokens of one source behind its weights."""

    checkpoint: Artifact  # the pretrain step's artifact (the stage folder and its checkpoints)
    label: str  # the stage (stage1, long2, anneal-math, cpt)
    source: str  # the source name, as the mixture ledger counts it
    shards: tuple[str, ...]  # the source's token shards this stage's mixture read (none: it read none)
    stage_tokens: int  # tokens of the source drawn in this stage
    cumulative_tokens: int  # ... in this stage and every stage its init chain continues
    chain: tuple[tuple[str, str, int], ...]  # (stage label, fingerprint, tokens), first stage first
    complete: bool  # False: a pinned checkpoint's own count was not available (a lower bound)
    runs: tuple[str, ...]  # flow runs that built or reused the stage


def artifact_of(row: dict[str, Any]) -> Artifact:
    """An Artifact from a row of the `artifacts` table."""
    meta = row["meta"]
    return Artifact(
        kind=row["kind"],
        uri=row["uri"],
        fingerprint=row["fingerprint"],
        meta=json.loads(meta) if isinstance(meta, str) else dict(meta or {}),
    )
