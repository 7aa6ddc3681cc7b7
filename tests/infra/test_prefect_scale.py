"""Prefect at scale: auth rules for exposed servers, prefect.yaml, and one end-to-end run of a
Prefect server on PostgreSQL with basic auth (server and database started by session fixtures).
"""

from __future__ import annotations

import base64
import importlib
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from infra.prefect_server import (
    AUTH_CLIENT,
    AUTH_SERVER,
    DATABASE_URL,
    InsecureServerError,
    client_env,
    is_loopback,
    redacted,
    server_env,
)
from tests.infra.postgres_local import local_postgres  # noqa: F401  (session fixture)

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
AUTH = "admin:s3cret-test-pass-91"


# --- server_env ---------------------------------------------------------------------------------


def test_loopback_detection():
    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "login-01", "prefect.example.org"):
        assert not is_loopback(host), host


def test_server_env_refuses_an_exposed_server_without_auth():
    env = server_env("127.0.0.1", 4200)
    assert env["PREFECT_API_URL"] == "http://127.0.0.1:4200/api"
    assert AUTH_SERVER not in env and AUTH_CLIENT not in env
    for host in ("0.0.0.0", "10.0.0.5", "login-01"):
        with pytest.raises(InsecureServerError, match=rf"host '{host}' is reachable beyond.*auth="):
            server_env(host, 4200)
    with pytest.raises(InsecureServerError, match="user:password"):
        server_env("0.0.0.0", 4200, auth="just-a-password")
    with pytest.raises(ValueError, match="port 70000"):
        server_env("127.0.0.1", 70000)

    env = server_env(
        "0.0.0.0", 4300, AUTH, database_url="postgresql+asyncpg://p:pw@db:5432/prefect", home="/srv/prefect"
    )
    assert env["PREFECT_SERVER_API_HOST"] == "0.0.0.0"
    assert env["PREFECT_API_URL"] == "http://127.0.0.1:4300/api"  # wildcard: clients use loopback
    assert env[AUTH_SERVER] == env[AUTH_CLIENT] == AUTH
    assert env[DATABASE_URL].startswith("postgresql+asyncpg://")
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    shown = json.dumps(redacted(env))
    assert "s3cret" not in shown and ":pw@" not in shown and "p:***@db" in shown
    with pytest.raises(ValueError, match="postgresql\\+asyncpg://"):
        server_env("127.0.0.1", 4200, database_url="postgresql://u:secret@db/prefect")
    assert client_env("http://login-01:4200/api", AUTH) == {
        "PREFECT_API_URL": "http://login-01:4200/api",
        AUTH_CLIENT: AUTH,
    }
    assert server_env("::1", 4200)["PREFECT_API_URL"] == "http://[::1]:4200/api"


# --- prefect.yaml -------------------------------------------------------------------------------


def load_prefect_yaml() -> dict:
    return yaml.safe_load((REPO / "prefect.yaml").read_text())


def test_prefect_yaml_deployments_point_at_importable_flows_with_valid_parameters():
    doc = load_prefect_yaml()
    deployments = doc["deployments"]
    names = [d["name"] for d in deployments]
    assert len(names) == len(set(names))
    pools = {d["work_pool"]["name"] for d in deployments}
    assert pools == {"smollm3-process", "smollm3-kubernetes"}
    from prefect import Flow

    for d in deployments:
        path, _, attr = d["entrypoint"].partition(":")
        assert (REPO / path).is_file(), d["entrypoint"]
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        flow = getattr(module, attr)
        assert isinstance(flow, Flow), d["entrypoint"]
        params = inspect.signature(flow.fn).parameters
        assert set(d["parameters"]) <= set(params), (d["name"], d["parameters"])
        assert isinstance(d["concurrency_limit"], int) and d["concurrency_limit"] >= 1
        assert d["parameters"]["recipe"] in {p.stem for p in (REPO / "configs").glob("*.yaml")}


# --- end to end: PostgreSQL + auth ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, auth: str | None, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    if auth is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, {}


