"""Tokenization: `.ds` shards with EOS after every document, the token type rule, bad input counted."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from curation.bpe import token_dtype
from pipeline.artifact import Artifact
from tasks.tokenize import TokenizeConfig, TokenizeSpec, tokenize
from tasks.tokenizer import TokenizerConfig, tokenizer
from tests.tasks.datafiles import corpus, doc_line, random_text


def _tokenizer_artifact(tmp_path, texts) -> Artifact:
    out = tmp_path / "tok"
    out.mkdir()
    src = corpus(tmp_path / "tokdata", [(f"t{i}", t) for i, t in enumerate(texts)])
    meta = tokenizer(TokenizerConfig(vocab_size=400, min_frequency=1), [src], out=out)
    return Artifact(kind="tokenizer", uri=str(out), fingerprint="2" * 64, meta=meta)


def test_shards_hold_every_document_followed_by_eos(tmp_path):
    rng = random.Random(0)
    texts = [random_text(rng, rng.randint(5, 80)) for _ in range(25)]
    tok_art = _tokenizer_artifact(tmp_path, texts)
    bad = [b'{"id": "x", "text": "unterminated', b'{"id": "y", "body": "no text"}']
    lines = [doc_line(f"d{i}", t) for i, t in enumerate(texts)]
    art = corpus(tmp_path / "curated", lines[:10] + bad + lines[10:], source="dclm/dclm")
    out = tmp_path / "out"
    out.mkdir()
    meta = tokenize(TokenizeSpec(tokenize=TokenizeConfig(), seed=3), tokenizer=tok_art, corpus=art, out=out)

    assert meta["token_dtype"] == "uint16" and meta["eos_id"] == 0 and meta["documents"] == 25
    assert meta["rejected"] == {"malformed_json": 1, "missing_text_field": 1}
    assert meta["input_documents"] == 27 and meta["unaccounted"] == 0
    assert meta["files"] and all(f.startswith("dclm_dclm") and f.endswith(".ds") for f in meta["files"])
    tok = Tokenizer.from_file(tok_art.meta["tokenizer_json"])
    decoded = []
    total = 0
    for name in meta["files"]:
        tokens = np.fromfile(out / name, dtype=np.uint16)
        ends = np.fromfile(out / (name + ".index"), dtype=np.uint64)
        assert (out / (name + ".metadata")).is_file()
        assert ends[-1] == len(tokens) and (tokens[ends.astype(np.int64) - 1] == 0).all()
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        for s, e in zip(starts, ends.astype(np.int64), strict=True):
            decoded.append(tok.decode(tokens[s : e - 1].tolist()))
        total += len(tokens)
    assert sorted(decoded) == sorted(texts)  # every document, intact, each closed by one EOS
    assert meta["tokens"] == total


def test_token_type_follows_vocabulary_size_as_datatrove_decides(tmp_path):
    from datatrove.pipeline.tokens import DocumentTokenizer

    assert token_dtype(4096) == "uint16" and token_dtype(65536) == "uint16"
    assert token_dtype(65537) == "uint32" and token_dtype(128256) == "uint32"
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    big = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "big.json"
    big.save(str(path))
    assert DocumentTokenizer(str(tmp_path), tokenizer_name_or_path=str(path)).token_size == 4
    selected = {"name": "big", "path": str(path), "vocab_size": 70_002, "eos_token": "<|endoftext|>", "eos_id": 0}
    fert = Artifact(kind="fertility", uri=str(tmp_path), fingerprint="3" * 64, meta={"selected": selected})
    art = corpus(tmp_path / "c", [("a", "w1 w69999 w5"), ("b", "w68000")])
    out = tmp_path / "out"
    out.mkdir()
    meta = tokenize(TokenizeSpec(tokenize=TokenizeConfig(shuffle_documents=False)), tokenizer=fert, corpus=art, out=out)
    assert meta["token_dtype"] == "uint32" and meta["tokens"] == 6
    tokens = np.fromfile(out / meta["files"][0], dtype=np.uint32)
    assert tokens.tolist() == [3, 70001, 7, 0, 68002, 0]


def test_tokenization_can_run_on_datatrove_slurm_or_ray_executors(tmp_path):
    """The recipe's tokenize section selects datatrove's executor like curation does."""
    from datatrove.executor import LocalPipelineExecutor, SlurmPipelineExecutor

    from curation.executors import SlurmExecutorConfig, make_executors
    from curation.ray_stage import RayStage
    from tasks.tokenize import TokenizeConfig

    stages = [("tokenize", [], 4)]
    local = make_executors(TokenizeConfig(), stages, tmp_path / "a")
    slurm = make_executors(
        TokenizeConfig(executor="slurm", slurm=SlurmExecutorConfig(partition="cpu")), stages, tmp_path / "b"
    )
    ray = make_executors(TokenizeConfig(executor="ray"), stages, tmp_path / "c")
    assert [type(e[0]) for e in (local, slurm, ray)] == [
        LocalPipelineExecutor,
        SlurmPipelineExecutor,
        RayStage,  # datatrove's RayPipelineExecutor with our run loop
    ]
    assert slurm[0].partition == "cpu" and slurm[0].tasks == 4
    with pytest.raises(ValueError, match="tokenize.executor is slurm but tokenize.slurm is not set"):
        make_executors(TokenizeConfig(executor="slurm"), stages, tmp_path / "d")


def test_token_shards_are_the_same_whatever_the_worker_count(tmp_path):
    """tokenize.workers is operational: 4 tasks run 1 or 2 at a time write the same bytes."""
    rng = random.Random(1)
    texts = [random_text(rng, rng.randint(5, 60)) for _ in range(40)]
    tok_art = _tokenizer_artifact(tmp_path, texts)
    art = corpus(tmp_path / "curated", [(f"d{i}", t) for i, t in enumerate(texts)], source="s", shards=4)
    written = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        out.mkdir()
        meta = tokenize(TokenizeSpec(tokenize=TokenizeConfig(tasks=4, workers=workers), seed=5), tok_art, art, out=out)
        assert len(meta["files"]) == 4
        written.append({f: (out / f).read_bytes() + (out / (f + ".index")).read_bytes() for f in meta["files"]})
    assert written[0] == written[1]
