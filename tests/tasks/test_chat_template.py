"""The exported tokenizer's chat template renders what SmolLM3's published template renders.

The fixtures (tests/tasks/data/smollm3_chat_template.json: messages, template arguments and the
expected string per case) were made once by a throwaway script, not kept in the repository, that
rendered the published template with jinja2 under transformers' chat-template settings
(`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`, plus the loopcontrols
extension) and checked the strings against transformers' own `apply_chat_template(...,
chat_template=published)`. The published template is the copy llama.cpp keeps of SmolLM3's:
repository Raudbjorn/ggml-llama.cpp, path models/templates/HuggingFaceTB-SmolLM3-3B.jinja, commit
733850e4c5231e9e414820769f12a720cbf74a12 (a Git LFS pointer there, sha256 19eacf64...ca97, whose
content is the file on that repository's later commits); the model card is
https://huggingface.co/HuggingFaceTB/SmolLM3-3B. That copy renders no "Today Date" line (the Hub
template's `strftime_now` date), so the fixtures need no fixed date, and it renders no tool
descriptions: `xml_tools` and `python_tools` leave the string unchanged and a `tool` turn renders as
a user turn, in the published copy and in ours.

The cases cover both modes with and without a system turn, the `/think` and `/no_think` flags
(which override `enable_thinking`), `enable_thinking`, multi-turn conversations, tools and the
generation prompt. Each is rendered by `AutoTokenizer.from_pretrained(exported folder)` and
compared byte for byte. The exported model stops generating at `<|im_end|>` in both modes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from evals.benchmarks.arithmetic_exact import CHAT_PROMPT, THINK_PROMPT
from model.config import ModelConfig
from model.hf import export_hf
from model.model import SmolLM3
from tasks.tokenizer import TokenizerConfig, tokenizer
from tests.tasks.datafiles import corpus, random_text

FIXTURES = json.loads((Path(__file__).parent / "data" / "smollm3_chat_template.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A random 2-layer SmolLM3 exported with a tokenizer the tokenizer step trained."""
    root = tmp_path_factory.mktemp("chat")
    rng = random.Random(0)
    docs = [(f"d{i}", random_text(rng, 120)) for i in range(20)]
    art = corpus(root / "prose", docs, source="prose")
    (root / "tok").mkdir()
    meta = tokenizer(TokenizerConfig(vocab_size=400, min_frequency=1), [art], out=root / "tok")
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(meta["vocab_size"], hidden_size=64, intermediate_size=128, num_layers=2)
    return export_hf(SmolLM3(cfg).eval(), root / "hf", tokenizer_dir=root / "tok", eos_token_id=meta["eos_id"])


def test_fixtures_cover_every_case_the_template_must_render():
    kwargs = [case["kwargs"] for case in FIXTURES]
    systems = [case["messages"][0]["content"] for case in FIXTURES if case["messages"][0]["role"] == "system"]
    assert any(k.get("enable_thinking") is False for k in kwargs) and any("enable_thinking" not in k for k in kwargs)
    assert any("/think" in s and "/no_think" not in s for s in systems) and any("/no_think" in s for s in systems)
    assert any(case["messages"][0]["role"] != "system" for case in FIXTURES)
    assert any("xml_tools" in k for k in kwargs) and any("python_tools" in k for k in kwargs)
    assert {case["add_generation_prompt"] for case in FIXTURES} == {True, False}
    assert any("Reasoning Mode: /no_think" in c["expected"] for c in FIXTURES)
    assert any("Reasoning Mode: /think" in c["expected"] for c in FIXTURES)


@pytest.mark.parametrize("case", FIXTURES, ids=[case["name"] for case in FIXTURES])
def test_exported_template_renders_the_published_strings(exported, case):
    tok = AutoTokenizer.from_pretrained(str(exported))
    text = tok.apply_chat_template(
        case["messages"], tokenize=False, add_generation_prompt=case["add_generation_prompt"], **case["kwargs"]
    )
    assert text == case["expected"]


def test_think_tokens_are_single_ids_kept_when_decoding(exported):
    tok = AutoTokenizer.from_pretrained(str(exported))
    ids = tok("<think>\nx\n</think>\nAnswer: 4")["input_ids"]
    assert tok.convert_tokens_to_ids("<think>") in ids and tok.convert_tokens_to_ids("</think>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nx\n</think>\nAnswer: 4"


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_generation_stops_at_the_end_of_turn_in_both_modes(exported, enable_thinking):
    """Only `<|im_end|>` may be sampled: the exported generation config ends the reply there."""
    tok = AutoTokenizer.from_pretrained(str(exported))
    model = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == [end, tok.eos_token_id]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "2 + 2?"}],
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
        return_dict=True,
    )["input_ids"]
    others = [i for i in range(len(tok)) if i != end]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, suppress_tokens=others)
    assert out[0].tolist() == [*prompt, end]


def test_the_arithmetic_eval_prompt_is_the_no_think_rendering(exported):
    """The generation task writes the template's prompt into its task file: the same string."""
    tok = AutoTokenizer.from_pretrained(str(exported))
    question = [{"role": "user", "content": "{{problem}}"}]
    flagged = tok.apply_chat_template(
        [{"role": "system", "content": "/no_think"}, *question], tokenize=False, add_generation_prompt=True
    )
    switched = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert flagged == switched == CHAT_PROMPT


def test_the_think_mode_arithmetic_prompt_is_the_think_rendering(exported):
    """The think-mode twin writes the template's `/think` prompt: the assistant turn left open for
    the model's own <think> block."""
    tok = AutoTokenizer.from_pretrained(str(exported))
    question = [{"role": "user", "content": "{{problem}}"}]
    flagged = tok.apply_chat_template(
        [{"role": "system", "content": "/think"}, *question], tokenize=False, add_generation_prompt=True
    )
    switched = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert flagged == switched == THINK_PROMPT
    assert THINK_PROMPT.endswith("<|im_start|>assistant\n") and "Reasoning Mode: /think\n" in THINK_PROMPT
