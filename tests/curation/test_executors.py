"""datatrove executors of the curation stages (curation/executors.py): Slurm and Ray chains, and
the worker count per stage."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest

from curation.executors import RayExecutorConfig, SlurmExecutorConfig, machine_cores, make_executors, stage_workers
from curation.stages import plan_stages
from tasks.curate import CurationConfig, curate
from tests.conftest import build_once


def test_slurm_and_ray_executors_are_constructed_and_chained(tmp_path):
    slurm = CurationConfig(
        executor="slurm", tasks=4, workers=2, slurm=SlurmExecutorConfig(partition="cpu", sbatch_args={"account": "lm"})
    )
    stages = plan_stages(slurm, "web", tmp_path / "train", tmp_path, 4)
    ex = make_executors(slurm, stages, tmp_path / "logs")
    assert [type(e).__name__ for e in ex] == ["SlurmPipelineExecutor"] * len(stages)
    assert ex[0].partition == "cpu" and ex[0].tasks == 4 and ex[0].depends is None
    assert all(b.depends is a for a, b in zip(ex, ex[1:], strict=False))
    ray = CurationConfig(executor="ray", tasks=4, workers=2, ray=RayExecutorConfig(time_limit_s=600, retries=1))
    ex = make_executors(ray, stages, tmp_path / "logs")
    assert [type(e).__name__ for e in ex] == ["RayStage"] * len(stages)  # datatrove's, with our run loop
    assert (ex[0].time, ex[0].retries, ex[0].workers, ex[0].depends) == (600, 1, 2, None)
    assert all(b.depends is a for a, b in zip(ex, ex[1:], strict=False))
    with pytest.raises(ValueError, match="curation.slurm is not set"):
        make_executors(CurationConfig(executor="slurm"), stages, tmp_path / "logs")


def test_workers_default_to_the_machines_cores_locally_and_all_tasks_on_clusters():
    assert stage_workers(CurationConfig(), 100) == min(machine_cores(), 100)
    assert stage_workers(CurationConfig(), 1) == 1
    assert stage_workers(CurationConfig(workers=3), 100) == 3
    assert stage_workers(CurationConfig(executor="ray"), 100) == 100


def test_slurm_scripts_find_the_submitting_venv_and_this_checkout(tmp_path):
    """Without venv_path the script puts the submitting interpreter's bin/ (datatrove's
    launch_pickled_pipeline) first on PATH; with it, activates it; either way this checkout is
    first on PYTHONPATH, whatever sbatch exports."""
    import subprocess
    import sys

    from curation.executors import CODE_ROOT

    stages = plan_stages(CurationConfig(), "web", tmp_path / "train", tmp_path, 2)[:1]
    for venv, first in (
        (None, f"export PATH={Path(sys.executable).parent}:"),
        ("/fsx/v/bin/activate", "source /fsx/v/bin/activate;"),
    ):
        config = CurationConfig(executor="slurm", slurm=SlurmExecutorConfig(partition="cpu", venv_path=venv))
        ex = make_executors(config, stages, tmp_path / "logs")[0]
        script = ex.get_launch_file_contents(ex.get_sbatch_args(max_array=2), "srun -l launch_pickled_pipeline x.pik")
        line = next(ln.strip() for ln in script.splitlines() if "PYTHONPATH" in ln)
        assert line.startswith(first) and f"export PYTHONPATH={CODE_ROOT}" in line
        # what the line does in bash: the checkout first, an inherited PYTHONPATH kept after it
        probe = f'{line.replace("source /fsx/v/bin/activate;", "")}; echo "$PYTHONPATH"'
        out = subprocess.run(
            ["bash", "-c", probe],
            env={"PYTHONPATH": "/elsewhere", "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
        )
        assert out.stdout.strip() == f"{CODE_ROOT}:/elsewhere", out.stderr


def test_ray_token_authentication_needs_a_token_and_names_where_it_is_read_from(tmp_path, monkeypatch):
    from curation.executors import RayExecutorConfig, ray_auth_env

    assert ray_auth_env(RayExecutorConfig(address="10.0.0.1:6379"), {}) == {}
    token = tmp_path / "token"
    token.write_text("0f" * 32)
    given = RayExecutorConfig(address="10.0.0.1:6379", auth="token", token_path=str(token))
    assert ray_auth_env(given, {}) == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    token.write_text("")
    with pytest.raises(ValueError, match=rf"ray.token_path {token}: no such file, or it is empty"):
        ray_auth_env(given, {})
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.ray/auth_token
    bare = RayExecutorConfig(address="10.0.0.1:6379", auth="token")
    with pytest.raises(ValueError, match="ray.auth is token but no token was found: set ray.token_path"):
        ray_auth_env(bare, {})
    assert ray_auth_env(bare, {"RAY_AUTH_TOKEN": "x"}) == {"RAY_AUTH_MODE": "token"}


# --- tiny's data steps on a real Slurm cluster and a real Ray head, against the local executor ------
# A subset of the tiny recipe, so that the cluster runs stay short: its `code` source at 200
# documents (one read task: a capped source), curated with tiny's settings in 2 tasks (every
# stage: filter, exact, unique, MinHash buckets and clusters, final, held-out) and tokenized in 2
# tasks with a small BPE trained on the curated text.


def _tiny_code_source():
    from flows.recipe import load_recipe

    recipe = load_recipe("tiny")
    return recipe, recipe.source("code").model_copy(update={"max_documents": 200})


def _contents(folder: Path, runs: tuple[Path, ...]) -> dict[str, bytes]:
    """Every file a step wrote, gzip members decompressed (their headers hold the write time),
    except its logs (datatrove's per-executor logs, timings and launch scripts). The runs' folders
    are named `<run>`: datatrove's readers record each document's input path (`file_path`), and
    a run of the test may read its own source folder."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and rel.parts[0] != "logs" and path.name != "_COMPLETE.json":
            data = path.read_bytes()
            data = gzip.decompress(data) if path.suffix == ".gz" else data
            for run in runs:
                data = data.replace(str(run).encode(), b"<run>")
            out[str(rel)] = data
    return out


def _same_meta(a: dict, b: dict) -> None:
    drop = ("seconds", "curate_seconds", "executor")
    # the tokenizer step's meta names its own folder's tokenizer.json (each run's folder)
    same = [
        Path(m["tokenizer_json"]).relative_to(Path(m["tokenizer_json"]).parents[1])
        for m in (a, b)
        if "tokenizer_json" in m
    ]
    assert len(set(same)) <= 1, same
    drop += ("tokenizer_json",)
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}


