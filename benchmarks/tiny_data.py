"""The data a recipe trains on: curated characters and tokens per source, epochs per stage.

Runs the data steps' build functions (sources -> curation -> decontamination of each source
against the held-out index of every source's split -> tokenizer -> fertility -> token shards ->
mixture plans) in a
temporary folder, no Prefect, and prints per source what curation kept and per stage how often
each source repeats (preflight's data check warns above 1 epoch, mixtures above max_epochs):

    .venv/bin/python benchmarks/tiny_data.py                                # the tiny recipe
    .venv/bin/python benchmarks/tiny_data.py curation.presets.prose=web     # the web preset on prose

The baseline of the comparison is the second command (the preset tiny used before `docs`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from flows.recipe import load_recipe
    from pipeline.artifact import Artifact
    from tasks.curate import curate
    from tasks.decontaminate import DecontaminateSpec, decontaminate
    from tasks.fertility import FertilitySpec, fertility
    from tasks.heldout_index import HeldoutIndexSpec, heldout_index
    from tasks.mixture import MixtureSpec, mixture
    from tasks.sources import SourceSpec, source
    from tasks.tokenize import TokenizeSpec, tokenize
    from tasks.tokenizer import tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    parser.add_argument("--recipe", default="tiny")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, args.overrides)
    root = Path(tempfile.mkdtemp(prefix="bench-data-"))
    quiet = lambda *a, **k: None  # noqa: E731

    def art(kind: str, folder: Path, meta: dict) -> Artifact:
        return Artifact(kind=kind, uri=str(folder), fingerprint=folder.name.ljust(64, "0")[:64], meta=meta)

    def folder(name: str) -> Path:
        path = root / name
        path.mkdir(parents=True)
        return path

    start = time.perf_counter()
    corpora = {}
    for s in recipe.sources:
        out = folder(f"src-{s.name}")
        corpora[s.name] = art("corpus", out, source(SourceSpec(source=s, seed=recipe.seed), out=out, log=quiet))
    out = folder("index")
    index = heldout_index(
        HeldoutIndexSpec.of(recipe.curation, recipe.sources), list(corpora.values()), out=out, log=quiet
    )
    index = art("heldout_index", out, index)
    curated = {}
    for s in recipe.sources:
        out = folder(f"cur-{s.name}")
        cur = art("corpus", out, curate(recipe.curation.for_source(s), corpora[s.name], out=out, log=quiet))
        out = folder(f"decont-{s.name}")
        meta = decontaminate(DecontaminateSpec.of(recipe.curation), cur, index, out=out, log=quiet)
        curated[s.name] = art("corpus", out, meta)
    out = folder("tok")
    tok = art("tokenizer", out, tokenizer(recipe.tokenizer, list(curated.values()), out=out, log=quiet))
    out = folder("fert")
    fert = art(
        "fertility",
        out,
        fertility(
            FertilitySpec(fertility=recipe.fertility, weights=recipe.mixture_weights()),
            tok,
            list(curated.values()),
            out=out,
            log=quiet,
        ),
    )
    shards = []
    for name, c in curated.items():
        out = folder(f"shards-{name}")
        shards.append(
            art(
                "shards",
                out,
                tokenize(
                    TokenizeSpec(tokenize=recipe.tokenize, seed=recipe.seed),
                    tokenizer=fert,
                    corpus=c,
                    out=out,
                    log=quiet,
                ),
            )
        )
    print(
        f"recipe {recipe.name} {' '.join(args.overrides)}: data steps in {time.perf_counter() - start:.0f}s; "
        f"tokenizer vocab {tok.meta['vocab_size']} of {recipe.tokenizer.vocab_size} requested; "
        f"fertility on {fert.meta['text']}"
    )
    print(
        "\n| source | preset | documents in -> kept | characters kept | held-out kept | removed as held-out copies | tokens |"
    )
    print("|---|---|---|---|---|---|---|")
    for sh in shards:
        c = curated[sh.meta["source"]].meta
        decont = sum(v for k, v in c["removed"].items() if k.startswith("heldout_decont:"))
        print(
            f"| {c['source']} | {c['preset']} | {c['input_documents']} -> {c['documents']} | {c['characters']:,} | "
            f"{c['heldout_documents']} | {decont} | {sh.meta['tokens']:,} |"
        )
    print("\n| stage | source | weight | budget tokens | available tokens | epochs |")
    print("|---|---|---|---|---|---|")
    for st in recipe.stages:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            meta = mixture(MixtureSpec.of(st, recipe.seed), shards, out=folder(f"plan-{st.name}"), log=quiet)
        import json

        for s in json.loads(Path(meta["plan"]).read_text())["sources"]:
            flag = " (above max_epochs)" if s["expected_epochs"] > st.max_epochs else ""
            print(
                f"| {st.name} | {s['name']} | {s['weight']:.3f} | {s['budget_tokens']:,} | "
                f"{s['available_tokens']:,} | {s['expected_epochs']:.3f}{flag} |"
            )
    print(f"\noutputs in {root}")


if __name__ == "__main__":  # guarded: datatrove's executor may start processes that import this
    main()
