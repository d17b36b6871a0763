"""Exact and MinHash dedup: clusters keyed by the caller's ids, determinism, accuracy vs exact Jaccard."""

from __future__ import annotations

import random

import numpy as np
import polars as pl
import pytest

from tasks.curation.dedup import (
    MinHashConfig,
    _shingles,
    build_index,
    exact_digests,
    exact_duplicates,
    load_index,
    minhash_clusters,
    minhash_duplicates,
    save_index,
    minhash_signatures,
    normalise_for_hash,
)

WORDS = ("river market school teacher budget winter village doctor garden window letter music "
         "station bridge forest engine harbor island mountain painter").split()


def doc(rng: random.Random, n: int = 300) -> str:
    # letters only: numbers are normalised to "0" before shingling
    return " ".join(rng.choice(WORDS) + "".join(rng.choice("abcdefgh") for _ in range(3)) for _ in range(n))


def mutate(text: str, rng: random.Random, k: int) -> str:
    w = text.split()
    for _ in range(k):
        w[rng.randrange(len(w))] = "changed" + "".join(rng.choice("xyz") for _ in range(8))
    return " ".join(w)


def test_normalise_for_hash():
    assert normalise_for_hash(pl.Series(["Hello,  World!\n", None])).to_list() == ["hello world", ""]


def test_exact_duplicates_clusters_and_representatives():
    texts = pl.Series(["A cat.", "b dog", "a  CAT", "c", "B dog!", "a cat"])
    ids = pl.Series(["x1", "x2", "x3", "x4", "x5", "x6"])
    assert exact_duplicates(texts, ids).to_list() == [None, None, "x1", None, "x2", "x1"]


def test_ids_are_validated():
    with pytest.raises(ValueError, match="unique"):
        exact_duplicates(pl.Series(["a", "b"]), pl.Series(["x", "x"]))
    with pytest.raises(ValueError, match="ids"):
        minhash_duplicates(pl.Series(["a", "b"]), pl.Series(["x"]), MinHashConfig())


def test_config_validation():
    with pytest.raises(ValueError, match="threshold"):
        MinHashConfig(threshold=0.5)
    with pytest.raises(ValueError, match="hash_bits"):
        MinHashConfig(hash_bits=16)
    assert abs(MinHashConfig().lsh_threshold - (1 / 14) ** (1 / 8)) < 1e-12


def test_signature_shape_dtype_and_empty_docs():
    texts = pl.Series(["one two three four five six", "", None, "short"], dtype=pl.Utf8)
    sig = minhash_signatures(texts, MinHashConfig())
    assert sig.shape == (4, 112) and sig.dtype == np.uint64
    assert (sig[1] == np.iinfo(np.uint64).max).all() and (sig[2] == np.iinfo(np.uint64).max).all()
    assert (sig[3] < np.iinfo(np.uint64).max).all()
    sig32 = minhash_signatures(texts, MinHashConfig(hash_bits=32, bands=4, rows=5))
    assert sig32.shape == (4, 20) and sig32.dtype == np.uint32


def test_signatures_do_not_depend_on_batching():
    rng = random.Random(1)
    texts = pl.Series([doc(rng, rng.randint(1, 200)) for _ in range(40)])
    a = minhash_signatures(texts, MinHashConfig(batch_shingles=7))
    b = minhash_signatures(texts, MinHashConfig(batch_shingles=100_000))
    c = minhash_signatures(texts[10:20], MinHashConfig())
    assert np.array_equal(a, b) and np.array_equal(a[10:20], c)


def test_minhash_finds_near_duplicates_not_distinct_docs():
    rng = random.Random(0)
    base = [doc(rng) for _ in range(30)]
    near = [mutate(base[i], rng, 2) for i in range(10)]  # 2 of 300 words changed, J ~ 0.94
    texts = pl.Series(base + near)
    ids = pl.Series([f"b{i}" for i in range(30)] + [f"n{i}" for i in range(10)])
    dup = minhash_duplicates(texts, ids, MinHashConfig())
    assert dup[:30].null_count() == 30  # distinct documents are all kept
    assert dup[30:].to_list() == [f"b{i}" for i in range(10)]


