"""Validation decontamination: remove training documents that largely repeat validation text.

Prepare removes exact copies of validation documents from train; near-copies (a re-scraped
article, a reformatted speech, a rewrite of a val document) survive it and every curation
step after it. :func:`val_contamination` flags them by word n-gram overlap with the prepared
validation split, the test GPT-3 used (Brown et al. 2020, "Language Models are Few-Shot
Learners", Appendix C: 13-gram collisions between training and benchmark text).

Words are the runs of word characters (``\\w+``) of the lower-cased text, so case and
punctuation edits do not hide a copy. A document's n-grams are the distinct windows of
``ngram`` consecutive words; its contamination is the containment

    c(d) = |G(d) ∩ G(val)| / |G(d)|

(the share of its distinct n-grams that occur anywhere in validation), and it is dropped with
reason ``val_contamination`` when ``c(d) >= threshold``. N-grams are compared as 64-bit hashes:
each distinct word is hashed once with blake2b, a window is a polynomial roll of its word
hashes finished by SplitMix64 (the shingle hash of :mod:`tasks.curation.dedup`); at 2^-64 per
pair, a false collision among the demo's ~10^6 × 10^5 pairs is not expected.

>>> deco = ValDecontaminator.from_val(prepared.val["text"], DecontaminationConfig())  # doctest: +SKIP
>>> deco(kept["text"]).reasons   # null = keep, "val_contamination" = drop               # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from tasks.common.config import at_least, require
from tasks.curation.dedup import _splitmix64, _word_hash
from tasks.curation.filters import FilterResult

REASON = "val_contamination"

_ROLL = np.uint64(0x100000001B3)  # FNV-64 prime: the polynomial base of the window hash
_SHORT_TAG = np.uint64(0xD6E8FEB86659FD93)  # keeps a short document's whole-text key off the n-gram keys


@dataclass(frozen=True, kw_only=True)
class DecontaminationConfig:
    """The ``curation.decontamination`` block: applied to every active variant after its recipe.

    ``ngram``: words per n-gram (13, as GPT-3). ``threshold``: drop a training document when at
    least this share of its distinct n-grams occur in validation. The default 0.5 rather than
    GPT-3's "any collision": GPT-3 compared benchmark items against a web-scale corpus, where one
    shared 13-gram is rare enough to mean a leak; here the validation split is a sample of the
    same five sources as train, so one shared 13-gram is usually a formula the sources repeat
    (wire-service bylines, "the right hon. member for ...", BBC sign-offs), and "any collision"
    would cut many unrelated documents, unevenly by source. A share >= 0.5 means half of the
    document is validation text: a near-copy or a rewrite of one. A long document that quotes a
    short validation document stays (its share is small); the residual overlap is reported as
    ``val_ngram_share_after``.

    Documents with fewer than ``ngram`` words have no n-gram. Each is instead keyed by its whole
    word sequence, matched against the whole-text keys of the short validation documents: a short
    training document is removed exactly when it has the same words as a short validation document
    (a tweet re-posted with different case or punctuation) — share 1 — and kept otherwise —
    share 0. A document with no words is kept (share 0; emptiness is other filters' business).
    """

    enabled: bool = True
    ngram: int = 13
    threshold: float = 0.5

    def __post_init__(self) -> None:
        at_least(self.ngram, 1, "ngram")
        require(0.0 < self.threshold <= 1.0, "threshold", f"must be in (0, 1], got {self.threshold}")


def _word_hashes(texts: pl.Series, cache: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """(hash per word (n_words,) uint64, words per document (n_docs,) int64), documents in order."""
    words = texts.cast(pl.Utf8).fill_null("").str.to_lowercase().str.extract_all(r"\w+")
    counts = words.list.len().fill_null(0).to_numpy().astype(np.int64)
    flat = words.explode().drop_nulls().alias("w")
    uniq = flat.unique()
    new = [w for w in uniq.to_list() if w not in cache]
    cache.update(zip(new, map(_word_hash, new)))
    table = pl.DataFrame({"w": uniq, "h": pl.Series(
        np.fromiter((cache[w] for w in uniq.to_list()), dtype=np.uint64, count=len(uniq)))})
    wh = flat.to_frame().join(table, on="w", how="left", maintain_order="left")["h"].to_numpy()
    return wh.astype(np.uint64, copy=False), counts


def word_ngram_hashes(
    texts: pl.Series, ngram: int, *, word_cache: dict[str, int] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hashed word n-grams of every document, with multiplicity, in document order.

    Returns ``(hashes (K,) uint64, doc (K,) int64, n_words (n_docs,) int64)``: ``hashes[k]`` is an
    n-gram of document ``doc[k]``. A document with ``0 < n_words < ngram`` gets one key of its
    whole word sequence (tagged so it cannot equal a full n-gram); one with no words gets none.
    ``word_cache`` (word -> hash) may be shared across calls to hash each word once.
    """
    wh, counts = _word_hashes(texts, {} if word_cache is None else word_cache)
    n_docs = len(counts)
    doc_of_word = np.repeat(np.arange(n_docs), counts)
    offs = np.concatenate([[0], np.cumsum(counts)])
    parts_h, parts_d = [], []
    if len(wh) >= ngram:
        m = len(wh) - ngram + 1
        h = np.zeros(m, dtype=np.uint64)
        for j in range(ngram):
            h = h * _ROLL + wh[j : j + m]
        starts = np.arange(m)
        inside = doc_of_word[starts] == doc_of_word[starts + ngram - 1]  # windows across a boundary
        parts_h.append(_splitmix64(h[inside]))
        parts_d.append(doc_of_word[starts[inside]])
    short = np.flatnonzero((counts > 0) & (counts < ngram))
    if len(short):
        # the same roll over each short document's words, vectorised over documents
        lens = counts[short]
        keys = np.zeros(len(short), dtype=np.uint64)
        for j in range(int(lens.max())):
            live = j < lens
            x = wh[np.minimum(offs[short] + j, len(wh) - 1)]
            keys = np.where(live, keys * _ROLL + x, keys)
        parts_h.append(_splitmix64(keys ^ _SHORT_TAG))
        parts_d.append(short)
    if not parts_h:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64), counts
    hashes, doc = np.concatenate(parts_h), np.concatenate(parts_d)
    order = np.argsort(doc, kind="stable")
    return hashes[order], doc[order], counts


