"""The curate step: planted duplicates, bad input accounting, presets, stats rows, decontamination,
the flow path (the curation library alone: tests/curation/)."""

from __future__ import annotations

import gzip
import json
import random
import socket
import threading
from pathlib import Path

import pytest

from curation.filters import (
    DocumentationProseFilter,
    filter_name,
)
from curation.heldout import word_ngrams
from curation.presets import PRESETS
from curation.source_kinds import SourceConfig, is_held_out
from evals.benchmarks.prose_cloze import prose_items
from evals.suite import contamination
from flows.recipe import RecipeError, load_recipe
from pipeline.artifact import Artifact
from tasks.curate import CurationConfig, DecontaminationConfig, curate
from tasks.decontaminate import DecontaminateSpec, decontaminate
from tasks.evaluate import EvalConfig, SuiteSpec, eval_suite
from tasks.heldout_index import HeldoutIndexSpec, heldout_index
from tasks.sources import SourceSpec
from tasks.sources import source as source_step
from tests.tasks.datafiles import PARAGRAPHS, corpus, doc_line, random_text


def curate_clean(cfg: CurationConfig, art: Artifact, others=(), *, out: Path, log=lambda _: None, presets=None) -> dict:
    """The source's curate step, the held-out index of it and `others`, and its decontaminate
    step, as flows/smollm3.py wires them: the decontaminated corpus in `out` (the two steps
    before it beside `out`, under `<out>.curate` and `<out>.index`); its meta. `presets`: every
    indexed source's preset (default: `cfg.presets`, the others by their domain)."""
    cur, idx = out.with_name(out.name + ".curate"), out.with_name(out.name + ".index")
    cur.mkdir()
    idx.mkdir()
    cmeta = curate(cfg, art, out=cur, log=log)
    d = cfg.decontamination
    spec = HeldoutIndexSpec(
        presets=presets if presets is not None else cfg.presets,
        ngram=d.ngram,
        partitions=d.index_partitions,
        tasks=cfg.tasks,
        workers=cfg.workers,
    )
    imeta = heldout_index(spec, (art, *others), out=idx, log=log)
    curated = Artifact(kind="corpus", uri=str(cur), fingerprint="c" * 64, meta=cmeta)
    index = Artifact(kind="heldout_index", uri=str(idx), fingerprint="d" * 64, meta=imeta)
    return decontaminate(DecontaminateSpec.of(cfg), curated, index, out=out, log=log)


def _ids(folder: Path) -> list[str]:
    out = []
    for path in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            out += [json.loads(line)["id"] for line in fh]
    return out


@pytest.mark.slow
def test_planted_exact_and_near_duplicates_are_all_found_without_false_positives(tmp_path):
    rng = random.Random(0)
    unique = [(f"u{i}", random_text(rng)) for i in range(40)]
    exact = [(f"exact{i}", unique[i][1]) for i in range(3)]
    near = []
    for i in range(3, 6):
        words = unique[i][1].split(" ")
        for k in (40, 120):  # two words changed out of 200: Jaccard of 5-grams ~0.9
            words[k] = "zeppelin"
        near.append((f"near{i}", " ".join(words)))
    train = unique[:20] + exact + unique[20:] + near
    art = corpus(tmp_path / "in", train, source="toy", domain="web")
    cfg = CurationConfig(presets={"toy": "none"})
    out = tmp_path / "out"
    out.mkdir()
    meta = curate(cfg, art, out=out)

    kept = _ids(out / "train")
    assert sorted(kept) == sorted(i for i, _ in unique)  # every planted copy gone, no original lost
    assert meta["removed"] == {"exact_dedup:exact_dedup": 3, "minhash_dedup:minhash_dedup": 3}
    assert meta["documents"] == 40 and meta["unaccounted"] == 0
    removed = _ids(out / "removed" / "minhash_dedup") + _ids(out / "removed" / "exact_dedup")
    assert sorted(removed) == sorted(i for i, _ in exact + near)
    rows = json.loads((out / "filter_stats.json").read_text())
    assert [r["filter"] for r in rows] == ["read", "exact_dedup", "minhash_dedup"]
    for a, b in zip(rows, rows[1:], strict=False):  # each filter starts where the last stopped
        assert b["docs_in"] == a["docs_out"] and b["chars_in"] == a["chars_out"]


