"""Fixtures for the flows' tests: a workspace holding a finished run (tests/tasks/conftest.py)."""

from tests.tasks.conftest import run_ws  # noqa: F401  (fixture)
