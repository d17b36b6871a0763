"""Heuristic document filters (Gopher quality & repetition, C4, FineWeb, QualityPajama "aesthetic").

Each filter takes a Utf8 ``pl.Series`` of documents and returns a :class:`FilterResult` whose
``reasons`` holds, per document, ``None`` (keep) or ``"<filter>.<rule>"`` naming the first rule
the document failed, in the same rule order as datatrove's filter of the same name, so reason
counts are comparable with datatrove's ``stats.json``. Null documents are treated as ``""``.

Decisions follow datatrove 0.10 (``pipeline/filters/*.py``) rule by rule; words, lines and
sentences are split by :mod:`tasks.curation.text`, a regex re-expression of datatrove's English
spaCy tokenizer. The work is done for the whole batch at once: documents are tokenised once into
a global vocabulary, per-word properties are computed per *vocabulary entry*, and per-document
counts, n-gram counts and duplicate n-gram bounds are numpy reductions over the batch.

Deviations from datatrove (documented where they live):

* datatrove's duplicate-n-gram rule compares n-grams as ``"".join(words)`` strings (so
  ``("ab", "c") == ("a", "bc")``); here n-grams are word tuples.
* Division by zero in datatrove (a document with no words or lines when a word-count bound is
  disabled) raises; here the ratio counts as 0 and the document is judged by the other rules.

>>> res = gopher_quality(pl.Series(["too short"]))
>>> res.reasons.to_list()
['gopher_quality.word_count']
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from tasks.common.config import require
from tasks.curation.text import (
    PUNCTUATION_SET,
    TERMINAL_PUNCTUATION,
    WORD_PATTERN,
    count_sentences,
    split_into_words,
    split_nonempty_lines,
    split_paragraphs,
)

STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")


@dataclass(frozen=True)
class FilterResult:
    """Per-document decisions of one filter.

    ``reasons``: Utf8, one per document; null = keep, else ``"<filter>.<rule>"``.
    ``texts``: the edited documents when the filter rewrites them (C4 line removal), else None;
    dropped documents keep their original text there.
    ``stats``: flat integer counters a step reports beside its reasons (PII replacements per kind).
    """

    reasons: pl.Series
    texts: pl.Series | None = None
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def keep(self) -> pl.Series:
        """Boolean mask: True where the document passed."""
        return self.reasons.is_null().alias("keep")


# ---------------------------------------------------------------------------------------------
# configs (datatrove's defaults)


def _frac(name: str, v: float | None) -> None:
    require(v is None or 0.0 <= v <= 1.0, name, f"must be in [0, 1] or null, got {v}")


@dataclass(frozen=True, kw_only=True)
class GopherQualityConfig:
    """Gopher quality rules (Rae et al. 2021, "Scaling Language Models", Table A1); None disables a rule."""

    min_doc_words: int | None = 50
    max_doc_words: int | None = 100_000
    min_avg_word_length: float | None = 3
    max_avg_word_length: float | None = 10
    max_symbol_word_ratio: float | None = 0.1
    max_bullet_lines_ratio: float | None = 0.9
    max_ellipsis_lines_ratio: float | None = 0.3
    # datatrove's name; it is the *minimum* fraction of words that contain a letter.
    max_non_alpha_words_ratio: float | None = 0.8
    min_stop_words: int | None = 2
    stop_words: tuple[str, ...] = STOP_WORDS

    def __post_init__(self) -> None:
        for name in ("min_doc_words", "max_doc_words", "min_stop_words"):
            v = getattr(self, name)
            require(v is None or v >= 0, name, f"must be >= 0 or null, got {v}")
        if self.min_doc_words is not None and self.max_doc_words is not None:
            require(self.min_doc_words <= self.max_doc_words, "max_doc_words", "must be >= min_doc_words")
        for name in ("min_avg_word_length", "max_avg_word_length"):
            v = getattr(self, name)
            require(v is None or v >= 0, name, f"must be >= 0 or null, got {v}")
        if self.min_avg_word_length is not None and self.max_avg_word_length is not None:
            require(
                self.min_avg_word_length <= self.max_avg_word_length,
                "max_avg_word_length",
                "must be >= min_avg_word_length",
            )
        require(self.max_symbol_word_ratio is None or self.max_symbol_word_ratio >= 0,
                "max_symbol_word_ratio", "must be >= 0 or null")
        _frac("max_bullet_lines_ratio", self.max_bullet_lines_ratio)
        _frac("max_ellipsis_lines_ratio", self.max_ellipsis_lines_ratio)
        _frac("max_non_alpha_words_ratio", self.max_non_alpha_words_ratio)


@dataclass(frozen=True, kw_only=True)
class GopherRepetitionConfig:
    """Gopher repetition rules (Rae et al. 2021, Table A1); fractions are of ``len(text)`` chars."""

    dup_line_frac: float | None = 0.3
    dup_para_frac: float | None = 0.3
    dup_line_char_frac: float | None = 0.2
    dup_para_char_frac: float | None = 0.2
    top_n_grams: tuple[tuple[int, float], ...] = ((2, 0.2), (3, 0.18), (4, 0.16))
    dup_n_grams: tuple[tuple[int, float], ...] = (
        (5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10),
    )

    def __post_init__(self) -> None:
        for name in ("dup_line_frac", "dup_para_frac", "dup_line_char_frac", "dup_para_char_frac"):
            _frac(name, getattr(self, name))
        for name in ("top_n_grams", "dup_n_grams"):
            for n, f in getattr(self, name):
                require(1 <= n <= 32, name, f"n-gram size must be in [1, 32], got {n}")
                require(0.0 <= f <= 1.0, name, f"fraction must be in [0, 1], got {f}")


@dataclass(frozen=True, kw_only=True)
class C4QualityConfig:
    """C4 rules (Raffel et al. 2020, section 2.2; tfds ``c4_utils``); -1 disables a count rule."""

    split_paragraph: bool = True
    remove_citations: bool = True
    filter_no_terminal_punct: bool = True
    min_num_sentences: int = 5
    min_words_per_line: int = 3
    max_word_length: int = 1000
    filter_lorem_ipsum: bool = True
    filter_javascript: bool = True
    filter_curly_bracket: bool = True
    filter_policy: bool = True

    def __post_init__(self) -> None:
        require(self.split_paragraph, "split_paragraph",
                "only line splitting (C4's default) is implemented; sentence mode needs punkt")
        for name in ("min_num_sentences", "min_words_per_line", "max_word_length"):
            v = getattr(self, name)
            require(v == -1 or v >= 0, name, f"must be >= 0 or -1 (disabled), got {v}")


@dataclass(frozen=True, kw_only=True)
class FineWebQualityConfig:
    """FineWeb's own rules (Penedo et al. 2024, "The FineWeb Datasets", section 3.5)."""

    line_punct_thr: float = 0.12
    line_punct_exclude_zero: bool = False
    stop_chars: tuple[str, ...] | None = None  # None: datatrove's TERMINAL_PUNCTUATION
    short_line_thr: float = 0.67
    short_line_length: int = 30
    char_duplicates_ratio: float = 0.01
    new_line_ratio: float = 0.3

    def __post_init__(self) -> None:
        _frac("line_punct_thr", self.line_punct_thr)
        _frac("short_line_thr", self.short_line_thr)
        _frac("char_duplicates_ratio", self.char_duplicates_ratio)
        require(self.new_line_ratio >= 0, "new_line_ratio", "must be >= 0")
        require(self.short_line_length >= 0, "short_line_length", "must be >= 0")
        require(self.stop_chars is None or len(self.stop_chars) > 0, "stop_chars", "must be non-empty or null")