@pytest.mark.parametrize(
    ("exact", "minhash", "removed"),
    [(True, False, {"exact_dedup:exact_dedup": 2}), (False, True, {"minhash_dedup:minhash_dedup": 4})],
)
@pytest.mark.slow
def test_each_dedup_pass_alone(tmp_path, exact, minhash, removed):
    rng = random.Random(2)
    unique = [(f"u{i}", random_text(rng)) for i in range(12)]
    copies = [(f"exact{i}", unique[i][1]) for i in range(2)]
    near = [(f"near{i}", unique[i][1].replace(" ", "  ", 1) + " Zeppelin.") for i in range(2, 4)]
    art = corpus(tmp_path / "in", unique + copies + near, source="toy", shards=2)
    out = tmp_path / "out"
    out.mkdir()
    cfg = CurationConfig(presets={"toy": "none"}, exact_dedup=exact, minhash=minhash, tasks=2)
    meta = curate(cfg, art, out=out)
    assert meta["removed"] == removed and meta["unaccounted"] == 0 and meta["tasks"] == 2
    assert meta["documents"] == 16 - sum(removed.values())


@pytest.mark.slow
def test_bad_input_is_counted_per_reason_never_dropped_silently(tmp_path):
    rng = random.Random(1)
    good = [doc_line(f"g{i}", random_text(rng, 60)) for i in range(5)]
    bad = [
        b'{"id": "broken", "text": "no closing',  # malformed JSON
        b'{"id": "latin1", "text": "caf\xe9"}',  # invalid UTF-8 bytes
        b'{"id": "surrogate", "text": "\\ud800 lone"}',  # cannot be encoded as UTF-8
        b'{"id": "notext", "body": "hello"}',  # missing text field
        b'{"id": "nonstring", "text": 42}',  # text is not a string
        b'["a", "list"]',  # not an object
        b'{"id": "blank", "text": "   "}',  # empty
        doc_line("huge", "word " * 3000),  # above max_document_chars
    ]
    art = corpus(tmp_path / "in", good[:2] + bad + good[2:], domain="math")
    out = tmp_path / "out"
    out.mkdir()
    meta = curate(CurationConfig(max_document_chars=10_000), art, out=out)
    assert meta["documents"] == 5
    # this step's own rejections, by reason; a source's rejections stay in the source's meta
    assert meta["rejected"] == {
        "malformed_json": 2,
        "invalid_utf8": 2,
        "missing_text_field": 2,
        "empty": 1,
        "too_large": 1,
    }
    assert meta["input_documents"] == 13 and meta["unaccounted"] == 0


def test_web_preset_runs_offline_with_spacy_blank(tmp_path, monkeypatch):
    real_connect = socket.socket.connect

    def no_network(self, address):  # local (AF_UNIX) sockets are fine: the executor's manager
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise OSError(f"test forbids network access (tried {address})")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    docs = [(f"p{i}", "\n".join(PARAGRAPHS[i:] + PARAGRAPHS[:i])) for i in range(3)]
    docs.append(("junk", "click here " * 200))  # repetition: Gopher removes it
    art = corpus(tmp_path / "in", docs, domain="web")
    out = tmp_path / "out"
    out.mkdir()
    meta = curate(CurationConfig(minhash=False, exact_dedup=False), art, out=out)
    assert meta["preset"] == "web" and "junk" not in _ids(out / "train")
    rows = json.loads((out / "filter_stats.json").read_text())
    assert [r["filter"] for r in rows] == [
        "read",
        "language",  # py3langid's bundled model: nothing downloaded
        "gopher_repetition",
        "gopher_quality",
        "c4_quality",
        "fineweb_quality",
    ]
    assert sum(sum(r["reasons"].values()) for r in rows) + meta["documents"] == 4
    assert list((out / "removed").iterdir())  # removed samples kept for inspection


