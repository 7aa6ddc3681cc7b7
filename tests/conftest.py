"""Shared test fixtures: an isolated Prefect home, a temporary Prefect server, small recipes."""

from __future__ import annotations

import os
import tempfile

# Before Prefect is imported anywhere: never touch the user's ~/.prefect, never phone home.
_PREFECT_HOME = tempfile.mkdtemp(prefix="smollm3-test-prefect-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_TO_API_ENABLED"] = "false"
os.environ.pop("PREFECT_API_URL", None)

import pytest  # noqa: E402

# Small overrides that keep the tiny recipe's sources fast in flow tests.
SMALL = [
    "sources.prose.max_documents=60",
    "sources.code.max_documents=20",
    "sources.math.max_documents=200",
]


# The data part of the DAG only (no stages: the flow stops after the data steps).
DATA_ONLY = [*SMALL, "stages=[]"]

# The whole DAG at a size that trains in about a minute on 2 cores: every stage a few steps.
TINY_TRAIN = [
    "sources.prose.max_documents=200",
    "sources.code.max_documents=60",
    "sources.math.max_documents=400",
    "stages.stage1.tokens=12288",
    "stages.stage2.tokens=8192",
    "stages.stage3.tokens=4096",
    "stages.long1.tokens=8192",
    "stages.long2.tokens=16384",
    "training.checkpoint_interval=1",
    "eval.items_per_task=20",
    "eval.passkey_items=5",
    "preflight.max_epochs=1000",
    "posttrain=null",  # the pretraining DAG only; post-training: tests/tasks/test_posttrain_*.py
]


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect server (SQLite) shared by every test that runs flows."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def api_url(prefect_harness) -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


@pytest.fixture
def private_api_url(tmp_path) -> str:
    """A Prefect server of this test's own (its own home and SQLite database), for tests that
    serve the project's deployments (`smollm3/full`, `anneal/nightly`): on the shared server a
    deployment registered by an earlier test on the same pytest worker (and its schedule) would
    meet this test's serve process. The test process's own Prefect client talks to it too."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from infra.prefect_server import EmbeddedServer

    home = tmp_path / "prefect-home"
    home.mkdir()
    with EmbeddedServer(home=str(home), log=lambda _: None) as server:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            yield server.api_url
