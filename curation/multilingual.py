"""datatrove components of multilingual curation: word tokenizers that work offline, language
identification over py3langid's bundled model (curation/languages.py has the per-language
settings and why; curation/presets.py builds FineWeb's stack for one language from them).

Like every module of this package it imports datatrove only (no Prefect).
"""

from __future__ import annotations

import functools

import regex
from datatrove.data import Document
from datatrove.pipeline.filters import LanguageFilter
from datatrove.utils.lid import LID, FastTextLID
from datatrove.utils.word_tokenizers import SpaCyTokenizer, WordTokenizer

from curation.languages import LanguageSettings

# --- word tokenizers ------------------------------------------------------------------------

# Scripts written without spaces between words: each letter is a word.
_SPACELESS = r"\p{Han}\p{Hiragana}\p{Katakana}\p{Thai}\p{Lao}\p{Khmer}\p{Myanmar}"
_TOKEN = regex.compile(rf"[{_SPACELESS}][\p{{M}}]*|[^\s\p{{P}}\p{{S}}{_SPACELESS}]+|[\p{{P}}\p{{S}}]")
_SENTENCE_END = regex.compile(r"[^。！？!?．.…\n]*(?:[。！？!?．.…]+[」』”\"')）]*|\n|$)")


class CharWordTokenizer(WordTokenizer):
    """Words of text in a script without spaces: each Han, kana or Thai letter (with its combining
    marks) is a word; runs of other letters and digits are words; punctuation marks are words.
    Sentences end at CJK or Latin terminal punctuation or a line break."""

    def __init__(self, language: str):
        super().__init__(language)

    def word_tokenize(self, text: str) -> list[str]:
        return _TOKEN.findall(text)

    def sent_tokenize(self, text: str) -> list[str]:
        return [s.strip() for s in _SENTENCE_END.findall(text) if s.strip()]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [m.span() for m in _SENTENCE_END.finditer(text) if m.group().strip()]

    def __reduce__(self):  # pickled to datatrove's workers by its language code only
        return (CharWordTokenizer, (self.language,))


class OfflineSpaCyTokenizer(SpaCyTokenizer):
    """datatrove's spaCy tokenizer with the blank pipeline of `model` (no optional segmenter)."""

    def __init__(self, language: str, model: str):
        super().__init__(model)
        self.language = language
        self.model = model
        self.config = None  # datatrove adds jieba/pyvi configs for zh/vi: not installed here

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import spacy

            self._tokenizer = spacy.blank(self.model)
            self._tokenizer.add_pipe("sentencizer")
        return self._tokenizer

    def __reduce__(self):
        return (OfflineSpaCyTokenizer, (self.language, self.model))


def word_tokenizer(settings: LanguageSettings) -> str | WordTokenizer:
    """What datatrove's filters take as `language`: a code its tokenizer table resolves offline,
    or a tokenizer instance (datatrove's `load_word_tokenizer` accepts either)."""
    if settings.words == "chars":
        return CharWordTokenizer(settings.code)
    if settings.words == "spaces":
        return OfflineSpaCyTokenizer(settings.code, "xx")
    if settings.code == "hi":  # datatrove maps Hindi to indic-nlp (not installed); spaCy has it
        return OfflineSpaCyTokenizer("hi", "hi")
    return settings.code


# --- language identification ----------------------------------------------------------------


@functools.cache
def bundled_identifier():
    """py3langid's bundled model with probabilities (loaded once per process: 2 s, it is
    xz-compressed; read-only afterwards, so every filter of the process shares it)."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


class Py3LangID(LID):
    """datatrove's LID interface over py3langid's bundled model (probabilities over 140 labels)."""

    def predict(self, doc: Document) -> tuple[tuple[str, float], dict[str, float]]:
        ranked = bundled_identifier().rank(doc.text)
        scores = dict(ranked)
        return ranked[0], ({lang: scores.get(lang, 0.0) for lang in self.languages} if self.languages else scores)


class LocalLID(FastTextLID):
    """datatrove's fastText language identifier reading a local model file (no download)."""

    def __init__(self, path: str, languages: list[str] | None = None):
        super().__init__(languages)
        self.path = path

    @property
    def model(self):
        if self._model is None:
            from fasttext.FastText import _FastText

            self._model = _FastText(self.path)
        return self._model


class LanguageIDFilter(LanguageFilter):
    """datatrove's LanguageFilter with an offline backend, keeping one language, and a reason per
    drop: `wrong_language` (another language scored best) or `low_score` (the kept language was
    best, below the threshold). The predicted language and score stay in the metadata."""

    slug = "language"
    # datatrove checks the dependencies of every class of the MRO: fastText (datatrove's
    # [processing] extra, installed) stays required; py3langid is checked here too
    _requires_dependencies = ["py3langid"]

    def __init__(self, language: str, threshold: float, backend: LID, exclusion_writer=None):
        super().__init__(languages=[language], language_threshold=threshold, exclusion_writer=exclusion_writer)
        self.model = backend  # replaces datatrove's fastText (whose model it would download)
        self.language = language

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        if super().filter(doc):
            return True
        if doc.metadata.get("language") != self.language:
            self.stat_update(f"detected_{doc.metadata.get('language')}")
            return False, "wrong_language"
        return False, "low_score"


def language_id(language: str, threshold: float, fasttext_model: str | None = None) -> LanguageIDFilter:
    """The language filter keeping `language`: py3langid, or a local fastText model if given."""
    backend = LocalLID(fasttext_model, [language]) if fasttext_model else Py3LangID([language])
    return LanguageIDFilter(language, threshold, backend)
