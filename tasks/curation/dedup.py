"""Exact and MinHash-LSH near-duplicate detection, keyed by the caller's own document ids.

Both detectors return ``duplicate_of`` (Utf8, one per document): null for documents that are kept,
else the id of the kept representative of their cluster — its lowest id in string order, or the
lowest id of a persisted :class:`DedupIndex` (an earlier corpus) in the cluster, since indexed
documents are already published and are never dropped. Results depend only on the input (no
input order, shard or worker count, no hash-order effects), so reruns agree.

MinHash follows Broder (1997), "On the resemblance and containment of documents": for a document's
set of word n-gram shingles S and random hash functions h_k, P[min h_k(S_a) = min h_k(S_b)] =
J(S_a, S_b) (Jaccard). Locality-sensitive hashing splits the b·r minima into b bands of r rows;
two documents become candidates when any band matches, with probability 1 - (1 - J^r)^b, a step
around (1/b)^(1/r) (≈ 0.72 for datatrove's 14 × 8).

>>> dup = minhash_duplicates(texts, ids, MinHashConfig())   # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from tasks.common.config import at_least, require

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True, kw_only=True)
class MinHashConfig:
    """MinHash-LSH settings; defaults are datatrove's (word 5-grams, 14 bands × 8 rows, seed 1).

    ``threshold``: when set (0.7–1.0), every LSH candidate pair is verified — two documents are
    linked only if the fraction of equal signature entries (the MinHash estimate of their Jaccard
    similarity) is >= threshold; clusters are the connected components of linked pairs. Choose ``bands``/``rows`` so
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
        at_least(self.ngram, 1, "ngram")
        at_least(self.bands, 1, "bands")
        at_least(self.rows, 1, "rows")
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


def exact_digests(texts: pl.Series) -> pl.Series:
    """Hex blake2b-128 digest of each :func:`normalise_for_hash` text (stable across runs and
    library versions, unlike polars' ``hash``), the key an exact-dedup index stores."""
    norm = normalise_for_hash(texts).to_list()
    return pl.Series("digest", [hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
                                for t in norm], dtype=pl.Utf8)


def exact_duplicates(texts: pl.Series, ids: pl.Series, *, index: "DedupIndex | None" = None) -> pl.Series:
    """Exact duplicates after :func:`normalise_for_hash`.

    Returns ``duplicate_of`` (Utf8, len(texts)): null for the lowest id of each group of equal
    normalised texts, else that id — or, when ``index`` holds an existing corpus, the lowest
    indexed id with the same text (indexed documents always win). ``ids`` must be unique and
    non-null (any type; compared as strings). Independent of input order.
    """
    ids = _check_ids(texts, ids)
    return exact_duplicates_of_digests(ids, exact_digests(texts), index=index)


def exact_duplicates_of_digests(ids: pl.Series, digests: pl.Series, *,
                                index: "DedupIndex | None" = None) -> pl.Series:
    """:func:`exact_duplicates` from already computed :func:`exact_digests` (unique Utf8 ids), so a
    sharded run can hash its shards apart and decide on (id, digest) alone."""
    frame = pl.DataFrame({"id": ids.cast(pl.Utf8), "digest": digests, "new": True})
    if index is not None and index.exact is not None and len(index.exact):
        frame = pl.concat([index.exact.select("id", "digest", new=pl.lit(False)), frame])
    # indexed documents first (new=False sorts first), then the lowest id
    rep = frame.select(pl.col("id").sort_by("new", "id").first().over("digest").alias("rep"), "id", "new")
    rep = rep.filter(pl.col("new"))
    return rep.select(pl.when(pl.col("rep") != pl.col("id")).then(pl.col("rep")).alias("duplicate_of"))[
        "duplicate_of"].cast(pl.Utf8)


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