TINY_FLOW = """
from prefect import flow, task

@task
def double(x: int) -> int:
    return 2 * x

@flow(name="scale-probe")
def probe(n: int = 21) -> int:
    return double(n)

print("RESULT", probe())
"""


@pytest.mark.slow
def test_prefect_server_on_postgres_with_auth_runs_a_flow_and_deploys(local_postgres, tmp_path):  # noqa: F811
    pg = local_postgres
    port = _free_port()
    home = tmp_path / "prefect-home"
    env = server_env("0.0.0.0", port, AUTH, database_url=pg.url, home=str(home))
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    full = base | env | {"PREFECT_SERVER_LOGGING_LEVEL": "WARNING"}
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "0.0.0.0", "--port", str(port), "--no-services"],
        env=full,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    api = env["PREFECT_API_URL"]
    try:
        deadline = time.monotonic() + 120
        while True:  # /api/health answers without auth (for load balancers and probes)
            try:
                with urllib.request.urlopen(f"{api}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prefect server did not come up: {(tmp_path / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)

        # no credentials, or wrong ones: refused
        assert _request(f"{api}/flows/filter", None)[0] == 401
        assert _request(f"{api}/flows/filter", "admin:wrong")[0] == 401
        assert _request(f"{api}/flows/filter", AUTH)[0] == 200

        # a client with the auth string runs a flow against it
        script = tmp_path / "probe.py"
        script.write_text(TINY_FLOW)
        client = base | client_env(api, AUTH) | {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        proc = subprocess.run([sys.executable, str(script)], env=client, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "RESULT 42" in proc.stdout
        # ... and without it the same client is refused
        no_auth = {k: v for k, v in client.items() if k != AUTH_CLIENT}
        proc = subprocess.run([sys.executable, str(script)], env=no_auth, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "401" in (proc.stdout + proc.stderr)

        status, runs = _request(f"{api}/flow_runs/filter", AUTH)
        assert status == 200
        assert [(r["name"] is not None, r["state_type"]) for r in runs] == [(True, "COMPLETED")]
        # the state lives in PostgreSQL, not in a SQLite file
        assert pg.sql("select state_type from flow_run") == "COMPLETED"
        assert not list(home.rglob("*.db"))

        # prefect.yaml deploys to the process pool (the kubernetes pool needs prefect-kubernetes)
        before = (REPO / "prefect.yaml").read_text()
        run = subprocess.run(
            [PREFECT, "work-pool", "create", "smollm3-process", "--type", "process"],
            env=client,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        deploy = subprocess.run(
            [
                PREFECT,
                "--no-prompt",
                "deploy",
                "--prefect-file",
                str(REPO / "prefect.yaml"),
                "--name",
                "smollm3-3b",
                "--name",
                "experiment",
                "--name",
                "tiny-smoke",
            ],
            env=client | {"SMOLLM3_CODE_DIR": str(REPO)},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert deploy.returncode == 0, (deploy.stdout + deploy.stderr)[-3000:]
        assert (REPO / "prefect.yaml").read_text() == before  # deploy must not rewrite it
        status, deps = _request(f"{api}/deployments/filter", AUTH)
        got = {d["name"]: d for d in deps}
        assert set(got) == {"smollm3-3b", "experiment", "tiny-smoke"}
        assert got["smollm3-3b"]["parameters"]["recipe"] == "smollm3-3b"
        assert got["smollm3-3b"]["work_pool_name"] == "smollm3-process"
        assert got["experiment"]["work_queue_name"] == "experiments"
        assert got["smollm3-3b"]["pull_steps"][0]["prefect.deployments.steps.set_working_directory"][
            "directory"
        ] == str(REPO)
        limits = {n: (d.get("global_concurrency_limit") or {}).get("limit") for n, d in got.items()}
        assert limits == {"smollm3-3b": 1, "experiment": 4, "tiny-smoke": 1}
        text = (tmp_path / "server.log").read_text() + deploy.stdout + deploy.stderr
        assert "s3cret-test-pass" not in text  # the auth string is never echoed
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
