"""Exact and MinHash-LSH near-duplicate detection, keyed by the caller's own document ids.

Both detectors return ``duplicate_of`` (Utf8, one per document): null for documents that are kept,
else the id of the kept representative of their cluster — the cluster's first document in input
order. Results depend only on the input (no worker count, no hash-order effects), so reruns agree.

MinHash follows Broder (1997), "On the resemblance and containment of documents": for a document's
set of word n-gram shingles S and random hash functions h_k, P[min h_k(S_a) = min h_k(S_b)] =
J(S_a, S_b) (Jaccard). Locality-sensitive hashing splits the b·r minima into b bands of r rows;
two documents become candidates when any band matches, with probability 1 - (1 - J^r)^b, a step
around (1/b)^(1/r) (≈ 0.72 for datatrove's 14 × 8).

>>> dup = minhash_duplicates(texts, ids, MinHashConfig())   # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import polars as pl
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from tasks.common.config import require

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True, kw_only=True)
class MinHashConfig:
    """MinHash-LSH settings; defaults are datatrove's (word 5-grams, 14 bands × 8 rows, seed 1).

    ``threshold``: when set (0.7–1.0), every LSH candidate pair is verified — a document joins a
    cluster only if the fraction of equal signature entries with the bucket's first document (the
    MinHash estimate of their Jaccard similarity) is >= threshold. Choose ``bands``/``rows`` so
    the LSH step (1/b)^(1/r) lies below the threshold (e.g. 28 × 4 ≈ 0.43 for 0.8), so that
    candidates are found with high probability and verification decides.
    ``lowercase`` / ``remove_punctuation`` / ``normalise_numbers``: text normalisation before
    shingling (datatrove's ``simplify_text`` does all three).
    ``batch_shingles``: shingles hashed per numpy block (memory ≈ batch_shingles × bands·rows × 8 B).
    """

    ngram: int = 5
    bands: int = 14
    rows: int = 8
    seed: int = 1
    hash_bits: int = 64
    threshold: float | None = None
    lowercase: bool = True
    remove_punctuation: bool = True
    normalise_numbers: bool = True
    batch_shingles: int = 8_192

    def __post_init__(self) -> None:
        require(self.ngram >= 1, "ngram", f"must be >= 1, got {self.ngram}")
        require(self.bands >= 1, "bands", f"must be >= 1, got {self.bands}")
        require(self.rows >= 1, "rows", f"must be >= 1, got {self.rows}")
        require(self.hash_bits in (32, 64), "hash_bits", f"must be 32 or 64, got {self.hash_bits}")
        require(self.threshold is None or 0.7 <= self.threshold <= 1.0, "threshold",
                f"must be in [0.7, 1.0] or null, got {self.threshold}")
        require(self.batch_shingles >= 1, "batch_shingles", "must be >= 1")

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows

    @property
    def lsh_threshold(self) -> float:
        """Similarity at which LSH candidate probability rises fastest, ≈ (1/b)^(1/r)."""
        return (1.0 / self.bands) ** (1.0 / self.rows)


# ---------------------------------------------------------------------------------------------
# exact


def normalise_for_hash(texts: pl.Series) -> pl.Series:
    """Text as compared by exact dedup: NFKC, lower case, punctuation and symbols removed,
    whitespace runs collapsed to one space, stripped. Nulls become ``""``.

    >>> normalise_for_hash(pl.Series(["Hello,  World!\\n"])).to_list()
    ['hello world']
    """
    return (
        texts.cast(pl.Utf8)
        .fill_null("")
        .str.normalize("NFKC")
        .str.to_lowercase()
        .str.replace_all(r"[\p{P}\p{S}]+", " ")
        .str.replace_all(r"\s+", " ")
        .str.strip_chars()
        .alias("normalised")
    )


def _check_ids(texts: pl.Series, ids: pl.Series) -> pl.Series:
    if len(texts) != len(ids):
        raise ValueError(f"ids: {len(ids)} ids for {len(texts)} texts")
    ids = ids.cast(pl.Utf8)
    if ids.null_count():
        raise ValueError("ids: must not contain nulls")
    if ids.n_unique() != len(ids):
        raise ValueError("ids: must be unique")
    return ids


def _duplicate_of(ids: pl.Series, rep: np.ndarray) -> pl.Series:
    """ids[rep[i]] where rep[i] != i, else null."""
    idx = np.arange(len(rep))
    is_dup = rep != idx
    frame = pl.DataFrame({"rep": ids.gather(rep), "dup": is_dup})
    return frame.select(
        pl.when(pl.col("dup")).then(pl.col("rep")).otherwise(None).alias("duplicate_of")
    )["duplicate_of"].cast(pl.Utf8)


def exact_duplicates(texts: pl.Series, ids: pl.Series) -> pl.Series:
    """Exact duplicates after :func:`normalise_for_hash`.

    Returns ``duplicate_of`` (Utf8, len(texts)): null for the first document (in input order)
    of each group of equal normalised texts, else that first document's id. ``ids`` must be
    unique and non-null (any type; compared as strings).
    """
    ids = _check_ids(texts, ids)
    norm = normalise_for_hash(texts)
    frame = pl.DataFrame({"norm": norm}).with_row_index("i")
    rep = frame.select(pl.col("i").min().over("norm"))["i"].to_numpy().astype(np.int64)
    return _duplicate_of(ids, rep)


# ---------------------------------------------------------------------------------------------
# MinHash


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (Steele et al. 2014): a bijective 64-bit mixer, wrapping arithmetic."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def _normalise_for_shingles(texts: pl.Series, cfg: MinHashConfig) -> pl.Series:
    s = texts.cast(pl.Utf8).fill_null("")
    if cfg.lowercase:
        s = s.str.to_lowercase()
    if cfg.normalise_numbers:
        s = s.str.replace_all(r"\p{Nd}+(?:[.,،٫⎖⎗⎘]\p{Nd}+)?", "0")
    if cfg.remove_punctuation:
        s = s.str.replace_all(r"[\p{P}\p{S}\p{Cc}]+", " ")
    return s


def _shingles(texts: pl.Series, cfg: MinHashConfig) -> tuple[np.ndarray, np.ndarray]:
    """Hashed word n-gram shingles of every document, deduplicated within each document.

    Returns (hashes (n_shingles,) uint64, counts (n_docs,) int64), documents in order. A document
    with fewer than ``ngram`` (but at least one) words gets one shingle of all its words
    (datatrove gives it none, so it can never be a near-duplicate); an empty one gets none.
    """
    norm = _normalise_for_shingles(texts, cfg).str.replace_all(r"\s+", " ").str.strip_chars()
    words_per_doc = norm.str.split(" ").list.eval(pl.element().filter(pl.element() != ""))
    counts_w = words_per_doc.list.len().fill_null(0).to_numpy().astype(np.int64)
    flat = words_per_doc.explode().drop_nulls().alias("w")
    # hash each distinct word once (stable blake2b), then map tokens to it with a join in Rust
    uniq = flat.unique()
    table = pl.DataFrame({
        "w": uniq,
        "h": np.fromiter(map(_word_hash, uniq.to_list()), dtype=np.uint64, count=len(uniq)),
    })
    wh = flat.to_frame().join(table, on="w", how="left", maintain_order="left")["h"].to_numpy()
    wh = wh.astype(np.uint64, copy=False)
    n_docs = len(counts_w)
    doc_of_word = np.repeat(np.arange(n_docs), counts_w)
    n = cfg.ngram
    # shingle hash: polynomial roll of word hashes, then a mixer
    if len(wh) >= n:
        h = np.zeros(len(wh) - n + 1, dtype=np.uint64)
        mult = np.uint64(0x100000001B3)
        for j in range(n):
            h = h * mult + wh[j : len(wh) - n + 1 + j]
        h = _splitmix64(h)
        starts = np.arange(len(h))
        ok = doc_of_word[starts] == doc_of_word[starts + n - 1]
        sh, sh_doc = h[ok], doc_of_word[starts[ok]]
    else:
        sh, sh_doc = np.zeros(0, np.uint64), np.zeros(0, np.int64)
    short = np.flatnonzero((counts_w > 0) & (counts_w < n))
    if len(short):
        offs = np.concatenate([[0], np.cumsum(counts_w)])
        extra = []
        for d in short:
            hh = 0
            for x in wh[offs[d] : offs[d + 1]].tolist():
                hh = (hh * 0x100000001B3 + x) & 0xFFFFFFFFFFFFFFFF
            extra.append(hh)
        sh = np.concatenate([sh, _splitmix64(np.array(extra, dtype=np.uint64))])
        sh_doc = np.concatenate([sh_doc, short])
    # unique (doc, shingle) pairs, sorted by doc
    order = np.lexsort((sh, sh_doc))
    sh, sh_doc = sh[order], sh_doc[order]
    keep = np.r_[True, (sh[1:] != sh[:-1]) | (sh_doc[1:] != sh_doc[:-1])] if len(sh) else np.zeros(0, bool)
    sh, sh_doc = sh[keep], sh_doc[keep]
    return sh, np.bincount(sh_doc, minlength=n_docs).astype(np.int64)


def _perm_params(cfg: MinHashConfig) -> tuple[np.ndarray, np.ndarray]:
    """(a, b), each (num_perm,) uint64, a odd: the multiply-add permutations of ``cfg.seed``."""
    rng = np.random.Generator(np.random.PCG64(cfg.seed))
    a = rng.integers(0, 2**64 - 1, size=cfg.num_perm, dtype=np.uint64, endpoint=True) | np.uint64(1)
    b = rng.integers(0, 2**64 - 1, size=cfg.num_perm, dtype=np.uint64, endpoint=True)
    return a, b


def minhash_signatures(texts: pl.Series, cfg: MinHashConfig) -> np.ndarray:
    """MinHash signatures, shape (n_docs, bands·rows), uint64 (``hash_bits=64``) or uint32.

    Permutation k is ``h_k(x) = (a_k·x + b_k) mod 2^64`` (a_k odd, drawn from ``cfg.seed``) on
    shingle hashes that are already SplitMix64-mixed; its high bits, which decide the minimum,
    are a multiply-shift universal family (Dietzfelbinger et al. 1997). 32-bit signatures keep
    the high 32 bits;
    all shingles of a block of documents are hashed against all permutations at once
    (a (shingles × perms) array) and reduced per document with ``np.minimum.reduceat``.
    Documents without shingles (no words) get all entries at the dtype's maximum, which no
    document with shingles can match in every band.
    """
    sh, counts = _shingles(texts, cfg)
    a, b = _perm_params(cfg)
    dtype = np.uint64 if cfg.hash_bits == 64 else np.uint32
    sig = np.full((len(counts), cfg.num_perm), np.iinfo(dtype).max, dtype=dtype)
    offs = np.concatenate([[0], np.cumsum(counts)])
    nonempty = np.flatnonzero(counts > 0)
    i = 0
    while i < len(nonempty):
        # a block of whole documents holding at most batch_shingles shingles (at least one doc)
        lo = offs[nonempty[i]]
        j = int(np.searchsorted(offs[nonempty + 1], lo + cfg.batch_shingles, side="right"))
        j = max(j, i + 1)
        docs = nonempty[i:j]
        hi = offs[docs[-1] + 1]
        block = sh[lo:hi, None] * a[None, :] + b[None, :]
        if cfg.hash_bits == 32:
            block = (block >> np.uint64(32)).astype(np.uint32)
        sig[docs] = np.minimum.reduceat(block, offs[docs] - lo, axis=0)
        i = j
    return sig


def _band_keys(sig: np.ndarray, cfg: MinHashConfig) -> np.ndarray:
    """(n_docs, bands) uint64: one 64-bit digest per band (rows mixed in order)."""
    s = sig.astype(np.uint64).reshape(len(sig), cfg.bands, cfg.rows)
    key = np.zeros((len(sig), cfg.bands), dtype=np.uint64)
    for r in range(cfg.rows):
        key = _splitmix64(key ^ s[:, :, r])
    return key


def minhash_clusters(sig: np.ndarray, cfg: MinHashConfig) -> np.ndarray:
    """Representative index per document from signatures (n_docs,) int64.

    Each document is linked to the first document (lowest index) sharing any LSH band bucket
    (verified by estimated Jaccard >= ``cfg.threshold`` when set); connected components of these
    links are clusters; a cluster's representative is its lowest index. Documents without
    shingles are singletons.
    """
    n = len(sig)
    if n == 0:
        return np.zeros(0, np.int64)
    empty = np.all(sig == np.iinfo(sig.dtype).max, axis=1)
    keys = _band_keys(sig, cfg)
    src, dst = [], []
    idx = np.arange(n)
    for b in range(cfg.bands):
        k = keys[:, b]
        _, first, inv = np.unique(k, return_index=True, return_inverse=True)
        head = first[inv.reshape(-1)]  # np.unique's return_index is the first occurrence
        link = (head != idx) & ~empty
        a, h = idx[link], head[link]
        if cfg.threshold is not None and len(a):
            est = (sig[a] == sig[h]).mean(axis=1)
            ok = est >= cfg.threshold
            a, h = a[ok], h[ok]
        src.append(a)
        dst.append(h)
    src_a = np.concatenate(src)
    dst_a = np.concatenate(dst)
    graph = coo_matrix((np.ones(len(src_a), np.int8), (src_a, dst_a)), shape=(n, n))
    _, label = connected_components(graph, directed=False)
    rep_of_label = np.full(label.max() + 1, n, dtype=np.int64)
    np.minimum.at(rep_of_label, label, idx)
    return rep_of_label[label]


def minhash_duplicates(texts: pl.Series, ids: pl.Series, cfg: MinHashConfig) -> pl.Series:
    """Near-duplicates by MinHash-LSH: ``duplicate_of`` (Utf8), null for kept documents, else the
    id of the lowest-index document of the cluster. Deterministic for a given input order."""
    ids = _check_ids(texts, ids)
    sig = minhash_signatures(texts, cfg)
    return _duplicate_of(ids, minhash_clusters(sig, cfg))
