"""pipeline/graph.py: fingerprints at add time, named inputs, and reuse of identical steps (what an
experiment's graph relies on to build shared data steps once), and inputs checked against the
parameters of the step's function when the node is added."""

from __future__ import annotations

import re
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


@step("joins", version=1, kind="report")
def joins(config: Cfg, corpus: Artifact, others: tuple[Artifact, ...] = (), *, out: Path, log=print) -> dict:
    return {"others": len(others)}


@step("any_names", version=1, kind="report")
def any_names(config: Cfg, *, out: Path, log=print, **inputs: Artifact | tuple[Artifact, ...]) -> dict:
    return {}


def test_add_refuses_inputs_the_steps_function_does_not_take():
    g = Graph("t")
    given = Given(Artifact(kind="corpus", uri="/x", fingerprint="f" * 64))
    params = re.escape("joins(corpus: Artifact, others: tuple[Artifact, ...] = ())")
    with pytest.raises(TypeError, match=rf"joins\[a\]: unknown input 'corpse'; the step takes {params}"):
        g.add(joins, Cfg(), label="a", corpse=given)
    with pytest.raises(TypeError, match=rf"joins\[b\]: missing input 'corpus'; the step takes {params}"):
        g.add(joins, Cfg(), label="b", others=[given])
    with pytest.raises(
        TypeError, match=rf"joins\[c\]: input 'corpus' is one artifact, not a list; the step takes {params}"
    ):
        g.add(joins, Cfg(), label="c", corpus=[given])
    assert len(g) == 0
    # a step with **inputs takes any names
    assert g.add(any_names, Cfg(), label="d", **{"x.lm": [given], "base": given}).key == "any_names[d]"


def test_a_single_node_for_a_list_parameter_is_kept_as_given(tmp_path):
    """The graph stores the inputs exactly as the flow passed them, so the fingerprint records a
    single input as one fingerprint and a list as a list; the function gets a 1-tuple either way."""
    from pipeline.artifact import fingerprint

    g = Graph("t")
    corpus = Given(Artifact(kind="corpus", uri="/x", fingerprint="c" * 64))
    other = Given(Artifact(kind="corpus", uri="/y", fingerprint="o" * 64))
    one = g.add(joins, Cfg(), label="one", corpus=corpus, others=other)
    listed = g.add(joins, Cfg(), label="listed", corpus=corpus, others=[other])
    assert one.inputs["others"] is other and listed.inputs["others"] == (other,)
    assert one.fingerprint == fingerprint("joins", 1, Cfg(), {"corpus": corpus, "others": other})
    assert listed.fingerprint == fingerprint("joins", 1, Cfg(), {"corpus": corpus, "others": [other]})
    assert one.fingerprint != listed.fingerprint
    got = joins.run(Cfg(), {"corpus": corpus.artifact, "others": other.artifact}, tmp_path)
    assert got == {"others": 1}
