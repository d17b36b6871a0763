"""Word, line, paragraph and sentence splitting shared by the heuristic filters and dedup, and the
whitespace token count shared by the recipes and the crawl filters.

The rules mirror what datatrove feeds its filters for English (``split_into_words`` is
``spacy.blank("en")``'s tokenizer, sentences come from spaCy's ``Sentencizer``), re-expressed
as one compiled regular expression so a document is split in a single C-level ``findall``
instead of a spaCy ``Doc`` per call. What matters for filter decisions is kept exactly:

* whitespace never belongs to a token; every other character belongs to exactly one token;
* leading/trailing punctuation is split into one-character tokens (``"(hello),"`` ->
  ``( hello ) ,``); runs of dots (``...``) and of hyphens (``--``) stay one token;
* word-internal ``. ' , : / & @`` stay inside a word (``3.5``, ``1,000``, ``3:30pm``, ``x@y.com``,
  ``rock'n'roll``) except where spaCy's infix rules split them: a comma between letters,
  ``:`` or ``/`` before a letter, and hyphens everywhere (``well-known`` -> ``well - known``);
* clitics are split as spaCy's English exceptions do (``don't`` -> ``do n't``, ``John's`` ->
  ``John 's``, ``I'm`` -> ``I 'm``); abbreviations ending in an upper-case letter and a period
  (``U.S.``, ``U.K.``), single initials (``A.``) and common titles (``Mr.``, ``Dr.``, ``e.g.``)
  keep their period.

Known deviations (rare in prose; measured by ``benchmarks/curation_vs_datatrove.py``): emoticons
(``:)`` is two tokens here, one in spaCy), number+unit splits (``10km`` stays one token here),
spaCy's URL matcher (here: ``http(s)://`` or ``www.`` up to whitespace, trailing punctuation split).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import polars as pl
import regex

# datatrove.utils.text.PUNCTUATION / TERMINAL_PUNCTUATION, copied so datatrove stays an optional
# benchmark dependency (tests check they agree when datatrove is importable).
PUNCTUATION = "!/—”:％１〈&(、━\\【#%「」，】；+^]~“《„';’{|∶´[=-`*．（–？！：$～«〉,><》)?）。…@_.\"}►»" + "".join(
    map(chr, (x for a, b in ((0, 9), (11, 13), (13, 32), (127, 160)) for x in range(a, b)))
)
TERMINAL_PUNCTUATION = frozenset(
    "᪩？⁈𑩂．꩞𑅃﹗𑂾\u1b7d፧𑅂꡶꘎⁉࠾᪨𑊩𑱂᱿𖩮᥅\U00011f43\U00011f44﹒𑈹𑈸።܂؞꛳\U00010f88𑗍𐩖𑙂\u061d꩟᠉\u1b7e𑗗᰼𑻸؟𑪜꧉𑗉𐽙𖫵𖬷܀꓿᜵𑗏𑁇𑗓𑥄៖𑥆𑗑𑗒꯫۔𐩗"
    "\U00010f86꡷\u2e54｡៕߹⸮.𑇅࠹𛲟꫰꤯𐽗᭞𑜼፨𑃁꣏𑇟𖬸𑪛𑜾࠷𝪈?𑃀𑗃！։꣎॥𑗖᭛᠃!၊𖺘⁇𑗌𑑋𖭄᭟𑅁𑙁⸼꩝𑗋。꧈꫱𑜽𐽖𑂿᙮។꛷\U00010f89៚᥄𑗕𑗎᪪᭚࠽"
    "𑇞𑗊𐽘\u2e53𑗔𖩯𑇍𑻷𐽕𑩃।𑗂𑇆𑁈။᱾𑱁꘏܁᜶‼𑈻‽᪫﹖𑑌𑈼\U00010f87𑗐៙᰻"
)
PUNCTUATION_SET = frozenset(PUNCTUATION) | TERMINAL_PUNCTUATION

# spaCy's Sentencizer.default_punct_chars: a token that is exactly one of these ends a sentence.
SENTENCE_END_CHARS = frozenset(
    "!.?։؟۔܀܁܂߹।॥၊။።፧፨᙮᜵᜶᠃᠉᥄᥅᪨᪩᪪᪫᭚᭛᭞᭟᰻᰼᱾᱿‼‽⁇⁈⁉⸮⸼꓿꘎꘏꛳꛷꡶꡷꣎꣏꤯꧈꧉꩝꩞꩟꫰꫱꯫﹒﹖﹗！．？𐩖𐩗𑁇𑁈𑂾𑂿𑃀𑃁𑅁𑅂𑅃𑇅𑇆𑇍𑇞𑇟"
    "𑈸𑈹𑈻𑈼𑊩𑑋𑑌𑗂𑗃𑗉𑗊𑗋𑗌𑗍𑗎𑗏𑗐𑗑𑗒𑗓𑗔𑗕𑗖𑗗𑙁𑙂𑜼𑜽𑜾𑩂𑩃𑪛𑪜𑱁𑱂𖩮𖩯𖫵𖬷𖬸𖭄𛲟𝪈｡。"
)

_TITLES = (
    "Mr|Mrs|Ms|Dr|St|Jr|Sr|Prof|Inc|Ltd|Co|Corp|vs|etc|Gov|Sen|Rep|Gen|Lt|Col|Capt|Sgt|Rev|Mt|Ft|"
    "Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec|Ala|Ariz|Ark|Calif|Colo|Conn|Del|Fla|Ga|Ill|Ind|"
    "Kan|Ky|La|Md|Mass|Mich|Minn|Miss|Mo|Neb|Nev|Okla|Ore|Pa|Tenn|Va|Wash|Wis|e\.g|i\.e|a\.m|p\.m|"
    "E\.g|I\.e|A\.M|P\.M|ca|cf|viz"
)
_CLITIC = r"(?:[sSdDmM]|re|ve|ll|RE|VE|LL|Re|Ve|Ll)\b"
# spaCy's English prefix / suffix characters (peeled one at a time off a whitespace-delimited chunk).
_PREFIX = r"§%=—–+…,:;!?¿؟¡()\[\]{}<>_#*&。？！，、；：～·।،۔؛٪'\"”“`‘´’‚„»«「」『』（）〔〕【】《》〈〉⟦⟧$£€¥฿₹\p{So}"
_SUFFIX = r"…,:;!?¿؟¡()\[\]{}<>_#*&。？！，、；：～·।،۔؛٪'\"”“`‘´’‚„»«「」『』（）〔〕【】《》〈〉⟦⟧—–.%°\p{So}"
# spaCy's UNITS, split off a number at the end of a chunk (``10km`` -> ``10 km``); am/pm from its exceptions.
_UNITS = (
    "km²|km³|km|m²|m³|m|dm²|dm³|dm|cm²|cm³|cm|mm²|mm³|mm|ha|µm|nm|yd|in|ft|kg|g|mg|µg|t|lb|oz|m/s|km/h|kmh|mph|"
    "hPa|Pa|mbar|mb|MB|kb|KB|gb|GB|tb|TB|T|G|M|K|%|am|pm|a\\.m\\.|p\\.m\\."
)
_SUFFIX_NO_DOT = _SUFFIX.replace(".", "")
# Positions where spaCy's infix rules (or a clitic) end a word inside a chunk.
_SPLIT = (
    r"\.{2,}|…"
    r"|(?<=[\p{L}\p{N}])[-–—~](?=\p{L})"
    r"|(?<=\p{L}),(?=\p{L})"
    r"|(?<=[\p{L}\p{N}])[:<>=/](?=\p{L})"
    r"|(?<=\p{Ll})\.(?=\p{Lu})"
    r"|(?<=\p{N})[+\-*^](?=[\p{N}-])"
    rf"|(?<=\w)['’]{_CLITIC}"
    r"|(?<=\p{L})n['’]t\b"
)
# Where a word ends although the next character starts another word (``10|km``, ``can|not``).
_BREAK = rf"{_SPLIT}|(?<=\p{{N}})(?:{_UNITS})(?=[{_SUFFIX}]*(?:\s|$))|(?<=(?<!\w)[Cc]an)not\b"
WORD_PATTERN = regex.compile(
    # fast path first: a plain word followed by suffix punctuation other than "." and a space
    rf"(?![Cc]annot\b)(?:\p{{L}}[\p{{L}}\p{{M}}]*|\p{{N}}+)(?=[{_SUFFIX_NO_DOT}]*(?:\s|$))"
    r'|[,;:!?()\[\]"“”]'  # prefix characters that never start a longer token
    r"|(?:https?://|www\.)\S+?(?=[.,;:!?)\]\"'”’…]*(?:\s|$))"  # URL, trailing punctuation split off
    rf"|(?<![\w.])(?:{_TITLES})\.(?!\w)"  # titles/abbreviations that keep their period
    r"|(?<![\w.])(?:\p{L}\.)*\p{Lu}\.(?!\w)"  # initials and U.S.-style abbreviations
    rf"|n['’]t\b|(?<=\w)['’]{_CLITIC}"  # do|n't, John|'s, I|'m
    r"|\.{2,}|…+"  # ellipses stay whole
    rf"|(?!{_SPLIT})[^\s{_PREFIX}](?:(?!{_BREAK})\S)*(?<![{_SUFFIX}])"  # a chunk's core up to the next infix
    r"|\S",  # any other character (prefix, suffix, infix) is its own token
    regex.UNICODE | regex.V0,
)
_LINE_RUNS = re.compile("\n+")
_PARAGRAPH_RUNS = re.compile(r"\n{2,}")


def split_into_words(text: str) -> list[str]:
    """Tokens of ``text`` as datatrove's English ``split_into_words`` sees them (see module doc).

    >>> split_into_words("Don't stop -- it's well-known (U.S.).")
    ['do', "n't", ...]  # doctest: +SKIP
    """
    return WORD_PATTERN.findall(text)


def split_lines(text: str) -> list[str]:
    """``text.splitlines()`` — the line notion of the Gopher quality and C4 filters."""
    return text.splitlines()


def split_nonempty_lines(text: str) -> list[str]:
    """Lines separated by runs of ``\\n`` (Gopher repetition's ``re.split("\\n+")``)."""
    return _LINE_RUNS.split(text)


def split_paragraphs(text: str) -> list[str]:
    """Paragraphs: ``text.strip()`` split on two or more newlines (Gopher repetition)."""
    return _PARAGRAPH_RUNS.split(text.strip())


def count_sentences(words: list[str]) -> int:
    """Number of sentences spaCy's ``Sentencizer`` finds in a tokenised span (>= 1 if any token).

    A new sentence starts at the first token after a sentence-end token (``.``, ``!``, ``?``, ...)
    that is neither itself a sentence-end nor pure punctuation (spaCy's ``is_punct``).
    """
    if not words:
        return 0
    n = 1
    seen_end = False
    for w in words:
        if w in SENTENCE_END_CHARS:
            seen_end = True
        elif seen_end and not is_punct(w):
            n += 1
            seen_end = False
    return n


def is_punct(token: str) -> bool:
    """spaCy's ``Token.is_punct``: every character is Unicode punctuation (category P*)."""
    return bool(_ALL_PUNCT.fullmatch(token))


_ALL_PUNCT = regex.compile(r"\p{P}+")


TokenCount = Callable[[pl.Series], pl.Series]


def whitespace_words(texts: pl.Series) -> pl.Series:
    """Tokens approximated by whitespace-separated words (≈ 0.75 of a GPT-2 BPE token count on English prose)."""
    return texts.fill_null("").str.count_matches(r"\S+").cast(pl.Int64)


#: ``curation.token_count`` values: whitespace words, or a tokenizers JSON file's tokens.
TOKEN_COUNT_CHOICES = "words | tokenizer:<path to a tokenizers JSON file>"


def check_token_count(spec: str) -> str | None:
    """Why ``spec`` is not a ``curation.token_count`` value (None when it is one)."""
    if spec == "words" or (spec.startswith("tokenizer:") and spec[len("tokenizer:"):].strip()):
        return None
    return f"expected {TOKEN_COUNT_CHOICES}, got {spec!r}"


def counter_name(token_count: TokenCount) -> str:
    """What ``stats.json``'s ``token_count`` says counted: ``words`` for :func:`whitespace_words`,
    else the counter's ``name`` (``tokenizer:<path>`` for a BPE count)."""
    if token_count is whitespace_words:
        return "words"
    return str(getattr(token_count, "name", None) or getattr(token_count, "__qualname__", repr(token_count)))