def _train_id(prefix: str, source: str, fraction: float) -> str:
    """An id the source's hash split sends to train."""
    k = 0
    while is_held_out(source, f"{prefix}{k}", fraction):
        k += 1
    return f"{prefix}{k}"


@pytest.mark.slow
def test_heldout_copies_straddling_the_split_leave_train_and_the_contamination_report(tmp_path):
    """A user's JSONL with copies of held-out documents planted under other ids: the source's id
    split puts them in train; curation removes them, and the eval suite's report shows 0."""
    rng = random.Random(7)
    docs = [(f"d{i}", random_text(rng, 200)) for i in range(60)]
    held = [d for d in docs if is_held_out("user", d[0], 0.2)]
    assert len(held) >= 8
    planted = {}
    for doc_id, text in held[:3]:  # verbatim copies
        planted[_train_id(f"copy-{doc_id}-", "user", 0.2)] = ("exact", text)
    for doc_id, text in held[3:6]:  # near copies: two words of 200 changed
        words = text.split(" ")
        words[50] = words[150] = "zeppelin"
        planted[_train_id(f"near-{doc_id}-", "user", 0.2)] = ("overlap", " ".join(words))
    doc_id, text = held[6]  # a longer text holding a whole held-out document
    planted[_train_id(f"holds-{doc_id}-", "user", 0.2)] = ("overlap", random_text(rng, 150) + " " + text)
    path = tmp_path / "user.jsonl"
    rows = docs + [(k, t) for k, (_, t) in planted.items()]
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in rows))
    source = SourceConfig(name="user", uri=f"files:{path}", domain="web", id_field="id", held_out_fraction=0.2)
    raw = source_step(SourceSpec(source=source), out=tmp_path / "src", log=lambda _: None)
    raw_art = Artifact(kind="corpus", uri=str(tmp_path / "src"), fingerprint="a" * 64, meta=raw)
    assert raw["heldout_documents"] == len(held)  # the planted copies all went to train
    out = tmp_path / "cur"
    out.mkdir()
    meta = curate_clean(CurationConfig(presets={"user": "none"}), raw_art, out=out)
    cur = Artifact(kind="corpus", uri=str(out), fingerprint="b" * 64, meta=meta)

    assert meta["removed"] == {"heldout_decont:exact": 3, "heldout_decont:overlap": 4}
    kept = set(_ids(out / "train"))
    assert not kept & set(planted) and kept == {d[0] for d in docs} - {d[0] for d in held}
    removed = {}
    for path in sorted((out / "removed" / "heldout_decont").glob("*.jsonl.gz")):  # one file per task
        for line in gzip.open(path, "rt"):
            doc = json.loads(line)
            removed[doc["id"]] = doc["metadata"]["filter_reason"]
    assert removed == {k: reason for k, (reason, _) in planted.items()}
    assert meta["decontaminated_against"] == ["user"] and meta["unaccounted"] == 0

    # The eval suite's prose items come from held-out text; raw train holds copies, curated none.
    suite = eval_suite(
        SuiteSpec(eval=EvalConfig(items_per_task=50)),
        heldout=[raw_art],
        train=[cur],
        out=tmp_path / "suite",
        log=lambda _: None,
    )
    assert suite["contamination"]["prose_cloze"] == 0.0
    items = prose_items([t for _, t in held], EvalConfig(items_per_task=50), random.Random(0))
    raw_train = [text for doc_id, text in rows if not is_held_out("user", doc_id, 0.2)]
    before = contamination({"prose_cloze": items}, raw_train, 8)
    assert before["prose_cloze"]["contaminated"] >= 7  # the planted copies, before curation


@pytest.mark.slow
def test_train_is_decontaminated_against_other_sources_heldout(tmp_path):
    rng = random.Random(11)
    other_held = [("o1", random_text(rng)), ("o2", random_text(rng))]
    other = corpus(tmp_path / "other", [("x", random_text(rng))], heldout=other_held, source="other")
    mine = [(f"m{i}", random_text(rng)) for i in range(6)] + [("copy", other_held[1][1])]
    art = corpus(tmp_path / "mine", mine, source="mine")
    out = tmp_path / "out"
    out.mkdir()
    meta = curate_clean(CurationConfig(presets={"mine": "none"}), art, [other], out=out)
    assert meta["removed"] == {"heldout_decont:exact": 1} and "copy" not in _ids(out / "train")
    assert meta["decontaminated_against"] == ["mine", "other"]


