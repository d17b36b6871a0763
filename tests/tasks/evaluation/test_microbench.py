"""Evaluation subsets: MDAD on matrices with known answers, the selectors' defining properties, the
matrix reader's refusals, and ``scalelab microbench`` end to end."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from tasks.evaluation.microbench import (
    METHODS, CorrectnessMatrix, MicrobenchConfig, Subset, anchor_points, compare_selectors, difficulty_strata,
    irt_population, kendall_tau, kmedoids, learn_anchor_weights, mdad, pair_outcomes, rank_probability,
    read_correctness_matrix, stratified_subset,
)

ROOT = Path(__file__).resolve().parents[3]


def nested_models(accuracies: list[float], n_items: int) -> CorrectnessMatrix:
    """Model m answers exactly the first ``accuracies[m] * n_items`` items: every gap is known, and a
    harder model's correct set contains no item an easier one misses."""
    k = np.round(np.asarray(accuracies) * n_items).astype(int)
    correct = (np.arange(n_items)[None, :] < k[:, None]).astype(np.int8)
    return CorrectnessMatrix(models=tuple(f"m{i}" for i in range(len(k))),
                             items=tuple(f"i{j}" for j in range(n_items)), correct=correct)


def noise_models(accuracies: list[float], n_items: int, seed: int = 0) -> CorrectnessMatrix:
    """Model m answers a random set of ``accuracies[m] * n_items`` items, independently of every
    other model: the items carry no structure a selector could use."""
    rng = np.random.default_rng(seed)
    correct = np.zeros((len(accuracies), n_items), dtype=np.int8)
    for m, acc in enumerate(accuracies):
        correct[m, rng.choice(n_items, size=round(acc * n_items), replace=False)] = 1
    return CorrectnessMatrix(models=tuple(f"m{i}" for i in range(len(accuracies))),
                             items=tuple(f"i{j}" for j in range(n_items)), correct=correct)


# ------------------------------------------------------------------------------------------ MDAD

