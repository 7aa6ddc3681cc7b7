"""The `passkey_beyond_<length>` eval task: passkey retrieval past the length the model was
trained at, run only by the evaluations of the last stage read at `eval.beyond_factor` x its
sequence length, once with plain RoPE and once with YaRN (docs/model.md "Long context: YaRN").

SmolLM3 is trained to 64k and served at 128k with YaRN, factor 2 (its model card): this task
is the small-scale check of that claim. Its length is `eval.beyond_passkey_words` words of
filler, sized by the recipe to fill more than the trained length and at most the factor times it
(the suite has no tokenizer: about 1.3 tokens per filler word with the tiny recipe's BPE).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from evals.benchmarks.passkey import Passkey, passkey_items


class PasskeyBeyond(Passkey):
    """Passkey's items, scoring and YAML at one length, `eval.beyond_passkey_words`."""

    name = "passkey_beyond"
    names = r"passkey_beyond_[1-9][0-9]{0,6}"
    beyond_training = True

    def build(self, heldout: Mapping[str, Sequence[str]], spec: Any, rng: random.Random) -> dict[str, list[dict]]:
        words = spec.eval.beyond_passkey_words
        return {} if words is None else {f"passkey_beyond_{words}": passkey_items(words, spec.eval, rng)}
