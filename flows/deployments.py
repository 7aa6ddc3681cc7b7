"""Serve every deployment of the project from one long-running process.

    python -m flows.deployments          (what `make demo` starts; `smollm3 serve` does the same)

Each deployment carries an explicit concurrency limit: `serve()` has none unless given one, and two
full runs on one machine would fight over its cores and the same workspace.
`pause_on_shutdown=False` keeps schedules active when this process stops, so a restart of the serve
process does not silently disable them. Before serving, flow runs are set to heartbeat every
`PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds (Prefect's 180 unless set; the demo uses 60) and the
server gets the automation that marks a run Crashed after three missed heartbeats
(pipeline/owner.py), the fallback for a lost machine: a run whose process was killed with this one
is marked Crashed within seconds by its sentinel (pipeline/sentinel.py). A run whose serve process
dies while the run lives on stops and ends Crashed, saying so (pipeline/owner.py). A scheduled
run whose parameters the flow would refuse (a misspelt recipe, an unknown override, data that
cannot be read) is set Failed with that message within seconds, instead of waiting for its
concurrency slot first (flows/admission.py).
"""

from __future__ import annotations

import logging
import os

from prefect import serve
from prefect.deployments.runner import RunnerDeployment

from flows.admission import watch_scheduled_runs
from flows.prefect_flows import ablation, anneal, cpt, smollm3
from infra.prefect_server import HEARTBEAT_ENV, heartbeat_seconds
from pipeline.owner import ensure_crash_detection, name_owner

# Nightly anneal: 02:00 (server time zone UTC), when the main run has had a day of new checkpoints.
ANNEAL_CRON = "0 2 * * *"


def deployments() -> list[RunnerDeployment]:
    return [
        smollm3.to_deployment(
            name="full",
            description="The whole SmolLM3 DAG on a recipe (default: the tiny CPU recipe).",
            parameters={"recipe": "tiny", "overrides": [], "refresh": []},
            concurrency_limit=1,
            tags=["smollm3"],
        ),
        # One anneal at a time: each trains several short runs, and two would share the base pin.
        anneal.to_deployment(
            name="nightly",
            description="Anneal the recipe's candidate data from the newest stable-phase checkpoint "
            "of the latest smollm3/full run; compare against a baseline anneal.",
            parameters={"recipe": "tiny", "overrides": [], "base": "", "refresh": []},
            cron=ANNEAL_CRON,
            concurrency_limit=1,
            tags=["smollm3", "anneal"],
        ),
        # One ablation at a time: its variants x seeds already fill the train slots.
        ablation.to_deployment(
            name="on-demand",
            description="Train the recipe and each variant (NAME:key=value,... overrides) with several "
            "seeds; compare them on the evals that carry signal, with seed noise.",
            parameters={"recipe": "tiny", "variants": [], "seeds": 2, "overrides": [], "refresh": []},
            concurrency_limit=1,
            tags=["smollm3", "ablation"],
        ),
        cpt.to_deployment(
            name="on-demand",
            description="Continued pretraining on the recipe's cpt.domain with general replay and "
            "a forgetting monitor.",
            parameters={"recipe": "tiny", "overrides": [], "base": "", "refresh": []},
            concurrency_limit=1,
            tags=["smollm3", "cpt"],
        ),
    ]


def main() -> None:
    os.environ[HEARTBEAT_ENV] = str(heartbeat_seconds())  # inherited by every flow-run process
    # A flow-run process that dies of a native crash (SIGSEGV in an in-process evaluation, say)
    # prints every thread's Python stack in its log first (Python's faulthandler).
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    name_owner()  # each run watches this process and ends Crashed if it dies (pipeline/owner.py)
    try:
        ensure_crash_detection()
    except Exception as exc:  # noqa: BLE001 - serving matters more; say what is missing
        logging.getLogger(__name__).warning(
            "could not install the crash-detection automation (%s: %s): runs whose process dies "
            "will stay Running until cancelled by hand",
            type(exc).__name__,
            exc,
        )
    served = deployments()
    # A run whose parameters would fail fails now, not after waiting for its concurrency slot.
    watch_scheduled_runs([(d.flow_name, d.name) for d in served])
    serve(*served, pause_on_shutdown=False, limit=2)


if __name__ == "__main__":
    main()