def test_the_held_out_index_is_built_by_executor_tasks_not_in_the_step_process(tmp_path, monkeypatch):
    import curation.heldout as heldout_module

    rng = random.Random(12)
    held = {name: [(f"{name}{i}", random_text(rng)) for i in range(3)] for name in ("o1", "o2")}
    others = [
        corpus(tmp_path / name, [("x", random_text(rng))], heldout=docs, source=name) for name, docs in held.items()
    ]
    clean = [(f"m{i}", random_text(rng)) for i in range(6)]
    art = corpus(tmp_path / "mine", [*clean, ("copy", held["o2"][1][1])], source="mine", shards=2)
    hashed: list[str] = []  # texts whose n-grams this process computes
    real = heldout_module.word_ngrams
    monkeypatch.setattr(heldout_module, "word_ngrams", lambda text, n: hashed.append(text) or real(text, n))
    monkeypatch.setattr(heldout_module.HeldoutIndex, "build", None)  # no index built in this process
    out = tmp_path / "out"
    cfg = CurationConfig(presets={"mine": "none"}, minhash=False, exact_dedup=False, workers=2)
    meta = curate_clean(cfg, art, others, out=out)
    # the planted copy of another source's held-out text goes; every clean document stays
    assert meta["removed"] == {"heldout_decont:exact": 1}
    assert sorted(_ids(out / "train")) == sorted(i for i, _ in clean)
    assert meta["decontaminated_against"] == ["mine", "o1", "o2"] and meta["heldout_index"]["documents"] == 6
    # built by the index stages' tasks (pool workers of the local executor, array jobs on Slurm),
    # none of the held-out text hashed here
    assert not {t for docs in held.values() for _, t in docs} & set(hashed)
    index = tmp_path / "out.index"  # the heldout_index step's folder
    stats = json.loads((index / "logs" / "index_shards" / "stats.json").read_text())
    assert sum(e["stats"]["documents"] for e in stats if "documents" in e.get("stats", {})) == 6
    assert len(list((index / "logs" / "index_merge" / "completions").iterdir())) == 16
    assert not (index / "shards").exists() and not (index / "parts").exists()  # the build's work is gone
    assert (index / "index" / "index.json").is_file()


def test_another_sources_preset_decides_which_form_of_its_heldout_is_matched(tmp_path):
    """Source `docs` is web text the recipe curates with the `docs` preset (links unwrapped). The
    curate step of another source gets every source's preset from the recipe, so a training
    document of `mine` that copies the prose of a held-out page of `docs` full of links leaves
    train; with the domain's preset (`web`, no rewrite) only the page as written was indexed,
    whose links break most n-grams, and the copy stayed."""
    rng = random.Random(5)
    plain = " ".join(PARAGRAPHS[2:4])
    words = plain.split(" ")
    page = " ".join(f"[{w}](https://docs.example.org/ref/{k}.html)" if k % 4 == 0 else w for k, w in enumerate(words))
    other = corpus(tmp_path / "docs", [("x", random_text(rng))], heldout=[("page", page)], source="docs")
    art = corpus(tmp_path / "mine", [*((f"m{i}", random_text(rng)) for i in range(4)), ("copy", plain)], source="mine")
    me = SourceConfig(name="mine", uri="builtin:prose", domain="web")
    docs = SourceConfig(name="docs", uri="builtin:prose", domain="web")
    recipe = CurationConfig(presets={"mine": "none", "docs": "docs"}, minhash=False)
    config = recipe.for_source(me)
    assert config.presets == {"mine": "none"} and config.plan_summary() == "preset none"
    # the held-out index holds every source's preset: the recipe's, resolved
    assert HeldoutIndexSpec.of(recipe, [me, docs]).presets == {"mine": "none", "docs": "docs"}
    for name, presets, found in (("out", {"mine": "none", "docs": "docs"}, True), ("blind", {"mine": "none"}, False)):
        meta = curate_clean(config, art, [other], out=tmp_path / name, presets=presets)
        assert ("copy" not in _ids(tmp_path / name / "train")) is found, (name, meta["removed"])