def test_mdad_is_the_smallest_gap_in_the_lowest_bin_from_which_every_bin_is_reliable():
    gaps = np.array([0.004, 0.006, 0.012, 0.013, 0.031, 0.032, 0.2, 0.3])
    scores = np.array([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    edges = (0.0, 0.01, 0.02, 0.05, 1.0)
    # [0, .01) is perfect but [.01, .02) is not: the lucky small-gap bin does not count.
    assert mdad(gaps, scores, probability=0.9, edges=edges, min_outcomes=2) == pytest.approx(0.031)
    # Every bin perfect: MDAD is the smallest gap of all.
    assert mdad(gaps, np.ones(8), probability=0.9, edges=edges, min_outcomes=2) == pytest.approx(0.004)
    # The largest gaps ranked wrong: no gap is reliable, and MDAD is missing, not 0.
    assert mdad(gaps, np.r_[np.ones(6), 0.0, 0.0], probability=0.9, edges=edges, min_outcomes=2) is None
    assert mdad(gaps, np.ones(8), probability=0.9, edges=edges, min_outcomes=20) is None  # too few outcomes


def test_sparse_gap_bins_merge_upward_until_each_has_enough_outcomes():
    gaps = np.array([0.001, 0.011, 0.012, 0.041, 0.6])
    bins = rank_probability(gaps, np.ones(5), (0.0, 0.01, 0.02, 0.03, 0.05, 1.0), min_outcomes=2)
    assert bins.select("gap_low", "gap_high", "outcomes").rows() == [(0.0, 0.02, 3), (0.02, 1.0, 2)]
    assert bins["min_gap"].to_list() == [0.001, 0.041]


def test_pair_outcomes_score_ties_as_a_coin_flip_and_skip_equal_models():
    gaps, scores = pair_outcomes(np.array([0.5, 0.5, 0.9, 0.8]), np.array([0.2, 0.3, 0.3, 0.9]))
    # pairs (0,1) tie in the estimate, (0,2) right, (0,3) right, (1,2) equal in full: skipped,
    # (1,3) right, (2,3) wrong
    assert gaps.tolist() == pytest.approx([0.1, 0.1, 0.7, 0.6, 0.6])
    assert scores.tolist() == [0.5, 1.0, 1.0, 1.0, 0.0]


def test_the_whole_set_ranks_every_pair_so_mdad_is_the_smallest_gap_and_tau_is_one():
    # 10 models 5 points apart on 100 items, one pair only 1 point apart: the smallest gap is 0.01.
    accs = [0.20, 0.25, 0.30, 0.35, 0.40, 0.45, 0.50, 0.55, 0.60, 0.61]
    matrix = nested_models(accs, 100)
    cfg = MicrobenchConfig(repeats=30, min_outcomes=5)
    res = compare_selectors(matrix, [100], cfg)
    assert res.table["method"].to_list() == list(METHODS)
    for row in res.table.iter_rows(named=True):
        assert row["mdad"] == pytest.approx(0.01), row
        assert row["kendall_tau"] == pytest.approx(1.0), row
        assert row["mae"] == pytest.approx(0.0, abs=1e-9), row
        assert row["p_correct"] == 1.0


def test_a_one_item_subset_of_pure_noise_items_cannot_rank_and_ranks_right_half_plus_half_the_gap():
    # One random item orders a pair right with probability P(i right, j wrong) + P(tie) / 2, which is
    # exactly 1/2 + gap/2 for any matrix: at most 0.7 here (gaps up to 40 points), never 0.95.
    accs = list(np.linspace(0.3, 0.7, 16))
    matrix = noise_models(accs, 400)
    cfg = MicrobenchConfig(repeats=150, min_outcomes=200, methods=("random",))
    res = compare_selectors(matrix, [1], cfg)
    assert res.table["mdad"].to_list() == [None]
    assert res.bins.height >= 3
    for row in res.bins.iter_rows(named=True):
        assert row["p_correct"] == pytest.approx(0.5 + row["mean_gap"] / 2, abs=0.04), row
    # A subset of every item ranks the same models perfectly (their gaps are at least 2.7 points).
    full = np.sort(matrix.accuracy)
    assert compare_selectors(matrix, [400], cfg).table["mdad"].to_list() == [pytest.approx(np.diff(full).min())]


def test_more_items_detect_smaller_gaps_on_an_irt_population():
    matrix = irt_population(24, 400, seed=1)
    res = compare_selectors(matrix, [10, 100, 400], MicrobenchConfig(repeats=6, methods=("random", "stratified")))
    for method in ("random", "stratified"):
        rows = res.table.filter(pl.col("method") == method).sort("n")
        values = [v if v is not None else np.inf for v in rows["mdad"].to_list()]
        assert values[0] > values[1] > values[2], (method, values)
        assert rows["kendall_tau"].to_list()[-1] == pytest.approx(1.0)
        taus = rows["kendall_tau"].to_list()
        assert taus[0] < taus[1] < taus[2]


def test_the_comparison_is_reproducible_from_its_seed():
    matrix = irt_population(10, 80, seed=3)
    cfg = MicrobenchConfig(repeats=2)
    a, b = compare_selectors(matrix, [8, 30], cfg), compare_selectors(matrix, [8, 30], cfg)
    assert a.table.equals(b.table) and a.bins.equals(b.bins)
    assert not compare_selectors(matrix, [8, 30], MicrobenchConfig(repeats=2, seed=1)).table.equals(a.table)
    # A size's draws do not depend on which other sizes or methods are compared beside it.
    alone = compare_selectors(matrix, [30], MicrobenchConfig(repeats=2, methods=("learned_anchors", "random")))
    assert alone.table.sort("method").equals(a.table.filter(pl.col("n") == 30, pl.col("method").is_in(
        ["learned_anchors", "random"])).sort("method"))


def test_kendall_tau():
    x = np.array([0.1, 0.4, 0.3, 0.8])
    assert kendall_tau(x, x) == 1.0
    assert kendall_tau(-x, x) == -1.0
    assert kendall_tau(np.full(4, 0.5), x) == 0.0  # a constant estimate ranks nothing
    assert np.isnan(kendall_tau(x, np.full(4, 0.5)))  # nothing to rank


# ------------------------------------------------------------------------------------- selectors

@pytest.mark.parametrize("n", [10, 17, 63], ids=lambda n: f"n{n}")
def test_the_stratified_selector_covers_every_difficulty_stratum_in_proportion(n):
    train = irt_population(30, 500, seed=2).correct
    cfg = MicrobenchConfig(strata=10)
    labels = difficulty_strata(train, 10, np.random.default_rng(7))  # the draw stratified_subset makes first
    subset = stratified_subset(train, n, np.random.default_rng(7), cfg)
    taken = np.bincount(labels[subset.items], minlength=10)
    assert (taken >= 1).all(), taken
    assert taken.max() - taken.min() <= 1, taken  # equal-count strata: near-equal draws
    assert len(set(subset.items.tolist())) == n
    assert subset.weights.sum() == pytest.approx(1.0)
    # Quantile strata: each stratum's items are no easier than the one below's.
    difficulty = train.mean(axis=0)
    assert all(difficulty[labels == s].max() <= difficulty[labels == s + 1].min() for s in range(9))


def test_strata_never_outnumber_the_items_drawn():
    train = irt_population(12, 100, seed=0).correct
    subset = stratified_subset(train, 3, np.random.default_rng(0), MicrobenchConfig(strata=10))
    assert len(subset.items) == 3 and subset.weights.sum() == pytest.approx(1.0)


def test_anchor_points_find_planted_clusters_and_weigh_each_by_its_share():
    # Three prototype answer patterns over 20 models, copied 50, 30 and 20 times: three anchors, one per
    # pattern, weighted 0.5, 0.3 and 0.2.
    rng = np.random.default_rng(0)
    protos = rng.integers(0, 2, (3, 20))
    train = np.concatenate([np.repeat(protos[i:i + 1], k, axis=0) for i, k in enumerate((50, 30, 20))]).T
    subset = anchor_points(train.astype(np.int8), 3, np.random.default_rng(1), MicrobenchConfig())
    pattern = [int(np.flatnonzero((protos == train[:, j]).all(axis=1))[0]) for j in subset.items]
    assert sorted(pattern) == [0, 1, 2]
    assert dict(zip(pattern, subset.weights.tolist())) == pytest.approx({0: 0.5, 1: 0.3, 2: 0.2})


@pytest.mark.parametrize("n", [1, 7, 40, 200], ids=lambda n: f"n{n}")
def test_anchor_weights_are_cluster_shares_summing_to_one(n):
    train = irt_population(16, 200, seed=4).correct
    medoids, labels = kmedoids(train.T.astype(float), n, np.random.default_rng(0), iters=30)
    assert len(set(medoids.tolist())) == n and (labels[medoids] == np.arange(n)).all()
    subset = anchor_points(train, n, np.random.default_rng(0), MicrobenchConfig())
    assert subset.weights.sum() == pytest.approx(1.0)
    assert (subset.weights >= 1 / 200 - 1e-12).all()  # no empty cluster


def test_learned_anchor_weights_cut_training_error_below_uniform_and_anchor_point_weights():
    matrix = irt_population(32, 600, seed=5)
    train, full = matrix.correct, matrix.accuracy
    cfg = MicrobenchConfig()
    for n in (10, 50):
        anchors = anchor_points(train, n, np.random.default_rng(n), cfg)
        learned = learn_anchor_weights(train, anchors, cfg)
        uniform = Subset(anchors.items, np.full(n, 1.0 / n))

        def mse(s: Subset) -> float:
            return float(((s.estimate(train) - full) ** 2).mean())

        assert (learned.weights >= 0).all()
        assert mse(learned) < 0.8 * mse(uniform), (n, mse(learned), mse(uniform))
        assert mse(learned) < mse(anchors)


def test_sizes_beyond_the_items_and_too_few_models_are_refused():
    matrix = irt_population(8, 50)
    with pytest.raises(ValueError, match=r"sizes: 60 is larger than the 50 items of irt_2pl"):
        compare_selectors(matrix, [10, 60], MicrobenchConfig(repeats=1))
    with pytest.raises(ValueError, match=r"3 models; cross-validation over models needs at least 4"):
        compare_selectors(CorrectnessMatrix(models=("a", "b", "c"), items=("x", "y"),
                                            correct=np.array([[0, 1], [1, 1], [0, 0]], np.int8)),
                          [1], MicrobenchConfig(repeats=1))


@pytest.mark.parametrize("field, value, pattern", [
    ("probability", 0.4, r"probability: must be in \(0.5, 1\)"),
    ("gap_bins", (0.0, 0.02, 0.01), r"gap_bins: edges must increase strictly"),
    ("gap_bins", (0.0, 5.0), r"gap_bins: edges must lie in \[0, 1\] \(accuracy, not points\)"),
    ("repeats", 0, r"repeats: must be >= 1"),
    ("methods", ("random", "tinybench"), r"methods: unknown \['tinybench'\]"),
    ("folds", 1, r"folds: must be >= 2"),
], ids=lambda v: str(v) if isinstance(v, str) else None)
def test_the_config_names_a_bad_field(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        MicrobenchConfig(**{field: value})


# ---------------------------------------------------------------------------------- reading files

GOOD_CSV = "model,q1,q2,q3\nalpha,1,0,1\nbeta,0,0,1\ngamma,1,1,1\n"

CSV_CASES = {
    # case: (CSV text, pattern after "<file>: ")
    "not 0 or 1": (GOOD_CSV.replace("beta,0,0,1", "beta,0,0.5,1"), r"line 3, column 3 \('q2'\): '0.5' is not 0 or 1"),
    "a word": (GOOD_CSV.replace("gamma,1,1,1", "gamma,1,yes,1"), r"line 4, column 3 \('q2'\): 'yes' is not 0 or 1"),
    "empty cell": (GOOD_CSV.replace("alpha,1,0,1", "alpha,1,,1"), r"line 2, column 3 \('q2'\): empty cell"),
    "first bad cell in file order": (GOOD_CSV.replace("alpha,1,0,1", "alpha,1,0,2").replace("beta,0,0,1", "beta,3,0,1"),
                                     r"line 2, column 4 \('q3'\): '2' is not 0 or 1"),
    "repeated model": (GOOD_CSV + "beta,1,1,1\n", r"line 5, column 1 \('model'\): model 'beta' is repeated \(first on line 3\)"),
    "one model": ("model,q1,q2\nalpha,1,0\n", r"1 model\(s\); ranking needs at least 2"),
    "empty model name": (GOOD_CSV.replace("gamma,", ","), r"line 4, column 1 \('model'\): empty model name"),
    "repeated item": ("model,q1,q1\nalpha,1,0\nbeta,0,1\n", r"line 1, column 3: item 'q1' is repeated \(first in column 2\)"),
    "no items": ("model\nalpha\nbeta\n", r"no item columns"),
    "empty file": ("", r"empty file"),
}


@pytest.mark.parametrize("case", sorted(CSV_CASES))
def test_a_bad_matrix_csv_is_refused_naming_file_line_and_column(tmp_path: Path, case: str):
    text, pattern = CSV_CASES[case]
    path = tmp_path / "matrix.csv"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        read_correctness_matrix(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert re.search(pattern, message), message


def test_a_good_csv_is_read_with_its_names_and_whitespace_tolerated(tmp_path: Path):
    path = tmp_path / "m.csv"
    path.write_text(GOOD_CSV.replace("beta,0,0,1", "beta, 0 ,0,1"))
    m = read_correctness_matrix(path)
    assert m.models == ("alpha", "beta", "gamma") and m.items == ("q1", "q2", "q3")
    assert m.correct.tolist() == [[1, 0, 1], [0, 0, 1], [1, 1, 1]]
    assert m.accuracy.tolist() == pytest.approx([2 / 3, 1 / 3, 1.0])
    with pytest.raises(FileNotFoundError, match="nope.csv: correctness matrix not found"):
        read_correctness_matrix(tmp_path / "nope.csv")


def test_the_evaluate_stages_parquet_matrix_is_read_and_unscored_items_left_out(tmp_path: Path):
    """The matrix flows/evaluate.py writes (correctness_matrices of its per-item rows): a model that
    scored fewer items leaves nulls, and those items are dropped, not counted as wrong."""
    from flows.evaluate import correctness_matrices

    items = pl.DataFrame({
        "model": ["a"] * 3 + ["b"] * 3 + ["c"] * 2,
        "task": ["arc_easy"] * 8,
        "doc_id": [0, 1, 2, 0, 1, 2, 0, 1],
        "correct": [True, False, True, True, True, False, False, False],
    })
    path = tmp_path / "correctness_arc_easy.parquet"
    correctness_matrices(items)["arc_easy"].write_parquet(path)
    m = read_correctness_matrix(path)
    assert m.models == ("a", "b", "c") and m.items == ("d0", "d1") and m.dropped_items == 1
    assert m.correct.tolist() == [[1, 0], [1, 1], [0, 0]]
    bad = pl.DataFrame({"model": ["a", "b"], "d0": [1, 2]})
    bad.write_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: row 1, column 2 \('d0'\): 2 is not 0 or 1"):
        read_correctness_matrix(tmp_path / "bad.parquet")


# ----------------------------------------------------------------------------- scalelab microbench

def test_the_microbench_command_writes_the_table_bins_config_and_plot(tmp_path: Path, capsys):
    from flows.cli import main

    matrix = irt_population(8, 40, seed=6)
    path = tmp_path / "matrix.csv"
    pl.DataFrame({"model": list(matrix.models),
                  **{item: matrix.correct[:, j] for j, item in enumerate(matrix.items)}}).write_csv(path)
    out = tmp_path / "mb"
    assert main(["microbench", "--matrix", str(path), "--sizes", "5,40", "--out", str(out), "--root", str(tmp_path)]) == 0
    table = pl.read_csv(out / "microbench.csv")
    assert table.columns[:5] == ["method", "n", "mdad", "kendall_tau", "mae"]
    assert table.height == len(METHODS) * 2
    assert table.filter(pl.col("n") == 40)["kendall_tau"].to_list() == pytest.approx([1.0] * len(METHODS))
    assert (out / "microbench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pl.read_csv(out / "microbench_bins.csv").columns[:3] == ["method", "n", "gap_low"]
    assert "learned_anchors" in capsys.readouterr().out


def test_the_microbench_command_refuses_sizes_that_are_not_positive_integers(tmp_path: Path, capsys):
    from flows.cli import main

    path = tmp_path / "m.csv"
    path.write_text(GOOD_CSV + "delta,0,1,1\n")
    for sizes in ("2,x", "0", "2,"):
        assert main(["microbench", "--matrix", str(path), "--sizes", sizes, "--out", str(tmp_path / "o"),
                     "--root", str(tmp_path)]) == 2
        assert "--sizes: " in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_stage_leaves_out_models_scored_on_fewer_items_and_sizes_beyond_the_items():
    from tasks.evaluation.microbench import MicrobenchStageConfig, microbench_task

    rng = np.random.default_rng(0)
    cols = {f"d{j}": rng.integers(0, 2, size=6).tolist() for j in range(12)}
    wide = pl.DataFrame({"model": [f"m{i}" for i in range(6)], **cols})
    wide = wide.with_columns(pl.when(pl.col("model") == "m5").then(None).otherwise(pl.col("d11")).alias("d11"))
    result, notes = microbench_task("arc_easy", wide, MicrobenchStageConfig(sizes=(4, 20), repeats=2))
    assert result is not None and result.table["n"].unique().to_list() == [4]
    assert any("1 model(s)" in n for n in notes) and any("[20]" in n for n in notes)
    too_few, notes = microbench_task("arc_easy", wide.head(3), MicrobenchStageConfig(sizes=(4,), repeats=2))
    assert too_few is None and any("at least 4" in n for n in notes)