def _candidate_pairs(sig: np.ndarray, cfg: MinHashConfig, empty: np.ndarray) -> np.ndarray:
    """(n_pairs, 2) int64, i < j: every pair of documents sharing an LSH band bucket.

    The bands are shuffled by band hash with a polars group-by on (band, key); each bucket yields
    all its member pairs (k·(k-1)/2), deduplicated across bands, so that verification compares
    every candidate pair and not only each member with the bucket's first document.
    """
    n = len(sig)
    keys = _band_keys(sig, cfg)
    docs = np.flatnonzero(~empty)
    frame = pl.DataFrame({
        "doc": np.repeat(docs, cfg.bands),
        "band": np.tile(np.arange(cfg.bands, dtype=np.int32), len(docs)),
        "key": keys[docs].ravel(),
    })
    buckets = (
        frame.group_by("band", "key").agg(pl.col("doc").sort())
        .filter(pl.col("doc").list.len() > 1)["doc"].to_list()
    )
    pairs = [np.zeros((0, 2), np.int64)]
    for members in buckets:
        m = np.asarray(members, dtype=np.int64)
        i, j = np.triu_indices(len(m), k=1)
        pairs.append(np.stack([m[i], m[j]], axis=1))
    out = np.concatenate(pairs)
    return np.unique(out, axis=0) if len(out) else out.reshape(0, 2) if n else out


def band_candidate_pairs(band_keys: Iterable[np.ndarray], empty: np.ndarray) -> np.ndarray:
    """The pairs of :func:`_candidate_pairs` from band keys given one band at a time.

    ``band_keys``: for each band, the (n_docs,) uint64 keys of every document (a column of
    :func:`_band_keys`), so a caller can read them from disk band by band and hold one band's
    keys at once; ``empty`` (n_docs,) bool marks documents without shingles (never candidates).
    Returns (n_pairs, 2) int64, i < j, sorted and unique: every pair sharing a (band, key) bucket.
    """
    docs = np.flatnonzero(~np.asarray(empty, bool))
    pairs = [np.zeros((0, 2), np.int64)]
    for keys in band_keys:
        k = np.asarray(keys)[docs]
        order = np.argsort(k, kind="stable")
        ks, ds = k[order], docs[order]
        if len(ks) < 2:
            continue
        starts = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
        sizes = np.diff(np.r_[starts, len(ks)])
        two = starts[sizes == 2]  # the common bucket: one pair, vectorised
        if len(two):
            a, b = ds[two], ds[two + 1]
            pairs.append(np.stack([np.minimum(a, b), np.maximum(a, b)], axis=1))
        for s, size in zip(starts[sizes > 2].tolist(), sizes[sizes > 2].tolist()):
            m = np.sort(ds[s : s + size])
            i, j = np.triu_indices(size, k=1)
            pairs.append(np.stack([m[i], m[j]], axis=1))
    out = np.concatenate(pairs).astype(np.int64, copy=False)
    return np.unique(out, axis=0) if len(out) else out


def minhash_clusters(sig: np.ndarray, cfg: MinHashConfig, rank: np.ndarray | None = None) -> np.ndarray:
    """Representative index per document from signatures (n_docs,) int64.

    Documents sharing any LSH band bucket are candidate pairs; with ``cfg.threshold`` set, each
    pair is verified on its own (estimated Jaccard, the fraction of equal signature entries,
    >= threshold). Connected components (union-find) of the kept pairs are clusters; a cluster's
    representative is the document of lowest ``rank`` (default: its index; callers pass the rank
    of the user id, so the result does not depend on input or shard order). Documents without
    shingles are singletons.
    """
    n = len(sig)
    if n == 0:
        return np.zeros(0, np.int64)
    rank = np.arange(n, dtype=np.int64) if rank is None else np.asarray(rank, dtype=np.int64)
    empty = np.all(sig == np.iinfo(sig.dtype).max, axis=1)
    pairs = _candidate_pairs(sig, cfg, empty)
    if cfg.threshold is not None and len(pairs):
        pairs = pairs[jaccard_estimates(sig, pairs) >= cfg.threshold]
    return clusters_from_pairs(pairs, n, rank)