def test_decontamination_judges_the_text_as_trained_after_a_preset_rewrites_it(tmp_path):
    """The `docs` preset keeps a document's prose: code dropped, links unwrapped. Copies that only
    show as trained must leave train (both cases were found in a tiny demo's workspace):

    - a fork's README (the held-out README's prose, other code) shares under a third of its
      n-grams as written; as trained it is the held-out README's prose exactly (paragraph
      breaks kept), an exact copy of the held-out document's curated form;
    - plain prose whose held-out original is full of links: the URLs break most n-grams of the
      held-out text as written; its form as curation keeps it (indexed too) is the same text;
    - a verbatim copy stays an exact match though the preset rewrote it.
    """

    def code(offset: int) -> str:
        return (
            "```python\n"
            + "\n".join(f"value_{i} = compute_{i}(x_{i}, y_{i})" for i in range(offset, offset + 150))
            + "\n```"
        )

    def linked(text: str) -> str:  # every fourth word a Markdown link
        words = text.split(" ")
        return " ".join(
            f"[{w}](https://docs.example.org/ref/{k}.html)" if k % 4 == 0 else w for k, w in enumerate(words)
        )

    prose = "\n\n".join(PARAGRAPHS[:2])
    market = (
        "The market opens early on Saturdays, and the farmers arrive before dawn. Most of them"
        " sell vegetables from their own fields and eggs from their hens. Visitors come from the"
        " nearby towns to buy fresh bread and cheese."
    )
    keep = (
        "The river rose after a week of rain and covered the lower meadow. Children watched the "
        "water from the bridge while their parents moved the sheep to higher ground. By evening the "
        "rain had stopped, and the swallows returned to hunt over the flooded grass. The farmer said "
        "the field would be green again within a month. Nobody in the valley remembered a wetter "
        "spring than this one."
    )
    held = [("readme-a", f"# Alpha\n\n{prose}\n\n{code(0)}\n"), ("guide-b", linked(f"{PARAGRAPHS[2]} {market}"))]
    fork = f"# Alpha2\n\n{prose}\n\n{code(1000)}\n"  # the same prose, other code
    plain = f"{PARAGRAPHS[2]} {market}"
    for h, t in ((held[0][1], fork), (held[1][1], plain)):
        grams = [set(word_ngrams(x, 8).tolist()) for x in (h, t)]
        assert len(grams[0] & grams[1]) / min(map(len, grams)) < 0.35  # as written: far below 0.5
    train = [("fork", fork), ("copy", held[0][1]), ("plain", plain), ("keep", keep)]
    art = corpus(tmp_path / "src", train, heldout=held, source="docs")
    out = tmp_path / "out"
    out.mkdir()
    meta = curate_clean(CurationConfig(presets={"docs": "docs"}, minhash=False), art, out=out)
    # `copy` is, as trained, the same text as `fork` (the held-out README's prose): exact dedup,
    # which runs before decontamination, removes it as `fork`'s duplicate, and decontamination
    # then removes `fork` (before, decontamination came first and removed both)
    assert meta["removed"] == {"exact_dedup:exact_dedup": 1, "heldout_decont:exact": 2}, meta["removed"]
    assert _ids(out / "train") == ["keep"]
    reasons = {}
    for line in gzip.open(out / "removed" / "heldout_decont" / "00000.jsonl.gz", "rt"):
        doc = json.loads(line)
        reasons[doc["id"]] = doc["metadata"]["filter_reason"]
    assert reasons == {"fork": "exact", "plain": "exact"}
    for line in gzip.open(out / "train" / "00000.jsonl.gz", "rt"):  # the working hash is gone
        assert "rewritten_from_hash" not in json.loads(line)["metadata"]