def test_minhash_is_deterministic_and_representative_is_lowest_id():
    rng = random.Random(2)
    base = doc(rng)
    texts = [doc(rng) for _ in range(5)] + [mutate(base, rng, 2), base, mutate(base, rng, 2)]
    ids = pl.Series([f"d{i}" for i in range(len(texts))])
    cfg = MinHashConfig()
    first = minhash_duplicates(pl.Series(texts), ids, cfg)
    assert first.to_list() == minhash_duplicates(pl.Series(texts), ids, cfg).to_list()
    assert first.to_list() == [None] * 6 + ["d5", "d5"]
    # reversed input: the representative is still the lowest id, d5
    rev = minhash_duplicates(pl.Series(texts[::-1]), ids.reverse(), cfg)
    assert rev.to_list() == ["d5", "d5", None] + [None] * 5


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / max(len(a | b), 1)


def test_minhash_precision_recall_vs_exact_jaccard():
    rng = random.Random(3)
    cfg = MinHashConfig(bands=28, rows=4, threshold=0.8)
    base = [doc(rng, 150) for _ in range(60)]
    texts, pairs = list(base), []
    for i in range(60):
        k = rng.choice([0, 1, 2, 3, 5, 8, 12, 20, 35])  # spread true Jaccard over (0, 1]
        texts.append(mutate(base[i], rng, k))
        pairs.append((i, len(texts) - 1))
    ids = pl.Series([f"{i:03d}" for i in range(len(texts))])  # lowest id = first in input order
    dup = minhash_duplicates(pl.Series(texts), ids, cfg).to_list()
    # exact shingle sets from the same shingling
    sh, counts = _shingles(pl.Series(texts), cfg)
    offs = np.concatenate([[0], np.cumsum(counts)])
    sets = [set(sh[offs[i]: offs[i + 1]].tolist()) for i in range(len(texts))]
    rand_pairs = [(rng.randrange(60), rng.randrange(60, 120)) for _ in range(200)]
    # With 112 permutations the estimate's standard deviation is ~0.04 near 0.8, so pairs within
    # 0.05 of the threshold are coin flips for any such estimator: they are not scored.
    tp = fp = fn = 0
    for a, b in pairs + rand_pairs:
        j = _jaccard(sets[a], sets[b])
        if abs(j - cfg.threshold) < 0.05:
            continue
        truth = j >= cfg.threshold
        pred = dup[b] == f"{a:03d}"
        tp += truth and pred
        fp += pred and not truth
        fn += truth and not pred
    assert tp >= 20  # the sample has real positives
    assert tp / (tp + fp) >= 0.95 and tp / (tp + fn) >= 0.95, (tp, fp, fn)


def test_pairwise_verification_links_members_other_than_the_bucket_head():
    # band 0 is shared by all three; a is far from b and c (estimate 0.25), b and c are close
    # (0.85) but share no other band. Verifying only against the bucket's first member missed b~c.
    cfg = MinHashConfig(bands=4, rows=5, threshold=0.8)
    a = np.arange(20, dtype=np.uint64) + np.uint64(1000)
    b = np.arange(20, dtype=np.uint64)
    a[:5] = b[:5]
    c = b.copy()
    c[[5, 10, 15]] += np.uint64(500)
    rep = minhash_clusters(np.stack([a, b, c]), cfg)
    assert rep.tolist() == [0, 1, 1]