@dataclass(frozen=True, kw_only=True)
class AestheticConfig:
    """QualityPajama's "aesthetic" filter: lorem ipsum, inline code, alphanumeric ratio.

    The paper names the three criteria without code; this operationalises them as:
    ``lorem_ipsum`` — the lower-cased text contains "lorem ipsum";
    ``inline_code`` — more than ``max_code_matches`` matches of ``code_pattern`` (backtick spans,
    fenced blocks, and common JavaScript/Python/C/HTML statement shapes);
    ``alphanumeric_ratio`` — letters and digits are at most ``min_alphanumeric_ratio`` of the
    non-whitespace characters (documents need a ratio *above* 0.8; empty documents fail).
    """

    filter_lorem_ipsum: bool = True
    code_pattern: str = (
        r"`[^`\n]{1,200}`|```|\bfunction\s*\([^)]*\)\s*\{|\bdef\s+\w+\s*\([^)]*\)\s*:|"
        r"\bvar\s+\w+\s*=|\bconsole\.log\(|#include\s*<|</?(?:div|span|script|style)\b|"
        r"\breturn\s+[^;\n]{0,80};\s*\}|=>\s*\{"
    )
    max_code_matches: int | None = 0
    min_alphanumeric_ratio: float | None = 0.8

    def __post_init__(self) -> None:
        try:
            re.compile(self.code_pattern)
        except re.error as exc:
            require(False, "code_pattern", f"invalid regex: {exc}")
        require(self.max_code_matches is None or self.max_code_matches >= 0, "max_code_matches", "must be >= 0")
        _frac("min_alphanumeric_ratio", self.min_alphanumeric_ratio)