def _run_data_steps(root: Path, executor: dict, raw=None, tokenizer_folder: Path | None = None) -> dict:
    """The source (unless `raw` is given), curate, heldout_index, decontaminate and tokenize steps
    of the subset (the index of its own held-out split) with the executor settings `executor`
    (curation's and tokenization's, the tokenizer's and the reasoning traces'), each in its own
    folder, then the tokenizer's training and the builtin reasoning traces; and the ingestion of an uncapped
    `files:` source (`ingest`: three files with duplicate ids across them and bad records,
    tests/tasks/test_sources.py) by 3 read tasks and 3 id buckets, the stages a capped source
    skips. The tokenize and reasoning steps use the small BPE at `tokenizer_folder` (default
    `root`'s sibling `tokenizer`), trained there by the first run that finds none."""
    from pipeline.artifact import Artifact
    from tasks.decontaminate import DecontaminateSpec, decontaminate
    from tasks.heldout_index import HeldoutIndexSpec, heldout_index
    from tasks.reasoning_data import ReasoningDataConfig, ReasoningDataSpec, reasoning_data
    from tasks.sources import SourceSpec, source
    from tasks.tokenize import TokenizeSpec, tokenize
    from tasks.tokenizer import TokenizerConfig, tokenizer
    from tests.tasks.test_sources import _three_files

    recipe, src = _tiny_code_source()
    quiet = lambda _: None  # noqa: E731
    curation = recipe.curation.model_copy(update={"tasks": 2, **executor})
    out = {}
    (root / "files").mkdir(parents=True)
    files = src.model_copy(
        update={"name": "files", "uri": _three_files(root / "files"), "domain": "web", "id_field": "id"}
        | {"held_out_fraction": 0.0, "max_document_chars": 1000, "max_documents": None}
    )
    spec = SourceSpec.of(files, recipe.seed, None, curation.model_copy(update={"tasks": 3}))
    assert spec.read_tasks == 3
    out["ingest"] = source(spec, out=root / "ingest", log=quiet)
    if raw is None:
        spec = SourceSpec.of(src, recipe.seed, recipe.curation.heldout.max_docs, curation)
        out["source"] = source(spec, out=root / "source", log=quiet)
        raw = Artifact(kind="corpus", uri=str(root / "source"), fingerprint="a" * 64, meta=out["source"])
    (root / "curate").mkdir(parents=True)
    out["curate"] = curate(curation.for_source(src), raw, out=root / "curate", log=quiet)
    cured = Artifact(kind="corpus", uri=str(root / "curate"), fingerprint="b" * 64, meta=out["curate"])
    spec = HeldoutIndexSpec.of(curation, [src])
    out["heldout_index"] = heldout_index(spec, [raw], out=root / "heldout_index", log=quiet)
    index = Artifact(
        kind="heldout_index", uri=str(root / "heldout_index"), fingerprint="d" * 64, meta=out["heldout_index"]
    )
    spec = DecontaminateSpec.of(curation)
    out["decontaminate"] = decontaminate(spec, cured, index, out=root / "decontaminate", log=quiet)
    cur = Artifact(kind="corpus", uri=str(root / "decontaminate"), fingerprint="e" * 64, meta=out["decontaminate"])
    tok = _tokenizer(tokenizer_folder or root.parent / "tokenizer", cur)
    settings = recipe.tokenize.model_copy(update={"tasks": 2, **executor})
    (root / "tokenize").mkdir()
    out["tokenize"] = tokenize(
        TokenizeSpec(tokenize=settings, seed=recipe.seed), tokenizer=tok, corpus=cur, out=root / "tokenize", log=quiet
    )
    # the tokenizer's training, its one task on this executor (the tokenizer section's own)
    run = {k: v for k, v in executor.items() if k in ("executor", "slurm", "ray")}
    (root / "tokenizer").mkdir()
    trained = TokenizerConfig(vocab_size=400, min_frequency=1, **run)
    out["tokenizer"] = tokenizer(trained, [cur], out=root / "tokenizer", log=quiet)
    # the reasoning traces: reader tasks, then a render-and-tokenize task per shard, on the
    # tokenize section's executor
    (root / "reasoning_data").mkdir()
    traces = ReasoningDataConfig(name="reasoning", examples=40)
    spec = ReasoningDataSpec.of(traces, recipe.seed, settings, recipe.reasoning_modes)
    out["reasoning_data"] = reasoning_data(spec, tokenizer=tok, heldout=(cur,), out=root / "reasoning_data", log=quiet)
    return out