def test_sharded_signatures_and_shard_order_give_single_process_clusters():
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    rng = random.Random(3)
    base = [doc(rng) for _ in range(4)]
    texts = [mutate(t, rng, 2) for t in base for _ in range(3)] + [doc(rng) for _ in range(6)]
    ids = pl.Series([f"x{i:02d}" for i in range(len(texts))])
    cfg = MinHashConfig(threshold=0.8, bands=28, rows=4)
    single = dict(zip(ids.to_list(), minhash_duplicates(pl.Series(texts), ids, cfg).to_list()))
    assert sum(v is not None for v in single.values()) == 8
    perm = list(range(len(texts)))
    random.Random(0).shuffle(perm)
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:  # fork deadlocks polars
        dup = minhash_duplicates(pl.Series([texts[i] for i in perm]), ids.gather(perm), cfg,
                                 executor=pool, n_shards=3)
    assert dict(zip(ids.gather(perm).to_list(), dup.to_list())) == single


def test_index_round_trip_and_dedup_against_an_existing_corpus(tmp_path):
    rng = random.Random(4)
    old = [doc(rng) for _ in range(5)]
    cfg = MinHashConfig(threshold=0.8, bands=28, rows=4)
    save_index(build_index(pl.Series(old), pl.Series([f"old{i}" for i in range(5)]), cfg), tmp_path / "idx")
    index = load_index(tmp_path / "idx")
    assert index.minhash_sig.shape == (5, cfg.num_perm) and index.exact["id"].to_list()[0] == "old0"
    new = [mutate(old[2], rng, 2), old[4].upper(), doc(rng)]
    new_ids = pl.Series(["a", "b", "c"])  # lower than "old*": the indexed id must still win
    assert minhash_duplicates(pl.Series(new), new_ids, cfg, index=index).to_list() == ["old2", "old4", None]
    assert exact_duplicates(pl.Series(new), new_ids, index=index).to_list() == [None, "old4", None]
    # extend with the kept new document; a later copy of it now duplicates the index
    grown = index.extended(minhash_ids=pl.Series(["c"]), minhash_sig=minhash_signatures(pl.Series([new[2]]), cfg),
                           exact=pl.DataFrame({"id": ["c"], "digest": exact_digests(pl.Series([new[2]]))}), cfg=cfg)
    save_index(grown, tmp_path / "idx2")
    again = load_index(tmp_path / "idx2")
    assert minhash_duplicates(pl.Series([new[2]]), pl.Series(["z"]), cfg, index=again).to_list() == ["c"]
    assert exact_duplicates(pl.Series([new[2]]), pl.Series(["z"]), index=again).to_list() == ["c"]
    with pytest.raises(ValueError, match="ngram"):
        minhash_duplicates(pl.Series(new), new_ids, MinHashConfig(ngram=4, threshold=0.8, bands=28, rows=4), index=index)
    with pytest.raises(ValueError, match="index.json"):
        load_index(tmp_path / "missing")


@pytest.mark.parametrize("bands,rows", [(14, 8), (28, 4), (5, 1)], ids=["14x8", "28x4", "5x1"])
def test_band_candidate_pairs_equal_the_in_memory_buckets(bands, rows):
    """Band keys given one band at a time (as the streaming engine reads them from disk) give the
    same candidate pairs as the whole-signature grouping, buckets of 2 and of more alike."""
    from tasks.curation.dedup import _band_keys, _candidate_pairs, band_candidate_pairs

    rng = random.Random(3)
    base = [doc(rng, 60) for _ in range(40)]
    texts = base + [mutate(t, rng, 1) for t in base[:15]] + [mutate(base[0], rng, 2) for _ in range(4)] + [""]
    cfg = MinHashConfig(bands=bands, rows=rows)
    sig = minhash_signatures(pl.Series(texts), cfg)
    empty = np.all(sig == np.iinfo(sig.dtype).max, axis=1)
    keys = _band_keys(sig, cfg)
    got = band_candidate_pairs((keys[:, b] for b in range(bands)), empty)
    want = _candidate_pairs(sig, cfg, empty)
    assert len(want) >= 15 and np.array_equal(got, want)
