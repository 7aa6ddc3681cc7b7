"""A tiny SmolLM3 exported in Hugging Face format with a small trained BPE tokenizer: the model
the lm-eval tests score (tests/evals/test_harness.py, tests/tasks/test_evaluate.py)."""

from __future__ import annotations

from pathlib import Path


def export_tiny_hf_model(root: Path) -> Path:
    """A randomly initialised SmolLM3 exported with a small trained BPE tokenizer, under `root`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from model.config import ModelConfig
    from model.hf import export_hf
    from model.model import SmolLM3

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [f"Problem: What is {i} + {i + 1}? Answer: {2 * i + 1}" for i in range(300)]
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(root / "tok")
    model = SmolLM3(ModelConfig.tiny(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2))
    model.init_weights(seed=0)
    return export_hf(model, root / "model", tokenizer_dir=root / "tok", eos_token_id=0)