def test_heldout_split_is_curated_and_counted_apart(tmp_path):
    rng = random.Random(5)
    good = random_text(rng, 120)
    heldout = [("h1", good), ("h2", good), ("h3", "click here " * 200), ("h4", random_text(rng, 120))]
    art = corpus(tmp_path / "in", [(f"t{i}", random_text(rng, 120)) for i in range(4)], heldout=heldout)
    out = tmp_path / "out"
    out.mkdir()
    cfg = CurationConfig(
        minhash=False, exact_dedup=False, presets={"toy": "math"}, decontamination=DecontaminationConfig(enabled=False)
    )
    meta = curate(cfg, art, out=out, log=lambda _: None)
    assert sorted(_ids(out / "heldout")) == ["h1", "h3", "h4"]  # the copy of h1 goes
    assert meta["heldout_removed"] == {"exact_dedup:exact_dedup": 1} and meta["heldout_curated"]
    assert meta["heldout_documents"] == 3 and meta["heldout_input_documents"] == 4
    assert meta["removed"] == {} and meta["decontaminated_against"] == [] and meta["unaccounted"] == 0
    assert (out / "heldout_removed" / "exact_dedup").is_dir()


def test_filter_names_agree_in_stats_removed_folders_and_meta(tmp_path):
    built = {filter_name(f) for name in PRESETS for f in PRESETS.get(name).filters()}
    assert "fineweb_quality" in built and "fine_web_quality" not in built
    assert filter_name(DocumentationProseFilter()) == "documentation_prose"
    docs = [(f"p{i}", "\n".join(PARAGRAPHS[i:] + PARAGRAPHS[:i])) for i in range(3)]
    held = (
        "The harbour was quiet before dawn. Fishing boats rocked against the pier while the "
        "gulls waited on the posts, and the smell of salt and diesel hung over the water. When "
        "the first engine started, the whole village seemed to wake at once: lights came on in "
        "the bakery, a dog barked at the milk van, and the ferry sounded its horn for the island. "
        "The fishermen loaded their nets and checked the weather once more. An old man sat on a "
        "bench by the harbour wall and watched them leave. By the time the sun rose over the hills, "
        "the boats were far out at sea and the village had settled into its morning routine."
    )
    # junk in English (language ID keeps it, Gopher's repetition rules remove it) and noise
    docs += [("junk", "\n".join([PARAGRAPHS[0]] * 8)), ("noise", "click here " * 200)]
    docs += [("copy", docs[0][1]), ("heldcopy", held)]
    art = corpus(tmp_path / "in", docs, heldout=[("h", held)])
    out = tmp_path / "out"
    out.mkdir()
    meta = curate_clean(CurationConfig(minhash=False), art, out=out)
    rows = {r["filter"] for r in json.loads((out / "filter_stats.json").read_text())}
    folders = {p.name for p in (out / "removed").iterdir()}
    keys = {k.split(":")[0] for k in meta["removed"]}
    assert keys == folders and folders <= rows
    assert {"heldout_decont", "gopher_repetition", "language"} <= keys


def test_recipe_rejects_unknown_presets_and_sources():
    with pytest.raises(RecipeError, match="unknown preset 'fancy'"):
        load_recipe("tiny", ["curation.presets.prose=fancy"])
    with pytest.raises(RecipeError, match="unknown source 'poetry'"):
        load_recipe("tiny", ["curation.presets.poetry=web"])


def data_flow(overrides: list[str]) -> dict:
    """The data part of flows/smollm3.py (sources -> ... -> mixture plans), as its own flow."""
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.recipe import run_setup
    from flows.smollm3 import data
    from pipeline.graph import Graph
    from pipeline.runner import run_flow

    @flow(name="smollm3-data-test", task_runner=ThreadPoolTaskRunner(max_workers=32))
    def run() -> dict:
        cfg = load_recipe("tiny", overrides)
        g = Graph("smollm3-data-test")
        data(g, cfg)
        return run_flow("smollm3-data-test", g, run_setup(cfg, "tiny"))

    return run()


