"""Languages of the curation presets: offline language identification and per-language quality settings.

Language identification is py3langid (a maintained fork of langid.py that ships its model in the
wheel: 140 labels, 4.6 MB, numpy only), used through datatrove's own `LanguageFilter` with a
backend of ours (`Py3LangID`), so nothing is downloaded at run time. A local fastText model
(`curation.language_model`, e.g. lid.176.bin) can replace it (`LocalLID`).

Quality settings per language, in the FineWeb-2 manner: the English FineWeb stack judged with
each language's own word tokenizer, stop words and thresholds (`LANGUAGES`). FineWeb-2's
published per-language thresholds live on the hub and cannot be read here; ours are the English
FineWeb values, changed only where a rule measures something that differs by script (word
length, what a word is, line length in characters) and checked on real paragraphs of each
language (tests/tasks/data/multilingual.json, docs/data.md). Word tokenizers:

- `spacy`: datatrove's spaCy blank tokenizer for the language (rule-based, no model to fetch).
- `spaces`: spaCy's multi-language tokenizer (whitespace and punctuation): for languages whose
  datatrove tokenizer needs a package not installed here (Korean, Vietnamese).
- `chars`: every letter of a script written without spaces between words (Han, kana, Thai) is
  one word; for Chinese, Japanese and Thai, whose segmenters (jieba, SudachiPy, PyThaiNLP) are
  not installed. Word-length rules are off for them and n-gram rules count characters.

This module is the table only (no datatrove): the recipe validates source languages against it
without importing datatrove. The datatrove components are in curation/multilingual.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Words = Literal["spacy", "spaces", "chars"]


@dataclass(frozen=True)
class LanguageSettings:
    """How the web preset judges one language (ISO 639-1 code, as py3langid labels it)."""

    code: str  # py3langid label, e.g. "fr"
    name: str  # English name, for messages and docs
    words: Words  # word tokenizer kind (module docstring)
    stop_words: tuple[str, ...] = ()  # frequent function words; empty: the stop-word rule is off
    min_stop_words: int = 2  # distinct stop words a document must hold (Gopher: 2)
    min_avg_word_length: float | None = 3  # Gopher: 3 (None: off)
    max_avg_word_length: float | None = 10  # Gopher: 10 (None: off)
    min_doc_words: int = 50  # Gopher: 50 words
    short_line_length: int = 30  # FineWeb: a line of at most this many characters is short
    lid_threshold: float = 0.65  # FineWeb: keep documents whose LID score is above 0.65
    # Whether the script ends sentences with punctuation. Thai does not (a space ends a sentence,
    # nothing ends a paragraph): FineWeb's share of lines ending in punctuation is off for it.
    sentence_punctuation: bool = True
    # (n, share) rules of Gopher repetition over word n-grams (None: Gopher's defaults)
    top_n_grams: tuple[tuple[int, float], ...] | None = None
    dup_n_grams: tuple[tuple[int, float], ...] | None = None


# Character n-grams stand for word n-grams where every letter is a word: a Chinese or Japanese
# word is ~1.5-2 characters, so the n-gram sizes are doubled and Gopher's shares kept.
_CHAR_TOP = ((4, 0.2), (6, 0.18), (8, 0.16))
_CHAR_DUP = ((10, 0.15), (12, 0.14), (14, 0.13), (16, 0.12), (18, 0.11), (20, 0.10))

_EN_STOP = ("the", "be", "to", "of", "and", "that", "have", "with")  # Gopher's (datatrove's default)

LANGUAGES: dict[str, LanguageSettings] = {
    s.code: s
    for s in (
        LanguageSettings("en", "English", "spacy", _EN_STOP),
        LanguageSettings(
            "fr",
            "French",
            "spacy",
            ("le", "la", "les", "de", "des", "et", "est", "un", "une", "du", "en", "que", "qui", "dans", "pour"),
        ),
        LanguageSettings(
            "de",
            "German",
            "spacy",
            ("der", "die", "das", "und", "ist", "nicht", "ein", "eine", "zu", "den", "mit", "von", "sich", "auf"),
            max_avg_word_length=12,  # compounds: German prose averages 6-7 letters a word
        ),
        LanguageSettings(
            "es",
            "Spanish",
            "spacy",
            ("el", "la", "los", "las", "de", "que", "y", "en", "un", "una", "es", "por", "con", "del", "se"),
        ),
        LanguageSettings(
            "it",
            "Italian",
            "spacy",
            ("il", "la", "di", "che", "e", "è", "un", "una", "per", "non", "in", "del", "con", "sono", "della"),
        ),
        LanguageSettings(
            "pt",
            "Portuguese",
            "spacy",
            ("o", "a", "os", "as", "de", "que", "e", "do", "da", "em", "um", "uma", "é", "não", "para", "com"),
        ),
        LanguageSettings(
            "ru",
            "Russian",
            "spacy",
            ("и", "в", "не", "на", "что", "с", "он", "как", "это", "по", "к", "но", "из", "у", "за", "для"),
            max_avg_word_length=12,  # inflected words: Russian prose averages 6-7 letters
        ),
        LanguageSettings(
            "el",
            "Greek",
            "spacy",
            ("και", "το", "να", "η", "της", "του", "την", "με", "ο", "σε", "που", "για", "τα", "είναι", "των"),
            max_avg_word_length=12,
        ),
        LanguageSettings(
            "fa",
            "Persian",
            "spacy",
            ("و", "در", "به", "از", "که", "این", "را", "با", "است", "برای", "آن", "یک", "تا", "بر", "هم"),
        ),
        LanguageSettings(
            "ar",
            "Arabic",
            "spacy",
            ("في", "من", "على", "أن", "إلى", "عن", "هذا", "التي", "الذي", "مع", "كان", "لا", "ما", "هو", "هي"),
        ),
        LanguageSettings(
            "hi",
            "Hindi",
            "spacy",
            ("के", "है", "में", "की", "और", "को", "से", "का", "एक", "पर", "हैं", "भी", "यह", "कि", "नहीं"),
            min_avg_word_length=2,  # postpositions (के, में, की) are two or three letters with their vowel sign
        ),
        LanguageSettings(
            "ko",
            "Korean",
            "spaces",
            # Korean attaches particles and endings to words, so a stop word must be a whole
            # eojeol that stands alone in prose: dependent nouns, determiners, adverbs and the
            # most frequent predicate forms (news prose ends sentences in 했다, 밝혔다, 말했다)
            (
                *("수", "것", "및", "등", "더", "그리고", "또한", "있는", "있다", "이", "그", "대한", "위해", "통해"),
                *("같은", "위한", "함께", "모든", "많은", "다른", "가장", "다시", "매우", "크게", "먼저", "이미"),
                *("하는", "한", "할", "한다", "했다", "하고", "된다", "있었다", "없는", "없다", "않는", "때문에"),
                *("하지만", "그러나", "지난", "이번", "우리", "밝혔다", "말했다", "있습니다", "합니다", "때"),
            ),
            min_avg_word_length=2,  # a Korean word (eojeol) is 2-4 syllable blocks
        ),
        LanguageSettings(
            "vi",
            "Vietnamese",
            "spaces",
            ("của", "và", "là", "các", "có", "được", "trong", "cho", "không", "những", "một", "với", "người", "này"),
            min_avg_word_length=2,  # Vietnamese writes syllables apart: "và", "là", "có"
        ),
        LanguageSettings(
            "zh",
            "Chinese",
            "chars",
            ("的", "是", "在", "了", "和", "有", "不", "这", "一", "中", "也", "为", "人", "们"),
            min_avg_word_length=None,
            max_avg_word_length=None,
            min_doc_words=100,  # characters
            short_line_length=12,  # characters: a CJK line of 12 holds as much as ~30 Latin ones
            top_n_grams=_CHAR_TOP,
            dup_n_grams=_CHAR_DUP,
        ),
        LanguageSettings(
            "ja",
            "Japanese",
            "chars",
            ("の", "に", "は", "を", "た", "が", "で", "て", "と", "し", "な", "る", "も", "い"),
            min_avg_word_length=None,
            max_avg_word_length=None,
            min_doc_words=100,
            short_line_length=12,
            top_n_grams=_CHAR_TOP,
            dup_n_grams=_CHAR_DUP,
        ),
        LanguageSettings(
            "th",
            "Thai",
            "chars",
            (),  # Thai function words are several letters: without a segmenter the rule is off
            sentence_punctuation=False,
            min_avg_word_length=None,
            max_avg_word_length=None,
            min_doc_words=100,
            short_line_length=15,
            top_n_grams=_CHAR_TOP,
            dup_n_grams=_CHAR_DUP,
        ),
    )
}
