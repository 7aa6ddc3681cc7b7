"""Before compute: a dry run needs no data, and a preset that would curate a readable source away
is refused by `smollm3 recipe`/`plan` naming the source, the preset and the filter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flows.cli import main
from flows.recipe import RecipeError, check_data, load_recipe

DATA = json.loads((Path(__file__).parents[1] / "tasks" / "data" / "multilingual.json").read_text(encoding="utf-8"))


def french_files(tmp_path: Path) -> Path:
    """Real French paragraphs as a JSONL source (each paragraph of the test data a document)."""
    path = tmp_path / "fr.jsonl"
    docs = [d for d in DATA["documents"] if d["source_language"] == "fr" and d["kind"] == "good"]
    with path.open("w", encoding="utf-8") as fh:
        for i in range(10):
            d = docs[i % len(docs)]
            fh.write(
                json.dumps({"text": d["text"] + f"\n\nPage {i}.", "id": f"{d['id']}-{i}"}, ensure_ascii=False) + "\n"
            )
    return path


def recipe_with(tmp_path: Path, language: str) -> list[str]:
    path = french_files(tmp_path)
    recipe = tmp_path / "fr.yaml"
    recipe.write_text(
        "name: fr\nworkspace: " + str(tmp_path / "ws") + "\nsources:\n"
        f"  - {{name: fr, uri: 'files:{path}', domain: web, language: {language}}}\n"
    )
    return [str(recipe)]


def test_a_preset_that_would_empty_a_source_is_refused_naming_it(tmp_path, capsys):
    argv = recipe_with(tmp_path, "en")
    assert main(["recipe", *argv]) == 2
    err = capsys.readouterr().err
    assert "sources[fr]: preset 'web' keeps 0 of its first" in err
    assert "language:wrong_language" in err and "curation.min_kept_share 0.2" in err
    with pytest.raises(RecipeError, match="preset 'web' keeps 0"):
        check_data(load_recipe(argv[0]))
    # lowering the floor is the user's call: the check then passes
    check_data(load_recipe(argv[0], ["curation.min_kept_share=0"]))


@pytest.mark.slow
def test_the_language_preset_passes_and_the_check_is_cached(tmp_path, capsys):
    argv = recipe_with(tmp_path, "fr")
    assert main(["recipe", *argv]) == 0  # a check alone creates no workspace: cached in the user's cache
    assert "language: fr" in capsys.readouterr().out
    assert not (tmp_path / "ws").exists()
    assert list((Path(os.environ["SMOLLM3_CACHE"]) / "preset-checks").glob("*.json"))
    (tmp_path / "ws").mkdir()  # a workspace a run made
    assert main(["recipe", *argv]) == 0
    capsys.readouterr()
    cached = list((tmp_path / "ws" / "checks" / "presets").glob("*.json"))
    assert len(cached) == 1
    result = json.loads(cached[0].read_text())
    assert result["preset"] == "web-fr" and result["kept"] == result["documents"] == 10
    assert main(["plan", *argv]) == 0
    assert "curate[fr]" in capsys.readouterr().out


def test_the_published_recipe_plans_without_its_corpora(tmp_path, capsys):
    """`plan` refuses a glob matching nothing as `run` does, naming it; `--allow-missing` plans
    such sources as unresolved (the laptop that plans a run whose data lives on the cluster)."""
    assert main(["plan", "smollm3-3b", f"workspace={tmp_path / 'ws'}"]) == 2
    err = capsys.readouterr().err
    assert "sources[stackexchange].uri: no files match 'data/smollm3/stackexchange/*.jsonl.gz'" in err
    assert "--allow-missing" in err
    assert main(["plan", "smollm3-3b", f"workspace={tmp_path / 'ws'}", "--allow-missing"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("source[", "curate[", "pretrain["))}
    assert "input not available here: sources[stackexchange].uri: no files match" in rows["source[stackexchange]"]
    assert {f"pretrain[{s}]" for s in ("stage1", "stage2", "stage3", "long32k", "long64k")} <= set(rows)
    languages = {"fra": "fr", "spa": "es", "deu": "de", "cmn": "zh", "jpn": "ja", "rus": "ru", "hin": "hi", "tha": "th"}
    for subset, code in languages.items():
        assert rows[f"curate[fw2-{subset}]"].endswith(f"[preset web-{code}]")
    assert rows["curate[fineweb-edu/fineweb-edu]"].endswith("[preset web]")
    assert "8 source(s) not on this machine, planned as unresolved (--allow-missing):" in out
    assert "  stackexchange: sources[stackexchange].uri: no files match" in out
    assert main(["recipe", "smollm3-3b"]) == 2  # validation still names what is missing


def test_checking_and_planning_write_nothing_anywhere(tmp_path, monkeypatch, capsys):
    """`recipe` and `plan` only read: run from an empty folder with an empty $SMOLLM3_HOME, they
    create no file there nor in the home (the preset checks are cached in a workspace a run made,
    else in $SMOLLM3_CACHE)."""
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("SMOLLM3_HOME", str(home))
    assert main(["recipe", "tiny"]) == 0
    assert main(["plan", "tiny"]) == 0
    assert main(["plan", "smollm3-3b", "--allow-missing"]) == 0
    capsys.readouterr()
    assert list(cwd.iterdir()) == [] and list(home.iterdir()) == []


def test_the_check_before_compute_passes_every_language_on_its_natural_paragraphs(tmp_path):
    """The sample check `recipe` and `plan` run (flows/datacheck.py) on each language's real
    paragraphs, as a `files:` source with its language: every preset keeps all of them, so a
    recipe naming any of the table's languages is not refused for its natural text."""
    from curation.languages import LANGUAGES
    from curation.source_kinds import SourceConfig
    from flows.datacheck import sample_source
    from tasks.curate import CurationConfig

    for code in sorted(LANGUAGES):
        docs = [d for d in DATA["documents"] if d["source_language"] == code and d["kind"].startswith("good")]
        path = tmp_path / f"{code}.jsonl"
        path.write_text(
            "".join(json.dumps({"text": d["text"], "id": d["id"]}, ensure_ascii=False) + "\n" for d in docs)
        )
        source = SourceConfig(name=code, uri=f"files:{path}", domain="web", language=code)
        result = sample_source(CurationConfig(), source, 0)
        assert (result.documents, result.kept) == (len(docs), len(docs)), (code, result.removed)
