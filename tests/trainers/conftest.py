"""Fixtures for the trainers' tests: the model tests' tiny configs and synthetic mixture plans."""

from tests.model.conftest import _two_threads, plan_path, tiny_cfg  # noqa: F401  (fixtures)