def _tokenizer(folder: Path, corpus):
    """One small BPE for every run of the test (trained once, from the first curated corpus)."""
    from pipeline.artifact import Artifact
    from tasks.tokenizer import TokenizerConfig, tokenizer

    if not (folder / "meta.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        meta = tokenizer(TokenizerConfig(vocab_size=400, min_frequency=1), [corpus], out=folder, log=lambda _: None)
        (folder / "meta.json").write_text(json.dumps(meta))
    meta = json.loads((folder / "meta.json").read_text())
    return Artifact(kind="tokenizer", uri=str(folder), fingerprint="c" * 64, meta=meta)


@pytest.fixture(scope="session")
def local_reference(tmp_path_factory) -> tuple[Path, Path]:
    """The local executor's run of the data steps (`_run_data_steps(..., {executor: local,
    workers: 1})`), computed once per session (`build_once`) and shared, read-only, by the Slurm
    and Ray tests: (its root, the tokenizer folder every run uses). Read its metas with
    `_reference_meta` (a fresh copy for each test)."""

    def run(root: Path) -> None:
        meta = _run_data_steps(root / "local", {"executor": "local", "workers": 1}, tokenizer_folder=root / "tokenizer")
        text = json.dumps(meta)
        assert json.loads(text) == meta  # the metas survive the file unchanged
        (root / "meta.json").write_text(text)

    root = build_once(tmp_path_factory, "executors-local-reference", run)
    return root / "local", root / "tokenizer"


def _reference_meta(local: Path) -> dict:
    return json.loads((local.parent / "meta.json").read_text())


def _assert_same_output(local: Path, other: Path, local_meta: dict, other_meta: dict) -> None:
    for step in local_meta:
        assert _contents(other / step, (local, other)) == _contents(local / step, (local, other)), step
        _same_meta(local_meta[step], other_meta[step])
    shards = sorted(p.name for p in (other / "tokenize").glob("*.ds"))
    assert len(shards) == 2 and other_meta["tokenize"]["documents"] > 100  # 2 token shards, the corpus in them
    # the copies of ids x1 and x4 in later files found by the id buckets, every bad record counted
    ingest = other_meta["ingest"]
    assert ingest["read_tasks"] == 3 and ingest["documents"] == 5
    assert ingest["rejected"] == {"empty": 1, "too_large": 1, "malformed_json": 3, "duplicate_id": 2}
    assert other_meta["reasoning_data"]["documents"] == 40 == other_meta["reasoning_data"]["think_conversations"]
    assert other_meta["tokenizer"]["origin"] == "trained"


def _queued_jobs() -> set[str]:
    import subprocess

    out = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def _end_jobs(jobs: set[str], wait_s: float = 120) -> None:
    """Wait for `jobs` (this test's) to leave the queue; cancel, by id, those still there."""
    import subprocess

    deadline = time.monotonic() + wait_s
    while jobs & _queued_jobs() and time.monotonic() < deadline:
        time.sleep(1)
    left = sorted(jobs & _queued_jobs())
    if left:
        subprocess.run(["scancel", *left], check=False)


@pytest.mark.slow
@pytest.mark.xdist_group("slurm")
def test_tiny_data_steps_run_as_slurm_jobs_with_the_local_executors_output(local_reference, local_slurm, tmp_path):
    """The source, curate, heldout_index, decontaminate and tokenize steps of a subset of tiny (its
    `code` source, 200 documents), and an uncapped `files:` source's read, id and finish stages,
    as sbatch array jobs through datatrove's SlurmPipelineExecutor: the same files
    (gzip contents), the same token shards byte for byte, the same counts and the same config
    identity (fingerprint) as on the local executor. No venv_path: the jobs find datatrove's
    launcher and this checkout through the script's PATH and PYTHONPATH lines."""
    from pipeline.artifact import identity
    from tasks.curate import CurationConfig

    slurm = SlurmExecutorConfig(partition="debug", time="00:20:00", mem_per_cpu_gb=1, poll_seconds=0.5)
    local, tok = local_reference
    before = _queued_jobs()
    start = time.monotonic()
    try:
        on_slurm = _run_data_steps(
            tmp_path / "slurm", {"executor": "slurm", "workers": 2, "slurm": slurm}, tokenizer_folder=tok
        )
        seconds = time.monotonic() - start
    finally:  # datatrove's merge_stats jobs (one per stage, after its array) end on their own in
        _end_jobs(_queued_jobs() - before)  # seconds; what is left of this test's jobs is cancelled
    _assert_same_output(local, tmp_path / "slurm", _reference_meta(local), on_slurm)
    assert identity(CurationConfig(executor="slurm", slurm=slurm, workers=2)) == identity(CurationConfig())
    # each stage was an array job of this cluster: its script and job id are in the step's logs
    scripts = sorted((tmp_path / "slurm").glob("*/logs/*/launch_script.slurm"))
    stages = {f"{p.parts[-4]}/{p.parts[-2]}" for p in scripts}
    assert {"source/read", "source/finish", "curate/filter", "curate/final", "tokenize/tokenize"} <= stages
    assert {"ingest/read", "ingest/ids", "ingest/finish"} <= stages  # an uncapped source's three stages
    # the tokenizer's training and the reasoning traces are array jobs of the cluster too
    assert {"tokenizer/train", "reasoning_data/read", "reasoning_data/tokenize"} <= stages, stages
    # the held-out index is built by the cluster's tasks too, in its own step (once per DAG), and
    # the decontamination of the curated shards runs there as well
    assert {"heldout_index/index_shards", "heldout_index/index_merge", "heldout_index/index_finish"} <= stages
    assert "decontaminate/decontaminate" in stages
    assert all("srun" in p.read_text() and "--partition=debug" in p.read_text() for p in scripts)
    # and Slurm ran its tasks: an output file per array task (`slurm_logs/{job}_{task}.out`)
    assert all(list((p.parent / "slurm_logs").glob("*_*.out")) for p in scripts)
    print(f"tiny subset on Slurm: {len(scripts)} array jobs, {seconds:.0f} s")  # measured for docs/scale.md


@pytest.fixture
def ray_head():
    """A Ray head on this machine with token authentication (`RAY_AUTH_MODE=token`), started with
    `--node-ip-address 127.0.0.1`, its own temporary folder and free ports, no dashboard; stopped
    at teardown (its `ray start --block` process drains and stops the node processes it started).
    Yields (address, token file, the head's log folder). Its workers import this checkout through
    the head's PYTHONPATH. Ray 2.60 does not bind to loopback: it replaces 127.0.0.1 by the
    host's routable address (`services.resolve_ip_for_localhost`) and its GCS and raylet listen on
    every interface, so for the test's minute the token is what keeps others out."""
    import os
    import secrets
    import shutil
    import signal
    import socket
    import subprocess
    import sys
    import tempfile

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    root = Path(tempfile.mkdtemp(prefix="ray"))  # short: Ray's Unix sockets live under it
    token = root / "token"
    token.write_text(secrets.token_hex(32))
    gcs = port()
    ports = ["--node-manager-port", "--object-manager-port", "--ray-client-server-port"]
    ports += ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port"]
    ports += ["--metrics-export-port"]
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1"]
    cmd += ["--port", str(gcs), "--temp-dir", str(root / "r"), "--num-cpus", "2", "--include-dashboard", "false"]
    cmd += ["--object-store-memory", str(100 * 1024 * 1024), "--disable-usage-stats"]
    cmd += [arg for flag in ports for arg in (flag, str(port()))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    repo = str(Path(__file__).resolve().parents[2])
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "PYTHONPATH": repo}
    log = open(root / "head.log", "w")  # noqa: SIM115  (closed at teardown)
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in (root / "head.log").read_text():
            assert head.poll() is None, (root / "head.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the Ray head did not start in 120 s"
            time.sleep(0.5)
        yield f"127.0.0.1:{gcs}", token, root / "r" / "session_latest" / "logs"
    finally:
        # what the head's processes logged as errors, shown with the test's output if it fails
        # (the folder is removed below): a stage that waits forever says why here
        for path in sorted((root / "r" / "session_latest" / "logs").glob("*")):
            if path.suffix in {".err", ".out", ".log"} and path.is_file():
                text = path.read_text(errors="replace").splitlines()
                errors = [line for line in text if " E " in line or "Error" in line or "Traceback" in line]
                if errors:
                    print(f"ray head {path.name}:", *errors[-15:], sep="\n  ")
        head.terminate()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)  # the group this fixture started
            head.wait(10)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_tiny_curation_runs_on_a_ray_head_with_token_auth_with_the_local_executors_output(
    local_reference, ray_head, tmp_path
):
    """The ingestion of an uncapped `files:` source (read, id buckets, finish) and the curate and
    tokenize steps of the same subset of tiny on a Ray head that requires a token: refused without `ray.auth: token` (Ray turns token mode on by itself only for a cluster
    it finds on this machine), and with it the same output as the local executor, computed on that
    head (the step's driver is in the head's logs: it did not start a Ray of its own)."""
    import os

    from curation.executors import RayExecutorConfig
    from pipeline.artifact import Artifact, identity

    address, token, head_logs = ray_head
    local_root, tok = local_reference
    local = _reference_meta(local_root)
    # the local run's source folder, read (never written) by the runs below
    raw = Artifact(kind="corpus", uri=str(local_root / "source"), fingerprint="a" * 64, meta=local.pop("source"))
    # a task that hangs (as one did in CI under datatrove's loop) is killed and rerun long before
    # pytest's timeout; a normal one takes seconds
    ray = RayExecutorConfig(address=address, cpus_per_task=1, mem_per_cpu_gb=0.25, time_limit_s=240)
    with pytest.raises(ConnectionError, match=rf"ray.address {address}: .*needs ray.auth: token"):
        _run_data_steps(tmp_path / "refused", {"executor": "ray", "ray": ray}, raw=raw, tokenizer_folder=tok)
    ray = ray.model_copy(update={"auth": "token", "token_path": str(token)})
    start = time.monotonic()
    on_ray = _run_data_steps(
        tmp_path / "ray", {"executor": "ray", "workers": 2, "ray": ray}, raw=raw, tokenizer_folder=tok
    )
    seconds = time.monotonic() - start
    _assert_same_output(local_root, tmp_path / "ray", local, on_ray)
    assert identity(CurationConfig(executor="ray", ray=ray)) == identity(CurationConfig())
    assert list(head_logs.glob(f"python-core-driver-*_{os.getpid()}.log"))  # this process drove the head
    assert "RAY_AUTH_MODE" not in os.environ  # the connection's environment is put back
    print(f"tiny subset on Ray: curate + tokenize {seconds:.0f} s")  # measured for docs/scale.md


def test_leaving_a_cluster_with_token_auth_drops_the_token_ray_loaded(tmp_path, monkeypatch):
    """Ray caches the token it loaded per process: after a connection to a head with token
    authentication, a local Ray started in the same process failed to start its GCS
    (`InvalidAuthToken`; seen when a serial `make test` ran the Ray head test, then the local Ray
    test). `_reload_ray_auth`, run as `ray_connection` connects and as it ends, makes Ray read
    the mode and the token again: the token is gone with the environment that named it."""
    from ray._raylet import AuthenticationTokenLoader

    from curation.executors import _reload_ray_auth

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    token = tmp_path / "token"
    token.write_text("ab" * 32)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    _reload_ray_auth()
    assert AuthenticationTokenLoader.instance().has_token()
    monkeypatch.delenv("RAY_AUTH_MODE")
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    _reload_ray_auth()
    assert not AuthenticationTokenLoader.instance().has_token()


_FORKED = """
import json, os, sys
from pathlib import Path
from types import SimpleNamespace
from curation.executors import make_executors, run_executors
from tests.curation import preload_steps

out = Path(sys.argv[2])
step = getattr(preload_steps, sys.argv[1])(str(out))
config = SimpleNamespace(executor="local", workers=2, slurm=None, ray=None)
run_executors(config, make_executors(config, [("only", [step], 2)], out / "logs"), out / "logs")
seen = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
print(json.dumps({"seen": seen, "pid": os.getpid(), "here": step.marker in sys.modules}))
"""


@pytest.mark.parametrize(
    "step, preloaded",
    [("NamesItsImport", True), ("RecordsImports", False), ("SplitsEnglishWords", True), ("RecordsSpacy", False)],
)
def test_local_workers_fork_with_the_steps_modules_and_their_named_imports(tmp_path, step, preloaded):
    """A local stage of two workers: each is forked from the fork server with the step's module
    imported, and the module the step names in `worker_imports` (or spaCy, where the step splits
    words in a language datatrove tokenizes with it) only if it names it; the step's own process
    never imports that module (the server does)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _FORKED, step, str(tmp_path)],
        cwd=root,
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    pids = {s["pid"] for s in got["seen"]}
    assert len(pids) == 2 and got["pid"] not in pids  # two worker processes, not the step's
    assert [s["own"] for s in got["seen"]] == [True, True]
    assert [s["marker"] for s in got["seen"]] == [preloaded, preloaded]
    assert got["here"] is False