@pytest.mark.slow
def test_data_flow_through_prefect_in_a_worker_thread(tmp_path, prefect_harness):
    """The data steps inside a Prefect flow run from a non-main thread (as a served flow is), with
    two datatrove worker processes (forkserver) per stage: lineage rows and Prefect artifacts."""
    from prefect.client.orchestration import get_client

    from pipeline.lineage import Lineage
    from tests.conftest import SMALL

    ws = tmp_path / "ws"
    over = [
        *SMALL,
        f"workspace={ws}",
        "sources.prose.max_documents=200",
        "sources.math.documents_per_shard=100",
        "curation.tasks=2",
        "curation.workers=2",
        "tokenize.workers=2",  # (SMALL runs them in one process: tests/conftest.py SERIAL_DATA)
    ]
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(data_flow(over)))
    thread.start()
    thread.join(timeout=240)
    assert not thread.is_alive() and set(result["states"]) == {"completed"}
    assert result["dropped"]["curate[prose]"]["removed"]  # drop counts reach the run summary
    lineage = Lineage(ws / "lineage.duckdb")
    rows = lineage.query("SELECT source, filter, docs_in, docs_out FROM filter_stats ORDER BY source, position")
    assert {r[0] for r in rows} == {"prose", "code", "math"}
    math_curated = lineage.query("SELECT meta FROM artifacts WHERE step='curate' AND label='math'")
    assert json.loads(math_curated[0][0])["tasks"] == 2  # two shards: two datatrove tasks
    (stage1,) = lineage.query("SELECT meta FROM artifacts WHERE step='mixture' AND label='stage1'")
    plan = json.loads(Path(json.loads(stage1[0])["plan"]).read_text())
    assert plan["stage"] == "stage1" and {s["name"] for s in plan["sources"]} == {"prose", "code", "math"}

    import asyncio

    async def keys():
        async with get_client() as client:
            return {a.key for a in await client.read_artifacts()}

    found = asyncio.run(keys())
    assert {"curate-prose", "curate-code", "curate-math", "fertility", "fertility-decision"} <= found


def test_an_exact_copy_of_held_out_web_text_is_counted_exact(tmp_path):
    """C4's line filter used to join kept lines with one newline: every web document with
    paragraphs was rewritten, so a verbatim copy of held-out text no longer had its hash and
    counted as `overlap`. Paragraph breaks are kept now, and a document C4 does rewrite (a short
    line dropped) keeps the hash of its written text: both copies are `exact`."""
    held = "\n\n".join(PARAGRAPHS)
    with_menu = "\n\n".join([PARAGRAPHS[0], "Share this", *PARAGRAPHS[1:]])  # C4 drops "Share this"
    data = json.loads((Path(__file__).parent / "data" / "multilingual.json").read_text(encoding="utf-8"))
    other = next(d["text"] for d in data["documents"] if d["id"] == "en-good-1")  # unrelated prose
    train = [("copy", held), ("menucopy", with_menu), ("other", other)]
    art = corpus(tmp_path / "in", train, heldout=[("h1", held), ("h2", with_menu)])
    out = tmp_path / "out"
    out.mkdir()
    meta = curate_clean(CurationConfig(minhash=False, exact_dedup=False), art, out=out)
    assert meta["preset"] == "web"
    assert meta["removed"].get("heldout_decont:exact") == 2, meta["removed"]
    assert meta["heldout_documents"] == 1  # h2 is h1 once C4 dropped its short line: deduplicated
    (kept,) = [json.loads(line)["text"] for line in gzip.open(out / "heldout" / "00000.jsonl.gz", "rt")][:1]
    assert kept.count("\n\n") == len(PARAGRAPHS) - 1  # the curated held-out text keeps its paragraphs