def _sorted_unique(x: np.ndarray) -> np.ndarray:
    # sort + adjacent compare: numpy's hash-based unique is several times slower on random uint64
    x = np.sort(x)
    return x[np.r_[True, x[1:] != x[:-1]]] if len(x) else x


def _isin(x: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Membership of each ``x`` in ``keys``, shape ``x.shape`` bool (a polars hash set: ~10x np.isin here)."""
    return pl.Series(x, dtype=pl.UInt64).is_in(pl.Series(keys, dtype=pl.UInt64).implode()).to_numpy()


class ValDecontaminator:
    """The validation split's n-gram set and the rule of :class:`DecontaminationConfig`.

    Build once per run from the prepared val texts; call on each variant's final training texts.
    """

    def __init__(self, val_keys: np.ndarray, val_ngrams: np.ndarray, cfg: DecontaminationConfig) -> None:
        """``val_keys``: every key of validation (n-grams and short documents' whole-text keys);
        ``val_ngrams``: the true n-grams only, with multiplicity (for :meth:`val_share`)."""
        self.cfg = cfg
        self.val_set = _sorted_unique(np.asarray(val_keys, dtype=np.uint64))
        self.val_ngrams = np.asarray(val_ngrams, dtype=np.uint64)
        self._words: dict[str, int] = {}

    @classmethod
    def from_val(cls, val_texts: pl.Series, cfg: DecontaminationConfig) -> ValDecontaminator:
        hashes, doc, n_words = word_ngram_hashes(val_texts, cfg.ngram)
        return cls(hashes, hashes[n_words[doc] >= cfg.ngram], cfg)

    def contamination(self, texts: pl.Series) -> np.ndarray:
        """``c(d)`` per document, shape ``(n_docs,)`` float64 in [0, 1] (0 for documents with no words)."""
        hashes, doc, counts = word_ngram_hashes(texts, self.cfg.ngram, word_cache=self._words)
        frac = np.zeros(len(counts), dtype=np.float64)
        if len(hashes) == 0:
            return frac
        # distinct n-grams per document: containment counts each repeated window once
        pairs = pl.DataFrame({"doc": doc, "h": hashes}).unique()
        doc, hashes = pairs["doc"].to_numpy(), pairs["h"].to_numpy()
        hit = _isin(hashes, self.val_set)
        total = np.bincount(doc, minlength=len(counts))
        found = np.bincount(doc, weights=hit, minlength=len(counts))
        has = total > 0
        frac[has] = found[has] / total[has]
        return frac

    def __call__(self, texts: pl.Series) -> FilterResult:
        """Keep/drop per document: reason ``val_contamination`` where ``c(d) >= threshold``, else null."""
        drop = self.contamination(texts) >= self.cfg.threshold
        reasons = pl.Series("reason", [REASON if d else None for d in drop.tolist()], dtype=pl.Utf8)
        return FilterResult(reasons=reasons)

    def val_found(self, train_texts: pl.Series) -> np.ndarray:
        """Which validation n-gram occurrences occur in ``train_texts``: ``(len(val_ngrams),)`` bool.

        Found-masks of parts of a corpus combine by ``|`` into the mask of the whole (the
        sharded engine decontaminates shard by shard)."""
        hashes, _doc, _n = word_ngram_hashes(train_texts, self.cfg.ngram, word_cache=self._words)
        return _isin(self.val_ngrams, hashes)

    def share_of(self, found: np.ndarray) -> float:
        """The share of validation n-gram occurrences a :meth:`val_found` mask marks; NaN when
        validation has no n-grams."""
        return float(found.mean()) if len(self.val_ngrams) else float("nan")

    def val_share(self, train_texts: pl.Series) -> float:
        """Share of validation n-gram occurrences (with multiplicity) found anywhere in ``train_texts``.

        The overlap measure of the problem report: 0 = no validation n-gram is trained on. Only
        true n-grams count (validation documents shorter than ``ngram`` words have none). NaN when
        validation has no n-grams.
        """
        if len(self.val_ngrams) == 0:
            return float("nan")
        return self.share_of(self.val_found(train_texts))

    def __getstate__(self) -> dict:
        # The word-hash cache grows with every text judged; a worker process rebuilds its own
        # rather than receiving the main process's with every shard.
        return {**self.__dict__, "_words": {}}
