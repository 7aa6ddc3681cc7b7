"""The flow runner's contract with builds that report progress or produce models: a progress
artifact ends at 100% when its step completes, in the flow process and in a child process, and
the path it logs for a model is the folder `from_pretrained` loads."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from infra.artifact import Inputs
from tasks.step import step


class Steps(BaseModel):
    """How far the test step reports before it returns."""

    last_report: float


@step("stops_early", version=1, kind="report")
def stops_early(config: Steps, inputs: Inputs, out: Path, *, log=print, progress=None) -> dict[str, Any]:
    progress(config.last_report)  # e.g. a watcher reporting in 10% steps, never the end
    return {"reported": config.last_report}


@step("stops_early_child", version=1, kind="report", isolate=True)
def stops_early_child(config: Steps, inputs: Inputs, out: Path, *, log=print, progress=None) -> dict[str, Any]:
    progress(config.last_report)
    return {"reported": config.last_report}


@step("tiny_model", version=1, kind="hf_model")
def tiny_model(config: Steps, inputs: Inputs, out: Path, *, log=print) -> dict[str, Any]:
    """A model step as export and post-training write them: the model in `out/model`."""
    from model.config import ModelConfig
    from model.hf import export_hf
    from model.model import SmolLM3

    model = SmolLM3(ModelConfig.tiny(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2))
    model.init_weights(seed=0)
    return {"model_dir": str(export_hf(model, out / "model"))}


def test_progress_ends_at_100_and_a_model_is_logged_at_its_loadable_path(tmp_path, prefect_harness):
    from prefect import flow
    from prefect.artifacts import Artifact as PrefectArtifact
    from transformers import AutoModelForCausalLM

    from flows.graph import Graph
    from flows.runner import run_flow
    from tasks.recipe import load_recipe

    recipe = load_recipe("tiny", [f"workspace={tmp_path / 'ws'}"])

    @flow
    def progress_flow() -> dict:
        g = Graph("runner-test")
        g.add(stops_early, Steps(last_report=40.0), label="here")
        g.add(stops_early_child, Steps(last_report=92.5), label="child")
        g.add(tiny_model, Steps(last_report=0.0), label="model")
        return run_flow("runner-test", g, recipe, "tiny")

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("prefect.task_runs")
    logger.addHandler(handler)
    try:
        progress_flow()
    finally:
        logger.removeHandler(handler)
    for key in ("stops-early-here-progress", "stops-early-child-child-progress"):
        assert PrefectArtifact.get(key).data == 100.0, key
    [line] = [text for text in lines if "tiny_model[model] built hf_model" in text]
    path = re.search(r" at (\S+)$", line).group(1)
    assert Path(path).name == "model"
    assert AutoModelForCausalLM.from_pretrained(path) is not None