def test_the_step_reports_the_held_out_index_every_task_loads_and_its_size_at_the_caps(tmp_path):
    rng = random.Random(3)
    held = [(f"h{i}", random_text(rng, 120)) for i in range(3)]
    art = corpus(tmp_path / "in", [(f"t{i}", random_text(rng, 120)) for i in range(4)], heldout=held)
    capped = art.model_copy(update={"meta": {**art.meta, "heldout_max_documents": 2000}})
    cfg = CurationConfig(minhash=False, exact_dedup=False, presets={"toy": "none"})
    for name, corpus_art, bound in (("open", art, None), ("capped", capped, 2000)):
        out = tmp_path / name
        out.mkdir()
        logs: list[str] = []
        meta = curate_clean(cfg, corpus_art, out=out, log=logs.append)
        index = meta["heldout_index"]
        assert index["documents"] == 3 and index["ngrams"] > 0 and index["bytes"] > 12 * index["ngrams"]
        assert index["documents_at_cap"] == bound
        line = next(ln for ln in logs if "held-out index: 3 documents of 1 sources" in ln)
        if bound is None:
            assert index["bytes_at_cap"] is None and "without curation.heldout.max_docs" in line
        else:
            assert index["bytes_at_cap"] == round(index["bytes"] / 3 * 2000)
            assert "at the sources' caps (2,000 documents)" in line


def test_a_decontaminate_task_that_dies_leaves_nothing_a_rerun_takes_as_finished(tmp_path):
    """Two curated shards, two decontamination tasks; the second shard's end cut off, so its task
    dies after writing part of its output. The step fails (no completion marker: the step
    function raised), the dead task has no datatrove completion; with the shard repaired the same
    step skips the finished task, redoes the dead one, and gives what an unbroken run gives."""
    rng = random.Random(13)
    other_held = [("o1", random_text(rng)), ("o2", random_text(rng))]
    other = corpus(tmp_path / "other", [("x", random_text(rng))], heldout=other_held, source="other")
    clean = [(f"m{i}", random_text(rng)) for i in range(40)]
    mine = [*clean[:20], ("copy", other_held[0][1]), *clean[20:], ("copy2", other_held[1][1])]
    art = corpus(tmp_path / "mine", mine, source="mine", shards=2)
    cfg = CurationConfig(presets={"mine": "none"}, minhash=False, tasks=2, workers=1)
    cur, idx, whole_out, out = (tmp_path / n for n in ("cur", "idx", "whole", "again"))
    curated = Artifact(
        kind="corpus", uri=str(cur), fingerprint="c" * 64, meta=curate(cfg, art, out=cur, log=lambda _: None)
    )
    spec = HeldoutIndexSpec(presets=cfg.presets, workers=1)
    imeta = heldout_index(spec, (art, other), out=idx, log=lambda _: None)
    index = Artifact(kind="heldout_index", uri=str(idx), fingerprint="d" * 64, meta=imeta)
    whole = decontaminate(DecontaminateSpec.of(cfg), curated, index, out=whole_out, log=lambda _: None)
    assert whole["removed"] == {"heldout_decont:exact": 2} and whole["documents"] == 40
    broken = cur / "train" / "00001.jsonl.gz"
    intact = broken.read_bytes()
    assert len(gzip.decompress(intact).splitlines()) > 5
    broken.write_bytes(intact[: len(intact) // 2])  # the reader dies part-way through the shard
    with pytest.raises(EOFError):
        decontaminate(DecontaminateSpec.of(cfg), curated, index, out=out, log=lambda _: None)
    done = out / "logs" / "decontaminate" / "completions"
    assert (done / "00000").is_file() and not (done / "00001").exists()
    assert not (out / "filter_stats.json").exists()  # nothing of a finished step
    first = (out / "train" / "00000.jsonl.gz").stat().st_mtime_ns

    broken.write_bytes(intact)
    again = decontaminate(DecontaminateSpec.of(cfg), curated, index, out=out, log=lambda _: None)
    assert (out / "train" / "00000.jsonl.gz").stat().st_mtime_ns == first  # skipped, not redone
    assert sorted(_ids(out / "train")) == sorted(_ids(whole_out / "train")) == sorted(i for i, _ in clean)
    for name in ("00000.jsonl.gz", "00001.jsonl.gz"):  # the redone shard: the same documents
        assert gzip.decompress((out / "train" / name).read_bytes()) == gzip.decompress(
            (whole_out / "train" / name).read_bytes()
        )
    assert again == {**whole, "seconds": again["seconds"]} and again["unaccounted"] == 0
