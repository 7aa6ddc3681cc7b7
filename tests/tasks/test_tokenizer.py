"""Tokenizer: BPE training with our special tokens, adoption of a given file, the chat template."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from curation.bpe import SPECIAL_TOKENS, train_bpe
from pipeline.artifact import Artifact
from tasks.tokenizer import TokenizerConfig, tokenizer
from tests.tasks.datafiles import corpus, random_text


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    rng = random.Random(0)
    docs = [(f"d{i}", random_text(rng, 150)) for i in range(30)]
    code = [(f"c{i}", f"def f{i}(x):\n    return x * {i} + 1\n") for i in range(30)]
    arts = [corpus(root / "prose", docs, source="prose"), corpus(root / "code", code, source="code")]
    out = root / "out"
    out.mkdir()
    meta = tokenizer(TokenizerConfig(vocab_size=512, min_frequency=1), arts, out=out)
    return out, meta


def test_trains_bpe_with_special_tokens_first(trained):
    out, meta = trained
    assert meta["origin"] == "trained" and meta["vocab_size"] == 512
    assert meta["special_tokens"] == {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    assert meta["eos_id"] == 0 and meta["sources"] == ["prose", "code"]
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    text = "Thé river — 北京 🙂 stone"  # byte-level: nothing is unknown
    assert tok.decode(tok(text)["input_ids"]) == text


def _assistant_runs(tok, messages, **kwargs) -> list[str]:
    """The decoded runs of tokens the assistant-token mask marks."""
    enc = tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
    )
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    assert len(ids) == len(mask)
    runs, current = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r) for r in runs]


def test_chat_template_marks_exactly_the_assistant_tokens(trained):
    out, _ = trained
    tok = AutoTokenizer.from_pretrained(str(out))
    messages = [
        {"role": "system", "content": "Be brief. /no_think"},
        {"role": "user", "content": "Name a river."},
        {"role": "assistant", "content": "The river stone garden."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Silver forest bridge."},
    ]
    # each assistant turn is one contiguous run: its content and the <|im_end|> that closes it; in
    # no-think mode the empty think block before it is part of the prompt, as at generation
    runs = _assistant_runs(tok, messages)
    assert runs == ["The river stone garden.<|im_end|>", "Silver forest bridge.<|im_end|>"]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text.startswith("<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\n")
    assert "Reasoning Mode: /no_think\n\n## Custom Instructions\n\nBe brief.\n\n<|im_end|>\n" in text
    assert "<|im_start|>assistant\n<think>\n\n</think>\nThe river stone garden.<|im_end|>\n" in text
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    # think mode: the worked trace is the assistant's, so it carries loss too
    think = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "<think>\n2 + 3 = 5\n</think>\n5"}]
    assert _assistant_runs(tok, think) == ["<think>\n2 + 3 = 5\n</think>\n5<|im_end|>"]


def test_adopts_an_existing_tokenizer_json_and_adds_missing_specials(tmp_path):
    base = train_bpe(iter(["hello world"] * 50), vocab_size=300)
    src = tmp_path / "given.json"
    from tokenizers import Tokenizer, models, pre_tokenizers

    plain = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    plain.save(str(src))
    out = tmp_path / "out"
    out.mkdir()
    meta = tokenizer(TokenizerConfig(path=str(src)), [], out=out)
    assert meta["origin"] == "given" and meta["vocab_size"] == 9  # 3 words, 4 specials, <think>, </think>
    assert set(meta["special_tokens"]) == set(SPECIAL_TOKENS)
    assert (out / "tokenizer.json").is_file() and base.get_vocab_size() <= 300
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        tokenizer(TokenizerConfig(path=str(tmp_path / "nope")), [], out=out)


def test_a_smaller_trained_vocabulary_warns_and_the_model_embedding_follows_it(tmp_path):
    """tokenizer meta -> tokenize meta -> mixture plan -> trainers/pretrain.py build_model_config."""
    from model.spec import TrainSpec
    from model.token_shards import MixturePlan
    from tasks.mixture import MixtureSpec, StageConfig, mixture
    from tasks.tokenize import TokenizeConfig, TokenizeSpec, tokenize
    from trainers.pretrain import build_model_config

    rng = random.Random(4)
    art = corpus(tmp_path / "c", [(f"d{i}", random_text(rng, 60)) for i in range(20)], source="toy")
    out = tmp_path / "tok"
    out.mkdir()
    logs: list[str] = []
    meta = tokenizer(TokenizerConfig(vocab_size=4096), [art], out=out, log=logs.append)
    real = meta["vocab_size"]
    assert real < 4096 and meta["requested_vocab_size"] == 4096
    assert len(meta["warnings"]) == 1 and f"has {real} entries, 4096 requested" in meta["warnings"][0]
    assert f"WARNING {meta['warnings'][0]}" in logs
    tok = Artifact(kind="tokenizer", uri=str(out), fingerprint="1" * 64, meta=meta)
    (tmp_path / "shards").mkdir()
    smeta = tokenize(
        TokenizeSpec(tokenize=TokenizeConfig()), tokenizer=tok, corpus=art, out=tmp_path / "shards", log=lambda _: None
    )
    shards = Artifact(kind="shards", uri=str(tmp_path / "shards"), fingerprint="2" * 64, meta=smeta)
    (tmp_path / "mix.yaml").write_text("weights: {toy: 1.0}\n")
    (tmp_path / "plan").mkdir()
    stage = StageConfig(name="s1", mixture=str(tmp_path / "mix.yaml"), tokens=1000, seq_len=16)
    plan = mixture(MixtureSpec.of(stage, 0), [shards], out=tmp_path / "plan", log=lambda _: None)
    loaded = MixturePlan.load(plan["plan"])
    spec = TrainSpec(mixture_plan=plan["plan"], out_dir=str(tmp_path / "run"), steps=1, global_batch=1, micro_batch=1)
    assert smeta["vocab_size"] == loaded.vocab_size == build_model_config(spec, loaded, 16).vocab_size == real


def test_a_full_vocabulary_does_not_warn(trained):
    _, meta = trained
    assert meta["vocab_size"] == meta["requested_vocab_size"] == 512 and meta["warnings"] == []


def test_training_runs_as_one_datatrove_task_and_trains_what_the_sample_trains(trained, tmp_path):
    """The step trains in a one-task datatrove stage (its completion and stats in `logs/train`):
    the same tokenizer as training on the streamed sample directly; a Slurm executor without its
    section is refused naming `tokenizer.slurm`."""
    from curation.bpe import sample_texts, save_hf_tokenizer
    from curation.stages import read_stage_stats
    from tests.tasks.datafiles import corpus

    out, meta = trained
    assert (out / "logs" / "train" / "completions" / "00000").is_file()
    (stats,) = read_stage_stats(out / "logs", "train")
    assert stats["stats"]["sample_chars"]["total"] == meta["sample_chars"]
    root = out.parent
    arts = [
        Artifact(kind="corpus", uri=str(root / name), fingerprint=str(i) * 64, meta={"source": name})
        for i, name in enumerate(("prose", "code"), 1)
    ]
    direct = tmp_path / "direct"
    save_hf_tokenizer(train_bpe(sample_texts(arts, 4_000_000), 512, 1), direct)
    assert (direct / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    src = corpus(tmp_path / "src", [("d0", "some text to learn from")])
    with pytest.raises(ValueError, match=r"tokenizer.executor is slurm but tokenizer.slurm is not set"):
        tokenizer(TokenizerConfig(vocab_size=300, executor="slurm"), [src], out=tmp_path / "slurm")
