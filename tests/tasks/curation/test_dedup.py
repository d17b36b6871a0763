"""Exact and MinHash dedup: clusters keyed by the caller's ids, determinism, accuracy vs exact Jaccard."""

from __future__ import annotations

import random

import numpy as np
import polars as pl
import pytest

from tasks.curation.dedup import (
    MinHashConfig,
    _shingles,
    exact_duplicates,
    minhash_duplicates,
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


def test_minhash_is_deterministic_and_representative_is_first_in_input_order():
    rng = random.Random(2)
    base = doc(rng)
    texts = [doc(rng) for _ in range(5)] + [mutate(base, rng, 2), base, mutate(base, rng, 2)]
    ids = pl.Series([f"d{i}" for i in range(len(texts))])
    cfg = MinHashConfig()
    first = minhash_duplicates(pl.Series(texts), ids, cfg)
    assert first.to_list() == minhash_duplicates(pl.Series(texts), ids, cfg).to_list()
    assert first.to_list() == [None] * 6 + ["d5", "d5"]
    # reversed input: the representative is again the first of the cluster in the new order
    rev = minhash_duplicates(pl.Series(texts[::-1]), ids.reverse(), cfg)
    assert rev.to_list() == [None, "d7", "d7"] + [None] * 5


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
    ids = pl.Series([str(i) for i in range(len(texts))])
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
        pred = dup[b] == str(a)
        tp += truth and pred
        fp += pred and not truth
        fn += truth and not pred
    assert tp >= 20  # the sample has real positives
    assert tp / (tp + fp) >= 0.95 and tp / (tp + fn) >= 0.95, (tp, fp, fn)
