"""The order pytest-xdist hands out the suite's tests in (tests/conftest.py `heaviest_first`)."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import EXPECTED_SECONDS, heaviest_first

CHAOS = next(n for n in EXPECTED_SECONDS if n.startswith("tests/flows/test_chaos.py::"))


def _item(nodeid: str, slow: bool = False) -> SimpleNamespace:
    """What `heaviest_first` reads of a pytest item: its node id (with xdist's `@group` suffix)
    and its `slow` marker."""
    return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: object() if slow and name == "slow" else None)


def test_the_heaviest_block_goes_first_and_each_block_stays_together_in_collection_order():
    items = [
        _item("tests/a/test_fast.py::test_one"),
        _item("tests/a/test_fast.py::test_two[x@y]"),  # an `@` inside a parameter is not a group
        _item("tests/infra/test_s1.py::test_job@slurm", slow=True),
        _item("tests/a/test_mixed.py::test_quick"),
        _item("tests/a/test_mixed.py::test_flow", slow=True),
        _item(CHAOS),
        _item("tests/infra/test_s2.py::test_other_job@slurm", slow=True),
        _item("tests/a/test_mixed.py::test_quick_again"),
    ]
    order = [i.nodeid for i in heaviest_first(items)]
    assert order == [
        CHAOS,  # 613 s
        "tests/infra/test_s1.py::test_job@slurm",  # one group, run whole by one worker: 60 s
        "tests/infra/test_s2.py::test_other_job@slurm",
        "tests/a/test_mixed.py::test_quick",  # a module: 31 s, its tests in their order
        "tests/a/test_mixed.py::test_flow",
        "tests/a/test_mixed.py::test_quick_again",
        "tests/a/test_fast.py::test_one",  # 1 s
        "tests/a/test_fast.py::test_two[x@y]",
    ]
    assert sorted(order) == sorted(i.nodeid for i in items)  # nothing lost or repeated


def test_blocks_of_equal_weight_keep_the_collection_order():
    items = [_item(f"tests/a/test_{n}.py::test_it") for n in ("c", "a", "b")]
    assert heaviest_first(items) == items
