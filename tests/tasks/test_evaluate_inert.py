"""A planted eval-suite payload stays inert through the S3 mirror and a normal evaluate (issue 35).

The suite is built on one machine by the runner's own `run_step` and mirrored as the runner
mirrors it (`mirror_artifact`); a bucket writer then plants payloads with a plain boto3 client,
rewriting `_SHA256SUMS.json` to match (no `$SMOLLM3_MIRROR_KEY`: the mirror takes them, which is
the case this test is about); a fresh machine fetches the suite through `pipeline/mirror.py`'s
fetcher. Each payload is shown live on the fetched folder first (lm-eval's own `TaskManager`
renders it and the canary file appears), then `evaluate` runs on a real tiny model with that
fetched suite: planted files are ignored and named, a swapped task YAML is refused naming it,
and the canary never appears. With the key set, the same forged folder is not even fetched: the
log names the object and the step builds its own suite.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from curation.source_kinds import SourceConfig
from evals.harness import ForeignTaskFile
from infra.storage import MANIFEST, MIRROR_KEY_ENV, mirror_artifact
from pipeline.artifact import Artifact, run_step
from pipeline.mirror import fetcher
from pipeline.workspace import Workspace
from tasks.evaluate import EvalConfig, EvalSpec, SuiteSpec, eval_suite, evaluate
from tasks.sources import SourceSpec, source
from tests.infra.test_storage import cfg, s3  # noqa: F401  (s3: a moto S3 server)
from tests.tasks.test_evaluate import tiny_hf_model  # noqa: F401  (a fixture)
from tests.tasks.test_evaluate_attacks import ROW, _jinja_yaml, _load

SUITE = SuiteSpec(
    eval=EvalConfig(items_per_task=6, passkey_lengths=(30,), passkey_items=2, batch_size=4, device="cpu", limit=2),
    generation_items=3,
    max_gen_tokens=5,
)


def _suite(ws: Workspace, log: list[str]) -> tuple[Artifact, bool]:
    """The eval_suite step as the runner runs it (sources first), fetching from the mirror when
    the workspace has one; (the suite artifact, whether it was fetched)."""
    corpora = []
    for name, uri, domain, n in (("prose", "builtin:prose", "web", 60), ("math", "builtin:math", "math", 300)):
        spec = SourceSpec(
            source=SourceConfig(name=name, uri=uri, domain=domain, max_documents=n, held_out_fraction=0.3)
        )
        corpora.append(
            run_step(
                root=ws.path,
                step=source.name,
                version=source.version,
                kind=source.kind,
                config=spec,
                inputs=[],
                build=lambda out, spec=spec: source(spec, out=out, log=log.append),
            ).artifact
        )
    inputs = {"heldout": tuple(corpora), "train": tuple(corpora)}
    outcome = run_step(
        root=ws.path,
        step=eval_suite.name,
        version=eval_suite.version,
        kind=eval_suite.kind,
        config=SUITE,
        inputs=inputs,
        build=lambda out: eval_suite(SUITE, **inputs, out=out, log=log.append),
        fetch=fetcher(ws, eval_suite.name, eval_suite.version, log.append),
    )
    return outcome.artifact, outcome.fetched


def _plant(client, folder: str, files: dict[str, bytes]) -> None:
    """The bucket writer: objects put and the folder's manifest rewritten to list them."""
    sums = json.loads(client.get_object(Bucket="ckpts", Key=f"{folder}/{MANIFEST}")["Body"].read())
    for rel, body in files.items():
        client.put_object(Bucket="ckpts", Key=f"{folder}/{rel}", Body=body)
        sums["files"][rel] = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    client.put_object(Bucket="ckpts", Key=f"{folder}/{MANIFEST}", Body=json.dumps(sums).encode())


