"""Byte-level BPE tokenizers as files: train one on text, adopt a given tokenizer.json, save a
Hugging Face folder with our special tokens and ChatML template; which tokenizer an upstream
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
SPECIAL_TOKENS = (EOS, "<|im_start|>", "<|im_end|>", "<|pad|>")  # EOS first: id 0

# ChatML; assistant content and its <|im_end|> are the tokens the assistant-only loss trains on.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


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

    missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
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
