"""Tokenization throughput: our tokenize step against raw `tokenizers` encode_batch.

Builds the built-in `code` and `prose` corpora and a 4096-token BPE in a temporary folder, then
tokenizes the same documents twice and prints tokens/s of each and their ratio:

- step: the `tasks.tokenize.tokenize` step (datatrove DocumentTokenizer in a
  LocalPipelineExecutor: reading gzip JSONL with per-line accounting, batched encoding, EOS,
  writing `.ds` + `.ds.index`, seeded document shuffle);
- baseline: `Tokenizer.encode_batch` over the same texts, already in memory, batches of 1000.

    .venv/bin/python benchmarks/tokenize_step.py                 # one round
    .venv/bin/python benchmarks/tokenize_step.py --rounds 3

The ratio is step/baseline: the share of raw encoding speed the step keeps end to end.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

# Not named benchmarks/tokenize.py: a script's folder goes first on the import path, and a
# `tokenize.py` there shadows the standard library's for every script in benchmarks/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from curation.source_kinds import SourceConfig
    from pipeline.artifact import Artifact
    from tasks.sources import SourceSpec, source
    from tasks.tokenize import TokenizeConfig, TokenizeSpec, tokenize
    from tasks.tokenizer import TokenizerConfig, tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    quiet = lambda *a, **k: None  # noqa: E731

    root = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    corpora = []
    for name, uri, domain in (("code", "builtin:code", "code"), ("prose", "builtin:prose", "web")):
        out = root / "src" / name
        out.mkdir(parents=True)
        cfg = SourceConfig(name=name, uri=uri, domain=domain, held_out_fraction=0.0)
        meta = source(SourceSpec(source=cfg), out=out, log=quiet)
        corpora.append(Artifact(kind="corpus", uri=str(out), fingerprint=name.ljust(64, "0"), meta=meta))
    tok_dir = root / "tok"
    tok_dir.mkdir()
    tok_meta = tokenizer(TokenizerConfig(vocab_size=4096, sample_chars=2_000_000), corpora, out=tok_dir, log=quiet)
    tok_art = Artifact(kind="tokenizer", uri=str(tok_dir), fingerprint="t".ljust(64, "0"), meta=tok_meta)

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_meta["tokenizer_json"])
    texts = []
    for c in corpora:
        for path in sorted((c.path / "train").glob("*.jsonl.gz")):
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                texts += [json.loads(line)["text"] for line in fh]
    chars = sum(map(len, texts))
    print(f"{len(texts)} documents, {chars / 1e6:.1f}M characters, vocab {tok.get_vocab_size()}")

    def raw() -> tuple[int, float]:
        n, start = 0, time.perf_counter()
        for b in range(0, len(texts), 1000):
            n += sum(len(e.ids) + 1 for e in tok.encode_batch(texts[b : b + 1000]))  # +1: EOS
        return n, time.perf_counter() - start

    for r in range(args.rounds):
        # the baseline runs before and after the step so warm-up and machine noise hit both
        raw_tokens, raw_a = raw()
        step_tokens, start = 0, time.perf_counter()
        for i, c in enumerate(corpora):
            out = root / f"shards-{r}-{i}"
            out.mkdir()
            step_tokens += tokenize(
                TokenizeSpec(tokenize=TokenizeConfig()), tokenizer=tok_art, corpus=c, out=out, log=quiet
            )["tokens"]
        step_s = time.perf_counter() - start
        _, raw_b = raw()
        raw_s = (raw_a + raw_b) / 2
        assert raw_tokens == step_tokens, (raw_tokens, step_tokens)
        step_rate, raw_rate = step_tokens / step_s, raw_tokens / raw_s
        print(
            f"round {r + 1}: step {step_rate:,.0f} tokens/s ({step_s:.2f}s), "
            f"encode_batch {raw_rate:,.0f} tokens/s ({raw_a:.2f}s, {raw_b:.2f}s), "
            f"ratio step/encode_batch {step_rate / raw_rate:.2f} ({step_tokens:,} tokens)"
        )


if __name__ == "__main__":  # guarded: datatrove's executor may start processes that import this
    main()