def jaccard_estimates(sig: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """(n_pairs,) estimated Jaccard of each pair of rows of ``sig`` (the fraction of equal
    signature entries), compared 65,536 pairs at a time so the (pairs × perms) array stays bounded."""
    est = np.empty(len(pairs))
    for lo in range(0, len(pairs), 65_536):
        p = pairs[lo : lo + 65_536]
        est[lo : lo + 65_536] = (sig[p[:, 0]] == sig[p[:, 1]]).mean(axis=1)
    return est


def clusters_from_pairs(pairs: np.ndarray, n: int, rank: np.ndarray) -> np.ndarray:
    """Representative index per document (n,) int64: connected components of the linked
    ``pairs`` (n_pairs, 2), each represented by its member of lowest ``rank`` (a permutation of
    0..n-1)."""
    rank = np.asarray(rank, dtype=np.int64)
    if n == 0:
        return np.zeros(0, np.int64)
    graph = coo_matrix((np.ones(len(pairs), np.int8), (pairs[:, 0], pairs[:, 1])), shape=(n, n))
    _, label = connected_components(graph, directed=False)
    best = np.full(label.max() + 1, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(best, label, rank)
    if not np.array_equal(np.sort(rank), np.arange(n)):
        raise ValueError("rank: must be a permutation of 0..n_docs-1")
    index_of_rank = np.empty(n, np.int64)
    index_of_rank[rank] = np.arange(n)
    return index_of_rank[best[label]]


def id_rank(ids: pl.Series) -> np.ndarray:
    """(n,) int64: rank of each id in ascending string order (ids unique), so "lowest user id"
    decides a cluster's representative."""
    return ids.cast(pl.Utf8).rank("ordinal").to_numpy().astype(np.int64) - 1


def minhash_signatures_sharded(shards: Sequence[pl.Series], cfg: MinHashConfig, executor=None) -> np.ndarray:
    """Signatures of each shard computed in parallel (anything with ``concurrent.futures``'
    ``submit``: a process pool, or ``flows.ray_executor.RayExecutor`` for Ray tasks), stacked in
    shard order: (sum of shard lengths, bands·rows). A signature depends only on its document, so
    the result equals :func:`minhash_signatures` on the concatenation."""
    if executor is None:
        parts = [minhash_signatures(s, cfg) for s in shards]
    else:
        parts = [f.result() for f in [executor.submit(minhash_signatures, s, cfg) for s in shards]]
    dtype = np.uint64 if cfg.hash_bits == 64 else np.uint32
    return np.concatenate(parts) if parts else np.zeros((0, cfg.num_perm), dtype)


def minhash_duplicates(texts: pl.Series, ids: pl.Series, cfg: MinHashConfig, *, executor=None,
                       n_shards: int = 1, index: "DedupIndex | None" = None) -> pl.Series:
    """Near-duplicates by MinHash-LSH: ``duplicate_of`` (Utf8), null for kept documents, else the
    id of the cluster's representative: the lowest indexed id when the cluster holds a document of
    ``index`` (an existing corpus), else the lowest id of this corpus. Independent of input order,
    shard count and executor."""
    ids = _check_ids(texts, ids)
    bounds = np.linspace(0, len(texts), max(1, n_shards) + 1).astype(int)
    sig = minhash_signatures_sharded([texts[a:b] for a, b in zip(bounds[:-1], bounds[1:])], cfg, executor)
    if index is None or index.minhash_ids is None or not len(index.minhash_ids):
        return _duplicate_of(ids, minhash_clusters(sig, cfg, id_rank(ids)))
    index.check_config(cfg)
    all_ids, rank = ids_after_index(index.minhash_ids, ids)
    rep = minhash_clusters(np.concatenate([index.minhash_sig.astype(sig.dtype), sig]), cfg, rank)
    return _duplicate_of(all_ids, rep)[len(index.minhash_ids):]


def ids_after_index(index_ids: pl.Series, ids: pl.Series) -> tuple[pl.Series, np.ndarray]:
    """The indexed ids then this corpus's (Utf8), and their ranks: indexed documents rank before
    every new one, so they represent any cluster they are in; within each part, the lowest id."""
    m = len(index_ids)
    return (pl.concat([index_ids.cast(pl.Utf8), ids.cast(pl.Utf8)]),
            np.concatenate([id_rank(index_ids), m + id_rank(ids)]))


# ---------------------------------------------------------------------------------------------
# persisted index of an existing corpus


@dataclass(kw_only=True)
class DedupIndex:
    """What a corpus leaves behind for deduplicating later corpora against it.

    On disk (``save_index`` / ``load_index``), a folder with ``exact.parquet`` (id, digest),
    ``minhash.parquet`` (id, signature) and ``index.json`` (the :class:`MinHashConfig` the
    signatures were made with; a different one is refused, since its signatures cannot match).
    """

    exact: pl.DataFrame | None = None
    minhash_ids: pl.Series | None = None
    minhash_sig: np.ndarray | None = None
    minhash_config: dict | None = None
    #: one entry per corpus added (what the caller records: output folder, documents added)
    history: list[dict] = field(default_factory=list)

    @property
    def ids(self) -> pl.Series:
        """Every indexed id (Utf8), exact and MinHash parts together, each once."""
        parts = [x.cast(pl.Utf8) for x in (None if self.exact is None else self.exact["id"], self.minhash_ids)
                 if x is not None]
        return pl.concat(parts).unique(maintain_order=True).alias("id") if parts else pl.Series("id", [], pl.Utf8)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def has_minhash(self) -> bool:
        return self.minhash_ids is not None and len(self.minhash_ids) > 0

    def fingerprint(self) -> str:
        """sha256 of the indexed ids, digests, signatures and MinHash config: what a dedup result
        against this index depends on (a resumable run keys its finished parts on it)."""
        h = hashlib.sha256(json.dumps(self.minhash_config, sort_keys=True).encode())
        if self.exact is not None:
            for col in ("id", "digest"):
                h.update("\0".join(self.exact[col].cast(pl.Utf8).to_list()).encode() + b"\1")
        if self.minhash_ids is not None:
            h.update("\0".join(self.minhash_ids.to_list()).encode() + b"\1")
            h.update(np.ascontiguousarray(self.minhash_sig).tobytes())
        return h.hexdigest()

    def refuse_indexed(self, ids: pl.Series) -> None:
        """``ValueError`` when any of a new corpus's ids is already indexed: deduplicating a corpus
        against an index that holds it drops its documents as copies of themselves."""
        if not len(self):
            return
        ids = ids.cast(pl.Utf8)
        clash = ids.filter(ids.is_in(self.ids.implode()))
        if len(clash):
            raise ValueError(f"index: {len(clash)} of this corpus's ids are already indexed (e.g. {clash[0]!r}): "
                             "was this corpus added to the index already (a rerun after an index update)? "
                             "Deduplicating it against itself would drop those documents; give new "
                             "documents distinct ids (an `id` key) or use an index without them")

    def minhash_config_for(self, recipe_configs: Sequence[MinHashConfig]) -> MinHashConfig | None:
        """The one MinHash config a run against this index uses, checked before any work.

        ``recipe_configs``: the settings of the recipe's ``minhash`` steps. They must agree with
        each other and with the index's own config; an index that holds documents but no
        signatures cannot deduplicate a ``minhash`` step (its texts are not stored). Returns the
        index's config, else the recipe's, else ``None`` (exact digests only).
        """
        distinct = list(dict.fromkeys(recipe_configs))
        if len(distinct) > 1:
            raise ValueError("index: the recipe's minhash steps use different settings; one index holds "
                             "signatures of one MinHash config")
        for cfg in distinct:
            self.check_config(cfg)
            if not self.has_minhash and len(self):
                raise ValueError(f"index: holds {len(self)} documents but no MinHash signatures (it was built "
                                 "by a recipe without a minhash step), so a minhash step cannot compare "
                                 "against it; rebuild the index with a recipe that has one")
        if self.minhash_config is not None:
            return MinHashConfig(**self.minhash_config)
        return distinct[0] if distinct else None

    def check_config(self, cfg: MinHashConfig) -> None:
        if self.minhash_config is not None and self.minhash_config != asdict(cfg):
            diff = sorted(k for k in asdict(cfg) if asdict(cfg)[k] != self.minhash_config.get(k))
            raise ValueError(f"index: built with another MinHash config (fields {diff} differ); "
                             "rebuild the index or use its settings")

    def extended(self, *, exact: pl.DataFrame | None = None, minhash_ids: pl.Series | None = None,
                 minhash_sig: np.ndarray | None = None, cfg: MinHashConfig | None = None) -> "DedupIndex":
        """A new index holding this one plus the given (kept) documents of a new corpus."""
        if cfg is not None:
            self.check_config(cfg)
        added = [x["id"] if isinstance(x, pl.DataFrame) else x for x in (exact, minhash_ids) if x is not None]
        if added and len(self):
            new_ids = pl.concat([x.cast(pl.Utf8) for x in added]).unique()
            clash = new_ids.filter(new_ids.is_in(self.ids.implode()))
            if len(clash):
                raise ValueError(f"index: {len(clash)} of the added ids are already indexed (e.g. {clash[0]!r}); "
                                 "ids are the index's keys")
        ex = self.exact if exact is None else exact if self.exact is None else pl.concat([self.exact, exact])
        if minhash_ids is None:
            return DedupIndex(exact=ex, minhash_ids=self.minhash_ids, minhash_sig=self.minhash_sig,
                              minhash_config=self.minhash_config, history=list(self.history))
        if self.minhash_ids is not None:
            minhash_ids = pl.concat([self.minhash_ids, minhash_ids.cast(pl.Utf8)])
            minhash_sig = np.concatenate([self.minhash_sig, minhash_sig.astype(self.minhash_sig.dtype)])
        return DedupIndex(exact=ex, minhash_ids=minhash_ids.cast(pl.Utf8), minhash_sig=minhash_sig,
                          minhash_config=asdict(cfg) if cfg is not None else self.minhash_config,
                          history=list(self.history))


def build_index(texts: pl.Series, ids: pl.Series, cfg: MinHashConfig | None = None, *, executor=None,
                n_shards: int = 1) -> DedupIndex:
    """Index of a corpus's documents: exact digests always, MinHash signatures when ``cfg``
    (computed in ``n_shards`` pieces through ``executor``, as in :func:`minhash_duplicates`)."""
    ids = _check_ids(texts, ids)
    exact = pl.DataFrame({"id": ids, "digest": exact_digests(texts)})
    if cfg is None:
        return DedupIndex(exact=exact)
    bounds = np.linspace(0, len(texts), max(1, n_shards) + 1).astype(int)
    sig = minhash_signatures_sharded([texts[a:b] for a, b in zip(bounds[:-1], bounds[1:])], cfg, executor)
    return DedupIndex(exact=exact, minhash_ids=ids, minhash_sig=sig, minhash_config=asdict(cfg))


def save_index(index: DedupIndex, folder: str | Path) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if index.exact is not None:
        index.exact.write_parquet(folder / "exact.parquet")
    if index.minhash_ids is not None:
        pl.DataFrame({"id": index.minhash_ids, "signature": index.minhash_sig}).write_parquet(folder / "minhash.parquet")
    (folder / "index.json").write_text(json.dumps({"minhash_config": index.minhash_config, "docs": len(index),
                                                   "history": index.history}, indent=1))


def load_index(folder: str | Path) -> DedupIndex:
    """Read a folder written by :func:`save_index`. A missing manifest, an unreadable file or a
    file without the expected columns is a ``ValueError`` naming the file."""
    folder = Path(folder)
    manifest = folder / "index.json"
    if not manifest.is_file():
        raise ValueError(f"index: {manifest} not found (build one with save_index or "
                         "`scalelab curate --index DIR --index-update`)")
    try:
        meta = json.loads(manifest.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"index: {manifest}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"index: {manifest}: expected a JSON object")

    def read(name: str, columns: tuple[str, ...]) -> pl.DataFrame | None:
        path = folder / name
        if not path.is_file():
            return None
        try:
            frame = pl.read_parquet(path)
        except (pl.exceptions.PolarsError, OSError) as exc:
            raise ValueError(f"index: {path}: not a readable Parquet file ({exc})") from None
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise ValueError(f"index: {path}: missing column(s) {missing}; columns are {frame.columns}")
        return frame

    exact = read("exact.parquet", ("id", "digest"))
    ids = sig = None
    mh = read("minhash.parquet", ("id", "signature"))
    if mh is not None:
        cfg = meta.get("minhash_config")
        if not isinstance(cfg, dict):
            raise ValueError(f"index: {manifest}: minhash.parquet present but no minhash_config")
        mcfg = MinHashConfig(**cfg)
        width = mcfg.num_perm
        ids = mh["id"].cast(pl.Utf8)
        sig = (mh["signature"].to_numpy() if mh.height else
               np.zeros((0, width), np.uint64 if mcfg.hash_bits == 64 else np.uint32))
        if sig.ndim != 2 or (len(sig) and sig.shape[1] != width):
            raise ValueError(f"index: {folder / 'minhash.parquet'}: signatures of shape {sig.shape}, "
                             f"expected (n, {width}) for its minhash_config")
    return DedupIndex(exact=exact.select("id", "digest") if exact is not None else None, minhash_ids=ids,
                      minhash_sig=sig, minhash_config=meta.get("minhash_config"),
                      history=list(meta.get("history", [])))
