"""pipeline/graph.py: fingerprints at add time, named inputs, and reuse of identical steps (what an
experiment's graph relies on to build shared data steps once)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from pipeline.artifact import Artifact
from pipeline.graph import Given, Graph
from pipeline.step import step


class Cfg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    value: int = 0


@step("make", version=1, kind="report")
def make(config: Cfg, data: Artifact | None = None, *, out: Path, log=print) -> dict:
    return {"value": config.value}


@step("other", version=1, kind="report")
def other(config: Cfg, data: Artifact | None = None, *, out: Path, log=print) -> dict:
    return {"value": config.value}


def test_reuse_returns_the_identical_node_whatever_its_label():
    g = Graph("t")
    given = Given(Artifact(kind="shards", uri="/x", fingerprint="f" * 64))
    a = g.add(make, Cfg(value=1), label="baseline", data=given)
    again = g.add(make, Cfg(value=1), label="variant.x", reuse=True, data=given)
    assert again is a and len(g) == 1
    # Another config, another input or another step is another node.
    b = g.add(make, Cfg(value=2), label="variant.y", reuse=True, data=given)
    c = g.add(make, Cfg(value=1), label="variant.z", reuse=True, data=a)
    d = g.add(other, Cfg(value=1), label="baseline", reuse=True, data=given)
    assert len({a.fingerprint, b.fingerprint, c.fingerprint, d.fingerprint}) == 4 and len(g) == 4
    # Downstream of a reused node, identical readers are reused too.
    assert g.add(make, Cfg(value=1), label="variant.w", reuse=True, data=again) is c


def test_without_reuse_a_second_identical_step_needs_its_own_label():
    g = Graph("t")
    a = g.add(make, Cfg(), label="one")
    with pytest.raises(ValueError, match=r"step make\[one\] is added twice"):
        g.add(make, Cfg(), label="one")
    with pytest.raises(ValueError, match=r"step make\[one\] is added twice"):
        g.add(make, Cfg(value=5), label="one", reuse=True)  # same label, another step: refused
    b = g.add(make, Cfg(), label="two")
    assert b is not a and b.fingerprint == a.fingerprint and len(g) == 2