# ---------------------------------------------------------------------------------------------
# batch tokenisation


@dataclass(frozen=True)
class _Tokens:
    """All documents' words as ids into one vocabulary.

    ids: (n_tokens,) int64; doc: (n_tokens,) int64 document index; counts: (n_docs,) words/doc;
    vocab: id -> word; wlen: (n_vocab,) word lengths.
    """

    ids: np.ndarray
    doc: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    vocab: list[str]
    wlen: np.ndarray


def _as_list(texts: pl.Series) -> list[str]:
    if texts.dtype != pl.Utf8:
        texts = texts.cast(pl.Utf8)
    return texts.fill_null("").to_list()


def _tokenize(docs: list[str]) -> _Tokens:
    vocab: dict[str, int] = {}
    get = vocab.setdefault
    findall = WORD_PATTERN.findall
    flat: list[int] = []
    counts = np.empty(len(docs), dtype=np.int64)
    for i, t in enumerate(docs):
        words = findall(t)
        counts[i] = len(words)
        flat.extend([get(w, len(vocab)) for w in words])
    ids = np.fromiter(flat, dtype=np.int64, count=len(flat))
    words = list(vocab)
    wlen = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if len(docs) else np.zeros(0, np.int64)
    doc = np.repeat(np.arange(len(docs), dtype=np.int64), counts)
    return _Tokens(ids=ids, doc=doc, starts=starts, counts=counts, vocab=words, wlen=wlen)


def _vocab_flags(vocab: list[str], pred: Callable[[str], bool]) -> np.ndarray:
    return np.fromiter(map(pred, vocab), dtype=bool, count=len(vocab))


def _per_doc(tok: _Tokens, values: np.ndarray, n_docs: int) -> np.ndarray:
    return np.bincount(tok.doc, weights=values, minlength=n_docs)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    out = np.zeros(len(num), dtype=np.float64)
    np.divide(num, den, out=out, where=den > 0)
    return out


def _assign(reasons: list[str | None], mask: np.ndarray | list[bool], reason: str) -> None:
    for i in np.flatnonzero(mask):
        if reasons[i] is None:
            reasons[i] = reason


def _series(reasons: list[str | None]) -> pl.Series:
    return pl.Series("reason", reasons, dtype=pl.Utf8)


# ---------------------------------------------------------------------------------------------
# Gopher quality


def _is_symbol_word(w: str) -> bool:
    return all(ch in PUNCTUATION_SET for ch in w)


