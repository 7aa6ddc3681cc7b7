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

from curation.bpe import NO_THINK_PERSONA, THINK_PERSONA
from curation.conversations import math_conversation
from curation.reasoning import builtin_traces
from evals.benchmarks.arithmetic_exact import ArithmeticExactThink
from model.config import ModelConfig
from model.hf import export_hf
from model.model import SmolLM3
from tasks.evaluate import EvalConfig, SuiteSpec
from tasks.tokenizer import TokenizerConfig, tokenizer
from tests.tasks.datafiles import corpus, random_text
from trainers.posttrain.sections import ReasoningModesConfig

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


def _training_rows(question: str, solution: str, answer: str, modes: ReasoningModesConfig) -> dict[str, list]:
    """The rows of each mode the model trains on for one question: the SFT conversation of
    posttrain_data (curation/conversations.py) and, in think mode, the reasoning trace of
    reasoning_data (curation/reasoning.py builds its traces the same way)."""
    text = f"Problem: {question}\nSolution: {solution}\nAnswer: {answer}"
    return {
        "no_think": [math_conversation(text, modes)["messages"]],
        "think": [math_conversation(text, modes, think=True)["messages"]]
        + [t["messages"] for t in builtin_traces(40, 0, modes) if t["messages"][1]["content"] == question],
    }


@pytest.mark.parametrize("own", [False, True], ids=["default modes", "the recipe's own modes"])
def test_the_eval_prompts_are_the_training_rows_prompt_prefix_in_each_mode(exported, own):
    """The eval's think / no-think prompt for a question is exactly what the exported tokenizer
    renders before the assistant's reply in the SFT row (and the reasoning trace) of that mode for
    that question: the same system turn (the recipe's `reasoning_modes`, its defaults or its own)
    through the same chat template; the row goes on with the reply and the end of the turn."""
    tok = AutoTokenizer.from_pretrained(str(exported))
    modes = (
        ReasoningModesConfig(think_system="Work it out. /think", no_think_system="Be direct. /no_think")
        if own
        else ReasoningModesConfig()
    )
    spec = SuiteSpec(eval=EvalConfig(), generation_items=1, think_gen_tokens=8, modes=modes)
    first = builtin_traces(1, 0, modes)[0]["messages"]  # a question the reasoning traces hold too
    question, trace = first[1]["content"], first[2]["content"]
    solution = "; ".join(line for line in trace.splitlines() if " = " in line and not line.startswith("Check"))
    answer = trace.rsplit("Answer: ", 1)[1]
    for mode, rows in _training_rows(question, solution, answer, modes).items():
        prompt = spec.chat_prompt(question, think=mode == "think")
        assert len(rows) == (2 if mode == "think" else 1)
        for messages in rows:
            row = tok.apply_chat_template(messages, tokenize=False)
            assert row == prompt + messages[2]["content"] + "<|im_end|>\n"
            assert f"Reasoning Mode: /{mode}\n" in prompt
            # the custom instructions are the mode's system turn without its flag, never the default persona
            instructions = modes.system(mode).replace(f"/{mode}", "").rstrip()
            assert f"## Custom Instructions\n\n{instructions or NO_THINK_PERSONA}\n\n<|im_end|>" in prompt
            assert THINK_PERSONA not in prompt
    # the same for the items the suite writes
    items = ArithmeticExactThink().build(
        {"math": [f"Problem: {question}\nSolution: x = 1.\nAnswer: {answer}"]}, spec, random.Random(0)
    )
    assert items["arithmetic_exact_think"][0]["prompt"] == spec.chat_prompt(question, think=True)


def test_the_published_no_system_rendering_is_kept(exported):
    """Without a system turn the template still renders SmolLM3's default instructions per mode
    (the think persona for /think): the reasoning modes only set the system turn of our own rows."""
    tok = AutoTokenizer.from_pretrained(str(exported))
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    think = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    plain = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert f"## Custom Instructions\n\n{THINK_PERSONA}\n\n<|im_end|>" in think and think.endswith("assistant\n")
    assert f"## Custom Instructions\n\n{NO_THINK_PERSONA}\n\n<|im_end|>" in plain
    assert plain == SuiteSpec(eval=EvalConfig()).chat_prompt("What is 2 + 2?", think=False)  # /no_think: the same
