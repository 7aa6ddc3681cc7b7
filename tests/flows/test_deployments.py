"""Served and deployed mean the same thing: `smollm3/full` in prefect.yaml matches the deployment
`smollm3 serve` serves, and prefect.yaml and docs/scale.md give the pool the same limit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from flows.deployments import deployments

REPO = Path(__file__).resolve().parents[2]


def test_prefect_yaml_deploys_smollm3_full_as_served():
    served = {f"{d.flow_name}/{d.name}": d for d in deployments()}["smollm3/full"]
    doc = yaml.safe_load((REPO / "prefect.yaml").read_text())
    (full,) = [d for d in doc["deployments"] if d["name"] == "full"]
    assert full["entrypoint"] == "flows/prefect_flows.py:smollm3"  # the flow named smollm3
    assert full["parameters"] == served.parameters
    assert full["concurrency_limit"] == served.concurrency_limit
    assert full["description"] == served.description
    assert full["tags"] == served.tags
    assert full["work_pool"]["name"] == "smollm3-process"


def test_docs_and_prefect_yaml_agree_on_the_pool_limit():
    pattern = re.compile(r"set-concurrency-limit smollm3-process (\d+)")
    in_yaml = pattern.findall((REPO / "prefect.yaml").read_text())
    in_docs = pattern.findall((REPO / "docs" / "scale.md").read_text())
    assert in_yaml and in_docs and set(in_yaml) == set(in_docs), (in_yaml, in_docs)


@pytest.mark.slow
def test_prefect_deploy_of_full_carries_the_described_run_form(api_url, tmp_path):
    """`prefect deploy` of prefect.yaml's `full` against a real server: the deployment is
    `smollm3/full`, its parameter schema has the descriptions, the recipe choices and the refresh
    step names the UI's run form shows, and the server refuses a run with an unknown step."""
    import os
    import subprocess
    import sys

    from prefect.client.orchestration import get_client

    prefect = str(Path(sys.executable).parent / "prefect")
    env = {**os.environ, "PREFECT_API_URL": api_url, "SMOLLM3_CODE_DIR": str(REPO), "PYTHONPATH": str(REPO)}
    for cmd in (
        ["work-pool", "create", "smollm3-process", "--type", "process"],
        ["--no-prompt", "deploy", "--prefect-file", str(REPO / "prefect.yaml"), "--name", "full"],
    ):
        done = subprocess.run([prefect, *cmd], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("smollm3/full")
        schema = dep.parameter_openapi_schema["properties"]
        assert dep.parameters == {"recipe": "tiny", "overrides": [], "refresh": []}
        assert all(len(p.get("description", "")) > 20 for p in schema.values())
        assert "smollm3-3b" in schema["recipe"]["anyOf"][0]["enum"]
        assert "pretrain" in schema["refresh"]["anyOf"][0]["items"]["enum"]
        from prefect.exceptions import PrefectHTTPStatusError

        try:
            client.create_flow_run_from_deployment(dep.id, parameters={"refresh": ["tokeniser"]})
        except PrefectHTTPStatusError as exc:
            assert exc.response.status_code == 409 and "tokeniser" in exc.response.text
        else:
            raise AssertionError("a run with an unknown refresh step was accepted")
