"""Byte-level BPE tokenizers as files: train one on text, adopt a given tokenizer.json, save a
Hugging Face folder with our special tokens and dual-mode chat template; which tokenizer an upstream
step chose; the `.ds` token type of a vocabulary.

The tokenizer step (tasks/tokenizer.py) trains and saves; fertility (tasks/fertility.py) compares
candidates; tokenize, export, held-out loss and preflight read `selected_tokenizer` of the
fertility decision or tokenizer artifact they are given. Artifacts are read through their
`path`, `kind` and `meta` only.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"
IM_END = "<|im_end|>"  # the end of a chat turn: generation stops here (and at EOS)
THINK_TOKENS = ("<think>", "</think>")  # one id each; decoded as text, so a reply keeps its trace
# Ids reserved in this order by BPE training (EOS first: id 0); save_hf_tokenizer re-marks the
# think tokens as ordinary added tokens (never split, not skipped when decoding).
SPECIAL_TOKENS = (EOS, "<|im_start|>", IM_END, "<|pad|>", *THINK_TOKENS)

# SmolLM3's default custom instructions, per reasoning mode (used when the system turn has none).
THINK_PERSONA = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Your role as an assistant "
    "involves thoroughly exploring questions through a systematic thinking process before providing "
    "the final precise and accurate solutions. This requires engaging in a comprehensive cycle of "
    "analysis, summarizing, exploration, reassessment, reflection, backtracking, and iteration to "
    "develop well-considered thinking process. Please structure your response into two main sections: "
    "Thought and Solution using the specified format: <think> Thought section </think> Solution "
    "section. In the Thought section, detail your reasoning process in steps. Each step should include "
    "detailed considerations such as analysing questions, summarizing relevant findings, brainstorming "
    "new ideas, verifying the accuracy of the current steps, refining any errors, and revisiting "
    "previous steps. In the Solution section, based on various attempts, explorations, and reflections "
    "from the Thought section, systematically present the final solution that you deem correct. The "
    "Solution section should be logical, accurate, and concise and detail necessary steps needed to "
    "reach the conclusion."
)
NO_THINK_PERSONA = "You are a helpful AI assistant named SmolLM, trained by Hugging Face."

# SmolLM3's dual-mode ChatML (renders what its published template renders, see
# docs/posttraining.md and tests/tasks/test_chat_template.py). The mode is /think unless
# `enable_thinking` is false; a `/think` or `/no_think` in the system turn overrides it (and is
# removed from the instructions). In /no_think mode every assistant turn, and the generation
# prompt, opens with an empty think block. Tool turns render as user turns; `xml_tools` and
# `python_tools` add nothing (as in the published copy). The assistant's content and its
# <|im_end|> sit inside {% generation %}: the tokens the assistant-only loss trains on.
CHAT_TEMPLATE = (
    "{%- set mode = '/think' if enable_thinking is not defined or enable_thinking else '/no_think' -%}"
    "{%- set custom = '' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set flags = messages[0]['content'] -%}"
    "{%- if '/no_think' in flags %}{% set mode = '/no_think' %}"
    "{%- elif '/think' in flags %}{% set mode = '/think' %}{% endif -%}"
    "{%- set custom = flags.replace('/no_think', '').replace('/think', '').rstrip() -%}"
    "{%- endif -%}"
    "{%- set persona = '" + THINK_PERSONA + "' if mode == '/think' else '" + NO_THINK_PERSONA + "' -%}"
    "{{- '<|im_start|>system\\n## Metadata\\n\\nKnowledge Cutoff Date: June 2025\\n' -}}"
    "{{- 'Reasoning Mode: ' + mode + '\\n\\n## Custom Instructions\\n\\n' -}}"
    "{{- (custom or persona) + '\\n\\n<|im_end|>\\n' -}}"
    "{%- set opening = '<|im_start|>assistant\\n' + ('' if mode == '/think' else '<think>\\n\\n</think>\\n') -%}"
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is string else '' -%}"
    "{%- if message['role'] in ('user', 'tool') -%}"
    "{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- opening -}}"
    "{% generation %}{{- content.lstrip('\\n') + '<|im_end|>' -}}{% endgeneration %}"
    "{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{- opening -}}{% endif -%}"
)


def render_chat(messages: Sequence[dict[str, str]], add_generation_prompt: bool = False, **kwargs: Any) -> str:
    """`messages` rendered by `CHAT_TEMPLATE` as transformers' `apply_chat_template(...,
    tokenize=False)` of an exported folder renders them (same Jinja renderer, same template), for
    places with no tokenizer folder at hand (the eval suite's prompts)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        [list(messages)], chat_template=CHAT_TEMPLATE, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return rendered[0]


def sample_texts(corpora: Sequence[Any], budget: int) -> Iterator[str]:
    """Texts of the curated corpora's train shards, an equal character budget per source."""
    share = max(1, budget // max(len(corpora), 1))
    for corpus in corpora:
        used = 0
        for path in sorted((corpus.path / "train").glob("*.jsonl.gz")):
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                for line in fh:
                    text = json.loads(line)["text"]
                    yield text[: share - used]
                    used += min(len(text), share - used)
                    if used >= share:
                        break
            if used >= share:
                break


def train_bpe(texts: Iterator[str], vocab_size: int, min_frequency: int = 2):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts` with our special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer_file(path: str | Path):
    """A `tokenizers.Tokenizer` from a tokenizer.json or a folder holding one."""
    from tokenizers import Tokenizer

    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(
            f"tokenizer {path!r}: no tokenizer.json there; give a tokenizer.json file or a "
            "Hugging Face tokenizer folder"
        )
    return Tokenizer.from_file(str(p))


def save_hf_tokenizer(tok, out: Path) -> dict[str, Any]:
    """Save as a Hugging Face folder with the chat template; return the facts for the meta."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    missing = [t for t in SPECIAL_TOKENS if t not in THINK_TOKENS and tok.token_to_id(t) is None]
    if missing:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    # Never split, but not skipped when decoding: a generated reply keeps its <think> block.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", IM_END],
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out))
    return {
        "vocab_size": tok.get_vocab_size(),
        "eos_token": EOS,
        "eos_id": tok.token_to_id(EOS),
        "pad_id": tok.token_to_id("<|pad|>"),
        "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
        "tokenizer_json": str(out / "tokenizer.json"),
    }


def token_dtype(vocab_size: int) -> str:
    """The `.ds` token type for a vocabulary: datatrove's rule (uint16 up to 65,536 entries)."""
    import numpy as np  # here, not at module level: the recipe imports this module's config

    return "uint32" if vocab_size > np.iinfo(np.uint16).max + 1 else "uint16"


def selected_tokenizer(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer to use: the fertility decision, or a tokenizer artifact given directly."""
    if tokenizer.kind == "fertility":
        return dict(tokenizer.meta["selected"])
    if tokenizer.kind == "tokenizer":
        return {
            "name": "trained",
            "path": tokenizer.meta["tokenizer_json"],
            "vocab_size": tokenizer.meta["vocab_size"],
            "eos_token": tokenizer.meta["eos_token"],
            "eos_id": tokenizer.meta["eos_id"],
        }
    raise ValueError(f"tokenize: give a fertility or tokenizer artifact as input, not a {tokenizer.kind} artifact")


def tokenizer_folder(tokenizer: Any) -> tuple[Path, int]:
    """The HF tokenizer folder and EOS id chosen upstream (fertility decision or tokenizer)."""
    chosen = selected_tokenizer(tokenizer)
    path = Path(chosen["path"])
    return (path.parent if path.is_file() else path), int(chosen["eos_id"])