@pytest.mark.slow
def test_a_payload_planted_in_the_mirror_stays_inert_through_a_fetch_and_evaluate(
    tmp_path,
    monkeypatch,
    s3,  # noqa: F811
    tiny_hf_model,  # noqa: F811
):
    endpoint, client = s3
    monkeypatch.delenv(MIRROR_KEY_ENV, raising=False)
    storage = cfg(endpoint, uri="s3://ckpts/mirror", attempts=1)
    first = Workspace.at(tmp_path / "first" / "ws", storage)
    built, fetched = _suite(first, [])
    assert not fetched
    mirror_artifact(built.path, "s3://ckpts/mirror/eval_suite", storage)  # as the runner mirrors it
    folder = f"mirror/eval_suite/{built.path.name}"
    canary = tmp_path / "canary"
    model = Artifact(
        kind="hf_model",
        uri=str(tiny_hf_model.parent),
        fingerprint="m" * 64,
        meta={"stage": "stage1", "model_dir": str(tiny_hf_model)},
    )
    run = EvalSpec(eval=EvalConfig(batch_size=4, device="cpu", limit=2))

    # 1. files planted beside the suite: a Jinja task YAML with its data, and a `utils.py`
    second = tmp_path / "second" / "ws"
    tasks_there = second / "eval_suite" / built.path.name / "tasks"  # where a fresh machine puts them
    _plant(
        client,
        folder,
        {
            "tasks/x.jsonl": (json.dumps(ROW) + "\n").encode(),
            "tasks/x.yaml": _jinja_yaml("x", tasks_there / "x.jsonl", canary).encode(),
            "tasks/utils.py": f"open({str(canary)!r}, 'w').close()\n".encode(),
        },
    )
    log: list[str] = []
    suite, fetched = _suite(Workspace.at(second, storage), log)
    assert fetched and suite.path == tasks_there.parent and (tasks_there / "x.yaml").exists()
    assert any("fetched from" in line and "(unsigned)" in line for line in log)
    assert _load(tasks_there, ["x"]) == {"x": ROW["context"]} and canary.exists()  # control: live
    canary.unlink()
    lines: list[str] = []
    meta = evaluate(run, model, suite, out=tmp_path / "eval-second", log=lines.append)
    assert set(meta["scores"]) == {"prose_cloze", "arithmetic_cloze", "arithmetic_exact"}
    assert any("ignored" in line and "'x.yaml'" in line and "'utils.py'" in line for line in lines)
    assert not canary.exists()

    # 2. one of the suite's own task YAMLs swapped for the payload
    third = tmp_path / "third" / "ws"
    tasks_there = third / "eval_suite" / built.path.name / "tasks"
    swapped = _jinja_yaml("prose_cloze", tasks_there / "prose_cloze.jsonl", canary)
    _plant(client, folder, {"tasks/prose_cloze.yaml": swapped.encode()})
    suite, fetched = _suite(Workspace.at(third, storage), [])
    assert fetched and (tasks_there / "prose_cloze.yaml").read_text() == swapped
    assert _load(tasks_there, ["prose_cloze"])["prose_cloze"] and canary.exists()  # control: live
    canary.unlink()
    with pytest.raises(ForeignTaskFile, match="prose_cloze.yaml"):
        evaluate(run, model, suite, out=tmp_path / "eval-third", log=lambda _: None)
    assert not canary.exists()

    # 3. with $SMOLLM3_MIRROR_KEY, a signed mirror forged the same way is not fetched at all: the
    # log names the object, and the step builds its own suite
    monkeypatch.setenv(MIRROR_KEY_ENV, "mirror-key-of-this-test-0123456789")
    mirror_artifact(built.path, "s3://ckpts/mirror/eval_suite", storage)
    _plant(client, folder, {"tasks/prose_cloze.yaml": swapped.encode()})
    log.clear()
    suite, fetched = _suite(Workspace.at(tmp_path / "fourth" / "ws", storage), log)
    assert not fetched
    assert any(f"s3://ckpts/{folder}/tasks/prose_cloze.yaml: its entry in {MANIFEST}" in line for line in log)
    ours = (built.path / "tasks" / "prose_cloze.yaml").read_text().replace(str(built.path), str(suite.path))
    assert (suite.path / "tasks" / "prose_cloze.yaml").read_text() == ours  # built here, no payload
    meta = evaluate(run, model, suite, out=tmp_path / "eval-fourth", log=lambda _: None)
    assert set(meta["scores"]) == {"prose_cloze", "arithmetic_cloze", "arithmetic_exact"}
    assert not canary.exists()