def _has_alpha(w: str) -> bool:
    return any(c.isalpha() for c in w)


def gopher_quality(texts: pl.Series, cfg: GopherQualityConfig = GopherQualityConfig()) -> FilterResult:
    """Gopher quality filter (Rae et al. 2021, appendix A.1.1), rule order as datatrove's.

    Rules (reason ``gopher_quality.<rule>``): ``word_count`` (non-symbol words outside
    [min_doc_words, max_doc_words]), ``avg_word_length`` (mean length of non-symbol words outside
    [min, max]), ``hash_ratio`` / ``ellipsis_ratio`` (``#`` or ``...``/``…`` occurrences per word
    > max_symbol_word_ratio; all tokens count as words), ``bullet_lines`` (lines starting with
    ``•``/``-``), ``ellipsis_lines`` (lines ending in an ellipsis), ``alpha_words`` (fraction of
    words with a letter < max_non_alpha_words_ratio), ``stop_words`` (distinct stop words <
    min_stop_words).
    """
    docs = _as_list(texts)
    n = len(docs)
    tok = _tokenize(docs)
    sym = _vocab_flags(tok.vocab, _is_symbol_word)[tok.ids]
    alpha = _vocab_flags(tok.vocab, _has_alpha)[tok.ids]
    nonsym = ~sym
    n_words = tok.counts.astype(np.float64)
    n_nonsym = _per_doc(tok, nonsym.astype(np.float64), n)
    len_nonsym = _per_doc(tok, np.where(nonsym, tok.wlen[tok.ids], 0).astype(np.float64), n)
    avg_len = _ratio(len_nonsym, n_nonsym)
    n_alpha = _per_doc(tok, alpha.astype(np.float64), n)

    stop_index = {w: i for i, w in enumerate(dict.fromkeys(cfg.stop_words))}
    stop_of_vocab = np.fromiter((stop_index.get(w, -1) for w in tok.vocab), dtype=np.int64, count=len(tok.vocab))
    sv = stop_of_vocab[tok.ids]
    hit = sv >= 0
    pairs = np.unique(tok.doc[hit] * max(len(stop_index), 1) + sv[hit])
    n_stop = np.bincount(pairs // max(len(stop_index), 1), minlength=n) if len(pairs) else np.zeros(n, np.int64)

    hashes = np.fromiter((t.count("#") for t in docs), dtype=np.float64, count=n)
    ellipses = np.fromiter((t.count("...") + t.count("…") for t in docs), dtype=np.float64, count=n)
    bullet = np.zeros(n)
    end_ellipsis = np.zeros(n)
    n_lines = np.zeros(n)
    need_lines = cfg.max_bullet_lines_ratio is not None or cfg.max_ellipsis_lines_ratio is not None
    if need_lines:
        for i, t in enumerate(docs):
            lines = t.splitlines()
            n_lines[i] = len(lines)
            bullet[i] = sum(1 for s in lines if s.lstrip().startswith(("•", "-")))
            end_ellipsis[i] = sum(1 for s in lines if s.rstrip().endswith(("...", "…")))

    reasons: list[str | None] = [None] * n
    r = "gopher_quality."
    # datatrove treats 0 like "disabled" (``if self.min_doc_words and ...``); so do we.
    if cfg.min_doc_words:
        _assign(reasons, n_nonsym < cfg.min_doc_words, r + "word_count")
    if cfg.max_doc_words:
        _assign(reasons, n_nonsym > cfg.max_doc_words, r + "word_count")
    has = n_nonsym > 0
    if cfg.min_avg_word_length:
        _assign(reasons, has & (avg_len < cfg.min_avg_word_length), r + "avg_word_length")
    if cfg.max_avg_word_length:
        _assign(reasons, has & (avg_len > cfg.max_avg_word_length), r + "avg_word_length")
    if cfg.max_symbol_word_ratio:
        _assign(reasons, _ratio(hashes, n_words) > cfg.max_symbol_word_ratio, r + "hash_ratio")
        _assign(reasons, _ratio(ellipses, n_words) > cfg.max_symbol_word_ratio, r + "ellipsis_ratio")
    if cfg.max_bullet_lines_ratio:
        _assign(reasons, _ratio(bullet, n_lines) > cfg.max_bullet_lines_ratio, r + "bullet_lines")
    if cfg.max_ellipsis_lines_ratio:
        _assign(reasons, _ratio(end_ellipsis, n_lines) > cfg.max_ellipsis_lines_ratio, r + "ellipsis_lines")
    if cfg.max_non_alpha_words_ratio:
        _assign(reasons, (n_words > 0) & (_ratio(n_alpha, n_words) < cfg.max_non_alpha_words_ratio),
                r + "alpha_words")
    if cfg.min_stop_words:
        _assign(reasons, n_stop < cfg.min_stop_words, r + "stop_words")
    return FilterResult(reasons=_series(reasons))


# ---------------------------------------------------------------------------------------------
# Gopher repetition


def _find_duplicates(items: list[str]) -> tuple[int, int]:
    """datatrove's ``find_duplicates``: (# repeated elements, # chars in repeated elements)."""
    seen: set[str] = set()
    n_dup = 0
    chars = 0
    for x in items:
        if x in seen:
            n_dup += 1
            chars += len(x)
        else:
            seen.add(x)
    return n_dup, chars


def _compact(keys: np.ndarray) -> np.ndarray:
    """Relabel ``keys`` as 0..k-1 (order-preserving), so the next n-gram level fits in int64."""
    _, inv = np.unique(keys, return_inverse=True)
    return inv.astype(np.int64, copy=False).reshape(-1)


def _ngram_levels(tok: _Tokens, max_n: int) -> dict[int, np.ndarray]:
    """keys[n][i]: an id for the word n-gram starting at token i (equal ids == equal n-grams).

    Keys are built level by level, ``key_n = compact(key_{n-1} * V + id[i + n - 1])``, so each
    level is one sort of the batch; windows that cross a document boundary are not masked here.
    """
    v = max(len(tok.vocab), 1)
    levels = {1: tok.ids}
    key = tok.ids
    for m in range(2, max_n + 1):
        if len(key) <= 1:
            levels[m] = np.zeros(0, np.int64)
            key = levels[m]
            continue
        key = _compact(key[:-1] * v + tok.ids[m - 1 :])
        levels[m] = key
    return levels


def _windows(tok: _Tokens, m: int) -> np.ndarray:
    """Start indices of the word m-grams that lie inside one document."""
    n_tok = len(tok.ids)
    if n_tok < m:
        return np.zeros(0, np.int64)
    starts = np.arange(n_tok - m + 1)
    return starts[tok.doc[starts] == tok.doc[starts + m - 1]]


def gopher_repetition(texts: pl.Series, cfg: GopherRepetitionConfig = GopherRepetitionConfig()) -> FilterResult:
    """Gopher repetition filter (Rae et al. 2021, appendix A.1.1 and Table A1).

    Rules in datatrove's order (reason ``gopher_repetition.<rule>``): ``empty``;
    ``dup_para_frac`` / ``dup_para_char_frac`` (paragraphs split on ``\\n{2,}``);
    ``dup_line_frac`` / ``dup_line_char_frac`` (lines split on ``\\n+``); ``top_<n>_gram`` (the most
    frequent word n-gram — first-seen among ties — times its length with spaces, over
    ``len(text)``); ``dup_<n>_gram`` (characters, without spaces, in n-grams that repeat an
    earlier one, counted greedily left to right skipping n words after a repeat, as datatrove).

    The greedy duplicate count is bounded from above by the characters of all words covered by
    any repeated n-gram (vectorised); only documents whose bound exceeds the threshold are
    counted exactly, word by word.
    """
    docs = _as_list(texts)
    n = len(docs)
    reasons: list[str | None] = [None] * n
    r = "gopher_repetition."
    text_len = np.fromiter(map(len, docs), dtype=np.float64, count=n)
    for i, t in enumerate(docs):
        if not t:
            reasons[i] = r + "empty"
            continue
        paras = split_paragraphs(t)
        p_dup, p_chars = _find_duplicates(paras)
        if cfg.dup_para_frac and p_dup / len(paras) > cfg.dup_para_frac:
            reasons[i] = r + "dup_para_frac"
            continue
        if cfg.dup_para_char_frac and p_chars / len(t) > cfg.dup_para_char_frac:
            reasons[i] = r + "dup_para_char_frac"
            continue
        lines = split_nonempty_lines(t)
        l_dup, l_chars = _find_duplicates(lines)
        if cfg.dup_line_frac and l_dup / len(lines) > cfg.dup_line_frac:
            reasons[i] = r + "dup_line_frac"
            continue
        if cfg.dup_line_char_frac and l_chars / len(t) > cfg.dup_line_char_frac:
            reasons[i] = r + "dup_line_char_frac"

    sizes = [m for m, _ in cfg.top_n_grams] + [m for m, _ in cfg.dup_n_grams]
    if not sizes or all(x is not None for x in reasons):
        return FilterResult(reasons=_series(reasons))
    tok = _tokenize(docs)
    levels = _ngram_levels(tok, max(sizes))
    csum = np.concatenate([[0], np.cumsum(tok.wlen[tok.ids])])  # chars of words[0:i]
    safe_len = np.maximum(text_len, 1)

    for m, frac in cfg.top_n_grams:
        w = _windows(tok, m)
        if len(w) == 0:
            continue
        d = tok.doc[w]
        k = levels[m][w]
        g = d * (int(k.max()) + 1) + k
        uniq, first, count = np.unique(g, return_index=True, return_counts=True)
        gdoc = d[first]
        order = np.lexsort((first, -count, gdoc))  # per doc: highest count, then first seen
        top = order[np.r_[True, gdoc[order][1:] != gdoc[order][:-1]]]
        start = w[first[top]]
        chars = (csum[start + m] - csum[start]) + (m - 1)
        score = np.zeros(n)
        score[gdoc[top]] = count[top] * chars
        _assign(reasons, score / safe_len > frac, r + f"top_{m}_gram")

    for m, frac in cfg.dup_n_grams:
        w = _windows(tok, m)
        if len(w) == 0:
            continue
        d = tok.doc[w]
        k = levels[m][w]
        g = d * (int(k.max()) + 1) + k
        _, first, inv = np.unique(g, return_index=True, return_inverse=True)
        repeat = w[first[inv.reshape(-1)] != np.arange(len(w))]
        if len(repeat) == 0:
            continue
        # upper bound: chars of all words covered by some repeated window
        cover = np.zeros(len(tok.ids) + 1, np.int64)
        np.add.at(cover, repeat, 1)
        np.add.at(cover, repeat + m, -1)
        covered = np.cumsum(cover[:-1]) > 0
        bound = np.bincount(tok.doc[covered], weights=tok.wlen[tok.ids[covered]], minlength=n)
        for i in np.flatnonzero(bound / safe_len > frac):
            if reasons[i] is not None:
                continue
            s, c = int(tok.starts[i]), int(tok.counts[i])
            if c < m:
                continue
            keys = levels[m][s : s + c - m + 1].tolist()
            wl = (csum[s + m : s + c + 1] - csum[s : s + c - m + 1]).tolist()
            seen: set[int] = set()
            rep = 0
            idx = 0
            while idx < len(keys):
                if keys[idx] in seen:
                    rep += wl[idx]
                    idx += m
                else:
                    seen.add(keys[idx])
                    idx += 1
            if rep / len(docs[i]) > frac:
                reasons[i] = r + f"dup_{m}_gram"
    return FilterResult(reasons=_series(reasons))


# ---------------------------------------------------------------------------------------------
# C4


_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
_END_PUNCTUATION = (".", "?", "!", '"', "'")
_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")


def c4_quality(texts: pl.Series, cfg: C4QualityConfig = C4QualityConfig()) -> FilterResult:
    """C4 line and page rules (Raffel et al. 2020, section 2.2), as datatrove's ``C4QualityFilter``.

    Lines (``str.splitlines``, stripped) are dropped for: a word longer than ``max_word_length``,
    no terminal punctuation (or ending in ``...``) after removing citation markers, fewer than
    ``min_words_per_line`` whitespace words, "javascript", policy/cookie phrases. Documents are
    dropped (reason ``c4_quality.<rule>``) for ``lorem_ipsum`` or ``curly_bracket`` in a kept-so-far
    line, or ``too_few_sentences`` (sentences, spaCy-Sentencizer style, in kept lines <
    ``min_num_sentences``). ``texts`` holds the kept lines joined by ``\\n``.
    """
    docs = _as_list(texts)
    reasons: list[str | None] = [None] * len(docs)
    out: list[str] = list(docs)
    r = "c4_quality."
    max_wl = cfg.max_word_length
    min_sent = cfg.min_num_sentences
    for i, t in enumerate(docs):
        n_sent = 0
        kept: list[str] = []
        reason = None
        for line in t.splitlines():
            line = line.strip()
            words = line.split()
            if max_wl != -1 and len(line) > max_wl and any(len(w) > max_wl for w in words):
                continue
            if cfg.remove_citations and "[" in line:
                line = _CITATION.sub("", line)
            if cfg.filter_no_terminal_punct and (not line.endswith(_END_PUNCTUATION) or line.endswith("...")):
                continue
            if len(words) < cfg.min_words_per_line:
                continue
            low = line.lower()
            if cfg.filter_lorem_ipsum and "lorem ipsum" in low:
                reason = r + "lorem_ipsum"
                break
            if cfg.filter_javascript and "javascript" in low:
                continue
            if cfg.filter_curly_bracket and "{" in line:
                reason = r + "curly_bracket"
                break
            if cfg.filter_policy and any(p in low for p in _POLICY):
                continue
            # only whether the count reaches min_num_sentences matters, so stop counting there
            if min_sent != -1 and n_sent < min_sent:
                n_sent += count_sentences(split_into_words(line))
            kept.append(line)
        if reason is None and n_sent < min_sent:
            reason = r + "too_few_sentences"
        if reason is None:
            out[i] = "\n".join(kept).strip()
        reasons[i] = reason
    return FilterResult(reasons=_series(reasons), texts=pl.Series("text", out, dtype=pl.Utf8))


# ---------------------------------------------------------------------------------------------
# FineWeb


def fineweb_quality(texts: pl.Series, cfg: FineWebQualityConfig = FineWebQualityConfig()) -> FilterResult:
    """FineWeb custom filters (Penedo et al. 2024, section 3.5), as datatrove's ``FineWebQualityFilter``.

    On non-blank ``\\n``-lines (reason ``fineweb_quality.<rule>``): ``empty``; ``line_punct_ratio``
    (fraction of lines ending in terminal punctuation < line_punct_thr); ``short_line_ratio``
    (fraction of lines of <= short_line_length chars > short_line_thr); ``char_dup_ratio``
    (chars in repeated lines / chars excluding newlines > char_duplicates_ratio); ``list_ratio``
    (newlines per word > new_line_ratio).
    """
    docs = _as_list(texts)
    stop = tuple(cfg.stop_chars) if cfg.stop_chars is not None else tuple(TERMINAL_PUNCTUATION)
    reasons: list[str | None] = [None] * len(docs)
    r = "fineweb_quality."
    findall = WORD_PATTERN.findall
    for i, t in enumerate(docs):
        lines = [ln for ln in t.split("\n") if ln.strip() != ""]
        if not lines:
            reasons[i] = r + "empty"
            continue
        ratio = sum(1 for ln in lines if ln.endswith(stop)) / len(lines)
        if ratio < cfg.line_punct_thr and not (ratio == 0 and cfg.line_punct_exclude_zero):
            reasons[i] = r + "line_punct_ratio"
            continue
        if sum(1 for ln in lines if len(ln) <= cfg.short_line_length) / len(lines) > cfg.short_line_thr:
            reasons[i] = r + "short_line_ratio"
            continue
        denom = len(t) - t.count("\n")
        if denom > 0 and _find_duplicates(lines)[1] / denom > cfg.char_duplicates_ratio:
            reasons[i] = r + "char_dup_ratio"
            continue
        n_words = len(findall(t))
        if n_words and t.count("\n") / n_words > cfg.new_line_ratio:
            reasons[i] = r + "list_ratio"
    return FilterResult(reasons=_series(reasons))


# ---------------------------------------------------------------------------------------------
# QualityPajama aesthetic


def aesthetic(texts: pl.Series, cfg: AestheticConfig = AestheticConfig()) -> FilterResult:
    """QualityPajama's aesthetic filter (see :class:`AestheticConfig` for the exact rules).

    Reasons, in order: ``aesthetic.lorem_ipsum``, ``aesthetic.inline_code``,
    ``aesthetic.alphanumeric_ratio``. Computed with polars string expressions (Rust regex).
    """
    s = texts.cast(pl.Utf8).fill_null("").alias("t")
    frame = pl.DataFrame([s]).select(
        lorem=pl.col("t").str.to_lowercase().str.contains("lorem ipsum", literal=True),
        code=pl.col("t").str.count_matches(cfg.code_pattern),
        alnum=pl.col("t").str.count_matches(r"[\p{L}\p{N}]"),
        visible=pl.col("t").str.count_matches(r"\S"),
    )
    reasons: list[str | None] = [None] * len(s)
    if cfg.filter_lorem_ipsum:
        _assign(reasons, frame["lorem"].to_numpy(), "aesthetic.lorem_ipsum")
    if cfg.max_code_matches is not None:
        _assign(reasons, frame["code"].to_numpy() > cfg.max_code_matches, "aesthetic.inline_code")
    if cfg.min_alphanumeric_ratio is not None:
        alnum = frame["alnum"].to_numpy().astype(np.float64)
        visible = frame["visible"].to_numpy().astype(np.float64)
        _assign(reasons, _ratio(alnum, visible) <= cfg.min_alphanumeric_ratio, "aesthetic.alphanumeric_ratio")
    return FilterResult(reasons=_series(reasons))


FILTERS: dict[str, tuple[type, Callable[..., FilterResult]]] = {
    "gopher_quality": (GopherQualityConfig, gopher_quality),
    "gopher_repetition": (GopherRepetitionConfig, gopher_repetition),
    "c4_quality": (C4QualityConfig, c4_quality),
    "fineweb_quality": (FineWebQualityConfig, fineweb_quality),
    "aesthetic": (AestheticConfig, aesthetic),
}

# Every reason a filter can return, for checks and metric names.
RULES: dict[str, tuple[str, ...]] = {
    "gopher_quality": ("word_count", "avg_word_length", "hash_ratio", "ellipsis_ratio", "bullet_lines",
                       "ellipsis_lines", "alpha_words", "stop_words"),
    "gopher_repetition": ("empty", "dup_para_frac", "dup_para_char_frac", "dup_line_frac", "dup_line_char_frac")
    + tuple(f"top_{m}_gram" for m in range(1, 33)) + tuple(f"dup_{m}_gram" for m in range(1, 33)),
    "c4_quality": ("lorem_ipsum", "curly_bracket", "too_few_sentences"),
    "fineweb_quality": ("empty", "line_punct_ratio", "short_line_ratio", "char_dup_ratio", "list_ratio"),
    "aesthetic": ("lorem_ipsum", "inline_code", "alphanumeric_ratio"),
}
